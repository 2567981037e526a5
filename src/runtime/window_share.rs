//! A shuffle window shared by every instance of every subscriber of one
//! consumer: each instance announces itself in a KV bucket whose entries
//! expire, and takes `max_window / instances` of the window. A share only
//! grows after the longest delay has run out, so delays granted under the
//! old shares have expired first and the consumer-wide count never passes
//! `max_window`.

use std::time::{Duration, Instant};

use async_nats::jetstream::kv;

use crate::nats::buckets::{BucketSpec, Buckets};
use crate::nats::kv_scan::live_entries;

/// Where instances announce themselves; entries live this long unrenewed.
const PRESENCE_BUCKET: &str = "keygate-presence";
const PRESENCE_TTL: Duration = Duration::from_secs(10);
/// How often an instance renews its entry and recounts the others.
pub const RENEW_EVERY: Duration = Duration::from_secs(2);

/// This instance's share of a consumer's shuffle window.
pub struct WindowShare {
    buckets: Buckets,
    prefix: String,
    key: String,
    max_delay: Duration,
    /// The share in force.
    share: u64,
    /// A larger share waiting until delays granted before it have expired.
    pending: Option<(u64, Instant)>,
}

impl WindowShare {
    /// Starts with no share: a newcomer waits until the others have
    /// shrunk theirs and their older delays have run out.
    pub fn new(buckets: Buckets, stream: &str, consumer: &str, max_delay: Duration) -> Self {
        let prefix = format!("{stream}.{consumer}.");
        let key = format!("{prefix}{}", uuid_like());
        Self { buckets, prefix, key, max_delay, share: 0, pending: None }
    }

    /// The share in force now.
    pub fn current(&mut self) -> u64 {
        if let Some((next, from)) = self.pending {
            if Instant::now() >= from {
                self.share = next;
                self.pending = None;
            }
        }
        self.share
    }

    /// Renews this instance's entry and recomputes its share of `max_window`.
    pub async fn renew(&mut self, max_window: u64) {
        let Ok(store) = self.bucket().await else {
            tracing::debug!("shuffle window: presence bucket unavailable");
            return;
        };
        if let Err(e) = store.put(&self.key, "1".into()).await {
            tracing::debug!(error = %e, "shuffle window: announcing failed");
            return;
        }
        // Without a consumer per count (src/nats/kv_scan.rs): one every
        // renewal per instance would linger on the server for 30 s each.
        let announced = match live_entries(self.buckets.js(), &store, &format!("{}*", self.prefix)).await {
            Ok(announced) => announced,
            Err(e) => {
                tracing::debug!(error = %e.report(), "shuffle window: listing failed");
                return;
            }
        };
        let instances = announced.len().max(1) as u64;
        let fair = max_window / instances;
        tracing::debug!(instances, fair, share = self.share, "shuffle window share");
        if fair < self.share {
            // Shrinking is safe at once.
            self.share = fair;
            self.pending = None;
        } else if fair > self.share && self.pending.is_none_or(|(next, _)| next != fair) {
            // Growing waits out every delay granted under the old shares
            // (and one renewal, so the others have seen a newcomer).
            self.pending = Some((fair, Instant::now() + self.max_delay + RENEW_EVERY));
        }
    }

    /// Removes this instance's entry (the others' shares grow later).
    pub async fn leave(&self) {
        if let Ok(store) = self.bucket().await {
            let _ = store.purge(&self.key).await;
        }
    }

    async fn bucket(&self) -> Result<kv::Store, ()> {
        self.buckets.open_or_create(BucketSpec::expiring(PRESENCE_BUCKET, PRESENCE_TTL)).await.map_err(|_| ())
    }
}

fn uuid_like() -> String {
    format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())
}
