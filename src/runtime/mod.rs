//! The instance runtime: every place a group member or a plain consumer's
//! subscriber is served (a webhook on every replica, a WebSocket
//! connection, an HTTP pull client) runs one instance of the same driver.
//! - `instance.rs`: pause/probe → join → drive → rejoin, for either target;
//! - `driver/`: one run against the joined consumer: pulls, the pin and its
//!   handover barrier, fencing, and dispatch by lanes (key or partition
//!   order) or by plain concurrency (with the shuffle window);
//! - `lanes.rs`, `pin.rs`, `pull.rs`: the pure cores the driver feeds;
//! - `deliver.rs`: one delivery and what its verdict does;
//! - `runtime/supervisor.rs`, `runtime/pull_instances.rs`: who starts instances.

pub mod config_watch;
pub mod context;
pub mod deliver;
pub mod driver;
pub mod fencing;
pub mod instance;
pub mod join;
pub mod lanes;
pub mod pin;
pub mod pull;
pub mod pull_instances;
pub mod shuffle_window;
pub mod supervisor;
pub mod target;
pub mod window_share;
