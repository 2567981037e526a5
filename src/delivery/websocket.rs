//! A WebSocket connection as a member's endpoint: the frames keygate sends
//! and reads (docs/design.md, "WebSocket protocol"), and the deliveries waiting
//! for the client's verdict.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::verdict::{Judgement, Verdict};
use super::webhook::Backoff;
use crate::events::Event;
use crate::member::deliver::{forwardable, Delivered, Held};
use crate::member::instance::MemberRef;

/// What keygate sends.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    Message(Box<MessageFrame>),
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

/// One message, as docs/design.md lists its fields.
#[derive(Debug, Serialize)]
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
    pub data: Option<Box<RawValue>>,
    /// The payload, base64, when it is not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
}

/// What the client sends.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientFrame {
    Ack { id: String },
    Nak { id: String, delay_ms: Option<u64> },
    Term { id: String },
    Progress { id: String },
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

/// A delivery waiting for the client's verdict.
struct Awaiting {
    verdict: oneshot::Sender<ClientFrame>,
    message: Held,
}

/// One WebSocket connection serving one instance of a member.
pub struct SocketEndpoint {
    /// Message frames: bounded, so a client that stops reading makes its
    /// partitions wait instead of growing keygate's memory. Boxed: an idle
    /// channel then costs pointers, not frames.
    messages: mpsc::Sender<Box<ServerFrame>>,
    /// Pin and assignment frames: bounded, never waited on.
    status: mpsc::Sender<Box<ServerFrame>>,
    awaiting: Mutex<HashMap<String, Awaiting>>,
    /// Cancelled when the connection ends: waiting deliveries give up.
    closed: CancellationToken,
    pub max_attempts: u64,
    pub backoff: Backoff,
}

impl SocketEndpoint {
    pub fn new(
        messages: mpsc::Sender<Box<ServerFrame>>,
        status: mpsc::Sender<Box<ServerFrame>>,
        closed: CancellationToken,
        max_attempts: u64,
        backoff: Backoff,
    ) -> Self {
        Self { messages, status, awaiting: Mutex::default(), closed, max_attempts, backoff }
    }

    fn awaiting(&self) -> std::sync::MutexGuard<'_, HashMap<String, Awaiting>> {
        self.awaiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sends the message and waits for the client's ack, NAK or term. The
    /// client may take as long as it likes while the connection lives
    /// (keygate keeps the message alive); a closed connection is a NAK
    /// without delay, so the message goes to the next holder at once.
    pub async fn call(&self, who: &MemberRef, held: &Held, fencing_token: u64) -> Judgement {
        let frame = message_frame(who, held, fencing_token);
        let id = frame.id.clone();
        let (tx, rx) = oneshot::channel();
        self.awaiting().insert(id.clone(), Awaiting { verdict: tx, message: held.clone() });
        let closed = || Judgement {
            verdict: Verdict::Nak { delay: Some(Duration::ZERO) },
            gone: false,
            reason: "the WebSocket closed before a verdict".into(),
        };
        let sent = tokio::select! {
            sent = self.messages.send(Box::new(ServerFrame::Message(Box::new(frame)))) => sent.is_ok(),
            () = self.closed.cancelled() => false,
        };
        if !sent {
            self.awaiting().remove(&id);
            return closed();
        }
        let answer = tokio::select! {
            answer = rx => answer.ok(),
            () = self.closed.cancelled() => None,
        };
        self.awaiting().remove(&id);
        match answer {
            Some(ClientFrame::Ack { .. }) => Judgement { verdict: Verdict::Ack, gone: false, reason: "acked".into() },
            // Capped like a webhook's Retry-After: a huge delay would hold
            // the partition (and every later holder's barrier) for ever.
            Some(ClientFrame::Nak { delay_ms, .. }) => Judgement {
                verdict: Verdict::Nak {
                    delay: delay_ms.map(|ms| Duration::from_millis(ms).min(super::webhook::MAX_RETRY_AFTER)),
                },
                gone: false,
                reason: "NAK'd by the client".into(),
            },
            Some(ClientFrame::Term { .. }) => {
                Judgement { verdict: Verdict::Term, gone: false, reason: "terminated by the client".into() }
            }
            Some(ClientFrame::Progress { .. }) | None => closed(),
        }
    }

    /// Applies a client frame to the delivery it names.
    pub async fn settle(&self, frame: ClientFrame) -> Result<(), String> {
        let id = match &frame {
            ClientFrame::Ack { id }
            | ClientFrame::Nak { id, .. }
            | ClientFrame::Term { id }
            | ClientFrame::Progress { id } => id.clone(),
        };
        if let ClientFrame::Progress { .. } = frame {
            let message = self.awaiting().get(&id).map(|a| a.message.clone());
            return match message {
                Some(message) => {
                    let _ = message.message.ack_with(AckKind::Progress).await;
                    Ok(())
                }
                None => Err(format!("no message {id} is waiting for a verdict")),
            };
        }
        match self.awaiting().remove(&id) {
            Some(awaiting) => {
                let _ = awaiting.verdict.send(frame);
                Ok(())
            }
            None => Err(format!("no message {id} is waiting for a verdict")),
        }
    }

    /// Queues a status frame; dropped when the client has stopped reading
    /// (its liveness check closes it soon).
    pub fn notify(&self, frame: ServerFrame) {
        if self.status.try_send(Box::new(frame)).is_err() {
            tracing::debug!("status frame dropped: the WebSocket client is not reading");
        }
    }

    /// An event frame from the JSON of an event.
    pub fn event_frame(json: &[u8]) -> Option<ServerFrame> {
        let event: Box<RawValue> = serde_json::from_slice(json).ok()?;
        Some(ServerFrame::Event { event })
    }

    /// An event frame from an event of this process.
    pub fn event_frame_of(event: &Event) -> Option<ServerFrame> {
        Self::event_frame(&serde_json::to_vec(event).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_frames_parse_as_the_protocol_names_them() {
        let parse = |s: &str| serde_json::from_str::<ClientFrame>(s);
        assert_eq!(parse(r#"{"type":"ack","id":"S-1"}"#).unwrap(), ClientFrame::Ack { id: "S-1".into() });
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
    fn status_frames_serialize_with_their_type() {
        let frame = ServerFrame::Pinned { partitions: vec![0, 2], fencing_token: Some(7), instance: "kg".into() };
        assert_eq!(
            serde_json::to_string(&frame).unwrap(),
            r#"{"type":"pinned","partitions":[0,2],"fencing_token":7,"instance":"kg"}"#
        );
        let error = ServerFrame::Error { error: "bad".into(), id: None };
        assert_eq!(serde_json::to_string(&error).unwrap(), r#"{"type":"error","error":"bad"}"#);
        let event = SocketEndpoint::event_frame(br#"{"type":"message.acked","seq":3}"#).unwrap();
        assert_eq!(
            serde_json::to_string(&event).unwrap(),
            r#"{"type":"event","event":{"type":"message.acked","seq":3}}"#
        );
    }
}
