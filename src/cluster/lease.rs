//! Duties one replica of a keygate cluster does for all (the backlog
//! sampler, elastic groups' source watchdog): a lease per duty in the KV
//! bucket `keygate-leases`, taken by compare-and-set (create), renewed by
//! revision, and expired by the bucket's max age when its holder stops
//! renewing (docs/scale-out.md, "Singleton duties").
//!
//! The holder gives its duty up as soon as one renewal fails, two renewal
//! periods after the last success, which is before the entry can expire
//! and another replica take it: in steady state one replica runs a duty.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::kv;

use crate::nats::buckets::{BucketSpec, Buckets};
use tokio_util::sync::CancellationToken;

/// Where leases live: one key per duty, the holder's name as the value.
pub const LEASES_BUCKET: &str = "keygate-leases";
/// An unrenewed lease expires after this long.
const LEASE_TTL: Duration = Duration::from_secs(6);
/// The holder renews this often (and a waiting replica tries this often).
const RENEW_EVERY: Duration = Duration::from_secs(2);

/// Runs `duty` on this replica while it holds the lease `name`, until
/// `cancel`; tries again for the lease whenever it is free. `holder` names
/// this replica in the bucket (and on the `keygate_singleton_held` gauge).
pub async fn run_as_singleton<F, Fut>(
    buckets: Buckets,
    name: &'static str,
    holder: String,
    cancel: CancellationToken,
    duty: F,
) where
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let gauge = metrics::gauge!(crate::telemetry::metrics::SINGLETON_HELD, "duty" => name);
    let held = |value: f64| gauge.set(value);
    held(0.0);
    loop {
        let acquired = match buckets.open_or_create(BucketSpec::expiring(LEASES_BUCKET, LEASE_TTL)).await {
            Ok(store) => match store.create(name, holder.clone().into()).await {
                Ok(revision) => Some((store, revision)),
                Err(_) => None,
            },
            Err(e) => {
                tracing::debug!(duty = name, error = %e.report(), "lease bucket unavailable");
                None
            }
        };
        let Some((store, revision)) = acquired else {
            // Jittered so replicas that wait do not all ask at once.
            let wait = RENEW_EVERY + Duration::from_millis(rand::random::<u64>() % 500);
            tokio::select! {
                () = tokio::time::sleep(wait) => continue,
                () = cancel.cancelled() => return,
            }
        };
        tracing::info!(duty = name, %holder, "took the lease; running the duty here");
        held(1.0);
        let running = cancel.child_token();
        let task = tokio::spawn(duty(running.clone()));
        let released = hold(&store, name, &holder, revision, &cancel).await;
        running.cancel();
        let _ = task.await;
        held(0.0);
        if released {
            return;
        }
        tracing::warn!(duty = name, "lost the lease; the duty stopped here");
    }
}

/// Renews the lease until `cancel` (then releases it: `true`) or until a
/// renewal fails (`false`).
async fn hold(store: &kv::Store, name: &str, holder: &str, mut revision: u64, cancel: &CancellationToken) -> bool {
    loop {
        tokio::select! {
            () = tokio::time::sleep(RENEW_EVERY) => {}
            () = cancel.cancelled() => {
                // Free at once, so another replica need not wait for the expiry.
                let _ = store.delete_expect_revision(name, Some(revision)).await;
                return true;
            }
        }
        let renewal = tokio::time::timeout(RENEW_EVERY, store.update(name, holder.to_owned().into(), revision)).await;
        match renewal {
            Ok(Ok(next)) => revision = next,
            _ => return false,
        }
    }
}
