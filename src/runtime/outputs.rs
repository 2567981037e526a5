//! Publishing an answer's outputs before the delivered message is acked
//! (docs/pipelines.md). Every output is checked and prepared before any is
//! sent, so an answer with one bad output publishes nothing. Each carries
//! the `Nats-Msg-Id` its place derives (`delivery/outputs.rs`), so a
//! redelivery's outputs, published again, are dropped by the target
//! stream's duplicate window. The outputs of one delivery to one stream
//! that stages atomic batches in memory go as one atomic batch, while one
//! of the process's atomic batch slots is free.

use std::sync::Arc;

use super::Runtime;
use crate::delivery::message::Delivered;
use crate::delivery::outputs::{output_msg_id, Output};
use crate::names::MemberRef;
use crate::publish::{self, Prepared, PublishAck, PublishError};
use crate::streams::StreamShape;

/// What the outputs of one delivery came to.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// Stored now.
    pub stored: usize,
    /// Stored by an earlier delivery of the same message: the target
    /// stream's duplicate window dropped them.
    pub duplicates: usize,
}

/// Why a delivery's outputs are not all stored: the delivered message is
/// not acked (it is retried, and dead-lettered with this reason once its
/// attempts are used up).
#[derive(Debug, thiserror::Error)]
pub enum OutputsError {
    /// An output the target stream cannot take (a missing stream, a bad
    /// key or subject, too large): nothing of the answer was published.
    #[error("output {index} to {stream} was refused: {error}")]
    Refused { index: usize, stream: String, error: PublishError },
    /// An output was not stored (no ack, the stream full); those before it
    /// may be, and a retry publishes them again under the same ids.
    #[error("output {index} to {stream} was not stored: {error}")]
    NotStored { index: usize, stream: String, error: PublishError },
}

/// Publishes `outputs` of the message `held` delivered to `who`, in order,
/// and waits for every ack.
pub async fn publish_outputs(
    ctx: &Runtime,
    who: &MemberRef,
    held: &Delivered,
    outputs: &[Output],
) -> Result<Published, OutputsError> {
    let mut shapes: Vec<Arc<StreamShape>> = Vec::with_capacity(outputs.len());
    let mut prepared: Vec<Prepared> = Vec::with_capacity(outputs.len());
    for (index, output) in outputs.iter().enumerate() {
        let refused = |error| OutputsError::Refused { index, stream: output.stream.to_string(), error };
        let shape = ctx.stores.streams.shape(&output.stream).await.map_err(|e| refused(e.into()))?;
        // All prepared before any is sent: a bad output refuses the answer whole.
        prepared.push(prepare(ctx, who, held, index, output, &shape).map_err(refused)?);
        shapes.push(shape);
    }
    let mut prepared = prepared.into_iter();
    let mut published = Published::default();
    let mut start = 0;
    // Runs of consecutive outputs to one stream, in the answer's order.
    while start < outputs.len() {
        let stream = &outputs[start].stream;
        let end = outputs[start..].iter().position(|o| &o.stream != stream).map_or(outputs.len(), |n| start + n);
        let run_prepared = prepared.by_ref().take(end - start).collect();
        let acks = publish_run(ctx, who, held, &outputs[start..end], start, &shapes[start], run_prepared).await?;
        let run = Published {
            stored: acks.iter().filter(|a| !a.duplicate).count(),
            duplicates: acks.iter().filter(|a| a.duplicate).count(),
        };
        record(stream, run);
        published.stored += run.stored;
        published.duplicates += run.duplicates;
        start = end;
    }
    Ok(published)
}

/// One stream's run of outputs (`first` is the first one's index): one
/// atomic batch where the stream stages them in memory, else one after
/// another with each subject's order kept (`publish::publish_all`). A
/// redelivery's atomic batch is refused for its duplicate ids and goes
/// again one by one, where each is answered as a duplicate.
async fn publish_run(
    ctx: &Runtime,
    who: &MemberRef,
    held: &Delivered,
    run: &[Output],
    first: usize,
    shape: &StreamShape,
    prepared: Vec<Prepared>,
) -> Result<Vec<PublishAck>, OutputsError> {
    let mut prepared = Some(prepared);
    // A slot of the batch publishes' (src/publish/runs.rs) keeps this
    // process under the server's limit of atomic batches open per stream.
    if let Some(_slot) = (run.len() > 1 && shape.atomic_runs).then(|| ctx.broker.run_slots.try_take()).flatten() {
        if let Ok(acks) = publish::publish_atomic(&ctx.broker.client, shape, prepared.take().unwrap_or_default()).await
        {
            return Ok(acks);
        }
    }
    // A message is not kept once sent: after a refused atomic batch, its
    // messages are made again.
    let prepared = match prepared {
        Some(prepared) => prepared,
        None => run
            .iter()
            .enumerate()
            .map(|(i, output)| {
                prepare(ctx, who, held, first + i, output, shape).map_err(|error| OutputsError::Refused {
                    index: first + i,
                    stream: shape.name.clone(),
                    error,
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    let results = publish::publish_all(&ctx.broker.js, shape, prepared.into_iter().map(Ok).collect()).await;
    results
        .into_iter()
        .enumerate()
        .map(|(i, result)| {
            result.map_err(|error| OutputsError::NotStored { index: first + i, stream: shape.name.clone(), error })
        })
        .collect()
}

fn prepare(
    ctx: &Runtime,
    who: &MemberRef,
    held: &Delivered,
    index: usize,
    output: &Output,
    shape: &StreamShape,
) -> Result<Prepared, PublishError> {
    let msg_id = output_msg_id(&held.origin_stream, who.group.as_str(), held.origin_seq, index);
    publish::prepare(shape, output.request(), Some(&msg_id), ctx.max_payload())
}

/// Counts one run's outputs by target stream and outcome.
fn record(stream: &crate::names::StreamName, run: Published) {
    for (outcome, count) in [("stored", run.stored), ("duplicate", run.duplicates)] {
        if count > 0 {
            crate::telemetry::metrics::count_outputs_published(stream.as_str(), outcome, count as u64);
        }
    }
}
