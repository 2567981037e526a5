//! Pin, assignment and verdict events: published on NATS subjects
//! `keygate.events.<stream>.<group>.<member>.<type>` (so every replica's
//! `/v1/events` sees every replica's events) and kept on a local broadcast
//! for in-process listeners.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::sync::broadcast;
use utoipa::ToSchema;

use crate::names::MemberRef;

/// Subject prefix of events.
pub const SUBJECT_PREFIX: &str = "keygate.events";

/// Event types (docs/architecture.md, "Events").
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
    /// An answer's outputs were stored (docs/pipelines.md); the message's
    /// `message.acked` follows.
    #[serde(rename = "message.published_outputs")]
    MessagePublishedOutputs,
    #[serde(rename = "partition.blocked")]
    PartitionBlocked,
    #[serde(rename = "partition.unblocked")]
    PartitionUnblocked,
    #[serde(rename = "key.blocked")]
    KeyBlocked,
    #[serde(rename = "key.unblocked")]
    KeyUnblocked,
    #[serde(rename = "member.paused")]
    MemberPaused,
    #[serde(rename = "member.resumed")]
    MemberResumed,
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
            Self::MessagePublishedOutputs => "message.published_outputs",
            Self::PartitionBlocked => "partition.blocked",
            Self::PartitionUnblocked => "partition.unblocked",
            Self::KeyBlocked => "key.blocked",
            Self::KeyUnblocked => "key.unblocked",
            Self::MemberPaused => "member.paused",
            Self::MemberResumed => "member.resumed",
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
    /// The key concerned (key events; `null` for a keyless message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
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
    /// Who paused or resumed the member (pause events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// `message.published_outputs`: the outputs stored now, and those an
    /// earlier delivery of the message had stored (duplicates dropped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs_stored: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs_duplicates: Option<u64>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub time: OffsetDateTime,
}

/// Who an event is about, and the keygate instance that saw it.
#[derive(Debug, Clone, Copy)]
pub struct About<'a> {
    pub who: &'a MemberRef,
    pub instance: &'a str,
}

/// The message a verdict event is about.
#[derive(Debug, Clone, Copy)]
pub struct MessageAt {
    pub partition: u32,
    /// The stream sequence (the origin stream's, for an elastic group's copy).
    pub seq: u64,
    pub attempt: u64,
}

impl Event {
    fn about(about: About<'_>, event_type: EventType) -> Self {
        Self {
            event_type,
            stream: about.who.stream.to_string(),
            group: about.who.group.to_string(),
            member: about.who.member.to_string(),
            partition: None,
            key: None,
            seq: None,
            instance: about.instance.to_owned(),
            attempt: None,
            delay_ms: None,
            reason: None,
            partitions: None,
            pin_id: None,
            fencing_token: None,
            by: None,
            outputs_stored: None,
            outputs_duplicates: None,
            time: OffsetDateTime::now_utc(),
        }
    }

    fn about_message(about: About<'_>, event_type: EventType, at: MessageAt, reason: &str) -> Self {
        Self {
            partition: Some(at.partition),
            seq: Some(at.seq),
            attempt: Some(at.attempt),
            reason: Some(reason.to_owned()),
            ..Self::about(about, event_type)
        }
    }

    /// The instance holds the member's pin; `fencing_token` is `None` while
    /// it could not be raised (nothing is delivered until it is).
    pub fn member_pinned(about: About<'_>, pin_id: String, fencing_token: Option<u64>, partitions: Vec<u32>) -> Self {
        Self {
            pin_id: Some(pin_id),
            fencing_token,
            partitions: Some(partitions),
            ..Self::about(about, EventType::MemberPinned)
        }
    }

    pub fn member_unpinned(about: About<'_>, reason: &str) -> Self {
        Self { reason: Some(reason.to_owned()), ..Self::about(about, EventType::MemberUnpinned) }
    }

    /// An operator paused the member: its instances stop pulling everywhere.
    pub fn member_paused(about: About<'_>, by: &str, reason: Option<&str>) -> Self {
        Self {
            by: Some(by.to_owned()),
            reason: reason.map(str::to_owned),
            ..Self::about(about, EventType::MemberPaused)
        }
    }

    pub fn member_resumed(about: About<'_>, by: &str) -> Self {
        Self { by: Some(by.to_owned()), ..Self::about(about, EventType::MemberResumed) }
    }

