//! Publish benchmark: keygate's REST publish beside two baselines, in the
//! same run, on the same nats-server and the same partition-stamped stream
//! shape:
//! - raw async-nats: JetStream publishes straight from the client
//!   (pipelined for throughput, one awaited publish for latency);
//! - a bare axum handler: parses the same JSON, publishes to JetStream and
//!   awaits the ack (a batch: every publish sent, then every ack awaited),
//!   the least any REST gateway in front of JetStream can cost.
//!
//! Batches are measured as users send them: distinct keys, and one key per
//! batch (an entity's events together), 100 messages per request with 8
//! requests in flight. Single publishes: 64 clients at once (closed loop)
//! and one client at 1,000 requests/s (open loop, p50/p99). Every keygate
//! row reports keygate / bare handler and keygate / raw; each measure runs
//! in alternating rounds and prints the median and the spread.
//!
//! `cargo bench --bench publish`; env `KEYGATE_BENCH_MESSAGES` (per
//! throughput round, default 40000), `KEYGATE_BENCH_ROUNDS` (default 3),
//! `KEYGATE_BENCH_STORAGE=file|memory` (the streams' storage, default
//! file), `KEYGATE_BENCH_RUN` (messages of a key in a row in the one-key
//! rows, default 100: the whole batch);
//! `KEYGATE_BENCH_PROFILE=single|batch|one-key` runs only keygate's 64
//! clients, distinct-key batches or one-key batches, for a profiler;
//! `bare-single|bare-batch|bare-one-key` the same through the bare handler,
//! so two profiles (or CPU times) of one path can be set side by side.
//! keygate runs with the log subscriber its binary installs, writing to
//! nowhere (`support::Rig`): the spans it records cost every request.
//! `KEYGATE_BENCH_LOGS=0` runs without one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};

use keygate_testkit as support;

use support::env_or;

/// The same allocator the keygate binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const PARTITIONS: u32 = 16;
const BATCH: usize = 100;
const BATCHES_IN_FLIGHT: usize = 8;
const CLIENTS: usize = 64;
const RATE_PER_SEC: u64 = 1000;
const LATENCY_SECONDS: u64 = 5;

fn payload(i: usize) -> Value {
    json!({"order": i, "customer": format!("customer-{}", i % 1000), "amount": 12.5, "items": ["a", "b"]})
}

/// Messages of one key in a row in the one-key rows: `KEYGATE_BENCH_RUN`,
/// default a whole batch.
static RUN: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| env_or("KEYGATE_BENCH_RUN", BATCH).max(1));

/// The key of message `i`: 1,000 distinct keys, or, with `one_key_per`
/// batch, the same key for each run of [`RUN`] messages.
fn key(i: usize, one_key_per_batch: bool) -> String {
    if one_key_per_batch {
        format!("customer-{}", (i / *RUN) % 1000)
    } else {
        format!("customer-{}", i % 1000)
    }
}

/// keygate stores `data` with its content type; the baselines publish the
/// same header so all three store the same messages.
fn json_headers() -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "application/json");
    headers
}

/// A fresh partition-stamped stream `name` over `<lowercase name>.*`.
async fn reset(js: &jetstream::Context, name: &str) {
    let subject = format!("{}.*", name.to_lowercase());
    let _ = js.delete_stream(name).await;
    js.create_stream(jetstream::stream::Config {
        name: name.into(),
        subjects: vec![subject.clone()],
        subject_transform: Some(jetstream::stream::SubjectTransform {
            destination: format!("{{{{partition({PARTITIONS},1)}}}}.{}", subject.replace('*', "{{wildcard(1)}}")),
            source: subject,
        }),
        // As keygate's `PUT /v1/streams/{stream}` makes streams by default.
        allow_atomic_publish: true,
        storage: match std::env::var("KEYGATE_BENCH_STORAGE").as_deref() {
            Ok("memory") => jetstream::stream::StorageType::Memory,
            _ => jetstream::stream::StorageType::File,
        },
        ..Default::default()
    })
    .await
    .expect("creating the bench stream");
}

/// The bare handler's request: what keygate's single publish takes, less
/// everything but the key and the data.
#[derive(serde::Deserialize)]
struct BareMessage {
    key: String,
    data: Box<serde_json::value::RawValue>,
}

#[derive(serde::Deserialize)]
struct BareBatch {
    messages: Vec<BareMessage>,
}

fn bare_subject(key: &str) -> String {
    format!("bare.{key}")
}

async fn bare_single(State(js): State<jetstream::Context>, Json(m): Json<BareMessage>) -> Json<Value> {
    let body = Bytes::copy_from_slice(m.data.get().as_bytes());
    let ack = js.publish_with_headers(bare_subject(&m.key), json_headers(), body).await.unwrap().await.unwrap();
    Json(json!({"stream": ack.stream, "seq": ack.sequence}))
}

