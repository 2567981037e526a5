//! This process's member instances and whether each holds its pin, kept
//! live for the group view: every replica publishes its roster with its
//! presence entry (`cluster/replicas.rs`), so a group's `GET` reads every
//! replica's instances from memory instead of asking each one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::names::{MemberRef, Owner};

/// One instance as a replica reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "FlatEntry", into = "FlatEntry")]
pub struct RosterEntry {
    pub stream: String,
    pub group: String,
    pub member: String,
    /// Tells apart several instances of a member in one process.
    pub session: u64,
    pub report: InstanceReport,
}

/// A roster entry as written: the report's fields beside the instance's.
/// Spelled out instead of `#[serde(flatten)]`, which reads through a
/// buffered map: every replica reads every other's thousand entries each
/// renewal, and that was a visible share of an idle replica's CPU.
#[derive(Serialize, Deserialize)]
struct FlatEntry {
    stream: String,
    group: String,
    member: String,
    session: u64,
    pinned: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fencing_token: Option<u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    blocked: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    outputs: Vec<String>,
}

impl From<FlatEntry> for RosterEntry {
    fn from(flat: FlatEntry) -> Self {
        let FlatEntry { stream, group, member, session, pinned, pin, fencing_token, blocked, outputs } = flat;
        let report = InstanceReport { pinned, pin, fencing_token, blocked, outputs };
        Self { stream, group, member, session, report }
    }
}

impl From<RosterEntry> for FlatEntry {
    fn from(entry: RosterEntry) -> Self {
        let RosterEntry { stream, group, member, session, report } = entry;
        let InstanceReport { pinned, pin, fencing_token, blocked, outputs } = report;
        Self { stream, group, member, session, pinned, pin, fencing_token, blocked, outputs }
    }
}

/// What an instance reports of itself: enough for a group's view to name
/// the pin holder and its fencing token without asking it, and to ask only
/// an instance that has blocked lanes to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstanceReport {
    pub pinned: bool,
    /// The pin id it holds (the consumer's `pinned_client_id`).
    pub pin: Option<String>,
    pub fencing_token: Option<u64>,
    /// Whether any of its lanes is blocked.
    pub blocked: bool,
    /// Streams its endpoint's answers may publish to (docs/pipelines.md).
    pub outputs: Vec<String>,
}

type SessionKey = (String, String, String, u64);

/// The instances of group members running in this process.
#[derive(Default)]
pub struct Roster {
    sessions: Mutex<BTreeMap<SessionKey, InstanceReport>>,
    /// Counts changes, so an unchanged roster is not serialized again.
    version: AtomicU64,
    /// Woken on every change, so the replica's entry follows soon.
    pub changed: Notify,
}

impl Roster {
    fn key(who: &MemberRef, session: u64) -> Option<SessionKey> {
        (who.owner == Owner::Group)
            .then(|| (who.stream.to_string(), who.group.to_string(), who.member.to_string(), session))
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, BTreeMap<SessionKey, InstanceReport>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the session's report; `add` records a session not listed yet
    /// (otherwise a session already removed stays removed).
    fn update(&self, who: &MemberRef, session: u64, add: bool, change: impl FnOnce(&mut InstanceReport)) {
        let Some(key) = Self::key(who, session) else { return };
        let mut sessions = self.sessions();
        let (report, added) = match sessions.entry(key) {
            std::collections::btree_map::Entry::Occupied(entry) => (entry.into_mut(), false),
            std::collections::btree_map::Entry::Vacant(entry) if add => (entry.insert(InstanceReport::default()), true),
            std::collections::btree_map::Entry::Vacant(_) => return,
        };
        let before = report.clone();
        change(report);
        if added || *report != before {
            self.version.fetch_add(1, Ordering::Relaxed);
            self.changed.notify_one();
        }
    }

    /// Records `who`'s session `session` (a subscriber's are not listed)
    /// and the pin it holds with its fencing token, if any.
    pub fn set_pin(&self, who: &MemberRef, session: u64, pin: Option<&str>, fencing_token: Option<u64>) {
        self.update(who, session, true, |report| {
            report.pinned = pin.is_some();
            report.pin = pin.map(str::to_owned);
            report.fencing_token = fencing_token.filter(|_| pin.is_some());
        });
    }

    /// Records the streams `who`'s session `session` may publish to
    /// (once the session is listed).
    pub fn set_outputs(&self, who: &MemberRef, session: u64, outputs: &[crate::names::StreamName]) {
        self.update(who, session, false, |report| {
            if report.outputs.len() != outputs.len() || report.outputs.iter().zip(outputs).any(|(a, b)| a != b.as_str())
            {
                report.outputs = outputs.iter().map(|o| o.to_string()).collect();
            }
        });
    }

    /// Records whether any lane of `who`'s session `session` is blocked
    /// (once the session is listed).
    pub fn set_blocked(&self, who: &MemberRef, session: u64, blocked: bool) {
        self.update(who, session, false, |report| report.blocked = blocked);
    }

    pub fn remove(&self, who: &MemberRef, session: u64) {
        let Some(key) = Self::key(who, session) else { return };
        if self.sessions().remove(&key).is_some() {
            self.version.fetch_add(1, Ordering::Relaxed);
            self.changed.notify_one();
        }
    }

    /// Changes so far: equal versions, equal entries.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }

    pub fn entries(&self) -> Vec<RosterEntry> {
        self.entries_where(|_, _| true)
    }

    /// The entries of the instances of `stream`/`group`'s members.
    pub fn entries_of(&self, stream: &str, group: &str) -> Vec<RosterEntry> {
        self.entries_where(|s, g| s == stream && g == group)
    }

    fn entries_where(&self, keep: impl Fn(&str, &str) -> bool) -> Vec<RosterEntry> {
        self.sessions()
            .iter()
            .filter(|((stream, group, _, _), _)| keep(stream, group))
            .map(|((stream, group, member, session), report)| RosterEntry {
                stream: stream.clone(),
                group: group.clone(),
                member: member.clone(),
                session: *session,
                report: report.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_change_and_only_a_change_moves_the_version() {
        let roster = Roster::default();
        let who = MemberRef {
            stream: crate::names::StreamName::parse("S").unwrap(),
            group: crate::names::GroupName::parse("g").unwrap(),
            member: crate::names::MemberName::parse("m").unwrap(),
            owner: Owner::Group,
        };
        roster.set_pin(&who, 1, None, None);
        let listed = roster.version();
        assert!(listed > 0, "a session listed without a pin is a change");
        roster.set_pin(&who, 1, None, None);
        assert_eq!(roster.version(), listed, "the same report again");
        roster.set_pin(&who, 1, Some("p"), Some(2));
        assert!(roster.version() > listed);
        let pinned = roster.version();
        roster.remove(&who, 1);
        assert!(roster.version() > pinned);
        assert!(roster.entries().is_empty());
    }

    #[test]
    fn entries_written_before_the_pin_fields_existed_still_read() {
        let old = r#"{"stream":"S","group":"g","member":"m","session":7,"pinned":true}"#;
        let entry: RosterEntry = serde_json::from_str(old).unwrap();
        assert_eq!(entry.report, InstanceReport { pinned: true, ..InstanceReport::default() });
        let new = RosterEntry {
            report: InstanceReport {
                pinned: true,
                pin: Some("p".into()),
                fencing_token: Some(3),
                blocked: true,
                outputs: vec!["PAYMENTS".into()],
            },
            ..entry
        };
        let back: RosterEntry = serde_json::from_str(&serde_json::to_string(&new).unwrap()).unwrap();
        assert_eq!(back, new);
    }
}
