//! Bearer-token authentication and scopes, against a real keygate and nats-server.

use std::path::PathBuf;
use std::time::Duration;

use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use crate::support::{into_parts, TestApp};

pub(crate) const SECRET: &str = "a-test-secret-of-at-least-32-bytes!!";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures/auth").join(name)
}

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// An HS256 token with these claims added to a valid `exp`.
fn hs256(claims: Value) -> String {
    let mut all = json!({"sub": "test", "exp": now() + 600});
    all.as_object_mut().unwrap().extend(claims.as_object().unwrap().clone());
    encode(&Header::new(Algorithm::HS256), &all, &EncodingKey::from_secret(SECRET.as_bytes()).unwrap()).unwrap()
}

pub(crate) fn scoped(scope: &str) -> String {
    hs256(json!({ "scope": scope }))
}

pub(crate) async fn start_with_secret() -> TestApp {
    TestApp::start_with(|s| s.auth.hs256_secret = Some(SECRET.into())).await
}

pub(crate) async fn call(
    app: &TestApp,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let (status, body, _) = call_full(app, method, path, token, body).await;
    (status, body)
}

async fn call_full(
    app: &TestApp,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut request = app.http.request(method.parse().unwrap(), app.url(path));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let headers = response.headers().clone();
    let (status, body) = into_parts(response).await;
    (status, body, headers)
}

#[tokio::test]
async fn a_request_without_a_token_is_a_401_problem_with_a_bearer_challenge_and_changes_nothing() {
    let app = start_with_secret().await;
    let (status, problem, headers) =
        call_full(&app, "PUT", "/v1/streams/ORDERS", None, Some(json!({"subjects":["orders.*"]}))).await;
    assert_eq!(status, 401, "{problem}");
    assert_eq!(problem["type"], "https://keygate.dev/problems/unauthorized");
    assert_eq!(headers["www-authenticate"], "Bearer realm=\"keygate\"");
    assert!(app.js.get_stream("ORDERS").await.is_err(), "a refused request created the stream");
    let (status, _) = call(&app, "GET", "/v1/streams/ORDERS", Some(&scoped("keygate:admin")), None).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn health_metrics_and_the_document_stay_open() {
    let app = start_with_secret().await;
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json", "/docs/"] {
        let status = app.http.get(app.url(path)).send().await.unwrap().status().as_u16();
        assert_eq!(status, 200, "{path}");
    }
}

#[tokio::test]
async fn tokens_that_do_not_verify_are_401_invalid_token() {
    let app = start_with_secret().await;
    let expired = hs256(json!({"scope": "keygate:admin", "exp": now() - 120}));
    let not_yet = hs256(json!({"scope": "keygate:admin", "nbf": now() + 120}));
    let other_secret = encode(
        &Header::new(Algorithm::HS256),
        &json!({"scope": "keygate:admin", "exp": now() + 600}),
        &EncodingKey::from_secret(b"another-secret-another-secret-another").unwrap(),
    )
    .unwrap();
    let no_exp = encode(
        &Header::new(Algorithm::HS256),
        &json!({"scope": "keygate:admin"}),
        &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
    )
    .unwrap();
    for (token, says) in [
        (expired.as_str(), "expired"),
        (not_yet.as_str(), "not valid yet"),
        (other_secret.as_str(), "signature"),
        (no_exp.as_str(), "`exp`"),
        ("not-a-jwt", "malformed"),
    ] {
        let (status, problem, headers) = call_full(&app, "GET", "/v1/streams", Some(token), None).await;
        assert_eq!(status, 401, "{says}: {problem}");
        assert!(problem["detail"].as_str().unwrap().contains(says), "{says}: {problem}");
        let challenge = headers["www-authenticate"].to_str().unwrap();
        assert!(challenge.starts_with("Bearer realm=\"keygate\", error=\"invalid_token\""), "{challenge}");
    }
    // Within the leeway, a just-expired token still works (clock skew).
    let skewed = hs256(json!({"scope": "keygate:admin", "exp": now() - 5}));
    assert_eq!(call(&app, "GET", "/v1/streams", Some(&skewed), None).await.0, 200);
}

