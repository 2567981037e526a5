//! `keygate serve`'s flags and environment variables, and the settings
//! they make (src/settings.rs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::nats::connect::NatsAuth;
use crate::settings::{NatsTarget, Settings};
use crate::telemetry::LogFormat;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address the HTTP API listens on.
    #[arg(long, env = "KEYGATE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// NATS server or cluster URLs, comma-separated. Omitted: keygate runs its own nats-server.
    #[arg(long, env = "KEYGATE_NATS_URL")]
    pub nats_url: Option<String>,
    /// Token for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// User for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,
    /// Password for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    pub nats_password: Option<String>,
    /// A .creds file (JWT + NKey) for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// Where the embedded nats-server keeps its JetStream store.
    #[arg(long, env = "KEYGATE_DATA_DIR", default_value = "./keygate-data")]
    pub data_dir: PathBuf,
    /// The nats-server binary for the embedded server.
    #[arg(long, env = "KEYGATE_NATS_SERVER_BIN", default_value = "nats-server")]
    pub nats_server_bin: PathBuf,
    /// Port of the embedded nats-server on 127.0.0.1 (0: any free port).
    #[arg(long, env = "KEYGATE_EMBEDDED_NATS_PORT", default_value_t = 0)]
    pub embedded_nats_port: u16,
    /// Timeout of JetStream requests and publish acks, in milliseconds.
    #[arg(long, env = "KEYGATE_NATS_TIMEOUT_MS", default_value_t = 5000)]
    pub nats_timeout_ms: u64,
    /// Most messages in one batch publish (at most 10000).
    #[arg(long, env = "KEYGATE_MAX_BATCH_MESSAGES", default_value_t = 1000, value_parser = clap::value_parser!(u16).range(1..=10000))]
    pub max_batch_messages: u16,
    /// Largest request body, in bytes.
    #[arg(long, env = "KEYGATE_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Longest time a client may take to send a request's headers, in milliseconds.
    #[arg(long, env = "KEYGATE_HEADER_READ_TIMEOUT_MS", default_value_t = 10_000)]
    pub header_read_timeout_ms: u64,
    /// Longest time a request may run (WebSockets and the event stream excepted), in milliseconds.
    #[arg(long, env = "KEYGATE_REQUEST_TIMEOUT_MS", default_value_t = 30_000)]
    pub request_timeout_ms: u64,
    /// Most HTTP connections open at once (further clients wait to be accepted).
    #[arg(long, env = "KEYGATE_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Hosts webhooks may always be delivered to (comma-separated names or IPs).
    #[arg(long, env = "KEYGATE_WEBHOOK_ALLOWED_HOSTS", value_delimiter = ',')]
    pub webhook_allowed_hosts: Vec<String>,
    /// Allow webhooks to private-network addresses (10/8, 172.16/12, 192.168/16, link-local, fc00::/7).
    #[arg(long, env = "KEYGATE_WEBHOOK_ALLOW_PRIVATE")]
    pub webhook_allow_private: bool,
    /// Allow webhooks to public internet addresses.
    #[arg(long, env = "KEYGATE_WEBHOOK_ALLOW_PUBLIC")]
    pub webhook_allow_public: bool,
    /// The only directory webhook credential files (bearer_file, mtls) may be read from.
    #[arg(long, env = "KEYGATE_WEBHOOK_CREDENTIALS_DIR")]
    pub webhook_credentials_dir: Option<std::path::PathBuf>,
    /// Messages held behind one blocked partition's head before intake slows.
    #[arg(long, env = "KEYGATE_HOLD_CAP", default_value_t = 256)]
    pub hold_cap: usize,
    /// Name of this keygate in events and group views (e.g. the pod name; default: random).
    #[arg(long, env = "KEYGATE_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Shared secret (at least 32 bytes) verifying HS256 bearer tokens.
    #[arg(long, env = "KEYGATE_AUTH_HS256_SECRET", hide_env_values = true)]
    auth_hs256_secret: Option<String>,
    /// PEM public key (RSA, EC P-256/P-384 or Ed25519) verifying RS*/ES*/EdDSA bearer tokens.
    #[arg(long, env = "KEYGATE_AUTH_PUBLIC_KEY")]
    pub auth_public_key: Option<PathBuf>,
    /// JWKS file (`{"keys":[…]}`) verifying bearer tokens; keys are chosen by `kid`.
    #[arg(long, env = "KEYGATE_AUTH_JWKS")]
    pub auth_jwks: Option<PathBuf>,
    /// Required `iss` claim.
    #[arg(long, env = "KEYGATE_AUTH_ISSUER")]
    pub auth_issuer: Option<String>,
    /// Required `aud` claim.
    #[arg(long, env = "KEYGATE_AUTH_AUDIENCE")]
    pub auth_audience: Option<String>,
    /// Clock skew tolerated on `exp` and `nbf`, in seconds.
    #[arg(long, env = "KEYGATE_AUTH_LEEWAY_SECS", default_value_t = 30)]
    pub auth_leeway_secs: u64,
    /// Serve without authentication on a non-loopback address (otherwise refused).
    #[arg(long, env = "KEYGATE_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,
    /// Separate listener for /healthz, /readyz and /metrics (then /metrics leaves --listen).
    #[arg(long, env = "KEYGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Seconds between samples of every group's backlog per partition for /metrics (0: off).
    #[arg(long, env = "KEYGATE_BACKLOG_SAMPLE_SECS", default_value_t = 15)]
    pub backlog_sample_secs: u64,
    /// Browser origins allowed to open WebSocket members, comma-separated (keygate's own origin always is; `*`: any).
    #[arg(long, env = "KEYGATE_WS_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub ws_allowed_origins: Vec<String>,
    /// Browser origins whose pages may call the REST API, comma-separated (CORS; default none; `*`: any).
    #[arg(long, env = "KEYGATE_CORS_ALLOWED_ORIGINS", value_delimiter = ',', value_parser = crate::http::cors::parse_origin)]
    pub cors_allowed_origins: Vec<String>,
    /// Most WebSocket connections one member (or subscriber) may have open on this keygate.
    #[arg(long, env = "KEYGATE_WS_MAX_CONNECTIONS_PER_MEMBER", default_value_t = 16)]
    pub ws_max_connections_per_member: usize,
    /// Seconds between pings to WebSocket members; two without an answer close the connection.
    #[arg(long, env = "KEYGATE_WS_PING_SECS", default_value_t = 15)]
    pub ws_ping_secs: u64,
    /// Webhook pins of a group one replica may hold beyond its fair share (⌈members / replicas⌉) before it steps the excess down.
    #[arg(long, env = "KEYGATE_PIN_BALANCE_SLACK", default_value_t = 0)]
    pub pin_balance_slack: usize,
    /// Most pull instances (members and subscribers fetched from over HTTP) running on this keygate.
    #[arg(long, env = "KEYGATE_PULL_MAX_INSTANCES", default_value_t = 1000)]
    pub pull_max_instances: usize,
    /// Replicas of keygate's own KV buckets and dead-letter stream, 1-5 (default: 3 on a cluster of three or more servers, else 1).
    #[arg(long, env = "KEYGATE_STATE_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    pub state_replicas: Option<u8>,
    /// Log format.
    #[arg(long, env = "KEYGATE_LOG_FORMAT", value_enum, default_value = "pretty")]
    pub log_format: LogFormat,
}

