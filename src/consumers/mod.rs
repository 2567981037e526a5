//! Plain pull consumers with a priority-group policy (ADR-42): `none`,
//! `overflow`, `pinned_client`, `prioritized`. The REST shape, validated as
//! the server validates it (before anything is created), and the few
//! JetStream calls behind it. Their subscribers run on the instance
//! runtime members use (`runtime/driver/`, concurrent dispatch), with the
//! shuffle window in `runtime/shuffle_window.rs` and
//! `runtime/window_share.rs`.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;

use crate::error::Error as DomainError;

/// What managing a plain consumer can fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerErrorKind {
    /// The consumer's specification is invalid.
    InvalidSpec,
    StreamNotFound,
    NotFound,
    /// The consumer is a partitioned group member's: managed through its group.
    GroupMembers,
    /// `unpin` on a consumer without the pinned_client policy.
    NotPinned,
    /// A filter matches nothing the stream stores.
    FilterMatchesNothing,
    /// The server refused the configuration.
    Refused,
    Unavailable,
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(ConsumerErrorKind {
    InvalidSpec => Invalid,
    StreamNotFound => NotFound,
    NotFound => NotFound,
    GroupMembers => Conflict,
    NotPinned => Conflict,
    FilterMatchesNothing => Unprocessable,
    Refused => Unprocessable,
});
crate::error::flows_into!(ConsumerErrorKind: crate::nats::errors::BrokerErrorKind, crate::groups::GroupErrorKind);

pub type ConsumerError = DomainError<ConsumerErrorKind>;
use crate::groups::config::PRIORITY_GROUP;
use crate::groups::GroupAdmin;
use crate::names::{ConsumerName, StreamName};
use crate::nats::errors::{is_not_found, is_transient, jetstream_error_code, unavailable_or_internal, NatsFailure};
use crate::partition::SubjectPattern;
use ConsumerError as Error;
use ConsumerErrorKind as Kind;

/// Default ack wait of a consumer.
pub const DEFAULT_ACK_WAIT_MS: u64 = 30_000;
/// Default most un-acked messages of a consumer.
pub const DEFAULT_MAX_ACK_PENDING: i64 = 1000;

/// How the server shares a consumer between the clients pulling from it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Every pull is served (plain work sharing).
    #[default]
    None,
    /// A pull is served only while the consumer's backlog is at least the
    /// pull's `min_pending` / `min_ack_pending` (a far region takes overflow).
    Overflow,
    /// One client is served; the others stand by until it stops pulling for
    /// `pinned_ttl_ms` or is unpinned.
    PinnedClient,
    /// The pull with the lowest `priority` (0–9) is served first.
    Prioritized,
}

/// A consumer as `PUT` creates it.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsumerSpec {
    #[serde(default)]
    pub policy: Policy,
    /// The priority group pulls must name (required with a policy): at
    /// most 16 characters of `A-Z a-z 0-9 - _ / = ) +`.
    #[schema(example = "jobs")]
    pub group: Option<String>,
    /// `pinned_client` only: how long the pinned client may go without
    /// pulling before another is pinned (default 2 minutes, as the server).
    pub pinned_ttl_ms: Option<u64>,
    #[schema(example = 30000)]
    pub ack_wait_ms: Option<u64>,
    #[schema(example = 1000)]
    pub max_ack_pending: Option<i64>,
    /// Only these subjects of the stream (default: all).
    pub filter_subjects: Option<Vec<String>>,
    /// Break publish order cheaply: subscribers delay a share of first
    /// deliveries by a random NAK delay.
    pub shuffle: Option<Shuffle>,
}

/// Bounded shuffling: a first delivery is, with `probability`, NAK'd with
/// a random delay in `[min_delay_ms, max_delay_ms]` instead of delivered;
/// redeliveries go out at once; at most `max_window` messages are delayed
/// at a time (per subscriber instance).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Shuffle {
    #[schema(example = 0.5)]
    pub probability: f64,
    #[schema(example = 100)]
    pub min_delay_ms: u64,
    #[schema(example = 2000)]
    pub max_delay_ms: u64,
    #[schema(example = 500)]
    pub max_window: u64,
}

/// Where a consumer's shuffle settings live: its own metadata, so every
/// subscriber on every replica reads them with the consumer.
pub const SHUFFLE_METADATA: &str = "keygate.shuffle";

