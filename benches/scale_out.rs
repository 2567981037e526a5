//! Scale-out benchmark (docs/scale-out.md), keygate processes (release
//! build) against one nats-server on loopback, in one run:
//!
//! 1. delivery of a 12-member group whose webhook does 1 ms of work per
//!    message, served by 1, 2 and 3 replicas, beside a raw async-nats
//!    consumer with one serial lane per partition doing the same work;
//!    with the pin spread each run reached;
//! 2. the group view's latency (`GET …/groups/{group}`) with 100 members on
//!    3 replicas, once their pins are spread, beside the stream's consumer
//!    list the view reads, raw, and the 100 consumer-info requests that
//!    would tell as much;
//! 3. 100 groups × 10 webhook members on 3 replicas, idle: CPU per keygate
//!    over 30 s, RSS, and at the start and end of the window its runtime
//!    tasks and NATS subscriptions and the server's consumer count (KV
//!    watches are consumers too); once for members that never had a
//!    message (`idle`), once for members quiet after traffic, each pinned
//!    on one replica (`quiet`); after each window, the dashboard's refresh
//!    of the 100 groups.
//!
//! `cargo bench --bench scale_out` (env `KEYGATE_BENCH_MESSAGES`, default 12000;
//! `KEYGATE_BENCH_PARTS`, default `delivery,view,idle,quiet`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use axum::Router;
use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};
use serde_json::{json, Value};

use keygate_testkit as support;

use support::{put, KeygateProcess, LocalNats, NatsEndpoint};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MEMBERS: usize = 12;
const WORK: Duration = Duration::from_millis(1);

/// A webhook receiver that works 1 ms per delivery; counts them.
async fn receiver() -> (String, Arc<AtomicU64>) {
    let count = Arc::new(AtomicU64::new(0));
    let counter = count.clone();
    let app = Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            tokio::time::sleep(WORK).await;
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, count)
}

