//! Fencing tokens: a counter per member in KV, raised by compare-and-set
//! whenever an instance gains the member's pin, so it grows across
//! instances and restarts.

use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;

use crate::nats::buckets::{BucketSpec, Buckets};
use crate::nats::errors::BrokerError;

/// KV bucket of fencing counters, key `<stream>.<group>.<member>`.
pub const FENCING_BUCKET: &str = "keygate-fencing";

/// The longest one attempt to raise a token may take. The driver's loop
/// waits for it, so while the bucket has no leader (a node lost) a request
/// waiting out NATS's own 5 s timeout held the instance's pulls, keep-alive
/// rounds and pin checks for those 5 s, again at every retry. A healthy
/// bucket answers in milliseconds; a pin whose token is not raised in time
/// stays pending and is retried at the next pin check.
pub const PATIENCE: Duration = Duration::from_secs(1);

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
    #[error("the fencing bucket did not answer within {PATIENCE:?}")]
    TookTooLong,
}

/// Raises the member's fencing token and returns the new value, or gives
/// up after [`PATIENCE`]. A token written just as time runs out is only
/// skipped: the next raise counts on from it.
pub async fn next_token(buckets: &Buckets, key: &str) -> Result<u64, FencingError> {
    tokio::time::timeout(PATIENCE, raise(buckets, key)).await.unwrap_or(Err(FencingError::TookTooLong))
}

async fn raise(buckets: &Buckets, key: &str) -> Result<u64, FencingError> {
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
