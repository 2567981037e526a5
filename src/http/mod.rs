//! The HTTP API: routes, the OpenAPI document generated from the handlers,
//! and problem+json answers for anything that does not route.

pub mod auth;
pub mod browser;
pub mod consumers;
pub mod cors;
pub mod dead_letters;
pub mod events;
pub mod extract;
pub mod groups;
pub mod health;
mod json_errors;
pub mod messages;
mod name_hints;
pub mod pauses;
pub mod problem;
pub mod pull;
pub mod seek;
pub mod serve;
pub mod streams;
mod target;
pub mod webhooks;
pub mod ws;

use axum::extract::DefaultBodyLimit;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::app::AppState;
use crate::http::problem::ApiError;

/// The document's fixed parts; paths and schemas come from the handlers.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "keygate",
        description = "Kafka-style ordered-per-key processing on NATS JetStream for any HTTP or WebSocket client.",
        license(name = "Apache-2.0")
    ),
    tags(
        (name = "streams", description = "Streams, optionally partition-stamped"),
        (name = "messages", description = "Keyed publishing"),
        (name = "groups", description = "Partitioned consumer groups (pcgroups-compatible)"),
        (name = "consumers", description = "Plain consumers with a priority-group policy"),
        (name = "webhooks", description = "Members served by webhook URLs"),
        (name = "websocket", description = "Members served over WebSocket"),
        (name = "pull", description = "Members and subscribers served to HTTP clients that fetch and ack"),
        (name = "dead-letters", description = "Messages terminated after failing: browse, redrive, delete"),
        (name = "events", description = "Pin, assignment and verdict events"),
        (name = "health", description = "Liveness and readiness")
    ),
    // Not a request or an answer of keygate's: what a webhook endpoint may
    // answer to publish outputs (docs/pipelines.md), for generated clients.
    components(schemas(crate::delivery::outputs::OutputsAnswer, crate::delivery::outputs::OutputMessage))
)]
struct ApiDoc;

/// The API routes and the OpenAPI document describing them.
pub fn api() -> (Router<AppState>, utoipa::openapi::OpenApi) {
    let (router, mut doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(streams::list_streams))
        .routes(routes!(streams::put_stream, streams::get_stream, streams::delete_stream))
        .routes(routes!(messages::publish_message))
        .routes(routes!(messages::publish_batch))
        .routes(routes!(groups::list_groups))
        .routes(routes!(groups::put_group, groups::get_group, groups::delete_group))
        .routes(routes!(groups::add_members))
        .routes(routes!(groups::drop_member))
        .routes(routes!(groups::put_mappings, groups::delete_mappings))
        .routes(routes!(groups::step_down))
        .routes(routes!(seek::seek_group))
        .routes(routes!(seek::seek_consumer))
        .routes(routes!(pauses::pause_member))
        .routes(routes!(pauses::resume_member))
        .routes(routes!(groups::skip_partition))
        .routes(routes!(groups::skip_key))
        .routes(routes!(groups::retry_key_now))
        .routes(routes!(groups::retry_partition_now))
        .routes(routes!(consumers::put_consumer, consumers::get_consumer, consumers::delete_consumer))
        .routes(routes!(consumers::unpin_consumer))
        .routes(routes!(consumers::put_subscriber, consumers::get_subscriber, consumers::delete_subscriber))
        .routes(routes!(pauses::pause_subscriber))
        .routes(routes!(pauses::resume_subscriber))
        .routes(routes!(webhooks::put_webhook, webhooks::get_webhook, webhooks::delete_webhook))
        .routes(routes!(webhooks::rotate_secret))
        .routes(routes!(consumers::rotate_subscriber_secret))
        .routes(routes!(ws::join_member))
        .routes(routes!(ws::join_consumer))
        .routes(routes!(pull::fetch_member))
        .routes(routes!(pull::settle_member))
        .routes(routes!(pull::fetch_subscriber))
        .routes(routes!(pull::settle_subscriber))
        .routes(routes!(dead_letters::list_dead_letters, dead_letters::delete_dead_letters))
        .routes(routes!(dead_letters::get_dead_letter, dead_letters::delete_dead_letter))
        .routes(routes!(dead_letters::redrive_dead_letters))
        .routes(routes!(events::events))
        .split_for_parts();
    auth::document_security(&mut doc);
    document_common_problems(&mut doc);
    document_name_patterns(&mut doc);
    (router, doc)
}

/// A problem+json answer in the document.
pub(crate) fn problem_response(description: &str) -> utoipa::openapi::RefOr<utoipa::openapi::Response> {
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/problem+json",
                ContentBuilder::new().schema(Some(Ref::from_schema_name("Problem"))).build(),
            )
            .build(),
    )
}

