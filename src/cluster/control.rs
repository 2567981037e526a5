//! Control requests to the instance holding a member's pin (status,
//! skip, retry-now), over core NATS request/reply: every instance of the
//! member listens, only the pin holder answers.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::names::MemberRef;

/// Members' control subjects, `<prefix><stream>.<group>.<member>`.
pub const CONTROL_PREFIX: &str = "keygate.control.";

/// The subject control requests for `who` go to.
pub fn control_subject(who: &MemberRef) -> String {
    format!("{CONTROL_PREFIX}{}.{}.{}", who.stream, who.group, who.member)
}

/// A control request to the instance that holds a member's pin.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Control {
    /// Blocked partitions and counters.
    Status,
    /// Terminate a blocked lane's head (to the dead-letter stream): the
    /// partition's, or under key ordering the named key's (or the
    /// partition's only blocked key).
    Skip {
        partition: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
    },
    /// Redeliver a blocked lane's head now instead of after its delay.
    RetryNow {
        partition: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
    },
    /// Every instance of the member answers, pinned or not (who stands by).
    RollCall,
    /// Published, not requested (cluster/balance.rs): the instance of keygate
    /// `instance` steps down if it holds the pin and pulls nothing for
    /// `hold_ms`; the others remember `reason` for a pin they gain next.
    StepDown { instance: String, hold_ms: u64, reason: String },
}

/// Most blocked lanes one instance lists in its answer (the count is whole).
pub const MAX_BLOCKED_LISTED: usize = 100;

/// A blocked partition, or key of a partition, as the pinned instance reports it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BlockedPartition {
    pub partition: u32,
    /// The blocked key under key ordering (`null`: the whole partition, or a keyless message).
    #[serde(default)]
    pub key: Option<String>,
    /// Stream sequence of the head message.
    pub seq: u64,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub since: time::OffsetDateTime,
    pub attempts: u64,
    pub last_error: String,
}

/// The pinned instance's answer to a control request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ControlReply {
    pub instance: String,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Blocked lanes, oldest head first, at most [`MAX_BLOCKED_LISTED`].
    #[serde(default)]
    pub blocked: Vec<BlockedPartition>,
    /// How many lanes are blocked in all.
    #[serde(default)]
    pub blocked_total: usize,
    #[serde(default)]
    pub holding: usize,
    #[serde(default)]
    pub fencing_token: u64,
    /// Per partition, the highest sequence settled in order: a finer ack
    /// floor than the consumer's, which one blocked partition holds back.
    #[serde(default)]
    pub floors: std::collections::BTreeMap<u32, u64>,
    /// Tells apart the instances of one keygate process (WebSocket connections).
    #[serde(default)]
    pub session: u64,
    #[serde(default)]
    pub pinned: bool,
    /// Streams its endpoint's answers may publish to (docs/pipelines.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<String>,
}

/// Every instance of a member that answers within `window`: the pinned one
/// and its standbys.
pub async fn roll_call(nats: &async_nats::Client, who: &MemberRef, window: Duration) -> Vec<ControlReply> {
    use futures::StreamExt as _;
    let inbox = nats.new_inbox();
    let Ok(mut answers) = nats.subscribe(inbox.clone()).await else { return Vec::new() };
    let payload = serde_json::to_vec(&Control::RollCall).unwrap_or_default();
    if nats.publish_with_reply(control_subject(who), inbox, payload.into()).await.is_err() {
        return Vec::new();
    }
    let mut replies = Vec::new();
    let deadline = tokio::time::Instant::now() + window;
    while let Ok(Some(message)) = tokio::time::timeout_at(deadline, answers.next()).await {
        if let Ok(reply) = serde_json::from_slice::<ControlReply>(&message.payload) {
            replies.push(reply);
        }
    }
    replies.sort_by(|a, b| b.pinned.cmp(&a.pinned).then_with(|| a.instance.cmp(&b.instance)));
    replies
}

/// Asks the pinned instance of a member; `None` when no instance holds the pin.
pub async fn ask(nats: &async_nats::Client, who: &MemberRef, control: &Control) -> Option<ControlReply> {
    let payload = serde_json::to_vec(control).ok()?;
    let reply =
        tokio::time::timeout(Duration::from_millis(750), nats.request(control_subject(who), payload.into())).await;
    match reply {
        Ok(Ok(message)) => serde_json::from_slice(&message.payload).ok(),
        _ => None,
    }
}
