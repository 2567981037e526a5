//! The dead-letter stream, `KEYGATE_DEAD_LETTERS`: terminated messages are
//! copied there with why they failed (`record.rs`), read back as letters
//! (`letter.rs`, pure), chosen by filters (`filter.rs`, pure), listed,
//! fetched and deleted (`archive.rs`) and redriven to the stream they came
//! from (`redrive.rs`). docs/operations.md describes the resource.

mod archive;
mod filter;
mod letter;
mod record;
mod redrive;

pub use archive::{Archive, Page, MAX_PAGE, PAGE_BYTES, SCAN_BUDGET};
pub use filter::{Cursor, DeadLetterQuery, Filter, Selection};
pub use letter::{DeadLetterView, Letter, Redriven};
pub use record::{dead_letter_id, record, DeadLetter, RecordError, Stored};
pub use redrive::{redrive_in_order, RedriveOutcome};

/// What reading, redriving or deleting dead letters can fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterErrorKind {
    /// A query parameter or cursor is invalid.
    InvalidQuery,
    /// The letter's stream is keygate's or the server's own.
    Reserved,
    /// An earlier letter of the same key could not go back; this one waits.
    HeldBehindEarlier,
    Unavailable,
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(DeadLetterErrorKind {
    InvalidQuery => Invalid,
    Reserved => Reserved,
    HeldBehindEarlier => Conflict,
});
crate::error::flows_into!(
    DeadLetterErrorKind: crate::nats::errors::BrokerErrorKind,
    crate::streams::StreamErrorKind,
    crate::publish::PublishErrorKind,
);

pub type DeadLetterError = crate::error::Error<DeadLetterErrorKind>;

/// Stream keeping dead letters.
pub const DEAD_LETTER_STREAM: &str = "KEYGATE_DEAD_LETTERS";
/// Its subjects: `keygate.dlq.<stream>.<group or consumer>.<member>`.
pub const DEAD_LETTER_SUBJECTS: &str = "keygate.dlq.>";
/// The bucket remembering which letters were redriven, and where to.
pub const REDRIVES_BUCKET: &str = "keygate-dead-letter-redrives";
pub use crate::publish::REDRIVEN_FROM;

/// The headers keygate adds to a dead letter beside the message's own.
mod headers {
    pub const STREAM: &str = "keygate-stream";
    pub const GROUP: &str = "keygate-group";
    pub const MEMBER: &str = "keygate-member";
    pub const SUBJECT: &str = "keygate-subject";
    pub const PARTITION: &str = "keygate-partition";
    pub const STREAM_SEQ: &str = "keygate-stream-seq";
    pub const ATTEMPTS: &str = "keygate-attempts";
    pub const REASON: &str = "keygate-reason";
    pub const KEY: &str = "keygate-key";
    pub const OWNER: &str = "keygate-owner";

    /// Every one of them: they describe the letter, not the message, and a
    /// redrive leaves them out.
    pub const ALL: [&str; 10] = [STREAM, GROUP, MEMBER, SUBJECT, PARTITION, STREAM_SEQ, ATTEMPTS, REASON, KEY, OWNER];
}
