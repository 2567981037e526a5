//! CloudEvents (docs/cloudevents.md): deliveries in binary mode read by the
//! CloudEvents SDK for Python, and events the SDK makes (structured and
//! binary mode) published with their attributes and key kept. Against a
//! real nats-server.

use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::delivery::{signed, verify_with_standardwebhooks};
use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::{eventually, into_parts, TestApp};

const WAIT: Duration = Duration::from_secs(20);

/// Runs tests/it/fixtures/cloudevents_sdk.py `command` on `input`.
fn sdk(command: &str, input: &Value) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/cloudevents_sdk.py");
    let mut child = std::process::Command::new("python3")
        .args([script, command])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("ModuleNotFoundError"), "install it: pip install cloudevents (scripts/test does)");
    assert!(output.status.success(), "{stderr}");
    serde_json::from_slice(&output.stdout).unwrap()
}

/// A request as the SDK reads it: every header, the body in base64.
fn as_received(r: &Recorded) -> Value {
    json!({"headers": r.headers, "body": base64::engine::general_purpose::STANDARD.encode(&r.body)})
}

/// Stream CE (two partitions), group g of m1 served by `receiver` with `options`; the signing secret.
async fn member(app: &TestApp, receiver: &Receiver, options: Value) -> String {
    app.create_stream("CE", json!({"subjects":["ce.*"],"partitions":2})).await;
    let group = json!({"kind":"static","partitions":2,"members":["m1"],"ack_wait_ms":3000});
    assert_eq!(app.put("/v1/streams/CE/groups/g", group).await.0, 201);
    let mut hook = json!({"url": receiver.url("/m1")});
    hook.as_object_mut().unwrap().extend(options.as_object().unwrap().clone());
    let (status, view) = app.put("/v1/streams/CE/groups/g/members/m1/webhook", hook).await;
    assert_eq!(status, 201, "{view}");
    view["secret"].as_str().unwrap().to_owned()
}

async fn acked(receiver: &Receiver, n: usize) -> Vec<Recorded> {
    eventually(WAIT, || async {
        let ok: Vec<Recorded> = receiver.requests().into_iter().filter(Recorded::ok).collect();
        (ok.len() >= n).then_some(ok)
    })
    .await
}

#[tokio::test]
async fn a_cloudevents_webhook_is_read_by_the_sdk_and_still_signed() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let secret = member(&app, &receiver, json!({"format": "cloudevents", "ce_type": "com.example.order"})).await;
    let (_, view) = app.get("/v1/streams/CE/groups/g/members/m1/webhook").await;
    assert_eq!((view["format"].clone(), view["ce_type"].clone()), (json!("cloudevents"), json!("com.example.order")));
    let (status, ack) = app.post("/v1/streams/CE/messages", json!({"key": "alice", "data": {"n": 1}})).await;
    assert_eq!(status, 200, "{ack}");

    let delivered = acked(&receiver, 1).await.remove(0);
    let event = sdk("read", &json!([as_received(&delivered)])).as_array().unwrap()[0].clone();
    let attributes = &event["attributes"];
    assert_eq!(attributes["specversion"], "1.0");
    assert_eq!(attributes["id"].as_str(), delivered.header("webhook-id"), "ce-id is the webhook-id");
    assert_eq!(attributes["source"], "keygate/CE");
    assert_eq!(attributes["type"], "com.example.order");
    assert_eq!(attributes["subject"].as_str(), delivered.header("keygate-subject"));
    assert_eq!(attributes["partitionkey"], "alice");
    assert_eq!(attributes["datacontenttype"], "application/json");
    assert!(attributes["time"].as_str().is_some_and(|t| t.starts_with("20")), "{attributes}");
    assert_eq!(event["data"], json!({"n": 1}));
    verify_with_standardwebhooks(&secret, &[signed(&delivered)], true);

    // The default type is the subject; a raw registration sends no ce-* headers.
    let hook = json!({"url": receiver.url("/m1"), "format": "cloudevents"});
    assert_eq!(app.put("/v1/streams/CE/groups/g/members/m1/webhook", hook).await.0, 200);
    let typed = eventually(WAIT, || async {
        app.post("/v1/streams/CE/messages", json!({"key": "bob", "data": 2})).await;
        let last = receiver.requests().into_iter().rfind(Recorded::ok)?;
        (last.header("ce-type") == last.header("keygate-subject")).then_some(last)
    })
    .await;
    assert_eq!(typed.header("ce-partitionkey"), Some("bob"));
    for (bad, why) in [
        (json!({"ce_type": "t"}), "ce_type goes with"),
        (json!({"format": "xml"}), "format"),
        (json!({"format": "cloudevents", "ce_type": ""}), "ce_type"),
    ] {
        let mut hook = json!({"url": receiver.url("/m1")});
        hook.as_object_mut().unwrap().extend(bad.as_object().unwrap().clone());
        let (status, problem) = app.put("/v1/streams/CE/groups/g/members/m1/webhook", hook).await;
        assert_eq!(status, 400, "{bad}: {problem}");
        assert!(problem["detail"].as_str().unwrap().contains(why), "{problem}");
    }
}

