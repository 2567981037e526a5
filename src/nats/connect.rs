//! Connecting to NATS with the configured credentials.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::watch;

/// Credentials for an external NATS.
#[derive(Clone, Default)]
pub struct NatsAuth {
    pub token: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub creds_file: Option<PathBuf>,
}

/// Shows which credentials are set, never their values.
impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuth")
            .field("token", &self.token.as_ref().map(|_| "(redacted)"))
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "(redacted)"))
            .field("creds_file", &self.creds_file)
            .finish()
    }
}

/// Connects to `url`, retrying in the background when the servers are not up
/// yet, so keygate starts and reports not-ready instead of exiting. The
/// receiver counts the connections made (one more at every reconnect):
/// what lives only as long as a connection, such as pulls waiting at the
/// server, is made again when it changes.
pub async fn connect(
    url: &str,
    auth: &NatsAuth,
    name: &str,
) -> anyhow::Result<(async_nats::Client, watch::Receiver<u64>)> {
    let (connections, counted) = watch::channel(0);
    let client = connect_with(url, auth, name, true, Some(connections)).await?;
    Ok((client, counted))
}

/// Connects once, failing when no server answers (for one-shot commands).
pub async fn connect_once(url: &str, auth: &NatsAuth) -> anyhow::Result<async_nats::Client> {
    connect_with(url, auth, "keygate", false, None).await
}

async fn connect_with(
    url: &str,
    auth: &NatsAuth,
    name: &str,
    retry_initial: bool,
    connections: Option<watch::Sender<u64>>,
) -> anyhow::Result<async_nats::Client> {
    let connections = Arc::new(connections);
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .request_timeout(Some(Duration::from_secs(5)))
        .read_buffer_capacity(8192)
        .event_callback(move |event| {
            let connections = connections.clone();
            async move {
                if let (async_nats::Event::Connected, Some(connections)) = (&event, connections.as_ref()) {
                    connections.send_modify(|n| *n += 1);
                }
                log_event(event);
            }
        });
    if retry_initial {
        options = options.retry_on_initial_connect();
    }
    if let Some(token) = &auth.token {
        options = options.token(token.clone());
    }
    if let (Some(user), Some(password)) = (&auth.user, &auth.password) {
        options = options.user_and_password(user.clone(), password.clone());
    }
    if let Some(path) = &auth.creds_file {
        options = options
            .credentials_file(path)
            .await
            .with_context(|| format!("reading NATS credentials file {}", path.display()))?;
    }
    let urls: Vec<async_nats::ServerAddr> = url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| u.parse().with_context(|| format!("invalid NATS URL {u:?}")))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(!urls.is_empty(), "no NATS URL given");
    options.connect(urls).await.context("connecting to NATS")
}

fn log_event(event: async_nats::Event) {
    match event {
        async_nats::Event::Connected => tracing::info!("connected to NATS"),
        async_nats::Event::Disconnected => tracing::warn!("disconnected from NATS"),
        other => tracing::debug!(event = %other, "NATS event"),
    }
}

/// A JetStream context sized for pipelined publishing.
pub fn jetstream(client: async_nats::Client, timeout: Duration) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(timeout)
        .max_ack_inflight(65_536)
        .backpressure_on_inflight(true)
        .build(client)
}
