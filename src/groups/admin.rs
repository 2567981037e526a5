//! Group administration against NATS: the pcgroups KV buckets, the elastic
//! work-queue streams, member consumers' state, and membership edits by
//! compare-and-set. The same code serves the REST API and the CLI.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::config::{
    config_key, elastic_stream_name, go_json, member_filter_subjects, ownership, static_consumer_name,
    validate_membership, ElasticGroupConfig, MemberMapping, StaticGroupConfig, ELASTIC_BUCKET, PRIORITY_GROUP,
    STATIC_BUCKET,
};
use super::spec::{GroupConfig, GroupKind, PartitioningFilterSpec};
use super::view::{GroupSummary, GroupView, MemberState, MembershipView, OwnedPartitions, PartitionPending};
use crate::error::ApiError;
use crate::names::{GroupName, MemberName, StreamName};
use crate::nats::errors::{is_not_found, jetstream_error_code, stream_read_error, unavailable_or_internal};
use crate::partition::{PartitionSpec, SubjectPattern, TransformSpelling};

/// keygate's own bucket for per-group settings pcgroups does not store
/// (a Go read-modify-write of the pcgroups value would drop them).
pub const SETTINGS_BUCKET: &str = "keygate-groups";
/// Ack wait when a group does not set one (pcgroups' default).
pub const DEFAULT_ACK_WAIT_MS: u64 = 5_000;
const CAS_ATTEMPTS: usize = 32;

/// Per-group settings kept in keygate's own bucket.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GroupSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_wait_ms: Option<u64>,
}

/// A group as read from its bucket.
#[derive(Debug, Clone)]
pub struct StoredGroup {
    pub config: GroupConfig,
    pub raw: Bytes,
    pub revision: u64,
}

/// Whether `PUT` created, found or changed the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Created,
    Unchanged,
    Updated,
}

/// Group administration over one JetStream context.
#[derive(Clone)]
pub struct GroupAdmin {
    js: jetstream::Context,
}

impl GroupAdmin {
    /// Administration through `js`.
    pub fn new(js: jetstream::Context) -> Self {
        Self { js }
    }

