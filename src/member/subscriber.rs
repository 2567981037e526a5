//! A webhook subscriber of a plain consumer (no key order): pulls with the
//! consumer's priority group and the subscriber's options (`priority`,
//! `min_pending`, `min_ack_pending`, the pin id), and delivers up to
//! `concurrency` messages at once with the same verdicts, dead letters and
//! events as group members.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PriorityPolicy};
use futures::StreamExt;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::deliver::{deliver, origin_of, Delivered};
use super::fencing::next_token;
use super::instance::{InstanceContext, MemberRef};
use super::pull::{classify, next_subject, Reply};
use crate::delivery::endpoint::Endpoint;
use crate::delivery::signing::SigningKey;
use crate::delivery::webhook::{Registration, SubscriberOptions};
use crate::delivery::websocket::ServerFrame;
use crate::events::EventType;
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};

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

/// A pull request with the subscriber's options.
#[derive(Debug, Serialize)]
struct Pull<'a> {
    batch: usize,
    expires: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_pending: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_ack_pending: Option<i64>,
}

/// Serves `target` through the registration's webhook until `cancel`.
pub async fn serve_consumer_webhook(
    ctx: Arc<InstanceContext>,
    target: ConsumerTarget,
    registration: Registration,
    cancel: CancellationToken,
) {
    let Ok(key) = SigningKey::parse(&registration.secret) else {
        tracing::error!(consumer = %target.consumer, "subscriber registration has an unusable secret");
        return;
    };
    let options = registration.subscriber.unwrap_or(SubscriberOptions {
        priority: None,
        min_pending: None,
        min_ack_pending: None,
        concurrency: 1,
    });
    serve_consumer(ctx, target, Arc::new(Endpoint::Webhook { registration, key }), options, cancel).await;
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
    let who = MemberRef {
        stream: target.stream.clone(),
        group,
        member: target.subscriber.clone(),
        owner: crate::delivery::dead_letter::Owner::Consumer,
    };
    while !cancel.is_cancelled() {
        match Box::pin(serve_once(&ctx, &target, &who, &endpoint, options, &cancel)).await {
            Ok(()) => return,
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

/// One run against the consumer as it is now; `Err` when it is missing or
/// was deleted (look again later).
async fn serve_once(
    ctx: &Arc<InstanceContext>,
    target: &ConsumerTarget,
    who: &MemberRef,
    endpoint: &Arc<Endpoint>,
    options: SubscriberOptions,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let stream = ctx.js.get_stream_no_info(target.stream.as_str()).await.map_err(|e| e.to_string())?;
    // Only a partition-stamped stream's subjects start with a partition token.
    let stamped = ctx
        .js
        .get_stream(target.stream.as_str())
        .await
        .map_err(|e| e.to_string())?
        .cached_info()
        .config
        .subject_transform
        .is_some();
    let info = stream.consumer_info(target.consumer.as_str()).await.map_err(|e| e.to_string())?;
    let group = info.config.priority_groups.first().cloned();
    let pinned_policy = info.config.priority_policy == PriorityPolicy::PinnedClient;
    let shuffle = crate::consumers::Shuffle::of(&info.config);
    let mut window = ShuffleWindow::new(target);
    let mut share = shuffle.map(|s| {
        super::window_share::WindowShare::new(
            ctx.js.clone(),
            target.stream.as_str(),
            target.consumer.as_str(),
            Duration::from_millis(s.max_delay_ms),
        )
    });
    if let (Some(share), Some(s)) = (share.as_mut(), shuffle) {
        share.renew(s.max_window).await;
    }
    let mut renew = tokio::time::interval(super::window_share::RENEW_EVERY);
    let inbox = ctx.nats.new_inbox();
    let mut replies = ctx.nats.subscribe(format!("{inbox}.*")).await.map_err(|e| e.to_string())?;
    let concurrency = options.concurrency.max(1);
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
    let mut queued: VecDeque<Arc<Delivered>> = VecDeque::new();
    let mut pin: Option<String> = None;
    let mut standby = false;
    let mut fencing = 0u64;
    // Open pulls, oldest first: inbox, messages still due, expiry.
    let mut outstanding: VecDeque<(String, usize, Instant)> = VecDeque::new();
    let mut pulls = 0u64;
    let end = loop {
        let now = Instant::now();
        outstanding.retain(|(_, remaining, deadline)| *remaining > 0 && *deadline > now);
        while deliveries.len() < concurrency {
            let Some(held) = queued.pop_front() else { break };
            let (ctx, who, endpoint) = (ctx.clone(), who.clone(), endpoint.clone());
            deliveries.spawn(async move { deliver(ctx, who, endpoint, held, fencing).await.events });
        }
        // Ask for all the room there is, so a burst stays with this
        // subscriber; top up in steps of at least `prefetch`, or whenever no
        // pull is waiting at all.
        let mut asked: usize = outstanding.iter().map(|(_, remaining, _)| remaining).sum();
        while outstanding.len() < MAX_OPEN_PULLS {
            let room = max_held.saturating_sub(deliveries.len() + queued.len() + asked);
            if room == 0 || (asked > 0 && room < prefetch) {
                break;
            }
            pulls += 1;
            let reply = format!("{inbox}.{pulls}");
            let body = Pull {
                batch: room,
                expires: PULL_EXPIRY.as_nanos() as u64,
                group: group.as_deref(),
                id: pin.as_deref(),
                priority: options.priority,
                min_pending: options.min_pending,
                min_ack_pending: options.min_ack_pending,
            };
            let payload = serde_json::to_vec(&body).unwrap_or_default();
            let subject = next_subject(target.stream.as_str(), target.consumer.as_str());
            if ctx.nats.publish_with_reply(subject, reply.clone(), payload.into()).await.is_err() {
                break;
            }
            outstanding.push_back((reply, room, Instant::now() + PULL_EXPIRY + Duration::from_millis(500)));
            asked += room;
        }
        let deadline =
            outstanding.iter().map(|(_, _, d)| *d).min().unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
        tokio::select! {
            () = cancel.cancelled() => break Ok(()),
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
                let finish = |outstanding: &mut VecDeque<(String, usize, Instant)>| {
                    outstanding.retain(|(inbox, _, _)| *inbox != pull_subject);
                };
                match classify(reply.status, reply.description.as_deref(), reply.headers.as_ref()) {
                    Reply::Message { pin: given } => {
                        // The server fills pulls oldest first.
                        if let Some((_, remaining, _)) = outstanding.front_mut() {
                            *remaining = remaining.saturating_sub(1);
                        }
                        if pinned_policy && given.is_some() && given != pin {
                            pin = given.clone();
                            standby = false;
                            fencing = next_token(&ctx.js, &fencing_key(target)).await.unwrap_or(fencing + 1);
                            let mut e = who.event(ctx, EventType::MemberPinned);
                            e.pin_id = given;
                            e.fencing_token = Some(fencing);
                            ctx.events.emit(e);
                            let instance = ctx.instance_id.clone();
                            endpoint.notify(|| ServerFrame::Pinned { partitions: Vec::new(), fencing_token: Some(fencing), instance });
                        }
                        let Some(held) = held(ctx, target, reply, stamped) else { continue };
                        let allowed = share.as_mut().map_or(0, |s| s.current());
                        if let Some(delay) = shuffle.and_then(|s| window.delay_first_delivery(&s, allowed, held.attempt)) {
                            let _ = held.message.ack_with(jetstream::AckKind::Nak(Some(delay))).await;
                            continue;
                        }
                        queued.push_back(held);
                    }
                    Reply::Done => {
                        finish(&mut outstanding);
                        // A pull that ends empty while another client holds
                        // the pin: this instance is a standby.
                        if pinned_policy && pin.is_none() && !standby {
                            if let Ok(info) = stream.consumer_info(target.consumer.as_str()).await {
                                if info.priority_groups.iter().any(|g| g.pinned_client_id.as_deref().is_some_and(|id| !id.is_empty())) {
                                    standby = true;
                                    ctx.events.emit(who.event(ctx, EventType::MemberStandby));
                                    endpoint.notify(|| ServerFrame::Standby { partitions: Vec::new() });
                                }
                            }
                        }
                    }
                    Reply::PinRejected { description } => {
                        // Every open pull carried the rejected id.
                        outstanding.clear();
                        if pin.take().is_some() {
                            let mut e = who.event(ctx, EventType::MemberUnpinned);
                            e.reason = Some(description);
                            ctx.events.emit(e);
                            endpoint.notify(|| ServerFrame::Standby { partitions: Vec::new() });
                        }
                    }
                    Reply::ConsumerDeleted => break Err("consumer deleted".to_owned()),
                    Reply::Conflict { description } | Reply::BadRequest { description } => {
                        finish(&mut outstanding);
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
    if pin.is_some() {
        if let Ok(stream) = ctx.js.get_stream_no_info(target.stream.as_str()).await {
            let _ = stream.unpin_consumer(target.consumer.as_str(), group.as_deref().unwrap_or_default()).await;
        }
    }
    end
}

fn fencing_key(target: &ConsumerTarget) -> String {
    format!("{}.{}.{}.consumer", target.stream, target.consumer, target.subscriber)
}

/// The messages a subscriber instance has delayed whose delay still runs.
struct ShuffleWindow {
    until: std::collections::BinaryHeap<std::cmp::Reverse<Instant>>,
    size: metrics::Gauge,
    delayed: metrics::Counter,
}

impl ShuffleWindow {
    fn new(target: &ConsumerTarget) -> Self {
        let labels = [("stream", target.stream.to_string()), ("consumer", target.consumer.to_string())];
        Self {
            until: Default::default(),
            size: metrics::gauge!(crate::metrics::SHUFFLE_WINDOW, &labels),
            delayed: metrics::counter!(crate::metrics::SHUFFLE_DELAYED, &labels),
        }
    }

    /// A delay for this delivery, if it is a first delivery chosen to be
    /// delayed and this instance's share of the window has room.
    fn delay_first_delivery(
        &mut self,
        shuffle: &crate::consumers::Shuffle,
        allowed: u64,
        attempt: u64,
    ) -> Option<Duration> {
        self.refresh();
        let now = Instant::now();
        let delay = (attempt == 1
            && (self.until.len() as u64) < allowed.min(shuffle.max_window)
            && rand::random::<f64>() < shuffle.probability)
            .then(|| Duration::from_millis(rand::random_range(shuffle.min_delay_ms..=shuffle.max_delay_ms)));
        if let Some(delay) = delay {
            self.until.push(std::cmp::Reverse(now + delay));
            self.delayed.increment(1);
        }
        self.size.set(self.until.len() as f64);
        delay
    }
}

impl ShuffleWindow {
    /// Forgets delays that have run out and publishes the window's size.
    fn refresh(&mut self) {
        let now = Instant::now();
        while self.until.peek().is_some_and(|std::cmp::Reverse(t)| *t <= now) {
            self.until.pop();
        }
        self.size.set(self.until.len() as f64);
    }
}

impl Drop for ShuffleWindow {
    fn drop(&mut self) {
        self.size.set(0.0);
    }
}

/// A pulled message as a delivery (partition 0 unless the stream stamps one).
fn held(
    ctx: &InstanceContext,
    target: &ConsumerTarget,
    reply: async_nats::Message,
    stamped: bool,
) -> Option<Arc<Delivered>> {
    let message = jetstream::Message { message: reply, context: ctx.js.clone() };
    let info = message.info().ok()?;
    let (stream_seq, attempt) = (info.stream_sequence, info.delivered.max(1) as u64);
    let full = message.subject.to_string();
    let (partition, subject) = match full.split_once('.').filter(|_| stamped) {
        Some((p, rest)) if p.parse::<u32>().is_ok() => (p.parse().unwrap_or(0), rest.to_owned()),
        _ => (0, full.clone()),
    };
    let (origin_stream, origin_seq) = origin_of(&message, target.stream.as_str(), stream_seq);
    Some(Arc::new(Delivered { message, partition, stream_seq, attempt, subject, key: None, origin_stream, origin_seq }))
}
