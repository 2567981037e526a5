//! Partition lanes: which message may go to the endpoint next. Pure state,
//! no I/O, so the ordering rules are tested exhaustively.
//!
//! Rules (docs/guarantees.md, "Per-key order"):
//! - one message in flight per partition; partitions are independent;
//! - a lane dispatches in stream-sequence order and never passes a lower
//!   sequence of its partition that is still outstanding (NAK'd and awaiting
//!   redelivery);
//! - while the handover barrier is up nothing is dispatched;
//! - a redelivery is answered without the endpoint only when this very
//!   sequence was settled here by a verdict (its ack or term was lost): the
//!   same settlement is sent again. Anything else goes to the endpoint
//!   (docs/guarantees.md, "Nothing acknowledged is lost").

use std::collections::{BTreeMap, VecDeque};
use std::time::SystemTime;

/// Why a partition's head is not moving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// Stream sequence of the head message.
    pub seq: u64,
    /// When it first failed.
    pub since: SystemTime,
    /// Attempts so far (the server's delivery count).
    pub attempts: u64,
    /// What the endpoint said last.
    pub last_error: String,
}

/// How a message left, as the endpoint (or an operator) decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// The endpoint acked it.
    Acked,
    /// Its dead-letter copy is stored and it was terminated.
    Terminated,
}

/// Settled sequences remembered per lane, to answer a redelivery whose ack
/// was lost. Older ones are forgotten: their redelivery is delivered again
/// (a duplicate with a higher attempt, never a loss).
const REMEMBERED_SETTLEMENTS: usize = 64;

#[derive(Debug)]
struct Lane<M> {
    /// Highest sequence settled in this lane (backlog estimates only: it is
    /// a maximum, not a set, and never decides what is acked).
    floor: u64,
    /// The sequences settled most recently, exactly, with how.
    settled: VecDeque<(u64, Settlement)>,
    held: BTreeMap<u64, M>,
    in_flight: Option<(u64, M)>,
    /// NAK'd messages, with their last copy (for skip and retry-now).
    awaiting: BTreeMap<u64, M>,
    blocked: Option<Blocked>,
}

impl<M> Default for Lane<M> {
    fn default() -> Self {
        Self {
            floor: 0,
            settled: VecDeque::new(),
            held: BTreeMap::new(),
            in_flight: None,
            awaiting: BTreeMap::new(),
            blocked: None,
        }
    }
}

impl<M> Lane<M> {
    fn is_empty(&self) -> bool {
        self.held.is_empty() && self.in_flight.is_none() && self.awaiting.is_empty() && self.blocked.is_none()
    }

    fn remember(&mut self, seq: u64, how: Settlement) {
        self.floor = self.floor.max(seq);
        if self.settled.len() == REMEMBERED_SETTLEMENTS {
            self.settled.pop_front();
        }
        self.settled.push_back((seq, how));
    }

    fn settlement_of(&self, seq: u64) -> Option<Settlement> {
        self.settled.iter().rev().find(|(s, _)| *s == seq).map(|(_, how)| *how)
    }

    /// The head, if it may go now.
    fn ready(&self) -> Option<u64> {
        if self.in_flight.is_some() {
            return None;
        }
        let (&head, _) = self.held.first_key_value()?;
        match self.awaiting.first_key_value() {
            Some((&outstanding, _)) if outstanding < head => None,
            _ => Some(head),
        }
    }
}

/// How a dispatched message was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Acked or terminated: it is gone.
    Done(Settlement),
    /// NAK'd: it will be redelivered, and nothing later in its partition may
    /// pass it until then.
    Naked { attempts: u64, error: String },
    /// The endpoint was not reached because this instance stopped serving;
    /// it is no longer ours.
    Abandoned,
}

/// Offer outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offered {
    /// A new message (or a NAK'd one come back).
    Held,
    /// A redelivery of a message already held or in flight: the newer copy
    /// replaces a held one; an in-flight one keeps going.
    Duplicate,
    /// A redelivery of a message this lane settled itself (its ack or term
    /// was lost): send the same settlement again, do not deliver it again.
    AlreadySettled(Settlement),
}

/// All lanes of one member instance.
#[derive(Debug)]
pub struct Lanes<M> {
    lanes: BTreeMap<u32, Lane<M>>,
    barrier: bool,
}

