//! Webhook delivery against a real nats-server and a scripted receiver.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};

use crate::support::receiver::{assert_key_order, assert_key_order_except, Answer, Receiver, Recorded};
use crate::support::{eventually, TestApp};
use keygate::partition::{encode_key, partition_of_tokens};

const PARTITIONS: u32 = 4;

/// A stamped stream, a static group of one member `m1` ordered by
/// partition (key ordering has its own tests in `key_order.rs`), and its webhook.
async fn setup(app: &TestApp, receiver: &Receiver, webhook: Value) -> String {
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":PARTITIONS})).await;
    let group =
        json!({"kind":"static","partitions":PARTITIONS,"members":["m1"],"ack_wait_ms":2000,"ordering":"partition"});
    let (status, _) = app.put("/v1/streams/ORDERS/groups/g", group).await;
    assert_eq!(status, 201);
    let mut body = webhook;
    body["url"] = json!(receiver.url("/hook"));
    let (status, registered) = app.put("/v1/streams/ORDERS/groups/g/members/m1/webhook", body).await;
    assert_eq!(status, 201, "{registered}");
    registered["secret"].as_str().unwrap_or_default().to_owned()
}

/// Publishes `(key, n)` messages; returns key → stream sequences.
async fn publish(app: &TestApp, messages: &[(String, u64)]) -> HashMap<String, Vec<u64>> {
    let body: Vec<Value> = messages
        .iter()
        .map(|(k, n)| json!({"key": k, "data": {"n": n}, "headers": {"X-Trace": format!("t{n}")}}))
        .collect();
    let (status, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": body})).await;
    assert_eq!(status, 200);
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    for ack in acks["results"].as_array().unwrap() {
        published.entry(ack["key"].as_str().unwrap().to_owned()).or_default().push(ack["seq"].as_u64().unwrap());
    }
    published
}

/// Waits until every published sequence was answered 2xx (or is in `except`).
async fn all_acked(
    receiver: &Receiver,
    published: &HashMap<String, Vec<u64>>,
    except: &[u64],
    limit: Duration,
) -> Vec<Recorded> {
    eventually(limit, || async {
        let requests = receiver.requests();
        let acked: std::collections::HashSet<u64> = requests.iter().filter(|r| r.ok()).map(Recorded::seq).collect();
        published.values().flatten().filter(|s| !except.contains(s)).all(|s| acked.contains(s)).then_some(requests)
    })
    .await
}

fn partition_of(key: &str) -> u32 {
    partition_of_tokens([encode_key(key).unwrap().as_str()], PARTITIONS)
}

/// Keys that land on `partition`.
fn keys_on(partition: u32, count: usize) -> Vec<String> {
    (0..).map(|i| format!("key-{i}")).filter(|k| partition_of(k) == partition).take(count).collect()
}

#[tokio::test]
async fn webhooks_receive_signed_messages_in_key_order_with_keygate_headers() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let secret = setup(&app, &receiver, json!({})).await;
    assert!(secret.starts_with("whsec_"));
    let messages: Vec<(String, u64)> = (0..200).map(|n| (format!("customer {}", n % 20), n)).collect();
    let published = publish(&app, &messages).await;
    let requests = all_acked(&receiver, &published, &[], Duration::from_secs(30)).await;
    assert_key_order(&requests, &published, &[]);

    let first = requests.iter().find(|r| r.key() == "customer%200").unwrap();
    assert_eq!(first.path, "/hook");
    assert_eq!(first.header("keygate-stream"), Some("ORDERS"));
    assert_eq!(first.header("keygate-group"), Some("g"));
    assert_eq!(first.header("keygate-member"), Some("m1"));
    // Headers are percent-encoded: decoded, this is the stored subject `orders.customer%200`.
    assert_eq!(first.header("keygate-subject"), Some("orders.customer%25200"));
    assert_eq!(first.header("keygate-partition").unwrap(), partition_of("customer 0").to_string());
    assert_eq!(first.header("keygate-attempt"), Some("1"));
    assert!(first.fencing() >= 1);
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(first.header("x-trace"), Some("t0"));
    assert_eq!(first.header("webhook-id").unwrap(), format!("ORDERS-{}", first.seq()));
    assert_eq!(first.body, br#"{"n":0}"#);
    assert!(first.header("nats-msg-id").is_none() && first.header("nats-expected-stream").is_none());

    // An independent implementation checks the signatures: the Standard
    // Webhooks reference library for Python.
    let sample: Vec<Value> = requests
        .iter()
        .take(5)
        .map(|r| {
            json!({
                "headers": {
                    "webhook-id": r.header("webhook-id"),
                    "webhook-timestamp": r.header("webhook-timestamp"),
                    "webhook-signature": r.header("webhook-signature"),
                },
                "body": base64::engine::general_purpose::STANDARD.encode(&r.body),
            })
        })
        .collect();
    verify_with_standardwebhooks(&secret, &sample, true);
    let mut tampered = sample[0].clone();
    tampered["body"] = json!(base64::engine::general_purpose::STANDARD.encode(b"{\"n\":999}"));
    verify_with_standardwebhooks(&secret, &[tampered], false);
    app.assert_no_acks_without_verdict().await;
}

/// What the Standard Webhooks library needs of a recorded delivery.
pub(crate) fn signed(r: &Recorded) -> Value {
    json!({
        "headers": {
            "webhook-id": r.header("webhook-id"),
            "webhook-timestamp": r.header("webhook-timestamp"),
            "webhook-signature": r.header("webhook-signature"),
        },
        "body": base64::engine::general_purpose::STANDARD.encode(&r.body),
    })
}

#[tokio::test]
async fn a_rotated_secret_signs_beside_the_old_one_for_the_overlap_then_alone() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let first = setup(&app, &receiver, json!({})).await;
    let rotate = |overlap: u64| {
        let app = &app;
        async move {
            let path = "/v1/streams/ORDERS/groups/g/members/m1/webhook/rotate-secret";
            let (status, view) = app.post(path, json!({"overlap_s": overlap})).await;
            assert_eq!(status, 200, "{view}");
            view
        }
    };
    let deliveries_of = |n: u64| {
        let (app, receiver) = (&app, &receiver);
        async move {
            let published = publish(app, &[(format!("rotation-{n}"), n)]).await;
            let requests = all_acked(receiver, &published, &[], Duration::from_secs(20)).await;
            let seq = published.values().flatten().next().copied().unwrap();
            requests.into_iter().filter(|r| r.seq() == seq).map(|r| signed(&r)).collect::<Vec<_>>()
        }
    };

    let view = rotate(60).await;
    let second = view["secret"].as_str().unwrap().to_owned();
    assert_ne!(second, first);
    let expires = time::OffsetDateTime::parse(
        view["previous_secret_expires_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let ahead = expires - time::OffsetDateTime::now_utc();
    assert!(ahead > time::Duration::seconds(50) && ahead <= time::Duration::seconds(61), "{ahead}");
    let (_, shown) = app.get("/v1/streams/ORDERS/groups/g/members/m1/webhook").await;
    assert!(shown.get("secret").is_none(), "secrets are never in a GET: {shown}");
    assert_eq!(shown["previous_secret_expires_at"], view["previous_secret_expires_at"]);
    // During the overlap: two signatures, and a receiver holding either secret accepts.
    let during = deliveries_of(1).await;
    assert_eq!(during[0]["headers"]["webhook-signature"].as_str().unwrap().split(' ').count(), 2, "{during:?}");
    verify_with_standardwebhooks(&second, &during, true);
    verify_with_standardwebhooks(&first, &during, true);

    // With no overlap the old secret stops at once.
    let third = rotate(0).await["secret"].as_str().unwrap().to_owned();
    let after = deliveries_of(2).await;
    verify_with_standardwebhooks(&third, &after, true);
    verify_with_standardwebhooks(&second, &after, false);
    verify_with_standardwebhooks(&first, &after, false);
    let path = "/v1/streams/ORDERS/groups/g/members/m1/webhook/rotate-secret";
    assert_eq!(app.post(path, json!({"overlap_s": 999999999})).await.0, 400);
    assert_eq!(app.post("/v1/streams/ORDERS/groups/g/members/m2/webhook/rotate-secret", json!({})).await.0, 404);
}

pub(crate) fn verify_with_standardwebhooks(secret: &str, requests: &[Value], expect_valid: bool) {
    let script = r#"
import base64, json, sys
from standardwebhooks.webhooks import Webhook
secret, requests = sys.argv[1], json.loads(sys.stdin.read())
hook = Webhook(secret)
for r in requests:
    hook.verify(base64.b64decode(r["body"]), r["headers"])
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script, secret])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(serde_json::to_string(requests).unwrap().as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("ModuleNotFoundError"), "install it: pip install standardwebhooks");
    assert_eq!(output.status.success(), expect_valid, "{stderr}");
}