#[tokio::test]
async fn publish_scopes_open_only_their_streams() {
    let app = start_with_secret().await;
    let admin = scoped("keygate:admin");
    for name in ["ORDERS", "AUDIT"] {
        let body = json!({"subjects":[format!("{}.*", name.to_lowercase())],"partitions":4});
        assert_eq!(call(&app, "PUT", &format!("/v1/streams/{name}"), Some(&admin), Some(body)).await.0, 201);
    }
    let orders = scoped("publish:ORDERS");
    let message = json!({"key":"alice","data":{"n":1}});
    let (status, ack) = call(&app, "POST", "/v1/streams/ORDERS/messages", Some(&orders), Some(message.clone())).await;
    assert_eq!(status, 200, "{ack}");
    let batch = json!({"messages":[message.clone()]});
    assert_eq!(call(&app, "POST", "/v1/streams/ORDERS/messages/batch", Some(&orders), Some(batch)).await.0, 200);

    let (status, problem, headers) =
        call_full(&app, "POST", "/v1/streams/AUDIT/messages", Some(&orders), Some(message.clone())).await;
    assert_eq!(status, 403, "{problem}");
    assert_eq!(problem["type"], "https://keygate.dev/problems/forbidden");
    assert!(problem["detail"].as_str().unwrap().contains("publish:AUDIT"));
    assert_eq!(
        headers["www-authenticate"],
        "Bearer realm=\"keygate\", error=\"insufficient_scope\", scope=\"publish:AUDIT\""
    );
    assert_eq!(app.js.get_stream("AUDIT").await.unwrap().info().await.unwrap().state.messages, 0);
    // Publishing does not grant administration.
    assert_eq!(call(&app, "GET", "/v1/streams/ORDERS", Some(&orders), None).await.0, 403);
    assert_eq!(call(&app, "DELETE", "/v1/streams/ORDERS", Some(&orders), None).await.0, 403);
    // A trailing wildcard, and the `scopes` array claim.
    let every = hs256(json!({"scopes": ["publish:*"]}));
    assert_eq!(call(&app, "POST", "/v1/streams/AUDIT/messages", Some(&every), Some(message)).await.0, 200);
    assert_eq!(call(&app, "PUT", "/v1/streams/X", Some(&every), Some(json!({"subjects":["x"]}))).await.0, 403);
}

#[tokio::test]
async fn events_need_a_consume_scope_covering_the_filter_and_take_the_token_as_a_query_parameter() {
    let app = start_with_secret().await;
    let one_group = scoped("consume:ORDERS/billing");
    let status_of = |query: String| {
        let http = app.http.clone();
        let url = app.url(&format!("/v1/events?{query}"));
        async move {
            let response = tokio::time::timeout(Duration::from_secs(5), http.get(url).send()).await.unwrap().unwrap();
            response.status().as_u16()
        }
    };
    assert_eq!(status_of(format!("stream=ORDERS&group=billing&access_token={one_group}")).await, 200);
    assert_eq!(status_of(format!("stream=ORDERS&group=shipping&access_token={one_group}")).await, 403);
    assert_eq!(status_of(format!("stream=ORDERS&access_token={one_group}")).await, 403);
    assert_eq!(status_of(format!("access_token={one_group}")).await, 403);
    assert_eq!(status_of("stream=ORDERS&group=billing".into()).await, 401);
    let whole_stream = scoped("consume:ORDERS/*");
    assert_eq!(status_of(format!("stream=ORDERS&access_token={whole_stream}")).await, 200);
    // The query token is for the browser routes only.
    let admin = scoped("keygate:admin");
    assert_eq!(app.http.get(app.url(&format!("/v1/streams?access_token={admin}"))).send().await.unwrap().status(), 401);
}

#[tokio::test]
async fn rs256_es256_and_eddsa_tokens_verify_with_a_pem_public_key() {
    for (public, private, algorithm) in [
        ("rsa-public.pem", "rsa-private.pem", Algorithm::RS256),
        ("ec-public.pem", "ec-private.pem", Algorithm::ES256),
        ("ed-public.pem", "ed-private.pem", Algorithm::EdDSA),
    ] {
        let app = TestApp::start_with(|s| s.auth.public_key_pem = Some(fixture(public))).await;
        let pem = std::fs::read(fixture(private)).unwrap();
        let key = match algorithm {
            Algorithm::RS256 => EncodingKey::from_rsa_pem(&pem),
            Algorithm::ES256 => EncodingKey::from_ec_pem(&pem),
            _ => EncodingKey::from_ed_pem(&pem),
        }
        .unwrap();
        let token = encode(&Header::new(algorithm), &json!({"scope":"keygate:admin","exp": now() + 60}), &key).unwrap();
        assert_eq!(call(&app, "GET", "/v1/streams", Some(&token), None).await.0, 200, "{algorithm:?}");
        // An HS256 token is refused: no secret is configured (no algorithm confusion).
        assert_eq!(call(&app, "GET", "/v1/streams", Some(&scoped("keygate:admin")), None).await.0, 401);
    }
}

