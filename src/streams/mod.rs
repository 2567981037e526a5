//! Streams: creation with partition stamping, inspection, deletion, and a
//! short-lived cache of each stream's shape for the publish path.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;

mod reserved;

pub use reserved::{reserved_stream, reserved_stream_name, reserved_subject};

use crate::error::{flows_into, Error as DomainError};

/// What creating, reading or deleting a stream can fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamErrorKind {
    /// The stream's specification is invalid.
    InvalidSpec,
    NotFound,
    /// A stream of that name exists with another configuration.
    ExistsDifferently,
    /// The subjects overlap another stream's.
    SubjectsOverlap,
    /// Another request created the stream meanwhile.
    CreatedConcurrently,
    /// JetStream cannot place the stream's replicas now.
    CannotPlace,
    /// The server refused the configuration (limits, replicas).
    Refused,
    Unavailable,
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(StreamErrorKind {
    InvalidSpec => Invalid,
    NotFound => NotFound,
    ExistsDifferently => Conflict,
    SubjectsOverlap => Conflict,
    CreatedConcurrently => Conflict,
    CannotPlace => Unavailable,
    Refused => Unprocessable,
});
flows_into!(StreamErrorKind: crate::nats::errors::BrokerErrorKind);

pub type StreamError = DomainError<StreamErrorKind>;
use crate::names::StreamName;
use crate::nats::errors::{codes, is_not_found, jetstream_error_code, unavailable_or_internal};
use crate::partition::{PartitionSpec, SubjectPattern, TransformSpelling};
use StreamError as Error;
use StreamErrorKind as Kind;

/// Most partitions a stream may be stamped with.
pub const MAX_PARTITIONS: u32 = 4096;

/// Where a stream keeps its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    File,
    Memory,
}

/// A stream as `PUT /v1/streams/{stream}` creates it.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamSpec {
    /// Subjects the stream captures, e.g. `["orders.*"]`.
    #[schema(example = json!(["orders.*"]))]
    pub subjects: Vec<String>,
    /// Stamp every message with its partition: the stream stores
    /// `orders.*` as `{{partition(N,…)}}.orders.{{wildcard(1)}}`. Needs
    /// exactly one subject. Never changes after creation.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 4096, example = 10)]
    pub partitions: Option<u32>,
    /// 1-based positions of the `*` tokens that form the key (default: all of
    /// them; `[]` hashes the whole subject).
    #[serde(default)]
    pub key_wildcards: Option<Vec<u32>>,
    /// `file` (default) or `memory`.
    #[serde(default)]
    pub storage: Option<Storage>,
    /// Replicas in a clustered JetStream (default 1).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 5)]
    pub replicas: Option<usize>,
    /// Discard messages older than this (0 or omitted: keep); at least
    /// 100, the server's shortest.
    #[serde(default)]
    pub max_age_ms: Option<u64>,
    /// Keep at most this many messages (omitted: no limit).
    #[serde(default)]
    pub max_msgs: Option<i64>,
    /// Keep at most this many bytes (omitted: no limit).
    #[serde(default)]
    pub max_bytes: Option<i64>,
    /// Window in which a repeated `msg_id` is reported as a duplicate (default 2 minutes).
    #[serde(default)]
    pub duplicate_window_ms: Option<u64>,
    /// Accept atomic batches (default true): `"atomic": true` on a batch
    /// publish; on a replicated or in-memory stream also a batch's run of
    /// one key's messages stored in one round trip. false: a key's
    /// messages in a batch are stored one after another.
    #[serde(default)]
    pub allow_atomic: Option<bool>,
    /// Free text.
    #[serde(default)]
    pub description: Option<String>,
}

