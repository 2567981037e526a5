//! Keyed publishing: a REST message becomes a subject, headers and payload
//! (`prepare.rs`), is published to JetStream alone, in a batch that keeps
//! each key's order (`batch.rs`; a key's run of messages as one atomic
//! batch, `runs.rs`) or in an all-or-nothing batch (`atomic.rs`), and is
//! answered after the JetStream ack with the partition the server stamped
//! (`send.rs`).

mod atomic;
mod batch;
mod error;
mod prepare;
#[cfg(any(test, feature = "fuzzing"))]
pub mod properties;
mod runs;
mod send;

pub use atomic::{publish_atomic, MAX_ATOMIC_MESSAGES};
pub use batch::{publish_all, publish_one};
pub use error::{PublishError, PublishErrorKind};
pub use prepare::{prepare, Prepared};
pub use runs::{publish_batch, RunSlots};

use std::collections::BTreeMap;

/// The header a redriven dead letter's message carries: the letter's id.
/// Only keygate sets it (publishers' requests with it are refused), so an
/// endpoint can trust it.
pub const REDRIVEN_FROM: &str = "keygate-redriven-from";

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::ToSchema;

/// Header values: one string or several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum HeaderValues {
    One(String),
    Many(Vec<String>),
}

/// One message to publish.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// The message key: any UTF-8 text. Messages with one key land in one
    /// partition and are delivered in order. Omitted: spread round-robin.
    #[serde(default)]
    #[schema(example = "alice")]
    pub key: Option<String>,
    /// A literal subject, or a pattern with one `*` the key fills. Default:
    /// the stream's subject.
    #[serde(default)]
    pub subject: Option<String>,
    /// The payload as JSON, any value: object, array, string, number,
    /// boolean or null (stored byte for byte as sent).
    #[serde(default)]
    #[schema(value_type = Option<serde_json::Value>)]
    pub data: Option<Box<RawValue>>,
    /// Or the payload as base64 bytes.
    #[serde(default)]
    pub data_base64: Option<String>,
    /// Content type to record with the payload (default `application/json`
    /// for `data`).
    #[serde(default)]
    pub content_type: Option<String>,
    /// Message headers: a string or an array of strings per name. Names and
    /// values follow HTTP's rules; names starting with `Nats-` or `KV-` are
    /// reserved.
    #[serde(default)]
    pub headers: Option<BTreeMap<String, HeaderValues>>,
    /// De-duplication id (`Nats-Msg-Id`): a repeat within the stream's
    /// duplicate window is stored once and answered with `duplicate: true`.
    #[serde(default)]
    pub msg_id: Option<String>,
    /// Keyless messages only: `round_robin` (default) puts successive
    /// messages on successive partitions, `random` on a random one.
    #[serde(default)]
    pub spread: Option<Spread>,
}

impl PublishRequest {
    /// Adds the trace context's headers, unless the message names its own.
    pub fn carry(&mut self, trace: &crate::telemetry::TraceContext) {
        let headers = self.headers.get_or_insert_with(Default::default);
        for (name, value) in trace.headers() {
            if !headers.keys().any(|own| own.eq_ignore_ascii_case(name)) {
                headers.insert(name.to_owned(), HeaderValues::One(value.to_owned()));
            }
        }
    }
}

/// How keyless messages are spread over partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Spread {
    RoundRobin,
    Random,
}

/// Several messages in one request.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    pub messages: Vec<PublishRequest>,
    /// All or nothing: every message is stored, or none is (JetStream's
    /// atomic batch publish; the stream needs `allow_atomic`, at most 1000
    /// messages). Then the answer is one problem, or one ack per message.
    #[serde(default)]
    pub atomic: bool,
}

/// Where a message was stored.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct PublishAck {
    pub stream: String,
    /// Stream sequence.
    pub seq: u64,
    /// The subject published (without the partition token the stream adds).
    pub subject: String,
    /// The partition the stream stamped, when it stamps partitions.
    pub partition: Option<u32>,
    /// The message key (`null` for keyless messages).
    pub key: Option<String>,
    /// True when `msg_id` was seen before and nothing new was stored.
    pub duplicate: bool,
}
