//! Where one member instance delivers: a webhook URL or a WebSocket
//! connection. Both give a verdict per message; the lanes do the rest.

use std::sync::Arc;

use super::frames::ServerFrame;
use super::signing::SigningKey;
use super::webhook::{Backoff, Registration};
use super::websocket::SocketEndpoint;

/// A member instance's endpoint.
pub enum Endpoint {
    Webhook { registration: Registration, key: SigningKey },
    Socket(Arc<SocketEndpoint>),
}

impl Endpoint {
    /// Deliveries of one message before it is dead-lettered.
    pub fn max_attempts(&self) -> u64 {
        match self {
            Self::Webhook { registration, .. } => registration.max_attempts,
            Self::Socket(socket) => socket.max_attempts,
        }
    }

    /// Most deliveries in flight at once, when the registration sets it.
    pub fn max_in_flight(&self) -> Option<usize> {
        match self {
            Self::Webhook { registration, .. } => registration.max_in_flight,
            Self::Socket(socket) => socket.max_in_flight,
        }
    }

    /// Retry backoff when the endpoint names no delay.
    pub fn backoff(&self) -> Backoff {
        match self {
            Self::Webhook { registration, .. } => registration.backoff,
            Self::Socket(socket) => socket.backoff,
        }
    }

    /// Tells a WebSocket client about its pin and partitions (webhooks
    /// learn them from the events instead).
    pub fn notify(&self, frame: impl FnOnce() -> ServerFrame) {
        if let Self::Socket(socket) = self {
            socket.notify(frame());
        }
    }
}
