//! `/v1/streams/{stream}/consumers`: plain consumers with a priority-group
//! policy (overflow, pinned client, prioritized) for work that needs no
//! key order.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;

use super::extract::{Json, OptionalJson, Path};
use crate::app::AppState;
use crate::consumers::{ConsumerPutOutcome, ConsumerSpec, ConsumerView, Policy};
use crate::http::problem::{ApiError, Problem};
use crate::names::{ConsumerName, MemberName, StreamName};
use crate::webhook::credentials::OutboundAuth;
use crate::webhook::{
    Backoff, BatchSpec, BreakerSpec, DeliveryFormat, Registration, RegistrationView, RotateSecret, SubscriberOptions,
    WebhookSpec,
};

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

/// Deletes a consumer and its webhook subscribers.
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
    // Its subscribers would otherwise look for it for ever.
    state.runtime.stores.consumer_webhooks.delete_prefixed(&format!("{stream}.{consumer}.")).await?;
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

/// A webhook subscriber as `PUT …/consumers/{consumer}/subscribers/{subscriber}/webhook` takes it.
#[derive(Debug, Clone, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubscriberSpec {
    /// Where messages are POSTed.
    #[schema(example = "http://127.0.0.1:9000/jobs")]
    pub url: String,
    /// Standard Webhooks signing secret; generated when omitted on creation and returned once.
    pub secret: Option<String>,
    pub timeout_ms: Option<u64>,
    pub max_attempts: Option<u64>,
    pub backoff: Option<Backoff>,
    /// `prioritized` consumers: 0 (served first) to 9 (default 0).
    pub priority: Option<u8>,
    /// `overflow` consumers: served only while at least this many messages wait.
    pub min_pending: Option<i64>,
    /// `overflow` consumers: served only while at least this many are un-acked.
    pub min_ack_pending: Option<i64>,
    /// Deliveries in flight at once, 1–256 (default 4).
    pub concurrency: Option<usize>,
    /// Endpoint protection and outbound auth, as for a member's webhook
    /// (`WebhookSpec`): the breaker pauses this subscriber on every replica.
    #[schema(minimum = 0.001, maximum = 100000)]
    pub max_rate: Option<f64>,
    #[schema(minimum = 1, maximum = 100000)]
    pub burst: Option<u32>,
    pub breaker: Option<BreakerSpec>,
    #[schema(max_items = 50)]
    pub retry_statuses: Option<Vec<u16>>,
    pub headers: Option<BTreeMap<String, String>>,
    pub auth: Option<OutboundAuth>,
    /// `cloudevents`: deliver in CloudEvents binary mode (default `raw`).
    pub format: Option<DeliveryFormat>,
    #[schema(min_length = 1, max_length = 256)]
    pub ce_type: Option<String>,
    /// Deliver in batches, as a member's webhook may.
    pub batch: Option<BatchSpec>,
    /// Streams the endpoint's answers may publish to, as a member's
    /// webhook may (docs/pipelines.md).
    #[schema(value_type = Option<Vec<String>>, max_items = 16)]
    pub outputs: Option<Vec<StreamName>>,
}

/// A consumer's webhook subscriber.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct SubscriberView {
    pub stream: String,
    pub consumer: String,
    pub subscriber: String,
    pub options: SubscriberOptions,
    #[serde(flatten)]
    pub registration: RegistrationView,
}

fn subscriber_view(
    stream: &StreamName,
    consumer: &ConsumerName,
    subscriber: &MemberName,
    r: Registration,
    secret: Option<String>,
) -> SubscriberView {
    let registration = RegistrationView::of(&r, secret);
    SubscriberView {
        stream: stream.to_string(),
        consumer: consumer.to_string(),
        subscriber: subscriber.to_string(),
        options: r.subscriber.unwrap_or(SubscriberOptions {
            priority: None,
            min_pending: None,
            min_ack_pending: None,
            concurrency: 1,
        }),
        registration,
    }
}

/// The pull options a subscriber (webhook or WebSocket) may use on a
/// consumer with `policy`.
pub fn pull_options(
    policy: Policy,
    priority: Option<u8>,
    min_pending: Option<i64>,
    min_ack_pending: Option<i64>,
    concurrency: Option<usize>,
) -> Result<SubscriberOptions, ApiError> {
    let bad = |m: &str| Err(ApiError::BadRequest(m.to_owned()));
    let concurrency = concurrency.unwrap_or(4);
    if !(1..=256).contains(&concurrency) {
        return bad("concurrency must be between 1 and 256");
    }
    if priority.is_some_and(|p| p > 9) {
        return bad("priority must be between 0 and 9");
    }
    if priority.is_some() && policy != Policy::Prioritized {
        return bad("priority applies to prioritized consumers only");
    }
    if (min_pending.is_some() || min_ack_pending.is_some()) && policy != Policy::Overflow {
        return bad("min_pending and min_ack_pending apply to overflow consumers only");
    }
    if min_pending.is_some_and(|n| n < 0) || min_ack_pending.is_some_and(|n| n < 0) {
        return bad("min_pending and min_ack_pending must not be negative");
    }
    Ok(SubscriberOptions {
        priority: priority.or((policy == Policy::Prioritized).then_some(0)),
        min_pending,
        min_ack_pending,
        concurrency,
    })
}

