//! Everything that talks to NATS directly: the connection, the embedded
//! server, and the classification of broker errors.

pub mod connect;
pub mod embedded;
pub mod errors;
pub mod replicas;
pub mod shared;
