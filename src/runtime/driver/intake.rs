//! A session's pulls and what their replies bring: messages offered to the
//! lanes, pin changes, and the ends of pulls.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::AckKind;

use super::plan::{subscriber_pull_expiry, PullSizing};
use super::{Dispatch, Driver, Ended};
use crate::delivery::message::{Delivered, Partitioning};
use crate::groups::Ordering;
use crate::nats::errors::is_not_found;
use crate::runtime::deliver::{remove, Because};
use crate::runtime::join::{pull_expiry, standby_pull_expiry};
use crate::runtime::lanes::{LaneId, LaneKey, Offered};
use crate::runtime::pull::{classify, grid_expiry, PullRequest, Reply};

/// How long a run waits before pulling again after a 409 or a 503.
const CONFLICT_PAUSE: Duration = Duration::from_millis(250);
/// Pulls that meet no responders have the consumer looked up at most this
/// often, each lookup waiting at most `LOOKUP_LIMIT`: during a leader
/// election every pull meets none, and the loop must go on meanwhile.
const LOOKUP_EVERY: Duration = Duration::from_secs(1);
const LOOKUP_LIMIT: Duration = Duration::from_secs(2);

impl Driver {
    /// Keeps pulls open as the dispatch policy sizes them (`plan.rs`).
    /// Returns whether this instance holds back (it pulls nothing now).
    pub(super) async fn ensure_pull(&mut self) -> bool {
        if self.holding_back() {
            return true;
        }
        let sizing = self.pull_sizing();
        let expiry = grid_expiry(self.pull_expiry(self.pin.is_pinned()), Instant::now());
        // Only a subscriber's sizing looks at what it holds, which sending
        // pulls does not change.
        let holding = match sizing {
            PullSizing::Subscriber { .. } => self.shared.lock().lanes.holding(),
            PullSizing::Member { .. } => 0,
        };
        loop {
            let Some(batch) = sizing.next_batch(self.pulls.len(), self.pulls.asked(), holding) else { return false };
            let request = self.pull_request(batch, expiry);
            let outbox = self.shared.ctx.broker.outbox.clone();
            if !self.pulls.send(&outbox, &self.joined.stream_name, &self.joined.consumer, &request).await {
                return false;
            }
        }
    }

    /// Whether the server says the consumer does not exist. A consumer can
    /// go without its "consumer deleted" reaching any pull of this run: an
    /// elastic member's is deleted after ack wait without pulls, which a
    /// leader election or a lost connection can cause, and the notice is
    /// lost with the connection. Its pulls then meet no responders for
    /// ever; a leader election also brings them, so only the server's
    /// "not found" counts, and no answer in time does not.
    async fn consumer_is_gone(&mut self) -> bool {
        if self.consumer_looked_up.is_some_and(|at| at.elapsed() < LOOKUP_EVERY) {
            return false;
        }
        self.consumer_looked_up = Some(Instant::now());
        let js = &self.ctx().broker.js;
        let lookup = async {
            let stream = js.get_stream_no_info(&self.joined.stream_name).await.ok()?;
            Some(stream.consumer_info(&self.joined.consumer).await)
        };
        matches!(tokio::time::timeout(LOOKUP_LIMIT, lookup).await, Ok(Some(Err(e))) if is_not_found(&e))
    }

    fn pull_sizing(&self) -> PullSizing {
        match &self.joined.dispatch {
            // Hold cap: a partition blocked with many messages behind its
            // head slows intake to one message per pull. Under key ordering
            // a blocked key holds back only its own messages, and what is
            // held stays within the consumer's ack-pending limit.
            Dispatch::Lanes(member) => PullSizing::Member {
                trickle: member.settings.ordering() == Ordering::Partition
                    && self.shared.lock().lanes.deepest() >= self.ctx().hold_cap,
            },
            Dispatch::Concurrent(subscriber) => PullSizing::subscriber(&subscriber.options),
        }
    }

    /// How long a pull waits at the server: a member's follows its ack
    /// wait (a standby's longer), a subscriber's its pin's TTL, if any.
    pub(super) fn pull_expiry(&self, pinned: bool) -> Duration {
        match &self.joined.dispatch {
            Dispatch::Lanes(_) if pinned => pull_expiry(self.joined.ack_wait),
            Dispatch::Lanes(_) => standby_pull_expiry(self.joined.ack_wait),
            Dispatch::Concurrent(_) => subscriber_pull_expiry(self.joined.pinned.then_some(self.joined.pin_ttl)),
        }
    }

    fn pull_request(&self, batch: usize, expiry: Duration) -> PullRequest {
        let mut request = PullRequest::new(batch, expiry, self.pin.id());
        request.group = self.joined.priority_group.clone();
        if let Dispatch::Concurrent(subscriber) = &self.joined.dispatch {
            let options = &subscriber.options;
            (request.priority, request.min_pending, request.min_ack_pending) =
                (options.priority, options.min_pending, options.min_ack_pending);
        }
        request
    }

