//! One instance of one member: joins the member's consumer, pulls with the
//! pinned-client protocol, keeps partition lanes in order, delivers to the
//! member's webhook, and follows rebalances. Every keygate replica runs one
//! instance per registered member; the pin makes one of them active.
//!
//! The session task owns the pin and the pull; each partition with a ready
//! head has a lane task that delivers its messages one at a time and picks
//! the next itself, so a partition's next message goes out without a round
//! trip through the session.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::consumer::{join, pull_expiry, JoinError};
use super::control::{BlockedPartition, Control, ControlReply};
use super::deliver::{dead_letter_and_term, deliver, origin_of, remove, Because, Delivered, Held, Outcome};
use super::fencing::next_token;
use super::lanes::{Blocked, Lanes, Offered, Settled, Settlement};
use super::pull::{classify, next_subject, DeliveryGaps, PullRequest, Reply};
use crate::delivery::endpoint::Endpoint;
use crate::delivery::signing::SigningKey;
use crate::delivery::webhook::{registration_key, Registration, WebhookClient, WebhookStore};
use crate::delivery::websocket::ServerFrame;
use crate::events::{Event, EventBus, EventType};
use crate::groups::admin::{filter_subjects_of, DEFAULT_ACK_WAIT_MS};
use crate::groups::config::{config_key, ELASTIC_BUCKET, STATIC_BUCKET};
use crate::groups::{GroupAdmin, GroupConfig, GroupKind};
use crate::names::{GroupName, MemberName, StreamName};
use crate::partition::{decode_key, PartitionSpec, SubjectPattern};

/// Members' control subjects, `<prefix><stream>.<group>.<member>`.
pub const CONTROL_PREFIX: &str = "keygate.control.";

/// Most messages asked for in one pull.
const MAX_PULL_BATCH: usize = 256;
/// Pulls kept open at once, so the server always has one to deliver on.
const MAX_OPEN_PULLS: usize = 3;
/// How often a non-pinned instance checks who holds the pin.
const PIN_CHECK: Duration = Duration::from_millis(250);
/// How often a newly pinned instance checks whether the handover barrier
/// can come down (nothing is delivered until it does).
const BARRIER_CHECK: Duration = Duration::from_millis(20);

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
    /// Group configuration updates, watched once for the process.
    pub config_watch: super::config_watch::ConfigWatch,
    /// Subscriptions shared by the instances of one member (control requests).
    pub subscriptions: crate::nats::shared::SharedSubscriptions,
    /// The latest configuration of each group, shared by its instances.
    pub configs: Mutex<SharedConfigs>,
}

/// Each group's latest configuration by revision.
pub type SharedConfigs = std::collections::HashMap<(StreamName, GroupName), (u64, Arc<GroupConfig>)>;

impl InstanceContext {
    /// One shared copy of a group's configuration per revision: a thousand
    /// connections of a group's members hold one, not a thousand.
    fn share_config(&self, who: &MemberRef, revision: u64, config: GroupConfig) -> Arc<GroupConfig> {
        let mut configs = self.configs.lock().unwrap_or_else(|p| p.into_inner());
        let key = (who.stream.clone(), who.group.clone());
        match configs.get(&key) {
            Some((known, shared)) if *known == revision => shared.clone(),
            _ => {
                let shared = Arc::new(config);
                configs.insert(key, (revision, shared.clone()));
                shared
            }
        }
    }
}

/// Which member an instance serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemberRef {
    pub stream: StreamName,
    pub group: GroupName,
    pub member: MemberName,
    /// A group's member, or a plain consumer's subscriber (whose `group`
    /// holds the consumer's name).
    pub owner: crate::delivery::dead_letter::Owner,
}

impl MemberRef {
    pub(crate) fn event(&self, ctx: &InstanceContext, event_type: EventType) -> Event {
        Event::new(event_type, self.stream.as_str(), self.group.as_str(), self.member.as_str(), &ctx.instance_id)
    }

