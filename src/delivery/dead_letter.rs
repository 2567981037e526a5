//! The dead-letter stream: terminated messages are copied here, with their
//! original payload and headers and why they failed, before they are
//! terminated.

use async_nats::jetstream::{self, stream};
use async_nats::HeaderMap;
use bytes::Bytes;

/// Stream keeping dead letters.
pub const DEAD_LETTER_STREAM: &str = "KEYGATE_DEAD_LETTERS";
/// Its subjects: `keygate.dlq.<stream>.<group>.<member>`.
pub const DEAD_LETTER_SUBJECTS: &str = "keygate.dlq.>";

/// What to record with a dead letter.
pub struct DeadLetter<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    pub member: &'a str,
    pub subject: &'a str,
    pub key: Option<&'a str>,
    pub partition: u32,
    pub stream_seq: u64,
    pub attempts: u64,
    pub reason: &'a str,
    pub headers: Option<&'a HeaderMap>,
    pub payload: Bytes,
}

/// Copies a message to the dead-letter stream and waits for the store.
pub async fn record(js: &jetstream::Context, letter: DeadLetter<'_>) -> anyhow::Result<u64> {
    ensure_stream(js).await?;
    let mut headers = HeaderMap::new();
    if let Some(original) = letter.headers {
        for (name, values) in original.iter() {
            if AsRef::<str>::as_ref(name).to_ascii_lowercase().starts_with("nats-") {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    headers.insert("keygate-stream", letter.stream);
    headers.insert("keygate-group", letter.group);
    headers.insert("keygate-member", letter.member);
    headers.insert("keygate-subject", letter.subject);
    headers.insert("keygate-partition", letter.partition.to_string().as_str());
    headers.insert("keygate-stream-seq", letter.stream_seq.to_string().as_str());
    headers.insert("keygate-attempts", letter.attempts.to_string().as_str());
    headers.insert("keygate-reason", letter.reason.replace(['\r', '\n'], " ").as_str());
    if let Some(key) = letter.key {
        headers.insert("keygate-key", super::header_safe(key).as_str());
    }
    // One dead letter per original message, however often termination is retried.
    headers.insert("Nats-Msg-Id", format!("dlq-{}-{}-{}", letter.stream, letter.group, letter.stream_seq).as_str());
    let subject = format!("keygate.dlq.{}.{}.{}", letter.stream, letter.group, letter.member);
    let ack = js.publish_with_headers(subject, headers, letter.payload).await?.await?;
    Ok(ack.sequence)
}

async fn ensure_stream(js: &jetstream::Context) -> anyhow::Result<()> {
    if js.get_stream(DEAD_LETTER_STREAM).await.is_ok() {
        return Ok(());
    }
    let config = stream::Config {
        name: DEAD_LETTER_STREAM.into(),
        subjects: vec![DEAD_LETTER_SUBJECTS.into()],
        description: Some("keygate: messages terminated after failing, with the reason".into()),
        num_replicas: crate::nats::replicas::state_replicas(js),
        ..Default::default()
    };
    match js.create_stream(config).await {
        Ok(_) => Ok(()),
        Err(e) => js.get_stream(DEAD_LETTER_STREAM).await.map(|_| ()).map_err(|_| e.into()),
    }
}
