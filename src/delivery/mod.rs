//! Where messages go: webhooks (signing, verdicts, the hardened client,
//! destination policy), WebSocket connections, and the dead-letter stream.

pub mod dead_letter;
pub mod destination;
pub mod endpoint;
pub mod frames;
pub mod message;
pub mod signing;
pub mod verdict;
pub mod webhook;
pub mod websocket;

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

#[cfg(test)]
mod tests {
    #[test]
    fn header_values_escape_what_http_cannot_carry() {
        assert_eq!(super::header_safe("alice"), "alice");
        assert_eq!(super::header_safe("a b%"), "a%20b%25");
        assert_eq!(super::header_safe("ключ"), "%D0%BA%D0%BB%D1%8E%D1%87");
    }
}