    /// The subject control requests for this member go to.
    pub fn control_subject(&self) -> String {
        format!("{CONTROL_PREFIX}{}.{}.{}", self.stream, self.group, self.member)
    }
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
    serve_member(ctx, who, Arc::new(Endpoint::Webhook { registration, key }), cancel).await;
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
        let ack_wait = Box::pin(ctx.groups.settings(&who.stream, &who.group))
            .await
            .ok()
            .and_then(|s| s.ack_wait_ms)
            .map_or(Duration::from_millis(DEFAULT_ACK_WAIT_MS), Duration::from_millis);
        let partitions = owned_partitions(&group.config, who.member.as_str());
        if last_partitions.as_ref() != Some(&partitions) {
            let mut e = who.event(&ctx, EventType::AssignmentChanged);
            e.partitions = Some(partitions.clone());
            ctx.events.emit(e);
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
        let session = Box::pin(Session::new(
            ctx.clone(),
            who.clone(),
            endpoint.clone(),
            group.config.clone(),
            group.revision,
            stream_name.clone(),
            consumer.clone(),
            ack_wait,
        ))
        .await;
        let Some(session) = session else {
            if sleep_or_cancel(&cancel, Duration::from_secs(1)).await {
                return;
            }
            continue;
        };
        let updates = match session.config.kind() {
            GroupKind::Static => updates.0,
            GroupKind::Elastic => updates.1,
        };
        match session.run(&cancel, updates).await {
            SessionEnd::Shutdown => return,
            SessionEnd::Gone => {
                if let Endpoint::Webhook { registration, .. } = &*endpoint {
                    Box::pin(deregister(&ctx, &who, registration)).await;
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
                    Box::pin(super::consumer::delete_if_unchanged(&ctx.js, &stream_name, &consumer, &old_filters))
                        .await;
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
    tracing::warn!(member = %who.member, url = %crate::delivery::webhook::redact_url(&registration.url),
        "endpoint answered 410 Gone: stopped serving it");
}

/// Where the key sits in a member's subjects, to give deliveries the key.
struct KeyLocator {
    patterns: Vec<(SubjectPattern, usize)>,
}

impl KeyLocator {
    /// `None` when the stream cannot be read now: a session without keys
    /// would deliver without `keygate-key` for its whole life, so it waits.
    async fn for_group(ctx: &InstanceContext, config: &GroupConfig, stream: &str) -> Option<Self> {
        let mut patterns = Vec::new();
        match config {
            GroupConfig::Static(_) => {
                let s = ctx.js.get_stream(stream).await.ok()?;
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
        Some(Self { patterns })
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
    /// The pin id the pull carried.
    pin: Option<String>,
}

/// Lane state shared by the session and the lane tasks. Never held across
/// an await.
struct LaneState {
    lanes: Lanes<Held>,
    blocked_reported: BlockedPartitions,
    /// Partitions whose head an operator skipped while it was being
    /// delivered: it is dead-lettered when that attempt fails.
    skip_requested: BTreeSet<u32>,
}

/// Partitions reported blocked, mirrored in the blocked-partitions gauge
/// (which drops back when the instance ends).
struct BlockedPartitions {
    set: BTreeSet<u32>,
    gauge: metrics::Gauge,
}

impl BlockedPartitions {
    fn new(who: &MemberRef) -> Self {
        let gauge = metrics::gauge!(crate::metrics::BLOCKED_PARTITIONS,
            "stream" => who.stream.to_string(), "group" => who.group.to_string(), "member" => who.member.to_string());
        Self { set: BTreeSet::new(), gauge }
    }

    fn contains(&self, partition: &u32) -> bool {
        self.set.contains(partition)
    }

    fn insert(&mut self, partition: u32) {
        if self.set.insert(partition) {
            self.gauge.increment(1.0);
        }
    }

    fn remove(&mut self, partition: &u32) {
        if self.set.remove(partition) {
            self.gauge.decrement(1.0);
        }
    }

    fn clear(&mut self) {
        self.gauge.decrement(self.set.len() as f64);
        self.set.clear();
    }
}

impl Drop for BlockedPartitions {
    fn drop(&mut self) {
        self.clear();
    }
}

/// What lane tasks need.
#[derive(Clone)]
struct LaneShared {
    ctx: Arc<InstanceContext>,
    who: MemberRef,
    endpoint: Arc<Endpoint>,
    state: Arc<Mutex<LaneState>>,
    /// Whether this instance holds the pin (lanes stop when it does not).
    pinned: Arc<AtomicBool>,
    fencing: Arc<AtomicU64>,
    /// Set when the endpoint answered 410.
    gone: Arc<AtomicBool>,
    wake: Arc<Notify>,
}

impl LaneShared {
    fn lock(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Delivers one partition's messages, one at a time, for as long as the
/// partition has a ready head: the next message goes out the moment the
/// previous one is settled, without a round trip through the session.
async fn run_lane(shared: LaneShared, partition: u32, first: (u64, Held)) {
    let mut next = Some(first);
    while let Some((seq, held)) = next {
        let fencing = shared.fencing.load(Ordering::Relaxed);
        let delivery = deliver(shared.ctx.clone(), shared.who.clone(), shared.endpoint.clone(), held.clone(), fencing);
        // A panic must not leave the partition marked in flight for ever.
        let outcome = match std::panic::AssertUnwindSafe(delivery).catch_unwind().await {
            Ok(outcome) => outcome,
            Err(_) => {
                tracing::error!(partition, seq, "delivery panicked; the message will be retried");
                let _ = held.message.ack_with(AckKind::Nak(Some(Duration::from_secs(1)))).await;
                Outcome {
                    settled: Settled::Naked { attempts: held.attempt, error: "keygate failed while delivering".into() },
                    events: Vec::new(),
                    gone: false,
                }
            }
        };
        let mut outcome = outcome;
        let skip = matches!(outcome.settled, Settled::Naked { .. }) && shared.lock().skip_requested.remove(&partition);
        if skip {
            match dead_letter_and_term(&shared.ctx, &shared.who, &held, "skipped by an operator").await {
                Ok(mut events) => {
                    outcome.events.append(&mut events);
                    outcome.settled = Settled::Done(Settlement::Terminated);
                }
                Err(e) => tracing::warn!(error = %e, partition, seq, "could not dead-letter a skipped message"),
            }
        }
        for e in outcome.events {
            shared.ctx.events.emit(e);
        }
        if outcome.gone {
            shared.gone.store(true, Ordering::Relaxed);
            shared.wake.notify_one();
        }
        let naked = matches!(outcome.settled, Settled::Naked { .. });
        let mut state = shared.lock();
        let was_blocked = state.lanes.blocked().contains_key(&partition);
        state.lanes.settle(partition, seq, outcome.settled);
        let blocked = state.lanes.blocked().remove(&partition);
        if naked && !state.blocked_reported.contains(&partition) {
            state.blocked_reported.insert(partition);
            if let Some(b) = blocked {
                let mut e = shared.who.event(&shared.ctx, EventType::PartitionBlocked);
                e.partition = Some(partition);
                e.seq = Some(b.seq);
                e.attempt = Some(b.attempts);
                e.reason = Some(b.last_error);
                shared.ctx.events.emit(e);
            }
        } else if was_blocked && blocked.is_none() {
            state.blocked_reported.remove(&partition);
            let mut e = shared.who.event(&shared.ctx, EventType::PartitionUnblocked);
            e.partition = Some(partition);
            e.seq = Some(seq);
            shared.ctx.events.emit(e);
        }
        next = if shared.pinned.load(Ordering::Relaxed) && !shared.gone.load(Ordering::Relaxed) {
            state.lanes.dispatch_partition(partition)
        } else {
            None
        };
    }
}

/// A group's configuration as an instance holds it.
struct SharedGroup {
    revision: u64,
    config: Arc<GroupConfig>,
}

struct Session {
    shared: LaneShared,
    config: Arc<GroupConfig>,
    revision: u64,
    stream_name: String,
    consumer: String,
    ack_wait: Duration,
    keys: KeyLocator,
    pin: Option<String>,
    standby: bool,
    last_message: Instant,
    /// When the server last answered anything (messages, timeouts).
    last_reply: Instant,
    /// The fencing token could not be raised yet: the barrier stays up.
    token_pending: bool,
    inbox: String,
    pulls: u64,
    /// Open pulls, oldest first.
    outstanding: VecDeque<Outstanding>,
    lane_tasks: JoinSet<()>,
    /// Tells this session apart from other instances of the member in this process.
    session_id: u64,
    /// The consumer's delivery sequence as this session saw it.
    gaps: DeliveryGaps,
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    async fn new(
        ctx: Arc<InstanceContext>,
        who: MemberRef,
        endpoint: Arc<Endpoint>,
        config: Arc<GroupConfig>,
        revision: u64,
        stream_name: String,
        consumer: String,
        ack_wait: Duration,
    ) -> Option<Self> {
        let keys = KeyLocator::for_group(&ctx, &config, who.stream.as_str()).await?;
        let inbox = ctx.nats.new_inbox();
        let blocked_reported = BlockedPartitions::new(&who);
        let shared = LaneShared {
            ctx,
            who,
            endpoint,
            state: Arc::new(Mutex::new(LaneState {
                lanes: Lanes::default(),
                blocked_reported,
                skip_requested: BTreeSet::new(),
            })),
            pinned: Arc::default(),
            fencing: Arc::default(),
            gone: Arc::default(),
            wake: Arc::default(),
        };
        Some(Self {
            shared,
            config,
            revision,
            stream_name,
            consumer,
            ack_wait,
            keys,
            pin: None,
            standby: false,
            last_message: Instant::now(),
            last_reply: Instant::now(),
            token_pending: false,
            inbox,
            pulls: 0,
            outstanding: VecDeque::new(),
            lane_tasks: JoinSet::new(),
            session_id: rand::random::<u64>() >> 16,
            gaps: DeliveryGaps::default(),
        })
    }

    fn ctx(&self) -> &Arc<InstanceContext> {
        &self.shared.ctx
    }

    fn who(&self) -> &MemberRef {
        &self.shared.who
    }

    async fn run(
        mut self,
        cancel: &CancellationToken,
        mut updates: tokio::sync::broadcast::Receiver<Arc<async_nats::jetstream::kv::Entry>>,
    ) -> SessionEnd {
        let Ok(mut replies) = self.ctx().nats.subscribe(format!("{}.*", self.inbox)).await else {
            return SessionEnd::ConsumerGone;
        };
        let Ok(mut control) = self.ctx().subscriptions.subscribe(&self.who().control_subject()).await else {
            return SessionEnd::ConsumerGone;
        };
        let key = config_key(self.who().stream.as_str(), self.who().group.as_str());
        let progress_every = (self.ack_wait / 3).max(Duration::from_millis(100));
        let mut progress = tokio::time::interval(progress_every);
        let mut pin_check = tokio::time::interval(PIN_CHECK);
        let mut barrier_check = tokio::time::interval(BARRIER_CHECK);
        let my_filters = filter_subjects_of(&self.config, self.who().member.as_str());
        let wake = self.shared.wake.clone();
        let end = loop {
            if self.shared.gone.load(Ordering::Relaxed) {
                break SessionEnd::Gone;
            }
            self.dispatch();
            Box::pin(self.ensure_pull()).await;
            let pull_deadline = self
                .outstanding
                .iter()
                .map(|o| o.deadline)
                .min()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                () = cancel.cancelled() => break SessionEnd::Shutdown,
                reply = replies.next() => {
                    let Some(reply) = reply else { break SessionEnd::ConsumerGone };
                    if let Some(end) = Box::pin(self.on_reply(reply)).await {
                        break end;
                    }
                }
                () = wake.notified() => {}
                _ = progress.tick() => Box::pin(self.progress()).await,
                _ = pin_check.tick() => Box::pin(self.check_pin()).await,
                _ = barrier_check.tick(), if self.pin.is_some() && self.shared.lock().lanes.barrier() => Box::pin(self.check_pin()).await,
                () = tokio::time::sleep_until(pull_deadline.into()) => {
                    let now = Instant::now();
                    self.outstanding.retain(|o| o.deadline > now);
                }
                request = control.recv() => {
                    match request {
                        Ok(request) => Box::pin(self.on_control(request)).await,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => break SessionEnd::ConsumerGone,
                    }
                }
                update = updates.recv() => {
                    let entry = match update {
                        Ok(entry) if entry.key == key => entry,
                        Ok(_) => continue,
                        // Missed updates: read the configuration again.
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => break SessionEnd::Rejoin { pinned: false },
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => continue,
                    };
                    match entry.operation {
                        async_nats::jetstream::kv::Operation::Put => {
                            if entry.revision <= self.revision {
                                continue;
                            }
                            let changed = match crate::groups::admin::parse_stored(self.config.kind(), &entry.value) {
                                Ok(next) => {
                                    next.partitions() != self.config.partitions()
                                        || filter_subjects_of(&next, self.who().member.as_str()) != my_filters
                                }
                                Err(_) => true,
                            };
                            if changed {
                                break SessionEnd::Rejoin { pinned: self.pin.is_some() };
                            }
                        }
                        _ => break SessionEnd::Rejoin { pinned: false },
                    }
                }
            }
        };
        Box::pin(self.wind_down(&end)).await;
        end
    }

    /// Keeps pulls open: a new one goes out while less than a batch is
    /// still asked for, so the server never waits for the next pull.
    async fn ensure_pull(&mut self) {
        // Hold cap: a partition blocked with many messages behind its head
        // slows intake to one message per pull, which still keeps the pin.
        let deepest = self.shared.lock().lanes.deepest();
        let trickle = deepest >= self.ctx().hold_cap;
        loop {
            let asked: usize = self.outstanding.iter().map(|o| o.remaining).sum();
            let enough = if trickle { !self.outstanding.is_empty() } else { asked >= MAX_PULL_BATCH };
            if enough || self.outstanding.len() >= MAX_OPEN_PULLS {
                return;
            }
            let room = if trickle { 1 } else { MAX_PULL_BATCH };
            self.pulls += 1;
            let reply = format!("{}.{}", self.inbox, self.pulls);
            let expires = pull_expiry(self.ack_wait);
            let body = serde_json::to_vec(&PullRequest::new(room, expires, self.pin.as_deref())).unwrap_or_default();
            let subject = next_subject(&self.stream_name, &self.consumer);
            if let Err(e) = self.ctx().nats.publish_with_reply(subject, reply.clone(), Bytes::from(body)).await {
                tracing::debug!(error = %e, "sending pull");
                return;
            }
            let deadline = Instant::now() + expires + Duration::from_millis(500);
            self.outstanding.push_back(Outstanding { reply, remaining: room, deadline, pin: self.pin.clone() });
        }
    }

    async fn on_reply(&mut self, reply: async_nats::Message) -> Option<SessionEnd> {
        self.last_reply = Instant::now();
        let subject = reply.subject.to_string();
        let finish = |outstanding: &mut VecDeque<Outstanding>| outstanding.retain(|o| o.reply != subject);
        match classify(reply.status, reply.description.as_deref(), reply.headers.as_ref()) {
            Reply::Message { pin } => {
                if let Some(pin) = pin {
                    if self.pin.as_deref() != Some(pin.as_str()) {
                        self.gain_pin(pin).await;
                    }
                }
                // Messages come with their own subject, not the pull's inbox
                // subject; the server fills pulls oldest first.
                if let Some(o) = self.outstanding.front_mut() {
                    o.remaining = o.remaining.saturating_sub(1);
                    if o.remaining == 0 {
                        self.outstanding.pop_front();
                    }
                }
                self.take(reply);
            }
            Reply::Done => finish(&mut self.outstanding),
            Reply::PinRejected { description } => {
                // Only a rejection of a pull that carried the current pin means
                // the pin is gone; a late one for an older id does not.
                let carried = self.outstanding.iter().find(|o| o.reply == subject).map(|o| o.pin.clone());
                finish(&mut self.outstanding);
                if let Some(Some(pin)) = carried {
                    if self.pin.as_deref() == Some(pin.as_str()) {
                        self.outstanding.clear();
                        self.lose_pin(&description);
                    }
                }
            }
            Reply::ConsumerDeleted => return Some(SessionEnd::ConsumerGone),
            Reply::Conflict { description } => {
                tracing::debug!(%description, "pull conflict");
                finish(&mut self.outstanding);
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
        self.last_reply = Instant::now();
        // Handover barrier: nothing goes out until every ack-pending message
        // of the consumer is ours (and the fencing token is raised).
        {
            let mut state = self.shared.lock();
            state.lanes.set_barrier(true);
            self.shared.pinned.store(true, Ordering::Relaxed);
        }
        self.token_pending = !self.raise_fencing_token().await;
        self.count_pin_change("gained");
        let mut e = self.who().event(self.ctx(), EventType::MemberPinned);
        e.pin_id = Some(pin);
        e.fencing_token = (!self.token_pending).then(|| self.shared.fencing.load(Ordering::Relaxed));
        let partitions = owned_partitions(&self.config, self.who().member.as_str());
        e.partitions = Some(partitions.clone());
        let fencing_token = e.fencing_token;
        self.ctx().events.emit(e);
        let instance = self.ctx().instance_id.clone();
        self.shared.endpoint.notify(|| ServerFrame::Pinned { partitions, fencing_token, instance });
    }

    fn count_pin_change(&self, change: &'static str) {
        let who = self.who();
        metrics::counter!(
            crate::metrics::PIN_CHANGES,
            "stream" => who.stream.to_string(),
            "group" => who.group.to_string(),
            "member" => who.member.to_string(),
            "change" => change
        )
        .increment(1);
    }

    /// Raises the member's fencing token in KV; false when it could not
    /// (then nothing is delivered until it can: a guessed token could be
    /// lower than the previous holder's).
    async fn raise_fencing_token(&mut self) -> bool {
        let who = self.who();
        let key = registration_key(who.stream.as_str(), who.group.as_str(), who.member.as_str());
        match next_token(&self.ctx().js, &key).await {
            Ok(token) => {
                self.shared.fencing.store(token, Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "raising the fencing token failed; holding deliveries");
                false
            }
        }
    }

    fn lose_pin(&mut self, why: &str) {
        self.pin = None;
        // Held and NAK'd messages now belong to the next holder; deliveries
        // in flight finish (and stay kept alive) so its barrier waits for them.
        {
            let mut state = self.shared.lock();
            self.shared.pinned.store(false, Ordering::Relaxed);
            state.lanes.release_held();
            state.blocked_reported.clear();
        }
        self.count_pin_change("lost");
        let mut e = self.who().event(self.ctx(), EventType::MemberUnpinned);
        e.reason = Some(why.to_owned());
        self.ctx().events.emit(e);
        let partitions = owned_partitions(&self.config, self.who().member.as_str());
        self.shared.endpoint.notify(|| ServerFrame::Standby { partitions });
    }

    fn take(&mut self, reply: async_nats::Message) {
        self.last_message = Instant::now();
        let message = jetstream::Message { message: reply, context: self.ctx().js.clone() };
        let Ok(info) = message.info() else { return };
        let (stream_seq, attempt) = (info.stream_sequence, info.delivered.max(1) as u64);
        if self.gaps.missed_before(info.consumer_sequence) && self.pin.is_some() {
            // Deliveries went where this session never saw them (a pull whose
            // reply was lost with a NATS connection): they come back only at
            // ack wait, and nothing of the member may pass them until then.
            // The handover barrier waits for exactly that.
            self.shared.lock().lanes.set_barrier(true);
            metrics::counter!(crate::metrics::DELIVERY_GAPS, "stream" => self.who().stream.to_string(),
                "group" => self.who().group.to_string())
            .increment(1);
            tracing::info!(member = %self.who().member, consumer_seq = info.consumer_sequence,
                "deliveries of the consumer went missing; holding until they are redelivered");
        }
        let full = message.subject.to_string();
        let (partition, subject) = match full.split_once('.') {
            Some((p, rest)) => match p.parse::<u32>() {
                Ok(p) => (p, rest.to_owned()),
                Err(_) => return,
            },
            None => return,
        };
        let (origin_stream, origin_seq) = origin_of(&message, self.who().stream.as_str(), stream_seq);
        let key = self.keys.key(&subject);
        let held =
            Arc::new(Delivered { message, partition, stream_seq, attempt, subject, key, origin_stream, origin_seq });
        let offered = self.shared.lock().lanes.offer(partition, stream_seq, held.clone());
        if let Offered::AlreadySettled(how) = offered {
            tokio::spawn(async move {
                let _ = remove(&held, Because::SettledBefore(how)).await;
            });
        }
    }

    /// Starts a lane task for every partition whose head may go and that
    /// has no delivery running.
    fn dispatch(&mut self) {
        if self.pin.is_none() {
            return;
        }
        let ready = self.shared.lock().lanes.dispatch();
        for (partition, seq, held) in ready {
            self.lane_tasks.spawn(run_lane(self.shared.clone(), partition, (seq, held)));
        }
        // Reap finished lane tasks.
        while let Some(done) = self.lane_tasks.try_join_next() {
            if let Err(e) = done {
                if e.is_panic() {
                    tracing::error!(error = %e, "a lane task panicked");
                }
            }
        }
    }

    /// Keeps held and in-flight messages from timing out (ack wait), and
    /// stops waiting for NAK'd heads that will never come back (removed by
    /// the stream's limits or a purge).
    async fn progress(&mut self) {
        let (messages, awaited): (Vec<Held>, Vec<(u32, u64)>) = {
            let state = self.shared.lock();
            let held = state.lanes.held_messages().chain(state.lanes.in_flight_messages()).cloned().collect();
            (held, state.lanes.awaited_heads())
        };
        for held in messages {
            let _ = held.message.ack_with(AckKind::Progress).await;
        }
        if awaited.is_empty() || self.pin.is_none() {
            return;
        }
        let Ok(handle) = self.ctx().js.get_stream_no_info(&self.stream_name).await else { return };
        for (partition, seq) in awaited {
            // Only the stream leader's definite answer (error code 10037, "no
            // message found") says it is gone; a timeout, no responders or
            // an election says nothing, and the lane keeps waiting.
            let gone = matches!(handle.get_raw_message(seq).await,
                Err(e) if e.kind() == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound);
            if !gone {
                continue;
            }
            {
                let mut state = self.shared.lock();
                state.lanes.skip(partition, seq, None);
                state.blocked_reported.remove(&partition);
            }
            let mut e = self.who().event(self.ctx(), EventType::PartitionUnblocked);
            e.partition = Some(partition);
            e.seq = Some(seq);
            e.reason = Some("the awaited message is no longer in the stream (limits or purge)".into());
            self.ctx().events.emit(e);
        }
    }

    async fn check_pin(&mut self) {
        if self.pin.is_some() {
            // Cut off from the server, this instance cannot see the pin move:
            // it stops on its own before the server re-pins another.
            let ttl = super::consumer::pinned_ttl(self.ack_wait);
            let silence = (ttl.saturating_sub(Duration::from_millis(250)))
                .max(pull_expiry(self.ack_wait) + Duration::from_millis(250));
            if self.last_reply.elapsed() > silence {
                self.outstanding.clear();
                self.lose_pin("no word from the server within the pin's TTL");
                return;
            }
        }
        if self.token_pending && self.pin.is_some() {
            self.token_pending = !self.raise_fencing_token().await;
            if self.token_pending {
                return;
            }
        }
        let (barrier, ours) = {
            let state = self.shared.lock();
            (state.lanes.barrier(), state.lanes.holding() + state.lanes.awaiting())
        };
        let barrier = self.pin.is_some() && barrier;
        // A standby only waits: the pin comes to it through its pulls.
        if (!barrier && self.pin.is_some()) || (self.pin.is_none() && self.standby) {
            return;
        }
        // `ours` was counted before asking, so messages arriving meanwhile
        // can only make the server's count higher (the safe side).
        let Ok(handle) = self.ctx().js.get_stream_no_info(&self.stream_name).await else { return };
        let Ok(info) = handle.consumer_info(&self.consumer).await else { return };
        if barrier {
            if info.num_ack_pending <= ours && !self.token_pending {
                self.shared.lock().lanes.set_barrier(false);
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
            self.ctx().events.emit(self.who().event(self.ctx(), EventType::MemberStandby));
            let partitions = owned_partitions(&self.config, self.who().member.as_str());
            self.shared.endpoint.notify(|| ServerFrame::Standby { partitions });
        }
    }

    fn blocked_view(&self) -> Vec<BlockedPartition> {
        self.shared
            .lock()
            .lanes
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

    async fn on_control(&mut self, request: Arc<async_nats::Message>) {
        let Some(reply_to) = request.reply.clone() else { return };
        let Ok(control) = serde_json::from_slice::<Control>(&request.payload) else { return };
        if let Control::RollCall = control {
            let answer = ControlReply {
                instance: self.ctx().instance_id.clone(),
                ok: true,
                error: None,
                blocked: Vec::new(),
                holding: 0,
                fencing_token: self.shared.fencing.load(Ordering::Relaxed),
                floors: Default::default(),
                session: self.session_id,
                pinned: self.pin.is_some(),
            };
            if let Ok(payload) = serde_json::to_vec(&answer) {
                let _ = self.ctx().nats.publish(reply_to, payload.into()).await;
            }
            return;
        }
        // Only the pin holder answers the others: the requester gets its word.
        if self.pin.is_none() {
            return;
        }
        let (holding, floors) = {
            let state = self.shared.lock();
            (state.lanes.holding(), state.lanes.floors())
        };
        let mut answer = ControlReply {
            instance: self.ctx().instance_id.clone(),
            ok: true,
            error: None,
            blocked: Vec::new(),
            holding,
            fencing_token: self.shared.fencing.load(Ordering::Relaxed),
            floors,
            session: self.session_id,
            pinned: true,
        };
        let head = |partition: u32| self.shared.lock().lanes.blocked_head(partition);
        match control {
            Control::Status | Control::RollCall => {}
            Control::Skip { partition } => match head(partition) {
                Some((seq, held)) => {
                    let reason = "skipped by an operator";
                    match dead_letter_and_term(self.ctx(), self.who(), &held, reason).await {
                        Ok(events) => {
                            {
                                let mut state = self.shared.lock();
                                state.lanes.skip(partition, seq, Some(Settlement::Terminated));
                                state.blocked_reported.remove(&partition);
                            }
                            for e in events {
                                self.ctx().events.emit(e);
                            }
                            let mut e = self.who().event(self.ctx(), EventType::PartitionUnblocked);
                            e.partition = Some(partition);
                            e.seq = Some(seq);
                            self.ctx().events.emit(e);
                        }
                        Err(e) => {
                            answer.ok = false;
                            answer.error = Some(format!("could not dead-letter the head: {e}"));
                        }
                    }
                }
                None => {
                    let mut state = self.shared.lock();
                    if state.lanes.blocked().contains_key(&partition) {
                        // The head is being retried right now: it is
                        // dead-lettered as soon as this attempt fails.
                        state.skip_requested.insert(partition);
                    } else {
                        answer.ok = false;
                        answer.error = Some(format!("partition {partition} is not blocked"));
                    }
                }
            },
            Control::RetryNow { partition } => match head(partition) {
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
            let _ = self.ctx().nats.publish(reply_to, payload.into()).await;
        }
    }

    /// Stop pulling and dispatching; let deliveries in flight finish within
    /// the grace, then cut them off and NAK them; step down so a standby
    /// takes over at once.
    async fn wind_down(&mut self, end: &SessionEnd) {
        {
            let _state = self.shared.lock();
            self.shared.pinned.store(false, Ordering::Relaxed);
        }
        let grace = self.ctx().shutdown_grace;
        let finished =
            tokio::time::timeout(grace, async { while self.lane_tasks.join_next().await.is_some() {} }).await;
        if finished.is_err() {
            self.lane_tasks.abort_all();
            while self.lane_tasks.join_next().await.is_some() {}
            let in_flight: Vec<Held> = self.shared.lock().lanes.in_flight_messages().cloned().collect();
            for held in in_flight {
                let _ = held.message.ack_with(AckKind::Nak(None)).await;
            }
        }
        // Messages received but never dispatched go back now, so the next
        // holder need not wait out ack_wait for them.
        let held = self.shared.lock().lanes.release_held();
        for held in held {
            let _ = held.message.ack_with(AckKind::Nak(None)).await;
        }
        if self.pin.is_some() {
            if matches!(end, SessionEnd::Shutdown | SessionEnd::Gone) {
                if let Ok(handle) = self.ctx().js.get_stream_no_info(&self.stream_name).await {
                    let _ = handle.unpin_consumer(&self.consumer, crate::groups::config::PRIORITY_GROUP).await;
                }
            }
            let mut e = self.who().event(self.ctx(), EventType::MemberUnpinned);
            e.reason = Some(
                match end {
                    SessionEnd::Shutdown => "shutting down",
                    SessionEnd::Rejoin { .. } => "rebalancing",
                    SessionEnd::ConsumerGone => "consumer gone",
                    SessionEnd::Gone => "endpoint gone",
                }
                .into(),
            );
            self.ctx().events.emit(e);
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ctx().nats.flush()).await;
    }
}
