//! `POST …/fetch` and `POST …/acks`: members and plain consumers'
//! subscribers served to HTTP clients that pull (docs/pull.md). A fetch
//! long-polls this replica's pull instance of the member; the acks settle
//! deliveries by ack id, wherever they were handed out.

use std::collections::HashSet;
use std::time::Duration;

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::extract::{Json, OptionalJson, Path};
use super::ws::max_attempts_of;
use crate::app::AppState;
use crate::auth::scopes::Requirement;
use crate::auth::Caller;
use crate::delivery::frames::ClientFrame;
use crate::delivery::outputs::OutputMessage;
use crate::delivery::pull::{replica_of, PulledMessage};
use crate::http::problem::{ApiError, Problem};
use crate::http::webhooks::{check_client_outputs, output_names};
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::runtime::join::pinned_ttl;
use crate::runtime::pull_instances::{PullInstance, PullTarget, SettleFailure, StartOptions};
use crate::webhook::{check_max_in_flight, MAX_RETRY_AFTER};

/// Most messages one fetch returns, and most verdicts one `acks` request carries.
const MAX_BATCH: usize = 1000;
/// Longest long poll.
const MAX_WAIT_MS: u64 = 60_000;

/// A pull member's fetch.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FetchRequest {
    /// Most messages in the answer, 1–1000 (default 100).
    #[schema(minimum = 1, maximum = 1000)]
    pub max_messages: Option<usize>,
    /// Longest wait for a first message, 0–60000 ms (default 5000). The
    /// answer comes as soon as one is there, with what else is ready.
    #[schema(maximum = 60000)]
    pub wait_ms: Option<u64>,
    /// How long the fetched messages wait for a verdict before they go
    /// back (to be delivered again, in order), from 1 ms to the group's
    /// ack wait (the default).
    #[schema(minimum = 1)]
    pub visibility_ms: Option<u64>,
    /// Taken by the fetch that starts this keygate's instance of the member:
    /// deliveries of one message before it is dead-lettered (1–1000, default 10).
    #[schema(minimum = 1, maximum = 1000)]
    pub max_attempts: Option<u64>,
    /// Taken by the fetch that starts the instance: most messages out at
    /// once across the member's lanes (1–1000; default one per partition
    /// under partition ordering, 256 under key ordering).
    #[schema(minimum = 1, maximum = 1000)]
    pub max_in_flight: Option<usize>,
    /// Taken by the fetch that starts the instance: streams the acks may
    /// publish to (docs/pipelines.md); each needs `publish:<stream>` and a
    /// duplicate window at least the instance's redelivery horizon.
    #[schema(max_items = 16)]
    pub outputs: Option<Vec<String>>,
}

/// A pull subscriber's fetch.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubscriberFetchRequest {
    /// Most messages in the answer, 1–1000 (default 100).
    #[schema(minimum = 1, maximum = 1000)]
    pub max_messages: Option<usize>,
    /// Longest wait for a first message, 0–60000 ms (default 5000).
    #[schema(maximum = 60000)]
    pub wait_ms: Option<u64>,
    /// How long the fetched messages wait for a verdict, from 1 ms to the
    /// consumer's ack wait (the default).
    #[schema(minimum = 1)]
    pub visibility_ms: Option<u64>,
    /// Taken by the fetch that starts the instance (1–1000, default 10).
    #[schema(minimum = 1, maximum = 1000)]
    pub max_attempts: Option<u64>,
    /// Taken by the fetch that starts the instance; `prioritized` consumers: 0 (served first) to 9.
    #[schema(maximum = 9)]
    pub priority: Option<u8>,
    /// Taken by the fetch that starts the instance; `overflow` consumers:
    /// served only while at least this many messages wait.
    pub min_pending: Option<i64>,
    /// Taken by the fetch that starts the instance; `overflow` consumers:
    /// served only while at least this many are un-acked.
    pub min_ack_pending: Option<i64>,
    /// Taken by the fetch that starts the instance: messages out at once, 1–256 (default 4).
    #[schema(minimum = 1, maximum = 256)]
    pub concurrency: Option<usize>,
    /// Taken by the fetch that starts the instance: streams the acks may
    /// publish to, as for a member's fetch (docs/pipelines.md).
    #[schema(max_items = 16)]
    pub outputs: Option<Vec<String>>,
}

/// What a fetch brings.
#[derive(Debug, Serialize, ToSchema)]
pub struct FetchAnswer {
    /// In lane order: a key's (or partition's) next message comes only
    /// after its previous one is settled.
    pub messages: Vec<PulledMessage>,
    /// This keygate's instance holds the pin (members, and `pinned_client`
    /// consumers): messages come here. Unpinned, it stands by.
    pub pinned: bool,
    /// The member's partitions (empty for subscribers).
    pub partitions: Vec<u32>,
}

