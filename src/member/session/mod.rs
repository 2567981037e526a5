//! One session of a member instance against its joined consumer: it owns
//! the pulls and the pin, offers what arrives to the partition lanes, and
//! ends on shutdown, a rebalance or a lost consumer. Its parts:
//! - `intake.rs`: pulls and what their replies bring;
//! - `pinning.rs`: gaining and losing the pin, the handover barrier, fencing;
//! - `lane.rs`: the lane workers that deliver;
//! - `control.rs`: operators' control requests;
//! - `keys.rs`: finding the key in a subject.

mod control;
mod intake;
mod keys;
mod lane;
mod pinning;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::{Entry, Operation};
use async_nats::jetstream::AckKind;
use futures::StreamExt;
use tokio::sync::broadcast::{error::RecvError, Receiver};
use tokio::task::JoinSet;
use tokio_stream::wrappers::{errors::BroadcastStreamRecvError, BroadcastStream};
use tokio_util::sync::CancellationToken;

use self::keys::KeyLocator;
use self::lane::{run_worker, unblocked_event, BlockedLanes, LaneShared, LaneState};
use super::balance::ROOM_RECHECK;
use super::context::InstanceContext;
use super::lanes::{LaneId, Lanes};
use super::pin::PinState;
use super::pull::{DeliveryGaps, OpenPulls};
use crate::delivery::endpoint::Endpoint;
use crate::delivery::message::Held;
use crate::delivery::webhook::DEFAULT_KEY_IN_FLIGHT;
use crate::events::Event;
use crate::groups::config::{config_key, PRIORITY_GROUP};
use crate::groups::spec::filter_subjects_of;
use crate::groups::{GroupConfig, GroupSettings, Ordering as GroupOrdering};
use crate::member_ref::MemberRef;
use crate::pauses::PauseUpdate;

/// How soon a seeking instance first asks who holds the pin, and how often
/// a pinned one retries raising its fencing token.
pub(super) const PIN_CHECK: Duration = Duration::from_millis(250);
/// How often a newly pinned instance checks whether the handover barrier
/// can come down (nothing is delivered until it does).
pub(super) const BARRIER_CHECK: Duration = Duration::from_millis(20);
/// A deadline far enough away to mean "not before something else happens".
const NOT_SOON: Duration = Duration::from_secs(3600);

/// Why a session ended.
pub enum SessionEnd {
    Shutdown,
    /// The member's filters changed (elastic rebalance) or the group changed.
    Rejoin {
        pinned: bool,
    },
    /// The consumer was deleted under us.
    ConsumerGone,
    /// The endpoint answered 410: stop serving it.
    Gone,
    /// An operator paused the member: stop pulling, finish, release the pin.
    Paused,
}

/// The consumer a session pulls from, as joined.
pub struct Joined {
    pub config: Arc<GroupConfig>,
    pub revision: u64,
    /// The stream holding the consumer (an elastic group's work queue).
    pub stream_name: String,
    pub consumer: String,
    pub ack_wait: Duration,
    /// keygate's settings of the group, as read when joining.
    pub settings: GroupSettings,
}

pub struct Session {
    shared: LaneShared,
    joined: Joined,
    keys: KeyLocator,
    pin: PinState,
    last_message: Instant,
    /// When the server last answered anything (messages, timeouts).
    last_reply: Instant,
    pulls: OpenPulls,
    lane_tasks: JoinSet<()>,
    /// Tells this session apart from other instances of the member in this process.
    session_id: u64,
    /// The consumer's delivery sequence as this session saw it.
    gaps: DeliveryGaps,
    /// A webhook instance of a group member: counted and moved by pin
    /// balancing (member/balance.rs).
    balanced: bool,
    /// No pulls before then (after stepping down for a rebalance).
    hold_pulls_until: Option<Instant>,
    /// Why the pin was last stepped down elsewhere, and when: the reason of
    /// the next pin this instance gains.
    handoff: Option<(String, Instant)>,
    /// While seeking: how long until it next asks who holds the pin, and when.
    seek_every: Duration,
    next_seek: Instant,
    /// When `check_pin` last ran.
    pin_checked: Instant,
}

