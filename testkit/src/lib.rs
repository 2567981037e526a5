//! What keygate's tests and benchmarks share (a dev-only crate, as nats.rs
//! keeps its `nats-server` crate): real nats-servers and 3-node clusters on
//! loopback, keygate in-process (`TestApp`) or as its own process,
//! webhook receivers, a WebSocket client, headless Chromium, a cuttable
//! proxy and the benchmark rig. Nothing here mocks NATS.

pub mod app;
pub mod browser;
pub mod cluster;
pub mod keygate;
pub mod nats;
pub mod proxy;
pub mod receiver;
pub mod rig;
pub mod ws;

pub use app::{eventually, http_client, into_parts, TestApp};
pub use keygate::{keygate_binary, metric_at, KeygateProcess, ACKS_WITHOUT_VERDICT};
pub use nats::{free_port, nats_server_binary, LocalNats, NatsEndpoint, NatsServer};
pub use rig::{baseline_consumer, env_or, put, serial_lanes, Rig};