    async fn bucket(&self, name: &str) -> Result<Option<kv::Store>, ApiError> {
        match self.js.get_key_value(name).await {
            Ok(store) => Ok(Some(store)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(unavailable_or_internal("reading KV bucket", e)),
        }
    }

    async fn bucket_or_create(&self, name: &str, replicas: usize) -> Result<kv::Store, ApiError> {
        if let Some(store) = self.bucket(name).await? {
            return Ok(store);
        }
        let config = kv::Config {
            bucket: name.to_owned(),
            history: 1,
            storage: stream::StorageType::File,
            num_replicas: replicas.max(1),
            ..Default::default()
        };
        match self.js.create_key_value(config).await {
            Ok(store) => Ok(store),
            Err(create_err) => match self.bucket(name).await? {
                Some(store) => Ok(store),
                None => Err(unavailable_or_internal("creating KV bucket", create_err)),
            },
        }
    }

    async fn stream_info(&self, stream: &str) -> Result<stream::Info, ApiError> {
        match self.js.get_stream(stream).await {
            // Deleted between the two requests: as unknown as never created.
            Ok(mut s) => s.info().await.cloned().map_err(|e| stream_read_error(stream, e)),
            Err(e) => Err(stream_read_error(stream, e)),
        }
    }

    async fn read(&self, kind: GroupKind, stream: &str, group: &str) -> Result<Option<StoredGroup>, ApiError> {
        let bucket = match kind {
            GroupKind::Static => STATIC_BUCKET,
            GroupKind::Elastic => ELASTIC_BUCKET,
        };
        let Some(store) = self.bucket(bucket).await? else { return Ok(None) };
        let entry =
            store.entry(config_key(stream, group)).await.map_err(|e| unavailable_or_internal("reading group", e))?;
        let Some(entry) = entry else { return Ok(None) };
        // A delete or purge marker means the group is gone (pcgroups misses purges).
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let config = parse_stored(kind, &entry.value).map_err(|why| {
            ApiError::Unprocessable(format!(
                "group {group} on {stream} has an invalid {} configuration: {why}",
                kind.as_str()
            ))
        })?;
        Ok(Some(StoredGroup { config, raw: entry.value, revision: entry.revision }))
    }

    /// Loads a group; `kind` disambiguates a name used by both flavours.
    pub async fn load(
        &self,
        stream: &StreamName,
        group: &GroupName,
        kind: Option<GroupKind>,
    ) -> Result<StoredGroup, ApiError> {
        let kinds: Vec<GroupKind> = kind.map_or_else(|| vec![GroupKind::Static, GroupKind::Elastic], |k| vec![k]);
        let mut found = Vec::new();
        for k in kinds {
            if let Some(g) = self.read(k, stream.as_str(), group.as_str()).await? {
                found.push(g);
            }
        }
        match found.len() {
            0 => Err(ApiError::NotFound(format!("group {group} not found on stream {stream}"))),
            1 => Ok(found.remove(0)),
            _ => Err(ApiError::Conflict(format!(
                "group {group} exists as both a static and an elastic group on {stream}; add ?kind=static or ?kind=elastic"
            ))),
        }
    }

    /// Creates a group, or confirms an identical one exists. An elastic
    /// group's membership may differ: it is then updated. Everything is
    /// checked before anything is written, so a refused request changes
    /// nothing.
    pub async fn put(
        &self,
        stream: &StreamName,
        group: &GroupName,
        config: GroupConfig,
        membership_given: bool,
        ack_wait_ms: Option<u64>,
    ) -> Result<PutOutcome, ApiError> {
        let info = self.stream_info(stream.as_str()).await?;
        let kind = config.kind();
        let other = match kind {
            GroupKind::Static => GroupKind::Elastic,
            GroupKind::Elastic => GroupKind::Static,
        };
        if self.read(other, stream.as_str(), group.as_str()).await?.is_some() {
            return Err(ApiError::Conflict(format!(
                "group {group} already exists on {stream} as an {} group; delete it first",
                other.as_str()
            )));
        }
        let key = config_key(stream.as_str(), group.as_str());
        let existing = self.read(kind, stream.as_str(), group.as_str()).await?;
        let plan = match &existing {
            Some(stored) => plan_reconcile(&stored.config, &config, membership_given)?,
            None => {
                match &config {
                    GroupConfig::Static(c) => {
                        check_static_stream(&info, c.max_members)?;
                        self.check_consumer_names_free(stream, group, &config).await?;
                    }
                    GroupConfig::Elastic(c) => check_elastic_filters(&info, c)?,
                }
                Reconcile::Create
            }
        };
        // The work-queue stream first: if it cannot be made, KV is untouched.
        let mut made_work_queue = false;
        if let GroupConfig::Elastic(c) = existing.as_ref().map_or(&config, |s| &s.config) {
            made_work_queue = self.ensure_work_queue(stream.as_str(), group.as_str(), c, &info).await?;
        }
        let bucket_name = match kind {
            GroupKind::Static => STATIC_BUCKET,
            GroupKind::Elastic => ELASTIC_BUCKET,
        };
        let written = self.apply(bucket_name, &key, &config, existing.as_ref(), plan, info.config.num_replicas).await;
        let outcome = match written {
            Ok(outcome) => outcome,
            Err(e) => {
                if made_work_queue {
                    let _ = self.js.delete_stream(elastic_stream_name(stream.as_str(), group.as_str())).await;
                }
                return Err(e);
            }
        };
        let settings = GroupSettings { ack_wait_ms };
        let current = self.settings(stream, group).await?;
        if outcome == PutOutcome::Created || (ack_wait_ms.is_some() && current != settings) {
            let settings_store = self.bucket_or_create(SETTINGS_BUCKET, info.config.num_replicas).await?;
            settings_store
                .put(&key, Bytes::from(serde_json::to_vec(&settings).unwrap_or_default()))
                .await
                .map_err(|e| unavailable_or_internal("storing group settings", e))?;
            if outcome == PutOutcome::Unchanged {
                return Ok(PutOutcome::Updated);
            }
        }
        Ok(outcome)
    }

    async fn apply(
        &self,
        bucket_name: &str,
        key: &str,
        config: &GroupConfig,
        existing: Option<&StoredGroup>,
        plan: Reconcile,
        replicas: usize,
    ) -> Result<PutOutcome, ApiError> {
        match (plan, existing) {
            (Reconcile::Unchanged, _) => Ok(PutOutcome::Unchanged),
            (Reconcile::Membership(next), Some(stored)) => {
                let store = self.bucket_or_create(bucket_name, replicas).await?;
                store
                    .update(key, Bytes::from(go_json(&next)), stored.revision)
                    .await
                    .map_err(|e| cas_error("updating membership", e))?;
                Ok(PutOutcome::Updated)
            }
            _ => {
                let store = self.bucket_or_create(bucket_name, replicas).await?;
                match store.create(key, config_bytes(config)).await {
                    Ok(_) => Ok(PutOutcome::Created),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                        Err(ApiError::Conflict("the group was created concurrently; read it and retry".into()))
                    }
                    Err(e) => Err(unavailable_or_internal("storing group", e)),
                }
            }
        }
    }

