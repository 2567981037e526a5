//! One delivery (or one batch) to an instance's endpoint: a webhook (the
//! request itself is built in `webhook/request.rs`), a WebSocket or a pull
//! client; and what its verdict does to the message: outputs published,
//! then ack; NAK with backoff; or dead-letter, then terminate.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;

use super::lanes::{LaneId, Settled, Settlement};
use super::outputs::publish_outputs;
use super::Runtime;
use crate::dead_letters::{self, DeadLetter};
use crate::delivery::batch_verdict::BatchJudgement;
use crate::delivery::message::{Delivered, Held};
use crate::delivery::outputs::{with_outputs, Output};
use crate::delivery::verdict::{backoff, Judgement, Verdict};
use crate::delivery::websocket::ClientAnswer;
use crate::events::{About, Event};
use crate::names::{MemberRef, StreamName};
use crate::pauses::{Pause, BREAKER};
use crate::runtime::endpoint::{Endpoint, WebhookEndpoint};
use crate::telemetry::TraceContext;
use crate::webhook::failure_log::{Failure, FailureLog};
use crate::webhook::protection::{BreakerStep, Protection};

/// What lets a message leave its consumer. Nothing else does: every ack and
/// term keygate sends goes through [`remove`] with one of these
/// (docs/guarantees.md, "Nothing acknowledged is lost").
pub enum Because<'a> {
    /// The endpoint's verdict (a 2xx, a WebSocket ack, `keygate-ack: ack`).
    EndpointAcked(&'a Judgement),
    /// The message's dead-letter copy is stored.
    DeadLettered(&'a dead_letters::Stored),
    /// This lane settled this very sequence before, and the server
    /// redelivered it: that ack or term was lost, so it is sent again.
    SettledBefore(Settlement),
}

/// Why a message could not be removed from its consumer.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// The reason given does not hold (no ack verdict, no stored dead
    /// letter): nothing was sent, and the message will be redelivered.
    #[error("no verdict")]
    NoVerdict,
    /// This instance's custody of the message lapsed (a NATS reconnect or
    /// late keep-alives since it arrived): the server may have given it to
    /// another instance, whose copy this settlement would settle too.
    /// Nothing was sent (delivery/custody.rs).
    #[error("custody of the message lapsed")]
    CustodyLapsed,
    /// The ack or term could not be sent.
    #[error("sending the ack: {0}")]
    Ack(#[source] async_nats::Error),
}

/// Acks or terminates `held` for the reason given; refuses (sends nothing,
/// counts `keygate_acks_without_verdict_total`) when the reason does not
/// hold, so the message is redelivered rather than lost, and when this
/// instance's custody of it lapsed.
pub async fn remove(held: &Delivered, because: Because<'_>) -> Result<Settlement, RemoveError> {
    let how = match because {
        Because::EndpointAcked(judgement) if judgement.verdict == Verdict::Ack => Settlement::Acked,
        Because::DeadLettered(stored) if !stored.id.is_empty() => Settlement::Terminated,
        Because::SettledBefore(how) => how,
        _ => {
            metrics::counter!(crate::telemetry::metrics::ACKS_WITHOUT_VERDICT).increment(1);
            tracing::error!(
                seq = held.stream_seq,
                "refused to remove a message without a verdict; it will be redelivered"
            );
            return Err(RemoveError::NoVerdict);
        }
    };
    if held.custody.as_ref().is_some_and(|custody| !custody.held()) {
        return Err(RemoveError::CustodyLapsed);
    }
    let kind = match how {
        Settlement::Acked => AckKind::Ack,
        Settlement::Terminated => AckKind::Term,
    };
    held.message.ack_with(kind).await.map_err(RemoveError::Ack)?;
    Ok(how)
}

/// Why an endpoint's ack became a retry (delivery/custody.rs).
const CUSTODY_LAPSED: &str =
    "acked by the endpoint, but keygate's hold on the message lapsed (a NATS reconnect or late keep-alives), so it is delivered again";

/// What a delivery future reports.
pub struct Outcome {
    pub settled: Settled,
    pub events: Vec<Event>,
    /// The endpoint answered 410 Gone.
    pub gone: bool,
}

/// One instance's delivery metrics, looked up once: building their labels
/// and finding them in the registry for every delivery showed in a profile.
pub struct DeliveryMetrics {
    endpoint_seconds: metrics::Histogram,
    redeliveries: metrics::Counter,
    /// By verdict: ack, nak, term.
    deliveries: [metrics::Counter; 3],
    in_flight: metrics::Gauge,
}

/// Messages counted in `keygate_deliveries_in_flight` until dropped.
struct InFlight<'a>(&'a metrics::Gauge, f64);

