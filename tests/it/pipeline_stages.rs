//! The two webhook stages of the pipeline the chaos and node-loss runs
//! drive (docs/pipelines.md): ORDERS-like → enrich → PAYMENTS-like → charge
//! → LEDGER, and the check of LEDGER at its end.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

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

/// LEDGER holds each order exactly once, and each key's entries in the
/// order of its orders (`by_key`, sorted); returns how many it holds.
pub async fn check_ledger(js: &async_nats::jetstream::Context, by_key: &HashMap<String, Vec<u64>>) -> usize {
    let mut stream = js.get_stream(LEDGER).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut ledger_by_key: HashMap<String, Vec<u64>> = HashMap::new();
    let mut seen: HashSet<u64> = HashSet::new();
    for seq in 1..=last {
        let Ok(message) = stream.get_raw_message(seq).await else { continue };
        let key = message.subject.rsplit('.').next().unwrap_or_default().to_owned();
        let order = serde_json::from_slice::<Value>(&message.payload).unwrap()["order"].as_u64().unwrap();
        assert!(seen.insert(order), "order {order} stored twice in LEDGER");
        ledger_by_key.entry(key).or_default().push(order);
    }
    for (key, orders) in by_key {
        assert_eq!(ledger_by_key.get(key), Some(orders), "key {key}: LEDGER entries against its orders");
    }
    seen.len()
}
