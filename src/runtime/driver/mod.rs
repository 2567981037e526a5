//! The driver: one run of an instance against its joined consumer, for
//! group members and plain consumers' subscribers alike. It owns the pulls
//! and the pin, offers what arrives to the lanes, and ends on shutdown, a
//! rebalance, a pause or a lost consumer. What differs between the two
//! targets is the dispatch policy ([`Dispatch`]): lanes by key or
//! partition for members, plain concurrency (and the shuffle window) for
//! subscribers. Its parts:
//! - `intake.rs`: pulls and what their replies bring;
//! - `pinning.rs`: gaining and losing the pin, the handover barrier, fencing;
//! - `worker.rs`: the workers that deliver;
//! - `control.rs`: operators' control requests (members);
//! - `keys.rs`: finding the key in a subject (members);
//! - `plan.rs`: pull sizes and timings (pure);
//! - `watches.rs`: configuration, settings and pause updates that end a run.

mod control;
mod intake;
mod keys;
mod pinning;
mod plan;
mod watches;
mod worker;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::AckKind;
use futures::StreamExt;
use tokio::sync::broadcast::error::RecvError;
use tokio::task::JoinSet;
use tokio_stream::wrappers::BroadcastStream;
use tokio_util::sync::CancellationToken;

use self::keys::KeyLocator;
pub use self::watches::Watches;
use self::watches::{next_of, received};
use self::worker::{run_batch_worker, run_worker, unblocked_event, Batching, BlockedLanes, LaneShared, LaneState};
use super::lanes::{LaneId, Lanes};
use super::pin::PinState;
use super::pull::{DeliveryGaps, OpenPulls};
use super::shuffle_window::ShuffleWindow;
use super::target::Target;
use super::window_share::{WindowShare, RENEW_EVERY};
use super::Runtime;
use crate::cluster::balance::ROOM_RECHECK;
use crate::consumers::Shuffle;
use crate::delivery::custody::CustodyClock;
use crate::delivery::message::{Held, Partitioning};
use crate::events::Event;
use crate::groups::{GroupConfig, GroupSettings, Ordering as GroupOrdering};
use crate::names::MemberRef;
use crate::pauses::PauseUpdate;
use crate::runtime::deliver::DeliveryMetrics;
use crate::runtime::endpoint::Endpoint;
use crate::webhook::{SubscriberOptions, DEFAULT_KEY_IN_FLIGHT};

/// How soon a seeking instance first asks who holds the pin, and how often
/// a pinned one retries raising its fencing token.
pub(super) const PIN_CHECK: Duration = Duration::from_millis(250);
/// How often a newly pinned instance checks whether the handover barrier
/// can come down (nothing is delivered until it does).
pub(super) const BARRIER_CHECK: Duration = Duration::from_millis(20);
/// A deadline far enough away to mean "not before something else happens".
const NOT_SOON: Duration = Duration::from_secs(3600);

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Shutdown,
    /// The member's filters changed (elastic rebalance), the group or its
    /// settings changed, or a breaker's probe succeeded: join again.
    Rejoin {
        pinned: bool,
    },
    /// The consumer was deleted under us, or cannot be pulled from.
    ConsumerGone,
    /// The endpoint answered 410: stop serving it.
    Gone,
    /// An operator paused the member: stop pulling, finish, release the pin.
    Paused,
}

/// The consumer a run pulls from, as joined.
pub struct Joined {
    /// The stream holding the consumer (an elastic group's work queue).
    pub stream_name: String,
    pub consumer: String,
    pub ack_wait: Duration,
    /// The priority group pulls name (a member's is always `PCG`).
    pub priority_group: Option<String>,
    /// Whether the consumer pins one client (every group member's does):
    /// then only the pin holder delivers, and it steps down when the
    /// server goes quiet for about `pin_ttl`.
    pub pinned: bool,
    pub pin_ttl: Duration,
    /// How messages are dispatched, as the target asks.
    pub dispatch: Dispatch,
}

