//! Pipelines (docs/pipelines.md): a webhook's answer names messages to
//! publish, keygate stores them with ids derived from the delivered message
//! before it acks it, and refuses answers it cannot publish whole. Against
//! a real nats-server.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;
use serde_json::{json, Value};

use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(30);
/// Longer than any test registration's redelivery horizon.
const WINDOW_MS: u64 = 600_000;

/// ORDERS (the source, 4 partitions) and PAYMENTS (a target with a long
/// duplicate window), a key-ordered static group g of m1 on ORDERS.
async fn pipeline(app: &TestApp) {
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":4})).await;
    app.create_stream("PAYMENTS", json!({"subjects":["payments.*"],"partitions":4,"duplicate_window_ms":WINDOW_MS}))
        .await;
    let group = json!({"kind":"static","partitions":4,"members":["m1"],"ack_wait_ms":5000});
    let (status, view) = app.put("/v1/streams/ORDERS/groups/g", group).await;
    assert_eq!(status, 201, "{view}");
}

async fn hook(app: &TestApp, receiver: &Receiver, outputs: Value) {
    let body = json!({"url": receiver.url("/m1"), "outputs": outputs, "max_attempts": 2, "timeout_ms": 5000,
        "backoff": {"initial_ms": 100, "max_ms": 200}});
    let (status, view) = app.put("/v1/streams/ORDERS/groups/g/members/m1/webhook", body).await;
    assert_eq!(status, 201, "{view}");
    assert_eq!(view["outputs"], outputs, "{view}");
}

/// Publishes `rounds` messages of every key; key → sequences.
async fn publish(app: &TestApp, keys: &[&str], rounds: u64) -> HashMap<String, Vec<u64>> {
    let messages: Vec<Value> =
        (0..rounds).flat_map(|n| keys.iter().map(move |k| json!({"key": k, "data": {"n": n}}))).collect();
    let (status, acks) = app.post("/v1/streams/ORDERS/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 200, "{acks}");
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    for ack in acks["results"].as_array().unwrap() {
        published.entry(ack["key"].as_str().unwrap().to_owned()).or_default().push(ack["seq"].as_u64().unwrap());
    }
    published
}

/// A 2xx JSON answer publishing `outputs`.
fn answer(outputs: Value) -> Answer {
    Answer { body: json!({ "publish": outputs }).to_string(), ..Answer::ok() }
        .header("content-type", "application/json")
}

/// One payment per order: same key, the order's sequence in the data.
fn payment(request: &Recorded) -> Value {
    json!({"stream": "PAYMENTS", "key": request.key(), "data": {"order": request.seq()}})
}

/// Every message of a stream: (msg id, key's subject token, data), in stream order.
async fn stored(js: &jetstream::Context, stream: &str) -> Vec<(String, String, Value)> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut all = Vec::new();
    for seq in 1..=last {
        let Ok(message) = stream.get_raw_message(seq).await else { continue };
        let id = message.headers.get("Nats-Msg-Id").map(|v| v.to_string()).unwrap_or_default();
        let key = message.subject.rsplit('.').next().unwrap_or_default().to_owned();
        all.push((id, key, serde_json::from_slice(&message.payload).unwrap_or(Value::Null)));
    }
    all
}

/// A stream's messages (as [`stored`] reads them) once it holds `count`.
async fn stored_once(app: &TestApp, stream: &str, count: usize) -> Vec<(String, String, Value)> {
    eventually(WAIT, || async {
        let all = stored(&app.js, stream).await;
        (all.len() == count).then_some(all)
    })
    .await
}

