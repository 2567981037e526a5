//! Reading every live key of a KV bucket under a key filter without making
//! a consumer. `kv::Store::keys` makes an ephemeral consumer per call, and
//! the server keeps it for its 30 s inactive threshold after the listing
//! ends: a client listing groups fast piles them up on keygate's own
//! buckets until the server's consumer limit refuses new ones, keygate's
//! included. A scan here is one batched direct get (`multi_last`, nats-server
//! 2.11+); where the filter matches more subjects than one such read may
//! (1,024), the subjects come from the stream's info, paged by the server,
//! and their last values from batched reads of those subjects by name.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};

use super::errors::unavailable_or_internal;
use super::errors::{BrokerError as Error, BrokerErrorKind};

/// How long one batched read may take before it counts as failed.
const BATCH_READ_WAIT: Duration = Duration::from_secs(2);
/// Subjects named in one batched read, under the server's 1,024.
const SUBJECTS_PER_READ: usize = 256;
/// Reads at once for a bucket without direct gets, one key per read.
const CONCURRENT_KEY_READS: usize = 32;

/// The live entries of `store` whose keys match `key_filter` (a KV key
/// pattern such as `orders.*` or `>`): key and value of every key whose
/// last operation is a put; deleted and purged keys are left out, as
/// `keys()` leaves them out.
pub async fn live_entries(
    js: &jetstream::Context,
    store: &kv::Store,
    key_filter: &str,
) -> Result<Vec<(String, Bytes)>, Error> {
    let filter = format!("{}{key_filter}", store.prefix);
    if let Ok(Batch { last, complete: true }) = last_values(js, store, std::slice::from_ref(&filter)).await {
        return Ok(live(last));
    }
    // Too many subjects for one read, a read cut short, or no direct gets:
    // name the subjects, then read them in batches (or one by one).
    let mut listed =
        store.stream.info_with_subjects(&filter).await.map_err(|e| unavailable_or_internal("listing keys", e))?;
    let direct = listed.info.config.allow_direct;
    let mut subjects = Vec::new();
    while let Some((subject, _)) = listed.try_next().await.map_err(|e| unavailable_or_internal("listing keys", e))? {
        subjects.push(subject);
    }
    let mut last = HashMap::new();
    if direct {
        for chunk in subjects.chunks(SUBJECTS_PER_READ) {
            let mut wanted = chunk.to_vec();
            loop {
                let batch = last_values(js, store, &wanted).await.map_err(|e| {
                    Error::new(BrokerErrorKind::Unavailable, "listing keys: a batched read failed").caused_by(e)
                })?;
                let answered = batch.last.len();
                wanted.retain(|subject| !batch.last.contains_key(subject_key(store, subject)));
                last.extend(batch.last);
                if batch.complete || wanted.is_empty() {
                    break;
                }
                if answered == 0 {
                    return Err(Error::new(
                        BrokerErrorKind::Unavailable,
                        "listing keys: a batched read returned nothing",
                    ));
                }
            }
        }
    } else {
        let keys: Vec<String> = subjects.iter().map(|subject| subject_key(store, subject).to_owned()).collect();
        let reads = keys.into_iter().map(|key| {
            let store = store.clone();
            async move { store.entry(&key).await.map(|entry| (key, entry)) }
        });
        let read: Vec<_> = futures::stream::iter(reads)
            .buffer_unordered(CONCURRENT_KEY_READS)
            .try_collect()
            .await
            .map_err(|e| unavailable_or_internal("listing keys", e))?;
        for (key, entry) in read {
            let Some(entry) = entry else { continue };
            let value = (entry.operation == kv::Operation::Put).then_some(entry.value);
            last.insert(key, value);
        }
    }
    Ok(live(last))
}

/// The last value of each key answered, `None` for a delete or purge
/// marker; `complete` when the server said nothing is left to send.
struct Batch {
    last: HashMap<String, Option<Bytes>>,
    complete: bool,
}

fn live(last: HashMap<String, Option<Bytes>>) -> Vec<(String, Bytes)> {
    last.into_iter().filter_map(|(key, value)| Some((key, value?))).collect()
}

fn subject_key<'a>(store: &kv::Store, subject: &'a str) -> &'a str {
    subject.strip_prefix(store.prefix.as_str()).unwrap_or(subject)
}

/// Why one batched read could not tell the keys' last values.
#[derive(Debug, thiserror::Error)]
enum BatchReadError {
    #[error("listing keys: {0}")]
    Subscribe(#[source] async_nats::SubscribeError),
    #[error("listing keys: {0}")]
    Publish(#[source] async_nats::PublishError),
    /// The server refused: over 1,024 subjects match (413).
    #[error("listing keys: more subjects than one batched read may name")]
    TooManySubjects,
    #[error("listing keys: {0}")]
    Malformed(&'static str),
    #[error("listing keys: no answer in time")]
    TimedOut,
}

/// One batched direct get of the last message of every subject matching
/// `subjects` (patterns or names). An error says why the read could not
/// tell, including the server's refusal of over 1,024 matching subjects.
async fn last_values(js: &jetstream::Context, store: &kv::Store, subjects: &[String]) -> Result<Batch, BatchReadError> {
    let client = js.client();
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(inbox.clone()).await.map_err(BatchReadError::Subscribe)?;
    let request = serde_json::to_vec(&serde_json::json!({ "multi_last": subjects })).unwrap_or_default();
    let subject = format!("$JS.API.DIRECT.GET.{}", store.stream_name);
    client.publish_with_reply(subject, inbox, request.into()).await.map_err(BatchReadError::Publish)?;
    let read = async {
        let mut last = HashMap::new();
        while let Some(answer) = answers.next().await {
            match answer.status.map(|s| s.as_u16()) {
                None | Some(200) => {
                    let headers =
                        answer.headers.as_ref().ok_or(BatchReadError::Malformed("an answer without headers"))?;
                    let subject = headers
                        .get("Nats-Subject")
                        .ok_or(BatchReadError::Malformed("an answer without its subject"))?
                        .as_str();
                    let deleted = headers.get("KV-Operation").is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
                        || headers.get("Nats-Marker-Reason").is_some();
                    let value = (!deleted).then(|| answer.payload.clone());
                    last.insert(subject_key(store, subject).to_owned(), value);
                }
                // The end of the batch; what the server did not send is pending.
                Some(204) => {
                    let pending = answer.headers.as_ref().and_then(|h| h.get("Nats-Num-Pending"));
                    let complete = pending.is_none_or(|n| n.as_str() == "0");
                    return Ok(Batch { last, complete });
                }
                // Nothing matches.
                Some(404) => return Ok(Batch { last, complete: true }),
                Some(413) => return Err(BatchReadError::TooManySubjects),
                Some(_) => return Err(BatchReadError::Malformed("an unexpected answer")),
            }
        }
        Err(BatchReadError::Malformed("the answers ended early"))
    };
    tokio::time::timeout(BATCH_READ_WAIT, read).await.unwrap_or(Err(BatchReadError::TimedOut))
}
