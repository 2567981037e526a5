//! Where groups live: the pcgroups KV buckets (one value per group, as Go
//! pcgroups writes it) and keygate's own settings bucket, read and written
//! by compare-and-set.

use async_nats::jetstream::{self, kv, stream};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::config::{config_key, go_json, validate_membership, ELASTIC_BUCKET, STATIC_BUCKET};
use super::spec::{GroupConfig, GroupKind, GroupSpec, Ordering};
use super::view::GroupSummary;
use super::{GroupError as Error, GroupErrorKind as Kind};
use crate::names::{GroupName, StreamName};
use crate::nats::buckets::{BucketSpec, Buckets, OpenBuckets};
use crate::nats::errors::{stream_read_error, unavailable_or_internal};
use crate::pauses::Pauses;

/// keygate's own bucket for per-group settings pcgroups does not store
/// (a Go read-modify-write of the pcgroups value would drop them).
pub const SETTINGS_BUCKET: &str = "keygate-groups";
/// Ack wait when a group does not set one (pcgroups' default).
pub const DEFAULT_ACK_WAIT_MS: u64 = 5_000;
pub(super) const CAS_ATTEMPTS: usize = 32;

/// Per-group settings kept in keygate's own bucket.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GroupSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_wait_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordering: Option<Ordering>,
}

impl GroupSettings {
    /// What a `PUT` of `spec` asks of keygate's settings.
    pub fn requested_by(spec: &GroupSpec) -> Self {
        Self { ack_wait_ms: spec.ack_wait_ms, ordering: spec.ordering }
    }

    /// The group's ack wait (pcgroups' default when it sets none).
    pub fn ack_wait(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.ack_wait_ms.unwrap_or(DEFAULT_ACK_WAIT_MS))
    }

    /// The ordering the group keeps.
    pub fn ordering(&self) -> Ordering {
        self.ordering.unwrap_or(Ordering::UNSTATED)
    }

    /// What to store after a `PUT` asking for `requested`: given fields
    /// replace `current` ones, the others stay; a group just created starts
    /// from nothing, with key ordering unless another is asked for.
    pub fn after_put(current: &GroupSettings, requested: &GroupSettings, created: bool) -> GroupSettings {
        let base = if created {
            GroupSettings { ack_wait_ms: None, ordering: Some(Ordering::FOR_NEW_GROUPS) }
        } else {
            current.clone()
        };
        GroupSettings {
            ack_wait_ms: requested.ack_wait_ms.or(base.ack_wait_ms),
            ordering: requested.ordering.or(base.ordering),
        }
    }
}

/// A group as read from its bucket.
#[derive(Debug, Clone)]
pub struct StoredGroup {
    pub config: GroupConfig,
    pub raw: Bytes,
    pub revision: u64,
}

/// Group administration over one JetStream context.
#[derive(Clone)]
pub struct GroupAdmin {
    pub(super) js: jetstream::Context,
    buckets: Buckets,
    /// The buckets reads go to, kept open (src/nats/buckets.rs).
    open: OpenBuckets,
    pub(super) pauses: Pauses,
}

impl GroupAdmin {
    /// Administration through `js`.
    pub fn new(buckets: Buckets) -> Self {
        Self { pauses: Pauses::new(buckets.clone()), js: buckets.js().clone(), buckets, open: OpenBuckets::default() }
    }

    pub(super) async fn bucket(&self, name: &str) -> Result<Option<kv::Store>, Error> {
        Ok(self.buckets.open(name).await?)
    }

    /// Bucket `name`, made with `replicas` (the group's stream's, as
    /// pcgroups does) when missing.
    pub(super) async fn bucket_or_create(&self, name: &str, replicas: usize) -> Result<kv::Store, Error> {
        Ok(self.buckets.open_or_create(BucketSpec { replicas: Some(replicas), ..BucketSpec::state(name, "") }).await?)
    }

    pub(super) async fn stream_info(&self, stream: &str) -> Result<stream::Info, Error> {
        match self.js.get_stream(stream).await {
            // Deleted between the two requests: as unknown as never created.
            Ok(mut s) => s.info().await.cloned().map_err(|e| stream_read_error(stream, e).into()),
            Err(e) => Err(stream_read_error(stream, e).into()),
        }
    }

    pub(super) async fn read(&self, kind: GroupKind, stream: &str, group: &str) -> Result<Option<StoredGroup>, Error> {
        let bucket = match kind {
            GroupKind::Static => STATIC_BUCKET,
            GroupKind::Elastic => ELASTIC_BUCKET,
        };
        let Some(entry) = self.open.entry(&self.js, bucket, &config_key(stream, group), "reading group").await? else {
            return Ok(None);
        };
        // A delete or purge marker means the group is gone (pcgroups misses purges).
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let config = parse_stored(kind, &entry.value).map_err(|why| {
            Error::new(
                Kind::StoredConfigInvalid,
                format!("group {group} on {stream} has an invalid {} configuration: {why}", kind.as_str()),
            )
        })?;
        Ok(Some(StoredGroup { config, raw: entry.value, revision: entry.revision }))
    }