/// The dispatch policy of a run.
pub enum Dispatch {
    /// A group member: one lane per key or per partition.
    Lanes(MemberJoined),
    /// A plain consumer's subscriber: up to `concurrency` at once, no order.
    Concurrent(SubscriberJoined),
}

/// What a member's run knows of its group, as joined.
pub struct MemberJoined {
    pub config: Arc<GroupConfig>,
    pub revision: u64,
    /// keygate's settings of the group, as read when joining.
    pub settings: GroupSettings,
}

/// What a subscriber's run knows of its consumer, as joined.
pub struct SubscriberJoined {
    pub options: SubscriberOptions,
    /// Only a partition-stamped stream's subjects start with a partition token.
    pub partitioning: Partitioning,
    pub shuffle: Option<Shuffle>,
}

impl Joined {
    /// The member's group configuration (`None` for a subscriber).
    pub fn member(&self) -> Option<&MemberJoined> {
        match &self.dispatch {
            Dispatch::Lanes(member) => Some(member),
            Dispatch::Concurrent(_) => None,
        }
    }

    /// The member's ordering, if it is a member.
    fn ordering(&self) -> Option<GroupOrdering> {
        self.member().map(|m| m.settings.ordering())
    }
}

/// A subscriber's shuffle window and its share of it.
struct Shuffling {
    shuffle: Shuffle,
    window: ShuffleWindow,
    share: WindowShare,
    renew_at: Instant,
}

pub struct Driver {
    shared: LaneShared,
    target: Target,
    joined: Joined,
    /// Members only: where the key sits in a subject.
    keys: Option<KeyLocator>,
    shuffling: Option<Shuffling>,
    pin: PinState,
    /// The last pin id this instance lost: messages still arriving under
    /// it go back to the server for the holder, and never pin it again.
    lost_pin: Option<String>,
    last_message: Instant,
    /// When the server last answered anything (messages, timeouts).
    last_reply: Instant,
    pulls: OpenPulls,
    lane_tasks: JoinSet<()>,
    /// Tells this run apart from other instances of the member in this process.
    session_id: u64,
    /// The consumer's delivery sequence as this run saw it.
    gaps: DeliveryGaps,
    /// A webhook instance of a group member: counted and moved by pin
    /// balancing (cluster/balance.rs).
    balanced: bool,
    /// No pulls before then (after stepping down for a rebalance, or a 409).
    hold_pulls_until: Option<Instant>,
    /// Why the pin was last stepped down elsewhere, and when: the reason of
    /// the next pin this instance gains.
    handoff: Option<(String, Instant)>,
    /// While seeking: how long until it next asks who holds the pin, and when.
    seek_every: Duration,
    next_seek: Instant,
    /// When `check_pin` last ran.
    pin_checked: Instant,
    /// When a pull that met no responders last had the consumer looked up.
    consumer_looked_up: Option<Instant>,
    /// Members only: whether what this run holds may still be settled
    /// (delivery/custody.rs). A subscriber keeps no order, so a late ack of
    /// a copy given to another instance costs it nothing.
    custody: Option<Arc<CustodyClock>>,
    /// A round of keep-alives is running.
    keeping_alive: Arc<AtomicBool>,
}

