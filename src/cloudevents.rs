//! CloudEvents 1.0 over HTTP, both ways (docs/cloudevents.md):
//! - publish: an event in structured mode (`application/cloudevents+json`)
//!   or binary mode (`ce-*` headers, the body as data) becomes a message
//!   whose payload is the data and whose headers keep the attributes as
//!   `ce-<name>`, percent-encoded as the HTTP binding says;
//! - delivery: a registration with `"format":"cloudevents"` sends each
//!   message in binary mode, with attributes keygate derives from the
//!   message where the message does not carry its own.
//!
//! Pure mapping; the HTTP handlers and the delivery path call it.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};
use serde_json::value::RawValue;
use serde_json::Value;

/// The only version keygate speaks.
pub const SPEC_VERSION: &str = "1.0";
/// The media type of structured mode.
pub const STRUCTURED_MEDIA_TYPE: &str = "application/cloudevents+json";
/// Binary-mode attribute headers, and the headers of stored messages.
const HEADER_PREFIX: &str = "ce-";
/// Extension attributes are at most this long (CloudEvents 1.0 asks
/// producers to keep them to 20 characters).
const MAX_ATTRIBUTE_NAME: usize = 20;
/// Attribute values a publisher may send, in bytes.
const MAX_ATTRIBUTE_VALUE: usize = 4096;
/// Attributes one event may carry.
const MAX_ATTRIBUTES: usize = 64;
/// The attribute that carries the key (the partitioning extension).
pub const PARTITION_KEY: &str = "partitionkey";

/// What the HTTP binding percent-encodes in a header value: controls,
/// space, `"` and `%` (and everything outside ASCII).
const HEADER_UNSAFE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// An event as a publisher sent it: attributes other than the data's own,
/// and the data.
#[derive(Debug)]
pub struct Event {
    /// Name → value; always `specversion`, `id`, `source` and `type`.
    pub attributes: BTreeMap<String, String>,
    /// `datacontenttype` (the `Content-Type` in binary mode).
    pub content_type: Option<String>,
    pub data: Data,
}

#[derive(Debug)]
pub enum Data {
    None,
    /// JSON, kept byte for byte.
    Json(Box<RawValue>),
    Bytes(Vec<u8>),
}

impl Event {
    /// The key the event names (`partitionkey`), if any.
    pub fn partition_key(&self) -> Option<&str> {
        self.attributes.get(PARTITION_KEY).map(String::as_str)
    }

    /// The attributes as message headers (`ce-<name>`, percent-encoded).
    pub fn headers(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.attributes.iter().map(|(name, value)| (format!("{HEADER_PREFIX}{name}"), encode(value)))
    }
}

/// Why a request is not a CloudEvent keygate accepts (a 400 at the edge).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidEvent(String);

impl From<String> for InvalidEvent {
    fn from(why: String) -> Self {
        Self(why)
    }
}

impl From<&str> for InvalidEvent {
    fn from(why: &str) -> Self {
        Self(why.to_owned())
    }
}

/// Percent-encodes an attribute value for a header.
pub fn encode(value: &str) -> String {
    utf8_percent_encode(value, HEADER_UNSAFE).to_string()
}

fn decode(name: &str, value: &str) -> Result<String, InvalidEvent> {
    percent_decode_str(value)
        .decode_utf8()
        .map(|v| v.into_owned())
        .map_err(|_| format!("ce-{name} is not percent-encoded UTF-8").into())
}

/// Reads a structured-mode event (a JSON object).
pub fn parse_structured(body: &[u8]) -> Result<Event, InvalidEvent> {
    let members: BTreeMap<String, Box<RawValue>> =
        serde_json::from_slice(body).map_err(|e| format!("the body is not a CloudEvents JSON object: {e}"))?;
    let mut attributes = BTreeMap::new();
    let mut content_type = None;
    let (mut data, mut data_base64) = (None, None);
    for (name, raw) in members {
        match name.as_str() {
            "data" => data = Some(raw),
            "data_base64" => data_base64 = Some(raw),
            _ => {
                let Some(value) = attribute_value(&name, raw.get())? else { continue };
                if name == "datacontenttype" {
                    content_type = Some(value);
                } else {
                    attributes.insert(name, value);
                }
            }
        }
    }
    let data = match (data, data_base64) {
        (Some(_), Some(_)) => return Err("give data or data_base64, not both".into()),
        (None, Some(b64)) => {
            let text: String = serde_json::from_str(b64.get()).map_err(|_| "data_base64 must be a string")?;
            Data::Bytes(
                base64::Engine::decode(&base64::engine::general_purpose::STANDARD, text.trim())
                    .map_err(|e| format!("data_base64 is not valid base64: {e}"))?,
            )
        }
        (Some(json), None) if json.get() == "null" => Data::None,
        // A non-JSON media type with a string: the string is the data itself.
        (Some(json), None) if !content_type.as_deref().is_none_or(is_json) && json.get().starts_with('"') => {
            let text: String = serde_json::from_str(json.get()).map_err(|e| e.to_string())?;
            Data::Bytes(text.into_bytes())
        }
        (Some(json), None) => Data::Json(json),
        (None, None) => Data::None,
    };
    let event = Event { attributes, content_type, data };
    check(&event)?;
    Ok(event)
}

