//! `POST …/groups/{group}/seek` and `POST …/consumers/{consumer}/seek`:
//! replay from a time or sequence, or skip to the end (src/seek.rs).

use axum::extract::State;

use super::extract::{Json, Path};
use crate::app::AppState;
use crate::http::problem::{ApiError, Problem};
use crate::names::{ConsumerName, GroupName, StreamName};
use crate::seek::{SeekAnswer, SeekRequest};

/// Makes a static group's members start again at a time, a sequence or the
/// end of the stream. Safe while they are served: each member is paused on
/// every replica (deliveries in flight finish), its consumer made again at
/// the new start, and resumed; each key's order runs again from there. On a
/// limits stream only what is still stored is replayed (`before_first`).
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/seek",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path)),
    request_body = SeekRequest,
    responses(
        (status = 200, description = "the members start at the new position", body = SeekAnswer),
        (status = 404, description = "unknown stream or group", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "an elastic group (its work queue keeps nothing to go back to)", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn seek_group(
    State(state): State<AppState>,
    Path((stream, group)): Path<(StreamName, GroupName)>,
    Json(request): Json<SeekRequest>,
) -> Result<Json<SeekAnswer>, ApiError> {
    Ok(Json(
        crate::seek::seek_group(
            &state.runtime.stores.groups,
            &state.runtime.stores.pauses,
            &state.runtime.broker.js,
            &stream,
            &group,
            request.to,
        )
        .await?,
    ))
}

/// Makes a plain consumer start again at a time, a sequence or the end of
/// the stream, keeping its configuration.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/consumers/{consumer}/seek",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path)),
    request_body = SeekRequest,
    responses(
        (status = 200, description = "the consumer starts at the new position", body = SeekAnswer),
        (status = 404, description = "unknown stream or consumer", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "a group member's consumer: seek the group", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn seek_consumer(
    State(state): State<AppState>,
    Path((stream, consumer)): Path<(StreamName, ConsumerName)>,
    Json(request): Json<SeekRequest>,
) -> Result<Json<SeekAnswer>, ApiError> {
    Ok(Json(crate::seek::seek_consumer(&state.runtime.broker.js, &stream, &consumer, request.to).await?))
}
