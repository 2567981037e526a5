//! Ordered delivery benchmark: keygate delivering a 16-partition backlog to a
//! local webhook receiver, against a raw async-nats consumer that processes
//! each partition serially (one message in flight per partition, the same
//! HTTP call to the same receiver) in the same run; then the failover time
//! when the pinned keygate process is killed.
//!
//! `cargo bench --bench delivery` (env `KEYGATE_BENCH_MESSAGES`, default 20000).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream, AckKind};
use axum::http::HeaderMap;
use axum::Router;
use bytes::Bytes;
use serde_json::{json, Value};

use keygate_testkit as support;
use support::NatsEndpoint;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const PARTITIONS: u32 = 16;
const KEYS: u64 = 1000;

/// A receiver that answers 200, after `work` of (blocking) work, and counts.
#[derive(Clone)]
struct Sink {
    work: Duration,
    done: Arc<AtomicU64>,
    last_by_key: Arc<Mutex<HashMap<String, u64>>>,
    reorders: Arc<AtomicU64>,
    arrivals: Arc<Mutex<Vec<Instant>>>,
}

impl Sink {
    fn new(work: Duration) -> Self {
        Self {
            work,
            done: Arc::default(),
            last_by_key: Arc::default(),
            reorders: Arc::default(),
            arrivals: Arc::default(),
        }
    }

    async fn serve(self) -> String {
        let app = Router::new().fallback(move |headers: HeaderMap| {
            let sink = self.clone();
            async move {
                if !sink.work.is_zero() {
                    let work = sink.work;
                    let _ = tokio::task::spawn_blocking(move || std::thread::sleep(work)).await;
                }
                let key = headers.get("keygate-key").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
                let seq: u64 = headers
                    .get("keygate-stream-seq")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                {
                    let mut last = sink.last_by_key.lock().unwrap();
                    let previous = last.entry(key).or_insert(0);
                    if seq < *previous {
                        sink.reorders.fetch_add(1, Ordering::Relaxed);
                    }
                    *previous = (*previous).max(seq);
                }
                sink.arrivals.lock().unwrap().push(Instant::now());
                sink.done.fetch_add(1, Ordering::Relaxed);
                "ok"
            }
        });
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        url
    }

