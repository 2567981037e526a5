//! Ordered delivery benchmark: keygate delivering a 16-partition backlog to a
//! local webhook receiver, against a raw async-nats consumer that processes
//! each partition serially (one message in flight per partition, the same
//! HTTP call to the same receiver) in the same run:
//! - partition ordering against the raw consumer, unfiltered and with the
//!   member's filters;
//! - key ordering and partition ordering with 0, 1 and 20 ms of work, over
//!   1,000 keys drawn uniformly and Zipf-like (s = 1), beside the raw
//!   partition-serial consumer and a raw consumer with the member's filters
//!   that keeps 256 messages in flight (no order: the server's ceiling);
//! - the user's order (a backlog published through keygate's REST API
//!   first, then the member registers), keygate as its own process with
//!   its CPU share, against the raw consumers on the same backlog;
//! - batched webhook deliveries (batches of 100) to a receiver that costs
//!   1 ms per request (answering requests in parallel, or one at a time),
//!   against keygate unbatched and the raw consumer with 256 in flight;
//! - a poison key: the rate of its partition's other keys with and without it;
//! - memory: a million distinct keys through one member of a keygate process;
//! - the failover time when the pinned keygate process is killed.
//!
//! `cargo bench --bench delivery` (env `KEYGATE_BENCH_MESSAGES`, default
//! 20000; `KEYGATE_BENCH_DISTINCT_KEYS`, default 1000000, 0 skips it;
//! `KEYGATE_BENCH_PROFILE=partition|key` runs only keygate's delivery with
//! an instant receiver in that ordering, for a profiler;
//! `KEYGATE_BENCH_USER_PATH=partition|key` runs only the user's order, with
//! `KEYGATE_BENCH_WORK_MS` of work per request, default 0;
//! `KEYGATE_BENCH_BATCHED=1` runs only the batched rows;
//! `KEYGATE_BENCH_PIPELINE=1` runs only the one-stage pipeline rows).

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
    /// A key answered 500 every time.
    poison: Option<String>,
    /// Keys whose arrivals are also kept apart (a poison key's neighbours).
    watched: Arc<std::collections::HashSet<String>>,
    watched_arrivals: Arc<Mutex<Vec<Instant>>>,
    /// Requests being answered now, and the most at once.
    in_flight: Arc<AtomicU64>,
    most_in_flight: Arc<AtomicU64>,
    /// Set: the receiver works on one request at a time (a single worker,
    /// a lock), so its cost is paid per request in series.
    serial: Option<Arc<tokio::sync::Mutex<()>>>,
    /// Set: each answer publishes one message to this stream
    /// (docs/pipelines.md), keyed and numbered like the message delivered.
    outputs: Option<&'static str>,
}

impl Sink {
    fn new(work: Duration) -> Self {
        Self {
            work,
            done: Arc::default(),
            last_by_key: Arc::default(),
            reorders: Arc::default(),
            arrivals: Arc::default(),
            poison: None,
            watched: Arc::default(),
            watched_arrivals: Arc::default(),
            in_flight: Arc::default(),
            most_in_flight: Arc::default(),
            serial: None,
            outputs: None,
        }
    }

    /// A receiver that works on one request at a time.
    fn serial(work: Duration) -> Self {
        Self { serial: Some(Arc::default()), ..Self::new(work) }
    }

