//! One instance of one member: joins the member's consumer, pulls with the
//! pinned-client protocol, keeps partition lanes in order, delivers to the
//! member's webhook, and follows rebalances. Every keygate replica runs one
//! instance per registered member; the pin makes one of them active.
//!
//! The instance is an actor: one task owns the pin, the lanes and the pull;
//! deliveries run as futures it polls and report their settlement back.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::consumer::{join, pull_expiry, JoinError};
use super::fencing::next_token;
use super::lanes::{Blocked, Lanes, Offered, Settled};
use super::pull::{classify, next_subject, PullRequest, Reply};
use crate::delivery::dead_letter::{self, DeadLetter};
use crate::delivery::header_safe;
use crate::delivery::signing::SigningKey;
use crate::delivery::verdict::{backoff, Verdict};
use crate::delivery::webhook::{registration_key, Outbound, Registration, WebhookClient, WebhookStore};
use crate::events::{Event, EventBus, EventType};
use crate::groups::admin::{filter_subjects_of, DEFAULT_ACK_WAIT_MS};
use crate::groups::config::{config_key, ELASTIC_BUCKET, STATIC_BUCKET};
use crate::groups::{GroupAdmin, GroupConfig, GroupKind};
use crate::names::{GroupName, MemberName, StreamName};
use crate::partition::{decode_key, PartitionSpec, SubjectPattern};

/// Most messages asked for in one pull.
const MAX_PULL_BATCH: usize = 256;
/// How often a non-pinned instance checks who holds the pin, and a pinned
/// one whether the handover barrier can come down.
const PIN_CHECK: Duration = Duration::from_millis(250);

/// What every instance shares.
pub struct InstanceContext {
    pub js: jetstream::Context,
    pub nats: async_nats::Client,
    pub events: EventBus,
    pub webhooks: WebhookClient,
    pub webhook_store: WebhookStore,
    pub groups: GroupAdmin,
    /// Names this keygate process in events.
    pub instance_id: String,
    /// Most messages held behind one partition's head before pulling slows
    /// to a trickle.
    pub hold_cap: usize,
    /// How long shutdown waits for deliveries in flight.
    pub shutdown_grace: Duration,
}

/// Which member an instance serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemberRef {
    pub stream: StreamName,
    pub group: GroupName,
    pub member: MemberName,
}

impl MemberRef {
    fn event(&self, ctx: &InstanceContext, event_type: EventType) -> Event {
        Event::new(event_type, self.stream.as_str(), self.group.as_str(), self.member.as_str(), &ctx.instance_id)
    }

    /// The subject control requests for this member go to.
    pub fn control_subject(&self) -> String {
        format!("keygate.control.{}.{}.{}", self.stream, self.group, self.member)
    }
}

/// A control request to the instance that holds a member's pin.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Control {
    /// Blocked partitions and counters.
    Status,
    /// Terminate a blocked partition's head (to the dead-letter stream).
    Skip { partition: u32 },
    /// Redeliver a blocked partition's head now instead of after its delay.
    RetryNow { partition: u32 },
}

/// A blocked partition as the pinned instance reports it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BlockedPartition {
    pub partition: u32,
    /// Stream sequence of the head message.
    pub seq: u64,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub since: time::OffsetDateTime,
    pub attempts: u64,
    pub last_error: String,
}

/// The pinned instance's answer to a control request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ControlReply {
    pub instance: String,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default)]
    pub blocked: Vec<BlockedPartition>,
    #[serde(default)]
    pub holding: usize,
    #[serde(default)]
    pub fencing_token: u64,
}

/// A message delivered to this instance.
#[derive(Debug)]
struct Delivered {
    message: jetstream::Message,
    partition: u32,
    stream_seq: u64,
    attempt: u64,
    subject: String,
    key: Option<String>,
    origin_stream: String,
    origin_seq: u64,
}

type Held = Arc<Delivered>;

/// What a delivery future reports.
struct Outcome {
    partition: u32,
    seq: u64,
    settled: Settled,
    events: Vec<Event>,
    gone: bool,
}

