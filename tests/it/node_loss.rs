//! Nothing acknowledged is lost when NATS nodes and keygate replicas die
//! under load (docs/guarantees.md). The operator's scenario that once lost
//! messages: a 3-node cluster, an R3 stream of 8 partitions, a static group
//! of two webhook members served by two keygate replicas given every seed
//! URL, keyed batches with message ids (refused items sent again with the
//! same ids), and in turn: keygate A SIGKILLed and restarted, the stream
//! leader's node SIGKILLed and restarted (with
//! `KEYGATE_NODE_LOSS_OUTPUTS_LEADER` set, made the leader of PAYMENTS, the
//! first stage's outputs' stream, too), keygate B SIGKILLed and
//! restarted, a follower node SIGKILLed and restarted.
//!
//! The group is the first stage of a pipeline (docs/pipelines.md): its
//! members' answers publish each message on to an R3 PAYMENTS stream, whose
//! group's answers publish it to an R3 LEDGER; the first attempt of every
//! 97th (89th) message is answered 503 with Retry-After.
//!
//! Checked from the receiver's side: every message answered 2xx to the
//! publisher reached its endpoint with a 2xx, first deliveries of each key
//! come in stream order, and no keygate acked anything without a verdict;
//! and at the pipeline's end LEDGER holds each message exactly once, in
//! each key's order.
//! The loss showed in about 2 runs of 5, so the test command runs it 4
//! times (a fifth took CI past its 25 minutes); `KEYGATE_NODE_LOSS_RUNS`
//! sets the count (20 by hand), and the
//! replicas' logs land in the test's target tmpdir (`node-loss-logs/`).
//! Run it alone: `cargo nextest run --run-ignored only node_loss --no-capture`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::pipeline_stages::{self, LEDGER, PAYMENTS};
use crate::support::cluster::NatsCluster;
use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::{eventually, http_client, KeygateProcess};

const KEYS: u64 = 100;
const BATCH: u64 = 50;
const PARTITIONS: u32 = 8;
/// Pause between batches.
const BATCH_EVERY: Duration = Duration::from_millis(60);
/// Every published message must reach its endpoint within this time after
/// publishing stops (redeliveries wait out the group's 2 s ack wait).
const DRAIN_LIMIT: Duration = Duration::from_secs(150);

/// (key, seq) of every message answered 2xx.
type Published = Arc<Mutex<Vec<(String, u64)>>>;

/// keygate replicas by slot; `None` while one is down.
type Alive = Arc<Mutex<Vec<Option<String>>>>;

/// Keyed batches of 50 over 100 keys, with message ids, through whichever
/// replica is up; items refused are sent again (same ids) until stored.
async fn publish_until(http: reqwest::Client, alive: Alive, published: Published, stop: Arc<AtomicBool>) {
    let mut next: u64 = 0;
    let mut turn = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let mut pending: Vec<Value> = (next..next + BATCH)
            .map(|i| json!({"key": format!("key-{:03}", i % KEYS), "msg_id": format!("m-{i}"), "data": {"i": i}}))
            .collect();
        next += BATCH;
        while !pending.is_empty() {
            turn += 1;
            let base = {
                let alive = alive.lock().unwrap();
                let up: Vec<&String> = alive.iter().flatten().collect();
                (!up.is_empty()).then(|| up[turn % up.len()].clone())
            };
            let Some(base) = base else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let answer = http
                .post(format!("{base}/v1/streams/ORD/messages/batch"))
                .json(&json!({"messages": pending}))
                .timeout(Duration::from_secs(10))
                .send()
                .await;
            let body = match answer {
                Ok(a) if a.status() == 200 => a.json::<Value>().await.unwrap_or_default(),
                _ => Value::Null,
            };
            let Some(results) = body["results"].as_array().filter(|r| r.len() == pending.len()) else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mut refused = Vec::new();
            for (item, result) in pending.iter().zip(results) {
                match result["seq"].as_u64() {
                    Some(seq) => published.lock().unwrap().push((item["key"].as_str().unwrap().to_owned(), seq)),
                    None => refused.push(item.clone()),
                }
            }
            pending = refused;
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // About 1,250 messages a second, the rate the loss was seen at.
        tokio::time::sleep(BATCH_EVERY).await;
    }
}

