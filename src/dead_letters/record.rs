//! Recording a dead letter: a terminated message is copied to the
//! dead-letter stream, with its original payload and headers and why it
//! failed, before it is terminated.

use async_nats::jetstream::stream;
use async_nats::HeaderMap;
use bytes::Bytes;

use super::headers as h;
use super::{DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECTS};
use crate::names::Owner;
use crate::nats::buckets::Buckets;
use crate::nats::errors::BrokerError;

/// What to record with a dead letter.
pub struct DeadLetter<'a> {
    pub owner: Owner,
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

/// The stored copy of one failed message: only `record` makes one, and a
/// message is terminated only with it in hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The dead letter's id (its `Nats-Msg-Id`).
    pub id: String,
    /// Its sequence in the dead-letter stream.
    pub seq: u64,
}

/// The dead letter's `Nats-Msg-Id`: one per failed message and holder,
/// however often termination is retried. Names are `[A-Za-z0-9_-]`, so the
/// `:` separators cannot be forged by a name.
pub fn dead_letter_id(owner: Owner, stream: &str, group: &str, member: &str, seq: u64) -> String {
    format!("dlq:{}:{stream}:{group}:{member}:{seq}", owner.as_str())
}

/// Why a dead-letter copy was not stored; the message is then not terminated.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("the dead-letter stream: {0}")]
    Stream(#[from] BrokerError),
    #[error("storing the copy: {0}")]
    Publish(#[from] async_nats::jetstream::context::PublishError),
    #[error("reading back the stored copy: {0}")]
    ReadBack(#[source] async_nats::Error),
    #[error("the dead-letter stream answered duplicate for {0}, but the stored copy is another message's")]
    OtherCopy(String),
}

/// Copies a message to the dead-letter stream and waits for the store. A
/// `duplicate` answer is accepted only when the copy already stored under
/// that id is this message's (an earlier attempt stored it, then could not
/// terminate); anything else is an error and the message is not terminated.
pub async fn record(buckets: &Buckets, letter: DeadLetter<'_>) -> Result<Stored, RecordError> {
    ensure_stream(buckets).await?;
    let js = buckets.js();
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
    headers.insert(h::STREAM, letter.stream);
    headers.insert(h::GROUP, letter.group);
    headers.insert(h::MEMBER, letter.member);
    headers.insert(h::SUBJECT, letter.subject);
    headers.insert(h::PARTITION, letter.partition.to_string().as_str());
    headers.insert(h::STREAM_SEQ, letter.stream_seq.to_string().as_str());
    headers.insert(h::ATTEMPTS, letter.attempts.to_string().as_str());
    headers.insert(h::REASON, letter.reason.replace(['\r', '\n'], " ").as_str());
    if let Some(key) = letter.key {
        headers.insert(h::KEY, crate::delivery::header_safe(key).as_str());
    }
    headers.insert(h::OWNER, letter.owner.as_str());
    let id = dead_letter_id(letter.owner, letter.stream, letter.group, letter.member, letter.stream_seq);
    headers.insert("Nats-Msg-Id", id.as_str());
    let subject = format!("keygate.dlq.{}.{}.{}", letter.stream, letter.group, letter.member);
    let ack = js.publish_with_headers(subject, headers, letter.payload.clone()).await?.await?;
    if ack.duplicate {
        let read_back = |e: Box<dyn std::error::Error + Send + Sync>| RecordError::ReadBack(e);
        let handle = js.get_stream_no_info(DEAD_LETTER_STREAM).await.map_err(|e| read_back(e.into()))?;
        let stored = handle.get_raw_message(ack.sequence).await.map_err(|e| read_back(e.into()))?;
        let header = |name: &str| stored.headers.get(name).map(|v| v.as_str().to_owned());
        // The id names the holder and the sequence; the subject and payload
        // tell this message apart from another one that had the same
        // sequence (its stream deleted and created again meanwhile).
        let same = header("Nats-Msg-Id").as_deref() == Some(id.as_str())
            && header(h::SUBJECT).as_deref() == Some(letter.subject)
            && stored.payload == letter.payload;
        if !same {
            return Err(RecordError::OtherCopy(id));
        }
    }
    Ok(Stored { id, seq: ack.sequence })
}

async fn ensure_stream(buckets: &Buckets) -> Result<(), BrokerError> {
    let config = stream::Config {
        name: DEAD_LETTER_STREAM.into(),
        subjects: vec![DEAD_LETTER_SUBJECTS.into()],
        description: Some("keygate: messages terminated after failing, with the reason".into()),
        ..Default::default()
    };
    buckets.stream_or_create(config).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_ids_tell_owners_and_names_apart() {
        let ids = [
            dead_letter_id(Owner::Group, "S", "billing", "m1", 7),
            dead_letter_id(Owner::Consumer, "S", "billing", "m1", 7),
            dead_letter_id(Owner::Group, "S", "a-b", "c", 7),
            dead_letter_id(Owner::Group, "S", "a", "b-c", 7),
            dead_letter_id(Owner::Group, "S-a", "b", "c", 7),
            dead_letter_id(Owner::Group, "S", "billing", "m1", 70),
        ];
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len(), "{ids:?}");
        assert_eq!(ids[0], "dlq:group:S:billing:m1:7");
    }
}
