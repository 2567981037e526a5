//! keygate: Kafka-style ordered-per-key processing on NATS JetStream for any
//! HTTP or WebSocket client.
//!
//! The library is the app: the binary parses its command line and calls
//! [`run`] (or the admin CLI in [`cli`]). What is public here is what the
//! binary, the integration tests, the benches and the fuzz targets reach;
//! everything else is internal, and tests reach it through the HTTP API
//! or the test kit (`testkit/`). docs/architecture.md has the module map.

mod app;
mod auth;
pub mod cli;
mod cloudevents;
pub mod cluster;
mod consumers;
pub mod dead_letters;
mod delivery;
pub mod error;
mod events;
#[cfg(test)]
mod future_size;
mod groups;
pub mod http;
pub mod names;
pub mod nats;
pub mod partition;
mod pauses;
pub mod publish;
pub mod runtime;
mod seek;
pub mod settings;
mod status;
pub mod streams;
pub mod telemetry;
mod webhook;

pub use app::run;
pub use settings::Settings;
