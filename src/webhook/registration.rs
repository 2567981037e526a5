//! A webhook registration: as `PUT …/webhook` takes it ([`WebhookSpec`]),
//! as stored ([`Registration`], in keygate's own KV bucket so every replica
//! serves it), and as the API shows it (never its secrets).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::credentials::OutboundAuth;
use super::signing::{SecretError, Signer};
use super::{WebhookError as Error, WebhookErrorKind as Kind};
use crate::delivery::outputs::MAX_OUTPUT_STREAMS;
use crate::delivery::verdict::Backoff;
use crate::delivery::BatchLimits;
use crate::names::StreamName;

/// KV bucket of webhook registrations, key `<stream>.<group>.<member>`.
pub const WEBHOOKS_BUCKET: &str = "keygate-webhooks";
/// Most bytes of a response body keygate reads.
pub const MAX_RESPONSE_BODY: usize = 64 * 1024;
/// A circuit breaker: after `failures` failed deliveries in a row (no 2xx
/// answer), the member pauses itself on every replica; with
/// `probe_interval_ms`, one replica then tries one message that often and
/// resumes the member when it succeeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BreakerSpec {
    #[schema(minimum = 1, maximum = 100000)]
    pub failures: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1000, maximum = 86400000)]
    pub probe_interval_ms: Option<u64>,
}

/// Batched deliveries: one request carries up to `max_messages` messages
/// as a JSON array (docs/batched-deliveries.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchSpec {
    /// Most messages in one request.
    #[schema(minimum = 1, maximum = 1000, example = 100)]
    pub max_messages: u32,
    /// Most payload bytes in one request (default 1048576); a single
    /// larger message still goes, alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1024, maximum = 16777216)]
    pub max_bytes: Option<u64>,
    /// How long a request that is not full waits for more messages
    /// (default 0: send what is ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 10000)]
    pub max_wait_ms: Option<u64>,
}

/// Most messages in one batched request.
pub const MAX_BATCH_MESSAGES: u32 = 1000;
/// Payload bytes of one batched request unless the registration says.
pub const DEFAULT_BATCH_BYTES: u64 = 1024 * 1024;

impl BatchSpec {
    /// Refuses sizes keygate cannot send.
    pub fn check(&self) -> Result<(), Error> {
        let bad = |m: &str| Err(Error::new(Kind::InvalidRegistration, m));
        if !(1..=MAX_BATCH_MESSAGES).contains(&self.max_messages) {
            return bad("batch.max_messages must be between 1 and 1000");
        }
        if self.max_bytes.is_some_and(|b| !(1024..=16 * 1024 * 1024).contains(&b)) {
            return bad("batch.max_bytes must be between 1024 and 16777216");
        }
        if self.max_wait_ms.is_some_and(|ms| ms > 10_000) {
            return bad("batch.max_wait_ms must be between 0 and 10000");
        }
        Ok(())
    }

    /// Payload bytes one request may carry.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes.unwrap_or(DEFAULT_BATCH_BYTES) as usize
    }

    /// How long a request that is not full waits for more.
    pub fn max_wait(&self) -> Duration {
        Duration::from_millis(self.max_wait_ms.unwrap_or(0))
    }

    /// The limits the batch workers apply.
    pub fn limits(&self) -> BatchLimits {
        BatchLimits { max_messages: self.max_messages as usize, max_bytes: self.max_bytes(), max_wait: self.max_wait() }
    }
}

/// How a delivery's request is shaped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryFormat {
    /// The payload as the body, keygate's headers beside it.
    #[default]
    Raw,
    /// The same, plus the CloudEvents binary-mode attributes (`ce-*`).
    Cloudevents,
}

impl DeliveryFormat {
    fn is_raw(&self) -> bool {
        *self == Self::Raw
    }
}

/// How long one call may take when the registration says nothing.
pub const DEFAULT_TIMEOUT_MS: u64 = 10_000;
/// Deliveries before a message is dead-lettered when the registration says nothing.
pub const DEFAULT_MAX_ATTEMPTS: u64 = 10;

