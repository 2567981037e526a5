//! A dead letter read back from the stream (pure): what failed, where it
//! came from and why, told apart from the message's own headers.

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::headers as h;
use crate::auth::Requirement;
use crate::names::Owner;

/// One dead letter as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Letter {
    /// Its sequence in the dead-letter stream: the letter's id.
    pub seq: u64,
    /// Its `Nats-Msg-Id` (one per failed message and holder).
    pub msg_id: String,
    pub owner: Owner,
    pub stream: String,
    /// The group's name, or the plain consumer's.
    pub name: String,
    pub member: String,
    /// The subject the message was published to (without a partition token).
    pub subject: String,
    pub key: Option<String>,
    pub partition: Option<u32>,
    pub stream_seq: Option<u64>,
    pub attempts: Option<u64>,
    pub reason: String,
    /// When it was dead-lettered (stored in the dead-letter stream).
    pub time: OffsetDateTime,
    /// The message's own headers; a repeated name's values in order.
    pub headers: Vec<(String, String)>,
    pub payload: Bytes,
}

/// Where a letter was redriven to; kept in the redrives bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Redriven {
    /// When it was redriven.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub at: OffsetDateTime,
    /// The stream it was published to again.
    pub stream: String,
    /// Its sequence there.
    pub stream_seq: u64,
    /// The letter's `Nats-Msg-Id`: a mark whose letter is gone (the stream
    /// was made again and reused the sequence) is not this letter's.
    #[serde(default, skip_serializing)]
    #[schema(ignore)]
    pub letter: String,
}

/// A dead letter as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeadLetterView {
    /// The letter's id (its sequence in the dead-letter stream).
    #[schema(example = "42")]
    pub id: String,
    pub stream: String,
    /// The group whose member failed it (`null` for a plain consumer's).
    pub group: Option<String>,
    /// The plain consumer whose subscriber failed it (`null` for a group's).
    pub consumer: Option<String>,
    /// The member (or the consumer's subscriber).
    pub member: String,
    /// The subject it was published to, without a partition token.
    pub subject: String,
    pub key: Option<String>,
    pub partition: Option<u32>,
    /// Its sequence in its own stream.
    pub stream_seq: Option<u64>,
    /// Deliveries tried before it was terminated.
    pub attempts: Option<u64>,
    pub reason: String,
    /// When it was dead-lettered.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub dead_lettered_at: OffsetDateTime,
    /// The message's own headers (values of a repeated name in order).
    pub headers: BTreeMap<String, Vec<String>>,
    /// The payload, when it is JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<serde_json::Value>)]
    pub data: Option<Box<RawValue>>,
    /// The payload as base64, when it is not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// Where it was redriven to, if it was.
    pub redriven: Option<Redriven>,
}

impl Letter {
    /// A letter from a message of the dead-letter stream; `None` for a
    /// message keygate did not write there (its subject is not
    /// `keygate.dlq.<stream>.<name>.<member>`).
    pub fn parse(
        seq: u64,
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: Bytes,
        time: OffsetDateTime,
    ) -> Option<Self> {
        let mut tokens = subject.strip_prefix("keygate.dlq.")?.split('.');
        let (stream, name, member) = (tokens.next()?, tokens.next()?, tokens.next()?);
        if tokens.next().is_some() {
            return None;
        }
        let empty = HeaderMap::new();
        let headers = headers.unwrap_or(&empty);
        let header = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
        let number = |name: &str| header(name).and_then(|v| v.parse::<u64>().ok());
        let owner = match header(h::OWNER).as_deref() {
            Some("consumer") => Owner::Consumer,
            _ => Owner::Group,
        };
        let own = headers
            .iter()
            .filter(|(name, _)| {
                let name: &str = name.as_ref();
                !h::ALL.iter().any(|ours| name.eq_ignore_ascii_case(ours)) && !name.eq_ignore_ascii_case("Nats-Msg-Id")
            })
            .flat_map(|(name, values)| {
                let name: &str = name.as_ref();
                values.iter().map(move |v| (name.to_owned(), v.as_str().to_owned()))
            })
            .collect();
        Some(Self {
            seq,
            msg_id: header("Nats-Msg-Id").unwrap_or_default(),
            owner,
            stream: stream.to_owned(),
            name: name.to_owned(),
            member: member.to_owned(),
            subject: header(h::SUBJECT).unwrap_or_default(),
            key: header(h::KEY).map(|k| crate::delivery::header_unescaped(&k).unwrap_or(k)),
            partition: number(h::PARTITION).and_then(|p| u32::try_from(p).ok()),
            stream_seq: number(h::STREAM_SEQ),
            attempts: number(h::ATTEMPTS),
            reason: header(h::REASON).unwrap_or_default(),
            time,
            headers: own,
            payload,
        })
    }

    /// The letter's id in the API.
    pub fn id(&self) -> String {
        self.seq.to_string()
    }

