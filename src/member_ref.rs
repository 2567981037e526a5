//! Who a delivery is for: a group's member, or a plain consumer's
//! subscriber. Every layer names its member this way, so it lives apart
//! from all of them (docs/architecture.md, "Module map").

use crate::names::{GroupName, MemberName, StreamName};

/// Whose delivery failed: a partitioned group's member, or a plain
/// consumer's subscriber (a group and a consumer may share a name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Owner {
    #[default]
    Group,
    Consumer,
}

impl Owner {
    pub fn as_str(self) -> &'static str {
        match self {
            Owner::Group => "group",
            Owner::Consumer => "consumer",
        }
    }
}

/// Which member an instance serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemberRef {
    pub stream: StreamName,
    pub group: GroupName,
    pub member: MemberName,
    /// A group's member, or a plain consumer's subscriber (whose `group`
    /// holds the consumer's name).
    pub owner: Owner,
}
