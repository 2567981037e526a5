//! Runs an instance for every registered webhook member and plain
//! consumer's webhook subscriber: watches the registration buckets and
//! starts, restarts or stops instances so every keygate replica serves
//! every member (the pin picks the active one).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::instance::serve_webhook;
use super::target::{Target, DEFAULT_SUBSCRIBER_OPTIONS};
use super::Runtime;
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::webhook::{redact_url, Registration, CONSUMER_WEBHOOKS_BUCKET, WEBHOOKS_BUCKET};

struct Running {
    registration: Registration,
    cancel: CancellationToken,
    /// Done when the instance has wound down.
    done: tokio::sync::watch::Receiver<bool>,
}

/// The member a registration key (`<stream>.<group>.<member>`) names.
fn member_of(key: &str) -> Option<Target> {
    let mut parts = key.splitn(3, '.');
    Some(Target::member(
        StreamName::parse(parts.next()?).ok()?,
        GroupName::parse(parts.next()?).ok()?,
        MemberName::parse(parts.next()?).ok()?,
    ))
}

/// The subscriber a registration key (`<stream>.<consumer>.<subscriber>`) names.
fn subscriber_of(key: &str, registration: &Registration) -> Option<Target> {
    let mut parts = key.splitn(3, '.');
    let stream = StreamName::parse(parts.next()?).ok()?;
    let consumer = ConsumerName::parse(parts.next()?).ok()?;
    let subscriber = MemberName::parse(parts.next()?).ok()?;
    let options = registration.subscriber.unwrap_or(DEFAULT_SUBSCRIBER_OPTIONS);
    Target::subscriber(stream, &consumer, subscriber, options)
}

/// Watches members' and consumer subscribers' registrations until
/// `shutdown`, then stops every instance (each finishes or NAKs its
/// deliveries in flight) and returns.
pub async fn supervise(ctx: Arc<Runtime>, shutdown: CancellationToken) {
    let members = supervise_bucket(ctx.clone(), WEBHOOKS_BUCKET, shutdown.clone(), |ctx, key, registration, token| {
        let target = member_of(&key);
        async move {
            if let Some(target) = target {
                let who = target.who();
                tracing::info!(stream = %who.stream, group = %who.group, member = %who.member, url = %redact_url(&registration.url), "serving webhook member");
                serve_webhook(ctx, target, registration, token).await;
            }
        }
    });
    let consumers = supervise_bucket(ctx, CONSUMER_WEBHOOKS_BUCKET, shutdown, |ctx, key, registration, token| {
        let target = subscriber_of(&key, &registration);
        async move {
            if let Some(target) = target {
                let who = target.who();
                tracing::info!(stream = %who.stream, consumer = %who.group, subscriber = %who.member, url = %redact_url(&registration.url), "serving consumer subscriber");
                serve_webhook(ctx, target, registration, token).await;
            }
        }
    });
    tokio::join!(members, consumers);
}

/// Runs `run` for every registration in `bucket`, restarting it when the
/// registration changes and stopping it when it is removed.
async fn supervise_bucket<F, Fut>(ctx: Arc<Runtime>, bucket: &'static str, shutdown: CancellationToken, run: F)
where
    F: Fn(Arc<Runtime>, String, Registration, CancellationToken) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let tracker = TaskTracker::new();
    let mut running: HashMap<String, Running> = HashMap::new();
    'watching: while !shutdown.is_cancelled() {
        // The bucket appears with the first registration; until then, look again.
        let store = match ctx.broker.js.get_key_value(bucket).await {
            Ok(store) => store,
            Err(e) => {
                tracing::debug!(bucket, error = %e, "no registrations yet");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    () = shutdown.cancelled() => break,
                }
            }
        };
        tracing::debug!("watching webhook registrations");
        let mut watch = match store.watch_with_history(">").await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "watching webhook registrations");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    () = shutdown.cancelled() => break,
                }
            }
        };
        loop {
            let entry = tokio::select! {
                entry = watch.next() => entry,
                () = shutdown.cancelled() => break 'watching,
            };
            let Some(Ok(entry)) = entry else {
                // The watch ended (NATS reconnect): watch again from the start.
                continue 'watching;
            };
            // Never the entry itself: its value holds the signing secret.
            tracing::debug!(key = %entry.key, operation = ?entry.operation, revision = entry.revision, "registration update");
            let registration = match entry.operation {
                async_nats::jetstream::kv::Operation::Put => serde_json::from_slice::<Registration>(&entry.value).ok(),
                _ => None,
            };
            match (registration, running.get(&entry.key)) {
                (Some(reg), Some(current)) if current.registration == reg => {}
                (Some(reg), _) => {
                    // A changed registration: the old instance winds down first,
                    // so two of this process never deliver one member at once.
                    let previous = running.remove(&entry.key).map(|old| {
                        old.cancel.cancel();
                        old.done
                    });
                    let cancel = shutdown.child_token();
                    let (finished, done) = tokio::sync::watch::channel(false);
                    let serving = run(ctx.clone(), entry.key.clone(), reg.clone(), cancel.clone());
                    tracker.spawn(async move {
                        if let Some(mut previous) = previous {
                            let _ = previous.wait_for(|done| *done).await;
                        }
                        serving.await;
                        let _ = finished.send(true);
                    });
                    running.insert(entry.key.clone(), Running { registration: reg, cancel, done });
                }
                (None, _) => {
                    if let Some(old) = running.remove(&entry.key) {
                        tracing::info!(key = %entry.key, bucket, "registration removed: stopping");
                        old.cancel.cancel();
                    }
                }
            }
        }
    }
    for (_, r) in running {
        r.cancel.cancel();
    }
    tracker.close();
    tracker.wait().await;
}
