//! The pinned-client pull protocol (ADR-42) as nats-server answers it:
//! request bodies, and what each reply means for this instance's pin.
//! async-nats' pull streams echo the pin id silently; keygate needs to know
//! the moment it gains or loses the pin, so it drives raw pull requests.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use async_nats::{HeaderMap, StatusCode};
use serde::Serialize;

use crate::groups::config::PRIORITY_GROUP;
use crate::nats::outbox::Outbox;

/// The header carrying the pin id on a pinned client's messages.
pub const PIN_HEADER: &str = "Nats-Pin-Id";

/// A pull request on `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct PullRequest {
    pub batch: usize,
    /// Nanoseconds.
    pub expires: u64,
    /// The consumer's priority group (a group member's is always `PCG`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The pin id, once this instance holds the pin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// A `prioritized` consumer's priority for this pull.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// An `overflow` consumer's thresholds for this pull.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_pending: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_ack_pending: Option<i64>,
}

impl PullRequest {
    /// A group member's request for up to `batch` messages, waiting at most `expires`.
    pub fn new(batch: usize, expires: Duration, pin: Option<&str>) -> Self {
        Self {
            batch: batch.max(1),
            expires: expires.as_nanos() as u64,
            group: Some(PRIORITY_GROUP.to_owned()),
            id: pin.map(str::to_owned),
            ..Self::default()
        }
    }
}

/// The grid pull deadlines are rounded down to.
const EXPIRY_GRID: Duration = Duration::from_millis(250);

/// A pull's expiry, at most `expiry`, chosen so the pull ends on a
/// process-wide 250 ms grid. Instances re-pull when their pulls end, so
/// a thousand idle ones end up renewing in a few bursts per expiry instead
/// of one at a time: the server's answers arrive together and the next
/// pulls leave together, a few reads and writes for all of them instead of
/// a wake-up and a system call each.
pub fn grid_expiry(expiry: Duration, now: Instant) -> Duration {
    static ANCHOR: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
    let since = (now + expiry).saturating_duration_since(*ANCHOR);
    let slots = since.as_nanos() / EXPIRY_GRID.as_nanos();
    let end = *ANCHOR + EXPIRY_GRID * slots as u32;
    end.saturating_duration_since(now).max(expiry.saturating_sub(EXPIRY_GRID))
}

/// Pulls sent and not yet over, oldest first: the server fills them in
/// that order, and messages come on their own subjects, not the pull's.
#[derive(Debug)]
pub struct OpenPulls {
    inbox: String,
    sent: u64,
    open: VecDeque<OpenPull>,
}

#[derive(Debug)]
struct OpenPull {
    reply: String,
    remaining: usize,
    deadline: Instant,
    /// The pin id the pull carried.
    pin: Option<String>,
}

impl OpenPulls {
    /// Pulls answered on `<inbox>.<n>`.
    pub fn new(inbox: String) -> Self {
        Self { inbox, sent: 0, open: VecDeque::new() }
    }

    /// The subjects replies come on.
    pub fn reply_filter(&self) -> String {
        format!("{}.*", self.inbox)
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Messages asked for and not yet received.
    pub fn asked(&self) -> usize {
        self.open.iter().map(|o| o.remaining).sum()
    }

    /// When the earliest open pull is over at the latest.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.open.iter().map(|o| o.deadline).min()
    }

    /// Sends `request` for `consumer`; false when it could not be sent.
    /// The pull counts as open until its expiry (plus a margin for the
    /// server's answer) unless a reply finishes it first.
    pub async fn send(&mut self, outbox: &Outbox, stream: &str, consumer: &str, request: &PullRequest) -> bool {
        self.sent += 1;
        let reply = format!("{}.{}", self.inbox, self.sent);
        let body = serde_json::to_vec(request).unwrap_or_default();
        if let Err(e) = outbox.publish_with_reply(next_subject(stream, consumer), reply.clone(), body.into()).await {
            tracing::debug!(error = %e, "sending pull");
            return false;
        }
        let deadline = Instant::now() + Duration::from_nanos(request.expires) + Duration::from_millis(500);
        self.open.push_back(OpenPull { reply, remaining: request.batch, deadline, pin: request.id.clone() });
        true
    }

    /// A message arrived: it belongs to the oldest open pull.
    pub fn message_arrived(&mut self) {
        if let Some(o) = self.open.front_mut() {
            o.remaining = o.remaining.saturating_sub(1);
            if o.remaining == 0 {
                self.open.pop_front();
            }
        }
    }

    /// The pull answered on `reply` is over; returns the pin id it carried
    /// (`None` when it was not open).
    pub fn finish(&mut self, reply: &str) -> Option<Option<String>> {
        let at = self.open.iter().position(|o| o.reply == reply)?;
        self.open.remove(at).map(|o| o.pin)
    }

