//! WebSocket and pull member benchmark: acked messages per second to one
//! client over 16 partitions (the WebSocket client acks each message as it
//! arrives; the pull client fetches up to 100 and acks each batch in one
//! request), beside a raw async-nats consumer with the same filters acking
//! each partition's messages serially in the same run, and a WebSocket
//! client joined with `batch=100` answering each batch frame in one
//! frame; then the memory
//! 1,000 idle member connections add to a keygate process.
//!
//! `cargo bench --bench websocket` (env `KEYGATE_BENCH_MESSAGES`, default 20000).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use keygate_testkit as support;

use support::{put, KeygateProcess, LocalNats, NatsEndpoint};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const PARTITIONS: u32 = 16;
const KEYS: u64 = 1000;
/// Messages per frame of the batched WebSocket client.
const BATCH: u32 = 100;
const IDLE_CONNECTIONS: usize = 1000;
/// Idle connections are measured spread over 100 members (10 instances
/// each: a pinned one and standbys) and over 1,000 members (one each).
const IDLE_MEMBER_COUNTS: [usize; 2] = [100, 1000];

/// `n` messages over `KEYS` keys, published raw (the stream is stamped by keygate's PUT).
async fn fill(js: &jetstream::Context, subject_prefix: &str, n: u64) {
    let mut acks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let ack = js.publish(format!("{subject_prefix}.k{}", i % KEYS), Bytes::from(format!("{{\"n\":{i}}}"))).await;
        acks.push(ack.unwrap());
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// A stream `name` with `n` messages waiting, and a group `g` over it with one member `m`.
async fn backlog_group(kg: &KeygateProcess, http: &reqwest::Client, js: &jetstream::Context, name: &str, n: u64) {
    let prefix = name.to_lowercase();
    let stream = json!({"subjects":[format!("{prefix}.*")],"partitions":PARTITIONS});
    put(http, format!("{}/v1/streams/{name}", kg.base), stream).await;
    fill(js, &prefix, n).await;
    let group = json!({"kind":"static","partitions":PARTITIONS,"members":["m"]});
    put(http, format!("{}/v1/streams/{name}/groups/g", kg.base), group).await;
}

async fn post_json(http: &reqwest::Client, url: String, body: Value) -> Value {
    http.post(url).json(&body).send().await.unwrap().json().await.unwrap()
}

/// Counts deliveries that came before an earlier one of their key.
#[derive(Default)]
struct Reorders {
    last_by_key: HashMap<String, u64>,
    count: u64,
}

impl Reorders {
    fn see(&mut self, message: &Value) {
        let key = message["key"].as_str().unwrap_or_default().to_owned();
        let seq = message["stream_seq"].as_u64().unwrap();
        let previous = self.last_by_key.entry(key).or_insert(0);
        if seq < *previous {
            self.count += 1;
        }
        *previous = seq;
    }
}

/// One WebSocket client acking every message as it arrives (with `batch`:
/// joined with `?batch=`, answering each batch frame with one results
/// frame); returns the rate from the first to the last message and the
/// reorders seen.
async fn keygate_ws(
    kg: &KeygateProcess,
    http: &reqwest::Client,
    js: &jetstream::Context,
    n: u64,
    batch: Option<u32>,
) -> (f64, u64) {
    let stream = if batch.is_some() { "WSB" } else { "WS" };
    backlog_group(kg, http, js, stream, n).await;
    let url = match batch {
        Some(size) => format!("{}?batch={size}", kg.ws(stream, "g", "m")),
        None => kg.ws(stream, "g", "m"),
    };
    let (mut socket, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await.unwrap();
    let mut received = 0u64;
    let mut reorders = Reorders::default();
    let mut first = None;
    let mut last = Instant::now();
    while received < n {
        let frame = tokio::time::timeout(Duration::from_secs(60), socket.next()).await.unwrap().unwrap().unwrap();
        let Message::Text(text) = frame else { continue };
        let mut value: Value = serde_json::from_str(text.as_str()).unwrap();
        let messages = match value["type"].as_str() {
            Some("message") => vec![value],
            Some("batch") => value["messages"].take().as_array().cloned().unwrap_or_default(),
            _ => continue,
        };
        let now = Instant::now();
        first.get_or_insert(now);
        last = now;
        received += messages.len() as u64;
        messages.iter().for_each(|message| reorders.see(message));
        let answer = if batch.is_some() {
            let results: Vec<Value> = messages.iter().map(|m| json!({"id": m["id"], "status": "ack"})).collect();
            json!({"type": "results", "results": results})
        } else {
            json!({"type": "ack", "id": messages[0]["id"]})
        };
        socket.send(Message::Text(answer.to_string().into())).await.unwrap();
    }
    let _ = socket.close(None).await;
    ((n - 1) as f64 / (last - first.unwrap()).as_secs_f64(), reorders.count)
}

/// One pull client: fetch up to 100, ack them in one request, again;
/// returns the rate from the first fetched message to the last ack and the
/// reorders seen.
async fn keygate_pull(kg: &KeygateProcess, http: &reqwest::Client, js: &jetstream::Context, n: u64) -> (f64, u64) {
    backlog_group(kg, http, js, "PULL", n).await;
    let member = format!("{}/v1/streams/PULL/groups/g/members/m", kg.base);
    let mut received = 0u64;
    let mut reorders = Reorders::default();
    let mut first = None;
    let mut last = Instant::now();
    while received < n {
        let answer = post_json(http, format!("{member}/fetch"), json!({"max_messages": 100, "wait_ms": 5000})).await;
        let messages = answer["messages"].as_array().cloned().unwrap_or_default();
        if messages.is_empty() {
            continue;
        }
        first.get_or_insert_with(Instant::now);
        messages.iter().for_each(|message| reorders.see(message));
        let ack_ids: Vec<&Value> = messages.iter().map(|m| &m["ack_id"]).collect();
        let settled = post_json(http, format!("{member}/acks"), json!({"ack": ack_ids})).await;
        assert_eq!(settled["failed"], json!([]), "every ack lands");
        received += messages.len() as u64;
        last = Instant::now();
    }
    ((n - 1) as f64 / (last - first.unwrap()).as_secs_f64(), reorders.count)
}

/// The baseline: the member's consumer config by hand (one filter per
/// partition), one lane per partition acking its messages serially.
async fn raw_ordered(js: &jetstream::Context, http: &reqwest::Client, base: &str, n: u64) -> f64 {
    put(http, format!("{base}/v1/streams/RAW"), json!({"subjects":["raw.*"],"partitions":PARTITIONS})).await;
    fill(js, "raw", n).await;
    let consumer = support::baseline_consumer(js, "RAW", PARTITIONS, true).await;
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<Instant>(4096);
    let pump = support::serial_lanes(consumer, PARTITIONS, move |message: jetstream::Message| {
        let done = done_tx.clone();
        async move {
            message.ack_with(AckKind::Ack).await.unwrap();
            let _ = done.send(Instant::now()).await;
        }
    })
    .await;
    let (mut first, mut last) = (None, Instant::now());
    for _ in 0..n {
        let at = tokio::time::timeout(Duration::from_secs(60), done_rx.recv()).await.unwrap().unwrap();
        first.get_or_insert(at);
        last = at;
    }
    pump.abort();
    (n - 1) as f64 / (last - first.unwrap()).as_secs_f64()
}

/// RSS of a fresh keygate process before and after 1,000 idle member
/// connections spread over `member_count` members.
async fn idle_connections(nats: &NatsEndpoint, http: &reqwest::Client, member_count: usize) -> (f64, f64) {
    let kg = KeygateProcess::for_bench(nats, None);
    kg.wait_ready(http).await;
    let members: Vec<String> = (0..member_count).map(|i| format!("m{i}")).collect();
    let stream = format!("IDLE{member_count}");
    let subjects = json!([format!("idle{member_count}.*")]);
    put(http, format!("{}/v1/streams/{stream}", kg.base), json!({"subjects":subjects,"partitions":member_count})).await;
    put(
        http,
        format!("{}/v1/streams/{stream}/groups/g", kg.base),
        json!({"kind":"static","partitions":member_count,"members":members}),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = kg.rss_mib();
    let mut sockets = Vec::with_capacity(IDLE_CONNECTIONS);
    for i in 0..IDLE_CONNECTIONS {
        let (mut socket, _) =
            tokio_tungstenite::connect_async(kg.ws(&stream, "g", &members[i % member_count])).await.unwrap();
        // Each connection is joined once it has its assignment.
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(30), socket.next()).await.unwrap().unwrap().unwrap();
            if let Message::Text(text) = frame {
                if text.as_str().contains("\"assigned\"") {
                    break;
                }
            }
        }
        sockets.push(socket);
    }
    // Idle: nothing published; keep answering pings by reading in the background.
    let readers: Vec<_> = sockets
        .into_iter()
        .map(|mut s| tokio::spawn(async move { while let Some(Ok(_)) = s.next().await {} }))
        .collect();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = kg.rss_mib();
    for r in readers {
        r.abort();
    }
    drop(kg);
    (before, after)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: u64 = support::env_or("KEYGATE_BENCH_MESSAGES", 20_000);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let server = LocalNats::start().await?;
    let kg = KeygateProcess::for_bench(&server.endpoint(), None);
    kg.wait_ready(&http).await;
    let nats = server.endpoint().connect().await?;
    let js = keygate::nats::connect::jetstream(nats, Duration::from_secs(10));

    println!(
        "keygate WebSocket member benchmark ({n} messages backlog, {PARTITIONS} partitions, {KEYS} keys, loopback)"
    );
    println!(
        "| measure | raw async-nats (member's filters, serial per partition) | keygate WebSocket | ratio | target |"
    );
    println!("|---|---|---|---|---|");
    let raw = raw_ordered(&js, &http, &kg.base, n).await;
    let (rate, reorders) = keygate_ws(&kg, &http, &js, n, None).await;
    println!(
        "| acked messages/s, one client | {raw:.0} msg/s | {rate:.0} msg/s | {:.2}× | ≥ 10,000 msg/s |",
        rate / raw
    );
    assert_eq!(reorders, 0, "no per-key reorder");
    let (batched, reorders) = keygate_ws(&kg, &http, &js, n, Some(BATCH)).await;
    println!(
        "| acked messages/s, one client, batch frames of {BATCH} (one results frame each) | {raw:.0} msg/s | {batched:.0} msg/s | {:.2}× (batched / unbatched: {:.2}×) | batched ≥ 1.5× unbatched |",
        batched / raw,
        batched / rate
    );
    assert_eq!(reorders, 0, "no per-key reorder");
    let (pulled, reorders) = keygate_pull(&kg, &http, &js, n).await;
    println!(
        "| acked messages/s, one pull client (fetch 100, batch acks) | {raw:.0} msg/s | {pulled:.0} msg/s | {:.2}× (pull / WebSocket: {:.2}×) | pull ≥ 0.8× WebSocket |",
        pulled / raw,
        pulled / rate
    );
    assert_eq!(reorders, 0, "no per-key reorder");
    drop(kg);
    for member_count in IDLE_MEMBER_COUNTS {
        let (before, after) = idle_connections(&server.endpoint(), &http, member_count).await;
        println!(
            "| RSS with {IDLE_CONNECTIONS} idle member connections ({member_count} members), fresh process | | {before:.1} → {after:.1} MiB (+{:.1} MiB = {:.1} MB) | | ≤ +50 MB |",
            after - before,
            (after - before) * 1.048_576
        );
    }
    server.stop().await;
    Ok(())
}
