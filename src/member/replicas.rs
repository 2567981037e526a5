//! Which keygate replicas are alive: each process renews an entry in the KV
//! bucket `keygate-replicas` and watches the others' (docs/scale-out.md).
//! An entry not renewed for [`REPLICA_TTL`] no longer counts, and the
//! bucket's max age removes it from the server too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub const REPLICAS_BUCKET: &str = "keygate-replicas";
/// A replica unheard for this long is gone.
pub const REPLICA_TTL: Duration = Duration::from_secs(6);
/// How often a replica renews its entry.
const RENEW_EVERY: Duration = Duration::from_secs(2);

/// The live replicas as this one sees them (itself included).
#[derive(Clone, Default)]
pub struct Replicas {
    /// Each replica's tag and when its entry was last written.
    seen: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Replicas {
    /// How many replicas are alive (at least this one).
    pub fn count(&self) -> usize {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, at| at.elapsed() < REPLICA_TTL);
        seen.len().max(1)
    }

    fn saw(&self, tag: &str) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).insert(tag.to_owned(), Instant::now());
    }

    fn forget(&self, tag: &str) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).remove(tag);
    }

    /// Announces this replica (as `name`) until `cancel`, and follows the others.
    pub async fn run(self, js: jetstream::Context, name: String, cancel: CancellationToken) {
        let tag = format!("{:016x}", rand::random::<u64>());
        self.saw(&tag);
        let store = loop {
            match bucket(&js).await {
                Ok(store) => break store,
                Err(e) => tracing::debug!(error = %e, "replicas bucket unavailable; retrying"),
            }
            tokio::select! {
                () = tokio::time::sleep(RENEW_EVERY) => {}
                () = cancel.cancelled() => return,
            }
        };
        let mut watch = None;
        let mut renew = tokio::time::interval(RENEW_EVERY);
        loop {
            if watch.is_none() {
                watch = store.watch_all().await.ok();
            }
            tokio::select! {
                _ = renew.tick() => {
                    if let Err(e) = store.put(&tag, name.clone().into()).await {
                        tracing::debug!(error = %e, "announcing this replica failed");
                    }
                }
                entry = next_entry(&mut watch) => match entry {
                    Some(entry) if entry.operation == kv::Operation::Put => self.saw(&entry.key),
                    Some(entry) => self.forget(&entry.key),
                    None => watch = None,
                },
                () = cancel.cancelled() => {
                    let _ = store.purge(&tag).await;
                    return;
                }
            }
        }
    }
}

async fn next_entry(watch: &mut Option<kv::Watch>) -> Option<kv::Entry> {
    match watch {
        Some(watch) => watch.next().await.and_then(Result::ok),
        None => std::future::pending().await,
    }
}

async fn bucket(js: &jetstream::Context) -> Result<kv::Store, String> {
    if let Ok(store) = js.get_key_value(REPLICAS_BUCKET).await {
        return Ok(store);
    }
    let config = kv::Config {
        bucket: REPLICAS_BUCKET.into(),
        history: 1,
        max_age: REPLICA_TTL,
        num_replicas: crate::nats::replicas::state_replicas(js),
        ..Default::default()
    };
    match js.create_key_value(config).await {
        Ok(store) => Ok(store),
        Err(created) => js.get_key_value(REPLICAS_BUCKET).await.map_err(|_| created.to_string()),
    }
}