/// Outputs the target streams dropped as duplicates, by the metric (`None`
/// before the first).
async fn duplicate_outputs(app: &TestApp) -> Option<f64> {
    let text = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let line = text.lines().find(|l| l.starts_with("keygate_outputs_published_total") && l.contains("duplicate"))?;
    line.rsplit(' ').next()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_are_stored_in_key_order_with_ids_a_replay_publishes_again_as_duplicates() {
    let app = TestApp::start().await;
    pipeline(&app).await;
    let receiver = Receiver::start(|request, _| answer(json!([payment(request)]))).await;
    hook(&app, &receiver, json!(["PAYMENTS"])).await;
    let mut events = app.nats.subscribe("keygate.events.ORDERS.g.m1.>").await.unwrap();
    let published = publish(&app, &["alice", "bob", "carol"], 10).await;
    let outputs = stored_once(&app, "PAYMENTS", 30).await;
    // Each output's id names the order it came from; each key's payments
    // are in its orders' order.
    for (key, seqs) in &published {
        let mine: Vec<&(String, String, Value)> = outputs.iter().filter(|(_, k, _)| k == key).collect();
        let orders: Vec<u64> = mine.iter().map(|(_, _, data)| data["order"].as_u64().unwrap()).collect();
        assert_eq!(&orders, seqs, "{key}'s payments in order");
        for (id, _, data) in mine {
            assert_eq!(id, &format!("ORDERS:g:{}:0", data["order"]), "the output's id derives from its order");
        }
    }
    // Stored before the ack: the outputs event comes before the ack's.
    let mut first_seen: HashMap<(String, u64), usize> = HashMap::new();
    let mut n = 0;
    while first_seen.len() < 60 {
        let event = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut events)).await.unwrap().unwrap();
        let event: Value = serde_json::from_slice(&event.payload).unwrap();
        let kind = event["type"].as_str().unwrap().to_owned();
        if kind == "message.published_outputs" || kind == "message.acked" {
            first_seen.entry((kind, event["seq"].as_u64().unwrap())).or_insert(n);
            n += 1;
        }
    }
    for seqs in published.values() {
        for seq in seqs {
            let outputs_at = first_seen[&("message.published_outputs".to_owned(), *seq)];
            assert!(outputs_at < first_seen[&("message.acked".to_owned(), *seq)], "seq {seq}: outputs after the ack");
        }
    }
    assert_eq!(app.metric("keygate_outputs_published_total").await, 30.0);

    // A replay delivers every order again; the answers publish the same
    // ids, which PAYMENTS's duplicate window drops.
    let (status, seek) = app.post("/v1/streams/ORDERS/groups/g/seek", json!({"to": {"seq": 1}})).await;
    assert_eq!(status, 200, "{seek}");
    eventually(WAIT, || async { (receiver.requests().iter().filter(|r| r.ok()).count() >= 60).then_some(()) }).await;
    eventually(WAIT, || async { (duplicate_outputs(&app).await? >= 30.0).then_some(()) }).await;
    assert_eq!(duplicate_outputs(&app).await, Some(30.0));
    assert_eq!(stored(&app.js, "PAYMENTS").await.len(), 30, "nothing stored twice");
    assert_eq!(app.metric(crate::support::ACKS_WITHOUT_VERDICT).await, 0.0);
}

