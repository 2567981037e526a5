//! Reading the dead-letter stream: pages of letters a filter selects, one
//! letter by id, deleting letters, and the marks of letters redriven.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use futures::StreamExt;

use super::filter::{Cursor, Selection};
use super::letter::{Letter, Redriven};
use super::{DeadLetterError as Error, DeadLetterErrorKind as Kind};
use super::{DEAD_LETTER_STREAM, REDRIVES_BUCKET};
use crate::nats::buckets::{BucketSpec, Buckets};
use crate::nats::errors::{is_not_found, jetstream_error_code, unavailable_or_internal};

/// Most letters one page may hold.
pub const MAX_PAGE: usize = 1000;
/// Most dead-letter stream messages one request reads: a filter that
/// matches little answers a short page with a cursor, not a long wait.
pub const SCAN_BUDGET: usize = 10_000;
/// Payload bytes past which a page ends early (its cursor goes on).
pub const PAGE_BYTES: usize = 8 << 20;
/// Messages asked of the server at a time while scanning.
const FETCH: usize = 256;
/// Stream timestamps come from whichever server led the stream; a scan
/// with `until` stops this far past it rather than at the first later one.
const CLOCK_SLACK: time::Duration = time::Duration::minutes(1);

/// A page of letters, oldest first, and where the next one starts.
#[derive(Debug, Default)]
pub struct Page {
    pub letters: Vec<Letter>,
    /// `None` when the scan reached the end of the stream.
    pub next: Option<Cursor>,
}

/// The dead-letter stream and the redrive marks.
#[derive(Clone)]
pub struct Archive {
    js: jetstream::Context,
    buckets: Buckets,
}

impl Archive {
    pub fn new(buckets: Buckets) -> Self {
        Self { js: buckets.js().clone(), buckets }
    }

