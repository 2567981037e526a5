//! Opening KV buckets: keygate's own, made when missing with the replicas
//! its state takes and waited for until they answer ([`Buckets`]); and
//! handles kept once opened, for reads on the request path ([`OpenBuckets`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;

use super::errors::BrokerError as Error;
use super::errors::{is_not_found, unavailable_or_internal};

/// How long keygate waits for a bucket it has just made to answer: on a
/// just-formed cluster a new replicated bucket has no leader for a moment,
/// and the first write to it would fail.
const NEW_BUCKET_PATIENCE: Duration = Duration::from_secs(10);

/// Opens and makes keygate's own KV buckets and streams, with the replicas
/// its state takes (`--state-replicas`, or else what the cluster's size
/// suggests: src/nats/replicas.rs). The one place buckets are made.
#[derive(Clone)]
pub struct Buckets {
    js: jetstream::Context,
    /// `--state-replicas`, when given.
    configured: Option<usize>,
}

/// A bucket as keygate makes it when missing.
#[derive(Debug, Clone, Copy)]
pub struct BucketSpec<'a> {
    pub name: &'a str,
    pub description: &'a str,
    /// Entries expire after this long (zero: never).
    pub max_age: Duration,
    /// `None`: the replicas of keygate's own state.
    pub replicas: Option<usize>,
}

impl<'a> BucketSpec<'a> {
    /// A bucket of keygate's own state, one value per key, kept until changed.
    pub fn state(name: &'a str, description: &'a str) -> Self {
        Self { name, description, max_age: Duration::ZERO, replicas: None }
    }

    /// A bucket of entries that expire on their own (presence, leases).
    pub fn expiring(name: &'a str, max_age: Duration) -> Self {
        Self { name, description: "", max_age, replicas: None }
    }
}

impl Buckets {
    /// Buckets through `js`; `configured`: `--state-replicas`.
    pub fn new(js: jetstream::Context, configured: Option<usize>) -> Self {
        Self { js, configured: configured.map(|r| r.clamp(1, 5)) }
    }

    pub fn js(&self) -> &jetstream::Context {
        &self.js
    }

    /// The replicas of keygate's own state (src/nats/replicas.rs).
    pub fn state_replicas(&self) -> usize {
        self.configured.unwrap_or_else(|| super::replicas::default_for(&self.js.client().server_info()))
    }

