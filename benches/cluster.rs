//! Cluster benchmark: keygate's batch publish and ordered webhook delivery
//! on a 3-node JetStream cluster on loopback with an R3 stream, beside the
//! same on one nats-server with an R1 stream, in the same run. keygate runs
//! as its own process (release build) in both.
//!
//! `cargo bench --bench cluster` (env `KEYGATE_BENCH_MESSAGES`, default 20000).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use serde_json::{json, Value};

use keygate_testkit as support;
use keygate_testkit::cluster;

use support::{put, KeygateProcess, LocalNats, NatsEndpoint};

const PARTITIONS: u32 = 16;
const KEYS: u64 = 1000;
const BATCH: u64 = 500;
const IN_FLIGHT: usize = 4;

struct Figures {
    publish_per_sec: f64,
    delivery_per_sec: f64,
}

/// A webhook receiver answering 200 at once; counts deliveries.
async fn receiver() -> (String, Arc<AtomicU64>) {
    let count = Arc::new(AtomicU64::new(0));
    let counter = count.clone();
    let app = Router::new().fallback(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        std::future::ready(())
    });
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, count)
}

/// Publishes `n` keyed messages in batches (several in flight), then lets
/// one webhook member deliver them in key order; both as rates.
async fn measure(http: &reqwest::Client, nats: &NatsEndpoint, replicas: u32, n: u64) -> Figures {
    let kg = KeygateProcess::for_bench(nats, None);
    kg.wait_ready(http).await;
    let base = kg.base.clone();
    let stream = json!({"subjects":["bench.*"],"partitions":PARTITIONS,"replicas":replicas});
    // A just-formed cluster may answer 503 until its meta leader settles.
    kg.put_until_stored(http, "/v1/streams/BENCH", &stream).await;

    let started = Instant::now();
    let batches: Vec<u64> = (0..n).step_by(BATCH as usize).collect();
    for chunk in batches.chunks(IN_FLIGHT) {
        let sends = chunk.iter().map(|from| {
            let messages: Vec<Value> = (*from..(*from + BATCH).min(n))
                .map(|i| json!({"key": format!("customer-{}", i % KEYS), "data": {"order": i, "amount": 12.5}}))
                .collect();
            let request =
                http.post(format!("{base}/v1/streams/BENCH/messages/batch")).json(&json!({"messages": messages}));
            async move {
                let r = request.send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
        });
        futures::future::join_all(sends).await;
    }
    let publish_per_sec = n as f64 / started.elapsed().as_secs_f64();

    let (hook, delivered) = receiver().await;
    let group = json!({"kind":"static","partitions":PARTITIONS,"members":["m1"]});
    put(http, format!("{base}/v1/streams/BENCH/groups/g"), group).await;
    let started = Instant::now();
    put(http, format!("{base}/v1/streams/BENCH/groups/g/members/m1/webhook"), json!({"url": hook})).await;
    while delivered.load(Ordering::Relaxed) < n {
        assert!(started.elapsed() < Duration::from_secs(300), "delivery stalled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let delivery_per_sec = n as f64 / started.elapsed().as_secs_f64();
    Figures { publish_per_sec, delivery_per_sec }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: u64 = support::env_or("KEYGATE_BENCH_MESSAGES", 20_000);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();

    let single = LocalNats::start().await?;
    let one = measure(&http, &single.endpoint(), 1, n).await;
    single.stop().await;

    let nodes = cluster::NatsCluster::start().await;
    let three = measure(&http, &NatsEndpoint { url: nodes.urls(), token: None }, 3, n).await;
    drop(nodes);

    println!(
        "keygate on one nats-server (R1) and on a 3-node loopback cluster (R3): {n} messages, {PARTITIONS} \
         partitions, {KEYS} keys, batches of {BATCH} ({IN_FLIGHT} in flight), one webhook member answering at once"
    );
    println!("| measure | one server, R1 | 3-node cluster, R3 | cluster / single |");
    println!("|---|---|---|---|");
    println!(
        "| batch publish | {:.0} msg/s | {:.0} msg/s | {:.2}× |",
        one.publish_per_sec,
        three.publish_per_sec,
        three.publish_per_sec / one.publish_per_sec
    );
    println!(
        "| ordered webhook delivery | {:.0} msg/s | {:.0} msg/s | {:.2}× |",
        one.delivery_per_sec,
        three.delivery_per_sec,
        three.delivery_per_sec / one.delivery_per_sec
    );
    Ok(())
}
