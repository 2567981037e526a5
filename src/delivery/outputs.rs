//! Outputs: the messages an endpoint's answer asks keygate to publish
//! before it acks the message delivered (docs/pipelines.md). This module
//! reads them from an answer and holds them to the registration's declared
//! streams and to the limits (pure); `runtime/outputs.rs` publishes them.
//!
//! An answer is `{"publish":[{"stream","key","data"|"data_base64",…}…]}`.
//! Any other 2xx body acks as it always did: only a JSON answer that has a
//! `publish` member is read as outputs, and once it is, it is all or
//! nothing (one bad item refuses the whole answer, and nothing of it is
//! published).

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::ToSchema;

use super::verdict::{Judgement, Verdict};
use crate::names::StreamName;
use crate::publish::{HeaderValues, PublishRequest};

/// Most outputs one answer may carry.
pub const MAX_OUTPUTS: usize = 100;
/// Most payload bytes all outputs of one answer may carry together.
pub const MAX_OUTPUT_BYTES: usize = 1024 * 1024;
/// How much of an answer is read when the registration declares outputs:
/// room for [`MAX_OUTPUT_BYTES`] as base64 with its JSON around it.
pub const MAX_OUTPUT_ANSWER: usize = 2 * 1024 * 1024;
/// Most streams one registration may declare as outputs.
pub const MAX_OUTPUT_STREAMS: usize = 16;

/// One message an endpoint's answer asks keygate to publish: the fields of
/// a publish request (`POST /v1/streams/{stream}/messages`) and the stream.
/// Its `msg_id` is not the endpoint's to choose: keygate derives it from
/// the message delivered ([`output_msg_id`]).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OutputMessage {
    /// The stream to publish to; one of the registration's `outputs`.
    #[schema(example = "PAYMENTS")]
    pub stream: String,
    /// The message key (its partition and order in the target stream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// A literal subject, or a pattern with one `*` the key fills.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// The payload as JSON, any value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<serde_json::Value>)]
    pub data: Option<Box<RawValue>>,
    /// Or the payload as base64 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// Content type recorded with the payload (default `application/json` for `data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// Message headers: a string or an array of strings per name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, HeaderValues>>,
}

/// Equal when every field is, a JSON payload compared as the text given
/// (`RawValue` has no equality of its own).
impl PartialEq for OutputMessage {
    fn eq(&self, other: &Self) -> bool {
        let data = |m: &Self| m.data.as_ref().map(|d| d.get().to_owned());
        self.stream == other.stream
            && self.key == other.key
            && self.subject == other.subject
            && data(self) == data(other)
            && self.data_base64 == other.data_base64
            && self.content_type == other.content_type
            && self.headers == other.headers
    }
}

impl Eq for OutputMessage {}

/// What a webhook endpoint may answer (a 2xx with `content-type:
/// application/json`) to have keygate publish messages before it acks the
/// message delivered (docs/pipelines.md).
#[derive(Debug, Deserialize, ToSchema)]
pub struct OutputsAnswer {
    /// Published in this order, each stored before the delivered message
    /// is acked.
    #[schema(max_items = 100)]
    pub publish: Vec<OutputMessage>,
}

/// An output checked against the registration: its stream is declared.
#[derive(Debug, Clone)]
pub struct Output {
    pub stream: StreamName,
    pub message: OutputMessage,
}

impl Output {
    /// The publish request it becomes (the msg_id is given apart).
    pub fn request(&self) -> PublishRequest {
        let m = self.message.clone();
        PublishRequest {
            key: m.key,
            subject: m.subject,
            data: m.data,
            data_base64: m.data_base64,
            content_type: m.content_type,
            headers: m.headers,
            msg_id: None,
            spread: None,
        }
    }
}

/// Why an answer's outputs are refused: the delivery is not acked, and
/// nothing of the answer is published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputRefusal {
    #[error("the answer is larger than {MAX_OUTPUT_ANSWER} bytes")]
    AnswerTooLarge,
    #[error("the answer's publish list is not valid: {0}")]
    Malformed(String),
    #[error("the answer publishes {0} messages; at most {MAX_OUTPUTS} are allowed")]
    TooMany(usize),
    #[error("the answer's outputs carry {0} payload bytes; at most {MAX_OUTPUT_BYTES} are allowed")]
    TooLarge(usize),
    #[error("output {index} names stream {stream:?}, which is not among the declared outputs")]
    Undeclared { index: usize, stream: String },
}

