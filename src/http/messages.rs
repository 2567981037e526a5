//! `/v1/streams/{stream}/messages`: keyed publishing.

use axum::extract::State;
use axum::http::HeaderMap;

use super::extract::{Json, Path};
use crate::app::AppState;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::Error;
use crate::http::problem::{ApiError, Problem};
use crate::names::StreamName;
use crate::publish::{self, BatchRequest, PublishAck, PublishRequest};
use crate::streams::StreamShape;

/// One item of a batch answer: the ack or the problem.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(untagged)]
pub enum BatchItem {
    Ok(PublishAck),
    Err { error: Problem },
}

/// Answers to a batch, in request order.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BatchResponse {
    pub results: Vec<BatchItem>,
}

fn record(stream: &StreamName, results: &[Result<PublishAck, Error>], kind: &'static str, started: std::time::Instant) {
    use crate::metrics::{PUBLISHED, PUBLISH_SECONDS};
    // One increment per outcome and request, not per message.
    let mut counts = [0u64; 3];
    for result in results {
        counts[match result {
            Ok(ack) if ack.duplicate => 1,
            Ok(_) => 0,
            Err(_) => 2,
        }] += 1;
    }
    for (outcome, count) in ["stored", "duplicate", "error"].into_iter().zip(counts) {
        if count > 0 {
            metrics::counter!(PUBLISHED, "stream" => stream.to_string(), "outcome" => outcome).increment(count);
        }
    }
    metrics::histogram!(PUBLISH_SECONDS, "kind" => kind).record(started.elapsed().as_secs_f64());
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    match headers.get("idempotency-key") {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim().to_owned()))
            .map_err(|_| ApiError::BadRequest("the Idempotency-Key header must be visible ASCII".into())),
    }
}

/// Publishes one keyed message; answers after JetStream has stored it.
///
/// The key fills the `*` of the stream's subject (keys that are not valid
/// subject tokens are escaped reversibly). Without a key, messages are spread
/// round-robin over the partitions. `Idempotency-Key` is the same as `msg_id`.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/messages",
    tag = "messages",
    params(
        ("stream" = String, Path, description = "Stream name"),
        ("Idempotency-Key" = Option<String>, Header, description = "De-duplication id (same as msg_id)")
    ),
    request_body = PublishRequest,
    responses(
        (status = 200, description = "stored (or a duplicate of a stored message)", body = PublishAck),
        (status = 400, description = "invalid message", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "larger than the server's max_payload", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "NATS unavailable", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn publish_message(
    State(state): State<AppState>,
    Path(stream): Path<StreamName>,
    headers: HeaderMap,
    Json(request): Json<PublishRequest>,
) -> Result<Json<PublishAck>, ApiError> {
    let started = std::time::Instant::now();
    let key = idempotency_key(&headers)?;
    let shape = publishable_shape(&state, &stream).await?;
    let prepared = publish::prepare(&shape, request, key.as_deref(), state.max_payload());
    let results = publish::publish_all(&state.js, &shape, vec![prepared]).await;
    record(&stream, &results, "single", started);
    let mut results = results;
    results.pop().unwrap_or_else(|| Err(Error::Internal("no publish result".into()))).map(Json).map_err(ApiError::from)
}

/// Publishes several messages with all acks in flight at once; answers each
/// in order. One failing message does not fail the others.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/messages/batch",
    tag = "messages",
    params(("stream" = String, Path, description = "Stream name")),
    request_body = BatchRequest,
    responses(
        (status = 200, description = "one result per message, in order", body = BatchResponse),
        (status = 400, description = "invalid batch", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "too many messages", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn publish_batch(
    State(state): State<AppState>,
    Path(stream): Path<StreamName>,
    Json(batch): Json<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let limit = state.settings.max_batch_messages;
    if batch.messages.is_empty() {
        return Err(ApiError::BadRequest("messages must hold at least one message".into()));
    }
    if batch.messages.len() > limit {
        return Err(ApiError::PayloadTooLarge(format!(
            "the batch has {} messages; at most {limit} are accepted",
            batch.messages.len()
        )));
    }
    let shape = publishable_shape(&state, &stream).await?;
    let max_payload = state.max_payload();
    if batch.atomic {
        let mut prepared = Vec::with_capacity(batch.messages.len());
        for (i, message) in batch.messages.into_iter().enumerate() {
            let item =
                publish::prepare(&shape, message, None, max_payload).map_err(|e| e.refusing_in_atomic_batch(i))?;
            prepared.push(item);
        }
        let started = std::time::Instant::now();
        let acks = publish::publish_atomic(&state.nats, &shape, prepared).await;
        let results: Vec<Result<PublishAck, Error>> = match acks {
            Ok(acks) => acks.into_iter().map(Ok).collect(),
            Err(e) => {
                record(&stream, &[Err(e.clone())], "atomic", started);
                return Err(e.into());
            }
        };
        record(&stream, &results, "atomic", started);
        let results = results.into_iter().filter_map(Result::ok).map(BatchItem::Ok).collect();
        return Ok(Json(BatchResponse { results }));
    }
    let prepared = batch.messages.into_iter().map(|m| publish::prepare(&shape, m, None, max_payload)).collect();
    let started = std::time::Instant::now();
    let results = publish::publish_all(&state.js, &shape, prepared).await;
    record(&stream, &results, "batch", started);
    let results = results
        .into_iter()
        .map(|r| match r {
            Ok(ack) => BatchItem::Ok(ack),
            Err(e) => BatchItem::Err { error: ApiError::from(e).problem() },
        })
        .collect();
    Ok(Json(BatchResponse { results }))
}

/// The stream's shape, once its name is known not to be reserved (refused
/// before the lookup, whether or not such a stream exists).
async fn publishable_shape(state: &AppState, stream: &StreamName) -> Result<std::sync::Arc<StreamShape>, Error> {
    if let Some(why) = publish::reserved_stream_name(stream.as_str()) {
        return Err(Error::Reserved(why));
    }
    state.streams.shape(stream).await
}
