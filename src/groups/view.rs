//! What the API answers about groups.

use serde::Serialize;
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::spec::{GroupKind, Ordering, PartitioningFilterSpec};

/// A group: its configuration, who owns which partition, and live state.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct GroupView {
    pub stream: String,
    pub group: String,
    pub kind: GroupKind,
    /// The partition count.
    pub partitions: u32,
    /// Balanced members as configured (a set; order is not meaningful).
    pub members: Vec<String>,
    /// Explicit mappings, when the group uses them.
    pub mappings: Option<Vec<OwnedPartitions>>,
    /// Static: the subject filters members consume.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filters: Option<Vec<String>>,
    /// Elastic: the partitioning filters (`null` when every subject is hashed whole).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitioning_filters: Option<Option<Vec<PartitioningFilterSpec>>>,
    /// Elastic: the work-queue stream's message cap (0: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_buffered_msgs: Option<i64>,
    /// Elastic: the work-queue stream's byte cap (0: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_buffered_bytes: Option<i64>,
    /// Elastic: the work-queue stream members consume from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub work_queue_stream: Option<String>,
    /// Ack wait of member consumers, in milliseconds (also the pin's TTL).
    pub ack_wait_ms: u64,
    /// What the group keeps in order: each key, or each whole partition.
    pub ordering: Ordering,
    /// Revision of the configuration in its KV bucket (for compare-and-set).
    pub revision: u64,
    /// The configuration exactly as stored in the pcgroups KV bucket.
    #[schema(value_type = Object)]
    pub config: serde_json::Value,
    /// Per member: its partitions, its consumer and who holds its pin.
    pub assignment: Vec<MemberState>,
    /// Messages not yet acknowledged, per partition.
    pub partition_pending: Vec<PartitionPending>,
    /// Lanes whose head message is retrying (whole partitions, or keys under
    /// key ordering), as the keygate instances holding the pins report
    /// them: at most 100 per member, oldest first.
    pub blocked: Vec<BlockedView>,
    /// How many lanes are blocked in all (`blocked` may list fewer).
    pub blocked_total: usize,
}

/// A partition, or one key of it, whose head message is retrying.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BlockedView {
    pub partition: u32,
    /// The blocked key (key ordering); `null` for a whole partition or a keyless message.
    pub key: Option<String>,
    pub member: String,
    /// Stream sequence of the head message.
    pub seq: u64,
    /// When its first attempt failed.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub since: OffsetDateTime,
    /// Attempts so far.
    pub attempts: u64,
    /// What the endpoint said last.
    pub last_error: String,
}

/// One member's share of a group and its consumer's live state.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MemberState {
    pub member: String,
    /// Partitions it owns, in filter order.
    pub partitions: Vec<u32>,
    /// Its consumer's name.
    pub consumer: String,
    /// Whether its consumer exists.
    pub consumer_exists: bool,
    /// pcgroups' notion of active: static, the consumer has waiting pulls;
    /// elastic, the consumer exists.
    pub active: bool,
    /// Pull requests waiting on the consumer (instances currently pulling).
    pub waiting_pulls: usize,
    /// Where the pin stands, and so why no instance may be delivering.
    pub pin: PinStatus,
    /// The pinned instance's id, if one holds the pin.
    pub pinned_client_id: Option<String>,
    /// Since when it holds the pin.
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub pinned_since: Option<OffsetDateTime>,
    /// Messages matching its filters not yet delivered.
    pub num_pending: u64,
    /// Messages delivered and not yet acknowledged.
    pub num_ack_pending: usize,
    /// The keygate instance delivering for this member (when keygate holds the pin).
    pub serving_instance: Option<String>,
    /// The fencing token of its current ownership.
    pub fencing_token: Option<u64>,
    /// keygate instances serving the member (webhook replicas, WebSocket
    /// connections): the pinned one first, then its standbys.
    pub instances: Vec<InstanceState>,
    /// Who paused the member, when and why; `null` when it is not paused.
    pub paused: Option<crate::pauses::Pause>,
}

