//! `GET …/members/{member}/ws`: a WebSocket connection becomes an instance
//! of a member. Several connections of one member share it through the
//! pin: one is served, the others stand by.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use utoipa::IntoParams;

use super::extract::{Path, Query};
use crate::app::AppState;
use crate::auth::Caller;
use crate::delivery::frames::{client_frames, ClientFrame, ServerFrame};
use crate::delivery::websocket::SocketEndpoint;
use crate::delivery::BatchLimits;
use crate::http::problem::{ApiError, Problem};
use crate::http::webhooks::{check_client_outputs, output_names};
use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::runtime::endpoint::Endpoint;
use crate::runtime::instance::serve;
use crate::runtime::target::Target;
use crate::webhook::{Backoff, BatchSpec};

/// The subprotocol keygate speaks (offered by clients that also pass their
/// token as a `bearer.<jwt>` subprotocol).
pub const SUBPROTOCOL: &str = "keygate.v1";
/// Message frames queued per connection before its partitions wait.
const MESSAGE_QUEUE: usize = 32;
/// Status frames queued per connection.
const STATUS_QUEUE: usize = 32;

/// Options of a WebSocket member.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct JoinOptions {
    /// Deliveries of one message before it is dead-lettered (1–1000, default 10).
    pub max_attempts: Option<u64>,
    /// Most messages in flight to this connection at once across the
    /// member's partitions (1–1000; default one per partition under
    /// partition ordering, 256 under key ordering).
    #[param(minimum = 1, maximum = 1000)]
    pub max_in_flight: Option<usize>,
    /// Messages per `batch` frame (1–1000): the connection then receives
    /// `{"type":"batch","messages":[…]}` and may answer all of them in one
    /// `results` frame (docs/batched-deliveries.md). Unset: one `message`
    /// frame each.
    #[param(minimum = 1, maximum = 1000)]
    pub batch: Option<u32>,
    /// With `batch`: how long a batch that is not full waits for more
    /// messages (0–10000 ms, default 0: send what is ready).
    #[param(minimum = 0, maximum = 10000)]
    pub batch_wait_ms: Option<u64>,
    /// Streams this connection's acks may publish to, comma-separated
    /// (`PAYMENTS,AUDIT`; docs/pipelines.md): each needs `publish:<stream>`
    /// and a duplicate window at least the connection's redelivery horizon.
    pub outputs: Option<String>,
    /// The bearer token, for browsers (which cannot set headers on a WebSocket).
    pub access_token: Option<String>,
}