    pub(super) async fn on_reply(&mut self, reply: async_nats::Message) -> Option<Ended> {
        self.last_reply = Instant::now();
        let subject = reply.subject.to_string();
        match classify(reply.status, reply.description.as_deref(), reply.headers.as_ref()) {
            Reply::Message { pin } => {
                let pin = pin.filter(|_| self.joined.pinned);
                // Sent under a pin this instance lost (it stepped down, or
                // heard the pin move) before the server knew: the holder's.
                let stale = pin.is_some() && pin == self.lost_pin;
                if let Some(pin) = pin.filter(|_| !stale) {
                    if self.pin.id() != Some(pin.as_str()) {
                        self.gain_pin(pin).await;
                    }
                }
                self.pulls.message_arrived();
                self.take(reply, stale);
            }
            Reply::Done => {
                self.pulls.finish(&subject);
            }
            Reply::PinRejected { description } => {
                // Only a rejection of a pull that carried the current pin means
                // the pin is gone; a late one for an older id does not.
                if self.pulls.pin_rejected(&subject, self.pin.id()) {
                    self.lose_pin(&description);
                }
            }
            Reply::ConsumerDeleted => return Some(Ended::ConsumerGone),
            Reply::Conflict { description } => {
                // Too many pulls waiting, a leader change: pull again after a
                // moment, not in a tight loop against the same refusal.
                tracing::debug!(%description, "pull conflict");
                self.pulls.finish(&subject);
                self.hold_pulls_until = Some(Instant::now() + CONFLICT_PAUSE);
            }
            Reply::BadRequest { description } => {
                tracing::warn!(%description, consumer = %self.joined.consumer, "the server refused the pull");
                return Some(Ended::ConsumerGone);
            }
            Reply::NoResponders => {
                self.pulls.finish(&subject);
                self.hold_pulls_until = Some(Instant::now() + CONFLICT_PAUSE);
                if Box::pin(self.consumer_is_gone()).await {
                    tracing::info!(consumer = %self.joined.consumer, "the consumer is gone; joining again");
                    return Some(Ended::ConsumerGone);
                }
            }
            Reply::Ignore => {}
        }
        None
    }

    /// Offers a pulled message to its lane: its key's or its partition's
    /// for a member, its own for a subscriber (after the shuffle window
    /// had its say); one sent under a lost pin (`stale`) goes back.
    fn take(&mut self, reply: async_nats::Message, stale: bool) {
        self.last_message = Instant::now();
        let keys = self.keys.as_ref();
        let partitioning = match &self.joined.dispatch {
            Dispatch::Lanes(_) => Partitioning::Required,
            Dispatch::Concurrent(subscriber) => subscriber.partitioning,
        };
        let pulled = Delivered::from_pull(
            &self.shared.ctx.broker.js,
            reply,
            self.shared.who.stream.as_str(),
            partitioning,
            self.custody.as_ref().map(|c| c.receive()),
            |subject| keys.and_then(|k| k.key(subject)),
        );
        let Some((delivered, consumer_seq)) = pulled else { return };
        let ordering = self.joined.ordering();
        if ordering.is_some() && self.gaps.missed_before(consumer_seq) && self.pin.is_pinned() {
            // Deliveries went where this run never saw them (a pull whose
            // reply was lost with a NATS connection): they come back only at
            // ack wait, and nothing of the member may pass them until then.
            // The handover barrier waits for exactly that.
            self.shared.lock().lanes.set_barrier(true);
            let who = self.who();
            metrics::counter!(crate::telemetry::metrics::DELIVERY_GAPS, "stream" => who.stream.to_string(),
                "group" => who.group.to_string())
            .increment(1);
            tracing::info!(member = %who.member, consumer_seq,
                "deliveries of the consumer went missing; holding until they are redelivered");
        }
        if stale {
            tokio::spawn(async move {
                let _ = delivered.message.ack_with(AckKind::Nak(None)).await;
            });
            return;
        }
        if let Some(s) = &mut self.shuffling {
            let allowed = s.share.current();
            if let Some(delay) = s.window.delay_first_delivery(&s.shuffle, allowed, delivered.attempt) {
                tokio::spawn(async move {
                    let _ = delivered.message.ack_with(AckKind::Nak(Some(delay))).await;
                });
                return;
            }
        }
        let (partition, stream_seq) = (delivered.partition, delivered.stream_seq);
        let lane = match (ordering, &self.keys) {
            (Some(Ordering::Key), Some(keys)) => keys.lane(partition, &delivered.subject, stream_seq),
            (Some(_), _) => LaneId::partition(partition),
            (None, _) => LaneId { partition, key: LaneKey::Alone(stream_seq) },
        };
        let held = Arc::new(delivered);
        let mut state = self.shared.lock();
        match state.lanes.offer(lane.clone(), stream_seq, held.clone()) {
            Offered::AlreadySettled(how) => {
                tokio::spawn(async move {
                    let _ = remove(&held, Because::SettledBefore(how)).await;
                });
            }
            // The server gave this instance again a message it is
            // delivering: the copy out is this instance's still, and the
            // server's ack wait for it starts over (delivery/custody.rs).
            Offered::Duplicate => {
                if let Some(custody) = state.lanes.in_flight_copy(&lane, stream_seq).and_then(|c| c.custody.as_ref()) {
                    custody.redelivered_here(Instant::now());
                }
            }
            Offered::Held => {}
        }
    }
}
