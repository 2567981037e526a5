//! The member runtime: a member's consumer joined as pcgroups joins it,
//! pinned pulls, partition lanes that keep per-key order, and the
//! supervisor that runs an instance for every registered webhook.

pub mod config_watch;
pub mod consumer;
pub mod control;
pub mod deliver;
pub mod fencing;
pub mod instance;
pub mod lanes;
pub mod observe;
pub mod pull;
pub mod subscriber;
pub mod supervisor;
pub mod window_share;
