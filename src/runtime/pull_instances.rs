//! HTTP pull clients' instances on this replica (docs/pull.md): the first
//! fetch for a member (or a plain consumer's subscriber) starts one
//! instance here, which competes for the pin like a WebSocket connection;
//! it stops once no one fetched or settled for the pin's TTL and nothing
//! it handed out waits for a verdict. Verdicts posted to another replica
//! reach the one that handed the delivery out over NATS.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::delivery::frames::ClientFrame;
use crate::delivery::pull::{new_replica_tag, replica_of, PullEndpoint, PullStatus, PulledMessage};
use crate::error::Error as DomainError;

/// What starting a pull instance can fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartErrorKind {
    /// This keygate runs as many pull instances as it may.
    TooManyInstances,
    Unavailable,
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(StartErrorKind { TooManyInstances => TooMany });

pub type StartError = DomainError<StartErrorKind>;
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::runtime::endpoint::Endpoint;
use crate::runtime::instance::serve;
use crate::runtime::target::Target;
use crate::runtime::Runtime;
use crate::webhook::SubscriberOptions;
use StartError as Error;
use StartErrorKind as Kind;

/// Where verdicts for another replica's deliveries go: `<prefix><replica tag>`.
pub const FORWARD_PREFIX: &str = "keygate.pull.";
/// How long a forwarded verdict waits for the replica that handed the delivery out.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(2);

/// Whom a pull client fetches for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PullTarget {
    Member { stream: StreamName, group: GroupName, member: MemberName },
    Subscriber { stream: StreamName, consumer: ConsumerName, subscriber: MemberName },
}

impl std::fmt::Display for PullTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Member { stream, group, member } => write!(f, "member {stream}/{group}/{member}"),
            Self::Subscriber { stream, consumer, subscriber } => {
                write!(f, "subscriber {stream}/{consumer}/{subscriber}")
            }
        }
    }
}

/// What an instance is started with; a fetch naming others while it runs is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartOptions {
    pub max_attempts: u64,
    /// Members: most deliveries out at once (`None`: the ordering's default).
    pub max_in_flight: Option<usize>,
    /// Subscribers: how they pull.
    pub subscriber: Option<SubscriberOptions>,
    /// The consumer's ack wait: the longest visibility timeout a fetch may choose.
    pub ack_wait: Duration,
    /// No fetch or verdict for this long, nothing handed out: the instance stops.
    pub idle_after: Duration,
    /// Streams the clients' acks may publish to (docs/pipelines.md).
    pub outputs: Vec<StreamName>,
}

/// A verdict that could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SettleFailure {
    pub id: String,
    pub error: String,
}

/// A verdict forwarded to the replica that handed the deliveries out.
#[derive(Debug, Serialize, Deserialize)]
struct Forwarded {
    target: PullTarget,
    frames: Vec<ClientFrame>,
}

/// One running pull instance.
pub struct PullInstance {
    endpoint: Arc<PullEndpoint>,
    pub options: StartOptions,
    last_active: Mutex<Instant>,
    fetching: std::sync::atomic::AtomicUsize,
    stop: CancellationToken,
}

