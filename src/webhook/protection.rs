//! Sparing a webhook endpoint: its rate limit (a token bucket, from
//! `governor`) and its circuit breaker's count of failures in a row (a
//! pure state machine; pausing the member is the caller's I/O).

use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use super::registration::{BreakerSpec, Registration};

/// What one delivery's outcome does to the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerStep {
    Nothing,
    /// `failures` deliveries in a row failed: pause the member.
    Trip {
        failures: u32,
    },
    /// The probe delivery succeeded: resume the member.
    ProbeSucceeded,
    /// The probe delivery failed: stay paused, probe again later.
    ProbeFailed,
}

/// A breaker's count: failures in a row, and whether it tripped or is
/// probing with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerCount {
    threshold: u32,
    in_a_row: u32,
    tripped: bool,
    probing: bool,
}

impl BreakerCount {
    pub fn new(threshold: u32) -> Self {
        Self { threshold: threshold.max(1), in_a_row: 0, tripped: false, probing: false }
    }

    /// One delivery's outcome.
    pub fn record(&mut self, failed: bool) -> BreakerStep {
        if self.probing {
            self.probing = false;
            if failed {
                return BreakerStep::ProbeFailed;
            }
            *self = Self::new(self.threshold);
            return BreakerStep::ProbeSucceeded;
        }
        if !failed {
            self.in_a_row = 0;
            return BreakerStep::Nothing;
        }
        self.in_a_row = self.in_a_row.saturating_add(1);
        // Deliveries in flight when it tripped fail too: one trip only.
        if self.in_a_row >= self.threshold && !self.tripped {
            self.tripped = true;
            return BreakerStep::Trip { failures: self.in_a_row };
        }
        BreakerStep::Nothing
    }

    /// This instance won the probe: its next delivery decides.
    pub fn start_probe(&mut self) {
        self.probing = true;
    }

    pub fn probing(&self) -> bool {
        self.probing
    }

    /// Tripped and not probing: the endpoint is not called.
    pub fn open(&self) -> bool {
        self.tripped && !self.probing
    }

    /// Counting starts over (the member was resumed).
    pub fn reset(&mut self) {
        *self = Self::new(self.threshold);
    }
}

/// An endpoint's rate limit and breaker, for the life of one instance.
pub struct Protection {
    limiter: Option<DefaultDirectRateLimiter>,
    breaker: Option<(BreakerSpec, Mutex<BreakerCount>)>,
}

impl Protection {
    /// What `registration` asks for.
    pub fn of(registration: &Registration) -> Self {
        let limiter = registration.max_rate.and_then(|rate| {
            let period = Duration::from_secs_f64(1.0 / rate);
            let burst = registration.burst.unwrap_or(rate.ceil() as u32).max(1);
            let quota = Quota::with_period(period)?.allow_burst(NonZeroU32::new(burst)?);
            Some(RateLimiter::direct(quota))
        });
        let breaker = registration.breaker.map(|spec| (spec, Mutex::new(BreakerCount::new(spec.failures))));
        Self { limiter, breaker }
    }

    /// No rate limit, no breaker.
    pub fn none() -> Self {
        Self { limiter: None, breaker: None }
    }

    /// Waits for the rate limit's next slot.
    pub async fn wait_turn(&self) {
        if let Some(limiter) = &self.limiter {
            limiter.until_ready().await;
        }
    }

    fn count(&self) -> Option<std::sync::MutexGuard<'_, BreakerCount>> {
        self.breaker.as_ref().map(|(_, count)| count.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// One delivery's outcome.
    pub fn record(&self, failed: bool) -> BreakerStep {
        self.count().map_or(BreakerStep::Nothing, |mut count| count.record(failed))
    }

    pub fn breaker(&self) -> Option<BreakerSpec> {
        self.breaker.as_ref().map(|(spec, _)| *spec)
    }

    pub fn start_probe(&self) {
        if let Some(mut count) = self.count() {
            count.start_probe();
        }
    }

    pub fn probing(&self) -> bool {
        self.count().is_some_and(|count| count.probing())
    }

    /// The breaker is open: deliveries go back without calling the endpoint
    /// (those in hand when it tripped, or after a failed probe, while the
    /// member pauses).
    pub fn open(&self) -> bool {
        self.count().is_some_and(|count| count.open())
    }

    pub fn reset(&self) {
        if let Some(mut count) = self.count() {
            count.reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_trips_once_after_failures_in_a_row_and_a_probe_decides() {
        let mut count = BreakerCount::new(3);
        assert_eq!(count.record(true), BreakerStep::Nothing);
        assert_eq!(count.record(true), BreakerStep::Nothing);
        assert_eq!(count.record(false), BreakerStep::Nothing, "a success starts the count over");
        assert_eq!(count.record(true), BreakerStep::Nothing);
        assert_eq!(count.record(true), BreakerStep::Nothing);
        assert_eq!(count.record(true), BreakerStep::Trip { failures: 3 });
        assert_eq!(count.record(true), BreakerStep::Nothing, "deliveries in flight do not trip it again");
        assert!(count.open());
        count.start_probe();
        assert!(!count.open(), "the probe goes through");
        assert!(count.probing());
        assert_eq!(count.record(true), BreakerStep::ProbeFailed);
        assert!(!count.probing() && count.open());
        count.start_probe();
        assert_eq!(count.record(false), BreakerStep::ProbeSucceeded);
        assert_eq!(count, BreakerCount::new(3), "closed again, counting from zero");
    }

    #[tokio::test]
    async fn the_rate_limit_spaces_deliveries_after_the_burst() {
        let registration = Registration { max_rate: Some(20.0), burst: Some(2), ..test_registration() };
        let protection = Protection::of(&registration);
        let started = std::time::Instant::now();
        for _ in 0..6 {
            protection.wait_turn().await;
        }
        // Two at once, then one every 50 ms.
        assert!(started.elapsed() >= Duration::from_millis(190), "{:?}", started.elapsed());
    }

    fn test_registration() -> Registration {
        serde_json::from_value(serde_json::json!({
            "url": "http://127.0.0.1:1/", "secret": "whsec_c2VjcmV0", "timeout_ms": 1, "max_attempts": 1,
            "backoff": {"initial_ms": 1, "max_ms": 1}
        }))
        .unwrap()
    }
}