/// A stream as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StreamView {
    pub name: String,
    pub subjects: Vec<String>,
    /// Partition count when the stream is partition-stamped.
    pub partitions: Option<u32>,
    /// The `*` positions hashed for the partition (empty: whole subject).
    pub key_wildcards: Option<Vec<u32>>,
    /// The stamping transform, as the server holds it.
    pub subject_transform: Option<String>,
    pub storage: Storage,
    pub replicas: usize,
    pub retention: String,
    pub max_age_ms: u64,
    pub max_msgs: i64,
    pub max_bytes: i64,
    pub duplicate_window_ms: u64,
    pub description: Option<String>,
    /// Accepts atomic batches.
    pub allow_atomic: bool,
    /// Messages stored now.
    pub messages: u64,
    pub bytes: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub consumers: usize,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created: OffsetDateTime,
}

/// The shortest message age JetStream accepts as a limit.
const MIN_MAX_AGE_MS: u64 = 100;

/// What a checked spec asks JetStream for.
#[derive(Debug, Clone, PartialEq)]
struct Planned {
    subjects: Vec<String>,
    stamping: Option<(PartitionSpec, String)>,
}

impl StreamSpec {
    fn plan(&self) -> Result<Planned, Error> {
        let bad = |m: String| Err(Error::new(Kind::InvalidSpec, m));
        if self.subjects.is_empty() {
            return bad("subjects must name at least one subject".into());
        }
        let mut patterns = Vec::new();
        for subject in &self.subjects {
            let pattern = SubjectPattern::parse(subject).map_err(|e| Error::new(Kind::InvalidSpec, e.to_string()))?;
            if subject.starts_with('$') {
                return bad(format!("subject {subject:?} is reserved for the system"));
            }
            patterns.push(pattern);
        }
        if self.max_age_ms.is_some_and(|ms| (1..MIN_MAX_AGE_MS).contains(&ms)) {
            return bad(format!(
                "max_age_ms must be 0 (keep messages) or at least {MIN_MAX_AGE_MS} (the server's shortest)"
            ));
        }
        let mut unique = self.subjects.clone();
        unique.sort();
        unique.dedup();
        if unique.len() != self.subjects.len() {
            return bad("subjects must not repeat".into());
        }
        if let Some(r) = self.replicas {
            if !(1..=5).contains(&r) {
                return bad("replicas must be between 1 and 5".into());
            }
        }
        let Some(partitions) = self.partitions else {
            if self.key_wildcards.is_some() {
                return bad("key_wildcards needs partitions".into());
            }
            return Ok(Planned { subjects: self.subjects.clone(), stamping: None });
        };
        if !(1..=MAX_PARTITIONS).contains(&partitions) {
            return bad(format!("partitions must be between 1 and {MAX_PARTITIONS}"));
        }
        if patterns.len() != 1 {
            return bad("a partition-stamped stream takes exactly one subject (the server applies one transform); \
                 to partition a stream with several subjects use an elastic group"
                .into());
        }
        let pattern = &patterns[0];
        let stars = pattern.star_count() as u32;
        let wildcards = self.key_wildcards.clone().unwrap_or_else(|| (1..=stars).collect());
        let mut seen = wildcards.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != wildcards.len() {
            return bad("key_wildcards must not repeat".into());
        }
        if let Some(w) = wildcards.iter().find(|w| **w < 1 || **w > stars) {
            return bad(format!("key wildcard {w} is out of range: {:?} has {stars} * wildcard(s)", self.subjects[0]));
        }
        let destination = pattern.partition_transform(partitions, &wildcards, TransformSpelling::Stream);
        Ok(Planned {
            subjects: self.subjects.clone(),
            stamping: Some((PartitionSpec { partitions, wildcards }, destination)),
        })
    }