/// Why a session ended.
enum SessionEnd {
    Shutdown,
    /// The member's filters changed (elastic rebalance) or the group changed.
    Rejoin {
        pinned: bool,
    },
    /// The consumer was deleted under us.
    ConsumerGone,
    /// The endpoint answered 410: stop serving it.
    Gone,
}

/// Serves `who` through its webhook until `cancel`.
pub async fn serve_webhook(
    ctx: Arc<InstanceContext>,
    who: MemberRef,
    registration: Registration,
    cancel: CancellationToken,
) {
    let key = match SigningKey::parse(&registration.secret) {
        Ok(k) => k,
        Err(e) => {
            tracing::error!(member = %who.member, error = %e, "webhook registration has an unusable secret");
            return;
        }
    };
    let mut last_partitions: Option<Vec<u32>> = None;
    loop {
        if cancel.is_cancelled() {
            return;
        }
        let group = match ctx.groups.load(&who.stream, &who.group, None).await {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(error = %e, "group not available; waiting");
                if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                    return;
                }
                continue;
            }
        };
        let ack_wait = ctx
            .groups
            .settings(&who.stream, &who.group)
            .await
            .ok()
            .and_then(|s| s.ack_wait_ms)
            .map_or(Duration::from_millis(DEFAULT_ACK_WAIT_MS), Duration::from_millis);
        let partitions = owned_partitions(&group.config, who.member.as_str());
        if last_partitions.as_ref() != Some(&partitions) {
            let mut e = who.event(&ctx, EventType::AssignmentChanged);
            e.partitions = Some(partitions.clone());
            ctx.events.emit(e);
            last_partitions = Some(partitions.clone());
        }
        let joined =
            join(&ctx.js, &group.config, who.stream.as_str(), who.group.as_str(), who.member.as_str(), ack_wait).await;
        let (stream_name, consumer) = match joined {
            Ok(names) => names,
            Err(JoinError::Overlap) => {
                if sleep_or_cancel(&cancel, ack_wait + Duration::from_millis(500)).await {
                    return;
                }
                continue;
            }
            Err(JoinError::NoPartitions) => {
                if wait_for_group_change(&ctx, &who, &group.config, group.revision, &cancel).await {
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
        let session = Session::new(
            ctx.clone(),
            who.clone(),
            registration.clone(),
            key.clone(),
            group.config,
            group.revision,
            stream_name.clone(),
            consumer.clone(),
            ack_wait,
        )
        .await;
        let Some(session) = session else {
            if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                return;
            }
            continue;
        };
        match session.run(&cancel).await {
            SessionEnd::Shutdown => return,
            SessionEnd::Gone => {
                deregister(&ctx, &who, &registration).await;
                return;
            }
            SessionEnd::ConsumerGone => {}
            SessionEnd::Rejoin { pinned } => {
                // pcgroups' rebalance: the pinned instance deletes the
                // consumer; the others give it a moment first.
                if pinned && group_kind_is_elastic(&stream_name, &who) {
                    let _ = ctx.js.delete_consumer_from_stream(&consumer, &stream_name).await;
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

fn owned_partitions(config: &GroupConfig, member: &str) -> Vec<u32> {
    crate::groups::config::ownership(config.partitions(), config.members(), config.mappings())
        .into_iter()
        .find(|(m, _)| m == member)
        .map(|(_, p)| p)
        .unwrap_or_default()
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
    tracing::warn!(member = %who.member, url = %registration.url, "endpoint answered 410 Gone: stopped serving it");
}

/// Where the key sits in a member's subjects, to give deliveries the key.
struct KeyLocator {
    patterns: Vec<(SubjectPattern, usize)>,
}

impl KeyLocator {
    async fn for_group(ctx: &InstanceContext, config: &GroupConfig, stream: &str) -> Self {
        let mut patterns = Vec::new();
        match config {
            GroupConfig::Static(_) => {
                if let Ok(s) = ctx.js.get_stream(stream).await {
                    if let Some(t) = &s.cached_info().config.subject_transform {
                        if let (Some(spec), Ok(source)) =
                            (PartitionSpec::from_transform(&t.destination), SubjectPattern::parse(&t.source))
                        {
                            if let [w] = spec.wildcards.as_slice() {
                                patterns.push((source, *w as usize));
                            }
                        }
                    }
                }
            }
            GroupConfig::Elastic(c) => {
                for pf in c.partitioning_filters.iter().flatten() {
                    if let (Ok(pattern), Some([w])) =
                        (SubjectPattern::parse(&pf.filter), pf.partitioning_wildcards.as_deref())
                    {
                        patterns.push((pattern, *w as usize));
                    }
                }
            }
        }
        Self { patterns }
    }

    fn key(&self, subject: &str) -> Option<String> {
        self.patterns.iter().find_map(|(pattern, w)| {
            let captured = pattern.captures(subject)?;
            decode_key(captured.get(w.checked_sub(1)?)?)
        })
    }
}

struct Outstanding {
    reply: String,
    remaining: usize,
    deadline: Instant,
}

struct Session {
    ctx: Arc<InstanceContext>,
    who: MemberRef,
    registration: Arc<Registration>,
    key: Arc<SigningKey>,
    config: GroupConfig,
    revision: u64,
    stream_name: String,
    consumer: String,
    ack_wait: Duration,
    keys: KeyLocator,
    lanes: Lanes<Held>,
    pin: Option<String>,
    fencing: u64,
    standby: bool,
    last_message: Instant,
    blocked_reported: BTreeSet<u32>,
    inbox: String,
    pulls: u64,
    outstanding: Option<Outstanding>,
    deliveries: FuturesUnordered<BoxFuture<'static, Outcome>>,
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    async fn new(
        ctx: Arc<InstanceContext>,
        who: MemberRef,
        registration: Registration,
        key: SigningKey,
        config: GroupConfig,
        revision: u64,
        stream_name: String,
        consumer: String,
        ack_wait: Duration,
    ) -> Option<Self> {
        let keys = KeyLocator::for_group(&ctx, &config, who.stream.as_str()).await;
        let inbox = ctx.nats.new_inbox();
        Some(Self {
            ctx,
            who,
            registration: Arc::new(registration),
            key: Arc::new(key),
            config,
            revision,
            stream_name,
            consumer,
            ack_wait,
            keys,
            lanes: Lanes::default(),
            pin: None,
            fencing: 0,
            standby: false,
            last_message: Instant::now(),
            blocked_reported: BTreeSet::new(),
            inbox,
            pulls: 0,
            outstanding: None,
            deliveries: FuturesUnordered::new(),
        })
    }

    async fn run(mut self, cancel: &CancellationToken) -> SessionEnd {
        let Ok(mut replies) = self.ctx.nats.subscribe(format!("{}.*", self.inbox)).await else {
            return SessionEnd::ConsumerGone;
        };
        let Ok(mut control) = self.ctx.nats.subscribe(self.who.control_subject()).await else {
            return SessionEnd::ConsumerGone;
        };
        let bucket = match self.config.kind() {
            GroupKind::Static => STATIC_BUCKET,
            GroupKind::Elastic => ELASTIC_BUCKET,
        };
        let key = config_key(self.who.stream.as_str(), self.who.group.as_str());
        let mut watch = match self.ctx.js.get_key_value(bucket).await {
            Ok(store) => store.watch_with_history(&key).await.ok(),
            Err(_) => None,
        };
        let progress_every = (self.ack_wait / 3).max(Duration::from_millis(100));
        let mut progress = tokio::time::interval(progress_every);
        let mut pin_check = tokio::time::interval(PIN_CHECK);
        let my_filters = filter_subjects_of(&self.config, self.who.member.as_str());
        let mut gone = false;
        let end = loop {
            if !gone {
                self.dispatch();
                self.ensure_pull().await;
            }
            let pull_deadline =
                self.outstanding.as_ref().map_or_else(|| Instant::now() + Duration::from_secs(3600), |o| o.deadline);
            tokio::select! {
                () = cancel.cancelled() => break SessionEnd::Shutdown,
                reply = replies.next() => {
                    let Some(reply) = reply else { break SessionEnd::ConsumerGone };
                    if let Some(end) = self.on_reply(reply).await {
                        break end;
                    }
                }
                Some(outcome) = self.deliveries.next() => {
                    gone |= outcome.gone;
                    self.on_outcome(outcome);
                    if gone && self.deliveries.is_empty() {
                        break SessionEnd::Gone;
                    }
                }
                _ = progress.tick() => self.progress().await,
                _ = pin_check.tick() => self.check_pin().await,
                () = tokio::time::sleep_until(pull_deadline.into()) => self.outstanding = None,
                request = control.next() => {
                    if let Some(request) = request {
                        self.on_control(request).await;
                    }
                }
                update = next_watch(&mut watch) => {
                    match update {
                        Some(entry) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
                            if entry.revision <= self.revision {
                                continue;
                            }
                            let changed = match crate::groups::admin::parse_stored(self.config.kind(), &entry.value) {
                                Ok(next) => {
                                    next.partitions() != self.config.partitions()
                                        || filter_subjects_of(&next, self.who.member.as_str()) != my_filters
                                }
                                Err(_) => true,
                            };
                            if changed {
                                break SessionEnd::Rejoin { pinned: self.pin.is_some() };
                            }
                        }
                        Some(_) => break SessionEnd::Rejoin { pinned: false },
                        None => watch = None,
                    }
                }
            }
        };
        self.wind_down(&end).await;
        end
    }

    /// Sends the next pull when none is outstanding.
    async fn ensure_pull(&mut self) {
        if self.outstanding.is_some() {
            return;
        }
        // Hold cap: a partition blocked with many messages behind its head
        // slows intake to one message per pull, which still keeps the pin.
        let room = if self.lanes.deepest() >= self.ctx.hold_cap { 1 } else { MAX_PULL_BATCH };
        self.pulls += 1;
        let reply = format!("{}.{}", self.inbox, self.pulls);
        let expires = pull_expiry(self.ack_wait);
        let body = serde_json::to_vec(&PullRequest::new(room, expires, self.pin.as_deref())).unwrap_or_default();
        let subject = next_subject(&self.stream_name, &self.consumer);
        if let Err(e) = self.ctx.nats.publish_with_reply(subject, reply.clone(), Bytes::from(body)).await {
            tracing::debug!(error = %e, "sending pull");
            return;
        }
        self.outstanding = Some(Outstanding {
            reply,
            remaining: room,
            deadline: Instant::now() + expires + Duration::from_millis(500),
        });
    }

    async fn on_reply(&mut self, reply: async_nats::Message) -> Option<SessionEnd> {
        let for_current = self.outstanding.as_ref().is_some_and(|o| o.reply == reply.subject.as_str());
        match classify(reply.status, reply.description.as_deref(), reply.headers.as_ref()) {
            Reply::Message { pin } => {
                if let Some(pin) = pin {
                    if self.pin.as_deref() != Some(pin.as_str()) {
                        self.gain_pin(pin).await;
                    }
                }
                if for_current {
                    if let Some(o) = self.outstanding.as_mut() {
                        o.remaining = o.remaining.saturating_sub(1);
                        if o.remaining == 0 {
                            self.outstanding = None;
                        }
                    }
                }
                self.take(reply);
            }
            Reply::Done => {
                if for_current {
                    self.outstanding = None;
                }
            }
            Reply::PinRejected { description } => {
                self.outstanding = None;
                if self.pin.is_some() {
                    self.lose_pin(&description);
                }
            }
            Reply::ConsumerDeleted => return Some(SessionEnd::ConsumerGone),
            Reply::Conflict { description } => {
                tracing::debug!(%description, "pull conflict");
                if for_current {
                    self.outstanding = None;
                }
            }
            Reply::BadRequest { description } => {
                tracing::warn!(%description, consumer = %self.consumer, "the server refused the pull");
                return Some(SessionEnd::ConsumerGone);
            }
            Reply::Ignore => {}
        }
        None
    }

    async fn gain_pin(&mut self, pin: String) {
        self.pin = Some(pin.clone());
        self.standby = false;
        let key = registration_key(self.who.stream.as_str(), self.who.group.as_str(), self.who.member.as_str());
        self.fencing = match next_token(&self.ctx.js, &key).await {
            Ok(token) => token,
            Err(e) => {
                tracing::warn!(error = %e, "raising the fencing token failed");
                self.fencing + 1
            }
        };
        // Handover barrier: nothing goes out until every ack-pending message
        // of the consumer is ours.
        self.lanes.set_barrier(true);
        let mut e = self.who.event(&self.ctx, EventType::MemberPinned);
        e.pin_id = Some(pin);
        e.fencing_token = Some(self.fencing);
        e.partitions = Some(owned_partitions(&self.config, self.who.member.as_str()));
        self.ctx.events.emit(e);
    }

    fn lose_pin(&mut self, why: &str) {
        self.pin = None;
        // What we held is no longer ours: the new holder gets it after ack wait.
        self.lanes.clear();
        self.blocked_reported.clear();
        let mut e = self.who.event(&self.ctx, EventType::MemberUnpinned);
        e.reason = Some(why.to_owned());
        self.ctx.events.emit(e);
    }

    fn take(&mut self, reply: async_nats::Message) {
        self.last_message = Instant::now();
        let message = jetstream::Message { message: reply, context: self.ctx.js.clone() };
        let Ok(info) = message.info() else { return };
        let (stream_seq, attempt) = (info.stream_sequence, info.delivered.max(1) as u64);
        let full = message.subject.to_string();
        let (partition, subject) = match full.split_once('.') {
            Some((p, rest)) => match p.parse::<u32>() {
                Ok(p) => (p, rest.to_owned()),
                Err(_) => return,
            },
            None => return,
        };
        let (origin_stream, origin_seq) = origin_of(&message, self.who.stream.as_str(), stream_seq);
        let key = self.keys.key(&subject);
        let held =
            Arc::new(Delivered { message, partition, stream_seq, attempt, subject, key, origin_stream, origin_seq });
        if self.lanes.offer(partition, stream_seq, held.clone()) == Offered::AlreadySettled {
            tokio::spawn(async move {
                let _ = held.message.ack().await;
            });
        }
    }

    fn dispatch(&mut self) {
        if self.pin.is_none() {
            return;
        }
        for (_, _, held) in self.lanes.dispatch() {
            let delivery = deliver(
                self.ctx.clone(),
                self.who.clone(),
                self.registration.clone(),
                self.key.clone(),
                held,
                self.fencing,
            );
            self.deliveries.push(Box::pin(delivery));
        }
    }

    fn on_outcome(&mut self, outcome: Outcome) {
        for e in outcome.events {
            self.ctx.events.emit(e);
        }
        let was_blocked = self.lanes.blocked().contains_key(&outcome.partition);
        let naked = matches!(outcome.settled, Settled::Naked { .. });
        self.lanes.settle(outcome.partition, outcome.seq, outcome.settled);
        let blocked = self.lanes.blocked();
        if naked && !self.blocked_reported.contains(&outcome.partition) {
            self.blocked_reported.insert(outcome.partition);
            if let Some(b) = blocked.get(&outcome.partition) {
                let mut e = self.who.event(&self.ctx, EventType::PartitionBlocked);
                e.partition = Some(outcome.partition);
                e.seq = Some(b.seq);
                e.attempt = Some(b.attempts);
                e.reason = Some(b.last_error.clone());
                self.ctx.events.emit(e);
            }
        } else if was_blocked && !blocked.contains_key(&outcome.partition) {
            self.blocked_reported.remove(&outcome.partition);
            let mut e = self.who.event(&self.ctx, EventType::PartitionUnblocked);
            e.partition = Some(outcome.partition);
            e.seq = Some(outcome.seq);
            self.ctx.events.emit(e);
        }
    }

    /// Keeps held and in-flight messages from timing out (ack wait).
    async fn progress(&mut self) {
        let messages: Vec<Held> = self.lanes.held_messages().chain(self.lanes.in_flight_messages()).cloned().collect();
        for held in messages {
            let _ = held.message.ack_with(AckKind::Progress).await;
        }
    }

    async fn check_pin(&mut self) {
        let barrier = self.pin.is_some() && self.lanes.barrier();
        if !barrier && self.pin.is_some() {
            return;
        }
        // Counted before asking, so messages arriving meanwhile can only
        // make the server's count higher (the safe side).
        let ours = self.lanes.holding() + self.lanes.awaiting();
        let Ok(handle) = self.ctx.js.get_stream_no_info(&self.stream_name).await else { return };
        let Ok(info) = handle.consumer_info(&self.consumer).await else { return };
        if barrier {
            if info.num_ack_pending <= ours {
                self.lanes.set_barrier(false);
            }
            return;
        }
        let pinned_elsewhere =
            info.priority_groups.iter().any(|g| g.pinned_client_id.as_deref().is_some_and(|id| !id.is_empty()));
        // A pin seen right after a message reached us may be ours, not yet
        // read from the message: only a quiet instance calls itself standby.
        let quiet = self.last_message.elapsed() > Duration::from_secs(1);
        if pinned_elsewhere && quiet && !self.standby {
            self.standby = true;
            self.ctx.events.emit(self.who.event(&self.ctx, EventType::MemberStandby));
        }
    }

    fn blocked_view(&self) -> Vec<BlockedPartition> {
        self.lanes
            .blocked()
            .into_iter()
            .map(|(partition, b): (u32, Blocked)| BlockedPartition {
                partition,
                seq: b.seq,
                since: time::OffsetDateTime::from(b.since),
                attempts: b.attempts,
                last_error: b.last_error,
            })
            .collect()
    }

    async fn on_control(&mut self, request: async_nats::Message) {
        // Only the pin holder answers: the requester gets its word.
        if self.pin.is_none() {
            return;
        }
        let Some(reply_to) = request.reply.clone() else { return };
        let Ok(control) = serde_json::from_slice::<Control>(&request.payload) else { return };
        let mut answer = ControlReply {
            instance: self.ctx.instance_id.clone(),
            ok: true,
            error: None,
            blocked: Vec::new(),
            holding: self.lanes.holding(),
            fencing_token: self.fencing,
        };
        match control {
            Control::Status => {}
            Control::Skip { partition } => match self.lanes.blocked_head(partition) {
                Some((seq, held)) => {
                    let reason = "skipped by an operator";
                    match dead_letter_and_term(&self.ctx, &self.who, &held, reason).await {
                        Ok(events) => {
                            self.lanes.skip(partition, seq);
                            self.blocked_reported.remove(&partition);
                            for e in events {
                                self.ctx.events.emit(e);
                            }
                            let mut e = self.who.event(&self.ctx, EventType::PartitionUnblocked);
                            e.partition = Some(partition);
                            e.seq = Some(seq);
                            self.ctx.events.emit(e);
                        }
                        Err(e) => {
                            answer.ok = false;
                            answer.error = Some(format!("could not dead-letter the head: {e}"));
                        }
                    }
                }
                None => {
                    answer.ok = false;
                    answer.error = Some(format!("partition {partition} is not blocked"));
                }
            },
            Control::RetryNow { partition } => match self.lanes.blocked_head(partition) {
                Some((_, held)) => {
                    if let Err(e) = held.message.ack_with(AckKind::Nak(None)).await {
                        answer.ok = false;
                        answer.error = Some(format!("could not ask for redelivery: {e}"));
                    }
                }
                None => {
                    answer.ok = false;
                    answer.error = Some(format!("partition {partition} is not blocked"));
                }
            },
        }
        answer.blocked = self.blocked_view();
        if let Ok(payload) = serde_json::to_vec(&answer) {
            let _ = self.ctx.nats.publish(reply_to, payload.into()).await;
        }
    }

    /// Stop pulling; let deliveries in flight finish within the grace, NAK
    /// the rest; leave held messages to time out to their next holder.
    async fn wind_down(&mut self, end: &SessionEnd) {
        let grace = match end {
            SessionEnd::Shutdown | SessionEnd::Rejoin { .. } => self.ctx.shutdown_grace,
            _ => Duration::ZERO,
        };
        let deadline = tokio::time::Instant::now() + grace;
        while !self.deliveries.is_empty() {
            match tokio::time::timeout_at(deadline, self.deliveries.next()).await {
                Ok(Some(outcome)) => self.on_outcome(outcome),
                Ok(None) => break,
                Err(_) => {
                    for held in self.lanes.in_flight_messages().cloned().collect::<Vec<_>>() {
                        let _ = held.message.ack_with(AckKind::Nak(None)).await;
                    }
                    break;
                }
            }
        }
        if self.pin.is_some() {
            let mut e = self.who.event(&self.ctx, EventType::MemberUnpinned);
            e.reason = Some(
                match end {
                    SessionEnd::Shutdown => "shutting down",
                    SessionEnd::Rejoin { .. } => "rebalancing",
                    SessionEnd::ConsumerGone => "consumer gone",
                    SessionEnd::Gone => "endpoint gone",
                }
                .into(),
            );
            self.ctx.events.emit(e);
        }
        let _ = self.ctx.nats.flush().await;
    }
}

async fn next_watch(watch: &mut Option<async_nats::jetstream::kv::Watch>) -> Option<async_nats::jetstream::kv::Entry> {
    match watch {
        Some(w) => match w.next().await {
            Some(Ok(entry)) => Some(entry),
            _ => None,
        },
        None => futures::future::pending().await,
    }
}

/// The origin stream and sequence of a message: an elastic group's
/// work-queue copy names its source in `Nats-Stream-Source`.
fn origin_of(message: &jetstream::Message, stream: &str, seq: u64) -> (String, u64) {
    let source = message.headers.as_ref().and_then(|h| h.get("Nats-Stream-Source")).map(|v| v.to_string());
    if let Some(source) = source {
        let mut parts = source.split_whitespace();
        if let (Some(name), Some(origin_seq)) = (parts.next(), parts.next().and_then(|s| s.parse().ok())) {
            let name = name.split(':').next().unwrap_or(name);
            return (name.to_owned(), origin_seq);
        }
    }
    (stream.to_owned(), seq)
}

fn outbound(who: &MemberRef, held: &Delivered, fencing: u64) -> Outbound {
    let mut headers = Vec::new();
    let mut content_type = None;
    if let Some(original) = &held.message.headers {
        for (name, values) in original.iter() {
            let name: &str = name.as_ref();
            if name.starts_with("Nats-") || name.to_ascii_lowercase().starts_with("keygate-") {
                continue;
            }
            for value in values {
                if name.eq_ignore_ascii_case("content-type") {
                    content_type = Some(value.to_string());
                } else {
                    headers.push((name.to_owned(), value.to_string()));
                }
            }
        }
    }
    headers.push(("content-type".into(), content_type.unwrap_or_else(|| "application/octet-stream".into())));
    headers.push(("keygate-stream".into(), who.stream.to_string()));
    headers.push(("keygate-group".into(), who.group.to_string()));
    headers.push(("keygate-member".into(), who.member.to_string()));
    headers.push(("keygate-subject".into(), header_safe(&held.subject)));
    if let Some(key) = &held.key {
        headers.push(("keygate-key".into(), header_safe(key)));
    }
    headers.push(("keygate-partition".into(), held.partition.to_string()));
    headers.push(("keygate-stream-seq".into(), held.origin_seq.to_string()));
    headers.push(("keygate-attempt".into(), held.attempt.to_string()));
    headers.push(("keygate-fencing-token".into(), fencing.to_string()));
    Outbound { id: format!("{}-{}", held.origin_stream, held.origin_seq), body: held.message.payload.clone(), headers }
}

/// One delivery: call the endpoint, apply its verdict to the message.
async fn deliver(
    ctx: Arc<InstanceContext>,
    who: MemberRef,
    registration: Arc<Registration>,
    key: Arc<SigningKey>,
    held: Held,
    fencing: u64,
) -> Outcome {
    let outbound = outbound(&who, &held, fencing);
    let judgement = ctx.webhooks.call(&registration, &key, &outbound).await;
    let event = |t: EventType| {
        let mut e = who.event(&ctx, t);
        e.partition = Some(held.partition);
        e.seq = Some(held.origin_seq);
        e.attempt = Some(held.attempt);
        e
    };
    let mut events = Vec::new();
    let (partition, seq) = (held.partition, held.stream_seq);
    let retry = |delay: Option<Duration>| {
        delay.unwrap_or_else(|| {
            let b = registration.backoff;
            backoff(held.attempt, Duration::from_millis(b.initial_ms), Duration::from_millis(b.max_ms), rand::random())
        })
    };
    let settled = match judgement.verdict {
        Verdict::Ack => {
            if let Err(e) = held.message.ack().await {
                tracing::debug!(error = %e, "ack not sent");
            }
            let mut e = event(EventType::MessageAcked);
            e.reason = Some(judgement.reason.clone());
            events.push(e);
            Settled::Done
        }
        Verdict::Nak { .. } | Verdict::Progress if held.attempt >= registration.max_attempts => {
            let reason = format!("gave up after {} attempts: {}", held.attempt, judgement.reason);
            match dead_letter_and_term(&ctx, &who, &held, &reason).await {
                Ok(mut e) => {
                    events.append(&mut e);
                    Settled::Done
                }
                Err(err) => {
                    nak(
                        &held,
                        retry(None),
                        &judgement.reason,
                        &err.to_string(),
                        &mut events,
                        event(EventType::MessageNaked),
                    )
                    .await
                }
            }
        }
        Verdict::Nak { delay } => {
            nak(&held, retry(delay), &judgement.reason, "", &mut events, event(EventType::MessageNaked)).await
        }
        Verdict::Progress => {
            nak(&held, retry(None), &judgement.reason, "", &mut events, event(EventType::MessageNaked)).await
        }
        Verdict::Term => match dead_letter_and_term(&ctx, &who, &held, &judgement.reason).await {
            Ok(mut e) => {
                events.append(&mut e);
                Settled::Done
            }
            Err(err) => {
                nak(
                    &held,
                    retry(None),
                    &judgement.reason,
                    &err.to_string(),
                    &mut events,
                    event(EventType::MessageNaked),
                )
                .await
            }
        },
    };
    Outcome { partition, seq, settled, events, gone: judgement.gone }
}

async fn nak(
    held: &Delivered,
    delay: Duration,
    reason: &str,
    extra: &str,
    events: &mut Vec<Event>,
    mut event: Event,
) -> Settled {
    if let Err(e) = held.message.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::debug!(error = %e, "nak not sent");
    }
    let error = if extra.is_empty() { reason.to_owned() } else { format!("{reason} ({extra})") };
    event.delay_ms = Some(delay.as_millis() as u64);
    event.reason = Some(error.clone());
    events.push(event);
    Settled::Naked { attempts: held.attempt, error }
}

/// Copies the message to the dead-letter stream, then terminates it: it is
/// never terminated without its copy stored.
async fn dead_letter_and_term(
    ctx: &InstanceContext,
    who: &MemberRef,
    held: &Delivered,
    reason: &str,
) -> anyhow::Result<Vec<Event>> {
    dead_letter::record(
        &ctx.js,
        DeadLetter {
            stream: who.stream.as_str(),
            group: who.group.as_str(),
            member: who.member.as_str(),
            subject: &held.subject,
            key: held.key.as_deref(),
            partition: held.partition,
            stream_seq: held.origin_seq,
            attempts: held.attempt,
            reason,
            headers: held.message.headers.as_ref(),
            payload: held.message.payload.clone(),
        },
    )
    .await?;
    held.message.ack_with(AckKind::Term).await.map_err(|e| anyhow::anyhow!("terminating: {e}"))?;
    let mut out = Vec::new();
    for t in [EventType::MessageTerminated, EventType::MessageDeadLettered] {
        let mut e = who.event(ctx, t);
        e.partition = Some(held.partition);
        e.seq = Some(held.origin_seq);
        e.attempt = Some(held.attempt);
        e.reason = Some(reason.to_owned());
        out.push(e);
    }
    Ok(out)
}

/// Asks the pinned instance of a member; `None` when no instance holds the pin.
pub async fn ask(nats: &async_nats::Client, who: &MemberRef, control: &Control) -> Option<ControlReply> {
    let payload = serde_json::to_vec(control).ok()?;
    let reply =
        tokio::time::timeout(Duration::from_millis(750), nats.request(who.control_subject(), payload.into())).await;
    match reply {
        Ok(Ok(message)) => serde_json::from_slice(&message.payload).ok(),
        _ => None,
    }
}
