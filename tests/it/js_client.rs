//! The JavaScript client (clients/js/keygate.js, docs/js-client.md) in
//! headless Chromium against a live keygate: it publishes, joins a group
//! as a member and acks through its async iterator, and when every
//! connection is cut in the middle of a stream it reconnects with a
//! refreshed token and resumes: nothing is lost, each key's first
//! deliveries stay in order, and a message that comes twice says so with
//! its `attempt`. Against a real nats-server.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::demo::wait_for;
use crate::support::browser::Browser;
use crate::support::proxy::CuttableProxy;
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(30);

/// Installs `window.kg`: a client at `base` whose token function counts its
/// calls, a membership of JS/g/web that records every message and acks it
/// after 30 ms (a verdict its connection lost is counted, not sent), and
/// what the callbacks saw.
const JOIN: &str = r#"(async () => {
  const { KeygateClient, ConnectionLost } = await import("/client/keygate.js");
  const kg = window.kg = { received: [], pins: 0, tokenCalls: 0, states: [], lost: 0, errors: [] };
  kg.client = new KeygateClient({ baseUrl: location.origin, token: () => { kg.tokenCalls += 1; return null; } });
  const membership = kg.client.join("JS", "g", "web", {
    maxInFlight: 8, reconnectInitialMs: 100, reconnectMaxMs: 500,
    onPinned: () => { kg.pins += 1; },
    onState: (state) => kg.states.push(state),
    onError: (e) => kg.errors.push(e.error),
  });
  (async () => {
    for await (const m of membership) {
      kg.received.push({ id: m.id, key: m.key, seq: m.streamSeq, attempt: m.attempt, data: m.data });
      setTimeout(() => {
        try { m.ack(); } catch (e) { if (e instanceof ConnectionLost) kg.lost += 1; else kg.errors.push(String(e)); }
      }, 30);
    }
  })();
  return true;
})()"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_js_client_publishes_joins_and_resumes_in_key_order_through_a_reconnect() {
    let app = TestApp::start().await;
    app.create_stream("JS", json!({"subjects":["js.*"],"partitions":2})).await;
    let group = json!({"kind":"static","partitions":2,"members":["web"],"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/JS/groups/g", group).await.0, 201);
    let proxy = CuttableProxy::start(app.base.trim_start_matches("http://").to_owned()).await;
    let proxied = format!("http://127.0.0.1:{}", proxy.port);

    let mut browser = Browser::launch().await;
    browser.navigate(&format!("{proxied}/demo")).await;
    assert_eq!(browser.eval(JOIN).await, true);
    // Published by the client: a batch, then one more, over four keys.
    let published = browser
        .eval(
            r#"(async () => {
              const batch = await kg.client.publishBatch("JS",
                Array.from({ length: 19 }, (_, n) => ({ key: "abcd"[n % 4], data: { n } })));
              const one = await kg.client.publish("JS", { key: "d", data: { n: 19 } });
              let refused = null;
              try { await kg.client.publish("NOPE", { data: 1 }); } catch (e) { refused = [e.name, e.status, e.problem.type]; }
              return { seqs: batch.results.map((r) => r.seq).concat([one.seq]), refused };
            })()"#,
        )
        .await;
    assert_eq!(published["seqs"].as_array().unwrap().len(), 20, "{published}");
    assert_eq!(published["refused"][0], "KeygateError");
    assert_eq!(published["refused"][1], 404);

    // In the middle of the stream every connection is cut.
    wait_for(&mut browser, "kg.received.length >= 8").await;
    proxy.cut();
    for n in 20..40 {
        let key = ["a", "b", "c", "d"][n % 4];
        let (status, _) = app.post("/v1/streams/JS/messages", json!({"key": key, "data": {"n": n}})).await;
        assert_eq!(status, 200);
    }
    wait_for(&mut browser, "new Set(kg.received.map((m) => m.id)).size >= 40").await;
    eventually(WAIT, || async {
        let info = app.js.get_stream("JS").await.ok()?.consumer_info("g-web").await.ok()?;
        (info.ack_floor.stream_sequence == 40 && info.num_ack_pending == 0).then_some(())
    })
    .await;

    let seen = browser.eval("({ received: kg.received, pins: kg.pins, tokenCalls: kg.tokenCalls, states: kg.states, lost: kg.lost, errors: kg.errors })").await;
    let states: Vec<&str> = seen["states"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(states.contains(&"reconnecting") && states.last() == Some(&"open"), "{states:?}");
    assert!(seen["tokenCalls"].as_u64().unwrap() >= 3, "the token is asked for again on reconnect: {seen}");
    assert!(seen["pins"].as_u64().unwrap() >= 2, "pinned again after the reconnect: {seen}");
    assert_eq!(seen["errors"], json!([]));

    let mut first_seqs: HashMap<String, Vec<u64>> = HashMap::new();
    let mut attempts: HashMap<String, u64> = HashMap::new();
    for m in seen["received"].as_array().unwrap() {
        let (id, attempt) = (m["id"].as_str().unwrap().to_owned(), m["attempt"].as_u64().unwrap());
        match attempts.get(&id) {
            // Delivered again: only with a higher attempt.
            Some(before) => assert!(attempt > *before, "{id} came again as attempt {attempt} after {before}"),
            None => {
                first_seqs.entry(m["key"].as_str().unwrap().to_owned()).or_default().push(m["seq"].as_u64().unwrap())
            }
        }
        attempts.insert(id, attempt);
    }
    for (key, seqs) in &first_seqs {
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "key {key} out of order: {seqs:?}");
    }
    assert_eq!(first_seqs.values().map(Vec::len).sum::<usize>(), 40, "every message arrived");
    let again = seen["received"].as_array().unwrap().len() - 40;
    println!("js client: 40 messages, {again} delivered again after the cut, {} verdicts lost with it", seen["lost"]);
}

