//! Any text as a message key: encoding gives one valid, non-wildcard subject
//! token that decodes back to the key; decoding any token never panics; the
//! partition is always in range.

#![no_main]

use keygate::partition::{decode_key, encode_key, partition_of_tokens, MAX_KEY_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|key: &str| {
    match encode_key(key) {
        Ok(token) => {
            assert!(!key.is_empty() && key.len() <= MAX_KEY_BYTES);
            assert!(!token.is_empty());
            assert!(token != "*" && token != ">", "{key:?} became a wildcard token");
            assert!(
                !token.chars().any(|c| c == '.' || c.is_whitespace() || c.is_control()),
                "{key:?} became {token:?}, which is not one subject token"
            );
            assert_eq!(decode_key(&token).as_deref(), Some(key), "{key:?} via {token:?}");
        }
        Err(_) => assert!(key.is_empty() || key.len() > MAX_KEY_BYTES, "{key:?} refused"),
    }
    let _ = decode_key(key);
    for partitions in [1, 3, 16, 1024] {
        assert!(partition_of_tokens([key], partitions) < partitions);
    }
});
