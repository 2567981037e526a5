//! `/v1/streams/{stream}/groups`: partitioned consumer groups.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::extract::{Json, OptionalJson, Path, Query};
use crate::app::AppState;
use crate::cluster::control::{ask, BlockedPartition, Control};
use crate::groups::admin::PutOutcome;
use crate::groups::config::MemberMapping;
use crate::groups::spec::Mapping;
use crate::groups::view::{GroupSummary, GroupView, MembershipView};
use crate::groups::{GroupKind, GroupSettings, GroupSpec};
use crate::http::problem::{ApiError, Problem};
use crate::names::MemberRef;
use crate::names::{GroupName, MemberName, StreamName};

/// Picks the flavour when a name is used by both.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct KindQuery {
    /// `static` or `elastic`.
    pub kind: Option<GroupKind>,
}

/// Who takes over when mappings are deleted.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TakeOver {
    /// The members that become the group's balanced members, comma-separated
    /// (`m1,m2`). Required while the group has mappings: without members
    /// no partition would have an owner.
    #[param(example = "m1,m2")]
    pub members: Option<String>,
}

impl TakeOver {
    fn members(&self) -> Result<Vec<MemberName>, ApiError> {
        let Some(list) = &self.members else { return Ok(Vec::new()) };
        list.split(',').map(str::trim).filter(|m| !m.is_empty()).map(|m| Ok(MemberName::parse(m)?)).collect()
    }
}

/// Members to add.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddMembers {
    #[schema(value_type = Vec<String>, example = json!(["m3"]))]
    pub members: Vec<MemberName>,
}

/// Explicit partition mappings.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetMappings {
    pub mappings: Vec<Mapping>,
}

/// Creates a static or elastic group (201), confirms an identical one (200),
/// or, for an elastic group, updates its membership (200).
///
/// The configuration is stored in the pcgroups KV buckets exactly as the Go
/// library writes it, so Go members can serve the group. The partition count,
/// filters and buffer limits never change: 409, delete and recreate.
#[utoipa::path(
    put,
    path = "/v1/streams/{stream}/groups/{group}",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path)),
    request_body = GroupSpec,
    responses(
        (status = 201, description = "created", body = GroupView),
        (status = 200, description = "exists (membership updated if it differed)", body = GroupView),
        (status = 400, description = "invalid", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "conflicts with the existing group", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "the stream does not fit the group", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn put_group(
    State(state): State<AppState>,
    Path((stream, group)): Path<(StreamName, GroupName)>,
    Json(spec): Json<GroupSpec>,
) -> Result<(StatusCode, Json<GroupView>), ApiError> {
    let membership_given = spec.members.is_some() || spec.mappings.is_some();
    let settings = GroupSettings::requested_by(&spec);
    let kind = spec.kind;
    let config = spec.into_config()?;
    let outcome = state.runtime.stores.groups.put(&stream, &group, config, membership_given, settings).await?;
    let view = state.runtime.stores.groups.view(&stream, &group, Some(kind)).await?;
    let status = if outcome == PutOutcome::Created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(view)))
}