/// Answers every `/v1` operation can give whatever it does: a malformed
/// path or query (400), NATS unavailable (503), and for those with a body,
/// one too large (413) or not JSON (415).
fn document_common_problems(doc: &mut utoipa::openapi::OpenApi) {
    for (path, item) in doc.paths.paths.iter_mut() {
        if !path.starts_with("/v1/") {
            continue;
        }
        for operation in [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch] {
            let Some(operation) = operation.as_mut() else { continue };
            let mut common =
                vec![("400", "invalid path, query or body"), ("503", "NATS or JetStream unavailable; retry later")];
            if operation.request_body.is_some() {
                common.push(("413", "the body is larger than keygate accepts"));
                common.push(("415", "the body is not JSON"));
            }
            for (status, description) in common {
                operation.responses.responses.entry(status.to_owned()).or_insert_with(|| problem_response(description));
            }
        }
    }
}

/// Path names follow `crate::names`' rules; saying so in the document lets
/// fuzzers and generated clients stay within them.
fn document_name_patterns(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::path::ParameterIn;
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    let max_of = |name: &str| match name {
        "stream" => Some(128),
        "group" | "member" | "consumer" | "subscriber" => Some(64),
        _ => None,
    };
    for item in doc.paths.paths.values_mut() {
        for operation in [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch] {
            let Some(operation) = operation.as_mut() else { continue };
            for parameter in operation.parameters.iter_mut().flatten() {
                let utoipa::openapi::RefOr::T(parameter) = parameter else { continue };
                let Some(max) = max_of(&parameter.name).filter(|_| parameter.parameter_in == ParameterIn::Path) else {
                    continue;
                };
                let schema = ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(format!("^[A-Za-z0-9_-]{{1,{max}}}$")))
                    .min_length(Some(1))
                    .max_length(Some(max))
                    .build();
                parameter.schema = Some(schema.into());
            }
        }
    }
}

/// The OpenAPI document as committed at `openapi/openapi.json`.
pub fn openapi_json() -> String {
    let (_, doc) = api();
    let mut text = doc.to_pretty_json().expect("the OpenAPI document serializes");
    text.push('\n');
    text
}

/// The whole HTTP application: the router inside the layers every request
/// passes. A service, not a `Router`: a router around them would box and
/// clone a service and box a future for every request once more.
pub fn router(
    state: AppState,
) -> impl tower::Service<
    axum::extract::Request,
    Response = Response,
    Error = std::convert::Infallible,
    Future: Send + 'static,
> + Clone
       + Send
       + Sync
       + 'static {
    let (api, doc) = api();
    let body_limit = state.settings.max_body_bytes;
    let docs: Router<AppState> = Router::from(utoipa_swagger_ui::SwaggerUi::new("/docs").url("/openapi.json", doc))
        .layer(axum::middleware::map_response(docs_problem));
    let separate_admin = state.settings.admin_listen.is_some();
    let docs = docs
        .route("/demo", axum::routing::get(demo_page))
        .route("/ui", axum::routing::get(dashboard_page))
        .route("/client/keygate.js", axum::routing::get(js_client));
    // One middleware per route: each layer of axum middleware costs every
    // request a boxed service and future.
    let front_door = || axum::middleware::from_fn_with_state(state.clone(), front_door);
    let mut app = api
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), api_gate))
        .merge(docs.route_layer(front_door()));
    if !separate_admin {
        app = app.merge(metrics_route().route_layer(front_door()));
    }
    let app = app
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed("method not allowed on this route".into()) })
        .with_state(state.clone());
    // These wrap the finished router once: as layers of the router they
    // would wrap each route in a boxed service, which every request clones
    // and boxes a future for. CORS stays outside the guard and
    // authentication (a preflight carries no token).
    tower::ServiceBuilder::new()
        .map_response(|response: axum::http::Response<_>| response.map(axum::body::Body::new))
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http().make_span_with(request_span))
        .option_layer(cors::layer(&state.settings.cors_allowed_origins))
        .layer(CatchPanicLayer::custom(|_| ApiError::Internal("a handler panicked".into()).into_response()))
        .layer(DefaultBodyLimit::max(body_limit))
        .service(app)
}

/// A browser member: publish, join over WebSocket, ack or NAK by button.
async fn demo_page() -> Response {
    self_contained_page(include_str!("demo.html"))
}

/// The JavaScript client (clients/js/keygate.js), for pages to import
/// from keygate itself as /demo does.
async fn js_client() -> Response {
    let javascript = (axum::http::header::CONTENT_TYPE, "text/javascript; charset=utf-8");
    let cache = (axum::http::header::CACHE_CONTROL, "no-cache");
    ([javascript, cache], include_str!("../../clients/js/keygate.js")).into_response()
}

/// The live dashboard: streams, groups, partitions by owner, pins, backlog,
/// blocked partitions and events, with admin actions.
async fn dashboard_page() -> Response {
    self_contained_page(include_str!("dashboard.html"))
}

/// A page with its scripts and styles inline: it works offline, and its
/// policy lets it talk to keygate only.
fn self_contained_page(html: &'static str) -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
            ),
        ],
        html,
    )
        .into_response()
}

