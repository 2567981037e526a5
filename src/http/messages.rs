//! `/v1/streams/{stream}/messages`: keyed publishing.

use std::collections::BTreeMap;

use axum::extract::{FromRequest, Request, State};
use axum::http::HeaderMap;
use bytes::Bytes;
use tracing::Instrument;

use super::extract::{Json, Path, Query};
use crate::app::AppState;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::cloudevents;
use crate::http::problem::{ApiError, Problem};
use crate::names::StreamName;
use crate::publish::{self, BatchRequest, HeaderValues, PublishAck, PublishRequest};
use crate::publish::{PublishError as Error, PublishErrorKind};
use crate::streams::StreamShape;
use crate::telemetry::TraceContext;

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
    use crate::telemetry::metrics::{count_published, time_publish};
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
            count_published(stream.as_str(), outcome, count);
        }
    }
    time_publish(kind, started.elapsed().as_secs_f64());
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    const IDEMPOTENCY_KEY: axum::http::HeaderName = axum::http::HeaderName::from_static("idempotency-key");
    match headers.get(IDEMPOTENCY_KEY) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim().to_owned()))
            .map_err(|_| ApiError::BadRequest("the Idempotency-Key header must be visible ASCII".into())),
    }
}

/// A CloudEvent in structured mode (the CloudEvents 1.0 JSON format), as
/// `POST …/messages` takes it with `Content-Type: application/cloudevents+json`.
/// Its other members are extension attributes (names of a-z and 0-9, at
/// most 20), such as `partitionkey`, the key.
#[derive(ToSchema)]
#[allow(dead_code)] // the document's schema: the handler reads the event with `cloudevents::parse_structured`
pub struct CloudEvent {
    #[schema(example = "1.0", pattern = "^1\\.0$")]
    specversion: String,
    #[schema(min_length = 1, max_length = 4096)]
    id: String,
    #[schema(min_length = 1, max_length = 4096, example = "/orders")]
    source: String,
    #[schema(rename = "type", min_length = 1, max_length = 4096, example = "order.created")]
    event_type: String,
    datacontenttype: Option<String>,
    dataschema: Option<String>,
    subject: Option<String>,
    #[schema(format = DateTime)]
    time: Option<String>,
    /// The key, unless `?key=` is given.
    partitionkey: Option<String>,
    /// The data as JSON (a string with a non-JSON `datacontenttype` is the data itself).
    #[schema(value_type = Option<serde_json::Value>)]
    data: Option<serde_json::Value>,
    /// Or the data as base64 bytes.
    data_base64: Option<String>,
    #[serde(flatten)]
    extensions: BTreeMap<String, ExtensionAttribute>,
}

/// An extension attribute's value.
#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub enum ExtensionAttribute {
    Text(String),
    Integer(i64),
    Boolean(bool),
}

/// `?key=` of a CloudEvents publish.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventKey {
    /// CloudEvents only: the key, in place of the event's `partitionkey`.
    pub key: Option<String>,
}