impl Shuffle {
    fn check(&self) -> Result<(), Error> {
        let bad = |m: &str| Err(Error::new(Kind::InvalidSpec, format!("shuffle: {m}")));
        if !(self.probability > 0.0 && self.probability <= 1.0) {
            return bad("probability must be above 0 and at most 1");
        }
        if self.min_delay_ms > self.max_delay_ms || self.max_delay_ms == 0 || self.max_delay_ms > 3_600_000 {
            return bad("need 0 <= min_delay_ms <= max_delay_ms <= 3600000 and max_delay_ms > 0");
        }
        if !(1..=100_000).contains(&self.max_window) {
            return bad("max_window must be between 1 and 100000");
        }
        Ok(())
    }

    /// A consumer's shuffle settings, from its metadata.
    pub fn of(config: &consumer::Config) -> Option<Self> {
        serde_json::from_str(config.metadata.get(SHUFFLE_METADATA)?).ok()
    }
}

/// A consumer, its pin and its backlog.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ConsumerView {
    pub stream: String,
    pub consumer: String,
    pub policy: Policy,
    pub group: Option<String>,
    pub pinned_ttl_ms: Option<u64>,
    pub ack_wait_ms: u64,
    pub max_ack_pending: i64,
    pub filter_subjects: Vec<String>,
    /// The pinned client's id (`pinned_client` only, when one is pinned).
    pub pinned_client_id: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub pinned_since: Option<OffsetDateTime>,
    /// Messages not yet delivered.
    pub num_pending: u64,
    /// Delivered, not yet acknowledged.
    pub num_ack_pending: usize,
    /// Pull requests waiting at the server.
    pub waiting_pulls: usize,
    pub shuffle: Option<Shuffle>,
}

/// What `PUT` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerPutOutcome {
    Created,
    Unchanged,
    Updated,
}

/// Whether `name` is a valid priority group name (as the server checks it).
pub fn valid_priority_group(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 16
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'/' | b'=' | b')' | b'+'))
}

impl ConsumerSpec {
    /// The consumer configuration, or why it would be refused.
    pub fn into_config(self, name: &ConsumerName) -> Result<consumer::pull::Config, Error> {
        let bad = |m: String| Err(Error::new(Kind::InvalidSpec, m));
        match (self.policy, &self.group) {
            (Policy::None, Some(_)) => {
                return bad("group needs a policy (overflow, pinned_client or prioritized)".into())
            }
            (Policy::None, None) => {}
            (_, None) => return bad("a consumer with a policy needs a group that pulls name".into()),
            (_, Some(group)) if !valid_priority_group(group) => {
                return bad(format!("group {group:?} is invalid: use 1 to 16 characters of A-Z a-z 0-9 - _ / = ) +"))
            }
            _ => {}
        }
        if self.pinned_ttl_ms.is_some() && self.policy != Policy::PinnedClient {
            return bad("pinned_ttl_ms applies to the pinned_client policy only".into());
        }
        if self.pinned_ttl_ms == Some(0) || self.ack_wait_ms == Some(0) {
            return bad("pinned_ttl_ms and ack_wait_ms must be at least 1".into());
        }
        let mut max_ack_pending = self.max_ack_pending.unwrap_or(DEFAULT_MAX_ACK_PENDING);
        if !(1..=1_000_000).contains(&max_ack_pending) {
            return bad("max_ack_pending must be between 1 and 1000000".into());
        }
        let mut metadata = std::collections::HashMap::new();
        if let Some(shuffle) = &self.shuffle {
            shuffle.check()?;
            // Delayed messages are un-acked: without room above the window
            // the cap would throttle deliveries by surprise.
            max_ack_pending += shuffle.max_window as i64;
            metadata.insert(SHUFFLE_METADATA.to_owned(), serde_json::to_string(shuffle).unwrap_or_default());
        }
        let filters = self.filter_subjects.unwrap_or_default();
        for filter in &filters {
            SubjectPattern::parse(filter)
                .map_err(|e| Error::new(Kind::InvalidSpec, format!("filter {filter:?}: {e}")))?;
        }
        let mut unique = filters.clone();
        unique.sort();
        unique.dedup();
        if unique.len() != filters.len() {
            return bad("filter_subjects must not repeat".into());
        }
        Ok(consumer::pull::Config {
            durable_name: Some(name.to_string()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_millis(self.ack_wait_ms.unwrap_or(DEFAULT_ACK_WAIT_MS)),
            max_ack_pending,
            filter_subjects: filters,
            priority_policy: match self.policy {
                Policy::None => consumer::PriorityPolicy::None,
                Policy::Overflow => consumer::PriorityPolicy::Overflow,
                Policy::PinnedClient => consumer::PriorityPolicy::PinnedClient,
                Policy::Prioritized => consumer::PriorityPolicy::Prioritized,
            },
            priority_groups: self.group.into_iter().collect(),
            priority_timeout: self.pinned_ttl_ms.map(Duration::from_millis).unwrap_or_default(),
            metadata,
            ..Default::default()
        })
    }
}

fn policy_of(config: &consumer::Config) -> Policy {
    match config.priority_policy {
        consumer::PriorityPolicy::Overflow => Policy::Overflow,
        consumer::PriorityPolicy::PinnedClient => Policy::PinnedClient,
        consumer::PriorityPolicy::Prioritized => Policy::Prioritized,
        _ => Policy::None,
    }
}

fn view(info: &consumer::Info) -> ConsumerView {
    let config = &info.config;
    let policy = policy_of(config);
    let pin = info.priority_groups.iter().find(|g| g.pinned_client_id.as_deref().is_some_and(|id| !id.is_empty()));
    let mut filter_subjects = config.filter_subjects.clone();
    if filter_subjects.is_empty() && !config.filter_subject.is_empty() {
        filter_subjects.push(config.filter_subject.clone());
    }
    ConsumerView {
        stream: info.stream_name.clone(),
        consumer: info.name.clone(),
        policy,
        group: config.priority_groups.first().cloned(),
        pinned_ttl_ms: (policy == Policy::PinnedClient).then_some(config.priority_timeout.as_millis() as u64),
        ack_wait_ms: config.ack_wait.as_millis() as u64,
        max_ack_pending: config.max_ack_pending,
        filter_subjects,
        pinned_client_id: pin.and_then(|p| p.pinned_client_id.clone()),
        pinned_since: pin.and_then(|p| p.pinned_ts),
        num_pending: info.num_pending,
        num_ack_pending: info.num_ack_pending,
        waiting_pulls: info.num_waiting,
        shuffle: Shuffle::of(config),
    }
}

/// The consumers API over JetStream.
#[derive(Clone)]
pub struct Consumers {
    js: jetstream::Context,
    /// Groups' member consumers, which plain consumers may not take.
    groups: GroupAdmin,
}

impl Consumers {
    pub fn new(js: jetstream::Context, groups: GroupAdmin) -> Self {
        Self { js, groups }
    }

