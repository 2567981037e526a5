//! A subscriber's shuffle window: the first deliveries it chose to delay
//! (NAK with a random delay, so a consumer's order is loosened on purpose)
//! whose delay still runs, bounded by its share of the consumer's window.

use std::time::{Duration, Instant};

use crate::consumers::Shuffle;

/// The messages a subscriber instance has delayed whose delay still runs.
pub struct ShuffleWindow {
    until: std::collections::BinaryHeap<std::cmp::Reverse<Instant>>,
    size: metrics::Gauge,
    delayed: metrics::Counter,
}

impl ShuffleWindow {
    pub fn new(stream: &str, consumer: &str) -> Self {
        let labels = [("stream", stream.to_owned()), ("consumer", consumer.to_owned())];
        Self {
            until: Default::default(),
            size: metrics::gauge!(crate::telemetry::metrics::SHUFFLE_WINDOW, &labels),
            delayed: metrics::counter!(crate::telemetry::metrics::SHUFFLE_DELAYED, &labels),
        }
    }

    /// A delay for this delivery, if it is a first delivery chosen to be
    /// delayed and this instance's share of the window has room.
    pub fn delay_first_delivery(&mut self, shuffle: &Shuffle, allowed: u64, attempt: u64) -> Option<Duration> {
        self.refresh();
        let now = Instant::now();
        let delay = (attempt == 1
            && (self.until.len() as u64) < allowed.min(shuffle.max_window)
            && rand::random::<f64>() < shuffle.probability)
            .then(|| Duration::from_millis(rand::random_range(shuffle.min_delay_ms..=shuffle.max_delay_ms)));
        if let Some(delay) = delay {
            self.until.push(std::cmp::Reverse(now + delay));
            self.delayed.increment(1);
        }
        self.size.set(self.until.len() as f64);
        delay
    }
}

impl ShuffleWindow {
    /// Forgets delays that have run out and publishes the window's size.
    pub fn refresh(&mut self) {
        let now = Instant::now();
        while self.until.peek().is_some_and(|std::cmp::Reverse(t)| *t <= now) {
            self.until.pop();
        }
        self.size.set(self.until.len() as f64);
    }
}

impl Drop for ShuffleWindow {
    fn drop(&mut self) {
        self.size.set(0.0);
    }
}
