//! What is going on right now, above the groups and the member runtime:
//! a group's view completed by its serving instances' reports, and the
//! backlog sampler behind the pending-messages metric.

pub mod backlog;
pub mod observe;
