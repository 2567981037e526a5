//! This process's member instances and whether each holds its pin, kept
//! live for the group view: every replica publishes its roster with its
//! presence entry (`member/replicas.rs`), so a group's `GET` reads every
//! replica's instances from memory instead of asking each one.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::member_ref::{MemberRef, Owner};

/// One instance as a replica reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RosterEntry {
    pub stream: String,
    pub group: String,
    pub member: String,
    /// Tells apart several instances of a member in one process.
    pub session: u64,
    #[serde(flatten)]
    pub report: InstanceReport,
}

/// What an instance reports of itself: enough for a group's view to name
/// the pin holder and its fencing token without asking it, and to ask only
/// an instance that has blocked lanes to list.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceReport {
    pub pinned: bool,
    /// The pin id it holds (the consumer's `pinned_client_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<u64>,
    /// Whether any of its lanes is blocked.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub blocked: bool,
}

type SessionKey = (String, String, String, u64);

/// The instances of group members running in this process.
#[derive(Default)]
pub struct Roster {
    sessions: Mutex<BTreeMap<SessionKey, InstanceReport>>,
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
        let report = match sessions.entry(key) {
            std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::btree_map::Entry::Vacant(entry) if add => entry.insert(InstanceReport::default()),
            std::collections::btree_map::Entry::Vacant(_) => return,
        };
        let before = report.clone();
        change(report);
        if *report != before {
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

    /// Records whether any lane of `who`'s session `session` is blocked
    /// (once the session is listed).
    pub fn set_blocked(&self, who: &MemberRef, session: u64, blocked: bool) {
        self.update(who, session, false, |report| report.blocked = blocked);
    }

    pub fn remove(&self, who: &MemberRef, session: u64) {
        let Some(key) = Self::key(who, session) else { return };
        if self.sessions().remove(&key).is_some() {
            self.changed.notify_one();
        }
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
    fn entries_written_before_the_pin_fields_existed_still_read() {
        let old = r#"{"stream":"S","group":"g","member":"m","session":7,"pinned":true}"#;
        let entry: RosterEntry = serde_json::from_str(old).unwrap();
        assert_eq!(entry.report, InstanceReport { pinned: true, ..InstanceReport::default() });
        let new = RosterEntry {
            report: InstanceReport { pinned: true, pin: Some("p".into()), fencing_token: Some(3), blocked: true },
            ..entry
        };
        let back: RosterEntry = serde_json::from_str(&serde_json::to_string(&new).unwrap()).unwrap();
        assert_eq!(back, new);
    }
}