impl PullInstance {
    fn touch(&self) {
        *self.last_active.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Long-polls for up to `max` deliveries; the answer says where the
    /// instance stands afterwards.
    pub async fn fetch(&self, max: usize, wait: Duration, visibility: Duration) -> (Vec<PulledMessage>, PullStatus) {
        use std::sync::atomic::Ordering::Relaxed;
        self.fetching.fetch_add(1, Relaxed);
        self.touch();
        let messages = self.endpoint.fetch(max, wait, visibility).await;
        self.touch();
        self.fetching.fetch_sub(1, Relaxed);
        (messages, self.endpoint.status())
    }

    fn idle(&self) -> bool {
        let quiet = self.last_active.lock().unwrap_or_else(|p| p.into_inner()).elapsed() >= self.options.idle_after;
        quiet && self.fetching.load(std::sync::atomic::Ordering::Relaxed) == 0 && self.endpoint.handed_out() == 0
    }
}

/// This replica's pull instances.
#[derive(Clone)]
pub struct PullInstances {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<Runtime>,
    /// Starts every ack id this replica hands out.
    replica: String,
    running: Mutex<HashMap<PullTarget, Arc<PullInstance>>>,
    max_instances: usize,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

impl PullInstances {
    /// The registry, listening for verdicts other replicas forward here.
    pub async fn start(
        ctx: Arc<Runtime>,
        max_instances: usize,
        tasks: TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Self, Error> {
        let replica = new_replica_tag();
        let forwarded = ctx
            .broker
            .client
            .subscribe(format!("{FORWARD_PREFIX}{replica}"))
            .await
            .map_err(|e| Error::new(Kind::Unavailable, "subscribing for forwarded verdicts").caused_by(e))?;
        let instances =
            Self { inner: Arc::new(Inner { ctx, replica, running: Mutex::default(), max_instances, tasks, shutdown }) };
        instances.inner.tasks.spawn(instances.clone().answer_forwarded(forwarded));
        Ok(instances)
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<PullTarget, Arc<PullInstance>>> {
        self.inner.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The instance serving `target` here, if one runs.
    pub fn get(&self, target: &PullTarget) -> Option<Arc<PullInstance>> {
        self.running().get(target).cloned()
    }

    /// The instance serving `target` here, started with `options` unless
    /// one runs already (then the caller compares its options).
    pub fn get_or_start(&self, target: &PullTarget, options: StartOptions) -> Result<Arc<PullInstance>, Error> {
        let mut running = self.running();
        if let Some(instance) = running.get(target) {
            return Ok(instance.clone());
        }
        if matches!(target, PullTarget::Subscriber { .. }) != options.subscriber.is_some() {
            return Err(Error::new(Kind::Internal, "subscribers, and only they, start with pull options"));
        }
        if running.len() >= self.inner.max_instances {
            return Err(Error::new(
                Kind::TooManyInstances,
                format!("this keygate already runs {} pull instances (--pull-max-instances)", self.inner.max_instances),
            ));
        }
        let closed = CancellationToken::new();
        let mut endpoint =
            PullEndpoint::new(self.inner.replica.clone(), closed.clone(), options.max_attempts, options.max_in_flight);
        endpoint.outputs = options.outputs.clone();
        let endpoint = Arc::new(endpoint);
        let instance = Arc::new(PullInstance {
            endpoint: endpoint.clone(),
            options,
            last_active: Mutex::new(Instant::now()),
            fetching: Default::default(),
            stop: self.inner.shutdown.child_token(),
        });
        running.insert(target.clone(), instance.clone());
        drop(running);
        let gauge = metrics::gauge!(crate::telemetry::metrics::PULL_INSTANCES);
        gauge.increment(1.0);
        let ctx = self.inner.ctx.clone();
        let serve = {
            let (target, stop, pull_options) = (target.clone(), instance.stop.clone(), instance.options.subscriber);
            let endpoint = Arc::new(Endpoint::Pull(endpoint));
            async move {
                let served = match target {
                    PullTarget::Member { stream, group, member } => Some(Target::member(stream, group, member)),
                    PullTarget::Subscriber { stream, consumer, subscriber } => {
                        pull_options.and_then(|pull| Target::subscriber(stream, &consumer, subscriber, pull))
                    }
                };
                if let Some(served) = served {
                    serve(ctx, served, endpoint, stop).await;
                }
                // Whatever still waits in the outbox goes back to the server.
                closed.cancel();
                gauge.decrement(1.0);
            }
        };
        self.inner.tasks.spawn(serve);
        self.inner.tasks.spawn(self.clone().stop_when_idle(target.clone(), instance.clone()));
        Ok(instance)
    }

    /// Stops `instance` once it is idle; its session winds down and releases
    /// the pin, so another replica's fetching instance takes over at once.
    async fn stop_when_idle(self, target: PullTarget, instance: Arc<PullInstance>) {
        let every = (instance.options.idle_after / 4).max(Duration::from_millis(100));
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = instance.stop.cancelled() => break,
            }
            if instance.idle() {
                tracing::debug!(%target, "pull instance idle; stopping");
                break;
            }
        }
        let mut running = self.running();
        if running.get(&target).is_some_and(|current| Arc::ptr_eq(current, &instance)) {
            running.remove(&target);
        }
        drop(running);
        instance.stop.cancel();
        instance.endpoint.close();
    }

    /// Applies client verdicts (ack ids already checked well-formed): each
    /// on the replica that handed its delivery out. Answers what failed.
    pub async fn settle(&self, target: &PullTarget, frames: Vec<ClientFrame>) -> Vec<SettleFailure> {
        let mut by_replica: BTreeMap<String, Vec<ClientFrame>> = BTreeMap::new();
        for frame in frames {
            let replica = replica_of(frame.id()).unwrap_or_default().to_owned();
            by_replica.entry(replica).or_default().push(frame);
        }
        let mut failed = Vec::new();
        for (replica, frames) in by_replica {
            if replica == self.inner.replica {
                failed.extend(self.settle_here(target, frames));
            } else {
                failed.extend(self.forward(&replica, target, frames).await);
            }
        }
        failed
    }

    fn settle_here(&self, target: &PullTarget, frames: Vec<ClientFrame>) -> Vec<SettleFailure> {
        let Some(instance) = self.get(target) else {
            let error = format!("no pull instance of {target} runs on the keygate that handed this out any more (its deliveries went back)");
            return frames.iter().map(|f| SettleFailure { id: f.id().to_owned(), error: error.clone() }).collect();
        };
        instance.touch();
        frames
            .into_iter()
            .filter_map(|frame| {
                let id = frame.id().to_owned();
                instance.endpoint.settle(frame).err().map(|e| SettleFailure { id, error: e.to_string() })
            })
            .collect()
    }

    async fn forward(&self, replica: &str, target: &PullTarget, frames: Vec<ClientFrame>) -> Vec<SettleFailure> {
        let ids: Vec<String> = frames.iter().map(|f| f.id().to_owned()).collect();
        let all_failed =
            |error: &str| ids.iter().map(|id| SettleFailure { id: id.clone(), error: error.to_owned() }).collect();
        let Ok(payload) = serde_json::to_vec(&Forwarded { target: target.clone(), frames }) else {
            return all_failed("could not encode the verdicts");
        };
        let request = self.inner.ctx.broker.client.request(format!("{FORWARD_PREFIX}{replica}"), payload.into());
        match tokio::time::timeout(FORWARD_TIMEOUT, request).await {
            Ok(Ok(reply)) => serde_json::from_slice(&reply.payload)
                .unwrap_or_else(|_| all_failed("the keygate that handed this out gave an unreadable answer")),
            _ => all_failed("the keygate that handed this out did not answer (its deliveries go back when it stops)"),
        }
    }

    async fn answer_forwarded(self, mut requests: async_nats::Subscriber) {
        loop {
            let request = tokio::select! {
                request = requests.next() => request,
                () = self.inner.shutdown.cancelled() => None,
            };
            let Some(request) = request else { return };
            let Some(reply_to) = request.reply.clone() else { continue };
            let Ok(forwarded) = serde_json::from_slice::<Forwarded>(&request.payload) else { continue };
            let failed = self.settle_here(&forwarded.target, forwarded.frames);
            if let Ok(payload) = serde_json::to_vec(&failed) {
                let _ = self.inner.ctx.broker.client.publish(reply_to, payload.into()).await;
            }
        }
    }
}
