//! A session's pin: the handover barrier when it is gained, the fencing
//! token, stepping down when it is lost or the server goes quiet, and
//! noticing that another instance holds it (docs/architecture.md, "Why
//! lanes, the handover barrier and fencing tokens").

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Driver;
use crate::cluster::balance::STEP_DOWN_HOLD;
use crate::delivery::message::Held;
use crate::runtime::barrier::{decide, Answer, Decision, Holding};
use crate::runtime::fencing::next_token;
use crate::runtime::pin::{
    announce_pinned, announce_standby, announce_unpinned, count_pin_change, pinned_here, pinned_to_someone,
};

/// The longest a seeking instance waits between asking who holds the pin.
/// The answer only tells clients it stands by (the pin itself comes through
/// the pulls), and an idle member nobody pins keeps every instance seeking:
/// a thousand of them asking every few seconds would be most of an idle
/// replica's work.
const MAX_SEEK_EVERY: Duration = Duration::from_secs(30);

impl Driver {
    /// A member's partitions (a subscriber owns none).
    fn owned_partitions(&self) -> Vec<u32> {
        self.config().map(|config| config.partitions_of(self.who().member.as_str())).unwrap_or_default()
    }

    pub(super) async fn gain_pin(&mut self, pin: String) {
        if self.pin.is_pinned() {
            // Pinned again under a new id without hearing the old pin end (a
            // restarted server forgets pins): another instance may have held
            // it meanwhile and settled what this one still holds or awaits.
            // What is held goes back (the server redelivers, here, only what
            // is still pending) and NAK'd heads are no longer awaited; the
            // barrier below waits for whatever of them is still pending.
            let released = self.shared.lock().lanes.release_held();
            hand_back(released);
        }
        self.pin.on_message_pin(&pin);
        self.last_reply = Instant::now();
        // Handover barrier: nothing goes out until every ack-pending message
        // of the consumer is ours (and the fencing token is raised). A
        // subscriber keeps no order, so it has none to protect.
        {
            let mut state = self.shared.lock();
            // A step-down left the barrier up; a subscriber never waits behind it.
            state.lanes.set_barrier(self.target.is_member());
            self.shared.serving.store(true, Ordering::Relaxed);
        }
        self.raise_fencing_token().await;
        if self.pin.token_pending() && !self.target.is_member() {
            // Without a raised token a subscriber still delivers: it counts
            // on from the last token it knew.
            let token = self.shared.fencing.load(Ordering::Relaxed) + 1;
            self.shared.fencing.store(token, Ordering::Relaxed);
            self.pin.set_token(token);
        }
        self.report_pin();
        count_pin_change(self.who(), "gained");
        if self.balanced {
            self.ctx().cluster.pins.set_pinned(self.who(), true);
        }
        let partitions = self.owned_partitions();
        let reason = self.handoff.take().filter(|(_, at)| at.elapsed() < STEP_DOWN_HOLD).map(|(why, _)| why);
        announce_pinned(self.ctx(), self.who(), &self.shared.endpoint, pin, self.pin.token(), partitions, reason);
    }

    /// Gives the pin up for a rebalance: unpinned at the server first (this
    /// instance's open pulls carry the old pin id, so none of them gets it
    /// back), then what it held goes back to the server for the next
    /// holder, and it pulls nothing for `hold`.
    pub(super) async fn step_down(&mut self, hold: Duration, why: &str) {
        let Ok(handle) = self.ctx().broker.js.get_stream_no_info(&self.joined.stream_name).await else { return };
        self.hold_pulls_until = Some(Instant::now() + hold);
        let group = self.joined.priority_group.as_deref().unwrap_or_default();
        // Nothing more goes out while the server is asked: once it unpins,
        // the next holder may be pinned before the answer comes back here,
        // and this instance must not be delivering then.
        let barrier_was = {
            let mut state = self.shared.lock();
            let was = state.lanes.barrier();
            state.lanes.set_barrier(true);
            was
        };
        if let Err(e) = handle.unpin_consumer(&self.joined.consumer, group).await {
            tracing::debug!(error = %e, "stepping down for a rebalance failed");
            self.hold_pulls_until = None;
            self.shared.lock().lanes.set_barrier(barrier_was);
            return;
        }
        self.lose_pin(why);
    }

