//! Batched webhook deliveries (docs/batched-deliveries.md): one
//! request carries many messages, the answer settles each, and each key's
//! order holds across retries and dead letters. Against a real nats-server.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::ws::{member_url, WsClient};
use crate::support::{eventually, http_client, KeygateProcess, NatsServer, TestApp};

const WAIT: Duration = Duration::from_secs(30);

/// A one-partition stream K and a key-ordered static group g of m1.
async fn one_partition(app: &TestApp) {
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":1})).await;
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":5000});
    let (status, view) = app.put("/v1/streams/K/groups/g", group).await;
    assert_eq!(status, 201, "{view}");
}

async fn hook(app: &TestApp, receiver: &Receiver, options: Value) -> Value {
    let mut body = json!({"url": receiver.url("/m1"), "backoff": {"initial_ms": 200, "max_ms": 1000}});
    body.as_object_mut().unwrap().extend(options.as_object().unwrap().clone());
    let (status, view) = app.put("/v1/streams/K/groups/g/members/m1/webhook", body).await;
    assert_eq!(status, 201, "{view}");
    view
}

/// Publishes `rounds` messages of every key, interleaved; key → sequences.
async fn publish(app: &TestApp, keys: &[&str], rounds: u64) -> HashMap<String, Vec<u64>> {
    let messages: Vec<Value> =
        (0..rounds).flat_map(|n| keys.iter().map(move |k| json!({"key": k, "data": {"n": n}}))).collect();
    let (status, acks) = app.post("/v1/streams/K/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 200, "{acks}");
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    for ack in acks["results"].as_array().unwrap() {
        published.entry(ack["key"].as_str().unwrap().to_owned()).or_default().push(ack["seq"].as_u64().unwrap());
    }
    published
}

fn items(request: &Recorded) -> Vec<Value> {
    serde_json::from_slice(&request.body).unwrap_or_else(|e| panic!("a batch is a JSON array: {e}"))
}

/// A 2xx whose body gives each message the status `status_of` says.
fn results(request: &Recorded, status_of: impl Fn(&Value) -> &'static str) -> Answer {
    let results: Vec<Value> =
        items(request).iter().map(|m| json!({"id": m["id"], "status": status_of(m), "delay_ms": 300})).collect();
    Answer { body: json!({ "results": results }).to_string(), ..Answer::ok() }
}

/// What a receiver that follows the contract counts as done, in order: a
/// message answered `ack` whose earlier messages of the same key in the
/// same request were all answered `ack` too (after a `retry` or `dead`,
/// the key's later messages of that request come again).
fn effective_acks(requests: &[Recorded], status_of: impl Fn(&Value) -> &'static str) -> HashMap<String, Vec<u64>> {
    effective_acks_of(requests.iter().filter(|r| r.ok()).map(items), status_of)
}

/// The same over batches as received (a webhook's bodies, a WebSocket's
/// `batch` frames).
fn effective_acks_of(
    batches: impl Iterator<Item = Vec<Value>>,
    status_of: impl Fn(&Value) -> &'static str,
) -> HashMap<String, Vec<u64>> {
    let mut done: HashMap<String, Vec<u64>> = HashMap::new();
    for batch in batches {
        let mut stopped: Vec<String> = Vec::new();
        for item in batch {
            let key = item["key"].as_str().unwrap().to_owned();
            if stopped.contains(&key) {
                continue;
            }
            match status_of(&item) {
                "ack" => done.entry(key).or_default().push(item["stream_seq"].as_u64().unwrap()),
                _ => stopped.push(key),
            }
        }
    }
    done
}

/// The dead-letter stream's messages, once it holds at least `count`.
async fn dead_letters_once(app: &TestApp, count: usize) -> Vec<(String, Vec<u8>, Option<async_nats::HeaderMap>)> {
    eventually(WAIT, || async {
        app.js.get_stream("KEYGATE_DEAD_LETTERS").await.ok()?;
        let letters = app.stream_messages("KEYGATE_DEAD_LETTERS").await;
        (letters.len() >= count).then_some(letters)
    })
    .await
}

fn status_by_key_and_attempt(item: &Value) -> &'static str {
    let n = item["data"]["n"].as_u64().unwrap();
    match (item["key"].as_str().unwrap(), n, item["attempt"].as_u64().unwrap()) {
        ("poison", _, _) => "dead",
        ("flaky", 1, 1 | 2) => "retry",
        _ => "ack",
    }
}

