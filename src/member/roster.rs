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
    pub pinned: bool,
}

/// The instances of group members running in this process.
#[derive(Default)]
pub struct Roster {
    sessions: Mutex<BTreeMap<(String, String, String, u64), bool>>,
    /// Woken on every change, so the replica's entry follows soon.
    pub changed: Notify,
}

impl Roster {
    fn key(who: &MemberRef, session: u64) -> Option<(String, String, String, u64)> {
        (who.owner == Owner::Group)
            .then(|| (who.stream.to_string(), who.group.to_string(), who.member.to_string(), session))
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String, String, u64), bool>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `who`'s session `session` (a subscriber's are not listed).
    pub fn set(&self, who: &MemberRef, session: u64, pinned: bool) {
        let Some(key) = Self::key(who, session) else { return };
        if self.sessions().insert(key, pinned) != Some(pinned) {
            self.changed.notify_one();
        }
    }

    pub fn remove(&self, who: &MemberRef, session: u64) {
        let Some(key) = Self::key(who, session) else { return };
        if self.sessions().remove(&key).is_some() {
            self.changed.notify_one();
        }
    }

    pub fn entries(&self) -> Vec<RosterEntry> {
        self.sessions()
            .iter()
            .map(|((stream, group, member, session), pinned)| RosterEntry {
                stream: stream.clone(),
                group: group.clone(),
                member: member.clone(),
                session: *session,
                pinned: *pinned,
            })
            .collect()
    }
}