    fn to_config(&self, name: &StreamName, plan: &Planned) -> stream::Config {
        stream::Config {
            name: name.to_string(),
            subjects: plan.subjects.clone(),
            subject_transform: plan.stamping.as_ref().map(|(_, destination)| stream::SubjectTransform {
                source: plan.subjects[0].clone(),
                destination: destination.clone(),
            }),
            storage: match self.storage.unwrap_or(Storage::File) {
                Storage::File => stream::StorageType::File,
                Storage::Memory => stream::StorageType::Memory,
            },
            num_replicas: self.replicas.unwrap_or(1),
            max_age: Duration::from_millis(self.max_age_ms.unwrap_or(0)),
            max_messages: self.max_msgs.filter(|n| *n > 0).unwrap_or(-1),
            max_bytes: self.max_bytes.filter(|n| *n > 0).unwrap_or(-1),
            duplicate_window: Duration::from_millis(self.duplicate_window_ms.unwrap_or(0)),
            description: self.description.clone().filter(|d| !d.is_empty()),
            allow_direct: true,
            allow_atomic_publish: self.allow_atomic.unwrap_or(true),
            ..Default::default()
        }
    }

    /// What differs between this spec and an existing stream's config.
    fn differences(&self, plan: &Planned, have: &stream::Config) -> Vec<String> {
        let mut diff = Vec::new();
        let mut want_subjects = plan.subjects.clone();
        want_subjects.sort();
        let mut have_subjects = have.subjects.clone();
        have_subjects.sort();
        if want_subjects != have_subjects {
            diff.push(format!("subjects (the stream has {:?})", have.subjects));
        }
        let have_spec = have.subject_transform.as_ref().and_then(|t| PartitionSpec::from_transform(&t.destination));
        let want_spec = plan.stamping.as_ref().map(|(spec, _)| spec.clone());
        if have_spec.as_ref().map(|s| s.partitions) != want_spec.as_ref().map(|s| s.partitions) {
            diff.push(format!(
                "partitions (the stream has {}; the partition count never changes: delete and recreate the stream)",
                have_spec.as_ref().map_or("none".to_owned(), |s| s.partitions.to_string())
            ));
        } else if have_spec.map(|s| s.wildcards) != want_spec.map(|s| s.wildcards) {
            diff.push("key_wildcards".into());
        }
        if let Some(storage) = self.storage {
            let have_storage = match have.storage {
                stream::StorageType::Memory => Storage::Memory,
                _ => Storage::File,
            };
            if storage != have_storage {
                diff.push("storage".into());
            }
        }
        if self.replicas.is_some_and(|r| r != have.num_replicas.max(1)) {
            diff.push("replicas".into());
        }
        if self.max_age_ms.is_some_and(|ms| Duration::from_millis(ms) != have.max_age) {
            diff.push("max_age_ms".into());
        }
        // The server stores 0 as "no limit" (-1) and an empty description as none.
        let limit = |n: i64| if n <= 0 { -1 } else { n };
        if self.max_msgs.is_some_and(|n| limit(n) != limit(have.max_messages)) {
            diff.push("max_msgs".into());
        }
        if self.max_bytes.is_some_and(|n| limit(n) != limit(have.max_bytes)) {
            diff.push("max_bytes".into());
        }
        // 0 asks for the server's default window, whatever it chose.
        if self.duplicate_window_ms.is_some_and(|ms| ms != 0 && Duration::from_millis(ms) != have.duplicate_window) {
            diff.push("duplicate_window_ms".into());
        }
        if self.allow_atomic.is_some_and(|a| a != have.allow_atomic_publish) {
            diff.push("allow_atomic".into());
        }
        let description = self.description.as_deref().filter(|d| !d.is_empty());
        if self.description.is_some() && description != have.description.as_deref().filter(|d| !d.is_empty()) {
            diff.push("description".into());
        }
        diff
    }
}

/// What `PUT` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamPutOutcome {
    Created,
    Unchanged,
}

