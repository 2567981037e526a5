//! What an endpoint's answer means for the message: one pure function from
//! a webhook response (or its absence) to a [`Verdict`], and the retry
//! backoff. Table-tested below.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Longest `Retry-After` honoured.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(15 * 60);

/// Retry backoff: `initial_ms` doubling up to `max_ms`, with jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Backoff {
    #[schema(minimum = 1, example = 500)]
    pub initial_ms: u64,
    #[schema(minimum = 1, example = 60000)]
    pub max_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { initial_ms: 500, max_ms: 60_000 }
    }
}

/// What happens to a message after a delivery attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Processed: acknowledge it.
    Ack,
    /// Deliver again later; `None` means after the retry backoff.
    Nak { delay: Option<Duration> },
    /// Never deliver again (it goes to the dead-letter stream).
    Term,
    /// Still working on it: extend the ack deadline.
    Progress,
}

/// A verdict with why, and whether the endpoint asked to stop serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judgement {
    pub verdict: Verdict,
    /// 410 Gone: stop serving this member at this URL.
    pub gone: bool,
    /// The endpoint failed: no 2xx answer (an error status, a timeout, no
    /// connection). What a circuit breaker counts.
    pub failed: bool,
    /// Human-readable reason (for events, blocked partitions, dead letters).
    pub reason: String,
}

/// What a registration says about retrying, beside the fixed rules.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy<'a> {
    /// Longest `Retry-After` honoured.
    pub max_retry_after: Duration,
    /// 4xx statuses retried (with backoff) rather than terminating.
    pub retry_statuses: &'a [u16],
}

/// What came back from one webhook call.
#[derive(Debug, Clone)]
pub enum Response<'a> {
    /// An HTTP response.
    Http {
        status: u16,
        /// The `Retry-After` header.
        retry_after: Option<&'a str>,
        /// The `keygate-ack` header.
        keygate_ack: Option<&'a str>,
        /// The start of the body (for `{"status":"RETRY"|"DROP"}`).
        body: &'a [u8],
    },
    /// No response in time.
    Timeout,
    /// No connection, or it broke.
    ConnectionError(String),
}

fn judgement(verdict: Verdict, reason: impl Into<String>) -> Judgement {
    Judgement { verdict, gone: false, failed: false, reason: reason.into() }
}

fn failure(verdict: Verdict, reason: impl Into<String>) -> Judgement {
    Judgement { failed: true, ..judgement(verdict, reason) }
}

/// The verdict for a webhook response (docs/architecture.md, "Webhook delivery").
/// `policy.max_retry_after` caps a `Retry-After` the endpoint asks for.
pub fn judge(response: &Response<'_>, now: SystemTime, policy: RetryPolicy<'_>) -> Judgement {
    let max_retry_after = policy.max_retry_after;
    let (status, retry_after, keygate_ack, body) = match response {
        Response::Timeout => return failure(Verdict::Nak { delay: None }, "the endpoint did not answer in time"),
        Response::ConnectionError(e) => {
            return failure(Verdict::Nak { delay: None }, format!("could not reach the endpoint: {e}"))
        }
        Response::Http { status, retry_after, keygate_ack, body } => (*status, *retry_after, *keygate_ack, *body),
    };
    let failed = !(200..=299).contains(&status);
    if let Some(header) = keygate_ack {
        if let Some(verdict) = parse_keygate_ack(header) {
            let verdict = match verdict {
                Verdict::Nak { delay } => Verdict::Nak { delay: delay.map(|d| d.min(max_retry_after)) },
                other => other,
            };
            let reason = format!("keygate-ack: {header} (status {status})");
            return Judgement { failed, ..judgement(verdict, reason) };
        }
    }
    match status {
        200..=299 => match body_status(body).as_deref() {
            Some("RETRY") => judgement(Verdict::Nak { delay: None }, format!("{status} with status RETRY")),
            Some("DROP") => judgement(Verdict::Term, format!("{status} with status DROP")),
            _ => judgement(Verdict::Ack, format!("{status}")),
        },
        429 | 503 if retry_after.is_some() => {
            let delay = retry_after.and_then(|v| parse_retry_after(v, now)).map(|d| d.min(max_retry_after));
            failure(Verdict::Nak { delay }, format!("{status} with Retry-After: {}", retry_after.unwrap_or_default()))
        }
        408 | 425 | 429 | 500..=599 => failure(Verdict::Nak { delay: None }, format!("{status}")),
        s if policy.retry_statuses.contains(&s) => {
            failure(Verdict::Nak { delay: None }, format!("{status} (retried: the registration's retry_statuses)"))
        }
        410 => Judgement {
            verdict: Verdict::Term,
            gone: true,
            failed: true,
            reason: "410 Gone: the endpoint stopped this member".into(),
        },
        _ => failure(Verdict::Term, format!("{status}: the endpoint refused the message")),
    }
}

