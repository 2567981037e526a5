//! What an endpoint's answer to a batched delivery means for each message
//! in it (docs/batched-deliveries.md). Pure, table-tested below.
//!
//! - A `keygate-ack` header settles the whole batch as it says.
//! - A non-2xx answer (or none) retries every message: 429 and 503 with
//!   `Retry-After` after that delay, 410 also stops the member.
//! - A 2xx with an empty body acks every message.
//! - A 2xx with `{"results":[{"id","status":"ack"|"retry"|"dead","delay_ms"}]}`
//!   settles each message as its result says. The results must name every
//!   message of the batch exactly once; anything else (an unknown id, an id
//!   twice, a message left out, a body that is not this object) retries
//!   the whole batch with the reason, and is never read as an ack.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use super::outputs::OutputMessage;
use super::verdict::{judge, Judgement, Response, RetryPolicy, Verdict};

/// Most bytes of a batch answer keygate reads: a result per message of the
/// largest batch (1,000) fits many times over.
pub const MAX_BATCH_ANSWER: usize = 1024 * 1024;
/// Most bytes of a batch answer read when the registration declares
/// outputs (docs/pipelines.md): each message's results may carry its own.
pub const MAX_BATCH_OUTPUTS_ANSWER: usize = 8 * 1024 * 1024;

/// The verdicts of one batched call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchJudgement {
    /// One per message, in the order of the ids judged.
    pub items: Vec<Judgement>,
    /// The `publish` list of each message's `ack` result, when it has one
    /// (docs/pipelines.md); empty when no result carried one.
    pub publish: Vec<Option<Vec<OutputMessage>>>,
    /// The call failed as a whole (what a circuit breaker counts).
    pub failed: bool,
    /// 410 Gone: stop serving this member at this URL.
    pub gone: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchAnswer {
    results: Vec<ItemResult>,
}

/// One message's result in a batch answer (a webhook's body, or a
/// WebSocket client's `results` frame).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ItemResult {
    pub id: String,
    pub status: ItemStatus,
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// With `ack`: messages to publish before it (docs/pipelines.md).
    #[serde(default)]
    pub publish: Option<Vec<OutputMessage>>,
}

