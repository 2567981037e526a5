//! HTTP pull members and subscribers (docs/pull.md): fetches hand out what
//! the lanes release (one message per key out at once, a NAK'd message
//! before the later ones of its key), verdicts settle by ack id on any
//! replica, un-settled messages come back after their visibility timeout,
//! and a replica's pull instance competes for the pin and hands it over
//! when its client stops fetching. Against a real nats-server.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::auth::{call, scoped, start_with_secret};
use crate::support::nats::NatsServer;
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(30);
const MEMBER: &str = "/v1/streams/P/groups/g/members/m";

async fn publish(app: &TestApp, stream: &str, key: &str, n: u64) -> u64 {
    let (status, ack) =
        app.post(&format!("/v1/streams/{stream}/messages"), json!({"key": key, "data": {"n": n}})).await;
    assert_eq!(status, 200, "{ack}");
    ack["seq"].as_u64().unwrap()
}

async fn fetch(app: &TestApp, path: &str, body: Value) -> Value {
    let (status, answer) = app.post(&format!("{path}/fetch"), body).await;
    assert_eq!(status, 200, "{answer}");
    answer
}

async fn settle(app: &TestApp, path: &str, body: Value) -> Value {
    let (status, answer) = app.post(&format!("{path}/acks"), body).await;
    assert_eq!(status, 200, "{answer}");
    answer
}

fn messages(answer: &Value) -> Vec<Value> {
    answer["messages"].as_array().cloned().unwrap_or_default()
}

fn n_of(message: &Value) -> u64 {
    message["data"]["n"].as_u64().unwrap()
}

fn ack_ids(batch: &[Value]) -> Vec<Value> {
    batch.iter().map(|m| m["ack_id"].clone()).collect()
}

/// Each key's deliveries, in the order they were handed out, never go back
/// to an earlier message than one already settled.
fn assert_key_order(deliveries: &[(String, u64, u64)]) {
    let mut by_key: HashMap<&str, Vec<u64>> = HashMap::new();
    for (key, n, _) in deliveries {
        by_key.entry(key).or_default().push(*n);
    }
    for (key, ns) in by_key {
        assert!(ns.windows(2).all(|w| w[0] <= w[1]), "key {key} out of order: {ns:?}");
    }
}

async fn consumer_settled(app: &TestApp, stream: &str, consumer: &str) {
    eventually(WAIT, || async {
        let info = app.js.get_stream(stream).await.ok()?.consumer_info(consumer).await.ok()?;
        (info.num_pending == 0 && info.num_ack_pending == 0).then_some(())
    })
    .await;
}

