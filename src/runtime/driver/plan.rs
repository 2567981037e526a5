//! How much a run asks the server for, and how long its pulls wait (pure).
//!
//! - A group member asks in batches of [`MAX_PULL_BATCH`] with up to
//!   [`MEMBER_OPEN_PULLS`] pulls open, so the server always has one to
//!   deliver on; while one partition has `hold_cap` messages queued behind
//!   its head (partition ordering), it trickles one message per pull, which
//!   still keeps the pin.
//! - A subscriber asks for all the room it has up to `max_held`, so a burst
//!   stays with it rather than passing to a lower priority; it tops up in
//!   steps of at least `prefetch`, with up to [`SUBSCRIBER_OPEN_PULLS`]
//!   open, so a prioritized or overflow subscriber is never seen without a
//!   pull (the server would serve the next priority then). Holding
//!   `max_held` it is saturated and stops pulling, which is when the next
//!   priority is served.

use std::time::Duration;

use crate::webhook::SubscriberOptions;

/// Most messages a member asks for in one pull.
pub const MAX_PULL_BATCH: usize = 256;
/// Pulls a member keeps open at once.
pub const MEMBER_OPEN_PULLS: usize = 3;
/// Pulls a subscriber keeps open at once.
pub const SUBSCRIBER_OPEN_PULLS: usize = 2;
/// The longest a subscriber's pull waits at the server.
pub const SUBSCRIBER_PULL_EXPIRY: Duration = Duration::from_secs(5);
/// Fewest messages a subscriber takes in at once.
pub const MIN_PREFETCH: usize = 64;
/// Fewest messages a subscriber may hold (in flight and queued) before it
/// counts as saturated.
pub const MIN_HELD: usize = 512;

/// How a run sizes its pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullSizing {
    /// A group member; `trickle` while a partition is backed up.
    Member { trickle: bool },
    /// A subscriber: hold at most `max_held`, top up by at least `prefetch`.
    Subscriber { max_held: usize, prefetch: usize },
}

impl PullSizing {
    /// A subscriber delivering `concurrency` at once.
    pub fn subscriber(options: &SubscriberOptions) -> Self {
        let concurrency = options.concurrency.max(1);
        Self::Subscriber { max_held: (16 * concurrency).max(MIN_HELD), prefetch: (4 * concurrency).max(MIN_PREFETCH) }
    }

    /// The batch of the next pull to send, if one should go now: `open`
    /// pulls are waiting for `asked` messages, and the run holds `holding`
    /// (queued and in flight).
    pub fn next_batch(self, open: usize, asked: usize, holding: usize) -> Option<usize> {
        match self {
            Self::Member { trickle: true } => (open == 0).then_some(1),
            Self::Member { trickle: false } => {
                (asked < MAX_PULL_BATCH && open < MEMBER_OPEN_PULLS).then_some(MAX_PULL_BATCH)
            }
            Self::Subscriber { max_held, prefetch } => {
                if open >= SUBSCRIBER_OPEN_PULLS {
                    return None;
                }
                let room = max_held.saturating_sub(holding + asked);
                (room > 0 && (asked == 0 || room >= prefetch)).then_some(room)
            }
        }
    }
}

/// How long a subscriber's pull waits at the server. Under a pin (`pin_ttl`)
/// the holder's pulls must renew it well within the TTL, and it must hear
/// from the server within the TTL to know it still holds it: half the TTL,
/// at least a second, as a group member's (runtime/join.rs).
pub fn subscriber_pull_expiry(pin_ttl: Option<Duration>) -> Duration {
    match pin_ttl {
        Some(ttl) => (ttl / 2).max(Duration::from_secs(1)).min(SUBSCRIBER_PULL_EXPIRY),
        None => SUBSCRIBER_PULL_EXPIRY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends pulls the way the driver does, until the sizing says stop.
    fn fill(sizing: PullSizing, mut open: usize, mut asked: usize, holding: usize) -> Vec<usize> {
        let mut sent = Vec::new();
        while let Some(batch) = sizing.next_batch(open, asked, holding) {
            sent.push(batch);
            open += 1;
            asked += batch;
            assert!(sent.len() < 10, "the sizing never stops");
        }
        sent
    }

    #[test]
    fn a_pinned_subscribers_pulls_end_within_half_the_pin_ttl() {
        assert_eq!(subscriber_pull_expiry(None), SUBSCRIBER_PULL_EXPIRY);
        assert_eq!(subscriber_pull_expiry(Some(Duration::from_secs(3))), Duration::from_millis(1500));
        assert_eq!(subscriber_pull_expiry(Some(Duration::from_millis(1500))), Duration::from_secs(1));
        assert_eq!(subscriber_pull_expiry(Some(Duration::from_secs(120))), SUBSCRIBER_PULL_EXPIRY);
    }

    #[test]
    fn a_member_keeps_a_batch_asked_for_and_at_most_three_pulls_open() {
        let member = PullSizing::Member { trickle: false };
        assert_eq!(fill(member, 0, 0, 0), vec![256]);
        assert_eq!(fill(member, 1, 10, 0), vec![256], "less than a batch still asked: another pull goes");
        assert_eq!(fill(member, 3, 10, 0), Vec::<usize>::new(), "three open is the most");
    }

    #[test]
    fn a_backed_up_partition_trickles_one_message_per_pull_with_one_pull_open() {
        let trickle = PullSizing::Member { trickle: true };
        assert_eq!(fill(trickle, 0, 0, 10_000), vec![1]);
        assert_eq!(fill(trickle, 1, 1, 10_000), Vec::<usize>::new());
    }

    #[test]
    fn a_subscriber_asks_for_its_room_tops_up_in_steps_and_stops_when_saturated() {
        let options = SubscriberOptions { priority: None, min_pending: None, min_ack_pending: None, concurrency: 4 };
        let sizing = PullSizing::subscriber(&options);
        assert_eq!(sizing, PullSizing::Subscriber { max_held: 512, prefetch: 64 });
        assert_eq!(fill(sizing, 0, 0, 0), vec![512], "all the room at once");
        assert_eq!(fill(sizing, 0, 0, 500), vec![12], "no pull open: even a little room is asked for");
        assert_eq!(fill(sizing, 1, 12, 450), Vec::<usize>::new(), "less than a prefetch of room: wait");
        assert_eq!(fill(sizing, 1, 100, 0), vec![412], "a second pull tops up");
        assert_eq!(fill(sizing, 0, 0, 512), Vec::<usize>::new(), "saturated: the next priority is served");
        let wide = SubscriberOptions { concurrency: 100, ..options };
        assert_eq!(PullSizing::subscriber(&wide), PullSizing::Subscriber { max_held: 1600, prefetch: 400 });
    }
}
