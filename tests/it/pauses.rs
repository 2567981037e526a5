//! Pause and resume (docs/operations.md, "Pause and resume"): a paused
//! member's instances stop pulling on every replica, release the pin, and
//! its backlog waits in NATS, across a restart of every replica; resumed,
//! the backlog flows in order. Against a real nats-server.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};

use crate::support::nats::NatsServer;
use crate::support::receiver::{assert_key_order, Answer, Receiver};
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(20);
/// Long enough for an instance that still pulled to have delivered.
const QUIET: Duration = Duration::from_secs(3);

async fn publish(app: &TestApp, stream: &str, n: u64) -> u64 {
    let (status, ack) =
        app.post(&format!("/v1/streams/{stream}/messages"), json!({"key": "k", "data": {"n": n}})).await;
    assert_eq!(status, 200, "{ack}");
    ack["seq"].as_u64().unwrap()
}

async fn delivered(receiver: &Receiver, seqs: &[u64]) {
    eventually(WAIT, || async {
        let acked: Vec<u64> = receiver.requests().iter().filter(|r| r.ok()).map(|r| r.seq()).collect();
        seqs.iter().all(|s| acked.contains(s)).then_some(())
    })
    .await;
}

fn delivered_any(receiver: &Receiver, seqs: &[u64]) -> bool {
    receiver.requests().iter().any(|r| seqs.contains(&r.seq()))
}

