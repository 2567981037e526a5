//! `/v1/streams`: create, inspect, list and delete streams.

use axum::extract::State;
use axum::http::StatusCode;

use super::extract::{Json, Path, Query};
use crate::app::AppState;
use crate::http::problem::{ApiError, Problem};
use crate::names::StreamName;
use crate::streams::{StreamPutOutcome, StreamSpec, StreamView};

/// Creates a stream (201), or confirms an identical one exists (200).
///
/// With `partitions`, every message is stamped with its key's partition by
/// the server's subject transform (`orders.*` is stored as
/// `<p>.orders.<key>`). A stream that exists with another configuration is a
/// 409: the partition count never changes.
#[utoipa::path(
    put,
    path = "/v1/streams/{stream}",
    tag = "streams",
    params(("stream" = String, Path, description = "Stream name")),
    request_body = StreamSpec,
    responses(
        (status = 201, description = "created", body = StreamView),
        (status = 200, description = "an identical stream exists", body = StreamView),
        (status = 400, description = "invalid", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "exists with another configuration", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "the server refused the configuration (storage or memory limits, more replicas than servers)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "NATS unavailable", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn put_stream(
    State(state): State<AppState>,
    Path(stream): Path<StreamName>,
    Json(spec): Json<StreamSpec>,
) -> Result<(StatusCode, Json<StreamView>), ApiError> {
    let (outcome, view) = state.runtime.stores.streams.put(&stream, &spec).await?;
    let status = match outcome {
        StreamPutOutcome::Created => StatusCode::CREATED,
        StreamPutOutcome::Unchanged => StatusCode::OK,
    };
    Ok((status, Json(view)))
}

/// A stream's configuration, partition count and message counts.
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}",
    tag = "streams",
    params(("stream" = String, Path, description = "Stream name")),
    responses(
        (status = 200, description = "the stream", body = StreamView),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn get_stream(
    State(state): State<AppState>,
    Path(stream): Path<StreamName>,
) -> Result<Json<StreamView>, ApiError> {
    Ok(Json(state.runtime.stores.streams.get(&stream).await?))
}

/// Whether deleting a stream also deletes its groups.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeleteQuery {
    /// Also delete the groups configured over the stream (their
    /// configurations, consumers and work-queue streams).
    #[serde(default)]
    pub cascade: bool,
}

/// Deletes a stream and every message in it. A stream with groups is a 409
/// unless `cascade=true`, which deletes the groups first.
#[utoipa::path(
    delete,
    path = "/v1/streams/{stream}",
    tag = "streams",
    params(("stream" = String, Path, description = "Stream name"), DeleteQuery),
    responses(
        (status = 204, description = "deleted"),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "groups are configured over the stream", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_stream(
    State(state): State<AppState>,
    Path(stream): Path<StreamName>,
    Query(query): Query<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    let groups = match state.runtime.stores.groups.list(&stream).await {
        Ok(groups) => groups,
        Err(e) if e.class() == crate::error::Class::NotFound => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    if !groups.is_empty() && !query.cascade {
        let names: Vec<String> = groups.iter().map(|g| format!("{} ({})", g.group, g.kind.as_str())).collect();
        return Err(ApiError::Conflict(format!(
            "groups are configured over stream {stream}: {}; delete them first, or pass cascade=true",
            names.join(", ")
        )));
    }
    for g in &groups {
        let name = crate::names::GroupName::parse(&g.group)?;
        state.runtime.stores.groups.delete(&stream, &name, Some(g.kind)).await?;
    }
    state.runtime.stores.streams.delete(&stream).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Include the streams behind KV buckets and object stores.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Also list `KV_*` and `OBJ_*` streams (as `nats stream ls --all`).
    #[serde(default)]
    pub all: bool,
}

/// Every stream on the server (without KV and object-store streams unless `all=true`).
#[utoipa::path(
    get,
    path = "/v1/streams",
    tag = "streams",
    params(ListQuery),
    responses((status = 200, description = "streams by name", body = Vec<StreamView>))
)]
pub async fn list_streams(
    State(state): State<AppState>,
    Query(query): Query<ListQuery>,
) -> Result<Json<Vec<StreamView>>, ApiError> {
    Ok(Json(state.runtime.stores.streams.list(query.all).await?))
}