impl Driver {
    /// `None` when the stream cannot be read now (see [`KeyLocator::for_group`]).
    pub async fn new(ctx: Arc<Runtime>, target: Target, endpoint: Arc<Endpoint>, joined: Joined) -> Option<Self> {
        let who = target.who().clone();
        let keys = match &joined.dispatch {
            Dispatch::Lanes(member) => Some(KeyLocator::for_group(&ctx, &member.config, who.stream.as_str()).await?),
            Dispatch::Concurrent(_) => None,
        };
        let pulls = OpenPulls::new(ctx.broker.client.new_inbox());
        let session_id = rand::random::<u64>() >> 16;
        let blocked_reported = BlockedLanes::new(&who, ctx.cluster.roster.clone(), session_id);
        let balanced = matches!(&*endpoint, Endpoint::Webhook(_)) && target.is_member();
        let lanes = match &joined.dispatch {
            Dispatch::Lanes(member) => Lanes::new(match member.settings.ordering() {
                GroupOrdering::Partition => endpoint.max_in_flight().unwrap_or(usize::MAX),
                GroupOrdering::Key => endpoint.max_in_flight().unwrap_or(DEFAULT_KEY_IN_FLIGHT),
            }),
            // A breaker's probe sends one at a time.
            Dispatch::Concurrent(s) => Lanes::unordered(endpoint.max_in_flight().unwrap_or(s.options.concurrency)),
        };
        let shuffling = match &joined.dispatch {
            Dispatch::Concurrent(SubscriberJoined { shuffle: Some(shuffle), .. }) => {
                let (stream, consumer) = (who.stream.as_str(), joined.consumer.as_str());
                let max_delay = Duration::from_millis(shuffle.max_delay_ms);
                let mut share = WindowShare::new(ctx.broker.buckets.clone(), stream, consumer, max_delay);
                share.renew(shuffle.max_window).await;
                let window = ShuffleWindow::new(stream, consumer);
                Some(Shuffling { shuffle: *shuffle, window, share, renew_at: Instant::now() + RENEW_EVERY })
            }
            Dispatch::Concurrent(_) | Dispatch::Lanes(_) => None,
        };
        let custody = matches!(joined.dispatch, Dispatch::Lanes(_)).then(|| {
            let elections = ctx.broker.consumer_leaders.watch(&joined.stream_name, &joined.consumer);
            CustodyClock::new(ctx.broker.client.clone(), ctx.broker.connections.clone(), elections, joined.ack_wait)
        });
        let metrics = Arc::new(DeliveryMetrics::of(&who));
        let batching = endpoint.batch().map(|spec| Arc::new(Batching::new(spec, lanes.max_in_flight())));
        let shared = LaneShared {
            ctx,
            who,
            endpoint,
            state: Arc::new(Mutex::new(LaneState { lanes, blocked_reported, skip_requested: BTreeSet::new() })),
            // A consumer without a pin lets every instance deliver.
            serving: Arc::new((!joined.pinned).into()),
            fencing: Arc::default(),
            gone: Arc::default(),
            wake: Arc::default(),
            metrics,
            batching,
        };
        Some(Self {
            shared,
            target,
            joined,
            keys,
            shuffling,
            pin: PinState::default(),
            lost_pin: None,
            last_message: Instant::now(),
            last_reply: Instant::now(),
            pulls,
            lane_tasks: JoinSet::new(),
            session_id,
            gaps: DeliveryGaps::default(),
            balanced,
            hold_pulls_until: None,
            handoff: None,
            seek_every: PIN_CHECK,
            next_seek: Instant::now(),
            pin_checked: Instant::now(),
            consumer_looked_up: None,
            custody,
            keeping_alive: Arc::default(),
        })
    }

    /// The group configuration a member joined with.
    pub fn config(&self) -> Option<&Arc<GroupConfig>> {
        self.joined.member().map(|m| &m.config)
    }

    fn ctx(&self) -> &Arc<Runtime> {
        &self.shared.ctx
    }

    fn who(&self) -> &MemberRef {
        &self.shared.who
    }