/// A structured-mode attribute's value as a string; `None` for `null`
/// (an attribute left out).
fn attribute_value(name: &str, raw: &str) -> Result<Option<String>, InvalidEvent> {
    check_name(name)?;
    match serde_json::from_str::<Value>(raw).map_err(|e| e.to_string())? {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        Value::Bool(b) => Ok(Some(b.to_string())),
        Value::Number(n) if n.is_i64() => Ok(Some(n.to_string())),
        _ => Err(format!("attribute {name} must be a string, an integer or a boolean").into()),
    }
}

/// Reads a binary-mode event: attributes from `ce-*` headers, the body as data.
pub fn parse_binary(headers: &HeaderMap, body: Vec<u8>) -> Result<Event, InvalidEvent> {
    let mut attributes = BTreeMap::new();
    for (name, value) in headers {
        let Some(attribute) = name.as_str().strip_prefix(HEADER_PREFIX) else { continue };
        check_name(attribute)?;
        let value = value.to_str().map_err(|_| format!("ce-{attribute} is not visible ASCII"))?;
        if attributes.insert(attribute.to_owned(), decode(attribute, value)?).is_some() {
            return Err(format!("ce-{attribute} is given twice").into());
        }
    }
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .map(|v| v.to_str().map(str::to_owned).map_err(|_| "Content-Type is not visible ASCII".to_owned()))
        .transpose()?;
    let data = if body.is_empty() { Data::None } else { Data::Bytes(body) };
    let event = Event { attributes, content_type, data };
    check(&event)?;
    Ok(event)
}

/// Whether a request is a binary-mode event.
pub fn is_binary(headers: &HeaderMap) -> bool {
    const SPECVERSION: axum::http::HeaderName = axum::http::HeaderName::from_static("ce-specversion");
    headers.contains_key(SPECVERSION)
}

/// Whether a request is a structured-mode event.
pub fn is_structured(headers: &HeaderMap) -> bool {
    media_type(headers).is_some_and(|t| t.eq_ignore_ascii_case(STRUCTURED_MEDIA_TYPE))
}

fn media_type(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(axum::http::header::CONTENT_TYPE)?.to_str().ok()?;
    Some(value.split(';').next().unwrap_or_default().trim())
}

fn is_json(content_type: &str) -> bool {
    let media = content_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    media == "application/json" || media == "text/json" || media.ends_with("+json")
}

fn check_name(name: &str) -> Result<(), InvalidEvent> {
    let valid = !name.is_empty()
        && name.len() <= MAX_ATTRIBUTE_NAME
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if valid {
        Ok(())
    } else {
        Err(format!("{name:?} is not a CloudEvents attribute name (a-z and 0-9, at most {MAX_ATTRIBUTE_NAME})").into())
    }
}

/// The rules of CloudEvents 1.0 keygate enforces: the version, the required
/// attributes, an RFC 3339 `time`, and bounds on what is stored.
fn check(event: &Event) -> Result<(), InvalidEvent> {
    let attributes = &event.attributes;
    match attributes.get("specversion").map(String::as_str) {
        Some(SPEC_VERSION) => {}
        Some(other) => return Err(format!("specversion {other:?} is not supported; send 1.0").into()),
        None => return Err("specversion is required".into()),
    }
    for required in ["id", "source", "type"] {
        if attributes.get(required).is_none_or(String::is_empty) {
            return Err(format!("{required} is required and must not be empty").into());
        }
    }
    if let Some(time) = attributes.get("time") {
        time::OffsetDateTime::parse(time, &time::format_description::well_known::Rfc3339)
            .map_err(|_| format!("time {time:?} is not an RFC 3339 timestamp"))?;
    }
    if attributes.len() > MAX_ATTRIBUTES {
        return Err(format!("an event may carry at most {MAX_ATTRIBUTES} attributes").into());
    }
    if let Some((name, _)) = attributes.iter().find(|(_, v)| v.len() > MAX_ATTRIBUTE_VALUE) {
        return Err(format!("attribute {name} is longer than {MAX_ATTRIBUTE_VALUE} bytes").into());
    }
    if attributes.values().any(|v| v.contains(['\r', '\n', '\0'])) {
        return Err("attribute values may not hold line breaks or NUL".into());
    }
    Ok(())
}