impl<'a> InFlight<'a> {
    fn count(gauge: &'a metrics::Gauge, messages: usize) -> Self {
        gauge.increment(messages as f64);
        Self(gauge, messages as f64)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.decrement(self.1);
    }
}

impl DeliveryMetrics {
    pub fn of(who: &MemberRef) -> Self {
        use crate::telemetry::metrics::{DELIVERIES, DELIVERIES_IN_FLIGHT, ENDPOINT_SECONDS, REDELIVERIES};
        let labels = [("stream", who.stream.to_string()), ("group", who.group.to_string())];
        let with_verdict = |verdict: &'static str| {
            let mut labels = labels.to_vec();
            labels.push(("verdict", verdict.to_owned()));
            metrics::counter!(DELIVERIES, &labels)
        };
        Self {
            endpoint_seconds: metrics::histogram!(ENDPOINT_SECONDS, &labels),
            redeliveries: metrics::counter!(REDELIVERIES, &labels),
            deliveries: [with_verdict("ack"), with_verdict("nak"), with_verdict("term")],
            in_flight: metrics::gauge!(DELIVERIES_IN_FLIGHT, &labels),
        }
    }
}

/// A WebSocket or pull client's verdict, its wait recorded (the time until
/// the client's verdict is the endpoint's latency), with the outputs its
/// ack asks to publish, checked against the `declared` streams.
fn client_answered(
    span: &tracing::Span,
    called: std::time::Instant,
    metrics: &DeliveryMetrics,
    (judgement, publish): ClientAnswer,
    declared: &[StreamName],
) -> (Judgement, Vec<Output>) {
    span.record("endpoint_ms", called.elapsed().as_secs_f64() * 1000.0);
    metrics.endpoint_seconds.record(called.elapsed().as_secs_f64());
    with_outputs(judgement, publish, declared)
}

/// One delivery: call the endpoint, apply its verdict to the message.
///
/// Its future lives inline in every lane worker's, and a worker is spawned
/// (its future copied) for about every message when deliveries keep pace
/// with arrivals. So what only some deliveries await is boxed: another
/// kind of member's call, publishing outputs, dead-lettering. Inline, they
/// made a webhook worker's future 9.6 KB; boxed, 2.5 KB (BENCHMARKS.md,
/// "2026-12-07 (night)").
pub async fn deliver(
    ctx: Arc<Runtime>,
    who: MemberRef,
    endpoint: Arc<Endpoint>,
    held: Held,
    fencing: u64,
    metrics: &DeliveryMetrics,
) -> Outcome {
    let span = crate::telemetry::export_span!("deliver", "otel.kind" = "client", stream = %who.stream, group = %who.group,
        member = %who.member, partition = held.partition, seq = held.origin_seq, attempt = held.attempt,
        verdict = tracing::field::Empty, endpoint_ms = tracing::field::Empty);
    if let Some(origin) = TraceContext::from_message(held.message.headers.as_ref()) {
        origin.parent_of(&span);
    }
    let _in_flight = InFlight::count(&metrics.in_flight, 1);
    let called = std::time::Instant::now();
    let mut events = Vec::new();
    let (judgement, outputs) = match &*endpoint {
        Endpoint::Webhook(webhook) if webhook.protection.open() => (
            Judgement {
                verdict: Verdict::Nak { delay: None },
                gone: false,
                failed: false,
                reason: "not sent: the circuit breaker is open and the member is pausing".into(),
            },
            Vec::new(),
        ),
        Endpoint::Webhook(webhook) => {
            let WebhookEndpoint { registration, uri, signer, protection, credentials, failures } = &**webhook;
            protection.wait_turn().await;
            let trace = TraceContext::of_span(&span);
            let request = crate::webhook::request::outbound(registration, &who, &held, fencing, trace.as_ref());
            let sent = std::time::Instant::now();
            let (judgement, outputs) = ctx.webhook_client.call(registration, uri, signer, credentials, &request).await;
            span.record("endpoint_ms", sent.elapsed().as_secs_f64() * 1000.0);
            log_outcome(failures, &who, &judgement, &held, 1);
            metrics.endpoint_seconds.record(called.elapsed().as_secs_f64());
            let step = protection.record(judgement.failed);
            Box::pin(breaker_step(&ctx, &who, protection, step, &judgement, &mut events)).await;
            (judgement, outputs)
        }
        Endpoint::Socket(socket) => {
            client_answered(&span, called, metrics, Box::pin(socket.call(&who, &held, fencing)).await, &socket.outputs)
        }
        Endpoint::Pull(pull) => {
            client_answered(&span, called, metrics, Box::pin(pull.call(&who, &held, fencing)).await, &pull.outputs)
        }
    };
    let settled = apply(&ctx, &who, &endpoint, &held, &judgement, &outputs, metrics, &mut events).await;
    span.record("verdict", verdict_word(&settled).0);
    Outcome { settled, events, gone: judgement.gone }
}