    /// Static consumers are named `<group>-<member>`: refuse a group whose
    /// names another group on the stream already uses (`g` + `x-m` and
    /// `g-x` + `m` would share `g-x-m`).
    async fn check_consumer_names_free(
        &self,
        stream: &StreamName,
        group: &GroupName,
        config: &GroupConfig,
    ) -> Result<(), ApiError> {
        let ours: Vec<String> = member_names(config).map(|m| static_consumer_name(group.as_str(), m)).collect();
        for summary in self.list(stream).await? {
            if summary.kind != GroupKind::Static || summary.group == group.as_str() {
                continue;
            }
            let Some(other) = self.read(GroupKind::Static, stream.as_str(), &summary.group).await? else { continue };
            for member in member_names(&other.config) {
                let theirs = static_consumer_name(&summary.group, member);
                if ours.contains(&theirs) {
                    return Err(ApiError::Conflict(format!(
                        "consumer {theirs} already belongs to group {} on {stream}; choose other group or member names",
                        summary.group
                    )));
                }
            }
        }
        Ok(())
    }

    async fn ensure_work_queue(
        &self,
        stream: &str,
        group: &str,
        config: &ElasticGroupConfig,
        source: &stream::Info,
    ) -> Result<bool, ApiError> {
        let name = elastic_stream_name(stream, group);
        let existed = self.js.get_stream(&name).await.is_ok();
        let filters = config.partitioning_filters.clone().unwrap_or_default();
        let transforms: Vec<stream::SubjectTransform> = if filters.is_empty() {
            let all = SubjectPattern::parse(">").expect("> is a valid filter");
            vec![stream::SubjectTransform {
                source: ">".into(),
                destination: all.partition_transform(config.max_members, &[], TransformSpelling::Pcgroups),
            }]
        } else {
            filters
                .iter()
                .map(|pf| {
                    let pattern = SubjectPattern::parse(&pf.filter).expect("validated filter");
                    let wildcards = pf.partitioning_wildcards.clone().unwrap_or_default();
                    stream::SubjectTransform {
                        source: pf.filter.clone(),
                        destination: pattern.partition_transform(
                            config.max_members,
                            &wildcards,
                            TransformSpelling::Pcgroups,
                        ),
                    }
                })
                .collect()
        };
        let wq = stream::Config {
            name: name.clone(),
            retention: stream::RetentionPolicy::WorkQueue,
            num_replicas: source.config.num_replicas,
            storage: source.config.storage,
            max_messages: config.max_buffered_msgs,
            max_bytes: config.max_buffered_bytes,
            discard: stream::DiscardPolicy::New,
            sources: Some(vec![stream::Source {
                name: stream.to_owned(),
                subject_transforms: transforms,
                ..Default::default()
            }]),
            allow_direct: true,
            ..Default::default()
        };
        self.js.create_stream(wq).await.map(|_| !existed).map_err(|e| {
            if jetstream_error_code(&e) == Some(crate::nats::errors::codes::STREAM_NAME_IN_USE) {
                ApiError::Conflict(format!(
                    "stream {name} already exists with another configuration; delete it or pick another group name"
                ))
            } else {
                unavailable_or_internal("creating the group's work-queue stream", e)
            }
        })
    }

    /// keygate's settings of a group (defaults when none are stored).
    pub async fn settings(&self, stream: &StreamName, group: &GroupName) -> Result<GroupSettings, ApiError> {
        let Some(store) = self.bucket(SETTINGS_BUCKET).await? else { return Ok(GroupSettings::default()) };
        let value = store
            .get(config_key(stream.as_str(), group.as_str()))
            .await
            .map_err(|e| unavailable_or_internal("reading group settings", e))?;
        Ok(value.and_then(|v| serde_json::from_slice(&v).ok()).unwrap_or_default())
    }

    /// Groups on a stream, both flavours, sorted by name.
    pub async fn list(&self, stream: &StreamName) -> Result<Vec<GroupSummary>, ApiError> {
        self.stream_info(stream.as_str()).await?;
        let mut out: Vec<GroupSummary> = self
            .list_all()
            .await?
            .into_iter()
            .filter(|(s, _, _)| s == stream)
            .map(|(_, group, kind)| GroupSummary { group: group.to_string(), kind })
            .collect();
        out.sort_by(|a, b| a.group.cmp(&b.group));
        Ok(out)
    }