/// `subscribe()` serves a plain consumer: several messages out at once (no
/// key order), each acked through the iterator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_js_client_subscribes_to_a_plain_consumer_with_its_concurrency() {
    let app = TestApp::start().await;
    app.create_stream("JOBS", json!({"subjects":["jobs.*"]})).await;
    assert_eq!(app.put("/v1/streams/JOBS/consumers/workers", json!({"ack_wait_ms": 2000})).await.0, 201);
    let mut browser = Browser::launch().await;
    browser.navigate(&app.url("/demo")).await;
    let subscribed = browser
        .eval(
            r#"(async () => {
              const { KeygateClient } = await import("/client/keygate.js");
              const kg = window.kg = { received: [], held: 0, most: 0 };
              kg.client = new KeygateClient();
              const work = kg.client.subscribe("JOBS", "workers", "w1", { concurrency: 4 });
              (async () => {
                for await (const m of work) {
                  kg.received.push(m.id);
                  kg.held += 1;
                  kg.most = Math.max(kg.most, kg.held);
                  setTimeout(() => { kg.held -= 1; m.ack(); }, 100);
                }
              })();
              await kg.client.publishBatch("JOBS", Array.from({ length: 12 }, (_, n) => ({ data: { n } })));
              return true;
            })()"#,
        )
        .await;
    assert_eq!(subscribed, true);
    wait_for(&mut browser, "new Set(kg.received).size === 12").await;
    eventually(WAIT, || async {
        let info = app.js.get_stream("JOBS").await.ok()?.consumer_info("workers").await.ok()?;
        (info.ack_floor.stream_sequence == 12 && info.num_ack_pending == 0).then_some(())
    })
    .await;
    let most = browser.eval("kg.most").await.as_u64().unwrap();
    assert!((2..=4).contains(&most), "{most} messages held at once with concurrency 4");
}