/// An answer's outputs to a stream that stages atomic batches in memory
/// go as one atomic batch: stored at consecutive sequences even while other
/// keys' outputs are published at the same time. A replay's batch, whose
/// ids are all stored, is refused by the server and goes again message by
/// message, each answered as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_answers_outputs_to_an_in_memory_stream_go_as_one_atomic_batch() {
    let app = TestApp::start().await;
    pipeline(&app).await;
    let audit = json!({"subjects":["audit.*"],"storage":"memory","duplicate_window_ms":WINDOW_MS});
    app.create_stream("AUDIT", audit).await;
    let receiver = Receiver::start(|request, _| {
        let entry = |step: u64| json!({"stream": "AUDIT", "key": request.key(), "data": {"order": request.seq(), "step": step}});
        answer(json!([entry(0), entry(1), entry(2)]))
    })
    .await;
    hook(&app, &receiver, json!(["AUDIT"])).await;
    let keys: Vec<String> = (0..16).map(|k| format!("k{k}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    publish(&app, &keys, 5).await;
    let entries = eventually(WAIT, || async {
        let entries = stored(&app.js, "AUDIT").await;
        (entries.len() == 16 * 5 * 3).then_some(entries)
    })
    .await;
    for three in entries.chunks(3) {
        let orders: Vec<&Value> = three.iter().map(|(_, _, d)| &d["order"]).collect();
        let steps: Vec<&Value> = three.iter().map(|(_, _, d)| &d["step"]).collect();
        assert!(orders.iter().all(|o| *o == orders[0]), "one answer's outputs at consecutive sequences: {three:?}");
        assert_eq!(steps, [&json!(0), &json!(1), &json!(2)]);
        assert_eq!(three[2].0, format!("ORDERS:g:{}:2", orders[0]));
    }
    let (status, seek) = app.post("/v1/streams/ORDERS/groups/g/seek", json!({"to": {"seq": 1}})).await;
    assert_eq!(status, 200, "{seek}");
    eventually(WAIT, || async { (duplicate_outputs(&app).await? == 240.0).then_some(()) }).await;
    assert_eq!(stored(&app.js, "AUDIT").await.len(), 240, "nothing stored twice");
}

/// Each kind of answer keygate cannot publish whole is retried, then
/// dead-lettered with its reason; nothing of it is published, and the
/// key's next message follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_cannot_be_published_whole_are_dead_lettered_with_nothing_published() {
    let app = TestApp::start().await;
    pipeline(&app).await;
    app.create_stream("GONE", json!({"subjects":["gone.*"],"duplicate_window_ms":WINDOW_MS})).await;
    let big = "x".repeat(600 * 1024);
    let receiver = Receiver::start(move |request, _| {
        let body: Value = serde_json::from_slice(&request.body).unwrap();
        let good = payment(request);
        if body["n"] == 1 {
            return answer(json!([good]));
        }
        match request.key().as_str() {
            "undeclared" => answer(json!([good, {"stream": "LEDGER", "key": "x", "data": 1}])),
            "malformed" => answer(json!({"stream": "PAYMENTS"})),
            "many" => answer(Value::Array(vec![good; 101])),
            "large" => answer(json!([good, {"stream": "PAYMENTS", "key": "l", "data": big}, {"stream": "PAYMENTS", "key": "l", "data": big}])),
            "missing" => answer(json!([good, {"stream": "GONE", "key": "g", "data": 1}])),
            "wrong-subject" => answer(json!([good, {"stream": "PAYMENTS", "subject": "orders.x", "data": 1}])),
            _ => answer(json!([good])),
        }
    })
    .await;
    hook(&app, &receiver, json!(["GONE", "PAYMENTS"])).await;
    assert_eq!(app.delete("/v1/streams/GONE").await.0, 204);
    let kinds = ["undeclared", "malformed", "many", "large", "missing", "wrong-subject"];
    let published = publish(&app, &kinds, 2).await;
    let letters = eventually(WAIT, || async {
        let (_, page) = app.get("/v1/dead-letters?stream=ORDERS&group=g").await;
        let letters = page["dead_letters"].as_array()?.clone();
        (letters.len() == kinds.len()).then_some(letters)
    })
    .await;
    let reasons: HashMap<String, String> = letters
        .iter()
        .map(|l| (l["key"].as_str().unwrap().to_owned(), l["reason"].as_str().unwrap().to_owned()))
        .collect();
    let expected = [
        ("undeclared", "not among the declared outputs"),
        ("malformed", "publish list is not valid"),
        ("many", "at most 100"),
        ("large", "payload bytes"),
        ("missing", "GONE"),
        ("wrong-subject", "output 1 to PAYMENTS was refused"),
    ];
    for (key, words) in expected {
        let reason = &reasons[key];
        assert!(reason.contains(words) && reason.starts_with("gave up after 2 attempts"), "{key}: {reason}");
    }
    for letter in &letters {
        assert_eq!(letter["attempts"], 2, "{letter}");
    }
    // Only the second message of each key published: its one payment.
    let outputs = stored_once(&app, "PAYMENTS", kinds.len()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stored(&app.js, "PAYMENTS").await.len(), kinds.len(), "nothing of a refused answer is published");
    for (key, seqs) in &published {
        let orders: Vec<u64> =
            outputs.iter().filter(|(_, k, _)| k == key).map(|(_, _, d)| d["order"].as_u64().unwrap()).collect();
        assert_eq!(orders, vec![seqs[1]], "{key}: only the second order's payment");
    }
    // Each key's second order came after its first one's last attempt was answered.
    let requests = receiver.requests();
    for seqs in published.values() {
        let first_done = requests.iter().filter(|r| r.seq() == seqs[0]).filter_map(|r| r.answered).max().unwrap();
        let second_came = requests.iter().filter(|r| r.seq() == seqs[1]).map(|r| r.at).min().unwrap();
        assert!(second_came > first_done, "seq {} went before seq {} was settled", seqs[1], seqs[0]);
    }
    assert_eq!(app.metric(crate::support::ACKS_WITHOUT_VERDICT).await, 0.0);
}