#[tokio::test]
async fn jwks_keys_are_chosen_by_kid_and_issuer_and_audience_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    let secret_b64 = base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, SECRET);
    std::fs::write(
        &jwks,
        json!({"keys":[
            {"kty":"oct","kid":"one","alg":"HS256","k": secret_b64},
            {"kty":"oct","kid":"two","alg":"HS256","k": "b3RoZXItc2VjcmV0LW90aGVyLXNlY3JldC1vdGhlci1zZWNyZXQ"}
        ]})
        .to_string(),
    )
    .unwrap();
    let app = TestApp::start_with(|s| {
        s.auth.jwks_file = Some(jwks.clone());
        s.auth.issuer = Some("https://issuer.test".into());
        s.auth.audience = Some("keygate".into());
    })
    .await;
    let token = |kid: &str, claims: Value| {
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(kid.into());
        encode(&header, &claims, &EncodingKey::from_secret(SECRET.as_bytes()).unwrap()).unwrap()
    };
    let good = json!({"scope":"keygate:admin","exp": now() + 60,"iss":"https://issuer.test","aud":"keygate"});
    assert_eq!(call(&app, "GET", "/v1/streams", Some(&token("one", good.clone())), None).await.0, 200);
    let (status, problem) = call(&app, "GET", "/v1/streams", Some(&token("two", good.clone())), None).await;
    assert_eq!(status, 401, "kid two holds another secret: {problem}");
    let (status, problem) = call(&app, "GET", "/v1/streams", Some(&token("three", good.clone())), None).await;
    assert_eq!(status, 401);
    assert!(problem["detail"].as_str().unwrap().contains("key id `three`"), "{problem}");
    let mut wrong_issuer = good.clone();
    wrong_issuer["iss"] = json!("https://elsewhere.test");
    let (_, problem) = call(&app, "GET", "/v1/streams", Some(&token("one", wrong_issuer)), None).await;
    assert!(problem["detail"].as_str().unwrap().contains("issuer"), "{problem}");
    let mut wrong_audience = good.clone();
    wrong_audience["aud"] = json!("someone-else");
    let (_, problem) = call(&app, "GET", "/v1/streams", Some(&token("one", wrong_audience)), None).await;
    assert!(problem["detail"].as_str().unwrap().contains("audience"), "{problem}");
    let mut no_audience = good;
    no_audience.as_object_mut().unwrap().remove("aud");
    let (_, problem) = call(&app, "GET", "/v1/streams", Some(&token("one", no_audience)), None).await;
    assert!(problem["detail"].as_str().unwrap().contains("`aud`"), "{problem}");
}

#[tokio::test]
async fn the_admin_listener_serves_health_and_metrics_and_takes_metrics_off_the_api() {
    // A port from the ephemeral range can be taken as an outgoing connection's
    // source port before keygate binds it (it failed CI once); see free_port.
    let admin: std::net::SocketAddr = ([127, 0, 0, 1], crate::support::free_port()).into();
    let app = TestApp::start_with(|s| s.admin_listen = Some(admin)).await;
    let admin_url = |path: &str| format!("http://{admin}{path}");
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(app.http.get(admin_url(path)).send().await.unwrap().status(), 200, "{path}");
    }
    let (status, problem) = into_parts(app.http.get(admin_url("/v1/streams")).send().await.unwrap()).await;
    assert_eq!(status, 404, "{problem}");
    assert_eq!(app.get("/metrics").await.0, 404);
    assert_eq!(app.get("/healthz").await.0, 200);
}

#[tokio::test]
async fn every_answer_carries_a_request_id_and_a_given_one_is_echoed() {
    let app = TestApp::start().await;
    let generated = app.http.get(app.url("/v1/streams")).send().await.unwrap();
    let id = generated.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    let echoed = app.http.get(app.url("/v1/nothing")).header("x-request-id", "abc-123").send().await.unwrap();
    assert_eq!(echoed.status(), 404);
    assert_eq!(echoed.headers()["x-request-id"], "abc-123");
}

