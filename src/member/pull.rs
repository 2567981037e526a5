//! The pinned-client pull protocol (ADR-42) as nats-server answers it:
//! request bodies, and what each reply means for this instance's pin.
//! async-nats' pull streams echo the pin id silently; keygate needs to know
//! the moment it gains or loses the pin, so it drives raw pull requests.

use std::time::Duration;

use async_nats::{HeaderMap, StatusCode};
use serde::Serialize;

use crate::groups::config::PRIORITY_GROUP;

/// The header carrying the pin id on a pinned client's messages.
pub const PIN_HEADER: &str = "Nats-Pin-Id";

/// A pull request on `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PullRequest {
    pub batch: usize,
    /// Nanoseconds.
    pub expires: u64,
    pub group: &'static str,
    /// The pin id, once this instance holds the pin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl PullRequest {
    /// A request for up to `batch` messages, waiting at most `expires`.
    pub fn new(batch: usize, expires: Duration, pin: Option<&str>) -> Self {
        Self {
            batch: batch.max(1),
            expires: expires.as_nanos() as u64,
            group: PRIORITY_GROUP,
            id: pin.map(str::to_owned),
        }
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
    }
}
