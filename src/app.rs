//! Wires state, the HTTP listener and background work under one shutdown
//! token.

use std::sync::Arc;
use std::time::Duration;

use std::future::IntoFuture as _;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::auth::Verifier;
use crate::nats::connect::connect;
use crate::nats::embedded::EmbeddedServer;
use crate::runtime::pull_instances::PullInstances;
use crate::runtime::Runtime;
use crate::settings::{NatsTarget, Settings};

/// How long shutdown waits for running requests.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(20);

/// What every request may use, behind one `Arc`: axum clones the state
/// for each middleware and handler of a request, and a clone of the parts
/// themselves (NATS clients, JetStream contexts) cost a fifth of a single
/// publish's CPU in a profile (BENCHMARKS.md, publishing).
#[derive(Clone)]
pub struct AppState(Arc<AppStateInner>);

impl std::ops::Deref for AppState {
    type Target = AppStateInner;

    fn deref(&self) -> &AppStateInner {
        &self.0
    }
}

/// The handles behind [`AppState`].
pub struct AppStateInner {
    pub settings: Arc<Settings>,
    /// What keygate runs on: NATS, its stores, the cluster (src/runtime/mod.rs).
    pub runtime: Arc<Runtime>,
    pub consumers: crate::consumers::Consumers,
    /// WebSocket member connections, awaited at shutdown.
    pub connections: tokio_util::task::TaskTracker,
    /// Pull clients' instances on this replica.
    pub pulls: PullInstances,
    /// WebSocket connections open per member or subscriber, capped.
    pub sockets_per_member: crate::http::ws::SocketCounts,
    /// Verifies bearer tokens; `None` runs the API open.
    pub verifier: Option<Arc<Verifier>>,
    /// Cancelled when keygate shuts down (ends long-lived responses).
    pub shutdown: CancellationToken,
}

