//! Liveness and readiness.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use super::extract::Json;
use crate::app::AppState;

/// Readiness details.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `ready` or `not ready`.
    pub status: String,
    /// Whether the NATS connection is up.
    pub nats_connected: bool,
    /// Whether JetStream answered an account-info request.
    pub jetstream: bool,
}

/// The process is alive.
#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "alive", body = String)))]
pub async fn healthz() -> &'static str {
    "ok"
}

/// NATS is connected and JetStream answers.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "health",
    responses(
        (status = 200, description = "ready", body = Readiness),
        (status = 503, description = "not ready", body = Readiness)
    )
)]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Readiness>) {
    let nats_connected = state.nats.connection_state() == async_nats::connection::State::Connected;
    let jetstream = nats_connected
        && matches!(tokio::time::timeout(Duration::from_secs(2), state.js.query_account()).await, Ok(Ok(_)));
    let ready = nats_connected && jetstream;
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let text = if ready { "ready" } else { "not ready" };
    (status, Json(Readiness { status: text.into(), nats_connected, jetstream }))
}