/// A NAK of one delivery.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NakRequest {
    pub id: String,
    /// Redeliver after this long, at most 900000 (15 minutes); default the
    /// retry backoff.
    #[schema(maximum = 900000)]
    pub delay_ms: Option<u64>,
}

/// Verdicts for fetched messages, by ack id; 1–1000 in all.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AckRequest {
    /// Processed: acknowledged. An entry is an ack id, or an ack id with
    /// the messages to publish before the ack (docs/pipelines.md).
    #[serde(default)]
    pub ack: Vec<AckEntry>,
    /// Deliver again (after `delay_ms`), before anything later of the key.
    #[serde(default)]
    pub nak: Vec<NakRequest>,
    /// Never deliver again: to the dead-letter stream.
    #[serde(default)]
    pub term: Vec<String>,
    /// Still working: the visibility timeout starts again.
    #[serde(default)]
    pub progress: Vec<String>,
}

/// One ack: an ack id, or an ack id with outputs.
// Serialize only lets the schema read `untagged`; it is read by hand, below.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum AckEntry {
    Id(String),
    WithOutputs(AckWithOutputs),
}

/// Read by hand: serde's untagged enums read from a buffered copy, from
/// which an output's payload (a `RawValue`) cannot be read.
impl<'de> Deserialize<'de> for AckEntry {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entry;
        impl<'de> serde::de::Visitor<'de> for Entry {
            type Value = AckEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an ack id, or {\"id\",\"publish\":[…]}")
            }
            fn visit_str<E: serde::de::Error>(self, id: &str) -> Result<AckEntry, E> {
                Ok(AckEntry::Id(id.to_owned()))
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(self, map: M) -> Result<AckEntry, M::Error> {
                AckWithOutputs::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(AckEntry::WithOutputs)
            }
        }
        deserializer.deserialize_any(Entry)
    }
}

/// An ack whose message's outputs are stored before it (docs/pipelines.md):
/// the instance must have been started with `outputs` naming their streams.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AckWithOutputs {
    pub id: String,
    /// Published in this order, each stored before the message is acked.
    #[schema(max_items = 100)]
    pub publish: Vec<OutputMessage>,
}

/// What an `acks` request did.
#[derive(Debug, Serialize, ToSchema)]
pub struct AckAnswer {
    /// Verdicts applied.
    pub settled: usize,
    /// Verdicts that found no delivery waiting (settled already, timed out,
    /// or handed out by an instance that stopped): those messages come again.
    pub failed: Vec<SettleFailure>,
}