    /// Every group on every stream, by the keys of both configuration buckets.
    pub async fn list_all(&self) -> Result<Vec<(StreamName, GroupName, GroupKind)>, ApiError> {
        let mut out = Vec::new();
        for (kind, bucket) in [(GroupKind::Static, STATIC_BUCKET), (GroupKind::Elastic, ELASTIC_BUCKET)] {
            let Some(store) = self.bucket(bucket).await? else { continue };
            let keys: Vec<String> = store
                .keys()
                .await
                .map_err(|e| unavailable_or_internal("listing groups", e))?
                .try_collect()
                .await
                .map_err(|e| unavailable_or_internal("listing groups", e))?;
            for key in keys {
                let Some((s, g)) = key.split_once('.') else { continue };
                if let (Ok(stream), Ok(group)) = (StreamName::parse(s), GroupName::parse(g)) {
                    out.push((stream, group, kind));
                }
            }
        }
        Ok(out)
    }

    /// Deletes a group: its configuration, its member consumers (static) or
    /// work-queue stream (elastic), and keygate's settings for it.
    pub async fn delete(
        &self,
        stream: &StreamName,
        group: &GroupName,
        kind: Option<GroupKind>,
    ) -> Result<(), ApiError> {
        let stored = self.load(stream, group, kind).await?;
        let key = config_key(stream.as_str(), group.as_str());
        // The configuration goes first: member instances (keygate's and Go's)
        // stop on its deletion instead of recreating what is deleted next.
        let bucket_name = match stored.config.kind() {
            GroupKind::Static => STATIC_BUCKET,
            GroupKind::Elastic => ELASTIC_BUCKET,
        };
        if let Some(store) = self.bucket(bucket_name).await? {
            store.delete(&key).await.map_err(|e| unavailable_or_internal("deleting group", e))?;
        }
        match &stored.config {
            GroupConfig::Static(_) => {
                // Only this group's members' consumers: pcgroups deletes every
                // consumer named `<group>-*`, which can belong to other groups.
                for member in member_names(&stored.config) {
                    let consumer = static_consumer_name(group.as_str(), member);
                    match self.js.delete_consumer_from_stream(&consumer, stream.as_str()).await {
                        Ok(_) => {}
                        Err(e) if is_not_found(&e) => {}
                        Err(e) => return Err(unavailable_or_internal("deleting member consumer", e)),
                    }
                }
            }
            GroupConfig::Elastic(_) => {
                match self.js.delete_stream(elastic_stream_name(stream.as_str(), group.as_str())).await {
                    Ok(_) => {}
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(unavailable_or_internal("deleting the group's work-queue stream", e)),
                }
            }
        }
        if let Some(settings) = self.bucket(SETTINGS_BUCKET).await? {
            let _ = settings.purge(&key).await;
        }
        Ok(())
    }

    /// Adds members to an elastic group (compare-and-set).
    pub async fn add_members(
        &self,
        stream: &StreamName,
        group: &GroupName,
        add: &[MemberName],
    ) -> Result<MembershipView, ApiError> {
        if add.is_empty() {
            return Err(ApiError::BadRequest("members must name at least one member".into()));
        }
        self.edit_elastic(stream, group, |config| {
            if !config.member_mappings.is_empty() {
                return Err(ApiError::Conflict(
                    "the group uses member mappings; change them with PUT …/mappings or delete them first".into(),
                ));
            }
            for member in add {
                if !config.members.iter().any(|m| m == member.as_str()) {
                    config.members.push(member.to_string());
                }
            }
            Ok(())
        })
        .await
    }

    /// Drops a member from an elastic group (compare-and-set).
    pub async fn drop_member(
        &self,
        stream: &StreamName,
        group: &GroupName,
        member: &MemberName,
    ) -> Result<MembershipView, ApiError> {
        self.edit_elastic(stream, group, |config| {
            if !config.member_mappings.is_empty() {
                return Err(ApiError::Conflict(
                    "the group uses member mappings; change them with PUT …/mappings or delete them first".into(),
                ));
            }
            let before = config.members.len();
            config.members.retain(|m| m != member.as_str());
            if config.members.len() == before {
                return Err(ApiError::NotFound(format!("member {member} is not in group {group}")));
            }
            Ok(())
        })
        .await
    }

    /// Replaces an elastic group's membership with explicit mappings.
    pub async fn set_mappings(
        &self,
        stream: &StreamName,
        group: &GroupName,
        mappings: Vec<MemberMapping>,
    ) -> Result<MembershipView, ApiError> {
        if mappings.is_empty() {
            return Err(ApiError::BadRequest("mappings must not be empty; DELETE …/mappings removes them".into()));
        }
        self.edit_elastic(stream, group, |config| {
            config.members.clear();
            config.member_mappings = mappings.clone();
            validate_membership(config.max_members, &config.members, &config.member_mappings)
                .map_err(|e| ApiError::BadRequest(e.to_string()))
        })
        .await
    }

