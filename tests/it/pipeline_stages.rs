//! The two webhook stages of the pipeline the chaos and node-loss runs
//! drive (docs/pipelines.md): ORDERS-like → enrich → PAYMENTS-like → charge
//! → LEDGER, and the check of LEDGER at its end.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

use crate::support::receiver::{Answer, Recorded};

/// The second stream, and the last.
pub const PAYMENTS: &str = "PAYMENTS";
pub const LEDGER: &str = "LEDGER";

/// The pipeline's duplicate windows: longer than its registrations'
/// redelivery horizon (50 calls of 5 s and the backoff between them: about
/// 5 minutes).
pub const WINDOW_MS: u64 = 3_600_000;

/// A stage's webhook registration: it may publish to `output`.
pub fn registration(url: String, output: &str) -> Value {
    json!({"url": url, "outputs": [output], "max_attempts": 50, "timeout_ms": 5000,
        "backoff": {"initial_ms": 100, "max_ms": 1000}})
}

/// One pipeline stage's answer: the next stage's message after `delay`,
/// or a 503 with Retry-After on the first attempt of every `fail_every`-th
/// message.
fn stage(request: &Recorded, earlier: usize, next: &str, order: u64, fail_every: u64, delay: Duration) -> Answer {
    if earlier == 0 && request.seq() % fail_every == 0 {
        return Answer::status(503).header("retry-after", "1");
    }
    let publish = json!([{"stream": next, "key": request.key(), "data": {"order": order}}]);
    Answer { body: json!({ "publish": publish }).to_string(), ..Answer::ok() }
        .header("content-type", "application/json")
        .after(delay)
}

/// The receiver of both webhook stages (paths `/enrich/…` publish to
/// PAYMENTS, others to LEDGER): an order's payment names the order by its
/// sequence in the first stream, and so does its ledger entry.
/// Each 2xx answer takes `delay`; the first attempt of every
/// `fail_every.0`-th message of the first stage and `fail_every.1`-th of
/// the second is answered 503 with Retry-After (each holds its key a
/// second).
pub fn answer(delay: Duration, fail_every: (u64, u64)) -> impl Fn(&Recorded, usize) -> Answer + Send + Sync + 'static {
    move |request, earlier| match request.path.starts_with("/enrich") {
        true => stage(request, earlier, PAYMENTS, request.seq(), fail_every.0, delay),
        false => {
            let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
            stage(request, earlier, LEDGER, body["order"].as_u64().unwrap_or(0), fail_every.1, delay)
        }
    }
}

/// Each key's messages in a pipeline stream, in stream order: (stream
/// sequence, the order each names).
pub type Entries = HashMap<String, Vec<(u64, u64)>>;

pub async fn stream_by_key(js: &async_nats::jetstream::Context, stream: &str) -> Entries {
    let mut stream = js.get_stream(stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut by_key = Entries::new();
    for seq in 1..=last {
        let Ok(message) = stream.get_raw_message(seq).await else { continue };
        let key = message.subject.rsplit('.').next().unwrap_or_default().to_owned();
        let order = serde_json::from_slice::<Value>(&message.payload).unwrap()["order"].as_u64().unwrap();
        by_key.entry(key).or_default().push((seq, order));
    }
    by_key
}

/// A stage's output stream whose entries of `key` do not follow its orders.
#[derive(Debug)]
pub struct Misordered {
    pub stream: &'static str,
    pub key: String,
    /// (stream sequence, order) of the key's entries, in stream order.
    pub found: Vec<(u64, u64)>,
    pub expected: Vec<u64>,
}

impl std::fmt::Display for Misordered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let found: Vec<String> = self.found.iter().map(|(seq, order)| format!("{order}@{seq}")).collect();
        write!(
            f,
            "key {}: {} entries (order@stream sequence) {} against its orders {:?}",
            self.key,
            self.stream,
            found.join(" "),
            self.expected
        )
    }
}

/// PAYMENTS (the first stage's outputs), then LEDGER (the second's), each
/// hold each order exactly once, and each key's entries in the order of its
/// orders (`by_key`, sorted); returns how many LEDGER holds, and PAYMENTS'
/// entries by key (what the second stage was to deliver in order).
pub async fn check_stage_outputs(
    js: &async_nats::jetstream::Context,
    by_key: &HashMap<String, Vec<u64>>,
) -> Result<(usize, Entries), Misordered> {
    let mut held = 0;
    let mut payments = HashMap::new();
    for stream in [PAYMENTS, LEDGER] {
        let entries = stream_by_key(js, stream).await;
        let mut seen: HashSet<u64> = HashSet::new();
        for (order, seq) in entries.values().flatten().map(|(seq, order)| (order, seq)) {
            assert!(seen.insert(*order), "order {order} stored twice in {stream} (the second at {seq})");
        }
        for (key, orders) in by_key {
            let found = entries.get(key).cloned().unwrap_or_default();
            if !found.iter().map(|(_, order)| order).eq(orders.iter()) {
                return Err(Misordered { stream, key: key.clone(), found, expected: orders.clone() });
            }
        }
        held = seen.len();
        if stream == PAYMENTS {
            payments = entries;
        }
    }
    Ok((held, payments))
}

