//! pcgroups-compatible group configurations: the exact JSON the Go library
//! reads and writes in its KV buckets, their validation, and the consumer
//! filters a member derives from them. Pure: no I/O.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::partition::{balanced_assignment, SubjectPattern};

/// KV bucket holding static group configurations (pcgroups' name).
pub const STATIC_BUCKET: &str = "static-consumer-groups";
/// KV bucket holding elastic group configurations (pcgroups' name).
pub const ELASTIC_BUCKET: &str = "elastic-consumer-groups";
/// The priority group every member consumer uses.
pub const PRIORITY_GROUP: &str = "PCG";

/// The KV key of a group: `<stream>.<group>`.
pub fn config_key(stream: &str, group: &str) -> String {
    format!("{stream}.{group}")
}

/// The durable consumer of a static group member: `<group>-<member>`.
pub fn static_consumer_name(group: &str, member: &str) -> String {
    format!("{group}-{member}")
}

/// The work-queue stream of an elastic group: `<stream>-<group>`.
pub fn elastic_stream_name(stream: &str, group: &str) -> String {
    format!("{stream}-{group}")
}

/// One member's explicit partitions (mapping mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberMapping {
    pub member: String,
    /// `null` and `[]` are kept apart: Go compares them deeply.
    pub partitions: Option<Vec<u32>>,
}

/// A static group as pcgroups stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StaticGroupConfig {
    pub max_members: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub member_mappings: Vec<MemberMapping>,
    /// Fields a newer writer added: kept when keygate rewrites the value.
    #[serde(flatten)]
    pub unknown: serde_json::Map<String, serde_json::Value>,
}

/// A filter an elastic group sources and partitions on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitioningFilter {
    pub filter: String,
    /// 1-based `*` positions hashed for the partition; `null` / `[]` (kept
    /// apart) hash the whole subject.
    pub partitioning_wildcards: Option<Vec<u32>>,
}

/// An elastic group as pcgroups stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ElasticGroupConfig {
    pub max_members: u32,
    /// Serialized as `null` when absent, exactly as Go writes a nil slice.
    pub partitioning_filters: Option<Vec<PartitioningFilter>>,
    #[serde(rename = "max_buffered_msg", default, skip_serializing_if = "is_zero")]
    pub max_buffered_msgs: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_buffered_bytes: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub member_mappings: Vec<MemberMapping>,
    #[serde(flatten)]
    pub unknown: serde_json::Map<String, serde_json::Value>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// Why a configuration is not valid (pcgroups' rules, same meanings).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("partitions must be at least 1")]
    NoPartitions,
    #[error("give either members or mappings, not both")]
    MembersAndMappings,
    #[error("there must be between 1 and {0} mappings (one per member at most, no more than partitions)")]
    MappingCount(u32),
    #[error("member {0:?} appears in more than one mapping")]
    DuplicateMappingMember(String),
    #[error("partition {0} is mapped more than once")]
    DuplicatePartition(u32),
    #[error("partition {0} is out of range: partitions are 0 to {1}")]
    PartitionOutOfRange(u32, u32),
    #[error("mappings cover {0} of {1} partitions: every partition must be mapped exactly once")]
    IncompleteMappings(usize, u32),
    #[error("filter {0:?}: {1}")]
    Filter(String, String),
}

/// Balanced membership or explicit mappings, checked (pcgroups' rules).
pub fn validate_membership(partitions: u32, members: &[String], mappings: &[MemberMapping]) -> Result<(), ConfigError> {
    if partitions < 1 {
        return Err(ConfigError::NoPartitions);
    }
    if !members.is_empty() && !mappings.is_empty() {
        return Err(ConfigError::MembersAndMappings);
    }
    if mappings.is_empty() {
        return Ok(());
    }
    if mappings.len() > partitions as usize {
        return Err(ConfigError::MappingCount(partitions));
    }
    let mut seen_members = BTreeSet::new();
    let mut seen_partitions = BTreeSet::new();
    for mapping in mappings {
        if !seen_members.insert(mapping.member.as_str()) {
            return Err(ConfigError::DuplicateMappingMember(mapping.member.clone()));
        }
        for &p in mapping.partitions.iter().flatten() {
            if !seen_partitions.insert(p) {
                return Err(ConfigError::DuplicatePartition(p));
            }
            if p >= partitions {
                return Err(ConfigError::PartitionOutOfRange(p, partitions - 1));
            }
        }
    }
    if seen_partitions.len() != partitions as usize {
        return Err(ConfigError::IncompleteMappings(seen_partitions.len(), partitions));
    }
    Ok(())
}

