//! The `keygate` command line: parses arguments and calls the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use keygate::cli::serve::ServeArgs;
use keygate::telemetry::LogFormat;
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

/// Logs to standard output, filtered by `KEYGATE_LOG`; spans also go to
/// OTLP when the `OTEL_*` variables ask for it (the provider returned, to
/// be flushed at exit).
fn init_logs(format: LogFormat) -> anyhow::Result<Option<opentelemetry_sdk::trace::SdkTracerProvider>> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KEYGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only for a terminal: redirected logs stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let provider = keygate::telemetry::otlp_provider()?;
    keygate::telemetry::install_subscriber(format, ansi, std::io::stdout, filter, provider.as_ref());
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