    /// Forgets pulls past their deadline.
    pub fn expire(&mut self, now: Instant) {
        self.open.retain(|o| o.deadline > now);
    }

    /// Forgets every open pull (they carried a pin that is gone, or went
    /// out on a connection that is).
    pub fn clear(&mut self) {
        self.open.clear();
    }

    /// A 423 on `reply`: whether it rejected the pin this instance holds
    /// (`current`), which is then gone with every open pull. A late one for
    /// an older id only closes its own pull.
    pub fn pin_rejected(&mut self, reply: &str, current: Option<&str>) -> bool {
        let carried = self.finish(reply).flatten();
        let ours = carried.is_some() && carried.as_deref() == current;
        if ours {
            self.clear();
        }
        ours
    }
}

/// The subject pulls are sent to.
pub fn next_subject(stream: &str, consumer: &str) -> String {
    format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}")
}

/// What a reply on the pull inbox is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A message; `pin` is the id the server pinned it to.
    Message { pin: Option<String> },
    /// The pull is over without (more) messages: 404 / 408.
    Done,
    /// Another instance holds the pin, or ours is stale: 423. Pull again
    /// without an id.
    PinRejected { description: String },
    /// The consumer is gone (409 Consumer Deleted): join again.
    ConsumerDeleted,
    /// Another 409 (max waiting, max bytes, leadership change): pull again
    /// after a pause.
    Conflict { description: String },
    /// 400: the request itself is wrong (no or unknown priority group).
    BadRequest { description: String },
    /// 503: nothing at the server serves the consumer: it has no leader
    /// yet, or it is gone without a "consumer deleted" reaching this pull.
    NoResponders,
    /// 100 idle heartbeat, or anything else to ignore.
    Ignore,
}

/// Classifies a reply by its status and headers.
pub fn classify(status: Option<StatusCode>, description: Option<&str>, headers: Option<&HeaderMap>) -> Reply {
    let description = description.unwrap_or_default().to_owned();
    match status.map(|s| s.as_u16()) {
        None | Some(200) => Reply::Message { pin: headers.and_then(|h| h.get(PIN_HEADER)).map(|v| v.to_string()) },
        Some(404 | 408) => Reply::Done,
        Some(423) => Reply::PinRejected { description },
        Some(409) if description.to_ascii_lowercase().contains("consumer deleted") => Reply::ConsumerDeleted,
        Some(409) => Reply::Conflict { description },
        Some(400) => Reply::BadRequest { description },
        Some(503) => Reply::NoResponders,
        _ => Reply::Ignore,
    }
}

/// The consumer's delivery sequence as one session sees it. The server
/// numbers every delivery of a consumer, redeliveries included, so a jump
/// means deliveries went where this session never saw them: to a pull
/// whose reply was lost with a NATS connection, or to another client.
#[derive(Debug, Default)]
pub struct DeliveryGaps {
    last: Option<u64>,
}

