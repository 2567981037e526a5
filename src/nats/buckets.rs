//! Opening KV buckets: those whose entries expire on their own (presence,
//! leases), made when missing (two replicas making one at once both end up
//! with the same bucket); and handles kept once opened, for reads on the
//! request path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;

use super::errors::{is_not_found, unavailable_or_internal};
use crate::error::Error;

/// The bucket `name`, keeping one value per key for at most `max_age`.
pub async fn expiring_bucket(js: &jetstream::Context, name: &str, max_age: Duration) -> Result<kv::Store, String> {
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    let config = kv::Config {
        bucket: name.into(),
        history: 1,
        max_age,
        num_replicas: super::replicas::state_replicas(js),
        ..Default::default()
    };
    match js.create_key_value(config).await {
        Ok(store) => Ok(store),
        Err(created) => js.get_key_value(name).await.map_err(|_| created.to_string()),
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
