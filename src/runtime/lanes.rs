//! Delivery lanes: which message may go to the endpoint next. Pure state,
//! no I/O, so the ordering rules are tested exhaustively.
//!
//! A lane is the unit of order: a whole partition (a group's `ordering`
//! is `partition`), or one key of a partition (`ordering` is `key`).
//! Rules (docs/guarantees.md, "Per-key order"):
//! - one message in flight per lane; lanes are independent, and at most
//!   `max_in_flight` messages are in flight across all of them. A batch
//!   ([`Lanes::dispatch_batch`]) may take a lane's next messages together,
//!   in order; when one of them fails, the later ones go back to the lane
//!   ([`Settled::Returned`]) and follow it;
//! - a lane dispatches in stream-sequence order and never passes a lower
//!   sequence of its own that is still outstanding (NAK'd and awaiting
//!   redelivery); ready lanes go oldest head first;
//! - while the handover barrier is up nothing is dispatched;
//! - a redelivery is answered without the endpoint only when this very
//!   sequence was settled here by a verdict (its ack or term was lost): the
//!   same settlement is sent again. Anything else goes to the endpoint
//!   (docs/guarantees.md, "Nothing acknowledged is lost");
//! - a lane exists only while it holds, delivers or awaits something, so
//!   memory follows what is outstanding, not how many keys were ever seen.
//!
//! A plain consumer's subscriber keeps no order: each message is its own
//! lane ([`LaneKey::Alone`]) and [`Lanes::unordered`] forgets a NAK'd
//! message (the server redelivers it when it will), so only
//! `max_in_flight` (the subscriber's `concurrency`) limits what goes.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::SystemTime;

/// What orders a message against others of its partition.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LaneKey {
    /// The whole partition: partition ordering, or a key ordering whose
    /// key cannot be found in the subject (the safe side).
    Partition,
    /// One key's messages (the partitioning tokens of the subject).
    Key(Arc<str>),
    /// A keyless message (its stream sequence): ordered with nothing.
    Alone(u64),
}

impl LaneKey {
    /// The key as users name it (`None` for a whole partition or a keyless message).
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Key(key) => Some(key),
            Self::Partition | Self::Alone(_) => None,
        }
    }
}

/// One lane: a partition, and within it a key (or the whole partition).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaneId {
    pub partition: u32,
    pub key: LaneKey,
}

impl LaneId {
    /// The lane of a whole partition.
    pub fn partition(partition: u32) -> Self {
        Self { partition, key: LaneKey::Partition }
    }
}

/// Why a lane's head is not moving.
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

/// Settled sequences remembered per partition, to answer a redelivery whose
/// ack was lost. Older ones are forgotten: their redelivery is delivered
/// again (a duplicate with a higher attempt, never a loss).
const REMEMBERED_SETTLEMENTS: usize = 64;

/// What a partition remembers of its settled messages.
#[derive(Debug, Default)]
struct Settlements {
    /// Highest sequence settled (backlog estimates only: a maximum, not a
    /// set, and it never decides what is acked).
    highest: u64,
    /// The sequences settled most recently, exactly, with how.
    recent: VecDeque<(u64, Settlement)>,
}

impl Settlements {
    fn remember(&mut self, seq: u64, how: Settlement) {
        self.highest = self.highest.max(seq);
        if self.recent.len() == REMEMBERED_SETTLEMENTS {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, how));
    }

    fn of(&self, seq: u64) -> Option<Settlement> {
        self.recent.iter().rev().find(|(s, _)| *s == seq).map(|(_, how)| *how)
    }
}

#[derive(Debug)]
struct Lane<M> {
    held: BTreeMap<u64, M>,
    /// One message, or a batch's run of the lane's next messages.
    in_flight: BTreeMap<u64, M>,
    /// NAK'd messages, with their last copy (for skip and retry-now).
    awaiting: BTreeMap<u64, M>,
    blocked: Option<Blocked>,
    /// The head under which this lane is listed as ready.
    listed: Option<u64>,
}

impl<M> Default for Lane<M> {
    fn default() -> Self {
        Self {
            held: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            awaiting: BTreeMap::new(),
            blocked: None,
            listed: None,
        }
    }
}

impl<M> Lane<M> {
    fn is_empty(&self) -> bool {
        self.held.is_empty() && self.in_flight.is_empty() && self.awaiting.is_empty() && self.blocked.is_none()
    }

    /// The head, if it may go now.
    fn ready(&self) -> Option<u64> {
        if !self.in_flight.is_empty() {
            return None;
        }
        let (&head, _) = self.held.first_key_value()?;
        match self.awaiting.first_key_value() {
            Some((&outstanding, _)) if outstanding < head => None,
            _ => Some(head),
        }
    }

    /// The lowest sequence this lane holds, delivers or awaits.
    fn lowest(&self) -> Option<u64> {
        [self.held.keys().next(), self.in_flight.keys().next(), self.awaiting.keys().next()]
            .into_iter()
            .flatten()
            .min()
            .copied()
    }
}

/// How a dispatched message was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Acked or terminated: it is gone.
    Done(Settlement),
    /// NAK'd: it will be redelivered, and nothing later in its lane may
    /// pass it until then.
    Naked { attempts: u64, error: String },
    /// Not settled: an earlier message of its lane in the same batch was
    /// retried or dead-lettered, so it goes back to the lane and follows
    /// that one (nothing is sent to the server).
    Returned,
}

/// Offer outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offered {
    /// A new message (or a NAK'd one come back).
    Held,
    /// A redelivery of a message already held or in flight: the newer copy
    /// replaces a held one; an in-flight one keeps going.
    Duplicate,
    /// A redelivery of a message this instance settled itself (its ack or
    /// term was lost): send the same settlement again, do not deliver it again.
    AlreadySettled(Settlement),
}