#[tokio::test]
async fn mixed_verdicts_settle_each_message_keep_key_order_and_dead_letter_exactly_the_dead_ones() {
    let app = TestApp::start().await;
    one_partition(&app).await;
    let receiver = Receiver::start(|r, _| results(r, status_by_key_and_attempt)).await;
    let view = hook(&app, &receiver, json!({"batch": {"max_messages": 20}})).await;
    assert_eq!(view["batch"], json!({"max_messages": 20}), "{view}");
    let published = publish(&app, &["poison", "flaky", "a", "b", "c"], 10).await;
    let expected: HashMap<String, Vec<u64>> =
        published.iter().filter(|(k, _)| *k != "poison").map(|(k, v)| (k.clone(), v.clone())).collect();
    let requests = eventually(WAIT, || async {
        let requests = receiver.requests();
        let done = effective_acks(&requests, status_by_key_and_attempt);
        expected.iter().all(|(k, seqs)| done.get(k).is_some_and(|d| d.len() >= seqs.len())).then_some(requests)
    })
    .await;
    assert!(requests.len() < 50, "{} requests for 50 messages: batched", requests.len());
    for request in &requests {
        assert_eq!(request.header("content-type"), Some("application/json"));
        assert!(request.header("webhook-signature").is_some(), "signed once per batch");
        let batch = items(request);
        assert!(batch.len() <= 20, "max_messages");
        let mut last: HashMap<String, u64> = HashMap::new();
        for item in &batch {
            let (key, seq) = (item["key"].as_str().unwrap().to_owned(), item["stream_seq"].as_u64().unwrap());
            assert!(
                last.insert(key.clone(), seq).is_none_or(|before| before < seq),
                "key {key}: out of order in a batch"
            );
            assert_eq!(item["id"], format!("K-{seq}"));
            for field in ["partition", "attempt", "fencing_token", "subject", "data"] {
                assert!(item.get(field).is_some(), "{field} in {item}");
            }
        }
    }
    let done = effective_acks(&requests, status_by_key_and_attempt);
    for (key, seqs) in &expected {
        assert_eq!(&done[key], seqs, "key {key}: each message done once, in order");
    }
    let poison = &published["poison"];
    let dead = dead_letters_once(&app, poison.len()).await;
    let seqs: Vec<u64> = dead
        .iter()
        .map(|(_, _, h)| h.as_ref().unwrap().get("keygate-stream-seq").unwrap().as_str().parse().unwrap())
        .collect();
    assert_eq!(&seqs, poison, "exactly the dead ones, one after another in key order");
    let reason = dead[0].2.as_ref().unwrap().get("keygate-reason").unwrap().to_string();
    assert!(reason.contains("dead"), "{reason}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(app.stream_messages("KEYGATE_DEAD_LETTERS").await.len(), poison.len(), "no other message dead-lettered");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn unusable_batch_answers_retry_the_whole_batch_with_the_reason_and_never_ack() {
    let app = TestApp::start().await;
    one_partition(&app).await;
    // Each attempt answers badly in another way; the fifth answers well.
    let receiver = Receiver::start(|r, _| {
        let batch = items(r);
        let attempt = batch[0]["attempt"].as_u64().unwrap();
        let id = |i: usize| batch[i % batch.len()]["id"].clone();
        let body = match attempt {
            1 => json!({"results": batch.iter().map(|m| json!({"id": m["id"], "status": "ack"})).chain([json!({"id": "K-999999", "status": "ack"})]).collect::<Vec<_>>()}).to_string(),
            2 => json!({"results": [{"id": id(0), "status": "ack"}, {"id": id(0), "status": "ack"}]}).to_string(),
            3 => "OK".to_owned(),
            4 => json!({"results": [{"id": id(0), "status": "ack"}]}).to_string(),
            _ => String::new(),
        };
        Answer { body, ..Answer::ok() }
    })
    .await;
    hook(&app, &receiver, json!({"batch": {"max_messages": 10}, "backoff": {"initial_ms": 1500, "max_ms": 1500}}))
        .await;
    let published = publish(&app, &["a"], 3).await;
    let reasons: std::sync::Mutex<Vec<String>> = std::sync::Mutex::default();
    let requests = eventually(WAIT, || async {
        let (_, view) = app.get("/v1/streams/K/groups/g").await;
        if let Some(error) = view["blocked"][0]["last_error"].as_str() {
            let mut reasons = reasons.lock().unwrap();
            if !reasons.iter().any(|r| r == error) {
                reasons.push(error.to_owned());
            }
        }
        let requests = receiver.requests();
        requests.iter().any(|r| items(r)[0]["attempt"] == 5 && r.ok()).then_some(requests)
    })
    .await;
    let reasons = reasons.into_inner().unwrap();
    for request in &requests {
        let seqs: Vec<u64> = items(request).iter().map(|m| m["stream_seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, published["a"], "every attempt is the whole batch again: nothing was acked by a bad answer");
    }
    assert_eq!(requests.len(), 5, "four bad answers, then one good");
    assert!(reasons.iter().any(|r| r.contains("unusable batch answer")), "{reasons:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(receiver.requests().len(), 5, "acked by the fifth answer");
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn a_failed_batch_is_retried_whole_and_cloudevents_batches_are_structured_events() {
    let app = TestApp::start().await;
    one_partition(&app).await;
    let receiver = Receiver::start(|r, _| match items(r)[0]["keygateattempt"].as_u64() {
        Some(1) => Answer::status(503).header("Retry-After", "1"),
        _ => Answer::ok(),
    })
    .await;
    hook(&app, &receiver, json!({"format": "cloudevents", "batch": {"max_messages": 100, "max_wait_ms": 300}})).await;
    let published = publish(&app, &["a", "b"], 5).await;
    let requests = eventually(WAIT, || async {
        let requests = receiver.requests();
        (requests.iter().filter(|r| r.ok()).map(|r| items(r).len()).sum::<usize>() >= 10).then_some(requests)
    })
    .await;
    let first = &requests[0];
    assert_eq!(first.header("content-type"), Some("application/cloudevents-batch+json"));
    assert_eq!(first.status, 503);
    let events = items(first);
    assert_eq!(events.len(), 10, "max_wait_ms let the whole backlog into one batch");
    let event = &events[0];
    assert_eq!(event["specversion"], "1.0");
    assert_eq!(event["source"], "keygate/K");
    assert_eq!(event["partitionkey"], "a");
    assert_eq!(event["id"], format!("K-{}", published["a"][0]));
    assert_eq!(event["data"], json!({"n": 0}));
    assert_eq!(event["keygatestreamseq"], published["a"][0]);
    let retried = &requests[1];
    assert!(retried.at - first.at >= Duration::from_millis(900), "Retry-After honoured for the whole batch");
    let ids = |r: &Recorded| items(r).iter().map(|e| e["id"].clone()).collect::<Vec<_>>();
    assert_eq!(ids(retried), ids(first), "the same messages again");
    // Each key's head was NAK'd (its attempt counts up); the messages behind
    // it were never sent back to the server, so theirs does not.
    let heads = [published["a"][0], published["b"][0]];
    for event in items(retried) {
        let head = heads.contains(&event["keygatestreamseq"].as_u64().unwrap());
        assert_eq!(event["keygateattempt"], if head { 2 } else { 1 }, "{event}");
    }
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn batch_options_are_checked() {
    let app = TestApp::start().await;
    one_partition(&app).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    for (batch, why) in [
        (json!({"max_messages": 0}), "max_messages"),
        (json!({"max_messages": 1001}), "max_messages"),
        (json!({"max_messages": 10, "max_bytes": 10}), "max_bytes"),
        (json!({"max_messages": 10, "max_wait_ms": 60000}), "max_wait_ms"),
        (json!({"max_messages": 10, "size": 1}), "size"),
        (json!({}), "max_messages"),
    ] {
        let body = json!({"url": receiver.url("/m1"), "batch": batch});
        let (status, problem) = app.put("/v1/streams/K/groups/g/members/m1/webhook", body).await;
        assert_eq!(status, 400, "{batch}: {problem}");
        assert!(problem["detail"].as_str().unwrap_or_default().contains(why), "{batch}: {problem}");
    }
    assert_eq!(app.get("/v1/streams/K/groups/g/members/m1/webhook").await.0, 404, "nothing stored");
}

/// Runs examples/batch-receiver/`file` with `program` on a free loopback
/// port as m1's batched webhook; what it printed once every message of
/// `keys` is settled.
async fn example_receiver(program: &str, file: &str) {
    let app = TestApp::start().await;
    one_partition(&app).await;
    let port = crate::support::free_port();
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let script = format!("{}/examples/batch-receiver/{file}", env!("CARGO_MANIFEST_DIR"));
    let mut child = tokio::process::Command::new(program)
        .args([script.as_str(), &port.to_string()])
        .env("KEYGATE_SECRET", secret)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    eventually(WAIT, || async { tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok() }).await;
    let hook = json!({"url": format!("http://127.0.0.1:{port}/"), "secret": secret,
        "batch": {"max_messages": 50}, "backoff": {"initial_ms": 200, "max_ms": 1000}});
    let (status, view) = app.put("/v1/streams/K/groups/g/members/m1/webhook", hook).await;
    assert_eq!(status, 201, "{view}");
    let mut messages: Vec<Value> = Vec::new();
    for n in 0..20 {
        for key in ["a", "b", "c"] {
            messages.push(json!({"key": key, "data": {"n": n}}));
        }
        messages.push(json!({"key": "p", "data": {"n": n, "poison": n == 5}}));
    }
    let (status, acks) = app.post("/v1/streams/K/messages/batch", json!({ "messages": messages })).await;
    assert_eq!(status, 200, "{acks}");
    let dead = eventually(WAIT, || async {
        app.js.get_stream("KEYGATE_DEAD_LETTERS").await.ok()?;
        let letters = app.stream_messages("KEYGATE_DEAD_LETTERS").await;
        (!letters.is_empty()).then_some(letters)
    })
    .await;
    let poisoned = dead[0].2.as_ref().unwrap().get("keygate-stream-seq").unwrap().to_string();
    assert_eq!(poisoned, acks["results"][23]["seq"].to_string(), "p's sixth message, dead-lettered");
    // 79 messages handled: p's later ones came again after its dead one.
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout);
    let mut printed: Vec<String> = Vec::new();
    let read = tokio::time::timeout(WAIT, async {
        use tokio::io::AsyncBufReadExt as _;
        let mut line = String::new();
        while printed.len() < 79 && lines.read_line(&mut line).await.unwrap() > 0 {
            printed.push(std::mem::take(&mut line));
        }
    });
    read.await.unwrap_or_else(|_| panic!("{printed:?}"));
    for key in ["a", "b", "c", "p"] {
        let ns: Vec<u64> = printed
            .iter()
            .filter(|l| l.starts_with(&format!("{key} #")))
            .map(|l| {
                serde_json::from_str::<Value>(l.split_once(": ").unwrap().1.trim()).unwrap()["n"].as_u64().unwrap()
            })
            .collect();
        let expected: Vec<u64> = (0..20).filter(|n| key != "p" || *n != 5).collect();
        assert_eq!(ns, expected, "{program}: key {key} handled once each, in order");
    }
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn the_python_example_receiver_works() {
    example_receiver("python3", "receiver.py").await;
}

#[tokio::test]
async fn the_node_example_receiver_works() {
    example_receiver("node", "receiver.mjs").await;
}

/// A batch cut off by a SIGKILL of the keygate delivering it is never
/// acked: the standby delivers it again, and every message is done, in
/// each key's order, with nothing lost.
#[tokio::test]
async fn a_batch_cut_by_a_keygate_sigkill_is_redelivered_without_loss() {
    let server = NatsServer::start();
    let http = http_client();
    let mut first = KeygateProcess::start(&server.url(), "keygate-a");
    first.wait_ready(&http).await;
    // Answers slowly, so that batches are in flight at the kill.
    let receiver = Receiver::start(|r, _| Answer { delay: Duration::from_millis(300), ..results(r, |_| "ack") }).await;
    let admin = TestApp::start_on(server.url()).await;
    let api = |path: &str| format!("{}{}", first.base, path);
    let put = |path: String, body: Value| http.put(path).json(&body).send();
    let stream = json!({"subjects":["k.*"],"partitions":4});
    assert_eq!(put(api("/v1/streams/K"), stream).await.unwrap().status(), 201);
    let group = json!({"kind":"static","partitions":4,"members":["m1"],"ack_wait_ms":2000});
    assert_eq!(put(api("/v1/streams/K/groups/g"), group).await.unwrap().status(), 201);
    let hook = json!({"url": receiver.url("/m1"), "batch": {"max_messages": 25}});
    assert_eq!(put(api("/v1/streams/K/groups/g/members/m1/webhook"), hook).await.unwrap().status(), 201);
    let keys: Vec<String> = (0..20).map(|k| format!("k{k}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let published = publish(&admin, &key_refs, 30).await;
    eventually(WAIT, || async { (!receiver.requests().is_empty()).then_some(()) }).await;
    first.kill();
    let all: usize = published.values().map(Vec::len).sum();
    let requests = eventually(Duration::from_secs(60), || async {
        let requests = receiver.requests();
        let done = effective_acks(&requests, |_| "ack");
        let distinct: usize =
            done.values().map(|seqs| seqs.iter().collect::<std::collections::HashSet<_>>().len()).sum();
        (distinct == all).then_some(requests)
    })
    .await;
    // Each key's messages, as the receiver saw them: the next one in the
    // key's order, or back to one already seen (the cut batch, again from
    // the first message its keygate had not acked); never a skip forward.
    let done = effective_acks(&requests, |_| "ack");
    for (key, seqs) in &published {
        let at = |seq: &u64| seqs.iter().position(|s| s == seq).unwrap();
        let seen: Vec<usize> = done[key].iter().map(at).collect();
        assert_eq!(seen[0], 0, "key {key} starts at its first message");
        for pair in seen.windows(2) {
            assert!(
                pair[1] == pair[0] + 1 || pair[1] <= pair[0],
                "key {key}: skipped from #{} to #{}",
                pair[0],
                pair[1]
            );
        }
        assert_eq!(seen.iter().max(), Some(&(seqs.len() - 1)), "key {key}: every message delivered");
    }
    let fencings: std::collections::BTreeSet<u64> = requests.iter().map(Recorded::fencing).collect();
    assert!(fencings.len() >= 2, "the standby delivered after the kill: {fencings:?}");
    assert_eq!(admin.metric("keygate_acks_without_verdict_total").await, 0.0);
}

/// A WebSocket member that joins with `batch` gets `batch` frames and
/// answers each in one `results` frame: mixed verdicts keep each key's
/// order and dead-letter exactly the dead ones, as for a webhook. Bad join
/// options are refused; a result for a message not waiting is an error.
#[tokio::test]
async fn a_websocket_member_with_batch_gets_batch_frames_and_answers_each_in_one_results_frame() {
    let app = TestApp::start().await;
    one_partition(&app).await;
    for bad in ["batch=0", "batch=1001", "batch_wait_ms=10", "batch=5&batch_wait_ms=10001"] {
        let url = member_url(&app.base, "K", "g", "m1", bad);
        assert_eq!(WsClient::connect_with(&url, &[]).await.err(), Some(400), "{bad}");
    }
    let published = publish(&app, &["poison", "flaky", "a", "b", "c"], 10).await;
    let expected: HashMap<String, Vec<u64>> =
        published.iter().filter(|(k, _)| *k != "poison").map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut client = WsClient::connect(&member_url(&app.base, "K", "g", "m1", "batch=20&max_in_flight=50")).await;
    let mut batches: Vec<Vec<Value>> = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let done = effective_acks_of(batches.iter().cloned(), status_by_key_and_attempt);
        if expected.iter().all(|(k, seqs)| done.get(k).is_some_and(|d| d.len() >= seqs.len())) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not all done within {WAIT:?}: {done:?}");
        let frame = client.next_of("batch", WAIT).await;
        let messages = frame["messages"].as_array().unwrap().clone();
        assert!((1..=20).contains(&messages.len()), "batch=20: {}", messages.len());
        let results: Vec<Value> = messages
            .iter()
            .map(|m| json!({"id": m["id"], "status": status_by_key_and_attempt(m), "delay_ms": 300}))
            .collect();
        client.send(json!({"type": "results", "results": results})).await;
        batches.push(messages);
    }
    assert!(batches.len() < 50, "{} batch frames for 50 messages", batches.len());
    for batch in &batches {
        let mut last: HashMap<&str, u64> = HashMap::new();
        for item in batch {
            let (key, seq) = (item["key"].as_str().unwrap(), item["stream_seq"].as_u64().unwrap());
            assert!(last.insert(key, seq).is_none_or(|before| before < seq), "key {key}: out of order in a batch");
            assert_eq!(item["id"], format!("K-{seq}"));
        }
    }
    let done = effective_acks_of(batches.iter().cloned(), status_by_key_and_attempt);
    for (key, seqs) in &expected {
        assert_eq!(&done[key], seqs, "key {key}: each message done once, in order");
    }
    client.send(json!({"type": "results", "results": [{"id": "K-999999", "status": "ack"}]})).await;
    let error = client.next_of("error", WAIT).await;
    assert!(error["error"].as_str().unwrap().contains("K-999999"), "{error}");
    let poison = &published["poison"];
    let dead = dead_letters_once(&app, poison.len()).await;
    assert_eq!(dead.len(), poison.len(), "exactly the dead ones");
    app.assert_no_acks_without_verdict().await;
}