/// Publishes one keyed message; answers after JetStream has stored it.
///
/// The key fills the `*` of the stream's subject (keys that are not valid
/// subject tokens are escaped reversibly). Without a key, messages are spread
/// round-robin over the partitions. `Idempotency-Key` is the same as `msg_id`.
///
/// A CloudEvent is published as it is: in structured mode
/// (`Content-Type: application/cloudevents+json`) or in binary mode
/// (`ce-specversion`, `ce-id`, `ce-source`, `ce-type` and other `ce-*`
/// headers, the body as the data). Its data becomes the payload, its
/// attributes the message's `ce-*` headers, and its key is `?key=` or else
/// its `partitionkey`.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/messages",
    tag = "messages",
    params(
        ("stream" = String, Path, description = "Stream name"),
        ("Idempotency-Key" = Option<String>, Header, description = "De-duplication id (same as msg_id)"),
        EventKey
    ),
    request_body(content(
        (PublishRequest = "application/json"),
        (CloudEvent = "application/cloudevents+json")
    )),
    responses(
        (status = 200, description = "stored (or a duplicate of a stored message)", body = PublishAck),
        (status = 400, description = "invalid message", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "larger than the server's max_payload", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "neither JSON nor a CloudEvent", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "NATS unavailable", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn publish_message(
    State(state): State<AppState>,
    Path(stream): Path<StreamName>,
    Query(query): Query<EventKey>,
    request: Request,
) -> Result<Json<PublishAck>, ApiError> {
    let started = std::time::Instant::now();
    let headers = request.headers();
    let idempotency = idempotency_key(headers)?;
    // Log lines of the work carry the request span (src/http/mod.rs).
    let span = crate::telemetry::export_span!("publish", stream = %stream, messages = 1);
    let trace = carried_trace(&span, headers);
    let structured = cloudevents::is_structured(headers);
    let mut request = if structured || cloudevents::is_binary(headers) {
        let headers = headers.clone();
        let body = Bytes::from_request(request, &state).await?;
        let event = match structured {
            true => cloudevents::parse_structured(&body),
            false => cloudevents::parse_binary(&headers, body.to_vec()),
        };
        event_request(event.map_err(|why| ApiError::BadRequest(format!("invalid CloudEvent: {why}")))?, query.key)
    } else if query.key.is_some() {
        return Err(ApiError::BadRequest("?key= is for CloudEvents; a JSON message gives its key in the body".into()));
    } else {
        Json::<PublishRequest>::from_request(request, &state).await?.0
    };
    if let Some(trace) = trace {
        request.carry(&trace);
    }
    async {
        let shape = publishable_shape(&state, &stream).await?;
        let prepared = publish::prepare(&shape, request, idempotency.as_deref(), state.runtime.max_payload());
        let result = publish::publish_one(&state.runtime.broker.js, &shape, prepared).await;
        record(&stream, std::slice::from_ref(&result), "single", started);
        result.map(Json).map_err(ApiError::from)
    }
    .instrument(span)
    .await
}

/// The trace context stored with published messages: keygate's publish
/// span when spans are exported, else the caller's own, passed through.
fn carried_trace(span: &tracing::Span, headers: &HeaderMap) -> Option<TraceContext> {
    TraceContext::of_span(span).or_else(|| TraceContext::from_http(headers))
}

/// The message a CloudEvent is published as.
fn event_request(event: cloudevents::Event, key: Option<String>) -> PublishRequest {
    let key = key.or_else(|| event.partition_key().map(str::to_owned));
    let headers = event.headers().map(|(name, value)| (name, HeaderValues::One(value))).collect();
    let (data, data_base64) = match event.data {
        cloudevents::Data::None => (None, None),
        cloudevents::Data::Json(json) => (Some(json), None),
        cloudevents::Data::Bytes(bytes) => {
            (None, Some(base64::Engine::encode(&base64::engine::general_purpose::STANDARD, bytes)))
        }
    };
    PublishRequest {
        key,
        subject: None,
        data,
        data_base64,
        content_type: event.content_type,
        headers: Some(headers),
        msg_id: None,
        spread: None,
    }
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
    headers: HeaderMap,
    Json(mut batch): Json<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let span = crate::telemetry::export_span!("publish", stream = %stream, messages = batch.messages.len());
    if let Some(trace) = carried_trace(&span, &headers) {
        batch.messages.iter_mut().for_each(|message| message.carry(&trace));
    }
    store_batch(state, stream, batch).instrument(span).await
}

async fn store_batch(
    state: AppState,
    stream: StreamName,
    batch: BatchRequest,
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
    let max_payload = state.runtime.max_payload();
    if batch.atomic {
        let mut prepared = Vec::with_capacity(batch.messages.len());
        for (i, message) in batch.messages.into_iter().enumerate() {
            let item =
                publish::prepare(&shape, message, None, max_payload).map_err(|e| e.refusing_in_atomic_batch(i))?;
            prepared.push(item);
        }
        let started = std::time::Instant::now();
        let acks = publish::publish_atomic(&state.runtime.broker.client, &shape, prepared).await;
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
    let broker = &state.runtime.broker;
    let results = publish::publish_batch(&broker.js, &broker.run_slots, &shape, prepared).await;
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
    if let Some(why) = crate::streams::reserved_stream_name(stream.as_str()) {
        return Err(Error::new(PublishErrorKind::Reserved, why));
    }
    Ok(state.runtime.stores.streams.shape(stream).await?)
}