/// A message handed out for delivery, now in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched<M> {
    pub lane: LaneId,
    pub seq: u64,
    pub message: M,
}

/// All lanes of one member instance.
#[derive(Debug)]
pub struct Lanes<M> {
    lanes: HashMap<LaneId, Lane<M>>,
    settlements: BTreeMap<u32, Settlements>,
    /// Lanes whose head may go, oldest head first.
    ready: BTreeSet<(u64, LaneId)>,
    in_flight: usize,
    /// Messages held (received, not yet dispatched) across all lanes.
    held: usize,
    max_in_flight: usize,
    barrier: bool,
    /// NAK'd messages block their lane (ordered) or are forgotten (unordered).
    ordered: bool,
    /// How many messages ever left what this instance holds, delivers or
    /// awaits (settled, forgotten, handed back).
    departures: u64,
    /// Messages in flight when the pin was lost (`let_go`): tracked until
    /// their delivery ends, then they leave whatever the verdict, since
    /// the next holder has them (even if the pin has come back since).
    let_go: BTreeSet<u64>,
}

impl<M> Default for Lanes<M> {
    fn default() -> Self {
        Self::new(usize::MAX)
    }
}

impl<M> Lanes<M> {
    /// Lanes that deliver at most `max_in_flight` messages at once.
    pub fn new(max_in_flight: usize) -> Self {
        Self {
            lanes: HashMap::new(),
            settlements: BTreeMap::new(),
            ready: BTreeSet::new(),
            in_flight: 0,
            held: 0,
            max_in_flight: max_in_flight.max(1),
            barrier: false,
            ordered: true,
            departures: 0,
            let_go: BTreeSet::new(),
        }
    }

    /// Lanes of a subscriber that keeps no order: a NAK'd message neither
    /// blocks nor is awaited.
    pub fn unordered(max_in_flight: usize) -> Self {
        Self { ordered: false, ..Self::new(max_in_flight) }
    }
}

impl<M: Clone> Lanes<M> {
    /// Takes a delivered message into its lane.
    pub fn offer(&mut self, id: LaneId, seq: u64, message: M) -> Offered {
        let lane = self.lanes.entry(id.clone()).or_default();
        if lane.in_flight.contains_key(&seq) {
            return Offered::Duplicate;
        }
        if !lane.awaiting.contains_key(&seq) {
            if let Some(how) = self.settlements.get(&id.partition).and_then(|s| s.of(seq)) {
                if lane.is_empty() {
                    self.lanes.remove(&id);
                }
                return Offered::AlreadySettled(how);
            }
        }
        let returning = lane.awaiting.remove(&seq).is_some();
        let replaced = lane.held.insert(seq, message).is_some();
        if !replaced {
            self.held += 1;
        }
        self.refresh(&id);
        if replaced && !returning {
            Offered::Duplicate
        } else {
            Offered::Held
        }
    }

    /// Messages that may go to the endpoint now, marked in flight.
    pub fn dispatch(&mut self) -> Vec<Dispatched<M>> {
        std::iter::from_fn(|| self.dispatch_one()).collect()
    }

    /// The oldest head that may go now, marked in flight.
    pub fn dispatch_one(&mut self) -> Option<Dispatched<M>> {
        if self.barrier || self.in_flight >= self.max_in_flight {
            return None;
        }
        let (seq, id) = self.ready.pop_first()?;
        let lane = self.lanes.get_mut(&id).expect("a listed lane exists");
        lane.listed = None;
        let message = lane.held.remove(&seq).expect("a listed head is held");
        self.held -= 1;
        lane.in_flight.insert(seq, message.clone());
        self.in_flight += 1;
        Some(Dispatched { lane: id, seq, message })
    }

    /// Messages for a batch that holds `filled` bytes so far: the oldest
    /// ready heads first, each with its lane's next held messages in order
    /// (never past a NAK'd one it awaits), up to `max_messages` more and
    /// `max_bytes` in all (`size` of each; the first message of an empty
    /// batch goes even when it alone is larger) and within `max_in_flight`.
    /// All are marked in flight.
    pub fn dispatch_batch(
        &mut self,
        max_messages: usize,
        max_bytes: usize,
        filled: usize,
        size: impl Fn(&M) -> usize,
    ) -> Vec<Dispatched<M>> {
        let mut batch: Vec<Dispatched<M>> = Vec::new();
        let mut bytes = filled;
        let max_in_flight = self.max_in_flight;
        let fits = |batch: &Vec<Dispatched<M>>, bytes: usize, in_flight: usize, message: &M| {
            batch.len() < max_messages
                && in_flight < max_in_flight
                && ((batch.is_empty() && filled == 0) || bytes + size(message) <= max_bytes)
        };
        while !self.barrier {
            let Some((head, id)) = self.ready.first().cloned() else { break };
            let lane = self.lanes.get_mut(&id).expect("a listed lane exists");
            if !fits(&batch, bytes, self.in_flight, &lane.held[&head]) {
                break;
            }
            self.ready.pop_first();
            lane.listed = None;
            let awaited = lane.awaiting.keys().next().copied().unwrap_or(u64::MAX);
            while let Some(entry) = lane.held.first_entry() {
                if *entry.key() > awaited || !fits(&batch, bytes, self.in_flight, entry.get()) {
                    break;
                }
                let (seq, message) = entry.remove_entry();
                bytes += size(&message);
                self.held -= 1;
                self.in_flight += 1;
                lane.in_flight.insert(seq, message.clone());
                batch.push(Dispatched { lane: id.clone(), seq, message });
            }
            self.refresh(&id);
        }
        batch
    }

