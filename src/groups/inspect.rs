//! A group's state as NATS has it now: its configuration, members'
//! consumers, pins and backlog, put together as the API's view.

use std::collections::BTreeMap;

use async_nats::jetstream::consumer::Info;
use async_nats::jetstream::context::{RequestError, RequestErrorKind};
use async_nats::jetstream::response::Response;
use async_nats::jetstream::{self};
use futures::{StreamExt as _, TryStreamExt as _};
use serde::Deserialize;

use super::config::{elastic_stream_name, ownership, MemberMapping, PRIORITY_GROUP};
use super::spec::{consumer_of, GroupConfig, GroupKind, PartitioningFilterSpec};
use super::store::{GroupAdmin, DEFAULT_ACK_WAIT_MS};
use super::view::{GroupView, MemberState, MembershipView, OwnedPartitions, PartitionPending, PinStatus};
use super::GroupError as Error;
use crate::names::{GroupName, StreamName};
use crate::names::{MemberRef, Owner};
use crate::nats::errors::{is_not_found, unavailable_or_internal};
use crate::pauses::pause_key;

/// JetStream API requests a group view has in flight at once: a hundred
/// members' consumer infos go out together (one connection pipelines
/// them), and a larger group still cannot flood the server.
pub(super) const CONCURRENT_REQUESTS: usize = 128;

impl GroupAdmin {
    /// The full view of a group: configuration, ownership, pins and backlog.
    pub async fn view(
        &self,
        stream: &StreamName,
        group: &GroupName,
        kind: Option<GroupKind>,
    ) -> Result<GroupView, Error> {
        Ok(self.view_counted(stream, group, kind).await?.0)
    }

