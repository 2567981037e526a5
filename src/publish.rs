//! Keyed publishing: a REST message becomes a subject, headers and payload,
//! is published to JetStream, and is answered after the JetStream ack with
//! the partition the server stamped.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, message::PublishMessage};
use async_nats::HeaderMap;
use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::ToSchema;

use crate::error::{ApiError, Problem};
use crate::nats::errors::unavailable_or_internal;
use crate::partition::{decode_key, encode_key, keyless_token, partition_of_tokens, SubjectPattern};
use crate::streams::StreamShape;

/// Header values: one string or several.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum HeaderValues {
    One(String),
    Many(Vec<String>),
}

/// One message to publish.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// The message key: any UTF-8 text. Messages with one key land in one
    /// partition and are delivered in order. Omitted: spread round-robin.
    #[serde(default)]
    #[schema(example = "alice")]
    pub key: Option<String>,
    /// A literal subject, or a pattern with one `*` the key fills. Default:
    /// the stream's subject.
    #[serde(default)]
    pub subject: Option<String>,
    /// The payload as JSON, any value: object, array, string, number,
    /// boolean or null (stored byte for byte as sent).
    #[serde(default)]
    #[schema(value_type = Option<serde_json::Value>)]
    pub data: Option<Box<RawValue>>,
    /// Or the payload as base64 bytes.
    #[serde(default)]
    pub data_base64: Option<String>,
    /// Content type to record with the payload (default `application/json`
    /// for `data`).
    #[serde(default)]
    pub content_type: Option<String>,
    /// Message headers: a string or an array of strings per name. Names and
    /// values follow HTTP's rules; names starting with `Nats-` or `KV-` are
    /// reserved.
    #[serde(default)]
    pub headers: Option<BTreeMap<String, HeaderValues>>,
    /// De-duplication id (`Nats-Msg-Id`): a repeat within the stream's
    /// duplicate window is stored once and answered with `duplicate: true`.
    #[serde(default)]
    pub msg_id: Option<String>,
    /// Keyless messages only: `round_robin` (default) puts successive
    /// messages on successive partitions, `random` on a random one.
    #[serde(default)]
    pub spread: Option<Spread>,
}

/// How keyless messages are spread over partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Spread {
    RoundRobin,
    Random,
}

/// Several messages in one request.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    pub messages: Vec<PublishRequest>,
    /// All or nothing: every message is stored, or none is (JetStream's
    /// atomic batch publish; the stream needs `allow_atomic`, at most 1000
    /// messages). Then the answer is one problem, or one ack per message.
    #[serde(default)]
    pub atomic: bool,
}

/// Where a message was stored.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct PublishAck {
    pub stream: String,
    /// Stream sequence.
    pub seq: u64,
    /// The subject published (without the partition token the stream adds).
    pub subject: String,
    /// The partition the stream stamped, when it stamps partitions.
    pub partition: Option<u32>,
    /// The message key (`null` for keyless messages).
    pub key: Option<String>,
    /// True when `msg_id` was seen before and nothing new was stored.
    pub duplicate: bool,
}

/// One item of a batch answer: the ack or the problem.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(untagged)]
pub enum BatchItem {
    Ok(PublishAck),
    Err { error: Problem },
}

/// Answers to a batch, in request order.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BatchResponse {
    pub results: Vec<BatchItem>,
}

/// A message ready to go to JetStream.
pub struct Prepared {
    pub subject: String,
    pub partition: Option<u32>,
    pub key: Option<String>,
    /// The message's headers with keygate's own (`Nats-Expected-Stream`,
    /// `Nats-Msg-Id`).
    headers: HeaderMap,
    payload: Bytes,
    /// Carries a msg_id: sending it again cannot store it twice.
    idempotent: bool,
}

impl Prepared {
    fn publish(&self) -> PublishMessage {
        PublishMessage::build().headers(self.headers.clone()).payload(self.payload.clone())
    }
}

/// Header prefixes the server acts on (`Nats-Msg-Id`, `Nats-Expected-*`,
/// `KV-Operation`): a publisher setting them could delete KV entries or
/// forge de-duplication, so they are keygate's alone.
const RESERVED_HEADER_PREFIXES: [&str; 2] = ["nats-", "kv-"];
const MAX_MSG_ID: usize = 256;

