//! The WebSocket protocol's frames: what keygate sends a member's
//! connection and what it reads back (docs/architecture.md, "WebSocket
//! protocol").

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::batch_verdict::{ItemResult, ItemStatus};
use super::message::{forwardable, Delivered};
use super::outputs::OutputMessage;
use crate::events::Event;
use crate::names::MemberRef;

/// What keygate sends.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    Message(Box<MessageFrame>),
    /// Several messages at once, for a connection that joined with `batch`
    /// (docs/batched-deliveries.md): each lane's messages in order.
    Batch {
        messages: Vec<MessageFrame>,
    },
    /// This connection holds the member's pin: messages of these partitions come here.
    Pinned {
        partitions: Vec<u32>,
        fencing_token: Option<u64>,
        instance: String,
    },
    /// Another connection (or webhook) of the member holds the pin.
    Standby {
        partitions: Vec<u32>,
    },
    /// Partitions the member gained.
    Assigned {
        partitions: Vec<u32>,
    },
    /// Partitions the member lost.
    Revoked {
        partitions: Vec<u32>,
    },
    /// One of the member's events (`/v1/events` shape).
    Event {
        event: Box<RawValue>,
    },
    /// A frame keygate could not act on.
    Error {
        error: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        id: Option<String>,
    },
}

/// One message, with the fields docs/architecture.md ("WebSocket protocol") lists.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MessageFrame {
    /// Stable across redeliveries (the webhook-id): `<stream>-<sequence>`.
    pub id: String,
    pub stream: String,
    pub group: String,
    pub member: String,
    /// The subject without the partition token.
    pub subject: String,
    pub key: Option<String>,
    pub partition: u32,
    pub stream_seq: u64,
    /// 1 on first delivery.
    pub attempt: u64,
    pub fencing_token: u64,
    pub headers: BTreeMap<String, String>,
    /// The payload when it is JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<serde_json::Value>)]
    pub data: Option<Box<RawValue>>,
    /// The payload, base64, when it is not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
}

/// What the client sends (and, for pull clients, what one replica
/// forwards to the replica that delivered the message). Read through
/// [`FrameFields`]: serde reads an internally tagged enum from a buffered
/// copy of its fields, from which an output's payload (kept as the text
/// given, a `RawValue`) cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", try_from = "FrameFields")]
pub enum ClientFrame {
    Ack {
        id: String,
        /// Messages to publish before the ack, as a pipeline stage's
        /// webhook answers them (docs/pipelines.md).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        publish: Option<Vec<OutputMessage>>,
    },
    Nak {
        id: String,
        delay_ms: Option<u64>,
    },
    Term {
        id: String,
    },
    Progress {
        id: String,
    },
}

/// A verdict frame's fields as sent, before they are checked to fit its type.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FrameFields {
    #[serde(rename = "type")]
    kind: FrameKind,
    id: String,
    #[serde(default)]
    delay_ms: Option<u64>,
    #[serde(default)]
    publish: Option<Vec<OutputMessage>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum FrameKind {
    Ack,
    Nak,
    Term,
    Progress,
}

impl TryFrom<FrameFields> for ClientFrame {
    type Error = &'static str;

    fn try_from(fields: FrameFields) -> Result<Self, Self::Error> {
        let FrameFields { kind, id, delay_ms, publish } = fields;
        if delay_ms.is_some() && !matches!(kind, FrameKind::Nak) {
            return Err("delay_ms belongs to a nak");
        }
        if publish.is_some() && !matches!(kind, FrameKind::Ack) {
            return Err("publish belongs to an ack");
        }
        Ok(match kind {
            FrameKind::Ack => Self::Ack { id, publish },
            FrameKind::Nak => Self::Nak { id, delay_ms },
            FrameKind::Term => Self::Term { id },
            FrameKind::Progress => Self::Progress { id },
        })
    }
}

impl ClientFrame {
    /// The delivery it names: a message id on a WebSocket, an ack id from a fetch.
    pub fn id(&self) -> &str {
        match self {
            Self::Ack { id, .. } | Self::Nak { id, .. } | Self::Term { id } | Self::Progress { id } => id,
        }
    }
}

impl From<ItemResult> for ClientFrame {
    fn from(result: ItemResult) -> Self {
        let id = result.id;
        match result.status {
            ItemStatus::Ack => Self::Ack { id, publish: result.publish },
            ItemStatus::Retry => Self::Nak { id, delay_ms: result.delay_ms },
            ItemStatus::Dead => Self::Term { id },
        }
    }
}

/// Verdicts for several messages in one WebSocket frame, in the shape a
/// batched webhook answers: `{"type":"results","results":[{"id","status":
/// "ack"|"retry"|"dead","delay_ms"}]}`.
/// A plain struct, not a tagged enum, for the reason [`ClientFrame`] says.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultsFrame {
    #[serde(rename = "type")]
    _kind: ResultsKind,
    results: Vec<ItemResult>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ResultsKind {
    Results,
}

/// The verdicts a WebSocket client's text frame carries: one (`ack`,
/// `nak`, `term`, `progress`), or several (`results`).
pub fn client_frames(text: &str) -> Result<Vec<ClientFrame>, serde_json::Error> {
    let one = match serde_json::from_str::<ClientFrame>(text) {
        Ok(frame) => return Ok(vec![frame]),
        Err(e) => e,
    };
    match serde_json::from_str::<ResultsFrame>(text) {
        Ok(ResultsFrame { results, .. }) => match results.iter().find(|r| r.publish_without_ack()) {
            Some(result) => Err(serde::de::Error::custom(format!(
                "result for {:?} carries a publish list with a status other than ack",
                result.id.chars().take(64).collect::<String>()
            ))),
            None => Ok(results.into_iter().map(ClientFrame::from).collect()),
        },
        // Not a results frame either: the single verdict's complaint is the
        // one that helps.
        Err(_) if !text.contains("\"results\"") => Err(one),
        Err(e) => Err(e),
    }
}