/// The admin listener: liveness, readiness and metrics, nothing else.
pub fn admin_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", axum::routing::get(health::healthz))
        .route("/readyz", axum::routing::get(health::readyz))
        .merge(metrics_route())
        .fallback(|| async { ApiError::NotFound("the admin listener serves /healthz, /readyz and /metrics".into()) })
        .with_state(state)
}

fn metrics_route() -> Router<AppState> {
    let handle = crate::telemetry::metrics::handle();
    Router::new()
        .route("/metrics", axum::routing::get(move || std::future::ready(crate::telemetry::metrics::render(&handle))))
}

/// The header a request's id travels in, both ways.
pub(crate) const REQUEST_ID: axum::http::HeaderName = axum::http::HeaderName::from_static("x-request-id");

/// Every log line of a request's work carries its id (`x-request-id`, taken
/// from the client when given, else generated, and echoed in the answer).
fn request_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    let id = request.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
    let span = tracing::info_span!("request", id, method = %request.method(), uri = %request.uri().path());
    // A parent matters to exported spans only; without export it is not
    // looked for (every request would pay for the lookup).
    if crate::telemetry::exporting_spans() {
        if let Some(caller) = crate::telemetry::TraceContext::from_http(request.headers()) {
            caller.parent_of(&span);
        }
    }
    span
}

/// Every API route's checks: the browser guard and the request metrics
/// ([`front_door`]), authentication, then the time limit, and a hint on a
/// 404 that names a stream or group by the wrong case
/// (src/http/name_hints.rs).
async fn api_gate(
    axum::extract::State(state): axum::extract::State<AppState>,
    path: axum::extract::RawPathParams,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    guarded_and_counted(&state, request, async |mut request| {
        if let Err(refused) = auth::authorize(&state, &path, &mut request) {
            return refused.into_response();
        }
        let hint_target = name_hints::hint_target(&state, &request);
        let response = bounded_in_time(state.settings.request_timeout, request, next).await;
        match hint_target {
            // Boxed, and only for a 404: its lookups would otherwise size
            // the future that every request allocates and moves.
            Some(uri) if response.status() == axum::http::StatusCode::NOT_FOUND => {
                Box::pin(name_hints::add_case_hint(&state, &uri, response)).await
            }
            _ => response,
        }
    })
    .await
}

/// The other routes' checks (documentation, pages, metrics): the browser
/// guard and the request metrics.
async fn front_door(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    guarded_and_counted(&state, request, async |request| next.run(request).await).await
}

/// Ends a `/v1` request that runs longer than the configured limit with a
/// 503. Streams are exempt (WebSocket upgrades and the event stream run for
/// as long as the client stays), fetches bound their own long poll
/// (`wait_ms`), and the health checks are exempt too.
async fn bounded_in_time(
    limit: std::time::Duration,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = request.extensions().get::<axum::extract::MatchedPath>().map(axum::extract::MatchedPath::as_str);
    let exempt = request.headers().contains_key(axum::http::header::UPGRADE)
        || route.is_none_or(|r| !r.starts_with("/v1/") || r == "/v1/events" || r.ends_with("/fetch"));
    if exempt {
        return next.run(request).await;
    }
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::Unavailable(format!("the request took longer than {} ms; retry later", limit.as_millis()))
            .into_response(),
    }
}

/// Runs a routed request unless a browser may not make it
/// (src/http/browser.rs), and counts it by route template (never the raw
/// path), method and status.
async fn guarded_and_counted(
    state: &AppState,
    request: axum::extract::Request,
    run: impl AsyncFnOnce(axum::extract::Request) -> Response,
) -> Response {
    let route = request.extensions().get::<axum::extract::MatchedPath>().cloned();
    let method = request.method().clone();
    let started = std::time::Instant::now();
    let response = match browser::refusal(state, &request) {
        Some(refused) => refused,
        None => run(request).await,
    };
    let route = route.as_ref().map(axum::extract::MatchedPath::as_str);
    crate::telemetry::metrics::count_http_request(route, &method, response.status(), started.elapsed().as_secs_f64());
    response
}

/// Swagger UI answers unknown files with a bare 404; keep every error problem+json.
async fn docs_problem(response: Response) -> Response {
    if response.status() == axum::http::StatusCode::NOT_FOUND {
        ApiError::NotFound("no such documentation file".into()).into_response()
    } else {
        response
    }
}

#[cfg(test)]
mod tests {
    use crate::future_size;

    /// Every `/v1` request allocates the gate's future and moves it into
    /// place; the 404 hint's lookups are boxed apart, so they do not size it.
    #[test]
    fn the_api_gates_future_leaves_the_404_hint_out() {
        let gate = future_size::of_values(super::api_gate);
        let hint = future_size::of_refs_value(super::name_hints::add_case_hint);
        assert!(gate < hint, "api_gate's future ({gate} bytes) holds the hint's ({hint} bytes)");
    }
}