    async fn stream(&self, stream: &StreamName) -> Result<jetstream::stream::Stream<()>, Error> {
        let handle = self.js.get_stream_no_info(stream.as_str()).await.map_err(|e| {
            if is_not_found(&e) {
                Error::new(Kind::StreamNotFound, format!("no stream {stream}"))
            } else {
                unavailable_or_internal("reading stream", e).into()
            }
        })?;
        Ok(handle)
    }

    async fn info(&self, stream: &StreamName, name: &ConsumerName) -> Result<Option<consumer::Info>, Error> {
        let handle = self.stream(stream).await?;
        match handle.consumer_info(name.as_str()).await {
            Ok(info) => Ok(Some(info)),
            Err(e) if is_not_found(&e) => {
                // Distinguish "no stream" from "no consumer".
                match self.js.get_stream(stream.as_str()).await {
                    Ok(_) => Ok(None),
                    Err(e) if is_not_found(&e) => Err(Error::new(Kind::StreamNotFound, format!("no stream {stream}"))),
                    Err(e) => Err(unavailable_or_internal("reading stream", e).into()),
                }
            }
            Err(e) => Err(unavailable_or_internal("reading consumer", e).into()),
        }
    }

    /// Creates (201), confirms (200) or updates (200) a consumer.
    pub async fn put(
        &self,
        stream: &StreamName,
        name: &ConsumerName,
        spec: ConsumerSpec,
    ) -> Result<(ConsumerPutOutcome, ConsumerView), Error> {
        let config = spec.into_config(name)?;
        self.check_not_a_members(stream, name).await?;
        let existing = self.info(stream, name).await?;
        self.check_filters(stream, &config.filter_subjects).await?;
        if let Some(info) = &existing {
            if info.config.priority_groups.iter().any(|g| g == PRIORITY_GROUP) {
                return Err(Error::new(
                    Kind::GroupMembers,
                    format!(
                        "consumer {name} belongs to a partitioned consumer group member; manage it through the group"
                    ),
                ));
            }
        }
        let handle = self.stream(stream).await?;
        let outcome = match &existing {
            None => ConsumerPutOutcome::Created,
            Some(info) if same(&info.config, &config) => return Ok((ConsumerPutOutcome::Unchanged, view(info))),
            Some(_) => ConsumerPutOutcome::Updated,
        };
        let result = match outcome {
            ConsumerPutOutcome::Created => handle.create_consumer_strict(config).await.map(|_| ()).map_err(refused),
            _ => handle.update_consumer(config).await.map(|_| ()).map_err(refused),
        };
        result?;
        let info = self.info(stream, name).await?.ok_or_else(|| Error::new(Kind::Internal, "consumer vanished"))?;
        Ok((outcome, view(&info)))
    }

