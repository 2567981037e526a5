//! Any bytes as a publish or batch request body: parsing and preparing never
//! panic, and whatever is accepted goes to a literal subject the stream
//! captures, in the partition range its transform stamps.

#![no_main]

use std::sync::LazyLock;

use async_nats::jetstream::stream::{Config, SubjectTransform};
use keygate::publish::{prepare, BatchRequest, PublishRequest};
use keygate::streams::StreamShape;
use libfuzzer_sys::fuzz_target;

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
    let plain = Config { name: "EVENTS".into(), subjects: vec!["events.>".into(), "audit.*.log".into()], ..Default::default() };
    vec![StreamShape::from_config(&stamped), StreamShape::from_config(&plain)]
});

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

fuzz_target!(|body: &[u8]| {
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
});