    async fn serve(self) -> String {
        let app = Router::new().fallback(move |headers: HeaderMap, body: Bytes| {
            let sink = self.clone();
            async move {
                let now = sink.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
                sink.most_in_flight.fetch_max(now, Ordering::Relaxed);
                let _leaving = InFlight(sink.in_flight.clone());
                let _turn = match &sink.serial {
                    Some(lock) => Some(lock.clone().lock_owned().await),
                    None => None,
                };
                if !sink.work.is_zero() {
                    let work = sink.work;
                    let _ = tokio::task::spawn_blocking(move || std::thread::sleep(work)).await;
                }
                let header =
                    |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
                // A batch (docs/batched-deliveries.md) carries each message's key
                // and sequence in its body; a single delivery in its headers.
                let batched = headers.contains_key("keygate-batch-size");
                let messages: Vec<(String, u64)> = if batched {
                    let batch: Vec<Value> = serde_json::from_slice(&body).unwrap_or_default();
                    batch
                        .iter()
                        .map(|m| {
                            (m["key"].as_str().unwrap_or_default().to_owned(), m["stream_seq"].as_u64().unwrap_or(0))
                        })
                        .collect()
                } else {
                    vec![(header("keygate-key"), header("keygate-stream-seq").parse().unwrap_or(0))]
                };
                if messages.iter().any(|(key, _)| sink.poison.as_deref() == Some(key.as_str())) {
                    let json = [(axum::http::header::CONTENT_TYPE, "application/json")];
                    return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, json, "poison".to_owned());
                }
                let answer = match sink.outputs {
                    Some(stream) if !batched => {
                        let (key, seq) = &messages[0];
                        json!({"publish": [{"stream": stream, "key": key, "data": {"seq": seq}}]}).to_string()
                    }
                    // A batch's 2xx acks all only with an empty body.
                    _ if batched => String::new(),
                    _ => "ok".to_owned(),
                };
                for (key, seq) in messages {
                    if sink.watched.contains(&key) {
                        sink.watched_arrivals.lock().unwrap().push(Instant::now());
                    }
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
                }
                (axum::http::StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "application/json")], answer)
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

/// Counts a request out of the sink's in-flight count when its answer is made.
struct InFlight(Arc<AtomicU64>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Keys of `n` messages: 1,000 keys drawn uniformly or Zipf-like (s = 1,
/// so the busiest key has about 13% of the messages), seeded.
fn key_sequence(n: u64, zipf: bool) -> Vec<u64> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    if !zipf {
        return (0..n).map(|i| i % KEYS).collect();
    }
    let weights: Vec<f64> = (1..=KEYS).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(weights.len());
    let mut sum = 0.0;
    for w in weights {
        sum += w / total;
        cdf.push(sum);
    }
    (0..n)
        .map(|_| {
            let draw = rng.random::<f64>();
            cdf.partition_point(|c| *c < draw).min(KEYS as usize - 1) as u64
        })
        .collect()
}

/// A partition-stamped stream `name` holding one message per entry of
/// `keys` (key `k<entry>`).
async fn fill(js: &jetstream::Context, name: &str, keys: &[u64]) {
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
    for (chunk_at, chunk) in keys.chunks(10_000).enumerate() {
        let mut acks = Vec::with_capacity(chunk.len());
        for (i, key) in chunk.iter().enumerate() {
            let subject = format!("{}.k{key}", name.to_lowercase());
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Content-Type", "application/json");
            let n = chunk_at * 10_000 + i;
            acks.push(js.publish_with_headers(subject, headers, Bytes::from(format!("{{\"n\":{n}}}"))).await.unwrap());
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
}

/// The hand-written baseline: one pull consumer, one lane per partition,
/// each message POSTed to the receiver, then acked. With `member_filters`
/// the consumer filters on `<p>.>` for each partition, as a pcgroups member
/// owning every partition does (the server's multi-filter delivery is the
/// cost both then pay); without, it takes the stream unfiltered.
async fn raw_ordered(js: &jetstream::Context, url: &str, sink: &Sink, keys: &[u64], member_filters: bool) -> f64 {
    let n = keys.len() as u64;
    fill(js, "RAW", keys).await;
    sink.done.store(0, Ordering::Relaxed);
    let consumer = support::baseline_consumer(js, "RAW", PARTITIONS, member_filters).await;
    let pump = raw_pump(consumer, url, None).await;
    sink.wait_for(n, Duration::from_secs(600)).await;
    pump.abort();
    sink.rate()
}

/// The raw baseline's one delivery: the receiver's POST, then the ack.
async fn raw_post(http: reqwest::Client, url: String, message: jetstream::Message) {
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

/// The server's ceiling for a consumer with the member's 16 filters: a raw
/// consumer that keeps `in_flight` deliveries going at once, in no order.
async fn raw_concurrent(js: &jetstream::Context, url: &str, sink: &Sink, keys: &[u64], in_flight: usize) -> f64 {
    let n = keys.len() as u64;
    fill(js, "RAWC", keys).await;
    sink.done.store(0, Ordering::Relaxed);
    let consumer = support::baseline_consumer(js, "RAWC", PARTITIONS, true).await;
    let pump = raw_pump(consumer, url, Some(in_flight)).await;
    sink.wait_for(n, Duration::from_secs(600)).await;
    pump.abort();
    sink.rate()
}

/// Starts the raw baseline's deliveries from `consumer` to `url`: each
/// partition's messages one at a time (`None`), or `in_flight` at once in
/// no order. Returns the pump, to abort when done.
async fn raw_pump(
    consumer: jetstream::consumer::PullConsumer,
    url: &str,
    in_flight: Option<usize>,
) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let (http, url) = (reqwest::Client::new(), url.to_owned());
    let Some(in_flight) = in_flight else {
        return support::serial_lanes(consumer, PARTITIONS, move |message| {
            raw_post(http.clone(), url.clone(), message)
        })
        .await;
    };
    let messages = consumer.messages().await.unwrap();
    tokio::spawn(messages.for_each_concurrent(in_flight, move |message| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            if let Ok(message) = message {
                raw_post(http, url, message).await;
            }
        }
    }))
}

/// keygate delivering `keys`' messages to `url` through a group with
/// `ordering`, its webhook registered with `webhook` options added.
async fn keygate_ordered(
    rig: &support::Rig,
    url: &str,
    sink: &Sink,
    keys: &[u64],
    ordering: &str,
    webhook: Value,
) -> f64 {
    let (base, http, js) = (&rig.base, &rig.http, &rig.js);
    let n = keys.len() as u64;
    fill(js, "KG", keys).await;
    sink.done.store(0, Ordering::Relaxed);
    let put = |path: &str, body: Value| http.put(format!("{base}{path}")).json(&body).send();
    let _ = http.delete(format!("{base}/v1/streams/KG/groups/g")).send().await;
    let group = json!({"kind":"static","partitions":PARTITIONS,"members":["m"],"ordering":ordering});
    let r = put("/v1/streams/KG/groups/g", group).await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let mut hook = json!({"url": url});
    hook.as_object_mut().unwrap().extend(webhook.as_object().unwrap().clone());
    let r = put("/v1/streams/KG/groups/g/members/m/webhook", hook).await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let poisoned = sink.poison.as_ref().map_or(0, |p| keys.iter().filter(|k| format!("k{k}") == *p).count() as u64);
    sink.wait_for(n - poisoned, Duration::from_secs(600)).await;
    let rate = sink.rate();
    let _ = http.delete(format!("{base}/v1/streams/KG/groups/g/members/m/webhook")).send().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    rate
}

/// What the user's path measured: keygate's rate from the first delivery
/// to the last, the most deliveries the receiver saw at once, keygate's CPU
/// time over that span as a share of one core, and the raw baseline's rate
/// over the same backlog.
struct UserPath {
    rate: f64,
    /// The most the receiver was answering at once (an instant receiver
    /// answers in one poll, so this is bounded by its worker threads).
    most_in_flight: u64,
    /// The most `keygate_deliveries_in_flight` read in keygate's `/metrics`
    /// (sampled every 250 ms): deliveries keygate had under way at once.
    most_in_flight_at_keygate: f64,
    cpu_share: f64,
    raw: f64,
}

/// The user's path, in the user's order: a stream made through keygate
/// with 16 partitions, a backlog of `keys`' messages published through its
/// REST API in batches of 100, and only then a static group and its
/// member's webhook. keygate runs alone as its own process, on a
/// nats-server of its own, so that its CPU time is what it spent. Then the
/// raw baseline consumes the same backlog on the same server: partition
/// ordering against the partition-serial consumer with the member's
/// filters, key ordering against a consumer with 256 deliveries in flight.
async fn user_path(
    http: &reqwest::Client,
    work: Duration,
    keys: &[u64],
    ordering: &str,
    outputs: Option<&'static str>,
) -> UserPath {
    let nats = support::NatsServer::start();
    let endpoint = NatsEndpoint::open(&nats.url());
    let keygate = support::KeygateProcess::for_bench(&endpoint, None);
    keygate.wait_ready(http).await;
    let base = &keygate.base;
    let put = |path: &str, body: Value| http.put(format!("{base}{path}")).json(&body).send();
    let r = put("/v1/streams/USER", json!({"subjects":["user.*"],"partitions":PARTITIONS})).await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    for (at, chunk) in keys.chunks(100).enumerate() {
        let messages: Vec<Value> = chunk
            .iter()
            .enumerate()
            .map(|(i, k)| json!({"key": format!("k{k}"), "data": {"n": at * 100 + i}}))
            .collect();
        let r = http
            .post(format!("{base}/v1/streams/USER/messages/batch"))
            .json(&json!({"messages": messages}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    }
    let sink = Sink { outputs, ..Sink::new(work) };
    let url = sink.clone().serve().await;
    let group = json!({"kind":"static","partitions":PARTITIONS,"members":["m"],"ordering":ordering});
    let r = put("/v1/streams/USER/groups/g", group).await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let mut hook = json!({"url": url});
    if let Some(target) = outputs {
        // Duplicates kept longer than the default registration's retries last.
        let stream = json!({"subjects":["out.*"],"partitions":PARTITIONS,"duplicate_window_ms":600_000});
        let r = put(&format!("/v1/streams/{target}"), stream).await.unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
        hook["outputs"] = json!([target]);
    }
    let r = put("/v1/streams/USER/groups/g/members/m/webhook", hook).await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    // keygate's CPU from the first delivery to the last.
    while sink.done.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (cpu_before, started) = (keygate.cpu_seconds(), Instant::now());
    let drained = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (http, base, drained) = (http.clone(), base.clone(), drained.clone());
        tokio::spawn(async move {
            let mut most: f64 = 0.0;
            while !drained.load(Ordering::Relaxed) {
                most = most.max(support::metric_at(&http, &base, "keygate_deliveries_in_flight").await);
                // Four scrapes a second see the steady peak; one every 20 ms
                // rendered the whole page 50 times a second, 1.5 % of
                // keygate's CPU in a profile, which raw consumers never paid.
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            most
        })
    };
    sink.wait_for(keys.len() as u64, Duration::from_secs(600)).await;
    let cpu_share = (keygate.cpu_seconds() - cpu_before) / started.elapsed().as_secs_f64();
    drained.store(true, Ordering::Relaxed);
    let most_in_flight_at_keygate = sampler.await.unwrap();
    assert_eq!(sink.reorders.load(Ordering::Relaxed), 0, "no per-key reorder");
    if let Some(target) = outputs {
        let view: Value = http.get(format!("{base}/v1/streams/{target}")).send().await.unwrap().json().await.unwrap();
        assert_eq!(view["messages"], json!(keys.len()), "one output stored per message: {view}");
    }
    let _ = http.delete(format!("{base}/v1/streams/USER/groups/g")).send().await;
    keygate.terminate().await;

    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let raw_sink = Sink::new(work);
    let raw_url = raw_sink.clone().serve().await;
    let consumer = support::baseline_consumer(&js, "USER", PARTITIONS, true).await;
    let pump = raw_pump(consumer, &raw_url, (ordering == "key").then_some(256)).await;
    raw_sink.wait_for(keys.len() as u64, Duration::from_secs(600)).await;
    pump.abort();
    UserPath {
        rate: sink.rate(),
        most_in_flight: sink.most_in_flight.load(Ordering::Relaxed),
        most_in_flight_at_keygate,
        cpu_share,
        raw: raw_sink.rate(),
    }
}

/// A one-stage pipeline (docs/pipelines.md) in the user's order: the same
/// instant receiver, key ordering, acking without outputs and answering
/// with one output per message (stored before the ack), each on a fresh
/// nats-server and keygate.
async fn print_pipeline(http: &reqwest::Client, keys: &[u64]) {
    let plain = user_path(http, Duration::ZERO, keys, "key", None).await;
    let pipeline = user_path(http, Duration::ZERO, keys, "key", Some("OUT")).await;
    println!("one-stage pipeline (key ordering, instant receiver, the user's order)");
    println!("| receiver answers | keygate | keygate CPU | ratio | target |");
    println!("|---|---|---|---|---|");
    println!("| 200, no outputs | {:.0} msg/s | {:.0}% of a core | | |", plain.rate, plain.cpu_share * 100.0);
    println!(
        "| 200 with one output per message | {:.0} msg/s | {:.0}% of a core | {:.2}× | ≥ 0.6× |",
        pipeline.rate,
        pipeline.cpu_share * 100.0,
        pipeline.rate / plain.rate
    );
}

/// Batched webhook deliveries against a receiver that costs `work` per
/// request (not per message), key ordering: keygate unbatched, keygate
/// with batches of 100, and the raw consumer with 256 deliveries in
/// flight (the most the server gives one consumer here), one message per
/// request. With `serial`, the receiver works on one request at a time.
/// Rates and reorders.
async fn batched(rig: &support::Rig, keys: &[u64], work: Duration, serial: bool) -> [(f64, u64); 3] {
    let sink = || if serial { Sink::serial(work) } else { Sink::new(work) };
    let mut rows = [(0.0, 0); 3];
    for (i, batch) in [None, Some(100)].into_iter().enumerate() {
        let sink = sink();
        let url = sink.clone().serve().await;
        let hook = match batch {
            Some(n) => json!({"batch": {"max_messages": n}}),
            None => json!({}),
        };
        rows[i] = (keygate_ordered(rig, &url, &sink, keys, "key", hook).await, sink.reorders.load(Ordering::Relaxed));
    }
    let raw_sink = sink();
    let raw_url = raw_sink.clone().serve().await;
    rows[2] = (raw_concurrent(&rig.js, &raw_url, &raw_sink, keys, 256).await, 0);
    rows
}

/// Both receivers' batched rows, measured and printed.
async fn print_batched(rig: &support::Rig, keys: &[u64]) {
    println!("| receiver, 1 ms per request | keygate unbatched | keygate, batches of 100 | raw, 256 in flight, one per request | batched / unbatched | batched / raw | reorders | target |");
    println!("|---|---|---|---|---|---|---|---|");
    for (label, serial) in [("requests in parallel", false), ("one request at a time", true)] {
        let [(single, r1), (batched, r2), (raw, _)] = batched(rig, keys, Duration::from_millis(1), serial).await;
        println!(
            "| {label} | {single:.0} msg/s | {batched:.0} msg/s | {raw:.0} msg/s | {:.1}× | {:.2}× | {} | ≥ 20×, ≥ 0.9×, 0 |",
            batched / single,
            batched / raw,
            r1 + r2
        );
    }
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

/// Rate of the poison key's partition's other keys, key ordering, 1 ms of
/// work: with the poison key answering 500 throughout, and without it.
async fn poison_key(rig: &support::Rig, keys: &[u64]) -> (f64, f64) {
    let poison = "k0".to_owned();
    let partition = keygate::partition::partition_of_tokens(["k0"], PARTITIONS);
    let neighbours: std::collections::HashSet<String> = (1..KEYS)
        .map(|k| format!("k{k}"))
        .filter(|k| keygate::partition::partition_of_tokens([k.as_str()], PARTITIONS) == partition)
        .collect();
    let neighbours = Arc::new(neighbours);
    let retrying = json!({"max_attempts": 1000, "backoff": {"initial_ms": 100, "max_ms": 1000}});
    let mut rates = [0.0; 2];
    for (i, with_poison) in [true, false].into_iter().enumerate() {
        let mut sink = Sink::new(Duration::from_millis(1));
        sink.poison = with_poison.then(|| poison.clone());
        sink.watched = neighbours.clone();
        let url = sink.clone().serve().await;
        keygate_ordered(rig, &url, &sink, keys, "key", retrying.clone()).await;
        let arrivals = sink.watched_arrivals.lock().unwrap();
        let first = *sink.arrivals.lock().unwrap().first().unwrap();
        rates[i] = arrivals.len() as f64 / (*arrivals.last().unwrap() - first).as_secs_f64();
    }
    (rates[0], rates[1])
}

/// A million distinct keys (one message each) through one member of a
/// keygate process, instant receiver: its RSS before, at peak while
/// delivering, and after draining.
async fn distinct_keys(rig: &support::Rig, n: u64) -> (f64, f64, f64, f64) {
    let keygate = support::KeygateProcess::for_bench(&rig.nats, Some("bench-keys"));
    let (http, base) = (&rig.http, keygate.base.clone());
    keygate.wait_ready(http).await;
    let keys: Vec<u64> = (0..n).collect();
    fill(&rig.js, "MILLION", &keys).await;
    let group = json!({"kind":"static","partitions":PARTITIONS,"members":["m"],"ordering":"key"});
    support::put(http, format!("{base}/v1/streams/MILLION/groups/g"), group).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = keygate.rss_mib();
    let done = Arc::new(AtomicU64::new(0));
    let url = {
        let done = done.clone();
        let app = Router::new().fallback(move || {
            let done = done.clone();
            async move {
                done.fetch_add(1, Ordering::Relaxed);
                "ok"
            }
        });
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        url
    };
    let started = Instant::now();
    support::put(http, format!("{base}/v1/streams/MILLION/groups/g/members/m/webhook"), json!({"url": url})).await;
    let mut peak = before;
    while done.load(Ordering::Relaxed) < n {
        assert!(started.elapsed() < Duration::from_secs(900), "only {} of {n} delivered", done.load(Ordering::Relaxed));
        peak = peak.max(keygate.rss_mib());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = keygate.rss_mib();
    let _ = rig.js.delete_stream("MILLION").await;
    (before, peak, after, rate)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: u64 = support::env_or("KEYGATE_BENCH_MESSAGES", 20_000);
    let distinct: u64 = support::env_or("KEYGATE_BENCH_DISTINCT_KEYS", 1_000_000);
    let rig = support::Rig::start().await?;
    let (js, http) = (rig.js.clone(), rig.http.clone());
    let uniform = key_sequence(n, false);
    if let Ok(ordering) = std::env::var("KEYGATE_BENCH_USER_PATH") {
        let work = Duration::from_millis(support::env_or("KEYGATE_BENCH_WORK_MS", 0));
        let user = user_path(&http, work, &uniform, &ordering, None).await;
        let baseline = if ordering == "key" { "raw, 256 in flight" } else { "raw partition-serial, member's filters" };
        println!(
            "{ordering} ordering, user's path, receiver work {} ms: keygate {:.0} msg/s (at most {} deliveries in \
             flight at keygate, {} requests answered at once by the receiver, keygate at {:.0}% of a core), \
             {baseline} {:.0} msg/s, ratio {:.2}x",
            work.as_millis(),
            user.rate,
            user.most_in_flight_at_keygate,
            user.most_in_flight,
            user.cpu_share * 100.0,
            user.raw,
            user.rate / user.raw
        );
        rig.stop().await;
        return Ok(());
    }
    if std::env::var("KEYGATE_BENCH_PIPELINE").is_ok() {
        print_pipeline(&http, &uniform).await;
        rig.stop().await;
        return Ok(());
    }
    if std::env::var("KEYGATE_BENCH_BATCHED").is_ok() {
        print_batched(&rig, &uniform).await;
        rig.stop().await;
        return Ok(());
    }
    if let Ok(ordering) = std::env::var("KEYGATE_BENCH_PROFILE") {
        let sink = Sink::new(Duration::ZERO);
        let url = sink.clone().serve().await;
        let rate = keygate_ordered(&rig, &url, &sink, &uniform, &ordering, json!({})).await;
        let most = sink.most_in_flight.load(Ordering::Relaxed);
        println!("keygate, {ordering} ordering, instant receiver: {rate:.0} msg/s, at most {most} in flight");
        rig.stop().await;
        return Ok(());
    }

    println!(
        "keygate ordered delivery benchmark ({n} messages backlog, {PARTITIONS} partitions, {KEYS} keys, loopback; \
         rates from first to last delivery)"
    );
    println!();
    println!("partition ordering");
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
            raw[i] = raw_ordered(&js, &url, &raw_sink, &uniform, filtered).await;
            reorders += raw_sink.reorders.load(Ordering::Relaxed);
        }
        let sink = Sink::new(work);
        let url = sink.clone().serve().await;
        let kg = keygate_ordered(&rig, &url, &sink, &uniform, "partition", json!({})).await;
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

    println!();
    println!("batched webhook deliveries (key ordering, 1,000 keys)");
    print_batched(&rig, &uniform).await;
    println!();
    print_pipeline(&http, &uniform).await;

    println!();
    println!("the user's order: a backlog published through keygate first, then the member registers (keygate as its own process)");
    println!("| ordering | receiver | raw baseline | raw | keygate | keygate / raw | keygate CPU | target |");
    println!("|---|---|---|---|---|---|---|---|");
    for (ordering, baseline, target) in [
        ("partition", "partition-serial, member's filters", "≥ 0.7×"),
        ("key", "256 in flight, member's filters", "≥ 0.9×"),
    ] {
        let user = user_path(&http, Duration::ZERO, &uniform, ordering, None).await;
        println!(
            "| {ordering} | answers at once | {baseline} | {:.0} msg/s | {:.0} msg/s | {:.2}× | {:.0}% of a core | {target} |",
            user.raw,
            user.rate,
            user.rate / user.raw,
            user.cpu_share * 100.0
        );
    }

    println!();
    println!("key ordering (max_in_flight 256, the default) against the raw partition-serial consumer with the member's filters");
    println!("| keys | work | raw partition-serial | raw, 256 in flight, no order | keygate partition ordering | keygate key ordering | key / raw serial | key / raw 256 in flight | target |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for zipf in [false, true] {
        for (work, target) in [(0u64, "≥ 1.2×"), (1, "≥ 3×"), (20, "≥ 10×")] {
            // 20 ms of work one partition at a time is slow: fewer messages.
            let count = if work == 20 { n.min(6_000) } else { n };
            let keys = key_sequence(count, zipf);
            let work = Duration::from_millis(work);
            let mut reorders = 0;
            let mut rates = Vec::new();
            for run in 0..4 {
                let sink = Sink::new(work);
                let url = sink.clone().serve().await;
                let rate = match run {
                    0 => raw_ordered(&js, &url, &sink, &keys, true).await,
                    1 => raw_concurrent(&js, &url, &sink, &keys, 256).await,
                    2 => keygate_ordered(&rig, &url, &sink, &keys, "partition", json!({})).await,
                    _ => keygate_ordered(&rig, &url, &sink, &keys, "key", json!({})).await,
                };
                if run != 1 {
                    reorders += sink.reorders.load(Ordering::Relaxed);
                }
                rates.push(rate);
            }
            println!(
                "| {} | {} ms | {:.0} msg/s | {:.0} msg/s | {:.0} msg/s | {:.0} msg/s | {:.2}× | {:.2}× | {target} |",
                if zipf { "Zipf-like (s = 1)" } else { "uniform" },
                work.as_millis(),
                rates[0],
                rates[1],
                rates[2],
                rates[3],
                rates[3] / rates[0],
                rates[3] / rates[1]
            );
            assert_eq!(reorders, 0, "no per-key reorder");
        }
    }

    println!();
    let (with_poison, without) = poison_key(&rig, &uniform).await;
    println!("| poison key (500 on every attempt), key ordering, 1 ms of work | its partition's other keys with it | without it | ratio | target |");
    println!("|---|---|---|---|---|");
    println!("| | {with_poison:.0} msg/s | {without:.0} msg/s | {:.2}× | ≥ 0.90× |", with_poison / without);

    if distinct > 0 {
        println!();
        let (before, peak, after, rate) = distinct_keys(&rig, distinct).await;
        println!("| {distinct} distinct keys through one member (keygate process, key ordering) | RSS before | peak | after draining | peak − before | delivery | target |");
        println!("|---|---|---|---|---|---|---|");
        println!(
            "| | {before:.1} MiB | {peak:.1} MiB | {after:.1} MiB | {:.1} MiB | {rate:.0} msg/s | ≤ 50 MB, back to baseline |",
            peak - before
        );
    }

    println!();
    let (seconds, reorders) = failover(&rig.nats, &http, &js).await;
    println!("| failover (pinned keygate killed, pinned TTL 2 s) | {seconds:.2} s until deliveries resume | {reorders} reorders | ≤ 3 s, 0 |");

    rig.stop().await;
    Ok(())
}
