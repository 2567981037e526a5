//! Everything that talks to NATS directly: the connection, the embedded
//! server, the classification of broker errors, consumer leader
//! elections, shared subscriptions,
//! publishes sent together, opening KV buckets and scanning their keys.

pub mod buckets;
pub mod connect;
pub mod consumer_leaders;
pub mod embedded;
pub mod errors;
pub mod kv_scan;
pub mod outbox;
pub mod replicas;
pub mod shared;