/// A webhook as `PUT …/members/{member}/webhook` takes it.
#[derive(Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookSpec {
    /// Where messages are POSTed.
    #[schema(example = "http://127.0.0.1:9000/orders")]
    pub url: String,
    /// Standard Webhooks signing secret (`whsec_…`); generated when omitted
    /// on creation and returned once.
    #[serde(default)]
    pub secret: Option<String>,
    /// How long one call may take (default 10000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Deliveries before a message is dead-lettered (default 10).
    #[serde(default)]
    pub max_attempts: Option<u64>,
    /// Retry backoff (default 500 ms doubling to 60 s).
    #[serde(default)]
    pub backoff: Option<Backoff>,
    /// Group members only: most deliveries in flight at once across the
    /// member's partitions (default: one per partition under partition
    /// ordering, 256 under key ordering).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000)]
    pub max_in_flight: Option<usize>,
    /// Most messages per second sent to the endpoint (fractions allowed:
    /// 0.5 is one every two seconds). Default: unlimited.
    #[serde(default)]
    #[schema(minimum = 0.001, maximum = 100000)]
    pub max_rate: Option<f64>,
    /// With `max_rate`: messages that may go at once after a quiet spell
    /// (default: `max_rate` rounded up).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100000)]
    pub burst: Option<u32>,
    /// Pause the member after this many failed deliveries in a row.
    #[serde(default)]
    pub breaker: Option<BreakerSpec>,
    /// 4xx statuses to retry with backoff like a 5xx (e.g. `[404]` while a
    /// deploy rolls) instead of terminating the message.
    #[serde(default)]
    #[schema(max_items = 50)]
    pub retry_statuses: Option<Vec<u16>>,
    /// Static headers sent with every delivery (not hop-by-hop headers,
    /// credentials, `Content-Type`, or keygate's own). A `GET` shows their
    /// names only.
    #[serde(default)]
    pub headers: Option<BTreeMap<String, String>>,
    /// How keygate authenticates to the endpoint.
    #[serde(default)]
    pub auth: Option<OutboundAuth>,
    /// `cloudevents`: deliver in CloudEvents binary mode (default `raw`).
    #[serde(default)]
    pub format: Option<DeliveryFormat>,
    /// With `cloudevents`: the `ce-type` of events that carry none (default: the subject).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 256)]
    pub ce_type: Option<String>,
    /// Deliver in batches: a JSON array of messages per request, answered
    /// with per-message results (docs/batched-deliveries.md).
    #[serde(default)]
    pub batch: Option<BatchSpec>,
    /// Streams the endpoint's answers may publish to
    /// (`{"publish":[…]}`, docs/pipelines.md): each answer's messages are
    /// stored there before the delivered message is acked. At most 16.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>, max_items = 16, example = json!(["PAYMENTS"]))]
    pub outputs: Option<Vec<StreamName>>,
}

/// A stored registration.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    pub url: String,
    pub secret: String,
    pub timeout_ms: u64,
    pub max_attempts: u64,
    pub backoff: Backoff,
    /// Group members only: most deliveries in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<usize>,
    /// Consumer subscribers only: how they pull and how many deliveries run at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscriber: Option<SubscriberOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retry_statuses: Vec<u16>,
    /// The secret a rotation replaced, still signing beside the new one
    /// until `previous_secret_until` (Unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_secret_until: Option<i64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<OutboundAuth>,
    #[serde(default, skip_serializing_if = "DeliveryFormat::is_raw")]
    pub format: DeliveryFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ce_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchSpec>,
    /// Streams the endpoint's answers may publish to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<StreamName>,
}

impl WebhookSpec {
    /// The streams its answers may publish to (docs/pipelines.md): at most
    /// [`MAX_OUTPUT_STREAMS`], none of keygate's or the server's own, each
    /// once, and only for unbatched deliveries. Whether they exist, keep
    /// duplicates long enough and may be published by the caller is
    /// checked where the registration is made (src/http/webhooks.rs).
    pub fn outputs(&self) -> Result<Vec<StreamName>, Error> {
        declared_outputs(self.outputs.clone().unwrap_or_default())
    }

