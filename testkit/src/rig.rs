//! What the benchmarks share: a rig (a nats-server in a temporary store,
//! keygate in-process against it, a JetStream context and an HTTP client),
//! and the raw baseline consumer with its serial per-partition lanes.

use std::time::Duration;

use keygate::nats::embedded::EmbeddedServer;
use tokio_util::sync::CancellationToken;

use crate::nats::{endpoint_of, NatsEndpoint};

pub struct Rig {
    pub base: String,
    pub nats: NatsEndpoint,
    pub js: async_nats::jetstream::Context,
    pub http: reqwest::Client,
    server: EmbeddedServer,
    server_stop: CancellationToken,
    app: tokio::task::JoinHandle<anyhow::Result<()>>,
    app_stop: CancellationToken,
    _store: tempfile::TempDir,
}

impl Rig {
    /// Starts everything and waits until keygate is ready.
    pub async fn start() -> anyhow::Result<Self> {
        install_log_subscriber();
        // reqwest needs a TLS provider chosen before a client is built.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
        let store = tempfile::tempdir()?;
        let server_stop = CancellationToken::new();
        let server = EmbeddedServer::start("nats-server".as_ref(), store.path(), 0, server_stop.clone()).await?;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let base = format!("http://{}", listener.local_addr()?);
        let app_stop = CancellationToken::new();
        let endpoint = endpoint_of(&server);
        let app = tokio::spawn(keygate::run(endpoint.settings(), listener, app_stop.clone()));
        let js = keygate::nats::connect::jetstream(endpoint.connect().await?, Duration::from_secs(10));
        for _ in 0..200 {
            if http.get(format!("{base}/readyz")).send().await.is_ok_and(|r| r.status() == 200) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Ok(Self { base, nats: endpoint, js, http, server, server_stop, app, app_stop, _store: store })
    }

    /// Stops keygate, then the nats-server.
    pub async fn stop(self) {
        self.app_stop.cancel();
        let _ = self.app.await;
        self.server_stop.cancel();
        self.server.stopped().await;
    }
}

/// keygate in-process logs as its binary does, at `info` and with no
/// colour codes (its output is no terminal), to nowhere: what that level
/// records costs every request, as it does a user's keygate (a benchmark's
/// keygate process logs likewise: `KeygateProcess::for_bench`). Once per
/// process; `KEYGATE_BENCH_LOGS=0` leaves it out.
fn install_log_subscriber() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        if std::env::var("KEYGATE_BENCH_LOGS").is_ok_and(|v| v == "0") {
            return;
        }
        let filter = tracing_subscriber::EnvFilter::new("info");
        keygate::telemetry::install_subscriber(
            keygate::telemetry::LogFormat::Pretty,
            false,
            std::io::sink,
            filter,
            None,
        );
    });
}

/// The raw baseline's consumer: durable, explicit acks, and with
/// `member_filters` one `<p>.>` filter per partition, as a pcgroups member
/// owning every partition (the server's multi-filter delivery is the cost
/// both then pay); without, the whole stream.
pub async fn baseline_consumer(
    js: &async_nats::jetstream::Context,
    stream: &str,
    partitions: u32,
    member_filters: bool,
) -> async_nats::jetstream::consumer::PullConsumer {
    use async_nats::jetstream::consumer;
    js.get_stream(stream)
        .await
        .unwrap()
        .create_consumer(consumer::pull::Config {
            durable_name: Some("raw".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 1000,
            filter_subjects: if member_filters {
                (0..partitions).map(|p| format!("{p}.>")).collect()
            } else {
                Vec::new()
            },
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Runs `handle` on each partition's messages one at a time (one lane per
/// partition, partitions concurrent), as an ordered consumer written by hand
/// would. Returns the pump, to abort when done.
pub async fn serial_lanes<F, Fut>(
    consumer: async_nats::jetstream::consumer::PullConsumer,
    partitions: u32,
    handle: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(async_nats::jetstream::Message) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    use futures::StreamExt;
    let mut lanes = Vec::new();
    for _ in 0..partitions {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<async_nats::jetstream::Message>(1024);
        let handle = handle.clone();
        tokio::spawn(async move {
            while let Some(message) = rx.recv().await {
                handle(message).await;
            }
        });
        lanes.push(tx);
    }
    let mut messages = consumer.messages().await.unwrap();
    tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            let partition: usize = message.subject.split('.').next().unwrap().parse().unwrap();
            if lanes[partition].send(message).await.is_err() {
                break;
            }
        }
    })
}

/// PUT `body` to `url`; panics unless the answer is 2xx.
pub async fn put(http: &reqwest::Client, url: String, body: serde_json::Value) {
    let r = http.put(&url).json(&body).send().await.unwrap();
    assert!(r.status().is_success(), "{url}: {}", r.text().await.unwrap());
}

/// The environment variable `name` parsed, or `default` when unset or unreadable.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
