//! Lane workers: each dispatched message has one, which delivers it,
//! settles it in its lane, and takes the next message that may go (of any
//! lane) itself, so the next delivery starts without a round trip through
//! the session. At most `max_in_flight` run at once, since only a dispatch
//! starts or continues one.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use futures::FutureExt;
use tokio::sync::Notify;

use crate::cluster::roster::Roster;
use crate::delivery::message::Held;
use crate::delivery::BatchLimits;
use crate::events::{About, Event};
use crate::names::MemberRef;
use crate::runtime::deliver::{dead_letter_and_term, deliver, deliver_batch, BatchOutcome, DeliveryMetrics, Outcome};
use crate::runtime::endpoint::Endpoint;
use crate::runtime::lanes::{Blocked, Dispatched, LaneId, LaneKey, Lanes, Settled, Settlement};
use crate::runtime::Runtime;

/// Lane state shared by the session and the lane workers. Never held across
/// an await.
pub(super) struct LaneState {
    pub lanes: Lanes<Held>,
    pub blocked_reported: BlockedLanes,
    /// Lanes whose head an operator skipped while it was being delivered:
    /// it is dead-lettered when that attempt fails.
    pub skip_requested: BTreeSet<LaneId>,
}

/// Lanes reported blocked, mirrored in the blocked-partitions and
/// blocked-keys gauges (which drop back when the instance ends) and, as
/// "any blocked", in the roster (the group view asks only such instances
/// for their list).
pub(super) struct BlockedLanes {
    set: BTreeSet<LaneId>,
    partitions: metrics::Gauge,
    keys: metrics::Gauge,
    roster: Arc<Roster>,
    who: MemberRef,
    session: u64,
}

impl BlockedLanes {
    pub fn new(who: &MemberRef, roster: Arc<Roster>, session: u64) -> Self {
        let labels =
            [("stream", who.stream.to_string()), ("group", who.group.to_string()), ("member", who.member.to_string())];
        Self {
            set: BTreeSet::new(),
            partitions: metrics::gauge!(crate::telemetry::metrics::BLOCKED_PARTITIONS, labels.as_slice()),
            keys: metrics::gauge!(crate::telemetry::metrics::BLOCKED_KEYS, labels.as_slice()),
            roster,
            who: who.clone(),
            session,
        }
    }

    fn gauge(&self, lane: &LaneId) -> &metrics::Gauge {
        match lane.key {
            LaneKey::Partition => &self.partitions,
            LaneKey::Key(_) | LaneKey::Alone(_) => &self.keys,
        }
    }

    fn report(&self) {
        self.roster.set_blocked(&self.who, self.session, !self.set.is_empty());
    }

    pub fn contains(&self, lane: &LaneId) -> bool {
        self.set.contains(lane)
    }

    /// Counts the lane as reported; true when it was not yet.
    pub fn insert(&mut self, lane: &LaneId) -> bool {
        let new = self.set.insert(lane.clone());
        if new {
            self.gauge(lane).increment(1.0);
            self.report();
        }
        new
    }

    /// Uncounts the lane; true when it was reported.
    pub fn remove(&mut self, lane: &LaneId) -> bool {
        let was = self.set.remove(lane);
        if was {
            self.gauge(lane).decrement(1.0);
            self.report();
        }
        was
    }

    pub fn clear(&mut self) {
        for lane in std::mem::take(&mut self.set) {
            self.gauge(&lane).decrement(1.0);
        }
        self.report();
    }
}

impl Drop for BlockedLanes {
    fn drop(&mut self) {
        self.clear();
    }
}

/// The event saying a lane's head failed: `partition.blocked` for a whole
/// partition, `key.blocked` for a key.
pub(super) fn blocked_event(about: About<'_>, lane: &LaneId, blocked: &Blocked) -> Event {
    let (p, seq, attempts, error) = (lane.partition, blocked.seq, blocked.attempts, blocked.last_error.as_str());
    match lane.key {
        LaneKey::Partition => Event::partition_blocked(about, p, seq, attempts, error),
        _ => Event::key_blocked(about, p, lane.key.key(), seq, attempts, error),
    }
}

