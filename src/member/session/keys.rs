//! Where a group's key sits in its members' subjects, so deliveries carry
//! `keygate-key`: the stream's partitioning transform (static groups) or
//! the group's partitioning filters (elastic groups).

use crate::groups::GroupConfig;
use crate::member::context::InstanceContext;
use crate::partition::{decode_key, PartitionSpec, SubjectPattern};

/// Where the key sits in a member's subjects, to give deliveries the key.
pub(super) struct KeyLocator {
    patterns: Vec<(SubjectPattern, usize)>,
}

impl KeyLocator {
    /// `None` when the stream cannot be read now: a session without keys
    /// would deliver without `keygate-key` for its whole life, so it waits.
    pub async fn for_group(ctx: &InstanceContext, config: &GroupConfig, stream: &str) -> Option<Self> {
        let mut patterns = Vec::new();
        match config {
            GroupConfig::Static(_) => {
                let s = ctx.js.get_stream(stream).await.ok()?;
                if let Some(t) = &s.cached_info().config.subject_transform {
                    if let (Some(spec), Ok(source)) =
                        (PartitionSpec::from_transform(&t.destination), SubjectPattern::parse(&t.source))
                    {
                        if let [w] = spec.wildcards.as_slice() {
                            patterns.push((source, *w as usize));
                        }
                    }
                }
            }
            GroupConfig::Elastic(c) => {
                for pf in c.partitioning_filters.iter().flatten() {
                    if let (Ok(pattern), Some([w])) =
                        (SubjectPattern::parse(&pf.filter), pf.partitioning_wildcards.as_deref())
                    {
                        patterns.push((pattern, *w as usize));
                    }
                }
            }
        }
        Some(Self { patterns })
    }

    pub fn key(&self, subject: &str) -> Option<String> {
        self.patterns.iter().find_map(|(pattern, w)| {
            let captured = pattern.captures(subject)?;
            decode_key(captured.get(w.checked_sub(1)?)?)
        })
    }
}
