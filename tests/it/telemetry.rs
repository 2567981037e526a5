//! Traces (docs/tracing.md): a publisher's `traceparent` is continued by
//! keygate's publish span and by the delivery span, which the webhook
//! receives as its `traceparent`; spans go to a small OTLP/HTTP receiver on
//! loopback (decoded with `opentelemetry-proto`). Without `OTEL_*` nothing
//! is exported and the publisher's context reaches the endpoint unchanged.
//! Against a real nats-server.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;
use serde_json::json;

use crate::support::keygate::Launch;
use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::{eventually, http_client, KeygateProcess, NatsEndpoint, NatsServer, TestApp};

const WAIT: Duration = Duration::from_secs(20);
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER: &str = "00f067aa0ba902b7";

/// One exported span: name, ids in hex, and its attributes as text.
#[derive(Debug, Clone)]
struct Exported {
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: Vec<(String, String)>,
}

impl Exported {
    fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An OTLP/HTTP receiver (`POST /v1/traces`, protobuf); its URL and what it got.
async fn otlp_receiver() -> (String, Arc<Mutex<Vec<Exported>>>) {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let spans = Arc::new(Mutex::new(Vec::new()));
    let store = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let store = store.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
                let spans = request.resource_spans.into_iter().flat_map(|r| r.scope_spans).flat_map(|s| s.spans);
                store.lock().unwrap().extend(spans.map(|span| {
                    Exported {
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: span
                            .attributes
                            .into_iter()
                            .map(|kv| {
                                let value = match kv.value.and_then(|v| v.value) {
                                    Some(Value::StringValue(s)) => s,
                                    Some(Value::IntValue(i)) => i.to_string(),
                                    Some(Value::DoubleValue(d)) => d.to_string(),
                                    Some(Value::BoolValue(b)) => b.to_string(),
                                    other => format!("{other:?}"),
                                };
                                (kv.key, value)
                            })
                            .collect(),
                    }
                }));
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

/// Stream T, group g of m1 served by `receiver`, at `base`.
async fn member(http: &reqwest::Client, base: &str, receiver: &Receiver) {
    let put = |path: &str, body: serde_json::Value| http.put(format!("{base}{path}")).json(&body).send();
    assert!(put("/v1/streams/T", json!({"subjects":["t.*"],"partitions":1})).await.unwrap().status().is_success());
    let group = json!({"kind":"static","partitions":1,"members":["m1"]});
    assert!(put("/v1/streams/T/groups/g", group).await.unwrap().status().is_success());
    let hook = json!({"url": receiver.url("/m1")});
    assert!(put("/v1/streams/T/groups/g/members/m1/webhook", hook).await.unwrap().status().is_success());
}

async fn publish_traced(http: &reqwest::Client, base: &str) {
    let response = http
        .post(format!("{base}/v1/streams/T/messages"))
        .header("traceparent", format!("00-{TRACE}-{CALLER}-01"))
        .header("tracestate", "vendor=caller")
        .json(&json!({"key": "k", "data": {"n": 1}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

async fn delivered(receiver: &Receiver) -> Recorded {
    eventually(WAIT, || async { receiver.requests().into_iter().find(Recorded::ok) }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_delivery_spans_continue_the_publishers_trace_and_reach_otlp() {
    let (otlp, spans) = otlp_receiver().await;
    let server = NatsServer::start();
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let keygate = KeygateProcess::launch(Launch { env: &env, ..Launch::plain(NatsEndpoint::open(&server.url())) });
    let http = http_client();
    keygate.wait_ready(&http).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    member(&http, &keygate.base, &receiver).await;
    publish_traced(&http, &keygate.base).await;

    let request = delivered(&receiver).await;
    let traceparent = request.header("traceparent").expect("the delivery carries a traceparent").to_owned();
    let [version, trace, parent, flags] = traceparent.split('-').collect::<Vec<_>>()[..] else {
        panic!("{traceparent}")
    };
    assert_eq!((version, trace, flags), ("00", TRACE, "01"), "the publisher's trace, continued");
    assert_ne!(parent, CALLER, "the parent is keygate's delivery span");
    assert_eq!(request.header("tracestate"), Some("vendor=caller"));

    let (publish, deliver) = eventually(WAIT, || async {
        let spans = spans.lock().unwrap().clone();
        let find = |name: &str| spans.iter().find(|s| s.name == name && s.trace_id == TRACE).cloned();
        Some((find("publish")?, find("deliver")?))
    })
    .await;
    let all = spans.lock().unwrap().clone();
    let request_span = all.iter().find(|s| s.span_id == publish.parent_span_id).expect("publish's parent span");
    assert_eq!((request_span.name.as_str(), request_span.parent_span_id.as_str()), ("request", CALLER));
    assert_eq!(deliver.span_id, parent, "the webhook got the delivery span's context");
    assert_eq!(deliver.parent_span_id, publish.span_id, "the delivery continues the stored publish span");
    assert_eq!(deliver.attribute("verdict"), Some("ack"));
    assert_eq!(deliver.attribute("attempt"), Some("1"));
    assert!(deliver.attribute("endpoint_ms").is_some_and(|ms| ms.parse::<f64>().is_ok()), "{deliver:?}");
    assert_eq!(publish.attribute("stream"), Some("T"));
}

#[tokio::test]
async fn without_otel_variables_the_publishers_context_passes_through() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    member(&app.http, &app.base, &receiver).await;
    publish_traced(&app.http, &app.base).await;
    let request = delivered(&receiver).await;
    assert_eq!(request.header("traceparent"), Some(format!("00-{TRACE}-{CALLER}-01").as_str()));
    assert_eq!(request.header("tracestate"), Some("vendor=caller"));
    let stored = app.stream_messages("T").await;
    let headers = stored[0].2.as_ref().unwrap();
    assert_eq!(headers.get("traceparent").map(|v| v.as_str()), Some(format!("00-{TRACE}-{CALLER}-01").as_str()));
}
