//! Webhook registrations in KV: members' and plain consumers' subscribers',
//! checked against the destination policy when stored.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, kv};
use bytes::Bytes;

use super::credentials::check_headers;
use super::destination::DestinationPolicy;
use super::registration::{
    check_max_in_flight, check_protection, DeliveryFormat, Registration, SubscriberOptions, WebhookSpec,
    CONSUMER_WEBHOOKS_BUCKET, DEFAULT_MAX_ATTEMPTS, DEFAULT_TIMEOUT_MS, WEBHOOKS_BUCKET,
};
use super::signing::SigningKey;
use super::{WebhookError as Error, WebhookErrorKind as Kind};
use crate::nats::buckets::{BucketSpec, Buckets};
use crate::nats::errors::{is_not_found, unavailable_or_internal};

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
        Ok(self.buckets.open_or_create(BucketSpec::state(self.bucket, "")).await?)
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
        let url =
            self.policy.check_url(&spec.url).await.map_err(|e| Error::new(Kind::DestinationRefused, e.to_string()))?;
        let timeout_ms = spec.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
        if !(1..=300_000).contains(&timeout_ms) {
            return Err(Error::new(Kind::InvalidRegistration, "timeout_ms must be between 1 and 300000"));
        }
        let max_attempts = spec.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
        if !(1..=1000).contains(&max_attempts) {
            return Err(Error::new(Kind::InvalidRegistration, "max_attempts must be between 1 and 1000"));
        }
        let backoff = spec.backoff.unwrap_or_default();
        if backoff.initial_ms == 0 || backoff.max_ms < backoff.initial_ms {
            return Err(Error::new(Kind::InvalidRegistration, "backoff needs 0 < initial_ms <= max_ms"));
        }
        check_max_in_flight(spec.max_in_flight)?;
        if spec.max_in_flight.is_some() && subscriber.is_some() {
            return Err(Error::new(
                Kind::InvalidRegistration,
                "max_in_flight is for group members; a subscriber takes concurrency",
            ));
        }
        if let Some(secret) = &spec.secret {
            SigningKey::parse(secret).map_err(|e| Error::new(Kind::InvalidRegistration, e.to_string()))?;
        }
        check_protection(&spec)?;
        if let Some(batch) = &spec.batch {
            batch.check()?;
        }
        let outputs = spec.outputs()?;
        if let Some(headers) = &spec.headers {
            check_headers(headers)?;
        }
        if let Some(auth) = &spec.auth {
            auth.check(&self.policy).await?;
        }
        let format = spec.format.unwrap_or_default();
        if let Some(event_type) = &spec.ce_type {
            if format != DeliveryFormat::Cloudevents {
                return Err(Error::new(Kind::InvalidRegistration, "ce_type goes with \"format\": \"cloudevents\""));
            }
            crate::cloudevents::check_event_type(event_type)
                .map_err(|e| Error::new(Kind::InvalidRegistration, e.to_string()))?;
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
            batch: spec.batch,
            outputs,
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
            Err(e) => Err(unavailable_or_internal("reading webhook", e).into()),
        }
    }

    /// Removes every registration whose key lies under `prefix`, which ends
    /// in a dot (a deleted consumer's subscribers: `{stream}.{consumer}.`).
    pub async fn delete_prefixed(&self, prefix: &str) -> Result<usize, Error> {
        let store = match self.js.get_key_value(self.bucket).await {
            Ok(store) => store,
            Err(e) if is_not_found(&e) => return Ok(0),
            Err(e) => return Err(unavailable_or_internal("reading webhooks", e).into()),
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
                Err(Error::new(Kind::ChangedConcurrently, "the registration changed meanwhile; rotate again"))
            }
            Err(e) => Err(unavailable_or_internal("storing webhook", e).into()),
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
