//! Key ordering (docs/guarantees.md, "Per-key order"): one message in flight
//! per key, so a key that is retrying holds back only its own messages and
//! the other keys of its partition overtake it. Against a real nats-server.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::receiver::{assert_key_order, assert_key_order_except, Answer, Receiver, Recorded};
use crate::support::ws::{member_url, WsClient};
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(20);

/// A one-partition stream (every key shares the partition) and a static
/// group of `m1` with `group` merged in.
async fn one_partition(app: &TestApp, group: Value) {
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":1})).await;
    let mut body = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":2000});
    body.as_object_mut().unwrap().extend(group.as_object().unwrap().clone());
    let (status, view) = app.put("/v1/streams/K/groups/g", body).await;
    assert_eq!(status, 201, "{view}");
}

async fn hook(app: &TestApp, receiver: &Receiver, options: Value) {
    let mut body = json!({"url": receiver.url("/m1"), "backoff": {"initial_ms": 200, "max_ms": 1000}});
    body.as_object_mut().unwrap().extend(options.as_object().unwrap().clone());
    let (status, view) = app.put("/v1/streams/K/groups/g/members/m1/webhook", body).await;
    assert_eq!(status, 201, "{view}");
}

/// Publishes `rounds` messages of every key, interleaved; key → sequences.
async fn publish(app: &TestApp, keys: &[&str], rounds: u64) -> HashMap<String, Vec<u64>> {
    let messages: Vec<Value> =
        (0..rounds).flat_map(|n| keys.iter().map(move |k| json!({"key": k, "data": {"n": n}}))).collect();
    let (status, acks) = app.post("/v1/streams/K/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 200, "{acks}");
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    for ack in acks["results"].as_array().unwrap() {
        published.entry(ack["key"].as_str().unwrap().to_owned()).or_default().push(ack["seq"].as_u64().unwrap());
    }
    published
}

async fn all_acked(receiver: &Receiver, seqs: impl Iterator<Item = u64>) -> Vec<Recorded> {
    let wanted: Vec<u64> = seqs.collect();
    eventually(WAIT, || async {
        let requests = receiver.requests();
        let acked: std::collections::HashSet<u64> = requests.iter().filter(|r| r.ok()).map(Recorded::seq).collect();
        wanted.iter().all(|s| acked.contains(s)).then_some(requests)
    })
    .await
}

#[tokio::test]
async fn new_groups_are_ordered_by_key_and_a_stored_ordering_is_kept() {
    let app = TestApp::start().await;
    one_partition(&app, json!({})).await;
    let (_, view) = app.get("/v1/streams/K/groups/g").await;
    assert_eq!(view["ordering"], "key");
    let settings: Value = serde_json::from_slice(&app.kv_raw("keygate-groups", "K.g").await.unwrap()).unwrap();
    assert_eq!(settings["ordering"], "key", "kept in keygate's bucket");
    let pcgroups = String::from_utf8(app.kv_raw("static-consumer-groups", "K.g").await.unwrap()).unwrap();
    assert!(!pcgroups.contains("ordering"), "never in the pcgroups value: {pcgroups}");

    let change = json!({"kind":"static","partitions":1,"members":["m1"],"ordering":"partition"});
    assert_eq!(app.put("/v1/streams/K/groups/g", change).await.0, 200);
    let (_, view) = app.get("/v1/streams/K/groups/g").await;
    assert_eq!(view["ordering"], "partition");
    assert_eq!(view["ack_wait_ms"], 2000, "other settings stay");
    let (status, _) = app.put("/v1/streams/K/groups/g", json!({"kind":"static","partitions":1,"members":["m1"]})).await;
    assert_eq!(status, 200, "unchanged");
    assert_eq!(app.get("/v1/streams/K/groups/g").await.1["ordering"], "partition", "left out, it stays");
    let (status, problem) =
        app.put("/v1/streams/K/groups/g", json!({"kind":"static","partitions":1,"ordering":"subject"})).await;
    assert_eq!(status, 400, "{problem}");

    // A group written as Go pcgroups writes it has no keygate settings:
    // it keeps pcgroups' order, per partition.
    app.create_stream("GO", json!({"subjects":["go.*"],"partitions":2})).await;
    let kv = app.js.get_key_value("static-consumer-groups").await.unwrap();
    kv.put("GO.g", r#"{"max_members":2,"members":["a"]}"#.into()).await.unwrap();
    let (status, view) = app.get("/v1/streams/GO/groups/g").await;
    assert_eq!((status, view["ordering"].clone()), (200, json!("partition")), "{view}");
}

#[tokio::test]
async fn a_retrying_key_holds_back_only_its_own_messages_and_its_neighbours_overtake_it() {
    let app = TestApp::start().await;
    one_partition(&app, json!({})).await;
    // The first message of three keys fails at first, three ways: 503 with
    // Retry-After (twice), a NAK with delay, a timeout.
    let receiver = Receiver::start(|r, earlier| match (r.key().as_str(), r.body.as_slice(), earlier) {
        ("slow", br#"{"n":0}"#, 0 | 1) => Answer::status(503).header("Retry-After", "1"),
        ("naked", br#"{"n":0}"#, 0) => Answer::ok().header("keygate-ack", "nak; delay=700ms"),
        ("late", br#"{"n":0}"#, 0) => Answer::ok().after(Duration::from_millis(1500)),
        _ => Answer::ok(),
    })
    .await;
    hook(&app, &receiver, json!({"timeout_ms": 500})).await;
    let published = publish(&app, &["slow", "naked", "late", "a", "b", "c"], 10).await;
    let requests = all_acked(&receiver, published.values().flatten().copied()).await;
    assert_key_order_except(&requests, &published, &[], &["late".to_owned()]);
    let attempts = |key: &str| -> Vec<&Recorded> { requests.iter().filter(|r| r.seq() == published[key][0]).collect() };
    let slow_first = attempts("slow");
    assert_eq!(slow_first.iter().map(|r| r.attempt()).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(slow_first[1].at - slow_first[0].at >= Duration::from_millis(900), "Retry-After honoured");
    let naked = attempts("naked");
    assert!(naked[1].at - naked[0].at >= Duration::from_millis(600), "the NAK's delay honoured");
    assert!(attempts("late").len() >= 2, "a timeout is retried");
    let slow_done = slow_first.last().unwrap().at;
    for key in ["a", "b", "c"] {
        let last = requests.iter().filter(|r| r.key() == key && r.ok()).map(|r| r.at).max().unwrap();
        assert!(last < slow_done, "key {key} of the same partition finished while slow was retrying");
    }
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_poison_key_is_dead_lettered_after_max_attempts_while_its_neighbours_flow() {
    let app = TestApp::start().await;
    one_partition(&app, json!({})).await;
    let receiver = Receiver::start(|r, _| match r.key().as_str() {
        "poison" => Answer::status(500),
        _ => Answer::ok(),
    })
    .await;
    hook(&app, &receiver, json!({"max_attempts": 2})).await;
    let published = publish(&app, &["poison", "a", "b"], 5).await;
    let flowing = published["a"].iter().chain(&published["b"]).copied();
    let requests = all_acked(&receiver, flowing).await;
    let poison = &published["poison"];
    assert_key_order(&requests, &published, poison);
    // Every poison message goes to the dead letters in turn, in order.
    let dead = eventually(Duration::from_secs(40), || async {
        if app.js.get_stream("KEYGATE_DEAD_LETTERS").await.is_err() {
            return None;
        }
        let letters = app.stream_messages("KEYGATE_DEAD_LETTERS").await;
        (letters.len() == poison.len()).then_some(letters)
    })
    .await;
    let seqs: Vec<u64> = dead
        .iter()
        .map(|(_, _, h)| h.as_ref().unwrap().get("keygate-stream-seq").unwrap().as_str().parse().unwrap())
        .collect();
    assert_eq!(&seqs, poison, "dead-lettered one after another, in key order");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn blocked_keys_are_listed_and_skip_and_retry_now_take_a_key() {
    let app = TestApp::start().await;
    one_partition(&app, json!({})).await;
    let stuck = "a b/ç"; // needs escaping in a subject and in a path
                         // The first attempt of each key's first message fails, but free's
                         // (keygate-key carries a key header-safe, so keys are told apart by "free").
    let receiver = Receiver::start(move |r, earlier| match (r.key().as_str(), r.body.as_slice(), earlier) {
        (k, br#"{"n":0}"#, 0) if k != "free" => Answer::status(503).header("Retry-After", "60"),
        _ => Answer::ok(),
    })
    .await;
    hook(&app, &receiver, json!({})).await;
    let mut events = app.http.get(app.url("/v1/events?stream=K")).send().await.unwrap();
    let published = publish(&app, &[stuck, "other", "free"], 3).await;
    all_acked(&receiver, published["free"].iter().copied()).await;
    let view = eventually(WAIT, || async {
        let (_, view) = app.get("/v1/streams/K/groups/g").await;
        (view["blocked_total"] == 2).then_some(view)
    })
    .await;
    let mut keys: Vec<&str> = view["blocked"].as_array().unwrap().iter().map(|b| b["key"].as_str().unwrap()).collect();
    keys.sort_unstable();
    assert_eq!(keys, vec![stuck, "other"], "{view}");
    assert_eq!(app.metric("keygate_blocked_keys").await, 2.0, "counted, never labelled by key");
    assert_eq!(app.metric("keygate_blocked_partitions").await, 0.0);

    let (status, problem) = app.post("/v1/streams/K/groups/g/partitions/0/skip", json!({})).await;
    assert_eq!(status, 409, "two keys are blocked and none was named: {problem}");
    assert!(problem["detail"].as_str().unwrap().contains("2 blocked keys"), "{problem}");

    // retry-now by key: redelivered now instead of in 60 s.
    let asked = Instant::now();
    let (status, op) = app.post("/v1/streams/K/groups/g/partitions/0/keys/other/retry-now", json!(null)).await;
    assert_eq!(status, 200, "{op}");
    all_acked(&receiver, published["other"].iter().copied()).await;
    assert!(asked.elapsed() < Duration::from_secs(30));

    // skip by key, percent-encoded in the path.
    let path = format!("/v1/streams/K/groups/g/partitions/0/keys/{}/skip", "a%20b%2F%C3%A7");
    let (status, op) = app.post(&path, json!(null)).await;
    assert_eq!(status, 200, "{op}");
    all_acked(&receiver, published[stuck][1..].iter().copied()).await;
    let (status, problem) = app.post(&path, json!(null)).await;
    assert_eq!(status, 409, "no longer blocked: {problem}");

    let mut text = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while let Ok(Some(chunk)) = events.chunk().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await;
    assert!(text.contains("event: key.blocked") && text.contains("event: key.unblocked"), "{text}");
    assert!(!text.contains("partition.blocked"), "the partition itself never blocked");
    assert!(text.contains(r#""key":"a b/ç""#), "events name the key: {text}");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn max_in_flight_bounds_concurrent_deliveries_across_keys() {
    let app = TestApp::start().await;
    one_partition(&app, json!({})).await;
    let receiver = Receiver::start(|_, _| Answer::ok().after(Duration::from_millis(200))).await;
    hook(&app, &receiver, json!({"max_in_flight": 3})).await;
    let keys: Vec<String> = (0..12).map(|i| format!("k{i}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let published = publish(&app, &key_refs, 2).await;
    let requests = all_acked(&receiver, published.values().flatten().copied()).await;
    assert_key_order(&requests, &published, &[]);
    let most = requests
        .iter()
        .map(|r| requests.iter().filter(|o| o.at <= r.at && o.answered.is_none_or(|t| t > r.at)).count())
        .max()
        .unwrap();
    assert!(most <= 3, "{most} deliveries at once");
    assert!(most >= 2, "keys of one partition went concurrently ({most} at most)");
    let (status, problem) = app
        .put(
            "/v1/streams/K/groups/g/members/m1/webhook",
            json!({"url": receiver.url("/m1"),
        "max_in_flight": 0}),
        )
        .await;
    assert_eq!(status, 400, "{problem}");
}

#[tokio::test]
async fn a_websocket_member_gets_several_keys_of_a_partition_at_once_and_acks_them_in_any_order() {
    let app = TestApp::start().await;
    one_partition(&app, json!({})).await;
    let mut client = WsClient::connect(&member_url(&app.base, "K", "g", "m1", "max_in_flight=8")).await;
    client.next_of("assigned", WAIT).await;
    let published = publish(&app, &["a", "b", "c"], 2).await;
    // The pin comes with the first message.
    client.next_of("pinned", WAIT).await;
    // The first message of each key arrives before any ack: three in flight.
    let mut first = Vec::new();
    for _ in 0..3 {
        let message = client.next_of("message", WAIT).await;
        first.push(message);
    }
    let mut keys: Vec<&str> = first.iter().map(|m| m["key"].as_str().unwrap()).collect();
    keys.sort_unstable();
    assert_eq!(keys, vec!["a", "b", "c"]);
    assert!(client.maybe_message(Duration::from_millis(300)).await.is_none(), "one in flight per key");
    // Acked in reverse order: each key's second message follows its own ack.
    let mut seen: HashMap<String, Vec<u64>> = HashMap::new();
    for message in first.iter().rev() {
        seen.entry(message["key"].as_str().unwrap().to_owned())
            .or_default()
            .push(message["stream_seq"].as_u64().unwrap());
        client.ack(&message["id"]).await;
        let next = client.next_of("message", WAIT).await;
        assert_eq!(next["key"], message["key"], "the acked key's next message");
        seen.entry(next["key"].as_str().unwrap().to_owned()).or_default().push(next["stream_seq"].as_u64().unwrap());
        client.ack(&next["id"]).await;
    }
    for (key, seqs) in &published {
        assert_eq!(&seen[key], seqs, "key {key} in order");
    }
    app.assert_no_acks_without_verdict().await;
}

/// A request of key `k` for `seq`, sent `at` ms and answered `status` at
/// `answered` ms after `start`.
fn recorded(start: Instant, seq: u64, at: u64, answered: u64, status: u16) -> Recorded {
    let ms = |n: u64| start + Duration::from_millis(n);
    Recorded::of_key_k(seq, ms(at), status, ms(answered))
}

#[test]
#[should_panic(expected = "seq 2 was delivered before seq 1 was acknowledged")]
fn the_key_order_check_catches_a_message_sent_before_its_predecessor_was_acked() {
    let start = Instant::now();
    // Seq 1 failed (503), seq 2 went before seq 1's retry was answered 2xx.
    let requests = [recorded(start, 1, 0, 5, 503), recorded(start, 2, 10, 15, 200), recorded(start, 1, 20, 25, 200)];
    assert_key_order(&requests, &HashMap::from([("k".to_owned(), vec![1, 2])]), &[]);
}

#[test]
#[should_panic(expected = "seq 2 arrived while seq 1 was still being delivered")]
fn the_key_order_check_catches_two_requests_of_a_key_at_once() {
    let start = Instant::now();
    let requests = [recorded(start, 1, 0, 10, 200), recorded(start, 2, 5, 15, 200)];
    assert_key_order(&requests, &HashMap::from([("k".to_owned(), vec![1, 2])]), &[]);
}

#[test]
fn the_key_order_check_allows_retries_redeliveries_and_skipped_messages() {
    let start = Instant::now();
    let requests = [
        recorded(start, 1, 0, 5, 503),
        recorded(start, 1, 10, 15, 200),
        recorded(start, 3, 20, 25, 200),
        // A redelivery of an acked message (its ack was lost) after later ones.
        recorded(start, 1, 30, 35, 200),
    ];
    assert_key_order(&requests, &HashMap::from([("k".to_owned(), vec![1, 2, 3])]), &[2]);
}