/// The shape of a stream the publish path needs, cached briefly.
#[derive(Debug)]
pub struct StreamShape {
    pub name: String,
    pub patterns: Vec<SubjectPattern>,
    /// The stamping transform's source and what it hashes.
    pub stamping: Option<(SubjectPattern, PartitionSpec)>,
    /// The key's place in the stream's subject, when it has one `*`.
    pub key_slot: Option<KeySlot>,
    /// Next partition for keyless messages (round-robin).
    pub next_partition: AtomicU64,
    /// Numbers keyless-marker tokens.
    pub keyless_counter: AtomicU64,
    /// Why publishers may not write this stream, if they may not.
    pub reserved: Option<String>,
    /// A batch publish sends a key's run of messages as one atomic batch
    /// (src/publish/runs.rs): the stream allows atomic batches and the
    /// server stages them in memory. It stages a one-replica file stream's
    /// batch in a file store of its own, created and removed with fsyncs
    /// per batch (BENCHMARKS.md: runs of 3 at 1,392 msg/s); those streams
    /// take a key's messages one after another.
    pub atomic_runs: bool,
}

/// What comes before and after the key in a stream's one-wildcard subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySlot {
    pub prefix: String,
    pub suffix: String,
    /// The stream stamps the partition from the key alone.
    pub key_only_hash: bool,
}

impl StreamShape {
    pub fn from_config(config: &stream::Config) -> Self {
        let patterns: Vec<SubjectPattern> =
            config.subjects.iter().filter_map(|s| SubjectPattern::parse(s).ok()).collect();
        let stamping = config.subject_transform.as_ref().and_then(|t| {
            let spec = PartitionSpec::from_transform(&t.destination)?;
            Some((SubjectPattern::parse(&t.source).ok()?, spec))
        });
        let key_slot = match patterns.as_slice() {
            [only] if only.star_count() == 1 && !only.has_tail() => {
                let text = only.as_string();
                let tokens: Vec<&str> = text.split('.').collect();
                let at = tokens.iter().position(|t| *t == "*").expect("one star");
                let prefix: String = tokens[..at].iter().map(|t| format!("{t}.")).collect();
                let suffix: String = tokens[at + 1..].iter().map(|t| format!(".{t}")).collect();
                let key_only_hash =
                    stamping.as_ref().is_some_and(|(source, spec)| source == only && spec.wildcards == [1]);
                Some(KeySlot { prefix, suffix, key_only_hash })
            }
            _ => None,
        };
        Self {
            name: config.name.clone(),
            patterns,
            stamping,
            key_slot,
            next_partition: AtomicU64::new(rand::random::<u32>() as u64),
            keyless_counter: AtomicU64::new(0),
            reserved: reserved_stream(config),
            atomic_runs: config.allow_atomic_publish
                && (config.num_replicas > 1 || config.storage == stream::StorageType::Memory),
        }
    }
}

/// How long a cached shape is trusted. A stream deleted and recreated with
/// another partition count elsewhere is noticed within this time.
const SHAPE_TTL: Duration = Duration::from_secs(2);

/// Stream name → (when read, shape). foldhash: every publish looks its
/// stream up here, and only streams that exist are kept.
type ShapeCache = HashMap<String, (Instant, Arc<StreamShape>), foldhash::fast::RandomState>;

/// Streams over one JetStream context.
#[derive(Clone)]
pub struct Streams {
    js: jetstream::Context,
    shapes: Arc<Mutex<ShapeCache>>,
}

impl Streams {
    /// Streams through `js`.
    pub fn new(js: jetstream::Context) -> Self {
        Self { js, shapes: Arc::default() }
    }

