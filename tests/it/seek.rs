//! Replay and seek (docs/operations.md, "Replay and seek"): a static group
//! served by two replicas replays from a time and from a sequence, each
//! key in order, and skips to the end; a limits stream says what it no
//! longer holds; a plain consumer replays too. Against a real nats-server.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::nats::NatsServer;
use crate::support::receiver::{assert_key_order, Answer, Receiver, Recorded};
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(30);

async fn publish(app: &TestApp, stream: &str, keys: &[&str], from: u64) -> HashMap<String, Vec<u64>> {
    let messages: Vec<Value> =
        keys.iter().enumerate().map(|(i, k)| json!({"key": k, "data": {"n": from + i as u64}})).collect();
    let (status, acks) = app.post(&format!("/v1/streams/{stream}/messages/batch"), json!({"messages": messages})).await;
    assert_eq!(status, 200, "{acks}");
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    for ack in acks["results"].as_array().unwrap() {
        published.entry(ack["key"].as_str().unwrap().to_owned()).or_default().push(ack["seq"].as_u64().unwrap());
    }
    published
}

/// The requests received after the first `skip`, once every one of `seqs` was acked among them.
async fn acked_after(receiver: &Receiver, skip: usize, seqs: &[u64]) -> Vec<Recorded> {
    eventually(WAIT, || async {
        let requests: Vec<Recorded> = receiver.requests().into_iter().skip(skip).collect();
        seqs.iter().all(|s| requests.iter().any(|r| r.seq() == *s && r.ok())).then_some(requests)
    })
    .await
}

fn all(published: &HashMap<String, Vec<u64>>) -> Vec<u64> {
    let mut seqs: Vec<u64> = published.values().flatten().copied().collect();
    seqs.sort_unstable();
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_group_replays_from_a_time_or_a_sequence_in_key_order_while_served_by_two_replicas() {
    let server = NatsServer::start();
    let app = TestApp::start_on(server.url()).await;
    let _replica = TestApp::start_on(server.url()).await;
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":2})).await;
    let group = json!({"kind":"static","partitions":2,"members":["m1","m2"],"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/K/groups/g", group).await.0, 201);
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    for member in ["m1", "m2"] {
        let hook = json!({"url": receiver.url(&format!("/{member}"))});
        assert_eq!(app.put(&format!("/v1/streams/K/groups/g/members/{member}/webhook"), hook).await.0, 201);
    }
    let keys = ["a", "b", "c", "d", "a", "b", "c", "d"];
    let early = publish(&app, "K", &keys, 0).await;
    acked_after(&receiver, 0, &all(&early)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mark = time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let late = publish(&app, "K", &keys, 8).await;
    acked_after(&receiver, 0, &all(&late)).await;

    // From the time: the later half again, each key in order, nothing earlier.
    let before = receiver.requests().len();
    let (status, answer) = app.post("/v1/streams/K/groups/g/seek", json!({"to": {"time": mark}})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!((answer["consumers"].clone(), answer["before_first"].clone()), (json!(["g-m1", "g-m2"]), json!(false)));
    let replayed = acked_after(&receiver, before, &all(&late)).await;
    assert!(replayed.iter().all(|r| late.values().flatten().any(|s| *s == r.seq())), "nothing before the time");
    assert_key_order(&replayed, &late, &[]);
    let (_, view) = app.get("/v1/streams/K/groups/g").await;
    assert!(view["assignment"].as_array().unwrap().iter().all(|m| m["paused"].is_null()), "resumed: {view}");

    // From a sequence: everything, in key order.
    let before = receiver.requests().len();
    let (status, _) = app.post("/v1/streams/K/groups/g/seek", json!({"to": {"seq": 1}})).await;
    assert_eq!(status, 200);
    let mut everything = early.clone();
    for (k, seqs) in &late {
        everything.get_mut(k).unwrap().extend(seqs);
    }
    let replayed = acked_after(&receiver, before, &all(&everything)).await;
    assert_key_order(&replayed, &everything, &[]);

    // To the end: nothing again; what comes next flows.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = receiver.requests().len();
    assert_eq!(app.post("/v1/streams/K/groups/g/seek", json!({"to": "latest"})).await.0, 200);
    let next = publish(&app, "K", &["a"], 16).await;
    let after = acked_after(&receiver, before, &all(&next)).await;
    assert!(
        after.iter().all(|r| r.seq() == all(&next)[0]),
        "only the new message: {:?}",
        after.iter().map(Recorded::seq).collect::<Vec<_>>()
    );

    for bad in [json!({"to": {"seq": 0}}), json!({"to": {"time": "yesterday"}}), json!({"to": "earliest"}), json!({})] {
        assert_eq!(app.post("/v1/streams/K/groups/g/seek", bad.clone()).await.0, 400, "{bad}");
    }
    app.create_stream("E", json!({"subjects":["e.>"]})).await;
    assert_eq!(app.put("/v1/streams/E/groups/el", json!({"kind":"elastic","partitions":2})).await.0, 201);
    assert_eq!(app.post("/v1/streams/E/groups/el/seek", json!({"to": "latest"})).await.0, 422);
    assert_eq!(app.post("/v1/streams/K/groups/nope/seek", json!({"to": "latest"})).await.0, 404);
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_limits_stream_says_the_start_is_gone_and_a_plain_consumer_replays() {
    let app = TestApp::start().await;
    app.create_stream("L", json!({"subjects":["l.*"],"max_msgs":5})).await;
    assert_eq!(app.put("/v1/streams/L/consumers/c", json!({"ack_wait_ms": 2000})).await.0, 201);
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/s1"), "concurrency": 1});
    assert_eq!(app.put("/v1/streams/L/consumers/c/subscribers/s1/webhook", hook).await.0, 201);
    let published = publish(&app, "L", &["a"; 8], 0).await;
    let kept: Vec<u64> = all(&published)[3..].to_vec();
    acked_after(&receiver, 0, &kept).await;

    let before = receiver.requests().len();
    let (status, answer) = app.post("/v1/streams/L/consumers/c/seek", json!({"to": {"seq": 1}})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!((answer["before_first"].clone(), answer["first_seq"].clone()), (json!(true), json!(kept[0])));
    let replayed = acked_after(&receiver, before, &kept).await;
    assert!(replayed.iter().all(|r| kept.contains(&r.seq())), "only what is still stored");
    let (_, view) = app.get("/v1/streams/L/consumers/c").await;
    assert_eq!(view["ack_wait_ms"], 2000, "the configuration is kept: {view}");
    assert_eq!(app.post("/v1/streams/L/consumers/nope/seek", json!({"to": "latest"})).await.0, 404);
}
