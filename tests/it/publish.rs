use std::collections::BTreeMap;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::support::TestApp;

/// 1,000+ keys of every kind a user may send: ASCII, unicode, emoji, long,
/// and keys that need escaping, plus the server-read vectors' keys.
fn parity_keys() -> Vec<String> {
    let mut keys: Vec<String> = (0..400).map(|i| format!("customer-{i:05}")).collect();
    keys.extend((0..100).map(|i| format!("ключ-{i}")));
    keys.extend((0..100).map(|i| format!("日本語キー{i}")));
    keys.extend((0..100).map(|i| format!("emoji😀{i}🚀")));
    keys.extend((0..50).map(|i| "x".repeat(100 + i * 7)));
    keys.extend((0..100).map(|i| format!("with space {i}.and.dots")));
    keys.extend((0..50).map(|i| format!("50%-{i}\t*>")));
    keys.extend(["*", ">", "%", "%20", "a>b", "a*", "é"].map(String::from));
    let vectors: Value = serde_json::from_str(include_str!("../vectors/partition-vectors.json")).unwrap();
    for case in vectors["single"].as_array().unwrap() {
        keys.push(case["key"].as_str().unwrap().to_owned());
    }
    keys.sort();
    keys.dedup();
    keys
}

#[tokio::test]
async fn keygate_partitions_equal_what_the_server_stamps_for_over_a_thousand_keys() {
    let app = TestApp::start().await;
    let keys = parity_keys();
    assert!(keys.len() >= 1000, "{} keys", keys.len());
    for partitions in [2u32, 7, 10, 64, 255] {
        let stream = format!("P{partitions}");
        app.create_stream(
            &stream,
            json!({"subjects":[format!("{}.*", stream.to_lowercase())],"partitions":partitions}),
        )
        .await;
        let mut reported = Vec::new();
        for chunk in keys.chunks(500) {
            let messages: Vec<Value> = chunk.iter().map(|k| json!({"key": k, "data": {"k": k}})).collect();
            let (status, body) =
                app.post(&format!("/v1/streams/{stream}/messages/batch"), json!({"messages": messages})).await;
            assert_eq!(status, 200);
            for result in body["results"].as_array().unwrap() {
                assert!(result.get("error").is_none(), "{result}");
                reported.push(result.clone());
            }
        }
        let stored = app.stream_messages(&stream).await;
        assert_eq!(stored.len(), keys.len());
        for ((key, ack), (subject, _, _)) in keys.iter().zip(&reported).zip(&stored) {
            let (stamp, rest) = subject.split_once('.').unwrap();
            let stamped: u32 = stamp.parse().unwrap();
            assert_eq!(ack["partition"], stamped, "key {key:?} mod {partitions}: stored as {subject}");
            assert_eq!(ack["subject"], rest, "key {key:?}");
            assert_eq!(ack["key"], key.as_str());
            let token = rest.split_once('.').unwrap().1;
            assert_eq!(keygate::partition::decode_key(token).as_deref(), Some(key.as_str()));
        }
    }
}