    /// The bucket `name`; `None` when there is none.
    pub async fn open(&self, name: &str) -> Result<Option<kv::Store>, Error> {
        match self.js.get_key_value(name).await {
            Ok(store) => Ok(Some(store)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(unavailable_or_internal("reading KV bucket", e)),
        }
    }

    /// The bucket `spec.name`, made as `spec` says when missing (two
    /// replicas making one at once both end up with the same bucket). A
    /// bucket made here is waited for until it answers, up to 10 s.
    pub async fn open_or_create(&self, spec: BucketSpec<'_>) -> Result<kv::Store, Error> {
        if let Some(store) = self.open(spec.name).await? {
            return Ok(store);
        }
        let config = kv::Config {
            bucket: spec.name.to_owned(),
            description: spec.description.to_owned(),
            history: 1,
            max_age: spec.max_age,
            storage: jetstream::stream::StorageType::File,
            num_replicas: spec.replicas.unwrap_or_else(|| self.state_replicas()).max(1),
            ..Default::default()
        };
        match self.js.create_key_value(config).await {
            Ok(store) => {
                self.until_led(&format!("KV_{}", spec.name)).await;
                Ok(store)
            }
            Err(create_err) => match self.open(spec.name).await? {
                Some(store) => Ok(store),
                None => Err(unavailable_or_internal("creating KV bucket", create_err)),
            },
        }
    }

    /// keygate's own stream `config.name` (the dead letters), made when
    /// missing with the replicas of keygate's state.
    pub async fn stream_or_create(&self, mut config: jetstream::stream::Config) -> Result<(), Error> {
        if self.js.get_stream(&config.name).await.is_ok() {
            return Ok(());
        }
        config.num_replicas = self.state_replicas();
        let name = config.name.clone();
        match self.js.create_stream(config).await {
            Ok(_) => {
                self.until_led(&name).await;
                Ok(())
            }
            Err(e) => match self.js.get_stream(&name).await {
                Ok(_) => Ok(()),
                Err(_) => Err(unavailable_or_internal("creating keygate's stream", e)),
            },
        }
    }

    /// Waits, at most [`NEW_BUCKET_PATIENCE`], until the stream just made
    /// has a leader (on one server it has at once).
    async fn until_led(&self, stream: &str) {
        let deadline = tokio::time::Instant::now() + NEW_BUCKET_PATIENCE;
        loop {
            if let Ok(mut handle) = self.js.get_stream(stream).await {
                if let Ok(info) = handle.info().await {
                    if info.cluster.as_ref().is_none_or(|c| c.leader.as_deref().is_some_and(|l| !l.is_empty())) {
                        return;
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(stream, "a stream keygate made has no leader yet; going on");
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Bucket handles kept once opened. Opening a bucket asks the server for its
/// stream's info, a round trip a group view would otherwise pay for each of
/// the three buckets it reads, one after another. A kept handle addresses
/// the bucket by name only, so it survives the bucket being edited or made
/// again; when a read through it fails, the caller forgets it and opens the
/// bucket afresh (it may be gone).
#[derive(Clone, Default)]
pub struct OpenBuckets {
    open: Arc<Mutex<HashMap<&'static str, kv::Store>>>,
}

impl OpenBuckets {
    /// `name`'s kept handle, or the bucket opened now (`Ok(None)`: there is
    /// no such bucket, which is not kept: it may be made later).
    pub async fn open(
        &self,
        js: &jetstream::Context,
        name: &'static str,
    ) -> Result<Option<kv::Store>, jetstream::context::KeyValueError> {
        if let Some(store) = self.lock().get(name) {
            return Ok(Some(store.clone()));
        }
        match js.get_key_value(name).await {
            Ok(store) => {
                self.lock().insert(name, store.clone());
                Ok(Some(store))
            }
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `key`'s entry in bucket `name` (none when the bucket does not exist),
    /// through the kept handle; a failed read opens the bucket afresh and
    /// tries once more, for a bucket deleted since is no error but absent.
    /// `what` names the read in its error.
    pub async fn entry(
        &self,
        js: &jetstream::Context,
        name: &'static str,
        key: &str,
        what: &str,
    ) -> Result<Option<kv::Entry>, Error> {
        let read = async || -> Result<Option<kv::Entry>, Error> {
            let Some(store) = self.opened(js, name).await? else { return Ok(None) };
            store.entry(key).await.map_err(|e| unavailable_or_internal(what, e))
        };
        match read().await {
            Ok(entry) => Ok(entry),
            Err(_) => {
                self.forget(name);
                read().await
            }
        }
    }

    /// The live entries of bucket `name` whose keys match `key_filter`
    /// (none when the bucket does not exist), read without a consumer
    /// (src/nats/kv_scan.rs); retried once afresh as [`entry`](Self::entry) is.
    pub async fn live_entries(
        &self,
        js: &jetstream::Context,
        name: &'static str,
        key_filter: &str,
    ) -> Result<Vec<(String, Bytes)>, Error> {
        let scan = async || -> Result<Vec<(String, Bytes)>, Error> {
            let Some(store) = self.opened(js, name).await? else { return Ok(Vec::new()) };
            super::kv_scan::live_entries(js, &store, key_filter).await
        };
        match scan().await {
            Ok(entries) => Ok(entries),
            Err(_) => {
                self.forget(name);
                scan().await
            }
        }
    }

    async fn opened(&self, js: &jetstream::Context, name: &'static str) -> Result<Option<kv::Store>, Error> {
        self.open(js, name).await.map_err(|e| unavailable_or_internal("reading KV bucket", e))
    }

    /// Drops `name`'s handle: the next [`open`](Self::open) asks the server.
    pub fn forget(&self, name: &str) {
        self.lock().remove(name);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<&'static str, kv::Store>> {
        // A panic elsewhere cannot leave a half-written map: every change is one call.
        self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