    /// Loads a group; `kind` disambiguates a name used by both flavours.
    pub async fn load(
        &self,
        stream: &StreamName,
        group: &GroupName,
        kind: Option<GroupKind>,
    ) -> Result<StoredGroup, Error> {
        let kinds: Vec<GroupKind> = kind.map_or_else(|| vec![GroupKind::Static, GroupKind::Elastic], |k| vec![k]);
        // Both buckets at once: a name is looked up in each unless the kind is given.
        let reads = kinds.into_iter().map(|k| self.read(k, stream.as_str(), group.as_str()));
        let mut found: Vec<StoredGroup> = futures::future::try_join_all(reads).await?.into_iter().flatten().collect();
        match found.len() {
            0 => Err(Error::new(Kind::NotFound, format!("group {group} not found on stream {stream}"))),
            1 => Ok(found.remove(0)),
            _ => Err(Error::new(Kind::Ambiguous, format!(
                "group {group} exists as both a static and an elastic group on {stream}; add ?kind=static or ?kind=elastic"
            ))),
        }
    }

    /// keygate's settings of a group (defaults when none are stored).
    pub async fn settings(&self, stream: &StreamName, group: &GroupName) -> Result<GroupSettings, Error> {
        let key = config_key(stream.as_str(), group.as_str());
        let entry = self.open.entry(&self.js, SETTINGS_BUCKET, &key, "reading group settings").await?;
        // A delete marker reads as no settings, as `get` would have it.
        let value = entry.filter(|e| e.operation == kv::Operation::Put).map(|e| e.value);
        Ok(value.and_then(|v| serde_json::from_slice(&v).ok()).unwrap_or_default())
    }

    /// Groups on a stream, both flavours, sorted by name.
    pub async fn list(&self, stream: &StreamName) -> Result<Vec<GroupSummary>, Error> {
        self.stream_info(stream.as_str()).await?;
        let mut out: Vec<GroupSummary> = self
            .groups_under(&format!("{stream}.*"))
            .await?
            .into_iter()
            .map(|(_, group, kind)| GroupSummary { group: group.to_string(), kind })
            .collect();
        out.sort_by(|a, b| a.group.cmp(&b.group));
        Ok(out)
    }

    /// Every group on every stream.
    pub async fn list_all(&self) -> Result<Vec<(StreamName, GroupName, GroupKind)>, Error> {
        self.groups_under(">").await
    }

    /// The groups whose configuration keys match `key_filter`, by the live
    /// keys of both configuration buckets, read without a consumer: a
    /// listing per request must not leave one behind on keygate's own
    /// buckets (src/nats/kv_scan.rs).
    async fn groups_under(&self, key_filter: &str) -> Result<Vec<(StreamName, GroupName, GroupKind)>, Error> {
        let (statics, elastics) = futures::try_join!(
            self.open.live_entries(&self.js, STATIC_BUCKET, key_filter),
            self.open.live_entries(&self.js, ELASTIC_BUCKET, key_filter),
        )?;
        let keys = statics.into_iter().map(|(key, _)| (key, GroupKind::Static));
        let keys = keys.chain(elastics.into_iter().map(|(key, _)| (key, GroupKind::Elastic)));
        Ok(keys
            .filter_map(|(key, kind)| {
                let (s, g) = key.split_once('.')?;
                Some((StreamName::parse(s).ok()?, GroupName::parse(g).ok()?, kind))
            })
            .collect())
    }
}

/// Why a stored configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoredConfigError {
    /// Not the JSON pcgroups writes.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// Well-formed, but its membership does not cover the partitions as it must.
    #[error("{0}")]
    Membership(#[from] super::config::ConfigError),
}

/// Parses and validates a stored configuration.
pub fn parse_stored(kind: GroupKind, raw: &[u8]) -> Result<GroupConfig, StoredConfigError> {
    let config = match kind {
        GroupKind::Static => GroupConfig::Static(serde_json::from_slice(raw)?),
        GroupKind::Elastic => GroupConfig::Elastic(serde_json::from_slice(raw)?),
    };
    validate_membership(config.partitions(), config.members(), config.mappings())?;
    Ok(config)
}

pub(super) fn config_bytes(config: &GroupConfig) -> Bytes {
    Bytes::from(match config {
        GroupConfig::Static(c) => go_json(c),
        GroupConfig::Elastic(c) => go_json(c),
    })
}

pub(super) fn sorted(items: &[String]) -> Vec<String> {
    let mut v = items.to_vec();
    v.sort();
    v.dedup();
    v
}

pub(super) fn cas_error(what: &str, e: kv::UpdateError) -> Error {
    if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
        Error::new(Kind::ChangedConcurrently, "the group changed concurrently; read it again and retry")
    } else {
        unavailable_or_internal(what, e).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_put_changes_only_the_settings_it_names_and_new_groups_are_key_ordered() {
        let none = GroupSettings::default();
        let created = GroupSettings::after_put(&none, &none, true);
        assert_eq!(created, GroupSettings { ack_wait_ms: None, ordering: Some(Ordering::Key) });
        let stored = GroupSettings { ack_wait_ms: Some(2000), ordering: Some(Ordering::Partition) };
        let asked = GroupSettings { ack_wait_ms: None, ordering: Some(Ordering::Key) };
        assert_eq!(
            GroupSettings::after_put(&stored, &asked, false),
            GroupSettings { ack_wait_ms: Some(2000), ordering: Some(Ordering::Key) }
        );
        assert_eq!(GroupSettings::after_put(&stored, &none, false), stored, "left out, kept");
        assert_eq!(none.ordering(), Ordering::Partition, "stored without one: pcgroups' order");
        let recreated = GroupSettings::after_put(&stored, &none, true);
        assert_eq!(recreated.ordering, Some(Ordering::Key), "a group created again starts afresh");
    }
}
