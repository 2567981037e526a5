//! One delivery to a member's webhook: the request (payload, signature and
//! `keygate-*` headers), and what its verdict does to the message (ack, NAK
//! with backoff, or dead-letter then terminate).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};

use super::instance::{InstanceContext, MemberRef};
use super::lanes::{Settled, Settlement};
use crate::delivery::dead_letter::{self, DeadLetter};
use crate::delivery::endpoint::Endpoint;
use crate::delivery::header_safe;
use crate::delivery::verdict::{backoff, Judgement, Verdict};
use crate::delivery::webhook::Outbound;
use crate::events::{Event, EventType};

/// A message delivered to this instance.
#[derive(Debug)]
pub struct Delivered {
    pub message: jetstream::Message,
    pub partition: u32,
    pub stream_seq: u64,
    pub attempt: u64,
    pub subject: String,
    pub key: Option<String>,
    pub origin_stream: String,
    pub origin_seq: u64,
}

/// A delivered message, shared by its lane and its delivery.
pub type Held = Arc<Delivered>;

/// What lets a message leave its consumer. Nothing else does: every ack and
/// term keygate sends goes through [`remove`] with one of these
/// (docs/guarantees.md, "Nothing acknowledged is lost").
pub enum Because<'a> {
    /// The endpoint's verdict (a 2xx, a WebSocket ack, `keygate-ack: ack`).
    EndpointAcked(&'a Judgement),
    /// The message's dead-letter copy is stored.
    DeadLettered(&'a dead_letter::Stored),
    /// This lane settled this very sequence before, and the server
    /// redelivered it: that ack or term was lost, so it is sent again.
    SettledBefore(Settlement),
}

/// Acks or terminates `held` for the reason given; refuses (sends nothing,
/// counts `keygate_acks_without_verdict_total`) when the reason does not
/// hold, so the message is redelivered rather than lost.
pub async fn remove(held: &Delivered, because: Because<'_>) -> Result<Settlement, String> {
    let how = match because {
        Because::EndpointAcked(judgement) if judgement.verdict == Verdict::Ack => Settlement::Acked,
        Because::DeadLettered(stored) if !stored.id.is_empty() => Settlement::Terminated,
        Because::SettledBefore(how) => how,
        _ => {
            metrics::counter!(crate::metrics::ACKS_WITHOUT_VERDICT).increment(1);
            tracing::error!(
                seq = held.stream_seq,
                "refused to remove a message without a verdict; it will be redelivered"
            );
            return Err("no verdict".into());
        }
    };
    let kind = match how {
        Settlement::Acked => AckKind::Ack,
        Settlement::Terminated => AckKind::Term,
    };
    held.message.ack_with(kind).await.map_err(|e| e.to_string())?;
    Ok(how)
}

/// What a delivery future reports.
pub struct Outcome {
    pub settled: Settled,
    pub events: Vec<Event>,
    /// The endpoint answered 410 Gone.
    pub gone: bool,
}

/// The origin stream and sequence of a message: an elastic group's
/// work-queue copy names its source in `Nats-Stream-Source`.
/// Whether a message header may go to the endpoint: not NATS's own, not
/// keygate's or the signature's, not one that frames the HTTP request, and
/// no credentials: the signature does not cover headers, so an endpoint
/// trusting a forwarded `Authorization` would act for whoever published.
pub(crate) fn forwardable(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    const NEVER_FORWARDED: [&str; 12] = [
        "authorization",
        "cookie",
        "set-cookie",
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "te",
        "upgrade",
        "trailer",
        "keep-alive",
        "proxy-connection",
    ];
    !(lower.starts_with("nats-")
        || lower.starts_with("keygate-")
        || lower.starts_with("webhook-")
        || lower.starts_with("proxy-")
        || NEVER_FORWARDED.contains(&lower.as_str()))
}

pub fn origin_of(message: &jetstream::Message, stream: &str, seq: u64) -> (String, u64) {
    let source = message.headers.as_ref().and_then(|h| h.get("Nats-Stream-Source")).map(|v| v.to_string());
    if let Some(source) = source {
        let mut parts = source.split_whitespace();
        if let (Some(name), Some(origin_seq)) = (parts.next(), parts.next().and_then(|s| s.parse().ok())) {
            let name = name.split(':').next().unwrap_or(name);
            return (name.to_owned(), origin_seq);
        }
    }
    (stream.to_owned(), seq)
}

fn outbound(who: &MemberRef, held: &Delivered, fencing: u64) -> Outbound {
    let mut headers = Vec::new();
    let mut content_type = None;
    if let Some(original) = &held.message.headers {
        for (name, values) in original.iter() {
            let name: &str = name.as_ref();
            if !forwardable(name) {
                continue;
            }
            for value in values {
                if name.eq_ignore_ascii_case("content-type") {
                    content_type = Some(value.to_string());
                } else {
                    headers.push((name.to_owned(), value.to_string()));
                }
            }
        }
    }
    headers.push(("content-type".into(), content_type.unwrap_or_else(|| "application/octet-stream".into())));
    headers.push(("keygate-stream".into(), who.stream.to_string()));
    headers.push(("keygate-group".into(), who.group.to_string()));
    headers.push(("keygate-member".into(), who.member.to_string()));
    headers.push(("keygate-subject".into(), header_safe(&held.subject)));
    if let Some(key) = &held.key {
        headers.push(("keygate-key".into(), header_safe(key)));
    }
    headers.push(("keygate-partition".into(), held.partition.to_string()));
    headers.push(("keygate-stream-seq".into(), held.origin_seq.to_string()));
    headers.push(("keygate-attempt".into(), held.attempt.to_string()));
    headers.push(("keygate-fencing-token".into(), fencing.to_string()));
    Outbound { id: format!("{}-{}", held.origin_stream, held.origin_seq), body: held.message.payload.clone(), headers }
}

/// One delivery: call the endpoint, apply its verdict to the message.
pub async fn deliver(
    ctx: Arc<InstanceContext>,
    who: MemberRef,
    endpoint: Arc<Endpoint>,
    held: Held,
    fencing: u64,
) -> Outcome {
    let labels = [("stream", who.stream.to_string()), ("group", who.group.to_string())];
    let called = std::time::Instant::now();
    let judgement = match &*endpoint {
        Endpoint::Webhook { registration, key } => {
            ctx.webhooks.call(registration, key, &outbound(&who, &held, fencing)).await
        }
        Endpoint::Socket(socket) => socket.call(&who, &held, fencing).await,
    };
    metrics::histogram!(crate::metrics::ENDPOINT_SECONDS, &labels).record(called.elapsed().as_secs_f64());
    if held.attempt > 1 {
        metrics::counter!(crate::metrics::REDELIVERIES, &labels).increment(1);
    }
    let event = |t: EventType| {
        let mut e = who.event(&ctx, t);
        e.partition = Some(held.partition);
        e.seq = Some(held.origin_seq);
        e.attempt = Some(held.attempt);
        e
    };
    let mut events = Vec::new();
    let retry = |delay: Option<Duration>| {
        delay.unwrap_or_else(|| {
            let b = endpoint.backoff();
            backoff(held.attempt, Duration::from_millis(b.initial_ms), Duration::from_millis(b.max_ms), rand::random())
        })
    };
    let settled = match judgement.verdict {
        Verdict::Ack => {
            // A lost ack means a redelivery, which the lane answers from its
            // memory of this settlement, or delivers again (a duplicate).
            if let Err(e) = remove(&held, Because::EndpointAcked(&judgement)).await {
                tracing::debug!(error = %e, "ack not sent");
            }
            let mut e = event(EventType::MessageAcked);
            e.reason = Some(judgement.reason.clone());
            events.push(e);
            Settled::Done(Settlement::Acked)
        }
        Verdict::Nak { .. } | Verdict::Progress if held.attempt >= endpoint.max_attempts() => {
            let reason = format!("gave up after {} attempts: {}", held.attempt, judgement.reason);
            terminate(&ctx, &who, &held, &reason, retry(None), &mut events, event(EventType::MessageNaked)).await
        }
        Verdict::Nak { delay } => {
            nak(&held, retry(delay), &judgement.reason, "", &mut events, event(EventType::MessageNaked)).await
        }
        Verdict::Progress => {
            nak(&held, retry(None), &judgement.reason, "", &mut events, event(EventType::MessageNaked)).await
        }
        Verdict::Term => {
            terminate(&ctx, &who, &held, &judgement.reason, retry(None), &mut events, event(EventType::MessageNaked))
                .await
        }
    };
    let verdict = match &settled {
        Settled::Done(Settlement::Acked) => "ack",
        Settled::Done(Settlement::Terminated) => "term",
        _ => "nak",
    };
    let mut with_verdict = labels.to_vec();
    with_verdict.push(("verdict", verdict.to_owned()));
    metrics::counter!(crate::metrics::DELIVERIES, &with_verdict).increment(1);
    Outcome { settled, events, gone: judgement.gone }
}

/// Dead-letters then terminates; if the copy cannot be stored, the message
/// is NAK'd instead (it is never terminated without its copy).
async fn terminate(
    ctx: &InstanceContext,
    who: &MemberRef,
    held: &Delivered,
    reason: &str,
    retry_in: Duration,
    events: &mut Vec<Event>,
    naked: Event,
) -> Settled {
    match dead_letter_and_term(ctx, who, held, reason).await {
        Ok(mut done) => {
            events.append(&mut done);
            Settled::Done(Settlement::Terminated)
        }
        Err(err) => nak(held, retry_in, reason, &err.to_string(), events, naked).await,
    }
}

async fn nak(
    held: &Delivered,
    delay: Duration,
    reason: &str,
    extra: &str,
    events: &mut Vec<Event>,
    mut event: Event,
) -> Settled {
    if let Err(e) = held.message.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::debug!(error = %e, "nak not sent");
    }
    let error = if extra.is_empty() { reason.to_owned() } else { format!("{reason} ({extra})") };
    event.delay_ms = Some(delay.as_millis() as u64);
    event.reason = Some(error.clone());
    events.push(event);
    Settled::Naked { attempts: held.attempt, error }
}