/// `ack`, `term`, `nak`, `nak; delay=5s` (also `500ms`, `2m`, or bare seconds).
fn parse_keygate_ack(header: &str) -> Option<Verdict> {
    let mut parts = header.split(';').map(str::trim);
    let word = parts.next()?.to_ascii_lowercase();
    match word.as_str() {
        "ack" => Some(Verdict::Ack),
        "term" => Some(Verdict::Term),
        "nak" => {
            let delay = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("delay"))
                .and_then(|(_, v)| parse_duration(v.trim()));
            Some(Verdict::Nak { delay })
        }
        _ => None,
    }
}

/// `250ms`, `5s`, `2m`, `1h`, or bare seconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().ok()?;
    let seconds = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return None,
    };
    if !seconds.is_finite() || seconds < 0.0 {
        return None;
    }
    Some(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
}

/// `Retry-After`: delay-seconds or an HTTP date.
fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

fn body_status(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct StatusBody {
        status: String,
    }
    serde_json::from_slice::<StatusBody>(body).ok().map(|b| b.status.to_ascii_uppercase())
}

/// Exponential backoff with jitter: `initial × 2^(attempt−1)`, capped at
/// `max`, then a random point in its upper half (so retries of many
/// messages spread out but never come sooner than half the step).
pub fn backoff(attempt: u64, initial: Duration, max: Duration, unit_random: f64) -> Duration {
    let exponent = attempt.saturating_sub(1).min(30) as i32;
    let step = initial.as_secs_f64() * 2f64.powi(exponent);
    let capped = step.min(max.as_secs_f64());
    Duration::from_secs_f64(capped * (0.5 + 0.5 * unit_random.clamp(0.0, 1.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_secs(300);
    const POLICY: RetryPolicy<'static> = RetryPolicy { max_retry_after: CAP, retry_statuses: &[] };

    fn http<'a>(
        status: u16,
        retry_after: Option<&'a str>,
        keygate_ack: Option<&'a str>,
        body: &'a [u8],
    ) -> Response<'a> {
        Response::Http { status, retry_after, keygate_ack, body }
    }

    #[test]
    fn responses_map_to_verdicts_as_design_md_says() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        let nak = |d: Option<u64>| Verdict::Nak { delay: d.map(Duration::from_secs) };
        let table: Vec<(Response<'_>, Verdict, bool)> = vec![
            (http(200, None, None, b""), Verdict::Ack, false),
            (http(204, None, None, b""), Verdict::Ack, false),
            (http(200, None, None, br#"{"status":"RETRY"}"#), nak(None), false),
            (http(200, None, None, br#"{"status":"DROP"}"#), Verdict::Term, false),
            (http(200, None, None, br#"{"status":"SUCCESS"}"#), Verdict::Ack, false),
            (http(200, None, None, b"not json"), Verdict::Ack, false),
            (http(429, Some("3"), None, b""), nak(Some(3)), false),
            (http(503, Some("10"), None, b""), nak(Some(10)), false),
            (http(503, Some(&later), None, b""), nak(Some(7)), false),
            (http(503, Some("99999"), None, b""), nak(Some(300)), false),
            (http(503, Some("garbage"), None, b""), nak(None), false),
            (http(429, None, None, b""), nak(None), false),
            (http(503, None, None, b""), nak(None), false),
            (http(500, None, None, b""), nak(None), false),
            (http(502, None, None, b""), nak(None), false),
            (http(408, None, None, b""), nak(None), false),
            (http(425, None, None, b""), nak(None), false),
            (http(400, None, None, b""), Verdict::Term, false),
            (http(404, None, None, b""), Verdict::Term, false),
            (http(422, None, None, b""), Verdict::Term, false),
            (http(410, None, None, b""), Verdict::Term, true),
            (http(301, None, None, b""), Verdict::Term, false),
            (http(500, None, Some("ack"), b""), Verdict::Ack, false),
            (http(200, None, Some("term"), b""), Verdict::Term, false),
            (http(200, None, Some("nak; delay=5s"), b""), nak(Some(5)), false),
            (
                http(200, None, Some("NAK;delay=250ms"), b""),
                Verdict::Nak { delay: Some(Duration::from_millis(250)) },
                false,
            ),
            (http(200, None, Some("nak"), b""), nak(None), false),
            (http(200, None, Some("progress"), b""), Verdict::Ack, false),
            (http(404, None, Some("bogus"), b""), Verdict::Term, false),
            (Response::Timeout, nak(None), false),
            (Response::ConnectionError("refused".into()), nak(None), false),
        ];
        for (response, verdict, gone) in table {
            let j = judge(&response, now, POLICY);
            assert_eq!((j.verdict, j.gone), (verdict, gone), "{response:?}");
            assert!(!j.reason.is_empty());
        }
    }

    #[test]
    fn retry_statuses_retry_what_would_terminate_and_failures_are_what_is_not_2xx() {
        let now = SystemTime::now();
        let retrying = RetryPolicy { max_retry_after: CAP, retry_statuses: &[404, 410] };
        let http = |status| Response::Http { status, retry_after: None, keygate_ack: None, body: b"" };
        assert_eq!(judge(&http(404), now, retrying).verdict, Verdict::Nak { delay: None });
        let gone = judge(&http(410), now, retrying);
        assert_eq!((gone.verdict, gone.gone), (Verdict::Nak { delay: None }, false), "410 listed: retried, not gone");
        assert_eq!(judge(&http(400), now, retrying).verdict, Verdict::Term, "only the listed statuses");
        let told = Response::Http { status: 404, retry_after: None, keygate_ack: Some("term"), body: b"" };
        assert_eq!(judge(&told, now, retrying).verdict, Verdict::Term, "keygate-ack still overrides");
        for (response, failed) in [
            (http(200), false),
            (
                Response::Http { status: 200, retry_after: None, keygate_ack: None, body: br#"{"status":"RETRY"}"# },
                false,
            ),
            (http(500), true),
            (http(404), true),
            (Response::Timeout, true),
            (Response::ConnectionError("refused".into()), true),
            (Response::Http { status: 500, retry_after: None, keygate_ack: Some("ack"), body: b"" }, true),
        ] {
            assert_eq!(judge(&response, now, POLICY).failed, failed, "{response:?}");
        }
    }

    #[test]
    fn backoff_doubles_caps_and_jitters_within_the_upper_half() {
        let (initial, max) = (Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(backoff(1, initial, max, 1.0), Duration::from_secs(1));
        assert_eq!(backoff(3, initial, max, 1.0), Duration::from_secs(4));
        assert_eq!(backoff(3, initial, max, 0.0), Duration::from_secs(2));
        assert_eq!(backoff(30, initial, max, 1.0), Duration::from_secs(60));
        assert_eq!(backoff(u64::MAX, initial, max, 1.0), Duration::from_secs(60));
    }

    #[test]
    fn durations_parse_in_the_usual_units() {
        assert_eq!(parse_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_duration("5 parsecs"), None);
        assert_eq!(parse_duration("99999999999999999999"), Some(Duration::MAX), "huge delays do not panic");
        let j = judge(
            &Response::Http {
                status: 200,
                retry_after: None,
                keygate_ack: Some("nak; delay=99999999999999999999"),
                body: b"",
            },
            SystemTime::now(),
            POLICY,
        );
        assert_eq!(j.verdict, Verdict::Nak { delay: Some(CAP) }, "keygate-ack delays are capped too");
    }
}
