//! Chaos under a pipeline (docs/pipelines.md): ORDERS → enrich webhook →
//! PAYMENTS → charge webhook → LEDGER, each stage a key-ordered group of
//! two members whose answers publish the next stage's message, some
//! answered 503 with Retry-After first, while three keygate processes are
//! SIGKILLed and restarted every few seconds and nats-server is restarted
//! once (file store). LEDGER must hold exactly one message per order, in
//! each key's order, and no ack may go without a verdict.
//!
//! `KEYGATE_PIPELINE_MESSAGES` (default 20000) sets the number of orders.
//! Run it alone: `cargo nextest run --run-ignored only chaos_pipeline --no-capture`
//! (`KEYGATE_TEST_LOG_DIR=<dir>` keeps each keygate's log).
//!
//! Not in `scripts/test`: CI's suite is at its time budget, and this run
//! adds over a minute. It found the handover barrier falling too early
//! (late acks of copies redelivered elsewhere: delivery/custody.rs and
//! docs/architecture.md, "Why lanes, the handover barrier and fencing
//! tokens"); the plain chaos run meets the same conditions in the suite (a
//! 20 ms receiver and 503s with Retry-After).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::chaos::{chaos_until, publish_all, start_replicas, Chaos, KEYS, KILL_EVERY};
use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::{http_client, NatsServer};

/// Everything must reach LEDGER within this time after publishing ends.
const DRAIN_LIMIT: Duration = Duration::from_secs(180);
/// Longer than the registrations' redelivery horizon (50 calls of 5 s and
/// the backoff between them: about 5 minutes).
const WINDOW_MS: u64 = 3_600_000;

/// One stage's answer: the next stage's message, or a 503 with Retry-After
/// on the first attempt of every `fail_every`-th message.
fn stage(request: &Recorded, earlier: usize, next: &str, order: u64, fail_every: u64) -> Answer {
    if earlier == 0 && request.seq() % fail_every == 0 {
        return Answer::status(503).header("retry-after", "1");
    }
    let publish = json!([{"stream": next, "key": request.key(), "data": {"order": order}}]);
    Answer { body: json!({ "publish": publish }).to_string(), ..Answer::ok() }
        .header("content-type", "application/json")
}