    /// Serves until shutdown, a rebalance, a pause, or the consumer is gone.
    pub async fn run(mut self, cancel: &CancellationToken, watches: Watches) -> Ended {
        let pause_key = crate::pauses::pause_key(self.who());
        // A breaker's probe: this instance's own claim does not pause it, and
        // the member's resume (the probe succeeded) rejoins at full width.
        let probing = self.shared.endpoint.protection().is_some_and(|p| p.probing());
        let instance_id = self.ctx().cluster.instance_id.clone();
        let Ok(mut replies) = self.ctx().broker.client.subscribe(self.pulls.reply_filter()).await else {
            return Ended::ConsumerGone;
        };
        // Operators' control requests go to group members only.
        let control = if self.target.is_member() {
            let subject = crate::cluster::control::control_subject(self.who());
            let Ok(control) = self.ctx().broker.subscriptions.subscribe(&subject).await else {
                return Ended::ConsumerGone;
            };
            Some(control)
        } else {
            None
        };
        // The loop's waits live across its turns: a turn that is a pull's
        // renewal does not sign up again with every channel and timer (a
        // visible share of an idle replica's CPU, with a thousand instances).
        let mut control = control.map(BroadcastStream::new);
        let mut configs = watches.configs.map(BroadcastStream::new);
        let mut settings = watches.settings.map(BroadcastStream::new);
        let mut pauses = BroadcastStream::new(watches.pauses);
        let mut cancelled = std::pin::pin!(cancel.cancelled());
        let mut timer = std::pin::pin!(tokio::time::sleep(NOT_SOON));
        // An idle instance sleeps until its next pull ends: no timer ticks
        // for work that is not there (a thousand idle members stay cheap).
        let progress_every = (self.joined.ack_wait / 3).max(Duration::from_millis(100));
        let mut progress_at: Option<Instant> = None;
        let wake = self.shared.wake.clone();
        let mut woken = std::pin::pin!(wake.notified());
        let mut room = self.balanced.then(|| self.ctx().cluster.pins.room(self.who()));
        let mut connections = self.ctx().broker.connections.clone();
        connections.mark_unchanged();
        self.report_pin();
        let end = loop {
            if self.shared.gone.load(Ordering::Relaxed) {
                break Ended::Gone;
            }
            self.dispatch();
            // Marked seen before the share is looked at: a change after it wakes the select.
            if let Some(room) = &mut room {
                room.borrow_and_update();
            }
            let held_back = Box::pin(self.ensure_pull()).await;
            let now = Instant::now();
            let pull_deadline = match self.pulls.next_deadline() {
                Some(deadline) => deadline,
                // Until the hold after a step-down ends, or the replica may
                // have room for this pin (told, or looked at now and then).
                None if held_back => self.hold_pulls_until.filter(|until| *until > now).unwrap_or(now + ROOM_RECHECK),
                // The last pull could not be sent: try again soon.
                None => now + PIN_CHECK,
            };
            let (barrier_up, busy) = {
                let state = self.shared.lock();
                (self.pin.is_pinned() && state.lanes.barrier(), state.lanes.lane_count() > 0)
            };
            // Held, in-flight and awaited messages are kept alive while there are any.
            progress_at = busy.then(|| progress_at.unwrap_or(now + progress_every));
            let pin_check_at = self.next_pin_check(barrier_up).unwrap_or(now + NOT_SOON);
            let renew_at = self.shuffling.as_ref().map_or(pin_check_at, |s| s.renew_at);
            let next_timer =
                progress_at.map_or(pin_check_at, |at| at.min(pin_check_at)).min(pull_deadline).min(renew_at);
            if timer.deadline() != next_timer.into() {
                timer.as_mut().reset(next_timer.into());
            }
            tokio::select! {
                () = &mut cancelled => break Ended::Shutdown,
                reply = replies.next() => {
                    let Some(reply) = reply else { break Ended::ConsumerGone };
                    if let Some(end) = Box::pin(self.on_reply(reply)).await {
                        break end;
                    }
                }
                () = &mut woken => woken.set(wake.notified()),
                // The pulls may have been waiting at a server this keygate
                // no longer reaches: ask again at once, not at their deadlines.
                Ok(()) = connections.changed() => {
                    self.pulls.clear();
                    self.on_reconnect();
                }
                () = room_made(&mut room), if held_back => {}
                () = &mut timer => {
                    let now = Instant::now();
                    if progress_at.is_some_and(|at| at <= now) {
                        progress_at = Some(now + progress_every);
                        self.progress();
                    }
                    if pin_check_at <= now {
                        Box::pin(self.check_pin()).await;
                    }
                    if pull_deadline <= now {
                        self.pulls.expire(now);
                    }
                    if renew_at <= now {
                        Box::pin(self.renew_share()).await;
                    }
                }
                Some(request) = next_of(&mut control) => match request {
                    Ok(request) => Box::pin(self.on_control(request)).await,
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => break Ended::ConsumerGone,
                },
                Some(update) = next_of(&mut configs) => {
                    if let Some(end) = self.on_config_update(update) {
                        break end;
                    }
                }
                Some(update) = next_of(&mut settings) => {
                    if let Some(end) = self.on_settings_update(update) {
                        break end;
                    }
                }
                update = pauses.next() => match crate::pauses::pause_update(&pause_key, received(update)) {
                    PauseUpdate::Paused { probing_by } if probing && probing_by.as_deref() == Some(instance_id.as_str()) => {}
                    // Missed updates: the instance reads the flag before it joins again.
                    PauseUpdate::Paused { .. } | PauseUpdate::Unknown => break Ended::Paused,
                    PauseUpdate::Resumed if probing => break Ended::Rejoin { pinned: self.pin.is_pinned() },
                    PauseUpdate::Resumed | PauseUpdate::Other => {}
                },
            }
        };
        Box::pin(self.wind_down(&end)).await;
        self.ctx().cluster.roster.remove(self.who(), self.session_id);
        end
    }