/// Registers (201) or replaces (200) the webhook subscribing to a consumer.
/// Every keygate replica runs it; the consumer's policy decides which pulls
/// the server serves (all, overflow only, the pinned one, the lowest priority).
#[utoipa::path(
    put,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/webhook",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    request_body = SubscriberSpec,
    responses(
        (status = 201, description = "registered", body = SubscriberView),
        (status = 200, description = "replaced", body = SubscriberView),
        (status = 400, description = "invalid", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream or consumer", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "a group member's consumer", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "destination not allowed", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn put_subscriber(
    State(state): State<AppState>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
    Json(spec): Json<SubscriberSpec>,
) -> Result<(StatusCode, Json<SubscriberView>), ApiError> {
    let current = state.consumers.subscribable(&stream, &consumer).await?;
    let options =
        pull_options(current.policy, spec.priority, spec.min_pending, spec.min_ack_pending, spec.concurrency)?;
    let webhook = WebhookSpec {
        url: spec.url,
        secret: spec.secret,
        timeout_ms: spec.timeout_ms,
        max_attempts: spec.max_attempts,
        backoff: spec.backoff,
        max_in_flight: None,
        max_rate: spec.max_rate,
        burst: spec.burst,
        breaker: spec.breaker,
        retry_statuses: spec.retry_statuses,
        headers: spec.headers,
        auth: spec.auth,
        format: spec.format,
        ce_type: spec.ce_type,
        batch: spec.batch,
        outputs: spec.outputs,
    };
    crate::http::webhooks::check_outputs(&state, caller.as_deref(), &webhook).await?;
    let key = format!("{stream}.{consumer}.{subscriber}");
    let (created, registration, secret) =
        state.runtime.stores.consumer_webhooks.put_with(&key, webhook, Some(options)).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(subscriber_view(&stream, &consumer, &subscriber, registration, secret))))
}

/// A consumer's webhook subscriber (without its secret).
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/webhook",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    responses(
        (status = 200, description = "the registration", body = SubscriberView),
        (status = 404, description = "none registered", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn get_subscriber(
    State(state): State<AppState>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
) -> Result<Json<SubscriberView>, ApiError> {
    let registration = state
        .runtime
        .stores
        .consumer_webhooks
        .get(&format!("{stream}.{consumer}.{subscriber}"))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no subscriber {subscriber} on consumer {consumer}")))?;
    Ok(Json(subscriber_view(&stream, &consumer, &subscriber, registration, None)))
}

/// Stops the consumer's webhook subscriber on every replica.
#[utoipa::path(
    delete,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/webhook",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    responses(
        (status = 204, description = "removed"),
        (status = 404, description = "none registered", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_subscriber(
    State(state): State<AppState>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
) -> Result<StatusCode, ApiError> {
    if state.runtime.stores.consumer_webhooks.delete(&format!("{stream}.{consumer}.{subscriber}")).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!("no subscriber {subscriber} on consumer {consumer}")))
    }
}

/// Replaces the subscriber's signing secret, the old one signing beside the
/// new one for `overlap_s` (as for a member's webhook).
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/webhook/rotate-secret",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    request_body(content = Option<RotateSecret>, description = "optional: the overlap"),
    responses(
        (status = 200, description = "rotated: the new secret, and until when the old one also signs", body = SubscriberView),
        (status = 404, description = "none registered", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "the registration changed meanwhile", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn rotate_subscriber_secret(
    State(state): State<AppState>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
    OptionalJson(request): OptionalJson<RotateSecret>,
) -> Result<Json<SubscriberView>, ApiError> {
    let overlap = request.unwrap_or_default().overlap()?;
    let (registration, secret) = state
        .runtime
        .stores
        .consumer_webhooks
        .rotate_secret(&format!("{stream}.{consumer}.{subscriber}"), overlap)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no subscriber {subscriber} on consumer {consumer}")))?;
    Ok(Json(subscriber_view(&stream, &consumer, &subscriber, registration, Some(secret))))
}