async fn member_group(app: &TestApp, group: Value) {
    app.create_stream("P", json!({"subjects":["p.*"],"partitions":4})).await;
    assert_eq!(app.put("/v1/streams/P/groups/g", group).await.0, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_member_gets_one_message_per_key_at_a_time_and_settles_in_batches_in_key_order() {
    let app = TestApp::start().await;
    member_group(&app, json!({"kind":"static","partitions":4,"members":["m"]})).await;
    for n in 0..40 {
        publish(&app, "P", &format!("k{}", n % 5), n).await;
    }
    // Nothing settled yet: a second fetch brings no key the first has out.
    let mut first = Vec::new();
    let deadline = Instant::now() + WAIT;
    while first.len() < 5 {
        assert!(Instant::now() < deadline, "the first fetches brought {first:?}");
        first.extend(messages(&fetch(&app, MEMBER, json!({"max_messages": 100, "wait_ms": 2000})).await));
    }
    let answer = fetch(&app, MEMBER, json!({"wait_ms": 300})).await;
    assert!(messages(&answer).is_empty(), "every key has a message out: {answer}");
    assert_eq!((answer["pinned"].clone(), answer["partitions"].clone()), (json!(true), json!([0, 1, 2, 3])));
    let keys: HashSet<&str> = first.iter().map(|m| m["key"].as_str().unwrap()).collect();
    assert_eq!(keys.len(), first.len(), "one message per key out at once: {first:?}");
    let message = &first[0];
    for field in ["id", "stream", "group", "member", "subject", "partition", "stream_seq", "attempt", "fencing_token"] {
        assert!(!message[field].is_null(), "{field} in {message}");
    }
    assert_eq!(message["member"], "m");

    // Settle in batches: NAK (300 ms) the first delivery of every n % 7 == 3,
    // terminate n 11, ack the rest; until every message is settled.
    let mut deliveries: Vec<(String, u64, u64)> = Vec::new();
    let mut done: HashSet<u64> = HashSet::new();
    let mut batch = first;
    let deadline = Instant::now() + WAIT;
    while done.len() < 40 {
        assert!(Instant::now() < deadline, "settled {} of 40", done.len());
        let (mut ack, mut nak, mut term) = (Vec::new(), Vec::new(), Vec::new());
        for message in &batch {
            let (n, attempt) = (n_of(message), message["attempt"].as_u64().unwrap());
            deliveries.push((message["key"].as_str().unwrap().to_owned(), n, attempt));
            if n % 7 == 3 && attempt == 1 {
                nak.push(json!({"id": message["ack_id"], "delay_ms": 300}));
            } else if n == 11 {
                term.push(message["ack_id"].clone());
                done.insert(n);
            } else {
                ack.push(message["ack_id"].clone());
                done.insert(n);
            }
        }
        if !batch.is_empty() {
            let settled = settle(&app, MEMBER, json!({"ack": ack, "nak": nak, "term": term})).await;
            assert_eq!((settled["settled"].as_u64(), settled["failed"].clone()), (Some(batch.len() as u64), json!([])));
        }
        batch = messages(&fetch(&app, MEMBER, json!({"max_messages": 100, "wait_ms": 1000})).await);
    }
    assert_key_order(&deliveries);
    for (key, n, attempt) in &deliveries {
        let expected = if n % 7 == 3 { vec![1, 2] } else { vec![1] };
        let seen: Vec<u64> = deliveries.iter().filter(|d| d.0 == *key && d.1 == *n).map(|d| d.2).collect();
        assert_eq!(seen, expected, "deliveries of {key} n {n} (this one attempt {attempt})");
    }
    consumer_settled(&app, "P", "g-m").await;
    let (status, letters) = app.get("/v1/dead-letters?stream=P&group=g").await;
    assert_eq!(status, 200, "{letters}");
    assert_eq!(letters["dead_letters"].as_array().map(Vec::len), Some(1), "{letters}");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsettled_messages_come_back_after_their_visibility_timeout_and_progress_extends_it() {
    let app = TestApp::start().await;
    member_group(&app, json!({"kind":"static","partitions":4,"members":["m"],"ack_wait_ms":3000})).await;
    publish(&app, "P", "a", 0).await;
    let first = eventually(WAIT, || async {
        let batch = messages(&fetch(&app, MEMBER, json!({"visibility_ms": 300, "wait_ms": 1000})).await);
        batch.into_iter().next()
    })
    .await;
    assert_eq!(first["attempt"], 1);
    // Not settled within 300 ms: it comes again, with a new ack id.
    let again = eventually(WAIT, || async {
        messages(&fetch(&app, MEMBER, json!({"visibility_ms": 500, "wait_ms": 1000})).await).into_iter().next()
    })
    .await;
    assert_eq!((again["id"].clone(), again["attempt"].clone()), (first["id"].clone(), json!(2)));
    assert_ne!(again["ack_id"], first["ack_id"]);
    let stale = settle(&app, MEMBER, json!({"ack": [first["ack_id"]]})).await;
    assert_eq!(stale["settled"], 0);
    assert_eq!(stale["failed"][0]["id"], first["ack_id"], "{stale}");
    // Progress at 300 ms of 500 restarts the timeout: an ack at 650 ms still lands.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(settle(&app, MEMBER, json!({"progress": [again["ack_id"]]})).await["settled"], 1);
    tokio::time::sleep(Duration::from_millis(350)).await;
    let acked = settle(&app, MEMBER, json!({"ack": [again["ack_id"]]})).await;
    assert_eq!((acked["settled"].clone(), acked["failed"].clone()), (json!(1), json!([])), "{acked}");
    consumer_settled(&app, "P", "g-m").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_instances_on_two_replicas_share_pin_and_verdicts_and_one_that_stops_fetching_hands_over() {
    let server = NatsServer::start();
    let (a, b) = (TestApp::start_on(server.url()).await, TestApp::start_on(server.url()).await);
    member_group(&a, json!({"kind":"static","partitions":4,"members":["m"],"ack_wait_ms":1500})).await;
    for n in 0..10 {
        publish(&a, "P", &format!("k{}", n % 5), n).await;
    }
    let mut deliveries: Vec<(String, u64, u64)> = Vec::new();
    let record = |deliveries: &mut Vec<(String, u64, u64)>, batch: &[Value]| {
        for m in batch {
            deliveries.push((m["key"].as_str().unwrap().to_owned(), n_of(m), m["attempt"].as_u64().unwrap()));
        }
    };
    // A fetches first and takes the pin; B's instance stands by.
    let on_a = eventually(WAIT, || async {
        let batch = messages(&fetch(&a, MEMBER, json!({"wait_ms": 2000})).await);
        (!batch.is_empty()).then_some(batch)
    })
    .await;
    record(&mut deliveries, &on_a);
    let standby = fetch(&b, MEMBER, json!({"wait_ms": 1000})).await;
    assert_eq!((messages(&standby).len(), standby["pinned"].clone()), (0, json!(false)), "{standby}");
    // Verdicts for A's deliveries posted to B reach A.
    let settled = settle(&b, MEMBER, json!({"ack": ack_ids(&on_a)})).await;
    assert_eq!((settled["settled"].as_u64(), settled["failed"].clone()), (Some(on_a.len() as u64), json!([])));
    let mut acked: HashSet<u64> = on_a.iter().map(n_of).collect();
    // A takes the next messages and its client goes away without a verdict.
    let abandoned = eventually(WAIT, || async {
        let batch = messages(&fetch(&a, MEMBER, json!({"wait_ms": 2000})).await);
        (!batch.is_empty()).then_some(batch)
    })
    .await;
    record(&mut deliveries, &abandoned);
    // B keeps fetching: it gains the pin and everything left, A's first.
    let deadline = Instant::now() + WAIT;
    let mut pinned_on_b = false;
    while acked.len() < 10 {
        assert!(Instant::now() < deadline, "B settled {acked:?} of 10");
        let answer = fetch(&b, MEMBER, json!({"wait_ms": 1000})).await;
        pinned_on_b |= answer["pinned"] == true;
        let batch = messages(&answer);
        if batch.is_empty() {
            continue;
        }
        record(&mut deliveries, &batch);
        acked.extend(batch.iter().map(n_of));
        assert_eq!(settle(&b, MEMBER, json!({"ack": ack_ids(&batch)})).await["failed"], json!([]));
    }
    assert!(pinned_on_b, "B's instance took the pin");
    assert_key_order(&deliveries);
    for m in &abandoned {
        let again = deliveries.iter().filter(|d| d.1 == n_of(m)).map(|d| d.2).max();
        assert!(again >= Some(2), "n {} came again with a higher attempt: {deliveries:?}", n_of(m));
    }
    let late = settle(&a, MEMBER, json!({"ack": ack_ids(&abandoned)})).await;
    assert_eq!(late["settled"], 0, "A's stale ack ids settle nothing: {late}");
    consumer_settled(&a, "P", "g-m").await;
    a.assert_no_acks_without_verdict().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_consumers_subscriber_pulls_with_its_options_and_acks() {
    let app = TestApp::start().await;
    app.create_stream("JOBS", json!({"subjects":["jobs.*"]})).await;
    let consumer = json!({"policy":"pinned_client","group":"workers","pinned_ttl_ms":2000,"ack_wait_ms":5000,"filter_subjects":["jobs.*"]});
    assert_eq!(app.put("/v1/streams/JOBS/consumers/c", consumer).await.0, 201);
    for n in 0..12 {
        publish(&app, "JOBS", &format!("j{n}"), n).await;
    }
    let path = "/v1/streams/JOBS/consumers/c/subscribers/s1";
    let mut acked = HashSet::new();
    let deadline = Instant::now() + WAIT;
    let mut most_out = 0;
    while acked.len() < 12 {
        assert!(Instant::now() < deadline, "acked {acked:?} of 12");
        let batch = messages(&fetch(&app, path, json!({"concurrency": 8, "wait_ms": 1000})).await);
        most_out = most_out.max(batch.len());
        if batch.is_empty() {
            continue;
        }
        assert!(batch.iter().all(|m| m["group"] == "c" && m["member"] == "s1"), "{batch:?}");
        acked.extend(batch.iter().map(n_of));
        assert_eq!(settle(&app, path, json!({"ack": ack_ids(&batch)})).await["failed"], json!([]));
    }
    assert!(most_out <= 8, "at most `concurrency` out at once, saw {most_out}");
    let (status, problem) = app.post(&format!("{path}/fetch"), json!({"concurrency": 2})).await;
    assert_eq!(status, 409, "other start options while it runs: {problem}");
    consumer_settled(&app, "JOBS", "c").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_fetches_and_verdicts_are_refused_and_start_nothing() {
    let app = TestApp::start().await;
    member_group(&app, json!({"kind":"static","partitions":4,"members":["m"],"ack_wait_ms":2000})).await;
    for (path, body, status) in [
        (MEMBER, json!({"max_messages": 0}), 400),
        (MEMBER, json!({"max_messages": 1001}), 400),
        (MEMBER, json!({"wait_ms": 60_001}), 400),
        (MEMBER, json!({"visibility_ms": 2001}), 400),
        (MEMBER, json!({"visibility_ms": 0}), 400),
        (MEMBER, json!({"max_attempts": 0}), 400),
        (MEMBER, json!({"max_in_flight": 1001}), 400),
        (MEMBER, json!({"batch": 5}), 400),
        ("/v1/streams/P/groups/g/members/stranger", json!({}), 404),
        ("/v1/streams/P/groups/nope/members/m", json!({}), 404),
    ] {
        let (got, problem) = app.post(&format!("{path}/fetch"), body.clone()).await;
        assert_eq!(got, status, "{body}: {problem}");
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()), "{problem}");
    }
    for body in [
        json!({}),
        json!({"ack": ["nope"]}),
        json!({"ack": ["0123456789abcdef0123456789abcdef"], "term": ["0123456789abcdef0123456789abcdef"]}),
        json!({"nak": [{"id": "0123456789abcdef0123456789abcdef", "delay_ms": 900_001}]}),
        json!({"acks": []}),
    ] {
        let (got, problem) = app.post(&format!("{MEMBER}/acks"), body.clone()).await;
        assert_eq!(got, 400, "{body}: {problem}");
    }
    // None of those started an instance of m: the group lists none.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, view) = app.get("/v1/streams/P/groups/g").await;
    assert_eq!(view["assignment"][0]["instances"], json!([]), "{view}");
    // A started instance refuses other start options while it runs.
    fetch(&app, MEMBER, json!({"max_attempts": 3, "wait_ms": 0})).await;
    fetch(&app, MEMBER, json!({"max_attempts": 3, "wait_ms": 0})).await;
    let (status, problem) = app.post(&format!("{MEMBER}/fetch"), json!({"max_attempts": 4})).await;
    assert_eq!(status, 409, "{problem}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_routes_take_the_scopes_of_websocket_joins_and_no_query_token() {
    let app = start_with_secret().await;
    let admin = scoped("keygate:admin");
    let (status, _) =
        call(&app, "PUT", "/v1/streams/P", Some(&admin), Some(json!({"subjects":["p.*"],"partitions":2}))).await;
    assert_eq!(status, 201);
    let group = json!({"kind":"static","partitions":2,"members":["m"]});
    assert_eq!(call(&app, "PUT", "/v1/streams/P/groups/g", Some(&admin), Some(group)).await.0, 201);
    let fetch_path = format!("{MEMBER}/fetch");
    let body = || Some(json!({"wait_ms": 0}));
    assert_eq!(call(&app, "POST", &fetch_path, Some(&scoped("consume:P/g")), body()).await.0, 200);
    assert_eq!(call(&app, "POST", &fetch_path, Some(&scoped("consume:P/other")), body()).await.0, 403);
    assert_eq!(call(&app, "POST", &fetch_path, Some(&scoped("publish:P")), body()).await.0, 403);
    assert_eq!(call(&app, "POST", &fetch_path, None, body()).await.0, 401);
    let in_query = format!("{fetch_path}?access_token={}", scoped("consume:P/g"));
    assert_eq!(call(&app, "POST", &in_query, None, body()).await.0, 401, "a POST's token goes in its header");
    let acks = Some(json!({"ack": ["0123456789abcdef0123456789abcdef"]}));
    assert_eq!(
        call(&app, "POST", &format!("{MEMBER}/acks"), Some(&scoped("consume:P/other")), acks.clone()).await.0,
        403
    );
    let (status, answer) = call(&app, "POST", &format!("{MEMBER}/acks"), Some(&scoped("consume:P/g")), acks).await;
    assert_eq!((status, answer["settled"].clone()), (200, json!(0)), "{answer}");
    let subscriber = "/v1/streams/P/consumers/c/subscribers/s/fetch";
    assert_eq!(call(&app, "POST", subscriber, Some(&scoped("consume:P/c")), body()).await.0, 403);
}