async fn bare_batch(State(js): State<jetstream::Context>, Json(batch): Json<BareBatch>) -> Json<Value> {
    let mut pending = Vec::with_capacity(batch.messages.len());
    for m in batch.messages {
        let body = Bytes::copy_from_slice(m.data.get().as_bytes());
        pending.push(js.publish_with_headers(bare_subject(&m.key), json_headers(), body).await.unwrap());
    }
    let mut results = Vec::with_capacity(pending.len());
    for ack in pending {
        let ack = ack.await.unwrap();
        results.push(json!({"stream": ack.stream, "seq": ack.sequence}));
    }
    Json(json!({"results": results}))
}

/// Serves the bare handler on loopback; answers its base URL.
async fn serve_bare(js: jetstream::Context) -> String {
    let app = Router::new().route("/single", post(bare_single)).route("/batch", post(bare_batch)).with_state(js);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    base
}

/// Who is measured, and where its requests go. The URLs are parsed once:
/// parsing one on every request would count the client's work against the
/// server, more for keygate's longer paths than for the bare handler's.
#[derive(Clone)]
enum Target {
    Raw(jetstream::Context),
    Bare { single: reqwest::Url, batch: reqwest::Url },
    Keygate { single: reqwest::Url, batch: reqwest::Url },
}

impl Target {
    fn stream(&self) -> &'static str {
        match self {
            Self::Raw(_) => "RAW",
            Self::Bare { .. } => "BARE",
            Self::Keygate { .. } => "REST",
        }
    }
}

/// Messages per second publishing `n` messages in batches of `BATCH`,
/// `BATCHES_IN_FLIGHT` requests at once (raw: every message pipelined).
async fn batch_rate(target: &Target, http: &reqwest::Client, n: usize, one_key: bool) -> f64 {
    let subject = |i: usize| format!("{}.{}", target.stream().to_lowercase(), key(i, one_key));
    if let Target::Raw(js) = target {
        let start = Instant::now();
        let mut acks = Vec::with_capacity(n);
        for i in 0..n {
            let body = Bytes::from(payload(i).to_string());
            acks.push(js.publish_with_headers(subject(i), json_headers(), body).await.expect("raw publish"));
        }
        for ack in acks {
            ack.await.expect("raw ack");
        }
        return n as f64 / start.elapsed().as_secs_f64();
    }
    let url = match target {
        Target::Bare { batch, .. } | Target::Keygate { batch, .. } => batch.clone(),
        Target::Raw(_) => unreachable!(),
    };
    let bodies: Vec<String> = (0..n)
        .collect::<Vec<_>>()
        .chunks(BATCH)
        .map(|chunk| {
            let messages: Vec<Value> =
                chunk.iter().map(|i| json!({"key": key(*i, one_key), "data": payload(*i)})).collect();
            json!({"messages": messages}).to_string()
        })
        .collect();
    let start = Instant::now();
    let semaphore = Arc::new(tokio::sync::Semaphore::new(BATCHES_IN_FLIGHT));
    let mut tasks = Vec::new();
    for body in bodies {
        let permit = semaphore.clone().acquire_owned().await.unwrap();
        let (http, url) = (http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let response = http.post(url).header("content-type", "application/json").body(body).send().await.unwrap();
            assert_eq!(response.status(), 200);
            let _ = response.bytes().await.unwrap();
            drop(permit);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// One single publish through `target`, awaited to its ack.
async fn publish_one(target: &Target, http: &reqwest::Client, i: usize) {
    match target {
        Target::Raw(js) => {
            let body = Bytes::from(payload(i).to_string());
            let subject = format!("raw.{}", key(i, false));
            js.publish_with_headers(subject, json_headers(), body).await.unwrap().await.unwrap();
        }
        Target::Bare { single, .. } | Target::Keygate { single, .. } => {
            let body = json!({"key": key(i, false), "data": payload(i)}).to_string();
            let r =
                http.post(single.clone()).header("content-type", "application/json").body(body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let _ = r.bytes().await.unwrap();
        }
    }
}

/// Requests per second of `CLIENTS` clients publishing one message at a
/// time each, `n` in all.
async fn concurrent_rate(target: &Target, http: &reqwest::Client, n: usize) -> f64 {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (target, http, next) = (target.clone(), http.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    publish_one(&target, &http, i).await;
                }
            })
        })
        .collect();
    for client in clients {
        client.await.unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

struct Percentiles {
    p50: Duration,
    p99: Duration,
}

/// Open loop: one publish every 1/RATE seconds, each timed on its own.
async fn paced_latency(target: &Target, http: &reqwest::Client) -> Percentiles {
    let total = (RATE_PER_SEC * LATENCY_SECONDS) as usize;
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / RATE_PER_SEC));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        ticker.tick().await;
        let (target, http) = (target.clone(), http.clone());
        tasks.push(tokio::spawn(async move {
            let start = Instant::now();
            publish_one(&target, &http, i).await;
            start.elapsed()
        }));
    }
    let mut samples = Vec::with_capacity(total);
    for task in tasks {
        samples.push(task.await.unwrap());
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Percentiles { p50: at(0.50), p99: at(0.99) }
}

