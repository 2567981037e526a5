//! Custody: whether the instance that received a message may still settle
//! it (ack or terminate) without settling a copy the server has since
//! given to another instance.
//!
//! The server settles by stream sequence alone: a late ack from an
//! instance whose copy was redelivered elsewhere settles the other copy
//! too. The new holder then counts a message the consumer no longer counts,
//! and with one such entry balanced by a message still out elsewhere its
//! handover barrier falls too early (docs/architecture.md, "Why lanes, the
//! handover barrier and fencing tokens"). The server redelivers a message
//! while its holder still works on it only when the ack wait passed
//! without word from the holder: across a NATS reconnect (a restarted
//! server forgets pins and the keep-alives it had not stored), or when
//! keep-alives went out late (a starved process), and when its consumer
//! elected a new leader, which works from replicated state that may lag
//! (nats/consumer_leaders.rs). Custody holds while none of these happened
//! since the message arrived. A keep-alive sent after a silence that long
//! does not bring custody back: the server may have given the message
//! elsewhere during the silence, and that copy's holder would have its
//! copy settled by this one's ack. Without it a verdict that
//! would settle the message NAKs it instead: a duplicate delivery with the
//! same `webhook-id`, never a reorder.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// One run's view of what custody depends on: its NATS connection (how
/// many connections were made, whether one is up), its consumer's leader
/// elections and the ack wait.
pub struct CustodyClock {
    client: async_nats::Client,
    connections: watch::Receiver<u64>,
    elections: Arc<AtomicU64>,
    ack_wait: Duration,
    origin: Instant,
}

impl CustodyClock {
    /// `connections` counts the connections made (one more at every
    /// reconnect), `elections` the consumer's leader elections.
    pub fn new(
        client: async_nats::Client,
        connections: watch::Receiver<u64>,
        elections: Arc<AtomicU64>,
        ack_wait: Duration,
    ) -> Arc<Self> {
        Arc::new(Self { client, connections, elections, ack_wait, origin: Instant::now() })
    }

    /// Custody of a message arriving now.
    pub fn receive(self: &Arc<Self>) -> Custody {
        let connection = *self.connections.borrow();
        let elections = self.elections.load(Ordering::Acquire);
        Custody {
            last_word_ms: AtomicU64::new(self.since_origin(Instant::now())),
            clock: self.clone(),
            connection,
            elections,
        }
    }

    fn since_origin(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX)
    }
}

/// Custody of one message (see the module's documentation).
pub struct Custody {
    clock: Arc<CustodyClock>,
    /// The connection it arrived on.
    connection: u64,
    /// The consumer's leader elections counted when it arrived.
    elections: u64,
    /// When the last word for it went out (its arrival, or the start of a
    /// keep-alive sent since), in milliseconds after the clock's origin.
    last_word_ms: AtomicU64,
}

impl Custody {
    /// A keep-alive for the message, begun at `sent`, went out: the
    /// server's ack wait for it runs from no earlier than that, unless the
    /// silence before it was already too long (custody lapses for good).
    pub fn kept_alive(&self, sent: Instant) {
        let (sent, longest) = (self.clock.since_origin(sent), longest_silence(self.clock.ack_wait));
        let _ = self
            .last_word_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| Some(after_keep_alive(last, sent, longest)));
    }

    /// The server gave this instance the message again while it was
    /// delivering it: pinned here, the server's ack wait for its copy
    /// starts over now. Custody already lapsed stays lapsed: a copy may
    /// have gone elsewhere in between.
    pub fn redelivered_here(&self, at: Instant) {
        let at = self.clock.since_origin(at);
        let _ = self.last_word_ms.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(if last == LAPSED { LAPSED } else { last.max(at) })
        });
    }

    /// Whether the message may be settled now.
    pub fn held(&self) -> bool {
        let clock = &self.clock;
        let since = SinceArrival {
            connection_up: clock.client.connection_state() == async_nats::connection::State::Connected,
            reconnected: *clock.connections.borrow() != self.connection,
            leader_elected: clock.elections.load(Ordering::Acquire) != self.elections,
        };
        let last_word = match self.last_word_ms.load(Ordering::Relaxed) {
            LAPSED => None,
            ms => Some(clock.origin + Duration::from_millis(ms)),
        };
        let held = unbroken(&since, last_word, clock.ack_wait, Instant::now());
        if !held {
            tracing::debug!(
                up = since.connection_up,
                reconnected = since.reconnected,
                leader_elected = since.leader_elected,
                silent_ms = last_word.map(|w| w.elapsed().as_millis()),
                "custody of a message lapsed"
            );
        }
        held
    }
}

