//! What publishing can fail with, by kind.

use crate::error::{flows_into, Class, Error, Kind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishErrorKind {
    /// The message is malformed: its key, subject, headers or data.
    InvalidMessage,
    /// The stream or subject is keygate's or the server's own.
    Reserved,
    /// The message is larger than the server or the stream accepts.
    TooLarge,
    /// The subject belongs to another stream than the one named.
    WrongStream,
    /// A limit with discard new: the stream takes nothing more now.
    StreamFull,
    /// JetStream did not acknowledge the message (a retry with the same
    /// msg_id stores it once).
    NotAcknowledged,
    /// The stream does not allow atomic batches.
    AtomicNotAllowed,
    /// The server refused an atomic batch.
    AtomicRefused,
    /// Not sent because an earlier item of the batch, of the same key,
    /// failed (with this class): storing it would break the key's order.
    NotSent(Class),
    Unavailable,
    Internal,
    Other(Class),
}

impl Kind for PublishErrorKind {
    fn class(self) -> Class {
        match self {
            Self::InvalidMessage | Self::WrongStream | Self::AtomicRefused => Class::Invalid,
            Self::Reserved => Class::Reserved,
            Self::TooLarge => Class::TooLarge,
            Self::AtomicNotAllowed => Class::Conflict,
            Self::StreamFull | Self::NotAcknowledged | Self::Unavailable => Class::Unavailable,
            Self::Internal => Class::Internal,
            Self::NotSent(class) | Self::Other(class) => class,
        }
    }

    fn from_class(class: Class) -> Self {
        match class {
            Class::Unavailable => Self::Unavailable,
            Class::Internal => Self::Internal,
            other => Self::Other(other),
        }
    }
}

pub type PublishError = Error<PublishErrorKind>;

flows_into!(PublishErrorKind: crate::nats::errors::BrokerErrorKind, crate::streams::StreamErrorKind);

impl PublishError {
    /// The error for a batch item not sent because item `first`, of the
    /// same subject (key), failed before it with this error.
    pub fn refusing_after(&self, first: usize) -> PublishError {
        let class = match self.class() {
            c @ (Class::Invalid | Class::TooLarge | Class::Unprocessable | Class::Conflict | Class::Reserved) => c,
            _ => Class::Unavailable,
        };
        let message = format!("not sent: item {first} of this batch, of the same key, failed first ({self})");
        Error::new(PublishErrorKind::NotSent(class), message)
    }

    /// The error for an atomic batch whose item `index` is refused with
    /// this error: the whole batch is, with that item's kind.
    pub fn refusing_in_atomic_batch(&self, index: usize) -> PublishError {
        let kind = match self.class() {
            Class::TooLarge | Class::Reserved | Class::Unavailable => self.kind(),
            _ => PublishErrorKind::InvalidMessage,
        };
        Error::new(kind, format!("atomic batch refused, nothing stored: item {index}: {self}"))
    }
}
