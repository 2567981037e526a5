//! Wires state, the HTTP listener and background work under one shutdown
//! token.

use std::sync::Arc;

use std::future::IntoFuture as _;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{NatsTarget, Settings};
use crate::delivery::webhook::{WebhookClient, WebhookStore};
use crate::events::EventBus;
use crate::groups::GroupAdmin;
use crate::member::instance::InstanceContext;
use crate::nats::connect::{connect, jetstream};
use crate::nats::embedded::EmbeddedServer;
use crate::streams::Streams;

/// How long shutdown waits for running requests.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(20);

/// Cheap handles every request needs.
#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub nats: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub streams: Streams,
    pub groups: GroupAdmin,
    pub webhooks: WebhookStore,
    pub events: EventBus,
    /// Cancelled when keygate shuts down (ends long-lived responses).
    pub shutdown: CancellationToken,
}

impl AppState {
    /// State over an established NATS connection.
    pub fn new(settings: Settings, nats: async_nats::Client, shutdown: CancellationToken) -> Self {
        let js = jetstream(nats.clone(), settings.nats_timeout);
        let policy = Arc::new(settings.destinations.clone());
        Self {
            settings: Arc::new(settings),
            streams: Streams::new(js.clone()),
            groups: GroupAdmin::new(js.clone()),
            webhooks: WebhookStore::new(js.clone(), policy),
            events: EventBus::new(nats.clone()),
            nats,
            js,
            shutdown,
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
    let state = AppState::new(settings, nats.clone(), shutdown.clone());
    let instances = Arc::new(InstanceContext {
        js: state.js.clone(),
        nats: nats.clone(),
        events: state.events.clone(),
        webhooks: WebhookClient::new(Arc::new(state.settings.destinations.clone()))?,
        webhook_store: state.webhooks.clone(),
        groups: state.groups.clone(),
        instance_id: state
            .settings
            .instance_id
            .clone()
            .unwrap_or_else(|| format!("keygate-{}", nats.new_inbox().rsplit('.').next().unwrap_or("0"))),
        hold_cap: state.settings.hold_cap,
        shutdown_grace: state.settings.delivery_grace,
    });
    // Members wind down as soon as shutdown starts, beside the HTTP drain.
    let members_token = shutdown.child_token();
    let members = tokio::spawn(crate::member::supervisor::supervise(instances, members_token.clone()));
    let app = crate::http::router(state);
    tracing::info!(address = %listener.local_addr()?, "keygate listening");
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    tokio::select! {
        served = server.into_future() => served.context("serving HTTP")?,
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => tracing::warn!(grace = ?SHUTDOWN_GRACE, "requests still running at shutdown; stopping anyway"),
    }
    tracing::info!("shutting down");
    members_token.cancel();
    let _ = members.await;
    if let Err(e) = nats.drain().await {
        tracing::warn!(error = %e, "draining NATS");
    }
    server_token.cancel();
    if let Some(server) = embedded {
        server.stopped().await;
    }
    Ok(())
}
