//! The REST shape of a group (what `PUT …/groups/{group}` takes) and its
//! translation into pcgroups configurations. Pure: no I/O.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::config::{
    elastic_stream_name, member_filter_subjects, static_consumer_name, validate_membership,
    validate_partitioning_filters, validate_static_filters, ElasticGroupConfig, MemberMapping, PartitioningFilter,
    StaticGroupConfig,
};
use super::{GroupError as Error, GroupErrorKind as Kind};
use crate::names::MemberName;

/// Most partitions a group may have.
pub const MAX_PARTITIONS: u32 = 4096;

/// The two flavours of partitioned consumer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum GroupKind {
    /// Over a partition-stamped stream; durable consumer `<group>-<member>`; fixed membership.
    Static,
    /// Over any stream, sourced into work-queue stream `<stream>-<group>`; live membership.
    Elastic,
}

impl GroupKind {
    /// The name used in URLs and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Elastic => "elastic",
        }
    }
}

/// What a group keeps in order (docs/guarantees.md, "Per-key order").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// One message in flight per partition: every key of a partition waits
    /// for the partition's head (pcgroups' behaviour).
    Partition,
    /// One message in flight per key: keys of a partition overtake each
    /// other, each key stays in order.
    Key,
}

impl Ordering {
    /// What a group created by keygate keeps when `ordering` is not given.
    pub const FOR_NEW_GROUPS: Ordering = Ordering::Key;
    /// What a group without a stored ordering keeps: groups made before the
    /// option existed, and groups made by Go pcgroups.
    pub const UNSTATED: Ordering = Ordering::Partition;

    /// The name used in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Partition => "partition",
            Self::Key => "key",
        }
    }
}

/// One member and the partitions it owns, in the order given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Mapping {
    /// The member.
    #[schema(value_type = String, example = "m1")]
    pub member: MemberName,
    /// Its partitions.
    pub partitions: Vec<u32>,
}

/// A subject filter an elastic group sources and partitions on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PartitioningFilterSpec {
    /// A filter on the stream's subjects, e.g. `orders.*`.
    #[schema(example = "orders.*")]
    pub filter: String,
    /// 1-based positions of the `*` tokens hashed for the partition. Omitted
    /// or `null`: the whole subject (kept as `null`, apart from `[]`, as Go
    /// compares them).
    #[serde(default)]
    pub wildcards: Option<Vec<u32>>,
}

/// A group as `PUT` creates it.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    /// `static` or `elastic`.
    pub kind: GroupKind,
    /// The partition count; it never changes after creation.
    #[schema(minimum = 1, maximum = 4096, example = 10)]
    pub partitions: u32,
    /// Members sharing the partitions evenly (pcgroups' balanced assignment).
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub members: Option<Vec<MemberName>>,
    /// Or explicit mappings covering every partition exactly once.
    #[serde(default)]
    pub mappings: Option<Vec<Mapping>>,
    /// Static only: subject filters (without the partition token) a member consumes.
    #[serde(default)]
    pub filters: Option<Vec<String>>,
    /// Elastic only: filters sourced from the stream and how each is partitioned.
    /// Omitted: every subject, hashed whole.
    #[serde(default)]
    pub partitioning_filters: Option<Vec<PartitioningFilterSpec>>,
    /// Elastic only: most messages buffered in the work-queue stream (0: no limit).
    #[serde(default)]
    pub max_buffered_msgs: Option<i64>,
    /// Elastic only: most bytes buffered in the work-queue stream (0: no limit).
    #[serde(default)]
    pub max_buffered_bytes: Option<i64>,
    /// How long a delivered message may stay un-acked before redelivery; also
    /// the pin's TTL. Default 5000.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub ack_wait_ms: Option<u64>,
    /// `key` (one message in flight per key) or `partition` (one per
    /// partition). New groups: `key`; groups stored without one: `partition`.
    #[serde(default)]
    pub ordering: Option<Ordering>,
}

impl GroupSpec {
    /// A group of `kind` with `partitions`, everything else left to its default.
    pub fn new(kind: GroupKind, partitions: u32) -> Self {
        Self {
            kind,
            partitions,
            members: None,
            mappings: None,
            filters: None,
            partitioning_filters: None,
            max_buffered_msgs: None,
            max_buffered_bytes: None,
            ack_wait_ms: None,
            ordering: None,
        }
    }
}

/// A validated group, ready to store.
#[derive(Debug, Clone, PartialEq)]
pub enum GroupConfig {
    Static(StaticGroupConfig),
    Elastic(ElasticGroupConfig),
}

impl GroupConfig {
    /// Which flavour this is.
    pub fn kind(&self) -> GroupKind {
        match self {
            Self::Static(_) => GroupKind::Static,
            Self::Elastic(_) => GroupKind::Elastic,
        }
    }

    /// The partition count.
    pub fn partitions(&self) -> u32 {
        match self {
            Self::Static(c) => c.max_members,
            Self::Elastic(c) => c.max_members,
        }
    }

    /// Balanced members (empty in mapping mode).
    pub fn members(&self) -> &[String] {
        match self {
            Self::Static(c) => &c.members,
            Self::Elastic(c) => &c.members,
        }
    }

    /// Explicit mappings (empty in balanced mode).
    pub fn mappings(&self) -> &[MemberMapping] {
        match self {
            Self::Static(c) => &c.member_mappings,
            Self::Elastic(c) => &c.member_mappings,
        }
    }

    /// The subject filters a member's consumer builds its filters from.
    pub fn consumer_filters(&self) -> Vec<String> {
        match self {
            Self::Static(c) => c.filters.clone(),
            Self::Elastic(c) => c.filter_subjects(),
        }
    }

