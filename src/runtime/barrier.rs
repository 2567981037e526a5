//! The handover barrier's decision (pure): whether an instance that gained
//! a pin may start delivering, from what its lanes hold and what the
//! consumer's info counts. docs/architecture.md, "Why lanes, the handover
//! barrier and fencing tokens"; the session asks and acts
//! (`driver/pinning.rs`).

/// What the lanes held when the check counted them, before asking the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// Held, in flight and awaited (NAK'd) messages.
    pub ours: usize,
    /// Held and awaited: what a hand-back can return.
    pub parked: usize,
    /// In flight to the endpoint.
    pub in_flight: usize,
    /// The newest stream sequence of them (0: none).
    pub highest: u64,
    /// `Lanes::departures` then.
    pub departures: u64,
}

/// What the server answered, and what changed here while it was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub num_ack_pending: usize,
    /// The consumer's last delivered stream sequence.
    pub delivered: u64,
    /// Whether the consumer's priority group names this instance's pin.
    pub pinned_here: bool,
    /// `Lanes::departures` when the answer came.
    pub departures: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Every message the consumer counts un-acked is here: deliver.
    Lower,
    Keep,
    /// Keep it up, and give the parked messages back for redelivery (NAK):
    /// some of them were settled elsewhere.
    KeepAndHandBack,
}

/// Whether the barrier may fall.
///
/// - More here than the consumer counts un-acked: some of it was settled
///   elsewhere (a previous holder's delivery that ended after the message
///   was redelivered here), and such entries could make the counts match
///   while another instance still has a message. When the surplus is among
///   the parked messages, they go back (the server redelivers, here, only
///   what is still pending); a consumer leader whose state lags counts too
///   little until its deliveries reach what is here, so not before then.
/// - The counts match, the consumer delivered at least up to the newest
///   message here (a new leader whose state lags forgets deliveries that
///   are due before ours), and it names this pin (an old holder that did
///   not hear the pin move can lower the count with late acks).
/// - Nothing of ours left while the server was asked, and nothing was in
///   flight: an ack the server applies before it answers lowers its count
///   below `ours`, and one message still out elsewhere then makes them
///   match. A worker acks before its lane records the settlement, so only
///   with nothing in flight (none starts while the barrier is up) is the
///   count certain.
pub fn decide(holding: Holding, answer: Answer) -> Decision {
    if answer.num_ack_pending < holding.ours {
        let lagging = answer.delivered < holding.highest;
        if answer.num_ack_pending < holding.parked && !lagging {
            return Decision::KeepAndHandBack;
        }
        return Decision::Keep;
    }
    let settled_meanwhile = holding.in_flight > 0 || answer.departures != holding.departures;
    let all_here = answer.num_ack_pending == holding.ours && answer.delivered >= holding.highest && answer.pinned_here;
    if all_here && !settled_meanwhile {
        Decision::Lower
    } else {
        Decision::Keep
    }
}

#[cfg(test)]
mod tests {
    use super::{decide, Answer, Decision, Holding};

    const HOLDING: Holding = Holding { ours: 5, parked: 5, in_flight: 0, highest: 90, departures: 7 };
    const ANSWER: Answer = Answer { num_ack_pending: 5, delivered: 90, pinned_here: true, departures: 7 };

    #[test]
    fn the_barrier_falls_when_everything_the_consumer_counts_is_here() {
        assert_eq!(decide(HOLDING, ANSWER), Decision::Lower);
    }

    #[test]
    fn a_message_out_elsewhere_keeps_it_up() {
        assert_eq!(decide(HOLDING, Answer { num_ack_pending: 6, ..ANSWER }), Decision::Keep);
    }

    #[test]
    fn an_ack_applied_while_the_server_was_asked_does_not_balance_a_message_out_elsewhere() {
        // One of ours was acked (the server no longer counts it) and one
        // message is out elsewhere: 5 = 5 - 1 + 1.
        let answer = Answer { departures: 8, ..ANSWER };
        assert_eq!(decide(HOLDING, answer), Decision::Keep);
        // The same while the ack is sent but the lane has not recorded it.
        let in_flight = Holding { in_flight: 1, parked: 4, ..HOLDING };
        assert_eq!(decide(in_flight, ANSWER), Decision::Keep);
    }

    #[test]
    fn a_lagging_leader_or_a_pin_named_elsewhere_keeps_it_up() {
        assert_eq!(decide(HOLDING, Answer { delivered: 80, ..ANSWER }), Decision::Keep);
        assert_eq!(decide(HOLDING, Answer { pinned_here: false, ..ANSWER }), Decision::Keep);
    }

    #[test]
    fn a_surplus_among_parked_messages_goes_back_unless_the_leader_lags() {
        assert_eq!(decide(HOLDING, Answer { num_ack_pending: 4, ..ANSWER }), Decision::KeepAndHandBack);
        let lagging = Answer { num_ack_pending: 4, delivered: 80, ..ANSWER };
        assert_eq!(decide(HOLDING, lagging), Decision::Keep);
        // A surplus in flight ends with its deliveries.
        let in_flight = Holding { parked: 3, in_flight: 2, ..HOLDING };
        assert_eq!(decide(in_flight, Answer { num_ack_pending: 4, ..ANSWER }), Decision::Keep);
    }
}