    /// The longest a message's deliveries can span under this
    /// registration's retry policy: every attempt taking its whole timeout
    /// and every retry waiting its whole backoff. An output published by
    /// one attempt may be published again by any later one, so a target
    /// stream must drop duplicates at least this long (docs/pipelines.md).
    pub fn redelivery_horizon(&self) -> Duration {
        let attempts = self.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
        let backoff = self.backoff.unwrap_or_default();
        let waits: f64 = (1..attempts)
            .map(|a| (backoff.initial_ms as f64 * 2f64.powi(a.min(40) as i32 - 1)).min(backoff.max_ms as f64))
            .sum();
        let calls = attempts.saturating_mul(self.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS));
        Duration::from_millis(calls).saturating_add(Duration::from_secs_f64(waits / 1000.0))
    }
}

/// Streams an endpoint declares its answers may publish to (a webhook's
/// `outputs`, a WebSocket join's or a first fetch's; docs/pipelines.md):
/// at most [`MAX_OUTPUT_STREAMS`], none of keygate's or the server's own,
/// sorted, each once.
pub fn declared_outputs(mut outputs: Vec<StreamName>) -> Result<Vec<StreamName>, Error> {
    if outputs.len() > MAX_OUTPUT_STREAMS {
        return Err(Error::new(
            Kind::InvalidRegistration,
            format!("outputs names at most {MAX_OUTPUT_STREAMS} streams"),
        ));
    }
    for stream in &outputs {
        if let Some(why) = crate::streams::reserved_stream_name(stream.as_str()) {
            return Err(Error::new(Kind::InvalidRegistration, format!("outputs: {why}")));
        }
    }
    outputs.sort();
    outputs.dedup();
    Ok(outputs)
}

/// The longest a WebSocket or pull client's message's deliveries can span
/// if the client answers each within the consumer's ack wait: every
/// attempt taking the whole ack wait and every retry its whole default
/// backoff. A client that holds a message longer (with `progress`) or asks
/// for longer NAK delays goes beyond it (docs/pipelines.md).
pub fn client_redelivery_horizon(max_attempts: u64, ack_wait: Duration) -> Duration {
    let spec = WebhookSpec {
        max_attempts: Some(max_attempts),
        timeout_ms: Some(ack_wait.as_millis().min(u64::MAX as u128) as u64),
        ..WebhookSpec::default()
    };
    spec.redelivery_horizon()
}

impl Registration {
    /// The keys its deliveries are signed with.
    pub fn signer(&self) -> Result<Signer, SecretError> {
        let until = |secs: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(secs.max(0) as u64);
        let previous = match (&self.previous_secret, self.previous_secret_until) {
            (Some(secret), Some(secs)) => Some((secret.as_str(), until(secs))),
            _ => None,
        };
        Signer::new(&self.secret, previous)
    }

    /// When the previous secret stops signing, if a rotation left one.
    pub fn previous_secret_expires(&self) -> Option<time::OffsetDateTime> {
        self.previous_secret.as_ref()?;
        time::OffsetDateTime::from_unix_timestamp(self.previous_secret_until?).ok()
    }
}

// Debug output never carries the signing secret or the URL's query string:
// whatever logs these types cannot leak them.
impl std::fmt::Debug for WebhookSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSpec")
            .field("url", &redact_url(&self.url))
            .field("secret", &self.secret.as_ref().map(|_| "(redacted)"))
            .field("timeout_ms", &self.timeout_ms)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_rate", &self.max_rate)
            .field("burst", &self.burst)
            .field("breaker", &self.breaker)
            .field("retry_statuses", &self.retry_statuses)
            .field("headers", &self.headers.as_ref().map(|h| h.keys().collect::<Vec<_>>()))
            .field("auth", &self.auth)
            .field("format", &self.format)
            .field("ce_type", &self.ce_type)
            .field("batch", &self.batch)
            .field("outputs", &self.outputs)
            .finish()
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("url", &redact_url(&self.url))
            .field("secret", &"(redacted)")
            .field("timeout_ms", &self.timeout_ms)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("max_in_flight", &self.max_in_flight)
            .field("subscriber", &self.subscriber)
            .field("previous_secret", &self.previous_secret.as_ref().map(|_| "(redacted)"))
            .field("previous_secret_until", &self.previous_secret_until)
            .field("max_rate", &self.max_rate)
            .field("burst", &self.burst)
            .field("breaker", &self.breaker)
            .field("retry_statuses", &self.retry_statuses)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("auth", &self.auth)
            .field("format", &self.format)
            .field("ce_type", &self.ce_type)
            .field("batch", &self.batch)
            .field("outputs", &self.outputs)
            .finish()
    }
}

