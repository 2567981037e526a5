use serde_json::json;

use crate::support::{into_parts, TestApp};

#[tokio::test]
async fn axum_rejections_are_problem_json() {
    let app = TestApp::start().await;
    app.create_stream("S", json!({"subjects":["s.*"],"partitions":2})).await;
    let url = app.url("/v1/streams/S/messages");

    let plain = app.http.post(&url).header("content-type", "text/plain").body("{}").send().await.unwrap();
    assert_eq!(into_parts(plain).await.0, 415);
    let malformed = app.http.post(&url).header("content-type", "application/json").body("{oops").send().await.unwrap();
    assert_eq!(into_parts(malformed).await.0, 400);
    let wrong_type = app.http.post(&url).json(&json!({"key": 5})).send().await.unwrap();
    assert_eq!(into_parts(wrong_type).await.0, 400);
    let huge = app
        .http
        .post(&url)
        .header("content-type", "application/json")
        .body(vec![b' '; 17 * 1024 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(into_parts(huge).await.0, 413);

    let (status, _) = app.get("/v1/nothing/here").await;
    assert_eq!(status, 404);
    let patch = app.http.patch(app.url("/v1/streams/S")).send().await.unwrap();
    assert_eq!(into_parts(patch).await.0, 405);
    let (status, problem) = app.get("/v1/streams/bad%20name").await;
    assert_eq!(status, 400);
    assert!(problem["detail"].as_str().unwrap().contains("stream name"), "{problem}");
    let (status, _) = app.get("/v1/streams/S/groups/g?kind=weird").await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn too_many_messages_in_a_batch_is_413_and_stores_nothing() {
    let app = TestApp::start_with(|s| s.max_batch_messages = 3).await;
    app.create_stream("S", json!({"subjects":["s.*"],"partitions":2})).await;
    let messages: Vec<_> = (0..4).map(|i| json!({"key": format!("k{i}")})).collect();
    let (status, _) = app.post("/v1/streams/S/messages/batch", json!({"messages": messages})).await;
    assert_eq!(status, 413);
    let (status, _) = app.post("/v1/streams/S/messages/batch", json!({"messages": []})).await;
    assert_eq!(status, 400);
    let (_, view) = app.get("/v1/streams/S").await;
    assert_eq!(view["messages"], 0);
}

#[tokio::test]
async fn nats_going_away_is_503_and_readyz_says_not_ready() {
    let mut app = TestApp::start().await;
    app.create_stream("S", json!({"subjects":["s.*"],"partitions":2})).await;
    let (status, _) = app.get("/readyz").await;
    assert_eq!(status, 200);
    drop(app.nats_server.take());
    let (status, body) = crate::support::eventually(std::time::Duration::from_secs(10), || async {
        let r = app.get("/readyz").await;
        (r.0 == 503).then_some(r)
    })
    .await;
    assert_eq!(status, 503);
    assert!(body["detail"].as_str().unwrap().contains("not ready"), "{body}");
    let (status, _) = app.get("/v1/streams/S").await;
    assert_eq!(status, 503);
}

/// Found by schemathesis: a stream deleted between keygate's two reads of it
/// (its handle, then its info) answered 500. The stale handle reproduces
/// the race on demand.
#[tokio::test]
async fn a_stream_deleted_between_two_reads_is_not_found() {
    let app = TestApp::start().await;
    app.create_stream("GONE", json!({"subjects":["gone.*"]})).await;
    let mut handle = app.js.get_stream("GONE").await.unwrap();
    app.js.delete_stream("GONE").await.unwrap();
    let err = handle.info().await.map(|_| ()).unwrap_err();
    let answer = keygate::nats::errors::stream_read_error("GONE", err);
    assert_eq!(answer.kind(), keygate::nats::errors::BrokerErrorKind::StreamNotFound, "{answer:?}");
}

/// What a newcomer gets wrong first, answered in plain words: broken JSON
/// with where and what, types in JSON's words rather than Rust's, a bad
/// name with one prefix, a name that differs only in case, a webhook URL
/// without its scheme (src/http/json_errors.rs, src/http/name_hints.rs).
#[tokio::test]
async fn refusals_say_what_is_wrong_in_a_newcomers_words() {
    let app = TestApp::start().await;
    app.create_stream("ORDERS", json!({"subjects":["orders.*"],"partitions":4})).await;
    let detail = |problem: &serde_json::Value| problem["detail"].as_str().unwrap_or_default().to_owned();
    let url = app.url("/v1/streams/ORDERS/messages");
    let broken = app
        .http
        .post(&url)
        .header("content-type", "application/json")
        .body(r#"{"key":"alice",data:1}"#)
        .send()
        .await
        .unwrap();
    let (status, problem) = into_parts(broken).await;
    assert_eq!(status, 400);
    assert_eq!(detail(&problem), "invalid JSON at line 1 column 16: object keys must be quoted strings");

    let (status, problem) = app.put("/v1/streams/TYPED", json!({"subjects":["typed.*"],"partitions":"4"})).await;
    assert_eq!(status, 400);
    assert_eq!(
        detail(&problem),
        r#"invalid request body: `partitions`: must be a whole number from 0 to 4294967295, not the string "4""#
    );
    let (status, problem) = app.put("/v1/streams/TYPED", json!({"subjects":"typed.*"})).await;
    assert_eq!(status, 400);
    assert_eq!(detail(&problem), r#"invalid request body: `subjects`: must be an array, not the string "typed.*""#);
    let (_, problem) = app.post("/v1/streams/ORDERS/messages", json!({"key": 5})).await;
    assert_eq!(detail(&problem), "invalid request body: `key`: must be a string, not the number 5");

    let (status, problem) = app.get("/v1/streams/ORDERS/groups/bad.name").await;
    assert_eq!(status, 400);
    let said = detail(&problem);
    assert!(said.starts_with("invalid path: group name") && !said.contains("Invalid URL"), "{said}");

    let (status, problem) = app.get("/v1/streams/orders").await;
    assert_eq!(status, 404);
    assert!(detail(&problem).ends_with("; did you mean stream ORDERS?"), "{problem}");
    app.put("/v1/streams/ORDERS/groups/billing", json!({"kind":"static","partitions":4,"members":["m1"]})).await;
    let (status, problem) = app.get("/v1/streams/ORDERS/groups/Billing").await;
    assert_eq!(status, 404);
    assert!(detail(&problem).ends_with("; did you mean group billing?"), "{problem}");
    let (status, problem) = app.get("/v1/streams/ORDERS/groups/nothing-like-it").await;
    assert_eq!(status, 404);
    assert!(!detail(&problem).contains("did you mean"), "{problem}");

    let hook = json!({"url": "127.0.0.1:9000/orders"});
    let (status, problem) = app.put("/v1/streams/ORDERS/groups/billing/members/m1/webhook", hook).await;
    assert_eq!(status, 422, "{problem}");
    assert!(detail(&problem).contains(r#"did you mean "http://127.0.0.1:9000/orders"?"#), "{problem}");
}
