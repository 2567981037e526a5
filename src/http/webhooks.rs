//! `…/members/{member}/webhook`: a member served by a webhook URL.

use axum::extract::State;
use axum::http::StatusCode;

use super::extract::{Json, OptionalJson, Path};
use crate::app::AppState;
use crate::auth::scopes::Requirement;
use crate::auth::Caller;
use crate::error::Class;
use crate::http::problem::{ApiError, Problem};
use crate::names::{GroupName, MemberName, StreamName};
use crate::webhook::{registration_key, Registration, RegistrationView, RotateSecret, WebhookSpec, WebhookView};

fn view(
    stream: &StreamName,
    group: &GroupName,
    member: &MemberName,
    r: Registration,
    secret: Option<String>,
) -> WebhookView {
    WebhookView {
        stream: stream.to_string(),
        group: group.to_string(),
        member: member.to_string(),
        max_in_flight: r.max_in_flight,
        registration: RegistrationView::of(&r, secret),
    }
}

/// Registers (201) or replaces (200) the webhook serving a member. Every
/// keygate replica serves it; the member's pin picks the active one. The
/// generated signing secret is in this answer only.
#[utoipa::path(
    put,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/webhook",
    tag = "webhooks",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    request_body = WebhookSpec,
    responses(
        (status = 201, description = "registered", body = WebhookView),
        (status = 200, description = "replaced", body = WebhookView),
        (status = 400, description = "invalid", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown group or member", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "destination not allowed", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn put_webhook(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
    Json(spec): Json<WebhookSpec>,
) -> Result<(StatusCode, Json<WebhookView>), ApiError> {
    let stored = state.runtime.stores.groups.load(&stream, &group, None).await?;
    if !stored.config.has_member(member.as_str()) {
        return Err(ApiError::NotFound(format!("member {member} is not in group {group}")));
    }
    check_outputs(&state, caller.as_deref(), &spec).await?;
    let key = registration_key(stream.as_str(), group.as_str(), member.as_str());
    let (created, registration, secret) = state.runtime.stores.webhooks.put(&key, spec).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(view(&stream, &group, &member, registration, secret))))
}

/// Refuses outputs (docs/pipelines.md) the caller may not publish to
/// (`publish:<stream>`), streams that do not exist, and streams whose
/// duplicate window is shorter than the registration's redelivery horizon:
/// past the window a republished output would be stored twice.
pub async fn check_outputs(state: &AppState, caller: Option<&Caller>, spec: &WebhookSpec) -> Result<(), ApiError> {
    let horizon = Horizon {
        length: spec.redelivery_horizon(),
        made_of: "this registration's redelivery horizon",
        parts: "max_attempts calls of timeout_ms and the backoff between them",
        shorter: "lower max_attempts, timeout_ms or backoff",
    };
    check_declared_outputs(state, caller, &spec.outputs()?, &horizon).await
}

/// Stream names given as a WebSocket join's or a fetch's `outputs`.
pub fn output_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Vec<StreamName>, ApiError> {
    names
        .into_iter()
        .map(|name| StreamName::parse(name).map_err(|e| ApiError::BadRequest(format!("outputs: {e}"))))
        .collect()
}

/// The outputs a WebSocket join or a pull instance's first fetch declares
/// (`names`), checked as a registration's are, against the horizon of a
/// client that answers each delivery within the consumer's `ack_wait`.
pub async fn check_client_outputs(
    state: &AppState,
    caller: Option<&Caller>,
    names: Vec<StreamName>,
    max_attempts: u64,
    ack_wait: std::time::Duration,
) -> Result<Vec<StreamName>, ApiError> {
    let outputs = crate::webhook::registration::declared_outputs(names)?;
    let horizon = Horizon {
        length: crate::webhook::registration::client_redelivery_horizon(max_attempts, ack_wait),
        made_of: "this client's redelivery horizon",
        parts: "max_attempts deliveries of the ack wait each and the backoff between them",
        shorter: "lower max_attempts or the ack wait",
    };
    check_declared_outputs(state, caller, &outputs, &horizon).await?;
    Ok(outputs)
}

