//! Prometheus metrics: every name in one place, labels bounded (stream,
//! group and member names, route templates, verdicts; never keys or raw
//! paths).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{LazyLock, OnceLock, RwLock};

use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Messages published through the REST API, by outcome (`stored`, `duplicate`, `error`).
pub const PUBLISHED: &str = "keygate_publish_messages_total";
/// Time from receiving a publish request to answering it.
pub const PUBLISH_SECONDS: &str = "keygate_publish_request_duration_seconds";
/// Webhook deliveries by verdict (`ack`, `nak`, `term`).
pub const DELIVERIES: &str = "keygate_deliveries_total";
/// Messages handed to an endpoint (webhook, WebSocket or pull client) whose
/// verdict is not applied yet: how much of the pipeline is busy at once.
pub const DELIVERIES_IN_FLIGHT: &str = "keygate_deliveries_in_flight";
/// Time an endpoint took to answer a delivery.
pub const ENDPOINT_SECONDS: &str = "keygate_endpoint_duration_seconds";
/// Deliveries that were not a message's first attempt.
pub const REDELIVERIES: &str = "keygate_redeliveries_total";
/// Acks or terms keygate was about to send without a verdict behind them
/// (the endpoint's ack, a stored dead letter, an operator's skip). They are
/// refused, not sent; any value above 0 is a bug (docs/guarantees.md).
pub const ACKS_WITHOUT_VERDICT: &str = "keygate_acks_without_verdict_total";
/// Deliveries that reached this instance after a gap in the consumer's
/// delivery sequence (deliveries it never saw): the handover barrier went up.
pub const DELIVERY_GAPS: &str = "keygate_delivery_gaps_total";
/// Endpoints' outputs by target stream and outcome: `stored`, or
/// `duplicate` (an earlier delivery of the same message stored it, and the
/// target stream's duplicate window dropped it; docs/pipelines.md).
pub const OUTPUTS_PUBLISHED: &str = "keygate_outputs_published_total";
/// Messages copied to the dead-letter stream.
pub const DEAD_LETTERS: &str = "keygate_dead_letters_total";
/// Dead letters published again to their stream (a repeated redrive of
/// one letter is not counted).
pub const REDRIVEN: &str = "keygate_dead_letters_redriven_total";
/// Circuit breakers that tripped and paused their member.
pub const BREAKER_TRIPS: &str = "keygate_breaker_trips_total";
/// Pins gained and lost by this keygate's member instances.
pub const PIN_CHANGES: &str = "keygate_pin_changes_total";
/// Member instances this keygate runs.
pub const MEMBER_INSTANCES: &str = "keygate_member_instances";
/// Partitions whose head message is being retried, per member instance.
pub const BLOCKED_PARTITIONS: &str = "keygate_blocked_partitions";
/// Keys whose head is retrying under key ordering (gauge; never labelled by key).
pub const BLOCKED_KEYS: &str = "keygate_blocked_keys";
/// Messages not yet delivered per partition of a group (sampled).
pub const PARTITION_PENDING: &str = "keygate_partition_pending_messages";
/// Messages a consumer subscriber holds delayed by shuffling right now.
pub const SHUFFLE_WINDOW: &str = "keygate_shuffle_window_messages";
/// First deliveries delayed by shuffling.
pub const SHUFFLE_DELAYED: &str = "keygate_shuffle_delayed_total";
/// Open WebSocket member connections.
pub const WS_CONNECTIONS: &str = "keygate_websocket_connections";
/// Pull instances running on this keygate (one per member or subscriber being fetched from).
pub const PULL_INSTANCES: &str = "keygate_pull_instances";
/// 1 while this keygate holds the lease of a singleton duty (label `duty`), else 0.
pub const SINGLETON_HELD: &str = "keygate_singleton_held";
/// Pins a replica stepped down because it held more than its share of a group's (cluster/balance.rs).
pub const PIN_REBALANCES: &str = "keygate_pin_rebalances_total";
/// Step-downs keygate asked of an elastic group's work-queue stream whose source stayed inactive.
pub const SOURCE_RESTARTS: &str = "keygate_source_restarts_total";
/// Tasks alive in keygate's runtime, read at each scrape (a leak shows as growth).
pub const RUNTIME_TASKS: &str = "keygate_runtime_alive_tasks";
/// HTTP requests by route template, method and status.
pub const HTTP_REQUESTS: &str = "keygate_http_requests_total";
/// HTTP request latency by route template and method.
pub const HTTP_SECONDS: &str = "keygate_http_request_duration_seconds";

/// The scrape: runtime gauges read now, then every metric as Prometheus text.
pub fn render(handle: &PrometheusHandle) -> String {
    // Present from the first scrape, so a check of "still 0" reads a 0.
    metrics::counter!(ACKS_WITHOUT_VERDICT).increment(0);
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        metrics::gauge!(RUNTIME_TASKS).set(runtime.metrics().num_alive_tasks() as f64);
    }
    handle.render()
}

/// Counts a request routed through the API or its pages: by route template
/// (`unmatched` without one), method and status.
pub fn count_http_request(
    route: Option<&str>,
    method: &axum::http::Method,
    status: axum::http::StatusCode,
    seconds: f64,
) {
    /// A request's count (by method and status) and latency (by method).
    type Handles = (Counter, Histogram);
    static SERIES: LazyLock<Series<(&str, u16), Handles>> = LazyLock::new(Series::default);
    let route = route.unwrap_or("unmatched");
    let method = method_label(method);
    let (requests, latency) = SERIES.get(route, (method, status.as_u16()), || {
        let (route, status) = (route.to_owned(), status.as_str().to_owned());
        (
            metrics::counter!(HTTP_REQUESTS, "route" => route.clone(), "method" => method, "status" => status),
            metrics::histogram!(HTTP_SECONDS, "route" => route, "method" => method),
        )
    });
    requests.increment(1);
    latency.record(seconds);
}