    /// The partitions `member` owns (none when it is not a member).
    pub fn partitions_of(&self, member: &str) -> Vec<u32> {
        super::config::ownership(self.partitions(), self.members(), self.mappings())
            .into_iter()
            .find(|(m, _)| m == member)
            .map(|(_, p)| p)
            .unwrap_or_default()
    }

    /// Whether `member` belongs to the group.
    pub fn has_member(&self, member: &str) -> bool {
        match self {
            Self::Static(c) => c.has_member(member),
            Self::Elastic(c) => c.has_member(member),
        }
    }
}

impl GroupSpec {
    /// Checks the spec and builds the configuration pcgroups would store.
    pub fn into_config(self) -> Result<GroupConfig, Error> {
        let bad = |msg: String| Err(Error::new(Kind::InvalidSpec, msg));
        if self.partitions < 1 || self.partitions > MAX_PARTITIONS {
            return bad(format!("partitions must be between 1 and {MAX_PARTITIONS}"));
        }
        if self.ack_wait_ms == Some(0) {
            return bad("ack_wait_ms must be at least 1".into());
        }
        let members: Vec<String> = self.members.unwrap_or_default().iter().map(|m| m.to_string()).collect();
        let mappings: Vec<MemberMapping> = self
            .mappings
            .unwrap_or_default()
            .into_iter()
            .map(|m| MemberMapping { member: m.member.to_string(), partitions: Some(m.partitions) })
            .collect();
        validate_membership(self.partitions, &members, &mappings)
            .map_err(|e| Error::new(Kind::InvalidSpec, e.to_string()))?;
        match self.kind {
            GroupKind::Static => {
                if self.partitioning_filters.is_some() {
                    return bad("partitioning_filters applies to elastic groups; a static group takes filters".into());
                }
                if self.max_buffered_msgs.is_some() || self.max_buffered_bytes.is_some() {
                    return bad("max_buffered_msgs and max_buffered_bytes apply to elastic groups only".into());
                }
                let filters = self.filters.unwrap_or_default();
                validate_static_filters(&filters).map_err(|e| Error::new(Kind::InvalidSpec, e.to_string()))?;
                Ok(GroupConfig::Static(StaticGroupConfig {
                    max_members: self.partitions,
                    filters,
                    members,
                    member_mappings: mappings,
                    unknown: Default::default(),
                }))
            }
            GroupKind::Elastic => {
                if self.filters.is_some() {
                    return bad("filters applies to static groups; an elastic group takes partitioning_filters".into());
                }
                let partitioning_filters: Option<Vec<PartitioningFilter>> = self.partitioning_filters.map(|list| {
                    list.into_iter()
                        .map(|pf| PartitioningFilter { filter: pf.filter, partitioning_wildcards: pf.wildcards })
                        .collect()
                });
                validate_partitioning_filters(partitioning_filters.as_deref().unwrap_or_default())
                    .map_err(|e| Error::new(Kind::InvalidSpec, e.to_string()))?;
                let max_buffered_msgs = self.max_buffered_msgs.unwrap_or(0);
                let max_buffered_bytes = self.max_buffered_bytes.unwrap_or(0);
                if max_buffered_msgs < 0 || max_buffered_bytes < 0 {
                    return bad("max_buffered_msgs and max_buffered_bytes must not be negative".into());
                }
                Ok(GroupConfig::Elastic(ElasticGroupConfig {
                    max_members: self.partitions,
                    partitioning_filters,
                    max_buffered_msgs,
                    max_buffered_bytes,
                    members,
                    member_mappings: mappings,
                    unknown: Default::default(),
                }))
            }
        }
    }
}

/// The stream and consumer that serve `member`.
pub fn consumer_of(config: &GroupConfig, stream: &str, group: &str, member: &str) -> (String, String) {
    match config.kind() {
        GroupKind::Static => (stream.to_owned(), static_consumer_name(group, member)),
        GroupKind::Elastic => (elastic_stream_name(stream, group), member.to_owned()),
    }
}

/// The filter subjects `member`'s consumer uses, in pcgroups' order.
pub fn filter_subjects_of(config: &GroupConfig, member: &str) -> Vec<String> {
    member_filter_subjects(config.partitions(), config.members(), config.mappings(), &config.consumer_filters(), member)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> Result<GroupConfig, Error> {
        serde_json::from_value::<GroupSpec>(json).unwrap().into_config()
    }

    #[test]
    fn flavour_specific_fields_are_refused_on_the_other_flavour() {
        assert!(spec(serde_json::json!({"kind":"static","partitions":2,"partitioning_filters":[]})).is_err());
        assert!(spec(serde_json::json!({"kind":"elastic","partitions":2,"filters":["a.*"]})).is_err());
        assert!(spec(serde_json::json!({"kind":"static","partitions":2,"max_buffered_msgs":5})).is_err());
        assert!(spec(serde_json::json!({"kind":"static","partitions":0})).is_err());
    }

    #[test]
    fn omitted_partitioning_filters_stay_null_and_empty_stays_empty() {
        let GroupConfig::Elastic(c) = spec(serde_json::json!({"kind":"elastic","partitions":2})).unwrap() else {
            panic!()
        };
        assert_eq!(c.partitioning_filters, None);
        let GroupConfig::Elastic(c) =
            spec(serde_json::json!({"kind":"elastic","partitions":2,"partitioning_filters":[]})).unwrap()
        else {
            panic!()
        };
        assert_eq!(c.partitioning_filters, Some(vec![]));
    }

    #[test]
    fn both_members_and_mappings_is_a_bad_request() {
        let err = spec(serde_json::json!({"kind":"static","partitions":1,"members":["a"],"mappings":[{"member":"a","partitions":[0]}]}))
            .unwrap_err();
        assert_eq!(err.kind(), Kind::InvalidSpec, "{err:?}");
    }
}