#[tokio::test]
async fn a_retried_message_is_never_overtaken_by_later_ones_of_its_key() {
    let app = TestApp::start().await;
    let slow_partition = 0;
    let keys = keys_on(slow_partition, 4);
    let other = keys_on(1, 1).remove(0);
    let (retry_after, server_error, nak_header, timeout) =
        (keys[0].clone(), keys[1].clone(), keys[2].clone(), keys[3].clone());
    let script = {
        let (retry_after, server_error, nak_header, timeout) =
            (retry_after.clone(), server_error.clone(), nak_header.clone(), timeout.clone());
        move |r: &Recorded, earlier: usize| {
            // The first message of each of these keys fails at first.
            let first = r.header("x-first") == Some("yes");
            let key = r.header("keygate-key").unwrap_or_default();
            match (first, earlier) {
                (true, 0 | 1) if key == retry_after => Answer::status(503).header("Retry-After", "1"),
                (true, 0 | 1) if key == server_error => Answer::status(500),
                (true, 0) if key == nak_header => Answer::ok().header("keygate-ack", "nak; delay=300ms"),
                (true, 0) if key == timeout => Answer::ok().after(Duration::from_millis(1500)),
                _ => Answer::ok(),
            }
        }
    };
    let receiver = Receiver::start(script).await;
    setup(&app, &receiver, json!({"timeout_ms": 500, "backoff": {"initial_ms": 200, "max_ms": 1000}})).await;
    let mut body = Vec::new();
    for n in 0..8u64 {
        for key in keys.iter().chain([&other]) {
            body.push(json!({"key": key, "data": {"n": n}, "headers": {"X-First": if n == 0 { "yes" } else { "no" }}}));
        }
    }
    let (_, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": body})).await;
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    for ack in acks["results"].as_array().unwrap() {
        published.entry(ack["key"].as_str().unwrap().to_owned()).or_default().push(ack["seq"].as_u64().unwrap());
    }
    all_acked(&receiver, &published, &[], Duration::from_secs(30)).await;
    // The timed-out first attempt is recorded when its late answer is sent.
    let timed_out_seq = published[&timeout][0];
    let requests = eventually(Duration::from_secs(5), || async {
        let requests = receiver.requests();
        (requests.iter().filter(|r| r.seq() == timed_out_seq).count() >= 2).then_some(requests)
    })
    .await;
    assert_key_order_except(&requests, &published, &[], std::slice::from_ref(&timeout));

    let attempts = |key: &str| -> Vec<&Recorded> {
        let first_seq = published[key][0];
        requests.iter().filter(|r| r.seq() == first_seq).collect()
    };
    let retried = attempts(&retry_after);
    assert_eq!(retried.iter().map(|r| r.attempt()).collect::<Vec<_>>(), vec![1, 2, 3], "the server's delivery count");
    assert!(retried[1].at - retried[0].at >= Duration::from_millis(900), "Retry-After: 1 was honoured");
    assert_eq!(attempts(&server_error).len(), 3);
    let naked = attempts(&nak_header);
    assert!(naked[1].at - naked[0].at >= Duration::from_millis(250), "keygate-ack nak delay was honoured");
    assert!(attempts(&timeout).len() >= 2, "a timeout is retried");

    // Guarantee 3: the other partition did not wait for the retries.
    let other_done = requests.iter().filter(|r| r.key() == other && r.ok()).map(|r| r.at).max().unwrap();
    let blocked_done = retried.last().unwrap().at;
    assert!(other_done < blocked_done, "partition 1 finished while partition 0 was retrying");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn messages_are_dead_lettered_after_max_attempts_and_the_partition_proceeds() {
    let app = TestApp::start().await;
    let receiver =
        Receiver::start(|r, _| if r.header("x-poison") == Some("yes") { Answer::status(500) } else { Answer::ok() })
            .await;
    setup(&app, &receiver, json!({"max_attempts": 3, "backoff": {"initial_ms": 50, "max_ms": 100}})).await;
    let body: Vec<Value> = (0..5)
        .map(|n| json!({"key":"poisoned","data":{"n":n},"headers":{"X-Poison": if n == 1 { "yes" } else { "no" }}}))
        .collect();
    let (_, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": body})).await;
    let seqs: Vec<u64> = acks["results"].as_array().unwrap().iter().map(|a| a["seq"].as_u64().unwrap()).collect();
    let published = HashMap::from([("poisoned".to_owned(), seqs.clone())]);
    let requests = all_acked(&receiver, &published, &[seqs[1]], Duration::from_secs(30)).await;
    assert_key_order(&requests, &published, &[seqs[1]]);
    assert_eq!(requests.iter().filter(|r| r.seq() == seqs[1]).count(), 3);

    let letters = eventually(Duration::from_secs(5), || async {
        let letters = app.stream_messages("KEYGATE_DEAD_LETTERS").await;
        (!letters.is_empty()).then_some(letters)
    })
    .await;
    assert_eq!(letters.len(), 1);
    let (subject, payload, headers) = &letters[0];
    assert_eq!(subject, "keygate.dlq.ORDERS.g.m1");
    assert_eq!(payload, br#"{"n":1}"#);
    let headers = headers.as_ref().unwrap();
    assert_eq!(headers.get("X-Poison").unwrap().as_str(), "yes");
    assert_eq!(headers.get("keygate-stream-seq").unwrap().as_str(), seqs[1].to_string());
    assert_eq!(headers.get("keygate-key").unwrap().as_str(), "poisoned");
    assert_eq!(headers.get("keygate-attempts").unwrap().as_str(), "3");
    assert!(headers.get("keygate-reason").unwrap().as_str().contains("gave up after 3 attempts"));
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_refusing_endpoint_terminates_and_410_stops_serving_the_member() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|r, _| match r.header("x-answer") {
        Some("422") => Answer::status(422),
        Some("410") => Answer::status(410),
        _ => Answer::ok(),
    })
    .await;
    setup(&app, &receiver, json!({})).await;
    let (_, first) = app.post("/v1/streams/ORDERS/messages", json!({"key":"a","headers":{"X-Answer":"422"}})).await;
    let (_, second) = app.post("/v1/streams/ORDERS/messages", json!({"key":"a"})).await;
    let published =
        HashMap::from([("a".to_owned(), vec![first["seq"].as_u64().unwrap(), second["seq"].as_u64().unwrap()])]);
    let requests = all_acked(&receiver, &published, &[first["seq"].as_u64().unwrap()], Duration::from_secs(20)).await;
    assert_eq!(requests.iter().filter(|r| r.status == 422).count(), 1, "a 4xx is not retried");
    eventually(Duration::from_secs(5), || async {
        (app.stream_messages("KEYGATE_DEAD_LETTERS").await.len() == 1).then_some(())
    })
    .await;

    app.post("/v1/streams/ORDERS/messages", json!({"key":"b","headers":{"X-Answer":"410"}})).await;
    eventually(Duration::from_secs(10), || async {
        let (status, _) = app.get("/v1/streams/ORDERS/groups/g/members/m1/webhook").await;
        (status == 404).then_some(())
    })
    .await;
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_blocked_partition_is_visible_and_can_be_skipped_or_retried_now() {
    let app = TestApp::start().await;
    let keys = keys_on(2, 2);
    let receiver = Receiver::start(|r, earlier| {
        let stuck = match r.header("x-stuck") {
            Some("forever") => true,
            Some("yes") => earlier == 0,
            _ => false,
        };
        if stuck {
            Answer::status(503).header("Retry-After", "30")
        } else {
            Answer::ok()
        }
    })
    .await;
    setup(&app, &receiver, json!({})).await;
    let (_, stuck) =
        app.post("/v1/streams/ORDERS/messages", json!({"key": keys[0], "headers": {"X-Stuck": "forever"}})).await;
    let (_, after) = app.post("/v1/streams/ORDERS/messages", json!({"key": keys[0]})).await;
    let view = eventually(Duration::from_secs(10), || async {
        let (_, view) = app.get("/v1/streams/ORDERS/groups/g").await;
        (view["blocked"].as_array()?.len() == 1).then_some(view)
    })
    .await;
    let blocked = &view["blocked"][0];
    assert_eq!(blocked["partition"], 2);
    assert_eq!(blocked["member"], "m1");
    assert_eq!(blocked["seq"], stuck["seq"]);
    assert_eq!(blocked["attempts"], 1);
    assert!(blocked["last_error"].as_str().unwrap().contains("503"));
    assert!(blocked["since"].is_string());
    assert!(!receiver.requests().iter().any(|r| r.seq() == after["seq"].as_u64().unwrap()), "the later message waits");

    let (status, _) = app.post("/v1/streams/ORDERS/groups/g/partitions/3/skip", json!({})).await;
    assert_eq!(status, 409, "partition 3 is not blocked");
    let (status, _) = app.post("/v1/streams/ORDERS/groups/g/partitions/9/skip", json!({})).await;
    assert_eq!(status, 404);
    let (status, op) = app.post("/v1/streams/ORDERS/groups/g/partitions/2/skip", json!({})).await;
    assert_eq!(status, 200, "{op}");
    eventually(Duration::from_secs(10), || async {
        receiver.requests().iter().any(|r| r.seq() == after["seq"].as_u64().unwrap() && r.ok()).then_some(())
    })
    .await;
    let letters = app.stream_messages("KEYGATE_DEAD_LETTERS").await;
    assert!(letters[0].2.as_ref().unwrap().get("keygate-reason").unwrap().as_str().contains("skipped"));

    // retry-now: the head is redelivered at once instead of in 30 s.
    let (_, again) =
        app.post("/v1/streams/ORDERS/messages", json!({"key": keys[1], "headers": {"X-Stuck": "yes"}})).await;
    eventually(Duration::from_secs(10), || async {
        let (_, view) = app.get("/v1/streams/ORDERS/groups/g").await;
        (view["blocked"].as_array()?.len() == 1).then_some(())
    })
    .await;
    let asked = Instant::now();
    let (status, _) = app.post("/v1/streams/ORDERS/groups/g/partitions/2/retry-now", json!({})).await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(5), || async {
        receiver.requests().iter().any(|r| r.seq() == again["seq"].as_u64().unwrap() && r.ok()).then_some(())
    })
    .await;
    assert!(asked.elapsed() < Duration::from_secs(5));
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn webhook_registrations_are_validated_and_destinations_restricted() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    setup(&app, &receiver, json!({})).await;
    let path = "/v1/streams/ORDERS/groups/g/members/m1/webhook";
    for url in
        ["http://169.254.169.254/latest/meta-data", "http://10.1.2.3/hook", "http://8.8.8.8/hook", "http://[fd00::1]/x"]
    {
        let (status, problem) = app.put(path, json!({"url": url})).await;
        assert_eq!(status, 422, "{url}: {problem}");
        assert!(problem["detail"].as_str().unwrap().contains("not allowed"), "{problem}");
    }
    for bad in [
        json!({"url":"ftp://127.0.0.1/"}),
        json!({"url":"not a url"}),
        json!({"url": receiver.url("/h"), "secret":"plain"}),
    ] {
        let (status, _) = app.put(path, bad.clone()).await;
        assert!(status == 400 || status == 422, "{bad}");
    }
    let (status, _) =
        app.put("/v1/streams/ORDERS/groups/g/members/nobody/webhook", json!({"url": receiver.url("/h")})).await;
    assert_eq!(status, 404);
    let (_, current) = app.get(path).await;
    assert_eq!(current["url"], receiver.url("/hook"));
    assert!(current.get("secret").is_none(), "the secret is shown once");

    let given = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let (status, replaced) = app.put(path, json!({"url": receiver.url("/other"), "secret": given})).await;
    assert_eq!(status, 200);
    assert!(replaced.get("secret").is_none(), "a given secret is not echoed");
    let (status, _) = app.delete(path).await;
    assert_eq!(status, 204);
    let (status, _) = app.get(path).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn events_stream_pins_and_verdicts_over_sse() {
    use futures::StreamExt;
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let response =
        app.http.get(app.url("/v1/events?stream=ORDERS&types=member.pinned,message.acked")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.bytes_stream();
    setup(&app, &receiver, json!({})).await;
    app.post("/v1/streams/ORDERS/messages", json!({"key":"a"})).await;
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(text.contains("event: member.pinned") && text.contains("event: message.acked")) {
        let chunk =
            tokio::time::timeout_at(deadline.into(), body.next()).await.expect("events arrive").unwrap().unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!text.contains("event: assignment.changed"), "filtered by type");
    assert!(text.contains("\"fencing_token\":"));

    // The same events are on NATS subjects.
    let mut sub = app.nats.subscribe("keygate.events.ORDERS.g.m1.message.acked").await.unwrap();
    app.post("/v1/streams/ORDERS/messages", json!({"key":"b"})).await;
    let event = tokio::time::timeout(Duration::from_secs(10), sub.next()).await.unwrap().unwrap();
    let event: Value = serde_json::from_slice(&event.payload).unwrap();
    assert_eq!(event["type"], "message.acked");
    assert_eq!(event["member"], "m1");
}

#[tokio::test]
async fn metrics_count_publishes_deliveries_and_requests_with_bounded_labels() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|r, earlier| {
        if r.header("x-fail") == Some("yes") && earlier == 0 {
            Answer::status(500)
        } else {
            Answer::ok()
        }
    })
    .await;
    setup(&app, &receiver, json!({"backoff": {"initial_ms": 50, "max_ms": 100}})).await;
    let body: Vec<Value> = (0..10)
        .map(|n| json!({"key": format!("user {n}"), "headers": {"X-Fail": if n == 0 { "yes" } else { "no" }}}))
        .collect();
    let (_, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": body})).await;
    let published = HashMap::from_iter(
        acks["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (a["key"].as_str().unwrap().to_owned(), vec![a["seq"].as_u64().unwrap()])),
    );
    all_acked(&receiver, &published, &[], Duration::from_secs(20)).await;
    let text = eventually(Duration::from_secs(5), || async {
        let text = app.http.get(app.url("/metrics")).send().await.ok()?.text().await.ok()?;
        text.contains(r#"keygate_deliveries_total{stream="ORDERS",group="g",verdict="ack"} 10"#).then_some(text)
    })
    .await;
    assert!(text.contains(r#"keygate_publish_messages_total{stream="ORDERS",outcome="stored"} 10"#), "{text}");
    assert!(text.contains(r#"keygate_deliveries_total{stream="ORDERS",group="g",verdict="nak"} 1"#), "{text}");
    assert!(text.contains(r#"keygate_redeliveries_total{stream="ORDERS",group="g"} 1"#), "{text}");
    assert!(
        text.contains(r#"keygate_pin_changes_total{stream="ORDERS",group="g",member="m1",change="gained"} 1"#),
        "{text}"
    );
    assert!(text.contains(r#"keygate_member_instances{stream="ORDERS",group="g"} 1"#), "{text}");
    assert!(text.contains("keygate_endpoint_duration_seconds_bucket"), "{text}");
    assert!(
        text.contains(
            r#"keygate_http_requests_total{route="/v1/streams/{stream}/messages/batch",method="POST",status="200"} 1"#
        ),
        "route templates, not raw paths: {text}"
    );
    assert!(!text.contains("user 1"), "keys never become labels");
}

#[tokio::test]
async fn the_in_flight_gauge_counts_deliveries_under_way_and_returns_to_zero() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok().after(Duration::from_secs(1))).await;
    setup(&app, &receiver, json!({})).await;
    // Two messages on each partition (a key per partition).
    let mut keys: HashMap<u32, String> = HashMap::new();
    for n in 0.. {
        let key = format!("user-{n}");
        keys.entry(keygate::partition::partition_of_tokens([key.as_str()], PARTITIONS)).or_insert(key);
        if keys.len() == PARTITIONS as usize {
            break;
        }
    }
    let messages: Vec<(String, u64)> = keys.values().flat_map(|k| [(k.clone(), 0), (k.clone(), 1)]).collect();
    let published = publish(&app, &messages).await;
    // Partition ordering: one delivery per partition at a time, each held 1 s.
    let open = || receiver.requests().iter().filter(|r| r.answered.is_none()).count();
    eventually(Duration::from_secs(5), || async { (open() == PARTITIONS as usize).then_some(()) }).await;
    assert_eq!(app.metric("keygate_deliveries_in_flight").await, PARTITIONS as f64);
    all_acked(&receiver, &published, &[], Duration::from_secs(20)).await;
    eventually(Duration::from_secs(5), || async {
        (app.metric("keygate_deliveries_in_flight").await == 0.0).then_some(())
    })
    .await;
}

/// The value of one sample line `name{labels} value` in a Prometheus text page.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test]
async fn backlog_per_partition_and_blocked_partitions_are_gauges() {
    let app = TestApp::start_with(|s| s.backlog_sample_interval = Some(Duration::from_millis(200))).await;
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":PARTITIONS})).await;
    let (status, _) = app
        .put(
            "/v1/streams/ORDERS/groups/g",
            json!({"kind":"static","partitions":PARTITIONS,"members":["m1"],"ordering":"partition"}),
        )
        .await;
    assert_eq!(status, 201);
    let messages: Vec<(String, u64)> = (0..12).map(|n| (format!("k{n}"), n)).collect();
    publish(&app, &messages).await;
    let (_, view) = app.get("/v1/streams/ORDERS/groups/g").await;
    let expected: Vec<(u64, f64)> = view["partition_pending"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["partition"].as_u64().unwrap(), p["pending"].as_f64().unwrap()))
        .collect();
    assert_eq!(expected.iter().map(|(_, n)| n).sum::<f64>(), 12.0);
    eventually(Duration::from_secs(10), || async {
        let text = app.http.get(app.url("/metrics")).send().await.ok()?.text().await.ok()?;
        expected
            .iter()
            .all(|(p, n)| {
                let series =
                    format!(r#"keygate_partition_pending_messages{{stream="ORDERS",group="g",partition="{p}"}}"#);
                sample(&text, &series) == Some(*n)
            })
            .then_some(())
    })
    .await;

    // A receiver failing one key blocks that key's partition.
    let receiver =
        Receiver::start(|r, _| if r.header("keygate-key") == Some("k3") { Answer::status(500) } else { Answer::ok() })
            .await;
    let hook =
        json!({"url": receiver.url("/hook"), "max_attempts": 1000, "backoff": {"initial_ms": 200, "max_ms": 400}});
    assert_eq!(app.put("/v1/streams/ORDERS/groups/g/members/m1/webhook", hook).await.0, 201);
    let blocked = r#"keygate_blocked_partitions{stream="ORDERS",group="g",member="m1"}"#;
    let pending_of =
        |p: u64| format!(r#"keygate_partition_pending_messages{{stream="ORDERS",group="g",partition="{p}"}}"#);
    let k3_partition = u64::from(partition_of_tokens([encode_key("k3").unwrap().as_str()], PARTITIONS));
    eventually(Duration::from_secs(15), || async {
        let text = app.http.get(app.url("/metrics")).send().await.ok()?.text().await.ok()?;
        let others_drained = (0..u64::from(PARTITIONS))
            .filter(|p| *p != k3_partition)
            .all(|p| sample(&text, &pending_of(p)) == Some(0.0));
        (sample(&text, blocked) == Some(1.0) && others_drained && sample(&text, &pending_of(k3_partition)) >= Some(1.0))
            .then_some(())
    })
    .await;
    // The instance ends with its webhook; its blocked count goes with it.
    assert_eq!(app.delete("/v1/streams/ORDERS/groups/g/members/m1/webhook").await.0, 204);
    eventually(Duration::from_secs(15), || async {
        let text = app.http.get(app.url("/metrics")).send().await.ok()?.text().await.ok()?;
        (sample(&text, blocked) == Some(0.0)).then_some(())
    })
    .await;
    // A deleted group's gauges fall to zero instead of keeping their last value.
    assert_eq!(app.delete("/v1/streams/ORDERS/groups/g").await.0, 204);
    eventually(Duration::from_secs(10), || async {
        let text = app.http.get(app.url("/metrics")).send().await.ok()?.text().await.ok()?;
        (sample(&text, &pending_of(k3_partition)) == Some(0.0)).then_some(())
    })
    .await;
}

/// A failing endpoint shows in keygate's log at warn: its first failure
/// with member, key, seq, attempt and what the endpoint did, then at most
/// one summary every 10 s however many fail (here more than 1,000), and a
/// line when it answers 2xx again; the URL, and the token in its query,
/// never (src/webhook/failure_log.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_deliveries_are_logged_at_warn_rate_limited_and_without_the_url() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use crate::support::{http_client, KeygateProcess, NatsServer};
    const FAILURES: usize = 1200;
    let server = NatsServer::start();
    let http = http_client();
    let log = tempfile::NamedTempFile::new().unwrap();
    let keygate =
        KeygateProcess::start_logging(&server.url(), "kg-log", "warn,keygate=info", &[], log.reopen().unwrap().into());
    keygate.wait_ready(&http).await;
    let base = keygate.base.clone();
    let put = |path: &str, body: Value| {
        let (http, url) = (http.clone(), format!("{base}{path}"));
        async move { http.put(url).json(&body).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(put("/v1/streams/ORDERS", json!({"subjects":["orders.*"],"partitions":PARTITIONS})).await, 201);
    let group = json!({"kind":"static","partitions":PARTITIONS,"members":["m1"],"ordering":"key"});
    assert_eq!(put("/v1/streams/ORDERS/groups/g", group).await, 201);
    let answered = Arc::new(AtomicUsize::new(0));
    let counter = answered.clone();
    let receiver = Receiver::start(move |_, _| match counter.fetch_add(1, Ordering::SeqCst) < FAILURES {
        true => Answer::status(500),
        false => Answer::ok(),
    })
    .await;
    let hook = json!({"url": receiver.url("/m1?token=sekret-in-the-query"), "max_attempts": 100,
        "backoff": {"initial_ms": 10, "max_ms": 50}});
    assert_eq!(put("/v1/streams/ORDERS/groups/g/members/m1/webhook", hook).await, 201);
    for batch in 0..4 {
        let messages: Vec<Value> =
            (0..250).map(|i| json!({"key": format!("k{}", batch * 250 + i), "data": {"i": i}})).collect();
        let url = format!("{base}/v1/streams/ORDERS/messages/batch");
        let status = http.post(url).json(&json!({"messages": messages})).send().await.unwrap().status();
        assert_eq!(status.as_u16(), 200);
    }
    let started = Instant::now();
    eventually(Duration::from_secs(60), || async {
        let ok: std::collections::HashSet<u64> =
            receiver.requests().iter().filter(|r| r.ok()).map(Recorded::seq).collect();
        (ok.len() == 1000).then_some(())
    })
    .await;
    let failing_for = started.elapsed();
    let text = std::fs::read_to_string(log.path()).unwrap();
    let lines = |what: &str| text.lines().filter(|l| l.contains(what)).collect::<Vec<_>>();
    let first = lines("webhook delivery failed");
    assert_eq!(first.len(), 1, "one first failure: {first:?}");
    for field in ["WARN", "member=m1", "key=\"k", "seq=", "attempt=1", "reason=\"500\""] {
        assert!(first[0].contains(field), "{field} in {}", first[0]);
    }
    // At most one failure line per 10 s, and a recovery line per logged streak.
    let periods = failing_for.as_secs() / 10 + 1;
    let summaries = lines("webhook deliveries keep failing");
    assert!(summaries.len() as u64 <= periods, "{} summaries in {failing_for:?}: {summaries:?}", summaries.len());
    let recovered = lines("webhook deliveries succeed again");
    assert!(!recovered.is_empty() && recovered.len() as u64 <= periods, "{recovered:?}");
    assert!(answered.load(Ordering::SeqCst) > FAILURES, "more than {FAILURES} requests failed");
    assert!(!text.contains("sekret-in-the-query") && !text.contains("/m1?"), "the URL stays out of the log");
}