    /// The scope that lets a caller see and act on this letter: its group's
    /// `consume:` or its consumer's `subscribe:` (admin covers both).
    pub fn requirement(&self) -> Requirement {
        match self.owner {
            Owner::Group => Requirement::Consume { stream: Some(self.stream.clone()), group: Some(self.name.clone()) },
            Owner::Consumer => Requirement::Subscribe { stream: self.stream.clone(), consumer: self.name.clone() },
        }
    }

    /// The API's view, with where it was redriven to (a mark of another
    /// letter is ignored).
    pub fn view(&self, redriven: Option<Redriven>) -> DeadLetterView {
        let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, value) in &self.headers {
            headers.entry(name.clone()).or_default().push(value.clone());
        }
        let data = serde_json::from_slice::<Box<RawValue>>(&self.payload).ok();
        let data_base64 = data.is_none().then(|| base64::engine::general_purpose::STANDARD.encode(&self.payload));
        let (group, consumer) = match self.owner {
            Owner::Group => (Some(self.name.clone()), None),
            Owner::Consumer => (None, Some(self.name.clone())),
        };
        DeadLetterView {
            id: self.id(),
            stream: self.stream.clone(),
            group,
            consumer,
            member: self.member.clone(),
            subject: self.subject.clone(),
            key: self.key.clone(),
            partition: self.partition,
            stream_seq: self.stream_seq,
            attempts: self.attempts,
            reason: self.reason.clone(),
            dead_lettered_at: self.time,
            headers,
            data,
            data_base64,
            redriven: redriven.filter(|r| r.letter == self.msg_id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("Content-Type", "text/plain");
        headers.append("x-trace", "a");
        headers.append("x-trace", "b");
        headers.insert(h::STREAM, "ORDERS");
        headers.insert(h::SUBJECT, "orders.a b");
        headers.insert(h::KEY, "a%20b");
        headers.insert(h::PARTITION, "3");
        headers.insert(h::STREAM_SEQ, "17");
        headers.insert(h::ATTEMPTS, "5");
        headers.insert(h::REASON, "gave up after 5 attempts: HTTP 500");
        headers.insert(h::OWNER, "consumer");
        headers.insert("Nats-Msg-Id", "dlq:consumer:ORDERS:c:s1:17");
        headers
    }

    #[test]
    fn a_letter_keeps_the_message_apart_from_why_it_failed() {
        let time = OffsetDateTime::UNIX_EPOCH;
        let letter =
            Letter::parse(42, "keygate.dlq.ORDERS.c.s1", Some(&stored()), Bytes::from_static(b"\xff"), time).unwrap();
        assert_eq!((letter.owner, letter.name.as_str(), letter.member.as_str()), (Owner::Consumer, "c", "s1"));
        assert_eq!(letter.key.as_deref(), Some("a b"), "the key is unescaped");
        assert_eq!((letter.partition, letter.stream_seq, letter.attempts), (Some(3), Some(17), Some(5)));
        let mut headers = letter.headers.clone();
        headers.sort();
        assert_eq!(
            headers,
            [("Content-Type", "text/plain"), ("x-trace", "a"), ("x-trace", "b")]
                .map(|(n, v)| (n.to_owned(), v.to_owned()))
        );
        assert_eq!(letter.requirement(), Requirement::Subscribe { stream: "ORDERS".into(), consumer: "c".into() });
        let view = letter.view(None);
        assert_eq!((view.group, view.consumer.as_deref()), (None, Some("c")));
        assert_eq!(view.data_base64.as_deref(), Some("/w=="));
        assert!(view.data.is_none());
        assert_eq!(view.headers["x-trace"], ["a", "b"]);
    }

    #[test]
    fn json_payloads_show_as_json_and_stale_redrive_marks_are_ignored() {
        let time = OffsetDateTime::UNIX_EPOCH;
        let letter =
            Letter::parse(1, "keygate.dlq.S.g.m", Some(&stored()), Bytes::from_static(br#"{"n":1}"#), time).unwrap();
        let mark = |letter: &str| Redriven { at: time, stream: "S".into(), stream_seq: 9, letter: letter.into() };
        let view = letter.view(Some(mark("dlq:consumer:ORDERS:c:s1:17")));
        assert_eq!(view.data.unwrap().get(), r#"{"n":1}"#);
        assert_eq!(view.redriven.map(|r| r.stream_seq), Some(9));
        assert!(letter.view(Some(mark("another letter's"))).redriven.is_none());
    }

    #[test]
    fn messages_keygate_did_not_write_are_not_letters() {
        let time = OffsetDateTime::UNIX_EPOCH;
        for subject in ["keygate.dlq.S.g", "keygate.dlq.S.g.m.x", "other.S.g.m"] {
            assert!(Letter::parse(1, subject, None, Bytes::new(), time).is_none(), "{subject}");
        }
        let bare = Letter::parse(1, "keygate.dlq.S.g.m", None, Bytes::new(), time).unwrap();
        assert_eq!(bare.owner, Owner::Group, "letters from before owners were recorded are groups'");
    }
}
