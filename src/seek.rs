//! Replay and seek: a static group's members' consumers, or a plain
//! consumer, made again to start at a time, a sequence or the end of the
//! stream. For a group it is safe while instances serve: the members are
//! paused (every instance stops pulling, finishes what it holds and lets go
//! of the pin), their consumers are made again at the new start, and the
//! members are resumed; instances then join the new consumers, so fencing
//! tokens rise and each key's order runs again from the new start.
//! docs/operations.md, "Replay and seek".

use std::time::Duration;

use async_nats::jetstream::{self, consumer::DeliverPolicy};
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use utoipa::ToSchema;

use crate::error::Error as DomainError;

/// What seeking a static group or a plain consumer can fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeekErrorKind {
    /// The position (`to`) is invalid.
    InvalidPosition,
    /// An elastic group keeps no acknowledged messages to go back to.
    ElasticGroup,
    ConsumerNotFound,
    /// The consumer is a partitioned group member's: seek the group.
    GroupMembers,
    Unavailable,
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(SeekErrorKind {
    InvalidPosition => Invalid,
    ElasticGroup => Unprocessable,
    ConsumerNotFound => NotFound,
    GroupMembers => Conflict,
});
crate::error::flows_into!(SeekErrorKind: crate::nats::errors::BrokerErrorKind, crate::groups::GroupErrorKind);

pub type SeekError = DomainError<SeekErrorKind>;
use crate::groups::config::ownership;
use crate::groups::spec::consumer_of;
use crate::groups::{GroupAdmin, GroupKind};
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::names::{MemberRef, Owner};
use crate::nats::errors::{is_not_found, stream_read_error, unavailable_or_internal};
use crate::pauses::{Pause, Pauses};
use crate::runtime::join::member_config;
use SeekError as Error;
use SeekErrorKind as Kind;

/// How long a seek waits for the members' instances to let go of their
/// consumers before it makes them again anyway (an instance still holding
/// one then finds it gone and joins the new one).
const LET_GO: Duration = Duration::from_secs(10);

/// Where to start: `{"time": RFC 3339}`, `{"seq": n}` or `"latest"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SeekTo {
    /// The first message stored at or after this time.
    Time(String),
    /// This stream sequence (1 or more).
    Seq(u64),
    /// Only messages stored from now on.
    Latest,
}

/// `POST …/seek`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SeekRequest {
    pub to: SeekTo,
}

/// What a seek did.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SeekAnswer {
    pub stream: String,
    /// The group (`null` for a plain consumer).
    pub group: Option<String>,
    /// The plain consumer (`null` for a group).
    pub consumer: Option<String>,
    pub to: SeekTo,
    /// The consumers made again at the new start.
    pub consumers: Vec<String>,
    /// The stream's oldest message still stored (`null`: the stream is empty).
    pub first_seq: Option<u64>,
    /// The start is older than that message: only what is still stored is
    /// replayed (a limits stream has dropped the rest).
    pub before_first: bool,
}

impl SeekTo {
    /// The consumer's deliver policy, or why the start is refused.
    pub fn policy(&self) -> Result<DeliverPolicy, Error> {
        match self {
            Self::Time(text) => OffsetDateTime::parse(text, &Rfc3339)
                .map(|start_time| DeliverPolicy::ByStartTime { start_time })
                .map_err(|e| Error::new(Kind::InvalidPosition, format!("to.time must be an RFC 3339 time ({e})"))),
            Self::Seq(0) => Err(Error::new(Kind::InvalidPosition, "to.seq starts at 1")),
            Self::Seq(seq) => Ok(DeliverPolicy::ByStartSequence { start_sequence: *seq }),
            Self::Latest => Ok(DeliverPolicy::New),
        }
    }

    /// Whether the start lies before the stream's first stored message.
    fn before(&self, first_seq: u64, first_time: OffsetDateTime) -> bool {
        match self.policy() {
            Ok(DeliverPolicy::ByStartSequence { start_sequence }) => start_sequence < first_seq,
            Ok(DeliverPolicy::ByStartTime { start_time }) => start_time < first_time,
            _ => false,
        }
    }
}

