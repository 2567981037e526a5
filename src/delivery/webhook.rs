//! Webhook members: registrations (stored in keygate's own KV bucket, so
//! every replica serves them) and the hardened HTTP client that calls them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::credentials::{check_headers, Credentials, OutboundAuth};
use super::destination::DestinationPolicy;
use super::signing::{SecretError, Signer, SigningKey};
use super::verdict::{judge, Judgement, Response, RetryPolicy};
use crate::error::Error;
use crate::nats::buckets::{BucketSpec, Buckets};
use crate::nats::errors::{is_not_found, unavailable_or_internal};

/// KV bucket of webhook registrations, key `<stream>.<group>.<member>`.
pub const WEBHOOKS_BUCKET: &str = "keygate-webhooks";
/// Most bytes of a response body keygate reads.
pub const MAX_RESPONSE_BODY: usize = 64 * 1024;
/// Longest `Retry-After` honoured.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(15 * 60);

/// Retry backoff: `initial_ms` doubling up to `max_ms`, with jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Backoff {
    #[schema(minimum = 1, example = 500)]
    pub initial_ms: u64,
    #[schema(minimum = 1, example = 60000)]
    pub max_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { initial_ms: 500, max_ms: 60_000 }
    }
}

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
            previous_secret_expires_at: r.previous_secret_expires(),
            secret,
        }
    }
}

/// Most deliveries a member may have in flight: the consumer's default
/// `max_ack_pending` (1000), past which the server sends no more anyway.
pub const MAX_IN_FLIGHT: usize = 1000;
/// Deliveries in flight under key ordering when the member sets none.
pub const DEFAULT_KEY_IN_FLIGHT: usize = 256;

/// Refuses a `max_in_flight` outside 1 to [`MAX_IN_FLIGHT`].
pub fn check_max_in_flight(max_in_flight: Option<usize>) -> Result<(), Error> {
    match max_in_flight {
        Some(n) if !(1..=MAX_IN_FLIGHT).contains(&n) => {
            Err(Error::Invalid(format!("max_in_flight must be between 1 and {MAX_IN_FLIGHT}")))
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
            s if s > MAX_ROTATION_OVERLAP_S => {
                Err(Error::Invalid(format!("overlap_s must be at most {MAX_ROTATION_OVERLAP_S} (a week)")))
            }
            s => Ok(Duration::from_secs(s)),
        }
    }
}