/// Stream name prefixes of state no publisher may write: KV buckets and
/// object stores (keygate's registrations, pcgroups' configurations, the
/// fencing tokens) and keygate's own streams.
const RESERVED_STREAM_PREFIXES: [&str; 3] = ["KV_", "OBJ_", "KEYGATE_"];
/// Subject spaces of the server (`$JS`, `$KV`, `$SYS`…) and of keygate
/// (control requests, events, dead letters).
const RESERVED_SUBJECT_PREFIXES: [&str; 2] = ["$", "keygate."];

/// Why `config`'s stream is not open to publishers, if it is not: it backs
/// a KV bucket or object store, it is keygate's own, it is an elastic
/// group's work queue (a sourced work-queue stream, fed only by its
/// source), or it captures a reserved subject space. This holds for every
/// token, admin included: keygate's state changes through its own API.
pub fn reserved_stream(config: &jetstream::stream::Config) -> Option<String> {
    let name = config.name.as_str();
    if let Some(prefix) = RESERVED_STREAM_PREFIXES.iter().find(|p| name.starts_with(**p)) {
        return Some(format!(
            "stream {name} holds keygate's or the server's own state ({prefix}*): it is changed through keygate's API, \
             never published to"
        ));
    }
    let fed_by_sources = config.sources.as_ref().is_some_and(|s| !s.is_empty());
    if config.retention == jetstream::stream::RetentionPolicy::WorkQueue && fed_by_sources {
        return Some(format!(
            "stream {name} is a group's work queue, fed by its source stream: publish to that stream"
        ));
    }
    config.subjects.iter().find_map(|s| {
        reserved_subject(s).then(|| format!("stream {name} captures the reserved subject space of {s:?}"))
    })
}

/// Whether a subject is in a reserved space.
fn reserved_subject(subject: &str) -> bool {
    RESERVED_SUBJECT_PREFIXES.iter().any(|p| subject.starts_with(p))
}

/// Turns a request into a subject, headers and payload, or says what is wrong.
pub fn prepare(
    shape: &StreamShape,
    request: PublishRequest,
    idempotency_key: Option<&str>,
    max_payload: usize,
) -> Result<Prepared, ApiError> {
    let bad = |m: String| ApiError::BadRequest(m);
    if let Some(why) = &shape.reserved {
        return Err(ApiError::Reserved(why.clone()));
    }
    if request.spread.is_some() && request.key.is_some() {
        return Err(bad("spread is for keyless messages: a key decides its partition".into()));
    }
    let random = request.spread == Some(Spread::Random);
    let (subject, key, partition) = match (request.subject.as_deref(), request.key.as_deref(), &shape.key_slot) {
        // The common case, kept free of pattern matching: a key in the
        // stream's own one-wildcard subject.
        (None, Some(key), Some(slot)) => {
            let token = encode_key(key).map_err(|e| bad(e.to_string()))?;
            let subject = format!("{}{token}{}", slot.prefix, slot.suffix);
            let partition = match &shape.stamping {
                Some((_, spec)) if slot.key_only_hash => Some(partition_of_tokens([token.as_str()], spec.partitions)),
                _ => stamped_partition(shape, &subject)?,
            };
            (subject, Some(key.to_owned()), partition)
        }
        (subject, key, _) => {
            let (subject, key) = resolve_subject(shape, key, subject, random)?;
            let partition = stamped_partition(shape, &subject)?;
            (subject, key, partition)
        }
    };

    if reserved_subject(&subject) {
        return Err(ApiError::Reserved(format!("subject {subject:?} is in a reserved subject space ($…, keygate.…)")));
    }

    let mut headers = HeaderMap::new();
    let mut header_bytes = 0usize;
    let mut has_content_type = false;
    for (name, values) in request.headers.into_iter().flatten() {
        // Headers are delivered as HTTP headers: one HTTP cannot carry would
        // make every delivery fail until the message dead-letters.
        if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(bad(format!("header name {name:?} is not a valid HTTP header name")));
        }
        let lower = name.to_ascii_lowercase();
        if RESERVED_HEADER_PREFIXES.iter().any(|p| lower.starts_with(p)) {
            return Err(bad(format!("header {name:?} is reserved (Nats-*, KV-*); use msg_id for de-duplication")));
        }
        has_content_type |= name.eq_ignore_ascii_case("content-type");
        let values = match values {
            HeaderValues::One(v) => vec![v],
            HeaderValues::Many(v) => v,
        };
        for value in values {
            if axum::http::HeaderValue::from_str(&value).is_err() {
                return Err(bad(format!("header {name:?} has a value HTTP cannot carry (control characters)")));
            }
            header_bytes += name.len() + value.len() + 4;
            headers.append(name.as_str(), value.as_str());
        }
    }

    let payload = match (request.data, request.data_base64) {
        (Some(_), Some(_)) => return Err(bad("give data or data_base64, not both".into())),
        (Some(json), None) => {
            if !has_content_type && request.content_type.is_none() {
                headers.insert("Content-Type", "application/json");
            }
            Bytes::copy_from_slice(json.get().as_bytes())
        }
        (None, Some(b64)) => Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| bad(format!("data_base64 is not valid base64: {e}")))?,
        ),
        (None, None) => Bytes::new(),
    };
    if let Some(ct) = &request.content_type {
        if has_content_type {
            return Err(bad("give content_type or a Content-Type header, not both".into()));
        }
        if ct.contains(['\r', '\n']) {
            return Err(bad("content_type has a line break".into()));
        }
        headers.insert("Content-Type", ct.as_str());
    }

    let msg_id = match (request.msg_id.as_deref(), idempotency_key) {
        (Some(a), Some(b)) if a != b => return Err(bad("msg_id and the Idempotency-Key header differ".into())),
        (a, b) => a.or(b),
    };
    if let Some(id) = msg_id {
        if id.is_empty() || id.len() > MAX_MSG_ID || id.contains(['\r', '\n']) {
            return Err(bad(format!("msg_id must be 1 to {MAX_MSG_ID} characters on one line")));
        }
        header_bytes += id.len() + 16;
    }
    let size = payload.len() + header_bytes + subject.len();
    if size > max_payload {
        return Err(ApiError::PayloadTooLarge(format!(
            "the message is {size} bytes with headers; the server accepts at most {max_payload}"
        )));
    }
    // The user's headers first (keeping repeated values), then keygate's own;
    // Nats-Expected-Stream makes the server refuse a subject that another
    // stream captures (the stream may have changed since its shape was read).
    headers.insert(async_nats::header::NATS_EXPECTED_STREAM, shape.name.as_str());
    if let Some(id) = msg_id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    Ok(Prepared { subject, partition, key, headers, payload, idempotent: msg_id.is_some() })
}

