//! A group as it is right now: what NATS stores and counts, completed by
//! what the instances holding members' pins report (who serves, blocked
//! partitions, per-partition floors that sharpen the backlog count).

use std::collections::BTreeMap;

use crate::cluster::control::{ask, Control};
use crate::cluster::replicas::Replicas;
use crate::groups::view::{BlockedView, GroupView, InstanceState};
use crate::groups::GroupError as Error;
use crate::groups::{GroupAdmin, GroupKind};
use crate::names::MemberRef;
use crate::names::{GroupName, MemberName, StreamName};

/// How long a roll call waits for instances to answer.
const ROLL_CALL_WINDOW: std::time::Duration = std::time::Duration::from_millis(200);

/// Where the view's list of every instance of every member comes from.
pub enum Instances<'a> {
    /// Not listed.
    Skip,
    /// Asked of the instances: a short wait for their answers (a process
    /// that is no replica, like the CLI).
    RollCall,
    /// Read from the replicas' rosters, kept live (cluster/replicas.rs).
    Live(&'a Replicas),
}

/// The group's view with its serving instances' state, and every instance
/// of every member (standbys too) as `instances` says.
pub async fn observe(
    groups: &GroupAdmin,
    nats: &async_nats::Client,
    stream: &StreamName,
    group: &GroupName,
    kind: Option<GroupKind>,
    instances: Instances<'_>,
) -> Result<GroupView, Error> {
    let (mut view, counted_from) = groups.view_counted(stream, group, kind).await?;
    let mut live = match &instances {
        Instances::Live(replicas) => Some(replicas.instances_of(stream.as_str(), group.as_str())),
        Instances::Skip | Instances::RollCall => None,
    };
    // The pin holder as its replica reports it. It is asked only for what
    // the report lacks: its blocked lanes, and the per-partition floors
    // that sharpen a backlog counted partition by partition; a holder no
    // report names (not published yet, or not keygate) is asked as well.
    let mut to_ask = Vec::new();
    for state in &mut view.assignment {
        let Some(pin) = state.pinned_client_id.as_deref() else { continue };
        let holder = live
            .as_ref()
            .and_then(|live| live.get(&state.member))
            .and_then(|instances| instances.iter().find(|i| i.report.pin.as_deref() == Some(pin)));
        if let Some(holder) = holder {
            state.serving_instance = Some(holder.instance.clone());
            state.fencing_token = holder.report.fencing_token;
        }
        let counted = state.partitions.iter().any(|p| counted_from.contains_key(p));
        if holder.is_none_or(|h| h.report.blocked) || counted {
            to_ask.push(state.member.clone());
        }
    }
    let asks = to_ask.into_iter().filter_map(|member| {
        let who = MemberRef {
            stream: stream.clone(),
            group: group.clone(),
            member: MemberName::parse(&member).ok()?,
            owner: Default::default(),
        };
        Some(async move { (member, ask(nats, &who, &Control::Status).await) })
    });
    let mut floors = BTreeMap::new();
    for (member, reply) in futures::future::join_all(asks).await {
        let Some(reply) = reply else { continue };
        if let Some(state) = view.assignment.iter_mut().find(|m| m.member == member) {
            state.serving_instance = Some(reply.instance.clone());
            state.fencing_token = Some(reply.fencing_token);
            // Only the member's own partitions: a reply from a stale
            // instance must not lower another member's count.
            let owned = state.partitions.clone();
            floors.extend(reply.floors.into_iter().filter(|(p, _)| owned.contains(p)));
        }
        view.blocked_total += reply.blocked_total.max(reply.blocked.len());
        for b in reply.blocked {
            view.blocked.push(BlockedView {
                partition: b.partition,
                key: b.key,
                member: member.clone(),
                seq: b.seq,
                since: b.since,
                attempts: b.attempts,
                last_error: b.last_error,
            });
        }
    }
    view.blocked.sort_by(|a, b| (a.partition, &a.key, a.seq).cmp(&(b.partition, &b.key, b.seq)));
    if let Some(live) = live.as_mut() {
        for state in &mut view.assignment {
            state.instances = live
                .remove(&state.member)
                .unwrap_or_default()
                .into_iter()
                .map(|i| InstanceState {
                    instance: i.instance,
                    session: i.session,
                    pinned: i.report.pinned,
                    outputs: i.report.outputs,
                })
                .collect();
        }
    } else if let Instances::RollCall = instances {
        let calls = view.assignment.iter().filter_map(|m| {
            let who = MemberRef {
                stream: stream.clone(),
                group: group.clone(),
                member: MemberName::parse(&m.member).ok()?,
                owner: Default::default(),
            };
            Some(async move {
                (who.member.to_string(), crate::cluster::control::roll_call(nats, &who, ROLL_CALL_WINDOW).await)
            })
        });
        for (member, replies) in futures::future::join_all(calls).await {
            if let Some(state) = view.assignment.iter_mut().find(|m| m.member == member) {
                state.instances = replies
                    .into_iter()
                    .map(|r| InstanceState {
                        instance: r.instance,
                        session: r.session,
                        pinned: r.pinned,
                        outputs: r.outputs,
                    })
                    .collect();
            }
        }
    }
    for state in &mut view.assignment {
        state.pin = state.pin_status();
    }
    // Only partitions whose instance floor is finer than the one counted
    // from can count lower; the others would ask the server for nothing.
    floors.retain(|p, floor| counted_from.get(p).is_none_or(|counted| *floor > *counted));
    if let Err(e) = groups.recount_static_pending(&mut view, &floors).await {
        tracing::warn!(%stream, %group, error = %e.report(), "could not recount the backlog from instance floors");
    }
    Ok(view)
}