/// How long one endpoint's deliveries of a message can span, and how to
/// say so in a refusal.
pub struct Horizon {
    pub length: std::time::Duration,
    /// Whose horizon it is, for the refusal.
    pub made_of: &'static str,
    /// What it adds up.
    pub parts: &'static str,
    /// How the caller can shorten it.
    pub shorter: &'static str,
}

/// Checks declared `outputs` against the caller's `publish:` scopes, the
/// streams there are, and `horizon` (see [`check_outputs`]).
pub async fn check_declared_outputs(
    state: &AppState,
    caller: Option<&Caller>,
    outputs: &[StreamName],
    horizon: &Horizon,
) -> Result<(), ApiError> {
    for output in outputs {
        let needed = Requirement::Publish { stream: output.to_string() };
        if caller.is_some_and(|c| !c.scopes.allows(&needed)) {
            return Err(ApiError::Forbidden { scope: needed.scope().unwrap_or_default() });
        }
        let view = match state.runtime.stores.streams.get(output).await {
            Ok(view) => view,
            Err(e) if e.class() == Class::NotFound => {
                return Err(ApiError::BadRequest(format!("outputs: stream {output} does not exist")))
            }
            Err(e) => return Err(e.into()),
        };
        let window = std::time::Duration::from_millis(view.duplicate_window_ms);
        if window < horizon.length {
            return Err(ApiError::BadRequest(format!(
                "outputs: stream {output} drops duplicates for {} s, shorter than {} of {} s ({}), so an output \
                 published again by a late retry could be stored twice; create {output} with a duplicate_window_ms \
                 of at least {}, or {}",
                window.as_secs(),
                horizon.made_of,
                horizon.length.as_secs_f64().ceil(),
                horizon.parts,
                horizon.length.as_millis(),
                horizon.shorter,
            )));
        }
    }
    Ok(())
}

/// The webhook serving a member (without its secret).
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/webhook",
    tag = "webhooks",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    responses(
        (status = 200, description = "the registration", body = WebhookView),
        (status = 404, description = "no webhook registered", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn get_webhook(
    State(state): State<AppState>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
) -> Result<Json<WebhookView>, ApiError> {
    let key = registration_key(stream.as_str(), group.as_str(), member.as_str());
    let registration = state
        .runtime
        .stores
        .webhooks
        .get(&key)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no webhook is registered for member {member}")))?;
    Ok(Json(view(&stream, &group, &member, registration, None)))
}

/// Stops serving a member through its webhook (every replica stops).
#[utoipa::path(
    delete,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/webhook",
    tag = "webhooks",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    responses(
        (status = 204, description = "removed"),
        (status = 404, description = "no webhook registered", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_webhook(
    State(state): State<AppState>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
) -> Result<StatusCode, ApiError> {
    let key = registration_key(stream.as_str(), group.as_str(), member.as_str());
    if state.runtime.stores.webhooks.delete(&key).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!("no webhook is registered for member {member}")))
    }
}

/// Replaces the member's signing secret with a new one, answered this once.
/// For `overlap_s` (default an hour) deliveries carry both signatures
/// (`webhook-signature: v1,<new> v1,<old>`, as Standard Webhooks allows), so
/// the receiver can switch to the new secret without missing a delivery.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/webhook/rotate-secret",
    tag = "webhooks",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    request_body(content = Option<RotateSecret>, description = "optional: the overlap"),
    responses(
        (status = 200, description = "rotated: the new secret, and until when the old one also signs", body = WebhookView),
        (status = 404, description = "no webhook registered", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "the registration changed meanwhile", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn rotate_secret(
    State(state): State<AppState>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
    OptionalJson(request): OptionalJson<RotateSecret>,
) -> Result<Json<WebhookView>, ApiError> {
    let overlap = request.unwrap_or_default().overlap()?;
    let key = registration_key(stream.as_str(), group.as_str(), member.as_str());
    let (registration, secret) = state
        .runtime
        .stores
        .webhooks
        .rotate_secret(&key, overlap)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no webhook is registered for member {member}")))?;
    Ok(Json(view(&stream, &group, &member, registration, Some(secret))))
}