#[tokio::test]
async fn multi_wildcard_keys_hash_in_the_listed_order_like_the_server() {
    let app = TestApp::start().await;
    app.create_stream("VM", json!({"subjects":["vm.*.*"],"partitions":7,"key_wildcards":[2,1]})).await;
    let vectors: Value = serde_json::from_str(include_str!("../vectors/partition-vectors.json")).unwrap();
    let mut published = Vec::new();
    for case in vectors["multi"].as_array().unwrap() {
        let tokens: Vec<&str> = case["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        let (status, ack) = app
            .post("/v1/streams/VM/messages", json!({"subject": format!("vm.{}.*", tokens[0]), "key": tokens[1]}))
            .await;
        assert_eq!(status, 200, "{ack}");
        assert_eq!(ack["partition"], case["partition"], "{tokens:?}");
        published.push(ack);
    }
    for region in ["eu", "us", "ap", "x y", "ü"] {
        for user in 0..60 {
            let (status, ack) = app
                .post("/v1/streams/VM/messages", json!({"subject": "vm.r.*", "key": format!("{region}-{user}")}))
                .await;
            assert_eq!(status, 200);
            published.push(ack);
        }
    }
    // A literal subject works too; its key is its key-position token.
    let (status, ack) = app.post("/v1/streams/VM/messages", json!({"subject":"vm.eu.alice"})).await;
    assert_eq!(status, 200);
    assert_eq!(ack["partition"], 2);
    published.push(ack);

    let stored = app.stream_messages("VM").await;
    for (ack, (subject, _, _)) in published.iter().zip(&stored) {
        assert_eq!(format!("{}.{}", ack["partition"], ack["subject"].as_str().unwrap()), *subject);
    }
}

#[tokio::test]
async fn keyless_messages_go_round_robin_over_partitions() {
    let app = TestApp::start().await;
    app.create_stream("RR", json!({"subjects":["rr.*"],"partitions":5})).await;
    let messages: Vec<Value> = (0..20).map(|i| json!({"data": i})).collect();
    let (_, body) = app.post("/v1/streams/RR/messages/batch", json!({"messages": messages})).await;
    let partitions: Vec<u64> =
        body["results"].as_array().unwrap().iter().map(|r| r["partition"].as_u64().unwrap()).collect();
    for pair in partitions.windows(2) {
        assert_eq!((pair[0] + 1) % 5, pair[1], "{partitions:?}");
    }
    let mut counts = BTreeMap::new();
    for p in &partitions {
        *counts.entry(*p).or_insert(0) += 1;
    }
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), vec![4; 5]);
    assert!(body["results"].as_array().unwrap().iter().all(|r| r["key"].is_null()));
    let stored = app.stream_messages("RR").await;
    for ((subject, _, _), p) in stored.iter().zip(&partitions) {
        assert!(subject.starts_with(&format!("{p}.rr.")), "{subject}");
    }
}

