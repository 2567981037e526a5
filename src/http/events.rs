//! `/v1/events`: server-sent events from every keygate replica.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde::Deserialize;
use utoipa::IntoParams;

use super::extract::Query;
use crate::app::AppState;
use crate::events::subject_filter;
use crate::http::problem::{ApiError, Problem};
use crate::names::{GroupName, MemberName, StreamName};

/// Which events to follow.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventFilter {
    /// Only this stream's.
    #[param(value_type = Option<String>)]
    pub stream: Option<StreamName>,
    /// Only this group's.
    #[param(value_type = Option<String>)]
    pub group: Option<GroupName>,
    /// Only this member's.
    #[param(value_type = Option<String>)]
    pub member: Option<MemberName>,
    /// Only these types, comma-separated (e.g. `member.pinned,message.dead_lettered`).
    pub types: Option<String>,
}

/// Pin, assignment and verdict events as server-sent events (`event:` is
/// the type, `data:` the JSON event). Follows every replica's events.
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "events",
    params(EventFilter),
    responses(
        (status = 200, description = "an event stream", content_type = "text/event-stream", body = crate::events::Event),
        (status = 400, description = "invalid filter", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn events(
    State(state): State<AppState>,
    Query(filter): Query<EventFilter>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let subject = subject_filter(
        filter.stream.as_ref().map(StreamName::as_str),
        filter.group.as_ref().map(GroupName::as_str),
        filter.member.as_ref().map(MemberName::as_str),
    );
    let types: Option<Vec<String>> =
        filter.types.map(|t| t.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect());
    let mut subscription = state
        .runtime
        .broker
        .client
        .subscribe(subject)
        .await
        .map_err(|e| crate::nats::errors::unavailable_or_internal("subscribing to events", e))?;
    // The subscription is drained into a bounded queue at once: a client
    // that stops reading fills the queue, not keygate's memory (the NATS
    // client buffers up to 65,536 messages per subscription), and is then
    // dropped with a last event saying why.
    let (queue, queued) = tokio::sync::mpsc::channel::<async_nats::Message>(SSE_QUEUE);
    let lagged = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let marked = lagged.clone();
    tokio::spawn(async move {
        while let Some(message) = subscription.next().await {
            match queue.try_send(message) {
                Ok(()) => {}
                Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                    marked.store(true, std::sync::atomic::Ordering::Relaxed);
                    break;
                }
                Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => break,
            }
        }
    });
    let events = tokio_stream::wrappers::ReceiverStream::new(queued).filter_map(move |message| {
        let types = types.clone();
        async move {
            let value: serde_json::Value = serde_json::from_slice(&message.payload).ok()?;
            let kind = value.get("type")?.as_str()?.to_owned();
            if types.as_ref().is_some_and(|t| !t.contains(&kind)) {
                return None;
            }
            Some(Ok(SseEvent::default().event(kind).data(value.to_string())))
        }
    });
    let farewell = futures::stream::once(async move {
        lagged.load(std::sync::atomic::Ordering::Relaxed).then(|| {
            let detail = format!("the client fell {SSE_QUEUE} events behind; reconnect to continue");
            Ok(SseEvent::default()
                .event("stream.lagged")
                .data(serde_json::json!({"type":"stream.lagged","detail":detail}).to_string()))
        })
    })
    .filter_map(std::future::ready);
    // Event streams end at shutdown, so they do not hold the HTTP drain.
    let stream = events.chain(farewell).take_until(state.shutdown.clone().cancelled_owned());
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// Events queued for one event-stream client before it counts as lagging.
const SSE_QUEUE: usize = 1024;
