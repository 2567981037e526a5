//! Pin, assignment and verdict events: published on NATS subjects
//! `keygate.events.<stream>.<group>.<member>.<type>` (so every replica's
//! `/v1/events` sees every replica's events) and kept on a local broadcast
//! for in-process listeners.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::sync::broadcast;
use utoipa::ToSchema;

/// Subject prefix of events.
pub const SUBJECT_PREFIX: &str = "keygate.events";

/// Event types (docs/design.md, "Events").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub enum EventType {
    #[serde(rename = "member.pinned")]
    MemberPinned,
    #[serde(rename = "member.unpinned")]
    MemberUnpinned,
    #[serde(rename = "member.standby")]
    MemberStandby,
    #[serde(rename = "assignment.changed")]
    AssignmentChanged,
    #[serde(rename = "message.acked")]
    MessageAcked,
    #[serde(rename = "message.naked")]
    MessageNaked,
    #[serde(rename = "message.terminated")]
    MessageTerminated,
    #[serde(rename = "message.dead_lettered")]
    MessageDeadLettered,
    #[serde(rename = "partition.blocked")]
    PartitionBlocked,
    #[serde(rename = "partition.unblocked")]
    PartitionUnblocked,
}

impl EventType {
    /// The name used in subjects and payloads.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MemberPinned => "member.pinned",
            Self::MemberUnpinned => "member.unpinned",
            Self::MemberStandby => "member.standby",
            Self::AssignmentChanged => "assignment.changed",
            Self::MessageAcked => "message.acked",
            Self::MessageNaked => "message.naked",
            Self::MessageTerminated => "message.terminated",
            Self::MessageDeadLettered => "message.dead_lettered",
            Self::PartitionBlocked => "partition.blocked",
            Self::PartitionUnblocked => "partition.unblocked",
        }
    }
}

/// One event.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Event {
    #[serde(rename = "type")]
    pub event_type: EventType,
    pub stream: String,
    pub group: String,
    pub member: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<u32>,
    /// Stream sequence of the message concerned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// The keygate instance that saw it.
    pub instance: String,
    /// Delivery attempt (the server's delivery count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u64>,
    /// NAK delay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// Why (verdict reason, unpin reason).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Partitions (assignment, pin events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<Vec<u32>>,
    /// The pin id (pin events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin_id: Option<String>,
    /// Fencing token (pin events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<u64>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub time: OffsetDateTime,
}

impl Event {
    /// An event of `event_type` about a member, stamped now.
    pub fn new(event_type: EventType, stream: &str, group: &str, member: &str, instance: &str) -> Self {
        Self {
            event_type,
            stream: stream.to_owned(),
            group: group.to_owned(),
            member: member.to_owned(),
            partition: None,
            seq: None,
            instance: instance.to_owned(),
            attempt: None,
            delay_ms: None,
            reason: None,
            partitions: None,
            pin_id: None,
            fencing_token: None,
            time: OffsetDateTime::now_utc(),
        }
    }

    /// The NATS subject it is published on.
    pub fn subject(&self) -> String {
        format!("{SUBJECT_PREFIX}.{}.{}.{}.{}", self.stream, self.group, self.member, self.event_type.as_str())
    }
}

/// The subject filter for `/v1/events?stream=&group=&member=`.
pub fn subject_filter(stream: Option<&str>, group: Option<&str>, member: Option<&str>) -> String {
    format!("{SUBJECT_PREFIX}.{}.{}.{}.>", stream.unwrap_or("*"), group.unwrap_or("*"), member.unwrap_or("*"))
}

/// Fans events out to NATS and local listeners.
#[derive(Clone)]
pub struct EventBus {
    outbound: tokio::sync::mpsc::Sender<Event>,
    local: broadcast::Sender<Event>,
}

/// Events waiting for NATS; past this, new ones are dropped (events are
/// notifications: delivery never waits for them).
const OUTBOUND_CAPACITY: usize = 16_384;

impl EventBus {
    /// A bus publishing through `nats` (from one task, in order).
    pub fn new(nats: async_nats::Client) -> Self {
        let (local, _) = broadcast::channel(4096);
        let (outbound, mut queue) = tokio::sync::mpsc::channel::<Event>(OUTBOUND_CAPACITY);
        tokio::spawn(async move {
            while let Some(event) = queue.recv().await {
                let Ok(payload) = serde_json::to_vec(&event) else { continue };
                if let Err(e) = nats.publish(event.subject(), payload.into()).await {
                    tracing::debug!(error = %e, "publishing event");
                }
            }
        });
        Self { outbound, local }
    }

    /// Publishes an event (best effort: events are notifications, not data).
    pub fn emit(&self, event: Event) {
        tracing::debug!(event = event.event_type.as_str(), stream = %event.stream, group = %event.group, member = %event.member, partition = ?event.partition, seq = ?event.seq, "event");
        if self.local.receiver_count() > 0 {
            let _ = self.local.send(event.clone());
        }
        if self.outbound.try_send(event).is_err() {
            tracing::debug!("event queue full: event dropped");
        }
    }

    /// Local events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.local.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_with_their_dotted_type_and_subject() {
        let mut e = Event::new(EventType::MessageNaked, "ORDERS", "g", "m1", "i1");
        e.partition = Some(3);
        e.delay_ms = Some(500);
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["type"], "message.naked");
        assert_eq!(json["partition"], 3);
        assert_eq!(e.subject(), "keygate.events.ORDERS.g.m1.message.naked");
        assert_eq!(subject_filter(Some("ORDERS"), None, None), "keygate.events.ORDERS.*.*.>");
    }
}