async fn publish_raw(js: &jetstream::Context, prefix: &str, from: u64, n: u64) {
    let mut acks = Vec::with_capacity(n as usize);
    for i in from..from + n {
        acks.push(js.publish(format!("{prefix}.k{}", i % 1000), Bytes::from(format!("{{\"n\":{i}}}"))).await.unwrap());
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// Members served per keygate (by `--instance-id`), once all are pinned.
async fn spread(http: &reqwest::Client, base: &str, stream: &str) -> Option<BTreeMap<String, usize>> {
    let view: Value = http.get(format!("{base}/v1/streams/{stream}/groups/g")).send().await.ok()?.json().await.ok()?;
    let mut counts = BTreeMap::new();
    for member in view["assignment"].as_array()? {
        *counts.entry(member["serving_instance"].as_str()?.to_owned()).or_default() += 1;
    }
    (counts.values().sum::<usize>() == view["assignment"].as_array()?.len()).then_some(counts)
}

/// Publishes a trickle to `stream` until every member of its group is
/// pinned and balancing has spread the pins fairly over `replicas` (or 90 s
/// passed), then waits for the trickle to be delivered: the spread, and the
/// messages sent.
async fn spread_pins(
    http: &reqwest::Client,
    js: &jetstream::Context,
    base: &str,
    stream: &str,
    replicas: usize,
    delivered: &AtomicU64,
) -> (BTreeMap<String, usize>, u64) {
    let prefix = stream.to_lowercase();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut sent = 0;
    let counts = loop {
        publish_raw(js, &prefix, sent, 50).await;
        sent += 50;
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Some(counts) = spread(http, base, stream).await {
            let fair = counts.values().sum::<usize>().div_ceil(replicas);
            if counts.len() == replicas && counts.values().all(|c| *c <= fair) || Instant::now() > deadline {
                break counts;
            }
        }
    };
    while delivered.load(Ordering::Relaxed) < sent {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (counts, sent)
}

/// A group of `members` webhook members over a fresh stream, on the first keygate.
async fn group(http: &reqwest::Client, base: &str, stream: &str, members: usize, hook: &str) {
    let prefix = stream.to_lowercase();
    put(http, format!("{base}/v1/streams/{stream}"), json!({"subjects":[format!("{prefix}.*")],"partitions":members}))
        .await;
    let names: Vec<String> = (0..members).map(|i| format!("m{i}")).collect();
    let spec = json!({"kind":"static","partitions":members,"members":names,"ack_wait_ms":5000});
    put(http, format!("{base}/v1/streams/{stream}/groups/g"), spec).await;
    for name in &names {
        put(http, format!("{base}/v1/streams/{stream}/groups/g/members/{name}/webhook"), json!({"url": hook})).await;
    }
}

/// Acked messages per second of a 12-member group on `replicas` keygates,
/// measured once the pins are spread; and the spread.
async fn delivery(
    http: &reqwest::Client,
    nats: &NatsEndpoint,
    js: &jetstream::Context,
    replicas: usize,
    n: u64,
) -> (f64, BTreeMap<String, usize>) {
    let kgs: Vec<KeygateProcess> =
        (0..replicas).map(|i| KeygateProcess::for_bench(nats, Some(&format!("kg-{i}")))).collect();
    for kg in &kgs {
        kg.wait_ready(http).await;
    }
    let stream = format!("SO{replicas}");
    let prefix = stream.to_lowercase();
    let (hook, delivered) = receiver().await;
    group(http, &kgs[0].base, &stream, MEMBERS, &hook).await;
    let (spread, sent) = spread_pins(http, js, &kgs[0].base, &stream, replicas, &delivered).await;
    let started = Instant::now();
    publish_raw(js, &prefix, sent, n).await;
    while delivered.load(Ordering::Relaxed) < sent + n {
        assert!(started.elapsed() < Duration::from_secs(300), "delivery stalled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    drop(kgs);
    (rate, spread)
}

/// The same work by hand: one consumer over every partition, one serial
/// lane per partition, 1 ms per message.
async fn raw_delivery(http: &reqwest::Client, nats: &NatsEndpoint, js: &jetstream::Context, n: u64) -> f64 {
    let kg = KeygateProcess::for_bench(nats, None);
    kg.wait_ready(http).await;
    put(http, format!("{}/v1/streams/SORAW", kg.base), json!({"subjects":["soraw.*"],"partitions":MEMBERS})).await;
    drop(kg);
    let consumer = support::baseline_consumer(js, "SORAW", MEMBERS as u32, true).await;
    let done = Arc::new(AtomicU64::new(0));
    let counter = done.clone();
    let pump = support::serial_lanes(consumer, MEMBERS as u32, move |message: jetstream::Message| {
        let counter = counter.clone();
        async move {
            tokio::time::sleep(WORK).await;
            message.ack().await.unwrap();
            counter.fetch_add(1, Ordering::Relaxed);
        }
    })
    .await;
    let started = Instant::now();
    publish_raw(js, "soraw", 0, n).await;
    while done.load(Ordering::Relaxed) < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    pump.abort();
    n as f64 / started.elapsed().as_secs_f64()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Views measured (each way): p99 is then the tenth slowest, not the second.
const VIEWS: usize = 1000;

/// p50 and p99 (ms) of a group GET with 100 members on 3 replicas; of the
/// stream's consumer list, read raw (the one request that gives the view
/// its members' consumers); and of the 100 consumer-info requests that
/// would give as much, sent raw at once.
async fn group_view(
    http: &reqwest::Client,
    nats: &NatsEndpoint,
    js: &jetstream::Context,
) -> ([f64; 2], [f64; 2], [f64; 2]) {
    let kgs: Vec<KeygateProcess> =
        (0..3).map(|i| KeygateProcess::for_bench(nats, Some(&format!("view-{i}")))).collect();
    for kg in &kgs {
        kg.wait_ready(http).await;
    }
    let (hook, delivered) = receiver().await;
    group(http, &kgs[0].base, "VIEW", 100, &hook).await;
    // Measured once the pins are spread (while the balancer still moves
    // them, the server's consumer answers slow down, and the views with
    // them), then after a few views per replica unmeasured (each opens its
    // connection, its buckets).
    spread_pins(http, js, &kgs[0].base, "VIEW", 3, &delivered).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..30 {
        http.get(format!("{}/v1/streams/VIEW/groups/g", kgs[i % 3].base)).send().await.unwrap().bytes().await.unwrap();
    }
    let mut keygate = Vec::new();
    for i in 0..VIEWS {
        let started = Instant::now();
        let r = http.get(format!("{}/v1/streams/VIEW/groups/g", kgs[i % 3].base)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
        keygate.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let stream = js.get_stream("VIEW").await.unwrap();
    let (mut listed, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..VIEWS {
        let started = Instant::now();
        let consumers: Vec<_> = stream.consumers().try_collect().await.unwrap();
        assert_eq!(consumers.len(), 100);
        listed.push(started.elapsed().as_secs_f64() * 1000.0);
        let started = Instant::now();
        let infos = (0..100).map(|m| {
            let stream = stream.clone();
            async move { stream.consumer_info(format!("g-m{m}")).await.unwrap() }
        });
        futures::future::join_all(infos).await;
        raw.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    drop(kgs);
    let p50_p99 = |mut ms: Vec<f64>| {
        ms.sort_by(f64::total_cmp);
        [percentile(&ms, 0.5), percentile(&ms, 0.99)]
    };
    (p50_p99(keygate), p50_p99(listed), p50_p99(raw))
}

/// Refreshes of the dashboard's groups tab measured: the median and the slowest.
const DASHBOARD_REFRESHES: usize = 20;

/// What one refresh of the dashboard's groups tab asks (`refresh` in
/// src/http/dashboard.html): the streams, each stream's groups, then every
/// group's view, six requests in flight at once as the page keeps them.
/// Median and slowest of [`DASHBOARD_REFRESHES`], in ms.
async fn dashboard_refreshes(http: &reqwest::Client, base: &str, groups: usize) -> [f64; 2] {
    let get = |path: String| {
        let url = format!("{base}{path}");
        async move { http.get(url).send().await.unwrap().error_for_status().unwrap().json::<Value>().await.unwrap() }
    };
    let mut took = Vec::new();
    for _ in 0..DASHBOARD_REFRESHES {
        let started = Instant::now();
        let streams = get("/v1/streams".to_owned()).await;
        let names: Vec<String> =
            streams.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap().to_owned()).collect();
        let listed: Vec<(String, Value)> = futures::stream::iter(names)
            .map(|stream| {
                let groups = get(format!("/v1/streams/{stream}/groups"));
                async move { (stream, groups.await) }
            })
            .buffered(6)
            .collect()
            .await;
        let views: Vec<String> = listed
            .iter()
            .flat_map(|(stream, groups)| {
                groups.as_array().unwrap().iter().map(move |g| {
                    format!(
                        "/v1/streams/{stream}/groups/{}?kind={}",
                        g["group"].as_str().unwrap(),
                        g["kind"].as_str().unwrap()
                    )
                })
            })
            .collect();
        assert_eq!(views.len(), groups);
        let _: Vec<Value> = futures::stream::iter(views).map(get).buffered(6).collect().await;
        took.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    took.sort_by(f64::total_cmp);
    [percentile(&took, 0.5), took[took.len() - 1]]
}

/// What one keygate costs idle: CPU (% of a core) over the window, RSS
/// (MiB), and at the start and end of the window its runtime tasks and
/// the subscriptions its NATS connection holds at the server.
struct IdleCost {
    cpu: f64,
    rss: f64,
    tasks: [f64; 2],
    subscriptions: [u64; 2],
}

/// One run of [`idle_members`]: each keygate's cost, the server's consumers
/// at the window's start and end, each keygate's pins, and the dashboard's
/// refresh (median and slowest, ms).
struct IdleRun {
    costs: Vec<IdleCost>,
    consumers: [u64; 2],
    pins: Vec<usize>,
    dashboard: [f64; 2],
}

/// Subscriptions per keygate connection (named `keygate <instance id>`)
/// and the server's consumer count, from its monitoring endpoint.
async fn server_counts(http: &reqwest::Client, monitor: u16) -> (BTreeMap<String, u64>, u64) {
    let connz: Value =
        http.get(format!("http://127.0.0.1:{monitor}/connz?limit=1024")).send().await.unwrap().json().await.unwrap();
    let subs = connz["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| Some((c["name"].as_str()?.to_owned(), c["subscriptions"].as_u64()?)))
        .collect();
    let jsz: Value = http.get(format!("http://127.0.0.1:{monitor}/jsz")).send().await.unwrap().json().await.unwrap();
    (subs, jsz["consumers"].as_u64().unwrap_or(0))
}

/// 1,000 idle webhook members (100 groups × 10) on 3 replicas, against a
/// nats-server of their own whose monitoring endpoint counts subscriptions
/// and consumers: the cost per keygate, the server's consumers at the start
/// and end of the window, the pins each keygate holds, and after the window
/// the dashboard's refresh over the 100 groups. `after_traffic`:
/// every member gets messages first, so each holds a pin and the pins are
/// spread (members in use, now quiet); else no member ever had one (every
/// instance of every member pulls as a standby).
async fn idle_members(http: &reqwest::Client, after_traffic: bool) -> IdleRun {
    let monitor = support::free_port();
    let server = support::NatsServer::start_with(&["-m", &monitor.to_string()]);
    let nats = NatsEndpoint::open(&server.url());
    let kgs: Vec<KeygateProcess> =
        (0..3).map(|i| KeygateProcess::for_bench(&nats, Some(&format!("idle-{i}")))).collect();
    for kg in &kgs {
        kg.wait_ready(http).await;
    }
    let (hook, _) = receiver().await;
    for g in 0..100 {
        group(http, &kgs[0].base, &format!("IDLE{g}"), 10, &hook).await;
    }
    if after_traffic {
        let js = keygate::nats::connect::jetstream(nats.connect().await.unwrap(), Duration::from_secs(10));
        for g in 0..100 {
            publish_raw(&js, &format!("idle{g}"), 0, 100).await;
        }
    }
    // Every replica runs all 1,000 instances before the window starts (and
    // after traffic, the pins have moved to their shares).
    tokio::time::sleep(Duration::from_secs(if after_traffic { 45 } else { 20 })).await;
    let window: u64 = support::env_or("KEYGATE_BENCH_IDLE_SECS", 30);
    let mut before = Vec::new();
    for kg in &kgs {
        before.push((kg.cpu_seconds(), kg.metric(http, "keygate_runtime_alive_tasks").await));
    }
    let (subs_before, consumers_before) = server_counts(http, monitor).await;
    tokio::time::sleep(Duration::from_secs(window)).await;
    let (subs_after, consumers_after) = server_counts(http, monitor).await;
    let mut pins = vec![0; kgs.len()];
    for g in 0..100 {
        for (i, n) in spread(http, &kgs[0].base, &format!("IDLE{g}")).await.unwrap_or_default() {
            if let Some(slot) = i.strip_prefix("idle-").and_then(|k| k.parse::<usize>().ok()) {
                pins[slot] += n;
            }
        }
    }
    let mut costs = Vec::new();
    for (i, (kg, (cpu, tasks))) in kgs.iter().zip(before).enumerate() {
        let name = format!("keygate idle-{i}");
        costs.push(IdleCost {
            cpu: (kg.cpu_seconds() - cpu) / window as f64 * 100.0,
            rss: kg.rss_mib(),
            tasks: [tasks, kg.metric(http, "keygate_runtime_alive_tasks").await],
            subscriptions: [subs_before.get(&name).copied().unwrap_or(0), subs_after.get(&name).copied().unwrap_or(0)],
        });
    }
    let dashboard = dashboard_refreshes(http, &kgs[0].base, 100).await;
    IdleRun { costs, consumers: [consumers_before, consumers_after], pins, dashboard }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: u64 = support::env_or("KEYGATE_BENCH_MESSAGES", 12_000);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let server = LocalNats::start().await?;
    let nats = server.endpoint();
    let js = keygate::nats::connect::jetstream(nats.connect().await?, Duration::from_secs(10));

    println!("keygate scale-out benchmark ({n} messages, {MEMBERS}-member group, 1 ms of work each, loopback)");
    println!("| measure | raw async-nats | keygate | ratio | target |");
    println!("|---|---|---|---|---|");
    // KEYGATE_BENCH_PARTS: which of delivery, view, idle, quiet to run (default all).
    let parts: String = support::env_or("KEYGATE_BENCH_PARTS", "delivery,view,idle,quiet".to_owned());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);
    let raw = if part("delivery") { raw_delivery(&http, &nats, &js, n).await } else { 0.0 };
    let mut one = None;
    for replicas in (1..=3).filter(|_| part("delivery")) {
        let (rate, spread) = delivery(&http, &nats, &js, replicas, n).await;
        let single = *one.get_or_insert(rate);
        println!(
            "| acked msg/s, {replicas} replica(s), pins {spread:?} | {raw:.0} msg/s | {rate:.0} msg/s | {:.2}× raw, {:.2}× one replica | spread ≤ ⌈12/{replicas}⌉ |",
            rate / raw,
            rate / single
        );
    }
    if part("view") {
        let (keygate, listed, infos) = group_view(&http, &nats, &js).await;
        println!(
            "| group GET, 100 members, 3 replicas: p50 / p99 | {:.1} / {:.1} ms (the consumer list); {:.1} / {:.1} ms (100 consumer infos at once) | {:.1} / {:.1} ms | {:.2}× the list, {:.2}× the infos at p99 | p99 ≤ 20 ms |",
            listed[0],
            listed[1],
            infos[0],
            infos[1],
            keygate[0],
            keygate[1],
            keygate[1] / listed[1],
            keygate[1] / infos[1]
        );
    }
    for (name, after_traffic) in [("idle", false), ("quiet", true)] {
        if !part(name) {
            continue;
        }
        let IdleRun { costs, consumers, pins, dashboard } = idle_members(&http, after_traffic).await;
        let state = if after_traffic { "quiet after traffic, pins spread" } else { "never had a message, no pins" };
        for (i, c) in costs.iter().enumerate() {
            println!(
                "| {name}: 100 groups × 10 webhook members ({state}), keygate {i} of 3, {} pins: CPU, RSS; tasks and NATS subscriptions at the window's start → end | | {:.2}% of a core, {:.1} MiB; tasks {:.0} → {:.0}, subscriptions {} → {} | | ≤ 2% CPU, ≤ 150 MB, no growth |",
                pins[i], c.cpu, c.rss, c.tasks[0], c.tasks[1], c.subscriptions[0], c.subscriptions[1]
            );
        }
        println!(
            "| {name}: the server's consumers (members' and KV watches') at the window's start → end | | {} → {} | | no growth |",
            consumers[0], consumers[1]
        );
        println!(
            "| {name}: a dashboard refresh of the 100 groups (streams, their groups, every view; 6 requests at once, as the page), median / slowest of {DASHBOARD_REFRESHES} | | {:.0} / {:.0} ms | | within the page's 2 s period |",
            dashboard[0], dashboard[1]
        );
    }
    server.stop().await;
    Ok(())
}
