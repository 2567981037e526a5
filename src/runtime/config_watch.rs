//! One watch per group-configuration bucket for the whole process, fanned
//! out to every member instance: a thousand WebSocket members cost one
//! watcher (and one server-side consumer), not a thousand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use tokio::sync::broadcast;

/// Updates buffered per receiver before it counts as lagging.
const CAPACITY: usize = 1024;

/// Shared watchers of the group-configuration buckets.
pub struct ConfigWatch {
    js: jetstream::Context,
    buckets: Mutex<HashMap<&'static str, broadcast::Sender<Arc<kv::Entry>>>>,
}

impl ConfigWatch {
    pub fn new(js: jetstream::Context) -> Self {
        Self { js, buckets: Mutex::default() }
    }

    /// Every update to `bucket` from now on. Take it before reading the
    /// configuration, so no update falls between the two.
    pub fn subscribe(&self, bucket: &'static str) -> broadcast::Receiver<Arc<kv::Entry>> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(sender) = buckets.get(bucket) {
            return sender.subscribe();
        }
        let (sender, receiver) = broadcast::channel(CAPACITY);
        buckets.insert(bucket, sender.clone());
        tokio::spawn(watch_bucket(self.js.clone(), bucket, sender));
        receiver
    }
}

/// Forwards the bucket's updates for the life of the process; restarts the watch
/// when it fails (a missed update makes receivers lag, which they treat as
/// "reload").
async fn watch_bucket(js: jetstream::Context, bucket: &'static str, sender: broadcast::Sender<Arc<kv::Entry>>) {
    let mut resume_from: Option<u64> = None;
    loop {
        let watch = match js.get_key_value(bucket).await {
            Ok(store) => match resume_from {
                Some(revision) => store.watch_all_from_revision(revision + 1).await,
                // The latest value of every key first: a session that read
                // its configuration before this watch began still sees any
                // newer revision (it ignores the ones it has).
                None => store.watch_many_with_history([">"]).await,
            },
            Err(e) => {
                tracing::debug!(bucket, error = %e, "configuration bucket not available yet");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut watch = match watch {
            Ok(w) => w,
            Err(e) => {
                tracing::debug!(bucket, error = %e, "watching the configuration bucket failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        while let Some(entry) = watch.next().await {
            match entry {
                Ok(entry) => {
                    resume_from = Some(entry.revision);
                    let _ = sender.send(Arc::new(entry));
                }
                Err(e) => {
                    tracing::debug!(bucket, error = %e, "configuration watch interrupted");
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