    /// After a reconnect the pin may be gone: a restarted server forgets
    /// it, and another instance may hold it by now. A member holds its
    /// lanes behind the handover barrier until the server names its pin
    /// again (`check_pin`); a pull refused for the old pin loses it.
    pub(super) fn on_reconnect(&mut self) {
        if self.pin.is_pinned() && self.target.is_member() {
            self.shared.lock().lanes.set_barrier(true);
        }
    }

    /// Whether this instance should leave the next pin to others: it
    /// stepped down a moment ago, or it stands by on a replica that already
    /// holds its share of the group's pins. Stopping at the share, not above
    /// it, is what sends a stepped-down pin to the replica that lacks pins
    /// rather than to one that would step it down again (the balance model,
    /// benches/balance_model.rs, measures both). The share counts only
    /// replicas heard from recently (`Replicas::count`), so a dead replica's
    /// pins find takers before they lapse.
    pub(super) fn holding_back(&self) -> bool {
        if self.hold_pulls_until.is_some_and(|until| Instant::now() < until) {
            return true;
        }
        let ctx = self.ctx();
        self.balanced
            && !self.pin.is_pinned()
            && ctx.cluster.pins.has_share(self.who(), ctx.cluster.replicas.count(), ctx.cluster.balance_slack)
    }

    /// Tells the roster (and through it the group view) the pin this
    /// instance holds now and its token.
    pub(super) fn report_pin(&self) {
        let roster = &self.ctx().cluster.roster;
        roster.set_pin(self.who(), self.session_id, self.pin.id(), self.pin.token());
        roster.set_outputs(self.who(), self.session_id, self.shared.endpoint.declared_outputs());
    }

    /// Raises the member's fencing token in KV; while it cannot, the pin
    /// stays with its token pending and nothing is delivered (a guessed
    /// token could be lower than the previous holder's).
    async fn raise_fencing_token(&mut self) {
        match next_token(&self.ctx().broker.buckets, &self.target.fencing_key()).await {
            Ok(token) => {
                self.shared.fencing.store(token, Ordering::Relaxed);
                self.pin.set_token(token);
                self.report_pin();
            }
            Err(e) => tracing::warn!(consumer = %self.joined.consumer, error = %e,
                "raising the fencing token failed; holding deliveries"),
        }
    }

    pub(super) fn lose_pin(&mut self, why: &str) {
        if let Some(id) = self.pin.id() {
            self.lost_pin = Some(id.to_owned());
        }
        self.pin.lose();
        self.seek_every = super::PIN_CHECK;
        self.next_seek = Instant::now();
        // Held and NAK'd messages now belong to the next holder; deliveries
        // in flight finish (and stay kept alive) so its barrier waits for
        // them. What was held goes back at once rather than at its ack wait.
        let released = {
            let mut state = self.shared.lock();
            self.shared.serving.store(false, Ordering::Relaxed);
            state.blocked_reported.clear();
            state.lanes.let_go()
        };
        hand_back(released);
        count_pin_change(self.who(), "lost");
        self.report_pin();
        if self.balanced {
            self.ctx().cluster.pins.set_pinned(self.who(), false);
        }
        announce_unpinned(self.ctx(), self.who(), &self.shared.endpoint, why, self.owned_partitions());
    }

    /// How long a pinned instance may hear nothing from the server before it
    /// steps down: less than the pin's TTL (the server re-pins then), more
    /// than a pull's expiry (every pull ends with an answer).
    fn allowed_silence(&self) -> Duration {
        (self.joined.pin_ttl.saturating_sub(Duration::from_millis(250)))
            .max(self.pull_expiry(true) + Duration::from_millis(250))
    }

    /// When `check_pin` next has something to do: soon while the handover
    /// barrier is up or the fencing token is pending, at the end of the
    /// allowed silence while pinned, at the next seek while seeking; never
    /// while standing by (the pin comes through the pulls).
    pub(super) fn next_pin_check(&self, barrier_up: bool) -> Option<Instant> {
        // A consumer that pins nobody has no pin to check.
        if !self.joined.pinned {
            return None;
        }
        if barrier_up {
            return Some(self.pin_checked + super::BARRIER_CHECK);
        }
        if self.pin.token_pending() {
            return Some(self.pin_checked + super::PIN_CHECK);
        }
        if self.pin.is_pinned() {
            return Some(self.last_reply + self.allowed_silence() + Duration::from_millis(1));
        }
        (!self.pin.is_standby()).then_some(self.next_seek)
    }

