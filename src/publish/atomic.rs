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
/// message and the commit are requests; the server stores the batch at the
/// commit, in request order, or nothing.
pub async fn publish_atomic(
    nats: &async_nats::Client,
    shape: &StreamShape,
    prepared: Vec<Prepared>,
) -> Result<Vec<PublishAck>, Error> {
    use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE};
    if prepared.len() > MAX_ATOMIC_MESSAGES {
        return Err(Error::new(
            Kind::TooLarge,
            format!("an atomic batch holds at most {MAX_ATOMIC_MESSAGES} messages, not {}", prepared.len()),
        ));
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
        let request = if i + 1 == last {
            headers.insert(NATS_BATCH_COMMIT, "1");
            true
        } else {
            i == 0
        };
        if !request {
            nats.publish_with_headers(subject, headers, payload)
                .await
                .map_err(|e| unavailable_or_internal("publishing an atomic batch", e))?;
            continue;
        }
        let answer = nats
            .request_with_headers(subject, headers, payload)
            .await
            .map_err(|e| unavailable_or_internal("publishing an atomic batch", e))?;
        if answer.payload.is_empty() {
            continue;
        }
        let answer: AtomicAnswer = serde_json::from_slice(&answer.payload)
            .map_err(|e| Error::new(Kind::Internal, "unreadable atomic batch answer").caused_by(e))?;
        if let Some(error) = answer.error {
            return Err(atomic_refusal(error));
        }
        if i + 1 == last {
            commit = Some(answer);
        }
    }
    let commit =
        commit.ok_or_else(|| Error::new(Kind::NotAcknowledged, "the atomic batch was not committed; retry"))?;
    let count = commit.count.unwrap_or(last as u64);
    if count != last as u64 {
        return Err(Error::new(Kind::Internal, format!("the server committed {count} of {last} messages")));
    }
    let first_seq = commit.seq + 1 - count;
    Ok(prepared
        .into_iter()
        .enumerate()
        .map(|(i, p)| PublishAck {
            stream: shape.name.clone(),
            seq: first_seq + i as u64,
            subject: p.subject,
            partition: p.partition,
            key: p.key,
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
