//! keygate on a 3-node JetStream cluster with R3 streams: a static and an
//! elastic group served by webhooks through two keygate replicas, while the
//! stream leader's node and then the group bucket leader's node are killed
//! and restarted. Run it alone: `cargo nextest run --run-ignored only cluster
//! --no-capture` (`scripts/test` does, after the other tests).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::cluster::NatsCluster;
use crate::support::receiver::{assert_key_order, Answer, Receiver, Recorded};
use crate::support::{eventually, http_client, KeygateProcess};

const KEYS: u64 = 40;
/// Deliveries must resume within this time after a node is killed.
const RESUME_LIMIT: Duration = Duration::from_secs(40);
/// How often the receiver's log is read (deliveries carry their own times).
const POLL: Duration = Duration::from_millis(500);

/// (stream, key, seq) of every message a keygate answered 2xx.
type Published = Arc<Mutex<Vec<(String, String, u64)>>>;

/// Publishes small batches with message ids to both streams through both
/// keygates in turn until `stop`; a failed batch is sent again.
async fn publish_until(
    http: reqwest::Client,
    bases: Vec<String>,
    published: Published,
    unexpected: Arc<Mutex<Vec<String>>>,
    stop: Arc<Mutex<bool>>,
) {
    let mut n: u64 = 0;
    let mut turn = 0;
    while !*stop.lock().unwrap() {
        for stream in ["ORDERS", "EV"] {
            let batch: Vec<Value> = (n..n + 10)
                .map(|i| json!({"key": format!("k{}", i % KEYS), "msg_id": format!("{stream}-{i}"), "data": {"n": i}}))
                .collect();
            let mut attempts = 0;
            loop {
                turn += 1;
                attempts += 1;
                let base = &bases[turn % bases.len()];
                let answer = http
                    .post(format!("{base}/v1/streams/{stream}/messages/batch"))
                    .json(&json!({"messages": batch}))
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await;
                let body = match answer {
                    Ok(a) if a.status() == 200 => a.json::<Value>().await.unwrap_or_default(),
                    Ok(a) => {
                        // Refusals during an election are 503 problem+json;
                        // anything else is kept for the test to fail on.
                        let status = a.status().as_u16();
                        let content_type = a.headers().get("content-type").cloned();
                        let body = a.text().await.unwrap_or_default();
                        if status != 503 || content_type.is_none_or(|c| c != "application/problem+json") {
                            unexpected.lock().unwrap().push(format!("{stream}: {status} {body}"));
                        }
                        Value::Null
                    }
                    Err(_) => Value::Null,
                };
                let results: Option<Vec<(String, u64)>> = body["results"].as_array().and_then(|r| {
                    r.iter().map(|a| Some((a["key"].as_str()?.to_owned(), a["seq"].as_u64()?))).collect()
                });
                if let Some(results) = results.filter(|r| r.len() == batch.len()) {
                    published.lock().unwrap().extend(results.into_iter().map(|(k, s)| (stream.to_owned(), k, s)));
                    break;
                }
                // A minute of refusals with every node up is a failure, not an election.
                assert!(attempts < 300, "{stream}: a batch was refused for a minute; last answer: {body}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        n += 10;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the server says of the streams and the groups' consumers.
async fn server_view(cluster: &NatsCluster) -> String {
    let Ok(client) = async_nats::connect(cluster.addrs()).await else { return "no connection".into() };
    let js = async_nats::jetstream::new(client);
    let mut lines = Vec::new();
    for (stream, consumers) in [("ORDERS", &["st-s1", "st-s2"][..]), ("EV", &[][..]), ("EV-el", &["e1", "e2"][..])] {
        let Ok(mut s) = js.get_stream(stream).await else {
            lines.push(format!("{stream}: unavailable"));
            continue;
        };
        if let Ok(info) = s.info().await {
            let leader = info.cluster.as_ref().map(|c| c.leader.clone());
            let sources: Vec<String> =
                info.sources.iter().map(|s| format!("{} lag {} active {:?}", s.name, s.lag, s.active)).collect();
            lines.push(format!(
                "{stream}: {} messages, last seq {}, leader {leader:?}, sources {sources:?}",
                info.state.messages, info.state.last_sequence
            ));
        }
        for consumer in consumers {
            lines.push(match s.consumer_info(*consumer).await {
                Ok(i) => format!(
                    "  {consumer}: pending {} ack pending {} waiting {} delivered {} ack floor {} leader {:?} pins {:?}",
                    i.num_pending,
                    i.num_ack_pending,
                    i.num_waiting,
                    i.delivered.stream_sequence,
                    i.ack_floor.stream_sequence,
                    i.cluster.as_ref().map(|c| c.leader.clone()),
                    i.priority_groups.iter().map(|g| g.pinned_client_id.clone()).collect::<Vec<_>>()
                ),
                Err(e) => format!("  {consumer}: {e}"),
            });
        }
    }
    lines.join("\n")
}

/// The last lines above debug of each keygate's log: a failed run in CI,
/// whose logs stay on its machine, explains itself with them.
fn keygate_log_tails(logs: &Path) -> String {
    let mut out = String::new();
    for id in ["keygate-a", "keygate-b"] {
        let log = std::fs::read_to_string(logs.join(format!("{id}.log"))).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|l| !l.contains(" DEBUG ")).collect();
        out.push_str(&format!("{id}, last {} of {} lines above debug:\n", lines.len().min(30), lines.len()));
        for line in &lines[lines.len().saturating_sub(30)..] {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// How long after `since` every receiver path saw a 2xx-answered delivery.
async fn resumed(
    receiver: &Receiver,
    paths: &[&str],
    since: Instant,
    cluster: &NatsCluster,
    unexpected: &Mutex<Vec<String>>,
    logs: &Path,
) -> Duration {
    loop {
        let requests = receiver.requests();
        let firsts: Vec<Option<Instant>> = paths
            .iter()
            .map(|p| requests.iter().filter(|r| r.path.starts_with(p) && r.ok() && r.at > since).map(|r| r.at).min())
            .collect();
        if firsts.iter().all(Option::is_some) {
            return firsts.into_iter().flatten().max().unwrap().duration_since(since);
        }
        if since.elapsed() > RESUME_LIMIT {
            let stalled: Vec<String> = paths
                .iter()
                .zip(&firsts)
                .filter(|(_, first)| first.is_none())
                .map(|(p, _)| {
                    let last = requests.iter().filter(|r| r.path.starts_with(p)).map(|r| r.at).max();
                    format!("{p}: last delivery {:?} before the kill", last.map(|l| since.saturating_duration_since(l)))
                })
                .collect();
            panic!(
                "deliveries did not resume within {RESUME_LIMIT:?}: {stalled:?}\n{}\npublishes: {:?}\n{}",
                server_view(cluster).await,
                unexpected.lock().unwrap(),
                keygate_log_tails(logs)
            );
        }
        // The receiver's log is copied on each look: look seldom, so the
        // test does not take the CPU from the keygates it measures.
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "three nats-servers and two keygates: scripts/test runs it on its own, after the other tests"]
async fn groups_keep_being_served_while_leader_nodes_are_killed_and_restarted() {
    let mut cluster = NatsCluster::start().await;
    let http = http_client();
    // Their logs are kept for a failed run to explain itself.
    let logs = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cluster-logs");
    std::fs::create_dir_all(&logs).unwrap();
    let replicas = ["keygate-a", "keygate-b"].map(|id| {
        let log = std::fs::File::create(logs.join(format!("{id}.log"))).unwrap();
        KeygateProcess::start_logging(&cluster.urls(), id, "info,keygate=debug", &[], log.into())
    });
    for r in &replicas {
        r.wait_ready(&http).await;
    }
    let bases: Vec<String> = replicas.iter().map(|r| r.base.clone()).collect();
    let first = &replicas[0];
    let created = async |path: &str, body: Value| first.put_until_stored(&http, path, &body).await;
    created("/v1/streams/ORDERS", json!({"subjects":["orders.*"],"partitions":8,"replicas":3})).await;
    created("/v1/streams/EV", json!({"subjects":["ev.*"],"replicas":3})).await;
    let static_group = json!({"kind":"static","partitions":8,"members":["s1","s2"],"ack_wait_ms":2000});
    created("/v1/streams/ORDERS/groups/st", static_group).await;
    let elastic_group = json!({"kind":"elastic","partitions":8,"members":["e1","e2"],"ack_wait_ms":2000,
        "partitioning_filters":[{"filter":"ev.*","wildcards":[1]}]});
    created("/v1/streams/EV/groups/el", elastic_group).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    for (stream, group, member) in
        [("ORDERS", "st", "s1"), ("ORDERS", "st", "s2"), ("EV", "el", "e1"), ("EV", "el", "e2")]
    {
        let hook = json!({"url": receiver.url(&format!("/{group}/{member}"))});
        created(&format!("/v1/streams/{stream}/groups/{group}/members/{member}/webhook"), hook).await;
    }
    // Everything keygate created for R3 streams is R3, its own state too.
    let client = async_nats::connect(cluster.addrs()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    for stream in ["ORDERS", "EV", "KV_static-consumer-groups", "KV_elastic-consumer-groups", "KV_keygate-webhooks"] {
        let mut s = js.get_stream(stream).await.unwrap();
        assert_eq!(s.info().await.unwrap().config.num_replicas, 3, "{stream}");
    }

    let published: Published = Arc::default();
    let stop = Arc::new(Mutex::new(false));
    let unexpected: Arc<Mutex<Vec<String>>> = Arc::default();
    let publisher =
        tokio::spawn(publish_until(http.clone(), bases.clone(), published.clone(), unexpected.clone(), stop.clone()));
    eventually(Duration::from_secs(30), || async { (receiver.requests().len() > 200).then_some(()) }).await;

    // 1. The ORDERS stream leader's node.
    let leader = cluster.leader_of("ORDERS").await;
    let node = cluster.index_of(&leader);
    let killed = Instant::now();
    cluster.kill(node);
    println!("killed {leader}, the ORDERS leader, at {:?}", std::time::SystemTime::now());
    let after_stream_leader =
        resumed(&receiver, &["/st/", "/el/"], killed + Duration::from_millis(500), &cluster, &unexpected, &logs).await;
    println!("deliveries resumed {after_stream_leader:?} after the kill");
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.restart(node);
    cluster.wait_jetstream().await;
    // One node down at a time: the next kill waits until the restarted node
    // has caught up (a first run without this wait lost both streams' write
    // quorum for over 40 s, node-2 still catching up when node-1 died).
    cluster.wait_current(&["ORDERS", "EV", "EV-el", "KV_elastic-consumer-groups"]).await;
    println!("{leader} restarted and caught up");

    // 2. The elastic groups' bucket leader's node, with a membership edit
    //    during the outage: it applies, or fails with a clear 503.
    let leader = cluster.leader_of("KV_elastic-consumer-groups").await;
    let node = cluster.index_of(&leader);
    let killed = Instant::now();
    cluster.kill(node);
    println!("killed {leader}, the elastic groups' bucket leader");
    let drop_e2 = http.delete(format!("{}/v1/streams/EV/groups/el/members/e2", bases[1])).send().await.unwrap();
    let edit_status = drop_e2.status().as_u16();
    if edit_status != 200 {
        assert_eq!(edit_status, 503, "an edit during the outage applies or answers 503");
        let problem: Value = drop_e2.json().await.unwrap();
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()), "{problem}");
    }
    println!("dropping e2 during the outage answered {edit_status}");
    let after_bucket_leader =
        resumed(&receiver, &["/st/", "/el/"], killed + Duration::from_millis(500), &cluster, &unexpected, &logs).await;
    println!("deliveries resumed {after_bucket_leader:?} after the kill");
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.restart(node);
    cluster.wait_jetstream().await;
    if edit_status != 200 {
        let status = eventually(Duration::from_secs(30), || async {
            let r = http.delete(format!("{}/v1/streams/EV/groups/el/members/e2", bases[1])).send().await.ok()?;
            (r.status() == 200).then_some(200)
        })
        .await;
        assert_eq!(status, 200);
    }
    // The restarted node can set off a new election of the bucket's leader,
    // and reads answer a retryable 503 until it settles: retry as a client would.
    let view = eventually(Duration::from_secs(30), || async {
        let r = http.get(format!("{}/v1/streams/EV/groups/el", bases[0])).send().await.ok()?;
        if r.status() == 503 {
            return None;
        }
        assert_eq!(r.status(), 200, "reading the group after the outage");
        r.json::<Value>().await.ok()
    })
    .await;
    assert_eq!(view["members"], json!(["e1"]), "{view}");

    // Keep publishing a little with every node back, then drain.
    tokio::time::sleep(Duration::from_secs(2)).await;
    *stop.lock().unwrap() = true;
    publisher.await.unwrap();
    let unexpected = unexpected.lock().unwrap().clone();
    assert!(unexpected.is_empty(), "publishes answered other than 200 or 503 problem+json: {unexpected:?}");
    let published = published.lock().unwrap().clone();
    println!("published {}; draining", published.len());
    let drain_started = Instant::now();
    let requests = loop {
        let requests = receiver.requests();
        let acked: std::collections::HashSet<(&str, u64)> = requests
            .iter()
            .filter(|r| r.ok())
            .map(|r| (if r.path.starts_with("/st/") { "ORDERS" } else { "EV" }, r.seq()))
            .collect();
        let missing = published.iter().filter(|(stream, _, seq)| !acked.contains(&(stream.as_str(), *seq))).count();
        if missing == 0 {
            break requests;
        }
        assert!(
            drain_started.elapsed() < Duration::from_secs(90),
            "{missing} published messages not delivered\n{}",
            server_view(&cluster).await
        );
        tokio::time::sleep(POLL).await;
    };
    let drained = drain_started.elapsed();
    for (stream, prefix) in [("ORDERS", "/st/"), ("EV", "/el/")] {
        let mut by_key: HashMap<String, Vec<u64>> = HashMap::new();
        for (_, key, seq) in published.iter().filter(|(s, _, _)| s == stream) {
            by_key.entry(key.clone()).or_default().push(*seq);
        }
        let of_group: Vec<Recorded> = requests.iter().filter(|r| r.path.starts_with(prefix)).cloned().collect();
        assert_key_order(&of_group, &by_key, &[]);
    }
    for r in &replicas {
        assert_eq!(r.acks_without_verdict(&http).await, 0.0, "keygate_acks_without_verdict_total");
    }
    println!(
        "cluster: {} messages published (2xx) and all delivered in key order; deliveries resumed {:.2} s after \
         the stream leader's node was killed and {:.2} s after the group bucket leader's node was killed \
         (membership edit during the outage: {edit_status}); drained {:.1} s after publishing stopped",
        published.len(),
        after_stream_leader.as_secs_f64(),
        after_bucket_leader.as_secs_f64(),
        drained.as_secs_f64()
    );
}

/// keygate makes its buckets on a user's first command. On a just-formed
/// cluster a new R3 bucket has no leader for a moment; keygate waits for
/// it (up to 10 s) rather than answering 503, so the first group, the first
/// webhook and the first pause are stored at the first try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "three nats-servers: scripts/test runs it on its own, after the other tests"]
async fn the_first_commands_on_a_just_formed_cluster_are_stored_at_the_first_try() {
    let cluster = NatsCluster::start().await;
    let http = http_client();
    let keygate = KeygateProcess::start(&cluster.urls(), "keygate-first");
    keygate.wait_ready(&http).await;
    // The stream's own placement may still be refused while the cluster
    // forms (a 503 the client retries); what follows is keygate's state.
    keygate
        .put_until_stored(&http, "/v1/streams/FIRST", &json!({"subjects":["first.*"],"partitions":4,"replicas":3}))
        .await;
    let put = async |path: &str, body: Value| {
        let response = http.put(format!("{}{path}", keygate.base)).json(&body).send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    };
    let group = json!({"kind":"static","partitions":4,"members":["m1"]});
    let (status, body) = put("/v1/streams/FIRST/groups/g", group).await;
    assert_eq!(status, 201, "the first group: {body}");
    let (status, body) =
        put("/v1/streams/FIRST/groups/g/members/m1/webhook", json!({"url":"http://127.0.0.1:9/h"})).await;
    assert_eq!(status, 201, "the first webhook: {body}");
    let response = http
        .post(format!("{}/v1/streams/FIRST/groups/g/members/m1/pause", keygate.base))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200, "the first pause: {}", response.text().await.unwrap());
}

/// The leader of one consumer, once it has one.
async fn consumer_leader(js: &async_nats::jetstream::Context, stream: &str, consumer: &str) -> String {
    eventually(Duration::from_secs(30), || async {
        js.get_stream(stream).await.ok()?.consumer_info(consumer).await.ok()?.cluster.as_ref()?.leader.clone()
    })
    .await
}

/// A consumer leader elected while a delivery is in flight: the new leader
/// works from replicated state (keep-alives sent while no leader was there
/// went nowhere) and may give the message to another instance, whose copy
/// an ack from the old holder would settle too. So the instance that had
/// it does not settle it after the endpoint's 2xx: the message is
/// delivered again, with the same webhook-id (src/delivery/custody.rs,
/// src/nats/consumer_leaders.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "three nats-servers: scripts/test runs it on its own, after the other tests"]
async fn a_delivery_in_flight_across_a_consumer_leader_election_is_not_settled_by_the_instance_that_had_it() {
    let cluster = NatsCluster::start().await;
    let http = http_client();
    let keygate = KeygateProcess::start(&cluster.urls(), "keygate-election");
    keygate.wait_ready(&http).await;
    let stream = json!({"subjects":["elect.*"],"partitions":1,"replicas":3});
    keygate.put_until_stored(&http, "/v1/streams/ELECT", &stream).await;
    // An ack wait far longer than the delivery: nothing here is redelivered for lateness.
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":30000});
    keygate.put_until_stored(&http, "/v1/streams/ELECT/groups/g", &group).await;
    // The first attempt takes 6 s (within the webhook's timeout); the
    // election happens meanwhile.
    let receiver = Receiver::start(|_, earlier| match earlier {
        0 => Answer::ok().after(Duration::from_secs(6)),
        _ => Answer::ok(),
    })
    .await;
    let hook = json!({"url": receiver.url("/m1")});
    keygate.put_until_stored(&http, "/v1/streams/ELECT/groups/g/members/m1/webhook", &hook).await;
    let published = http
        .post(format!("{}/v1/streams/ELECT/messages", keygate.base))
        .json(&json!({"key":"k","data":{"i":1}}))
        .send()
        .await
        .unwrap();
    assert_eq!(published.status().as_u16(), 200);
    eventually(Duration::from_secs(20), || async { (!receiver.requests().is_empty()).then_some(()) }).await;

    let js = async_nats::jetstream::new(async_nats::connect(cluster.addrs()).await.unwrap());
    let before = consumer_leader(&js, "ELECT", "g-m1").await;
    let stepped: Value = js.request("CONSUMER.LEADER.STEPDOWN.ELECT.g-m1".to_owned(), &json!({})).await.unwrap();
    assert_eq!(stepped["success"], true, "{stepped}");
    assert_eq!(receiver.requests()[0].status, 0, "the first attempt was still in flight at the election");

    let attempts = eventually(Duration::from_secs(30), || async {
        let requests = receiver.requests();
        (requests.iter().filter(|r| r.ok()).count() >= 2).then_some(requests)
    })
    .await;
    let ids: Vec<Option<&str>> = attempts.iter().map(|r| r.header("webhook-id")).collect();
    assert_eq!(ids[0], ids[1], "the same message, delivered again: {ids:?}");
    assert_eq!(attempts[0].seq(), attempts[1].seq());
    assert_ne!(consumer_leader(&js, "ELECT", "g-m1").await, before, "the consumer has a new leader");
}
