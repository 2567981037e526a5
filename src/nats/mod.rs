//! Everything that talks to NATS directly: the connection, the embedded
//! server, the classification of broker errors, shared subscriptions,
//! publishes sent together, opening KV buckets and scanning their keys.

pub mod buckets;
pub mod connect;
pub mod embedded;
pub mod errors;
pub mod kv_scan;
pub mod outbox;
pub mod replicas;
pub mod shared;