/// Every event keygate published (`keygate.events.>`) while the test ran,
/// with when it arrived: what a failed order check prints about its key.
/// Events go over core NATS, so those sent while nats-server was away are
/// missing. Kept as sent (a parsed event takes several times the memory,
/// and a run of 100,000 orders sends about half a million).
#[derive(Clone, Default)]
pub struct EventLog(Arc<Mutex<Vec<(Instant, bytes::Bytes)>>>);

impl EventLog {
    pub async fn record(nats_url: &str) -> Self {
        let log = Self::default();
        let nats = async_nats::connect(nats_url).await.unwrap();
        let mut events = nats.subscribe("keygate.events.>").await.unwrap();
        nats.flush().await.unwrap();
        let kept = log.clone();
        tokio::spawn(async move {
            let _connection = nats;
            while let Some(event) = events.next().await {
                kept.0.lock().unwrap().push((Instant::now(), event.payload));
            }
        });
        log
    }

    /// With `KEYGATE_TEST_LOG_DIR` set (testkit/src/keygate.rs), writes
    /// every event so far to `events.jsonl` there, beside the processes'
    /// logs, each with its arrival in ms since the first.
    pub fn keep_in_log_dir(&self) {
        let Some(dir) = std::env::var_os("KEYGATE_TEST_LOG_DIR") else { return };
        let events = self.0.lock().unwrap();
        let Some(start) = events.first().map(|(at, _)| *at) else { return };
        let lines: Vec<String> = events
            .iter()
            .map(|(at, event)| {
                format!("{} {}", at.saturating_duration_since(start).as_millis(), String::from_utf8_lossy(event))
            })
            .collect();
        std::fs::write(std::path::Path::new(&dir).join("events.jsonl"), lines.join("\n")).unwrap();
    }
}

/// What both stages did with `key`, one line each in time order (ms from
/// the first): each webhook request (member, sequence, the order it
/// carries, attempt, fencing token, answer), each verdict event of the
/// key's messages (instance, attempt, reason), and each pin event of the
/// stages' members; and where the key's orders landed in PAYMENTS and
/// LEDGER.
pub fn key_history(key: &str, requests: &[Recorded], events: &EventLog, outputs: &[(&str, Entries)]) -> String {
    let order_of = |r: &Recorded| -> u64 {
        match r.path.starts_with("/enrich") {
            true => r.seq(),
            false => serde_json::from_slice::<Value>(&r.body).ok().and_then(|b| b["order"].as_u64()).unwrap_or(0),
        }
    };
    let mut lines: Vec<(Instant, String)> = Vec::new();
    for r in requests.iter().filter(|r| r.key() == key) {
        let answered = match r.answered {
            Some(t) => format!("answered {} after {} ms", r.status, t.saturating_duration_since(r.at).as_millis()),
            None => "never answered".to_owned(),
        };
        let line = format!(
            "request {} seq {} (order {}) attempt {} fencing {}: {answered}",
            r.path,
            r.seq(),
            order_of(r),
            r.attempt(),
            r.fencing()
        );
        lines.push((r.at, line));
    }
    // The key's stream sequences: its orders in ORDERS, its payments in PAYMENTS.
    let seqs: HashSet<(&str, u64)> = requests
        .iter()
        .filter(|r| r.key() == key)
        .map(|r| (if r.path.starts_with("/enrich") { "ORDERS" } else { PAYMENTS }, r.seq()))
        .collect();
    for (at, event) in events.0.lock().unwrap().iter() {
        let Ok(event) = serde_json::from_slice::<Value>(event) else { continue };
        let stream = event["stream"].as_str().unwrap_or_default();
        let kind = event["type"].as_str().unwrap_or_default();
        let about_key = event["seq"].as_u64().is_some_and(|seq| seqs.contains(&(stream, seq)));
        let pin = kind.starts_with("member.") && event["group"] != "socket";
        if about_key || pin {
            let mut fields = event.clone();
            for noise in ["type", "time", "stream"] {
                fields.as_object_mut().map(|o| o.remove(noise));
            }
            lines.push((*at, format!("event {kind} of {stream} {fields}")));
        }
    }
    lines.sort_by_key(|(at, _)| *at);
    let Some(start) = lines.first().map(|(at, _)| *at) else { return String::new() };
    let mut history: Vec<String> = lines
        .iter()
        .map(|(at, line)| format!("  {} ms {line}", at.saturating_duration_since(start).as_millis()))
        .collect();
    for (stream, entries) in outputs {
        let found: Vec<String> =
            entries.get(key).into_iter().flatten().map(|(seq, order)| format!("{order}@{seq}")).collect();
        history.push(format!("  {stream} holds (order@stream sequence): {}", found.join(" ")));
    }
    history.join("\n")
}
