//! One instance of one member: the join → serve → rejoin loop. It joins
//! the member's consumer as pcgroups does, runs a session against it
//! (`session/`), and follows rebalances. Every keygate replica runs one
//! instance per registered member; the pin makes one of them active.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::context::InstanceContext;
use super::join::{join, JoinError};
use super::session::{Joined, Session, SessionEnd};
use crate::delivery::endpoint::Endpoint;
use crate::delivery::frames::ServerFrame;
use crate::delivery::webhook::{registration_key, Registration};
use crate::events::Event;
use crate::groups::config::{ELASTIC_BUCKET, STATIC_BUCKET};
use crate::groups::spec::filter_subjects_of;
use crate::groups::store::{DEFAULT_ACK_WAIT_MS, SETTINGS_BUCKET};
use crate::groups::{GroupConfig, GroupKind};
use crate::member_ref::MemberRef;
use crate::pauses::{wait_while_paused, Waited, PAUSES_BUCKET};

/// Serves `who` through its webhook until `cancel`.
pub async fn serve_webhook(
    ctx: Arc<InstanceContext>,
    who: MemberRef,
    registration: Registration,
    cancel: CancellationToken,
) {
    let endpoint = match Endpoint::webhook(registration, &ctx.webhooks) {
        Ok(endpoint) => endpoint,
        Err(e) => {
            tracing::error!(member = %who.member, error = %e, "webhook registration has an unusable secret");
            return;
        }
    };
    let _served = ctx.pins.serve(&who);
    serve_member(ctx, who, Arc::new(endpoint), cancel).await;
}

/// Serves `who` through `endpoint` until `cancel`: joins the member's
/// consumer, runs sessions, and follows rebalances.
pub async fn serve_member(
    ctx: Arc<InstanceContext>,
    who: MemberRef,
    endpoint: Arc<Endpoint>,
    cancel: CancellationToken,
) {
    let gauge = metrics::gauge!(crate::metrics::MEMBER_INSTANCES, "stream" => who.stream.to_string(), "group" => who.group.to_string());
    gauge.increment(1.0);
    struct Running(metrics::Gauge);
    impl Drop for Running {
        fn drop(&mut self) {
            self.0.decrement(1.0);
        }
    }
    let _running = Running(gauge);
    let mut last_partitions: Option<Vec<u32>> = None;
    loop {
        if cancel.is_cancelled() {
            return;
        }
        // Taken before the configuration is read, so no update falls between.
        let updates = (ctx.config_watch.subscribe(STATIC_BUCKET), ctx.config_watch.subscribe(ELASTIC_BUCKET));
        let settings_updates = ctx.config_watch.subscribe(SETTINGS_BUCKET);
        let mut pause_updates = ctx.config_watch.subscribe(PAUSES_BUCKET);
        if !matches!(ctx.pauses.get(&who).await, Ok(None)) {
            // Paused (or its flag unreadable): no pulls, so no pin.
            let probe = endpoint.probe_lease().map(|lease| (ctx.instance_id.as_str(), lease));
            match wait_while_paused(&ctx.pauses, &who, probe, pause_updates, &cancel).await {
                Waited::Cancelled => return,
                Waited::Resumed => {
                    if let Some(protection) = endpoint.protection() {
                        protection.reset();
                    }
                    continue;
                }
                // Joins as usual, with one message in flight until it is judged.
                Waited::Probe => {
                    if let Some(protection) = endpoint.protection() {
                        protection.start_probe();
                    }
                    pause_updates = ctx.config_watch.subscribe(PAUSES_BUCKET);
                }
            }
        }
        let stored = match Box::pin(ctx.groups.load(&who.stream, &who.group, None)).await {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(error = %e, "group not available; waiting");
                if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                    return;
                }
                continue;
            }
        };
        let group =
            SharedGroup { revision: stored.revision, config: ctx.share_config(&who, stored.revision, stored.config) };
        // Unreadable settings keep the defaults: ack wait 5 s and partition
        // ordering, the stricter order.
        let settings = Box::pin(ctx.groups.settings(&who.stream, &who.group)).await.unwrap_or_default();
        let ack_wait = Duration::from_millis(settings.ack_wait_ms.unwrap_or(DEFAULT_ACK_WAIT_MS));
        let partitions = group.config.partitions_of(who.member.as_str());
        if last_partitions.as_ref() != Some(&partitions) {
            ctx.events.emit(Event::assignment_changed(ctx.about(&who), partitions.clone()));
            let before = last_partitions.clone().unwrap_or_default();
            let gained: Vec<u32> = partitions.iter().copied().filter(|p| !before.contains(p)).collect();
            let lost: Vec<u32> = before.iter().copied().filter(|p| !partitions.contains(p)).collect();
            if !lost.is_empty() {
                endpoint.notify(|| ServerFrame::Revoked { partitions: lost });
            }
            if !gained.is_empty() {
                endpoint.notify(|| ServerFrame::Assigned { partitions: gained });
            }
            last_partitions = Some(partitions.clone());
        }
        let joined = Box::pin(join(
            &ctx.js,
            &group.config,
            who.stream.as_str(),
            who.group.as_str(),
            who.member.as_str(),
            ack_wait,
        ))
        .await;
        let (stream_name, consumer) = match joined {
            Ok(names) => names,
            Err(JoinError::Overlap) => {
                if sleep_or_cancel(&cancel, ack_wait + Duration::from_millis(500)).await {
                    return;
                }
                continue;
            }
            Err(JoinError::NoPartitions) => {
                if Box::pin(wait_for_group_change(&ctx, &who, &group.config, group.revision, &cancel)).await {
                    return;
                }
                continue;
            }
            Err(JoinError::Other(e)) => {
                tracing::warn!(member = %who.member, error = %e, "joining the member's consumer failed; retrying");
                if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                    return;
                }
                continue;
            }
        };
        let old_filters = filter_subjects_of(&group.config, who.member.as_str());
        let joined = Joined {
            config: group.config.clone(),
            revision: group.revision,
            stream_name: stream_name.clone(),
            consumer: consumer.clone(),
            ack_wait,
            settings,
        };
        let session = Box::pin(Session::new(ctx.clone(), who.clone(), endpoint.clone(), joined)).await;
        let Some(session) = session else {
            if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                return;
            }
            continue;
        };
        let updates = match session.config().kind() {
            GroupKind::Static => updates.0,
            GroupKind::Elastic => updates.1,
        };
        match session.run(&cancel, updates, settings_updates, pause_updates).await {
            SessionEnd::Shutdown => return,
            // The loop's next turn finds the flag and waits.
            SessionEnd::Paused => {}
            SessionEnd::Gone => {
                if let Endpoint::Webhook(webhook) = &*endpoint {
                    Box::pin(deregister(&ctx, &who, &webhook.registration)).await;
                }
                return;
            }
            SessionEnd::ConsumerGone => {
                // Deleted with its group, or by an operator: look again, not at once.
                if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                    return;
                }
            }
            SessionEnd::Rejoin { pinned } => {
                // pcgroups' rebalance: the pinned instance deletes the
                // consumer (once its deliveries are done); the others give it
                // a moment first.
                if pinned && group_kind_is_elastic(&stream_name, &who) {
                    Box::pin(super::join::delete_if_unchanged(&ctx.js, &stream_name, &consumer, &old_filters)).await;
                } else if sleep_or_cancel(&cancel, Duration::from_millis(rand::random_range(400..500))).await {
                    return;
                }
            }
        }
    }
}