    /// Records how an in-flight message ended. Returns a message to give
    /// back to the server (NAK): one returned unsettled after the pin was
    /// lost, which the next holder must have.
    pub fn settle(&mut self, id: &LaneId, seq: u64, settled: Settled) -> Option<M> {
        let lane = self.lanes.get_mut(id)?;
        let message = lane.in_flight.remove(&seq);
        let let_go = self.let_go.remove(&seq);
        if message.is_some() {
            self.in_flight -= 1;
            // A NAK'd message stays awaited (ordered lanes), a returned one
            // held, unless the pin was lost meanwhile.
            let stays = !let_go
                && match settled {
                    Settled::Naked { .. } => self.ordered,
                    Settled::Returned => true,
                    Settled::Done(_) => false,
                };
            if !stays {
                self.departures += 1;
            }
        }
        let mut give_back = None;
        match settled {
            Settled::Done(how) => {
                self.settlements.entry(id.partition).or_default().remember(seq, how);
                if lane.blocked.as_ref().is_some_and(|b| b.seq == seq) {
                    lane.blocked = None;
                }
            }
            // Awaited after the pin was lost, it would be counted by the
            // handover barrier when the pin comes back, though the holder
            // in between may have settled it: the barrier would then fall
            // while a message is still out elsewhere.
            Settled::Naked { .. } if !self.ordered || let_go => {}
            Settled::Returned if let_go => give_back = message,
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
            Settled::Returned => {
                if let Some(message) = message {
                    lane.held.insert(seq, message);
                    self.held += 1;
                }
            }
        }
        self.refresh(id);
        give_back
    }

    /// Lists or unlists a lane as ready, and forgets it once empty.
    fn refresh(&mut self, id: &LaneId) {
        let Some(lane) = self.lanes.get_mut(id) else { return };
        let ready = lane.ready();
        if lane.listed != ready {
            if let Some(old) = lane.listed.take() {
                self.ready.remove(&(old, id.clone()));
            }
            if let Some(head) = ready {
                self.ready.insert((head, id.clone()));
            }
            lane.listed = ready;
        }
        if lane.is_empty() {
            self.lanes.remove(id);
        }
    }

    /// Lanes whose head is retrying, in lane order.
    pub fn blocked(&self) -> Vec<(LaneId, Blocked)> {
        let mut blocked: Vec<(LaneId, Blocked)> =
            self.lanes.iter().filter_map(|(id, lane)| Some((id.clone(), lane.blocked.clone()?))).collect();
        blocked.sort_by(|a, b| a.0.cmp(&b.0));
        blocked
    }

    /// Why one lane is blocked, if it is.
    pub fn blocked_lane(&self, id: &LaneId) -> Option<&Blocked> {
        self.lanes.get(id)?.blocked.as_ref()
    }

    /// Per partition, the highest sequence below which every message of the
    /// partition this instance saw is settled.
    pub fn floors(&self) -> BTreeMap<u32, u64> {
        let mut lowest: BTreeMap<u32, u64> = BTreeMap::new();
        for (id, lane) in &self.lanes {
            if let Some(seq) = lane.lowest() {
                let entry = lowest.entry(id.partition).or_insert(seq);
                *entry = (*entry).min(seq);
            }
        }
        self.settlements
            .iter()
            .map(|(p, s)| (*p, lowest.get(p).map_or(s.highest, |l| s.highest.min(l - 1))))
            .filter(|(_, floor)| *floor > 0)
            .collect()
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
        self.held + self.in_flight
    }

    /// How many messages ever left what this instance holds, delivers or
    /// awaits: the handover barrier does not trust a count during which
    /// this moved (`runtime/barrier.rs`).
    pub fn departures(&self) -> u64 {
        self.departures
    }

    /// Messages held and not in flight.
    pub fn held_count(&self) -> usize {
        self.held
    }

    /// NAK'd messages this instance waits for.
    pub fn awaiting(&self) -> usize {
        self.lanes.values().map(|l| l.awaiting.len()).sum()
    }

    /// The newest stream sequence held, in flight or awaited (0: none).
    pub fn highest(&self) -> u64 {
        self.lanes
            .values()
            .filter_map(|l| {
                [l.held.keys().next_back(), l.in_flight.keys().next_back(), l.awaiting.keys().next_back()]
                    .into_iter()
                    .flatten()
                    .max()
                    .copied()
            })
            .max()
            .unwrap_or(0)
    }

    /// Most messages in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// Messages in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Lanes that exist now (each holds, delivers or awaits something).
    pub fn lane_count(&self) -> usize {
        self.lanes.len()
    }

    /// Held messages in the fullest lane.
    pub fn deepest(&self) -> usize {
        self.lanes.values().map(|l| l.held.len()).max().unwrap_or(0)
    }

    /// Held (not in-flight) messages, for progress acks.
    pub fn held_messages(&self) -> impl Iterator<Item = &M> {
        self.lanes.values().flat_map(|l| l.held.values())
    }

    /// The pin was lost: held and NAK'd messages now belong to the next
    /// holder, but messages in flight stay tracked (and kept alive) until
    /// their delivery ends, so the next holder's barrier waits for them.
    pub fn release_held(&mut self) -> Vec<M> {
        let mut released = Vec::new();
        for lane in self.lanes.values_mut() {
            released.extend(std::mem::take(&mut lane.held).into_values());
            self.departures += lane.awaiting.len() as u64;
            lane.awaiting.clear();
            lane.blocked = None;
            lane.listed = None;
        }
        self.held = 0;
        self.departures += released.len() as u64;
        self.ready.clear();
        self.lanes.retain(|_, lane| !lane.is_empty());
        released
    }