/// Where a member's pin stands, as the view can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PinStatus {
    /// A keygate instance holds it and delivers (`serving_instance`).
    Held,
    /// A client holds it that no keygate replica reports: a pcgroups client,
    /// or a keygate whose report is not in yet.
    HeldElsewhere,
    /// Nobody holds it while instances are there: the server pins one of
    /// them with the next message (after pin balancing stepped it down, or
    /// while the member is idle).
    FreeUntilNextDelivery,
    /// Nobody holds it and no instance pulls: nothing serves the member.
    NoInstance,
    /// The member is paused: its instances pull nothing, so none holds it.
    Paused,
}

impl MemberState {
    /// Where the pin stands, from what the view holds.
    pub fn pin_status(&self) -> PinStatus {
        if self.paused.is_some() {
            return PinStatus::Paused;
        }
        match (&self.pinned_client_id, &self.serving_instance) {
            (Some(_), Some(_)) => PinStatus::Held,
            (Some(_), None) => PinStatus::HeldElsewhere,
            (None, _) if self.waiting_pulls > 0 || !self.instances.is_empty() => PinStatus::FreeUntilNextDelivery,
            (None, _) => PinStatus::NoInstance,
        }
    }
}

/// One keygate instance of a member.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct InstanceState {
    /// The keygate process (`--instance-id`).
    pub instance: String,
    /// Tells apart several instances in one process (WebSocket connections).
    pub session: u64,
    pub pinned: bool,
    /// Streams its endpoint's answers may publish to (docs/pipelines.md);
    /// empty when it publishes nothing.
    pub outputs: Vec<String>,
}

/// Backlog of one partition.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PartitionPending {
    pub partition: u32,
    /// The member owning it (none when no member does).
    pub member: Option<String>,
    /// Messages not yet acknowledged by the owner (`null` when they could
    /// not be counted).
    pub pending: Option<u64>,
}

/// A group's name and flavour.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct GroupSummary {
    pub group: String,
    pub kind: GroupKind,
}

/// A group's membership after an edit.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MembershipView {
    /// Balanced members (a set; order is not meaningful).
    pub members: Vec<String>,
    /// Explicit mappings, when the group uses them.
    pub mappings: Option<Vec<OwnedPartitions>>,
    /// Who owns which partitions now.
    pub ownership: Vec<OwnedPartitions>,
    /// The new revision of the configuration.
    pub revision: u64,
    /// What the edit did beyond what was asked, in words: setting mappings
    /// replaces the member list.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A member and partitions it owns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct OwnedPartitions {
    pub member: String,
    pub partitions: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member() -> MemberState {
        MemberState {
            member: "m1".into(),
            partitions: vec![0],
            consumer: "g-m1".into(),
            consumer_exists: true,
            active: false,
            waiting_pulls: 0,
            pin: PinStatus::NoInstance,
            pinned_client_id: None,
            pinned_since: None,
            num_pending: 0,
            num_ack_pending: 0,
            serving_instance: None,
            fencing_token: None,
            instances: Vec::new(),
            paused: None,
        }
    }

    #[test]
    fn the_pin_status_says_who_holds_it_or_why_nobody_does() {
        let pinned = MemberState { pinned_client_id: Some("p".into()), ..member() };
        assert_eq!(pinned.pin_status(), PinStatus::HeldElsewhere);
        let served = MemberState { serving_instance: Some("kg-a".into()), ..pinned.clone() };
        assert_eq!(served.pin_status(), PinStatus::Held);
        assert_eq!(member().pin_status(), PinStatus::NoInstance);
        let pulling = MemberState { waiting_pulls: 2, ..member() };
        assert_eq!(pulling.pin_status(), PinStatus::FreeUntilNextDelivery);
        let standing_by = MemberState {
            instances: vec![InstanceState { instance: "kg-a".into(), session: 1, pinned: false, outputs: vec![] }],
            ..member()
        };
        assert_eq!(standing_by.pin_status(), PinStatus::FreeUntilNextDelivery, "held-back standbys pull nothing");
        let paused = crate::pauses::Pause::by("ops".into(), None);
        assert_eq!(MemberState { paused: Some(paused), ..served }.pin_status(), PinStatus::Paused);
    }
}
