//! Broker errors classified at the boundary: what is the caller's fault,
//! what is worth retrying, what is keygate's own.

use std::fmt::Display;

use crate::error::ApiError;

/// Maps an error from a NATS request to 503 when NATS or JetStream is not
/// answering (retrying may succeed), otherwise to a 500 with the cause logged.
pub fn unavailable_or_internal(what: &str, err: impl Display) -> ApiError {
    let text = err.to_string();
    let lower = text.to_ascii_lowercase();
    let transient = [
        "timed out",
        "timeout",
        "no responders",
        "disconnected",
        "not available",
        "connection",
        "jetstream not enabled",
        "insufficient resources",
        "leader",
    ];
    if transient.iter().any(|needle| lower.contains(needle)) {
        tracing::warn!(error = %text, "{what}: NATS did not answer");
        ApiError::Unavailable(format!("{what}: NATS or JetStream did not answer; retry later"))
    } else {
        ApiError::Internal(format!("{what}: {text}"))
    }
}

/// The answer for a failed read of stream `stream`: 404 when it does not
/// exist (also when it was deleted between two requests of one call), 503
/// when NATS does not answer, else 500.
pub fn stream_read_error(stream: &str, err: impl Display) -> ApiError {
    if is_not_found(&err) {
        ApiError::NotFound(format!("stream {stream} not found"))
    } else {
        unavailable_or_internal("reading stream", err)
    }
}

/// The JetStream API error code carried in an async-nats error's text
/// (`… (code 404, error code 10014)`), if any.
pub fn jetstream_error_code(err: &impl Display) -> Option<u64> {
    let text = err.to_string();
    let at = text.find("error code ")? + "error code ".len();
    let digits: String = text[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Whether a NATS error says the stream or consumer asked for does not exist.
/// async-nats folds the server's codes into per-call error kinds whose text
/// says "not found"; the raw code is checked too.
pub fn is_not_found(err: &impl Display) -> bool {
    matches!(jetstream_error_code(err), Some(codes::STREAM_NOT_FOUND | codes::CONSUMER_NOT_FOUND))
        || err.to_string().to_ascii_lowercase().contains("not found")
}

/// JetStream error codes keygate reacts to.
pub mod codes {
    /// Stream not found.
    pub const STREAM_NOT_FOUND: u64 = 10059;
    /// Consumer not found.
    pub const CONSUMER_NOT_FOUND: u64 = 10014;
    /// Stream name already in use with a different configuration.
    pub const STREAM_NAME_IN_USE: u64 = 10058;
    /// Subjects overlap with an existing stream.
    pub const SUBJECT_OVERLAP: u64 = 10065;
    /// No servers to place the stream's replicas on yet (a cluster that
    /// is forming, or a node down): retry.
    pub const NO_SUITABLE_PEERS: u64 = 10005;
    /// JetStream is temporarily unavailable (no meta leader): retry.
    pub const JETSTREAM_UNAVAILABLE: u64 = 10008;
    /// The stream's byte limit is more than the server's storage can reserve.
    pub const STORAGE_RESOURCES_EXCEEDED: u64 = 10047;
    /// Likewise for memory storage.
    pub const MEMORY_RESOURCES_EXCEEDED: u64 = 10028;
    /// More replicas than the cluster has servers.
    pub const REPLICAS_EXCEED_CLUSTER: u64 = 10074;
}
