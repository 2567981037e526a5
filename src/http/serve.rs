//! The HTTP listener, bounded against clients that hold connections open:
//! hyper-util's connection builder with a timer, so hyper's header-read
//! timeout applies (`axum::serve` sets no timer, and a client sending half a
//! request line was never disconnected), a cap on open connections, and
//! graceful shutdown of the connections in progress.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// What one client may hold of the listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Longest time a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// Most connections open at once; further clients wait in the kernel's
    /// accept queue.
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `shutdown`, then lets the connections in
/// progress finish (the caller bounds how long).
pub async fn serve<S>(listener: TcpListener, app: S, limits: ConnectionLimits, shutdown: CancellationToken)
where
    S: tower::Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    // HTTP/1.1 only, as before (axum::serve without its http2 feature).
    let mut builder = Builder::new(TokioExecutor::new()).http1_only();
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: pause, do not spin.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        // Small frames and answers go out at once (WebSocket acks, single
        // publishes) instead of waiting on Nagle's algorithm.
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone().map_request(|r: Request<Incoming>| r.map(Body::new)));
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(tcp), service).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(permit);
        });
    }
    graceful.shutdown().await;
}