#[tokio::test]
async fn events_the_sdk_publishes_keep_their_attributes_and_their_key() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    member(&app, &receiver, json!({"format": "cloudevents"})).await;
    let event = |mode: &str, id: &str, total: u64| {
        json!({"mode": mode, "data": {"total": total}, "attributes": {
            "id": id, "type": "order.created", "source": "https://shop.example/orders", "subject": "order 1",
            "partitionkey": "bob", "tenant": "acme", "datacontenttype": "application/json"}})
    };
    let specs = json!([event("structured", "e1", 5), event("binary", "e2", 6), event("structured", "e3", 7)]);
    let made = sdk("make", &specs);
    let made = made.as_array().unwrap();
    assert!(made[0]["headers"]["content-type"].as_str().unwrap().starts_with("application/cloudevents+json"));
    assert!(made[1]["headers"]["ce-specversion"].is_string());
    for (n, request) in made.iter().enumerate() {
        // The third names its key in the query, over its partitionkey.
        let query = if n == 2 { "?key=carol" } else { "" };
        let mut post = app.http.post(app.url(&format!("/v1/streams/CE/messages{query}")));
        for (name, value) in request["headers"].as_object().unwrap() {
            post = post.header(name, value.as_str().unwrap());
        }
        let body = base64::engine::general_purpose::STANDARD.decode(request["body"].as_str().unwrap()).unwrap();
        let (status, ack) = into_parts(post.body(body).send().await.unwrap()).await;
        assert_eq!(status, 200, "{request}: {ack}");
    }

    let mut delivered = acked(&receiver, 3).await;
    delivered.sort_by_key(Recorded::seq);
    let keys: Vec<String> = delivered.iter().map(Recorded::key).collect();
    assert_eq!(keys, ["bob", "bob", "carol"]);
    let events = sdk("read", &Value::Array(delivered.iter().map(as_received).collect()));
    for (event, (id, total)) in events.as_array().unwrap().iter().zip([("e1", 5), ("e2", 6), ("e3", 7)]) {
        let attributes = &event["attributes"];
        assert_eq!(attributes["id"], id, "the event's own id, not keygate's: {event}");
        assert_eq!(attributes["source"], "https://shop.example/orders");
        assert_eq!(attributes["type"], "order.created");
        assert_eq!(attributes["subject"], "order 1");
        assert_eq!(attributes["tenant"], "acme");
        assert_eq!(attributes["partitionkey"], "bob", "the event as it was sent");
        assert!(attributes["time"].is_string(), "{event}");
        assert_eq!(event["data"], json!({"total": total}));
    }
}

#[tokio::test]
async fn events_that_break_the_spec_are_refused_and_nothing_is_stored() {
    let app = TestApp::start().await;
    app.create_stream("CE", json!({"subjects":["ce.*"],"partitions":1})).await;
    let url = app.url("/v1/streams/CE/messages");
    let structured = |body: Value| app.http.post(&url).header("content-type", STRUCTURED).body(body.to_string());
    const STRUCTURED: &str = "application/cloudevents+json";
    let binary = |version: &str| {
        app.http
            .post(&url)
            .header("ce-specversion", version)
            .header("ce-id", "1")
            .header("ce-source", "s")
            .header("ce-type", "t")
            .body("x")
    };
    for (request, why) in [
        (structured(json!({"specversion": "1.0", "id": "1", "source": "s"})), "type is required"),
        (structured(json!({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "time": "noon"})), "RFC 3339"),
        (structured(json!({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "Caps": 1})), "attribute name"),
        (app.http.post(&url).header("content-type", STRUCTURED).body("{"), "not a CloudEvents JSON object"),
        (binary("0.3"), "not supported"),
        (app.http.post(format!("{url}?key=k")).json(&json!({"key": "k", "data": 1})), "?key= is for CloudEvents"),
    ] {
        let response = request.send().await.unwrap();
        let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
        let (status, problem) = into_parts(response).await;
        assert_eq!((status, content_type.as_str()), (400, "application/problem+json"), "{problem}");
        assert!(problem["detail"].as_str().unwrap().contains(why), "{why}: {problem}");
    }
    assert!(app.stream_messages("CE").await.is_empty(), "nothing was stored");
    let (status, ack) = into_parts(binary("1.0").send().await.unwrap()).await;
    assert_eq!(status, 200, "{ack}");
    let stored = app.stream_messages("CE").await;
    let headers = stored[0].2.as_ref().unwrap();
    assert_eq!(headers.get("ce-source").map(|v| v.as_str()), Some("s"));
    assert_eq!(stored[0].1, b"x");
}
