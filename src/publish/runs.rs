//! A batch publish's runs: several messages of one key in one request go to
//! the stream as one JetStream atomic batch (all stored or none, at
//! consecutive sequences, one round trip) instead of one round trip per
//! message, on streams that allow atomic batches and are replicated or in
//! memory (`StreamShape::atomic_runs` says why not others).
//! docs/guarantees.md says what a caller is promised either way.

use std::collections::HashMap;

use async_nats::jetstream;
use tokio::sync::{Semaphore, SemaphorePermit};

use super::atomic::{send_atomic, AtomicFailure, FirstMessage, MAX_ATOMIC_MESSAGES};
use super::batch::publish_all;
use super::error::PublishError as Error;
use super::{Prepared, PublishAck};
use crate::streams::StreamShape;

/// A key's run shorter than this goes message by message with the rest:
/// two messages cost two round trips either way, and the atomic batch
/// costs the server a staging store.
const MIN_RUN: usize = 3;

/// Atomic batches this process keeps open at once, under nats-server's
/// default of 50 per stream (`max_batch_inflight_per_stream`), so runs of
/// many requests at once do not crowd out `"atomic": true` batches.
const RUNS_AT_ONCE: usize = 32;

/// The atomic batches runs may hold open. A run that finds none free goes
/// message by message: slower, never refused.
pub struct RunSlots(Semaphore);

impl Default for RunSlots {
    fn default() -> Self {
        Self(Semaphore::new(RUNS_AT_ONCE))
    }
}

impl RunSlots {
    /// A free slot, held until dropped; `None` when all are taken.
    pub fn try_take(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        self.0.try_acquire().ok()
    }
}

/// Publishes a batch request's items, each key's in request order, and
/// answers in request order (as [`publish_all`], which it falls back to):
/// each key with a run of several messages (on a stream whose atomic
/// batches the server stages in memory, while a slot is free) goes as one
/// atomic batch, the other items go message by message alongside.
pub async fn publish_batch(
    js: &jetstream::Context,
    slots: &RunSlots,
    shape: &StreamShape,
    prepared: Vec<Result<Prepared, Error>>,
) -> Vec<Result<PublishAck, Error>> {
    let runs = if shape.atomic_runs {
        key_runs(prepared.iter().map(|p| p.as_ref().ok().map(|p| p.subject.as_str())))
    } else {
        Vec::new()
    };
    let taken: Vec<(Vec<usize>, SemaphorePermit<'_>)> =
        runs.into_iter().map_while(|run| slots.try_take().map(|permit| (run, permit))).collect();
    if taken.is_empty() {
        return publish_all(js, shape, prepared).await;
    }
    let total = prepared.len();
    let mut items: Vec<Option<Result<Prepared, Error>>> = prepared.into_iter().map(Some).collect();
    let atomic: Vec<(Vec<usize>, Vec<Prepared>, SemaphorePermit<'_>)> = taken
        .into_iter()
        .map(|(at, permit)| {
            let run = at.iter().filter_map(|&i| items[i].take()?.ok()).collect();
            (at, run, permit)
        })
        .collect();
    let rest_at: Vec<usize> = (0..total).filter(|&i| items[i].is_some()).collect();
    let rest: Vec<Result<Prepared, Error>> = items.into_iter().flatten().collect();
    let client = js.client();
    let client = &client;
    let (rest_answers, run_answers) = tokio::join!(
        publish_all(js, shape, rest),
        futures::future::join_all(atomic.into_iter().map(|(at, run, permit)| async move {
            let answers = publish_run(js, client, shape, run).await;
            drop(permit);
            (at, answers)
        }))
    );
    let mut answers: Vec<Option<Result<PublishAck, Error>>> = (0..total).map(|_| None).collect();
    for (at, answer) in rest_at.into_iter().zip(rest_answers) {
        answers[at] = Some(answer);
    }
    for (at, run) in run_answers {
        for (at, answer) in at.into_iter().zip(run) {
            answers[at] = Some(answer);
        }
    }
    answers
        .into_iter()
        .map(|a| {
            a.unwrap_or_else(|| Err(Error::new(super::PublishErrorKind::Internal, "a batch item went unanswered")))
        })
        .collect()
}

/// One key's run as an atomic batch. When the batch is refused or never
/// committed, nothing of it is stored and the run goes message by message
/// (which answers each item as a batch without runs would: a duplicate, a
/// refusal, a resend through a leader election). When the commit went
/// unanswered, the run may be stored: sending it again is safe only when
/// every message carries a msg_id, which the stream's duplicate window
/// drops; otherwise every item answers "not acknowledged".
async fn publish_run(
    js: &jetstream::Context,
    client: &async_nats::Client,
    shape: &StreamShape,
    run: Vec<Prepared>,
) -> Vec<Result<PublishAck, Error>> {
    match send_atomic(client, shape, &run, FirstMessage::Publish).await {
        Ok(acks) => acks.into_iter().map(Ok).collect(),
        Err(AtomicFailure::Unknown(e)) if !run.iter().all(|p| p.idempotent) => {
            run.iter().map(|_| Err(e.clone())).collect()
        }
        Err(AtomicFailure::NotStored(e) | AtomicFailure::Unknown(e)) => {
            tracing::debug!(error = %e, messages = run.len(), "a key's run was not stored at once; message by message");
            publish_all(js, shape, run.into_iter().map(Ok).collect()).await
        }
    }
}

/// The runs among a batch's items, given each sendable item's subject (one
/// key): per subject with [`MIN_RUN`] to [`MAX_ATOMIC_MESSAGES`] items,
/// their indices in request order; longest runs first.
fn key_runs<'a>(subjects: impl Iterator<Item = Option<&'a str>>) -> Vec<Vec<usize>> {
    let mut by_subject: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, subject) in subjects.enumerate() {
        if let Some(subject) = subject {
            by_subject.entry(subject).or_default().push(i);
        }
    }
    let mut runs: Vec<Vec<usize>> =
        by_subject.into_values().filter(|at| (MIN_RUN..=MAX_ATOMIC_MESSAGES).contains(&at.len())).collect();
    runs.sort_by(|a, b| b.len().cmp(&a.len()).then(a[0].cmp(&b[0])));
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_a_keys_items_in_request_order_longest_first() {
        let subjects = [Some("a"), Some("b"), None, Some("a"), Some("c"), Some("a"), Some("b"), Some("b"), Some("b")];
        assert_eq!(key_runs(subjects.into_iter()), vec![vec![1, 6, 7, 8], vec![0, 3, 5]]);
    }

    #[test]
    fn short_runs_and_refused_items_are_not_runs() {
        // Two of a key, and an unsendable item between (no subject known).
        assert!(key_runs([Some("a"), None, Some("a"), Some("b")].into_iter()).is_empty());
        let too_long = vec![Some("a"); MAX_ATOMIC_MESSAGES + 1];
        assert!(key_runs(too_long.into_iter()).is_empty());
        let longest = vec![Some("a"); MAX_ATOMIC_MESSAGES];
        assert_eq!(key_runs(longest.into_iter())[0].len(), MAX_ATOMIC_MESSAGES);
    }
}
