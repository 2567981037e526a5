//! What the benchmarks share: a rig (a nats-server in a temporary store,
//! keygate in-process against it, a JetStream context and an HTTP client),
//! and the raw baseline consumer with its serial per-partition lanes.

use std::process::{Command, Stdio};
use std::time::Duration;

use keygate::nats::embedded::EmbeddedServer;
use keygate::Settings;
use tokio_util::sync::CancellationToken;

/// Where a benchmark's nats-server is, and the token it takes (keygate's
/// embedded server requires one).
#[derive(Clone, Debug)]
pub struct NatsEndpoint {
    pub url: String,
    pub token: Option<String>,
}

impl NatsEndpoint {
    /// A client connection.
    pub async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        let options = match &self.token {
            Some(token) => async_nats::ConnectOptions::with_token(token.clone()),
            None => async_nats::ConnectOptions::new(),
        };
        Ok(options.connect(self.url.as_str()).await?)
    }

    /// keygate's own settings for this server.
    pub fn settings(&self) -> Settings {
        let auth = keygate::nats::connect::NatsAuth { token: self.token.clone(), ..Default::default() };
        Settings {
            nats: keygate::config::NatsTarget::External { url: self.url.clone(), auth },
            ..Settings::for_nats_url(&self.url)
        }
    }

    /// `keygate serve` arguments (and environment) for this server.
    pub fn command(&self, command: &mut Command) {
        command.args(["--nats-url", &self.url]);
        if let Some(token) = &self.token {
            command.env("KEYGATE_NATS_TOKEN", token);
        }
    }
}

fn endpoint_of(server: &EmbeddedServer) -> NatsEndpoint {
    NatsEndpoint { url: server.url().to_owned(), token: Some(server.token().to_owned()) }
}

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

/// keygate as its own process (release build, errors-only logs), so its
/// memory is its own; killed when dropped.
pub struct KeygateProcess {
    child: std::process::Child,
    pub base: String,
}

impl KeygateProcess {
    pub fn start(nats: &NatsEndpoint) -> Self {
        Self::start_named(nats, None)
    }

    /// Started with `--instance-id` when `id` is given.
    pub fn start_named(nats: &NatsEndpoint, id: Option<&str>) -> Self {
        let port = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_keygate"));
        command.args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--backlog-sample-secs", "0"]);
        nats.command(&mut command);
        if let Some(id) = id {
            command.args(["--instance-id", id]);
        }
        let child = command.env("KEYGATE_LOG", "error").stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        Self { child, base: format!("http://127.0.0.1:{port}") }
    }

    /// Resident memory of the keygate process, in MiB.
    pub fn rss_mib(&self) -> f64 {
        self.status_field("VmRSS:") / 1024.0
    }

    /// OS threads of the keygate process.
    pub fn threads(&self) -> u64 {
        self.status_field("Threads:") as u64
    }

    /// Open file descriptors of the keygate process.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id())).map(|d| d.count()).unwrap_or(0)
    }

    fn status_field(&self, field: &str) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    pub async fn ready(&self, http: &reqwest::Client) {
        for _ in 0..400 {
            if http.get(format!("{}/readyz", self.base)).send().await.is_ok_and(|r| r.status() == 200) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("keygate did not become ready");
    }

    pub fn ws(&self, stream: &str, group: &str, member: &str) -> String {
        format!("{}/v1/streams/{stream}/groups/{group}/members/{member}/ws", self.base.replacen("http", "ws", 1))
    }
}

impl Drop for KeygateProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A nats-server with JetStream in a temporary store, for benchmarks that
/// run keygate as its own process.
pub struct LocalNats {
    server: EmbeddedServer,
    stop: CancellationToken,
    _store: tempfile::TempDir,
}

impl LocalNats {
    pub async fn start() -> anyhow::Result<Self> {
        let store = tempfile::tempdir()?;
        let stop = CancellationToken::new();
        let server = EmbeddedServer::start("nats-server".as_ref(), store.path(), 0, stop.clone()).await?;
        Ok(Self { server, stop, _store: store })
    }

    pub fn endpoint(&self) -> NatsEndpoint {
        endpoint_of(&self.server)
    }

    pub async fn stop(self) {
        self.stop.cancel();
        self.server.stopped().await;
    }
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
