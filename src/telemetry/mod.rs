//! Traces (docs/tracing.md): the W3C trace context a publisher sends is
//! kept with each message and continued by each delivery, and keygate's
//! spans go out over OTLP/HTTP when the standard `OTEL_*` variables ask for
//! it, and not otherwise.
//!
//! Without export the context is passed through as it came: the publisher's
//! `traceparent` reaches the endpoint unchanged. With export, the message
//! carries keygate's publish span and the endpoint gets the delivery span,
//! both in the publisher's trace.

pub mod metrics;
mod plain_fields;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";
/// Longest `tracestate` kept (W3C allows 32 members of up to 256 bytes).
const MAX_TRACESTATE: usize = 8192;

/// The W3C trace context one message or request carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: String,
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// From a lookup of headers; `None` without a well-formed `traceparent`.
    pub fn from_lookup<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<Self> {
        let traceparent = get(TRACEPARENT)?.trim();
        if !well_formed(traceparent) {
            return None;
        }
        let tracestate = get(TRACESTATE).map(str::trim).filter(|s| !s.is_empty() && s.len() <= MAX_TRACESTATE);
        let visible = |s: &str| s.bytes().all(|b| (0x20..0x7f).contains(&b));
        Some(Self {
            traceparent: traceparent.to_owned(),
            tracestate: tracestate.filter(|s| visible(s)).map(str::to_owned),
        })
    }

    /// From HTTP request headers.
    pub fn from_http(headers: &axum::http::HeaderMap) -> Option<Self> {
        // Looked up by `HeaderName`: a `&str` name is parsed on every lookup,
        // and every request is looked at.
        const PARENT: axum::http::HeaderName = axum::http::HeaderName::from_static(TRACEPARENT);
        const STATE: axum::http::HeaderName = axum::http::HeaderName::from_static(TRACESTATE);
        Self::from_lookup(|name| {
            let name = if name == TRACEPARENT { PARENT } else { STATE };
            headers.get(&name).and_then(|v| v.to_str().ok())
        })
    }

    /// From a stored message's headers.
    pub fn from_message(headers: Option<&async_nats::HeaderMap>) -> Option<Self> {
        let headers = headers?;
        Self::from_lookup(|name| headers.get(name).map(|v| v.as_str()))
    }

    /// The context of `span`, when spans are exported (otherwise spans have
    /// no trace context and this is `None`).
    pub fn of_span(span: &tracing::Span) -> Option<Self> {
        let context = span.context();
        if !context.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = Carrier::default();
        TraceContextPropagator::new().inject_context(&context, &mut carrier);
        Some(Self { traceparent: carrier.traceparent?, tracestate: carrier.tracestate.filter(|s| !s.is_empty()) })
    }

    /// Makes `span` continue this context (a no-op without export).
    pub fn parent_of(&self, span: &tracing::Span) {
        let parent = TraceContextPropagator::new().extract(self);
        // Fails only when the span is disabled, which leaves nothing to link.
        let _ = span.set_parent(parent);
    }

    /// The headers that carry it.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        std::iter::once((TRACEPARENT, self.traceparent.as_str()))
            .chain(self.tracestate.as_deref().map(|state| (TRACESTATE, state)))
    }
}

impl Extractor for TraceContext {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => Some(&self.traceparent),
            TRACESTATE => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

#[derive(Default)]
struct Carrier {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl Injector for Carrier {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.traceparent = Some(value),
            TRACESTATE => self.tracestate = Some(value),
            _ => {}
        }
    }
}

/// `version-traceid-parentid-flags` in lower-case hex, with a trace id and
/// a parent id that are not all zeros (W3C Trace Context, version 00 and
/// later versions' first four fields).
fn well_formed(traceparent: &str) -> bool {
    let fields: Vec<&str> = traceparent.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let [version, trace, parent, flags, rest @ ..] = fields.as_slice() else { return false };
    hex(version, 2)
        && *version != "ff"
        && (*version != "00" || rest.is_empty())
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && parent.bytes().any(|b| b != b'0')
        && hex(flags, 2)
}

/// Whether the environment asks for span export: an OTLP endpoint is set,
/// and neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`.
pub fn export_requested(env: impl Fn(&str) -> Option<String>) -> bool {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return false;
    }
    if env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim() == "none") {
        return false;
    }
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .into_iter()
        .any(|name| env(name).is_some_and(|v| !v.trim().is_empty()))
}

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

