//! Where a group's key sits in its members' subjects: the stream's
//! partitioning transform (static groups) or the group's partitioning
//! filters (elastic groups). It gives deliveries their `keygate-key`, and
//! key ordering its lanes: the tokens the partition is hashed from.

use std::sync::Arc;

use crate::groups::GroupConfig;
use crate::partition::{decode_key, is_keyless_token, PartitionSpec, SubjectPattern};
use crate::runtime::lanes::{LaneId, LaneKey};
use crate::runtime::Runtime;

/// One subject shape and the 1-based `*` positions its partition is hashed
/// from (none: the whole subject).
struct Partitioned {
    pattern: SubjectPattern,
    wildcards: Vec<usize>,
}

/// Where the key sits in a member's subjects.
pub(super) struct KeyLocator {
    shapes: Vec<Partitioned>,
    /// Every subject is hashed whole (an elastic group without partitioning filters).
    whole_subject: bool,
}

impl KeyLocator {
    /// `None` when the stream cannot be read now: a session without keys
    /// would deliver without `keygate-key` for its whole life, so it waits.
    pub async fn for_group(ctx: &Runtime, config: &GroupConfig, stream: &str) -> Option<Self> {
        let mut shapes = Vec::new();
        let mut whole_subject = false;
        match config {
            GroupConfig::Static(_) => {
                let s = ctx.broker.js.get_stream(stream).await.ok()?;
                if let Some(t) = &s.cached_info().config.subject_transform {
                    if let (Some(spec), Ok(pattern)) =
                        (PartitionSpec::from_transform(&t.destination), SubjectPattern::parse(&t.source))
                    {
                        let wildcards = spec.wildcards.iter().map(|w| *w as usize).collect();
                        shapes.push(Partitioned { pattern, wildcards });
                    }
                }
            }
            GroupConfig::Elastic(c) => match &c.partitioning_filters {
                None => whole_subject = true,
                Some(filters) => {
                    for pf in filters {
                        if let Ok(pattern) = SubjectPattern::parse(&pf.filter) {
                            let wildcards = pf.partitioning_wildcards.iter().flatten().map(|w| *w as usize).collect();
                            shapes.push(Partitioned { pattern, wildcards });
                        }
                    }
                }
            },
        }
        Some(Self { shapes, whole_subject })
    }

    /// The key a delivery names: one partitioning token, decoded.
    pub fn key(&self, subject: &str) -> Option<String> {
        self.shapes.iter().find_map(|shape| {
            let [w] = shape.wildcards.as_slice() else { return None };
            let captured = shape.pattern.captures(subject)?;
            decode_key(captured.get(w.checked_sub(1)?)?)
        })
    }

    /// The lane of a message under key ordering: its partitioning tokens.
    /// A keyless message is alone; a subject whose key cannot be found
    /// keeps the whole partition's order.
    pub fn lane(&self, partition: u32, subject: &str, seq: u64) -> LaneId {
        LaneId { partition, key: self.lane_key(subject, seq) }
    }

    fn lane_key(&self, subject: &str, seq: u64) -> LaneKey {
        if self.whole_subject {
            return LaneKey::Key(Arc::from(subject));
        }
        for shape in &self.shapes {
            let Some(captured) = shape.pattern.captures(subject) else { continue };
            if shape.wildcards.is_empty() {
                return LaneKey::Key(Arc::from(subject));
            }
            let tokens: Option<Vec<&str>> =
                shape.wildcards.iter().map(|w| captured.get(w.checked_sub(1)?).copied()).collect();
            let Some(tokens) = tokens else { continue };
            if let [token] = tokens.as_slice() {
                // One token: the key as published (it names the lane in
                // views, events and the skip route).
                return match decode_key(token) {
                    _ if is_keyless_token(token) => LaneKey::Alone(seq),
                    Some(key) => LaneKey::Key(Arc::from(key)),
                    None => LaneKey::Key(Arc::from(*token)),
                };
            }
            // Tokens never contain '.', so joining keeps them apart.
            return LaneKey::Key(Arc::from(tokens.join(".")));
        }
        LaneKey::Partition
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locator(shapes: &[(&str, &[usize])], whole_subject: bool) -> KeyLocator {
        let shapes = shapes
            .iter()
            .map(|(p, w)| Partitioned { pattern: SubjectPattern::parse(p).unwrap(), wildcards: w.to_vec() })
            .collect();
        KeyLocator { shapes, whole_subject }
    }

    #[test]
    fn the_lane_is_the_tokens_the_partition_is_hashed_from() {
        let keys = locator(&[("orders.*", &[1])], false);
        assert_eq!(keys.lane(3, "orders.alice", 9).key, LaneKey::Key("alice".into()));
        let escaped = format!("orders.{}", crate::partition::encode_key("a b.c").unwrap());
        assert_eq!(keys.lane(3, &escaped, 9).key, LaneKey::Key("a b.c".into()), "the key as published");
        assert_eq!(keys.key("orders.alice").as_deref(), Some("alice"));
        let two = locator(&[("vm.*.*.>", &[1, 2])], false);
        assert_eq!(two.lane(0, "vm.eu.7.boot", 1).key, LaneKey::Key("eu.7".into()));
        assert_eq!(two.key("vm.eu.7.boot"), None, "no single key to name");
        assert_eq!(locator(&[("a.>", &[])], false).lane(0, "a.b.c", 1).key, LaneKey::Key("a.b.c".into()));
        assert_eq!(locator(&[], true).lane(0, "x.y", 1).key, LaneKey::Key("x.y".into()));
    }

    #[test]
    fn keyless_messages_are_alone_and_unknown_shapes_keep_the_partition_order() {
        let keys = locator(&[("orders.*", &[1])], false);
        let keyless = format!("orders.{}", crate::partition::keyless_token(4));
        assert_eq!(keys.lane(1, &keyless, 17).key, LaneKey::Alone(17));
        assert_eq!(keys.lane(1, "other.alice", 18).key, LaneKey::Partition);
        assert_eq!(locator(&[], false).lane(2, "orders.alice", 1), LaneId::partition(2));
    }
}