    /// The pin was lost: what is held goes back (`release_held`), and
    /// what is in flight leaves when its delivery ends, whatever the
    /// verdict. (A holder handing back what its barrier found surplus
    /// keeps awaiting what it NAKs.)
    pub fn let_go(&mut self) -> Vec<M> {
        let in_flight: Vec<u64> = self.lanes.values().flat_map(|l| l.in_flight.keys().copied()).collect();
        self.let_go.extend(in_flight);
        self.release_held()
    }

    /// The copy of `seq` in flight in lane `id`, if it is.
    pub fn in_flight_copy(&self, id: &LaneId, seq: u64) -> Option<&M> {
        self.lanes.get(id)?.in_flight.get(&seq)
    }

    /// Messages in flight, for progress acks while the endpoint works.
    pub fn in_flight_messages(&self) -> impl Iterator<Item = &M> {
        self.lanes.values().flat_map(|l| l.in_flight.values())
    }

    /// The NAK'd head a blocked lane waits for, with its last copy.
    pub fn blocked_head(&self, id: &LaneId) -> Option<(u64, M)> {
        let lane = self.lanes.get(id)?;
        let seq = lane.blocked.as_ref()?.seq;
        lane.awaiting.get(&seq).map(|m| (seq, m.clone()))
    }

    /// The lowest NAK'd sequence each lane waits for.
    pub fn awaited_heads(&self) -> Vec<(LaneId, u64)> {
        self.lanes.iter().filter_map(|(id, l)| l.awaiting.keys().next().map(|s| (id.clone(), *s))).collect()
    }