#[test]
fn every_v1_operation_in_the_document_names_its_scope_and_its_401_and_403() {
    let doc: Value = serde_json::from_str(&keygate::http::openapi_json()).unwrap();
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
    let mut checked = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let security = &operation["security"];
            if !path.starts_with("/v1/") {
                assert!(security.is_null(), "{method} {path} should be open");
                continue;
            }
            let scope = security[0]["bearer"][0].as_str().unwrap_or_else(|| panic!("{method} {path}: {security}"));
            let expected = match (method.as_str(), path.as_str()) {
                ("post", p) if p.ends_with("/messages") || p.ends_with("/messages/batch") => "publish:{stream}",
                (_, "/v1/events") => "consume:{stream}/{group}",
                ("get", p) if p.ends_with("/subscribers/{subscriber}/ws") => "subscribe:{stream}/{consumer}",
                ("get", p) if p.ends_with("/ws") => "consume:{stream}/{group}",
                ("post", p) if p.contains("/subscribers/") && (p.ends_with("/fetch") || p.ends_with("/acks")) => {
                    "subscribe:{stream}/{consumer}"
                }
                ("post", p) if p.ends_with("/fetch") || p.ends_with("/acks") => "consume:{stream}/{group}",
                _ => "keygate:admin",
            };
            assert_eq!(scope, expected, "{method} {path}");
            assert!(operation["responses"]["401"].is_object() && operation["responses"]["403"].is_object());
            checked += 1;
        }
    }
    assert!(checked > 20, "{checked}");
}

/// keygate's and the server's state are refused on the data path whatever
/// the token: admin, `publish:*`, or a wildcard aimed at the reserved names.
#[tokio::test]
async fn no_token_reaches_reserved_streams_or_subjects_through_publish() {
    let app = start_with_secret().await;
    let admin = scoped("keygate:admin");
    let stream = json!({"subjects":["orders.*"],"partitions":2});
    assert_eq!(call(&app, "PUT", "/v1/streams/ORDERS", Some(&admin), Some(stream)).await.0, 201);
    let elastic = json!({"kind":"elastic","partitions":2,"members":["m1"]});
    assert_eq!(call(&app, "PUT", "/v1/streams/ORDERS/groups/e", Some(&admin), Some(elastic)).await.0, 201);
    let hook = json!({"url":"http://127.0.0.1:9/hook"});
    let webhook = "/v1/streams/ORDERS/groups/e/members/m1/webhook";
    assert_eq!(call(&app, "PUT", webhook, Some(&admin), Some(hook)).await.0, 201);
    // An object store's stream, as the server names it.
    let files = async_nats::jetstream::stream::Config {
        name: "OBJ_files".into(),
        subjects: vec!["$O.files.>".into()],
        ..Default::default()
    };
    app.js.create_stream(files).await.unwrap();
    let targets = [
        ("KV_keygate-webhooks", json!({"subject":"$KV.keygate-webhooks.ORDERS.e.m1","data":{"url":"http://evil"}})),
        ("OBJ_files", json!({"subject":"$O.files.M.x","data":{}})),
        ("KEYGATE_DEAD_LETTERS", json!({"subject":"keygate.dlq.ORDERS.e.m1","data":1})),
        ("ORDERS-e", json!({"key":"k","data":1})),
        ("ORDERS", json!({"subject":"$JS.API.STREAM.DELETE.ORDERS","data":1})),
    ];
    for token in [admin.clone(), scoped("publish:*"), scoped("publish:KV_*"), scoped("publish:ORDERS*")] {
        for (stream, body) in &targets {
            let (status, problem) =
                call(&app, "POST", &format!("/v1/streams/{stream}/messages"), Some(&token), Some(body.clone())).await;
            assert!(matches!(status, 400 | 403), "{stream} {body}: {status} {problem}");
            assert_eq!(problem["status"].as_u64(), Some(status as u64), "a problem answer");
        }
    }
    let (_, view) = call(&app, "GET", webhook, Some(&admin), None).await;
    assert_eq!(view["url"], "http://127.0.0.1:9/hook", "the registration is untouched");
}
