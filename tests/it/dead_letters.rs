//! Dead letters as a resource (docs/operations.md): listed with filters and
//! cursors, read, redriven behind the later messages of their key, once,
//! deleted, and open only to their own group's or consumer's scope.
//! Against a real nats-server.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::{eventually, into_parts, TestApp};

const WAIT: Duration = Duration::from_secs(20);

/// A one-partition stream K with group g of m1, served by `receiver`.
pub(crate) async fn group_with_hook(app: &TestApp, receiver: &Receiver) {
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":1})).await;
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/K/groups/g", group).await.0, 201);
    let hook = json!({"url": receiver.url("/m1"), "max_attempts": 3, "backoff": {"initial_ms": 100, "max_ms": 200}});
    assert_eq!(app.put("/v1/streams/K/groups/g/members/m1/webhook", hook).await.0, 201);
}

/// A receiver refusing key `poison` with a 400 (terminal: dead-lettered at
/// once) while `failing` holds.
pub(crate) async fn poison_receiver(failing: Arc<AtomicBool>) -> Receiver {
    Receiver::start(move |r, _| {
        if r.key() == "poison" && failing.load(Ordering::SeqCst) {
            Answer::status(400)
        } else {
            Answer::ok()
        }
    })
    .await
}

pub(crate) async fn publish(app: &TestApp, key: &str, n: u64) -> u64 {
    let (status, ack) = app
        .post("/v1/streams/K/messages", json!({"key": key, "data": {"n": n}, "headers": {"x-origin": ["a", "b"]}}))
        .await;
    assert_eq!(status, 200, "{ack}");
    ack["seq"].as_u64().unwrap()
}

async fn letters(app: &TestApp, query: &str) -> Value {
    let (status, page) = app.get(&format!("/v1/dead-letters{query}")).await;
    assert_eq!(status, 200, "{query}: {page}");
    page
}

pub(crate) fn ids(page: &Value) -> Vec<String> {
    page["dead_letters"].as_array().unwrap().iter().map(|l| l["id"].as_str().unwrap().to_owned()).collect()
}

/// Waits until the group's letters number `count`.
pub(crate) async fn wait_for_letters(app: &TestApp, count: usize) -> Value {
    eventually(WAIT, || async {
        let page = letters(app, "?stream=K&group=g").await;
        (page["dead_letters"].as_array().unwrap().len() == count).then_some(page)
    })
    .await
}

fn body_n(r: &Recorded) -> u64 {
    serde_json::from_slice::<Value>(&r.body).unwrap()["n"].as_u64().unwrap()
}