/// Several rounds of one measure: the median and the spread.
struct Rounds(Vec<f64>);

impl Rounds {
    fn median(&self) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    fn spread(&self) -> String {
        let (lo, hi) = self.0.iter().fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        format!("{lo:.0}–{hi:.0}")
    }
}

fn ms(seconds: f64) -> String {
    format!("{:.3} ms", seconds * 1000.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n = env_or("KEYGATE_BENCH_MESSAGES", 40_000);
    let rounds = env_or("KEYGATE_BENCH_ROUNDS", 3).max(1);
    let rig = support::Rig::start().await?;
    let (base, js, http) = (rig.base.clone(), rig.js.clone(), rig.http.clone());
    let bare = serve_bare(js.clone()).await;
    let targets = [
        Target::Raw(js.clone()),
        Target::Bare { single: format!("{bare}/single").parse()?, batch: format!("{bare}/batch").parse()? },
        Target::Keygate {
            single: format!("{base}/v1/streams/REST/messages").parse()?,
            batch: format!("{base}/v1/streams/REST/messages/batch").parse()?,
        },
    ];
    if let Ok(what) = std::env::var("KEYGATE_BENCH_PROFILE") {
        let (target, path) = match what.strip_prefix("bare-") {
            Some(path) => (&targets[1], path),
            None => (&targets[2], what.as_str()),
        };
        reset(&js, target.stream()).await;
        let rate = match path {
            "single" => concurrent_rate(target, &http, n).await,
            "batch" => batch_rate(target, &http, n, false).await,
            _ => batch_rate(target, &http, n, true).await,
        };
        println!("{what}: {rate:.0} per second");
        rig.stop().await;
        return Ok(());
    }
    for target in &targets {
        reset(&js, target.stream()).await;
        batch_rate(target, &http, 2_000, false).await;
        concurrent_rate(target, &http, 2_000).await;
    }

    // Rounds alternate the three, so a slow spell of the machine falls on each.
    let mut rates: Vec<[Rounds; 3]> = (0..3).map(|_| [Rounds(vec![]), Rounds(vec![]), Rounds(vec![])]).collect();
    for _ in 0..rounds {
        for (t, target) in targets.iter().enumerate() {
            for (m, one_key) in [false, true].into_iter().enumerate() {
                reset(&js, target.stream()).await;
                rates[t][m].0.push(batch_rate(target, &http, n, one_key).await);
            }
            reset(&js, target.stream()).await;
            rates[t][2].0.push(concurrent_rate(target, &http, n / 4).await);
        }
    }
    let mut latency = Vec::new();
    for target in &targets {
        reset(&js, target.stream()).await;
        latency.push(paced_latency(target, &http).await);
    }

    println!(
        "keygate publish benchmark ({n} messages per throughput round, {rounds} rounds alternating, medians and \
         spreads; {PARTITIONS} partitions, {} store, loopback; bare = axum handler publishing and awaiting the ack)",
        std::env::var("KEYGATE_BENCH_STORAGE").unwrap_or_else(|_| "file".into())
    );
    println!("| measure | raw async-nats | bare handler | keygate | keygate / bare | keygate / raw |");
    println!("|---|---|---|---|---|---|");
    let labels = [
        format!("batch publish, {BATCH} per request, distinct keys, {BATCHES_IN_FLIGHT} in flight (raw: pipelined), msg/s"),
        format!(
            "batch publish, {BATCH} per request, one key per {} messages, {BATCHES_IN_FLIGHT} in flight (raw: pipelined), msg/s",
            *RUN
        ),
        format!("single publish, {CLIENTS} clients at once, req/s"),
    ];
    for (m, label) in labels.iter().enumerate() {
        let [raw, bare, kg] = [&rates[0][m], &rates[1][m], &rates[2][m]];
        println!(
            "| {label} | {:.0} ({}) | {:.0} ({}) | {:.0} ({}) | {:.2}× | {:.2}× |",
            raw.median(),
            raw.spread(),
            bare.median(),
            bare.spread(),
            kg.median(),
            kg.spread(),
            kg.median() / bare.median(),
            kg.median() / raw.median()
        );
    }
    for (name, pick) in [("p50", 0), ("p99", 1)] {
        let at = |p: &Percentiles| if pick == 0 { p.p50 } else { p.p99 }.as_secs_f64();
        let (raw, bare, kg) = (at(&latency[0]), at(&latency[1]), at(&latency[2]));
        println!(
            "| single publish {name}, one client at {RATE_PER_SEC}/s | {} | {} | {} | +{} | +{} |",
            ms(raw),
            ms(bare),
            ms(kg),
            ms((kg - bare).max(0.0)),
            ms((kg - raw).max(0.0))
        );
    }

    rig.stop().await;
    Ok(())
}