    /// The stream; `None` while no letter was ever recorded.
    async fn stream(&self) -> Result<Option<stream::Stream<()>>, Error> {
        match self.js.get_stream_no_info(DEAD_LETTER_STREAM).await {
            Ok(stream) => Ok(Some(stream)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(unavailable_or_internal("reading the dead-letter stream", e).into()),
        }
    }

    /// The letters `selection` picks, oldest first, through a short-lived
    /// consumer narrowed to the filter's subjects. A page ends at its
    /// limit, at [`PAGE_BYTES`] of payload or after [`SCAN_BUDGET`]
    /// messages read, each with a cursor to go on from.
    pub async fn page(&self, selection: &Selection) -> Result<Page, Error> {
        let Some(stream) = self.stream().await? else { return Ok(Page::default()) };
        let filter = &selection.filter;
        let deliver_policy = match (selection.cursor, filter.since) {
            (Some(Cursor(seq)), _) => consumer::DeliverPolicy::ByStartSequence { start_sequence: seq },
            (None, Some(start_time)) => consumer::DeliverPolicy::ByStartTime { start_time },
            (None, None) => consumer::DeliverPolicy::All,
        };
        let config = consumer::pull::Config {
            deliver_policy,
            ack_policy: consumer::AckPolicy::None,
            filter_subject: filter.subject(),
            inactive_threshold: Duration::from_secs(30),
            memory_storage: true,
            num_replicas: 1,
            ..Default::default()
        };
        let scanner: consumer::PullConsumer = match stream.create_consumer(config).await {
            Ok(consumer) => consumer,
            Err(e) if is_not_found(&e) => return Ok(Page::default()),
            Err(e) => return Err(unavailable_or_internal("reading the dead-letter stream", e).into()),
        };
        let page = scan(&scanner, selection).await;
        let name = scanner.cached_info().name.clone();
        tokio::spawn(async move {
            let _ = stream.delete_consumer(&name).await;
        });
        page
    }

    /// One letter by its sequence; `None` when there is none. Read through
    /// a consumer as pages are: async-nats's stream message get keeps only
    /// the last value of a repeated header (its raw-message header parser
    /// inserts rather than appends), and a letter keeps every value.
    pub async fn get(&self, seq: u64) -> Result<Option<Letter>, Error> {
        let selection = Selection { filter: Default::default(), cursor: Some(Cursor(seq)), limit: 1 };
        let page = self.page(&selection).await?;
        Ok(page.letters.into_iter().next().filter(|letter| letter.seq == seq))
    }

    /// Deletes a letter and its redrive mark; false when it was gone already.
    pub async fn delete(&self, letter: &Letter) -> Result<bool, Error> {
        let Some(stream) = self.stream().await? else { return Ok(false) };
        let deleted = match stream.delete_message(letter.seq).await {
            Ok(deleted) => deleted,
            // The server's answer for a sequence it does not hold.
            Err(e) if jetstream_error_code(&e) == Some(jetstream::ErrorCode::NO_MESSAGE_FOUND.0) => false,
            Err(e) => return Err(unavailable_or_internal("deleting a dead letter", e).into()),
        };
        if let Some(marks) = self.marks(false).await? {
            marks
                .purge(mark_key(letter.seq))
                .await
                .map_err(|e| unavailable_or_internal("deleting a redrive mark", e))?;
        }
        Ok(deleted)
    }

    /// Where each letter was redriven to, if anywhere (in order).
    pub async fn redriven(&self, letters: &[Letter]) -> Result<Vec<Option<Redriven>>, Error> {
        let Some(marks) = self.marks(false).await? else { return Ok(vec![None; letters.len()]) };
        let mut found = Vec::with_capacity(letters.len());
        for letter in letters {
            let entry = marks
                .get(mark_key(letter.seq))
                .await
                .map_err(|e| unavailable_or_internal("reading a redrive mark", e))?;
            let mark = entry.and_then(|bytes| serde_json::from_slice::<Redriven>(&bytes).ok());
            found.push(mark.filter(|m| m.letter == letter.msg_id));
        }
        Ok(found)
    }

    /// Remembers that `letter` was redriven.
    pub(super) async fn mark_redriven(&self, letter: &Letter, mark: &Redriven) -> Result<(), Error> {
        let marks = self.marks(true).await?.ok_or_else(|| Error::new(Kind::Internal, "no redrives bucket"))?;
        let mut value = serde_json::to_value(mark)
            .map_err(|e| Error::new(Kind::Internal, "encoding a redrive mark").caused_by(e))?;
        value["letter"] = serde_json::Value::String(letter.msg_id.clone());
        let bytes = serde_json::to_vec(&value)
            .map_err(|e| Error::new(Kind::Internal, "encoding a redrive mark").caused_by(e))?;
        marks
            .put(mark_key(letter.seq), bytes.into())
            .await
            .map_err(|e| unavailable_or_internal("storing a redrive mark", e))?;
        Ok(())
    }

    /// The redrives bucket, made when `create` and missing.
    async fn marks(&self, create: bool) -> Result<Option<kv::Store>, Error> {
        if !create {
            return Ok(self.buckets.open(REDRIVES_BUCKET).await?);
        }
        let spec = BucketSpec::state(REDRIVES_BUCKET, "keygate: where dead letters were redriven to");
        Ok(Some(self.buckets.open_or_create(spec).await?))
    }
}

fn mark_key(seq: u64) -> String {
    seq.to_string()
}

async fn scan(scanner: &consumer::PullConsumer, selection: &Selection) -> Result<Page, Error> {
    let unavailable = |e: &dyn std::fmt::Display| {
        tracing::warn!(error = %e, "scanning the dead-letter stream");
        Error::new(Kind::Unavailable, "reading the dead-letter stream: NATS did not answer; retry later")
    };
    let filter = &selection.filter;
    let mut page = Page::default();
    let (mut read, mut bytes) = (0usize, 0usize);
    loop {
        let mut batch = scanner.fetch().max_messages(FETCH).messages().await.map_err(|e| unavailable(&e))?;
        let mut got = 0;
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| unavailable(&e))?;
            got += 1;
            read += 1;
            let info = message.info().map_err(|e| unavailable(&e))?;
            let (seq, pending, time) = (info.stream_sequence, info.pending, info.published);
            if filter.until.is_some_and(|until| time > until + CLOCK_SLACK) {
                return Ok(page);
            }
            let letter = Letter::parse(seq, &message.subject, message.headers.as_ref(), message.payload.clone(), time);
            if let Some(letter) = letter.filter(|l| filter.matches(l)) {
                bytes += letter.payload.len();
                page.letters.push(letter);
                if page.letters.len() >= selection.limit || bytes >= PAGE_BYTES {
                    page.next = (pending > 0).then_some(Cursor(seq + 1));
                    return Ok(page);
                }
            }
            if pending == 0 {
                return Ok(page);
            }
            if read >= SCAN_BUDGET {
                page.next = Some(Cursor(seq + 1));
                return Ok(page);
            }
        }
        if got == 0 {
            return Ok(page);
        }
    }
}