#[tokio::test]
async fn registrations_are_refused_outputs_they_cannot_publish_effectively_once() {
    let app = TestApp::start().await;
    pipeline(&app).await;
    app.create_stream("SHORT", json!({"subjects":["short.*"],"duplicate_window_ms":1000})).await;
    let put = |body: Value| {
        let app = &app;
        async move { app.put("/v1/streams/ORDERS/groups/g/members/m1/webhook", body).await }
    };
    let url = "http://127.0.0.1:9/m1";
    let cases = [
        (json!({"url": url, "outputs": ["NOPE"]}), "stream NOPE does not exist"),
        (json!({"url": url, "outputs": ["SHORT"], "max_attempts": 2}), "drops duplicates for 1 s"),
        (json!({"url": url, "outputs": ["PAYMENTS"], "timeout_ms": 60_000}), "duplicate_window_ms of at least"),
        (json!({"url": url, "outputs": ["KV_keygate"]}), "own state"),
        (json!({"url": url, "outputs": ["not a name"]}), "invalid"),
    ];
    // PAYMENTS keeps duplicates 600 s: ten calls of 60 s and the default
    // backoff between them (183.5 s) outlast it.
    for (body, words) in cases {
        let (status, problem) = put(body.clone()).await;
        assert_eq!(status, 400, "{body}: {problem}");
        assert!(problem["detail"].as_str().unwrap_or_default().contains(words), "{body}: {problem}");
    }
    let many: Vec<String> = (0..17).map(|i| format!("S{i}")).collect();
    let (status, problem) = put(json!({"url": url, "outputs": many})).await;
    assert_eq!(status, 400, "{problem}");
    let (status, view) = put(json!({"url": url, "outputs": ["PAYMENTS", "PAYMENTS"], "max_attempts": 3})).await;
    assert_eq!(status, 201, "{view}");
    assert_eq!(view["outputs"], json!(["PAYMENTS"]));
}