/// The event saying a lane's head passed (`reason`: how, when not by a verdict).
pub(super) fn unblocked_event(about: About<'_>, lane: &LaneId, seq: u64, reason: Option<&str>) -> Event {
    match lane.key {
        LaneKey::Partition => Event::partition_unblocked(about, lane.partition, seq, reason),
        _ => Event::key_unblocked(about, lane.partition, lane.key.key(), seq, reason),
    }
}

/// What lane workers need.
#[derive(Clone)]
pub(super) struct LaneShared {
    pub ctx: Arc<Runtime>,
    pub who: MemberRef,
    pub endpoint: Arc<Endpoint>,
    pub state: Arc<Mutex<LaneState>>,
    /// Whether this instance may deliver: it holds the pin, or the consumer
    /// pins nobody (workers stop when it may not).
    pub serving: Arc<AtomicBool>,
    /// The fencing token deliveries carry.
    pub fencing: Arc<AtomicU64>,
    /// Set when the endpoint answered 410.
    pub gone: Arc<AtomicBool>,
    pub wake: Arc<Notify>,
    pub metrics: Arc<DeliveryMetrics>,
    /// Batched deliveries: the registration's batch, the signal that more
    /// messages arrived (for a batch waiting to fill), and how many
    /// batches are filling now.
    pub batching: Option<Arc<Batching>>,
}

/// What batch workers share.
pub(super) struct Batching {
    pub limits: BatchLimits,
    /// More messages arrived (a batch waiting to fill looks again).
    pub arrived: Notify,
    /// Batches waiting to fill now.
    filling: AtomicUsize,
    /// Batch workers running now, and the most that may: messages arrive
    /// one by one, so a worker started for each would send batches of one;
    /// with few workers, what arrives while they send makes the next batches.
    workers: Arc<AtomicUsize>,
    max_workers: usize,
}

/// Most batch workers of one instance: enough for `max_in_flight` in full
/// batches, and at least one.
const MAX_BATCH_WORKERS: usize = 8;

/// Counts one batch worker while it lives.
pub(super) struct BatchWorker(Arc<AtomicUsize>);

impl Drop for BatchWorker {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Batching {
    pub fn new(limits: BatchLimits, max_in_flight: usize) -> Self {
        let max_workers = (max_in_flight / limits.max_messages.max(1)).clamp(1, MAX_BATCH_WORKERS);
        Self { limits, arrived: Notify::new(), filling: AtomicUsize::new(0), workers: Arc::default(), max_workers }
    }

    /// Whether the driver may start another batch worker now: none is
    /// waiting for its batch to fill, and fewer than the most are running.
    pub fn may_start(&self) -> bool {
        self.filling.load(Ordering::Acquire) == 0 && self.workers.load(Ordering::Acquire) < self.max_workers
    }

    /// Counts a worker about to start.
    pub fn request_started(&self) -> BatchWorker {
        self.workers.fetch_add(1, Ordering::AcqRel);
        BatchWorker(self.workers.clone())
    }

    /// More messages for `batch` (which holds `filled` payload bytes), as the spec allows.
    pub fn take(&self, lanes: &mut Lanes<Held>, batch_len: usize, filled: usize) -> Vec<Dispatched<Held>> {
        let room = self.limits.max_messages.saturating_sub(batch_len);
        if room == 0 {
            return Vec::new();
        }
        lanes.dispatch_batch(room, self.limits.max_bytes, filled, |held| held.message.payload.len())
    }

    /// Whether `batch` waits to fill: it is short of `max_messages` and the
    /// spec gives a wait.
    fn waits_to_fill(&self, batch: &[Dispatched<Held>]) -> bool {
        !batch.is_empty() && !self.limits.max_wait.is_zero() && batch.len() < self.limits.max_messages
    }