/// A group: configuration, member → partitions, consumers, pin holders and
/// backlog per partition.
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}/groups/{group}",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), KindQuery),
    responses(
        (status = 200, description = "the group", body = GroupView),
        (status = 404, description = "unknown stream or group", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "both flavours use the name: pass kind", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn get_group(
    State(state): State<AppState>,
    Path((stream, group)): Path<(StreamName, GroupName)>,
    Query(query): Query<KindQuery>,
) -> Result<Json<GroupView>, ApiError> {
    use crate::status::observe::{observe, Instances};
    let instances = Instances::Live(&state.runtime.cluster.replicas);
    let view =
        observe(&state.runtime.stores.groups, &state.runtime.broker.client, &stream, &group, query.kind, instances)
            .await?;
    Ok(Json(view))
}

/// What a partition operation did.
#[derive(Debug, Serialize, ToSchema)]
pub struct PartitionOperation {
    pub partition: u32,
    pub member: String,
    /// The keygate instance that acted.
    pub instance: String,
    /// Lanes of the member still blocked afterwards (at most 100).
    pub blocked: Vec<BlockedPartition>,
}

async fn partition_operation(
    state: &AppState,
    stream: StreamName,
    group: GroupName,
    partition: u32,
    control: Control,
) -> Result<Json<PartitionOperation>, ApiError> {
    let stored = state.runtime.stores.groups.load(&stream, &group, None).await?;
    let config = &stored.config;
    if partition >= config.partitions() {
        return Err(ApiError::NotFound(format!("group {group} has partitions 0 to {}", config.partitions() - 1)));
    }
    let owner = crate::groups::config::ownership(config.partitions(), config.members(), config.mappings())
        .into_iter()
        .find(|(_, ps)| ps.contains(&partition))
        .map(|(m, _)| m)
        .ok_or_else(|| ApiError::Conflict(format!("no member owns partition {partition}")))?;
    let member = MemberName::parse(&owner)?;
    let who = MemberRef { stream, group, member: member.clone(), owner: Default::default() };
    let reply = ask(&state.runtime.broker.client, &who, &control).await.ok_or_else(|| {
        ApiError::Conflict(format!(
            "no keygate instance holds member {member}'s pin, so nothing is delivering partition {partition}"
        ))
    })?;
    if !reply.ok {
        return Err(ApiError::Conflict(reply.error.unwrap_or_else(|| "the operation failed".into())));
    }
    Ok(Json(PartitionOperation {
        partition,
        member: member.to_string(),
        instance: reply.instance,
        blocked: reply.blocked,
    }))
}

/// Names a key of the partition (key ordering): optional when the
/// partition has one blocked key, or is ordered as a whole.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LaneTarget {
    /// The blocked key, as published.
    pub key: Option<String>,
}

/// Terminates a blocked partition's head message (it is copied to the
/// dead-letter stream) so the partition proceeds. Under key ordering it
/// skips the head of the key named in the body, or of the partition's only
/// blocked key.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/partitions/{partition}/skip",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("partition" = u32, Path)),
    request_body(content = Option<LaneTarget>, description = "the key to skip (key ordering)"),
    responses(
        (status = 200, description = "the head was dead-lettered", body = PartitionOperation),
        (status = 404, description = "unknown group or partition", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "the partition or key is not blocked, several keys are and none was named, or no keygate instance serves it", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn skip_partition(
    State(state): State<AppState>,
    Path((stream, group, partition)): Path<(StreamName, GroupName, u32)>,
    OptionalJson(target): OptionalJson<LaneTarget>,
) -> Result<Json<PartitionOperation>, ApiError> {
    let key = target.and_then(|t| t.key);
    partition_operation(&state, stream, group, partition, Control::Skip { partition, key }).await
}

/// Redelivers a blocked partition's head now instead of after its delay
/// (under key ordering: the named key's, or the only blocked key's).
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/partitions/{partition}/retry-now",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("partition" = u32, Path)),
    request_body(content = Option<LaneTarget>, description = "the key to retry (key ordering)"),
    responses(
        (status = 200, description = "redelivery asked for", body = PartitionOperation),
        (status = 404, description = "unknown group or partition", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "the partition or key is not blocked, several keys are and none was named, or no keygate instance serves it", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn retry_partition_now(
    State(state): State<AppState>,
    Path((stream, group, partition)): Path<(StreamName, GroupName, u32)>,
    OptionalJson(target): OptionalJson<LaneTarget>,
) -> Result<Json<PartitionOperation>, ApiError> {
    let key = target.and_then(|t| t.key);
    partition_operation(&state, stream, group, partition, Control::RetryNow { partition, key }).await
}

/// Terminates a blocked key's head message (key ordering; it is copied to
/// the dead-letter stream) so the key proceeds. The key is percent-encoded
/// in the path.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/partitions/{partition}/keys/{key}/skip",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("partition" = u32, Path),
        ("key" = String, Path, description = "the blocked key, percent-encoded")),
    responses(
        (status = 200, description = "the head was dead-lettered", body = PartitionOperation),
        (status = 404, description = "unknown group or partition", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "the key is not blocked, or no keygate instance serves it", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn skip_key(
    State(state): State<AppState>,
    Path((stream, group, partition, key)): Path<(StreamName, GroupName, u32, String)>,
) -> Result<Json<PartitionOperation>, ApiError> {
    partition_operation(&state, stream, group, partition, Control::Skip { partition, key: Some(key) }).await
}

/// Redelivers a blocked key's head now instead of after its delay.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/partitions/{partition}/keys/{key}/retry-now",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("partition" = u32, Path),
        ("key" = String, Path, description = "the blocked key, percent-encoded")),
    responses(
        (status = 200, description = "redelivery asked for", body = PartitionOperation),
        (status = 404, description = "unknown group or partition", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "the key is not blocked, or no keygate instance serves it", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn retry_key_now(
    State(state): State<AppState>,
    Path((stream, group, partition, key)): Path<(StreamName, GroupName, u32, String)>,
) -> Result<Json<PartitionOperation>, ApiError> {
    partition_operation(&state, stream, group, partition, Control::RetryNow { partition, key: Some(key) }).await
}

/// Deletes a group: its configuration and its consumers (static) or
/// work-queue stream (elastic).
#[utoipa::path(
    delete,
    path = "/v1/streams/{stream}/groups/{group}",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), KindQuery),
    responses(
        (status = 204, description = "deleted"),
        (status = 404, description = "unknown group", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_group(
    State(state): State<AppState>,
    Path((stream, group)): Path<(StreamName, GroupName)>,
    Query(query): Query<KindQuery>,
) -> Result<StatusCode, ApiError> {
    state.runtime.stores.groups.delete(&stream, &group, query.kind).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The groups on a stream, both flavours.
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}/groups",
    tag = "groups",
    params(("stream" = String, Path)),
    responses(
        (status = 200, description = "groups by name", body = Vec<GroupSummary>),
        (status = 404, description = "unknown stream", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn list_groups(
    State(state): State<AppState>,
    Path(stream): Path<StreamName>,
) -> Result<Json<Vec<GroupSummary>>, ApiError> {
    Ok(Json(state.runtime.stores.groups.list(&stream).await?))
}

/// Adds members to an elastic group; partitions are re-balanced live.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/members",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path)),
    request_body = AddMembers,
    responses(
        (status = 200, description = "the new membership", body = MembershipView),
        (status = 404, description = "unknown group", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "static group, or the group uses mappings", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn add_members(
    State(state): State<AppState>,
    Path((stream, group)): Path<(StreamName, GroupName)>,
    Json(body): Json<AddMembers>,
) -> Result<Json<MembershipView>, ApiError> {
    Ok(Json(state.runtime.stores.groups.add_members(&stream, &group, &body.members).await?))
}

/// Drops a member from an elastic group; its partitions move to the others.
#[utoipa::path(
    delete,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    responses(
        (status = 200, description = "the new membership", body = MembershipView),
        (status = 404, description = "unknown group or member", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "static group, or the group uses mappings", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn drop_member(
    State(state): State<AppState>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
) -> Result<Json<MembershipView>, ApiError> {
    Ok(Json(state.runtime.stores.groups.drop_member(&stream, &group, &member).await?))
}

/// Replaces an elastic group's membership with explicit mappings covering
/// every partition exactly once.
#[utoipa::path(
    put,
    path = "/v1/streams/{stream}/groups/{group}/mappings",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path)),
    request_body = SetMappings,
    responses(
        (status = 200, description = "the new membership", body = MembershipView),
        (status = 400, description = "mappings do not cover every partition once", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown group", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "static group", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn put_mappings(
    State(state): State<AppState>,
    Path((stream, group)): Path<(StreamName, GroupName)>,
    Json(body): Json<SetMappings>,
) -> Result<Json<MembershipView>, ApiError> {
    let mappings = body
        .mappings
        .into_iter()
        .map(|m| MemberMapping { member: m.member.to_string(), partitions: Some(m.partitions) })
        .collect();
    Ok(Json(state.runtime.stores.groups.set_mappings(&stream, &group, mappings).await?))
}

/// Removes an elastic group's mappings; the members named in `members`
/// become its balanced members in the same edit. Refused (409) while the
/// group has mappings and no members are named: no partition would have
/// an owner, and members cannot be added while mappings are set. A group
/// without mappings is answered as it stands.
#[utoipa::path(
    delete,
    path = "/v1/streams/{stream}/groups/{group}/mappings",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), TakeOver),
    responses(
        (status = 200, description = "the new membership", body = MembershipView),
        (status = 400, description = "a member name is invalid", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown group", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "static group, or no members named to take over from the mappings", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_mappings(
    State(state): State<AppState>,
    Path((stream, group)): Path<(StreamName, GroupName)>,
    Query(take_over): Query<TakeOver>,
) -> Result<Json<MembershipView>, ApiError> {
    let members = take_over.members()?;
    Ok(Json(state.runtime.stores.groups.delete_mappings(&stream, &group, &members).await?))
}

/// Unpins the member's current instance; a standby instance takes over.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/step-down",
    tag = "groups",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    responses(
        (status = 204, description = "unpinned"),
        (status = 404, description = "unknown group or member, or no instance is serving it", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn step_down(
    State(state): State<AppState>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
) -> Result<StatusCode, ApiError> {
    state.runtime.stores.groups.step_down(&stream, &group, &member).await?;
    Ok(StatusCode::NO_CONTENT)
}