    /// Renews a subscriber's share of its consumer's shuffle window.
    async fn renew_share(&mut self) {
        if let Some(s) = &mut self.shuffling {
            s.renew_at = Instant::now() + RENEW_EVERY;
            s.share.renew(s.shuffle.max_window).await;
        }
    }

    /// Whether this instance may deliver: it holds the pin, or the
    /// consumer pins nobody.
    fn may_deliver(&self) -> bool {
        (self.pin.is_pinned() || !self.joined.pinned) && worker::nats_reachable(self.ctx())
    }

    /// Starts a lane worker for every message that may go now (each worker
    /// then takes the next one itself); a batching webhook's workers take
    /// a batch each, and none starts while one waits to fill.
    fn dispatch(&mut self) {
        if !self.may_deliver() {
            return;
        }
        if let Some(batching) = self.shared.batching.clone() {
            batching.arrived.notify_waiters();
            while batching.may_start() {
                let batch = batching.take(&mut self.shared.lock().lanes, 0, 0);
                if batch.is_empty() {
                    break;
                }
                batching.begin(&batch);
                let requests = batching.request_started();
                self.lane_tasks.spawn(run_batch_worker(self.shared.clone(), batching.clone(), requests, batch));
            }
        } else {
            let ready = self.shared.lock().lanes.dispatch();
            for first in ready {
                self.lane_tasks.spawn(run_worker(self.shared.clone(), first));
            }
        }
        // Reap finished lane workers.
        while let Some(done) = self.lane_tasks.try_join_next() {
            if let Err(e) = done {
                if e.is_panic() {
                    tracing::error!(error = %e, "a lane task panicked");
                }
            }
        }
    }

    /// Keeps held and in-flight messages from timing out (ack wait), and
    /// stops waiting for NAK'd heads that will never come back (removed by
    /// the stream's limits or a purge). The round runs beside the loop: a
    /// thousand keep-alives and a lookup per awaited head, awaited here,
    /// held up the pulls that renew the pin (its TTL is the ack wait), so
    /// under load the server moved the pin while this instance delivered.
    /// A round still running when the next is due is not doubled.
    fn progress(&mut self) {
        if let Some(s) = &mut self.shuffling {
            s.window.refresh();
        }
        if self.keeping_alive.swap(true, Ordering::AcqRel) {
            return;
        }
        let (messages, awaited): (Vec<Held>, Vec<(LaneId, u64)>) = {
            let state = self.shared.lock();
            let held = state.lanes.in_flight_messages().chain(state.lanes.held_messages()).cloned().collect();
            (held, state.lanes.awaited_heads())
        };
        let awaited = if self.pin.is_pinned() { awaited } else { Vec::new() };
        let (shared, running) = (self.shared.clone(), self.keeping_alive.clone());
        let stream = self.joined.stream_name.clone();
        tokio::spawn(async move {
            for held in messages {
                let sent = Instant::now();
                if held.message.ack_with(AckKind::Progress).await.is_ok() {
                    if let Some(custody) = &held.custody {
                        custody.kept_alive(sent);
                    }
                }
            }
            forget_vanished_heads(&shared, &stream, awaited).await;
            running.store(false, Ordering::Release);
        });
    }