/// The `publish` list a 2xx answer carries: `Ok(None)` when it asks
/// nothing (no JSON, no `publish` member). `truncated` says the body was
/// cut at the read limit. [`checked`] holds the list to the declared
/// streams and the limits.
pub fn read_outputs(
    content_type: Option<&str>,
    body: &[u8],
    truncated: bool,
) -> Result<Option<Vec<OutputMessage>>, OutputRefusal> {
    let is_json = content_type.is_some_and(|t| {
        let essence = t.split(';').next().unwrap_or_default().trim();
        essence.eq_ignore_ascii_case("application/json")
    });
    // Answers without outputs are the common case: they cost one scan.
    if !is_json || !contains(body, b"\"publish\"") {
        return Ok(None);
    }
    if truncated {
        return Err(OutputRefusal::AnswerTooLarge);
    }
    let answer: OutputsAnswer = match serde_json::from_slice(body) {
        Ok(answer) => answer,
        // Valid JSON that only mentions "publish" somewhere (in a string,
        // a nested object) is not an outputs answer; a body that is not
        // valid JSON may be one cut short, and is refused.
        Err(_) if is_json_without_publish(body) => return Ok(None),
        Err(e) => return Err(OutputRefusal::Malformed(e.to_string())),
    };
    Ok(Some(answer.publish))
}

/// A verdict and the `publish` list that came with it (a WebSocket or
/// pull client's ack, a batch answer's result) made into the verdict to
/// apply and the outputs to store first. A list that cannot be published
/// whole turns the ack into a retry with the reason, as a webhook's
/// answer does (`webhook/client.rs`); a list with any other verdict is
/// refused by the frame or answer that carried it.
pub fn with_outputs(
    judgement: Judgement,
    publish: Option<Vec<OutputMessage>>,
    declared: &[StreamName],
) -> (Judgement, Vec<Output>) {
    match publish {
        Some(publish) if judgement.verdict == Verdict::Ack => match checked(publish, declared) {
            Ok(outputs) => (judgement, outputs),
            Err(refusal) => {
                let reason = format!("{}, but {refusal}", judgement.reason);
                (Judgement { verdict: Verdict::Nak { delay: None }, reason, ..judgement }, Vec::new())
            }
        },
        _ => (judgement, Vec::new()),
    }
}

/// A `publish` list (a webhook's answer, or a WebSocket or pull client's
/// ack) held to the declared streams and to the limits: all of it, or a
/// refusal and nothing.
pub fn checked(publish: Vec<OutputMessage>, declared: &[StreamName]) -> Result<Vec<Output>, OutputRefusal> {
    if publish.len() > MAX_OUTPUTS {
        return Err(OutputRefusal::TooMany(publish.len()));
    }
    let mut bytes = 0usize;
    let mut outputs = Vec::with_capacity(publish.len());
    for (index, message) in publish.into_iter().enumerate() {
        bytes += payload_len(&message, index)?;
        let stream =
            declared.iter().find(|d| d.as_str() == message.stream).cloned().ok_or_else(|| {
                OutputRefusal::Undeclared { index, stream: message.stream.chars().take(64).collect() }
            })?;
        outputs.push(Output { stream, message });
    }
    if bytes > MAX_OUTPUT_BYTES {
        return Err(OutputRefusal::TooLarge(bytes));
    }
    Ok(outputs)
}

/// The `Nats-Msg-Id` of output `index` of the message at `origin_seq` of
/// `origin_stream`, delivered to `group` (a group, or a plain consumer):
/// the same on every redelivery, so the target stream's duplicate window
/// drops a republish; the group tells apart two groups' outputs of one
/// message.
pub fn output_msg_id(origin_stream: &str, group: &str, origin_seq: u64, index: usize) -> String {
    format!("{origin_stream}:{group}:{origin_seq}:{index}")
}

