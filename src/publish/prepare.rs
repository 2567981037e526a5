//! A REST message made ready for JetStream: its subject (from the key and
//! the stream's shape), headers and payload, refused before anything is
//! sent when it names keygate's or the server's own state.

use std::sync::atomic::Ordering;

use async_nats::jetstream::message::PublishMessage;
use async_nats::HeaderMap;
use base64::Engine as _;
use bytes::Bytes;

use super::error::{PublishError as Error, PublishErrorKind as Kind};
use super::{HeaderValues, PublishRequest, Spread};
use crate::partition::{decode_key, encode_key, keyless_token, partition_of_tokens, SubjectPattern};
use crate::streams::{reserved_subject, StreamShape};

/// A message ready to go to JetStream.
pub struct Prepared {
    pub subject: String,
    pub partition: Option<u32>,
    pub key: Option<String>,
    /// The message's headers with keygate's own (`Nats-Expected-Stream`,
    /// `Nats-Msg-Id`).
    pub(super) headers: HeaderMap,
    pub(super) payload: Bytes,
    /// Carries a msg_id: sending it again cannot store it twice.
    pub(super) idempotent: bool,
}

impl Prepared {
    pub(super) fn publish(&self) -> PublishMessage {
        PublishMessage::build().headers(self.headers.clone()).payload(self.payload.clone())
    }

    /// Marks the message as the redrive of dead letter `letter_id`: a
    /// header only keygate sets (publishers' requests with it are refused).
    pub fn redriven_from(mut self, letter_id: &str, max_payload: usize) -> Result<Self, Error> {
        let header_bytes: usize = self
            .headers
            .iter()
            .flat_map(|(n, vs)| vs.iter().map(move |v| AsRef::<str>::as_ref(n).len() + v.as_str().len() + 4))
            .sum();
        let size =
            self.payload.len() + self.subject.len() + header_bytes + super::REDRIVEN_FROM.len() + letter_id.len() + 4;
        if size > max_payload {
            return Err(Error::new(
                Kind::TooLarge,
                format!(
                    "the redriven message would be {size} bytes with headers; the server accepts at most {max_payload}"
                ),
            ));
        }
        self.headers.insert(super::REDRIVEN_FROM, letter_id);
        Ok(self)
    }
}

/// Header prefixes the server acts on (`Nats-Msg-Id`, `Nats-Expected-*`,
/// `KV-Operation`): a publisher setting them could delete KV entries or
/// forge de-duplication, so they are keygate's alone.
const RESERVED_HEADER_PREFIXES: [&str; 2] = ["nats-", "kv-"];
const MAX_MSG_ID: usize = 256;

/// Turns a request into a subject, headers and payload, or says what is wrong.
pub fn prepare(
    shape: &StreamShape,
    request: PublishRequest,
    idempotency_key: Option<&str>,
    max_payload: usize,
) -> Result<Prepared, Error> {
    let bad = |m: String| Error::new(Kind::InvalidMessage, m);
    if let Some(why) = &shape.reserved {
        return Err(Error::new(Kind::Reserved, why.clone()));
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
        return Err(Error::new(
            Kind::Reserved,
            format!("subject {subject:?} is in a reserved subject space ($…, keygate.…)"),
        ));
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
        if lower == super::REDRIVEN_FROM {
            return Err(bad(format!("header {name:?} is set by keygate when it redrives a dead letter")));
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
        return Err(Error::new(
            Kind::TooLarge,
            format!("the message is {size} bytes with headers; the server accepts at most {max_payload}"),
        ));
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
) -> Result<(String, Option<String>), Error> {
    let bad = |m: String| Error::new(Kind::InvalidMessage, m);
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

fn stamped_partition(shape: &StreamShape, subject: &str) -> Result<Option<u32>, Error> {
    let Some((source, spec)) = &shape.stamping else { return Ok(None) };
    spec.partition_of_subject(source, subject).map(Some).ok_or_else(|| {
        Error::new(Kind::InvalidMessage, format!("subject {subject:?} is not stamped by stream {}", shape.name))
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::stream::Config;

    fn stream(name: &str, subjects: &[&str]) -> Config {
        Config { name: name.into(), subjects: subjects.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    fn message(body: serde_json::Value) -> PublishRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn publishing_to_reserved_state_is_refused_before_anything_is_sent() {
        let shape = StreamShape::from_config(&stream("KV_keygate-webhooks", &["$KV.keygate-webhooks.>"]));
        let request = message(serde_json::json!({"subject": "$KV.keygate-webhooks.S.g.m1", "data": {}}));
        assert!(matches!(prepare(&shape, request, None, 1 << 20), Err(e) if e.kind() == Kind::Reserved));
        let open = StreamShape::from_config(&stream("WIDE", &[">"]));
        for subject in ["$KV.keygate-webhooks.S.g.m1", "$JS.API.STREAM.DELETE.X", "keygate.control.S.g.m"] {
            let request = message(serde_json::json!({"subject": subject, "data": 1}));
            assert!(
                matches!(prepare(&open, request, None, 1 << 20), Err(e) if e.kind() == Kind::Reserved),
                "{subject}"
            );
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
                matches!(prepare(&shape, with(refused.clone()), None, 1 << 20), Err(e) if e.kind() == Kind::InvalidMessage),
                "{refused}"
            );
        }
        let accepted = serde_json::json!({"X-Trace": "abc", "x-many": ["1", "2"], "x-utf8": "café"});
        assert!(prepare(&shape, with(accepted), None, 1 << 20).is_ok());
    }
}
