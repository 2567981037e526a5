//! Where one member instance delivers: a webhook URL, a WebSocket
//! connection or HTTP pull clients. Each gives a verdict per message; the
//! lanes do the rest.

use std::sync::Arc;

use crate::delivery::frames::ServerFrame;
use crate::delivery::pull::PullEndpoint;
use crate::delivery::websocket::SocketEndpoint;
use crate::delivery::BatchLimits;
use crate::names::StreamName;
use crate::webhook::credentials::Credentials;
use crate::webhook::failure_log::FailureLog;
use crate::webhook::protection::Protection;
use crate::webhook::signing::{SecretError, Signer};
use crate::webhook::{Backoff, Registration, WebhookClient};

/// A member instance's endpoint.
pub enum Endpoint {
    Webhook(Box<WebhookEndpoint>),
    Socket(Arc<SocketEndpoint>),
    Pull(Arc<PullEndpoint>),
}

/// A webhook as one instance calls it.
pub struct WebhookEndpoint {
    pub registration: Registration,
    /// The registration's URL, parsed once: parsing it for every delivery
    /// was a visible share of a delivery's CPU in a profile.
    pub uri: http::Uri,
    pub signer: Signer,
    pub protection: Protection,
    pub credentials: Credentials,
    /// Failed requests, logged without flooding the log.
    pub failures: FailureLog,
}

/// Why a stored registration cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum UnusableRegistration {
    #[error("its secret: {0}")]
    Secret(#[from] SecretError),
    /// Registrations are checked when stored; only a stored value edited
    /// by hand gets here, and the URL is left out of logs (it may hold a token).
    #[error("its URL does not parse")]
    Url,
}

impl Endpoint {
    /// A webhook endpoint with the signing keys, rate limit and breaker its
    /// registration holds.
    pub fn webhook(registration: Registration, client: &WebhookClient) -> Result<Self, UnusableRegistration> {
        let signer = registration.signer()?;
        // Through the URL parser first, which registering used: the URI is its
        // normal form (host names in punycode, paths escaped).
        let mut url = reqwest::Url::parse(&registration.url).map_err(|_| UnusableRegistration::Url)?;
        url.set_fragment(None);
        let uri = http::Uri::try_from(url.as_str()).map_err(|_| UnusableRegistration::Url)?;
        let protection = Protection::of(&registration);
        let credentials = client.credentials(registration.auth.as_ref());
        Ok(Self::Webhook(Box::new(WebhookEndpoint {
            registration,
            uri,
            signer,
            protection,
            credentials,
            failures: FailureLog::default(),
        })))
    }

    /// The rate limit and breaker (none for a WebSocket or pull client:
    /// the client paces itself).
    pub fn protection(&self) -> Option<&Protection> {
        match self {
            Self::Webhook(webhook) => Some(&webhook.protection),
            Self::Socket(_) | Self::Pull(_) => None,
        }
    }

    /// Streams its answers may publish to (docs/pipelines.md).
    pub fn declared_outputs(&self) -> &[StreamName] {
        match self {
            Self::Webhook(webhook) => &webhook.registration.outputs,
            Self::Socket(socket) => &socket.outputs,
            Self::Pull(pull) => &pull.outputs,
        }
    }

    /// Deliveries of one message before it is dead-lettered.
    pub fn max_attempts(&self) -> u64 {
        match self {
            Self::Webhook(webhook) => webhook.registration.max_attempts,
            Self::Socket(socket) => socket.max_attempts,
            Self::Pull(pull) => pull.max_attempts,
        }
    }

    /// Most deliveries in flight at once, when the registration sets it;
    /// one while the breaker probes.
    pub fn max_in_flight(&self) -> Option<usize> {
        match self {
            Self::Webhook(webhook) if webhook.protection.probing() => Some(1),
            Self::Webhook(webhook) => webhook.registration.max_in_flight,
            Self::Socket(socket) => socket.max_in_flight,
            Self::Pull(pull) => pull.max_in_flight,
        }
    }

    /// How the endpoint takes batches, if it asked for them (a webhook's
    /// registration, a WebSocket's join); pull clients fetch their own.
    pub fn batch(&self) -> Option<BatchLimits> {
        match self {
            Self::Webhook(webhook) => webhook.registration.batch.map(|spec| spec.limits()),
            Self::Socket(socket) => socket.batch,
            Self::Pull(_) => None,
        }
    }

    /// How long a claimed breaker probe holds before another replica may
    /// claim it: the probe interval, or long enough for a delivery to
    /// time out twice. `None` when the endpoint has no probing breaker.
    pub fn probe_lease(&self) -> Option<std::time::Duration> {
        let Self::Webhook(webhook) = self else { return None };
        let WebhookEndpoint { registration, protection, .. } = &**webhook;
        let interval = std::time::Duration::from_millis(protection.breaker()?.probe_interval_ms?);
        let delivery = std::time::Duration::from_millis(registration.timeout_ms);
        Some(interval.max(delivery * 2 + std::time::Duration::from_secs(30)))
    }

    /// Retry backoff when the endpoint names no delay.
    pub fn backoff(&self) -> Backoff {
        match self {
            Self::Webhook(webhook) => webhook.registration.backoff,
            Self::Socket(socket) => socket.backoff,
            Self::Pull(pull) => pull.backoff,
        }
    }

    /// Tells a WebSocket client about its pin and partitions, or keeps
    /// them for pull clients' fetch answers (webhooks learn them from the
    /// events instead).
    pub fn notify(&self, frame: impl FnOnce() -> ServerFrame) {
        match self {
            Self::Socket(socket) => socket.notify(frame()),
            Self::Pull(pull) => pull.notify(frame()),
            Self::Webhook(_) => {}
        }
    }
}