    /// A static group member's consumer is refused even before the member
    /// created it: a plain consumer of that name would be taken by the
    /// member's instances, or stop them from joining.
    async fn check_not_a_members(&self, stream: &StreamName, name: &ConsumerName) -> Result<(), Error> {
        let members = self.groups.static_member_consumers(stream).await?;
        match members.iter().find(|(_, consumer)| consumer == name.as_str()) {
            Some((group, _)) => Err(Error::new(
                Kind::GroupMembers,
                format!("consumer {name} is the consumer of a member of group {group}; manage it through the group"),
            )),
            None => Ok(()),
        }
    }

    /// The server accepts a filter that matches none of the stream's
    /// subjects; such a consumer would never get a message, so it is refused.
    async fn check_filters(&self, stream: &StreamName, filters: &[String]) -> Result<(), Error> {
        if filters.is_empty() {
            return Ok(());
        }
        let info =
            self.js.get_stream(stream.as_str()).await.map_err(|e| unavailable_or_internal("reading stream", e))?;
        let config = &info.cached_info().config;
        // Stored subjects: the stream's own, or what its transform makes of them.
        let stored: Vec<String> = match &config.subject_transform {
            Some(t) => vec![t
                .destination
                .split('.')
                .map(|token| if token.starts_with("{{") { "*" } else { token })
                .collect::<Vec<_>>()
                .join(".")],
            None => config.subjects.clone(),
        };
        let stored: Vec<SubjectPattern> = stored.iter().filter_map(|s| SubjectPattern::parse(s).ok()).collect();
        for filter in filters {
            let pattern = SubjectPattern::parse(filter).map_err(|e| Error::new(Kind::InvalidSpec, e.to_string()))?;
            if !stored.iter().any(|s| s.overlaps(&pattern)) {
                return Err(Error::new(
                    Kind::FilterMatchesNothing,
                    format!(
                        "filter {filter:?} matches none of stream {stream}'s stored subjects ({})",
                        stored.iter().map(SubjectPattern::as_string).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    pub async fn get(&self, stream: &StreamName, name: &ConsumerName) -> Result<ConsumerView, Error> {
        let info = self.info(stream, name).await?.ok_or_else(|| not_found(stream, name))?;
        Ok(view(&info))
    }

    /// A plain consumer to subscribe to: a partitioned group member's
    /// consumer is refused (409), since a plain subscriber on it would take
    /// the member's pin and deliver without key order.
    pub async fn subscribable(&self, stream: &StreamName, name: &ConsumerName) -> Result<ConsumerView, Error> {
        let info = self.info(stream, name).await?.ok_or_else(|| not_found(stream, name))?;
        self.check_not_a_members(stream, name).await?;
        if info.config.priority_groups.iter().any(|g| g == PRIORITY_GROUP) {
            return Err(Error::new(
                Kind::GroupMembers,
                format!(
                "consumer {name} belongs to a partitioned consumer group member; join the group as that member instead"
            ),
            ));
        }
        Ok(view(&info))
    }

    pub async fn delete(&self, stream: &StreamName, name: &ConsumerName) -> Result<(), Error> {
        let info = self.info(stream, name).await?.ok_or_else(|| not_found(stream, name))?;
        if info.config.priority_groups.iter().any(|g| g == PRIORITY_GROUP) {
            return Err(Error::new(
                Kind::GroupMembers,
                format!("consumer {name} belongs to a partitioned consumer group member; delete the group instead"),
            ));
        }
        let handle = self.stream(stream).await?;
        handle.delete_consumer(name.as_str()).await.map_err(|e| unavailable_or_internal("deleting consumer", e))?;
        Ok(())
    }

    /// Unpins the pinned client (`pinned_client` only): the next pull pins another.
    pub async fn unpin(&self, stream: &StreamName, name: &ConsumerName) -> Result<ConsumerView, Error> {
        let info = self.info(stream, name).await?.ok_or_else(|| not_found(stream, name))?;
        if policy_of(&info.config) != Policy::PinnedClient {
            return Err(Error::new(
                Kind::NotPinned,
                format!("consumer {name} has no pinned_client policy: nothing to unpin"),
            ));
        }
        let group = info.config.priority_groups.first().cloned().unwrap_or_default();
        let handle = self.stream(stream).await?;
        handle.unpin_consumer(name.as_str(), &group).await.map_err(|e| unavailable_or_internal("unpinning", e))?;
        self.get(stream, name).await
    }
}

fn not_found(stream: &StreamName, name: &ConsumerName) -> Error {
    Error::new(Kind::NotFound, format!("no consumer {name} on stream {stream}"))
}

/// The server's refusal of a configuration, in its words.
fn refused(err: impl NatsFailure + Send + Sync) -> Error {
    match jetstream_error_code(&err) {
        Some(_) if !is_transient(&err) => {
            Error::new(Kind::Refused, format!("the server refused the consumer: {err}")).caused_by(err)
        }
        _ => unavailable_or_internal("creating consumer", err).into(),
    }
}

/// Whether the fields keygate sets are the same.
fn same(existing: &consumer::Config, wanted: &consumer::pull::Config) -> bool {
    let mut existing_filters = existing.filter_subjects.clone();
    if existing_filters.is_empty() && !existing.filter_subject.is_empty() {
        existing_filters.push(existing.filter_subject.clone());
    }
    existing.priority_policy == wanted.priority_policy
        && existing.priority_groups == wanted.priority_groups
        && (wanted.priority_policy != consumer::PriorityPolicy::PinnedClient
            || wanted.priority_timeout.is_zero()
            || existing.priority_timeout == wanted.priority_timeout)
        && existing.ack_wait == wanted.ack_wait
        && existing.max_ack_pending == wanted.max_ack_pending
        && existing_filters == wanted.filter_subjects
        && existing.metadata.get(SHUFFLE_METADATA) == wanted.metadata.get(SHUFFLE_METADATA)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> Result<consumer::pull::Config, Error> {
        serde_json::from_value::<ConsumerSpec>(json).unwrap().into_config(&ConsumerName::parse("c").unwrap())
    }

    #[test]
    fn a_policy_needs_a_valid_group_and_no_policy_takes_none() {
        assert!(spec(serde_json::json!({})).is_ok());
        assert!(spec(serde_json::json!({"group":"jobs"})).is_err());
        assert!(spec(serde_json::json!({"policy":"overflow"})).is_err());
        assert!(spec(serde_json::json!({"policy":"overflow","group":"jobs/eu=1+)"})).is_ok());
        assert!(spec(serde_json::json!({"policy":"overflow","group":"seventeen-chars-x"})).is_err());
        assert!(spec(serde_json::json!({"policy":"prioritized","group":"a.b"})).is_err());
        assert!(spec(serde_json::json!({"policy":"prioritized","group":""})).is_err());
    }

    #[test]
    fn pinned_ttl_belongs_to_pinned_client_only() {
        let ok = spec(serde_json::json!({"policy":"pinned_client","group":"g","pinned_ttl_ms":5000})).unwrap();
        assert_eq!(ok.priority_timeout, Duration::from_secs(5));
        assert_eq!(ok.priority_policy, consumer::PriorityPolicy::PinnedClient);
        assert!(spec(serde_json::json!({"policy":"overflow","group":"g","pinned_ttl_ms":5000})).is_err());
        assert!(spec(serde_json::json!({"policy":"pinned_client","group":"g","pinned_ttl_ms":0})).is_err());
    }

    #[test]
    fn limits_and_filters_are_checked() {
        assert!(spec(serde_json::json!({"max_ack_pending":0})).is_err());
        assert!(spec(serde_json::json!({"ack_wait_ms":0})).is_err());
        assert!(spec(serde_json::json!({"filter_subjects":["a.*","a.*"]})).is_err());
        assert!(spec(serde_json::json!({"filter_subjects":["a..b"]})).is_err());
        let config = spec(serde_json::json!({"filter_subjects":["a.*","b.>"],"max_ack_pending":5})).unwrap();
        assert_eq!(config.filter_subjects, vec!["a.*", "b.>"]);
        assert_eq!(config.max_ack_pending, 5);
        assert_eq!(config.durable_name.as_deref(), Some("c"));
    }

    #[test]
    fn unknown_fields_and_policies_are_refused() {
        assert!(serde_json::from_value::<ConsumerSpec>(serde_json::json!({"unknown":1})).is_err());
        assert!(serde_json::from_value::<ConsumerSpec>(serde_json::json!({"policy":"sticky"})).is_err());
    }
}