/// Any replica that is up.
fn base_of(alive: &Alive) -> String {
    alive.lock().unwrap().iter().flatten().next().cloned().expect("a replica is up")
}

/// Asks the server to move a stream's or consumer's leader to `node` (or,
/// `None`, anywhere else); a refusal is fine, the caller checks the result.
async fn step_down(js: &async_nats::jetstream::Context, api: &str, node: Option<&str>) {
    let body = match node {
        Some(node) => json!({"placement": {"preferred": node}}),
        None => json!({}),
    };
    let _: Result<Value, _> = js.request(api.to_owned(), &body).await;
}

/// The node that m1's serving replica is connected to, after making it the
/// leader of both members' consumers and not the stream's leader.
async fn worst_follower(cluster: &NatsCluster, http: &reqwest::Client, base: &str) -> usize {
    let view: Value =
        http.get(format!("{base}/v1/streams/ORD/groups/enrich")).send().await.unwrap().json().await.unwrap();
    let serving = view["assignment"][0]["serving_instance"].as_str().unwrap_or("keygate-a").to_owned();
    let node = cluster.node_serving(&format!("keygate {serving}")).await.unwrap_or(0);
    let name = cluster.nodes[node].name.clone();
    let client = async_nats::connect(cluster.addrs()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    for _ in 0..5 {
        if cluster.leader_of("ORD").await == name {
            step_down(&js, "STREAM.LEADER.STEPDOWN.ORD", None).await;
        }
        for consumer in ["enrich-m1", "enrich-m2"] {
            let leader = async {
                let s = js.get_stream("ORD").await.ok()?;
                s.consumer_info(consumer).await.ok()?.cluster.as_ref()?.leader.clone()
            };
            if leader.await.as_deref() != Some(name.as_str()) {
                step_down(&js, &format!("CONSUMER.LEADER.STEPDOWN.ORD.{consumer}"), Some(&name)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!("killing {name}, the node {serving} is connected to");
    node
}

/// What the server says of the stream and the members' consumers.
async fn server_view(cluster: &NatsCluster) -> String {
    let Ok(client) = async_nats::connect(cluster.addrs()).await else { return "no connection".into() };
    let js = async_nats::jetstream::new(client);
    let Ok(mut s) = js.get_stream("ORD").await else { return "ORD unavailable".into() };
    let mut lines = Vec::new();
    if let Ok(info) = s.info().await {
        lines.push(format!("ORD: {} messages, last seq {}", info.state.messages, info.state.last_sequence));
    }
    for consumer in ["enrich-m1", "enrich-m2"] {
        if let Ok(i) = s.consumer_info(consumer).await {
            lines.push(format!(
                "  {consumer}: pending {} ack pending {} ack floor {} delivered {} pinned {:?}",
                i.num_pending,
                i.num_ack_pending,
                i.ack_floor.stream_sequence,
                i.delivered.stream_sequence,
                i.priority_groups.iter().filter_map(|g| g.pinned_client_id.clone()).collect::<Vec<_>>()
            ));
        }
    }
    lines.join("\n")
}

/// What keygate says of the first stage: its group view, with each
/// member's instances, pin status and blocked lanes (a stalled run's
/// evidence, whatever the log level).
async fn keygate_view(http: &reqwest::Client, alive: &Alive) -> String {
    let url = format!("{}/v1/streams/ORD/groups/enrich", base_of(alive));
    match http.get(url).send().await {
        Ok(answer) => answer.text().await.unwrap_or_default(),
        Err(e) => format!("no group view: {e}"),
    }
}

/// The key a delivery was published with, from its body (`{"i": n}` is
/// key `key-{n % KEYS}`), so the check does not rest on keygate's header.
fn key_of(r: &Recorded) -> String {
    let i = serde_json::from_slice::<Value>(&r.body).ok().and_then(|b| b["i"].as_u64()).expect("a published body");
    format!("key-{:03}", i % KEYS)
}

/// Every key's first deliveries came in stream order, and each came only
/// after every earlier message of its key was answered 2xx.
fn assert_first_deliveries_in_key_order(requests: &[Recorded], published: &[(String, u64)]) {
    let mut first_ack: HashMap<u64, Instant> = HashMap::new();
    for r in requests.iter().filter(|r| r.ok()) {
        let answered = r.answered.unwrap_or(r.at);
        first_ack.entry(r.seq()).and_modify(|t| *t = (*t).min(answered)).or_insert(answered);
    }
    let mut by_key: HashMap<&str, Vec<u64>> = HashMap::new();
    for (key, seq) in published {
        by_key.entry(key.as_str()).or_default().push(*seq);
    }
    for seqs in by_key.values_mut() {
        seqs.sort_unstable();
    }
    let mut seen: HashMap<u64, ()> = HashMap::new();
    let mut last_first: HashMap<String, u64> = HashMap::new();
    for r in requests {
        let (key, seq) = (key_of(r), r.seq());
        assert_eq!(r.key(), key, "seq {seq}: the keygate-key header");
        if seen.insert(seq, ()).is_some() {
            continue;
        }
        if let Some(&previous) = last_first.get(&key) {
            assert!(seq > previous, "key {key}: seq {seq} first delivered after seq {previous}");
        }
        last_first.insert(key.clone(), seq);
        for earlier in by_key.get(key.as_str()).into_iter().flatten().take_while(|s| **s < seq) {
            let acked = first_ack.get(earlier).is_some_and(|t| *t <= r.at);
            assert!(acked, "key {key}: seq {seq} delivered before seq {earlier} was answered 2xx");
        }
    }
}

/// One run of the scenario; panics on a lost or reordered message.
async fn one_run(run: usize) {
    let mut cluster = NatsCluster::start().await;
    let urls = cluster.urls();
    let http = http_client();
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("node-loss-logs");
    std::fs::create_dir_all(&logs).unwrap();
    // `KEYGATE_NODE_LOSS_LOG` sets the replicas' log filter for a run by hand
    // (e.g. `info,keygate::runtime=debug` shows the barrier and custody).
    let log_filter = std::env::var("KEYGATE_NODE_LOSS_LOG").unwrap_or_else(|_| "info".into());
    let start = |id: &str| {
        let log = std::fs::File::create(logs.join(format!("run{run}-{id}-{}.log", rand::random::<u16>()))).unwrap();
        KeygateProcess::start_logging(&urls, id, &log_filter, &[], log.into())
    };
    let mut replicas = vec![start("keygate-a"), start("keygate-b")];
    for r in &replicas {
        r.wait_ready(&http).await;
    }
    let first = &replicas[0];
    first
        .put_until_stored(&http, "/v1/streams/ORD", &json!({"subjects":["ord.*"],"partitions":PARTITIONS,"replicas":3}))
        .await;
    for (stream, subject) in [(PAYMENTS, "payments.*"), (LEDGER, "ledger.*")] {
        let body = json!({"subjects":[subject],"partitions":PARTITIONS,"replicas":3,
            "duplicate_window_ms":pipeline_stages::WINDOW_MS});
        first.put_until_stored(&http, &format!("/v1/streams/{stream}"), &body).await;
    }
    // The group on ORD is the first stage of a pipeline (docs/pipelines.md):
    // its answers publish to PAYMENTS, whose group's answers publish to LEDGER.
    let receiver = Receiver::start(pipeline_stages::answer(Duration::ZERO, (97, 89))).await;
    for (stream, group, output) in [("ORD", "enrich", PAYMENTS), (PAYMENTS, "charge", LEDGER)] {
        let body = json!({"kind":"static","partitions":PARTITIONS,"members":["m1","m2"],"ack_wait_ms":2000});
        first.put_until_stored(&http, &format!("/v1/streams/{stream}/groups/{group}"), &body).await;
        for member in ["m1", "m2"] {
            let hook = pipeline_stages::registration(receiver.url(&format!("/{group}/{member}")), output);
            let path = format!("/v1/streams/{stream}/groups/{group}/members/{member}/webhook");
            first.put_until_stored(&http, &path, &hook).await;
        }
    }

    let alive: Alive = Arc::new(Mutex::new(replicas.iter().map(|r| Some(r.base.clone())).collect()));
    let published: Published = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = tokio::spawn(publish_until(http.clone(), alive.clone(), published.clone(), stop.clone()));
    eventually(Duration::from_secs(30), || async { (receiver.requests().len() > 500).then_some(()) }).await;

    let mut breaches = 0.0;
    let mut gaps = 0.0;
    let mut replace = async |replicas: &mut Vec<KeygateProcess>, slot: usize, down_for: Duration| {
        breaches += replicas[slot].acks_without_verdict(&http).await;
        gaps += replicas[slot].metric(&http, "keygate_delivery_gaps_total").await;
        alive.lock().unwrap()[slot] = None;
        replicas[slot].kill();
        tokio::time::sleep(down_for).await;
        replicas[slot] = start(["keygate-a", "keygate-b"][slot]);
        replicas[slot].wait_ready(&http).await;
        alive.lock().unwrap()[slot] = Some(replicas[slot].base.clone());
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    replace(&mut replicas, 0, Duration::from_secs(2)).await;

    // With `KEYGATE_NODE_LOSS_OUTPUTS_LEADER` set, the outputs' target
    // stream loses its leader in the same kill: PAYMENTS' leader is moved
    // to ORD's leader's node first. Not yet in the test command: one run of
    // twenty-nine by hand stalled (a member's consumer at its 1,000
    // ack-pending limit for the whole drain), and its cause is not found yet;
    // a stall now prints keygate's view of the group beside the server's.
    let leader_name = cluster.leader_of("ORD").await;
    let js = async_nats::jetstream::new(async_nats::connect(cluster.addrs()).await.unwrap());
    let move_outputs_leader = std::env::var_os("KEYGATE_NODE_LOSS_OUTPUTS_LEADER").is_some();
    for _ in 0..5 {
        if !move_outputs_leader || cluster.leader_of(PAYMENTS).await == leader_name {
            break;
        }
        step_down(&js, &format!("STREAM.LEADER.STEPDOWN.{PAYMENTS}"), Some(&leader_name)).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let outputs_too = cluster.leader_of(PAYMENTS).await == leader_name;
    println!("killing {leader_name}, the leader of ORD{}", if outputs_too { " and of PAYMENTS" } else { "" });
    let leader = cluster.index_of(&leader_name);
    cluster.kill(leader);
    tokio::time::sleep(Duration::from_secs(6)).await;
    cluster.restart(leader);
    cluster.wait_jetstream().await;

    tokio::time::sleep(Duration::from_secs(2)).await;
    replace(&mut replicas, 1, Duration::from_secs(1)).await;

    // The worst follower to lose: the node m1's serving replica is
    // connected to, made the leader of both members' consumers while the
    // stream's leader sits elsewhere. Deliveries in that node's buffers die
    // with it, counted as delivered by the consumer's replicated state.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let follower = worst_follower(&cluster, &http, &base_of(&alive)).await;
    cluster.kill(follower);
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.restart(follower);
    cluster.wait_jetstream().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    publisher.await.unwrap();
    let published = published.lock().unwrap().clone();

    let drain_started = Instant::now();
    let nats = async_nats::ConnectOptions::new().connect(cluster.addrs()).await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let requests = loop {
        let requests: Vec<Recorded> =
            receiver.requests().into_iter().filter(|r| r.path.starts_with("/enrich")).collect();
        let delivered: std::collections::HashSet<u64> = requests.iter().filter(|r| r.ok()).map(Recorded::seq).collect();
        let missing: BTreeMap<u64, &str> =
            published.iter().filter(|(_, s)| !delivered.contains(s)).map(|(k, s)| (*s, k.as_str())).collect();
        let in_ledger = match js.get_stream(LEDGER).await {
            Ok(mut ledger) => ledger.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        };
        if missing.is_empty() && in_ledger >= published.len() as u64 {
            break requests;
        }
        assert!(
            drain_started.elapsed() < DRAIN_LIMIT,
            "run {run}: {} messages answered 2xx to the publisher never reached their endpoint with a 2xx \
             (first: {:?}); LEDGER holds {in_ledger} of {}\n{}\nkeygate's view of enrich: {}",
            missing.len(),
            missing.iter().take(10).collect::<Vec<_>>(),
            published.len(),
            server_view(&cluster).await,
            keygate_view(&http, &alive).await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_first_deliveries_in_key_order(&requests, &published);
    let mut by_key: HashMap<String, Vec<u64>> = HashMap::new();
    for (key, seq) in &published {
        by_key.entry(key.clone()).or_default().push(*seq);
    }
    for seqs in by_key.values_mut() {
        seqs.sort_unstable();
    }
    let in_ledger = match pipeline_stages::check_stage_outputs(&js, &by_key).await {
        Ok((in_ledger, _)) => in_ledger,
        Err(misordered) => {
            let all = receiver.requests();
            let history = pipeline_stages::key_history(&misordered.key, &all, &Default::default(), &[]);
            panic!("run {run}: {misordered}; the key's history:\n{history}")
        }
    };
    for r in &replicas {
        breaches += r.acks_without_verdict(&http).await;
        gaps += r.metric(&http, "keygate_delivery_gaps_total").await;
    }
    assert_eq!(breaches, 0.0, "run {run}: keygate_acks_without_verdict_total");
    let duplicates = requests.iter().filter(|r| r.ok()).count() - published.len();
    println!(
        "node loss run {run}: {} messages published (2xx), all delivered in key order; {duplicates} duplicate \
         deliveries; {gaps} delivery gaps held by the barrier; LEDGER holds each of {in_ledger} orders once, in key \
         order; drained {:.1} s after publishing stopped",
        published.len(),
        drain_started.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "three nats-servers and two keygates, several runs: scripts/test runs it on its own"]
async fn nothing_acknowledged_is_lost_when_nats_nodes_and_replicas_are_killed_under_load() {
    let runs: usize = std::env::var("KEYGATE_NODE_LOSS_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    for run in 1..=runs {
        one_run(run).await;
    }
}

/// keygate reaching its nats-server through a proxy that can hold back and
/// cut what the server sends; a one-partition stream `LOSS` and a static
/// group `g` of `m1`.
async fn behind_a_cuttable_proxy() -> (crate::support::TestApp, crate::support::proxy::CuttableProxy) {
    use crate::support::proxy::CuttableProxy;
    use crate::support::{NatsServer, TestApp};
    let server = NatsServer::start();
    let proxy = CuttableProxy::start(format!("127.0.0.1:{}", server.url().rsplit(':').next().unwrap())).await;
    let app = TestApp::start_through(server, proxy.url()).await;
    app.create_stream("LOSS", json!({"subjects":["loss.*"],"partitions":1})).await;
    // An ack wait long enough that the newer messages are pulled (after the
    // open pulls expire, at half of it) well before the lost ones return.
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":8000});
    assert_eq!(app.put("/v1/streams/LOSS/groups/g", group).await.0, 201);
    (app, proxy)
}

/// Waits until the server counts every message up to `last` as delivered
/// to `g-m1` (asked straight, past the proxy): only then are they in the
/// held bytes that the cut throws away, which is the path under test.
async fn until_the_server_has_sent(app: &crate::support::TestApp, last: u64) {
    eventually(Duration::from_secs(15), || async {
        let info = app.js.get_stream("LOSS").await.ok()?.consumer_info("g-m1").await.ok()?;
        (info.delivered.stream_sequence >= last).then_some(())
    })
    .await;
}

/// Publishes `{"i": i}` on key `k` of `LOSS` (straight to the server, past
/// the proxy); its stream sequence.
async fn publish_loss(app: &crate::support::TestApp, i: u64) -> u64 {
    let ack = app.js.publish("loss.k", serde_json::to_vec(&json!({"i": i})).unwrap().into()).await.unwrap();
    ack.await.unwrap().sequence
}

/// The exact path that lost messages, on one server and on cue: the server
/// sends messages to the pinned instance's open pulls, counts them as
/// delivered, and the bytes die with the connection (a proxy holds them
/// back, then cuts). The instance reconnects within the pin's TTL, keeps
/// the pin, and pulls newer messages of the same key, whose delivery
/// sequence jumps. Those must wait, and the lost ones, redelivered after
/// the ack wait, must reach the endpoint first: never be taken for
/// redeliveries of settled messages and acked unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_lost_with_the_connection_reach_the_endpoint_first_when_they_come_back() {
    let (app, proxy) = behind_a_cuttable_proxy().await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/m1")});
    assert_eq!(app.put("/v1/streams/LOSS/groups/g/members/m1/webhook", hook).await.0, 201);
    let publish = |i: u64| publish_loss(&app, i);
    let mut published = Vec::new();
    for i in 0..5 {
        published.push(publish(i).await);
    }
    let delivered = |n: usize| {
        let receiver = &receiver;
        async move { (receiver.requests().iter().filter(|r| r.ok()).count() >= n).then_some(()) }
    };
    eventually(Duration::from_secs(20), || delivered(5)).await;

    // Sent by the server to the pinned instance's open pulls, never received.
    proxy.hold_server_bytes();
    let mut lost = Vec::new();
    for i in 5..10 {
        lost.push(publish(i).await);
    }
    until_the_server_has_sent(&app, *lost.last().unwrap()).await;
    proxy.cut();
    // Newer messages of the same key, pulled after the reconnect.
    let mut newer = Vec::new();
    for i in 10..15 {
        newer.push(publish(i).await);
    }
    published.extend(&lost);
    published.extend(&newer);

    let all_delivered = eventually(Duration::from_secs(20), || async {
        let requests = receiver.requests();
        let ok: std::collections::HashSet<u64> = requests.iter().filter(|r| r.ok()).map(Recorded::seq).collect();
        published.iter().all(|s| ok.contains(s)).then_some(requests)
    })
    .await;
    let firsts: Vec<u64> = {
        let mut seen = std::collections::HashSet::new();
        all_delivered.iter().map(Recorded::seq).filter(|s| seen.insert(*s)).collect()
    };
    assert_eq!(firsts, published, "first deliveries in stream order (lost: {lost:?}, newer: {newer:?})");
    assert!(app.metric("keygate_delivery_gaps_total").await >= 1.0, "the jump in delivery sequence was seen");
    app.assert_no_acks_without_verdict().await;
}

/// The same path for a WebSocket member, which shares the session's intake
/// and lanes: deliveries lost with keygate's NATS connection reach the
/// client before the newer messages of their key, and nothing is acked
/// that the client did not ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_member_gets_deliveries_lost_with_the_connection_first_when_they_come_back() {
    use crate::support::ws::{member_url, WsClient};

    let (app, proxy) = behind_a_cuttable_proxy().await;
    let mut client = WsClient::connect(&member_url(&app.base, "LOSS", "g", "m1", "")).await;
    client.next_of("assigned", Duration::from_secs(10)).await;
    let publish = |i: u64| publish_loss(&app, i);
    let mut published = Vec::new();
    for i in 0..3 {
        published.push(publish(i).await);
    }
    let mut firsts = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut take = async |client: &mut WsClient, firsts: &mut Vec<u64>, until: usize| {
        while seen.len() < until {
            let message = client.next_of("message", Duration::from_secs(30)).await;
            let seq = message["stream_seq"].as_u64().unwrap();
            if seen.insert(seq) {
                firsts.push(seq);
            }
            client.ack(&message["id"]).await;
        }
    };
    take(&mut client, &mut firsts, 3).await;
    proxy.hold_server_bytes();
    let mut lost = Vec::new();
    for i in 3..6 {
        lost.push(publish(i).await);
    }
    until_the_server_has_sent(&app, *lost.last().unwrap()).await;
    proxy.cut();
    let mut newer = Vec::new();
    for i in 6..9 {
        newer.push(publish(i).await);
    }
    published.extend(&lost);
    published.extend(&newer);
    take(&mut client, &mut firsts, published.len()).await;
    assert_eq!(firsts, published, "first deliveries in stream order (lost: {lost:?}, newer: {newer:?})");
    assert!(app.metric("keygate_delivery_gaps_total").await >= 1.0, "the jump in delivery sequence was seen");
    app.assert_no_acks_without_verdict().await;
}

/// A batch stores each key's messages in request order even when the
/// stream's leader is killed in the middle of it: after one item of a key
/// fails, no later item of that key in the batch is stored before it. Read
/// back from the stream: per (batch, key), the stored items are a prefix of
/// the request, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "three nats-servers: scripts/test runs it on its own"]
async fn batches_store_each_keys_messages_in_request_order_while_the_leader_is_killed() {
    let mut cluster = NatsCluster::start().await;
    let http = http_client();
    let keygate = KeygateProcess::start(&cluster.urls(), "keygate-order");
    keygate.wait_ready(&http).await;
    let base = keygate.base.clone();
    let stream = json!({"subjects":["bo.*"],"partitions":4,"replicas":3});
    keygate.put_until_stored(&http, "/v1/streams/BO", &stream).await;
    let stop = Arc::new(AtomicBool::new(false));
    // Items stored, items refused, and the slowest batch answer.
    let outcomes: Arc<Mutex<(usize, usize, Duration)>> = Arc::default();
    let publisher = {
        let (http, base, stop, outcomes) = (http.clone(), base.clone(), stop.clone(), outcomes.clone());
        tokio::spawn(async move {
            let mut batch = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // 20 keys × 10 items each, interleaved.
                let messages: Vec<Value> = (0..200u64)
                    .map(|n| {
                        json!({"key": format!("k{}", n % 20), "msg_id": format!("b{batch}-{n}"),
                        "data": {"batch": batch, "key": n % 20, "i": n / 20}})
                    })
                    .collect();
                let sent = Instant::now();
                let answer = http
                    .post(format!("{base}/v1/streams/BO/messages/batch"))
                    .json(&json!({"messages": messages}))
                    .timeout(Duration::from_secs(20))
                    .send()
                    .await;
                if let Ok(answer) = answer {
                    if let Ok(body) = answer.json::<Value>().await {
                        let results = body["results"].as_array().cloned().unwrap_or_default();
                        let stored = results.iter().filter(|r| r["seq"].is_u64()).count();
                        let mut o = outcomes.lock().unwrap();
                        o.0 += stored;
                        o.1 += results.len() - stored;
                        o.2 = o.2.max(sent.elapsed());
                    }
                }
                batch += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let leader = cluster.index_of(&cluster.leader_of("BO").await);
    cluster.kill(leader);
    tokio::time::sleep(Duration::from_secs(6)).await;
    cluster.restart(leader);
    cluster.wait_jetstream().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    publisher.await.unwrap();

    let client = async_nats::connect(cluster.addrs()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream("BO").await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut stored: BTreeMap<(u64, u64), Vec<u64>> = BTreeMap::new();
    for seq in 1..=last {
        let Ok(message) = stream.get_raw_message(seq).await else { continue };
        let data: Value = serde_json::from_slice(&message.payload).unwrap();
        let (batch, key, i) =
            (data["batch"].as_u64().unwrap(), data["key"].as_u64().unwrap(), data["i"].as_u64().unwrap());
        stored.entry((batch, key)).or_default().push(i);
    }
    for ((batch, key), items) in &stored {
        let prefix: Vec<u64> = (0..items.len() as u64).collect();
        assert_eq!(items, &prefix, "batch {batch} key k{key}: stored out of request order");
    }
    let (ok, refused, slowest) = *outcomes.lock().unwrap();
    println!(
        "batch order: {} batches, {ok} items stored and {refused} refused across a leader kill (slowest batch \
         {slowest:?}); every key's stored items are a prefix of its request, in order",
        stored.keys().map(|(b, _)| b).collect::<std::collections::BTreeSet<_>>().len()
    );
    assert!(ok > 0, "batches were stored");
    // Whether the kill met a batch in flight depends on the election: on
    // loopback it can be over between two batches (seen: slowest 34 ms), so
    // it is reported, not asserted; the order check above holds either way.
}

/// What `DeliveryGaps` rests on (docs/pcgroups-compatibility.md): the server numbers
/// every delivery of a consumer, redeliveries included, one after another.
#[tokio::test]
async fn the_server_numbers_redeliveries_as_new_deliveries() {
    use async_nats::jetstream::{consumer::pull, AckKind};
    use futures::StreamExt;
    let server = crate::support::NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "NUM".into(),
            subjects: vec!["num.*".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    for i in 0..3 {
        js.publish(format!("num.{i}"), "x".into()).await.unwrap().await.unwrap();
    }
    let consumer =
        stream.create_consumer(pull::Config { durable_name: Some("c".into()), ..Default::default() }).await.unwrap();
    let mut numbers = Vec::new();
    let mut messages = consumer.fetch().max_messages(3).messages().await.unwrap();
    let mut first = None;
    while let Some(message) = messages.next().await {
        let message = message.unwrap();
        let info = message.info().unwrap();
        numbers.push((info.stream_sequence, info.consumer_sequence, info.delivered));
        if first.is_none() {
            first = Some(message);
        } else {
            message.ack().await.unwrap();
        }
    }
    first.unwrap().ack_with(AckKind::Nak(None)).await.unwrap();
    let mut again = consumer.batch().max_messages(1).expires(Duration::from_secs(3)).messages().await.unwrap();
    let redelivered = again.next().await.unwrap().unwrap();
    let info = redelivered.info().unwrap();
    numbers.push((info.stream_sequence, info.consumer_sequence, info.delivered));
    assert_eq!(numbers, vec![(1, 1, 1), (2, 2, 1), (3, 3, 1), (1, 4, 2)], "(stream seq, consumer seq, delivered)");
}

/// What custody rests on (src/delivery/custody.rs): the server settles by
/// stream sequence, whichever delivery an ack answers. A holder whose copy
/// outlived the ack wait, and was redelivered, settles the redelivered copy
/// with its late ack; the new holder, which still counts that copy, would
/// then count one message too many (docs/architecture.md, "Why lanes, the
/// handover barrier and fencing tokens").
#[tokio::test]
async fn a_late_ack_of_an_outlived_copy_settles_its_redelivered_copy() {
    use async_nats::jetstream::consumer::pull;
    use futures::StreamExt;
    let server = crate::support::NatsServer::start();
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "LATE".into(),
            subjects: vec!["late.*".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    js.publish("late.k", "x".into()).await.unwrap().await.unwrap();
    let config =
        pull::Config { durable_name: Some("c".into()), ack_wait: Duration::from_secs(1), ..Default::default() };
    let mut consumer = stream.create_consumer(config).await.unwrap();
    let next = |consumer: &async_nats::jetstream::consumer::PullConsumer| {
        let consumer = consumer.clone();
        async move {
            let mut batch = consumer.batch().max_messages(1).expires(Duration::from_secs(3)).messages().await.unwrap();
            batch.next().await.unwrap().unwrap()
        }
    };
    let outlived = next(&consumer).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let redelivered = next(&consumer).await;
    assert_eq!(redelivered.info().unwrap().delivered, 2, "redelivered after the ack wait");
    assert_eq!(consumer.info().await.unwrap().num_ack_pending, 1);
    outlived.double_ack().await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(info.num_ack_pending, 0, "the outlived copy's ack settled the redelivered one");
    assert_eq!(info.ack_floor.stream_sequence, 1);
}
