//! Redriving a dead letter: its message published again to the stream it
//! came from, under its subject and so its key, with its own headers and
//! `keygate-redriven-from`. It takes the key's order position of now, after
//! everything already stored. Once per letter: a letter marked redriven is
//! not published again, and the republish carries a `msg_id` derived from
//! the letter, so a second redrive before the mark is stored is a duplicate
//! the stream drops.

use std::collections::BTreeMap;

use async_nats::jetstream;
use base64::Engine as _;
use sha2::Digest as _;

use super::archive::Archive;
use super::letter::{Letter, Redriven};
use super::REDRIVEN_FROM;
use super::{DeadLetterError as Error, DeadLetterErrorKind as Kind};
use crate::error::Class;
use crate::names::StreamName;
use crate::publish::{self, HeaderValues, PublishRequest};
use crate::streams::Streams;

/// What one redrive did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveOutcome {
    pub redriven: Redriven,
    /// It had been redriven before: nothing was published now.
    pub earlier: bool,
}

/// Redrives `letter`, unless `mark` says it was already.
async fn redrive(
    js: &jetstream::Context,
    archive: &Archive,
    streams: &Streams,
    max_payload: usize,
    letter: &Letter,
    mark: Option<Redriven>,
) -> Result<RedriveOutcome, Error> {
    if let Some(redriven) = mark {
        return Ok(RedriveOutcome { redriven, earlier: true });
    }
    let stream =
        StreamName::parse(&letter.stream).map_err(|e| Error::new(Kind::Other(Class::Invalid), e.to_string()))?;
    if let Some(why) = crate::streams::reserved_stream_name(stream.as_str()) {
        return Err(Error::new(Kind::Reserved, why));
    }
    let shape = streams.shape(&stream).await?;
    let prepared =
        publish::prepare(&shape, republished(letter), None, max_payload)?.redriven_from(&letter.id(), max_payload)?;
    let ack = publish::publish_one(js, &shape, Ok(prepared)).await?;
    let redriven = Redriven {
        at: time::OffsetDateTime::now_utc(),
        stream: ack.stream,
        stream_seq: ack.seq,
        letter: letter.msg_id.clone(),
    };
    archive.mark_redriven(letter, &redriven).await?;
    metrics::counter!(crate::telemetry::metrics::REDRIVEN, "stream" => letter.stream.clone()).increment(1);
    Ok(RedriveOutcome { redriven, earlier: false })
}

/// Redrives `letters` in the dead-letter stream's order, whatever order
/// they come in, so a key's letters go back in the order they failed. A key
/// whose letter could not go back holds its later letters, which would
/// overtake it. NATS not answering ends the run with that error: the
/// letters redriven so far are marked, and a retry answers them as earlier.
pub async fn redrive_in_order(
    js: &jetstream::Context,
    archive: &Archive,
    streams: &Streams,
    max_payload: usize,
    mut letters: Vec<Letter>,
) -> Result<Vec<(Letter, Result<RedriveOutcome, Error>)>, Error> {
    letters.sort_by_key(|l| l.seq);
    letters.dedup_by_key(|l| l.seq);
    let marks = archive.redriven(&letters).await?;
    let mut outcomes = Vec::with_capacity(letters.len());
    let mut held: Vec<(String, Option<String>, String)> = Vec::new();
    for (letter, mark) in letters.into_iter().zip(marks) {
        if let Some((_, _, first)) = held.iter().find(|(s, k, _)| *s == letter.stream && *k == letter.key) {
            let why = format!(
                "not redriven: dead letter {first} of the same key could not be, and this one would overtake it"
            );
            outcomes.push((letter, Err(Error::new(Kind::HeldBehindEarlier, why))));
            continue;
        }
        match redrive(js, archive, streams, max_payload, &letter, mark).await {
            Err(e) if e.class() == Class::Unavailable => return Err(e),
            Err(e) => {
                held.push((letter.stream.clone(), letter.key.clone(), letter.id()));
                outcomes.push((letter, Err(e)));
            }
            Ok(done) => outcomes.push((letter, Ok(done))),
        }
    }
    Ok(outcomes)
}

/// The letter's message as a publish request: its subject, headers and
/// payload, without the `keygate-redriven-from` of an earlier redrive of
/// the same message (the new one names this letter).
fn republished(letter: &Letter) -> PublishRequest {
    let mut values: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in letter.headers.iter().filter(|(name, _)| !name.eq_ignore_ascii_case(REDRIVEN_FROM)) {
        values.entry(name.clone()).or_default().push(value.clone());
    }
    let headers = values.into_iter().map(|(name, values)| (name, HeaderValues::Many(values))).collect();
    PublishRequest {
        key: None,
        subject: Some(letter.subject.clone()),
        data: None,
        data_base64: Some(base64::engine::general_purpose::STANDARD.encode(&letter.payload)),
        content_type: None,
        headers: Some(headers),
        msg_id: Some(redrive_msg_id(&letter.msg_id)),
        spread: None,
    }
}

/// One `msg_id` per letter (its own id can be longer than a `msg_id` may be).
fn redrive_msg_id(letter_msg_id: &str) -> String {
    let digest = sha2::Sha256::digest(letter_msg_id.as_bytes());
    let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("keygate-redrive-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::Owner;

    #[test]
    fn the_republished_message_is_the_original_with_the_letter_named() {
        let letter = Letter {
            seq: 42,
            msg_id: "dlq:group:S:g:m:7".into(),
            owner: Owner::Group,
            stream: "S".into(),
            name: "g".into(),
            member: "m".into(),
            subject: "orders.alice".into(),
            key: Some("alice".into()),
            partition: Some(1),
            stream_seq: Some(7),
            attempts: Some(3),
            reason: "HTTP 500".into(),
            time: time::OffsetDateTime::UNIX_EPOCH,
            headers: vec![
                ("Content-Type".into(), "application/json".into()),
                ("x-v".into(), "1".into()),
                ("x-v".into(), "2".into()),
                (REDRIVEN_FROM.into(), "3".into()),
            ],
            payload: bytes::Bytes::from_static(b"{}"),
        };
        let request = republished(&letter);
        assert_eq!(request.subject.as_deref(), Some("orders.alice"));
        let headers = request.headers.unwrap();
        assert!(matches!(&headers["x-v"], HeaderValues::Many(v) if v == &["1", "2"]));
        assert!(!headers.contains_key(REDRIVEN_FROM), "the earlier redrive's mark is dropped");
        assert_eq!(request.msg_id, Some(redrive_msg_id("dlq:group:S:g:m:7")));
        assert_ne!(redrive_msg_id("dlq:group:S:g:m:7"), redrive_msg_id("dlq:group:S:g:m:8"));
        assert!(redrive_msg_id(&"x".repeat(400)).len() < 64);
    }
}
