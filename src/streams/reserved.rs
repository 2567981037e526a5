//! Streams no publisher may write: keygate's and the server's own state,
//! elastic groups' work queues, and reserved subject spaces. Read when a
//! stream's shape is cached (streams/mod.rs) and before a publish or a
//! redrive looks the stream up.

use async_nats::jetstream;

/// Stream name prefixes of state no publisher may write: KV buckets and
/// object stores (keygate's registrations, pcgroups' configurations, the
/// fencing tokens) and keygate's own streams.
const RESERVED_STREAM_PREFIXES: [&str; 3] = ["KV_", "OBJ_", "KEYGATE_"];
/// Subject spaces of the server (`$JS`, `$KV`, `$SYS`…) and of keygate
/// (control requests, events, dead letters).
const RESERVED_SUBJECT_PREFIXES: [&str; 2] = ["$", "keygate."];

/// Why `config`'s stream is not open to publishers, if it is not: it backs
/// a KV bucket or object store, it is keygate's own, it is an elastic
/// group's work queue (a sourced work-queue stream, fed only by its
/// source), or it captures a reserved subject space. This holds for every
/// token, admin included: keygate's state changes through its own API.
pub fn reserved_stream(config: &jetstream::stream::Config) -> Option<String> {
    let name = config.name.as_str();
    if let Some(why) = reserved_stream_name(name) {
        return Some(why);
    }
    let fed_by_sources = config.sources.as_ref().is_some_and(|s| !s.is_empty());
    if config.retention == jetstream::stream::RetentionPolicy::WorkQueue && fed_by_sources {
        return Some(format!(
            "stream {name} is a group's work queue, fed by its source stream: publish to that stream"
        ));
    }
    config.subjects.iter().find_map(|s| {
        reserved_subject(s).then(|| format!("stream {name} captures the reserved subject space of {s:?}"))
    })
}

/// Why a stream of this name is not open to publishers, whether or not it
/// exists: the name alone says so, before the stream is looked up.
pub fn reserved_stream_name(name: &str) -> Option<String> {
    RESERVED_STREAM_PREFIXES.iter().find(|p| name.starts_with(**p)).map(|prefix| {
        format!(
            "stream {name} holds keygate's or the server's own state ({prefix}*): it is changed through keygate's API, \
             never published to"
        )
    })
}

/// Whether a subject is in a reserved space.
pub fn reserved_subject(subject: &str) -> bool {
    RESERVED_SUBJECT_PREFIXES.iter().any(|p| subject.starts_with(p))
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::stream::{Config, RetentionPolicy, Source};

    use super::*;

    fn stream(name: &str, subjects: &[&str]) -> Config {
        Config { name: name.into(), subjects: subjects.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn state_streams_and_work_queues_are_reserved_for_every_caller() {
        for name in ["KV_keygate-webhooks", "KV_static-consumer-groups", "OBJ_files", "KEYGATE_DEAD_LETTERS"] {
            assert!(reserved_stream(&stream(name, &["x.>"])).is_some(), "{name}");
        }
        assert!(reserved_stream(&stream("SYS", &["$SYS.>"])).is_some());
        assert!(reserved_stream(&stream("MINE", &["keygate.events.>"])).is_some());
        let work_queue = Config {
            retention: RetentionPolicy::WorkQueue,
            sources: Some(vec![Source { name: "ORDERS".into(), ..Default::default() }]),
            ..stream("ORDERS-billing", &[])
        };
        assert!(reserved_stream(&work_queue).is_some());
        assert_eq!(reserved_stream(&stream("ORDERS", &["orders.*"])), None);
        assert_eq!(reserved_stream(&stream("KVX", &["kv.*"])), None, "only the prefixes JetStream uses");
    }
}
