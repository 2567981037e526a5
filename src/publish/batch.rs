//! Batches that keep each key's request order: one message of a key in
//! flight at a time, later ones refused after a failure.

use std::collections::HashMap;

use async_nats::jetstream::{self};

use super::error::{PublishError as Error, PublishErrorKind as Kind};
use super::send::{acknowledged, publish_error, stored_ack};
use super::{Prepared, PublishAck};
use crate::streams::StreamShape;

/// How many sent messages may wait for their ack before sending pauses.
/// Acks are awaited while sending goes on, so a batch never holds more of
/// the client's ack slots than this, whatever its size or how many batches
/// run at once.
const ACK_WINDOW: usize = 1024;

/// Per subject (one key), what a batch has sent and how it went.
#[derive(Default)]
struct KeyProgress {
    /// An item of this subject is sent and not yet answered.
    awaiting: bool,
    /// The first item of this subject that failed, and why.
    failed: Option<(usize, Error)>,
}

/// What the sender does with a message, given its key's progress.
enum Turn {
    Send,
    Wait,
    Refused(Error),
}

/// Publishes prepared messages in request order with many acks in flight,
/// and answers in order; one failure does not fail the others. Two
/// messages of one subject (one key) are never in flight at once: the
/// later one is sent once the earlier is stored, so their stored order is
/// their request order even when the earlier must be sent again during a
/// leader election; after one fails, the later ones of its subject are not
/// sent and answer the same error. An item refused before sending (invalid
/// input, whose subject may not even be known) holds nothing back.
pub async fn publish_all(
    js: &jetstream::Context,
    shape: &StreamShape,
    mut prepared: Vec<Result<Prepared, Error>>,
) -> Vec<Result<PublishAck, Error>> {
    if prepared.len() == 1 {
        // One message has no key to wait for: no channel, map or wake-ups.
        let Some(item) = prepared.pop() else { return Vec::new() };
        return vec![publish_one(js, shape, item).await];
    }
    type Sent = Result<(Prepared, jetstream::context::PublishAckFuture), Error>;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, Sent)>(ACK_WINDOW);
    let total = prepared.len();
    let keys: std::sync::Mutex<HashMap<String, KeyProgress>> = Default::default();
    let answered = tokio::sync::Notify::new();
    let lock = || keys.lock().unwrap_or_else(|p| p.into_inner());
    let sender = async {
        // Owned here: the collector ends when the sender is done.
        let tx = tx;
        for (index, item) in prepared.into_iter().enumerate() {
            let sent = match item {
                Ok(p) => loop {
                    let notified = answered.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    let turn = {
                        let mut keys = lock();
                        let key = keys.entry(p.subject.clone()).or_default();
                        match &key.failed {
                            Some((first, error)) => Turn::Refused(error.refusing_after(*first)),
                            None if key.awaiting => Turn::Wait,
                            None => {
                                key.awaiting = true;
                                Turn::Send
                            }
                        }
                    };
                    match turn {
                        Turn::Refused(refused) => break Err(refused),
                        // The earlier message of this key is still in flight.
                        Turn::Wait => notified.await,
                        Turn::Send => {
                            break match js.send_publish(p.subject.clone(), p.publish()).await {
                                Ok(ack) => Ok((p, ack)),
                                Err(e) => {
                                    // Not sent: the key's later messages answer this too.
                                    let error = publish_error(e);
                                    let mut keys = lock();
                                    let key = keys.entry(p.subject.clone()).or_default();
                                    key.awaiting = false;
                                    key.failed = Some((index, error.clone()));
                                    Err(error)
                                }
                            };
                        }
                    }
                },
                Err(e) => Err(e),
            };
            if tx.send((index, sent)).await.is_err() {
                break;
            }
        }
    };
    let collector = async {
        let resend_until = std::sync::Mutex::new(None);
        let mut results = Vec::with_capacity(total);
        while let Some((index, sent)) = rx.recv().await {
            let (subject, result) = match sent {
                Ok((prepared, ack)) => {
                    let subject = prepared.subject.clone();
                    let outcome = acknowledged(js, &prepared, ack, &resend_until).await;
                    (Some(subject), answer(js, shape, prepared, outcome).await)
                }
                Err(e) => (None, Err(e)),
            };
            if let Some(subject) = subject {
                let mut keys = lock();
                let key = keys.entry(subject).or_default();
                key.awaiting = false;
                if let (Err(e), None) = (&result, &key.failed) {
                    key.failed = Some((index, e.clone()));
                }
                drop(keys);
                answered.notify_waiters();
            }
            results.push(result);
        }
        results
    };
    let ((), results) = tokio::join!(sender, collector);
    results
}

/// Publishes one message and answers where it was stored.
pub async fn publish_one(
    js: &jetstream::Context,
    shape: &StreamShape,
    item: Result<Prepared, Error>,
) -> Result<PublishAck, Error> {
    let prepared = item?;
    let ack = js.send_publish(prepared.subject.clone(), prepared.publish()).await.map_err(publish_error)?;
    let outcome = acknowledged(js, &prepared, ack, &std::sync::Mutex::new(None)).await;
    answer(js, shape, prepared, outcome).await
}

/// The answer for a sent message, from the server's acknowledgement.
async fn answer(
    js: &jetstream::Context,
    shape: &StreamShape,
    prepared: Prepared,
    outcome: Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
) -> Result<PublishAck, Error> {
    match outcome {
        Ok(ack) if ack.stream != shape.name => Err(Error::new(
            Kind::Internal,
            format!("message stored in stream {} instead of {}", ack.stream, shape.name),
        )),
        // Boxed, as rare: its reads would otherwise size every publish's future.
        Ok(ack) if ack.duplicate => Ok(Box::pin(stored_ack(js, shape, ack.sequence, &prepared)).await),
        Ok(ack) => Ok(PublishAck {
            stream: ack.stream,
            seq: ack.sequence,
            subject: prepared.subject,
            partition: prepared.partition,
            key: prepared.key,
            duplicate: false,
        }),
        Err(e) => Err(publish_error(e)),
    }
}