/// Installs the process's subscriber: log lines in `format` to `writer`,
/// filtered by `filter`, and, with a `provider`, keygate's spans to its OTLP
/// exporter under their own filter, so a quiet log level does not silence
/// traces.
///
/// Without export the filter is the whole subscriber's, not the log
/// layer's: a filter of one layer (tracing-subscriber's per-layer
/// filtering) looks the span up again on every entry, exit and close, which
/// every request pays (BENCHMARKS.md, "2026-12-07 (stop 53): the per-request duties
/// of a single publish").
pub fn install_subscriber<W>(
    format: LogFormat,
    ansi: bool,
    writer: W,
    filter: tracing_subscriber::EnvFilter,
    provider: Option<&SdkTracerProvider>,
) where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;
    let registry = tracing_subscriber::registry();
    match provider {
        None => registry.with(filter).with(log_layer(format, ansi, writer)).init(),
        Some(provider) => {
            let keygate_spans = tracing_subscriber::filter::Targets::new().with_target("keygate", tracing::Level::INFO);
            let spans =
                tracing_opentelemetry::layer().with_tracer(provider.tracer("keygate")).with_filter(keygate_spans);
            registry.with(log_layer(format, ansi, writer).with_filter(filter)).with(spans).init();
        }
    }
}

/// The layer writing log lines, for a subscriber `S`.
fn log_layer<S, W>(format: LogFormat, ansi: bool, writer: W) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::Layer as _;
    match format {
        LogFormat::Json => tracing_subscriber::fmt::layer().json().with_writer(writer).boxed(),
        LogFormat::Pretty => tracing_subscriber::fmt::layer()
            .fmt_fields(plain_fields::PlainFields)
            .with_ansi(ansi)
            .with_writer(writer)
            .boxed(),
    }
}

/// Set once the OTLP provider exists: spans made only for export are made.
static EXPORTING_SPANS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether keygate's spans go out over OTLP. Spans that exist for the
/// trace alone ([`export_span`]) are not made otherwise: the log subscriber
/// records every span it is enabled for, at a cost per request
/// (BENCHMARKS.md, "2026-12-07 (later): the publish path with keygate's
/// logs on").
pub fn exporting_spans() -> bool {
    EXPORTING_SPANS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `tracing::info_span!` when spans are exported, else a disabled span: for
/// the spans that exist for the trace (the publish and delivery spans),
/// which the log subscriber would otherwise record on every publish and
/// delivery.
macro_rules! export_span {
    ($($span:tt)*) => {
        match $crate::telemetry::exporting_spans() {
            true => tracing::info_span!($($span)*),
            false => tracing::Span::none(),
        }
    };
}
pub(crate) use export_span;

/// The tracer provider exporting over OTLP/HTTP (protobuf) in batches, when
/// the environment asks for it. The exporter reads the standard variables
/// (endpoint, headers, timeout, batch settings); the service is `keygate`
/// unless `OTEL_SERVICE_NAME` says otherwise.
pub fn otlp_provider() -> anyhow::Result<Option<SdkTracerProvider>> {
    let env = |name: &str| std::env::var(name).ok();
    if !export_requested(env) {
        return Ok(None);
    }
    let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"));
    if let Some(other) = protocol.filter(|p| p.trim() != "http/protobuf") {
        anyhow::bail!("OTEL_EXPORTER_OTLP_PROTOCOL={other}: keygate exports spans over http/protobuf only");
    }
    // The exporter's client uses the same TLS provider as the webhook clients.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if env("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("keygate");
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    EXPORTING_SPANS.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(Some(provider))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn only_well_formed_traceparents_are_taken() {
        let lookup = |tp: &'static str| move |name: &str| (name == TRACEPARENT).then_some(tp);
        assert!(TraceContext::from_lookup(lookup(PARENT)).is_some());
        assert!(TraceContext::from_lookup(lookup("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"))
            .is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(TraceContext::from_lookup(lookup(bad)).is_none(), "{bad}");
        }
    }

    #[test]
    fn tracestate_travels_with_its_traceparent_only() {
        let both = |name: &str| match name {
            TRACEPARENT => Some(PARENT),
            TRACESTATE => Some("vendor=abc"),
            _ => None,
        };
        let context = TraceContext::from_lookup(both).unwrap();
        assert_eq!(context.headers().collect::<Vec<_>>(), [(TRACEPARENT, PARENT), (TRACESTATE, "vendor=abc")]);
        assert!(TraceContext::from_lookup(|name| (name == TRACESTATE).then_some("vendor=abc")).is_none());
    }

    #[test]
    fn without_export_the_trace_only_spans_are_not_made_even_under_a_log_subscriber() {
        let logs = tracing_subscriber::fmt().with_max_level(tracing::Level::INFO).with_writer(std::io::sink).finish();
        tracing::subscriber::with_default(logs, || {
            assert!(!exporting_spans(), "no OTLP provider in this process");
            assert!(!tracing::info_span!("request").is_disabled(), "the subscriber records info spans");
            assert!(export_span!("publish", stream = "S", messages = 1).is_disabled());
        });
    }

    #[test]
    fn export_needs_an_endpoint_and_no_opt_out() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
        };
        assert!(!export_requested(env(&[])));
        assert!(export_requested(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")])));
        assert!(export_requested(env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")])));
        assert!(!export_requested(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_SDK_DISABLED", "true")])));
        assert!(!export_requested(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
            ("OTEL_TRACES_EXPORTER", "none")
        ])));
    }

    #[test]
    fn without_export_a_span_has_no_context_to_give() {
        assert_eq!(TraceContext::of_span(&tracing::info_span!("deliver")), None);
    }
}
