//! WebSocket members against a real nats-server and keygate.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::ws::{member_url, WsClient};
use crate::support::TestApp;
use keygate::partition::{encode_key, partition_of_tokens};

const PARTITIONS: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

async fn setup(app: &TestApp, group: Value) {
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":PARTITIONS})).await;
    let (status, view) = app.put("/v1/streams/ORDERS/groups/g", group).await;
    assert_eq!(status, 201, "{view}");
}

/// A group ordered by partition, what these tests pin down (key ordering
/// has its own tests in `key_order.rs`).
fn static_group(ack_wait_ms: u64) -> Value {
    json!({"kind":"static","partitions":PARTITIONS,"members":["m1"],"ack_wait_ms":ack_wait_ms,"ordering":"partition"})
}

/// Publishes keyed messages `(key, n)`; returns their sequences in order.
async fn publish(app: &TestApp, messages: &[(&str, u64)]) -> Vec<u64> {
    let body: Vec<Value> = messages.iter().map(|(k, n)| json!({"key": k, "data": {"n": n}})).collect();
    let (status, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": body})).await;
    assert_eq!(status, 200, "{acks}");
    acks["results"].as_array().unwrap().iter().map(|a| a["seq"].as_u64().unwrap()).collect()
}

fn partition_of(key: &str) -> u64 {
    u64::from(partition_of_tokens([encode_key(key).unwrap().as_str()], PARTITIONS))
}

/// A connection of member m1, after its `assigned` frame. The server pins
/// a client with the first message it delivers, so `pinned` comes then.
async fn member_client(app: &TestApp, query: &str) -> WsClient {
    let mut client = WsClient::connect(&member_url(&app.base, "ORDERS", "g", "m1", query)).await;
    client.next_of("assigned", WAIT).await;
    client
}

#[tokio::test]
async fn messages_arrive_in_key_order_with_every_field_one_in_flight_per_partition() {
    let app = TestApp::start().await;
    setup(&app, static_group(5000)).await;
    let mut client = WsClient::connect(&member_url(&app.base, "ORDERS", "g", "m1", "")).await;
    let assigned = client.next_of("assigned", WAIT).await;
    assert_eq!(assigned["partitions"], json!([0, 1, 2, 3]));
    let keys = ["alice", "bob", "carol", "dave", "erin", "frank"];
    let messages: Vec<(&str, u64)> = (0..60).map(|n| (keys[n as usize % keys.len()], n)).collect();
    publish(&app, &messages).await;
    let pinned = client.next_of("pinned", WAIT).await;
    assert!(pinned["fencing_token"].as_u64().unwrap() >= 1, "{pinned}");
    assert_eq!(pinned["partitions"], json!([0, 1, 2, 3]));
    // Read everything the server offers before acking: only one message per
    // partition may be in flight.
    let mut last_n: HashMap<String, u64> = HashMap::new();
    let mut received = 0;
    while received < messages.len() {
        let mut batch = Vec::new();
        while let Some(frame) = client.maybe_message(Duration::from_millis(300)).await {
            batch.push(frame);
        }
        assert!(!batch.is_empty(), "stalled after {received}");
        let mut partitions: Vec<u64> = batch.iter().map(|f| f["partition"].as_u64().unwrap()).collect();
        partitions.sort_unstable();
        let before = partitions.len();
        partitions.dedup();
        assert_eq!(before, partitions.len(), "two messages of one partition in flight: {batch:?}");
        for frame in &batch {
            let key = frame["key"].as_str().unwrap().to_owned();
            let n = frame["data"]["n"].as_u64().unwrap();
            assert_eq!(frame["partition"].as_u64().unwrap(), partition_of(&key));
            assert!(last_n.get(&key).is_none_or(|prev| *prev < n), "{key} out of order");
            last_n.insert(key.clone(), n);
            assert_eq!(frame["subject"], format!("orders.{key}"));
            assert_eq!(frame["stream"], "ORDERS");
            assert_eq!((frame["group"].as_str(), frame["member"].as_str()), (Some("g"), Some("m1")));
            assert_eq!(frame["attempt"], 1);
            assert_eq!(frame["id"], format!("ORDERS-{}", frame["stream_seq"]));
            assert!(frame["fencing_token"].as_u64().unwrap() >= 1);
            assert!(frame["headers"].is_object());
            client.ack(&frame["id"]).await;
        }
        received += batch.len();
    }
    crate::support::eventually(WAIT, || async {
        let info = app.js.get_stream("ORDERS").await.ok()?.consumer_info("g-m1").await.ok()?;
        (info.ack_floor.stream_sequence == 60 && info.num_ack_pending == 0).then_some(())
    })
    .await;
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn non_json_payloads_come_as_base64_and_unknown_ids_are_errors() {
    let app = TestApp::start().await;
    setup(&app, static_group(5000)).await;
    let mut client = member_client(&app, "").await;
    let (status, _) = app.post("/v1/streams/ORDERS/messages", json!({"key":"k","data_base64":"AAEC"})).await;
    assert_eq!(status, 200);
    let frame = client.maybe_message(WAIT).await.unwrap();
    assert_eq!(frame["data_base64"], "AAEC");
    assert!(frame.get("data").is_none());
    client.send(json!({"type":"ack","id":"ORDERS-999"})).await;
    let error = client.next_of("error", WAIT).await;
    assert!(error["error"].as_str().unwrap().contains("ORDERS-999"), "{error}");
    client.send(json!({"type":"ack"})).await;
    assert!(client.next_of("error", WAIT).await["error"].as_str().unwrap().contains("unreadable"));
    client.ack(&frame["id"]).await;
}

#[tokio::test]
async fn a_nak_with_delay_blocks_only_its_partition_and_the_message_comes_back_first() {
    let app = TestApp::start().await;
    setup(&app, static_group(5000)).await;
    let (a, b) =
        ("alice", (0..100).map(|i| format!("other{i}")).find(|k| partition_of(k) != partition_of("alice")).unwrap());
    let mut client = member_client(&app, "").await;
    publish(&app, &[(a, 0), (a, 1), (b.as_str(), 2)]).await;
    let mut first = None;
    for _ in 0..2 {
        let frame = client.maybe_message(WAIT).await.unwrap();
        if frame["key"] == a {
            first = Some(frame);
        } else {
            client.ack(&frame["id"]).await;
        }
    }
    let first = first.expect("alice's first message");
    assert_eq!(first["data"]["n"], 0);
    let naked_at = std::time::Instant::now();
    client.send(json!({"type":"nak","id":first["id"],"delay_ms":700})).await;
    let again = client.maybe_message(WAIT).await.unwrap();
    assert_eq!(again["id"], first["id"], "the NAK'd message is not overtaken by alice's next");
    assert_eq!(again["attempt"], 2);
    assert!(naked_at.elapsed() >= Duration::from_millis(600), "came back after its delay");
    client.ack(&again["id"]).await;
    let next = client.maybe_message(WAIT).await.unwrap();
    assert_eq!((next["key"].as_str(), next["data"]["n"].as_u64()), (Some(a), Some(1)));
    client.ack(&next["id"]).await;
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn term_dead_letters_the_message_and_the_partition_proceeds() {
    let app = TestApp::start().await;
    setup(&app, static_group(5000)).await;
    let mut client = member_client(&app, "").await;
    publish(&app, &[("k", 0), ("k", 1)]).await;
    let first = client.maybe_message(WAIT).await.unwrap();
    client.send(json!({"type":"term","id":first["id"]})).await;
    let second = client.maybe_message(WAIT).await.unwrap();
    assert_eq!(second["data"]["n"], 1);
    client.ack(&second["id"]).await;
    let dead = app.stream_messages("KEYGATE_DEAD_LETTERS").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1, br#"{"n":0}"#);
    let reason = dead[0].2.as_ref().unwrap().get("keygate-reason").map(|v| v.to_string()).unwrap_or_default();
    assert!(reason.contains("terminated by the client"), "{reason}");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_slow_client_keeps_its_message_with_progress_and_is_not_redelivered() {
    let app = TestApp::start().await;
    setup(&app, static_group(1000)).await;
    let mut client = member_client(&app, "").await;
    publish(&app, &[("k", 0)]).await;
    let frame = client.maybe_message(WAIT).await.unwrap();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        client.send(json!({"type":"progress","id":frame["id"]})).await;
    }
    // 2.4 s on a 1 s ack wait: still the first delivery, never sent twice.
    assert!(client.maybe_message(Duration::from_millis(300)).await.is_none());
    assert!(!client.seen.iter().any(|f| f["type"] == "error"), "{:?}", client.seen);
    client.ack(&frame["id"]).await;
    crate::support::eventually(WAIT, || async {
        let info = app.js.get_stream("ORDERS").await.ok()?.consumer_info("g-m1").await.ok()?;
        (info.num_ack_pending == 0 && info.num_redelivered == 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_standby_connection_takes_over_in_order_when_the_pinned_one_closes() {
    let app = TestApp::start().await;
    setup(&app, static_group(2000)).await;
    let url = member_url(&app.base, "ORDERS", "g", "m1", "");
    let mut first = WsClient::connect(&url).await;
    let messages: Vec<(&str, u64)> = (0..20).map(|n| ("k", n)).collect();
    publish(&app, &messages).await;
    first.next_of("pinned", WAIT).await;
    let m0 = first.maybe_message(WAIT).await.unwrap();
    let mut second = WsClient::connect(&url).await;
    second.next_of("standby", WAIT).await;
    // The first acks one and closes with the next un-acked.
    first.ack(&m0["id"]).await;
    let m1 = first.maybe_message(WAIT).await.unwrap();
    assert_eq!(m1["data"]["n"], 1);
    first.close().await;
    second.next_of("pinned", WAIT).await;
    let again = second.maybe_message(WAIT).await.unwrap();
    assert_eq!(again["id"], m1["id"], "the un-acked message comes first");
    assert_eq!(again["attempt"], 2);
    second.ack(&again["id"]).await;
    for n in 2..20 {
        let frame = second.maybe_message(WAIT).await.unwrap();
        assert_eq!(frame["data"]["n"], n);
        second.ack(&frame["id"]).await;
    }
    assert!(second.maybe_message(Duration::from_millis(300)).await.is_none(), "nothing twice");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_reconnecting_client_resumes_from_what_it_acked() {
    let app = TestApp::start().await;
    setup(&app, static_group(2000)).await;
    publish(&app, &[("k", 0), ("k", 1), ("k", 2)]).await;
    let mut client = member_client(&app, "").await;
    let m0 = client.maybe_message(WAIT).await.unwrap();
    client.ack(&m0["id"]).await;
    let m1 = client.maybe_message(WAIT).await.unwrap();
    client.close().await;
    let mut again = member_client(&app, "").await;
    let resumed = again.maybe_message(WAIT).await.unwrap();
    assert_eq!((resumed["id"].clone(), resumed["attempt"].clone()), (m1["id"].clone(), json!(2)));
    again.ack(&resumed["id"]).await;
    let last = again.maybe_message(WAIT).await.unwrap();
    // `attempt` is the server's delivery count: a message keygate had
    // received (held behind its partition's head) counts as delivered.
    assert_eq!(last["data"]["n"], 2);
    again.ack(&last["id"]).await;
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_silent_client_is_closed_and_the_standby_takes_over() {
    let app = TestApp::start_with(|s| s.ws_ping_interval = Duration::from_millis(300)).await;
    setup(&app, static_group(2000)).await;
    let url = member_url(&app.base, "ORDERS", "g", "m1", "");
    let mut silent = WsClient::connect(&url).await;
    publish(&app, &[("k", 0)]).await;
    silent.next_of("pinned", WAIT).await;
    let mut standby = WsClient::connect(&url).await;
    // `silent` stops reading: it answers no pings, and keygate closes it.
    let frame = standby.maybe_message(Duration::from_secs(15)).await.expect("the standby took over");
    assert_eq!(frame["data"]["n"], 0);
    assert_eq!(frame["attempt"], 2, "the message the silent client held comes again");
    standby.ack(&frame["id"]).await;
    assert!(standby.seen.iter().any(|f| f["type"] == "pinned"), "{:?}", standby.seen);
    drop(silent);
}

#[tokio::test]
async fn a_client_that_stops_reading_leaves_the_backlog_in_nats() {
    let app = TestApp::start().await;
    setup(&app, static_group(5000)).await;
    let client = member_client(&app, "").await;
    let messages: Vec<(String, u64)> = (0..3000).map(|n| (format!("k{}", n % 50), n)).collect();
    for chunk in messages.chunks(1000) {
        let refs: Vec<(&str, u64)> = chunk.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        publish(&app, &refs).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let info = app.js.get_stream("ORDERS").await.unwrap().consumer_info("g-m1").await.unwrap();
    // keygate took at most what its hold cap and the consumer's
    // max_ack_pending allow; the rest waits in the stream.
    assert!(info.num_ack_pending <= 1000, "{}", info.num_ack_pending);
    assert!(info.num_pending >= 2000, "the backlog stays in NATS: {}", info.num_pending);
    drop(client);
}

#[tokio::test]
async fn websocket_members_need_a_consume_token_and_an_allowed_origin() {
    let secret = "a-test-secret-of-at-least-32-bytes!!";
    let app = TestApp::start_with(|s| {
        s.auth.hs256_secret = Some(secret.into());
        s.ws_allowed_origins = vec!["https://app.test".into()];
    })
    .await;
    let token = |scope: &str| {
        let claims = json!({"scope": scope, "exp": time::OffsetDateTime::now_utc().unix_timestamp() + 600});
        jsonwebtoken::encode(
            &jsonwebtoken::Header::default(),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let admin = token("keygate:admin");
    let put = |path: &str, body: Value| app.http.put(app.url(path)).bearer_auth(&admin).json(&body).send();
    put("/v1/streams/ORDERS", json!({"subjects":["orders.*"],"partitions":PARTITIONS})).await.unwrap();
    assert_eq!(put("/v1/streams/ORDERS/groups/g", static_group(2000)).await.unwrap().status(), 201);
    let url = |query: &str| member_url(&app.base, "ORDERS", "g", "m1", query);
    assert_eq!(WsClient::connect_with(&url(""), &[]).await.err(), Some(401));
    let other = token("consume:ORDERS/other");
    assert_eq!(WsClient::connect_with(&url(&format!("access_token={other}")), &[]).await.err(), Some(403));
    let consume = token("consume:ORDERS/g");
    let mut by_query = WsClient::connect_with(&url(&format!("access_token={consume}")), &[]).await.unwrap();
    by_query.next_of("assigned", WAIT).await;
    by_query.close().await;
    let protocols = format!("keygate.v1, bearer.{consume}");
    let mut by_protocol =
        WsClient::connect_with(&url(""), &[("sec-websocket-protocol", protocols.as_str())]).await.unwrap();
    by_protocol.next_of("assigned", WAIT).await;
    by_protocol.close().await;
    let query = format!("access_token={consume}");
    assert_eq!(WsClient::connect_with(&url(&query), &[("origin", "https://evil.test")]).await.err(), Some(403));
    assert!(WsClient::connect_with(&url(&query), &[("origin", "https://app.test")]).await.is_ok());
    // Unknown members are refused before the upgrade.
    let stranger = member_url(&app.base, "ORDERS", "g", "nobody", &query);
    assert_eq!(WsClient::connect_with(&stranger, &[]).await.err(), Some(404));
}

#[tokio::test]
async fn shutdown_closes_websocket_members_with_a_close_frame() {
    let app = TestApp::start().await;
    setup(&app, static_group(2000)).await;
    let mut client = member_client(&app, "").await;
    publish(&app, &[("k", 0)]).await;
    let frame = client.maybe_message(WAIT).await.unwrap();
    app.shutdown();
    // A delivery in flight may still be acked while keygate winds down.
    client.ack(&frame["id"]).await;
    assert_eq!(client.closed(Duration::from_secs(15)).await, Some(1001), "going away");
}

#[tokio::test]
async fn a_websocket_subscriber_of_a_plain_consumer_gets_up_to_its_concurrency_at_once() {
    let app = TestApp::start().await;
    app.create_stream("JOBS", json!({"subjects":["jobs.*"]})).await;
    assert_eq!(app.put("/v1/streams/JOBS/consumers/work", json!({"policy":"pinned_client","group":"g"})).await.0, 201);
    for n in 0..10 {
        app.js.publish(format!("jobs.{n}"), format!("{{\"n\":{n}}}").into()).await.unwrap().await.unwrap();
    }
    let base = app.base.replacen("http://", "ws://", 1);
    let url = format!("{base}/v1/streams/JOBS/consumers/work/subscribers/browser/ws?concurrency=3");
    let mut client = WsClient::connect(&url).await;
    let pinned = client.next_of("pinned", WAIT).await;
    assert!(pinned["fencing_token"].as_u64().unwrap() >= 1);
    let mut acked = 0;
    while acked < 10 {
        let mut batch = Vec::new();
        while let Some(frame) = client.maybe_message(Duration::from_millis(300)).await {
            batch.push(frame);
        }
        assert!(!batch.is_empty() && batch.len() <= 3, "at most 3 in flight: {}", batch.len());
        for frame in batch {
            assert_eq!((frame["group"].as_str(), frame["member"].as_str()), (Some("work"), Some("browser")));
            client.ack(&frame["id"]).await;
            acked += 1;
        }
    }
    crate::support::eventually(WAIT, || async {
        let info = app.js.get_stream("JOBS").await.ok()?.consumer_info("work").await.ok()?;
        (info.num_pending == 0 && info.num_ack_pending == 0).then_some(())
    })
    .await;
    // Options must fit the policy.
    let bad = format!("{base}/v1/streams/JOBS/consumers/work/subscribers/b2/ws?priority=1");
    assert_eq!(WsClient::connect_with(&bad, &[]).await.err(), Some(400));
}

#[tokio::test]
async fn the_group_view_lists_every_instance_of_a_member_pinned_first() {
    let app = TestApp::start().await;
    setup(&app, static_group(2000)).await;
    let url = member_url(&app.base, "ORDERS", "g", "m1", "");
    let mut first = WsClient::connect(&url).await;
    publish(&app, &[("k", 0)]).await;
    first.next_of("pinned", WAIT).await;
    let mut second = WsClient::connect(&url).await;
    second.next_of("assigned", WAIT).await;
    let (status, view) = app.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(status, 200);
    let instances = view["assignment"][0]["instances"].as_array().unwrap().clone();
    assert_eq!(instances.len(), 2, "{instances:?}");
    assert_eq!(instances[0]["pinned"], true, "the pinned one first: {instances:?}");
    assert_eq!(instances[1]["pinned"], false);
    assert_ne!(instances[0]["session"], instances[1]["session"]);
}
