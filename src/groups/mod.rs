//! Partitioned consumer groups, wire-compatible with Go's pcgroups.

pub mod admin;
pub mod backlog;
pub mod config;
pub mod source_watch;
pub mod spec;
pub mod view;

pub use admin::GroupAdmin;
pub use spec::{GroupConfig, GroupKind, GroupSpec};