/// What a verdict does to its message: ack it (once the answer's
/// `outputs` are stored), NAK it with the endpoint's delay or the backoff,
/// or dead-letter it (also once its attempts are used up). Outputs that
/// are not all stored make the ack a retry (docs/pipelines.md). Counted by
/// verdict.
#[allow(clippy::too_many_arguments)]
async fn apply(
    ctx: &Runtime,
    who: &MemberRef,
    endpoint: &Endpoint,
    held: &Delivered,
    judgement: &Judgement,
    outputs: &[Output],
    metrics: &DeliveryMetrics,
    events: &mut Vec<Event>,
) -> Settled {
    if held.attempt > 1 {
        metrics.redeliveries.increment(1);
    }
    let about = ctx.about(who);
    let unstored;
    let judgement = match judgement.verdict {
        Verdict::Ack if !outputs.is_empty() => match Box::pin(publish_outputs(ctx, who, held, outputs)).await {
            Ok(published) => {
                events.push(Event::message_published_outputs(about, held.at(), published.stored, published.duplicates));
                judgement
            }
            Err(e) => {
                let reason = format!("{}, but {e}", judgement.reason);
                unstored = Judgement { verdict: Verdict::Nak { delay: None }, reason, ..judgement.clone() };
                &unstored
            }
        },
        _ => judgement,
    };
    let retry = |delay: Option<Duration>| {
        delay.unwrap_or_else(|| {
            let b = endpoint.backoff();
            backoff(held.attempt, Duration::from_millis(b.initial_ms), Duration::from_millis(b.max_ms), rand::random())
        })
    };
    let settled = match judgement.verdict {
        Verdict::Ack => match remove(held, Because::EndpointAcked(judgement)).await {
            // Given again at once, and delivered again: a duplicate.
            Err(RemoveError::CustodyLapsed) => nak(about, held, Duration::ZERO, CUSTODY_LAPSED, events).await,
            // A lost ack means a redelivery, which the lane answers from its
            // memory of this settlement, or delivers again (a duplicate).
            sent => {
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "ack not sent");
                }
                events.push(Event::message_acked(about, held.at(), &judgement.reason));
                Settled::Done(Settlement::Acked)
            }
        },
        Verdict::Nak { .. } | Verdict::Progress if held.attempt >= endpoint.max_attempts() => {
            let reason = format!("gave up after {} attempts: {}", held.attempt, judgement.reason);
            terminate(ctx, who, held, &reason, retry(None), events).await
        }
        Verdict::Nak { delay } => nak(about, held, retry(delay), &judgement.reason, events).await,
        Verdict::Progress => nak(about, held, retry(None), &judgement.reason, events).await,
        Verdict::Term => terminate(ctx, who, held, &judgement.reason, retry(None), events).await,
    };
    metrics.deliveries[verdict_word(&settled).1].increment(1);
    settled
}

/// A settlement as the `verdict` span field and metric label name it.
fn verdict_word(settled: &Settled) -> (&'static str, usize) {
    match settled {
        Settled::Done(Settlement::Acked) => ("ack", 0),
        Settled::Done(Settlement::Terminated) => ("term", 2),
        _ => ("nak", 1),
    }
}

/// What a batch's delivery reports: each message's settlement, in the
/// order given.
pub struct BatchOutcome {
    pub settled: Vec<Settled>,
    pub events: Vec<Event>,
    pub gone: bool,
}