/// The message frame of a delivery.
pub fn message_frame(who: &MemberRef, held: &Delivered, fencing_token: u64) -> MessageFrame {
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    if let Some(original) = &held.message.headers {
        for (name, values) in original.iter() {
            let name: &str = name.as_ref();
            if !forwardable(name) {
                continue;
            }
            let joined = values.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", ");
            headers.insert(name.to_owned(), joined);
        }
    }
    let payload = &held.message.payload;
    let data = serde_json::from_slice::<Box<RawValue>>(payload).ok();
    let data_base64 = data.is_none().then(|| base64::engine::general_purpose::STANDARD.encode(payload));
    MessageFrame {
        id: format!("{}-{}", held.origin_stream, held.origin_seq),
        stream: who.stream.to_string(),
        group: who.group.to_string(),
        member: who.member.to_string(),
        subject: held.subject.clone(),
        key: held.key.clone(),
        partition: held.partition,
        stream_seq: held.origin_seq,
        attempt: held.attempt,
        fencing_token,
        headers,
        data,
        data_base64,
    }
}

impl ServerFrame {
    /// An event frame from the JSON of an event.
    pub fn event_from_json(json: &[u8]) -> Option<Self> {
        let event: Box<RawValue> = serde_json::from_slice(json).ok()?;
        Some(Self::Event { event })
    }

    /// An event frame from an event of this process.
    pub fn event(event: &Event) -> Option<Self> {
        Self::event_from_json(&serde_json::to_vec(event).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_frames_parse_as_the_protocol_names_them() {
        let parse = |s: &str| serde_json::from_str::<ClientFrame>(s);
        assert_eq!(
            parse(r#"{"type":"ack","id":"S-1"}"#).unwrap(),
            ClientFrame::Ack { id: "S-1".into(), publish: None }
        );
        let with_outputs = parse(r#"{"type":"ack","id":"S-1","publish":[{"stream":"P","key":"k","data":{"n":1}}]}"#);
        let Ok(ClientFrame::Ack { publish: Some(publish), .. }) = with_outputs else { panic!("{with_outputs:?}") };
        assert_eq!((publish[0].stream.as_str(), publish[0].data.as_ref().unwrap().get()), ("P", r#"{"n":1}"#));
        assert_eq!(
            parse(r#"{"type":"nak","id":"S-1","delay_ms":500}"#).unwrap(),
            ClientFrame::Nak { id: "S-1".into(), delay_ms: Some(500) }
        );
        assert_eq!(
            parse(r#"{"type":"nak","id":"S-1"}"#).unwrap(),
            ClientFrame::Nak { id: "S-1".into(), delay_ms: None }
        );
        assert_eq!(parse(r#"{"type":"term","id":"S-1"}"#).unwrap(), ClientFrame::Term { id: "S-1".into() });
        assert_eq!(parse(r#"{"type":"progress","id":"S-1"}"#).unwrap(), ClientFrame::Progress { id: "S-1".into() });
        assert!(parse(r#"{"type":"ack"}"#).is_err());
        assert!(parse(r#"{"type":"nack","id":"S-1"}"#).is_err());
        assert!(parse(r#"{"type":"ack","id":"S-1","extra":1}"#).is_err());
    }

    #[test]
    fn a_results_frame_carries_a_verdict_per_message() {
        let frames = client_frames(
            r#"{"type":"results","results":[{"id":"S-1","status":"ack"},
                {"id":"S-2","status":"retry","delay_ms":500},{"id":"S-3","status":"dead"}]}"#,
        )
        .unwrap();
        assert_eq!(
            frames,
            vec![
                ClientFrame::Ack { id: "S-1".into(), publish: None },
                ClientFrame::Nak { id: "S-2".into(), delay_ms: Some(500) },
                ClientFrame::Term { id: "S-3".into() },
            ]
        );
        assert_eq!(
            client_frames(r#"{"type":"ack","id":"S-1"}"#).unwrap(),
            vec![ClientFrame::Ack { id: "S-1".into(), publish: None }]
        );
        let complaint = |s: &str| client_frames(s).unwrap_err().to_string();
        assert!(complaint(r#"{"type":"results","results":[{"id":"S-1","status":"maybe"}]}"#).contains("maybe"));
        assert!(complaint(r#"{"type":"results","results":[],"extra":1}"#).contains("extra"));
        assert!(complaint(r#"{"type":"ack"}"#).contains("id"), "a single verdict's own complaint");
    }

    #[test]
    fn status_frames_serialize_with_their_type() {
        let frame = ServerFrame::Pinned { partitions: vec![0, 2], fencing_token: Some(7), instance: "kg".into() };
        assert_eq!(
            serde_json::to_string(&frame).unwrap(),
            r#"{"type":"pinned","partitions":[0,2],"fencing_token":7,"instance":"kg"}"#
        );
        let error = ServerFrame::Error { error: "bad".into(), id: None };
        assert_eq!(serde_json::to_string(&error).unwrap(), r#"{"type":"error","error":"bad"}"#);
        let event = ServerFrame::event_from_json(br#"{"type":"message.acked","seq":3}"#).unwrap();
        assert_eq!(
            serde_json::to_string(&event).unwrap(),
            r#"{"type":"event","event":{"type":"message.acked","seq":3}}"#
        );
    }
}