    /// Stops waiting for a blocked head: it was terminated by an operator
    /// (`Some`, remembered like any settlement), or the server answered that
    /// it no longer exists (`None`: if it ever came back it would be
    /// delivered). The lane proceeds with what follows.
    pub fn skip(&mut self, id: &LaneId, seq: u64, how: Option<Settlement>) {
        let Some(lane) = self.lanes.get_mut(id) else { return };
        if lane.awaiting.remove(&seq).is_some() {
            self.departures += 1;
        }
        if lane.blocked.as_ref().is_some_and(|b| b.seq == seq) {
            lane.blocked = None;
        }
        let settlements = self.settlements.entry(id.partition).or_default();
        match how {
            Some(how) => settlements.remember(seq, how),
            None => settlements.highest = settlements.highest.max(seq),
        }
        self.refresh(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naked() -> Settled {
        Settled::Naked { attempts: 1, error: "503".into() }
    }

    fn p(partition: u32) -> LaneId {
        LaneId::partition(partition)
    }

    fn k(partition: u32, key: &str) -> LaneId {
        LaneId { partition, key: LaneKey::Key(key.into()) }
    }

    fn seqs(d: &[Dispatched<u64>]) -> Vec<(u32, u64)> {
        d.iter().map(|d| (d.lane.partition, d.seq)).collect()
    }

    fn ack(lanes: &mut Lanes<u64>, id: &LaneId, seq: u64) {
        lanes.settle(id, seq, Settled::Done(Settlement::Acked));
    }

    #[test]
    fn one_in_flight_per_partition_and_partitions_are_independent() {
        let mut lanes = Lanes::default();
        for (partition, s) in [(0, 1), (1, 2), (0, 3), (1, 4), (2, 5)] {
            lanes.offer(p(partition), s, s);
        }
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1), (1, 2), (2, 5)]);
        assert!(lanes.dispatch().is_empty());
        ack(&mut lanes, &p(1), 2);
        assert_eq!(seqs(&lanes.dispatch()), vec![(1, 4)]);
        assert_eq!(lanes.holding(), 4);
    }

    #[test]
    fn a_batch_takes_each_lanes_next_messages_in_order_within_its_limits() {
        let mut lanes = Lanes::new(5);
        for (key, s) in [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("a", 5), ("b", 6)] {
            lanes.offer(k(0, key), s, s);
        }
        let batch = lanes.dispatch_batch(100, usize::MAX, 0, |_| 1);
        let got: Vec<(LaneId, u64)> = batch.iter().map(|d| (d.lane.clone(), d.seq)).collect();
        assert_eq!(
            got,
            vec![(k(0, "a"), 1), (k(0, "a"), 3), (k(0, "a"), 5), (k(0, "b"), 2), (k(0, "b"), 6)],
            "the oldest head's lane first, its run in order; max_in_flight 5 stops before c"
        );
        assert_eq!(lanes.in_flight(), 5);
        assert!(lanes.dispatch_batch(100, usize::MAX, 0, |_| 1).is_empty());
        ack(&mut lanes, &k(0, "b"), 2);
        ack(&mut lanes, &k(0, "b"), 6);
        assert_eq!(seqs(&lanes.dispatch_batch(100, usize::MAX, 0, |_| 1)), vec![(0, 4)]);
        let mut sized = Lanes::default();
        for s in 1..=4 {
            sized.offer(p(0), s, s);
        }
        assert_eq!(seqs(&sized.dispatch_batch(3, usize::MAX, 0, |_| 1)), vec![(0, 1), (0, 2), (0, 3)], "max_messages");
        let mut sized = Lanes::default();
        for s in 1..=4 {
            sized.offer(p(0), s, s);
        }
        let by_bytes = sized.dispatch_batch(100, 250, 0, |_| 100);
        assert_eq!(seqs(&by_bytes), vec![(0, 1), (0, 2)], "max_bytes");
        let mut big = Lanes::default();
        big.offer(p(0), 1, 1);
        assert_eq!(
            seqs(&big.dispatch_batch(100, 10, 0, |_| 100)),
            vec![(0, 1)],
            "one message larger than max_bytes goes alone"
        );
    }

    #[test]
    fn a_batch_never_passes_an_awaited_message_and_returned_ones_follow_the_failed_one() {
        let mut lanes = Lanes::default();
        for s in 1..=4 {
            lanes.offer(k(0, "a"), s, s);
        }
        let batch = lanes.dispatch_batch(100, usize::MAX, 0, |_| 1);
        assert_eq!(seqs(&batch), vec![(0, 1), (0, 2), (0, 3), (0, 4)]);
        ack(&mut lanes, &k(0, "a"), 1);
        lanes.settle(&k(0, "a"), 2, naked());
        lanes.settle(&k(0, "a"), 3, Settled::Returned);
        lanes.settle(&k(0, "a"), 4, Settled::Returned);
        assert_eq!(lanes.in_flight(), 0);
        assert_eq!(lanes.holding(), 2, "3 and 4 are held again");
        assert!(lanes.dispatch_batch(100, usize::MAX, 0, |_| 1).is_empty(), "3 and 4 wait for 2");
        assert_eq!(lanes.offer(k(0, "a"), 2, 2), Offered::Held);
        assert_eq!(seqs(&lanes.dispatch_batch(100, usize::MAX, 0, |_| 1)), vec![(0, 2), (0, 3), (0, 4)]);
        // A redelivery of a NAK'd message earlier in the lane than held ones: the
        // batch stops before anything past a message still awaited.
        let mut lanes = Lanes::default();
        lanes.offer(k(0, "a"), 5, 5);
        assert_eq!(seqs(&lanes.dispatch_batch(100, usize::MAX, 0, |_| 1)), vec![(0, 5)]);
        lanes.settle(&k(0, "a"), 5, naked());
        lanes.offer(k(0, "a"), 2, 2);
        lanes.offer(k(0, "a"), 7, 7);
        assert_eq!(
            seqs(&lanes.dispatch_batch(100, usize::MAX, 0, |_| 1)),
            vec![(0, 2)],
            "7 stays behind the awaited 5"
        );
    }

    #[test]
    fn a_naked_message_is_never_overtaken() {
        let mut lanes = Lanes::default();
        lanes.offer(p(0), 1, 1);
        lanes.offer(p(0), 2, 2);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1)]);
        lanes.settle(&p(0), 1, naked());
        assert!(lanes.dispatch().is_empty(), "2 waits for 1 to come back");
        lanes.offer(p(0), 3, 3);
        assert!(lanes.dispatch().is_empty());
        assert_eq!(lanes.blocked()[0].1.seq, 1);
        assert_eq!(lanes.offer(p(0), 1, 1), Offered::Held);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1)]);
        ack(&mut lanes, &p(0), 1);
        assert!(lanes.blocked().is_empty());
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 2)]);
    }

    #[test]
    fn a_blocked_key_holds_only_its_own_messages_and_other_keys_of_the_partition_overtake_it() {
        let mut lanes = Lanes::default();
        lanes.offer(k(0, "a"), 1, 1);
        lanes.offer(k(0, "b"), 2, 2);
        lanes.offer(k(0, "a"), 3, 3);
        lanes.offer(k(0, "b"), 4, 4);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1), (0, 2)], "one in flight per key, both keys at once");
        lanes.settle(&k(0, "a"), 1, naked());
        ack(&mut lanes, &k(0, "b"), 2);
        let next = lanes.dispatch();
        assert_eq!(next.iter().map(|d| d.seq).collect::<Vec<_>>(), vec![4], "b overtakes a's NAK'd 1; a's 3 waits");
        assert_eq!(lanes.blocked().iter().map(|(id, b)| (id.clone(), b.seq)).collect::<Vec<_>>(), vec![(k(0, "a"), 1)]);
        assert_eq!(lanes.offer(k(0, "a"), 1, 1), Offered::Held);
        assert_eq!(lanes.dispatch().iter().map(|d| d.seq).collect::<Vec<_>>(), vec![1]);
        ack(&mut lanes, &k(0, "a"), 1);
        assert_eq!(lanes.dispatch().iter().map(|d| d.seq).collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn unordered_lanes_send_up_to_max_in_flight_oldest_first_and_forget_a_naked_message() {
        let alone = |seq: u64| LaneId { partition: 0, key: LaneKey::Alone(seq) };
        let mut lanes = Lanes::unordered(2);
        for s in 1..=4 {
            lanes.offer(alone(s), s, s);
        }
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1), (0, 2)]);
        lanes.settle(&alone(1), 1, naked());
        assert!(lanes.blocked().is_empty(), "a subscriber's NAK blocks nothing");
        assert_eq!(lanes.awaiting(), 0, "nor is it awaited: the server redelivers it");
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 3)]);
        assert_eq!(lanes.offer(alone(1), 1, 1), Offered::Held, "its redelivery is delivered again");
        ack(&mut lanes, &alone(2), 2);
        ack(&mut lanes, &alone(3), 3);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 1), (0, 4)]);
        assert_eq!(lanes.offer(alone(3), 3, 3), Offered::AlreadySettled(Settlement::Acked), "a lost ack is sent again");
    }

    #[test]
    fn keyless_messages_are_ordered_with_nothing() {
        let mut lanes = Lanes::default();
        for seq in 1..=3 {
            lanes.offer(LaneId { partition: 0, key: LaneKey::Alone(seq) }, seq, seq);
        }
        assert_eq!(lanes.dispatch().len(), 3);
    }

    #[test]
    fn no_more_than_max_in_flight_go_at_once_and_the_oldest_head_goes_first() {
        let mut lanes = Lanes::new(2);
        for (key, seq) in [("c", 5), ("a", 7), ("b", 6), ("d", 8)] {
            lanes.offer(k(0, key), seq, seq);
        }
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 5), (0, 6)]);
        assert_eq!(lanes.dispatch_one(), None);
        ack(&mut lanes, &k(0, "b"), 6);
        assert_eq!(lanes.dispatch_one().map(|d| d.seq), Some(7));
        assert_eq!(lanes.in_flight(), 2);
    }

    #[test]
    fn lanes_are_forgotten_once_settled_so_a_million_keys_cost_nothing_after_they_drain() {
        let mut lanes = Lanes::new(64);
        for seq in 1..=20_000u64 {
            lanes.offer(k((seq % 16) as u32, &format!("key-{seq}")), seq, seq);
            for d in lanes.dispatch() {
                ack(&mut lanes, &d.lane, d.seq);
            }
        }
        assert_eq!(lanes.lane_count(), 0);
        assert_eq!(lanes.holding(), 0);
        assert!(lanes.ready.is_empty());
    }

    #[test]
    fn older_messages_arriving_late_go_first() {
        let mut lanes = Lanes::default();
        lanes.set_barrier(true);
        lanes.offer(p(0), 7, 7);
        lanes.offer(p(0), 8, 8);
        assert!(lanes.dispatch().is_empty(), "the barrier holds everything");
        // A previous holder's un-acked message comes back.
        lanes.offer(p(0), 3, 3);
        lanes.set_barrier(false);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 3)]);
    }

    #[test]
    fn redeliveries_of_held_or_in_flight_messages_are_not_dispatched_twice() {
        let mut lanes = Lanes::default();
        lanes.offer(p(0), 1, 1);
        lanes.offer(p(0), 2, 2);
        lanes.dispatch();
        assert_eq!(lanes.offer(p(0), 1, 10), Offered::Duplicate);
        assert_eq!(lanes.offer(p(0), 2, 20), Offered::Duplicate);
        ack(&mut lanes, &p(0), 1);
        let next = lanes.dispatch();
        assert_eq!(
            next,
            vec![Dispatched { lane: p(0), seq: 2, message: 20 }],
            "the newer copy (new reply subject) is used"
        );
    }

    #[test]
    fn settling_everything_empties_the_lanes() {
        let mut lanes = Lanes::default();
        lanes.offer(p(3), 1, 1);
        lanes.dispatch();
        ack(&mut lanes, &p(3), 1);
        assert_eq!(lanes.holding(), 0);
        assert_eq!(lanes.lane_count(), 0);
        assert_eq!(
            lanes.offer(p(3), 1, 1),
            Offered::AlreadySettled(Settlement::Acked),
            "a lost ack's redelivery is not delivered again"
        );
        assert_eq!(lanes.lane_count(), 0);
    }

    #[test]
    fn a_message_lost_in_transit_is_delivered_when_it_comes_back_after_later_ones_settled() {
        // 2 and 3 went to a pull whose reply was lost with the NATS
        // connection; 4 arrived on a later pull and was settled first.
        let mut lanes = Lanes::default();
        lanes.offer(p(0), 1, 1);
        lanes.dispatch();
        ack(&mut lanes, &p(0), 1);
        lanes.offer(p(0), 4, 4);
        lanes.dispatch();
        ack(&mut lanes, &p(0), 4);
        assert_eq!(lanes.offer(p(0), 2, 2), Offered::Held, "never acked without reaching the endpoint");
        assert_eq!(lanes.offer(p(0), 3, 3), Offered::Held);
        assert_eq!(seqs(&lanes.dispatch()), vec![(0, 2)]);
        assert_eq!(lanes.offer(p(0), 4, 4), Offered::AlreadySettled(Settlement::Acked), "4's lost ack is sent again");
    }

    #[test]
    fn only_recent_settlements_are_remembered_and_a_forgotten_one_is_delivered_again() {
        let mut lanes = Lanes::default();
        for seq in 1..=(REMEMBERED_SETTLEMENTS as u64 + 1) {
            lanes.offer(p(0), seq, seq);
            lanes.dispatch();
            ack(&mut lanes, &p(0), seq);
        }
        assert_eq!(lanes.offer(p(0), 1, 1), Offered::Held, "a duplicate delivery, never a loss");
        assert_eq!(lanes.offer(p(0), 2, 2), Offered::AlreadySettled(Settlement::Acked));
    }

    #[test]
    fn a_skipped_head_is_terminated_again_if_it_returns_but_a_vanished_one_is_delivered() {
        let mut lanes = Lanes::default();
        for seq in [1, 2] {
            lanes.offer(p(0), seq, seq);
        }
        lanes.dispatch();
        lanes.settle(&p(0), 1, naked());
        lanes.skip(&p(0), 1, Some(Settlement::Terminated));
        assert_eq!(lanes.offer(p(0), 1, 1), Offered::AlreadySettled(Settlement::Terminated));
        lanes.dispatch();
        lanes.settle(&p(0), 2, naked());
        lanes.skip(&p(0), 2, None);
        assert_eq!(lanes.offer(p(0), 2, 2), Offered::Held);
    }

    #[test]
    fn departures_count_what_leaves_the_holding_and_nothing_that_stays() {
        let mut lanes = Lanes::default();
        for seq in 1..=6 {
            lanes.offer(k(0, &format!("k{seq}")), seq, seq);
        }
        lanes.dispatch();
        let ours = |l: &Lanes<u64>| l.holding() + l.awaiting();
        assert_eq!((ours(&lanes), lanes.departures()), (6, 0));
        lanes.settle(&k(0, "k2"), 2, naked());
        lanes.settle(&k(0, "k3"), 3, Settled::Returned);
        assert_eq!((ours(&lanes), lanes.departures()), (6, 0), "awaited and held again: still ours");
        ack(&mut lanes, &k(0, "k1"), 1);
        lanes.settle(&k(0, "k4"), 4, Settled::Done(Settlement::Terminated));
        lanes.skip(&k(0, "k2"), 2, None);
        assert_eq!((ours(&lanes), lanes.departures()), (3, 3));
        lanes.offer(k(0, "k7"), 7, 7);
        lanes.settle(&k(0, "k5"), 5, naked());
        assert_eq!(lanes.release_held().len(), 2, "k3 and k7");
        assert_eq!((ours(&lanes), lanes.departures()), (1, 6), "k6 in flight");
        let mut unordered = Lanes::unordered(10);
        unordered.offer(LaneId { partition: 0, key: LaneKey::Alone(1) }, 1, 1);
        unordered.dispatch();
        unordered.settle(&LaneId { partition: 0, key: LaneKey::Alone(1) }, 1, naked());
        assert_eq!(unordered.departures(), 1, "a NAK'd message of unordered lanes is not awaited");
    }

    #[test]
    fn losing_the_pin_keeps_in_flight_messages_tracked() {
        let mut lanes = Lanes::default();
        lanes.offer(p(0), 1, 1);
        lanes.offer(p(0), 2, 2);
        lanes.offer(p(1), 3, 3);
        lanes.dispatch();
        lanes.settle(&p(1), 3, naked());
        assert_eq!(lanes.release_held(), vec![2]);
        assert_eq!(lanes.in_flight_messages().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(lanes.holding(), 1);
        assert_eq!(lanes.awaiting(), 0);
        assert!(lanes.blocked().is_empty());
        assert!(lanes.dispatch().is_empty());
    }

    #[test]
    fn after_the_pin_is_lost_in_flight_messages_leave_whatever_their_verdict() {
        let mut lanes = Lanes::default();
        for seq in 1..=3 {
            lanes.offer(k(0, &seq.to_string()), seq, seq);
        }
        lanes.dispatch();
        lanes.let_go();
        let departed = lanes.departures();
        // A NAK'd one is not awaited: the holder may settle it meanwhile,
        // and counted here it would lower a later barrier too early.
        assert_eq!(lanes.settle(&k(0, "1"), 1, naked()), None);
        assert_eq!(lanes.awaiting(), 0);
        assert!(lanes.blocked().is_empty());
        // A returned one (a batch's) goes back to the server.
        assert_eq!(lanes.settle(&k(0, "2"), 2, Settled::Returned), Some(2));
        assert_eq!(lanes.settle(&k(0, "3"), 3, Settled::Done(Settlement::Acked)), None);
        assert_eq!(lanes.holding(), 0);
        assert_eq!(lanes.departures(), departed + 3);
        // What is dispatched after (the pin came back) is awaited as before.
        lanes.offer(k(0, "5"), 5, 5);
        lanes.dispatch();
        lanes.release_held();
        lanes.settle(&k(0, "5"), 5, naked());
        assert_eq!(lanes.awaiting(), 1, "a barrier's hand-back is no lost pin");
        lanes.offer(k(0, "4"), 4, 4);
        lanes.dispatch();
        lanes.settle(&k(0, "4"), 4, naked());
        assert_eq!(lanes.awaiting(), 2);
        // One in flight when the pin was lost and still out when it came
        // back leaves all the same; one sent since is awaited.
        lanes.offer(k(1, "6"), 6, 6);
        lanes.dispatch();
        lanes.let_go();
        lanes.offer(k(1, "7"), 7, 7);
        lanes.dispatch();
        lanes.settle(&k(1, "6"), 6, naked());
        lanes.settle(&k(1, "7"), 7, naked());
        assert_eq!(lanes.awaiting(), 1);
    }

    #[test]
    fn the_highest_sequence_counts_held_in_flight_and_awaited_messages() {
        let mut lanes = Lanes::default();
        assert_eq!(lanes.highest(), 0);
        lanes.offer(k(0, "a"), 5, 5);
        lanes.offer(k(1, "b"), 9, 9);
        lanes.offer(k(1, "b"), 12, 12);
        assert_eq!(lanes.highest(), 12);
        for d in lanes.dispatch() {
            lanes.settle(&d.lane, d.seq, naked());
        }
        assert_eq!(lanes.highest(), 12, "9 awaited, 12 held");
        lanes.release_held();
        assert_eq!(lanes.highest(), 0);
    }

    #[test]
    fn floors_stop_below_the_lowest_outstanding_message_of_the_partition() {
        let mut lanes = Lanes::default();
        lanes.offer(k(0, "a"), 1, 1);
        lanes.offer(k(0, "b"), 2, 2);
        lanes.dispatch();
        ack(&mut lanes, &k(0, "b"), 2);
        assert_eq!(lanes.floors(), BTreeMap::new(), "1 is still in flight");
        ack(&mut lanes, &k(0, "a"), 1);
        assert_eq!(lanes.floors(), BTreeMap::from([(0, 2)]));
    }

    /// The model's view of one lane: every sequence offered or in transit
    /// and not yet settled, so the only one that may go is the lowest.
    #[derive(Default)]
    struct Model {
        outstanding: BTreeMap<LaneId, BTreeSet<u64>>,
        settled: BTreeSet<(u32, u64)>,
    }

    /// Random offers, settles, NAKs, redeliveries, messages lost in transit,
    /// operator skips and the barrier, in both orderings, checked against
    /// the model after every step: one in flight per lane, at most
    /// `max_in_flight` in all, only a lane's lowest outstanding sequence
    /// goes out, nothing while the barrier is up, a settlement is repeated
    /// only for what was settled, and at the end everything drains and
    /// every lane is forgotten.
    #[test]
    fn random_schedules_keep_per_lane_order_against_a_model() {
        use rand::{Rng, SeedableRng};
        for seed in 0..400u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let by_key = seed % 2 == 0;
            let max_in_flight = rng.random_range(1..6);
            let mut lanes: Lanes<u64> = Lanes::new(max_in_flight);
            let mut model = Model::default();
            let mut lane_of: BTreeMap<u64, LaneId> = BTreeMap::new();
            let mut next_seq = 1u64;
            let mut in_flight: Vec<(LaneId, u64)> = Vec::new();
            let mut naked_out: Vec<(LaneId, u64)> = Vec::new();
            let mut lost: Vec<u64> = Vec::new();
            let offer = |lanes: &mut Lanes<u64>, model: &Model, id: &LaneId, s: u64| {
                if let Offered::AlreadySettled(_) = lanes.offer(id.clone(), s, s) {
                    assert!(model.settled.contains(&(id.partition, s)), "seed {seed}: {s} settled unseen");
                }
            };
            let dispatch = |lanes: &mut Lanes<u64>, model: &Model, in_flight: &mut Vec<(LaneId, u64)>| {
                let barrier = lanes.barrier();
                for d in lanes.dispatch() {
                    assert!(!barrier, "seed {seed}: nothing goes out while the barrier is up");
                    assert_eq!(d.seq, d.message);
                    let lowest = model.outstanding.get(&d.lane).and_then(|s| s.first().copied());
                    assert_eq!(lowest, Some(d.seq), "seed {seed}: {:?} passed a lower sequence", d.lane);
                    assert!(!in_flight.iter().any(|(l, _)| *l == d.lane), "seed {seed}: two in flight in a lane");
                    in_flight.push((d.lane, d.seq));
                }
                assert!(in_flight.len() <= max_in_flight, "seed {seed}: over max_in_flight");
                assert_eq!(lanes.in_flight(), in_flight.len());
                assert_eq!(lanes.holding(), lanes.held_messages().count() + in_flight.len(), "seed {seed}: held count");
            };
            let settle_done = |lanes: &mut Lanes<u64>, model: &mut Model, id: &LaneId, s: u64, how| {
                lanes.settle(id, s, Settled::Done(how));
                model.outstanding.get_mut(id).map(|set| set.remove(&s));
                model.settled.insert((id.partition, s));
            };
            for _ in 0..500 {
                match rng.random_range(0..7) {
                    0 | 6 => {
                        let partition = rng.random_range(0..3);
                        let key = match (by_key, rng.random_range(0..5)) {
                            (false, _) => LaneKey::Partition,
                            (true, 0) => LaneKey::Alone(next_seq),
                            (true, n) => LaneKey::Key(format!("k{n}").into()),
                        };
                        let id = LaneId { partition, key };
                        model.outstanding.entry(id.clone()).or_default().insert(next_seq);
                        lane_of.insert(next_seq, id.clone());
                        if rng.random_bool(0.1) {
                            // Lost in transit: the next delivery shows the gap
                            // and the barrier goes up until it is redelivered.
                            lost.push(next_seq);
                        } else {
                            if !lost.is_empty() {
                                lanes.set_barrier(true);
                            }
                            offer(&mut lanes, &model, &id, next_seq);
                        }
                        next_seq += 1;
                    }
                    // The barrier falls only when nothing is missing (the
                    // session's check: the server's ack-pending count is ours).
                    1 => lanes.set_barrier(!lanes.barrier() || !lost.is_empty()),
                    2 if !lost.is_empty() => {
                        let s = lost.remove(rng.random_range(0..lost.len()));
                        offer(&mut lanes, &model, &lane_of[&s].clone(), s);
                    }
                    3 if !in_flight.is_empty() => {
                        let (id, s) = in_flight.remove(rng.random_range(0..in_flight.len()));
                        if rng.random_bool(0.3) {
                            lanes.settle(&id, s, naked());
                            naked_out.push((id, s));
                        } else {
                            settle_done(&mut lanes, &mut model, &id, s, Settlement::Acked);
                        }
                    }
                    4 if !naked_out.is_empty() => {
                        let (id, s) = naked_out.remove(rng.random_range(0..naked_out.len()));
                        if rng.random_bool(0.2) && lanes.blocked_head(&id).is_some_and(|(head, _)| head == s) {
                            // An operator skips the blocked head: it never comes back.
                            lanes.skip(&id, s, Some(Settlement::Terminated));
                            model.outstanding.get_mut(&id).map(|set| set.remove(&s));
                            model.settled.insert((id.partition, s));
                        } else {
                            offer(&mut lanes, &model, &id, s);
                        }
                    }
                    _ => dispatch(&mut lanes, &model, &mut in_flight),
                }
            }
            // Drain: everything in transit comes back, every delivery is acked.
            for s in std::mem::take(&mut lost) {
                offer(&mut lanes, &model, &lane_of[&s].clone(), s);
            }
            for (id, s) in std::mem::take(&mut naked_out) {
                offer(&mut lanes, &model, &id, s);
            }
            lanes.set_barrier(false);
            loop {
                dispatch(&mut lanes, &model, &mut in_flight);
                let Some((id, s)) = in_flight.pop() else { break };
                settle_done(&mut lanes, &mut model, &id, s, Settlement::Acked);
            }
            assert!(model.outstanding.values().all(BTreeSet::is_empty), "seed {seed}: something never went out");
            assert_eq!(lanes.lane_count(), 0, "seed {seed}: drained lanes are forgotten");
            assert_eq!(lanes.holding() + lanes.awaiting(), 0);
        }
    }
}