    /// Another instance holds the pin; this one waits.
    pub fn member_standby(about: About<'_>) -> Self {
        Self::about(about, EventType::MemberStandby)
    }

    pub fn assignment_changed(about: About<'_>, partitions: Vec<u32>) -> Self {
        Self { partitions: Some(partitions), ..Self::about(about, EventType::AssignmentChanged) }
    }

    pub fn message_acked(about: About<'_>, at: MessageAt, reason: &str) -> Self {
        Self::about_message(about, EventType::MessageAcked, at, reason)
    }

    /// The answer's outputs are stored: `stored` now, `duplicates` by an
    /// earlier delivery of the same message.
    pub fn message_published_outputs(about: About<'_>, at: MessageAt, stored: usize, duplicates: usize) -> Self {
        Self {
            outputs_stored: Some(stored as u64),
            outputs_duplicates: Some(duplicates as u64),
            ..Self::about_message(about, EventType::MessagePublishedOutputs, at, "outputs stored before the ack")
        }
    }

    /// The message comes back after `delay`.
    pub fn message_naked(about: About<'_>, at: MessageAt, delay: std::time::Duration, reason: &str) -> Self {
        Self {
            delay_ms: Some(delay.as_millis() as u64),
            ..Self::about_message(about, EventType::MessageNaked, at, reason)
        }
    }

    pub fn message_terminated(about: About<'_>, at: MessageAt, reason: &str) -> Self {
        Self::about_message(about, EventType::MessageTerminated, at, reason)
    }

    pub fn message_dead_lettered(about: About<'_>, at: MessageAt, reason: &str) -> Self {
        Self::about_message(about, EventType::MessageDeadLettered, at, reason)
    }

    /// The partition's head failed; nothing behind it goes until it passes.
    pub fn partition_blocked(about: About<'_>, partition: u32, seq: u64, attempt: u64, reason: &str) -> Self {
        Self {
            partition: Some(partition),
            seq: Some(seq),
            attempt: Some(attempt),
            reason: Some(reason.to_owned()),
            ..Self::about(about, EventType::PartitionBlocked)
        }
    }

    /// The head passed (acked, skipped, or gone from the stream: `reason`).
    pub fn partition_unblocked(about: About<'_>, partition: u32, seq: u64, reason: Option<&str>) -> Self {
        Self {
            partition: Some(partition),
            seq: Some(seq),
            reason: reason.map(str::to_owned),
            ..Self::about(about, EventType::PartitionUnblocked)
        }
    }

    /// Under key ordering, a key's head failed; the key's later messages
    /// wait, the partition's other keys go on.
    pub fn key_blocked(
        about: About<'_>,
        partition: u32,
        key: Option<&str>,
        seq: u64,
        attempt: u64,
        reason: &str,
    ) -> Self {
        Self {
            key: key.map(str::to_owned),
            event_type: EventType::KeyBlocked,
            ..Self::partition_blocked(about, partition, seq, attempt, reason)
        }
    }

    /// The key's head passed (acked, skipped, or gone from the stream: `reason`).
    pub fn key_unblocked(about: About<'_>, partition: u32, key: Option<&str>, seq: u64, reason: Option<&str>) -> Self {
        Self {
            key: key.map(str::to_owned),
            event_type: EventType::KeyUnblocked,
            ..Self::partition_unblocked(about, partition, seq, reason)
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
        use crate::names::{GroupName, MemberName, StreamName};
        let who = MemberRef {
            stream: StreamName::parse("ORDERS").unwrap(),
            group: GroupName::parse("g").unwrap(),
            member: MemberName::parse("m1").unwrap(),
            owner: Default::default(),
        };
        let about = About { who: &who, instance: "i1" };
        let at = MessageAt { partition: 3, seq: 9, attempt: 2 };
        let e = Event::message_naked(about, at, std::time::Duration::from_millis(500), "503");
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["type"], "message.naked");
        assert_eq!(json["partition"], 3);
        assert_eq!(json["delay_ms"], 500);
        assert_eq!(json["attempt"], 2);
        assert_eq!(json["instance"], "i1");
        assert_eq!(e.subject(), "keygate.events.ORDERS.g.m1.message.naked");
        assert_eq!(subject_filter(Some("ORDERS"), None, None), "keygate.events.ORDERS.*.*.>");
    }
}