/// How a webhook subscriber of a plain consumer pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SubscriberOptions {
    /// `prioritized` consumers: 0 (served first) to 9.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// `overflow` consumers: served only while at least this many messages wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_pending: Option<i64>,
    /// `overflow` consumers: served only while at least this many are un-acked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_ack_pending: Option<i64>,
    /// Deliveries in flight at once (no key order to keep).
    pub concurrency: usize,
}

/// Where consumer subscribers' registrations are kept (key `<stream>.<consumer>.<subscriber>`).
pub const CONSUMER_WEBHOOKS_BUCKET: &str = "keygate-consumer-webhooks";

/// A member's webhook as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct WebhookView {
    pub stream: String,
    pub group: String,
    pub member: String,
    /// Most deliveries in flight at once, when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<usize>,
    #[serde(flatten)]
    pub registration: RegistrationView,
}

/// What members' webhooks and consumers' subscribers show alike: where and
/// how keygate calls the endpoint (format, protection, auth; where its
/// secrets are, never the secrets), and the signing secret's state.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RegistrationView {
    pub url: String,
    pub timeout_ms: u64,
    pub max_attempts: u64,
    pub backoff: Backoff,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rate: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerSpec>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub retry_statuses: Vec<u16>,
    /// The static headers' names (their values are never shown).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<String>,
    /// How keygate authenticates (where its secrets are, never the secrets).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth: Option<OutboundAuth>,
    pub format: DeliveryFormat,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ce_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchSpec>,
    /// Streams the endpoint's answers may publish to (docs/pipelines.md).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<String>)]
    pub outputs: Vec<StreamName>,
    /// After a rotation: until when the previous secret also signs.
    #[serde(skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub previous_secret_expires_at: Option<time::OffsetDateTime>,
    /// The signing secret: only in the answer that generated it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

impl RegistrationView {
    /// The view of `r`, with `secret` when this answer hands it out.
    pub fn of(r: &Registration, secret: Option<String>) -> Self {
        Self {
            url: r.url.clone(),
            timeout_ms: r.timeout_ms,
            max_attempts: r.max_attempts,
            backoff: r.backoff,
            max_rate: r.max_rate,
            burst: r.burst,
            breaker: r.breaker,
            retry_statuses: r.retry_statuses.clone(),
            headers: r.headers.keys().cloned().collect(),
            auth: r.auth.clone(),
            format: r.format,
            ce_type: r.ce_type.clone(),
            batch: r.batch,
            outputs: r.outputs.clone(),
            previous_secret_expires_at: r.previous_secret_expires(),
            secret,
        }
    }
}

/// Most deliveries a member may have in flight: the consumer's default
/// `max_ack_pending` (1000), past which the server sends no more anyway.
pub const MAX_IN_FLIGHT: usize = 1000;
const _: () = assert!(MAX_IN_FLIGHT <= super::transport::POOL_MAX_IDLE_PER_HOST);
/// Deliveries in flight under key ordering when the member sets none.
pub const DEFAULT_KEY_IN_FLIGHT: usize = 256;

/// Refuses a `max_in_flight` outside 1 to [`MAX_IN_FLIGHT`].
pub fn check_max_in_flight(max_in_flight: Option<usize>) -> Result<(), Error> {
    match max_in_flight {
        Some(n) if !(1..=MAX_IN_FLIGHT).contains(&n) => {
            Err(Error::new(Kind::InvalidRegistration, format!("max_in_flight must be between 1 and {MAX_IN_FLIGHT}")))
        }
        _ => Ok(()),
    }
}

/// Longest overlap of a secret rotation: a week.
pub const MAX_ROTATION_OVERLAP_S: u64 = 7 * 24 * 3600;

/// `POST …/webhook/rotate-secret`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateSecret {
    /// Seconds the old secret keeps signing beside the new one (default
    /// 3600; 0 stops it at once; at most a week).
    #[schema(minimum = 0, maximum = 604800)]
    pub overlap_s: Option<u64>,
}