impl DeliveryGaps {
    /// Records a delivery; true when it does not follow the last one seen
    /// (deliveries are missing before it, or the numbering restarted, as a
    /// new consumer leader may do: both are treated alike).
    pub fn missed_before(&mut self, consumer_seq: u64) -> bool {
        let broken = self.last.is_some_and(|last| consumer_seq != last + 1);
        self.last = Some(consumer_seq);
        broken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulls_end_on_the_grid_and_never_later_than_asked() {
        let start = Instant::now();
        let expiry = Duration::from_millis(2500);
        let mut ends = std::collections::BTreeSet::new();
        for offset_ms in (0..1000).step_by(7) {
            let now = start + Duration::from_millis(offset_ms);
            let chosen = grid_expiry(expiry, now);
            assert!(chosen <= expiry && chosen > expiry - EXPIRY_GRID, "{chosen:?} at +{offset_ms} ms");
            ends.insert((now + chosen).duration_since(start).as_millis() / 10);
        }
        // 143 pulls sent over a second end in about five distinct moments.
        assert!(ends.len() <= 6, "{ends:?}");
    }

    #[test]
    fn a_jump_in_the_delivery_sequence_is_a_gap() {
        let mut gaps = DeliveryGaps::default();
        assert!(!gaps.missed_before(7), "the first delivery of a session starts the count");
        assert!(!gaps.missed_before(8));
        assert!(gaps.missed_before(11), "9 and 10 went elsewhere");
        assert!(!gaps.missed_before(12));
        assert!(gaps.missed_before(5), "numbering restarted");
        assert!(!gaps.missed_before(6));
    }

    #[test]
    fn pull_bodies_carry_the_group_and_the_pin_once_held() {
        let body = serde_json::to_value(PullRequest::new(10, Duration::from_secs(2), None)).unwrap();
        assert_eq!(body, serde_json::json!({"batch":10,"expires":2_000_000_000u64,"group":"PCG"}));
        let body = serde_json::to_value(PullRequest::new(0, Duration::from_millis(1500), Some("abc"))).unwrap();
        assert_eq!(body, serde_json::json!({"batch":1,"expires":1_500_000_000u64,"group":"PCG","id":"abc"}));
    }

    #[test]
    fn subscriber_pulls_carry_only_the_options_they_have() {
        let request = PullRequest {
            batch: 64,
            expires: 5_000_000_000,
            group: Some("jobs".into()),
            priority: Some(2),
            ..PullRequest::default()
        };
        let body = serde_json::to_value(request).unwrap();
        assert_eq!(body, serde_json::json!({"batch":64,"expires":5_000_000_000u64,"group":"jobs","priority":2}));
    }

    #[test]
    fn open_pulls_are_filled_oldest_first_and_finished_by_their_reply_subject() {
        let mut pulls = OpenPulls::new("_INBOX.x".into());
        let now = Instant::now();
        for (n, pin) in [(1, None), (2, Some("p"))] {
            pulls.open.push_back(OpenPull {
                reply: format!("_INBOX.x.{n}"),
                remaining: 2,
                deadline: now + Duration::from_secs(n),
                pin: pin.map(str::to_owned),
            });
        }
        assert_eq!(pulls.asked(), 4);
        pulls.message_arrived();
        pulls.message_arrived();
        assert_eq!(pulls.len(), 1, "the first pull is filled");
        assert_eq!(pulls.finish("_INBOX.x.1"), None, "no longer open");
        assert_eq!(pulls.finish("_INBOX.x.2"), Some(Some("p".into())));
        assert!(pulls.is_empty());
        pulls.open.push_back(OpenPull { reply: "r".into(), remaining: 1, deadline: now, pin: None });
        pulls.expire(now + Duration::from_millis(1));
        assert!(pulls.is_empty());
        assert_eq!(pulls.reply_filter(), "_INBOX.x.*");
    }

    #[test]
    fn only_a_rejection_of_the_current_pin_loses_it() {
        let mut pulls = OpenPulls::new("_INBOX.x".into());
        let now = Instant::now() + Duration::from_secs(5);
        for (reply, pin) in [("old", "p1"), ("new", "p2"), ("other", "p2")] {
            pulls.open.push_back(OpenPull { reply: reply.into(), remaining: 1, deadline: now, pin: Some(pin.into()) });
        }
        assert!(!pulls.pin_rejected("old", Some("p2")), "a late 423 for an older id");
        assert_eq!(pulls.len(), 2, "only its own pull is closed");
        assert!(!pulls.pin_rejected("gone", Some("p2")), "a pull no longer open");
        assert!(pulls.pin_rejected("new", Some("p2")));
        assert!(pulls.is_empty(), "every open pull carried the lost pin");
    }

    #[test]
    fn replies_are_classified_like_the_server_sends_them() {
        let mut headers = HeaderMap::new();
        headers.insert(PIN_HEADER, "pin-1");
        assert_eq!(classify(None, None, Some(&headers)), Reply::Message { pin: Some("pin-1".into()) });
        assert_eq!(classify(Some(StatusCode::from_u16(408).unwrap()), Some("Request Timeout"), None), Reply::Done);
        assert_eq!(classify(Some(StatusCode::NOT_FOUND), Some("No Messages"), None), Reply::Done);
        assert!(matches!(
            classify(Some(StatusCode::from_u16(423).unwrap()), Some("Nats-Pin-Id mismatch"), None),
            Reply::PinRejected { .. }
        ));
        assert_eq!(
            classify(Some(StatusCode::from_u16(409).unwrap()), Some("Consumer Deleted"), None),
            Reply::ConsumerDeleted
        );
        assert!(matches!(
            classify(Some(StatusCode::from_u16(409).unwrap()), Some("Exceeded MaxWaiting"), None),
            Reply::Conflict { .. }
        ));
        assert!(matches!(
            classify(Some(StatusCode::from_u16(400).unwrap()), Some("Bad Request - Priority Group missing"), None),
            Reply::BadRequest { .. }
        ));
        assert_eq!(classify(Some(StatusCode::from_u16(100).unwrap()), Some("Idle Heartbeat"), None), Reply::Ignore);
        assert_eq!(classify(Some(StatusCode::NO_RESPONDERS), None, None), Reply::NoResponders);
    }
}
