//! keygate's domain errors: what went wrong, in terms of streams, groups,
//! consumers and messages. They carry no HTTP status; `http/problem.rs`
//! turns each kind into a problem answer, and the CLI prints them.

/// What a domain operation could not do, and whose fault it is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The input is malformed or invalid.
    #[error("{0}")]
    Invalid(String),
    /// The target is keygate's or the server's own state, which no caller
    /// may write through the data path.
    #[error("{0}")]
    Reserved(String),
    /// The stream, group, consumer or member does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with what exists.
    #[error("{0}")]
    Conflict(String),
    /// A payload or batch larger than allowed.
    #[error("{0}")]
    TooLarge(String),
    /// The caller holds as many of a bounded resource as it may.
    #[error("{0}")]
    TooMany(String),
    /// Well-formed input that cannot be applied (the server refused it).
    #[error("{0}")]
    Unprocessable(String),
    /// NATS or JetStream is unavailable; retrying may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// Anything else: keygate's own fault. The detail is for its log.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// The error for a batch item not sent because item `first`, of the
    /// same subject (key), failed before it: the same kind, saying why.
    pub fn refusing_after(&self, first: usize) -> Error {
        let detail = format!("not sent: item {first} of this batch, of the same key, failed first ({self})");
        match self {
            Self::Invalid(_) => Self::Invalid(detail),
            Self::TooLarge(_) => Self::TooLarge(detail),
            Self::Unprocessable(_) => Self::Unprocessable(detail),
            Self::Conflict(_) => Self::Conflict(detail),
            Self::Reserved(_) => Self::Reserved(detail),
            _ => Self::Unavailable(detail),
        }
    }

    /// The error for an atomic batch whose item `index` is refused: the
    /// whole batch is, with that item's kind.
    pub fn refusing_in_atomic_batch(&self, index: usize) -> Error {
        let detail = format!("atomic batch refused, nothing stored: item {index}: {self}");
        match self {
            Self::TooLarge(_) => Self::TooLarge(detail),
            Self::Reserved(_) => Self::Reserved(detail),
            Self::Unavailable(_) => Self::Unavailable(detail),
            _ => Self::Invalid(detail),
        }
    }
}

impl From<crate::names::NameError> for Error {
    fn from(e: crate::names::NameError) -> Self {
        Self::Invalid(e.to_string())
    }
}
