//! What holds for any publish or batch body, however hostile: parsing and
//! preparing never panic, and whatever is accepted goes to a literal
//! subject its stream captures, in the partition range the stream's
//! transform stamps. Checked by the proptest below on every test run and,
//! coverage-guided, by the `publish_body` target of `fuzz/` (feature
//! `fuzzing`; `scripts/fuzz-code`).

use std::sync::LazyLock;

use async_nats::jetstream::stream::{Config, SubjectTransform};

use super::{prepare, BatchRequest, PublishRequest};
use crate::streams::StreamShape;

const PARTITIONS: u32 = 16;

/// A stamped one-key stream (as keygate creates them) and a multi-subject one.
static SHAPES: LazyLock<Vec<StreamShape>> = LazyLock::new(|| {
    let stamped = Config {
        name: "ORDERS".into(),
        subjects: vec!["orders.*".into()],
        subject_transform: Some(SubjectTransform {
            source: "orders.*".into(),
            destination: format!("{{{{partition({PARTITIONS},1)}}}}.orders.{{{{wildcard(1)}}}}"),
        }),
        ..Default::default()
    };
    let plain =
        Config { name: "EVENTS".into(), subjects: vec!["events.>".into(), "audit.*.log".into()], ..Default::default() };
    vec![StreamShape::from_config(&stamped), StreamShape::from_config(&plain)]
});

/// Panics when a body breaks the properties above.
pub fn check_body(body: &[u8]) {
    for shape in SHAPES.iter() {
        if let Ok(request) = serde_json::from_slice::<PublishRequest>(body) {
            check(shape, request);
        }
        if let Ok(batch) = serde_json::from_slice::<BatchRequest>(body) {
            for request in batch.messages {
                check(shape, request);
            }
        }
    }
}

fn check(shape: &StreamShape, request: PublishRequest) {
    let Ok(prepared) = prepare(shape, request, None, 1 << 20) else { return };
    let subject = &prepared.subject;
    assert!(
        subject.split('.').all(|t| !t.is_empty() && t != "*" && t != ">" && !t.contains(char::is_whitespace)),
        "accepted a subject that is not literal: {subject:?}"
    );
    assert!(shape.patterns.iter().any(|p| p.captures(subject).is_some()), "{subject:?} is outside the stream");
    if let Some(partition) = prepared.partition {
        assert!(partition < PARTITIONS, "partition {partition} of {subject:?}");
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::check_body;

    #[test]
    fn the_fuzzers_seeds_hold() {
        for seed in [
            include_str!("../../fuzz/seeds/publish_body/batch.json"),
            include_str!("../../fuzz/seeds/publish_body/keyed.json"),
            include_str!("../../fuzz/seeds/publish_body/subject.json"),
        ] {
            check_body(seed.as_bytes());
        }
    }

    /// Subjects near the streams' own and far from them, wildcards and
    /// reserved prefixes among them.
    fn subject() -> impl Strategy<Value = Option<String>> {
        proptest::option::of(prop_oneof![
            "orders\\.[a-z*>. ]{0,8}",
            "events(\\.[a-z*>]{0,4}){0,3}",
            "audit\\.[a-z*>]{0,3}\\.log",
            "[$a-zA-Z.*> ]{0,16}",
        ])
    }

    fn message() -> impl Strategy<Value = Value> {
        let key = proptest::option::of("\\PC{0,24}|[ .%*>\\t$]{1,6}");
        let spread = proptest::option::of(prop_oneof![Just("round_robin"), Just("random")]);
        (key, subject(), spread, any::<bool>()).prop_map(|(key, subject, spread, base64)| {
            let mut m = json!({"key": key, "subject": subject, "spread": spread});
            m[if base64 { "data_base64" } else { "data" }] = if base64 { json!("aGk=") } else { json!({"n": 1}) };
            m
        })
    }

    proptest! {
        #[test]
        fn any_accepted_message_lands_on_a_literal_subject_of_its_stream(m in message()) {
            check_body(m.to_string().as_bytes());
        }

        #[test]
        fn any_accepted_batch_lands_on_literal_subjects_of_its_stream(ms in proptest::collection::vec(message(), 1..8)) {
            check_body(json!({"messages": ms}).to_string().as_bytes());
        }

        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..128)) {
            check_body(&body);
        }
    }
}
