//! Fencing tokens: a counter per member in KV, raised by compare-and-set
//! whenever an instance gains the member's pin, so it grows across
//! instances and restarts.

use async_nats::jetstream::kv;
use bytes::Bytes;

use crate::nats::buckets::{BucketSpec, Buckets};
use crate::nats::errors::BrokerError;

/// KV bucket of fencing counters, key `<stream>.<group>.<member>`.
pub const FENCING_BUCKET: &str = "keygate-fencing";

/// Why a fencing token could not be raised (the pin then stays with its
/// token pending and nothing is delivered).
#[derive(Debug, thiserror::Error)]
pub enum FencingError {
    #[error("the fencing bucket: {0}")]
    Bucket(#[from] BrokerError),
    #[error("reading the fencing counter: {0}")]
    Read(#[from] kv::EntryError),
    #[error("the fencing counter kept changing")]
    KeptChanging,
}

/// Raises the member's fencing token and returns the new value.
pub async fn next_token(buckets: &Buckets, key: &str) -> Result<u64, FencingError> {
    let store = buckets.open_or_create(BucketSpec::state(FENCING_BUCKET, "keygate: fencing tokens per member")).await?;
    for _ in 0..64 {
        let current = store.entry(key).await?;
        let (value, revision) = match &current {
            Some(e) if e.operation == kv::Operation::Put => (
                std::str::from_utf8(&e.value).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0),
                Some(e.revision),
            ),
            Some(e) => (0, Some(e.revision)),
            None => (0, None),
        };
        let next = value + 1;
        let bytes = Bytes::from(next.to_string());
        let written = match revision {
            Some(r) => store.update(key, bytes, r).await.is_ok(),
            None => store.create(key, bytes).await.is_ok(),
        };
        if written {
            return Ok(next);
        }
        tokio::time::sleep(std::time::Duration::from_millis(rand::random_range(1..10))).await;
    }
    Err(FencingError::KeptChanging)
}