impl Session {
    /// `None` when the stream cannot be read now (see [`KeyLocator::for_group`]).
    pub async fn new(
        ctx: Arc<InstanceContext>,
        who: MemberRef,
        endpoint: Arc<Endpoint>,
        joined: Joined,
    ) -> Option<Self> {
        let keys = KeyLocator::for_group(&ctx, &joined.config, who.stream.as_str()).await?;
        let pulls = OpenPulls::new(ctx.nats.new_inbox());
        let session_id = rand::random::<u64>() >> 16;
        let blocked_reported = BlockedLanes::new(&who, ctx.roster.clone(), session_id);
        let balanced = matches!(&*endpoint, Endpoint::Webhook(_)) && who.owner == crate::member_ref::Owner::Group;
        let max_in_flight = match joined.settings.ordering() {
            GroupOrdering::Partition => endpoint.max_in_flight().unwrap_or(usize::MAX),
            GroupOrdering::Key => endpoint.max_in_flight().unwrap_or(DEFAULT_KEY_IN_FLIGHT),
        };
        let shared = LaneShared {
            ctx,
            who,
            endpoint,
            state: Arc::new(Mutex::new(LaneState {
                lanes: Lanes::new(max_in_flight),
                blocked_reported,
                skip_requested: BTreeSet::new(),
            })),
            pinned: Arc::default(),
            fencing: Arc::default(),
            gone: Arc::default(),
            wake: Arc::default(),
        };
        Some(Self {
            shared,
            joined,
            keys,
            pin: PinState::default(),
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
        })
    }

    pub fn config(&self) -> &Arc<GroupConfig> {
        &self.joined.config
    }

    fn ctx(&self) -> &Arc<InstanceContext> {
        &self.shared.ctx
    }

    fn who(&self) -> &MemberRef {
        &self.shared.who
    }

