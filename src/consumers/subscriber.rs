//! A webhook subscriber of a plain consumer (no key order): pulls with the
//! consumer's priority group and the subscriber's options (`priority`,
//! `min_pending`, `min_ack_pending`, the pin id), and delivers up to
//! `concurrency` messages at once with the same verdicts, dead letters and
//! events as group members.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PriorityPolicy, kv};
use futures::StreamExt;
use tokio::sync::broadcast::Receiver;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::shuffle_window::ShuffleWindow;
use super::window_share::{WindowShare, RENEW_EVERY};
use crate::delivery::endpoint::Endpoint;
use crate::delivery::message::{Delivered, Held, Partitioning};
use crate::delivery::webhook::{Registration, SubscriberOptions};
use crate::member::context::InstanceContext;
use crate::member::deliver::deliver;
use crate::member::fencing::next_token;
use crate::member::pin::{announce_pinned, announce_standby, announce_unpinned, pinned_to_someone, PinState};
use crate::member::pull::{classify, OpenPulls, PullRequest, Reply};
use crate::member_ref::{MemberRef, Owner};
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::pauses::{pause_key, pause_update, wait_while_paused, PauseUpdate, Waited, PAUSES_BUCKET};

/// How long one pull waits at the server.
const PULL_EXPIRY: Duration = Duration::from_secs(5);
/// Fewest messages a subscriber takes in at once.
const MIN_PREFETCH: usize = 64;
/// Fewest messages a subscriber may hold (in flight and queued) before it
/// counts as saturated.
const MIN_HELD: usize = 512;
/// Pulls kept open at once: the next is waiting at the server before the
/// current one is filled, so a prioritized or overflow subscriber is never
/// seen without a pull (the server would serve the next priority then).
const MAX_OPEN_PULLS: usize = 2;

/// A named subscriber of a consumer (a consumer may have several, each
/// with its own pull options: a near and a far region, priorities 0 and 5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerTarget {
    pub stream: StreamName,
    pub consumer: ConsumerName,
    pub subscriber: MemberName,
}

/// Serves `target` through the registration's webhook until `cancel`.
pub async fn serve_consumer_webhook(
    ctx: Arc<InstanceContext>,
    target: ConsumerTarget,
    registration: Registration,
    cancel: CancellationToken,
) {
    let options = registration.subscriber.unwrap_or(SubscriberOptions {
        priority: None,
        min_pending: None,
        min_ack_pending: None,
        concurrency: 1,
    });
    let Ok(endpoint) = Endpoint::webhook(registration, &ctx.webhooks) else {
        tracing::error!(consumer = %target.consumer, "subscriber registration has an unusable secret");
        return;
    };
    serve_consumer(ctx, target, Arc::new(endpoint), options, cancel).await;
}

/// Serves `target` through `endpoint` (a webhook or a WebSocket) until `cancel`.
pub async fn serve_consumer(
    ctx: Arc<InstanceContext>,
    target: ConsumerTarget,
    endpoint: Arc<Endpoint>,
    options: SubscriberOptions,
    cancel: CancellationToken,
) {
    // Events of a subscriber: keygate.events.<stream>.<consumer>.<subscriber>.<type>.
    let Ok(group) = GroupName::parse(target.consumer.as_str()) else { return };
    let who =
        MemberRef { stream: target.stream.clone(), group, member: target.subscriber.clone(), owner: Owner::Consumer };
    while !cancel.is_cancelled() {
        // Taken before the flag is read, so no pause falls between.
        let mut pause_updates = ctx.config_watch.subscribe(PAUSES_BUCKET);
        if !matches!(ctx.pauses.get(&who).await, Ok(None)) {
            let probe = endpoint.probe_lease().map(|lease| (ctx.instance_id.as_str(), lease));
            match wait_while_paused(&ctx.pauses, &who, probe, pause_updates, &cancel).await {
                Waited::Cancelled => return,
                Waited::Resumed => {
                    if let Some(protection) = endpoint.protection() {
                        protection.reset();
                    }
                    continue;
                }
                Waited::Probe => {
                    if let Some(protection) = endpoint.protection() {
                        protection.start_probe();
                    }
                    pause_updates = ctx.config_watch.subscribe(PAUSES_BUCKET);
                }
            }
        }
        match Box::pin(serve_once(&ctx, &target, &who, &endpoint, options, pause_updates, &cancel)).await {
            Ok(Ended::Shutdown) => return,
            Ok(Ended::Paused) => {}
            Err(why) => {
                tracing::debug!(consumer = %target.consumer, %why, "subscriber pausing");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = cancel.cancelled() => return,
                }
            }
        }
    }
}