/// Copies the message to the dead-letter stream, then terminates it: it is
/// never terminated without its copy stored.
pub async fn dead_letter_and_term(
    ctx: &InstanceContext,
    who: &MemberRef,
    held: &Delivered,
    reason: &str,
) -> anyhow::Result<Vec<Event>> {
    let stored = dead_letter::record(
        &ctx.js,
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
    remove(held, Because::DeadLettered(&stored)).await.map_err(|e| anyhow::anyhow!("terminating: {e}"))?;
    metrics::counter!(crate::metrics::DEAD_LETTERS, "stream" => who.stream.to_string(), "group" => who.group.to_string())
        .increment(1);
    let mut out = Vec::new();
    for t in [EventType::MessageTerminated, EventType::MessageDeadLettered] {
        let mut e = who.event(ctx, t);
        e.partition = Some(held.partition);
        e.seq = Some(held.origin_seq);
        e.attempt = Some(held.attempt);
        e.reason = Some(reason.to_owned());
        out.push(e);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_the_messages_own_headers_are_forwarded() {
        for kept in ["X-Trace", "content-type", "Authorization-Context", "traceparent"] {
            assert!(super::forwardable(kept), "{kept}");
        }
        for dropped in [
            "nats-msg-id",
            "Nats-Pin-Id",
            "Host",
            "content-length",
            "Transfer-Encoding",
            "webhook-signature",
            "KEYGATE-key",
            "Connection",
            "proxy-authorization",
            "Authorization",
            "cookie",
        ] {
            assert!(!super::forwardable(dropped), "{dropped}");
        }
    }
}
