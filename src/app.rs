//! Wires state, the HTTP listener and background work under one shutdown
//! token.

use std::sync::Arc;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{NatsTarget, Settings};
use crate::groups::GroupAdmin;
use crate::nats::connect::{connect, jetstream};
use crate::nats::embedded::EmbeddedServer;
use crate::streams::Streams;

/// Cheap handles every request needs.
#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub nats: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub streams: Streams,
    pub groups: GroupAdmin,
}

impl AppState {
    /// State over an established NATS connection.
    pub fn new(settings: Settings, nats: async_nats::Client) -> Self {
        let js = jetstream(nats.clone(), settings.nats_timeout);
        Self {
            settings: Arc::new(settings),
            streams: Streams::new(js.clone()),
            groups: GroupAdmin::new(js.clone()),
            nats,
            js,
        }
    }

    /// The largest message the server accepts.
    pub fn max_payload(&self) -> usize {
        match self.nats.server_info().max_payload {
            0 => 1024 * 1024,
            n => n,
        }
    }
}

/// Runs keygate on `listener` until `shutdown` is cancelled: starts the
/// embedded nats-server when no URL is configured, connects, serves HTTP,
/// and on shutdown drains NATS and stops the embedded server.
pub async fn run(settings: Settings, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
    let server_token = CancellationToken::new();
    let (embedded, url, auth) = match &settings.nats {
        NatsTarget::External { url, auth } => (None, url.clone(), auth.clone()),
        NatsTarget::Embedded { binary, store_dir, port } => {
            let server = EmbeddedServer::start(binary, store_dir, *port, server_token.clone()).await?;
            let url = server.url().to_owned();
            (Some(server), url, Default::default())
        }
    };
    let nats = connect(&url, &auth).await?;
    let state = AppState::new(settings, nats.clone());
    let app = crate::http::router(state);
    tracing::info!(address = %listener.local_addr()?, "keygate listening");
    axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await.context("serving HTTP")?;
    tracing::info!("shutting down");
    if let Err(e) = nats.drain().await {
        tracing::warn!(error = %e, "draining NATS");
    }
    server_token.cancel();
    if let Some(server) = embedded {
        server.stopped().await;
    }
    Ok(())
}
