//! Who a route that comes in pairs names (the WebSocket, fetch and acks,
//! pause and resume of a group member and of a plain consumer's
//! subscriber), checked once, the same way for every pair, before anything
//! is done.

use super::problem::ApiError;
use crate::app::AppState;
use crate::consumers::ConsumerView;
use crate::names::{ConsumerName, GroupName, MemberName, MemberRef, Owner, StreamName};

/// A group's member, when the group exists and has it.
pub(super) async fn group_member(
    state: &AppState,
    stream: StreamName,
    group: GroupName,
    member: MemberName,
) -> Result<MemberRef, ApiError> {
    let stored = state.runtime.stores.groups.load(&stream, &group, None).await?;
    if !stored.config.has_member(member.as_str()) {
        return Err(ApiError::NotFound(format!("{member} is not a member of group {group}")));
    }
    Ok(MemberRef { stream, group, member, owner: Owner::Group })
}

/// A plain consumer's subscriber, when the consumer exists and may be
/// subscribed to (not a group member's: 409), with the consumer as it is.
pub(super) async fn consumer_subscriber(
    state: &AppState,
    stream: StreamName,
    consumer: ConsumerName,
    subscriber: MemberName,
) -> Result<(MemberRef, ConsumerView), ApiError> {
    let current = state.consumers.subscribable(&stream, &consumer).await?;
    // Events and pause flags name the consumer in a group's place.
    let group = GroupName::parse(consumer.as_str()).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    Ok((MemberRef { stream, group, member: subscriber, owner: Owner::Consumer }, current))
}