impl RotateSecret {
    /// The overlap asked for, or why it is refused.
    pub fn overlap(&self) -> Result<Duration, Error> {
        match self.overlap_s.unwrap_or(3600) {
            s if s > MAX_ROTATION_OVERLAP_S => Err(Error::new(
                Kind::InvalidRegistration,
                format!("overlap_s must be at most {MAX_ROTATION_OVERLAP_S} (a week)"),
            )),
            s => Ok(Duration::from_secs(s)),
        }
    }
}

/// Refuses rate, breaker and retry settings keygate cannot apply.
pub(super) fn check_protection(spec: &WebhookSpec) -> Result<(), Error> {
    let bad = |m: &str| Err(Error::new(Kind::InvalidRegistration, m));
    match (spec.max_rate, spec.burst) {
        (Some(rate), _) if !(0.001..=100_000.0).contains(&rate) => {
            return bad("max_rate must be between 0.001 and 100000")
        }
        (None, Some(_)) => return bad("burst needs max_rate"),
        (_, Some(burst)) if !(1..=100_000).contains(&burst) => return bad("burst must be between 1 and 100000"),
        _ => {}
    }
    if let Some(breaker) = spec.breaker {
        if !(1..=100_000).contains(&breaker.failures) {
            return bad("breaker.failures must be between 1 and 100000");
        }
        if breaker.probe_interval_ms.is_some_and(|ms| !(1000..=86_400_000).contains(&ms)) {
            return bad("breaker.probe_interval_ms must be between 1000 and 86400000");
        }
    }
    if let Some(statuses) = &spec.retry_statuses {
        if statuses.len() > 50 {
            return bad("retry_statuses takes at most 50 statuses");
        }
        if statuses.iter().any(|s| !(400..=499).contains(s)) {
            return bad("retry_statuses are 4xx statuses (5xx, 408, 425 and 429 are always retried)");
        }
    }
    Ok(())
}

/// The registration key of a member.
pub fn registration_key(stream: &str, group: &str, member: &str) -> String {
    format!("{stream}.{group}.{member}")
}

/// A URL fit for a log line: scheme, host, port and path, without the user
/// info and query string that often carry credentials.
pub fn redact_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut parsed) => {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            parsed.to_string()
        }
        Err(_) => "(unparsable URL)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redelivery_horizon_is_every_call_and_every_backoff_wait_in_full() {
        let default = WebhookSpec::default();
        // 10 calls of 10 s; waits 0.5, 1, 2, 4, 8, 16, 32, then 60 twice.
        assert_eq!(default.redelivery_horizon(), Duration::from_millis(100_000 + 183_500));
        let one = WebhookSpec { max_attempts: Some(1), timeout_ms: Some(2000), ..Default::default() };
        assert_eq!(one.redelivery_horizon(), Duration::from_secs(2));
        let wide = WebhookSpec { max_attempts: Some(1000), timeout_ms: Some(300_000), ..Default::default() };
        assert!(wide.redelivery_horizon() > Duration::from_secs(300_000));
    }

    #[test]
    fn registrations_never_show_their_secret_or_url_credentials() {
        let registration = Registration {
            url: "https://user:pw@hooks.example/orders?token=abc123#frag".into(),
            secret: "whsec_c2VjcmV0c2VjcmV0".into(),
            timeout_ms: 1,
            max_attempts: 1,
            backoff: Backoff { initial_ms: 1, max_ms: 1 },
            max_in_flight: None,
            subscriber: None,
            max_rate: None,
            burst: None,
            breaker: None,
            retry_statuses: vec![],
            previous_secret: Some("whsec_b2xkc2VjcmV0b2xkc2VjcmV0".into()),
            previous_secret_until: Some(1),
            headers: BTreeMap::from([("x-api-key".into(), "hidden-value".into())]),
            auth: None,
            format: DeliveryFormat::Raw,
            ce_type: None,
            batch: None,
            outputs: vec![],
        };
        let shown = format!("{registration:?}");
        for secret in
            ["whsec_c2VjcmV0c2VjcmV0", "whsec_b2xkc2VjcmV0b2xkc2VjcmV0", "abc123", "pw@", "frag", "hidden-value"]
        {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("https://hooks.example/orders"), "{shown}");
    }
}
