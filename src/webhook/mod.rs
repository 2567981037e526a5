//! Webhook endpoints: the registration as the API takes and stores it
//! (`registration.rs`), its KV store (`store.rs`), the request one
//! delivery makes (`request.rs`) and its Standard Webhooks signature
//! (`signing.rs`), the hardened client that sends it (`client.rs`: no
//! redirects, bounded time and bodies) over hyper (`transport.rs`) with
//! the destination policy (`destination.rs`) and outbound credentials
//! (`credentials.rs`), the
//! rate limit and breaker (`protection.rs`), and failed requests in the
//! log (`failure_log.rs`). Below the runtime, above
//! `delivery/` (the message, the verdict).

pub mod client;
pub mod credentials;
pub mod destination;
pub mod failure_log;
pub mod protection;
pub mod registration;
pub mod request;
pub mod signing;
pub mod store;
pub mod transport;

pub use crate::delivery::verdict::{Backoff, MAX_RETRY_AFTER};
pub use client::WebhookClient;
pub use registration::*;
pub use store::WebhookStore;

/// What registering, reading or rotating a webhook can fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WebhookErrorKind {
    /// A field of the registration is invalid.
    InvalidRegistration,
    /// The destination policy refuses the URL (or the token URL).
    DestinationRefused,
    /// A credential file outside the allowed directory, or unreadable.
    CredentialRefused,
    /// Another writer changed the registration meanwhile.
    ChangedConcurrently,
    Unavailable,
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(WebhookErrorKind {
    InvalidRegistration => Invalid,
    DestinationRefused => Unprocessable,
    CredentialRefused => Unprocessable,
    ChangedConcurrently => Conflict,
});
crate::error::flows_into!(WebhookErrorKind: crate::nats::errors::BrokerErrorKind);

pub type WebhookError = crate::error::Error<WebhookErrorKind>;
