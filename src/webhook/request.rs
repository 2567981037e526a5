//! The request one webhook delivery makes: the message's payload unchanged,
//! its forwardable headers, the `keygate-*` headers, trace context, and in
//! the CloudEvents format the binary-mode attributes
//! (docs/architecture.md, "Webhook delivery"); or, for a batched delivery,
//! the JSON array of its messages (docs/batched-deliveries.md).
//! Signed by the client.

use super::client::Outbound;
use super::registration::{DeliveryFormat, Registration};
use crate::cloudevents;
use crate::delivery::frames::message_frame;
use crate::delivery::header_safe;
use crate::delivery::message::{forwardable, Delivered};
use crate::names::MemberRef;
use crate::telemetry::{TraceContext, TRACEPARENT, TRACESTATE};

/// The request for one delivery. `trace` is the delivery span's context
/// when spans are exported: it replaces the one the message carries.
pub fn outbound(
    registration: &Registration,
    who: &MemberRef,
    held: &Delivered,
    fencing: u64,
    trace: Option<&TraceContext>,
) -> Outbound {
    // Room for keygate's ten headers, trace context's two and a few forwarded ones.
    let mut headers = Vec::with_capacity(16);
    let mut content_type = None;
    if let Some(original) = &held.message.headers {
        for (name, values) in original.iter() {
            let name: &str = name.as_ref();
            let replaced =
                trace.is_some() && (name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE));
            if !forwardable(name) || replaced {
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
    headers.extend(trace.into_iter().flat_map(|t| t.headers()).map(|(n, v)| (n.to_owned(), v.to_owned())));
    let id = delivery_id(held);
    if registration.format == DeliveryFormat::Cloudevents {
        let attributes = cloudevents::binary_headers(&event_of(registration, who, held, &id), &headers);
        headers.extend(attributes);
    }
    Outbound { id, body: held.message.payload.clone(), headers }
}

/// A delivery's `webhook-id`: `<stream>-<sequence>`, stable across retries.
pub fn delivery_id(held: &Delivered) -> String {
    format!("{}-{}", held.origin_stream, held.origin_seq)
}

fn event_of<'a>(
    registration: &'a Registration,
    who: &'a MemberRef,
    held: &'a Delivered,
    id: &'a str,
) -> cloudevents::Delivery<'a> {
    cloudevents::Delivery {
        id,
        stream: who.stream.as_str(),
        subject: &held.subject,
        key: held.key.as_deref(),
        time: held.message.info().map_or_else(|_| time::OffsetDateTime::now_utc(), |info| info.published),
        event_type: registration.ce_type.as_deref(),
    }
}

/// The request for a batch: a JSON array of the messages in the order
/// given, each as a WebSocket message frame has it (`raw`), or as a
/// structured-mode event with keygate's facts as extension attributes
/// (`cloudevents`, `application/cloudevents-batch+json`). Its `webhook-id`
/// names the batch by its first and last message. `trace` as for one.
pub fn batch_outbound(
    registration: &Registration,
    who: &MemberRef,
    batch: &[&Delivered],
    fencing: u64,
    trace: Option<&TraceContext>,
) -> Outbound {
    let items: Vec<serde_json::Value> = batch
        .iter()
        .map(|held| match registration.format {
            DeliveryFormat::Raw => serde_json::to_value(message_frame(who, held, fencing)).unwrap_or_default(),
            DeliveryFormat::Cloudevents => {
                let id = delivery_id(held);
                let present: Vec<(String, String)> = held
                    .message
                    .headers
                    .iter()
                    .flat_map(|h| h.iter())
                    .flat_map(|(name, values)| values.iter().map(move |v| (name.to_string(), v.to_string())))
                    .collect();
                let extensions = [
                    ("keygatestream", who.stream.as_str().into()),
                    ("keygatepartition", held.partition.into()),
                    ("keygatestreamseq", held.origin_seq.into()),
                    ("keygateattempt", held.attempt.into()),
                    ("keygatefencing", fencing.into()),
                ];
                let event = event_of(registration, who, held, &id);
                serde_json::Value::Object(cloudevents::structured(&event, &present, &extensions, &held.message.payload))
            }
        })
        .collect();
    let content_type = match registration.format {
        DeliveryFormat::Raw => "application/json",
        DeliveryFormat::Cloudevents => cloudevents::BATCH_MEDIA_TYPE,
    };
    let mut headers = vec![
        ("content-type".to_owned(), content_type.to_owned()),
        ("keygate-stream".into(), who.stream.to_string()),
        ("keygate-group".into(), who.group.to_string()),
        ("keygate-member".into(), who.member.to_string()),
        ("keygate-batch-size".into(), batch.len().to_string()),
        ("keygate-fencing-token".into(), fencing.to_string()),
    ];
    headers.extend(trace.into_iter().flat_map(|t| t.headers()).map(|(n, v)| (n.to_owned(), v.to_owned())));
    let (first, last) = (batch.first().map_or(0, |h| h.origin_seq), batch.last().map_or(0, |h| h.origin_seq));
    let stream = batch.first().map_or("", |h| h.origin_stream.as_str());
    let id = format!("{stream}-{first}-{last}-{}", batch.len());
    Outbound { id, body: serde_json::to_vec(&items).unwrap_or_default().into(), headers }
}