/// The stream's first stored message, if any.
async fn first_message(js: &jetstream::Context, stream: &StreamName) -> Result<Option<(u64, OffsetDateTime)>, Error> {
    let mut handle = js.get_stream(stream.as_str()).await.map_err(|e| stream_read_error(stream.as_str(), e))?;
    let state = handle.info().await.map_err(|e| stream_read_error(stream.as_str(), e))?.state.clone();
    Ok((state.messages > 0).then_some((state.first_sequence, state.first_timestamp)))
}

fn answer(
    stream: &StreamName,
    owner: (Option<String>, Option<String>),
    to: SeekTo,
    consumers: Vec<String>,
    first: Option<(u64, OffsetDateTime)>,
) -> SeekAnswer {
    let before_first = first.is_some_and(|(seq, time)| to.before(seq, time));
    SeekAnswer {
        stream: stream.to_string(),
        group: owner.0,
        consumer: owner.1,
        to,
        consumers,
        first_seq: first.map(|(seq, _)| seq),
        before_first,
    }
}

/// Seeks every member of a static group.
pub async fn seek_group(
    groups: &GroupAdmin,
    pauses: &Pauses,
    js: &jetstream::Context,
    stream: &StreamName,
    group: &GroupName,
    to: SeekTo,
) -> Result<SeekAnswer, Error> {
    let policy = to.policy()?;
    let stored = groups.load(stream, group, None).await?;
    let config = stored.config;
    if config.kind() == GroupKind::Elastic {
        return Err(Error::new(
            Kind::ElasticGroup,
            "seek applies to static groups and plain consumers: an elastic group's work queue keeps no acknowledged \
             messages to go back to",
        ));
    }
    let first = first_message(js, stream).await?;
    let ack_wait = groups.settings(stream, group).await?.ack_wait();
    let members: Vec<String> =
        ownership(config.partitions(), config.members(), config.mappings()).into_iter().map(|(m, _)| m).collect();
    let who = |member: &str| -> Result<MemberRef, Error> {
        let member =
            MemberName::parse(member).map_err(|e| Error::new(Kind::Internal, "a stored member name").caused_by(e))?;
        Ok(MemberRef { stream: stream.clone(), group: group.clone(), member, owner: Owner::Group })
    };
    // Pause the members not paused already; only those are resumed after.
    let mut paused_here = Vec::new();
    let why = format!("seeking to {}", serde_json::to_string(&to).unwrap_or_default());
    for member in &members {
        let who = who(member)?;
        if pauses.get(&who).await?.is_none() {
            let (_, new) = pauses.pause(&who, Pause::by("seek".into(), Some(why.clone()))).await?;
            if new {
                paused_here.push(who);
            }
        }
    }
    let handle = js.get_stream_no_info(stream.as_str()).await.map_err(|e| stream_read_error(stream.as_str(), e))?;
    let remade = async {
        let names: Vec<String> =
            members.iter().map(|m| consumer_of(&config, stream.as_str(), group.as_str(), m).1).collect();
        let deadline = tokio::time::Instant::now() + LET_GO;
        for name in &names {
            wait_until_let_go(&handle, name, deadline).await;
        }
        for (member, name) in members.iter().zip(&names) {
            match handle.delete_consumer(name).await {
                Ok(_) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(Error::from(unavailable_or_internal("deleting a member's consumer", e))),
            }
            let wanted = jetstream::consumer::pull::Config {
                deliver_policy: policy,
                ..member_config(&config, group.as_str(), member, ack_wait)
            };
            handle
                .create_consumer_strict(wanted)
                .await
                .map_err(|e| unavailable_or_internal("making a member's consumer", e))?;
        }
        Ok::<_, Error>(names)
    }
    .await;
    // Resumed whatever happened: a member is never left paused by a failed seek.
    for who in &paused_here {
        if let Err(e) = pauses.resume(who).await {
            tracing::warn!(member = %who.member, error = %e.report(), "could not resume a member after seeking; resume it by hand");
        }
    }
    Ok(answer(stream, (Some(group.to_string()), None), to, remade?, first))
}