/// A static group's filters: valid subject filters.
pub fn validate_static_filters(filters: &[String]) -> Result<(), ConfigError> {
    for filter in filters {
        SubjectPattern::parse(filter).map_err(|e| ConfigError::Filter(filter.clone(), e.to_string()))?;
    }
    Ok(())
}

/// An elastic group's partitioning filters (pcgroups' rules).
pub fn validate_partitioning_filters(filters: &[PartitioningFilter]) -> Result<(), ConfigError> {
    for pf in filters {
        let fail = |why: &str| ConfigError::Filter(pf.filter.clone(), why.to_owned());
        let pattern = SubjectPattern::parse(&pf.filter).map_err(|e| fail(&e.to_string()))?;
        let stars = pattern.star_count() as u32;
        if stars == 0 && !pattern.has_tail() {
            return Err(fail("a partitioning filter needs at least one * wildcard or a trailing >"));
        }
        let wildcards = pf.partitioning_wildcards.as_deref().unwrap_or_default();
        let mut seen = BTreeSet::new();
        for &w in wildcards {
            if !seen.insert(w) {
                return Err(fail("partitioning wildcard indexes must be unique"));
            }
            if w < 1 || w > stars {
                return Err(fail(&format!(
                    "partitioning wildcard {w} is out of range: the filter has {stars} * wildcard(s)"
                )));
            }
        }
    }
    Ok(())
}

/// Who owns what: `(member, partitions)` in member order (sorted for balanced
/// groups, listed order for mappings).
pub fn ownership(partitions: u32, members: &[String], mappings: &[MemberMapping]) -> Vec<(String, Vec<u32>)> {
    if !members.is_empty() {
        return balanced_assignment(members, partitions).into_iter().collect();
    }
    mappings.iter().map(|m| (m.member.clone(), m.partitions.clone().unwrap_or_default())).collect()
}

/// The filter subjects of a member's consumer, in the order pcgroups builds
/// them, so a Go instance and a keygate instance of one member create
/// identical consumers. Unlike pcgroups, mapping mode with several filters
/// emits each `<p>.>` once (the server refuses duplicates).
pub fn member_filter_subjects(
    partitions: u32,
    members: &[String],
    mappings: &[MemberMapping],
    filters: &[String],
    member: &str,
) -> Vec<String> {
    if !members.is_empty() {
        let owned = balanced_assignment(members, partitions).remove(member).unwrap_or_default();
        if filters.is_empty() {
            return owned.iter().map(|p| format!("{p}.>")).collect();
        }
        return filters.iter().flat_map(|f| owned.iter().map(move |p| format!("{p}.{f}"))).collect();
    }
    mappings
        .iter()
        .filter(|m| m.member == member)
        .flat_map(|m| m.partitions.iter().flatten().map(|p| format!("{p}.>")))
        .collect()
}

/// Compact JSON exactly as Go's `encoding/json` writes it: `<`, `>`, `&`,
/// U+2028 and U+2029 escaped, so a value keygate writes is byte-identical to
/// the one pcgroups would.
pub fn go_json<T: Serialize>(value: &T) -> Vec<u8> {
    let text = serde_json::to_string(value).unwrap_or_default();
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            other => out.push(other),
        }
    }
    out.into_bytes()
}

impl StaticGroupConfig {
    /// Whether `member` is part of this group.
    pub fn has_member(&self, member: &str) -> bool {
        self.members.iter().any(|m| m == member) || self.member_mappings.iter().any(|m| m.member == member)
    }
}

impl ElasticGroupConfig {
    /// Whether `member` is part of this group.
    pub fn has_member(&self, member: &str) -> bool {
        self.members.iter().any(|m| m == member) || self.member_mappings.iter().any(|m| m.member == member)
    }

