//! Stream, group and member names, parsed once at the edge.
//!
//! They end up in KV keys (`<stream>.<group>`), consumer names
//! (`<group>-<member>`, `<member>`) and work-queue stream names
//! (`<stream>-<group>`), so they are held to the characters every one of those
//! accepts.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} name {value:?} is invalid: use 1 to {max} characters of A-Z a-z 0-9 _ -")]
pub struct NameError {
    pub kind: &'static str,
    pub value: String,
    pub max: usize,
}

fn check(kind: &'static str, value: &str, max: usize) -> Result<(), NameError> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(NameError { kind, value: value.to_owned(), max })
    }
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Accepts the name if it is valid.
            pub fn parse(value: &str) -> Result<Self, NameError> {
                check($kind, value, $max).map(|()| Self(value.to_owned()))
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let raw = String::deserialize(d)?;
                Self::parse(&raw).map_err(serde::de::Error::custom)
            }
        }
    };
}

name_type!(
    /// A JetStream stream name.
    StreamName, "stream", 128
);
name_type!(
    /// A consumer group name.
    GroupName, "group", 64
);
name_type!(
    /// A group member name.
    MemberName, "member", 64
);
name_type!(
    /// A durable consumer name.
    ConsumerName, "consumer", 64
);

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_accept_consumer_safe_characters_only() {
        assert!(StreamName::parse("ORDERS_v2-eu").is_ok());
        for bad in ["", "a.b", "a b", "a*", "a>", "a/b", "ä", &"x".repeat(129)] {
            assert!(StreamName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(GroupName::parse(&"g".repeat(64)).is_ok());
        assert!(GroupName::parse(&"g".repeat(65)).is_err());
        let err = MemberName::parse("m.1").unwrap_err();
        assert!(err.to_string().contains("member name \"m.1\""));
    }
}