    /// Removes an elastic group's mappings (it then has no members).
    pub async fn delete_mappings(&self, stream: &StreamName, group: &GroupName) -> Result<MembershipView, ApiError> {
        self.edit_elastic(stream, group, |config| {
            config.member_mappings.clear();
            Ok(())
        })
        .await
    }

    async fn edit_elastic(
        &self,
        stream: &StreamName,
        group: &GroupName,
        mut change: impl FnMut(&mut ElasticGroupConfig) -> Result<(), ApiError>,
    ) -> Result<MembershipView, ApiError> {
        for _ in 0..CAS_ATTEMPTS {
            let stored = self.load(stream, group, None).await?;
            let GroupConfig::Elastic(mut config) = stored.config else {
                return Err(ApiError::Conflict(format!(
                    "group {group} is a static group: its membership is fixed; delete and recreate it to change members"
                )));
            };
            change(&mut config)?;
            let store =
                self.bucket(ELASTIC_BUCKET).await?.ok_or_else(|| ApiError::NotFound("group not found".into()))?;
            let key = config_key(stream.as_str(), group.as_str());
            match store.update(&key, Bytes::from(go_json(&config)), stored.revision).await {
                Ok(revision) => {
                    let config = GroupConfig::Elastic(config);
                    return Ok(membership_view(&config, revision));
                }
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    // Someone else edited first: back off a little, re-read, re-apply.
                    let jitter = Duration::from_millis(rand::random_range(1..20));
                    tokio::time::sleep(jitter).await;
                    continue;
                }
                Err(e) => return Err(unavailable_or_internal("updating group", e)),
            }
        }
        Err(ApiError::Conflict(format!("group {group} kept changing concurrently; retry")))
    }

    /// Unpins a member's current instance so another can take over.
    pub async fn step_down(&self, stream: &StreamName, group: &GroupName, member: &MemberName) -> Result<(), ApiError> {
        let stored = self.load(stream, group, None).await?;
        if !stored.config.has_member(member.as_str()) {
            return Err(ApiError::NotFound(format!("member {member} is not in group {group}")));
        }
        let (stream_name, consumer) = consumer_of(&stored.config, stream.as_str(), group.as_str(), member.as_str());
        let handle =
            self.js.get_stream_no_info(&stream_name).await.map_err(|e| unavailable_or_internal("step-down", e))?;
        handle.unpin_consumer(&consumer, PRIORITY_GROUP).await.map_err(|e| {
            if is_not_found(&e) {
                ApiError::NotFound(format!("member {member} has no consumer: no instance is serving it"))
            } else {
                unavailable_or_internal("step-down", e)
            }
        })
    }

    /// The full view of a group: configuration, ownership, pins and backlog.
    pub async fn view(
        &self,
        stream: &StreamName,
        group: &GroupName,
        kind: Option<GroupKind>,
    ) -> Result<GroupView, ApiError> {
        let stored = self.load(stream, group, kind).await?;
        let settings = self.settings(stream, group).await?;
        let config = &stored.config;
        let partitions = config.partitions();
        let owners = ownership(partitions, config.members(), config.mappings());
        let mut assignment = Vec::with_capacity(owners.len());
        let mut floors: BTreeMap<String, u64> = BTreeMap::new();
        for (member, owned) in &owners {
            let (stream_name, consumer) = consumer_of(config, stream.as_str(), group.as_str(), member);
            let info = self.consumer_info(&stream_name, &consumer).await?;
            let state = match info {
                Some(info) => {
                    floors.insert(member.clone(), info.ack_floor.stream_sequence);
                    let pin = info.priority_groups.iter().find(|g| g.group == PRIORITY_GROUP);
                    MemberState {
                        member: member.clone(),
                        partitions: owned.clone(),
                        consumer,
                        consumer_exists: true,
                        active: match config.kind() {
                            GroupKind::Static => info.num_waiting > 0,
                            GroupKind::Elastic => true,
                        },
                        waiting_pulls: info.num_waiting,
                        pinned_client_id: pin.and_then(|p| p.pinned_client_id.clone()).filter(|id| !id.is_empty()),
                        pinned_since: pin.and_then(|p| p.pinned_ts),
                        num_pending: info.num_pending,
                        num_ack_pending: info.num_ack_pending,
                        serving_instance: None,
                        fencing_token: None,
                        instances: Vec::new(),
                    }
                }
                None => MemberState {
                    member: member.clone(),
                    partitions: owned.clone(),
                    consumer,
                    consumer_exists: false,
                    active: false,
                    waiting_pulls: 0,
                    pinned_client_id: None,
                    pinned_since: None,
                    num_pending: 0,
                    num_ack_pending: 0,
                    serving_instance: None,
                    fencing_token: None,
                    instances: Vec::new(),
                },
            };
            assignment.push(state);
        }
        let owner_of: BTreeMap<u32, String> =
            owners.iter().flat_map(|(m, ps)| ps.iter().map(move |p| (*p, m.clone()))).collect();
        // Backlog is best effort: a GET still answers when it cannot be counted.
        let counted = match config {
            GroupConfig::Static(c) => {
                let floor_of: BTreeMap<u32, u64> = (0..partitions)
                    .map(|p| (p, owner_of.get(&p).and_then(|m| floors.get(m)).copied().unwrap_or(0)))
                    .collect();
                self.static_pending(stream.as_str(), c, &floor_of).await
            }
            GroupConfig::Elastic(_) => {
                self.subject_counts(&elastic_stream_name(stream.as_str(), group.as_str()), partitions).await
            }
        };
        let pending = match counted {
            Ok(counts) => Some(counts),
            Err(e) => {
                tracing::warn!(error = %e, %stream, %group, "could not count the group's backlog");
                None
            }
        };
        let partition_pending = (0..partitions)
            .map(|p| PartitionPending {
                partition: p,
                member: owner_of.get(&p).cloned(),
                pending: pending.as_ref().map(|counts| counts.get(&p).copied().unwrap_or(0)),
            })
            .collect();
        let raw: serde_json::Value = serde_json::from_slice(&stored.raw).unwrap_or(serde_json::Value::Null);
        let mut view = GroupView {
            stream: stream.to_string(),
            group: group.to_string(),
            kind: config.kind(),
            partitions,
            members: config.members().to_vec(),
            mappings: mappings_view(config.mappings()),
            filters: None,
            partitioning_filters: None,
            max_buffered_msgs: None,
            max_buffered_bytes: None,
            work_queue_stream: None,
            ack_wait_ms: settings.ack_wait_ms.unwrap_or(DEFAULT_ACK_WAIT_MS),
            revision: stored.revision,
            config: raw,
            assignment,
            partition_pending,
            blocked: Vec::new(),
        };
        match config {
            GroupConfig::Static(c) => view.filters = Some(c.filters.clone()),
            GroupConfig::Elastic(c) => {
                view.partitioning_filters = Some(c.partitioning_filters.as_ref().map(|list| {
                    list.iter()
                        .map(|pf| PartitioningFilterSpec {
                            filter: pf.filter.clone(),
                            wildcards: pf.partitioning_wildcards.clone(),
                        })
                        .collect()
                }));
                view.max_buffered_msgs = Some(c.max_buffered_msgs);
                view.max_buffered_bytes = Some(c.max_buffered_bytes);
                view.work_queue_stream = Some(elastic_stream_name(stream.as_str(), group.as_str()));
            }
        }
        Ok(view)
    }

    async fn consumer_info(&self, stream: &str, consumer: &str) -> Result<Option<jetstream::consumer::Info>, ApiError> {
        let handle = match self.js.get_stream_no_info(stream).await {
            Ok(h) => h,
            Err(e) => return Err(unavailable_or_internal("reading consumer", e)),
        };
        match handle.consumer_info(consumer).await {
            Ok(info) => Ok(Some(info)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(unavailable_or_internal("reading consumer", e)),
        }
    }

    /// Recounts a static group's backlog for partitions whose serving
    /// instance reports a higher floor than the consumer's ack floor (which
    /// one un-acked message of another partition holds back).
    pub async fn recount_static_pending(
        &self,
        view: &mut GroupView,
        instance_floors: &BTreeMap<u32, u64>,
    ) -> Result<(), ApiError> {
        if view.kind != GroupKind::Static || instance_floors.is_empty() {
            return Ok(());
        }
        let stream = StreamName::parse(&view.stream)?;
        let group = GroupName::parse(&view.group)?;
        let GroupConfig::Static(config) = self.load(&stream, &group, Some(GroupKind::Static)).await?.config else {
            return Ok(());
        };
        let counts = self.static_pending(stream.as_str(), &config, instance_floors).await?;
        for entry in &mut view.partition_pending {
            if let Some(count) = counts.get(&entry.partition) {
                entry.pending = Some(entry.pending.map_or(*count, |old| old.min(*count)));
            }
        }
        Ok(())
    }

    /// A static group's backlog per partition: messages of the partition
    /// after the given floor, counted by the server through a short-lived
    /// consumer starting there.
    async fn static_pending(
        &self,
        stream: &str,
        config: &StaticGroupConfig,
        floor_of: &BTreeMap<u32, u64>,
    ) -> Result<BTreeMap<u32, u64>, ApiError> {
        let handle =
            self.js.get_stream_no_info(stream).await.map_err(|e| unavailable_or_internal("reading stream", e))?;
        let counts = futures::stream::iter(floor_of.clone())
            .map(|(p, floor)| {
                let handle = handle.clone();
                let filters: Vec<String> = if config.filters.is_empty() || !config.member_mappings.is_empty() {
                    vec![format!("{p}.>")]
                } else {
                    config.filters.iter().map(|f| format!("{p}.{f}")).collect()
                };
                async move {
                    let counter = jetstream::consumer::pull::Config {
                        filter_subjects: filters,
                        deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                            start_sequence: floor + 1,
                        },
                        ack_policy: jetstream::consumer::AckPolicy::None,
                        inactive_threshold: Duration::from_secs(10),
                        memory_storage: true,
                        ..Default::default()
                    };
                    let mut consumer = handle
                        .create_consumer(counter)
                        .await
                        .map_err(|e| unavailable_or_internal("counting backlog", e))?;
                    let info =
                        consumer.info().await.map_err(|e| unavailable_or_internal("counting backlog", e))?.clone();
                    let _ = handle.delete_consumer(&info.name).await;
                    Ok::<_, ApiError>((p, info.num_pending))
                }
            })
            .buffer_unordered(16)
            .try_collect::<BTreeMap<u32, u64>>()
            .await?;
        Ok(counts)
    }

    /// Messages a stream stores per leading partition token: an elastic
    /// group's backlog (what is left in its work-queue stream).
    async fn subject_counts(&self, wq_stream: &str, partitions: u32) -> Result<BTreeMap<u32, u64>, ApiError> {
        let handle = match self.js.get_stream(wq_stream).await {
            Ok(h) => h,
            Err(e) if is_not_found(&e) => return Ok(BTreeMap::new()),
            Err(e) => return Err(unavailable_or_internal("reading work-queue stream", e)),
        };
        let mut counts = BTreeMap::new();
        if handle.cached_info().state.messages == 0 {
            return Ok(counts);
        }
        let mut subjects =
            handle.info_with_subjects(">").await.map_err(|e| unavailable_or_internal("counting backlog", e))?;
        while let Some(item) = subjects.next().await {
            let (subject, count) = item.map_err(|e| unavailable_or_internal("counting backlog", e))?;
            if let Some(p) = subject.split('.').next().and_then(|t| t.parse::<u32>().ok()).filter(|p| *p < partitions) {
                *counts.entry(p).or_insert(0) += count as u64;
            }
        }
        Ok(counts)
    }
}