#[tokio::test]
async fn spread_random_puts_keyless_messages_on_random_partitions_where_the_server_stamps_them() {
    let app = TestApp::start().await;
    app.create_stream("RND", json!({"subjects":["rnd.*"],"partitions":4})).await;
    let messages: Vec<Value> = (0..400).map(|i| json!({"data": i, "spread": "random"})).collect();
    let (status, body) = app.post("/v1/streams/RND/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 200, "{body}");
    let partitions: Vec<u64> =
        body["results"].as_array().unwrap().iter().map(|r| r["partition"].as_u64().unwrap()).collect();
    let mut counts = BTreeMap::new();
    for p in &partitions {
        *counts.entry(*p).or_insert(0) += 1;
    }
    assert_eq!(counts.len(), 4, "{counts:?}");
    assert!(counts.values().all(|n| *n > 40), "roughly even: {counts:?}");
    let round_robin_steps = partitions.windows(2).filter(|w| (w[0] + 1) % 4 == w[1]).count();
    assert!(round_robin_steps < 200, "not round-robin: {round_robin_steps} of 399 steps were +1");
    let stored = app.stream_messages("RND").await;
    for ((subject, _, _), p) in stored.iter().zip(&partitions) {
        assert!(subject.starts_with(&format!("{p}.rnd.")), "the server stamped {subject}, keygate said {p}");
    }
    // A key decides the partition: spread with a key is refused.
    let (status, problem) = app.post("/v1/streams/RND/messages", json!({"key":"k","spread":"random"})).await;
    assert_eq!(status, 400, "{problem}");
    let (status, _) = app.post("/v1/streams/RND/messages", json!({"spread":"sideways"})).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn payloads_headers_and_content_types_are_stored_as_sent() {
    let app = TestApp::start().await;
    app.create_stream("DATA", json!({"subjects":["data.*"],"partitions":3})).await;
    let raw_json = r#"{"b": 2,  "a": [1, 2.50]}"#;
    let body = format!(r#"{{"key":"k1","data":{raw_json},"headers":{{"X-Trace":"t1","X-Multi":["a","b"]}}}}"#);
    let response = app
        .http
        .post(app.url("/v1/streams/DATA/messages"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let bytes = vec![0u8, 159, 146, 150, 255];
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
    let (status, _) = app
        .post(
            "/v1/streams/DATA/messages",
            json!({"key":"k2","data_base64": b64, "content_type":"application/octet-stream"}),
        )
        .await;
    assert_eq!(status, 200);
    let (status, _) = app.post("/v1/streams/DATA/messages", json!({"key":"k3"})).await;
    assert_eq!(status, 200);

    let stored = app.stream_messages("DATA").await;
    let (_, payload, headers) = &stored[0];
    assert_eq!(payload, raw_json.as_bytes());
    let headers = headers.as_ref().unwrap();
    assert_eq!(headers.get("Content-Type").unwrap().as_str(), "application/json");
    assert_eq!(headers.get("X-Trace").unwrap().as_str(), "t1");
    let multi: Vec<&str> = headers.get_all("X-Multi").map(|v| v.as_str()).collect();
    assert_eq!(multi, vec!["a", "b"]);
    let (_, payload, headers) = &stored[1];
    assert_eq!(payload, &bytes);
    assert_eq!(headers.as_ref().unwrap().get("Content-Type").unwrap().as_str(), "application/octet-stream");
    assert!(stored[2].1.is_empty());
}

#[tokio::test]
async fn msg_id_and_idempotency_key_deduplicate() {
    let app = TestApp::start().await;
    app.create_stream("DEDUP", json!({"subjects":["d.*"],"partitions":2})).await;
    let (_, first) = app.post("/v1/streams/DEDUP/messages", json!({"key":"a","msg_id":"m-1"})).await;
    let (_, again) = app.post("/v1/streams/DEDUP/messages", json!({"key":"a","msg_id":"m-1"})).await;
    assert_eq!(first["duplicate"], false);
    assert_eq!(again["duplicate"], true);
    assert_eq!(first["seq"], again["seq"]);

    let send = |key: &'static str| {
        app.http
            .post(app.url("/v1/streams/DEDUP/messages"))
            .header("Idempotency-Key", "order-77")
            .json(&json!({"key": key}))
            .send()
    };
    let one: Value = send("b").await.unwrap().json().await.unwrap();
    let two: Value = send("b").await.unwrap().json().await.unwrap();
    assert_eq!((one["duplicate"].clone(), two["duplicate"].clone()), (json!(false), json!(true)));
    let stored = app.stream_messages("DEDUP").await;
    assert_eq!(stored.len(), 2);

    let response = app
        .http
        .post(app.url("/v1/streams/DEDUP/messages"))
        .header("Idempotency-Key", "x")
        .json(&json!({"key":"c","msg_id":"y"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
}

#[tokio::test]
async fn a_failing_batch_item_does_not_fail_the_others() {
    let app = TestApp::start().await;
    app.create_stream("B", json!({"subjects":["b.*"],"partitions":4})).await;
    let (status, body) = app
        .post(
            "/v1/streams/B/messages/batch",
            json!({"messages":[
                {"key":"one"},
                {"key":""},
                {"key":"two","data":1,"data_base64":"AA=="},
                {"key":"three","subject":"elsewhere.*"},
                {"key":"four","headers":{"Nats-Msg-Id":"x"}},
                {"key":"five"}
            ]}),
        )
        .await;
    assert_eq!(status, 200);
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 6);
    assert_eq!(results[0]["key"], "one");
    for bad in &results[1..5] {
        assert_eq!(bad["error"]["status"], 400, "{bad}");
    }
    assert_eq!(results[5]["key"], "five");
    assert_eq!(results[5]["seq"].as_u64().unwrap(), results[0]["seq"].as_u64().unwrap() + 1);
    assert_eq!(app.stream_messages("B").await.len(), 2);
}

#[tokio::test]
async fn bad_publishes_are_problems_and_store_nothing() {
    let app = TestApp::start().await;
    app.create_stream("E", json!({"subjects":["e.*"],"partitions":2})).await;
    let cases = [
        (json!({"key":"a","data":1,"data_base64":"AA=="}), 400),
        (json!({"key":"a","data_base64":"not base64!"}), 400),
        (json!({"key":"a","headers":{"bad name":"x"}}), 400),
        (json!({"key":"a","headers":{"Nats-Expected-Stream":"x"}}), 400),
        (json!({"key":"a","subject":"e.literal"}), 400),
        (json!({"subject":"other.x"}), 400),
        (json!({"key":"x".repeat(2000)}), 400),
        (json!({"key":"a","unknown":true}), 400),
        (json!({"key":"a","data_base64": base64::engine::general_purpose::STANDARD.encode(vec![7u8; 1_100_000])}), 413),
    ];
    for (body, want) in cases {
        let (status, problem) = app.post("/v1/streams/E/messages", body.clone()).await;
        assert_eq!(status, want, "{problem}");
    }
    let (status, _) = app.post("/v1/streams/NOPE/messages", json!({"key":"a"})).await;
    assert_eq!(status, 404);
    let (_, view) = app.get("/v1/streams/E").await;
    assert_eq!(view["messages"], 0);
}

#[tokio::test]
async fn plain_streams_take_keys_without_partitions() {
    let app = TestApp::start().await;
    app.create_stream("PLAIN", json!({"subjects":["plain.*"]})).await;
    let (status, ack) = app.post("/v1/streams/PLAIN/messages", json!({"key":"a b","data":{"x":1}})).await;
    assert_eq!(status, 200);
    assert_eq!(ack["partition"], Value::Null);
    assert_eq!(ack["subject"], "plain.a%20b");
}

#[tokio::test]
async fn an_explicit_subject_pattern_lands_keys_where_the_stream_subject_does() {
    let app = TestApp::start().await;
    app.create_stream("X", json!({"subjects":["x.*"],"partitions":13})).await;
    let keys: Vec<String> = (0..300).map(|i| format!("k {i}/ü")).collect();
    let implicit: Vec<Value> = keys.iter().map(|k| json!({"key": k})).collect();
    let explicit: Vec<Value> = keys.iter().map(|k| json!({"key": k, "subject": "x.*"})).collect();
    let (_, a) = app.post("/v1/streams/X/messages/batch", json!({"messages": implicit})).await;
    let (_, b) = app.post("/v1/streams/X/messages/batch", json!({"messages": explicit})).await;
    let stored = app.stream_messages("X").await;
    let acks: Vec<&Value> = a["results"].as_array().unwrap().iter().chain(b["results"].as_array().unwrap()).collect();
    for (ack, (subject, _, _)) in acks.iter().zip(&stored) {
        assert_eq!(format!("{}.{}", ack["partition"], ack["subject"].as_str().unwrap()), *subject);
    }
    for (x, y) in a["results"].as_array().unwrap().iter().zip(b["results"].as_array().unwrap()) {
        assert_eq!(x["partition"], y["partition"]);
        assert_eq!(x["subject"], y["subject"]);
    }
}

#[tokio::test]
async fn many_concurrent_batches_all_complete() {
    let app = TestApp::start().await;
    app.create_stream("MANY", json!({"subjects":["many.*"],"partitions":8})).await;
    let batches = (0..70).map(|b| {
        let app = &app;
        async move {
            let messages: Vec<Value> = (0..1000).map(|i| json!({"key": format!("k{}", (b * 1000 + i) % 97)})).collect();
            let fut = app.post("/v1/streams/MANY/messages/batch", json!({"messages": messages}));
            tokio::time::timeout(std::time::Duration::from_secs(120), fut).await.expect("the batch finished")
        }
    });
    for (status, body) in futures::future::join_all(batches).await {
        assert_eq!(status, 200);
        assert!(body["results"].as_array().unwrap().iter().all(|r| r["seq"].is_u64()));
    }
    let (_, view) = app.get("/v1/streams/MANY").await;
    assert_eq!(view["messages"], 70_000);
}

#[tokio::test]
async fn a_duplicate_answers_where_the_first_message_was_stored() {
    let app = TestApp::start().await;
    app.create_stream("DUP", json!({"subjects":["dup.*"],"partitions":16})).await;
    let (_, first) = app.post("/v1/streams/DUP/messages", json!({"key":"alice","msg_id":"x1"})).await;
    let (_, retry) = app.post("/v1/streams/DUP/messages", json!({"key":"bob","msg_id":"x1"})).await;
    assert_eq!(retry["duplicate"], true);
    assert_eq!(retry["seq"], first["seq"]);
    assert_eq!(retry["key"], "alice");
    assert_eq!(retry["subject"], "dup.alice");
    assert_eq!(retry["partition"], first["partition"]);
}

#[tokio::test]
async fn publishers_cannot_write_keygate_or_server_state() {
    let app = TestApp::start().await;
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":4})).await;
    let (status, _) =
        app.put("/v1/streams/ORDERS/groups/g", json!({"kind":"static","partitions":4,"members":["m1"]})).await;
    assert_eq!(status, 201);
    let hook = json!({"url":"http://127.0.0.1:9/hook"});
    let (status, answer) = app.put("/v1/streams/ORDERS/groups/g/members/m1/webhook", hook).await;
    assert_eq!(status, 201, "{answer}");
    let registration = app.kv_raw("keygate-webhooks", "ORDERS.g.m1").await.expect("registered");

    // Redirecting a member's deliveries, deleting its registration, or
    // editing a pcgroups configuration, through the data path.
    let attacks = [
        ("KV_keygate-webhooks", json!({"subject":"$KV.keygate-webhooks.ORDERS.g.m1","data":{"url":"http://evil"}})),
        ("KV_keygate-webhooks", json!({"subject":"$KV.keygate-webhooks.ORDERS.g.m1","headers":{"KV-Operation":"DEL"}})),
        ("KV_static-consumer-groups", json!({"subject":"$KV.static-consumer-groups.ORDERS.g","data":{}})),
        ("ORDERS", json!({"key":"k","data":1,"headers":{"KV-Operation":"PURGE"}})),
        ("ORDERS", json!({"key":"k","data":1,"headers":{"Nats-Expected-Last-Sequence":"0"}})),
    ];
    for (stream, body) in attacks {
        let (status, problem) = app.post(&format!("/v1/streams/{stream}/messages"), body.clone()).await;
        assert!(status == 403 || status == 400, "{stream} {body}: {status} {problem}");
        let batch = json!({"messages":[body.clone()]});
        let (status, answer) = app.post(&format!("/v1/streams/{stream}/messages/batch"), batch).await;
        let refused =
            status == 403 || answer["results"][0]["error"]["status"].as_u64().is_some_and(|s| s == 400 || s == 403);
        assert!(refused, "batch {stream} {body}: {status} {answer}");
    }
    assert_eq!(app.kv_raw("keygate-webhooks", "ORDERS.g.m1").await.as_deref(), Some(registration.as_slice()));
    let stored = app.stream_messages("ORDERS").await;
    assert!(stored.is_empty(), "nothing was stored: {}", stored.len());

    // keygate's own subject spaces, even when a stream captures everything.
    app.create_stream("WIDE", json!({"subjects":["wide.>"]})).await;
    let (status, problem) =
        app.post("/v1/streams/WIDE/messages", json!({"subject":"keygate.control.ORDERS.g.m1"})).await;
    assert_eq!(status, 400, "{problem}");
}

#[tokio::test]
async fn header_names_http_cannot_carry_are_refused_at_publish() {
    let app = TestApp::start().await;
    app.create_stream("H", json!({"subjects":["h.*"]})).await;
    for headers in [json!({"a(b":"x"}), json!({"a b":"x"}), json!({"x":"a\u{1}b"})] {
        let (status, problem) = app.post("/v1/streams/H/messages", json!({"key":"k","data":1,"headers":headers})).await;
        assert_eq!(status, 400, "{headers}: {problem}");
    }
    assert!(app.stream_messages("H").await.is_empty());
}

#[tokio::test]
async fn atomic_batches_store_every_message_or_none() {
    let app = TestApp::start().await;
    app.create_stream("AT", json!({"subjects":["at.*"],"partitions":4,"allow_atomic":true})).await;
    let messages: Vec<Value> = (0..10).map(|i| json!({"key": format!("k{}", i % 3), "data": {"i": i}})).collect();
    let (status, answer) =
        app.post("/v1/streams/AT/messages/batch", json!({"messages": messages, "atomic": true})).await;
    assert_eq!(status, 200, "{answer}");
    let seqs: Vec<u64> = answer["results"].as_array().unwrap().iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>(), "stored together, in request order");
    let stored = app.stream_messages("AT").await;
    for (i, (_, payload, _)) in stored.iter().enumerate() {
        assert_eq!(serde_json::from_slice::<Value>(payload).unwrap()["i"], i, "request order");
    }

    // One bad item: nothing is stored.
    let mut bad = messages.clone();
    bad[5] = json!({"key":"k","data":1,"headers":{"Nats-Msg-Id":"x"}});
    let (status, problem) = app.post("/v1/streams/AT/messages/batch", json!({"messages": bad, "atomic": true})).await;
    assert_eq!(status, 400, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("item 5"), "{problem}");
    assert_eq!(app.stream_messages("AT").await.len(), 10);

    // A stream without allow_atomic refuses, and stores nothing.
    app.create_stream("PLAIN", json!({"subjects":["plain.*"],"allow_atomic":false})).await;
    let (status, problem) =
        app.post("/v1/streams/PLAIN/messages/batch", json!({"messages": messages, "atomic": true})).await;
    assert_eq!(status, 409, "{problem}");
    assert!(app.stream_messages("PLAIN").await.is_empty());
    let (_, view) = app.get("/v1/streams/AT").await;
    assert_eq!(view["allow_atomic"], true);
}

#[tokio::test]
async fn a_duplicate_answer_names_the_key_on_a_stream_without_partitions() {
    let app = TestApp::start().await;
    app.create_stream("UNST", json!({"subjects":["unst.*"]})).await;
    let message = json!({"key":"alice","msg_id":"m-1","data":1});
    let (_, first) = app.post("/v1/streams/UNST/messages", message.clone()).await;
    let (status, again) = app.post("/v1/streams/UNST/messages", message).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["duplicate"], true);
    assert_eq!(again["seq"], first["seq"]);
    assert_eq!(again["key"], "alice", "{again}");
}

/// The stream's own refusals, read from the server's error codes: a full
/// stream with discard new is a retryable 503, a message over the stream's
/// `max_msg_size` a 413.
#[tokio::test]
async fn a_full_stream_is_a_503_and_a_message_over_its_size_limit_a_413() {
    use async_nats::jetstream::stream;
    let app = TestApp::start().await;
    app.js
        .create_stream(stream::Config {
            name: "FULL".into(),
            subjects: vec!["full.*".into()],
            max_messages: 1,
            discard: stream::DiscardPolicy::New,
            max_message_size: 512,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(app.post("/v1/streams/FULL/messages", json!({"key":"a","data":1})).await.0, 200);
    let (status, problem) = app.post("/v1/streams/FULL/messages", json!({"key":"b","data":2})).await;
    assert_eq!(status, 503, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("full"), "{problem}");
    let (status, problem) = app.post("/v1/streams/FULL/messages", json!({"key":"c","data":"x".repeat(2000)})).await;
    assert_eq!(status, 413, "{problem}");
}

/// The subject's key and the payload's `i` of the message stored at `seq`.
async fn stored_at(app: &TestApp, stream: &str, seq: u64) -> (String, Value) {
    let stored = app.js.get_stream(stream).await.unwrap().get_raw_message(seq).await.unwrap();
    let data: Value = serde_json::from_slice(&stored.payload).unwrap();
    (stored.subject.rsplit('.').next().unwrap().to_owned(), data["i"].clone())
}

/// On a stream whose atomic batches the server stages in memory, a batch's
/// run of one key's messages is stored as one atomic batch: at consecutive
/// sequences, in request order, each item answered with where it is. A
/// repeat of the batch (the same msg_ids) is refused as an atomic batch
/// and answered message by message: every item a duplicate, at its first
/// place.
#[tokio::test]
async fn a_keys_run_in_a_batch_is_stored_at_once_in_request_order() {
    let app = TestApp::start().await;
    app.create_stream("RUNS", json!({"subjects":["runs.*"],"partitions":4,"storage":"memory"})).await;
    let keys = ["a", "b", "a", "c", "a", "b", "a", "", "b", "a"];
    let messages: Vec<Value> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| json!({"key": key, "msg_id": format!("m{i}"), "data": {"i": i}}))
        .collect();
    let batch = json!({"messages": messages});
    let (status, first) = app.post("/v1/streams/RUNS/messages/batch", batch.clone()).await;
    assert_eq!(status, 200, "{first}");
    let results = first["results"].as_array().unwrap().clone();
    assert_eq!(results[7]["error"]["status"], 400, "the empty key is refused alone: {}", results[7]);
    let mut seqs_of: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (i, (key, result)) in keys.iter().zip(&results).enumerate().filter(|(i, _)| *i != 7) {
        let seq = result["seq"].as_u64().unwrap_or_else(|| panic!("item {i}: {result}"));
        assert_eq!(result["key"], *key);
        assert_eq!(result["duplicate"], false);
        assert_eq!(stored_at(&app, "RUNS", seq).await, (key.to_string(), json!(i)), "item {i} is stored at {seq}");
        seqs_of.entry(key).or_default().push(seq);
    }
    for (key, seqs) in &seqs_of {
        let consecutive: Vec<u64> = (seqs[0]..seqs[0] + seqs.len() as u64).collect();
        assert_eq!(seqs, &consecutive, "key {key}'s run is stored together, in request order");
    }

    let (status, again) = app.post("/v1/streams/RUNS/messages/batch", batch).await;
    assert_eq!(status, 200, "{again}");
    for (i, (result, was)) in again["results"].as_array().unwrap().iter().zip(&results).enumerate() {
        if i == 7 {
            continue;
        }
        assert_eq!(result["duplicate"], true, "item {i}: {result}");
        assert_eq!(result["seq"], was["seq"], "item {i}");
    }
    assert_eq!(app.stream_messages("RUNS").await.len(), 9);
}

/// When the stream refuses one message of a key's run, the run is not
/// stored as one batch; it is sent message by message, and answers as
/// without runs: the items before the refused one are stored, the refused
/// one says why, and the later ones of that key are not sent.
#[tokio::test]
async fn a_run_the_stream_refuses_answers_each_item_as_message_by_message() {
    use async_nats::jetstream::stream;
    let app = TestApp::start().await;
    app.js
        .create_stream(stream::Config {
            name: "SMALL".into(),
            subjects: vec!["small.*".into()],
            storage: stream::StorageType::Memory,
            allow_atomic_publish: true,
            max_message_size: 512,
            ..Default::default()
        })
        .await
        .unwrap();
    let messages: Vec<Value> = (0..5)
        .map(|i| match i {
            2 => json!({"key": "k", "data": {"i": i, "pad": "x".repeat(2000)}}),
            _ => json!({"key": "k", "data": {"i": i}}),
        })
        .collect();
    let (status, answer) = app.post("/v1/streams/SMALL/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().unwrap();
    for (i, stored) in results.iter().enumerate().take(2) {
        let seq = stored["seq"].as_u64().unwrap_or_else(|| panic!("item {i}: {stored}"));
        assert_eq!(stored_at(&app, "SMALL", seq).await, ("k".to_string(), json!(i)));
    }
    assert_eq!(results[2]["error"]["status"], 413, "{}", results[2]);
    for later in &results[3..] {
        assert!(later["error"]["detail"].as_str().unwrap().contains("not sent"), "{later}");
    }
    assert_eq!(app.stream_messages("SMALL").await.len(), 2);
}

/// Streams keygate makes allow atomic batches unless told not to.
#[tokio::test]
async fn streams_allow_atomic_batches_by_default() {
    let app = TestApp::start().await;
    app.create_stream("DEF", json!({"subjects":["def.*"]})).await;
    app.create_stream("OFF", json!({"subjects":["off.*"],"allow_atomic":false})).await;
    assert_eq!(app.get("/v1/streams/DEF").await.1["allow_atomic"], true);
    assert_eq!(app.get("/v1/streams/OFF").await.1["allow_atomic"], false);
}
