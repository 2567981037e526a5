//! Sending one prepared message and reading its ack: resends while the
//! stream leader is away, and the answer for a duplicate.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, ErrorCode};

use super::error::{PublishError as Error, PublishErrorKind as Kind};
use super::{Prepared, PublishAck};
use crate::nats::errors::{unavailable_or_internal, NatsFailure};
use crate::partition::decode_key;
use crate::streams::StreamShape;

/// How long one request keeps publishing again messages the stream did not
/// acknowledge, from the first such message; the backoff between attempts.
const RESEND_FOR: Duration = Duration::from_secs(3);
const RESEND_BACKOFF: [Duration; 5] = [
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
    Duration::from_millis(800),
    Duration::from_millis(1600),
];

/// The server's acknowledgement of a sent message, publishing it again
/// (with backoff) while that is safe: when no stream answered (a stream
/// leader is being elected, so nothing stored it), or when it timed out but
/// its msg_id makes a second copy a duplicate the server drops. A request
/// resends for [`RESEND_FOR`] in all (`resend_until`, set by its first
/// resend), so a batch during an election answers 503 in seconds, not
/// seconds per message.
pub(super) async fn acknowledged(
    js: &jetstream::Context,
    prepared: &Prepared,
    ack: jetstream::context::PublishAckFuture,
    resend_until: &std::sync::Mutex<Option<Instant>>,
) -> Result<jetstream::publish::PublishAck, jetstream::context::PublishError> {
    match ack.await {
        Err(e) if safe_to_resend(prepared, &e) => {
            // Boxed: the resends' futures would otherwise size every
            // publish's future, which is allocated and moved per request.
            Box::pin(resend(js, prepared, e, resend_until)).await
        }
        outcome => outcome,
    }
}

fn safe_to_resend(prepared: &Prepared, e: &jetstream::context::PublishError) -> bool {
    use jetstream::context::PublishErrorKind as K;
    match e.kind() {
        K::StreamNotFound => true,
        K::TimedOut | K::BrokenPipe => prepared.idempotent,
        _ => false,
    }
}

/// Publishes `prepared` again after `first`, with backoff, while that is
/// safe and the request's resend time lasts.
async fn resend(
    js: &jetstream::Context,
    prepared: &Prepared,
    first: jetstream::context::PublishError,
    resend_until: &std::sync::Mutex<Option<Instant>>,
) -> Result<jetstream::publish::PublishAck, jetstream::context::PublishError> {
    let mut outcome = Err(first);
    for delay in RESEND_BACKOFF {
        match &outcome {
            Err(e) if safe_to_resend(prepared, e) => {
                let until = *resend_until
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(|| Instant::now() + RESEND_FOR);
                if Instant::now() + delay > until {
                    break;
                }
                tracing::debug!(error = %e, subject = %prepared.subject, "publishing again");
                tokio::time::sleep(delay).await;
                outcome = match js.send_publish(prepared.subject.clone(), prepared.publish()).await {
                    Ok(ack) => ack.await,
                    Err(e) => Err(e),
                };
            }
            _ => break,
        }
    }
    outcome
}

/// The answer for a duplicate: where the first message with that id was
/// stored (its subject, partition and key, which may differ from the retry's).
pub(super) async fn stored_ack(js: &jetstream::Context, shape: &StreamShape, seq: u64, retry: &Prepared) -> PublishAck {
    // Until the stored copy is read: the retry's own subject and key.
    let mut ack = PublishAck {
        stream: shape.name.clone(),
        seq,
        subject: retry.subject.clone(),
        partition: retry.partition,
        key: retry.key.clone(),
        duplicate: true,
    };
    let Ok(stream) = js.get_stream_no_info(&shape.name).await else { return ack };
    let Ok(message) = stream.get_raw_message(seq).await else { return ack };
    let stored = message.subject.to_string();
    let (partition, subject) = match &shape.stamping {
        Some(_) => match stored.split_once('.') {
            Some((p, rest)) => (p.parse().ok(), rest.to_owned()),
            None => (None, stored.clone()),
        },
        None => (None, stored.clone()),
    };
    let decoded = shape.stamping.as_ref().and_then(|(source, spec)| {
        let captured = source.captures(&subject)?;
        match spec.wildcards.as_slice() {
            [w] => decode_key(captured.get((*w as usize).checked_sub(1)?)?),
            _ => None,
        }
    });
    // The same subject carries the same key (an unstamped stream's key is
    // not in its stored subject's transform to decode).
    ack.key = decoded.or_else(|| (subject == retry.subject).then(|| retry.key.clone()).flatten());
    ack.subject = subject;
    ack.partition = partition;
    ack
}

pub(super) fn publish_error(e: jetstream::context::PublishError) -> Error {
    use jetstream::context::PublishErrorKind as K;
    match e.kind() {
        K::MaxPayloadExceeded => Error::new(Kind::TooLarge, "the message exceeds the server's max_payload"),
        K::StreamNotFound => Error::new(Kind::Unavailable, "no stream answered for the subject; retry"),
        K::TimedOut | K::BrokenPipe | K::MaxAckPending => {
            tracing::warn!(error = %e, "publish not acknowledged");
            Error::new(
                Kind::NotAcknowledged,
                "JetStream did not acknowledge the message; retry, with msg_id to avoid duplicates",
            )
            .caused_by(e)
        }
        _ => match e.jetstream().map(|js| js.error_code()) {
            Some(ErrorCode::STREAM_NOT_MATCH) => {
                Error::new(Kind::WrongStream, "the subject belongs to another stream than the one named")
            }
            Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
                Error::new(Kind::TooLarge, "the message exceeds the stream's max_msg_size")
            }
            // A limit with discard new: maximum messages, bytes or messages per subject.
            Some(ErrorCode::STREAM_STORE_FAILED) => {
                tracing::warn!(error = %e, "stream refused a message");
                Error::new(Kind::StreamFull, "the stream is full (a limit with discard new); retry later")
            }
            _ => unavailable_or_internal("publishing", e).into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use crate::future_size;

    /// A single publish's future is allocated and moved per request; the
    /// resends and the duplicate's lookup are boxed apart, so that future
    /// is smaller than either.
    #[test]
    fn a_publishs_future_leaves_resends_and_duplicate_lookups_out() {
        let publish = future_size::of_refs_value(super::super::publish_one);
        let resend = future_size::of_refs_value_ref(super::resend);
        let stored = future_size::of_refs_value_ref(super::stored_ack);
        assert!(publish < resend && publish < stored, "publish {publish} bytes, resend {resend}, stored_ack {stored}");
    }
}