/// What `PUT` of an existing group does.
#[derive(Debug, Clone, PartialEq)]
enum Reconcile {
    Create,
    Unchanged,
    Membership(ElasticGroupConfig),
}

/// Compares an existing group with a `PUT`: the partition count, filters
/// and buffer limits never change; an elastic group's membership may.
fn plan_reconcile(have: &GroupConfig, want: &GroupConfig, membership_given: bool) -> Result<Reconcile, ApiError> {
    let recreate = "delete and recreate the group to change it";
    if have.partitions() != want.partitions() {
        return Err(ApiError::Conflict(format!(
            "the group has {} partitions; the partition count never changes: {recreate}",
            have.partitions()
        )));
    }
    match (have, want) {
        (GroupConfig::Static(have), GroupConfig::Static(want)) => {
            if have.filters != want.filters {
                return Err(ApiError::Conflict(format!("the group's filters differ: {recreate}")));
            }
            if membership_given && (have.members != want.members || have.member_mappings != want.member_mappings) {
                return Err(ApiError::Conflict(format!("a static group's membership is fixed: {recreate}")));
            }
            Ok(Reconcile::Unchanged)
        }
        (GroupConfig::Elastic(have), GroupConfig::Elastic(want)) => {
            if have.partitioning_filters != want.partitioning_filters {
                return Err(ApiError::Conflict(format!("the group's partitioning filters differ: {recreate}")));
            }
            if have.max_buffered_msgs != want.max_buffered_msgs || have.max_buffered_bytes != want.max_buffered_bytes {
                return Err(ApiError::Conflict(format!("the group's buffer limits differ: {recreate}")));
            }
            let same_members = sorted(&have.members) == sorted(&want.members);
            if !membership_given || (same_members && have.member_mappings == want.member_mappings) {
                return Ok(Reconcile::Unchanged);
            }
            let mut next = have.clone();
            next.members = want.members.clone();
            next.member_mappings = want.member_mappings.clone();
            Ok(Reconcile::Membership(next))
        }
        _ => Err(ApiError::Conflict("the group exists with another kind".into())),
    }
}