impl ServeArgs {
    pub fn settings(&self) -> Settings {
        let nats = match &self.nats_url {
            Some(url) => NatsTarget::External {
                url: url.clone(),
                auth: NatsAuth {
                    token: self.nats_token.clone(),
                    user: self.nats_user.clone(),
                    password: self.nats_password.clone(),
                    creds_file: self.nats_creds.clone(),
                },
            },
            None => NatsTarget::Embedded {
                binary: self.nats_server_bin.clone(),
                store_dir: self.data_dir.join("nats"),
                port: self.embedded_nats_port,
            },
        };
        Settings {
            listen: self.listen,
            nats,
            nats_timeout: Duration::from_millis(self.nats_timeout_ms.max(1)),
            max_batch_messages: usize::from(self.max_batch_messages),
            max_body_bytes: self.max_body_bytes,
            header_read_timeout: Duration::from_millis(self.header_read_timeout_ms.max(1)),
            request_timeout: Duration::from_millis(self.request_timeout_ms.max(1)),
            max_connections: self.max_connections.max(1),
            destinations: crate::webhook::destination::DestinationPolicy {
                allowed_hosts: self.webhook_allowed_hosts.clone(),
                allow_private: self.webhook_allow_private,
                allow_public: self.webhook_allow_public,
                credentials_dir: self.webhook_credentials_dir.clone(),
            },
            hold_cap: self.hold_cap.max(1),
            delivery_grace: Duration::from_secs(10),
            instance_id: self.instance_id.clone(),
            auth: crate::auth::AuthSettings {
                hs256_secret: self.auth_hs256_secret.clone(),
                public_key_pem: self.auth_public_key.clone(),
                jwks_file: self.auth_jwks.clone(),
                issuer: self.auth_issuer.clone(),
                audience: self.auth_audience.clone(),
                leeway: Duration::from_secs(self.auth_leeway_secs),
            },
            allow_unauthenticated: self.allow_unauthenticated,
            admin_listen: self.admin_listen,
            ws_allowed_origins: self.ws_allowed_origins.clone(),
            cors_allowed_origins: self.cors_allowed_origins.clone(),
            ws_ping_interval: Duration::from_secs(self.ws_ping_secs.max(1)),
            ws_max_connections_per_member: self.ws_max_connections_per_member.max(1),
            pull_max_instances: self.pull_max_instances.max(1),
            pin_balance_slack: self.pin_balance_slack,
            state_replicas: self.state_replicas.map(usize::from),
            backlog_sample_interval: (self.backlog_sample_secs > 0)
                .then(|| Duration::from_secs(self.backlog_sample_secs)),
        }
    }
}
