//! Partitioned consumer groups, wire-compatible with Go's pcgroups.

pub mod admin;
pub mod config;
mod inspect;
mod pending;
pub mod source_watch;
pub mod spec;
pub mod store;
pub mod view;

pub use spec::{GroupConfig, GroupKind, GroupSpec, Ordering};
pub use store::{GroupAdmin, GroupSettings};