/// Every member a configuration names (balanced or mapped).
fn member_names(config: &GroupConfig) -> impl Iterator<Item = &str> {
    config.members().iter().map(String::as_str).chain(config.mappings().iter().map(|m| m.member.as_str()))
}

/// What the stream stores: its subjects, or what its transform makes of them.
fn stored_patterns(info: &stream::Info) -> Vec<SubjectPattern> {
    match &info.config.subject_transform {
        Some(t) => {
            let dest: Vec<String> = t
                .destination
                .split('.')
                .map(|token| if token.starts_with("{{") { "*".to_owned() } else { token.to_owned() })
                .collect();
            SubjectPattern::parse(&dest.join(".")).into_iter().collect()
        }
        None => info.config.subjects.iter().filter_map(|s| SubjectPattern::parse(s).ok()).collect(),
    }
}

/// An elastic group's filters must match something the stream stores: over
/// a partition-stamped stream, `orders.*` matches nothing (it stores
/// `<p>.orders.<key>`).
fn check_elastic_filters(info: &stream::Info, config: &ElasticGroupConfig) -> Result<(), ApiError> {
    let stored = stored_patterns(info);
    for pf in config.partitioning_filters.iter().flatten() {
        let Ok(filter) = SubjectPattern::parse(&pf.filter) else { continue };
        if !stored.iter().any(|s| s.overlaps(&filter)) {
            let stored_text: Vec<String> = stored.iter().map(SubjectPattern::as_string).collect();
            return Err(ApiError::Unprocessable(format!(
                "filter {:?} matches nothing stream {} stores ({}); a partition-stamped stream stores <partition>.<subject>",
                pf.filter,
                info.config.name,
                stored_text.join(", ")
            )));
        }
    }
    Ok(())
}

