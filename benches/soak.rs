//! Soak: one keygate process (release build) under a steady load for
//! `KEYGATE_SOAK_MINUTES` (default 10) at `KEYGATE_SOAK_RATE` messages/s
//! (default 500), each published with its own REST request over 1,000 keys
//! to a 16-partition stream read by a webhook group (two members) and a
//! WebSocket member of a second group. Every minute it prints keygate's
//! memory, tasks, threads and file descriptors and the latency percentiles
//! of that minute; at the end, whether they stayed flat. Exits non-zero when
//! something grew or messages went missing.
//!
//! `scripts/soak [minutes]`, or `cargo bench --bench soak`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::Router;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use keygate_testkit as support;

use support::{env_or, put, KeygateProcess, LocalNats};

const PARTITIONS: u32 = 16;
const KEYS: u64 = 1000;

fn now_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64
}

/// Latencies (ms) gathered since the last minute's row, and running totals.
#[derive(Default)]
struct Samples {
    publish_ms: Vec<f64>,
    webhook_ms: Vec<f64>,
    socket_ms: Vec<f64>,
    published: u64,
    publish_errors: u64,
    webhook_deliveries: u64,
    socket_deliveries: u64,
}

type Shared = Arc<Mutex<Samples>>;

fn latency_of(payload: &[u8]) -> Option<f64> {
    let sent = serde_json::from_slice::<Value>(payload).ok()?["t"].as_u64()?;
    Some(now_micros().saturating_sub(sent) as f64 / 1000.0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (percentile(&v, 0.5), percentile(&v, 0.99), v.last().copied().unwrap_or(f64::NAN))
}

struct Row {
    rss_mib: f64,
    tasks: u64,
    threads: u64,
    fds: usize,
    webhook_p99: f64,
}

async fn alive_tasks(http: &reqwest::Client, base: &str) -> u64 {
    let Ok(r) = http.get(format!("{base}/metrics")).send().await else { return 0 };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("keygate_runtime_alive_tasks "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

/// A webhook receiver that answers 200 at once and records each message's latency.
async fn start_receiver(samples: Shared) -> String {
    let app = Router::new().fallback(move |body: Bytes| {
        let samples = samples.clone();
        async move {
            let mut s = samples.lock().unwrap();
            s.webhook_deliveries += 1;
            if let Some(ms) = latency_of(&body) {
                s.webhook_ms.push(ms);
            }
        }
    });
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// The WebSocket member: acks each message as it arrives.
async fn socket_member(url: String, samples: Shared) {
    let (socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    let (mut sink, mut stream) = socket.split();
    while let Some(Ok(frame)) = stream.next().await {
        let Message::Text(text) = frame else { continue };
        let Ok(frame) = serde_json::from_str::<Value>(text.as_str()) else { continue };
        if frame["type"] != "message" {
            continue;
        }
        {
            let mut s = samples.lock().unwrap();
            s.socket_deliveries += 1;
            if let Some(ms) = latency_of(frame["data"].to_string().as_bytes()) {
                s.socket_ms.push(ms);
            }
        }
        let ack = json!({"type": "ack", "id": frame["id"]}).to_string();
        if sink.send(Message::Text(ack.into())).await.is_err() {
            return;
        }
    }
}

/// Publishes `rate` messages per second, one request each, for `duration`.
async fn publish_steadily(http: reqwest::Client, base: String, rate: u64, duration: Duration, samples: Shared) {
    const TICK: Duration = Duration::from_millis(10);
    let per_tick = (rate as f64 * TICK.as_secs_f64()).max(1.0);
    let mut owed = 0.0;
    let mut tick = tokio::time::interval(TICK);
    let end = Instant::now() + duration;
    let mut n: u64 = 0;
    let url = format!("{base}/v1/streams/SOAK/messages");
    while Instant::now() < end {
        tick.tick().await;
        owed += per_tick;
        while owed >= 1.0 {
            owed -= 1.0;
            n += 1;
            let (http, url, samples) = (http.clone(), url.clone(), samples.clone());
            let body = json!({"key": format!("k{}", n % KEYS), "data": {"t": now_micros(), "n": n}});
            tokio::spawn(async move {
                let started = Instant::now();
                let ok = http.post(url).json(&body).send().await.is_ok_and(|r| r.status().is_success());
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                let mut s = samples.lock().unwrap();
                if ok {
                    s.published += 1;
                    s.publish_ms.push(ms);
                } else {
                    s.publish_errors += 1;
                }
            });
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let minutes = env_or("KEYGATE_SOAK_MINUTES", 10).max(2);
    let rate = env_or("KEYGATE_SOAK_RATE", 500);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
    let server = LocalNats::start().await?;
    let kg = KeygateProcess::for_bench(&server.endpoint(), None);
    kg.wait_ready(&http).await;
    let base = kg.base.clone();
    put(&http, format!("{base}/v1/streams/SOAK"), json!({"subjects":["soak.*"],"partitions":PARTITIONS})).await;
    for (group, members) in [("hooks", json!(["m1", "m2"])), ("socket", json!(["w1"]))] {
        let body = json!({"kind":"static","partitions":PARTITIONS,"members":members});
        put(&http, format!("{base}/v1/streams/SOAK/groups/{group}"), body).await;
    }
    let samples: Shared = Arc::default();
    let hook = start_receiver(samples.clone()).await;
    for member in ["m1", "m2"] {
        put(&http, format!("{base}/v1/streams/SOAK/groups/hooks/members/{member}/webhook"), json!({"url": hook})).await;
    }
    tokio::spawn(socket_member(kg.ws("SOAK", "socket", "w1"), samples.clone()));

    println!(
        "keygate soak: {minutes} min at {rate} msg/s (one REST publish each), {PARTITIONS} partitions, {KEYS} keys; \
         a webhook group of two members and a WebSocket member read every message"
    );
    println!(
        "| minute | published | publish p50 / p99 ms | webhook p50 / p99 / max ms | WebSocket p50 / p99 / max ms | RSS MiB | tasks | threads | fds |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let publisher = tokio::spawn(publish_steadily(
        http.clone(),
        base.clone(),
        rate,
        Duration::from_secs(minutes * 60),
        samples.clone(),
    ));
    let mut rows = Vec::new();
    for minute in 1..=minutes {
        tokio::time::sleep(Duration::from_secs(60)).await;
        let (publish, webhook, socket, published) = {
            let mut s = samples.lock().unwrap();
            (
                std::mem::take(&mut s.publish_ms),
                std::mem::take(&mut s.webhook_ms),
                std::mem::take(&mut s.socket_ms),
                s.published,
            )
        };
        let (p50, p99, _) = summary(publish);
        let (w50, w99, wmax) = summary(webhook);
        let (s50, s99, smax) = summary(socket);
        let row = Row {
            rss_mib: kg.rss_mib(),
            tasks: alive_tasks(&http, &base).await,
            threads: kg.threads(),
            fds: kg.open_fds(),
            webhook_p99: w99,
        };
        println!(
            "| {minute} | {published} | {p50:.2} / {p99:.2} | {w50:.1} / {w99:.1} / {wmax:.0} | {s50:.1} / {s99:.1} / {smax:.0} | {:.1} | {} | {} | {} |",
            row.rss_mib, row.tasks, row.threads, row.fds
        );
        rows.push(row);
    }
    publisher.await?;
    // Let the last messages arrive.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (published, errors, hooked, socketed) = {
        let s = samples.lock().unwrap();
        (s.published, s.publish_errors, s.webhook_deliveries, s.socket_deliveries)
    };

    // Minute 1 is warm-up; later minutes are compared with minute 2.
    let steady = &rows[1..];
    let first = &steady[0];
    let last = steady.last().unwrap();
    let peak_rss = steady.iter().map(|r| r.rss_mib).fold(0.0, f64::max);
    let mut p99s: Vec<f64> = steady.iter().map(|r| r.webhook_p99).collect();
    p99s.sort_by(f64::total_cmp);
    let median_p99 = percentile(&p99s, 0.5);
    let checks = [
        (
            "memory flat (last within 10% or 8 MiB of minute 2)",
            last.rss_mib <= (first.rss_mib * 1.10).max(first.rss_mib + 8.0),
        ),
        ("tasks flat (last ≤ minute 2 + 16)", last.tasks <= first.tasks + 16),
        ("threads flat (last ≤ minute 2 + 4)", last.threads <= first.threads + 4),
        ("file descriptors flat (last ≤ minute 2 + 16)", last.fds <= first.fds + 16),
        (
            "webhook p99 stable (every minute ≤ 3× the median minute)",
            steady.iter().all(|r| r.webhook_p99 <= 3.0 * median_p99),
        ),
        ("nothing missing (every published message reached both groups)", hooked >= published && socketed >= published),
    ];
    println!();
    println!(
        "published {published} ({errors} refused), webhook deliveries {hooked}, WebSocket deliveries {socketed}; \
         RSS minute 2 {:.1} MiB, last {:.1} MiB, peak {peak_rss:.1} MiB; tasks {} → {}; fds {} → {}",
        first.rss_mib, last.rss_mib, first.tasks, last.tasks, first.fds, last.fds
    );
    println!("| check | result |");
    println!("|---|---|");
    for (check, ok) in &checks {
        println!("| {check} | {} |", if *ok { "yes" } else { "**no**" });
    }
    drop(kg);
    server.stop().await;
    if checks.iter().all(|(_, ok)| *ok) {
        Ok(())
    } else {
        anyhow::bail!("the soak found growth or loss (table above)")
    }
}
