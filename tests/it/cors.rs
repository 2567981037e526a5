//! CORS (docs/security.md, "Browsers on other origins"): a page served from
//! an allowed origin calls the REST API with a bearer token from headless
//! Chromium and reads the exposed headers; a page from any other origin is
//! blocked by the browser before its request is sent. Against a real
//! nats-server.

use serde_json::{json, Value};

use crate::auth::{call, scoped, SECRET};
use crate::support::browser::Browser;
use crate::support::TestApp;

/// A blank page served on its own loopback port: another origin than keygate's.
async fn page_server() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let origin = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    let page = axum::Router::new()
        .route("/", axum::routing::get(|| async { axum::response::Html("<!doctype html><title>app</title>") }));
    tokio::spawn(async move { axum::serve(listener, page).await });
    origin
}

/// What a `fetch` from the page answered (status, and the headers a page
/// may read), or `"blocked"` when the browser refused it.
fn fetch_script(url: &str, token: Option<&str>) -> String {
    let auth = token.map(|t| format!("authorization: 'Bearer {t}',")).unwrap_or_default();
    format!(
        "fetch('{url}', {{method: 'POST', headers: {{{auth} 'content-type': 'application/json'}},
            body: JSON.stringify({{key: 'k', data: {{from: 'browser'}}}})}})
          .then(r => ({{status: r.status, request_id: r.headers.get('x-request-id'),
                        challenge: r.headers.get('www-authenticate')}}))
          .catch(e => 'blocked')"
    )
}

async fn preflight(app: &TestApp, origin: &str) -> reqwest::header::HeaderMap {
    let response = app
        .http
        .request(reqwest::Method::OPTIONS, app.url("/v1/streams/CORS/messages"))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization,content-type")
        .send()
        .await
        .unwrap();
    response.headers().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_origin_calls_the_api_from_a_browser_and_others_are_blocked() {
    let (allowed, other) = (page_server().await, page_server().await);
    let allowed_origin = allowed.clone();
    let app = TestApp::start_with(move |s| {
        s.auth.hs256_secret = Some(SECRET.into());
        s.cors_allowed_origins = vec![allowed_origin];
    })
    .await;
    let body = json!({"subjects":["cors.*"],"partitions":1});
    assert_eq!(call(&app, "PUT", "/v1/streams/CORS", Some(&scoped("keygate:admin")), Some(body)).await.0, 201);
    let token = scoped("publish:CORS");
    let url = app.url("/v1/streams/CORS/messages");

    // The preflight answer: this origin, the methods and headers, cached.
    let answer = preflight(&app, &allowed).await;
    let header = |name: &str| answer.get(name).map(|v| v.to_str().unwrap().to_ascii_lowercase());
    assert_eq!(header("access-control-allow-origin").as_deref(), Some(allowed.as_str()));
    assert!(header("access-control-allow-headers").unwrap().contains("authorization"), "{answer:?}");
    for method in ["GET", "POST", "PUT", "DELETE"] {
        assert!(answer["access-control-allow-methods"].to_str().unwrap().contains(method), "{answer:?}");
    }
    assert_eq!(header("access-control-max-age").as_deref(), Some("600"));
    assert!(preflight(&app, &other).await.get("access-control-allow-origin").is_none());

    let mut browser = Browser::launch().await;
    browser.navigate(&format!("{allowed}/")).await;
    let published = browser.eval(&fetch_script(&url, Some(&token))).await;
    assert_eq!(published["status"], 200, "{published}");
    assert!(published["request_id"].is_string(), "x-request-id is exposed: {published}");
    let refused = browser.eval(&fetch_script(&url, None)).await;
    assert_eq!(refused["status"], 401, "{refused}");
    assert!(refused["challenge"].as_str().is_some_and(|c| c.starts_with("Bearer")), "{refused}");

    browser.navigate(&format!("{other}/")).await;
    assert_eq!(browser.eval(&fetch_script(&url, Some(&token))).await, Value::from("blocked"));
    let stored = app.stream_messages("CORS").await;
    assert_eq!(stored.len(), 1, "only the allowed page's message was published");
}

#[tokio::test]
async fn without_allowed_origins_there_is_no_cors_answer() {
    let app = TestApp::start().await;
    let answer = preflight(&app, "http://127.0.0.1:1").await;
    assert!(answer.keys().all(|name| !name.as_str().starts_with("access-control-")), "{answer:?}");
}