fn group_kind_is_elastic(stream_name: &str, who: &MemberRef) -> bool {
    stream_name != who.stream.as_str()
}

/// Sleeps; true when cancelled instead.
async fn sleep_or_cancel(cancel: &CancellationToken, duration: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(duration) => false,
        () = cancel.cancelled() => true,
    }
}

/// Waits until the group's configuration changes; true when cancelled.
async fn wait_for_group_change(
    ctx: &InstanceContext,
    who: &MemberRef,
    config: &GroupConfig,
    revision: u64,
    cancel: &CancellationToken,
) -> bool {
    loop {
        if sleep_or_cancel(cancel, Duration::from_millis(500)).await {
            return true;
        }
        match ctx.groups.load(&who.stream, &who.group, Some(config.kind())).await {
            Ok(g) if g.revision == revision => continue,
            _ => return false,
        }
    }
}

/// 410 Gone: the endpoint asked to stop; remove the registration if it is
/// still the one that answered (every replica then stops).
async fn deregister(ctx: &InstanceContext, who: &MemberRef, registration: &Registration) {
    let key = registration_key(who.stream.as_str(), who.group.as_str(), who.member.as_str());
    if let Ok(Some(current)) = ctx.webhook_store.get(&key).await {
        if current.url == registration.url {
            let _ = ctx.webhook_store.delete(&key).await;
        }
    }
    tracing::warn!(member = %who.member, url = %crate::delivery::webhook::redact_url(&registration.url),
        "endpoint answered 410 Gone: stopped serving it");
}

/// A group's configuration as an instance holds it.
struct SharedGroup {
    revision: u64,
    config: Arc<GroupConfig>,
}