/// What keygate says about a message it delivers as an event.
pub struct Delivery<'a> {
    /// `ce-id`: the delivery's `webhook-id`.
    pub id: &'a str,
    pub stream: &'a str,
    /// The subject without its partition token.
    pub subject: &'a str,
    pub key: Option<&'a str>,
    pub time: time::OffsetDateTime,
    /// The registration's `ce_type`; default: the subject.
    pub event_type: Option<&'a str>,
}

/// Binary-mode headers for a delivery: `ce-specversion`, `ce-id`,
/// `ce-source` (`keygate/<stream>`), `ce-type`, `ce-time`, `ce-subject` and
/// `ce-partitionkey`, except those the message already carries (an event
/// published as one keeps its own attributes).
pub fn binary_headers(delivery: &Delivery<'_>, present: &[(String, String)]) -> Vec<(String, String)> {
    let time = delivery.time.format(&time::format_description::well_known::Rfc3339).unwrap_or_default();
    let source = format!("keygate/{}", delivery.stream);
    let derived = [
        ("specversion", Some(SPEC_VERSION)),
        ("id", Some(delivery.id)),
        ("source", Some(source.as_str())),
        ("type", Some(delivery.event_type.unwrap_or(delivery.subject))),
        ("time", Some(time.as_str())),
        ("subject", Some(delivery.subject)),
        (PARTITION_KEY, delivery.key),
    ];
    derived
        .into_iter()
        .filter_map(|(name, value)| Some((format!("{HEADER_PREFIX}{name}"), encode(value?))))
        .filter(|(header, _)| !present.iter().any(|(name, _)| name.eq_ignore_ascii_case(header)))
        .collect()
}

/// One delivery as a structured-mode event (an element of a batch's
/// `application/cloudevents-batch+json` array): the derived attributes and
/// the message's own `ce-*` headers (theirs win), `extensions` (keygate's
/// delivery facts), and the payload as `data` when it is JSON, else
/// `data_base64`.
pub fn structured(
    delivery: &Delivery<'_>,
    present: &[(String, String)],
    extensions: &[(&str, Value)],
    payload: &[u8],
) -> serde_json::Map<String, Value> {
    let mut event = serde_json::Map::new();
    let carried = present.iter().filter_map(|(name, value)| {
        let attribute = name.get(..HEADER_PREFIX.len())?.eq_ignore_ascii_case(HEADER_PREFIX).then(|| &name[3..])?;
        Some((attribute.to_ascii_lowercase(), value.as_str()))
    });
    let derived = binary_headers(delivery, &[]);
    let derived = derived.iter().map(|(name, value)| (name[HEADER_PREFIX.len()..].to_owned(), value.as_str()));
    for (attribute, value) in derived.chain(carried) {
        let value = percent_decode_str(value).decode_utf8_lossy().into_owned();
        event.insert(attribute, Value::String(value));
    }
    for (name, value) in extensions {
        event.insert((*name).to_owned(), value.clone());
    }
    match serde_json::from_slice::<Value>(payload) {
        Ok(data) => {
            event.entry("datacontenttype").or_insert_with(|| Value::String("application/json".into()));
            event.insert("data".into(), data);
        }
        Err(_) => {
            use base64::Engine as _;
            let encoded = base64::engine::general_purpose::STANDARD.encode(payload);
            event.insert("data_base64".into(), Value::String(encoded));
        }
    }
    event
}

/// The media type of a batch of structured events.
pub const BATCH_MEDIA_TYPE: &str = "application/cloudevents-batch+json";

