//! Publish benchmark: keygate's REST publish against raw async-nats
//! JetStream publishes of the same messages, in the same run, on the same
//! nats-server. Prints throughput, latency percentiles and ratios.
//!
//! `cargo bench --bench publish`; env `KEYGATE_BENCH_MESSAGES` (default
//! 50000), `KEYGATE_BENCH_BATCH` (messages per request, default 500) and
//! `KEYGATE_BENCH_CONCURRENCY` (batch requests in flight, default 4).

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};

use keygate_testkit as support;

use support::env_or;

/// The same allocator the keygate binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const PARTITIONS: u32 = 16;
const RATE_PER_SEC: u64 = 1000;
const LATENCY_SECONDS: u64 = 5;

fn payload(i: usize) -> Value {
    json!({"order": i, "customer": format!("customer-{}", i % 1000), "amount": 12.5, "items": ["a", "b"]})
}

/// keygate stores `data` with its content type; the raw baseline publishes
/// the same header so both store the same messages.
fn json_headers() -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "application/json");
    headers
}

fn key(i: usize) -> String {
    format!("customer-{}", i % 1000)
}

struct Percentiles {
    p50: Duration,
    p99: Duration,
}

fn percentiles(mut samples: Vec<Duration>) -> Percentiles {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Percentiles { p50: at(0.50), p99: at(0.99) }
}

async fn reset(js: &async_nats::jetstream::Context, name: &str, subject: &str) {
    let _ = js.delete_stream(name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.into(),
        subjects: vec![subject.into()],
        subject_transform: Some(async_nats::jetstream::stream::SubjectTransform {
            source: subject.into(),
            destination: format!("{{{{partition({PARTITIONS},1)}}}}.{}", subject.replace('*', "{{wildcard(1)}}")),
        }),
        ..Default::default()
    })
    .await
    .expect("creating the bench stream");
}

async fn raw_throughput(js: &async_nats::jetstream::Context, n: usize) -> f64 {
    reset(js, "RAW", "raw.*").await;
    let bodies: Vec<(String, Bytes)> =
        (0..n).map(|i| (format!("raw.{}", key(i)), Bytes::from(payload(i).to_string()))).collect();
    let start = Instant::now();
    let mut acks = Vec::with_capacity(n);
    for (subject, body) in bodies {
        acks.push(js.publish_with_headers(subject, json_headers(), body).await.expect("raw publish"));
    }
    for ack in acks {
        ack.await.expect("raw ack");
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn rest_batch_throughput(
    http: &reqwest::Client,
    base: &str,
    js: &async_nats::jetstream::Context,
    n: usize,
    (batch, concurrency): (usize, usize),
) -> f64 {
    reset(js, "REST", "rest.*").await;
    let bodies: Vec<String> = (0..n)
        .collect::<Vec<_>>()
        .chunks(batch)
        .map(|chunk| {
            let messages: Vec<Value> = chunk.iter().map(|i| json!({"key": key(*i), "data": payload(*i)})).collect();
            json!({"messages": messages}).to_string()
        })
        .collect();
    let url = format!("{base}/v1/streams/REST/messages/batch");
    let start = Instant::now();
    let semaphore = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency));
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

/// Open-loop: one publish every 1/RATE seconds, each timed on its own.
async fn paced_latency<F, Fut>(publish_one: F) -> Percentiles
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let total = (RATE_PER_SEC * LATENCY_SECONDS) as usize;
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / RATE_PER_SEC));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        ticker.tick().await;
        let fut = publish_one(i);
        tasks.push(tokio::spawn(async move {
            let start = Instant::now();
            fut.await;
            start.elapsed()
        }));
    }
    let mut samples = Vec::with_capacity(total);
    for task in tasks {
        samples.push(task.await.unwrap());
    }
    percentiles(samples)
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n = env_or("KEYGATE_BENCH_MESSAGES", 50_000);
    let shape = (env_or("KEYGATE_BENCH_BATCH", 500).max(1), env_or("KEYGATE_BENCH_CONCURRENCY", 4).max(1));
    let (batch, concurrency) = shape;
    let rig = support::Rig::start().await?;
    let (base, js, http) = (rig.base.clone(), rig.js.clone(), rig.http.clone());

    // Warm both paths once.
    raw_throughput(&js, 2_000).await;
    rest_batch_throughput(&http, &base, &js, 2_000, shape).await;

    // Alternate the two in several rounds and take medians: on a small
    // machine one run is at the mercy of whatever else is scheduled.
    let rounds = env_or("KEYGATE_BENCH_ROUNDS", 5).max(1);
    let (mut raw_rates, mut rest_rates) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        raw_rates.push(raw_throughput(&js, n).await);
        rest_rates.push(rest_batch_throughput(&http, &base, &js, n, shape).await);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (raw_rate, rest_rate) = (median(raw_rates), median(rest_rates));

    reset(&js, "RAW", "raw.*").await;
    let raw_js = js.clone();
    let raw_lat = paced_latency(move |i| {
        let js = raw_js.clone();
        async move {
            let body = Bytes::from(payload(i).to_string());
            js.publish_with_headers(format!("raw.{}", key(i)), json_headers(), body).await.unwrap().await.unwrap();
        }
    })
    .await;
    reset(&js, "REST", "rest.*").await;
    let url = format!("{base}/v1/streams/REST/messages");
    let rest_http = http.clone();
    let rest_lat = paced_latency(move |i| {
        let (http, url) = (rest_http.clone(), url.clone());
        async move {
            let body = json!({"key": key(i), "data": payload(i)}).to_string();
            let r = http.post(url).header("content-type", "application/json").body(body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let _ = r.bytes().await.unwrap();
        }
    })
    .await;

    println!(
        "keygate publish benchmark ({n} messages x {rounds} rounds, medians; {PARTITIONS} partitions, file store, loopback)"
    );
    println!("| measure | raw async-nats | keygate REST | ratio / overhead |");
    println!("|---|---|---|---|");
    println!(
        "| throughput, batches of {batch} x {concurrency} in flight vs pipelined raw | {raw_rate:.0} msg/s | {rest_rate:.0} msg/s | {:.2}x |",
        rest_rate / raw_rate
    );
    println!(
        "| single publish p50 at {RATE_PER_SEC}/s | {} | {} | +{} |",
        ms(raw_lat.p50),
        ms(rest_lat.p50),
        ms(rest_lat.p50.saturating_sub(raw_lat.p50))
    );
    println!(
        "| single publish p99 at {RATE_PER_SEC}/s | {} | {} | +{} |",
        ms(raw_lat.p99),
        ms(rest_lat.p99),
        ms(rest_lat.p99.saturating_sub(raw_lat.p99))
    );

    rig.stop().await;
    Ok(())
}