    /// Creates a stream, or confirms an identical one exists.
    pub async fn put(&self, name: &StreamName, spec: &StreamSpec) -> Result<(StreamPutOutcome, StreamView), Error> {
        let plan = spec.plan()?;
        if let Some(info) = self.info(name).await? {
            let diff = spec.differences(&plan, &info.config);
            if !diff.is_empty() {
                return Err(Error::new(
                    Kind::ExistsDifferently,
                    format!("stream {name} exists with another configuration: {}", diff.join("; ")),
                ));
            }
            return Ok((StreamPutOutcome::Unchanged, view(&info)));
        }
        let config = spec.to_config(name, &plan);
        match self.js.create_stream(config).await {
            Ok(mut created) => {
                self.forget(name);
                let info = created
                    .info()
                    .await
                    .map_err(|e| Error::from(unavailable_or_internal("reading stream", e)))?
                    .clone();
                Ok((StreamPutOutcome::Created, view(&info)))
            }
            Err(e) => Err(match jetstream_error_code(&e) {
                Some(codes::SUBJECT_OVERLAP) => Error::new(
                    Kind::SubjectsOverlap,
                    format!("subjects {:?} overlap with another stream's subjects", spec.subjects),
                ),
                Some(codes::STREAM_NAME_IN_USE) => {
                    Error::new(Kind::CreatedConcurrently, format!("stream {name} was created concurrently"))
                }
                Some(codes::JETSTREAM_UNAVAILABLE | codes::NO_SUITABLE_PEERS) => {
                    Error::new(Kind::CannotPlace, "JetStream cannot place the stream now; retry").caused_by(e)
                }
                Some(code) => {
                    let field = match code {
                        codes::STORAGE_RESOURCES_EXCEEDED | codes::MEMORY_RESOURCES_EXCEEDED => {
                            "max_bytes (or storage): more than the server can reserve"
                        }
                        codes::REPLICAS_EXCEED_CLUSTER => "replicas: more than the cluster has servers",
                        _ => "the stream's configuration",
                    };
                    Error::new(Kind::Refused, format!("the server refused {field}: {e}")).caused_by(e)
                }
                _ => unavailable_or_internal("creating stream", e).into(),
            }),
        }
    }

    async fn info(&self, name: &StreamName) -> Result<Option<stream::Info>, Error> {
        match self.js.get_stream(name.as_str()).await {
            Ok(s) => Ok(Some(s.cached_info().clone())),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(unavailable_or_internal("reading stream", e).into()),
        }
    }

    /// One stream.
    pub async fn get(&self, name: &StreamName) -> Result<StreamView, Error> {
        let info =
            self.info(name).await?.ok_or_else(|| Error::new(Kind::NotFound, format!("stream {name} not found")))?;
        Ok(view(&info))
    }

    /// Every stream, by name; the storage streams behind KV buckets and
    /// object stores (`KV_*`, `OBJ_*`) only with `all`.
    pub async fn list(&self, all: bool) -> Result<Vec<StreamView>, Error> {
        let mut streams: Vec<StreamView> = self
            .js
            .streams()
            .map_ok(|info| view(&info))
            .try_collect()
            .await
            .map_err(|e| unavailable_or_internal("listing streams", e))?;
        if !all {
            streams.retain(|s| !s.name.starts_with("KV_") && !s.name.starts_with("OBJ_"));
        }
        streams.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(streams)
    }

    /// Deletes a stream and its messages.
    pub async fn delete(&self, name: &StreamName) -> Result<(), Error> {
        self.forget(name);
        match self.js.delete_stream(name.as_str()).await {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Err(Error::new(Kind::NotFound, format!("stream {name} not found"))),
            Err(e) => Err(unavailable_or_internal("deleting stream", e).into()),
        }
    }

    /// The stream's shape for publishing, from the cache when fresh.
    pub async fn shape(&self, name: &StreamName) -> Result<Arc<StreamShape>, Error> {
        if let Some((at, shape)) = self.shapes.lock().expect("shape cache").get(name.as_str()) {
            if at.elapsed() < SHAPE_TTL {
                return Ok(shape.clone());
            }
        }
        // Boxed: a lookup every SHAPE_TTL would otherwise size the future
        // of every publish.
        let info = Box::pin(self.info(name))
            .await?
            .ok_or_else(|| Error::new(Kind::NotFound, format!("stream {name} not found")))?;
        let mut cache = self.shapes.lock().expect("shape cache");
        let fresh = Arc::new(StreamShape::from_config(&info.config));
        // Keep the round-robin position of a shape that did not change.
        let shape = match cache.get(name.as_str()) {
            Some((_, old)) if old.patterns == fresh.patterns && old.stamping == fresh.stamping => old.clone(),
            _ => fresh,
        };
        cache.insert(name.to_string(), (Instant::now(), shape.clone()));
        Ok(shape)
    }