/// The subject a message goes to and the key it carries.
fn resolve_subject(
    shape: &StreamShape,
    key: Option<&str>,
    subject: Option<&str>,
    random: bool,
) -> Result<(String, Option<String>), ApiError> {
    let bad = |m: String| ApiError::BadRequest(m);
    let template = match subject {
        Some(s) => SubjectPattern::parse(s).map_err(|e| bad(e.to_string()))?,
        None => match shape.patterns.as_slice() {
            [only] => only.clone(),
            [] => return Err(bad(format!("stream {} has no subjects to publish to", shape.name))),
            _ => return Err(bad(format!("stream {} has several subjects: give subject", shape.name))),
        },
    };
    if template.has_tail() {
        return Err(bad(format!(
            "subject {:?} ends in >: give a literal subject, or one with a single * for the key",
            template.as_string()
        )));
    }
    let stars = template.star_count();
    let subject = match (stars, key) {
        (0, None) => template.as_string(),
        (0, Some(_)) => {
            return Err(bad(format!(
                "subject {:?} has no * for the key to fill; drop the key or put a * where it goes",
                template.as_string()
            )))
        }
        (1, Some(k)) => fill(&template, &encode_key(k).map_err(|e| bad(e.to_string()))?),
        (1, None) => keyless_subject(shape, &template, random),
        (n, _) => {
            return Err(bad(format!(
                "subject {:?} has {n} wildcards; give a subject with the other tokens filled and one * for the key",
                template.as_string()
            )))
        }
    };
    if !shape.patterns.iter().any(|p| p.captures(&subject).is_some()) {
        return Err(bad(format!(
            "subject {subject:?} is not one of stream {}'s subjects ({})",
            shape.name,
            shape.patterns.iter().map(SubjectPattern::as_string).collect::<Vec<_>>().join(", ")
        )));
    }
    let key = key.map(str::to_owned).or_else(|| {
        // A literal subject's key is its token in the key position, if any.
        let (source, spec) = shape.stamping.as_ref()?;
        let captured = source.captures(&subject)?;
        match spec.wildcards.as_slice() {
            [w] => decode_key(captured.get((*w as usize).checked_sub(1)?)?),
            _ => None,
        }
    });
    Ok((subject, key))
}

fn stamped_partition(shape: &StreamShape, subject: &str) -> Result<Option<u32>, ApiError> {
    let Some((source, spec)) = &shape.stamping else { return Ok(None) };
    spec.partition_of_subject(source, subject)
        .map(Some)
        .ok_or_else(|| ApiError::BadRequest(format!("subject {subject:?} is not stamped by stream {}", shape.name)))
}