/// Checks a registration's `ce_type`.
pub fn check_event_type(event_type: &str) -> Result<(), InvalidEvent> {
    if event_type.is_empty() || event_type.len() > 256 || event_type.chars().any(char::is_control) {
        return Err("ce_type must be 1 to 256 characters without control characters".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
        }
        map
    }

    #[test]
    fn a_structured_event_keeps_its_attributes_and_its_data_byte_for_byte() {
        let body = br#"{"specversion":"1.0","id":"e1","source":"/orders","type":"order.created",
            "partitionkey":"alice","priority":3,"urgent":true,"time":"2026-12-02T03:00:00Z",
            "datacontenttype":"application/json","data":{"total": 9.50}}"#;
        let event = parse_structured(body).unwrap();
        assert_eq!(event.partition_key(), Some("alice"));
        assert_eq!(event.attributes["priority"], "3");
        assert_eq!(event.attributes["urgent"], "true");
        assert_eq!(event.content_type.as_deref(), Some("application/json"));
        let Data::Json(data) = &event.data else { panic!("{:?}", event.data) };
        assert_eq!(data.get(), r#"{"total": 9.50}"#);
        let headers: Vec<_> = event.headers().collect();
        assert!(headers.contains(&("ce-source".into(), "/orders".into())), "{headers:?}");
        assert!(!headers.iter().any(|(n, _)| n == "ce-datacontenttype"), "the content type is the message's own");
    }

    #[test]
    fn structured_data_is_base64_bytes_or_the_string_of_a_non_json_type() {
        let b64 = br#"{"specversion":"1.0","id":"1","source":"s","type":"t","data_base64":"AAEC"}"#;
        assert!(matches!(parse_structured(b64).unwrap().data, Data::Bytes(b) if b == [0, 1, 2]));
        let text =
            br#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"text/plain","data":"hi"}"#;
        assert!(matches!(parse_structured(text).unwrap().data, Data::Bytes(b) if b == b"hi"));
        let json_string = br#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":"hi"}"#;
        assert!(matches!(parse_structured(json_string).unwrap().data, Data::Json(j) if j.get() == "\"hi\""));
    }

    #[test]
    fn events_that_break_the_spec_are_refused_with_the_reason() {
        for (body, why) in [
            (r#"{"id":"1","source":"s","type":"t"}"#, "specversion is required"),
            (r#"{"specversion":"0.3","id":"1","source":"s","type":"t"}"#, "not supported"),
            (r#"{"specversion":"1.0","source":"s","type":"t"}"#, "id is required"),
            (r#"{"specversion":"1.0","id":"1","source":"","type":"t"}"#, "source is required"),
            (r#"{"specversion":"1.0","id":"1","source":"s","type":"t","time":"yesterday"}"#, "RFC 3339"),
            (r#"{"specversion":"1.0","id":"1","source":"s","type":"t","Bad-Name":"x"}"#, "attribute name"),
            (r#"{"specversion":"1.0","id":"1","source":"s","type":"t","nested":{"a":1}}"#, "must be a string"),
            (r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":1,"data_base64":"AA=="}"#, "not both"),
            (r#"[1]"#, "not a CloudEvents JSON object"),
        ] {
            let err = parse_structured(body.as_bytes()).unwrap_err();
            assert!(err.to_string().contains(why), "{body}: {err}");
        }
    }

    #[test]
    fn binary_mode_attributes_are_percent_decoded_and_the_body_is_the_data() {
        let map = headers(&[
            ("ce-specversion", "1.0"),
            ("ce-id", "e%201"),
            ("ce-source", "https%3A%2F%2Fexample.com%2Fx"),
            ("ce-type", "t"),
            ("ce-partitionkey", "k%C3%A7"),
            ("content-type", "text/plain"),
        ]);
        let event = parse_binary(&map, b"hello".to_vec()).unwrap();
        assert_eq!(event.attributes["id"], "e 1");
        assert_eq!(event.attributes["source"], "https://example.com/x");
        assert_eq!(event.partition_key(), Some("kç"));
        assert_eq!(event.content_type.as_deref(), Some("text/plain"));
        let stored: BTreeMap<_, _> = event.headers().collect();
        assert_eq!(stored["ce-id"], "e%201");
        assert_eq!(stored["ce-partitionkey"], "k%C3%A7");
        let missing = headers(&[("ce-specversion", "1.0"), ("ce-id", "1"), ("ce-source", "s")]);
        assert!(parse_binary(&missing, Vec::new()).unwrap_err().to_string().contains("type is required"));
    }

    #[test]
    fn deliveries_derive_what_the_message_does_not_carry() {
        let delivery = Delivery {
            id: "ORDERS-7",
            stream: "ORDERS",
            subject: "orders.alice",
            key: Some("a b"),
            time: time::OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap(),
            event_type: None,
        };
        let derived: BTreeMap<_, _> = binary_headers(&delivery, &[]).into_iter().collect();
        assert_eq!(derived["ce-specversion"], "1.0");
        assert_eq!(derived["ce-id"], "ORDERS-7");
        assert_eq!(derived["ce-source"], "keygate/ORDERS");
        assert_eq!(derived["ce-type"], "orders.alice");
        assert_eq!(derived["ce-time"], "2027-01-15T08:00:00Z");
        assert_eq!(derived["ce-partitionkey"], "a%20b");
        let own = vec![("ce-id".to_owned(), "original".to_owned()), ("ce-type".to_owned(), "mine".to_owned())];
        let derived: BTreeMap<_, _> =
            binary_headers(&Delivery { event_type: Some("x"), ..delivery }, &own).into_iter().collect();
        assert!(!derived.contains_key("ce-id") && !derived.contains_key("ce-type"), "{derived:?}");
    }
}