/// Refuses rate, breaker and retry settings keygate cannot apply.
fn check_protection(spec: &WebhookSpec) -> Result<(), Error> {
    let bad = |m: &str| Err(Error::Invalid(m.to_owned()));
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

/// Registrations over one JetStream context.
#[derive(Clone)]
pub struct WebhookStore {
    js: jetstream::Context,
    buckets: Buckets,
    policy: Arc<DestinationPolicy>,
    bucket: &'static str,
}

impl WebhookStore {
    /// Members' registrations through `js`, checked against `policy`.
    pub fn new(buckets: Buckets, policy: Arc<DestinationPolicy>) -> Self {
        Self { js: buckets.js().clone(), buckets, policy, bucket: WEBHOOKS_BUCKET }
    }

    /// Consumer subscribers' registrations.
    pub fn for_consumers(buckets: Buckets, policy: Arc<DestinationPolicy>) -> Self {
        Self { js: buckets.js().clone(), buckets, policy, bucket: CONSUMER_WEBHOOKS_BUCKET }
    }

    /// The bucket, created when missing.
    pub async fn bucket(&self) -> Result<kv::Store, Error> {
        self.buckets.open_or_create(BucketSpec::state(self.bucket, "")).await
    }

    /// Registers or replaces a webhook. Returns whether it was new.
    pub async fn put(&self, key: &str, spec: WebhookSpec) -> Result<(bool, Registration, Option<String>), Error> {
        self.put_with(key, spec, None).await
    }

    /// Registers or replaces a webhook with subscriber options.
    pub async fn put_with(
        &self,
        key: &str,
        spec: WebhookSpec,
        subscriber: Option<SubscriberOptions>,
    ) -> Result<(bool, Registration, Option<String>), Error> {
        let url = self.policy.check_url(&spec.url).await.map_err(Error::Unprocessable)?;
        let timeout_ms = spec.timeout_ms.unwrap_or(10_000);
        if !(1..=300_000).contains(&timeout_ms) {
            return Err(Error::Invalid("timeout_ms must be between 1 and 300000".into()));
        }
        let max_attempts = spec.max_attempts.unwrap_or(10);
        if !(1..=1000).contains(&max_attempts) {
            return Err(Error::Invalid("max_attempts must be between 1 and 1000".into()));
        }
        let backoff = spec.backoff.unwrap_or_default();
        if backoff.initial_ms == 0 || backoff.max_ms < backoff.initial_ms {
            return Err(Error::Invalid("backoff needs 0 < initial_ms <= max_ms".into()));
        }
        check_max_in_flight(spec.max_in_flight)?;
        if spec.max_in_flight.is_some() && subscriber.is_some() {
            return Err(Error::Invalid("max_in_flight is for group members; a subscriber takes concurrency".into()));
        }
        if let Some(secret) = &spec.secret {
            SigningKey::parse(secret).map_err(|e| Error::Invalid(e.to_string()))?;
        }
        check_protection(&spec)?;
        if let Some(headers) = &spec.headers {
            check_headers(headers)?;
        }
        if let Some(auth) = &spec.auth {
            auth.check(&self.policy).await?;
        }
        let format = spec.format.unwrap_or_default();
        if let Some(event_type) = &spec.ce_type {
            if format != DeliveryFormat::Cloudevents {
                return Err(Error::Invalid("ce_type goes with \"format\": \"cloudevents\"".into()));
            }
            crate::cloudevents::check_event_type(event_type).map_err(Error::Invalid)?;
        }
        let store = self.bucket().await?;
        let existing = self.read(&store, key).await?;
        let mut generated = None;
        let secret_given = spec.secret.is_some();
        let secret = match (spec.secret, &existing) {
            (Some(given), _) => given,
            (None, Some(old)) => old.secret.clone(),
            (None, None) => {
                let new = SigningKey::generate();
                generated = Some(new.clone());
                new
            }
        };
        let registration = Registration {
            url: url.to_string(),
            secret,
            timeout_ms,
            max_attempts,
            backoff,
            max_in_flight: spec.max_in_flight,
            subscriber,
            max_rate: spec.max_rate,
            burst: spec.burst,
            breaker: spec.breaker,
            retry_statuses: spec.retry_statuses.unwrap_or_default(),
            // A PUT that names its secret ends any rotation's overlap; one
            // that keeps the secret keeps it.
            previous_secret: existing.as_ref().filter(|_| !secret_given).and_then(|old| old.previous_secret.clone()),
            previous_secret_until: existing
                .as_ref()
                .filter(|_| !secret_given)
                .and_then(|old| old.previous_secret_until),
            headers: spec.headers.unwrap_or_default(),
            auth: spec.auth,
            format,
            ce_type: spec.ce_type,
        };
        let bytes = Bytes::from(serde_json::to_vec(&registration).unwrap_or_default());
        store.put(key, bytes).await.map_err(|e| unavailable_or_internal("storing webhook", e))?;
        Ok((existing.is_none(), registration, generated))
    }

    async fn read(&self, store: &kv::Store, key: &str) -> Result<Option<Registration>, Error> {
        let value = store.get(key).await.map_err(|e| unavailable_or_internal("reading webhook", e))?;
        Ok(value.and_then(|v| serde_json::from_slice(&v).ok()))
    }

    /// A member's registration.
    pub async fn get(&self, key: &str) -> Result<Option<Registration>, Error> {
        match self.js.get_key_value(self.bucket).await {
            Ok(store) => self.read(&store, key).await,
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(unavailable_or_internal("reading webhook", e)),
        }
    }

    /// Removes every registration whose key lies under `prefix`, which ends
    /// in a dot (a deleted consumer's subscribers: `{stream}.{consumer}.`).
    pub async fn delete_prefixed(&self, prefix: &str) -> Result<usize, Error> {
        let store = match self.js.get_key_value(self.bucket).await {
            Ok(store) => store,
            Err(e) if is_not_found(&e) => return Ok(0),
            Err(e) => return Err(unavailable_or_internal("reading webhooks", e)),
        };
        let registered = crate::nats::kv_scan::live_entries(&self.js, &store, &format!("{prefix}>")).await?;
        let mut removed = 0;
        for (key, _) in registered {
            store.delete(&key).await.map_err(|e| unavailable_or_internal("deleting webhook", e))?;
            removed += 1;
        }
        Ok(removed)
    }

    /// Replaces the registration's secret with a new one; the old one keeps
    /// signing beside it for `overlap`. `None` when nothing is registered.
    /// Compare-and-set: a concurrent change makes it a 409.
    pub async fn rotate_secret(&self, key: &str, overlap: Duration) -> Result<Option<(Registration, String)>, Error> {
        let store = self.bucket().await?;
        let entry = store.entry(key).await.map_err(|e| unavailable_or_internal("reading webhook", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else { return Ok(None) };
        let Ok(mut registration) = serde_json::from_slice::<Registration>(&entry.value) else { return Ok(None) };
        let new = SigningKey::generate();
        let until = SystemTime::now() + overlap;
        let until_secs = until.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let old = std::mem::replace(&mut registration.secret, new.clone());
        (registration.previous_secret, registration.previous_secret_until) =
            if overlap.is_zero() { (None, None) } else { (Some(old), Some(until_secs)) };
        let bytes = Bytes::from(serde_json::to_vec(&registration).unwrap_or_default());
        match store.update(key, bytes, entry.revision).await {
            Ok(_) => Ok(Some((registration, new))),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                Err(Error::Conflict("the registration changed meanwhile; rotate again".into()))
            }
            Err(e) => Err(unavailable_or_internal("storing webhook", e)),
        }
    }

    /// Removes a member's registration; every replica stops serving it.
    pub async fn delete(&self, key: &str) -> Result<bool, Error> {
        if self.get(key).await?.is_none() {
            return Ok(false);
        }
        let store = self.bucket().await?;
        store.delete(key).await.map_err(|e| unavailable_or_internal("deleting webhook", e))?;
        Ok(true)
    }
}

/// One call to make.
#[derive(Debug, Clone)]
pub struct Outbound {
    /// `webhook-id`: stable across retries.
    pub id: String,
    pub body: Bytes,
    /// Headers besides the signature ones.
    pub headers: Vec<(String, String)>,
}

/// The client that calls webhooks: no redirects, bounded time and bodies,
/// destinations checked on every connection.
#[derive(Clone)]
pub struct WebhookClient {
    http: reqwest::Client,
    policy: Arc<DestinationPolicy>,
}

impl WebhookClient {
    /// A client bound by `policy`.
    pub fn new(policy: Arc<DestinationPolicy>) -> anyhow::Result<Self> {
        let http = super::destination::client_builder(&policy).build()?;
        Ok(Self { http, policy })
    }

    /// `auth`'s credentials for one instance of a registration.
    pub fn credentials(&self, auth: Option<&OutboundAuth>) -> Credentials {
        Credentials::load(auth, &self.policy, &self.http)
    }

    /// POSTs one message and judges the answer.
    pub async fn call(
        &self,
        registration: &Registration,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
    ) -> Judgement {
        let now = SystemTime::now();
        // With credentials, a 401 means they expired or were rotated: they
        // are fetched again and the message retried, not dead-lettered.
        let with_401;
        let retry_statuses = match &registration.auth {
            Some(_) => {
                with_401 = [registration.retry_statuses.as_slice(), &[401]].concat();
                with_401.as_slice()
            }
            None => registration.retry_statuses.as_slice(),
        };
        let policy = RetryPolicy { max_retry_after: MAX_RETRY_AFTER, retry_statuses };
        let timestamp = now.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let signature = signer.sign(&outbound.id, timestamp, &outbound.body, now);
        if let Ok(url) = reqwest::Url::parse(&registration.url) {
            if let Some(ip) = url.host_str().and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok())
            {
                if !self.policy.host_listed(url.host_str().unwrap_or_default()) {
                    if let Some(why) = self.policy.refuse_address(ip) {
                        return judge(&Response::ConnectionError(why), now, policy);
                    }
                }
            }
        }
        let authorization = match credentials.authorization().await {
            Ok(value) => value,
            Err(why) => return judge(&Response::ConnectionError(format!("no credentials: {why}")), now, policy),
        };
        let mut request = credentials
            .client()
            .unwrap_or(&self.http)
            .post(&registration.url)
            .timeout(Duration::from_millis(registration.timeout_ms))
            .header("webhook-id", &outbound.id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature);
        for (name, value) in registration.headers.iter().chain(outbound.headers.iter().map(|(n, v)| (n, v))) {
            request = request.header(name.as_str(), value.as_str());
        }
        if let Some(value) = authorization {
            request = request.header(reqwest::header::AUTHORIZATION, value);
        }
        let response = match request.body(outbound.body.clone()).send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return judge(&Response::Timeout, now, policy),
            // reqwest names the URL in its errors; its query string is often
            // a token, and this text reaches events and dead letters.
            Err(e) => return judge(&Response::ConnectionError(error_chain(&e.without_url())), now, policy),
        };
        let status = response.status().as_u16();
        if status == 401 {
            credentials.refused().await;
        }
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (retry_after, keygate_ack) = (header("retry-after"), header("keygate-ack"));
        let body = match read_capped(response).await {
            Ok(body) => body,
            Err(e) if e.is_timeout() => return judge(&Response::Timeout, now, policy),
            Err(_) => Vec::new(),
        };
        judge(
            &Response::Http {
                status,
                retry_after: retry_after.as_deref(),
                keygate_ack: keygate_ack.as_deref(),
                body: &body,
            },
            now,
            policy,
        )
    }
}

async fn read_capped(mut response: reqwest::Response) -> Result<Vec<u8>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = MAX_RESPONSE_BODY.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= MAX_RESPONSE_BODY {
            break;
        }
    }
    Ok(body)
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

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

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
