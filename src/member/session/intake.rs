//! A session's pulls and what their replies bring: messages offered to the
//! lanes, pin changes, and the ends of pulls.

use std::sync::Arc;
use std::time::Instant;

use super::{Session, SessionEnd};
use crate::delivery::message::{Delivered, Partitioning};
use crate::groups::Ordering;
use crate::member::deliver::{remove, Because};
use crate::member::join::{pull_expiry, standby_pull_expiry};
use crate::member::lanes::{LaneId, Offered};
use crate::member::pull::{classify, grid_expiry, PullRequest, Reply};

/// Most messages asked for in one pull.
const MAX_PULL_BATCH: usize = 256;
/// Pulls kept open at once, so the server always has one to deliver on.
const MAX_OPEN_PULLS: usize = 3;

impl Session {
    /// Keeps pulls open: a new one goes out while less than a batch is
    /// still asked for, so the server never waits for the next pull.
    /// Returns whether this instance holds back (it pulls nothing now).
    pub(super) async fn ensure_pull(&mut self) -> bool {
        if self.holding_back() {
            return true;
        }
        // Hold cap: a partition blocked with many messages behind its head
        // slows intake to one message per pull, which still keeps the pin.
        // Under key ordering a blocked key holds back only its own messages,
        // and what is held stays within the consumer's ack-pending limit.
        let by_key = self.joined.settings.ordering() == Ordering::Key;
        let deepest = self.shared.lock().lanes.deepest();
        let trickle = !by_key && deepest >= self.ctx().hold_cap;
        loop {
            let enough = if trickle { !self.pulls.is_empty() } else { self.pulls.asked() >= MAX_PULL_BATCH };
            if enough || self.pulls.len() >= MAX_OPEN_PULLS {
                return false;
            }
            let room = if trickle { 1 } else { MAX_PULL_BATCH };
            let expiry = if self.pin.is_pinned() { pull_expiry } else { standby_pull_expiry };
            let expiry = grid_expiry(expiry(self.joined.ack_wait), Instant::now());
            let request = PullRequest::new(room, expiry, self.pin.id());
            let outbox = self.shared.ctx.outbox.clone();
            if !self.pulls.send(&outbox, &self.joined.stream_name, &self.joined.consumer, &request).await {
                return false;
            }
        }
    }

    pub(super) async fn on_reply(&mut self, reply: async_nats::Message) -> Option<SessionEnd> {
        self.last_reply = Instant::now();
        let subject = reply.subject.to_string();
        match classify(reply.status, reply.description.as_deref(), reply.headers.as_ref()) {
            Reply::Message { pin } => {
                if let Some(pin) = pin {
                    if self.pin.id() != Some(pin.as_str()) {
                        self.gain_pin(pin).await;
                    }
                }
                self.pulls.message_arrived();
                self.take(reply);
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
            Reply::ConsumerDeleted => return Some(SessionEnd::ConsumerGone),
            Reply::Conflict { description } => {
                tracing::debug!(%description, "pull conflict");
                self.pulls.finish(&subject);
            }
            Reply::BadRequest { description } => {
                tracing::warn!(%description, consumer = %self.joined.consumer, "the server refused the pull");
                return Some(SessionEnd::ConsumerGone);
            }
            Reply::Ignore => {}
        }
        None
    }

    /// Offers a pulled message to its partition's lane.
    fn take(&mut self, reply: async_nats::Message) {
        self.last_message = Instant::now();
        let keys = &self.keys;
        let pulled = Delivered::from_pull(
            &self.shared.ctx.js,
            reply,
            self.shared.who.stream.as_str(),
            Partitioning::Required,
            |subject| keys.key(subject),
        );
        let Some((delivered, consumer_seq)) = pulled else { return };
        if self.gaps.missed_before(consumer_seq) && self.pin.is_pinned() {
            // Deliveries went where this session never saw them (a pull whose
            // reply was lost with a NATS connection): they come back only at
            // ack wait, and nothing of the member may pass them until then.
            // The handover barrier waits for exactly that.
            self.shared.lock().lanes.set_barrier(true);
            let who = self.who();
            metrics::counter!(crate::metrics::DELIVERY_GAPS, "stream" => who.stream.to_string(),
                "group" => who.group.to_string())
            .increment(1);
            tracing::info!(member = %who.member, consumer_seq,
                "deliveries of the consumer went missing; holding until they are redelivered");
        }
        let (partition, stream_seq) = (delivered.partition, delivered.stream_seq);
        let lane = match self.joined.settings.ordering() {
            Ordering::Partition => LaneId::partition(partition),
            Ordering::Key => self.keys.lane(partition, &delivered.subject, stream_seq),
        };
        let held = Arc::new(delivered);
        let offered = self.shared.lock().lanes.offer(lane, stream_seq, held.clone());
        if let Offered::AlreadySettled(how) = offered {
            tokio::spawn(async move {
                let _ = remove(&held, Because::SettledBefore(how)).await;
            });
        }
    }
}