fn fill(template: &SubjectPattern, token: &str) -> String {
    template.as_string().split('.').map(|t| if t == "*" { token } else { t }).collect::<Vec<_>>().join(".")
}

/// A keyless message gets a marker token chosen so that successive keyless
/// messages land on successive partitions (or, `random`, on a random one).
fn keyless_subject(shape: &StreamShape, template: &SubjectPattern, random: bool) -> String {
    let Some((source, spec)) = &shape.stamping else {
        return fill(template, &keyless_token(shape.keyless_counter.fetch_add(1, Ordering::Relaxed)));
    };
    let target = if random {
        rand::random_range(0..spec.partitions)
    } else {
        (shape.next_partition.fetch_add(1, Ordering::Relaxed) % spec.partitions as u64) as u32
    };
    let mut subject = String::new();
    // Expected tries are the partition count; give up (any partition will
    // do) if the marker's position does not take part in the hash.
    for _ in 0..(spec.partitions as usize * 32).max(64) {
        let n = shape.keyless_counter.fetch_add(1, Ordering::Relaxed);
        subject = fill(template, &keyless_token(n));
        if spec.partition_of_subject(source, &subject) == Some(target) {
            break;
        }
    }
    subject
}

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
    failed: Option<(usize, ApiError)>,
}

/// What the sender does with a message, given its key's progress.
enum Turn {
    Send,
    Wait,
    Refused(ApiError),
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
    prepared: Vec<Result<Prepared, ApiError>>,
) -> Vec<Result<PublishAck, ApiError>> {
    type Sent = Result<(Prepared, jetstream::context::PublishAckFuture), ApiError>;
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
                    let result = match acknowledged(js, &prepared, ack, &resend_until).await {
                        Ok(ack) if ack.stream != shape.name => Err(ApiError::Internal(format!(
                            "message stored in stream {} instead of {}",
                            ack.stream, shape.name
                        ))),
                        Ok(ack) if ack.duplicate => Ok(stored_ack(js, shape, ack.sequence, &prepared).await),
                        Ok(ack) => Ok(PublishAck {
                            stream: ack.stream,
                            seq: ack.sequence,
                            subject: prepared.subject,
                            partition: prepared.partition,
                            key: prepared.key,
                            duplicate: false,
                        }),
                        Err(e) => Err(publish_error(e)),
                    };
                    (Some(subject), result)
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
) -> Result<Vec<PublishAck>, ApiError> {
    use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE};
    if prepared.len() > MAX_ATOMIC_MESSAGES {
        return Err(ApiError::PayloadTooLarge(format!(
            "an atomic batch holds at most {MAX_ATOMIC_MESSAGES} messages, not {}",
            prepared.len()
        )));
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
            .map_err(|e| ApiError::Internal(format!("unreadable atomic batch answer: {e}")))?;
        if let Some(error) = answer.error {
            return Err(atomic_refusal(error));
        }
        if i + 1 == last {
            commit = Some(answer);
        }
    }
    let commit = commit.ok_or_else(|| ApiError::Unavailable("the atomic batch was not committed; retry".into()))?;
    let count = commit.count.unwrap_or(last as u64);
    if count != last as u64 {
        return Err(ApiError::Internal(format!("the server committed {count} of {last} messages")));
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
fn atomic_refusal(error: AtomicError) -> ApiError {
    /// Atomic publish is not enabled on the stream.
    const ATOMIC_DISABLED: u64 = 10174;
    match error.err_code {
        ATOMIC_DISABLED => {
            ApiError::Conflict("the stream does not allow atomic batches: create it with \"allow_atomic\": true".into())
        }
        _ => ApiError::BadRequest(format!("the server refused the atomic batch: {}", error.description)),
    }
}

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
async fn acknowledged(
    js: &jetstream::Context,
    prepared: &Prepared,
    ack: jetstream::context::PublishAckFuture,
    resend_until: &std::sync::Mutex<Option<Instant>>,
) -> Result<jetstream::publish::PublishAck, jetstream::context::PublishError> {
    use jetstream::context::PublishErrorKind as K;
    let safe_to_resend = |e: &jetstream::context::PublishError| match e.kind() {
        K::StreamNotFound => true,
        K::TimedOut | K::BrokenPipe => prepared.idempotent,
        _ => false,
    };
    let mut outcome = ack.await;
    for delay in RESEND_BACKOFF {
        match &outcome {
            Err(e) if safe_to_resend(e) => {
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
async fn stored_ack(js: &jetstream::Context, shape: &StreamShape, seq: u64, retry: &Prepared) -> PublishAck {
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

fn publish_error(e: jetstream::context::PublishError) -> ApiError {
    use jetstream::context::PublishErrorKind as K;
    match e.kind() {
        K::MaxPayloadExceeded => ApiError::PayloadTooLarge("the message exceeds the server's max_payload".into()),
        K::StreamNotFound => ApiError::Unavailable("no stream answered for the subject; retry".into()),
        K::TimedOut | K::BrokenPipe | K::MaxAckPending => {
            tracing::warn!(error = %e, "publish not acknowledged");
            ApiError::Unavailable(
                "JetStream did not acknowledge the message; retry, with msg_id to avoid duplicates".into(),
            )
        }
        _ => {
            let text = e.to_string();
            if text.contains("10060") || text.contains("expected stream") {
                ApiError::BadRequest(format!("the subject belongs to another stream: {text}"))
            } else if text.contains("maximum") || text.contains("limit") || text.contains("10077") {
                tracing::warn!(error = %text, "stream refused a message");
                ApiError::Unavailable("the stream is full (a limit with discard new); retry later".into())
            } else {
                unavailable_or_internal("publishing", e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::stream::{Config, RetentionPolicy, Source};

    fn stream(name: &str, subjects: &[&str]) -> Config {
        Config { name: name.into(), subjects: subjects.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    fn message(body: serde_json::Value) -> PublishRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn state_streams_and_work_queues_are_reserved_for_every_caller() {
        for name in ["KV_keygate-webhooks", "KV_static-consumer-groups", "OBJ_files", "KEYGATE_DEAD_LETTERS"] {
            assert!(reserved_stream(&stream(name, &["x.>"])).is_some(), "{name}");
        }
        assert!(reserved_stream(&stream("SYS", &["$SYS.>"])).is_some());
        assert!(reserved_stream(&stream("MINE", &["keygate.events.>"])).is_some());
        let work_queue = Config {
            retention: RetentionPolicy::WorkQueue,
            sources: Some(vec![Source { name: "ORDERS".into(), ..Default::default() }]),
            ..stream("ORDERS-billing", &[])
        };
        assert!(reserved_stream(&work_queue).is_some());
        assert_eq!(reserved_stream(&stream("ORDERS", &["orders.*"])), None);
        assert_eq!(reserved_stream(&stream("KVX", &["kv.*"])), None, "only the prefixes JetStream uses");
    }

    #[test]
    fn publishing_to_reserved_state_is_refused_before_anything_is_sent() {
        let shape = StreamShape::from_config(&stream("KV_keygate-webhooks", &["$KV.keygate-webhooks.>"]));
        let request = message(serde_json::json!({"subject": "$KV.keygate-webhooks.S.g.m1", "data": {}}));
        assert!(matches!(prepare(&shape, request, None, 1 << 20), Err(ApiError::Reserved(_))));
        let open = StreamShape::from_config(&stream("WIDE", &[">"]));
        for subject in ["$KV.keygate-webhooks.S.g.m1", "$JS.API.STREAM.DELETE.X", "keygate.control.S.g.m"] {
            let request = message(serde_json::json!({"subject": subject, "data": 1}));
            assert!(matches!(prepare(&open, request, None, 1 << 20), Err(ApiError::Reserved(_))), "{subject}");
        }
    }

    #[test]
    fn header_names_and_values_follow_http_and_reserved_prefixes_are_refused() {
        let shape = StreamShape::from_config(&stream("ORDERS", &["orders.*"]));
        let with = |headers: serde_json::Value| message(serde_json::json!({"key": "k", "data": 1, "headers": headers}));
        for refused in [
            serde_json::json!({"a(b": "x"}),
            serde_json::json!({"a b": "x"}),
            serde_json::json!({"KV-Operation": "DEL"}),
            serde_json::json!({"Nats-Expected-Stream": "X"}),
            serde_json::json!({"x-ok": "line\u{0}break"}),
            serde_json::json!({"x-ok": ["fine", "bad\r\nInjected: 1"]}),
        ] {
            assert!(
                matches!(prepare(&shape, with(refused.clone()), None, 1 << 20), Err(ApiError::BadRequest(_))),
                "{refused}"
            );
        }
        let accepted = serde_json::json!({"X-Trace": "abc", "x-many": ["1", "2"], "x-utf8": "café"});
        assert!(prepare(&shape, with(accepted), None, 1 << 20).is_ok());
    }
}