/// Joins a group as an instance of `member` over a WebSocket. Server
/// frames: `message`, `pinned`, `standby`, `assigned`, `revoked`, `event`,
/// `error` (and `batch` with `batch`); client frames: `ack`, `nak` (with
/// `delay_ms`), `term`, `progress`, each naming a message `id`, or
/// `results` with several. Each partition has one message
/// in flight; a NAK'd message is never overtaken; un-acked messages come
/// again, in order, to whichever connection holds the pin next.
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}/groups/{group}/members/{member}/ws",
    tag = "websocket",
    params(("stream" = String, Path), ("group" = String, Path), ("member" = String, Path), JoinOptions),
    responses(
        (status = 101, description = "switching to the WebSocket protocol"),
        (status = 400, description = "not a WebSocket upgrade, or invalid options", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "the Origin is not allowed", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream, group or member", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "the member has as many WebSocket connections on this keygate as it may", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn join_member(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, group, member)): Path<(StreamName, GroupName, MemberName)>,
    Query(options): Query<JoinOptions>,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let batch = batch_of(options.batch, options.batch_wait_ms)?;
    let (upgrade, mut limits) = accept(upgrade, &headers, &state, options.max_attempts, batch)?;
    crate::webhook::check_max_in_flight(options.max_in_flight)?;
    limits.max_in_flight = options.max_in_flight;
    let who = super::target::group_member(&state, stream, group, member).await?;
    if let Some(names) = joined_outputs(options.outputs.as_deref())? {
        let ack_wait = state.runtime.stores.groups.settings(&who.stream, &who.group).await?.ack_wait();
        limits.outputs = check_client_outputs(&state, caller.as_deref(), names, limits.max_attempts, ack_wait).await?;
    }
    let instances = state.runtime.clone();
    let limit = state.settings.ws_max_connections_per_member;
    let slot = state.sockets_per_member.take(format!("member {}/{}/{}", who.stream, who.group, who.member), limit)?;
    let events_of =
        crate::events::subject_filter(Some(who.stream.as_str()), Some(who.group.as_str()), Some(who.member.as_str()));
    let target = Target::Member(who);
    let connections = state.connections.clone();
    let upgrade = small_frames(upgrade, &limits);
    Ok(upgrade.on_upgrade(move |socket| {
        let run: Runner = Box::new(move |endpoint, cancel| Box::pin(serve(instances, target, endpoint, cancel)));
        connections.track_future(serve_connection(state, events_of, socket, limits, run, slot))
    }))
}

/// WebSocket connections open per member or subscriber on this keygate,
/// so one name cannot take every connection slot (and every instance).
#[derive(Clone, Default)]
pub struct SocketCounts(Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>);

/// One counted connection; uncounted when dropped.
pub struct SocketSlot {
    counts: SocketCounts,
    name: String,
}

impl SocketCounts {
    /// A slot for `name`, unless it already has `limit` connections.
    pub fn take(&self, name: String, limit: usize) -> Result<SocketSlot, ApiError> {
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let open = counts.entry(name.clone()).or_default();
        if *open >= limit {
            return Err(ApiError::TooMany(format!(
                "{name} already has {limit} WebSocket connections on this keygate (--ws-max-connections-per-member)"
            )));
        }
        *open += 1;
        Ok(SocketSlot { counts: self.clone(), name })
    }
}

impl Drop for SocketSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(open) = counts.get_mut(&self.name) {
            *open -= 1;
            if *open == 0 {
                counts.remove(&self.name);
            }
        }
    }
}

/// Starts the instance a connection serves, given its endpoint.
type Runner = Box<
    dyn FnOnce(Arc<Endpoint>, CancellationToken) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;

/// Options of a WebSocket subscriber of a plain consumer.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SubscribeOptions {
    /// `prioritized` consumers: 0 (served first) to 9.
    pub priority: Option<u8>,
    /// `overflow` consumers: served only while at least this many messages wait.
    pub min_pending: Option<i64>,
    /// `overflow` consumers: served only while at least this many are un-acked.
    pub min_ack_pending: Option<i64>,
    /// Messages in flight to this connection at once, 1–256 (default 4).
    pub concurrency: Option<usize>,
    /// Deliveries of one message before it is dead-lettered (1–1000, default 10).
    pub max_attempts: Option<u64>,
    /// Messages per `batch` frame (1–1000): the connection then receives
    /// `{"type":"batch","messages":[…]}` and may answer all of them in one
    /// `results` frame (docs/batched-deliveries.md). Unset: one `message`
    /// frame each.
    #[param(minimum = 1, maximum = 1000)]
    pub batch: Option<u32>,
    /// With `batch`: how long a batch that is not full waits for more
    /// messages (0–10000 ms, default 0: send what is ready).
    #[param(minimum = 0, maximum = 10000)]
    pub batch_wait_ms: Option<u64>,
    /// Streams this connection's acks may publish to, comma-separated
    /// (docs/pipelines.md), as for a member's connection.
    pub outputs: Option<String>,
    /// The bearer token, for browsers.
    pub access_token: Option<String>,
}

