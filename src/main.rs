//! The `keygate` command line: parses arguments and calls the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use keygate::nats::connect::NatsAuth;
use keygate::settings::{NatsTarget, Settings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// keygate allocates small, short-lived buffers per message; mimalloc
/// serves them markedly cheaper than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "keygate",
    version,
    about = "Ordered-per-key processing on NATS JetStream for HTTP and WebSocket clients"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Admin commands' connection and output flags.
#[derive(clap::Args)]
struct AdminFlags {
    #[command(flatten)]
    args: keygate::cli::AdminArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP API (and, without --nats-url, a local nats-server).
    Serve(Box<ServeArgs>),
    /// Print the OpenAPI document (or write it to a file).
    Openapi {
        /// Write here instead of standard output.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Static partitioned consumer groups (as pcgroups' `cg static`).
    Static {
        #[command(flatten)]
        flags: AdminFlags,
        #[command(subcommand)]
        command: keygate::cli::StaticCommand,
    },
    /// Elastic partitioned consumer groups (as pcgroups' `cg elastic`).
    Elastic {
        #[command(flatten)]
        flags: AdminFlags,
        #[command(subcommand)]
        command: keygate::cli::ElasticCommand,
    },
    /// Streams.
    Streams {
        #[command(flatten)]
        flags: AdminFlags,
        #[command(subcommand)]
        command: keygate::cli::StreamsCommand,
    },
    /// Dead letters: list, show, redrive, delete.
    Dlq {
        #[command(flatten)]
        flags: AdminFlags,
        #[command(subcommand)]
        command: keygate::cli::DlqCommand,
    },
    /// Exit 0 when a running keygate answers /healthz (for container health checks).
    Healthcheck {
        #[arg(long, env = "KEYGATE_LISTEN", default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Checked instead of --listen when set (it serves /healthz too).
        #[arg(long, env = "KEYGATE_ADMIN_LISTEN")]
        admin_listen: Option<SocketAddr>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Pretty,
    Json,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address the HTTP API listens on.
    #[arg(long, env = "KEYGATE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// NATS server or cluster URLs, comma-separated. Omitted: keygate runs its own nats-server.
    #[arg(long, env = "KEYGATE_NATS_URL")]
    nats_url: Option<String>,
    /// Token for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_TOKEN", hide_env_values = true)]
    nats_token: Option<String>,
    /// User for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_USER", requires = "nats_password")]
    nats_user: Option<String>,
    /// Password for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    nats_password: Option<String>,
    /// A .creds file (JWT + NKey) for --nats-url.
    #[arg(long, env = "KEYGATE_NATS_CREDS")]
    nats_creds: Option<PathBuf>,
    /// Where the embedded nats-server keeps its JetStream store.
    #[arg(long, env = "KEYGATE_DATA_DIR", default_value = "./keygate-data")]
    data_dir: PathBuf,
    /// The nats-server binary for the embedded server.
    #[arg(long, env = "KEYGATE_NATS_SERVER_BIN", default_value = "nats-server")]
    nats_server_bin: PathBuf,
    /// Port of the embedded nats-server on 127.0.0.1 (0: any free port).
    #[arg(long, env = "KEYGATE_EMBEDDED_NATS_PORT", default_value_t = 0)]
    embedded_nats_port: u16,
    /// Timeout of JetStream requests and publish acks, in milliseconds.
    #[arg(long, env = "KEYGATE_NATS_TIMEOUT_MS", default_value_t = 5000)]
    nats_timeout_ms: u64,
    /// Most messages in one batch publish (at most 10000).
    #[arg(long, env = "KEYGATE_MAX_BATCH_MESSAGES", default_value_t = 1000, value_parser = clap::value_parser!(u16).range(1..=10000))]
    max_batch_messages: u16,
    /// Largest request body, in bytes.
    #[arg(long, env = "KEYGATE_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Longest time a client may take to send a request's headers, in milliseconds.
    #[arg(long, env = "KEYGATE_HEADER_READ_TIMEOUT_MS", default_value_t = 10_000)]
    header_read_timeout_ms: u64,
    /// Longest time a request may run (WebSockets and the event stream excepted), in milliseconds.
    #[arg(long, env = "KEYGATE_REQUEST_TIMEOUT_MS", default_value_t = 30_000)]
    request_timeout_ms: u64,
    /// Most HTTP connections open at once (further clients wait to be accepted).
    #[arg(long, env = "KEYGATE_MAX_CONNECTIONS", default_value_t = 4096)]
    max_connections: usize,
    /// Hosts webhooks may always be delivered to (comma-separated names or IPs).
    #[arg(long, env = "KEYGATE_WEBHOOK_ALLOWED_HOSTS", value_delimiter = ',')]
    webhook_allowed_hosts: Vec<String>,
    /// Allow webhooks to private-network addresses (10/8, 172.16/12, 192.168/16, link-local, fc00::/7).
    #[arg(long, env = "KEYGATE_WEBHOOK_ALLOW_PRIVATE")]
    webhook_allow_private: bool,
    /// Allow webhooks to public internet addresses.
    #[arg(long, env = "KEYGATE_WEBHOOK_ALLOW_PUBLIC")]
    webhook_allow_public: bool,
    /// The only directory webhook credential files (bearer_file, mtls) may be read from.
    #[arg(long, env = "KEYGATE_WEBHOOK_CREDENTIALS_DIR")]
    webhook_credentials_dir: Option<std::path::PathBuf>,
    /// Messages held behind one blocked partition's head before intake slows.
    #[arg(long, env = "KEYGATE_HOLD_CAP", default_value_t = 256)]
    hold_cap: usize,
    /// Name of this keygate in events and group views (e.g. the pod name; default: random).
    #[arg(long, env = "KEYGATE_INSTANCE_ID")]
    instance_id: Option<String>,
    /// Shared secret (at least 32 bytes) verifying HS256 bearer tokens.
    #[arg(long, env = "KEYGATE_AUTH_HS256_SECRET", hide_env_values = true)]
    auth_hs256_secret: Option<String>,
    /// PEM public key (RSA, EC P-256/P-384 or Ed25519) verifying RS*/ES*/EdDSA bearer tokens.
    #[arg(long, env = "KEYGATE_AUTH_PUBLIC_KEY")]
    auth_public_key: Option<PathBuf>,
    /// JWKS file (`{"keys":[…]}`) verifying bearer tokens; keys are chosen by `kid`.
    #[arg(long, env = "KEYGATE_AUTH_JWKS")]
    auth_jwks: Option<PathBuf>,
    /// Required `iss` claim.
    #[arg(long, env = "KEYGATE_AUTH_ISSUER")]
    auth_issuer: Option<String>,
    /// Required `aud` claim.
    #[arg(long, env = "KEYGATE_AUTH_AUDIENCE")]
    auth_audience: Option<String>,
    /// Clock skew tolerated on `exp` and `nbf`, in seconds.
    #[arg(long, env = "KEYGATE_AUTH_LEEWAY_SECS", default_value_t = 30)]
    auth_leeway_secs: u64,
    /// Serve without authentication on a non-loopback address (otherwise refused).
    #[arg(long, env = "KEYGATE_ALLOW_UNAUTHENTICATED")]
    allow_unauthenticated: bool,
    /// Separate listener for /healthz, /readyz and /metrics (then /metrics leaves --listen).
    #[arg(long, env = "KEYGATE_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Seconds between samples of every group's backlog per partition for /metrics (0: off).
    #[arg(long, env = "KEYGATE_BACKLOG_SAMPLE_SECS", default_value_t = 15)]
    backlog_sample_secs: u64,
    /// Browser origins allowed to open WebSocket members, comma-separated (keygate's own origin always is; `*`: any).
    #[arg(long, env = "KEYGATE_WS_ALLOWED_ORIGINS", value_delimiter = ',')]
    ws_allowed_origins: Vec<String>,
    /// Browser origins whose pages may call the REST API, comma-separated (CORS; default none; `*`: any).
    #[arg(long, env = "KEYGATE_CORS_ALLOWED_ORIGINS", value_delimiter = ',', value_parser = keygate::http::cors::parse_origin)]
    cors_allowed_origins: Vec<String>,
    /// Most WebSocket connections one member (or subscriber) may have open on this keygate.
    #[arg(long, env = "KEYGATE_WS_MAX_CONNECTIONS_PER_MEMBER", default_value_t = 16)]
    ws_max_connections_per_member: usize,
    /// Seconds between pings to WebSocket members; two without an answer close the connection.
    #[arg(long, env = "KEYGATE_WS_PING_SECS", default_value_t = 15)]
    ws_ping_secs: u64,
    /// Webhook pins of a group one replica may hold beyond its fair share (⌈members / replicas⌉) before it steps the excess down.
    #[arg(long, env = "KEYGATE_PIN_BALANCE_SLACK", default_value_t = 0)]
    pin_balance_slack: usize,
    /// Most pull instances (members and subscribers fetched from over HTTP) running on this keygate.
    #[arg(long, env = "KEYGATE_PULL_MAX_INSTANCES", default_value_t = 1000)]
    pull_max_instances: usize,
    /// Replicas of keygate's own KV buckets and dead-letter stream, 1-5 (default: 3 on a cluster of three or more servers, else 1).
    #[arg(long, env = "KEYGATE_STATE_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    state_replicas: Option<u8>,
    /// Log format.
    #[arg(long, env = "KEYGATE_LOG_FORMAT", value_enum, default_value = "pretty")]
    log_format: LogFormat,
}

impl ServeArgs {
    fn settings(&self) -> Settings {
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
            destinations: keygate::delivery::destination::DestinationPolicy {
                allowed_hosts: self.webhook_allowed_hosts.clone(),
                allow_private: self.webhook_allow_private,
                allow_public: self.webhook_allow_public,
                credentials_dir: self.webhook_credentials_dir.clone(),
            },
            hold_cap: self.hold_cap.max(1),
            delivery_grace: Duration::from_secs(10),
            instance_id: self.instance_id.clone(),
            auth: keygate::auth::AuthSettings {
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

/// Logs to standard output, filtered by `KEYGATE_LOG`; spans also go to
/// OTLP when the `OTEL_*` variables ask for it (the provider returned, to
/// be flushed at exit). Exported spans have their own filter, so a quiet
/// log level does not silence traces.
fn init_logs(format: LogFormat) -> anyhow::Result<Option<opentelemetry_sdk::trace::SdkTracerProvider>> {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;
    let filter = tracing_subscriber::EnvFilter::try_from_env("KEYGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only for a terminal: redirected logs stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let logs = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer().json().boxed(),
        LogFormat::Pretty => tracing_subscriber::fmt::layer().with_ansi(ansi).boxed(),
    };
    let provider = keygate::telemetry::otlp_provider()?;
    let spans = provider.as_ref().map(|provider| {
        let keygate_spans = tracing_subscriber::filter::Targets::new().with_target("keygate", tracing::Level::INFO);
        tracing_opentelemetry::layer().with_tracer(provider.tracer("keygate")).with_filter(keygate_spans)
    });
    tracing_subscriber::registry().with(logs.with_filter(filter)).with(spans).init();
    Ok(provider)
}

async fn shutdown_signal(token: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
    token.cancel();
}

async fn healthcheck(listen: SocketAddr) -> anyhow::Result<()> {
    let addr = if listen.ip().is_unspecified() { SocketAddr::from(([127, 0, 0, 1], listen.port())) } else { listen };
    let mut stream = tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr))
        .await
        .context("timed out connecting")??;
    stream.write_all(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n").await?;
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut reply))
        .await
        .context("timed out reading")??;
    let status_line = String::from_utf8_lossy(&reply).lines().next().unwrap_or_default().to_owned();
    anyhow::ensure!(status_line.contains(" 200 "), "unhealthy: {status_line}");
    Ok(())
}

/// Admin commands print a one-line error and exit 1, without a backtrace.
async fn admin(flags: &AdminFlags, command: keygate::cli::AdminCommand) -> anyhow::Result<()> {
    if let Err(e) = keygate::cli::run(&flags.args, command).await {
        eprintln!("keygate: {e:#}");
        std::process::exit(1);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let spans = init_logs(args.log_format)?;
            let settings = args.settings();
            let listener = tokio::net::TcpListener::bind(settings.listen)
                .await
                .with_context(|| format!("listening on {}", settings.listen))?;
            let token = CancellationToken::new();
            tokio::spawn(shutdown_signal(token.clone()));
            let outcome = keygate::run(settings, listener, token).await;
            if let Some(provider) = spans {
                // The batch exporter blocks while it sends what is left.
                let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            }
            if let Err(e) = outcome {
                eprintln!("keygate: {e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Openapi { output } => {
            let doc = keygate::http::openapi_json();
            match output {
                Some(path) => std::fs::write(&path, doc).with_context(|| format!("writing {}", path.display()))?,
                None => keygate::cli::render::write_stdout(doc.as_bytes())?,
            }
            Ok(())
        }
        Command::Static { flags, command } => admin(&flags, keygate::cli::AdminCommand::Static(command)).await,
        Command::Elastic { flags, command } => admin(&flags, keygate::cli::AdminCommand::Elastic(command)).await,
        Command::Streams { flags, command } => admin(&flags, keygate::cli::AdminCommand::Streams(command)).await,
        Command::Dlq { flags, command } => admin(&flags, keygate::cli::AdminCommand::Dlq(command)).await,
        Command::Healthcheck { listen, admin_listen } => healthcheck(admin_listen.unwrap_or(listen)).await,
    }
}