impl<M> Default for Lanes<M> {
    fn default() -> Self {
        Self { lanes: BTreeMap::new(), barrier: false }
    }
}

impl<M: Clone> Lanes<M> {
    /// Takes a delivered message into its partition's lane.
    pub fn offer(&mut self, partition: u32, seq: u64, message: M) -> Offered {
        let lane = self.lanes.entry(partition).or_default();
        if lane.in_flight.as_ref().is_some_and(|(s, _)| *s == seq) {
            return Offered::Duplicate;
        }
        if !lane.awaiting.contains_key(&seq) {
            if let Some(how) = lane.settlement_of(seq) {
                return Offered::AlreadySettled(how);
            }
        }
        let returning = lane.awaiting.remove(&seq).is_some();
        let replaced = lane.held.insert(seq, message).is_some();
        if replaced && !returning {
            Offered::Duplicate
        } else {
            Offered::Held
        }
    }

    /// Messages that may go to the endpoint now, marked in flight.
    pub fn dispatch(&mut self) -> Vec<(u32, u64, M)> {
        if self.barrier {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (&partition, lane) in &mut self.lanes {
            if let Some(seq) = lane.ready() {
                let message = lane.held.remove(&seq).expect("ready head is held");
                lane.in_flight = Some((seq, message.clone()));
                out.push((partition, seq, message));
            }
        }
        out
    }

    /// The next message of one partition, if it may go now (marked in flight).
    pub fn dispatch_partition(&mut self, partition: u32) -> Option<(u64, M)> {
        if self.barrier {
            return None;
        }
        let lane = self.lanes.get_mut(&partition)?;
        let seq = lane.ready()?;
        let message = lane.held.remove(&seq).expect("ready head is held");
        lane.in_flight = Some((seq, message.clone()));
        Some((seq, message))
    }

    /// Records how an in-flight message ended.
    pub fn settle(&mut self, partition: u32, seq: u64, settled: Settled) {
        let Some(lane) = self.lanes.get_mut(&partition) else { return };
        let message = match lane.in_flight.take() {
            Some((s, m)) if s == seq => Some(m),
            other => {
                lane.in_flight = other;
                None
            }
        };
        match settled {
            Settled::Done(how) => {
                lane.remember(seq, how);
                if lane.blocked.as_ref().is_some_and(|b| b.seq == seq) {
                    lane.blocked = None;
                }
            }
            Settled::Naked { attempts, error } => {
                if let Some(message) = message {
                    lane.awaiting.insert(seq, message);
                }
                let since = match &lane.blocked {
                    Some(b) if b.seq == seq => b.since,
                    _ => SystemTime::now(),
                };
                lane.blocked = Some(Blocked { seq, since, attempts, last_error: error });
            }
            Settled::Abandoned => {}
        }
    }

    /// Whether the partition's head is retrying.
    pub fn blocked(&self) -> BTreeMap<u32, Blocked> {
        self.lanes.iter().filter_map(|(p, lane)| lane.blocked.clone().map(|b| (*p, b))).collect()
    }

    /// Per partition, the highest sequence settled (every earlier message
    /// of the partition this instance saw is settled too).
    pub fn floors(&self) -> BTreeMap<u32, u64> {
        self.lanes.iter().filter(|(_, lane)| lane.floor > 0).map(|(p, lane)| (*p, lane.floor)).collect()
    }

    /// Holds or releases every lane (the handover barrier).
    pub fn set_barrier(&mut self, up: bool) {
        self.barrier = up;
    }

    /// Whether the handover barrier is up.
    pub fn barrier(&self) -> bool {
        self.barrier
    }

    /// Messages delivered to this instance and not yet settled: held plus in flight.
    pub fn holding(&self) -> usize {
        self.lanes.values().map(|l| l.held.len() + usize::from(l.in_flight.is_some())).sum()
    }

    /// NAK'd messages this instance waits for.
    pub fn awaiting(&self) -> usize {
        self.lanes.values().map(|l| l.awaiting.len()).sum()
    }

    /// Held messages in the fullest lane.
    pub fn deepest(&self) -> usize {
        self.lanes.values().map(|l| l.held.len()).max().unwrap_or(0)
    }

    /// Held (not in-flight) messages, for progress acks.
    pub fn held_messages(&self) -> impl Iterator<Item = &M> {
        self.lanes.values().flat_map(|l| l.held.values())
    }

    /// Forgets everything (the consumer was replaced): the held messages
    /// are returned so the caller can let them go.
    pub fn clear(&mut self) -> Vec<M> {
        let lanes = std::mem::take(&mut self.lanes);
        lanes.into_values().flat_map(|l| l.held.into_values()).collect()
    }

    /// The pin was lost: held and NAK'd messages now belong to the next
    /// holder, but messages in flight stay tracked (and kept alive) until
    /// their delivery ends, so the next holder's barrier waits for them.
    pub fn release_held(&mut self) -> Vec<M> {
        let mut released = Vec::new();
        for lane in self.lanes.values_mut() {
            released.extend(std::mem::take(&mut lane.held).into_values());
            lane.awaiting.clear();
            lane.blocked = None;
        }
        released
    }

    /// Partitions with anything held, in flight or awaited.
    pub fn partitions(&self) -> Vec<u32> {
        self.lanes.iter().filter(|(_, l)| !l.is_empty()).map(|(p, _)| *p).collect()
    }

    /// Messages in flight, for progress acks while the endpoint works.
    pub fn in_flight_messages(&self) -> impl Iterator<Item = &M> {
        self.lanes.values().filter_map(|l| l.in_flight.as_ref().map(|(_, m)| m))
    }

    /// The NAK'd head a blocked partition waits for, with its last copy.
    pub fn blocked_head(&self, partition: u32) -> Option<(u64, M)> {
        let lane = self.lanes.get(&partition)?;
        let seq = lane.blocked.as_ref()?.seq;
        lane.awaiting.get(&seq).map(|m| (seq, m.clone()))
    }

    /// The lowest NAK'd sequence each partition waits for.
    pub fn awaited_heads(&self) -> Vec<(u32, u64)> {
        self.lanes.iter().filter_map(|(p, l)| l.awaiting.keys().next().map(|s| (*p, *s))).collect()
    }

    /// Stops waiting for a blocked head: it was terminated by an operator
    /// (`Some`, remembered like any settlement), or the server answered that
    /// it no longer exists (`None`: if it ever came back it would be
    /// delivered). The partition proceeds with what follows.
    pub fn skip(&mut self, partition: u32, seq: u64, how: Option<Settlement>) {
        if let Some(lane) = self.lanes.get_mut(&partition) {
            lane.awaiting.remove(&seq);
            match how {
                Some(how) => lane.remember(seq, how),
                None => lane.floor = lane.floor.max(seq),
            }
            if lane.blocked.as_ref().is_some_and(|b| b.seq == seq) {
                lane.blocked = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naked() -> Settled {
        Settled::Naked { attempts: 1, error: "503".into() }
    }

    fn seqs(d: &[(u32, u64, u64)]) -> Vec<(u32, u64)> {
        d.iter().map(|(p, s, _)| (*p, *s)).collect()
    }

    #[test]
    fn one_in_flight_per_partition_and_partitions_are_independent() {
        let mut lanes = Lanes::default();
        for (p, s) in [(0, 1), (1, 2), (0, 3), (1, 4), (2, 5)] {
            lanes.offer(p, s, s);
        }
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1), (1, 2), (2, 5)]);
        assert!(lanes.dispatch().is_empty());
        lanes.settle(1, 2, Settled::Done(Settlement::Acked));
        assert_eq!(seqs(&lanes.dispatch()), vec![(1, 4)]);
        assert_eq!(lanes.holding(), 4);
    }

    #[test]
    fn a_naked_message_is_never_overtaken() {
        let mut lanes = Lanes::default();
        lanes.offer(0, 1, 1);
        lanes.offer(0, 2, 2);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1)]);
        lanes.settle(0, 1, naked());
        assert!(lanes.dispatch().is_empty(), "2 waits for 1 to come back");
        lanes.offer(0, 3, 3);
        assert!(lanes.dispatch().is_empty());
        assert_eq!(lanes.blocked()[&0].seq, 1);
        assert_eq!(lanes.offer(0, 1, 1), Offered::Held);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1)]);
        lanes.settle(0, 1, Settled::Done(Settlement::Acked));
        assert!(lanes.blocked().is_empty());
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 2)]);
    }

    #[test]
    fn older_messages_arriving_late_go_first() {
        let mut lanes = Lanes::default();
        lanes.set_barrier(true);
        lanes.offer(0, 7, 7);
        lanes.offer(0, 8, 8);
        assert!(lanes.dispatch().is_empty(), "the barrier holds everything");
        // A previous holder's un-acked message comes back.
        lanes.offer(0, 3, 3);
        lanes.set_barrier(false);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 3)]);
    }

    #[test]
    fn redeliveries_of_held_or_in_flight_messages_are_not_dispatched_twice() {
        let mut lanes = Lanes::default();
        lanes.offer(0, 1, 1);
        lanes.offer(0, 2, 2);
        lanes.dispatch();
        assert_eq!(lanes.offer(0, 1, 10), Offered::Duplicate);
        assert_eq!(lanes.offer(0, 2, 20), Offered::Duplicate);
        lanes.settle(0, 1, Settled::Done(Settlement::Acked));
        let next = lanes.dispatch();
        assert_eq!(next, vec![(0, 2, 20)], "the newer copy (new reply subject) is used");
    }

    #[test]
    fn settling_everything_empties_the_lanes() {
        let mut lanes = Lanes::default();
        lanes.offer(3, 1, 1);
        lanes.dispatch();
        lanes.settle(3, 1, Settled::Done(Settlement::Acked));
        assert_eq!(lanes.holding(), 0);
        assert!(lanes.partitions().is_empty());
        assert_eq!(
            lanes.offer(3, 1, 1),
            Offered::AlreadySettled(Settlement::Acked),
            "a lost ack's redelivery is not delivered again"
        );
        lanes.offer(3, 2, 2);
        assert_eq!(lanes.clear(), vec![2]);
    }

    #[test]
    fn a_message_lost_in_transit_is_delivered_when_it_comes_back_after_later_ones_settled() {
        // 2 and 3 went to a pull whose reply was lost with the NATS
        // connection; 4 arrived on a later pull and was settled first.
        let mut lanes = Lanes::default();
        lanes.offer(0, 1, 1);
        lanes.dispatch();
        lanes.settle(0, 1, Settled::Done(Settlement::Acked));
        lanes.offer(0, 4, 4);
        lanes.dispatch();
        lanes.settle(0, 4, Settled::Done(Settlement::Acked));
        assert_eq!(lanes.offer(0, 2, 2), Offered::Held, "never acked without reaching the endpoint");
        assert_eq!(lanes.offer(0, 3, 3), Offered::Held);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 2)]);
        assert_eq!(lanes.offer(0, 4, 4), Offered::AlreadySettled(Settlement::Acked), "4's lost ack is sent again");
    }

    #[test]
    fn only_recent_settlements_are_remembered_and_a_forgotten_one_is_delivered_again() {
        let mut lanes = Lanes::default();
        for seq in 1..=(REMEMBERED_SETTLEMENTS as u64 + 1) {
            lanes.offer(0, seq, seq);
            lanes.dispatch();
            lanes.settle(0, seq, Settled::Done(Settlement::Acked));
        }
        assert_eq!(lanes.offer(0, 1, 1), Offered::Held, "a duplicate delivery, never a loss");
        assert_eq!(lanes.offer(0, 2, 2), Offered::AlreadySettled(Settlement::Acked));
    }

    #[test]
    fn a_skipped_head_is_terminated_again_if_it_returns_but_a_vanished_one_is_delivered() {
        let mut lanes = Lanes::default();
        for seq in [1, 2] {
            lanes.offer(0, seq, seq);
        }
        lanes.dispatch();
        lanes.settle(0, 1, naked());
        lanes.skip(0, 1, Some(Settlement::Terminated));
        assert_eq!(lanes.offer(0, 1, 1), Offered::AlreadySettled(Settlement::Terminated));
        lanes.dispatch();
        lanes.settle(0, 2, naked());
        lanes.skip(0, 2, None);
        assert_eq!(lanes.offer(0, 2, 2), Offered::Held);
    }

    #[test]
    fn losing_the_pin_keeps_in_flight_messages_tracked() {
        let mut lanes = Lanes::default();
        lanes.offer(0, 1, 1);
        lanes.offer(0, 2, 2);
        lanes.offer(1, 3, 3);
        lanes.dispatch();
        lanes.settle(1, 3, naked());
        assert_eq!(lanes.release_held(), vec![2]);
        assert_eq!(lanes.in_flight_messages().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(lanes.holding(), 1);
        assert_eq!(lanes.awaiting(), 0);
        assert!(lanes.blocked().is_empty());
    }

    #[test]
    fn random_schedules_keep_per_partition_order() {
        use rand::{Rng, SeedableRng};
        for seed in 0..200u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut lanes: Lanes<u64> = Lanes::default();
            let mut next_seq = 1u64;
            let mut delivered: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
            let mut acked: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
            let mut in_flight: Vec<(u32, u64)> = Vec::new();
            let mut naked_out: Vec<(u32, u64)> = Vec::new();
            let mut lost: Vec<(u32, u64)> = Vec::new();
            // Only a message this lane settled may be answered without the endpoint.
            let offer = |lanes: &mut Lanes<u64>, p: u32, s: u64, acked: &BTreeMap<u32, Vec<u64>>| {
                if let Offered::AlreadySettled(_) = lanes.offer(p, s, s) {
                    assert!(acked.get(&p).is_some_and(|a| a.contains(&s)), "seed {seed}: {s} settled unseen");
                }
            };
            for _ in 0..400 {
                match rng.random_range(0..6) {
                    // The barrier falls only when nothing is missing (the
                    // session's check: the server's ack-pending count is ours).
                    4 => lanes.set_barrier(!lanes.barrier() || !lost.is_empty()),
                    5 if !naked_out.is_empty() => {
                        // An operator skips a blocked head: it never comes back.
                        let (p, s) = naked_out.remove(rng.random_range(0..naked_out.len()));
                        if lanes.blocked_head(p).is_some_and(|(head, _)| head == s) {
                            lanes.skip(p, s, Some(Settlement::Terminated));
                        } else {
                            naked_out.push((p, s));
                        }
                    }
                    0 => {
                        let p = rng.random_range(0..3);
                        if rng.random_bool(0.1) {
                            // Lost in transit: the next delivery shows the gap
                            // and the barrier goes up until it is redelivered.
                            lost.push((p, next_seq));
                        } else {
                            if !lost.is_empty() {
                                lanes.set_barrier(true);
                            }
                            offer(&mut lanes, p, next_seq, &acked);
                        }
                        next_seq += 1;
                    }
                    3 if !lost.is_empty() => {
                        // Redelivered at ack wait.
                        let (p, s) = lost.remove(0);
                        offer(&mut lanes, p, s, &acked);
                    }
                    1 if !in_flight.is_empty() => {
                        let (p, s) = in_flight.remove(rng.random_range(0..in_flight.len()));
                        if rng.random_bool(0.3) {
                            lanes.settle(p, s, naked());
                            naked_out.push((p, s));
                        } else {
                            lanes.settle(p, s, Settled::Done(Settlement::Acked));
                            acked.entry(p).or_default().push(s);
                        }
                    }
                    2 if !naked_out.is_empty() => {
                        let (p, s) = naked_out.remove(rng.random_range(0..naked_out.len()));
                        offer(&mut lanes, p, s, &acked);
                    }
                    _ => {
                        let barrier = lanes.barrier();
                        let dispatched = lanes.dispatch();
                        assert!(!barrier || dispatched.is_empty(), "nothing goes out while the barrier is up");
                        for (p, s, _) in dispatched {
                            delivered.entry(p).or_default().push(s);
                            in_flight.push((p, s));
                        }
                    }
                }
            }
            for (p, seqs) in &acked {
                let mut sorted = seqs.clone();
                sorted.sort_unstable();
                assert_eq!(seqs, &sorted, "seed {seed}: partition {p} acked out of order");
            }
            for (p, seqs) in &delivered {
                // A redelivery repeats its sequence; nothing later goes before it.
                for window in seqs.windows(2) {
                    assert!(window[1] >= window[0], "seed {seed}: partition {p} delivered {seqs:?}");
                }
            }
        }
    }
}