/// Parses and validates a stored configuration.
pub fn parse_stored(kind: GroupKind, raw: &[u8]) -> Result<GroupConfig, String> {
    let config = match kind {
        GroupKind::Static => GroupConfig::Static(serde_json::from_slice(raw).map_err(|e| e.to_string())?),
        GroupKind::Elastic => GroupConfig::Elastic(serde_json::from_slice(raw).map_err(|e| e.to_string())?),
    };
    validate_membership(config.partitions(), config.members(), config.mappings()).map_err(|e| e.to_string())?;
    Ok(config)
}

fn config_bytes(config: &GroupConfig) -> Bytes {
    Bytes::from(match config {
        GroupConfig::Static(c) => go_json(c),
        GroupConfig::Elastic(c) => go_json(c),
    })
}

fn sorted(items: &[String]) -> Vec<String> {
    let mut v = items.to_vec();
    v.sort();
    v.dedup();
    v
}

fn cas_error(what: &str, e: kv::UpdateError) -> ApiError {
    if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
        ApiError::Conflict("the group changed concurrently; read it again and retry".into())
    } else {
        unavailable_or_internal(what, e)
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

fn mappings_view(mappings: &[MemberMapping]) -> Option<Vec<OwnedPartitions>> {
    (!mappings.is_empty()).then(|| {
        mappings
            .iter()
            .map(|m| OwnedPartitions { member: m.member.clone(), partitions: m.partitions.clone().unwrap_or_default() })
            .collect()
    })
}

fn membership_view(config: &GroupConfig, revision: u64) -> MembershipView {
    MembershipView {
        members: config.members().to_vec(),
        mappings: mappings_view(config.mappings()),
        ownership: ownership(config.partitions(), config.members(), config.mappings())
            .into_iter()
            .map(|(member, partitions)| OwnedPartitions { member, partitions })
            .collect(),
        revision,
    }
}

/// A static group needs a stream stamped with the same partition count.
fn check_static_stream(info: &stream::Info, partitions: u32) -> Result<(), ApiError> {
    let stamped = info.config.subject_transform.as_ref().and_then(|t| PartitionSpec::from_transform(&t.destination));
    match stamped {
        Some(spec) if spec.partitions == partitions => Ok(()),
        Some(spec) => Err(ApiError::Unprocessable(format!(
            "stream {} is stamped with {} partitions; a static group over it must have {}",
            info.config.name, spec.partitions, spec.partitions
        ))),
        None => {
            let pre_stamped = !info.config.subjects.is_empty()
                && info.config.subjects.iter().all(|s| s.starts_with("*.") || s == ">");
            if pre_stamped {
                Ok(())
            } else {
                Err(ApiError::Unprocessable(format!(
                    "stream {} is not partition-stamped: create it with \"partitions\", or use an elastic group",
                    info.config.name
                )))
            }
        }
    }
}
