//! One instance of one member or subscriber: the pause → join → drive →
//! rejoin loop. A member joins its consumer as pcgroups does and follows
//! rebalances; a subscriber reads its plain consumer as it is. Every
//! keygate replica runs one instance per webhook registration, a WebSocket
//! connection or pull client runs one more; the pin makes one active.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PriorityPolicy;
use tokio_util::sync::CancellationToken;

use super::driver::{Dispatch, Driver, Ended, Joined, MemberJoined, SubscriberJoined, Watches};
use super::join::{join, pinned_ttl, JoinError};
use super::target::Target;
use super::Runtime;
use crate::delivery::frames::ServerFrame;
use crate::delivery::message::Partitioning;
use crate::events::Event;
use crate::groups::config::{ELASTIC_BUCKET, PRIORITY_GROUP, STATIC_BUCKET};
use crate::groups::spec::filter_subjects_of;
use crate::groups::store::SETTINGS_BUCKET;
use crate::groups::{GroupConfig, GroupKind};
use crate::names::MemberRef;
use crate::pauses::{wait_while_paused, Waited, PAUSES_BUCKET};
use crate::runtime::endpoint::Endpoint;
use crate::webhook::{redact_url, registration_key, Registration, SubscriberOptions};

/// Serves `target` through its webhook registration until `cancel`.
pub async fn serve_webhook(ctx: Arc<Runtime>, target: Target, registration: Registration, cancel: CancellationToken) {
    let who = target.who().clone();
    let endpoint = match Endpoint::webhook(registration, &ctx.webhook_client) {
        Ok(endpoint) => endpoint,
        Err(e) => {
            tracing::error!(stream = %who.stream, group = %who.group, member = %who.member, error = %e,
                "webhook registration cannot be served");
            return;
        }
    };
    // Webhook members' pins are balanced across replicas (cluster/balance.rs).
    let _served = target.is_member().then(|| ctx.cluster.pins.serve(&who));
    serve(ctx, target, Arc::new(endpoint), cancel).await;
}