/// `join(…, { batch })`: keygate sends `batch` frames and the client
/// answers each with one `results` frame once every message of it has a
/// verdict, while the iterator still yields one message at a time. A NAK'd
/// message comes back before the rest of its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_js_client_joins_with_batch_and_answers_each_batch_in_one_frame() {
    let app = TestApp::start().await;
    let keys = ["a", "b", "c", "d"];
    let messages: Vec<Value> = (0..40).map(|n| json!({"key": keys[n % 4], "data": {"n": n}})).collect();
    let mut browser = backlog_then_browser(&app, messages).await;
    let joined = browser
        .eval(
            r#"(async () => {
              const { KeygateClient } = await import("/client/keygate.js");
              const kg = window.kg = { received: [], sent: [], naked: false };
              const send = WebSocket.prototype.send;
              WebSocket.prototype.send = function (data) { kg.sent.push(JSON.parse(data).type); return send.call(this, data); };
              kg.client = new KeygateClient();
              const membership = kg.client.join("JS", "g", "web", { batch: 10, maxInFlight: 20 });
              (async () => {
                for await (const m of membership) {
                  kg.received.push({ id: m.id, key: m.key, seq: m.streamSeq });
                  if (m.key === "b" && !kg.naked) { kg.naked = true; m.nak(100); } else m.ack();
                }
              })();
              return true;
            })()"#,
        )
        .await;
    assert_eq!(joined, true);
    eventually(WAIT, || async {
        let info = app.js.get_stream("JS").await.ok()?.consumer_info("g-web").await.ok()?;
        (info.ack_floor.stream_sequence == 40 && info.num_ack_pending == 0).then_some(())
    })
    .await;
    let seen = browser.eval("({ received: kg.received, sent: kg.sent })").await;
    let sent: Vec<&str> = seen["sent"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(sent.iter().all(|t| *t == "results"), "verdicts go in results frames: {sent:?}");
    assert!(sent.len() < 40, "{} results frames for 40 messages and a retry", sent.len());
    // Each key's messages, by their last delivery (the one that counted),
    // are in order: what followed the NAK'd one came again after it.
    let received = seen["received"].as_array().unwrap();
    let mut last_delivery: HashMap<String, (String, usize)> = HashMap::new();
    for (at, m) in received.iter().enumerate() {
        last_delivery.insert(m["id"].as_str().unwrap().to_owned(), (m["key"].as_str().unwrap().to_owned(), at));
    }
    let mut by_key: HashMap<String, Vec<(u64, usize)>> = HashMap::new();
    for m in received {
        let (key, at) = &last_delivery[m["id"].as_str().unwrap()];
        by_key.entry(key.clone()).or_default().push((m["seq"].as_u64().unwrap(), *at));
    }
    for (key, mut deliveries) in by_key {
        deliveries.sort_unstable();
        deliveries.dedup();
        assert!(deliveries.windows(2).all(|w| w[0].1 < w[1].1), "key {key}: {deliveries:?}");
    }
    assert_eq!(last_delivery.len(), 40, "every message arrived");
}

/// A pipeline stage in a browser (docs/pipelines.md): a member that joined
/// with `outputs` acks each message with the message to publish, and
/// keygate stores it under an id derived from the message acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_js_client_acks_with_outputs_as_a_pipeline_stage() {
    let app = TestApp::start().await;
    app.create_stream("OUT", json!({"subjects":["out.*"],"partitions":2,"duplicate_window_ms":600_000})).await;
    let messages: Vec<Value> = (0..10).map(|n| json!({"key": format!("k{}", n % 3), "data": {"n": n}})).collect();
    let mut browser = backlog_then_browser(&app, messages).await;
    let joined = browser
        .eval(
            r#"(async () => {
              const { KeygateClient } = await import("/client/keygate.js");
              const membership = new KeygateClient().join("JS", "g", "web", { outputs: ["OUT"] });
              (async () => {
                for await (const m of membership) {
                  m.ack({ publish: [{ stream: "OUT", key: m.key ?? undefined, data: { from: m.streamSeq, n: m.data.n } }] });
                }
              })();
              return true;
            })()"#,
        )
        .await;
    assert_eq!(joined, true);
    let stored = eventually(WAIT, || async {
        let mut out = app.js.get_stream("OUT").await.ok()?;
        let count = out.info().await.ok()?.state.messages;
        if count < 10 {
            return None;
        }
        let mut stored = Vec::new();
        for seq in 1..=count {
            let message = out.get_raw_message(seq).await.ok()?;
            let data: Value = serde_json::from_slice(&message.payload).ok()?;
            stored.push((message.headers.get("Nats-Msg-Id")?.to_string(), data));
        }
        Some(stored)
    })
    .await;
    for (id, data) in &stored {
        assert_eq!(id, &format!("JS:g:{}:0", data["from"]), "{data}");
    }
    let mut from: Vec<u64> = stored.iter().map(|(_, d)| d["from"].as_u64().unwrap()).collect();
    from.sort_unstable();
    assert_eq!(from, (1..=10).collect::<Vec<u64>>(), "one output per message");
}

/// The user's order: stream JS (2 partitions) and group g of member `web`,
/// `messages` published, and only then a browser on `/demo`, where the
/// member joins.
async fn backlog_then_browser(app: &TestApp, messages: Vec<Value>) -> Browser {
    app.create_stream("JS", json!({"subjects":["js.*"],"partitions":2})).await;
    let group = json!({"kind":"static","partitions":2,"members":["web"],"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/JS/groups/g", group).await.0, 201);
    assert_eq!(app.post("/v1/streams/JS/messages/batch", json!({"messages": messages})).await.0, 200);
    let mut browser = Browser::launch().await;
    browser.navigate(&app.url("/demo")).await;
    browser
}