/// Fetches messages for `member` as an instance of it on this keygate: the
/// first fetch starts the instance, which competes for the member's pin
/// like a WebSocket connection (an unpinned one stands by and returns
/// nothing); it stops when no one fetched or settled for the pin's TTL.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/fetch",
    tag = "pull",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    request_body(content = Option<FetchRequest>, description = "optional: every field has a default"),
    responses(
        (status = 200, description = "the messages ready within the wait (possibly none)", body = FetchAnswer),
        (status = 400, description = "invalid", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream, group or member", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "this keygate's instance of the member runs with other start options", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "this keygate runs as many pull instances as it may", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn fetch_member(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
    OptionalJson(request): OptionalJson<FetchRequest>,
) -> Result<Json<FetchAnswer>, ApiError> {
    let request = request.unwrap_or_default();
    let batch = Batch::of(request.max_messages, request.wait_ms)?;
    let pulls = state.pulls.clone();
    let target = PullTarget::Member { stream: stream.clone(), group: group.clone(), member: member.clone() };
    let named = request.max_attempts.is_some() || request.max_in_flight.is_some() || request.outputs.is_some();
    let max_attempts = max_attempts_of(request.max_attempts)?;
    check_max_in_flight(request.max_in_flight)?;
    let names = output_names(request.outputs.iter().flatten().map(String::as_str))?;
    let (instance, outputs) = match pulls.get(&target) {
        Some(instance) => {
            let ack_wait = instance.options.ack_wait;
            let outputs = check_client_outputs(&state, caller.as_deref(), names, max_attempts, ack_wait).await?;
            (instance, outputs)
        }
        None => {
            super::target::group_member(&state, stream.clone(), group.clone(), member.clone()).await?;
            let ack_wait = state.runtime.stores.groups.settings(&stream, &group).await?.ack_wait();
            let outputs = check_client_outputs(&state, caller.as_deref(), names, max_attempts, ack_wait).await?;
            let options = StartOptions {
                max_attempts,
                max_in_flight: request.max_in_flight,
                subscriber: None,
                ack_wait,
                idle_after: pinned_ttl(ack_wait),
                outputs: outputs.clone(),
            };
            visibility(request.visibility_ms, &options)?;
            (pulls.get_or_start(&target, options)?, outputs)
        }
    };
    let same = instance.options.max_attempts == max_attempts
        && instance.options.max_in_flight == request.max_in_flight
        && instance.options.outputs == outputs;
    if named && !same {
        return Err(started_otherwise(&target, &instance));
    }
    let visibility = visibility(request.visibility_ms, &instance.options)?;
    Ok(Json(batch.fetch(&instance, visibility).await))
}

/// Fetches messages for a plain consumer's subscriber, as an instance of it
/// on this keygate (started by the first fetch, with the pull options its
/// consumer's policy takes).
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/fetch",
    tag = "pull",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    request_body(content = Option<SubscriberFetchRequest>, description = "optional: every field has a default"),
    responses(
        (status = 200, description = "the messages ready within the wait (possibly none)", body = FetchAnswer),
        (status = 400, description = "invalid", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream or consumer", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "a group member's consumer, or this keygate's instance runs with other start options", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "this keygate runs as many pull instances as it may", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn fetch_subscriber(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
    OptionalJson(request): OptionalJson<SubscriberFetchRequest>,
) -> Result<Json<FetchAnswer>, ApiError> {
    let request = request.unwrap_or_default();
    let batch = Batch::of(request.max_messages, request.wait_ms)?;
    let pulls = state.pulls.clone();
    let target =
        PullTarget::Subscriber { stream: stream.clone(), consumer: consumer.clone(), subscriber: subscriber.clone() };
    let max_attempts = max_attempts_of(request.max_attempts)?;
    let named = request.max_attempts.is_some()
        || request.priority.is_some()
        || request.min_pending.is_some()
        || request.min_ack_pending.is_some()
        || request.concurrency.is_some()
        || request.outputs.is_some();
    if let Some(instance) = pulls.get(&target).filter(|_| !named) {
        let visibility = visibility(request.visibility_ms, &instance.options)?;
        return Ok(Json(batch.fetch(&instance, visibility).await));
    }
    let (_, current) =
        super::target::consumer_subscriber(&state, stream.clone(), consumer.clone(), subscriber.clone()).await?;
    let pull = super::consumers::pull_options(
        current.policy,
        request.priority,
        request.min_pending,
        request.min_ack_pending,
        request.concurrency,
    )?;
    let ack_wait = Duration::from_millis(current.ack_wait_ms);
    let names = output_names(request.outputs.iter().flatten().map(String::as_str))?;
    let outputs = check_client_outputs(&state, caller.as_deref(), names, max_attempts, ack_wait).await?;
    let options = StartOptions {
        max_attempts,
        max_in_flight: None,
        subscriber: Some(pull),
        ack_wait,
        idle_after: current.pinned_ttl_ms.map_or_else(|| pinned_ttl(ack_wait), Duration::from_millis),
        outputs,
    };
    visibility(request.visibility_ms, &options)?;
    let instance = pulls.get_or_start(&target, options.clone())?;
    let same = instance.options.max_attempts == options.max_attempts
        && instance.options.subscriber == options.subscriber
        && instance.options.outputs == options.outputs;
    if named && !same {
        return Err(started_otherwise(&target, &instance));
    }
    let visibility = visibility(request.visibility_ms, &instance.options)?;
    Ok(Json(batch.fetch(&instance, visibility).await))
}

/// Settles messages a member's fetches handed out, by ack id: on this
/// keygate or on the one that handed them out. Each verdict applies on its
/// own; those that find nothing waiting are listed.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/acks",
    tag = "pull",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path)),
    request_body = AckRequest,
    responses(
        (status = 200, description = "applied; `failed` lists verdicts that found no delivery waiting", body = AckAnswer),
        (status = 400, description = "invalid: nothing applied", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn settle_member(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
    Json(request): Json<AckRequest>,
) -> Result<Json<AckAnswer>, ApiError> {
    settle(&state, caller.as_deref(), PullTarget::Member { stream, group, member }, request).await
}

/// Settles messages a subscriber's fetches handed out, by ack id.
#[utoipa::path(
    post,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/acks",
    tag = "pull",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path)),
    request_body = AckRequest,
    responses(
        (status = 200, description = "applied; `failed` lists verdicts that found no delivery waiting", body = AckAnswer),
        (status = 400, description = "invalid: nothing applied", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn settle_subscriber(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
    Json(request): Json<AckRequest>,
) -> Result<Json<AckAnswer>, ApiError> {
    settle(&state, caller.as_deref(), PullTarget::Subscriber { stream, consumer, subscriber }, request).await
}

fn started_otherwise(target: &PullTarget, instance: &PullInstance) -> ApiError {
    let StartOptions { max_attempts, max_in_flight, subscriber, outputs, .. } = &instance.options;
    let mut running = format!("max_attempts {max_attempts}");
    if let Some(n) = max_in_flight {
        running.push_str(&format!(", max_in_flight {n}"));
    }
    if let Some(pull) = subscriber {
        running.push_str(&format!(", concurrency {}", pull.concurrency));
    }
    if !outputs.is_empty() {
        let names: Vec<&str> = outputs.iter().map(|o| o.as_str()).collect();
        running.push_str(&format!(", outputs {}", names.join(",")));
    }
    ApiError::Conflict(format!(
        "this keygate's pull instance of {target} runs with other start options ({running}); fetch without them, \
         or with the same, or let it stop (no fetches for the pin's TTL) first"
    ))
}

/// The visibility timeout a fetch asks for, within the ack wait.
fn visibility(requested: Option<u64>, options: &StartOptions) -> Result<Duration, ApiError> {
    let ack_wait_ms = options.ack_wait.as_millis() as u64;
    match requested {
        None => Ok(options.ack_wait),
        Some(ms) if (1..=ack_wait_ms).contains(&ms) => Ok(Duration::from_millis(ms)),
        Some(_) => Err(ApiError::BadRequest(format!(
            "visibility_ms must be between 1 and the ack wait, {ack_wait_ms} ms (a longer ack wait is a group or consumer setting)"
        ))),
    }
}

/// How much one fetch takes and how long it waits.
struct Batch {
    max: usize,
    wait: Duration,
}

impl Batch {
    fn of(max_messages: Option<usize>, wait_ms: Option<u64>) -> Result<Self, ApiError> {
        let max = max_messages.unwrap_or(100);
        if !(1..=MAX_BATCH).contains(&max) {
            return Err(ApiError::BadRequest(format!("max_messages must be between 1 and {MAX_BATCH}")));
        }
        let wait_ms = wait_ms.unwrap_or(5000);
        if wait_ms > MAX_WAIT_MS {
            return Err(ApiError::BadRequest(format!("wait_ms must be at most {MAX_WAIT_MS}")));
        }
        Ok(Self { max, wait: Duration::from_millis(wait_ms) })
    }

    async fn fetch(&self, instance: &PullInstance, visibility: Duration) -> FetchAnswer {
        let (messages, status) = instance.fetch(self.max, self.wait, visibility).await;
        FetchAnswer { messages, pinned: status.pinned, partitions: status.partitions }
    }
}

/// Checks the whole request, then applies each verdict.
async fn settle(
    state: &AppState,
    caller: Option<&Caller>,
    target: PullTarget,
    request: AckRequest,
) -> Result<Json<AckAnswer>, ApiError> {
    let frames = frames_of(request)?;
    // The instance's `outputs` were checked against whoever started it;
    // an ack publishes with the rights of whoever sends it.
    if let Some(caller) = caller {
        for frame in &frames {
            let ClientFrame::Ack { publish: Some(publish), .. } = frame else { continue };
            for output in publish {
                let needed = Requirement::Publish { stream: output.stream.clone() };
                if !caller.scopes.allows(&needed) {
                    return Err(ApiError::Forbidden { scope: needed.scope().unwrap_or_default() });
                }
            }
        }
    }
    let count = frames.len();
    let failed = state.pulls.settle(&target, frames).await;
    Ok(Json(AckAnswer { settled: count - failed.len(), failed }))
}

/// The verdicts of a request as client frames; refused whole when one is
/// malformed, repeated or out of range, or there are none or too many.
fn frames_of(request: AckRequest) -> Result<Vec<ClientFrame>, ApiError> {
    let AckRequest { ack, nak, term, progress } = request;
    let bad = |m: String| Err(ApiError::BadRequest(m));
    let max_delay_ms = MAX_RETRY_AFTER.as_millis() as u64;
    if let Some(n) = nak.iter().find(|n| n.delay_ms.is_some_and(|ms| ms > max_delay_ms)) {
        return bad(format!("nak {}: delay_ms must be at most {max_delay_ms} (15 minutes)", shown(&n.id)));
    }
    let frames: Vec<ClientFrame> = ack
        .into_iter()
        .map(|entry| match entry {
            AckEntry::Id(id) => ClientFrame::Ack { id, publish: None },
            AckEntry::WithOutputs(AckWithOutputs { id, publish }) => ClientFrame::Ack { id, publish: Some(publish) },
        })
        .chain(nak.into_iter().map(|n| ClientFrame::Nak { id: n.id, delay_ms: n.delay_ms }))
        .chain(term.into_iter().map(|id| ClientFrame::Term { id }))
        .chain(progress.into_iter().map(|id| ClientFrame::Progress { id }))
        .collect();
    if frames.is_empty() || frames.len() > MAX_BATCH {
        return bad(format!("give 1 to {MAX_BATCH} verdicts in ack, nak, term and progress together"));
    }
    let mut seen = HashSet::new();
    for frame in &frames {
        if replica_of(frame.id()).is_none() {
            return bad(format!("{} is not an ack id keygate hands out (32 lowercase hex digits)", shown(frame.id())));
        }
        if !seen.insert(frame.id()) {
            return bad(format!("ack id {} has more than one verdict", frame.id()));
        }
    }
    Ok(frames)
}

/// A client's string in an error, short and quoted.
fn shown(id: &str) -> String {
    let mut short: String = id.chars().take(40).collect();
    if short.len() < id.len() {
        short.push('…');
    }
    format!("{short:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef";
    const OTHER: &str = "0123456789abcdeffedcba9876543210";

    fn request(json: serde_json::Value) -> AckRequest {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn verdicts_become_client_frames_in_one_list() {
        let frames = frames_of(request(serde_json::json!({
            "ack": [ID], "nak": [{"id": OTHER, "delay_ms": 500}]
        })))
        .unwrap();
        assert_eq!(
            frames,
            vec![
                ClientFrame::Ack { id: ID.into(), publish: None },
                ClientFrame::Nak { id: OTHER.into(), delay_ms: Some(500) }
            ]
        );
    }

    #[test]
    fn a_request_with_one_bad_verdict_is_refused_whole() {
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"ack": ["not-an-id"]}),
            serde_json::json!({"ack": [ID], "term": [ID]}),
            serde_json::json!({"ack": [ID], "nak": [{"id": OTHER, "delay_ms": 900_001}]}),
            serde_json::json!({"ack": [ID.to_uppercase()]}),
        ] {
            assert!(frames_of(request(bad.clone())).is_err(), "{bad}");
        }
        let too_many: Vec<String> = (0..=MAX_BATCH as u64).map(|n| format!("0123456789abcdef{n:016x}")).collect();
        assert!(frames_of(request(serde_json::json!({"ack": too_many}))).is_err());
        assert!(serde_json::from_value::<AckRequest>(serde_json::json!({"acks": [ID]})).is_err(), "unknown field");
    }

    #[test]
    fn an_ack_entry_is_an_id_or_an_id_with_outputs() {
        let outputs = serde_json::json!({"stream": "PAYMENTS", "key": "k", "data": {"n": 1.50}});
        let frames = frames_of(request(serde_json::json!({"ack": [ID, {"id": OTHER, "publish": [outputs]}]}))).unwrap();
        assert_eq!(frames[0], ClientFrame::Ack { id: ID.into(), publish: None });
        let ClientFrame::Ack { id, publish: Some(publish) } = &frames[1] else { panic!("{:?}", frames[1]) };
        assert_eq!((id.as_str(), publish[0].data.as_ref().unwrap().get()), (OTHER, r#"{"n":1.5}"#));
        for bad in [
            serde_json::json!({"ack": [{"id": ID}]}),
            serde_json::json!({"ack": [{"id": ID, "publish": [], "x": 1}]}),
            serde_json::json!({"ack": [7]}),
        ] {
            assert!(serde_json::from_value::<AckRequest>(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn visibility_stays_within_the_ack_wait() {
        let options = StartOptions {
            max_attempts: 10,
            max_in_flight: None,
            subscriber: None,
            ack_wait: Duration::from_secs(5),
            idle_after: Duration::from_secs(5),
            outputs: Vec::new(),
        };
        assert_eq!(visibility(None, &options).unwrap(), Duration::from_secs(5));
        assert_eq!(visibility(Some(1), &options).unwrap(), Duration::from_millis(1));
        assert!(visibility(Some(0), &options).is_err());
        assert!(visibility(Some(5001), &options).is_err());
        assert!(Batch::of(Some(0), None).is_err());
        assert!(Batch::of(Some(1001), None).is_err());
        assert!(Batch::of(None, Some(60_001)).is_err());
    }
}