/// Waits until no instance pulls from the consumer or holds its pin.
async fn wait_until_let_go(handle: &jetstream::stream::Stream<()>, name: &str, deadline: tokio::time::Instant) {
    while tokio::time::Instant::now() < deadline {
        match handle.consumer_info(name).await {
            Ok(info) => {
                let pinned =
                    info.priority_groups.iter().any(|g| g.pinned_client_id.as_ref().is_some_and(|id| !id.is_empty()));
                if info.num_waiting == 0 && !pinned {
                    return;
                }
            }
            Err(_) => return,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Seeks a plain consumer: made again with its configuration at the new
/// start. Its subscribers find it gone and join it again.
pub async fn seek_consumer(
    js: &jetstream::Context,
    stream: &StreamName,
    consumer: &ConsumerName,
    to: SeekTo,
) -> Result<SeekAnswer, Error> {
    let policy = to.policy()?;
    let handle = js.get_stream_no_info(stream.as_str()).await.map_err(|e| stream_read_error(stream.as_str(), e))?;
    let info = match handle.consumer_info(consumer.as_str()).await {
        Ok(info) => info,
        Err(e) if is_not_found(&e) => {
            return Err(Error::new(Kind::ConsumerNotFound, format!("consumer {consumer} not found on stream {stream}")))
        }
        Err(e) => return Err(unavailable_or_internal("reading the consumer", e).into()),
    };
    if info.config.priority_groups.iter().any(|g| g == crate::groups::config::PRIORITY_GROUP) {
        return Err(Error::new(
            Kind::GroupMembers,
            format!("consumer {consumer} belongs to a partitioned consumer group member; seek the group instead"),
        ));
    }
    let first = first_message(js, stream).await?;
    let original = info.config.clone();
    let wanted = jetstream::consumer::Config { deliver_policy: policy, ..original.clone() };
    handle.delete_consumer(consumer.as_str()).await.map_err(|e| unavailable_or_internal("deleting the consumer", e))?;
    if let Err(e) = handle.create_consumer(wanted).await {
        // Never leave the consumer gone: make it again as it was.
        let _ = handle.create_consumer(original).await;
        return Err(unavailable_or_internal("making the consumer again", e).into());
    }
    Ok(answer(stream, (None, Some(consumer.to_string())), to, vec![consumer.to_string()], first))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_parse_as_the_contract_writes_them() {
        let parse = |json: serde_json::Value| serde_json::from_value::<SeekRequest>(json).map(|r| r.to);
        assert_eq!(parse(serde_json::json!({"to": "latest"})).unwrap(), SeekTo::Latest);
        assert_eq!(parse(serde_json::json!({"to": {"seq": 7}})).unwrap(), SeekTo::Seq(7));
        let at = parse(serde_json::json!({"to": {"time": "2026-12-01T10:00:00Z"}})).unwrap();
        assert!(matches!(at.policy().unwrap(), DeliverPolicy::ByStartTime { .. }));
        assert!(parse(serde_json::json!({"to": {"seq": 1, "time": "x"}})).is_err());
        assert!(parse(serde_json::json!({"to": "earliest"})).is_err());
        assert!(SeekTo::Seq(0).policy().is_err());
        assert!(SeekTo::Time("yesterday".into()).policy().is_err());
        let noon = OffsetDateTime::parse("2026-12-01T12:00:00Z", &Rfc3339).unwrap();
        assert!(SeekTo::Seq(3).before(5, noon));
        assert!(!SeekTo::Seq(5).before(5, noon));
        assert!(SeekTo::Time("2026-12-01T11:00:00Z".into()).before(5, noon));
        assert!(!SeekTo::Latest.before(5, noon));
    }
}
