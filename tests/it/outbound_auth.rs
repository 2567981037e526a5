//! Outbound headers and credentials (docs/operations.md, "Outbound headers
//! and auth"): static headers, bearer tokens from a file (read again when
//! it changes) or the environment, OAuth2 client credentials from a local
//! token server, and mTLS to a loopback TLS receiver with certificates made
//! in the test. Against a real nats-server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::receiver::{Answer, Receiver, Recorded};
use crate::support::{eventually, TestApp};

const WAIT: Duration = Duration::from_secs(20);

async fn app_with_credentials(dir: &std::path::Path) -> TestApp {
    let dir = dir.to_path_buf();
    TestApp::start_with(move |s| s.destinations.credentials_dir = Some(dir)).await
}

async fn group(app: &TestApp) {
    app.create_stream("K", json!({"subjects":["k.*"],"partitions":1})).await;
    let group = json!({"kind":"static","partitions":1,"members":["m1"],"ack_wait_ms":2000});
    assert_eq!(app.put("/v1/streams/K/groups/g", group).await.0, 201);
}

async fn register(app: &TestApp, body: Value) -> (u16, Value) {
    app.put("/v1/streams/K/groups/g/members/m1/webhook", body).await
}

async fn publish(app: &TestApp, n: u64) -> u64 {
    let (status, ack) = app.post("/v1/streams/K/messages", json!({"key": format!("k{n}"), "data": {"n": n}})).await;
    assert_eq!(status, 200, "{ack}");
    ack["seq"].as_u64().unwrap()
}

async fn acked(receiver: &Receiver, seq: u64) -> Recorded {
    eventually(WAIT, || async { receiver.requests().into_iter().find(|r| r.seq() == seq && r.ok()) }).await
}

#[tokio::test]
async fn static_headers_and_bearer_tokens_from_a_file_or_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), "first-token\n").unwrap();
    let app = app_with_credentials(dir.path()).await;
    group(&app).await;
    let receiver = Receiver::start(|_, _| Answer::ok()).await;
    let hook = json!({"url": receiver.url("/m1"), "headers": {"X-Tenant": "acme"}, "auth": {"bearer_file": "token"}});
    let (status, view) = register(&app, hook).await;
    assert_eq!(status, 201, "{view}");
    assert_eq!((view["headers"].clone(), view["auth"].clone()), (json!(["X-Tenant"]), json!({"bearer_file": "token"})));
    let (_, shown) = app.get("/v1/streams/K/groups/g/members/m1/webhook").await;
    assert!(!shown.to_string().contains("acme") && !shown.to_string().contains("first-token"), "{shown}");

    let first = acked(&receiver, publish(&app, 0).await).await;
    assert_eq!(first.header("authorization"), Some("Bearer first-token"));
    assert_eq!(first.header("x-tenant"), Some("acme"));
    // The file changes: the next delivery carries the new token.
    std::fs::write(dir.path().join("token"), "second-token-longer").unwrap();
    let second = acked(&receiver, publish(&app, 1).await).await;
    assert_eq!(second.header("authorization"), Some("Bearer second-token-longer"));

    // From the environment (nextest runs each test in its own process).
    std::env::set_var("WEBHOOK_AUTH_TEST_TOKEN", "env-token");
    let hook = json!({"url": receiver.url("/m1"), "auth": {"bearer_env": "WEBHOOK_AUTH_TEST_TOKEN"}});
    assert_eq!(register(&app, hook).await.0, 200);
    let from_env = eventually(WAIT, || async {
        let seq = publish(&app, 2).await;
        let r = acked(&receiver, seq).await;
        (r.header("authorization") == Some("Bearer env-token")).then_some(r)
    })
    .await;
    assert!(from_env.header("x-tenant").is_none(), "the replaced registration has no headers");

    // Refused, and nothing changes.
    for (bad, status) in [
        (json!({"auth": {"bearer_file": "../token"}}), 422),
        (json!({"auth": {"bearer_file": "/etc/passwd"}}), 422),
        (json!({"auth": {"bearer_env": "KEYGATE_AUTH_HS256_SECRET"}}), 400),
        (json!({"auth": {"bearer_env": "HOME"}}), 400),
        (json!({"auth": {"bearer_file": "token", "bearer_env": "WEBHOOK_AUTH_X"}}), 400),
        (json!({"headers": {"Authorization": "Bearer x"}}), 400),
        (json!({"headers": {"Host": "evil"}}), 400),
        (json!({"headers": {"keygate-key": "forged"}}), 400),
    ] {
        let mut hook = json!({"url": receiver.url("/m1")});
        hook.as_object_mut().unwrap().extend(bad.as_object().unwrap().clone());
        let (got, problem) = register(&app, hook).await;
        assert_eq!(got, status, "{bad}: {problem}");
    }
    assert_eq!(
        app.get("/v1/streams/K/groups/g/members/m1/webhook").await.1["auth"]["bearer_env"],
        "WEBHOOK_AUTH_TEST_TOKEN"
    );
    // Without a credentials directory, files are refused outright.
    let plain = TestApp::start_on(app.nats_url.clone()).await;
    let hook = json!({"url": receiver.url("/m1"), "auth": {"bearer_file": "token"}});
    assert_eq!(register(&plain, hook).await.0, 422);
}