async fn member_state(app: &TestApp) -> Value {
    let (status, view) = app.get("/v1/streams/K/groups/g").await;
    assert_eq!(status, 200, "{view}");
    view["assignment"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_member_holds_its_backlog_on_every_replica_and_across_their_restart() {
    let server = NatsServer::start();
    let replicas = [TestApp::start_on(server.url()).await, TestApp::start_on(server.url()).await];
    let app = &replicas[0];
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":2})).await;
    let group = json!({"kind":"static","partitions":2,"members":["m1"],"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/K/groups/g", group).await.0, 201);
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/m1")});
    assert_eq!(app.put("/v1/streams/K/groups/g/members/m1/webhook", hook).await.0, 201);
    let before: Vec<u64> = futures::future::join_all((0..3).map(|n| publish(app, "K", n))).await;
    delivered(&receiver, &before).await;

    let mut events = app.nats.subscribe("keygate.events.K.g.m1.>").await.unwrap();
    let (status, paused) = app.post("/v1/streams/K/groups/g/members/m1/pause", json!({"reason": "db migration"})).await;
    assert_eq!(status, 200, "{paused}");
    assert_eq!((paused["paused"].clone(), paused["group"].clone()), (json!(true), json!("g")));
    assert_eq!(
        (paused["pause"]["reason"].clone(), paused["pause"]["paused_by"].clone()),
        (json!("db migration"), json!("anonymous"))
    );
    let event = tokio::time::timeout(WAIT, async {
        while let Some(message) = events.next().await {
            let event: Value = serde_json::from_slice(&message.payload).unwrap();
            if event["type"] == "member.paused" {
                return event;
            }
        }
        panic!("the event subscription ended");
    })
    .await
    .expect("a member.paused event");
    assert_eq!((event["reason"].clone(), event["by"].clone()), (json!("db migration"), json!("anonymous")));
    // Pausing again keeps the first pause.
    let (_, again) = app.post("/v1/streams/K/groups/g/members/m1/pause", json!({"reason": "other"})).await;
    assert_eq!(again["pause"], paused["pause"]);

    // The pin is released and nobody takes it; the view says who paused.
    eventually(WAIT, || async {
        let state = member_state(app).await;
        (state["pinned_client_id"].is_null() && state["waiting_pulls"] == 0).then_some(())
    })
    .await;
    let state = member_state(app).await;
    assert_eq!(state["paused"]["reason"], "db migration", "{state}");
    let backlog: Vec<u64> = {
        let mut seqs = Vec::new();
        for n in 3..8 {
            seqs.push(publish(app, "K", n).await);
        }
        seqs
    };
    tokio::time::sleep(QUIET).await;
    assert!(!delivered_any(&receiver, &backlog), "a paused member receives nothing");
    assert_eq!(member_state(app).await["num_pending"], 5, "the backlog waits in NATS");

    // Both replicas restart: the member stays paused.
    for replica in &replicas {
        replica.shutdown();
    }
    drop(replicas);
    let replicas = [TestApp::start_on(server.url()).await, TestApp::start_on(server.url()).await];
    tokio::time::sleep(QUIET).await;
    assert!(!delivered_any(&receiver, &backlog), "still paused after both replicas restarted");
    let state = member_state(&replicas[1]).await;
    assert_eq!((state["paused"]["reason"].clone(), state["num_pending"].clone()), (json!("db migration"), json!(5)));

    let (status, resumed) = replicas[1].post("/v1/streams/K/groups/g/members/m1/resume", json!(null)).await;
    assert_eq!(status, 200, "{resumed}");
    assert_eq!((resumed["paused"].clone(), resumed["pause"]["reason"].clone()), (json!(false), json!("db migration")));
    delivered(&receiver, &backlog).await;
    let published = std::collections::HashMap::from([("k".to_owned(), [before, backlog].concat())]);
    assert_key_order(&receiver.requests(), &published, &[]);
    assert!(member_state(&replicas[0]).await["paused"].is_null());
    let (status, not_paused) = replicas[0].post("/v1/streams/K/groups/g/members/m1/resume", json!(null)).await;
    assert_eq!((status, not_paused["pause"].clone()), (200, Value::Null), "resuming twice changes nothing");

    // Bad input changes nothing.
    assert_eq!(replicas[0].post("/v1/streams/K/groups/g/members/zed/pause", json!(null)).await.0, 404);
    let (status, problem) =
        replicas[0].post("/v1/streams/K/groups/g/members/m1/pause", json!({"reason": "two\nlines"})).await;
    assert_eq!(status, 400, "{problem}");
    assert_eq!(replicas[0].post("/v1/streams/K/groups/g/members/m1/pause", json!({"why": "x"})).await.0, 400);
    assert!(member_state(&replicas[0]).await["paused"].is_null());
    for replica in &replicas {
        replica.assert_no_acks_without_verdict().await;
    }
}

#[tokio::test]
async fn a_paused_subscriber_of_a_plain_consumer_stops_and_resumes() {
    let app = TestApp::start().await;
    app.create_stream("JOBS", json!({"subjects":["jobs.*"]})).await;
    assert_eq!(app.put("/v1/streams/JOBS/consumers/c", json!({"ack_wait_ms": 2000})).await.0, 201);
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/s1")});
    assert_eq!(app.put("/v1/streams/JOBS/consumers/c/subscribers/s1/webhook", hook).await.0, 201);
    let first = publish(&app, "JOBS", 0).await;
    delivered(&receiver, &[first]).await;

    let (status, paused) = app.post("/v1/streams/JOBS/consumers/c/subscribers/s1/pause", json!(null)).await;
    assert_eq!(status, 200, "{paused}");
    assert_eq!((paused["consumer"].clone(), paused["group"].clone()), (json!("c"), Value::Null));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held = publish(&app, "JOBS", 1).await;
    tokio::time::sleep(QUIET).await;
    assert!(!delivered_any(&receiver, &[held]), "a paused subscriber receives nothing");
    let (status, _) = app.post("/v1/streams/JOBS/consumers/c/subscribers/s1/resume", json!(null)).await;
    assert_eq!(status, 200);
    delivered(&receiver, &[held]).await;
    assert_eq!(app.post("/v1/streams/JOBS/consumers/nope/subscribers/s1/pause", json!(null)).await.0, 404);
}

/// The group view reads its members' pause flags in one batched direct get
/// of the flags under the group's prefix: a resumed member's delete marker
/// counts as none, and another group's flags stay out.
#[tokio::test]
async fn the_group_view_reads_every_members_pause_at_once() {
    let app = TestApp::start().await;
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":3})).await;
    for group in ["g", "g2"] {
        let spec = json!({"kind":"static","partitions":3,"members":["m1","m2","m3"]});
        assert_eq!(app.put(&format!("/v1/streams/K/groups/{group}"), spec).await.0, 201);
    }
    for (group, member) in [("g", "m1"), ("g", "m3"), ("g2", "m2")] {
        let path = format!("/v1/streams/K/groups/{group}/members/{member}/pause");
        assert_eq!(app.post(&path, json!({"reason": format!("{group} {member}")})).await.0, 200);
    }
    assert_eq!(app.post("/v1/streams/K/groups/g/members/m3/resume", json!(null)).await.0, 200);
    let (status, view) = app.get("/v1/streams/K/groups/g").await;
    assert_eq!(status, 200, "{view}");
    let reasons: Vec<Value> = (0..3).map(|m| view["assignment"][m]["paused"]["reason"].clone()).collect();
    assert_eq!(reasons, [json!("g m1"), Value::Null, Value::Null], "{view}");
}

/// What that read rests on, as nats-server answers it: `multi_last` with a
/// wildcard sends the last message of every matching key (a delete marker
/// too, with its `KV-Operation`), each counting down `Nats-Num-Pending`,
/// then a 204 whose `Nats-Num-Pending` is 0; a prefix with no key answers
/// 404 "No Results".
#[tokio::test]
async fn a_batched_direct_get_sends_each_keys_last_value_then_the_end() {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let kv = js
        .create_key_value(async_nats::jetstream::kv::Config { bucket: "flags".into(), ..Default::default() })
        .await
        .unwrap();
    kv.put("a.x.1", "one".into()).await.unwrap();
    kv.put("a.x.1", "one again".into()).await.unwrap();
    kv.put("a.x.2", "two".into()).await.unwrap();
    kv.delete("a.x.2").await.unwrap();
    kv.put("a.y.1", "elsewhere".into()).await.unwrap();
    let batch = async |filters: &[&str]| {
        let inbox = client.new_inbox();
        let mut answers = client.subscribe(inbox.clone()).await.unwrap();
        let body = serde_json::to_vec(&json!({ "multi_last": filters })).unwrap();
        client.publish_with_reply("$JS.API.DIRECT.GET.KV_flags", inbox, body.into()).await.unwrap();
        let mut got = Vec::new();
        while let Some(answer) = tokio::time::timeout(WAIT, answers.next()).await.unwrap() {
            let header = |name: &str| answer.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.to_string());
            let status = answer.status.map_or(200, |s| s.as_u16());
            let payload = String::from_utf8_lossy(&answer.payload).into_owned();
            got.push((status, header("Nats-Subject"), header("KV-Operation"), header("Nats-Num-Pending"), payload));
            if status != 200 {
                return (got, answer.description.clone());
            }
        }
        panic!("the answers ended without a status");
    };
    let (got, _) = batch(&["$KV.flags.a.x.*"]).await;
    let some = |s: &str| Some(s.to_owned());
    assert_eq!(
        got,
        vec![
            (200, some("$KV.flags.a.x.1"), None, some("1"), "one again".to_owned()),
            (200, some("$KV.flags.a.x.2"), some("DEL"), some("0"), String::new()),
            (204, None, None, some("0"), String::new()),
        ]
    );
    let (got, description) = batch(&["$KV.flags.b.*.*"]).await;
    assert_eq!((got.len(), got[0].0, description.as_deref()), (1, 404, Some("No Results")));

    // Subjects named one by one are read alike (src/nats/kv_scan.rs reads
    // them so past the cap): a deleted one comes with its marker.
    let (got, _) = batch(&["$KV.flags.a.x.2", "$KV.flags.a.y.1"]).await;
    let answered: Vec<_> =
        got.iter().map(|(status, subject, op, _, _)| (*status, subject.clone(), op.clone())).collect();
    assert_eq!(
        answered,
        vec![(200, some("$KV.flags.a.x.2"), some("DEL")), (200, some("$KV.flags.a.y.1"), None), (204, None, None)]
    );
    // Over 1,024 matching subjects the server refuses the read.
    for i in 0..1_025 {
        kv.put(format!("c.{i}"), "x".into()).await.unwrap();
    }
    let (got, _) = batch(&["$KV.flags.c.*"]).await;
    assert_eq!((got.len(), got[0].0), (1, 413));
}
