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

/// What managing or reading a group can fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupErrorKind {
    /// The group's specification or membership change is invalid.
    InvalidSpec,
    NotFound,
    MemberNotFound,
    /// The member has no consumer: no instance serves it.
    NoConsumer,
    /// The group exists with another configuration or kind.
    ExistsDifferently,
    /// A name the group needs (a consumer, its work-queue stream) is taken.
    NameTaken,
    /// The name is used by a static and an elastic group: give the kind.
    Ambiguous,
    /// The membership cannot change this way (a static group, mappings).
    MembershipFixed,
    /// Another writer changed the group meanwhile.
    ChangedConcurrently,
    /// The stream cannot carry this group (its stamping, its subjects).
    StreamUnsuitable,
    /// The stored configuration does not parse.
    StoredConfigInvalid,
    Unavailable,
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(GroupErrorKind {
    InvalidSpec => Invalid,
    NotFound => NotFound,
    MemberNotFound => NotFound,
    NoConsumer => NotFound,
    ExistsDifferently => Conflict,
    NameTaken => Conflict,
    Ambiguous => Conflict,
    MembershipFixed => Conflict,
    ChangedConcurrently => Conflict,
    StreamUnsuitable => Unprocessable,
    StoredConfigInvalid => Unprocessable,
});
crate::error::flows_into!(GroupErrorKind: crate::nats::errors::BrokerErrorKind, crate::streams::StreamErrorKind);

pub type GroupError = crate::error::Error<GroupErrorKind>;
pub use store::{GroupAdmin, GroupSettings};
