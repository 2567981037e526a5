//! Endpoint protection (docs/operations.md, "Endpoint protection"): a rate
//! limit per registration, statuses that retry, and a circuit breaker that
//! pauses the member and probes until the endpoint is back. Against a real
//! nats-server and a scripted receiver.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::receiver::{assert_key_order, Answer, Receiver};
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(30);

/// Stream K (one partition) and group g of m1 served by `receiver` with `options`.
async fn member(app: &TestApp, receiver: &Receiver, options: Value) {
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":1})).await;
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":3000});
    assert_eq!(app.put("/v1/streams/K/groups/g", group).await.0, 201);
    let mut hook = json!({"url": receiver.url("/m1"), "backoff": {"initial_ms": 100, "max_ms": 200}});
    hook.as_object_mut().unwrap().extend(options.as_object().unwrap().clone());
    let (status, view) = app.put("/v1/streams/K/groups/g/members/m1/webhook", hook).await;
    assert_eq!(status, 201, "{view}");
}

async fn publish(app: &TestApp, keys: &[&str]) -> HashMap<String, Vec<u64>> {
    let messages: Vec<Value> = keys.iter().enumerate().map(|(n, k)| json!({"key": k, "data": {"n": n}})).collect();
    let (status, acks) = app.post("/v1/streams/K/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 200, "{acks}");
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    for ack in acks["results"].as_array().unwrap() {
        published.entry(ack["key"].as_str().unwrap().to_owned()).or_default().push(ack["seq"].as_u64().unwrap());
    }
    published
}

async fn all_acked(receiver: &Receiver, published: &HashMap<String, Vec<u64>>) {
    eventually(WAIT, || async {
        let acked: Vec<u64> = receiver.requests().iter().filter(|r| r.ok()).map(|r| r.seq()).collect();
        published.values().flatten().all(|s| acked.contains(s)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn max_rate_spaces_deliveries_after_the_burst() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    member(&app, &receiver, json!({"max_rate": 10, "burst": 2})).await;
    let (_, view) = app.get("/v1/streams/K/groups/g/members/m1/webhook").await;
    assert_eq!((view["max_rate"].clone(), view["burst"].clone()), (json!(10.0), json!(2)));
    // Twelve keys, so key ordering would send them all at once.
    let keys: Vec<String> = (0..12).map(|n| format!("k{n}")).collect();
    let published = publish(&app, &keys.iter().map(String::as_str).collect::<Vec<_>>()).await;
    all_acked(&receiver, &published).await;
    let times: Vec<Instant> = receiver.requests().iter().map(|r| r.at).collect();
    let span = *times.iter().max().unwrap() - *times.iter().min().unwrap();
    // Two at once, then one every 100 ms: ten intervals at least.
    assert!(span >= Duration::from_millis(950), "12 deliveries at 10/s with a burst of 2 took only {span:?}");

    for bad in [json!({"max_rate": 0}), json!({"burst": 5}), json!({"max_rate": 1, "burst": 0})] {
        let mut hook = json!({"url": receiver.url("/m1")});
        hook.as_object_mut().unwrap().extend(bad.as_object().unwrap().clone());
        let (status, problem) = app.put("/v1/streams/K/groups/g/members/m1/webhook", hook).await;
        assert_eq!(status, 400, "{bad}: {problem}");
    }
}

#[tokio::test]
async fn retry_statuses_retry_a_404_instead_of_dead_lettering_it() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, earlier| if earlier < 2 { Answer::status(404) } else { Answer::ok() }).await;
    member(&app, &receiver, json!({"retry_statuses": [404], "max_attempts": 5})).await;
    let published = publish(&app, &["a"]).await;
    all_acked(&receiver, &published).await;
    let attempts: Vec<u64> = receiver.requests().iter().map(|r| r.attempt()).collect();
    assert_eq!(attempts, vec![1, 2, 3], "two 404s retried, then acked");
    assert_eq!(app.get("/v1/dead-letters").await.1["dead_letters"], json!([]));
    for bad in [json!([500]), json!([200]), json!(vec![404; 51])] {
        let hook = json!({"url": receiver.url("/m1"), "retry_statuses": bad});
        assert_eq!(app.put("/v1/streams/K/groups/g/members/m1/webhook", hook).await.0, 400, "{bad}");
    }
}

#[tokio::test]
async fn the_breaker_pauses_the_member_then_a_probe_resumes_it_when_the_endpoint_is_back() {
    let app = TestApp::start().await;
    let down = Arc::new(AtomicBool::new(true));
    let receiver = {
        let down = down.clone();
        Receiver::start(move |_, _| if down.load(Ordering::SeqCst) { Answer::status(500) } else { Answer::ok() }).await
    };
    let options = json!({"max_attempts": 1000, "breaker": {"failures": 3, "probe_interval_ms": 1000}});
    member(&app, &receiver, options).await;
    let (_, view) = app.get("/v1/streams/K/groups/g/members/m1/webhook").await;
    assert_eq!(view["breaker"], json!({"failures": 3, "probe_interval_ms": 1000}));
    let mut events = app.http.get(app.url("/v1/events?stream=K&group=g")).send().await.unwrap();
    let keys: Vec<String> = (0..20).map(|n| format!("k{}", n % 4)).collect();
    let published = publish(&app, &keys.iter().map(String::as_str).collect::<Vec<_>>()).await;

    // Tripped: paused by the breaker on every replica, with why.
    let paused = eventually(WAIT, || async {
        let (_, view) = app.get("/v1/streams/K/groups/g").await;
        let paused = view["assignment"][0]["paused"].clone();
        (!paused.is_null()).then_some(paused)
    })
    .await;
    assert_eq!(paused["paused_by"], "circuit breaker");
    assert!(paused["reason"].as_str().unwrap().contains("deliveries in a row failed"), "{paused}");
    assert_eq!(paused["probe_every_ms"], 1000);
    assert_eq!(app.metric("keygate_breaker_trips_total").await, 1.0);
    // While it is down: a probe now and then (each waits out the handover
    // barrier of its new pin, up to ack_wait), not deliveries every backoff.
    let before = receiver.requests().len();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let probes = receiver.requests().len() - before;
    assert!((1..=6).contains(&probes), "{probes} deliveries in 6 s while the breaker is open");

    // Back up: the next probe succeeds, the member resumes, everything flows in key order.
    down.store(false, Ordering::SeqCst);
    all_acked(&receiver, &published).await;
    assert!(app.get("/v1/streams/K/groups/g").await.1["assignment"][0]["paused"].is_null());
    assert_key_order(&receiver.requests(), &published, &[]);
    let mut seen = String::new();
    let deadline = Instant::now() + WAIT;
    while !(seen.contains("member.resumed") && seen.contains("member.paused")) {
        assert!(Instant::now() < deadline, "no pause and resume events: {seen}");
        if let Ok(Ok(Some(chunk))) = tokio::time::timeout(Duration::from_secs(1), events.chunk()).await {
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
    assert!(seen.contains(r#""by":"circuit breaker""#), "{seen}");
    app.assert_no_acks_without_verdict().await;
}

/// A plain consumer's webhook subscriber takes the same protection and
/// outbound options as a member's webhook: static headers and a bearer
/// token reach the endpoint (their values never shown), a 404 in
/// `retry_statuses` is retried, and the breaker pauses the subscriber.
#[tokio::test]
async fn a_plain_consumers_subscriber_takes_the_same_protection_headers_and_auth() {
    std::env::set_var("WEBHOOK_AUTH_SUBSCRIBER_TOKEN", "sub-token");
    let app = TestApp::start().await;
    app.create_stream("JOBS", json!({"subjects":["jobs.*"]})).await;
    assert_eq!(app.put("/v1/streams/JOBS/consumers/c", json!({"ack_wait_ms": 3000})).await.0, 201);
    let down = Arc::new(AtomicBool::new(false));
    let receiver = {
        let down = down.clone();
        Receiver::start(move |_, earlier| match () {
            () if down.load(Ordering::SeqCst) => Answer::status(500),
            () if earlier < 2 => Answer::status(404),
            () => Answer::ok(),
        })
        .await
    };
    let path = "/v1/streams/JOBS/consumers/c/subscribers/s1/webhook";
    let hook = |breaker: Value| {
        json!({"url": receiver.url("/s1"), "concurrency": 1, "backoff": {"initial_ms": 100, "max_ms": 200},
            "headers": {"X-Tenant": "acme"}, "auth": {"bearer_env": "WEBHOOK_AUTH_SUBSCRIBER_TOKEN"},
            "retry_statuses": [404], "max_rate": 50, "burst": 5, "breaker": breaker, "max_attempts": 1000})
    };
    let (status, view) = app.put(path, hook(json!({"failures": 100}))).await;
    assert_eq!(status, 201, "{view}");
    let (_, shown) = app.get(path).await;
    for (field, expected) in [
        ("headers", json!(["X-Tenant"])),
        ("auth", json!({"bearer_env": "WEBHOOK_AUTH_SUBSCRIBER_TOKEN"})),
        ("retry_statuses", json!([404])),
        ("max_rate", json!(50.0)),
        ("burst", json!(5)),
        ("breaker", json!({"failures": 100})),
    ] {
        assert_eq!(shown[field], expected, "{field}: {shown}");
    }
    assert!(!shown.to_string().contains("acme") && !shown.to_string().contains("sub-token"), "{shown}");

    let (_, ack) = app.post("/v1/streams/JOBS/messages", json!({"key": "j", "data": {"n": 0}})).await;
    let seq = ack["seq"].as_u64().unwrap();
    let acked = eventually(WAIT, || async { receiver.requests().into_iter().find(|r| r.seq() == seq && r.ok()) }).await;
    assert_eq!(acked.attempt(), 3, "two 404s retried, then acked");
    assert_eq!(acked.header("authorization"), Some("Bearer sub-token"));
    assert_eq!(acked.header("x-tenant"), Some("acme"));

    // The endpoint fails: three in a row pause the subscriber.
    assert_eq!(app.put(path, hook(json!({"failures": 3}))).await.0, 200);
    down.store(true, Ordering::SeqCst);
    for n in 1..=5 {
        app.post("/v1/streams/JOBS/messages", json!({"key": "j", "data": {"n": n}})).await;
    }
    eventually(WAIT, || async { (app.metric("keygate_breaker_trips_total").await == 1.0).then_some(()) }).await;
    let (status, paused) = app.post("/v1/streams/JOBS/consumers/c/subscribers/s1/pause", json!(null)).await;
    assert_eq!(status, 200, "{paused}");
    assert_eq!(paused["pause"]["paused_by"], "circuit breaker", "{paused}");
}
