//! A message as keygate holds it between its pull and its verdict, and
//! what of it may leave keygate (headers forwarded to endpoints).

use std::sync::Arc;

use async_nats::jetstream;

use super::custody::Custody;

/// A message delivered to this instance.
#[derive(Debug)]
pub struct Delivered {
    pub message: jetstream::Message,
    pub partition: u32,
    pub stream_seq: u64,
    pub attempt: u64,
    pub subject: String,
    pub key: Option<String>,
    pub origin_stream: String,
    pub origin_seq: u64,
    /// Whether this instance may still settle it (group members only:
    /// see `custody.rs`).
    pub custody: Option<Custody>,
}

/// A delivered message, shared by its lane and its delivery.
pub type Held = Arc<Delivered>;

/// Where a pulled message's subject keeps its partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partitioning {
    /// A group member's: the first token is the partition; a subject
    /// without one is not a member's message.
    Required,
    /// A plain consumer's: the first token when the stream stamps one,
    /// else partition 0.
    IfStamped(bool),
}

impl Delivered {
    /// Where events place this message.
    pub fn at(&self) -> crate::events::MessageAt {
        crate::events::MessageAt { partition: self.partition, seq: self.origin_seq, attempt: self.attempt }
    }

    /// A message pulled from `stream`'s consumer, with its consumer
    /// sequence (the server's count of the consumer's deliveries);
    /// `key_of` finds the key in the subject without the partition.
    pub fn from_pull(
        js: &jetstream::Context,
        reply: async_nats::Message,
        stream: &str,
        partitioning: Partitioning,
        custody: Option<Custody>,
        key_of: impl FnOnce(&str) -> Option<String>,
    ) -> Option<(Self, u64)> {
        let message = jetstream::Message { message: reply, context: js.clone() };
        let info = message.info().ok()?;
        let (stream_seq, attempt, consumer_seq) =
            (info.stream_sequence, info.delivered.max(1) as u64, info.consumer_sequence);
        let full = message.subject.as_str();
        let stamped = full.split_once('.').and_then(|(p, rest)| Some((p.parse::<u32>().ok()?, rest)));
        let (partition, subject) = match (partitioning, stamped) {
            (Partitioning::Required | Partitioning::IfStamped(true), Some((p, rest))) => (p, rest.to_owned()),
            (Partitioning::Required, None) => return None,
            (Partitioning::IfStamped(_), _) => (0, full.to_owned()),
        };
        let (origin_stream, origin_seq) = origin_of(&message, stream, stream_seq);
        let key = key_of(&subject);
        let delivered =
            Self { message, partition, stream_seq, attempt, subject, key, origin_stream, origin_seq, custody };
        Some((delivered, consumer_seq))
    }
}

/// Whether a message header may go to the endpoint: not NATS's own, not
/// keygate's or the signature's, not one that frames the HTTP request, and
/// no credentials: the signature does not cover headers, so an endpoint
/// trusting a forwarded `Authorization` would act for whoever published.
pub fn forwardable(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    const NEVER_FORWARDED: [&str; 12] = [
        "authorization",
        "cookie",
        "set-cookie",
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "te",
        "upgrade",
        "trailer",
        "keep-alive",
        "proxy-connection",
    ];
    // A redrive's mark is keygate's alone (publishers may not set it), and
    // it is for the endpoint to see.
    if lower == crate::publish::REDRIVEN_FROM {
        return true;
    }
    !(lower.starts_with("nats-")
        || lower.starts_with("keygate-")
        || lower.starts_with("webhook-")
        || lower.starts_with("proxy-")
        || NEVER_FORWARDED.contains(&lower.as_str()))
}

/// The origin stream and sequence of a message: an elastic group's
/// work-queue copy names its source in `Nats-Stream-Source`.
fn origin_of(message: &jetstream::Message, stream: &str, seq: u64) -> (String, u64) {
    let source = message.headers.as_ref().and_then(|h| h.get("Nats-Stream-Source")).map(|v| v.to_string());
    if let Some(source) = source {
        let mut parts = source.split_whitespace();
        if let (Some(name), Some(origin_seq)) = (parts.next(), parts.next().and_then(|s| s.parse().ok())) {
            let name = name.split(':').next().unwrap_or(name);
            return (name.to_owned(), origin_seq);
        }
    }
    (stream.to_owned(), seq)
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_the_messages_own_headers_are_forwarded() {
        for kept in ["X-Trace", "content-type", "Authorization-Context", "traceparent"] {
            assert!(super::forwardable(kept), "{kept}");
        }
        for dropped in [
            "nats-msg-id",
            "Nats-Pin-Id",
            "Host",
            "content-length",
            "Transfer-Encoding",
            "webhook-signature",
            "KEYGATE-key",
            "Connection",
            "proxy-authorization",
            "Authorization",
            "cookie",
        ] {
            assert!(!super::forwardable(dropped), "{dropped}");
        }
    }
}