/// `last_word_ms` of a custody that lapsed for good.
const LAPSED: u64 = u64::MAX;

/// The longest silence custody survives: a quarter of the ack wait is left
/// for the settlement to reach the server and for the server's own clock.
fn longest_silence(ack_wait: Duration) -> Duration {
    ack_wait - ack_wait / 4
}

/// The last word (ms after the clock's origin) once a keep-alive begun at
/// `sent` went out: the later of the two, or [`LAPSED`] when the silence
/// before it reached `longest` (the server may have redelivered meanwhile).
fn after_keep_alive(last: u64, sent: u64, longest: Duration) -> u64 {
    let longest = u64::try_from(longest.as_millis()).unwrap_or(u64::MAX);
    match last {
        LAPSED => LAPSED,
        last if sent.saturating_sub(last) >= longest => LAPSED,
        last => last.max(sent),
    }
}

impl fmt::Debug for Custody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Custody").field("connection", &self.connection).finish_non_exhaustive()
    }
}

/// What happened to the connection and the consumer since a message arrived.
struct SinceArrival {
    connection_up: bool,
    reconnected: bool,
    leader_elected: bool,
}

/// Custody holds on the connection the message arrived on, while it is
/// up, under the consumer leader it arrived under, and within the longest
/// silence of the last word sent for it (its arrival or a keep-alive), if
/// no silence before was longer (`None`).
fn unbroken(since: &SinceArrival, last_word: Option<Instant>, ack_wait: Duration, now: Instant) -> bool {
    since.connection_up
        && !since.reconnected
        && !since.leader_elected
        && last_word.is_some_and(|word| now.saturating_duration_since(word) < longest_silence(ack_wait))
}

#[cfg(test)]
mod tests {
    use super::{after_keep_alive, longest_silence, unbroken, SinceArrival, LAPSED};
    use std::time::{Duration, Instant};

    const ACK_WAIT: Duration = Duration::from_secs(2);

    fn on(arrived_on: u64, now: u64, up: bool) -> SinceArrival {
        SinceArrival { connection_up: up, reconnected: arrived_on != now, leader_elected: false }
    }

    #[test]
    fn custody_holds_on_the_same_connection_while_keep_alives_are_on_time() {
        let word = Instant::now();
        assert!(unbroken(&on(3, 3, true), Some(word), ACK_WAIT, word + Duration::from_millis(1400)));
    }

    #[test]
    fn a_reconnect_or_a_connection_down_breaks_custody() {
        let word = Instant::now();
        assert!(!unbroken(&on(3, 4, true), Some(word), ACK_WAIT, word), "reconnected since it arrived");
        assert!(!unbroken(&on(3, 3, false), Some(word), ACK_WAIT, word), "the connection is down now");
    }

    #[test]
    fn a_consumer_leader_elected_since_it_arrived_breaks_custody() {
        let word = Instant::now();
        let elected = SinceArrival { connection_up: true, reconnected: false, leader_elected: true };
        assert!(!unbroken(&elected, Some(word), ACK_WAIT, word), "the new leader may have given it elsewhere");
    }

    #[test]
    fn keep_alives_late_by_most_of_the_ack_wait_break_custody() {
        let word = Instant::now();
        assert!(!unbroken(&on(1, 1, true), Some(word), ACK_WAIT, word + Duration::from_millis(1500)));
        assert!(!unbroken(&on(1, 1, true), Some(word), ACK_WAIT, word + Duration::from_secs(60)));
    }

    #[test]
    fn keep_alives_on_time_carry_custody_on() {
        let longest = longest_silence(ACK_WAIT);
        assert_eq!(after_keep_alive(1000, 2400, longest), 2400);
        assert_eq!(after_keep_alive(2400, 3800, longest), 3800);
        // A round that began before the last word it follows moves nothing back.
        assert_eq!(after_keep_alive(3800, 3700, longest), 3800);
    }

    #[test]
    fn a_keep_alive_after_too_long_a_silence_does_not_restore_custody() {
        // Starved for 1.6 s of a 2 s ack wait: the server may have given the
        // message to the next pin holder meanwhile, and an ack from here
        // would settle that holder's copy.
        let longest = longest_silence(ACK_WAIT);
        assert_eq!(after_keep_alive(1000, 2600, longest), LAPSED);
        assert_eq!(after_keep_alive(LAPSED, 2700, longest), LAPSED, "lapsed for good");
        let word = Instant::now();
        assert!(!unbroken(&on(1, 1, true), None, ACK_WAIT, word));
    }
}
