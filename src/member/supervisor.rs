//! Runs an instance for every registered webhook member: watches the
//! registrations bucket and starts, restarts or stops instances so every
//! keygate replica serves every member (the pin picks the active one).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::instance::{serve_webhook, InstanceContext, MemberRef};
use crate::delivery::webhook::Registration;
use crate::names::{GroupName, MemberName, StreamName};

struct Running {
    registration: Registration,
    cancel: CancellationToken,
    /// Done when the instance has wound down.
    done: tokio::sync::watch::Receiver<bool>,
}

fn member_of(key: &str) -> Option<MemberRef> {
    let mut parts = key.splitn(3, '.');
    Some(MemberRef {
        stream: StreamName::parse(parts.next()?).ok()?,
        group: GroupName::parse(parts.next()?).ok()?,
        member: MemberName::parse(parts.next()?).ok()?,
    })
}

/// Watches registrations until `shutdown`, then stops every instance
/// (each finishes or NAKs its deliveries in flight) and returns.
pub async fn supervise(ctx: Arc<InstanceContext>, shutdown: CancellationToken) {
    let tracker = TaskTracker::new();
    let mut running: HashMap<String, Running> = HashMap::new();
    'watching: while !shutdown.is_cancelled() {
        // The bucket appears with the first registration; until then, look again.
        let store = match ctx.js.get_key_value(crate::delivery::webhook::WEBHOOKS_BUCKET).await {
            Ok(store) => store,
            Err(e) => {
                tracing::debug!(error = %e, "no webhook registrations yet");
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
            tracing::debug!(?entry, "registration update");
            let Some(Ok(entry)) = entry else {
                // The watch ended (NATS reconnect): watch again from the start.
                continue 'watching;
            };
            let Some(who) = member_of(&entry.key) else { continue };
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
                    tracing::info!(stream = %who.stream, group = %who.group, member = %who.member, url = %reg.url, "serving webhook member");
                    let (ctx, registration, token) = (ctx.clone(), reg.clone(), cancel.clone());
                    tracker.spawn(async move {
                        if let Some(mut previous) = previous {
                            let _ = previous.wait_for(|done| *done).await;
                        }
                        serve_webhook(ctx, who, registration, token).await;
                        let _ = finished.send(true);
                    });
                    running.insert(entry.key.clone(), Running { registration: reg, cancel, done });
                }
                (None, _) => {
                    if let Some(old) = running.remove(&entry.key) {
                        tracing::info!(member = %who.member, "webhook registration removed: stopping");
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