    /// The view, and the floor each partition's backlog was counted from
    /// (its owner's ack floor; static groups only, and only partitions
    /// counted one by one, see [`backlog_from_consumers`]).
    pub async fn view_counted(
        &self,
        stream: &StreamName,
        group: &GroupName,
        kind: Option<GroupKind>,
    ) -> Result<(GroupView, BTreeMap<u32, u64>), Error> {
        // With the configuration, what needs only the names: the group's pause
        // flags, and the stream's consumers, where a static group's are.
        let first_page = async {
            match kind {
                Some(GroupKind::Elastic) => None,
                _ => Some(self.consumer_page(stream.as_str(), 0).await),
            }
        };
        let (stored, settings, flags, first_page) = tokio::join!(
            self.load(stream, group, kind),
            self.settings(stream, group),
            self.pauses.of_group(stream, group),
            first_page
        );
        let (stored, settings) = (stored?, settings?);
        let config = &stored.config;
        let partitions = config.partitions();
        let owners = ownership(partitions, config.members(), config.mappings());
        let mut assignment = Vec::with_capacity(owners.len());
        let mut floors: BTreeMap<String, u64> = BTreeMap::new();
        // What each member's consumer has not had acknowledged: undelivered
        // plus delivered and unacknowledged.
        let mut backlogs: BTreeMap<String, u64> = BTreeMap::new();
        // Every member's consumer is on one stream, the group's own (static)
        // or its work queue (elastic), and read from its list: a hundred
        // members cost a request or two, not a hundred.
        let consumers: Vec<String> =
            owners.iter().map(|(member, _)| consumer_of(config, stream.as_str(), group.as_str(), member).1).collect();
        let (consumers_stream, first_page) = match config {
            GroupConfig::Static(_) => (stream.to_string(), first_page),
            GroupConfig::Elastic(_) => (elastic_stream_name(stream.as_str(), group.as_str()), None),
        };
        let infos = async {
            let infos = self.consumer_infos(&consumers_stream, &consumers, first_page).await?;
            Ok::<_, Error>(consumers.iter().cloned().zip(infos).collect::<Vec<_>>())
        };
        let members: Vec<Option<MemberRef>> = owners
            .iter()
            .map(|(member, _)| {
                let member = crate::names::MemberName::parse(member).ok()?;
                Some(MemberRef { stream: stream.clone(), group: group.clone(), member, owner: Owner::Group })
            })
            .collect();
        let paused = async {
            match &flags {
                Some(flags) => {
                    members.iter().map(|m| m.as_ref().and_then(|m| flags.get(&pause_key(m)).cloned())).collect()
                }
                None => self.pauses.get_many(&members).await,
            }
        };
        let (infos, paused): (_, Vec<_>) = tokio::join!(infos, paused);
        for (((member, owned), (consumer, info)), paused) in owners.iter().zip(infos?).zip(paused) {
            let state = match info {
                Some(info) => {
                    floors.insert(member.clone(), info.ack_floor.stream_sequence);
                    backlogs.insert(member.clone(), info.num_pending + info.num_ack_pending as u64);
                    let pin = info.priority_groups.iter().find(|g| g.group == PRIORITY_GROUP);
                    MemberState {
                        member: member.clone(),
                        partitions: owned.clone(),
                        consumer,
                        consumer_exists: true,
                        active: match config.kind() {
                            GroupKind::Static => info.num_waiting > 0,
                            GroupKind::Elastic => true,
                        },
                        waiting_pulls: info.num_waiting,
                        pin: PinStatus::NoInstance,
                        pinned_client_id: pin.and_then(|p| p.pinned_client_id.clone()).filter(|id| !id.is_empty()),
                        pinned_since: pin.and_then(|p| p.pinned_ts),
                        num_pending: info.num_pending,
                        num_ack_pending: info.num_ack_pending,
                        serving_instance: None,
                        fencing_token: None,
                        instances: Vec::new(),
                        paused,
                    }
                }
                None => MemberState {
                    member: member.clone(),
                    partitions: owned.clone(),
                    consumer,
                    consumer_exists: false,
                    active: false,
                    waiting_pulls: 0,
                    pin: PinStatus::NoInstance,
                    pinned_client_id: None,
                    pinned_since: None,
                    num_pending: 0,
                    num_ack_pending: 0,
                    serving_instance: None,
                    fencing_token: None,
                    instances: Vec::new(),
                    paused,
                },
            };
            let state = MemberState { pin: state.pin_status(), ..state };
            assignment.push(state);
        }
        let owner_of: BTreeMap<u32, String> =
            owners.iter().flat_map(|(m, ps)| ps.iter().map(move |p| (*p, m.clone()))).collect();
        // Backlog is best effort: a GET still answers when it cannot be counted.
        let mut counted_from = BTreeMap::new();
        let counted = match config {
            GroupConfig::Static(c) => {
                let known = backlog_from_consumers(&owners, &backlogs);
                counted_from = (0..partitions)
                    .filter(|p| !known.contains_key(p))
                    .map(|p| (p, owner_of.get(&p).and_then(|m| floors.get(m)).copied().unwrap_or(0)))
                    .collect();
                self.static_pending(stream.as_str(), c, &counted_from).await.map(|mut counts| {
                    counts.extend(known);
                    counts
                })
            }
            GroupConfig::Elastic(_) => {
                self.subject_counts(&elastic_stream_name(stream.as_str(), group.as_str()), partitions).await
            }
        };
        let pending = match counted {
            Ok(counts) => Some(counts),
            Err(e) => {
                tracing::warn!(error = %e.report(), %stream, %group, "could not count the group's backlog");
                None
            }
        };
        let partition_pending = (0..partitions)
            .map(|p| PartitionPending {
                partition: p,
                member: owner_of.get(&p).cloned(),
                pending: pending.as_ref().map(|counts| counts.get(&p).copied().unwrap_or(0)),
            })
            .collect();
        let raw: serde_json::Value = serde_json::from_slice(&stored.raw).unwrap_or(serde_json::Value::Null);
        let mut view = GroupView {
            stream: stream.to_string(),
            group: group.to_string(),
            kind: config.kind(),
            partitions,
            members: config.members().to_vec(),
            mappings: mappings_view(config.mappings()),
            filters: None,
            partitioning_filters: None,
            max_buffered_msgs: None,
            max_buffered_bytes: None,
            work_queue_stream: None,
            ack_wait_ms: settings.ack_wait_ms.unwrap_or(DEFAULT_ACK_WAIT_MS),
            ordering: settings.ordering(),
            revision: stored.revision,
            config: raw,
            assignment,
            partition_pending,
            blocked: Vec::new(),
            blocked_total: 0,
        };
        match config {
            GroupConfig::Static(c) => view.filters = Some(c.filters.clone()),
            GroupConfig::Elastic(c) => {
                view.partitioning_filters = Some(c.partitioning_filters.as_ref().map(|list| {
                    list.iter()
                        .map(|pf| PartitioningFilterSpec {
                            filter: pf.filter.clone(),
                            wildcards: pf.partitioning_wildcards.clone(),
                        })
                        .collect()
                }));
                view.max_buffered_msgs = Some(c.max_buffered_msgs);
                view.max_buffered_bytes = Some(c.max_buffered_bytes);
                view.work_queue_stream = Some(elastic_stream_name(stream.as_str(), group.as_str()));
            }
        }
        Ok((view, counted_from))
    }