/// Counts one publish request's messages of one outcome (`stored`,
/// `duplicate`, `error`) to `stream`.
pub fn count_published(stream: &str, outcome: &'static str, messages: u64) {
    static SERIES: LazyLock<Series<&str, Counter>> = LazyLock::new(Series::default);
    count_by_stream(&SERIES, PUBLISHED, stream, outcome, messages);
}

/// Counts an answer's outputs of one outcome (`stored`, `duplicate`) to `stream`.
pub fn count_outputs_published(stream: &str, outcome: &'static str, messages: u64) {
    static SERIES: LazyLock<Series<&str, Counter>> = LazyLock::new(Series::default);
    count_by_stream(&SERIES, OUTPUTS_PUBLISHED, stream, outcome, messages);
}

/// Adds `messages` to counter `name`'s series of `stream` and `outcome`.
fn count_by_stream(
    series: &Series<&'static str, Counter>,
    name: &'static str,
    stream: &str,
    outcome: &'static str,
    messages: u64,
) {
    let register = || metrics::counter!(name, "stream" => stream.to_owned(), "outcome" => outcome);
    series.get(stream, outcome, register).increment(messages);
}

/// Times one publish request of a kind (`single`, `batch`, `atomic`).
pub fn time_publish(kind: &'static str, seconds: f64) {
    static SERIES: LazyLock<Series<(), Histogram>> = LazyLock::new(Series::default);
    SERIES.get(kind, (), || metrics::histogram!(PUBLISH_SECONDS, "kind" => kind)).record(seconds);
}

/// A method as a label: the standard ones by name, any other as `other`,
/// so a client inventing methods cannot add series.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}

/// Handles of one labelled metric, kept by their labels: the first a name
/// (a route template, a stream), the rest small copied values. Registering
/// a series on every call builds label strings and a key, copies them and
/// takes the registry's lock; a kept handle costs a read lock and a hash of
/// the borrowed labels (BENCHMARKS.md, "2026-12-07 (later): the publish path
/// with keygate's logs on"). Every label of a series must come from a
/// bounded set.
struct Series<T, H> {
    handles: RwLock<FastMap<Box<str>, FastMap<T, H>>>,
}

/// foldhash rather than SipHash: every request looks up several series, and
/// labels come from bounded sets keygate controls.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

impl<T, H> Default for Series<T, H> {
    fn default() -> Self {
        Self { handles: RwLock::default() }
    }
}

impl<T: Copy + Eq + Hash, H: Clone> Series<T, H> {
    fn get(&self, name: &str, rest: T, register: impl FnOnce() -> H) -> H {
        let kept =
            self.handles.read().unwrap_or_else(|p| p.into_inner()).get(name).and_then(|by| by.get(&rest)).cloned();
        if let Some(handle) = kept {
            return handle;
        }
        let handle = register();
        let mut handles = self.handles.write().unwrap_or_else(|p| p.into_inner());
        handles.entry(name.into()).or_default().entry(rest).or_insert(handle).clone()
    }
}

const LATENCY_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// The process-wide recorder, installed once (tests run several apps in one process).
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .expect("latency buckets are valid")
                .build_recorder();
            let handle = recorder.handle();
            drain_histograms(handle.clone());
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; keygate's metrics go there");
            }
            handle
        })
        .clone()
}

/// How often recorded histogram samples are folded into their buckets.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// The recorder keeps every histogram sample in a queue until an upkeep
/// folds it into the buckets, and a recorder built with `build_recorder`
/// runs none of its own: without scrapes, every request's samples stayed
/// in memory. A thread, not a task: the recorder outlives any one runtime
/// (tests start several apps in one process).
fn drain_histograms(handle: PrometheusHandle) {
    let spawned = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || loop {
        std::thread::sleep(UPKEEP_EVERY);
        handle.run_upkeep();
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the metrics upkeep; histograms are folded at each scrape only");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_handles_count_into_the_registered_series_and_methods_stay_bounded() {
        let handle = handle();
        let route = Some("/v1/kept-handles-test/{stream}");
        let post = axum::http::Method::POST;
        for _ in 0..3 {
            count_http_request(route, &post, axum::http::StatusCode::OK, 0.001);
        }
        count_http_request(route, &post, axum::http::StatusCode::NOT_FOUND, 0.001);
        for invented in ["BREW", "WHEN", "X-ANY"] {
            let method = axum::http::Method::from_bytes(invented.as_bytes()).unwrap();
            count_http_request(route, &method, axum::http::StatusCode::OK, 0.001);
        }
        let text = handle.render();
        let series = |method: &str, status: &str| {
            format!(
                r#"keygate_http_requests_total{{route="/v1/kept-handles-test/{{stream}}",method="{method}",status="{status}"}}"#
            )
        };
        assert!(text.contains(&format!("{} 3", series("POST", "200"))), "{text}");
        assert!(text.contains(&format!("{} 1", series("POST", "404"))), "{text}");
        assert!(text.contains(&format!("{} 3", series("other", "200"))), "invented methods share one series: {text}");
        assert!(!text.contains("BREW"), "{text}");
    }
}
