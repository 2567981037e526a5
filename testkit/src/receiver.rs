//! A scripted webhook receiver: records every request and answers what the
//! test's script says.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;

/// One request as received, with the status it was answered.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub at: Instant,
    pub path: String,
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    /// The status answered; 0 while answering, or when the caller gave up.
    pub status: u16,
    /// When the answer was sent.
    pub answered: Option<Instant>,
}

impl Recorded {
    /// A request to `/m1` of key `k` for `seq`, made and answered at the
    /// given instants: what the order checks' own tests feed them.
    pub fn of_key_k(seq: u64, at: Instant, status: u16, answered: Instant) -> Self {
        Self {
            at,
            path: "/m1".into(),
            headers: HashMap::from([
                ("keygate-key".to_owned(), "k".to_owned()),
                ("keygate-stream-seq".to_owned(), seq.to_string()),
            ]),
            body: Vec::new(),
            status,
            answered: Some(answered),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    pub fn key(&self) -> String {
        self.header("keygate-key").unwrap_or_default().to_owned()
    }
    pub fn seq(&self) -> u64 {
        self.header("keygate-stream-seq").and_then(|v| v.parse().ok()).unwrap_or(0)
    }
    pub fn attempt(&self) -> u64 {
        self.header("keygate-attempt").and_then(|v| v.parse().ok()).unwrap_or(0)
    }
    pub fn fencing(&self) -> u64 {
        self.header("keygate-fencing-token").and_then(|v| v.parse().ok()).unwrap_or(0)
    }
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// What to answer.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub delay: Duration,
}

impl Answer {
    pub fn status(status: u16) -> Self {
        Self { status, headers: Vec::new(), body: String::new(), delay: Duration::ZERO }
    }
    pub fn ok() -> Self {
        Self::status(200)
    }
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

type Script = dyn Fn(&Recorded, usize) -> Answer + Send + Sync;
type Arrivals = Arc<Mutex<HashMap<String, usize>>>;

/// A running receiver; stops when dropped.
pub struct Receiver {
    pub base: String,
    log: Arc<Mutex<Vec<Recorded>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Starts a receiver answering with `script(request, earlier requests for the same webhook-id)`.
    pub async fn start(script: impl Fn(&Recorded, usize) -> Answer + Send + Sync + 'static) -> Self {
        let log: Arc<Mutex<Vec<Recorded>>> = Arc::default();
        let script: Arc<Script> = Arc::new(script);
        let arrivals: Arrivals = Arc::default();
        let state = (log.clone(), script, arrivals);
        let app = Router::new().fallback(move |uri: axum::http::Uri, headers: HeaderMap, body: Bytes| {
            let (log, script, arrivals) = state.clone();
            async move { handle(log, script, arrivals, uri.path().to_owned(), headers, body).await }
        });
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { base, log, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    log: Arc<Mutex<Vec<Recorded>>>,
    script: Arc<Script>,
    arrivals: Arrivals,
    path: String,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let headers: HashMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.as_str().to_ascii_lowercase(), v.to_str().unwrap_or_default().to_owned()))
        .collect();
    let recorded = Recorded { at: Instant::now(), path, headers, body: body.to_vec(), status: 0, answered: None };
    // Counted on arrival, so a retry that comes while an earlier attempt is
    // still being answered sees it.
    let earlier = {
        let mut arrivals = arrivals.lock().unwrap();
        let count = arrivals.entry(recorded.header("webhook-id").unwrap_or_default().to_owned()).or_default();
        *count += 1;
        *count - 1
    };
    let answer = script(&recorded, earlier);
    // Recorded on arrival: a caller that times out drops this handler.
    let index = {
        let mut log = log.lock().unwrap();
        log.push(recorded);
        log.len() - 1
    };
    // If the caller goes away first, the request ends then (status 0).
    struct Ended(Arc<Mutex<Vec<Recorded>>>, usize);
    impl Drop for Ended {
        fn drop(&mut self) {
            let mut log = self.0.lock().unwrap();
            log[self.1].answered.get_or_insert_with(Instant::now);
        }
    }
    let _ended = Ended(log.clone(), index);
    if !answer.delay.is_zero() {
        tokio::time::sleep(answer.delay).await;
    }
    {
        let mut log = log.lock().unwrap();
        log[index].status = answer.status;
        log[index].answered = Some(Instant::now());
    }
    let mut response = (StatusCode::from_u16(answer.status).unwrap(), answer.body).into_response();
    for (name, value) in answer.headers {
        response.headers_mut().insert(
            axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            axum::http::HeaderValue::from_str(&value).unwrap(),
        );
    }
    response
}

/// Per-key order (docs/guarantees.md), checked on what a receiver saw: when a message
/// arrives, every earlier message of its key was already answered 2xx
/// before it (or dead-lettered: `skipped`), and no other request of its key
/// is still open.
pub fn assert_key_order(requests: &[Recorded], published: &HashMap<String, Vec<u64>>, skipped: &[u64]) {
    assert_key_order_except(requests, published, skipped, &[]);
}

/// As [`assert_key_order`]; requests of `timing_out` keys may overlap (a
/// caller that times out stops waiting while the endpoint keeps working).
pub fn assert_key_order_except(
    requests: &[Recorded],
    published: &HashMap<String, Vec<u64>>,
    skipped: &[u64],
    timing_out: &[String],
) {
    // Each request's key and sequence read once, its requests by key in
    // arrival order, and each (key, seq)'s first 2xx answer: comparing every
    // request with every other took minutes for the cluster run's 8,000
    // messages in a debug build.
    let keyed: Vec<(String, u64, &Recorded)> = requests.iter().map(|r| (r.key(), r.seq(), r)).collect();
    let mut of_key: HashMap<&str, Vec<(u64, &Recorded)>> = HashMap::new();
    let mut first_ok: HashMap<(&str, u64), Instant> = HashMap::new();
    for (key, seq, r) in &keyed {
        of_key.entry(key.as_str()).or_default().push((*seq, *r));
        if let (true, Some(answered)) = (r.ok(), r.answered) {
            first_ok.entry((key.as_str(), *seq)).and_modify(|t| *t = (*t).min(answered)).or_insert(answered);
        }
    }
    for (key, arrivals) in &of_key {
        if timing_out.iter().any(|k| k == key) {
            continue;
        }
        for (i, (seq, r)) in arrivals.iter().enumerate() {
            for (earlier_seq, earlier) in &arrivals[..i] {
                let open = earlier.answered.is_none_or(|t| t > r.at);
                assert!(!open, "key {key}: seq {seq} arrived while seq {earlier_seq} was still being delivered");
            }
        }
    }
    for (key, seq, r) in &keyed {
        let Some(seqs) = published.get(key) else { continue };
        for earlier in seqs.iter().filter(|s| **s < *seq && !skipped.contains(s)) {
            let done = first_ok.get(&(key.as_str(), *earlier)).is_some_and(|t| *t <= r.at);
            assert!(done, "key {key}: seq {seq} was delivered before seq {earlier} was acknowledged");
        }
    }
}