/// Output `index`'s payload size.
fn payload_len(message: &OutputMessage, index: usize) -> Result<usize, OutputRefusal> {
    let malformed = |why: &str| OutputRefusal::Malformed(format!("output {index}: {why}"));
    match (&message.data, &message.data_base64) {
        (Some(_), Some(_)) => Err(malformed("give data or data_base64, not both")),
        (Some(data), None) => Ok(data.get().len()),
        (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map(|d| d.len())
            .map_err(|_| malformed("data_base64 is not valid base64")),
        (None, None) => Ok(0),
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Whether the body is valid JSON without a `publish` member at its top level.
fn is_json_without_publish(body: &[u8]) -> bool {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(object)) => !object.contains_key("publish"),
        Ok(_) => true,
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared() -> Vec<StreamName> {
        vec![StreamName::parse("PAYMENTS").unwrap(), StreamName::parse("AUDIT").unwrap()]
    }

    /// An answer read and checked against `declared` (nothing asked: no outputs).
    fn read_with(
        content_type: Option<&str>,
        body: &[u8],
        truncated: bool,
        declared: &[StreamName],
    ) -> Result<Vec<Output>, OutputRefusal> {
        checked(read_outputs(content_type, body, truncated)?.unwrap_or_default(), declared)
    }

    fn read(body: &str) -> Result<Vec<Output>, OutputRefusal> {
        read_with(Some("application/json"), body.as_bytes(), false, &declared())
    }

    #[test]
    fn answers_without_outputs_ask_for_nothing() {
        for body in
            ["", "ok", "{}", r#"{"status":"ok"}"#, r#"{"note":"we publish \"publish\" later"}"#, r#"["publish"]"#, "{"]
        {
            assert!(read(body).unwrap().is_empty(), "{body}");
        }
        let not_json = read_with(Some("text/plain"), br#"{"publish":[{"stream":"X"}]}"#, false, &declared());
        assert!(not_json.unwrap().is_empty());
        let none = read_with(None, br#"{"publish":[{"stream":"X"}]}"#, false, &declared());
        assert!(none.unwrap().is_empty());
        assert!(read(r#"{"publish":[]}"#).unwrap().is_empty());
    }

    #[test]
    fn outputs_come_in_the_order_given_with_their_streams() {
        let outputs = read(
            r#"{"publish":[{"stream":"PAYMENTS","key":"alice","data":{"a":1}},
                           {"stream":"AUDIT","data_base64":"aGk=","headers":{"x":"1"}}]}"#,
        )
        .unwrap();
        assert_eq!(outputs.len(), 2);
        assert_eq!(outputs[0].stream.as_str(), "PAYMENTS");
        assert_eq!(outputs[0].request().key.as_deref(), Some("alice"));
        assert_eq!(outputs[1].stream.as_str(), "AUDIT");
        let with_charset = read_with(
            Some("Application/JSON; charset=utf-8"),
            br#"{"publish":[{"stream":"AUDIT"}]}"#,
            false,
            &declared(),
        );
        assert_eq!(with_charset.unwrap().len(), 1);
    }

    #[test]
    fn each_kind_of_bad_answer_is_refused_whole() {
        let undeclared = read(r#"{"publish":[{"stream":"PAYMENTS"},{"stream":"LEDGER"}]}"#).unwrap_err();
        assert_eq!(undeclared, OutputRefusal::Undeclared { index: 1, stream: "LEDGER".into() });
        assert!(matches!(read(r#"{"publish":{"stream":"PAYMENTS"}}"#), Err(OutputRefusal::Malformed(_))));
        assert!(matches!(read(r#"{"publish":null}"#), Err(OutputRefusal::Malformed(_))));
        assert!(matches!(
            read(r#"{"publish":[{"stream":"PAYMENTS","msg_id":"x"}]}"#),
            Err(OutputRefusal::Malformed(_))
        ));
        assert!(matches!(read(r#"{"publish":[{"key":"a"}]}"#), Err(OutputRefusal::Malformed(_))));
        assert!(matches!(read(r#"{"publish":[{"stream":"PAYMENTS","#), Err(OutputRefusal::Malformed(_))));
        let both = read(r#"{"publish":[{"stream":"PAYMENTS","data":1,"data_base64":"aGk="}]}"#).unwrap_err();
        assert!(matches!(both, OutputRefusal::Malformed(ref m) if m.contains("output 0")), "{both}");
        let many = format!(r#"{{"publish":[{}]}}"#, vec![r#"{"stream":"AUDIT"}"#; MAX_OUTPUTS + 1].join(","));
        assert_eq!(read(&many).unwrap_err(), OutputRefusal::TooMany(MAX_OUTPUTS + 1));
        let big = "x".repeat(MAX_OUTPUT_BYTES / 2 + 1);
        let large =
            format!(r#"{{"publish":[{{"stream":"AUDIT","data":"{big}"}},{{"stream":"AUDIT","data":"{big}"}}]}}"#);
        assert!(matches!(read(&large), Err(OutputRefusal::TooLarge(_))));
        let cut = read_with(Some("application/json"), br#"{"publish":[{"stream":"AUDIT"}]}"#, true, &declared());
        assert_eq!(cut.unwrap_err(), OutputRefusal::AnswerTooLarge);
        let none_declared = read_with(Some("application/json"), br#"{"publish":[{"stream":"AUDIT"}]}"#, false, &[]);
        assert!(matches!(none_declared, Err(OutputRefusal::Undeclared { .. })));
    }

    #[test]
    fn output_ids_repeat_for_the_same_delivery_and_differ_across_groups() {
        assert_eq!(output_msg_id("ORDERS", "enrich", 42, 0), "ORDERS:enrich:42:0");
        assert_ne!(output_msg_id("ORDERS", "enrich", 42, 0), output_msg_id("ORDERS", "audit", 42, 0));
        assert_ne!(output_msg_id("ORDERS", "enrich", 42, 0), output_msg_id("ORDERS", "enrich", 42, 1));
    }
}