    /// Stop pulling and dispatching; let deliveries in flight finish within
    /// the grace, then cut them off and NAK them; step down so a standby
    /// takes over at once.
    async fn wind_down(&mut self, end: &Ended) {
        {
            let _state = self.shared.lock();
            self.shared.serving.store(false, Ordering::Relaxed);
        }
        let grace = self.ctx().shutdown_grace;
        let finished =
            tokio::time::timeout(grace, async { while self.lane_tasks.join_next().await.is_some() {} }).await;
        if finished.is_err() {
            self.lane_tasks.abort_all();
            while self.lane_tasks.join_next().await.is_some() {}
            let in_flight: Vec<Held> = self.shared.lock().lanes.in_flight_messages().cloned().collect();
            for held in in_flight {
                let _ = held.message.ack_with(AckKind::Nak(None)).await;
            }
        }
        // Messages received but never dispatched go back now, so the next
        // holder need not wait out ack_wait for them.
        let held = self.shared.lock().lanes.release_held();
        for held in held {
            let _ = held.message.ack_with(AckKind::Nak(None)).await;
        }
        if self.balanced {
            self.ctx().cluster.pins.set_pinned(self.who(), false);
        }
        if self.pin.is_pinned() {
            // Released at once when nobody else may take it now (a pause)
            // or this instance is leaving; a rebalance lets it lapse.
            if matches!(end, Ended::Shutdown | Ended::Gone | Ended::Paused) {
                if let Ok(handle) = self.ctx().broker.js.get_stream_no_info(&self.joined.stream_name).await {
                    let group = self.joined.priority_group.as_deref().unwrap_or_default();
                    let _ = handle.unpin_consumer(&self.joined.consumer, group).await;
                }
            }
            let why = match end {
                Ended::Shutdown => "shutting down",
                Ended::Rejoin { .. } => "rebalancing",
                Ended::ConsumerGone => "consumer gone",
                Ended::Gone => "endpoint gone",
                Ended::Paused => "paused",
            };
            self.ctx().events.emit(Event::member_unpinned(self.ctx().about(self.who()), why));
        }
        if let Some(s) = &self.shuffling {
            s.share.leave().await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ctx().broker.client.flush()).await;
    }
}

/// Stops waiting for NAK'd heads the stream no longer has. Only the stream
/// leader's definite answer (error code 10037, "no message found") says one
/// is gone; a timeout, no responders or an election says nothing, and the
/// lane keeps waiting.
async fn forget_vanished_heads(shared: &LaneShared, stream: &str, awaited: Vec<(LaneId, u64)>) {
    if awaited.is_empty() {
        return;
    }
    let Ok(handle) = shared.ctx.broker.js.get_stream_no_info(stream).await else { return };
    for (lane, seq) in awaited {
        let gone = matches!(handle.get_raw_message(seq).await,
            Err(e) if e.kind() == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound);
        if !gone {
            continue;
        }
        {
            let mut state = shared.lock();
            state.lanes.skip(&lane, seq, None);
            state.blocked_reported.remove(&lane);
        }
        let why = "the awaited message is no longer in the stream (limits or purge)";
        shared.ctx.events.emit(unblocked_event(shared.ctx.about(&shared.who), &lane, seq, Some(why)));
    }
}

/// Resolves when the pin ledger says this replica may have room for
/// another of the group's pins; never once the ledger is gone.
async fn room_made(room: &mut Option<tokio::sync::watch::Receiver<()>>) {
    let Some(receiver) = room else { return std::future::pending().await };
    if receiver.changed().await.is_err() {
        *room = None;
        std::future::pending::<()>().await;
    }
}
