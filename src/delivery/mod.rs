//! What every endpoint shares: the message handed out and what of it may
//! leave keygate, the verdict an answer means and the retry backoff (and
//! each message's, for a batched delivery), the WebSocket frames, and the outboxes of WebSocket and HTTP pull clients.
//! Webhooks are `crate::webhook`; the dead-letter stream is
//! `crate::dead_letters`.

pub mod batch_verdict;
pub mod custody;
pub mod frames;
pub mod message;
pub mod outputs;
pub mod pull;
pub mod verdict;
pub mod websocket;

/// How an endpoint that asked for batches takes them (a webhook's `batch`,
/// a WebSocket join's `batch`), in the units the batch workers count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most messages in one batch.
    pub max_messages: usize,
    /// Most payload bytes in one batch (a single larger message goes alone).
    pub max_bytes: usize,
    /// How long a batch that is not full waits for more.
    pub max_wait: std::time::Duration,
}

/// A client's verdict that names no delivery waiting for one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    /// No message of this id waits for a verdict on this WebSocket connection.
    #[error("no message {0} is waiting for a verdict")]
    NotWaiting(String),
    /// No pull delivery of this ack id waits: settled, or its visibility
    /// timeout ran out.
    #[error("no delivery {0} waits for a verdict (settled, or its visibility timeout ran out)")]
    NotHandedOut(String),
}

/// A value fit for an HTTP header: visible ASCII kept, everything else
/// (including `%`) percent-escaped as UTF-8.
pub fn header_safe(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if (0x21..=0x7e).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The value [`header_safe`] was made from; `None` when `escaped` is not
/// one of its answers.
pub fn header_unescaped(escaped: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(escaped.len());
    let mut rest = escaped.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        if byte == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(byte);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_values_escape_what_http_cannot_carry() {
        assert_eq!(super::header_safe("alice"), "alice");
        assert_eq!(super::header_safe("a b%"), "a%20b%25");
        assert_eq!(super::header_safe("ключ"), "%D0%BA%D0%BB%D1%8E%D1%87");
    }

    #[test]
    fn escaped_header_values_come_back_whole() {
        for value in ["alice", "a b%", "ключ", "", "%%41", "tab\there"] {
            assert_eq!(super::header_unescaped(&super::header_safe(value)).as_deref(), Some(value));
        }
        assert_eq!(super::header_unescaped("%4"), None);
        assert_eq!(super::header_unescaped("%ZZ"), None);
        assert_eq!(super::header_unescaped("%FF"), None, "not UTF-8");
    }
}
