//! `…/members/{member}/pause|resume` and
//! `…/subscribers/{subscriber}/pause|resume`: an operator stops a member on
//! every replica (its backlog waits in NATS) and lets it go on.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::extract::{Json, OptionalJson, Path};
use crate::app::AppState;
use crate::auth::Caller;
use crate::events::Event;
use crate::http::problem::{ApiError, Problem};
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::names::{MemberRef, Owner};
use crate::pauses::{Pause, MAX_REASON};

/// Why the member is paused (optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// Shown in the group view and the `member.paused` event.
    #[schema(max_length = 500)]
    pub reason: Option<String>,
}

/// Whether a member is paused, by whom, since when and why.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PauseState {
    pub stream: String,
    /// The group (`null` for a plain consumer's subscriber).
    pub group: Option<String>,
    /// The plain consumer (`null` for a group's member).
    pub consumer: Option<String>,
    /// The member (or subscriber).
    pub member: String,
    pub paused: bool,
    /// The pause, while paused; after a resume, the pause it lifted (if any).
    pub pause: Option<Pause>,
}

fn state_of(who: &MemberRef, paused: bool, pause: Option<Pause>) -> PauseState {
    let (group, consumer) = match who.owner {
        Owner::Group => (Some(who.group.to_string()), None),
        Owner::Consumer => (None, Some(who.group.to_string())),
    };
    PauseState { stream: who.stream.to_string(), group, consumer, member: who.member.to_string(), paused, pause }
}

/// Who is acting: the token's `sub`, or `anonymous` without authentication.
fn actor(caller: Option<&Caller>) -> String {
    match caller {
        Some(caller) => caller.subject.clone().unwrap_or_else(|| "token without sub".into()),
        None => "anonymous".into(),
    }
}

async fn pause(
    state: &AppState,
    who: MemberRef,
    caller: Option<&Caller>,
    request: Option<PauseRequest>,
) -> Result<Json<PauseState>, ApiError> {
    let reason = request.and_then(|r| r.reason).map(|r| r.trim().to_owned()).filter(|r| !r.is_empty());
    if reason.as_ref().is_some_and(|r| r.chars().count() > MAX_REASON || r.contains(['\r', '\n'])) {
        return Err(ApiError::BadRequest(format!("reason must be at most {MAX_REASON} characters on one line")));
    }
    let by = actor(caller);
    let asked = Pause::by(by.clone(), reason);
    let (pause, new) = state.runtime.stores.pauses.pause(&who, asked).await?;
    if new {
        let instance = state.runtime.cluster.instance_id.as_str();
        let about = crate::events::About { who: &who, instance };
        state.runtime.events.emit(Event::member_paused(about, &by, pause.reason.as_deref()));
    }
    Ok(Json(state_of(&who, true, Some(pause))))
}

async fn resume(state: &AppState, who: MemberRef, caller: Option<&Caller>) -> Result<Json<PauseState>, ApiError> {
    let lifted = state.runtime.stores.pauses.resume(&who).await?;
    if lifted.is_some() {
        let instance = state.runtime.cluster.instance_id.as_str();
        let about = crate::events::About { who: &who, instance };
        state.runtime.events.emit(Event::member_resumed(about, &actor(caller)));
    }
    Ok(Json(state_of(&who, false, lifted)))
}

/// Pauses a group member on every keygate replica: its instances stop
/// pulling, finish the deliveries in flight and release the pin; no standby
/// takes over, and its backlog stays in NATS. Pausing a paused member
/// changes nothing (the first pause is answered). Kept across restarts.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/pause",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    request_body(content = Option<PauseRequest>, description = "optional: why"),
    responses(
        (status = 200, description = "paused", body = PauseState),
        (status = 404, description = "unknown group or member", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn pause_member(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
    OptionalJson(request): OptionalJson<PauseRequest>,
) -> Result<Json<PauseState>, ApiError> {
    let who = super::target::group_member(&state, stream, group, member).await?;
    pause(&state, who, caller.as_deref(), request).await
}

/// Resumes a paused group member: its instances join again and the backlog
/// flows, in order. Resuming a member that is not paused changes nothing.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/resume",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    responses(
        (status = 200, description = "not paused (any more)", body = PauseState),
        (status = 404, description = "unknown group or member", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn resume_member(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
) -> Result<Json<PauseState>, ApiError> {
    let who = super::target::group_member(&state, stream, group, member).await?;
    resume(&state, who, caller.as_deref()).await
}

/// Pauses a plain consumer's subscriber on every keygate replica.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/pause",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    request_body(content = Option<PauseRequest>, description = "optional: why"),
    responses(
        (status = 200, description = "paused", body = PauseState),
        (status = 404, description = "unknown consumer", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn pause_subscriber(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
    OptionalJson(request): OptionalJson<PauseRequest>,
) -> Result<Json<PauseState>, ApiError> {
    let (who, _) = super::target::consumer_subscriber(&state, stream, consumer, subscriber).await?;
    pause(&state, who, caller.as_deref(), request).await
}

/// Resumes a plain consumer's paused subscriber.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/resume",
    tag = "consumers",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    responses(
        (status = 200, description = "not paused (any more)", body = PauseState),
        (status = 404, description = "unknown consumer", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn resume_subscriber(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
) -> Result<Json<PauseState>, ApiError> {
    let (who, _) = super::target::consumer_subscriber(&state, stream, consumer, subscriber).await?;
    resume(&state, who, caller.as_deref()).await
}