#[tokio::test]
async fn letters_are_listed_by_filter_and_cursor_and_read_whole() {
    let app = TestApp::start().await;
    let failing = Arc::new(AtomicBool::new(true));
    let receiver = poison_receiver(failing.clone()).await;
    group_with_hook(&app, &receiver).await;
    let mut poison = Vec::new();
    for n in 0..3 {
        poison.push(publish(&app, "poison", n).await);
        publish(&app, "fine", n).await;
    }
    let page = wait_for_letters(&app, 3).await;
    let first = &page["dead_letters"][0];
    assert_eq!(first["stream"], "K");
    assert_eq!((first["group"].clone(), first["consumer"].clone()), (json!("g"), Value::Null));
    assert_eq!((first["member"].clone(), first["subject"].clone()), (json!("m1"), json!("k.poison")));
    assert_eq!((first["key"].clone(), first["partition"].clone()), (json!("poison"), json!(0)));
    assert_eq!(first["stream_seq"], poison[0]);
    assert_eq!(first["attempts"], 1, "a 400 is terminal");
    assert!(first["reason"].as_str().unwrap().contains("400"), "{first}");
    assert_eq!(first["data"], json!({"n": 0}));
    assert_eq!(first["headers"]["x-origin"], json!(["a", "b"]));
    assert!(first["headers"].get("keygate-reason").is_none(), "the letter's own fields are not the message's headers");
    assert_eq!(first["redriven"], Value::Null);
    let seqs: Vec<u64> =
        page["dead_letters"].as_array().unwrap().iter().map(|l| l["stream_seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, poison, "oldest first");

    // Filters.
    let count = |page: Value| page["dead_letters"].as_array().unwrap().len();
    assert_eq!(count(letters(&app, "?key=poison&member=m1&reason=ENDPOINT%20refused").await), 3);
    assert_eq!(count(letters(&app, "?key=fine").await), 0);
    assert_eq!(count(letters(&app, "?stream=K&consumer=g").await), 0, "a consumer named g is another owner");
    assert_eq!(count(letters(&app, "?since=2999-01-01T00:00:00Z").await), 0);
    assert_eq!(count(letters(&app, "?until=2000-01-01T00:00:00Z").await), 0);
    assert_eq!(count(letters(&app, "?since=2000-01-01T00:00:00Z").await), 3);
    // Pages by cursor.
    let one = letters(&app, "?limit=2").await;
    assert_eq!(ids(&one), ids(&page)[..2]);
    let cursor = one["next_cursor"].as_str().unwrap();
    let two = letters(&app, &format!("?limit=2&cursor={cursor}")).await;
    assert_eq!(ids(&two), ids(&page)[2..]);
    assert_eq!(two["next_cursor"], Value::Null);

    // One letter.
    let id = ids(&page)[1].clone();
    let (status, letter) = app.get(&format!("/v1/dead-letters/{id}")).await;
    assert_eq!((status, letter["data"].clone()), (200, json!({"n": 1})));
    assert_eq!(letter["headers"]["x-origin"], json!(["a", "b"]), "every value of a repeated header");

    // Bad input changes nothing and says what is wrong.
    for bad in ["?cursor=abc", "?limit=0", "?since=yesterday", "?group=g&consumer=c", "?stream=a.b", "?colour=red"] {
        let (status, problem) = app.get(&format!("/v1/dead-letters{bad}")).await;
        assert_eq!(status, 400, "{bad}: {problem}");
    }
    assert_eq!(app.get("/v1/dead-letters/abc").await.0, 400);
    let forged = json!({"key": "k", "data": 1, "headers": {"Keygate-Redriven-From": "1"}});
    let (status, problem) = app.post("/v1/streams/K/messages", forged).await;
    assert_eq!(status, 400, "only keygate marks a redrive: {problem}");
    assert_eq!(app.get("/v1/dead-letters/999999").await.0, 404);
}

#[tokio::test]
async fn a_redriven_letter_goes_behind_the_later_messages_of_its_key_once() {
    let app = TestApp::start().await;
    let failing = Arc::new(AtomicBool::new(true));
    let receiver = poison_receiver(failing.clone()).await;
    group_with_hook(&app, &receiver).await;
    for n in 0..3 {
        publish(&app, "poison", n).await;
    }
    let page = wait_for_letters(&app, 3).await;
    let letter_ids = ids(&page);
    // The endpoint is fixed; the key goes on with a later message.
    failing.store(false, Ordering::SeqCst);
    let later = publish(&app, "poison", 3).await;
    eventually(WAIT, || async { receiver.requests().iter().any(|r| r.seq() == later && r.ok()).then_some(()) }).await;

    let (status, answer) =
        app.post("/v1/dead-letters/redrive", json!({"filter": {"stream": "K", "key": "poison"}})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["failed"], json!([]));
    let redriven = answer["redriven"].as_array().unwrap();
    let new_seqs: Vec<u64> = redriven.iter().map(|r| r["stream_seq"].as_u64().unwrap()).collect();
    assert_eq!(redriven.iter().map(|r| r["id"].as_str().unwrap()).collect::<Vec<_>>(), letter_ids);
    assert!(redriven.iter().all(|r| r["earlier"] == false));
    assert!(new_seqs.windows(2).all(|w| w[0] < w[1]) && new_seqs[0] > later, "{new_seqs:?} after {later}");

    // Delivered after the later message, in the letters' order, saying where from.
    let requests = eventually(WAIT, || async {
        let requests = receiver.requests();
        new_seqs.iter().all(|s| requests.iter().any(|r| r.seq() == *s && r.ok())).then_some(requests)
    })
    .await;
    let acked: Vec<&Recorded> = requests.iter().filter(|r| r.ok() && r.key() == "poison").collect();
    assert_eq!(acked.iter().map(|r| body_n(r)).collect::<Vec<_>>(), vec![3, 0, 1, 2]);
    for (r, id) in acked[1..].iter().zip(&letter_ids) {
        assert_eq!(r.header("keygate-redriven-from"), Some(id.as_str()));
        assert_eq!(r.header("x-origin"), acked[0].header("x-origin"), "the message's own headers go with it");
        assert!(r.header("x-origin").is_some());
    }

    // Once: again is a no-op that answers the first redrive.
    let last_seq = app.js.get_stream("K").await.unwrap().info().await.unwrap().state.last_sequence;
    let (status, again) = app.post("/v1/dead-letters/redrive", json!({"ids": [letter_ids[2], letter_ids[0]]})).await;
    assert_eq!(status, 200, "{again}");
    let again = again["redriven"].as_array().unwrap();
    assert!(again.iter().all(|r| r["earlier"] == true), "{again:?}");
    assert_eq!(again[0]["stream_seq"], new_seqs[0], "in the stream's order, whatever the request's");
    assert_eq!(app.js.get_stream("K").await.unwrap().info().await.unwrap().state.last_sequence, last_seq);
    let (_, shown) = app.get(&format!("/v1/dead-letters/{}", letter_ids[0])).await;
    assert_eq!(shown["redriven"]["stream_seq"], new_seqs[0]);

    // Deleting: one by id, then the rest by filter; an empty filter is refused.
    assert_eq!(app.delete(&format!("/v1/dead-letters/{}", letter_ids[0])).await.0, 204);
    assert_eq!(app.get(&format!("/v1/dead-letters/{}", letter_ids[0])).await.0, 404);
    assert_eq!(app.delete(&format!("/v1/dead-letters/{}", letter_ids[0])).await.0, 404);
    let response = app.http.delete(app.url("/v1/dead-letters")).send().await.unwrap();
    assert_eq!(into_parts(response).await.0, 400, "deleting every letter takes a criterion");
    let response = app.http.delete(app.url("/v1/dead-letters?stream=K&key=poison")).send().await.unwrap();
    let (status, deleted) = into_parts(response).await;
    assert_eq!((status, deleted["deleted"].clone()), (200, json!(letter_ids[1..])));
    assert_eq!(letters(&app, "").await["dead_letters"], json!([]));
    for bad in [json!({}), json!({"ids": [], "filter": {}}), json!({"ids": []}), json!({"ids": ["x"], "extra": 1})] {
        assert_eq!(app.post("/v1/dead-letters/redrive", bad.clone()).await.0, 400, "{bad}");
    }
    app.assert_no_acks_without_verdict().await;
}

const SECRET: &str = "a-test-secret-of-at-least-32-bytes!!";

fn token(scope: &str) -> String {
    let exp = time::OffsetDateTime::now_utc().unix_timestamp() + 600;
    let claims = json!({"sub": "test", "exp": exp, "scope": scope});
    encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(SECRET.as_bytes()).unwrap()).unwrap()
}

async fn call(app: &TestApp, method: &str, path: &str, scope: &str, body: Option<Value>) -> (u16, Value) {
    let mut request = app.http.request(method.parse().unwrap(), app.url(path)).bearer_auth(token(scope));
    if let Some(body) = body {
        request = request.json(&body);
    }
    into_parts(request.send().await.unwrap()).await
}

#[tokio::test]
async fn a_groups_letters_are_open_to_its_consume_scope_and_no_other() {
    let app = TestApp::start_with(|s| s.auth.hs256_secret = Some(SECRET.into())).await;
    let admin = "keygate:admin";
    let failing = Arc::new(AtomicBool::new(true));
    let receiver = poison_receiver(failing).await;
    let put = |path: &'static str, body: Value| {
        let app = &app;
        async move { call(app, "PUT", path, admin, Some(body)).await }
    };
    put("/v1/streams/K", json!({"subjects":["k.*"],"partitions":1})).await;
    put("/v1/streams/K/groups/g", json!({"kind":"static","partitions":1,"members":["m1"]})).await;
    let hook = json!({"url": receiver.url("/m1"), "max_attempts": 1});
    assert_eq!(put("/v1/streams/K/groups/g/members/m1/webhook", hook).await.0, 201);
    let (status, _) =
        call(&app, "POST", "/v1/streams/K/messages", "publish:K", Some(json!({"key":"poison","data":1}))).await;
    assert_eq!(status, 200);
    let page = eventually(WAIT, || async {
        let (_, page) = call(&app, "GET", "/v1/dead-letters?stream=K&group=g", admin, None).await;
        (page["dead_letters"].as_array().is_some_and(|l| l.len() == 1)).then_some(page)
    })
    .await;
    let id = page["dead_letters"][0]["id"].as_str().unwrap().to_owned();
    let by_id = format!("/v1/dead-letters/{id}");

    let own = "consume:K/g";
    assert_eq!(call(&app, "GET", "/v1/dead-letters?stream=K&group=g", own, None).await.1, page);
    assert_eq!(call(&app, "GET", &by_id, own, None).await.0, 200);
    assert_eq!(call(&app, "GET", &by_id, "consume:K/*", None).await.0, 200);
    let (status, problem) = call(&app, "GET", "/v1/dead-letters", own, None).await;
    assert_eq!(status, 403, "every letter is admin's: {problem}");
    for other in ["consume:K/other", "subscribe:K/g"] {
        assert_eq!(call(&app, "GET", "/v1/dead-letters?stream=K&group=g", other, None).await.0, 403, "{other}");
        assert_eq!(call(&app, "GET", &by_id, other, None).await.0, 404, "{other}: as if it did not exist");
        assert_eq!(call(&app, "DELETE", &by_id, other, None).await.0, 404, "{other}");
        let (status, answer) = call(&app, "POST", "/v1/dead-letters/redrive", other, Some(json!({"ids": [id]}))).await;
        assert_eq!((status, answer["redriven"].clone()), (200, json!([])), "{other}: {answer}");
        assert_eq!(answer["failed"][0]["error"]["status"], 404);
    }
    let (status, problem) = call(&app, "GET", "/v1/dead-letters?stream=K&group=g", "publish:*", None).await;
    assert_eq!(status, 403, "{problem}");
    let response = app.http.get(app.url("/v1/dead-letters")).send().await.unwrap();
    assert_eq!(into_parts(response).await.0, 401);

    let (status, answer) = call(&app, "POST", "/v1/dead-letters/redrive", own, Some(json!({"ids": [id]}))).await;
    assert_eq!((status, answer["redriven"][0]["id"].clone()), (200, json!(id)), "{answer}");
    assert_eq!(call(&app, "DELETE", &by_id, own, None).await.0, 204);
}