/// Runs keygate on `listener` until `shutdown` is cancelled: starts the
/// embedded nats-server when no URL is configured, connects, serves HTTP,
/// and on shutdown drains NATS and stops the embedded server.
pub async fn run(settings: Settings, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
    let verifier = Verifier::load(&settings.auth).context("loading the authentication keys")?;
    // Installed before any task takes a metric handle (one taken earlier records nowhere).
    crate::telemetry::metrics::handle();
    let address = listener.local_addr()?;
    if verifier.is_none() {
        refuse_open_public_listener(address, settings.allow_unauthenticated)?;
    }
    let admin_listener = match settings.admin_listen {
        Some(admin) => Some(TcpListener::bind(admin).await.with_context(|| format!("listening (admin) on {admin}"))?),
        None => None,
    };
    let server_token = CancellationToken::new();
    let (embedded, url, auth) = match &settings.nats {
        NatsTarget::External { url, auth } => (None, url.clone(), auth.clone()),
        NatsTarget::Embedded { binary, store_dir, port } => {
            let server = EmbeddedServer::start(binary, store_dir, *port, server_token.clone()).await?;
            let url = server.url().to_owned();
            let auth = crate::nats::connect::NatsAuth { token: Some(server.token().to_owned()), ..Default::default() };
            (Some(server), url, auth)
        }
    };
    // The server's connection list (connz) then tells replicas apart.
    let connection_name =
        settings.instance_id.as_ref().map_or_else(|| "keygate".to_owned(), |id| format!("keygate {id}"));
    let (nats, connections) = connect(&url, &auth, &connection_name).await?;
    let runtime = Arc::new(Runtime::start(&settings, nats.clone(), connections)?);
    let connections = tokio_util::task::TaskTracker::new();
    // Pull instances finish like WebSocket connections: after the HTTP drain.
    let pulls =
        PullInstances::start(runtime.clone(), settings.pull_max_instances, connections.clone(), shutdown.child_token())
            .await?;
    let state = AppState(Arc::new(AppStateInner {
        consumers: crate::consumers::Consumers::new(runtime.broker.js.clone(), runtime.stores.groups.clone()),
        settings: Arc::new(settings),
        runtime: runtime.clone(),
        connections,
        pulls,
        sockets_per_member: Default::default(),
        verifier: verifier.map(Arc::new),
        shutdown: shutdown.clone(),
    }));
    // Members wind down as soon as shutdown starts, beside the HTTP drain.
    let members_token = shutdown.child_token();
    // Replicas know each other and share the webhook members' pins.
    let replicas = tokio::spawn(runtime.cluster.replicas.clone().run(
        runtime.broker.buckets.clone(),
        runtime.cluster.instance_id.clone(),
        runtime.cluster.roster.clone(),
        members_token.clone(),
    ));
    let balancer = tokio::spawn(crate::cluster::rebalance::run_balancer(
        runtime.cluster.clone(),
        nats.clone(),
        members_token.clone(),
    ));
    // One replica of the cluster samples and watches for all (src/cluster/lease.rs).
    let holder = runtime.cluster.instance_id.clone();
    let members = tokio::spawn(crate::runtime::supervisor::supervise(runtime.clone(), members_token.clone()));
    let backlog = state.settings.backlog_sample_interval.map(|every| {
        let (groups, nats) = (runtime.stores.groups.clone(), nats.clone());
        tokio::spawn(crate::cluster::lease::run_as_singleton(
            runtime.broker.buckets.clone(),
            "backlog-sampler",
            holder.clone(),
            members_token.clone(),
            move |cancel| crate::status::backlog::sample_backlog(groups.clone(), nats.clone(), every, cancel),
        ))
    });
    let (groups, js) = (runtime.stores.groups.clone(), runtime.broker.js.clone());
    let source_watch = tokio::spawn(crate::cluster::lease::run_as_singleton(
        runtime.broker.buckets.clone(),
        "source-watchdog",
        holder,
        members_token.clone(),
        move |cancel| crate::groups::source_watch::watch_sources(groups.clone(), js.clone(), cancel),
    ));
    let admin = admin_listener.map(|admin_listener| {
        let app = crate::http::admin_router(state.clone());
        if let Ok(address) = admin_listener.local_addr() {
            tracing::info!(%address, "keygate admin listening (/healthz, /readyz, /metrics)");
        }
        tokio::spawn(
            axum::serve(admin_listener, app).with_graceful_shutdown(shutdown.clone().cancelled_owned()).into_future(),
        )
    });
    let connections = state.connections.clone();
    let grace = state.settings.delivery_grace;
    let limits = crate::http::serve::ConnectionLimits {
        header_read_timeout: state.settings.header_read_timeout,
        max_connections: state.settings.max_connections,
    };
    let app = crate::http::router(state);
    tracing::info!(%address, "keygate listening");
    let server = crate::http::serve::serve(listener, app, limits, shutdown.clone());
    tokio::select! {
        () = server => {}
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => tracing::warn!(grace = ?SHUTDOWN_GRACE, "requests still running at shutdown; stopping anyway"),
    }
    tracing::info!("shutting down");
    if let Some(admin) = admin {
        admin.abort();
    }
    members_token.cancel();
    let _ = members.await;
    // axum does not wait for upgraded connections: WebSocket members finish
    // their deliveries and get a Close frame before NATS is drained.
    connections.close();
    if tokio::time::timeout(grace + Duration::from_secs(2), connections.wait()).await.is_err() {
        tracing::warn!("WebSocket connections still open at shutdown; closing anyway");
    }
    if let Some(backlog) = backlog {
        let _ = backlog.await;
    }
    let _ = source_watch.await;
    let _ = balancer.await;
    let _ = replicas.await;
    if let Err(e) = nats.drain().await {
        tracing::warn!(error = %e, "draining NATS");
    }
    server_token.cancel();
    if let Some(server) = embedded {
        server.stopped().await;
    }
    Ok(())
}

/// Without keys keygate runs open: said loudly on loopback, refused
/// elsewhere unless explicitly allowed.
fn refuse_open_public_listener(address: std::net::SocketAddr, allowed: bool) -> anyhow::Result<()> {
    if address.ip().is_loopback() {
        tracing::warn!(
            %address,
            "AUTHENTICATION IS OFF: no verification keys are configured, so every request is allowed. \
             Fine on loopback for development; set KEYGATE_AUTH_HS256_SECRET, KEYGATE_AUTH_PUBLIC_KEY or \
             KEYGATE_AUTH_JWKS before exposing keygate."
        );
        return Ok(());
    }
    anyhow::ensure!(
        allowed,
        "refusing to serve {address} without authentication: configure a verification key \
         (--auth-hs256-secret, --auth-public-key or --auth-jwks), listen on loopback, \
         or pass --allow-unauthenticated"
    );
    tracing::warn!(%address, "AUTHENTICATION IS OFF on a non-loopback address (--allow-unauthenticated)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::refuse_open_public_listener;

    #[test]
    fn without_keys_only_loopback_or_an_explicit_opt_in_may_serve() {
        assert!(refuse_open_public_listener("127.0.0.1:8080".parse().unwrap(), false).is_ok());
        assert!(refuse_open_public_listener("[::1]:8080".parse().unwrap(), false).is_ok());
        let refused = refuse_open_public_listener("0.0.0.0:8080".parse().unwrap(), false).unwrap_err();
        assert!(refused.to_string().contains("--allow-unauthenticated"), "{refused}");
        assert!(refuse_open_public_listener("10.1.2.3:8080".parse().unwrap(), false).is_err());
        assert!(refuse_open_public_listener("0.0.0.0:8080".parse().unwrap(), true).is_ok());
    }
}