fn answer(request: &Recorded, earlier: usize) -> Answer {
    let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
    match request.path.as_str() {
        // An order's payment names the order by its ORDERS sequence.
        p if p.starts_with("/enrich") => stage(request, earlier, "PAYMENTS", request.seq(), 17),
        _ => stage(request, earlier, "LEDGER", body["order"].as_u64().unwrap_or(0), 13),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "over a minute of both cores: run by hand (module doc)"]
async fn a_pipeline_stores_each_order_once_in_key_order_while_keygate_and_nats_are_killed() {
    let messages: u64 = std::env::var("KEYGATE_PIPELINE_MESSAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let mut server = NatsServer::start();
    let http = http_client();
    let (mut processes, alive) = start_replicas(&server, &http).await;
    let base = processes[0].base.clone();
    let put = |path: String, body: Value| http.put(format!("{base}{path}")).json(&body).send();
    for (stream, subject) in [("ORDERS", "orders.*"), ("PAYMENTS", "payments.*"), ("LEDGER", "ledger.*")] {
        let body = json!({"subjects":[subject],"partitions":16,"duplicate_window_ms":WINDOW_MS});
        assert_eq!(put(format!("/v1/streams/{stream}"), body).await.unwrap().status(), 201);
    }
    let receiver = Receiver::start(answer).await;
    for (stream, group, output) in [("ORDERS", "enrich", "PAYMENTS"), ("PAYMENTS", "charge", "LEDGER")] {
        let body = json!({"kind":"static","partitions":16,"members":["m1","m2"],"ack_wait_ms":2000});
        assert_eq!(put(format!("/v1/streams/{stream}/groups/{group}"), body).await.unwrap().status(), 201);
        for member in ["m1", "m2"] {
            let hook = json!({"url": receiver.url(&format!("/{group}/{member}")), "outputs": [output],
                "max_attempts": 50, "timeout_ms": 5000, "backoff": {"initial_ms": 100, "max_ms": 1000}});
            let answer = put(format!("/v1/streams/{stream}/groups/{group}/members/{member}/webhook"), hook).await;
            assert_eq!(answer.unwrap().status(), 201);
        }
    }

    // Every event, to tell what happened when a check fails.
    let events: Arc<Mutex<Vec<(Instant, Value)>>> = Arc::default();
    let recorder = {
        let events = events.clone();
        let nats = async_nats::connect(server.url()).await.unwrap();
        let mut subscription = nats.subscribe("keygate.events.>").await.unwrap();
        tokio::spawn(async move {
            while let Some(event) = futures::StreamExt::next(&mut subscription).await {
                if let Ok(event) = serde_json::from_slice::<Value>(&event.payload) {
                    events.lock().unwrap().push((Instant::now(), event));
                }
            }
        })
    };
    let publisher = tokio::spawn(publish_all(http.clone(), alive.clone(), "ORDERS", messages));
    let Chaos { kills, nats_restarted, mut acks_without_verdict } =
        chaos_until(&mut processes, &mut server, &alive, &http, || publisher.is_finished()).await;
    let published = publisher.await.unwrap();
    let published_at = Instant::now();
    assert_eq!(published.len() as u64, messages);

    // Drain: LEDGER holds as many messages as there are orders (more would
    // be duplicates, which the check below names).
    let nats = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let deadline = Instant::now() + DRAIN_LIMIT;
    loop {
        let held = js.get_stream("LEDGER").await.unwrap().info().await.unwrap().state.messages;
        if held >= messages {
            break;
        }
        if Instant::now() >= deadline {
            let payments = js.get_stream("PAYMENTS").await.unwrap().info().await.unwrap().state.messages;
            let base = alive.lock().unwrap().iter().flatten().next().cloned().unwrap_or_default();
            for group in ["ORDERS/groups/enrich", "PAYMENTS/groups/charge"] {
                let view = http.get(format!("{base}/v1/streams/{group}")).send().await.unwrap().text().await.unwrap();
                println!("{group}: {view}");
            }
            let dead = js
                .get_stream("KEYGATE_DEAD_LETTERS")
                .await
                .map(|mut s| async move { s.info().await.map(|i| i.state.messages) });
            let dead = match dead {
                Ok(f) => f.await.unwrap_or(0),
                Err(_) => 0,
            };
            for (at, event) in events.lock().unwrap().iter() {
                if event["type"].as_str().is_some_and(|t| t.starts_with("member.") || t.starts_with("key.")) {
                    println!("  event at {:?}: {event}", at.duration_since(published_at));
                }
            }
            panic!("after {DRAIN_LIMIT:?} LEDGER holds {held} of {messages} orders (PAYMENTS {payments}, dead letters {dead})");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drained = published_at.elapsed();
    // Late duplicates would land now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for p in &processes {
        acks_without_verdict += p.acks_without_verdict(&http).await;
    }

    let entries = orders_in(&js, "LEDGER").await;
    let payments = orders_in(&js, "PAYMENTS").await;
    let mut times: HashMap<u64, usize> = HashMap::new();
    for (_, order) in &entries {
        *times.entry(*order).or_default() += 1;
    }
    let duplicates: usize = times.values().map(|n| n - 1).sum();
    let missing = published.iter().filter(|(_, seq)| !times.contains_key(seq)).count();
    let mut ledger_by_key: HashMap<&str, Vec<u64>> = HashMap::new();
    for (key, order) in &entries {
        ledger_by_key.entry(key.as_str()).or_default().push(*order);
    }
    let mut orders_by_key: HashMap<&str, Vec<u64>> = HashMap::new();
    for (key, seq) in &published {
        orders_by_key.entry(key.as_str()).or_default().push(*seq);
    }
    let reordered = orders_by_key
        .iter()
        .filter(|(key, orders)| {
            let mut sorted = orders.to_vec();
            sorted.sort_unstable();
            ledger_by_key.get(*key).is_some_and(|in_ledger| in_ledger != &sorted)
        })
        .count();
    if let Some((key, orders)) = orders_by_key.iter().find(|(key, orders)| ledger_by_key.get(*key) != Some(orders)) {
        let in_payments: Vec<u64> = payments.iter().filter(|(k, _)| k == key).map(|(_, o)| *o).collect();
        println!(
            "first reordered key {key}: ORDERS {orders:?}, PAYMENTS {in_payments:?}, LEDGER {:?}",
            ledger_by_key[key]
        );
        let start = receiver.requests().first().map(|r| r.at).unwrap();
        let member = receiver
            .requests()
            .iter()
            .find(|r| r.key() == *key)
            .map(|r| r.header("keygate-member").unwrap_or_default().to_owned())
            .unwrap_or_default();
        for (at, event) in events.lock().unwrap().iter() {
            let kind = event["type"].as_str().unwrap_or_default();
            let mine = event["seq"].as_u64().is_some_and(|s| orders.contains(&s));
            if event["group"] == "enrich" && event["member"] == member.as_str() && (mine || kind.starts_with("member."))
            {
                println!("  event at {:.3}: {event}", (*at - start).as_secs_f64());
            }
        }
        for r in receiver.requests().iter().filter(|r| r.key() == *key && r.path.starts_with("/enrich")) {
            println!(
                "  {} seq {} attempt {} fencing {} status {} at {:.3} answered {:?}",
                r.path,
                r.seq(),
                r.attempt(),
                r.fencing(),
                r.status,
                (r.at - start).as_secs_f64(),
                r.answered.map(|a| (a - start).as_secs_f64())
            );
        }
    }
    recorder.abort();
    let requests = receiver.requests();
    let retried = requests.iter().filter(|r| r.status == 503).count();
    println!("pipeline chaos summary");
    println!("| measure | result |");
    println!("|---|---|");
    println!("| orders published (2xx), keys | {messages}, {KEYS} |");
    println!("| keygate processes SIGKILLed and restarted | {kills} (every {KILL_EVERY:?}) |");
    println!("| nats-server restarts (file store) | {} |", u8::from(nats_restarted));
    println!("| webhook calls (both stages), answered 503 with Retry-After | {}, {retried} |", requests.len());
    println!("| LEDGER messages, missing orders, duplicates | {}, {missing}, {duplicates} |", entries.len());
    println!("| keys whose LEDGER order differs from ORDERS | {reordered} |");
    println!("| acks without a verdict | {acks_without_verdict} |");
    println!("| LEDGER complete after the last publish | {:.1} s |", drained.as_secs_f64());
    assert_eq!((missing, duplicates), (0, 0), "LEDGER holds each order exactly once");
    assert_eq!(reordered, 0, "each key's LEDGER entries in its orders' order");
    assert_eq!(acks_without_verdict, 0.0, "keygate_acks_without_verdict_total");
}

/// (key, order) of every message of `stream`, in stream order.
async fn orders_in(js: &async_nats::jetstream::Context, stream: &str) -> Vec<(String, u64)> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut entries = Vec::with_capacity(last as usize);
    for seq in 1..=last {
        let Ok(message) = stream.get_raw_message(seq).await else { continue };
        let key = message.subject.rsplit('.').next().unwrap_or_default().to_owned();
        let order = serde_json::from_slice::<Value>(&message.payload).unwrap()["order"].as_u64().unwrap();
        entries.push((key, order));
    }
    entries
}
