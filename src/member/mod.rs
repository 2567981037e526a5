//! The member runtime: a member's consumer joined as pcgroups joins it,
//! pinned pulls, partition lanes that keep per-key order, and the verdicts
//! that settle each message. Plain consumers' subscribers (`consumers/`)
//! reuse its context, pull, pin and delivery parts.

pub mod balance;
pub mod config_watch;
pub mod context;
pub mod control;
pub mod deliver;
pub mod fencing;
pub mod instance;
pub mod join;
pub mod lanes;
pub mod pin;
pub mod pull;
pub mod rebalance;
pub mod replicas;
pub mod roster;
pub mod session;
