//! All-or-nothing batches on JetStream's atomic batch publish (streams
//! with `allow_atomic`).

use serde::Deserialize;

use super::error::{PublishError as Error, PublishErrorKind as Kind};
use super::{Prepared, PublishAck};
use crate::nats::errors::unavailable_or_internal;
use crate::streams::StreamShape;

/// Most messages in one atomic batch (the server's limit).
pub const MAX_ATOMIC_MESSAGES: usize = 1000;

/// The server's answer to a message of an atomic batch: empty while the
/// batch goes on, a publish ack (or an error) for the commit.
#[derive(Deserialize)]
struct AtomicAnswer {
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    count: Option<u64>,
    #[serde(default)]
    error: Option<AtomicError>,
}

#[derive(Deserialize)]
struct AtomicError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

/// Publishes every message or none, with JetStream's atomic batch publish
/// (`Nats-Batch-Id`, `Nats-Batch-Sequence`, `Nats-Batch-Commit`): the first
/// message and the commit are requests, so a refusal names its reason; the
/// server stores the batch at the commit, in request order, or nothing.
pub async fn publish_atomic(
    nats: &async_nats::Client,
    shape: &StreamShape,
    prepared: Vec<Prepared>,
) -> Result<Vec<PublishAck>, Error> {
    if prepared.len() > MAX_ATOMIC_MESSAGES {
        return Err(Error::new(
            Kind::TooLarge,
            format!("an atomic batch holds at most {MAX_ATOMIC_MESSAGES} messages, not {}", prepared.len()),
        ));
    }
    send_atomic(nats, shape, &prepared, FirstMessage::Request).await.map_err(AtomicFailure::into_error)
}

/// How the first message of an atomic batch goes out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum FirstMessage {
    /// As a request: a refusal of the batch's start answers at once, with
    /// its reason (one more round trip).
    Request,
    /// Published like the rest: a refused start shows only at the commit,
    /// which then finds the batch incomplete.
    Publish,
}

/// Why an atomic batch was not (known to be) stored.
pub(super) enum AtomicFailure {
    /// Nothing of the batch was stored: refused, or never committed.
    NotStored(Error),
    /// The commit went out and no answer came: stored or not, unknown.
    Unknown(Error),
}

impl AtomicFailure {
    pub(super) fn into_error(self) -> Error {
        match self {
            Self::NotStored(e) | Self::Unknown(e) => e,
        }
    }
}

/// Sends `prepared` (at most [`MAX_ATOMIC_MESSAGES`]) as one atomic batch
/// and answers each message's place: the server commits a batch's
/// messages at consecutive sequences, so the commit's sequence and count
/// give every one.
pub(super) async fn send_atomic(
    nats: &async_nats::Client,
    shape: &StreamShape,
    prepared: &[Prepared],
    first: FirstMessage,
) -> Result<Vec<PublishAck>, AtomicFailure> {
    use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE};
    use AtomicFailure::{NotStored, Unknown};
    fn not_sent(e: impl crate::nats::errors::NatsFailure + Send + Sync) -> AtomicFailure {
        AtomicFailure::NotStored(unavailable_or_internal("publishing an atomic batch", e).into())
    }
    let batch_id = nats.new_inbox().rsplit('.').next().unwrap_or("batch").to_owned();
    let last = prepared.len();
    let mut commit = None;
    for (i, message) in prepared.iter().enumerate() {
        let mut headers = message.headers.clone();
        headers.insert(NATS_BATCH_ID, batch_id.as_str());
        headers.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
        let subject = message.subject.clone();
        let payload = message.payload.clone();
        let is_commit = i + 1 == last;
        if is_commit {
            headers.insert(NATS_BATCH_COMMIT, "1");
        } else if i > 0 || first == FirstMessage::Publish {
            nats.publish_with_headers(subject, headers, payload).await.map_err(not_sent)?;
            continue;
        }
        let answer = match nats.request_with_headers(subject, headers, payload).await {
            Ok(answer) => answer,
            // No stream took the commit (or the start): nothing is stored.
            Err(e) if !is_commit || e.kind() == async_nats::RequestErrorKind::NoResponders => return Err(not_sent(e)),
            Err(e) => {
                return Err(Unknown(
                    Error::new(
                        Kind::NotAcknowledged,
                        "JetStream did not answer the atomic batch's commit; retry, with msg_id to avoid duplicates",
                    )
                    .caused_by(e),
                ))
            }
        };
        if answer.payload.is_empty() {
            continue;
        }
        let answer: AtomicAnswer = serde_json::from_slice(&answer.payload)
            .map_err(|e| Unknown(Error::new(Kind::Internal, "unreadable atomic batch answer").caused_by(e)))?;
        if let Some(error) = answer.error {
            return Err(NotStored(atomic_refusal(error)));
        }
        if is_commit {
            commit = Some(answer);
        }
    }
    let commit = commit
        .ok_or_else(|| Unknown(Error::new(Kind::NotAcknowledged, "the atomic batch was not committed; retry")))?;
    let count = commit.count.unwrap_or(last as u64);
    if count != last as u64 {
        return Err(Unknown(Error::new(Kind::Internal, format!("the server committed {count} of {last} messages"))));
    }
    let first_seq = commit.seq + 1 - count;
    Ok(prepared
        .iter()
        .enumerate()
        .map(|(i, p)| PublishAck {
            stream: shape.name.clone(),
            seq: first_seq + i as u64,
            subject: p.subject.clone(),
            partition: p.partition,
            key: p.key.clone(),
            duplicate: false,
        })
        .collect())
}

/// What the server's refusal of an atomic batch means for the caller.
fn atomic_refusal(error: AtomicError) -> Error {
    /// Atomic publish is not enabled on the stream.
    const ATOMIC_DISABLED: u64 = 10174;
    match error.err_code {
        ATOMIC_DISABLED => Error::new(
            Kind::AtomicNotAllowed,
            "the stream does not allow atomic batches: create it with \"allow_atomic\": true",
        ),
        _ => Error::new(Kind::AtomicRefused, format!("the server refused the atomic batch: {}", error.description)),
    }
}