/// Subscribes to a plain consumer over a WebSocket, with the pull options
/// its policy takes. The same frames as members; no key order, so up to
/// `concurrency` messages are in flight at once; `pinned` / `standby`
/// frames for `pinned_client` consumers.
#[utoipa::path(
    get,
    path = "/v1/streams/{stream}/consumers/{consumer}/subscribers/{subscriber}/ws",
    tag = "websocket",
    params(("stream" = String, Path), ("consumer" = String, Path), ("subscriber" = String, Path), SubscribeOptions),
    responses(
        (status = 101, description = "switching to the WebSocket protocol"),
        (status = 400, description = "not a WebSocket upgrade, or invalid options", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "the Origin is not allowed", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "unknown stream or consumer", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "a group member's consumer: join the group instead", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "the subscriber has as many WebSocket connections on this keygate as it may", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn join_consumer(
    State(state): State<AppState>,
    caller: Option<axum::Extension<Caller>>,
    Path((stream, consumer, subscriber)): Path<(StreamName, ConsumerName, MemberName)>,
    Query(options): Query<SubscribeOptions>,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let batch = batch_of(options.batch, options.batch_wait_ms)?;
    let (upgrade, mut limits) = accept(upgrade, &headers, &state, options.max_attempts, batch)?;
    let (who, current) = super::target::consumer_subscriber(&state, stream, consumer, subscriber).await?;
    if let Some(names) = joined_outputs(options.outputs.as_deref())? {
        let ack_wait = Duration::from_millis(current.ack_wait_ms);
        limits.outputs = check_client_outputs(&state, caller.as_deref(), names, limits.max_attempts, ack_wait).await?;
    }
    let pull = super::consumers::pull_options(
        current.policy,
        options.priority,
        options.min_pending,
        options.min_ack_pending,
        options.concurrency,
    )?;
    let instances = state.runtime.clone();
    let events_of =
        crate::events::subject_filter(Some(who.stream.as_str()), Some(who.group.as_str()), Some(who.member.as_str()));
    let limit = state.settings.ws_max_connections_per_member;
    let slot =
        state.sockets_per_member.take(format!("subscriber {}/{}/{}", who.stream, who.group, who.member), limit)?;
    let target = Target::Subscriber { who, options: pull };
    let connections = state.connections.clone();
    let upgrade = small_frames(upgrade, &limits);
    Ok(upgrade.on_upgrade(move |socket| {
        let run: Runner = Box::new(move |endpoint, cancel| Box::pin(serve(instances, target, endpoint, cancel)));
        connections.track_future(serve_connection(state, events_of, socket, limits, run, slot))
    }))
}

/// Client frames are small verdicts: small buffers keep idle connections
/// cheap, and a size cap keeps a misbehaving client from growing them. A
/// batched connection's `results` frame names up to 1,000 messages; a
/// connection that declared outputs acks with up to an answer's worth of
/// them (docs/pipelines.md).
fn small_frames(upgrade: WebSocketUpgrade, limits: &SocketLimits) -> WebSocketUpgrade {
    use crate::delivery::batch_verdict::MAX_BATCH_OUTPUTS_ANSWER;
    use crate::delivery::outputs::MAX_OUTPUT_ANSWER;
    let most = match (limits.batch.is_some(), limits.outputs.is_empty()) {
        (true, true) => 256 * 1024,
        (false, true) => 64 * 1024,
        (true, false) => MAX_BATCH_OUTPUTS_ANSWER,
        (false, false) => MAX_OUTPUT_ANSWER,
    };
    upgrade
        .protocols([SUBPROTOCOL])
        .read_buffer_size(1024)
        .write_buffer_size(0)
        .max_write_buffer_size(4 * 1024 * 1024)
        .max_message_size(most)
        .max_frame_size(most)
}

/// How a connection's deliveries are bounded.
#[derive(Debug, Clone)]
struct SocketLimits {
    max_attempts: u64,
    max_in_flight: Option<usize>,
    batch: Option<BatchLimits>,
    /// Streams its acks may publish to.
    outputs: Vec<StreamName>,
}

/// A join's `outputs`, comma-separated stream names; `None` when not given.
fn joined_outputs(outputs: Option<&str>) -> Result<Option<Vec<StreamName>>, ApiError> {
    outputs.map(|list| output_names(list.split(',').map(str::trim))).transpose()
}

/// A join's `batch` and `batch_wait_ms`, checked as a webhook's `batch` is.
fn batch_of(batch: Option<u32>, batch_wait_ms: Option<u64>) -> Result<Option<BatchLimits>, ApiError> {
    let Some(max_messages) = batch else {
        if batch_wait_ms.is_some() {
            return Err(ApiError::BadRequest("batch_wait_ms needs batch".into()));
        }
        return Ok(None);
    };
    let spec = BatchSpec { max_messages, max_bytes: None, max_wait_ms: batch_wait_ms };
    spec.check().map_err(|e| ApiError::BadRequest(e.to_string().replace("batch.max_messages", "batch")))?;
    Ok(Some(spec.limits()))
}

/// What both joins check before upgrading: a real upgrade, an allowed
/// origin, a sane `max_attempts`.
fn accept(
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
    headers: &HeaderMap,
    state: &AppState,
    max_attempts: Option<u64>,
    batch: Option<BatchLimits>,
) -> Result<(WebSocketUpgrade, SocketLimits), ApiError> {
    let upgrade =
        upgrade.map_err(|e| ApiError::BadRequest(format!("this route opens a WebSocket: {}", e.body_text())))?;
    check_origin(headers, &state.settings.ws_allowed_origins)?;
    let max_attempts = max_attempts_of(max_attempts)?;
    Ok((upgrade, SocketLimits { max_attempts, max_in_flight: None, batch, outputs: Vec::new() }))
}

/// A client-served member's or subscriber's `max_attempts` (WebSocket or
/// pull): 1–1000, default 10.
pub(super) fn max_attempts_of(requested: Option<u64>) -> Result<u64, ApiError> {
    let max_attempts = requested.unwrap_or(10);
    if !(1..=1000).contains(&max_attempts) {
        return Err(ApiError::BadRequest("max_attempts must be between 1 and 1000".into()));
    }
    Ok(max_attempts)
}

/// Browsers send `Origin`; other clients do not. Keygate's own origin (the
/// `/demo` page) and configured ones may connect.
fn check_origin(headers: &HeaderMap, allowed: &[String]) -> Result<(), ApiError> {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else { return Ok(()) };
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if super::browser::origin_allowed(origin, host, allowed) {
        Ok(())
    } else {
        Err(ApiError::OriginNotAllowed(format!(
            "origin {origin} may not open WebSocket members (see --ws-allowed-origins)"
        )))
    }
}

/// Runs one connection: the instance behind it, frames both ways,
/// liveness, and a Close frame at the end.
async fn serve_connection(
    state: AppState,
    events_of: String,
    socket: WebSocket,
    limits: SocketLimits,
    run: Runner,
    _slot: SocketSlot,
) {
    let gauge = metrics::gauge!(crate::telemetry::metrics::WS_CONNECTIONS);
    gauge.increment(1.0);
    let (mut sink, mut incoming) = socket.split();
    let (messages_tx, mut messages) = mpsc::channel(MESSAGE_QUEUE);
    let (status_tx, mut status) = mpsc::channel(STATUS_QUEUE);
    let closed = CancellationToken::new();
    let mut endpoint =
        SocketEndpoint::new(messages_tx, status_tx, closed.clone(), limits.max_attempts, Backoff::default());
    endpoint.max_in_flight = limits.max_in_flight;
    endpoint.batch = limits.batch;
    endpoint.outputs = limits.outputs;
    let endpoint = Arc::new(endpoint);
    let session_cancel = CancellationToken::new();
    let mut session = tokio::spawn(run(Arc::new(Endpoint::Socket(endpoint.clone())), session_cancel.clone()));
    let mut events = match state.runtime.broker.subscriptions.subscribe(&events_of).await {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "WebSocket member without events");
            None
        }
    };
    let ping_every = state.settings.ws_ping_interval;
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + ping_every, ping_every);
    let mut last_heard = Instant::now();
    let mut stopping = false;
    let close_reason: (u16, &str) = loop {
        tokio::select! {
            frame = status.recv() => {
                let Some(frame) = frame else { continue };
                if send(&mut sink, &frame).await.is_err() { break (1011, "") }
            }
            frame = messages.recv() => {
                let Some(frame) = frame else { continue };
                if send(&mut sink, &frame).await.is_err() { break (1011, "") }
            }
            event = next_event(&mut events) => {
                if let Some(frame) = event.and_then(|e| ServerFrame::event_from_json(&e.payload)) {
                    if send(&mut sink, &frame).await.is_err() { break (1011, "") }
                }
            }
            received = incoming.next() => {
                last_heard = Instant::now();
                match received {
                    Some(Ok(Message::Text(text))) => {
                        let errors = match client_frames(text.as_str()) {
                            Ok(frames) => settle_all(&endpoint, frames).await,
                            Err(e) => vec![format!("unreadable frame: {e}")],
                        };
                        let mut failed = false;
                        for error in errors {
                            failed = send(&mut sink, &ServerFrame::Error { error, id: None }).await.is_err();
                            if failed { break }
                        }
                        if failed { break (1011, "") }
                    }
                    Some(Ok(Message::Binary(_))) => {
                        let error = ServerFrame::Error { error: "frames are JSON text".into(), id: None };
                        if send(&mut sink, &error).await.is_err() { break (1011, "") }
                    }
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break (0, ""),
                }
            }
            _ = ping.tick() => {
                if last_heard.elapsed() > ping_every * 2 {
                    tracing::info!(events = %events_of, "WebSocket member went silent; closing");
                    break (1001, "no answer to pings");
                }
                if sink.send(Message::Ping(Default::default())).await.is_err() { break (1011, "") }
            }
            () = state.shutdown.cancelled(), if !stopping => {
                // Stop pulling; deliveries in flight may still be acked
                // while the session winds down.
                stopping = true;
                session_cancel.cancel();
            }
            _ = &mut session => break (1001, if stopping { "keygate is shutting down" } else { "the member's session ended" }),
        }
    };
    closed.cancel();
    session_cancel.cancel();
    if !session.is_finished() {
        let _ = session.await;
    }
    if close_reason.0 != 0 {
        let frame = CloseFrame { code: close_reason.0, reason: Utf8Bytes::from(close_reason.1) };
        let _ = tokio::time::timeout(Duration::from_secs(2), sink.send(Message::Close(Some(frame)))).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
    gauge.decrement(1.0);
}