    /// Counts `batch` as filling, if it waits to: no other batch starts
    /// until [`fill`] is done with it. Called where the batch is taken, so
    /// that the count is up before anything else could take a batch.
    pub fn begin(&self, batch: &[Dispatched<Held>]) {
        if self.waits_to_fill(batch) {
            self.filling.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl LaneShared {
    pub fn lock(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether a worker may take the next message: the instance still
    /// serves the pin, its endpoint is not gone, and keygate reaches NATS.
    pub fn may_take_more(&self) -> bool {
        self.serving.load(Ordering::Relaxed) && !self.gone.load(Ordering::Relaxed) && nats_reachable(&self.ctx)
    }
}

/// Whether keygate's NATS connection is up. While it is not, nothing new is
/// delivered: acks would only wait in the client's buffer, and the server
/// may be restarting, which forgets the pin (another instance may hold it
/// when the connection comes back; docs/architecture.md, "Why lanes, the
/// handover barrier and fencing tokens").
pub(super) fn nats_reachable(ctx: &Runtime) -> bool {
    ctx.broker.client.connection_state() == async_nats::connection::State::Connected
}

/// Delivers `first`, then whatever may go next, one at a time, for as long
/// as something may: each message is settled in its lane before the next
/// is taken.
pub(super) async fn run_worker(shared: LaneShared, first: Dispatched<Held>) {
    let mut next = Some(first);
    while let Some(Dispatched { lane, seq, message: held }) = next {
        let outcome = deliver_one(&shared, &lane, seq, &held).await;
        announce(&shared, outcome.events, outcome.gone);
        let mut state = shared.lock();
        settle_and_report(&shared, &mut state, &lane, seq, outcome.settled);
        next = if shared.may_take_more() { state.lanes.dispatch_one() } else { None };
    }
}

/// Emits a delivery's events; an endpoint gone (410) wakes the driver to
/// stop serving it.
fn announce(shared: &LaneShared, events: Vec<Event>, gone: bool) {
    for e in events {
        shared.ctx.events.emit(e);
    }
    if gone {
        shared.gone.store(true, Ordering::Relaxed);
        shared.wake.notify_one();
    }
}

/// Records a message's settlement in its lane and reports the lane
/// blocked (its head NAK'd) or unblocked (its head passed).
fn settle_and_report(shared: &LaneShared, state: &mut LaneState, lane: &LaneId, seq: u64, settled: Settled) {
    let naked = matches!(settled, Settled::Naked { .. });
    let was_blocked = state.lanes.blocked_lane(lane).is_some();
    if let Some(held) = state.lanes.settle(lane, seq, settled) {
        tokio::spawn(async move {
            let _ = held.message.ack_with(AckKind::Nak(None)).await;
        });
    }
    let blocked = state.lanes.blocked_lane(lane).cloned();
    let about = shared.ctx.about(&shared.who);
    if naked && !state.blocked_reported.contains(lane) {
        state.blocked_reported.insert(lane);
        if let Some(b) = blocked {
            shared.ctx.events.emit(blocked_event(about, lane, &b));
        }
    } else if was_blocked && blocked.is_none() {
        state.blocked_reported.remove(lane);
        shared.ctx.events.emit(unblocked_event(about, lane, seq, None));
    }
}

/// Delivers `first` as one batched request, then further batches for as
/// long as something may go. A batch short of `max_messages` first waits
/// up to `max_wait_ms` for more. Each batch is settled in its lanes before
/// the next is taken.
pub(super) async fn run_batch_worker(
    shared: LaneShared,
    batching: Arc<Batching>,
    _counted: BatchWorker,
    first: Vec<Dispatched<Held>>,
) {
    let mut next = first;
    while !next.is_empty() {
        fill(&shared, &batching, &mut next).await;
        let batch: Vec<(LaneId, Held)> = next.iter().map(|d| (d.lane.clone(), d.message.clone())).collect();
        let fencing = shared.fencing.load(Ordering::Relaxed);
        let delivery = deliver_batch(
            shared.ctx.clone(),
            shared.who.clone(),
            shared.endpoint.clone(),
            &batch,
            fencing,
            &shared.metrics,
        );
        // A panic must not leave the lanes marked in flight for ever.
        let outcome = match std::panic::AssertUnwindSafe(delivery).catch_unwind().await {
            Ok(outcome) => outcome,
            Err(_) => {
                tracing::error!(messages = batch.len(), "batch delivery panicked; its messages will be retried");
                let error = "keygate failed while delivering".to_owned();
                let mut settled = Vec::new();
                for (_, held) in &batch {
                    let _ = held.message.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
                    settled.push(Settled::Naked { attempts: held.attempt, error: error.clone() });
                }
                BatchOutcome { settled, events: Vec::new(), gone: false }
            }
        };
        let mut outcome = outcome;
        skip_failed_heads(&shared, &batch, &mut outcome).await;
        announce(&shared, std::mem::take(&mut outcome.events), outcome.gone);
        let mut state = shared.lock();
        for (dispatched, settled) in next.iter().zip(outcome.settled) {
            settle_and_report(&shared, &mut state, &dispatched.lane, dispatched.seq, settled);
        }
        next = if shared.may_take_more() {
            let next = batching.take(&mut state.lanes, 0, 0);
            batching.begin(&next);
            next
        } else {
            Vec::new()
        };
    }
}

/// Dead-letters the messages of a batch that failed while an operator asked
/// to skip them (their lane's head), as [`deliver_one`] does for one.
async fn skip_failed_heads(shared: &LaneShared, batch: &[(LaneId, Held)], outcome: &mut BatchOutcome) {
    for ((lane, held), settled) in batch.iter().zip(outcome.settled.iter_mut()) {
        if !matches!(settled, Settled::Naked { .. }) || !shared.lock().skip_requested.remove(lane) {
            continue;
        }
        match Box::pin(dead_letter_and_term(&shared.ctx, &shared.who, held, "skipped by an operator")).await {
            Ok(mut events) => {
                outcome.events.append(&mut events);
                *settled = Settled::Done(Settlement::Terminated);
            }
            Err(e) => tracing::warn!(error = %e, partition = lane.partition, "could not dead-letter a skipped message"),
        }
    }
}

/// Tops `batch` up with messages arriving within `max_wait_ms`, until it
/// is full. While it fills (counted by [`Batching::begin`]), the driver
/// starts no other batch.
async fn fill(shared: &LaneShared, batching: &Batching, batch: &mut Vec<Dispatched<Held>>) {
    if !batching.waits_to_fill(batch) {
        return;
    }
    let full = |batch: &Vec<Dispatched<Held>>| batch.len() >= batching.limits.max_messages;
    let deadline = tokio::time::Instant::now() + batching.limits.max_wait;
    loop {
        let arrived = batching.arrived.notified();
        let timed_out = tokio::select! {
            _ = arrived => false,
            _ = tokio::time::sleep_until(deadline) => true,
        };
        let filled: usize = batch.iter().map(|d| d.message.message.payload.len()).sum();
        let more = batching.take(&mut shared.lock().lanes, batch.len(), filled);
        batch.extend(more);
        if timed_out || full(batch) || !shared.serving.load(Ordering::Relaxed) {
            break;
        }
    }
    batching.filling.fetch_sub(1, Ordering::AcqRel);
}

/// One delivery and its verdict; a head an operator asked to skip while it
/// was out is dead-lettered when that attempt fails.
async fn deliver_one(shared: &LaneShared, lane: &LaneId, seq: u64, held: &Held) -> Outcome {
    let fencing = shared.fencing.load(Ordering::Relaxed);
    let delivery = deliver(
        shared.ctx.clone(),
        shared.who.clone(),
        shared.endpoint.clone(),
        held.clone(),
        fencing,
        &shared.metrics,
    );
    // A panic must not leave the lane marked in flight for ever.
    let mut outcome = match std::panic::AssertUnwindSafe(delivery).catch_unwind().await {
        Ok(outcome) => outcome,
        Err(_) => {
            tracing::error!(partition = lane.partition, seq, "delivery panicked; the message will be retried");
            let _ = held.message.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            Outcome {
                settled: Settled::Naked { attempts: held.attempt, error: "keygate failed while delivering".into() },
                events: Vec::new(),
                gone: false,
            }
        }
    };
    let skip = matches!(outcome.settled, Settled::Naked { .. }) && shared.lock().skip_requested.remove(lane);
    if skip {
        match Box::pin(dead_letter_and_term(&shared.ctx, &shared.who, held, "skipped by an operator")).await {
            Ok(mut events) => {
                outcome.events.append(&mut events);
                outcome.settled = Settled::Done(Settlement::Terminated);
            }
            Err(e) => {
                tracing::warn!(error = %e, partition = lane.partition, seq, "could not dead-letter a skipped message")
            }
        }
    }
    outcome
}