    /// The filters member consumers use (the partitioning filters' subjects).
    pub fn filter_subjects(&self) -> Vec<String> {
        self.partitioning_filters.iter().flatten().map(|pf| pf.filter.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn static_json_matches_pcgroups_byte_for_byte() {
        let config = StaticGroupConfig {
            max_members: 10,
            filters: strings(&["orders.*"]),
            members: strings(&["m1", "m2"]),
            member_mappings: vec![],
            unknown: Default::default(),
        };
        assert_eq!(
            String::from_utf8(go_json(&config)).unwrap(),
            r#"{"max_members":10,"filters":["orders.*"],"members":["m1","m2"]}"#
        );
    }

    #[test]
    fn elastic_json_keeps_null_apart_from_empty() {
        let from_go = r#"{"max_members":4,"partitioning_filters":null,"members":["a"]}"#;
        let config: ElasticGroupConfig = serde_json::from_str(from_go).unwrap();
        assert_eq!(config.partitioning_filters, None);
        assert_eq!(String::from_utf8(go_json(&config)).unwrap(), from_go);

        let empty = r#"{"max_members":4,"partitioning_filters":[]}"#;
        let config: ElasticGroupConfig = serde_json::from_str(empty).unwrap();
        assert_eq!(String::from_utf8(go_json(&config)).unwrap(), empty);

        let wild = r#"{"max_members":4,"partitioning_filters":[{"filter":"orders.\u003e","partitioning_wildcards":null}],"max_buffered_msg":100,"member_mappings":[{"member":"a","partitions":[0,1,2,3]}],"future":true}"#;
        let config: ElasticGroupConfig = serde_json::from_str(wild).unwrap();
        assert_eq!(config.partitioning_filters.as_ref().unwrap()[0].filter, "orders.>");
        assert_eq!(config.max_buffered_msgs, 100);
        assert_eq!(String::from_utf8(go_json(&config)).unwrap(), wild);
    }

    #[test]
    fn mappings_must_cover_every_partition_once() {
        let map = |m: &str, p: &[u32]| MemberMapping { member: m.into(), partitions: Some(p.to_vec()) };
        assert_eq!(validate_membership(3, &[], &[map("a", &[0, 1]), map("b", &[2])]), Ok(()));
        assert_eq!(validate_membership(3, &[], &[map("a", &[0, 1])]), Err(ConfigError::IncompleteMappings(2, 3)));
        assert_eq!(
            validate_membership(3, &[], &[map("a", &[0, 1]), map("b", &[1, 2])]),
            Err(ConfigError::DuplicatePartition(1))
        );
        assert_eq!(validate_membership(3, &[], &[map("a", &[0, 3])]), Err(ConfigError::PartitionOutOfRange(3, 2)));
        assert_eq!(
            validate_membership(2, &[], &[map("a", &[0]), map("a", &[1])]),
            Err(ConfigError::DuplicateMappingMember("a".into()))
        );
        assert_eq!(validate_membership(1, &[], &[map("a", &[0]), map("b", &[])]), Err(ConfigError::MappingCount(1)));
        assert_eq!(
            validate_membership(2, &strings(&["x"]), &[map("a", &[0, 1])]),
            Err(ConfigError::MembersAndMappings)
        );
        assert_eq!(validate_membership(0, &[], &[]), Err(ConfigError::NoPartitions));
    }

    #[test]
    fn partitioning_filters_follow_pcgroups_rules() {
        let pf = |f: &str, w: Option<Vec<u32>>| PartitioningFilter { filter: f.into(), partitioning_wildcards: w };
        assert!(validate_partitioning_filters(&[pf("orders.*", Some(vec![1]))]).is_ok());
        assert!(validate_partitioning_filters(&[pf("orders.>", None)]).is_ok());
        assert!(validate_partitioning_filters(&[pf("orders.x", None)]).is_err());
        assert!(validate_partitioning_filters(&[pf("orders.*", Some(vec![2]))]).is_err());
        assert!(validate_partitioning_filters(&[pf("a.*.*", Some(vec![1, 1]))]).is_err());
        assert!(validate_partitioning_filters(&[pf("a.*.*", Some(vec![0]))]).is_err());
    }

    #[test]
    fn filters_come_in_pcgroups_order() {
        let members = strings(&["a", "b", "c"]);
        assert_eq!(
            member_filter_subjects(4, &members, &[], &strings(&["x.*", "y.*"]), "a"),
            strings(&["0.x.*", "3.x.*", "0.y.*", "3.y.*"])
        );
        assert_eq!(member_filter_subjects(4, &members, &[], &[], "b"), strings(&["1.>"]));
        let mappings = vec![MemberMapping { member: "a".into(), partitions: Some(vec![2, 0]) }];
        assert_eq!(member_filter_subjects(3, &[], &mappings, &strings(&["x.*", "y.*"]), "a"), strings(&["2.>", "0.>"]));
    }
}
