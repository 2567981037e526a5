//! Everything that talks to NATS directly: the connection, the embedded
//! server, the classification of broker errors, shared subscriptions,
//! publishes sent together, and opening KV buckets.

pub mod buckets;
pub mod connect;
pub mod embedded;
pub mod errors;
pub mod outbox;
pub mod replicas;
pub mod shared;