    /// Steps down when the server has gone quiet, raises a pending token,
    /// lowers the handover barrier once the consumer's ack-pending messages
    /// are all this instance's, and notices a pin held elsewhere.
    pub(super) async fn check_pin(&mut self) {
        self.pin_checked = Instant::now();
        if self.pin.is_pinned() {
            // Cut off from the server, this instance cannot see the pin move:
            // it stops on its own before the server re-pins another.
            if self.last_reply.elapsed() > self.allowed_silence() {
                self.pulls.clear();
                self.lose_pin("no word from the server within the pin's TTL");
                return;
            }
        }
        if self.pin.token_pending() {
            self.raise_fencing_token().await;
            if self.pin.token_pending() {
                return;
            }
            tracing::info!(consumer = %self.joined.consumer, token = ?self.pin.token(),
                "fencing token raised after holding deliveries");
        }
        let (barrier, holding) = {
            let lanes = &self.shared.lock().lanes;
            let holding = Holding {
                ours: lanes.holding() + lanes.awaiting(),
                parked: lanes.held_count() + lanes.awaiting(),
                in_flight: lanes.in_flight(),
                highest: lanes.highest(),
                departures: lanes.departures(),
            };
            (lanes.barrier(), holding)
        };
        let barrier = self.pin.is_pinned() && barrier;
        // A standby only waits: the pin comes to it through its pulls.
        if (!barrier && self.pin.is_pinned()) || self.pin.is_standby() {
            return;
        }
        // Seeking, it asks who holds the pin less and less often while
        // nobody does (an idle member's instances would otherwise ask four
        // times a second each).
        if !barrier {
            if Instant::now() < self.next_seek {
                return;
            }
            self.seek_every = (self.seek_every * 2).min(MAX_SEEK_EVERY);
            self.next_seek = Instant::now() + self.seek_every;
        }
        // `holding` was counted before asking, so messages arriving
        // meanwhile can only make the server's count higher (the safe
        // side); what left meanwhile is checked after (`barrier::decide`).
        let Ok(handle) = self.ctx().broker.js.get_stream_no_info(&self.joined.stream_name).await else { return };
        let Ok(info) = handle.consumer_info(&self.joined.consumer).await else { return };
        if barrier {
            if pinned_to_someone(&info) && !pinned_here(&info, self.pin.id()) {
                // The server pins another client: this instance lost the pin
                // without hearing it (a message under its old pin id came
                // after it stepped down, or the pin moved while it was
                // starved). What it holds goes to the holder now; kept
                // here, and kept alive, it would hold up that holder's barrier.
                self.lose_pin("the server pins another client");
                return;
            }
            let answer = Answer {
                num_ack_pending: info.num_ack_pending,
                delivered: info.delivered.stream_sequence,
                pinned_here: pinned_here(&info, self.pin.id()),
                departures: self.shared.lock().lanes.departures(),
            };
            let decision = decide(holding, answer);
            tracing::debug!(consumer = %self.joined.consumer, pin = self.pin.id(), ?holding, ?answer, ?decision,
                "handover barrier checked");
            match decision {
                Decision::Lower => self.shared.lock().lanes.set_barrier(false),
                Decision::KeepAndHandBack => hand_back(self.shared.lock().lanes.release_held()),
                Decision::Keep => {}
            }
            return;
        }
        // A pin seen right after a message reached us may be ours, not yet
        // read from the message: only a quiet instance calls itself standby.
        let quiet = self.last_message.elapsed() > Duration::from_secs(1);
        if pinned_to_someone(&info) && quiet && self.pin.stand_by() {
            announce_standby(self.ctx(), self.who(), &self.shared.endpoint, self.owned_partitions());
        }
    }
}

/// Gives messages received but not delivered back to the server (NAK, no
/// delay), which redelivers to the pin holder whatever of them is still
/// pending. Sent beside the loop: there can be a thousand.
fn hand_back(released: Vec<Held>) {
    if released.is_empty() {
        return;
    }
    tokio::spawn(async move {
        for held in released {
            let _ = held.message.ack_with(async_nats::jetstream::AckKind::Nak(None)).await;
        }
    });
}