/// One batched call to a webhook or a WebSocket client
/// (docs/batched-deliveries.md): one request or frame for the whole batch
/// (for a webhook one turn of the rate limit, one count of the breaker),
/// then each message's verdict applied in the batch's order. `batch` holds each lane's messages in order; once one of a lane
/// is not acked, that lane's later ones are [`Settled::Returned`] (neither
/// acked nor NAK'd), so they follow it.
pub async fn deliver_batch(
    ctx: Arc<Runtime>,
    who: MemberRef,
    endpoint: Arc<Endpoint>,
    batch: &[(LaneId, Held)],
    fencing: u64,
    metrics: &DeliveryMetrics,
) -> BatchOutcome {
    let span = crate::telemetry::export_span!("deliver_batch", "otel.kind" = "client", stream = %who.stream, group = %who.group,
        member = %who.member, messages = batch.len(), endpoint_ms = tracing::field::Empty);
    let _in_flight = InFlight::count(&metrics.in_flight, batch.len());
    let mut events = Vec::new();
    let called = std::time::Instant::now();
    let judged = match &*endpoint {
        Endpoint::Webhook(webhook) => call_webhook(&ctx, &who, webhook, batch, fencing, &span, &mut events).await,
        Endpoint::Socket(socket) => {
            let messages: Vec<&Held> = batch.iter().map(|(_, held)| held).collect();
            let (items, publish) = socket.call_batch(&who, &messages, fencing).await.into_iter().unzip();
            BatchJudgement { items, publish, failed: false, gone: false }
        }
        Endpoint::Pull(_) => unreachable!("pull clients fetch their own batches (runtime/endpoint.rs)"),
    };
    span.record("endpoint_ms", called.elapsed().as_secs_f64() * 1000.0);
    metrics.endpoint_seconds.record(called.elapsed().as_secs_f64());
    let mut stopped: HashSet<&LaneId> = HashSet::new();
    let mut settled = Vec::with_capacity(batch.len());
    let declared = endpoint.declared_outputs();
    let mut publish = judged.publish.into_iter();
    for ((lane, held), judgement) in batch.iter().zip(judged.items) {
        let publish = publish.next().flatten();
        if stopped.contains(lane) {
            settled.push(Settled::Returned);
            continue;
        }
        let (judgement, outputs) = with_outputs(judgement, publish, declared);
        let outcome = apply(&ctx, &who, &endpoint, held, &judgement, &outputs, metrics, &mut events).await;
        if outcome != Settled::Done(Settlement::Acked) {
            stopped.insert(lane);
        }
        settled.push(outcome);
    }
    BatchOutcome { settled, events, gone: judged.gone }
}

/// A batch's one request to a webhook: one turn of the rate limit, one
/// count of the breaker; not sent while the breaker is open.
async fn call_webhook(
    ctx: &Runtime,
    who: &MemberRef,
    webhook: &WebhookEndpoint,
    batch: &[(LaneId, Held)],
    fencing: u64,
    span: &tracing::Span,
    events: &mut Vec<Event>,
) -> BatchJudgement {
    let WebhookEndpoint { registration, uri, signer, protection, credentials, failures } = webhook;
    if protection.open() {
        let reason = "not sent: the circuit breaker is open and the member is pausing".to_owned();
        let not_sent = Judgement { verdict: Verdict::Nak { delay: None }, gone: false, failed: false, reason };
        return BatchJudgement { items: vec![not_sent; batch.len()], publish: Vec::new(), failed: false, gone: false };
    }
    protection.wait_turn().await;
    let ids: Vec<String> = batch.iter().map(|(_, held)| crate::webhook::request::delivery_id(held)).collect();
    let trace = TraceContext::of_span(span);
    let messages: Vec<&Delivered> = batch.iter().map(|(_, held)| &**held).collect();
    let request = crate::webhook::request::batch_outbound(registration, who, &messages, fencing, trace.as_ref());
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let judged = ctx.webhook_client.call_batch(registration, uri, signer, credentials, &request, &id_refs).await;
    if let (Some(first), Some((_, held))) = (judged.items.first(), batch.first()) {
        let judgement = Judgement { failed: judged.failed, ..first.clone() };
        log_outcome(failures, who, &judgement, held, batch.len());
    }
    let step = protection.record(judged.failed);
    if let Some(first) = judged.items.first() {
        Box::pin(breaker_step(ctx, who, protection, step, first, events)).await;
    }
    judged
}

/// A failed request to a webhook in keygate's log (rate-limited per
/// member), and the end of a streak of them.
fn log_outcome(failures: &FailureLog, who: &MemberRef, judgement: &Judgement, held: &Delivered, messages: usize) {
    if judgement.failed {
        let (key, seq, attempt, reason) = (held.key.as_deref(), held.origin_seq, held.attempt, &judgement.reason);
        failures.failed(who, &Failure { key, seq, attempt, messages, reason });
    } else {
        failures.succeeded(who);
    }
}

