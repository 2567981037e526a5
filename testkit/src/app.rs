//! keygate started in-process against a nats-server of its own, and the
//! helpers tests call it with.

use std::time::{Duration, Instant};

use keygate::Settings;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::nats::NatsServer;

/// An HTTP client for tests (reqwest needs a TLS provider chosen).
pub fn http_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// keygate running in-process against its own nats-server.
pub struct TestApp {
    pub nats_server: Option<NatsServer>,
    pub nats_url: String,
    pub base: String,
    pub http: reqwest::Client,
    pub nats: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestApp {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(adjust: impl FnOnce(&mut Settings)) -> Self {
        let nats_server = NatsServer::start();
        let url = nats_server.url();
        Self::start_inner(Some(nats_server), url.clone(), url, adjust).await
    }

    /// Another keygate on an existing server.
    pub async fn start_on(url: String) -> Self {
        Self::start_on_with(url, |_| {}).await
    }

    pub async fn start_on_with(url: String, adjust: impl FnOnce(&mut Settings)) -> Self {
        Self::start_inner(None, url.clone(), url, adjust).await
    }

    /// keygate reaching `server` through `keygate_url` (a proxy); the test's
    /// own client connects directly.
    pub async fn start_through(server: NatsServer, keygate_url: String) -> Self {
        let url = server.url();
        Self::start_inner(Some(server), keygate_url, url, |_| {}).await
    }

    async fn start_inner(
        nats_server: Option<NatsServer>,
        keygate_url: String,
        url: String,
        adjust: impl FnOnce(&mut Settings),
    ) -> Self {
        // KEYGATE_TEST_LOG=keygate=debug shows keygate's logs for a failing test.
        if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("KEYGATE_TEST_LOG") {
            let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
        }
        let mut settings = Settings::for_nats_url(keygate_url);
        adjust(&mut settings);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(keygate::run(settings, listener, shutdown.clone()));
        let nats = async_nats::connect(url.clone()).await.unwrap();
        let js = async_nats::jetstream::new(nats.clone());
        let mut app =
            Self { nats_server, nats_url: url, base, http: http_client(), nats, js, shutdown, task: Some(task) };
        app.wait_ready().await;
        app
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = self.http.get(self.url("/readyz")).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            if let Some(task) = self.task.take_if(|task| task.is_finished()) {
                panic!("keygate stopped before it became ready: {:?}", task.await);
            }
            assert!(Instant::now() < deadline, "keygate did not become ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts keygate's shutdown (as SIGTERM does).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// A metric's value in `/metrics` (summed over labels). The recorder is
    /// the process's: nextest runs each test in its own.
    pub async fn metric(&self, name: &str) -> f64 {
        crate::keygate::metric_at(&self.http, &self.base, name).await
    }

    /// Asserts that nothing was acked or terminated without a verdict.
    pub async fn assert_no_acks_without_verdict(&self) {
        assert_eq!(self.metric(crate::keygate::ACKS_WITHOUT_VERDICT).await, 0.0, "keygate_acks_without_verdict_total");
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn put(&self, path: &str, body: Value) -> (u16, Value) {
        into_parts(self.http.put(self.url(path)).json(&body).send().await.unwrap()).await
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        into_parts(self.http.post(self.url(path)).json(&body).send().await.unwrap()).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        into_parts(self.http.get(self.url(path)).send().await.unwrap()).await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        into_parts(self.http.delete(self.url(path)).send().await.unwrap()).await
    }

    /// Creates a stream through the API and checks it was created.
    pub async fn create_stream(&self, name: &str, body: Value) {
        let (status, view) = self.put(&format!("/v1/streams/{name}"), body).await;
        assert_eq!(status, 201, "{view}");
    }

    /// The raw value of a KV key.
    pub async fn kv_raw(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let store = self.js.get_key_value(bucket).await.ok()?;
        store.get(key).await.unwrap().map(|b| b.to_vec())
    }

    /// Every message of a stream, in order: (subject, payload).
    pub async fn stream_messages(&self, stream: &str) -> Vec<(String, Vec<u8>, Option<async_nats::HeaderMap>)> {
        use futures::StreamExt;
        let handle = self.js.get_stream(stream).await.unwrap();
        let total = handle.cached_info().state.messages as usize;
        let consumer =
            handle.create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default()).await.unwrap();
        let mut messages = consumer.messages().await.unwrap();
        let mut out = Vec::with_capacity(total);
        while out.len() < total {
            let m = tokio::time::timeout(Duration::from_secs(10), messages.next()).await.unwrap().unwrap().unwrap();
            out.push((m.subject.to_string(), m.payload.to_vec(), m.headers.clone()));
        }
        out
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

pub async fn into_parts(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let content_type =
        response.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let bytes = response.bytes().await.unwrap();
    if status >= 400 {
        assert_eq!(content_type, "application/problem+json", "status {status} body {bytes:?}");
    }
    let value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap_or(Value::Null) };
    if status >= 400 {
        assert_eq!(value["status"], status, "problem status matches: {value}");
        assert!(value["detail"].as_str().is_some_and(|d| !d.is_empty()), "problem has a detail: {value}");
    }
    (status, value)
}

/// Polls `check` until it returns `Some`, or fails after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "condition not met within {limit:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