/// Applies a frame's verdicts; what could not be applied, in words.
async fn settle_all(endpoint: &SocketEndpoint, frames: Vec<ClientFrame>) -> Vec<String> {
    let mut errors = Vec::new();
    for frame in frames {
        if let Err(e) = Box::pin(endpoint.settle(frame)).await {
            errors.push(e.to_string());
        }
    }
    errors
}

async fn send(
    sink: &mut futures::stream::SplitSink<WebSocket, Message>,
    frame: &ServerFrame,
) -> Result<(), axum::Error> {
    let text = serde_json::to_string(frame).unwrap_or_default();
    sink.send(Message::Text(text.into())).await
}

/// The next event; a lagging connection skips what it missed (events are
/// notifications), a closed tap ends the events.
async fn next_event(
    events: &mut Option<tokio::sync::broadcast::Receiver<Arc<async_nats::Message>>>,
) -> Option<Arc<async_nats::Message>> {
    let Some(receiver) = events else { return std::future::pending().await };
    loop {
        match receiver.recv().await {
            Ok(payload) => return Some(payload),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                *events = None;
                return std::future::pending().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(origin: Option<&str>, host: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, host.parse().unwrap());
        if let Some(o) = origin {
            h.insert(header::ORIGIN, o.parse().unwrap());
        }
        h
    }

    #[test]
    fn origins_are_keygates_own_or_configured() {
        assert!(check_origin(&headers(None, "kg:8080"), &[]).is_ok(), "non-browser clients send none");
        assert!(check_origin(&headers(Some("http://kg:8080"), "kg:8080"), &[]).is_ok());
        assert!(check_origin(&headers(Some("https://evil.test"), "kg:8080"), &[]).is_err());
        let allowed = vec!["https://app.test".to_owned()];
        assert!(check_origin(&headers(Some("https://app.test"), "kg:8080"), &allowed).is_ok());
        assert!(check_origin(&headers(Some("https://app.test.evil"), "kg:8080"), &allowed).is_err());
        assert!(check_origin(&headers(Some("https://any.test"), "kg:8080"), &["*".to_owned()]).is_ok());
    }
}
