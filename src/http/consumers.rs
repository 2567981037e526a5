//! `/v1/streams/{stream}/consumers`: plain consumers with a priority-group
//! policy (overflow, pinned client, prioritized) for work that needs no
//! key order.

use axum::extract::State;
use axum::http::StatusCode;

use super::extract::{Json, Path};
use crate::app::AppState;
use crate::consumers::{ConsumerPutOutcome, ConsumerSpec, ConsumerView};
use crate::error::{ApiError, Problem};
use crate::names::{ConsumerName, StreamName};

/// Creates (201) or updates (200) a durable pull consumer with a policy.
/// Refused configurations change nothing.
#[utoipa::path(
    put,
    path = "/v1/streams/{stream}/consumers/{consumer}",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path)),
    request_body = ConsumerSpec,
    responses(
        (status = 201, description = "created", body = ConsumerView),
        (status = 200, description = "unchanged or updated", body = ConsumerView),
        (status = 400, description = "invalid", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "a group member's consumer", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "the server refused the configuration", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn put_consumer(
    State(state): State<AppState>,
    Path((stream, consumer)): Path<(StreamName, ConsumerName)>,
    Json(spec): Json<ConsumerSpec>,
) -> Result<(StatusCode, Json<ConsumerView>), ApiError> {
    let (outcome, view) = state.consumers.put(&stream, &consumer, spec).await?;
    let status = if outcome == ConsumerPutOutcome::Created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(view)))
}

/// A consumer: configuration, who is pinned since when, backlog, waiting pulls.
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}/consumers/{consumer}",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path)),
    responses(
        (status = 200, description = "the consumer", body = ConsumerView),
        (status = 404, description = "unknown stream or consumer", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn get_consumer(
    State(state): State<AppState>,
    Path((stream, consumer)): Path<(StreamName, ConsumerName)>,
) -> Result<Json<ConsumerView>, ApiError> {
    Ok(Json(state.consumers.get(&stream, &consumer).await?))
}

/// Deletes a consumer.
#[utoipa::path(
    delete,
    path = "/v1/streams/{stream}/consumers/{consumer}",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path)),
    responses(
        (status = 204, description = "deleted"),
        (status = 404, description = "unknown stream or consumer", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "a group member's consumer", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_consumer(
    State(state): State<AppState>,
    Path((stream, consumer)): Path<(StreamName, ConsumerName)>,
) -> Result<StatusCode, ApiError> {
    state.consumers.delete(&stream, &consumer).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Unpins the pinned client of a `pinned_client` consumer; the next pull
/// of the group is pinned instead.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/consumers/{consumer}/unpin",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path)),
    responses(
        (status = 200, description = "unpinned", body = ConsumerView),
        (status = 404, description = "unknown stream or consumer", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "not a pinned_client consumer", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn unpin_consumer(
    State(state): State<AppState>,
    Path((stream, consumer)): Path<(StreamName, ConsumerName)>,
) -> Result<Json<ConsumerView>, ApiError> {
    Ok(Json(state.consumers.unpin(&stream, &consumer).await?))
}