    /// The infos of `consumers` of `stream`, in order (`None`: no such
    /// consumer). One request lists up to 256 consumers with their infos,
    /// several times cheaper at the server than as many info requests, so a
    /// stream with at most [`LISTED_CONSUMERS`] is read from its list, its
    /// pages at once; a consumer the list does not hold (created since, or
    /// its leader did not answer in a cluster) is asked for on its own.
    /// `first_page`: the list's first page when it was already asked for.
    async fn consumer_infos(
        &self,
        stream: &str,
        consumers: &[String],
        first_page: Option<Result<ConsumerPage, RequestError>>,
    ) -> Result<Vec<Option<Info>>, Error> {
        let mut listed: BTreeMap<String, Info> = BTreeMap::new();
        let first_page = match first_page {
            Some(page) => page,
            None => self.consumer_page(stream, 0).await,
        };
        match first_page {
            Ok(first) => {
                let total = first.total;
                listed.extend(first.consumers.into_iter().flatten().map(|info| (info.name.clone(), info)));
                // The rest at once, a page apart (the server's page size).
                let per_page = listed.len();
                if per_page > 0 && total > per_page && total <= LISTED_CONSUMERS {
                    let pages = (per_page..total).step_by(per_page).map(|offset| self.consumer_page(stream, offset));
                    for page in futures::future::join_all(pages).await.into_iter().flatten() {
                        listed.extend(page.consumers.into_iter().flatten().map(|info| (info.name.clone(), info)));
                    }
                }
            }
            // No stream (an elastic group's work queue before its first member): no consumers.
            Err(e) if is_not_found(&e) => return Ok(vec![None; consumers.len()]),
            // Asked one by one below, which says what is wrong.
            Err(e) => tracing::debug!(error = %e, stream, "listing consumers"),
        }
        // Each request owns its names: with borrows inside, the handler's
        // future would not be `Send`.
        let asked: Vec<(String, Option<Info>)> =
            consumers.iter().map(|consumer| (consumer.clone(), listed.remove(consumer))).collect();
        let infos = futures::stream::iter(asked)
            .map(|(consumer, listed)| {
                let stream = stream.to_owned();
                async move {
                    match listed {
                        Some(info) => Ok(Some(info)),
                        None => self.consumer_info(&stream, &consumer).await,
                    }
                }
            })
            .buffered(CONCURRENT_REQUESTS);
        infos.try_collect().await
    }

    /// One page of `stream`'s consumer list, from `offset`.
    async fn consumer_page(&self, stream: &str, offset: usize) -> Result<ConsumerPage, RequestError> {
        let answer: Response<ConsumerPage> =
            self.js.request(format!("CONSUMER.LIST.{stream}"), &serde_json::json!({ "offset": offset })).await?;
        match answer {
            Response::Ok(page) => Ok(page),
            Response::Err { error } => Err(RequestError::with_source(RequestErrorKind::Other, error)),
        }
    }

    async fn consumer_info(&self, stream: &str, consumer: &str) -> Result<Option<jetstream::consumer::Info>, Error> {
        let handle = match self.js.get_stream_no_info(stream).await {
            Ok(h) => h,
            Err(e) => return Err(unavailable_or_internal("reading consumer", e).into()),
        };
        match handle.consumer_info(consumer).await {
            Ok(info) => Ok(Some(info)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(unavailable_or_internal("reading consumer", e).into()),
        }
    }
}

/// The most consumers a stream may have for a group view to read them from
/// its list: two pages at once (nats-server answers 256 a page). On a
/// stream with more, most of what a page brings would be other groups'
/// consumers.
const LISTED_CONSUMERS: usize = 512;

/// A page of `$JS.API.CONSUMER.LIST.<stream>`.
#[derive(Debug, Deserialize)]
struct ConsumerPage {
    total: usize,
    consumers: Option<Vec<Info>>,
}

/// The partitions whose backlog a member's consumer already tells exactly:
/// every partition of a member with nothing unacknowledged, and the one
/// partition of a member that owns one. Only a member owning several
/// partitions with a backlog needs it counted partition by partition (and
/// one whose consumer does not exist yet, from the start).
fn backlog_from_consumers(owners: &[(String, Vec<u32>)], backlogs: &BTreeMap<String, u64>) -> BTreeMap<u32, u64> {
    let mut known = BTreeMap::new();
    for (member, owned) in owners {
        match (backlogs.get(member), owned.as_slice()) {
            (Some(0), _) => known.extend(owned.iter().map(|p| (*p, 0))),
            (Some(backlog), [only]) => {
                known.insert(*only, *backlog);
            }
            _ => {}
        }
    }
    known
}

pub(super) fn mappings_view(mappings: &[MemberMapping]) -> Option<Vec<OwnedPartitions>> {
    (!mappings.is_empty()).then(|| {
        mappings
            .iter()
            .map(|m| OwnedPartitions { member: m.member.clone(), partitions: m.partitions.clone().unwrap_or_default() })
            .collect()
    })
}

pub(super) fn membership_view(config: &GroupConfig, revision: u64) -> MembershipView {
    MembershipView {
        members: config.members().to_vec(),
        mappings: mappings_view(config.mappings()),
        ownership: ownership(config.partitions(), config.members(), config.mappings())
            .into_iter()
            .map(|(member, partitions)| OwnedPartitions { member, partitions })
            .collect(),
        revision,
        note: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_members_with_several_partitions_and_a_backlog_are_counted_one_by_one() {
        let owners = vec![
            ("idle".to_owned(), vec![0, 1]),
            ("single".to_owned(), vec![2]),
            ("busy".to_owned(), vec![3, 4]),
            ("unjoined".to_owned(), vec![5]),
        ];
        let backlogs: BTreeMap<String, u64> =
            [("idle", 0), ("single", 7), ("busy", 3)].into_iter().map(|(m, n)| (m.to_owned(), n)).collect();
        let known = backlog_from_consumers(&owners, &backlogs);
        assert_eq!(known, BTreeMap::from([(0, 0), (1, 0), (2, 7)]), "3 and 4 split, 5 has no consumer");
    }
}