/// Why a run ended, when it ended well.
enum Ended {
    Shutdown,
    /// An operator paused the subscriber.
    Paused,
}

/// One run against the consumer as it is now; `Err` when it is missing or
/// was deleted (look again later).
async fn serve_once(
    ctx: &Arc<InstanceContext>,
    target: &ConsumerTarget,
    who: &MemberRef,
    endpoint: &Arc<Endpoint>,
    options: SubscriberOptions,
    mut pauses: Receiver<Arc<kv::Entry>>,
    cancel: &CancellationToken,
) -> Result<Ended, String> {
    let pause_key = pause_key(who);
    // A breaker's probe: one delivery at a time, this instance's own claim
    // does not pause it, and the resume (the probe succeeded) starts over at
    // full width.
    let probing = endpoint.protection().is_some_and(|p| p.probing());
    let stream = ctx.js.get_stream(target.stream.as_str()).await.map_err(|e| e.to_string())?;
    // Only a partition-stamped stream's subjects start with a partition token.
    let partitioning = Partitioning::IfStamped(stream.cached_info().config.subject_transform.is_some());
    let info = stream.consumer_info(target.consumer.as_str()).await.map_err(|e| e.to_string())?;
    let group = info.config.priority_groups.first().cloned();
    let pinned_policy = info.config.priority_policy == PriorityPolicy::PinnedClient;
    let shuffle = crate::consumers::Shuffle::of(&info.config);
    let mut window = ShuffleWindow::new(target.stream.as_str(), target.consumer.as_str());
    let mut share = shuffle.map(|s| {
        WindowShare::new(
            ctx.js.clone(),
            target.stream.as_str(),
            target.consumer.as_str(),
            Duration::from_millis(s.max_delay_ms),
        )
    });
    if let (Some(share), Some(s)) = (share.as_mut(), shuffle) {
        share.renew(s.max_window).await;
    }
    let mut renew = tokio::time::interval(RENEW_EVERY);
    let mut pulls = OpenPulls::new(ctx.nats.new_inbox());
    let mut replies = ctx.nats.subscribe(pulls.reply_filter()).await.map_err(|e| e.to_string())?;
    let concurrency = if probing { 1 } else { options.concurrency.max(1) };
    // Held messages (in flight + queued, kept alive with progress acks) and
    // messages asked for stay within `max_held`, so a burst goes to this
    // subscriber rather than past it to a lower priority; when it holds
    // that many it is saturated and stops pulling, which is when the next
    // priority is served. Pulls top up in steps of at least `prefetch`.
    let prefetch = (4 * concurrency).max(MIN_PREFETCH);
    let max_held = (16 * concurrency).max(MIN_HELD);
    let mut progress = tokio::time::interval((info.config.ack_wait / 3).max(Duration::from_millis(100)));
    let mut deliveries = JoinSet::new();
    // Received, waiting for a delivery slot: keeps a pull open while all
    // slots are busy, so a prioritized or overflow subscriber stays "pulling"
    // (the server serves others only when it is saturated).
    let mut queued: VecDeque<Held> = VecDeque::new();
    let mut pin = PinState::default();
    // Without a raised token a subscriber still delivers (it keeps no key
    // order to protect): it counts on from the last token it knew.
    let mut fencing = 0u64;
    let end = loop {
        pulls.expire(Instant::now());
        while deliveries.len() < concurrency {
            let Some(held) = queued.pop_front() else { break };
            let (ctx, who, endpoint) = (ctx.clone(), who.clone(), endpoint.clone());
            deliveries.spawn(async move { deliver(ctx, who, endpoint, held, fencing).await.events });
        }
        // Ask for all the room there is, so a burst stays with this
        // subscriber; top up in steps of at least `prefetch`, or whenever no
        // pull is waiting at all.
        while pulls.len() < MAX_OPEN_PULLS {
            let asked = pulls.asked();
            let room = max_held.saturating_sub(deliveries.len() + queued.len() + asked);
            if room == 0 || (asked > 0 && room < prefetch) {
                break;
            }
            let request = PullRequest {
                batch: room,
                expires: PULL_EXPIRY.as_nanos() as u64,
                group: group.clone(),
                id: pin.id().map(str::to_owned),
                priority: options.priority,
                min_pending: options.min_pending,
                min_ack_pending: options.min_ack_pending,
            };
            if !pulls.send(&ctx.outbox, target.stream.as_str(), target.consumer.as_str(), &request).await {
                break;
            }
        }
        let deadline = pulls.next_deadline().unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
        tokio::select! {
            () = cancel.cancelled() => break Ok(Ended::Shutdown),
            update = pauses.recv() => match pause_update(&pause_key, update) {
                PauseUpdate::Paused { probing_by } if probing && probing_by.as_deref() == Some(ctx.instance_id.as_str()) => {}
                PauseUpdate::Paused { .. } | PauseUpdate::Unknown => break Ok(Ended::Paused),
                PauseUpdate::Resumed if probing => break Ok(Ended::Paused),
                PauseUpdate::Resumed | PauseUpdate::Other => {}
            },
            done = deliveries.join_next(), if !deliveries.is_empty() => {
                if let Some(Ok(events)) = done {
                    for e in events {
                        ctx.events.emit(e);
                    }
                }
            }
            () = tokio::time::sleep_until(deadline.into()) => {}
            _ = renew.tick(), if share.is_some() => {
                if let (Some(share), Some(s)) = (share.as_mut(), shuffle) {
                    share.renew(s.max_window).await;
                }
            }
            _ = progress.tick() => {
                window.refresh();
                // Queued messages wait for a slot: keep them from timing out.
                for held in &queued {
                    let _ = held.message.ack_with(jetstream::AckKind::Progress).await;
                }
            }
            reply = replies.next() => {
                let Some(reply) = reply else { break Err("reply subscription closed".to_owned()) };
                // Status replies come on the pull's own inbox subject.
                let pull_subject = reply.subject.to_string();
                match classify(reply.status, reply.description.as_deref(), reply.headers.as_ref()) {
                    Reply::Message { pin: given } => {
                        pulls.message_arrived();
                        if let Some(given) = given.filter(|_| pinned_policy) {
                            if pin.on_message_pin(&given) {
                                fencing = next_token(&ctx.js, &fencing_key(target)).await.unwrap_or(fencing + 1);
                                pin.set_token(fencing);
                                announce_pinned(ctx, who, endpoint, given, Some(fencing), Vec::new(), None);
                            }
                        }
                        let pulled = Delivered::from_pull(&ctx.js, reply, target.stream.as_str(), partitioning, |_| None);
                        let Some((held, _)) = pulled else { continue };
                        let allowed = share.as_mut().map_or(0, |s| s.current());
                        if let Some(delay) = shuffle.and_then(|s| window.delay_first_delivery(&s, allowed, held.attempt)) {
                            let _ = held.message.ack_with(jetstream::AckKind::Nak(Some(delay))).await;
                            continue;
                        }
                        queued.push_back(Arc::new(held));
                    }
                    Reply::Done => {
                        pulls.finish(&pull_subject);
                        // A pull that ends empty while another client holds
                        // the pin: this instance is a standby.
                        if pinned_policy && !pin.is_pinned() && !pin.is_standby() {
                            if let Ok(info) = stream.consumer_info(target.consumer.as_str()).await {
                                if pinned_to_someone(&info) && pin.stand_by() {
                                    announce_standby(ctx, who, endpoint, Vec::new());
                                }
                            }
                        }
                    }
                    Reply::PinRejected { description } => {
                        if pulls.pin_rejected(&pull_subject, pin.id()) && pin.lose() {
                            announce_unpinned(ctx, who, endpoint, &description, Vec::new());
                        }
                    }
                    Reply::ConsumerDeleted => break Err("consumer deleted".to_owned()),
                    Reply::Conflict { description } | Reply::BadRequest { description } => {
                        pulls.finish(&pull_subject);
                        tracing::debug!(%description, "pull refused");
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    Reply::Ignore => {}
                }
            }
        }
    };
    if let Some(share) = &share {
        share.leave().await;
    }
    // Messages not yet handed to the endpoint go back at once.
    for held in queued {
        let _ = held.message.ack_with(jetstream::AckKind::Nak(None)).await;
    }
    // Deliveries in flight finish (bounded by the webhook timeout).
    while let Some(done) = deliveries.join_next().await {
        if let Ok(events) = done {
            for e in events {
                ctx.events.emit(e);
            }
        }
    }
    if pin.is_pinned() {
        let _ = stream.unpin_consumer(target.consumer.as_str(), group.as_deref().unwrap_or_default()).await;
    }
    end
}

fn fencing_key(target: &ConsumerTarget) -> String {
    format!("{}.{}.{}.consumer", target.stream, target.consumer, target.subscriber)
}