impl ItemResult {
    /// Outputs belong to an ack: with a retry or a dead verdict they would
    /// be published for a message that is not done.
    pub fn publish_without_ack(&self) -> bool {
        self.publish.is_some() && !matches!(self.status, ItemStatus::Ack)
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ItemStatus {
    Ack,
    Retry,
    Dead,
}

/// The verdict of every message of a batch whose ids are `ids` (in the
/// order they were sent).
pub fn judge_batch(response: &Response<'_>, ids: &[&str], now: SystemTime, policy: RetryPolicy<'_>) -> BatchJudgement {
    let whole = judge(response, now, policy);
    let all = |judgement: Judgement| BatchJudgement {
        failed: judgement.failed,
        gone: judgement.gone,
        items: vec![judgement; ids.len()],
        publish: Vec::new(),
    };
    let (status, body) = match response {
        Response::Http { status, keygate_ack: None, body, .. } => (*status, *body),
        // No answer, or a keygate-ack header: the whole batch as judged.
        Response::Http { .. } | Response::Timeout | Response::ConnectionError(_) => return all(whole),
    };
    if !(200..=299).contains(&status) {
        let delay = match whole.verdict {
            Verdict::Nak { delay } => delay,
            _ => None,
        };
        let reason = format!("{} (the whole batch is retried)", whole.reason);
        return all(Judgement { verdict: Verdict::Nak { delay }, reason, ..whole });
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return all(whole);
    }
    match results(body, ids, policy.max_retry_after) {
        Ok((items, publish)) => BatchJudgement { items, publish, failed: false, gone: false },
        Err(why) => all(Judgement {
            verdict: Verdict::Nak { delay: None },
            gone: false,
            failed: true,
            reason: format!("{status} with an unusable batch answer, the whole batch is retried: {why}"),
        }),
    }
}

/// Why a 2xx batch answer's body cannot settle its batch (ids from the
/// answer are cut to 64 characters: the reason reaches events and dead
/// letters).
#[derive(Debug, thiserror::Error)]
enum UnusableAnswer {
    #[error("the body is not {{\"results\":[{{\"id\",\"status\"}}…]}} ({0})")]
    NotResults(serde_json::Error),
    #[error("result for {0:?}, which is not in this batch")]
    UnknownId(String),
    #[error("two results for {0:?}")]
    TwoResults(String),
    #[error("results for {answered} of the batch's {size} messages (every message needs one)")]
    Incomplete { answered: usize, size: usize },
    #[error("result for {0:?} carries a publish list with a status other than ack")]
    PublishWithoutAck(String),
}

/// Each message's verdict (and `publish` list) from a `{"results":[…]}`
/// body, or why the body cannot settle this batch.
#[allow(clippy::type_complexity)]
fn results(
    body: &[u8],
    ids: &[&str],
    max_delay: Duration,
) -> Result<(Vec<Judgement>, Vec<Option<Vec<OutputMessage>>>), UnusableAnswer> {
    let answer: BatchAnswer = serde_json::from_slice(body).map_err(UnusableAnswer::NotResults)?;
    let position: HashMap<&str, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut items: Vec<Option<Judgement>> = vec![None; ids.len()];
    let mut publish: Vec<Option<Vec<OutputMessage>>> = vec![None; ids.len()];
    for result in answer.results {
        if result.publish_without_ack() {
            return Err(UnusableAnswer::PublishWithoutAck(truncated(&result.id)));
        }
        let Some(&at) = position.get(result.id.as_str()) else {
            return Err(UnusableAnswer::UnknownId(truncated(&result.id)));
        };
        if items[at].is_some() {
            return Err(UnusableAnswer::TwoResults(truncated(&result.id)));
        }
        let (verdict, word) = match result.status {
            ItemStatus::Ack => (Verdict::Ack, "ack"),
            ItemStatus::Retry => {
                (Verdict::Nak { delay: result.delay_ms.map(|ms| Duration::from_millis(ms).min(max_delay)) }, "retry")
            }
            ItemStatus::Dead => (Verdict::Term, "dead"),
        };
        let reason = format!("the batch answer's result: {word}");
        items[at] = Some(Judgement { verdict, gone: false, failed: false, reason });
        publish[at] = result.publish;
    }
    let answered = items.iter().filter(|i| i.is_some()).count();
    if answered != ids.len() {
        return Err(UnusableAnswer::Incomplete { answered, size: ids.len() });
    }
    Ok((items.into_iter().flatten().collect(), publish))
}

/// An id from an answer, short enough for a reason.
fn truncated(id: &str) -> String {
    id.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: RetryPolicy<'static> = RetryPolicy { max_retry_after: Duration::from_secs(300), retry_statuses: &[] };
    const IDS: [&str; 3] = ["S-1", "S-2", "S-3"];

    fn answer(status: u16, keygate_ack: Option<&str>, body: &str) -> BatchJudgement {
        let response = Response::Http { status, retry_after: None, keygate_ack, body: body.as_bytes() };
        judge_batch(&response, &IDS, SystemTime::now(), POLICY)
    }

    fn verdicts(judged: &BatchJudgement) -> Vec<Verdict> {
        judged.items.iter().map(|j| j.verdict).collect()
    }

    const NAK: Verdict = Verdict::Nak { delay: None };

    #[test]
    fn whole_batch_answers() {
        assert_eq!(verdicts(&answer(200, None, "")), vec![Verdict::Ack; 3], "2xx, no body: all acked");
        assert_eq!(verdicts(&answer(204, None, " \n")), vec![Verdict::Ack; 3]);
        let failed = answer(500, None, "");
        assert_eq!(verdicts(&failed), vec![NAK; 3], "non-2xx: all retried");
        assert!(failed.failed && failed.items[0].reason.contains("whole batch"));
        assert_eq!(verdicts(&answer(400, None, "")), vec![NAK; 3], "a 4xx retries the batch too");
        let gone = answer(410, None, "");
        assert!(gone.gone);
        assert_eq!(verdicts(&gone), vec![NAK; 3]);
        let later = Response::Http { status: 503, retry_after: Some("7"), keygate_ack: None, body: b"" };
        let judged = judge_batch(&later, &IDS, SystemTime::now(), POLICY);
        assert_eq!(verdicts(&judged), vec![Verdict::Nak { delay: Some(Duration::from_secs(7)) }; 3]);
        assert_eq!(
            verdicts(&answer(200, Some("nak; delay=2s"), "")),
            vec![Verdict::Nak { delay: Some(Duration::from_secs(2)) }; 3]
        );
        for none in [Response::Timeout, Response::ConnectionError("refused".into())] {
            let judged = judge_batch(&none, &IDS, SystemTime::now(), POLICY);
            assert_eq!(verdicts(&judged), vec![NAK; 3]);
            assert!(judged.failed);
        }
    }

    #[test]
    fn per_message_results_settle_each_message() {
        let judged = answer(
            200,
            None,
            r#"{"results":[{"id":"S-3","status":"dead"},{"id":"S-1","status":"ack"},
                {"id":"S-2","status":"retry","delay_ms":1500}]}"#,
        );
        assert_eq!(
            verdicts(&judged),
            vec![Verdict::Ack, Verdict::Nak { delay: Some(Duration::from_millis(1500)) }, Verdict::Term]
        );
        assert!(!judged.failed);
        let capped = answer(
            200,
            None,
            r#"{"results":[{"id":"S-1","status":"retry","delay_ms":99999999},{"id":"S-2","status":"ack"},{"id":"S-3","status":"ack"}]}"#,
        );
        assert_eq!(capped.items[0].verdict, Verdict::Nak { delay: Some(Duration::from_secs(300)) });
    }

    #[test]
    fn unusable_answers_retry_the_whole_batch_and_never_ack() {
        for (body, why) in [
            (
                r#"{"results":[{"id":"S-1","status":"ack"},{"id":"S-2","status":"ack"},{"id":"X-9","status":"ack"}]}"#,
                "not in this batch",
            ),
            (
                r#"{"results":[{"id":"S-1","status":"ack"},{"id":"S-1","status":"ack"},{"id":"S-2","status":"ack"}]}"#,
                "two results",
            ),
            (r#"{"results":[{"id":"S-1","status":"ack"},{"id":"S-2","status":"ack"}]}"#, "2 of the batch's 3"),
            (
                r#"{"results":[{"id":"S-1","status":"ok"},{"id":"S-2","status":"ack"},{"id":"S-3","status":"ack"}]}"#,
                "not {",
            ),
            (r#"{"status":"RETRY"}"#, "not {"),
            ("OK", "not {"),
            (r#"{"results":[],"extra":1}"#, "not {"),
        ] {
            let judged = answer(200, None, body);
            assert_eq!(verdicts(&judged), vec![NAK; 3], "{body}");
            assert!(judged.failed, "{body}");
            assert!(judged.items[0].reason.contains(why), "{body}: {}", judged.items[0].reason);
        }
    }
}