    /// Serves until shutdown, a rebalance, or the consumer is gone;
    /// `updates` brings the group's configuration changes, `settings` the
    /// changes of keygate's own settings of groups.
    pub async fn run(
        mut self,
        cancel: &CancellationToken,
        updates: Receiver<Arc<Entry>>,
        settings: Receiver<Arc<Entry>>,
        pauses: Receiver<Arc<Entry>>,
    ) -> SessionEnd {
        let pause_key = crate::pauses::pause_key(self.who());
        // A breaker's probe: this instance's own claim does not pause it, and
        // the member's resume (the probe succeeded) rejoins at full width.
        let probing = self.shared.endpoint.protection().is_some_and(|p| p.probing());
        let instance_id = self.ctx().instance_id.clone();
        let Ok(mut replies) = self.ctx().nats.subscribe(self.pulls.reply_filter()).await else {
            return SessionEnd::ConsumerGone;
        };
        let control_subject = super::control::control_subject(self.who());
        let Ok(control) = self.ctx().subscriptions.subscribe(&control_subject).await else {
            return SessionEnd::ConsumerGone;
        };
        // The loop's waits live across its turns: a turn that is a pull's
        // renewal does not sign up again with every channel and timer (a
        // visible share of an idle replica's CPU, with a thousand instances).
        let (mut control, mut updates, mut settings, mut pauses) = (
            BroadcastStream::new(control),
            BroadcastStream::new(updates),
            BroadcastStream::new(settings),
            BroadcastStream::new(pauses),
        );
        let mut cancelled = std::pin::pin!(cancel.cancelled());
        let mut timer = std::pin::pin!(tokio::time::sleep(NOT_SOON));
        // An idle instance sleeps until its next pull ends: no timer ticks
        // for work that is not there (a thousand idle members stay cheap).
        let progress_every = (self.joined.ack_wait / 3).max(Duration::from_millis(100));
        let mut progress_at: Option<Instant> = None;
        let wake = self.shared.wake.clone();
        let mut woken = std::pin::pin!(wake.notified());
        let mut room = self.balanced.then(|| self.ctx().pins.room(self.who()));
        let mut connections = self.ctx().connections.clone();
        connections.mark_unchanged();
        self.report_pin();
        let end = loop {
            if self.shared.gone.load(Ordering::Relaxed) {
                break SessionEnd::Gone;
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
            let next_timer = progress_at.map_or(pin_check_at, |at| at.min(pin_check_at)).min(pull_deadline);
            if timer.deadline() != next_timer.into() {
                timer.as_mut().reset(next_timer.into());
            }
            tokio::select! {
                () = &mut cancelled => break SessionEnd::Shutdown,
                reply = replies.next() => {
                    let Some(reply) = reply else { break SessionEnd::ConsumerGone };
                    if let Some(end) = Box::pin(self.on_reply(reply)).await {
                        break end;
                    }
                }
                () = &mut woken => woken.set(wake.notified()),
                // The pulls may have been waiting at a server this keygate
                // no longer reaches: ask again at once, not at their deadlines.
                Ok(()) = connections.changed() => self.pulls.clear(),
                () = room_made(&mut room), if held_back => {}
                () = &mut timer => {
                    let now = Instant::now();
                    if progress_at.is_some_and(|at| at <= now) {
                        progress_at = Some(now + progress_every);
                        Box::pin(self.progress()).await;
                    }
                    if pin_check_at <= now {
                        Box::pin(self.check_pin()).await;
                    }
                    if pull_deadline <= now {
                        self.pulls.expire(now);
                    }
                }
                request = control.next() => match received(request) {
                    Ok(request) => Box::pin(self.on_control(request)).await,
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => break SessionEnd::ConsumerGone,
                },
                update = updates.next() => {
                    if let Some(end) = self.on_config_update(received(update)) {
                        break end;
                    }
                }
                update = settings.next() => {
                    if let Some(end) = self.on_settings_update(received(update)) {
                        break end;
                    }
                }
                update = pauses.next() => match crate::pauses::pause_update(&pause_key, received(update)) {
                    PauseUpdate::Paused { probing_by } if probing && probing_by.as_deref() == Some(instance_id.as_str()) => {}
                    // Missed updates: the instance reads the flag before it joins again.
                    PauseUpdate::Paused { .. } | PauseUpdate::Unknown => break SessionEnd::Paused,
                    PauseUpdate::Resumed if probing => break SessionEnd::Rejoin { pinned: self.pin.is_pinned() },
                    PauseUpdate::Resumed | PauseUpdate::Other => {}
                },
            }
        };
        Box::pin(self.wind_down(&end)).await;
        self.ctx().roster.remove(self.who(), self.session_id);
        end
    }

    /// A change of the group's configuration ends the session when it
    /// changes what this member consumes.
    fn on_config_update(&self, update: Result<Arc<Entry>, RecvError>) -> Option<SessionEnd> {
        let key = config_key(self.who().stream.as_str(), self.who().group.as_str());
        let entry = match update {
            Ok(entry) if entry.key == key => entry,
            // Missed updates: read the configuration again.
            Err(RecvError::Lagged(_)) => return Some(SessionEnd::Rejoin { pinned: false }),
            Ok(_) | Err(RecvError::Closed) => return None,
        };
        if entry.operation != Operation::Put {
            return Some(SessionEnd::Rejoin { pinned: false });
        }
        if entry.revision <= self.joined.revision {
            return None;
        }
        let member = self.who().member.as_str();
        let config = &self.joined.config;
        let changed = match crate::groups::store::parse_stored(config.kind(), &entry.value) {
            Ok(next) => {
                next.partitions() != config.partitions()
                    || filter_subjects_of(&next, member) != filter_subjects_of(config, member)
            }
            Err(_) => true,
        };
        changed.then_some(SessionEnd::Rejoin { pinned: self.pin.is_pinned() })
    }

    /// A change of keygate's settings of this group (its ordering, its ack
    /// wait) ends the session, which joins again with them.
    fn on_settings_update(&self, update: Result<Arc<Entry>, RecvError>) -> Option<SessionEnd> {
        let key = config_key(self.who().stream.as_str(), self.who().group.as_str());
        let entry = match update {
            Ok(entry) if entry.key == key => entry,
            Err(RecvError::Lagged(_)) => return Some(SessionEnd::Rejoin { pinned: self.pin.is_pinned() }),
            Ok(_) | Err(RecvError::Closed) => return None,
        };
        let next: GroupSettings = match entry.operation {
            Operation::Put => serde_json::from_slice(&entry.value).unwrap_or_default(),
            Operation::Delete | Operation::Purge => GroupSettings::default(),
        };
        let current = &self.joined.settings;
        let changed = next.ordering() != current.ordering() || next.ack_wait_ms != current.ack_wait_ms;
        changed.then_some(SessionEnd::Rejoin { pinned: self.pin.is_pinned() })
    }

    /// Starts a lane worker for every message that may go now (each worker
    /// then takes the next one itself).
    fn dispatch(&mut self) {
        if !self.pin.is_pinned() {
            return;
        }
        let ready = self.shared.lock().lanes.dispatch();
        for first in ready {
            self.lane_tasks.spawn(run_worker(self.shared.clone(), first));
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
    /// the stream's limits or a purge).
    async fn progress(&mut self) {
        let (messages, awaited): (Vec<Held>, Vec<(LaneId, u64)>) = {
            let state = self.shared.lock();
            let held = state.lanes.held_messages().chain(state.lanes.in_flight_messages()).cloned().collect();
            (held, state.lanes.awaited_heads())
        };
        for held in messages {
            let _ = held.message.ack_with(AckKind::Progress).await;
        }
        if awaited.is_empty() || !self.pin.is_pinned() {
            return;
        }
        let Ok(handle) = self.ctx().js.get_stream_no_info(&self.joined.stream_name).await else { return };
        for (lane, seq) in awaited {
            // Only the stream leader's definite answer (error code 10037, "no
            // message found") says it is gone; a timeout, no responders or
            // an election says nothing, and the lane keeps waiting.
            let gone = matches!(handle.get_raw_message(seq).await,
                Err(e) if e.kind() == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound);
            if !gone {
                continue;
            }
            {
                let mut state = self.shared.lock();
                state.lanes.skip(&lane, seq, None);
                state.blocked_reported.remove(&lane);
            }
            let why = "the awaited message is no longer in the stream (limits or purge)";
            self.ctx().events.emit(unblocked_event(self.ctx().about(self.who()), &lane, seq, Some(why)));
        }
    }

    /// Stop pulling and dispatching; let deliveries in flight finish within
    /// the grace, then cut them off and NAK them; step down so a standby
    /// takes over at once.
    async fn wind_down(&mut self, end: &SessionEnd) {
        {
            let _state = self.shared.lock();
            self.shared.pinned.store(false, Ordering::Relaxed);
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
            self.ctx().pins.set_pinned(self.who(), false);
        }
        if self.pin.is_pinned() {
            // Released at once when nobody else may take it now (a pause)
            // or this instance is leaving; a rebalance lets it lapse.
            if matches!(end, SessionEnd::Shutdown | SessionEnd::Gone | SessionEnd::Paused) {
                if let Ok(handle) = self.ctx().js.get_stream_no_info(&self.joined.stream_name).await {
                    let _ = handle.unpin_consumer(&self.joined.consumer, PRIORITY_GROUP).await;
                }
            }
            let why = match end {
                SessionEnd::Shutdown => "shutting down",
                SessionEnd::Rejoin { .. } => "rebalancing",
                SessionEnd::ConsumerGone => "consumer gone",
                SessionEnd::Gone => "endpoint gone",
                SessionEnd::Paused => "paused",
            };
            self.ctx().events.emit(Event::member_unpinned(self.ctx().about(self.who()), why));
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ctx().nats.flush()).await;
    }
}

/// A broadcast stream's item as the channel's own `recv` tells it.
fn received<T>(item: Option<Result<T, BroadcastStreamRecvError>>) -> Result<T, RecvError> {
    match item {
        Some(Ok(value)) => Ok(value),
        Some(Err(BroadcastStreamRecvError::Lagged(missed))) => Err(RecvError::Lagged(missed)),
        None => Err(RecvError::Closed),
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
