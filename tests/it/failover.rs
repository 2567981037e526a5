//! Hot standby through the pin, and elastic rebalances, with messages in flight.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::receiver::{assert_key_order, Answer, Receiver, Recorded};
use crate::support::{eventually, http_client, KeygateProcess, NatsServer, TestApp};

async fn publish_batch(app: &TestApp, stream: &str, from: u64, count: u64, keys: u64) -> Vec<(String, u64)> {
    let messages: Vec<Value> =
        (from..from + count).map(|n| json!({"key": format!("k{}", n % keys), "data": {"n": n}})).collect();
    let (status, acks) = app.post(&format!("/v1/streams/{stream}/messages/batch"), json!({"messages": messages})).await;
    assert_eq!(status, 200);
    acks["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["key"].as_str().unwrap().to_owned(), a["seq"].as_u64().unwrap()))
        .collect()
}

fn by_key(published: &[(String, u64)]) -> HashMap<String, Vec<u64>> {
    let mut map: HashMap<String, Vec<u64>> = HashMap::new();
    for (k, s) in published {
        map.entry(k.clone()).or_default().push(*s);
    }
    map
}

async fn wait_all_acked(receiver: &Receiver, published: &[(String, u64)], limit: Duration) -> Vec<Recorded> {
    eventually(limit, || async {
        let requests = receiver.requests();
        let acked: std::collections::HashSet<u64> = requests.iter().filter(|r| r.ok()).map(Recorded::seq).collect();
        published.iter().all(|(_, s)| acked.contains(s)).then_some(requests)
    })
    .await
}

#[tokio::test]
async fn the_standby_takes_over_in_order_when_the_pinned_keygate_is_killed() {
    let server = NatsServer::start();
    let http = http_client();
    let mut first = KeygateProcess::start(&server.url(), "keygate-a");
    first.wait_ready(&http).await;
    // The receiver takes a while per message, so deliveries are in flight at
    // the kill: under key ordering, many of them at once, one per key.
    let receiver = Receiver::start(|_, _| Answer::ok().after(Duration::from_millis(15))).await;
    let admin = TestApp::start_on(server.url()).await;
    // Configure through the first keygate's API; it is the only instance for now.
    let api = |path: &str| format!("{}{}", first.base, path);
    let put = |path: String, body: Value| http.put(path).json(&body).send();
    assert_eq!(
        put(api("/v1/streams/ORDERS"), json!({"subjects":["orders.*"],"partitions":8})).await.unwrap().status(),
        201
    );
    let group = json!({"kind":"static","partitions":8,"members":["m1"],"ack_wait_ms":2000,"ordering":"key"});
    assert_eq!(put(api("/v1/streams/ORDERS/groups/g"), group).await.unwrap().status(), 201);
    let hook = json!({"url": receiver.url("/hook")});
    assert_eq!(put(api("/v1/streams/ORDERS/groups/g/members/m1/webhook"), hook).await.unwrap().status(), 201);
    // `admin` is a second keygate: the standby once it sees the registration.
    let mut published = publish_batch(&admin, "ORDERS", 0, 1, 40).await;
    wait_all_acked(&receiver, &published, Duration::from_secs(20)).await;
    let (_, view) = admin.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(view["assignment"][0]["serving_instance"], "keygate-a");

    let mut n = 1;
    while n < 600 {
        published.extend(publish_batch(&admin, "ORDERS", n, 50, 40).await);
        n += 50;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Kill the pinned keygate with deliveries in flight and messages held.
    eventually(Duration::from_secs(20), || async { (receiver.requests().len() > 150).then_some(()) }).await;
    let killed_at = Instant::now();
    first.kill();
    let fencing_before = receiver.requests().iter().map(Recorded::fencing).max().unwrap();
    while n < 1200 {
        published.extend(publish_batch(&admin, "ORDERS", n, 50, 40).await);
        n += 50;
    }
    let requests = wait_all_acked(&receiver, &published, Duration::from_secs(60)).await;
    let keyed = by_key(&published);
    assert_key_order(&requests, &keyed, &[]);
    let takeover =
        requests.iter().filter(|r| r.fencing() > fencing_before).map(|r| r.at).min().expect("the standby delivered");
    let failover = takeover.duration_since(killed_at);
    println!("failover: the standby delivered {:.2} s after the kill (pinned TTL 2 s)", failover.as_secs_f64());
    assert!(failover < Duration::from_secs(3), "took over within priority_timeout + 1 s: {failover:?}");
    let (_, view) = admin.get("/v1/streams/ORDERS/groups/g").await;
    assert_ne!(view["assignment"][0]["serving_instance"], "keygate-a");
    let duplicates = requests.len() - published.len();
    println!("{} messages, {} deliveries ({duplicates} redelivered after the kill)", published.len(), requests.len());
}

#[tokio::test]
async fn elastic_members_added_and_dropped_while_messages_flow_lose_nothing() {
    let app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok().after(Duration::from_millis(2))).await;
    app.create_stream("EV", json!({"subjects":["ev.*"]})).await;
    let group = json!({"kind":"elastic","partitions":8,"partitioning_filters":[{"filter":"ev.*","wildcards":[1]}],"members":["a"],"ack_wait_ms":2000,"ordering":"key"});
    let (status, _) = app.put("/v1/streams/EV/groups/g", group).await;
    assert_eq!(status, 201);
    let register = |member: &'static str| {
        let app = &app;
        let url = receiver.url(&format!("/{member}"));
        async move {
            let (status, body) =
                app.put(&format!("/v1/streams/EV/groups/g/members/{member}/webhook"), json!({"url": url})).await;
            assert_eq!(status, 201, "{body}");
        }
    };
    register("a").await;
    let mut published = Vec::new();
    let mut n = 0;
    for round in 0..30 {
        published.extend(publish_batch(&app, "EV", n, 40, 30).await);
        n += 40;
        if round == 8 {
            // keygate finds the first registration of a store within a
            // second: `a` serves before `b` shares its partitions, whatever
            // the rounds took until now.
            eventually(Duration::from_secs(20), || async {
                receiver.requests().iter().any(|r| r.path == "/a" && r.ok()).then_some(())
            })
            .await;
            let (status, _) = app.post("/v1/streams/EV/groups/g/members", json!({"members":["b"]})).await;
            assert_eq!(status, 200);
            register("b").await;
        }
        if round == 18 {
            let (status, _) = app.delete("/v1/streams/EV/groups/g/members/a").await;
            assert_eq!(status, 200);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let requests = wait_all_acked(&receiver, &published, Duration::from_secs(60)).await;
    assert_key_order(&requests, &by_key(&published), &[]);
    let served_by = |path: &str| requests.iter().filter(|r| r.path == path && r.ok()).count();
    assert!(served_by("/a") > 0 && served_by("/b") > 0, "both members served");
    let last_a = requests.iter().filter(|r| r.path == "/a").map(|r| r.at).max().unwrap();
    let last = requests.iter().map(|r| r.at).max().unwrap();
    assert!(last_a < last, "after a was dropped, b served everything");
}

#[tokio::test]
async fn sigterm_finishes_deliveries_in_flight_hands_the_pin_over_and_exits_cleanly() {
    let server = NatsServer::start();
    let http = http_client();
    let first = KeygateProcess::start(&server.url(), "keygate-a");
    first.wait_ready(&http).await;
    // Slow answers: deliveries are in flight when SIGTERM arrives.
    let receiver = Receiver::start(|_, _| Answer::ok().after(Duration::from_millis(150))).await;
    let admin = TestApp::start_on(server.url()).await;
    let api = |path: &str| format!("{}{}", first.base, path);
    let put = |path: String, body: Value| http.put(path).json(&body).send();
    put(api("/v1/streams/ORDERS"), json!({"subjects":["orders.*"],"partitions":8})).await.unwrap();
    let group = json!({"kind":"static","partitions":8,"members":["m1"],"ack_wait_ms":5000});
    assert_eq!(put(api("/v1/streams/ORDERS/groups/g"), group).await.unwrap().status(), 201);
    let hook = json!({"url": receiver.url("/hook")});
    assert_eq!(put(api("/v1/streams/ORDERS/groups/g/members/m1/webhook"), hook).await.unwrap().status(), 201);
    let mut published = publish_batch(&admin, "ORDERS", 0, 1, 40).await;
    wait_all_acked(&receiver, &published, Duration::from_secs(20)).await;
    let (_, view) = admin.get("/v1/streams/ORDERS/groups/g").await;
    assert_eq!(view["assignment"][0]["serving_instance"], "keygate-a");
    published.extend(publish_batch(&admin, "ORDERS", 1, 120, 40).await);
    eventually(Duration::from_secs(20), || async { (receiver.requests().len() > 10).then_some(()) }).await;

    let stopping = Instant::now();
    let status = first.terminate().await;
    assert!(status.success(), "keygate exits 0 on SIGTERM: {status}");
    println!("keygate stopped {:.2} s after SIGTERM", stopping.elapsed().as_secs_f64());
    let requests = wait_all_acked(&receiver, &published, Duration::from_secs(60)).await;
    assert_key_order(&requests, &by_key(&published), &[]);
    // Deliveries in flight at SIGTERM were finished and acked, not abandoned:
    // no message reached the endpoint twice.
    let mut seen = std::collections::HashSet::new();
    let repeated: Vec<u64> = requests.iter().map(Recorded::seq).filter(|s| !seen.insert(*s)).collect();
    assert!(repeated.is_empty(), "redelivered after a graceful stop: {repeated:?}");
    let (_, view) = admin.get("/v1/streams/ORDERS/groups/g").await;
    assert_ne!(view["assignment"][0]["serving_instance"], "keygate-a");
}

/// A server that restarts forgets the pulls waiting on it. keygate pulls
/// again as soon as it has reconnected, not when the forgotten pulls would
/// have ended: with an 8 s ack wait a standby's pull waits 8 s, so a
/// message published after the restart reaches the never-pinned member
/// within a few seconds only if its instance pulled again on reconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_pull_again_as_soon_as_keygate_reconnects_to_a_restarted_server() {
    let mut app = TestApp::start().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    app.create_stream("RE", json!({"subjects":["re.*"],"partitions":1})).await;
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":8000});
    assert_eq!(app.put("/v1/streams/RE/groups/g", group).await.0, 201);
    let hook = json!({"url": receiver.url("/m1")});
    assert_eq!(app.put("/v1/streams/RE/groups/g/members/m1/webhook", hook).await.0, 201);
    // No message yet, so no pin: the instance's pull waits as a standby's.
    eventually(Duration::from_secs(10), || async {
        let info = app.js.get_stream("RE").await.ok()?.consumer_info("g-m1").await.ok()?;
        (info.num_waiting > 0).then_some(())
    })
    .await;
    let server = app.nats_server.as_mut().unwrap();
    tokio::task::block_in_place(|| server.restart());
    let restarted = Instant::now();
    eventually(Duration::from_secs(10), || async {
        let (status, _) = app.post("/v1/streams/RE/messages", json!({"key":"k","data":1})).await;
        (status == 200).then_some(())
    })
    .await;
    eventually(Duration::from_secs(15), || async { receiver.requests().iter().any(Recorded::ok).then_some(()) }).await;
    let took = restarted.elapsed();
    println!("delivered {:.2} s after the server restarted", took.as_secs_f64());
    assert!(took < Duration::from_secs(4), "the instance waited for its forgotten pull to end: {took:?}");
}

/// A member's consumer can go while no pull of keygate's waits on it, so
/// no "consumer deleted" reaches keygate: an elastic member's consumer is
/// deleted by the server after ack wait without pulls, as happens when its
/// leader's node dies and the new leader hears from nobody in time (the
/// cluster test saw both of a group's consumers go that way). The pulls
/// that follow meet no responders; keygate looks the consumer up, finds it
/// gone and joins again, which creates it again. Here the deletion's
/// notice is held back at a proxy and lost with the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_consumer_deleted_unheard_is_created_again() {
    use crate::support::proxy::CuttableProxy;
    let server = NatsServer::start();
    let proxy = CuttableProxy::start(format!("127.0.0.1:{}", server.port)).await;
    let app = TestApp::start_through(server, proxy.url()).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    app.create_stream("EV", json!({"subjects":["ev.*"]})).await;
    let group = json!({"kind":"elastic","partitions":2,"members":["e1"],"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/EV/groups/g", group).await.0, 201);
    let hook = json!({"url": receiver.url("/e1")});
    assert_eq!(app.put("/v1/streams/EV/groups/g/members/e1/webhook", hook).await.0, 201);
    assert_eq!(app.post("/v1/streams/EV/messages", json!({"key":"k","data":1})).await.0, 200);
    eventually(Duration::from_secs(15), || async { receiver.requests().iter().any(Recorded::ok).then_some(()) }).await;

    proxy.hold_server_bytes();
    app.js.get_stream("EV-g").await.unwrap().delete_consumer("e1").await.unwrap();
    proxy.cut();
    let deleted = Instant::now();
    eventually(Duration::from_secs(10), || async {
        let (status, _) = app.post("/v1/streams/EV/messages", json!({"key":"k","data":2})).await;
        (status == 200).then_some(())
    })
    .await;
    eventually(Duration::from_secs(20), || async {
        (receiver.requests().iter().filter(|r| r.ok()).count() >= 2).then_some(())
    })
    .await;
    println!("delivered again {:.2} s after the consumer was deleted", deleted.elapsed().as_secs_f64());
    let consumer = app.js.get_stream("EV-g").await.unwrap().consumer_info("e1").await;
    assert!(consumer.is_ok(), "the member's consumer was created again: {consumer:?}");
}