#[tokio::test]
async fn oauth2_tokens_are_fetched_cached_and_fetched_again_after_a_401() {
    use axum::routing::post;
    let fetches = Arc::new(AtomicUsize::new(0));
    let forms = Arc::new(Mutex::new(Vec::<String>::new()));
    let token_server = {
        let (fetches, forms) = (fetches.clone(), forms.clone());
        axum::Router::new().route(
            "/token",
            post(move |body: String| {
                let (fetches, forms) = (fetches.clone(), forms.clone());
                async move {
                    forms.lock().unwrap().push(body);
                    let n = fetches.fetch_add(1, Ordering::SeqCst) + 1;
                    axum::Json(json!({"access_token": format!("tok-{n}"), "token_type": "Bearer", "expires_in": 3600}))
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let token_url = format!("http://{}/token", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, token_server).await });

    std::env::set_var("WEBHOOK_AUTH_CLIENT_SECRET", "s3cret");
    let app = TestApp::start().await;
    group(&app).await;
    // The first token is refused, as an expired one is.
    let receiver = Receiver::start(|r, _| match r.header("authorization") {
        Some("Bearer tok-2") => Answer::ok(),
        _ => Answer::status(401),
    })
    .await;
    let auth = json!({"oauth2": {"token_url": token_url, "client_id": "keygate", "client_secret_env": "WEBHOOK_AUTH_CLIENT_SECRET", "scope": "hooks"}});
    let (status, view) = register(&app, json!({"url": receiver.url("/m1"), "auth": auth})).await;
    assert_eq!(status, 201, "{view}");
    assert!(!view.to_string().contains("s3cret"));
    let mut seqs = Vec::new();
    for n in 0..5 {
        seqs.push(publish(&app, n).await);
    }
    for seq in &seqs {
        acked(&receiver, *seq).await;
    }
    assert_eq!(fetches.load(Ordering::SeqCst), 2, "one token, then one more after the 401; cached in between");
    let form = forms.lock().unwrap()[0].clone();
    for part in ["grant_type=client_credentials", "client_id=keygate", "client_secret=s3cret", "scope=hooks"] {
        assert!(form.split('&').any(|p| p == part), "{form}");
    }
    assert_eq!(app.get("/v1/dead-letters").await.1["dead_letters"], json!([]), "a 401 with auth is retried");
    let private = json!({"url": receiver.url("/m1"), "auth": {"oauth2": {"token_url": "http://10.1.2.3/token", "client_id": "k", "client_secret_env": "WEBHOOK_AUTH_CLIENT_SECRET"}}});
    assert_eq!(register(&app, private).await.0, 422, "the token URL passes the destination policy too");
}

/// A CA, and a certificate it signs for `name` (server or client).
struct TestPki {
    ca_pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl TestPki {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, "keygate test CA");
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
        let key = rcgen::KeyPair::generate().unwrap();
        let ca_pem = params.self_signed(&key).unwrap().pem();
        Self { ca_pem, issuer: rcgen::Issuer::new(params, key) }
    }

    /// (certificate PEM, key PEM)
    fn leaf(&self, name: &str, client: bool) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = rcgen::KeyPair::generate().unwrap();
        (params.signed_by(&key, &self.issuer).unwrap().pem(), key.serialize_pem())
    }
}

/// A loopback HTTPS receiver that demands a client certificate from `pki`'s
/// CA; counts the requests that got through.
async fn mtls_receiver(pki: &TestPki) -> (u16, Arc<AtomicUsize>) {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (cert, key) = pki.leaf("localhost", false);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(pki.ca_pem.as_bytes()).unwrap()).unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots)).build().unwrap();
    let config = rustls::ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = Arc::new(AtomicUsize::new(0));
    let counter = served.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let (acceptor, counter) = (acceptor.clone(), counter.clone());
            tokio::spawn(async move {
                // No client certificate: the handshake fails here.
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper::service::service_fn(move |_request| {
                    counter.fetch_add(1, Ordering::SeqCst);
                    async { Ok::<_, std::convert::Infallible>(hyper::Response::new(String::new())) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (port, served)
}

#[tokio::test]
async fn mtls_presents_a_client_certificate_to_a_tls_receiver() {
    let pki = TestPki::new();
    let (port, served) = mtls_receiver(&pki).await;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = pki.leaf("keygate", true);
    std::fs::write(dir.path().join("client.pem"), cert).unwrap();
    std::fs::write(dir.path().join("client.key"), key).unwrap();
    std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
    let app = app_with_credentials(dir.path()).await;
    group(&app).await;
    let url = format!("https://localhost:{port}/hook");

    // Without the certificate the receiver refuses the connection: retried, never delivered.
    let hook =
        json!({"url": url, "auth": {"mtls": {"cert_file": "ca.pem", "key_file": "client.key", "ca_file": "ca.pem"}}});
    let (status, _) = register(&app, hook).await;
    assert_eq!(status, 201, "files are checked for place, their contents when used");
    publish(&app, 0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(served.load(Ordering::SeqCst), 0, "a certificate that is not the key's is refused");

    let hook = json!({"url": url, "auth": {"mtls": {"cert_file": "client.pem", "key_file": "client.key", "ca_file": "ca.pem"}}});
    assert_eq!(register(&app, hook).await.0, 200);
    eventually(WAIT, || async { (served.load(Ordering::SeqCst) >= 1).then_some(()) }).await;
    eventually(WAIT, || async {
        let (_, view) = app.get("/v1/streams/K/groups/g").await;
        (view["assignment"][0]["num_ack_pending"] == 0 && view["assignment"][0]["num_pending"] == 0).then_some(())
    })
    .await;
    let missing = json!({"url": url, "auth": {"mtls": {"cert_file": "nope.pem", "key_file": "client.key"}}});
    assert_eq!(register(&app, missing).await.0, 422);
}