/// Dead-letters then terminates; if the copy cannot be stored, the message
/// is NAK'd instead (it is never terminated without its copy).
async fn terminate(
    ctx: &Runtime,
    who: &MemberRef,
    held: &Delivered,
    reason: &str,
    retry_in: Duration,
    events: &mut Vec<Event>,
) -> Settled {
    match Box::pin(dead_letter_and_term(ctx, who, held, reason)).await {
        Ok(mut done) => {
            events.append(&mut done);
            Settled::Done(Settlement::Terminated)
        }
        Err(err) => nak(ctx.about(who), held, retry_in, &format!("{reason} ({err})"), events).await,
    }
}

async fn nak(about: About<'_>, held: &Delivered, delay: Duration, error: &str, events: &mut Vec<Event>) -> Settled {
    if let Err(e) = held.message.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::debug!(error = %e, "nak not sent");
    }
    events.push(Event::message_naked(about, held.at(), delay, error));
    Settled::Naked { attempts: held.attempt, error: error.to_owned() }
}

/// What a breaker's step does: trips pause the member on every replica, a
/// probe's outcome resumes it or schedules the next probe. The message's
/// own verdict is applied as usual either way.
async fn breaker_step(
    ctx: &Runtime,
    who: &MemberRef,
    protection: &Protection,
    step: BreakerStep,
    judgement: &Judgement,
    events: &mut Vec<Event>,
) {
    let about = ctx.about(who);
    match step {
        BreakerStep::Nothing => {}
        BreakerStep::Trip { failures } => {
            let probe_every = protection.breaker().and_then(|b| b.probe_interval_ms).map(Duration::from_millis);
            let why = format!("{failures} deliveries in a row failed (last: {})", judgement.reason);
            match ctx.stores.pauses.pause(who, Pause::by_breaker(why, probe_every)).await {
                Ok((pause, true)) => {
                    metrics::counter!(crate::telemetry::metrics::BREAKER_TRIPS, "stream" => who.stream.to_string(), "group" => who.group.to_string())
                        .increment(1);
                    tracing::warn!(member = %who.member, reason = pause.reason.as_deref().unwrap_or_default(), "circuit breaker tripped: member paused");
                    events.push(Event::member_paused(about, BREAKER, pause.reason.as_deref()));
                }
                Ok((_, false)) => {}
                // The count stays tripped; the next failures are the same
                // endpoint failing, and the operator sees them as NAKs.
                Err(e) => {
                    tracing::warn!(member = %who.member, error = %e.report(), "circuit breaker could not pause the member")
                }
            }
        }
        BreakerStep::ProbeSucceeded => match ctx.stores.pauses.resume(who).await {
            Ok(Some(_)) => events.push(Event::member_resumed(about, BREAKER)),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(member = %who.member, error = %e.report(), "circuit breaker could not resume the member")
            }
        },
        BreakerStep::ProbeFailed => {
            if let Err(e) = ctx.stores.pauses.probe_failed(who).await {
                tracing::warn!(member = %who.member, error = %e.report(), "circuit breaker could not schedule its next probe");
            }
        }
    }
}

/// Why a message was not dead-lettered and terminated.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterFailure {
    /// Its copy was not stored: it was not terminated either.
    #[error("storing its dead-letter copy: {0}")]
    Record(#[from] dead_letters::RecordError),
    /// The copy is stored; the term was not sent (a redelivery finds the
    /// copy by its id and terminates then).
    #[error("terminating: {0}")]
    Term(#[from] RemoveError),
}

/// Copies the message to the dead-letter stream, then terminates it: it is
/// never terminated without its copy stored.
pub async fn dead_letter_and_term(
    ctx: &Runtime,
    who: &MemberRef,
    held: &Delivered,
    reason: &str,
) -> Result<Vec<Event>, DeadLetterFailure> {
    let stored = dead_letters::record(
        &ctx.broker.buckets,
        DeadLetter {
            owner: who.owner,
            stream: who.stream.as_str(),
            group: who.group.as_str(),
            member: who.member.as_str(),
            subject: &held.subject,
            key: held.key.as_deref(),
            partition: held.partition,
            stream_seq: held.origin_seq,
            attempts: held.attempt,
            reason,
            headers: held.message.headers.as_ref(),
            payload: held.message.payload.clone(),
        },
    )
    .await?;
    remove(held, Because::DeadLettered(&stored)).await?;
    metrics::counter!(crate::telemetry::metrics::DEAD_LETTERS, "stream" => who.stream.to_string(), "group" => who.group.to_string())
        .increment(1);
    let about = ctx.about(who);
    Ok(vec![
        Event::message_terminated(about, held.at(), reason),
        Event::message_dead_lettered(about, held.at(), reason),
    ])
}