/// A message frame's or fetched message's payment: same key, its sequence.
fn payment_of(message: &Value) -> Value {
    json!({"stream": "PAYMENTS", "key": message["key"], "data": {"order": message["stream_seq"]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_and_pull_clients_acks_publish_their_outputs_before_the_ack() {
    use crate::support::ws::{member_url, WsClient};
    let app = TestApp::start().await;
    pipeline(&app).await;
    app.create_stream("SHORT", json!({"subjects":["short.*"],"duplicate_window_ms":1000})).await;
    // Declared outputs are checked at the join as a registration's are.
    for (query, status) in [("outputs=NOPE", 400), ("outputs=SHORT", 400), ("outputs=KV_keygate", 400)] {
        let url = member_url(&app.base, "ORDERS", "g", "m1", query);
        assert_eq!(WsClient::connect_with(&url, &[]).await.err(), Some(status), "{query}");
    }
    let url = member_url(&app.base, "ORDERS", "g", "m1", "outputs=PAYMENTS&max_attempts=3");
    let mut socket = WsClient::connect(&url).await;
    let published = publish(&app, &["alice", "bob"], 1).await;
    for _ in 0..2 {
        let message = socket.next_of("message", WAIT).await;
        socket.send(json!({"type": "ack", "id": message["id"], "publish": [payment_of(&message)]})).await;
    }
    let payments = stored_once(&app, "PAYMENTS", 2).await;
    for (id, key, data) in &payments {
        assert_eq!(&vec![data["order"].as_u64().unwrap()], &published[key.as_str()], "{key}");
        assert_eq!(id, &format!("ORDERS:g:{}:0", data["order"]));
    }
    // The group view (and the dashboard from it) names the streams an instance publishes to.
    eventually(WAIT, || async {
        let (_, view) = app.get("/v1/streams/ORDERS/groups/g").await;
        (view["assignment"][0]["instances"][0]["outputs"] == json!(["PAYMENTS"])).then_some(())
    })
    .await;
    // An ack whose outputs name an undeclared stream is a retry: the same
    // message again, nothing published; then a plain ack settles it.
    publish(&app, &["carol"], 1).await;
    let message = socket.next_of("message", WAIT).await;
    let elsewhere = json!({"stream": "LEDGER", "key": "carol", "data": 1});
    socket.send(json!({"type": "ack", "id": message["id"], "publish": [elsewhere]})).await;
    let again = socket.next_of("message", WAIT).await;
    assert_eq!((&again["id"], &again["attempt"]), (&message["id"], &json!(2)), "{again}");
    socket.send(json!({"type": "ack", "id": again["id"]})).await;
    // Applied before the connection closes (a close would hand it to the pull client below).
    eventually(WAIT, || async {
        let info = app.js.get_stream("ORDERS").await.ok()?.consumer_info("g-m1").await.ok()?;
        (info.num_ack_pending == 0 && info.num_pending == 0).then_some(())
    })
    .await;
    socket.close().await;
    assert_eq!(stored(&app.js, "PAYMENTS").await.len(), 2, "nothing published for the refused ack");

    // A pull client: the first fetch declares the outputs; an ack entry
    // carries them.
    let fetch = json!({"outputs": ["PAYMENTS"], "max_attempts": 3, "wait_ms": 200});
    let published = publish(&app, &["dave"], 1).await;
    let message = eventually(WAIT, || async {
        let (status, answer) = app.post("/v1/streams/ORDERS/groups/g/members/m1/fetch", fetch.clone()).await;
        assert_eq!(status, 200, "{answer}");
        answer["messages"].as_array().and_then(|m| m.first().cloned())
    })
    .await;
    let acks = json!({"ack": [{"id": message["ack_id"], "publish": [payment_of(&message)]}]});
    let (status, answer) = app.post("/v1/streams/ORDERS/groups/g/members/m1/acks", acks).await;
    assert_eq!((status, &answer["settled"]), (200, &json!(1)), "{answer}");
    let payments = stored_once(&app, "PAYMENTS", 3).await;
    let (id, key, data) = &payments[2];
    assert_eq!((key.as_str(), data["order"].as_u64().unwrap()), ("dave", published["dave"][0]));
    assert_eq!(id, &format!("ORDERS:g:{}:0", published["dave"][0]));
    // The running instance declared PAYMENTS; a fetch naming others is refused.
    let (status, problem) =
        app.post("/v1/streams/ORDERS/groups/g/members/m1/fetch", json!({"outputs": [], "wait_ms": 0})).await;
    assert_eq!(status, 409, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("outputs PAYMENTS"), "{problem}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_webhooks_results_carry_each_messages_outputs() {
    let app = TestApp::start().await;
    pipeline(&app).await;
    let receiver = Receiver::start(|request, _| {
        let batch: Vec<Value> = serde_json::from_slice(&request.body).unwrap();
        let results: Vec<Value> =
            batch.iter().map(|m| json!({"id": m["id"], "status": "ack", "publish": [payment_of(m)]})).collect();
        Answer { body: json!({ "results": results }).to_string(), ..Answer::ok() }
            .header("content-type", "application/json")
    })
    .await;
    let body = json!({"url": receiver.url("/m1"), "outputs": ["PAYMENTS"], "max_attempts": 2, "timeout_ms": 5000,
        "backoff": {"initial_ms": 100, "max_ms": 200}, "batch": {"max_messages": 20}});
    let (status, view) = app.put("/v1/streams/ORDERS/groups/g/members/m1/webhook", body).await;
    assert_eq!(status, 201, "{view}");
    let published = publish(&app, &["alice", "bob", "carol"], 10).await;
    let payments = stored_once(&app, "PAYMENTS", 30).await;
    for (key, seqs) in &published {
        let orders: Vec<u64> =
            payments.iter().filter(|(_, k, _)| k == key).map(|(_, _, d)| d["order"].as_u64().unwrap()).collect();
        assert_eq!(&orders, seqs, "{key}'s payments in order");
    }
    assert!(receiver.requests().len() < 30, "batched: {} requests", receiver.requests().len());
    app.assert_no_acks_without_verdict().await;
}

#[tokio::test]
async fn declaring_or_acking_with_outputs_needs_the_publish_scope_of_each_stream() {
    use crate::auth::{call, scoped, start_with_secret};
    let app = start_with_secret().await;
    let admin = scoped("keygate:admin");
    for (path, body) in [
        ("/v1/streams/ORDERS", json!({"subjects":["orders.*"],"partitions":4})),
        ("/v1/streams/PAYMENTS", json!({"subjects":["payments.*"],"partitions":4,"duplicate_window_ms":WINDOW_MS})),
        ("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":4,"members":["m1"],"ack_wait_ms":5000})),
    ] {
        let (status, view) = call(&app, "PUT", path, Some(&admin), Some(body)).await;
        assert_eq!(status, 201, "{path}: {view}");
    }
    let fetch_path = "/v1/streams/ORDERS/groups/g/members/m1/fetch";
    let consumer = scoped("consume:ORDERS/g");
    let declared = json!({"outputs": ["PAYMENTS"], "wait_ms": 0});
    let (status, problem) = call(&app, "POST", fetch_path, Some(&consumer), Some(declared.clone())).await;
    assert_eq!(status, 403, "{problem}");
    // A client allowed to consume only cannot publish through an ack of an
    // instance someone else started with outputs.
    let both = scoped("consume:ORDERS/g publish:PAYMENTS");
    let (status, answer) = call(&app, "POST", fetch_path, Some(&both), Some(declared)).await;
    assert_eq!(status, 200, "{answer}");
    let (status, _) = call(&app, "POST", "/v1/streams/ORDERS/messages", Some(&admin), Some(json!({"key": "a"}))).await;
    assert_eq!(status, 200);
    let message = eventually(WAIT, || async {
        let (_, answer) = call(&app, "POST", fetch_path, Some(&consumer), Some(json!({"wait_ms": 200}))).await;
        answer["messages"].as_array().and_then(|m| m.first().cloned())
    })
    .await;
    let acks = json!({"ack": [{"id": message["ack_id"], "publish": [payment_of(&message)]}]});
    let acks_path = "/v1/streams/ORDERS/groups/g/members/m1/acks";
    let (status, problem) = call(&app, "POST", acks_path, Some(&consumer), Some(acks.clone())).await;
    assert_eq!(status, 403, "{problem}");
    let (status, answer) = call(&app, "POST", acks_path, Some(&both), Some(acks)).await;
    assert_eq!((status, &answer["settled"]), (200, &json!(1)), "{answer}");
    stored_once(&app, "PAYMENTS", 1).await;
}
