//! keygate: Kafka-style ordered-per-key processing on NATS JetStream for any
//! HTTP or WebSocket client.

pub mod app;
pub mod auth;
pub mod cli;
pub mod cloudevents;
pub mod cluster;
pub mod consumers;
pub mod dead_letters;
pub mod delivery;
pub mod error;
pub mod events;
pub mod groups;
pub mod http;
pub mod names;
pub mod nats;
pub mod partition;
pub mod pauses;
pub mod publish;
pub mod runtime;
pub mod seek;
pub mod settings;
pub mod status;
pub mod streams;
pub mod telemetry;
pub mod webhook;

pub use app::{run, AppState};
pub use settings::Settings;