    fn forget(&self, name: &StreamName) {
        self.shapes.lock().expect("shape cache").remove(name.as_str());
    }
}

fn view(info: &stream::Info) -> StreamView {
    let c = &info.config;
    let spec = c.subject_transform.as_ref().and_then(|t| PartitionSpec::from_transform(&t.destination));
    StreamView {
        name: c.name.clone(),
        subjects: c.subjects.clone(),
        partitions: spec.as_ref().map(|s| s.partitions),
        key_wildcards: spec.map(|s| s.wildcards),
        subject_transform: c.subject_transform.as_ref().map(|t| format!("{} -> {}", t.source, t.destination)),
        storage: match c.storage {
            stream::StorageType::Memory => Storage::Memory,
            _ => Storage::File,
        },
        replicas: c.num_replicas.max(1),
        retention: match c.retention {
            stream::RetentionPolicy::Limits => "limits",
            stream::RetentionPolicy::Interest => "interest",
            stream::RetentionPolicy::WorkQueue => "workqueue",
        }
        .to_owned(),
        max_age_ms: c.max_age.as_millis() as u64,
        max_msgs: c.max_messages,
        max_bytes: c.max_bytes,
        duplicate_window_ms: c.duplicate_window.as_millis() as u64,
        description: c.description.clone(),
        allow_atomic: c.allow_atomic_publish,
        messages: info.state.messages,
        bytes: info.state.bytes,
        first_seq: info.state.first_sequence,
        last_seq: info.state.last_sequence,
        consumers: info.state.consumer_count,
        created: info.created,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> StreamSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn stamping_defaults_to_every_wildcard() {
        let plan = spec(serde_json::json!({"subjects":["orders.*"],"partitions":10})).plan().unwrap();
        let (s, dest) = plan.stamping.unwrap();
        assert_eq!(s.wildcards, vec![1]);
        assert_eq!(dest, "{{partition(10,1)}}.orders.{{wildcard(1)}}");
        let plan =
            spec(serde_json::json!({"subjects":["vm.*.*"],"partitions":7,"key_wildcards":[2,1]})).plan().unwrap();
        assert_eq!(plan.stamping.unwrap().1, "{{partition(7,2,1)}}.vm.{{wildcard(1)}}.{{wildcard(2)}}");
        let plan = spec(serde_json::json!({"subjects":["logs.>"],"partitions":3})).plan().unwrap();
        assert_eq!(plan.stamping.unwrap().1, "{{partition(3)}}.logs.>");
    }

    #[test]
    fn bad_stream_specs_are_refused() {
        for bad in [
            serde_json::json!({"subjects":[]}),
            serde_json::json!({"subjects":["a.*","b.*"],"partitions":2}),
            serde_json::json!({"subjects":["a.*"],"partitions":0}),
            serde_json::json!({"subjects":["a.*"],"partitions":2,"key_wildcards":[2]}),
            serde_json::json!({"subjects":["a.*.*"],"partitions":2,"key_wildcards":[1,1]}),
            serde_json::json!({"subjects":["a.*"],"key_wildcards":[1]}),
            serde_json::json!({"subjects":["a b"]}),
            serde_json::json!({"subjects":["a.*","a.*"]}),
            serde_json::json!({"subjects":["$JS.x"]}),
            serde_json::json!({"subjects":["a.*"],"max_age_ms":10}),
        ] {
            assert!(spec(bad.clone()).plan().is_err(), "{bad}");
        }
    }
}
