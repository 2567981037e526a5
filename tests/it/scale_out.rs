//! Replicas share the work (docs/scale-out.md): webhook members' pins
//! spread over the keygate processes, follow a replica that joins or dies,
//! and singleton duties run on one replica at a time and move when it dies.
//! Keygate processes against a real nats-server.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::receiver::{assert_key_order, Answer, Receiver, Recorded};
use crate::support::{eventually, http_client, KeygateProcess, NatsServer};

const MEMBERS: usize = 12;
const SPREAD_WITHIN: Duration = Duration::from_secs(60);

/// How many of the group's members each keygate serves (by `--instance-id`),
/// once every member's pin is held by one.
async fn spread(http: &reqwest::Client, base: &str) -> Option<BTreeMap<String, usize>> {
    let view: Value = http.get(format!("{base}/v1/streams/S/groups/g")).send().await.ok()?.json().await.ok()?;
    let mut counts = BTreeMap::new();
    for member in view["assignment"].as_array()? {
        *counts.entry(member["serving_instance"].as_str()?.to_owned()).or_default() += 1;
    }
    (counts.values().sum::<usize>() == MEMBERS).then_some(counts)
}

async fn spread_until(
    http: &reqwest::Client,
    base: &str,
    what: &str,
    ok: impl Fn(&BTreeMap<String, usize>) -> bool,
) -> BTreeMap<String, usize> {
    let mut last = None;
    let found = tokio::time::timeout(SPREAD_WITHIN, async {
        loop {
            if let Some(counts) = spread(http, base).await {
                if ok(&counts) {
                    return counts;
                }
                last = Some(counts);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| panic!("{what}: the pins stayed at {last:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "cluster-scale: run with the cluster tests (scripts/test)"]
async fn pins_spread_over_replicas_follow_a_join_and_a_kill_with_nothing_lost_or_reordered() {
    let server = NatsServer::start();
    let http = http_client();
    let mut a = KeygateProcess::start(&server.url(), "kg-a");
    a.wait_ready(&http).await;
    let receiver = Receiver::start(|_, _| Answer::ok().after(Duration::from_millis(2))).await;
    let put = |url: String, body: Value| http.put(url).json(&body).send();
    let stream = json!({"subjects":["s.*"],"partitions":MEMBERS});
    assert_eq!(put(format!("{}/v1/streams/S", a.base), stream).await.unwrap().status(), 201);
    let members: Vec<String> = (0..MEMBERS).map(|i| format!("m{i}")).collect();
    let group = json!({"kind":"static","partitions":MEMBERS,"members":members,"ack_wait_ms":2000});
    assert_eq!(put(format!("{}/v1/streams/S/groups/g", a.base), group).await.unwrap().status(), 201);
    for member in &members {
        let hook = json!({"url": receiver.url(&format!("/{member}"))});
        let url = format!("{}/v1/streams/S/groups/g/members/{member}/webhook", a.base);
        assert_eq!(put(url, hook).await.unwrap().status(), 201);
    }
    // Messages flow through everything that follows, published to NATS
    // directly (pins come with the first messages; no keygate is spared).
    let publishing = Arc::new(AtomicBool::new(true));
    let publisher = {
        let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
        let publishing = publishing.clone();
        tokio::spawn(async move {
            let mut published: Vec<(String, u64)> = Vec::new();
            let mut n = 0u64;
            while publishing.load(Ordering::Relaxed) {
                let key = format!("k{}", n % 40);
                n += 1;
                if let Ok(ack) = js.publish(format!("s.{key}"), format!("{{\"n\":{n}}}").into()).await {
                    if let Ok(ack) = ack.await {
                        published.push((key, ack.sequence));
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            published
        })
    };
    let alone = spread_until(&http, &a.base, "one replica", |c| c.len() == 1).await;
    assert_eq!(alone.get("kg-a"), Some(&MEMBERS));

    // Pins gained by a rebalance say so.
    let events = async_nats::connect(server.url()).await.unwrap();
    let mut pinned_events = events.subscribe("keygate.events.S.g.*.member.pinned").await.unwrap();
    let (b, c) = (KeygateProcess::start(&server.url(), "kg-b"), KeygateProcess::start(&server.url(), "kg-c"));
    b.wait_ready(&http).await;
    c.wait_ready(&http).await;
    let three = spread_until(&http, &b.base, "three replicas", |c| c.len() == 3 && c.values().all(|n| *n == 4)).await;
    println!("three replicas: {three:?}");
    let rebalanced = tokio::time::timeout(Duration::from_secs(10), async {
        use futures::StreamExt as _;
        while let Some(message) = pinned_events.next().await {
            let event: Value = serde_json::from_slice(&message.payload).unwrap();
            if event["reason"].as_str().is_some_and(|r| r.starts_with("rebalancing")) {
                return event;
            }
        }
        panic!("the event subscription ended");
    })
    .await
    .expect("a member.pinned event with a rebalancing reason");
    assert_eq!(rebalanced["stream"], "S", "{rebalanced}");

    let d = KeygateProcess::start(&server.url(), "kg-d");
    d.wait_ready(&http).await;
    let four = spread_until(&http, &b.base, "a fourth replica", |c| {
        c.get("kg-d").is_some_and(|n| *n >= 1) && c.values().all(|n| *n <= 4)
    })
    .await;
    println!("four replicas: {four:?}");

    a.kill();
    let survivors = spread_until(&http, &b.base, "after kg-a was killed", |c| {
        !c.contains_key("kg-a") && c.values().all(|n| *n <= 4)
    })
    .await;
    println!("after the kill: {survivors:?}");

    tokio::time::sleep(Duration::from_secs(2)).await;
    publishing.store(false, Ordering::Relaxed);
    let published = publisher.await.unwrap();
    assert!(published.len() > 100, "messages flowed: {}", published.len());
    let requests: Vec<Recorded> = eventually(Duration::from_secs(60), || async {
        let requests = receiver.requests();
        let acked: std::collections::HashSet<u64> = requests.iter().filter(|r| r.ok()).map(Recorded::seq).collect();
        published.iter().all(|(_, s)| acked.contains(s)).then_some(requests)
    })
    .await;
    let mut by_key: HashMap<String, Vec<u64>> = HashMap::new();
    for (key, seq) in &published {
        by_key.entry(key.clone()).or_default().push(*seq);
    }
    assert_key_order(&requests, &by_key, &[]);
    for kg in [&b, &c, &d] {
        assert_eq!(kg.acks_without_verdict(&http).await, 0.0);
        let moves = kg.metric(&http, "keygate_pin_rebalances_total").await;
        println!("{}: {moves} rebalancing step-downs", kg.base);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn singleton_duties_run_on_one_replica_and_move_when_it_is_killed() {
    let server = NatsServer::start();
    let http = http_client();
    let mut first = KeygateProcess::start(&server.url(), "kg-1");
    first.wait_ready(&http).await;
    let second = KeygateProcess::start(&server.url(), "kg-2");
    second.wait_ready(&http).await;
    let nats = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let holder = |duty: &'static str| {
        let js = js.clone();
        async move {
            let leases = js.get_key_value("keygate-leases").await.ok()?;
            let value = leases.get(duty).await.ok()??;
            Some(String::from_utf8_lossy(&value).into_owned())
        }
    };
    for duty in ["backlog-sampler", "source-watchdog"] {
        let held = eventually(Duration::from_secs(10), || holder(duty)).await;
        assert_eq!(held, "kg-1", "{duty}: the first replica took it");
    }
    let held_by = |kg: &KeygateProcess| {
        let (http, base) = (http.clone(), kg.base.clone());
        async move { crate::support::metric_at(&http, &base, "keygate_singleton_held").await }
    };
    assert_eq!(held_by(&first).await, 2.0, "kg-1 says it holds both");
    assert_eq!(held_by(&second).await, 0.0, "kg-2 holds none");
    first.kill();
    for duty in ["backlog-sampler", "source-watchdog"] {
        let held = eventually(Duration::from_secs(15), || async { holder(duty).await.filter(|h| h == "kg-2") }).await;
        assert_eq!(held, "kg-2");
    }
    eventually(Duration::from_secs(5), || async { (held_by(&second).await == 2.0).then_some(()) }).await;
}