    async fn wait_for(&self, n: u64, limit: Duration) {
        let start = Instant::now();
        while self.done.load(Ordering::Relaxed) < n {
            assert!(start.elapsed() < limit, "only {} of {n} delivered", self.done.load(Ordering::Relaxed));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Deliveries per second from the first to the last arrival: the
    /// steady ordered throughput, without start-up (joining, first pull).
    fn rate(&self) -> f64 {
        let arrivals = self.arrivals.lock().unwrap();
        let (first, last) = (arrivals.first().unwrap(), arrivals.last().unwrap());
        (arrivals.len() - 1) as f64 / (*last - *first).as_secs_f64()
    }
}

async fn fill(js: &jetstream::Context, name: &str, n: u64) {
    let _ = js.delete_stream(name).await;
    let subject = format!("{}.*", name.to_lowercase());
    js.create_stream(stream::Config {
        name: name.into(),
        subjects: vec![subject.clone()],
        subject_transform: Some(stream::SubjectTransform {
            source: subject,
            destination: format!("{{{{partition({PARTITIONS},1)}}}}.{}.{{{{wildcard(1)}}}}", name.to_lowercase()),
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut acks = Vec::new();
    for i in 0..n {
        let subject = format!("{}.k{}", name.to_lowercase(), i % KEYS);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Content-Type", "application/json");
        acks.push(js.publish_with_headers(subject, headers, Bytes::from(format!("{{\"n\":{i}}}"))).await.unwrap());
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// The hand-written baseline: one pull consumer, one lane per partition,
/// each message POSTed to the receiver, then acked. With `member_filters`
/// the consumer filters on `<p>.>` for each partition, as a pcgroups member
/// owning every partition does (the server's multi-filter delivery is the
/// cost both then pay); without, it takes the stream unfiltered.
async fn raw_ordered(js: &jetstream::Context, url: &str, sink: &Sink, n: u64, member_filters: bool) -> f64 {
    fill(js, "RAW", n).await;
    sink.done.store(0, Ordering::Relaxed);
    let consumer = support::baseline_consumer(js, "RAW", PARTITIONS, member_filters).await;
    let (http, url) = (reqwest::Client::new(), url.to_owned());
    let pump = support::serial_lanes(consumer, PARTITIONS, move |message: jetstream::Message| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let seq = message.info().unwrap().stream_sequence;
            let key = message.subject.split('.').nth(2).unwrap_or_default().to_owned();
            let r = http
                .post(&url)
                .header("keygate-key", key)
                .header("keygate-stream-seq", seq.to_string())
                .body(message.payload.clone())
                .send()
                .await
                .unwrap();
            let _ = r.bytes().await;
            message.ack_with(AckKind::Ack).await.unwrap();
        }
    })
    .await;
    sink.wait_for(n, Duration::from_secs(300)).await;
    pump.abort();
    sink.rate()
}

async fn keygate_ordered(
    base: &str,
    http: &reqwest::Client,
    js: &jetstream::Context,
    url: &str,
    sink: &Sink,
    n: u64,
) -> f64 {
    fill(js, "KG", n).await;
    sink.done.store(0, Ordering::Relaxed);
    let put = |path: &str, body: Value| http.put(format!("{base}{path}")).json(&body).send();
    let _ = http.delete(format!("{base}/v1/streams/KG/groups/g")).send().await;
    let r =
        put("/v1/streams/KG/groups/g", json!({"kind":"static","partitions":PARTITIONS,"members":["m"]})).await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let r = put("/v1/streams/KG/groups/g/members/m/webhook", json!({"url": url})).await.unwrap();
    assert!(r.status().is_success());
    sink.wait_for(n, Duration::from_secs(300)).await;
    let rate = sink.rate();
    let _ = http.delete(format!("{base}/v1/streams/KG/groups/g/members/m/webhook")).send().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    rate
}

/// Two keygate processes serve one member; messages flow at a steady rate;
/// the pinned one is killed. Returns (seconds until deliveries resume, reorders).
async fn failover(nats: &NatsEndpoint, http: &reqwest::Client, js: &jetstream::Context) -> (f64, u64) {
    let sink = Sink::new(Duration::ZERO);
    let url = sink.clone().serve().await;
    let mut first = support::KeygateProcess::for_bench(nats, Some("bench-a"));
    let base = first.base.clone();
    for _ in 0..400 {
        if http.get(format!("{base}/readyz")).send().await.is_ok_and(|r| r.status() == 200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let put = |path: &str, body: Value| http.put(format!("{base}{path}")).json(&body).send();
    put("/v1/streams/FO", json!({"subjects":["fo.*"],"partitions":PARTITIONS})).await.unwrap();
    put("/v1/streams/FO/groups/g", json!({"kind":"static","partitions":PARTITIONS,"members":["m"],"ack_wait_ms":2000}))
        .await
        .unwrap();
    put("/v1/streams/FO/groups/g/members/m/webhook", json!({"url": url})).await.unwrap();
    js.publish("fo.warmup", Bytes::new()).await.unwrap().await.unwrap();
    sink.wait_for(1, Duration::from_secs(20)).await;
    let mut second = support::KeygateProcess::for_bench(nats, Some("bench-b"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Kill whichever holds the pin (asked until one answers).
    let mut serving = Value::Null;
    for _ in 0..50 {
        let view: Value =
            http.get(format!("{base}/v1/streams/FO/groups/g")).send().await.unwrap().json().await.unwrap();
        serving = view["assignment"][0]["serving_instance"].clone();
        if !serving.is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if serving == "bench-b" {
        std::mem::swap(&mut first, &mut second);
    }
    let publishing = {
        let js = js.clone();
        tokio::spawn(async move {
            for i in 0..6000u64 {
                js.publish(format!("fo.k{}", i % KEYS), Bytes::new()).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let killed = Instant::now();
    drop(first); // SIGKILL
    publishing.await.unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let arrivals = sink.arrivals.lock().unwrap().clone();
    let resumed = arrivals.iter().find(|t| **t > killed + Duration::from_millis(50)).copied();
    drop(second);
    (resumed.map_or(f64::NAN, |t| (t - killed).as_secs_f64()), sink.reorders.load(Ordering::Relaxed))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: u64 = support::env_or("KEYGATE_BENCH_MESSAGES", 20_000);
    let rig = support::Rig::start().await?;
    let (base, js, http) = (rig.base.clone(), rig.js.clone(), rig.http.clone());

    println!(
        "keygate ordered delivery benchmark ({n} messages backlog, {PARTITIONS} partitions, {KEYS} keys, loopback; \
         rates from first to last delivery)"
    );
    println!("| receiver | raw, unfiltered consumer | raw, the member's filters (as pcgroups) | keygate webhook | keygate / raw same filters | keygate / raw unfiltered | target |");
    println!("|---|---|---|---|---|---|---|");
    for (label, work, target) in
        [("answers at once", Duration::ZERO, "≥ 0.70×"), ("1 ms of work", Duration::from_millis(1), "≥ 12,800 msg/s")]
    {
        let mut reorders = 0;
        let mut raw = [0.0; 2];
        for (i, filtered) in [false, true].into_iter().enumerate() {
            let raw_sink = Sink::new(work);
            let url = raw_sink.clone().serve().await;
            raw[i] = raw_ordered(&js, &url, &raw_sink, n, filtered).await;
            reorders += raw_sink.reorders.load(Ordering::Relaxed);
        }
        let sink = Sink::new(work);
        let url = sink.clone().serve().await;
        let kg = keygate_ordered(&base, &http, &js, &url, &sink, n).await;
        reorders += sink.reorders.load(Ordering::Relaxed);
        println!(
            "| {label} | {:.0} msg/s | {:.0} msg/s | {kg:.0} msg/s | {:.2}× | {:.2}× | {target} |",
            raw[0],
            raw[1],
            kg / raw[1],
            kg / raw[0]
        );
        assert_eq!(reorders, 0, "no per-key reorder");
    }
    let (seconds, reorders) = failover(&rig.nats, &http, &js).await;
    println!("| failover (pinned keygate killed, pinned TTL 2 s) | | | {seconds:.2} s until deliveries resume | {reorders} reorders | | ≤ 3 s, 0 |");

    rig.stop().await;
    Ok(())
}
