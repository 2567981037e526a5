//! Liveness and readiness.

use std::time::Duration;

use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::extract::Json;
use crate::app::AppState;
use crate::http::problem::ApiError;

/// Readiness details.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `ready`.
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
        (status = 503, description = "not ready", body = crate::http::problem::Problem, content_type = "application/problem+json")
    )
)]
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Readiness>, ApiError> {
    if state.runtime.broker.client.connection_state() != async_nats::connection::State::Connected {
        return Err(ApiError::Unavailable("not ready: NATS is not connected".into()));
    }
    match tokio::time::timeout(Duration::from_secs(2), state.runtime.broker.js.query_account()).await {
        Ok(Ok(_)) => Ok(Json(Readiness { status: "ready".into(), nats_connected: true, jetstream: true })),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: JetStream account request failed");
            Err(ApiError::Unavailable("not ready: JetStream did not answer".into()))
        }
        Err(_) => Err(ApiError::Unavailable("not ready: JetStream did not answer within 2 s".into())),
    }
}
