//! Failing webhook deliveries in keygate's log, at `warn`, without
//! flooding it: the first failure of a streak is logged in full (member,
//! key, seq, attempt, what the endpoint did), then at most one summary
//! every [`SUMMARY_EVERY`] while the endpoint keeps failing, and one line
//! when it answers 2xx again. The reasons come from the webhook client,
//! which drops the URL from its errors, so no URL token or secret reaches
//! the log.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::names::MemberRef;

/// Most one summary line per member in this time while it keeps failing.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// What one failure was, as logged.
pub struct Failure<'a> {
    pub key: Option<&'a str>,
    pub seq: u64,
    pub attempt: u64,
    /// Messages in the failed request (more than one for a batch).
    pub messages: usize,
    /// The status or error, as the webhook client words it.
    pub reason: &'a str,
}

/// One member's failure streak on this keygate.
#[derive(Default)]
pub struct FailureLog {
    streak: Mutex<Streak>,
}

impl FailureLog {
    /// A request to the endpoint failed.
    pub fn failed(&self, who: &MemberRef, failure: &Failure<'_>) {
        let line = self.streak.lock().unwrap_or_else(|p| p.into_inner()).failed(Instant::now());
        let Failure { key, seq, attempt, messages, reason } = failure;
        let key = key.unwrap_or_default();
        match line {
            Some(Line::First) => tracing::warn!(stream = %who.stream, group = %who.group, member = %who.member, key,
                seq, attempt, messages, reason, "webhook delivery failed"),
            Some(Line::StillFailing { failures, streak, since }) => tracing::warn!(stream = %who.stream,
                group = %who.group, member = %who.member, failures, streak, failing_for_s = since.as_secs(), key,
                seq, attempt, reason, "webhook deliveries keep failing (failures since the last line; the latest named)"),
            Some(Line::Recovered { .. }) | None => {}
        }
    }

    /// A request to the endpoint was answered 2xx.
    pub fn succeeded(&self, who: &MemberRef) {
        let line = self.streak.lock().unwrap_or_else(|p| p.into_inner()).succeeded(Instant::now());
        if let Some(Line::Recovered { streak, since }) = line {
            tracing::info!(stream = %who.stream, group = %who.group, member = %who.member, failures = streak,
                failing_for_s = since.as_secs(), "webhook deliveries succeed again");
        }
    }
}

/// What to log for an outcome.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// The first failure after successes (or ever).
    First,
    /// `failures` since the last line, `streak` in this streak, failing `since`.
    StillFailing { failures: u64, streak: u64, since: Duration },
    /// A success ended a logged streak of `streak` failures that lasted `since`.
    Recovered { streak: u64, since: Duration },
}

/// Failures and the lines about them; pure, so the rate is tested exactly.
/// At most one failure line per [`SUMMARY_EVERY`] whatever the pattern (an
/// endpoint failing every other request included), and a recovery line
/// only for a streak that was logged.
#[derive(Debug, Default)]
struct Streak {
    /// When the current streak's first failure came (None: not failing).
    started: Option<Instant>,
    /// Failures in the current streak.
    failures: u64,
    /// Whether a line named the current streak.
    logged: bool,
    /// Failures no line has counted yet, across streaks.
    unlogged: u64,
    last_line: Option<Instant>,
}

impl Streak {
    fn failed(&mut self, now: Instant) -> Option<Line> {
        let started = *self.started.get_or_insert_with(|| {
            self.failures = 0;
            self.logged = false;
            now
        });
        self.failures += 1;
        self.unlogged += 1;
        if self.last_line.is_some_and(|at| now.saturating_duration_since(at) < SUMMARY_EVERY) {
            return None;
        }
        self.last_line = Some(now);
        self.logged = true;
        let failures = std::mem::take(&mut self.unlogged);
        if failures == 1 && self.failures == 1 {
            return Some(Line::First);
        }
        Some(Line::StillFailing { failures, streak: self.failures, since: now.saturating_duration_since(started) })
    }

    fn succeeded(&mut self, now: Instant) -> Option<Line> {
        let started = self.started.take()?;
        if !std::mem::take(&mut self.logged) {
            return None;
        }
        self.last_line = Some(now);
        self.unlogged = 0;
        Some(Line::Recovered { streak: self.failures, since: now.saturating_duration_since(started) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thousand_failures_in_a_burst_make_one_line_and_a_summary_every_ten_seconds() {
        let start = Instant::now();
        let mut streak = Streak::default();
        let lines: Vec<Line> = (0..1000).filter_map(|i| streak.failed(start + Duration::from_millis(i * 25))).collect();
        // 25 s of failures: the first, then a summary at 10 s and at 20 s.
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[0], Line::First);
        assert_eq!(
            lines[1],
            Line::StillFailing { failures: 400, streak: 401, since: Duration::from_secs(10) },
            "the failures since the first line"
        );
        assert!(matches!(lines[2], Line::StillFailing { failures: 400, streak: 801, .. }));
    }

    #[test]
    fn a_success_ends_a_logged_streak_once_and_a_later_failure_is_first_again() {
        let start = Instant::now();
        let mut streak = Streak::default();
        assert_eq!(streak.succeeded(start), None, "nothing to recover from");
        assert_eq!(streak.failed(start), Some(Line::First));
        assert_eq!(streak.failed(start + Duration::from_secs(1)), None);
        assert_eq!(
            streak.succeeded(start + Duration::from_secs(3)),
            Some(Line::Recovered { streak: 2, since: Duration::from_secs(3) })
        );
        assert_eq!(streak.succeeded(start + Duration::from_secs(4)), None);
        assert_eq!(streak.failed(start + Duration::from_secs(5)), None, "within the period of the last line");
        assert_eq!(streak.succeeded(start + Duration::from_secs(6)), None, "that streak was not logged");
        assert_eq!(
            streak.failed(start + Duration::from_secs(20)),
            Some(Line::StillFailing { failures: 2, streak: 1, since: Duration::ZERO }),
            "the unlogged failure is counted in the next line"
        );
        assert_eq!(streak.succeeded(start + Duration::from_secs(21)).map(|_| ()), Some(()));
        assert_eq!(streak.failed(start + Duration::from_secs(40)), Some(Line::First));
    }

    #[test]
    fn an_endpoint_failing_every_other_request_is_logged_at_most_twice_per_period() {
        let start = Instant::now();
        let mut streak = Streak::default();
        let mut lines = Vec::new();
        for i in 0..2500u64 {
            let at = start + Duration::from_millis(i * 10);
            lines.extend(if i % 2 == 0 { streak.failed(at) } else { streak.succeeded(at) });
        }
        // 25 s: a failure line and its recovery at 0, 10 and 20 s.
        assert_eq!(lines.len(), 6, "{lines:?}");
        assert_eq!(lines[0], Line::First);
        assert!(matches!(lines[2], Line::StillFailing { failures: 501, streak: 1, .. }), "{:?}", lines[2]);
    }

    #[test]
    fn failures_further_apart_than_the_summary_period_are_each_logged() {
        let start = Instant::now();
        let mut streak = Streak::default();
        assert_eq!(streak.failed(start), Some(Line::First));
        assert_eq!(
            streak.failed(start + Duration::from_secs(30)),
            Some(Line::StillFailing { failures: 1, streak: 2, since: Duration::from_secs(30) })
        );
    }
}
