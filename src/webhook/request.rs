//! The request one webhook delivery makes: the message's payload unchanged,
//! its forwardable headers, the `keygate-*` headers, trace context, and in
//! the CloudEvents format the binary-mode attributes
//! (docs/architecture.md, "Webhook delivery"). Signed by the client.

use super::client::Outbound;
use super::registration::{DeliveryFormat, Registration};
use crate::cloudevents;
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
    let mut headers = Vec::new();
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
    let id = format!("{}-{}", held.origin_stream, held.origin_seq);
    if registration.format == DeliveryFormat::Cloudevents {
        let event = cloudevents::Delivery {
            id: &id,
            stream: who.stream.as_str(),
            subject: &held.subject,
            key: held.key.as_deref(),
            time: held.message.info().map_or_else(|_| time::OffsetDateTime::now_utc(), |info| info.published),
            event_type: registration.ce_type.as_deref(),
        };
        let attributes = cloudevents::binary_headers(&event, &headers);
        headers.extend(attributes);
    }
    Outbound { id, body: held.message.payload.clone(), headers }
}
