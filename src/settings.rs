//! Settings for `keygate serve`: flags, each also read from a `KEYGATE_*`
//! environment variable, with defaults that run a local sidecar.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::nats::connect::NatsAuth;

/// How to reach NATS: an existing server or cluster, or one keygate runs.
#[derive(Debug, Clone)]
pub enum NatsTarget {
    /// Connect to these servers (comma-separated URLs).
    External { url: String, auth: NatsAuth },
    /// Start and supervise a local `nats-server -js`.
    Embedded {
        binary: PathBuf,
        store_dir: PathBuf,
        /// 0 picks a free loopback port.
        port: u16,
    },
}

/// Everything `keygate serve` runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub nats: NatsTarget,
    /// Timeout of JetStream API requests and publish acks.
    pub nats_timeout: Duration,
    /// Most messages one batch publish may carry.
    pub max_batch_messages: usize,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Longest time a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// Longest time a request (other than a WebSocket or the event stream) may run.
    pub request_timeout: Duration,
    /// Most HTTP connections open at once.
    pub max_connections: usize,
    /// Where webhooks may be delivered.
    pub destinations: crate::webhook::destination::DestinationPolicy,
    /// Most messages held behind one partition's head before intake slows.
    pub hold_cap: usize,
    /// How long shutdown waits for webhook deliveries in flight.
    pub delivery_grace: Duration,
    /// Names this process in events and group views (default: random).
    pub instance_id: Option<String>,
    /// Bearer-token verification; no keys means no authentication.
    pub auth: crate::auth::AuthSettings,
    /// Serve without authentication on a non-loopback address.
    pub allow_unauthenticated: bool,
    /// A second listener for `/healthz`, `/readyz` and `/metrics` only
    /// (then `/metrics` leaves the API listener).
    pub admin_listen: Option<SocketAddr>,
    /// How often groups' backlog per partition is sampled into metrics (`None`: never).
    pub backlog_sample_interval: Option<Duration>,
    /// Browser origins allowed to open WebSocket members (besides keygate's own origin; `*`: any).
    pub ws_allowed_origins: Vec<String>,
    /// Browser origins whose pages may call the REST API (CORS; `*`: any).
    pub cors_allowed_origins: Vec<String>,
    /// Most WebSocket connections open at once for one member (or subscriber) on this keygate.
    pub ws_max_connections_per_member: usize,
    /// How often WebSocket members are pinged; two intervals without a word close the connection.
    pub ws_ping_interval: Duration,
    /// Most pull instances running at once on this keygate.
    pub pull_max_instances: usize,
    /// Pins of a group one replica may hold beyond its fair share.
    pub pin_balance_slack: usize,
    /// Replicas of keygate's own KV buckets and dead-letter stream (`None`:
    /// 3 on a cluster of three or more servers, else 1).
    pub state_replicas: Option<usize>,
}

impl Settings {
    /// Settings for tests and embedding: listen on loopback, talk to `url`.
    pub fn for_nats_url(url: impl Into<String>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            nats: NatsTarget::External { url: url.into(), auth: NatsAuth::default() },
            nats_timeout: Duration::from_secs(5),
            max_batch_messages: 1000,
            max_body_bytes: 16 * 1024 * 1024,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 4096,
            destinations: Default::default(),
            hold_cap: 256,
            delivery_grace: Duration::from_secs(10),
            instance_id: None,
            auth: crate::auth::AuthSettings { leeway: Duration::from_secs(30), ..Default::default() },
            allow_unauthenticated: false,
            admin_listen: None,
            backlog_sample_interval: Some(Duration::from_secs(15)),
            ws_allowed_origins: Vec::new(),
            cors_allowed_origins: Vec::new(),
            ws_ping_interval: Duration::from_secs(15),
            ws_max_connections_per_member: 16,
            pull_max_instances: 1000,
            pin_balance_slack: 0,
            state_replicas: None,
        }
    }
}
