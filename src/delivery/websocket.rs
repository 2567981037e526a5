//! A WebSocket connection as a member's endpoint: the deliveries waiting
//! for the client's verdict (the frames are in `frames.rs`).

use super::SettleError;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::frames::{message_frame, ClientFrame, ServerFrame};
use super::message::Held;
use super::outputs::OutputMessage;
use super::verdict::Backoff;
use super::verdict::{Judgement, Verdict};
use super::BatchLimits;
use crate::names::{MemberRef, StreamName};

/// A client's judgement and the `publish` list its ack carried.
pub type ClientAnswer = (Judgement, Option<Vec<OutputMessage>>);

/// Why a delivery without a client verdict goes to the next holder.
const CLOSED: &str = "the WebSocket closed before a verdict";

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
    /// Most messages in flight to the connection at once, when the client set it.
    pub max_in_flight: Option<usize>,
    /// Messages go in `batch` frames, when the client joined with `batch`.
    pub batch: Option<BatchLimits>,
    /// Streams the client's acks may publish to (docs/pipelines.md).
    pub outputs: Vec<StreamName>,
}

impl SocketEndpoint {
    pub fn new(
        messages: mpsc::Sender<Box<ServerFrame>>,
        status: mpsc::Sender<Box<ServerFrame>>,
        closed: CancellationToken,
        max_attempts: u64,
        backoff: Backoff,
    ) -> Self {
        Self {
            messages,
            status,
            awaiting: Mutex::default(),
            closed,
            max_attempts,
            backoff,
            max_in_flight: None,
            batch: None,
            outputs: Vec::new(),
        }
    }

    fn awaiting(&self) -> std::sync::MutexGuard<'_, HashMap<String, Awaiting>> {
        self.awaiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sends the message and waits for the client's ack, NAK or term. The
    /// client may take as long as it likes while the connection lives
    /// (keygate keeps the message alive); a closed connection is a NAK
    /// without delay, so the message goes to the next holder at once.
    pub async fn call(&self, who: &MemberRef, held: &Held, fencing_token: u64) -> ClientAnswer {
        let frame = message_frame(who, held, fencing_token);
        let id = frame.id.clone();
        let (tx, rx) = oneshot::channel();
        self.awaiting().insert(id.clone(), Awaiting { verdict: tx, message: held.clone() });
        let sent = tokio::select! {
            sent = self.messages.send(Box::new(ServerFrame::Message(Box::new(frame)))) => sent.is_ok(),
            () = self.closed.cancelled() => false,
        };
        if !sent {
            self.awaiting().remove(&id);
            return client_judgement(None, CLOSED);
        }
        let answer = tokio::select! {
            answer = rx => answer.ok(),
            () = self.closed.cancelled() => None,
        };
        self.awaiting().remove(&id);
        client_judgement(answer, CLOSED)
    }

    /// Sends the messages in one `batch` frame and waits for the client's
    /// verdict on each (by id, in one `results` frame or one frame each).
    /// Judgements come in the batch's order; a closed connection is a NAK
    /// without delay for every message still waiting.
    pub async fn call_batch(&self, who: &MemberRef, batch: &[&Held], fencing_token: u64) -> Vec<ClientAnswer> {
        let mut frames = Vec::with_capacity(batch.len());
        let mut answers = Vec::with_capacity(batch.len());
        {
            let mut awaiting = self.awaiting();
            for held in batch {
                let frame = message_frame(who, held, fencing_token);
                let (tx, rx) = oneshot::channel();
                awaiting.insert(frame.id.clone(), Awaiting { verdict: tx, message: (*held).clone() });
                answers.push((frame.id.clone(), rx));
                frames.push(frame);
            }
        }
        let sent = tokio::select! {
            sent = self.messages.send(Box::new(ServerFrame::Batch { messages: frames })) => sent.is_ok(),
            () = self.closed.cancelled() => false,
        };
        let mut judgements = Vec::with_capacity(batch.len());
        for (id, answer) in answers {
            let answer = if sent {
                tokio::select! {
                    answer = answer => answer.ok(),
                    () = self.closed.cancelled() => None,
                }
            } else {
                None
            };
            self.awaiting().remove(&id);
            judgements.push(client_judgement(answer, CLOSED));
        }
        judgements
    }

    /// Applies a client frame to the delivery it names.
    pub async fn settle(&self, frame: ClientFrame) -> Result<(), SettleError> {
        let id = frame.id().to_owned();
        if let ClientFrame::Progress { .. } = frame {
            let message = self.awaiting().get(&id).map(|a| a.message.clone());
            return match message {
                Some(message) => {
                    let _ = message.message.ack_with(AckKind::Progress).await;
                    Ok(())
                }
                None => Err(SettleError::NotWaiting(id)),
            };
        }
        match self.awaiting().remove(&id) {
            Some(awaiting) => {
                let _ = awaiting.verdict.send(frame);
                Ok(())
            }
            None => Err(SettleError::NotWaiting(id)),
        }
    }

    /// Queues a status frame; dropped when the client has stopped reading
    /// (its liveness check closes it soon).
    pub fn notify(&self, frame: ServerFrame) {
        if self.status.try_send(Box::new(frame)).is_err() {
            tracing::debug!("status frame dropped: the WebSocket client is not reading");
        }
    }
}

/// A client's verdict frame (WebSocket or pull) as a judgement, with the
/// `publish` list an ack carried (held to the endpoint's declared outputs
/// where the verdict is applied, `runtime/deliver.rs`). `None`
/// (no verdict: the client went away, or its time ran out) and a bare
/// `progress` are a NAK without delay, so the message goes to the next
/// holder at once; `lost` says why.
pub fn client_judgement(answer: Option<ClientFrame>, lost: &str) -> ClientAnswer {
    let judged = |verdict, reason: &str| Judgement { verdict, gone: false, failed: false, reason: reason.into() };
    let judgement = match answer {
        Some(ClientFrame::Ack { publish, .. }) => return (judged(Verdict::Ack, "acked"), publish),
        // Capped like a webhook's Retry-After: a huge delay would hold
        // the lane (and every later holder's barrier) for ever.
        Some(ClientFrame::Nak { delay_ms, .. }) => judged(
            Verdict::Nak { delay: delay_ms.map(|ms| Duration::from_millis(ms).min(super::verdict::MAX_RETRY_AFTER)) },
            "NAK'd by the client",
        ),
        Some(ClientFrame::Term { .. }) => judged(Verdict::Term, "terminated by the client"),
        Some(ClientFrame::Progress { .. }) | None => judged(Verdict::Nak { delay: Some(Duration::ZERO) }, lost),
    };
    (judgement, None)
}
