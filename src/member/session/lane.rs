//! Lane tasks: each partition with a ready head has one, delivering its
//! messages one at a time and picking the next itself, so a partition's
//! next message goes out without a round trip through the session.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use futures::FutureExt;
use tokio::sync::Notify;

use crate::delivery::endpoint::Endpoint;
use crate::delivery::message::Held;
use crate::events::Event;
use crate::member::context::InstanceContext;
use crate::member::deliver::{dead_letter_and_term, deliver, Outcome};
use crate::member::lanes::{Lanes, Settled, Settlement};
use crate::member_ref::MemberRef;

/// Lane state shared by the session and the lane tasks. Never held across
/// an await.
pub(super) struct LaneState {
    pub lanes: Lanes<Held>,
    pub blocked_reported: BlockedPartitions,
    /// Partitions whose head an operator skipped while it was being
    /// delivered: it is dead-lettered when that attempt fails.
    pub skip_requested: BTreeSet<u32>,
}

/// Partitions reported blocked, mirrored in the blocked-partitions gauge
/// (which drops back when the instance ends).
pub(super) struct BlockedPartitions {
    set: BTreeSet<u32>,
    gauge: metrics::Gauge,
}

impl BlockedPartitions {
    pub fn new(who: &MemberRef) -> Self {
        let gauge = metrics::gauge!(crate::metrics::BLOCKED_PARTITIONS,
            "stream" => who.stream.to_string(), "group" => who.group.to_string(), "member" => who.member.to_string());
        Self { set: BTreeSet::new(), gauge }
    }

    pub fn contains(&self, partition: &u32) -> bool {
        self.set.contains(partition)
    }

    pub fn insert(&mut self, partition: u32) {
        if self.set.insert(partition) {
            self.gauge.increment(1.0);
        }
    }

    pub fn remove(&mut self, partition: &u32) {
        if self.set.remove(partition) {
            self.gauge.decrement(1.0);
        }
    }

    pub fn clear(&mut self) {
        self.gauge.decrement(self.set.len() as f64);
        self.set.clear();
    }
}

impl Drop for BlockedPartitions {
    fn drop(&mut self) {
        self.clear();
    }
}

/// What lane tasks need.
#[derive(Clone)]
pub(super) struct LaneShared {
    pub ctx: Arc<InstanceContext>,
    pub who: MemberRef,
    pub endpoint: Arc<Endpoint>,
    pub state: Arc<Mutex<LaneState>>,
    /// Whether this instance holds the pin (lanes stop when it does not).
    pub pinned: Arc<AtomicBool>,
    /// The fencing token deliveries carry.
    pub fencing: Arc<AtomicU64>,
    /// Set when the endpoint answered 410.
    pub gone: Arc<AtomicBool>,
    pub wake: Arc<Notify>,
}

impl LaneShared {
    pub fn lock(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Delivers one partition's messages, one at a time, for as long as the
/// partition has a ready head: the next message goes out the moment the
/// previous one is settled, without a round trip through the session.
pub(super) async fn run_lane(shared: LaneShared, partition: u32, first: (u64, Held)) {
    let mut next = Some(first);
    while let Some((seq, held)) = next {
        let fencing = shared.fencing.load(Ordering::Relaxed);
        let delivery = deliver(shared.ctx.clone(), shared.who.clone(), shared.endpoint.clone(), held.clone(), fencing);
        // A panic must not leave the partition marked in flight for ever.
        let outcome = match std::panic::AssertUnwindSafe(delivery).catch_unwind().await {
            Ok(outcome) => outcome,
            Err(_) => {
                tracing::error!(partition, seq, "delivery panicked; the message will be retried");
                let _ = held.message.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
                Outcome {
                    settled: Settled::Naked { attempts: held.attempt, error: "keygate failed while delivering".into() },
                    events: Vec::new(),
                    gone: false,
                }
            }
        };
        let mut outcome = outcome;
        let skip = matches!(outcome.settled, Settled::Naked { .. }) && shared.lock().skip_requested.remove(&partition);
        if skip {
            match dead_letter_and_term(&shared.ctx, &shared.who, &held, "skipped by an operator").await {
                Ok(mut events) => {
                    outcome.events.append(&mut events);
                    outcome.settled = Settled::Done(Settlement::Terminated);
                }
                Err(e) => tracing::warn!(error = %e, partition, seq, "could not dead-letter a skipped message"),
            }
        }
        for e in outcome.events {
            shared.ctx.events.emit(e);
        }
        if outcome.gone {
            shared.gone.store(true, Ordering::Relaxed);
            shared.wake.notify_one();
        }
        let naked = matches!(outcome.settled, Settled::Naked { .. });
        let mut state = shared.lock();
        let was_blocked = state.lanes.blocked().contains_key(&partition);
        state.lanes.settle(partition, seq, outcome.settled);
        let blocked = state.lanes.blocked().remove(&partition);
        if naked && !state.blocked_reported.contains(&partition) {
            state.blocked_reported.insert(partition);
            if let Some(b) = blocked {
                let about = shared.ctx.about(&shared.who);
                shared.ctx.events.emit(Event::partition_blocked(about, partition, b.seq, b.attempts, &b.last_error));
            }
        } else if was_blocked && blocked.is_none() {
            state.blocked_reported.remove(&partition);
            shared.ctx.events.emit(Event::partition_unblocked(shared.ctx.about(&shared.who), partition, seq, None));
        }
        next = if shared.pinned.load(Ordering::Relaxed) && !shared.gone.load(Ordering::Relaxed) {
            state.lanes.dispatch_partition(partition)
        } else {
            None
        };
    }
}
