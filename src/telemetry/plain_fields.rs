//! Text log fields written as tracing-subscriber's default writes them
//! without colours, minus its styling calls.
//!
//! The default field formatter paints every field name and `=` with a style,
//! empty when colours are off, and each painting is a formatting call of its
//! own. Every request's span has its fields formatted when it is made, so
//! that was a third of the span's cost (BENCHMARKS.md, "2026-12-07 (stop 55):
//! instructions per single publish"). Here a plain field is written
//! directly; messages, errors and `r#` names, which the default formatter
//! escapes or expands, and all fields when colours are on, still go through
//! it, so a line reads the same either way.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{RecordFields, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultFields, DefaultVisitor, Writer};
use tracing_subscriber::fmt::FormatFields;

/// The field formatter of text logs.
#[derive(Debug, Default)]
pub struct PlainFields;

impl<'writer> FormatFields<'writer> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        if writer.has_ansi_escapes() {
            return DefaultFields::new().format_fields(writer, fields);
        }
        let mut visitor = PlainVisitor { writer, is_empty: true, result: Ok(()) };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct PlainVisitor<'writer> {
    writer: Writer<'writer>,
    is_empty: bool,
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    /// Lets the default formatter write one field, after what is written.
    fn by_default(&mut self, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        if self.result.is_err() {
            return;
        }
        let mut default = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        record(&mut default);
        self.result = default.finish();
        self.is_empty = false;
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.by_default(|default| default.record_str(field, value)),
            _ => self.record_debug(field, &value),
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.by_default(|default| default.record_error(field, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        // The `log` crate's metadata, which the default formatter leaves out.
        if name.starts_with("log.") {
            return;
        }
        if name == "message" || name.starts_with("r#") {
            return self.by_default(|default| default.record_debug(field, value));
        }
        if !std::mem::take(&mut self.is_empty) {
            if let Err(e) = self.writer.write_char(' ') {
                self.result = Err(e);
                return;
            }
        }
        self.result = self.writer.write_str(name).and_then(|()| write!(self.writer, "={value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[derive(Debug)]
    struct Failed(Option<Box<Failed>>);

    impl fmt::Display for Failed {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(if self.0.is_some() { "outer \x1b[31m failure" } else { "inner cause" })
        }
    }

    impl std::error::Error for Failed {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.0.as_deref().map(|e| e as _)
        }
    }

    /// What a span and events inside it write, with `fields` as the
    /// formatter.
    fn written<N>(fields: N) -> String
    where
        N: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        let out = Captured::default();
        let writer = {
            let out = out.clone();
            move || out.clone()
        };
        let layer =
            tracing_subscriber::fmt::layer().with_ansi(false).without_time().fmt_fields(fields).with_writer(writer);
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("request", id = "a\"b", method = %"POST", uri = %"/v1/streams/S/messages");
            let _entered = span.enter();
            span.record("id", "c d");
            tracing::info!(partition = 3, r#type = "x", flag = true, "stored \x1b[2J {}", 7);
            let failed = Failed(Some(Box::new(Failed(None))));
            tracing::warn!(error = &failed as &(dyn std::error::Error + 'static), "publish failed");
            tracing::warn!(error = %failed, ratio = 0.5, text = ?"q\"uote");
            tracing::info!(message = "only a message");
        });
        let text = out.0.lock().unwrap().clone();
        String::from_utf8(text).unwrap()
    }

    #[test]
    fn lines_read_as_the_default_formatter_writes_them() {
        let plain = written(PlainFields);
        assert_eq!(plain, written(DefaultFields::new()));
        assert!(plain.contains("request{id=\"a\\\"b\" method=POST uri=/v1/streams/S/messages id=\"c d\"}"), "{plain}");
        assert!(plain.contains("partition=3 type=\"x\" flag=true"), "{plain}");
    }
}
