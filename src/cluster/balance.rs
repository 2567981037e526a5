//! Pin balancing across replicas (docs/scale-out.md), its rules and its
//! ledger; `rebalance.rs` runs it. Every replica runs
//! an instance of every webhook member, and a replica holding more than
//! its fair share of a group's pins (⌈members / replicas⌉ + slack) steps
//! the excess down; its standbys stop pulling while it holds its share,
//! so the freed pins go to replicas under theirs. Every move is an ordinary
//! pin change: the handover barrier and fencing tokens apply.
//!
//! WebSocket and pull instances are not moved (a client connection is where
//! it is) and not counted: only webhook instances, which every replica runs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::names::MemberRef;
use crate::names::{GroupName, MemberName, StreamName};

/// A pin held for less than this is not stepped down: pins that just moved
/// settle before they move again.
pub const MIN_TENURE: Duration = Duration::from_secs(2);
/// A replica's instance that stepped down does not pull for this long, so
/// the pin goes elsewhere.
pub const STEP_DOWN_HOLD: Duration = Duration::from_secs(10);

/// How often a standby holding back because its replica has its share
/// looks again without being told there may be room ([`PinLedger::room`]
/// tells it at once).
pub const ROOM_RECHECK: Duration = Duration::from_secs(5);

/// The most pins of a group one replica should hold.
pub fn fair_share(members: usize, replicas: usize, slack: usize) -> usize {
    members.div_ceil(replicas.max(1)) + slack
}

/// Which of `pinned` (member, held since) to step down so at most `share`
/// remain: the most recently gained first, none held for less than `tenure`.
pub fn to_step_down(
    pinned: &BTreeMap<MemberName, Instant>,
    share: usize,
    now: Instant,
    tenure: Duration,
) -> Vec<MemberName> {
    let excess = pinned.len().saturating_sub(share);
    let mut settled: Vec<(&MemberName, &Instant)> =
        pinned.iter().filter(|(_, since)| now.saturating_duration_since(**since) >= tenure).collect();
    settled.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    settled.into_iter().take(excess).map(|(member, _)| member.clone()).collect()
}

/// Webhook members served and pinned on this replica, per group.
#[derive(Default)]
pub struct PinLedger {
    groups: Mutex<BTreeMap<(StreamName, GroupName), GroupPins>>,
}

struct GroupPins {
    /// Members with a webhook instance here (every replica runs one each).
    served: BTreeMap<MemberName, usize>,
    /// Members whose pin a webhook instance here holds, since when.
    pinned: BTreeMap<MemberName, Instant>,
    /// Told when this replica may have room for more of the group's pins
    /// (one lost here, members served changed, replicas counted changed):
    /// standbys holding back wait for it instead of looking again and again.
    room: watch::Sender<()>,
}

impl Default for GroupPins {
    fn default() -> Self {
        Self { served: BTreeMap::new(), pinned: BTreeMap::new(), room: watch::Sender::new(()) }
    }
}

impl PinLedger {
    fn with<T>(&self, who: &MemberRef, f: impl FnOnce(&mut GroupPins) -> T) -> T {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let key = (who.stream.clone(), who.group.clone());
        let pins = groups.entry(key.clone()).or_default();
        let answer = f(pins);
        // Kept while a standby still waits on its signal.
        if pins.served.is_empty() && pins.pinned.is_empty() && pins.room.receiver_count() == 0 {
            groups.remove(&key);
        }
        answer
    }

    /// A webhook instance of `who` runs here while the guard lives.
    pub fn serve(self: &Arc<Self>, who: &MemberRef) -> Served {
        self.with(who, |pins| {
            *pins.served.entry(who.member.clone()).or_default() += 1;
            pins.room.send_replace(());
        });
        Served { ledger: self.clone(), who: who.clone() }
    }

    pub fn set_pinned(&self, who: &MemberRef, pinned: bool) {
        self.with(who, |pins| {
            if pinned {
                pins.pinned.entry(who.member.clone()).or_insert_with(Instant::now);
            } else if pins.pinned.remove(&who.member).is_some() {
                pins.room.send_replace(());
            }
        });
    }

    /// What tells `who`'s group's standbys here that the replica may have
    /// room for another pin ([`has_share`](Self::has_share) may have turned false).
    pub fn room(&self, who: &MemberRef) -> watch::Receiver<()> {
        self.with(who, |pins| pins.room.subscribe())
    }

    /// The replicas counted changed: every group's share did.
    pub fn replicas_changed(&self) {
        let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        for pins in groups.values() {
            pins.room.send_replace(());
        }
    }

    /// Whether this replica holds at least its share of the group's pins
    /// (one more would be a pin to step down again).
    pub fn has_share(&self, who: &MemberRef, replicas: usize, slack: usize) -> bool {
        self.with(who, |pins| pins.pinned.len() >= fair_share(pins.served.len(), replicas, slack))
    }

    /// Every group with webhook members here, as it stands now.
    pub fn snapshot(&self) -> Vec<GroupShare> {
        let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups
            .iter()
            .map(|((stream, group), pins)| GroupShare {
                stream: stream.clone(),
                group: group.clone(),
                served: pins.served.len(),
                pinned: pins.pinned.clone(),
            })
            .collect()
    }
}

/// A group's webhook members on this replica.
pub struct GroupShare {
    pub stream: StreamName,
    pub group: GroupName,
    /// Members with a webhook instance here.
    pub served: usize,
    /// Members pinned here, since when.
    pub pinned: BTreeMap<MemberName, Instant>,
}

/// One webhook instance counted in the ledger; uncounted when dropped.
pub struct Served {
    ledger: Arc<PinLedger>,
    who: MemberRef,
}

impl Drop for Served {
    fn drop(&mut self) {
        let member = self.who.member.clone();
        self.ledger.with(&self.who, |pins| {
            if let Some(count) = pins.served.get_mut(&member) {
                *count -= 1;
                if *count == 0 {
                    pins.served.remove(&member);
                    pins.pinned.remove(&member);
                    pins.room.send_replace(());
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str) -> MemberName {
        MemberName::parse(name).unwrap()
    }

    #[test]
    fn the_fair_share_rounds_up_and_adds_the_slack() {
        assert_eq!(fair_share(12, 3, 0), 4);
        assert_eq!(fair_share(12, 4, 0), 3);
        assert_eq!(fair_share(10, 3, 0), 4);
        assert_eq!(fair_share(10, 3, 1), 5);
        assert_eq!(fair_share(3, 0, 0), 3, "no replica known: this one");
    }

    #[test]
    fn the_newest_settled_pins_step_down_and_only_the_excess() {
        let now = Instant::now();
        let ago = |s: u64| now - Duration::from_secs(s);
        let pinned: BTreeMap<MemberName, Instant> = [("a", ago(60)), ("b", ago(30)), ("c", ago(10)), ("d", ago(1))]
            .into_iter()
            .map(|(m, t)| (member(m), t))
            .collect();
        // Two over the share: the newest settled ones go; d is too fresh.
        assert_eq!(to_step_down(&pinned, 2, now, MIN_TENURE), vec![member("c"), member("b")]);
        assert!(to_step_down(&pinned, 4, now, MIN_TENURE).is_empty(), "at the share: nothing moves");
        assert_eq!(to_step_down(&pinned, 3, now, MIN_TENURE), vec![member("c")]);
    }
}