/// Serves `target` through `endpoint` until `cancel`: waits while it is
/// paused, joins its consumer, drives it, and joins again after a
/// rebalance, a resume or a lost consumer.
pub async fn serve(ctx: Arc<Runtime>, target: Target, endpoint: Arc<Endpoint>, cancel: CancellationToken) {
    let who = target.who().clone();
    let _running = target.is_member().then(|| Running::count(&who));
    let mut last_partitions: Option<Vec<u32>> = None;
    loop {
        if cancel.is_cancelled() {
            return;
        }
        // Taken before the configuration and the flag are read, so no
        // update falls between.
        let configs = (ctx.config_watch.subscribe(STATIC_BUCKET), ctx.config_watch.subscribe(ELASTIC_BUCKET));
        let settings = ctx.config_watch.subscribe(SETTINGS_BUCKET);
        let mut pauses = ctx.config_watch.subscribe(PAUSES_BUCKET);
        if !matches!(ctx.stores.pauses.get(&who).await, Ok(None)) {
            // Paused (or its flag unreadable): no pulls, so no pin.
            let probe = endpoint.probe_lease().map(|lease| (ctx.cluster.instance_id.as_str(), lease));
            match wait_while_paused(&ctx.stores.pauses, &who, probe, pauses, &cancel).await {
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
                    pauses = ctx.config_watch.subscribe(PAUSES_BUCKET);
                }
            }
        }
        let step = match &target {
            Target::Member(who) => Box::pin(join_member(&ctx, who, &endpoint, &mut last_partitions, &cancel)).await,
            Target::Subscriber { who, options } => Box::pin(join_subscriber(&ctx, who, *options)).await,
        };
        let joined = match step {
            Step::Joined(joined) => joined,
            Step::Cancelled => return,
            Step::Retry(after) => {
                if sleep_or_cancel(&cancel, after).await {
                    return;
                }
                continue;
            }
        };
        let (stream_name, consumer) = (joined.stream_name.clone(), joined.consumer.clone());
        let member = joined.member().map(|m| (m.config.clone(), filter_subjects_of(&m.config, who.member.as_str())));
        let watches = Watches {
            configs: member.as_ref().map(|(config, _)| match config.kind() {
                GroupKind::Static => configs.0,
                GroupKind::Elastic => configs.1,
            }),
            settings: member.is_some().then_some(settings),
            pauses,
        };
        let Some(driver) = Box::pin(Driver::new(ctx.clone(), target.clone(), endpoint.clone(), joined)).await else {
            if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                return;
            }
            continue;
        };
        match driver.run(&cancel, watches).await {
            Ended::Shutdown => return,
            // The loop's next turn finds the flag and waits.
            Ended::Paused => {}
            Ended::Gone => {
                if let Endpoint::Webhook(webhook) = &*endpoint {
                    Box::pin(deregister(&ctx, &target, &webhook.registration)).await;
                }
                return;
            }
            Ended::ConsumerGone => {
                // Deleted with its group, or by an operator: look again, not at once.
                if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                    return;
                }
            }
            Ended::Rejoin { pinned } => {
                // pcgroups' rebalance: the pinned instance deletes the
                // consumer (once its deliveries are done); the others give it
                // a moment first.
                let elastic = stream_name != who.stream.as_str();
                match member {
                    Some((_, old_filters)) if pinned && elastic => {
                        Box::pin(super::join::delete_if_unchanged(
                            &ctx.broker.js,
                            &stream_name,
                            &consumer,
                            &old_filters,
                        ))
                        .await;
                    }
                    _ => {
                        if sleep_or_cancel(&cancel, Duration::from_millis(rand::random_range(400..500))).await {
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// What a join attempt came to.
enum Step {
    Joined(Joined),
    /// Not now: try again after this long.
    Retry(Duration),
    Cancelled,
}

/// Joins a group member's consumer as pcgroups does, telling the endpoint
/// and events when its partitions changed.
async fn join_member(
    ctx: &Runtime,
    who: &MemberRef,
    endpoint: &Endpoint,
    last_partitions: &mut Option<Vec<u32>>,
    cancel: &CancellationToken,
) -> Step {
    let stored = match Box::pin(ctx.stores.groups.load(&who.stream, &who.group, None)).await {
        Ok(g) => g,
        Err(e) => {
            tracing::debug!(error = %e.report(), "group not available; waiting");
            return Step::Retry(Duration::from_secs(1));
        }
    };
    let (revision, config) = (stored.revision, ctx.share_config(who, stored.revision, stored.config));
    // Unreadable settings keep the defaults: ack wait 5 s and partition
    // ordering, the stricter order.
    let settings = Box::pin(ctx.stores.groups.settings(&who.stream, &who.group)).await.unwrap_or_default();
    let ack_wait = settings.ack_wait();
    let partitions = config.partitions_of(who.member.as_str());
    if last_partitions.as_ref() != Some(&partitions) {
        ctx.events.emit(Event::assignment_changed(ctx.about(who), partitions.clone()));
        let before = last_partitions.clone().unwrap_or_default();
        let gained: Vec<u32> = partitions.iter().copied().filter(|p| !before.contains(p)).collect();
        let lost: Vec<u32> = before.iter().copied().filter(|p| !partitions.contains(p)).collect();
        if !lost.is_empty() {
            endpoint.notify(|| ServerFrame::Revoked { partitions: lost });
        }
        if !gained.is_empty() {
            endpoint.notify(|| ServerFrame::Assigned { partitions: gained });
        }
        *last_partitions = Some(partitions);
    }
    let joined =
        Box::pin(join(&ctx.broker.js, &config, who.stream.as_str(), who.group.as_str(), who.member.as_str(), ack_wait))
            .await;
    let (stream_name, consumer) = match joined {
        Ok(names) => names,
        Err(JoinError::Overlap) => return Step::Retry(ack_wait + Duration::from_millis(500)),
        Err(JoinError::NoPartitions) => {
            return match Box::pin(wait_for_group_change(ctx, who, &config, revision, cancel)).await {
                true => Step::Cancelled,
                false => Step::Retry(Duration::ZERO),
            };
        }
        Err(JoinError::Other(e)) => {
            tracing::warn!(member = %who.member, error = %e, "joining the member's consumer failed; retrying");
            return Step::Retry(Duration::from_secs(1));
        }
    };
    Step::Joined(Joined {
        stream_name,
        consumer,
        ack_wait,
        priority_group: Some(PRIORITY_GROUP.to_owned()),
        pinned: true,
        pin_ttl: pinned_ttl(ack_wait),
        dispatch: Dispatch::Lanes(MemberJoined { config, revision, settings }),
    })
}

/// Reads a plain consumer as it is now; retries while it or its stream is
/// missing.
async fn join_subscriber(ctx: &Runtime, who: &MemberRef, options: SubscriberOptions) -> Step {
    let (stream_name, consumer) = (who.stream.as_str(), who.group.as_str());
    let stream = match ctx.broker.js.get_stream(stream_name).await {
        Ok(stream) => stream,
        Err(e) => {
            tracing::debug!(stream = stream_name, error = %e, "subscriber's stream not available; waiting");
            return Step::Retry(Duration::from_secs(1));
        }
    };
    let stamped = stream.cached_info().config.subject_transform.is_some();
    let info = match stream.consumer_info(consumer).await {
        Ok(info) => info,
        Err(e) => {
            tracing::debug!(consumer, error = %e, "subscriber's consumer not available; waiting");
            return Step::Retry(Duration::from_secs(1));
        }
    };
    let config = &info.config;
    Step::Joined(Joined {
        stream_name: stream_name.to_owned(),
        consumer: consumer.to_owned(),
        ack_wait: config.ack_wait,
        priority_group: config.priority_groups.first().cloned(),
        pinned: config.priority_policy == PriorityPolicy::PinnedClient,
        pin_ttl: config.priority_timeout,
        dispatch: Dispatch::Concurrent(SubscriberJoined {
            options,
            partitioning: Partitioning::IfStamped(stamped),
            shuffle: crate::consumers::Shuffle::of(config),
        }),
    })
}

/// Counts a running member instance in `keygate_member_instances`.
struct Running(metrics::Gauge);

impl Running {
    fn count(who: &MemberRef) -> Self {
        let gauge = metrics::gauge!(crate::telemetry::metrics::MEMBER_INSTANCES, "stream" => who.stream.to_string(), "group" => who.group.to_string());
        gauge.increment(1.0);
        Self(gauge)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
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
    ctx: &Runtime,
    who: &MemberRef,
    config: &GroupConfig,
    revision: u64,
    cancel: &CancellationToken,
) -> bool {
    loop {
        if sleep_or_cancel(cancel, Duration::from_millis(500)).await {
            return true;
        }
        match ctx.stores.groups.load(&who.stream, &who.group, Some(config.kind())).await {
            Ok(g) if g.revision == revision => continue,
            _ => return false,
        }
    }
}

/// 410 Gone: the endpoint asked to stop; remove the registration if it is
/// still the one that answered (every replica then stops).
async fn deregister(ctx: &Runtime, target: &Target, registration: &Registration) {
    let who = target.who();
    let key = registration_key(who.stream.as_str(), who.group.as_str(), who.member.as_str());
    let store = if target.is_member() { &ctx.stores.webhooks } else { &ctx.stores.consumer_webhooks };
    if let Ok(Some(current)) = store.get(&key).await {
        if current.url == registration.url {
            let _ = store.delete(&key).await;
        }
    }
    tracing::warn!(stream = %who.stream, group = %who.group, member = %who.member, url = %redact_url(&registration.url),
        "endpoint answered 410 Gone: stopped serving it");
}
