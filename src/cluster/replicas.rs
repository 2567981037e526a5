//! Which keygate replicas are alive, and their member instances: each
//! process renews an entry in the KV bucket `keygate-replicas` holding its
//! roster (`cluster/roster.rs`), rewritten soon after every change, and
//! watches the others' (docs/scale-out.md). A replica whose entry is not
//! renewed within [`RECENT`] no longer counts toward pin shares; one not
//! renewed for [`REPLICA_TTL`] is forgotten (its instances no longer
//! listed), and the bucket's max age removes it from the server too.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::roster::{InstanceReport, Roster, RosterEntry};
use crate::nats::buckets::{BucketSpec, Buckets};

pub const REPLICAS_BUCKET: &str = "keygate-replicas";
/// A replica unheard for this long is gone.
pub const REPLICA_TTL: Duration = Duration::from_secs(6);
/// How often a replica renews its entry.
const RENEW_EVERY: Duration = Duration::from_secs(2);
/// A replica heard from within this is counted by [`Replicas::count`]: one
/// renewal, and a second of lateness.
pub const RECENT: Duration = Duration::from_secs(3);
/// Changes of the roster wait this long, so a burst is written once.
const CHANGE_DEBOUNCE: Duration = Duration::from_millis(50);

/// What a replica writes in its entry.
#[derive(Debug, Default, Serialize, Deserialize)]
struct ReplicaReport {
    /// Its `--instance-id`.
    name: String,
    instances: Vec<RosterEntry>,
}

/// One instance of a member on a live replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingInstance {
    /// The replica's `--instance-id`.
    pub instance: String,
    pub session: u64,
    pub report: InstanceReport,
}

/// Another replica's entry as last written.
struct Seen {
    at: Instant,
    /// As written: a renewal that changes nothing is not read again.
    value: bytes::Bytes,
    report: Arc<ReplicaReport>,
}

/// This replica: its tag, name and roster (read live, not from its entry).
#[derive(Clone)]
struct Own {
    tag: String,
    name: String,
    roster: Arc<Roster>,
}

/// The live replicas as this one sees them (itself included).
#[derive(Clone, Default)]
pub struct Replicas {
    /// By tag.
    seen: Arc<Mutex<HashMap<String, Seen>>>,
    own: Arc<Mutex<Option<Own>>>,
}

impl Replicas {
    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<String, Seen>> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, seen| seen.at.elapsed() < REPLICA_TTL);
        seen
    }

    fn own(&self) -> Option<Own> {
        self.own.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many replicas are alive and on time: their last renewal at most
    /// [`RECENT`] ago (at least this one). A replica that died drops out of
    /// this count before its pins lapse at the server, so standbys that hold
    /// back while their replica has its share pull again in time to take
    /// those pins, and the others do not step down what they took for a
    /// share that counts the dead one. A replica late with its renewal makes
    /// the share larger for a moment: fewer moves, never fewer takers.
    pub fn count(&self) -> usize {
        let own = self.own().map(|own| own.tag);
        let others =
            self.seen().iter().filter(|(tag, seen)| Some(*tag) != own.as_ref() && seen.at.elapsed() < RECENT).count();
        others + 1
    }

    /// Every live replica's instances of the members of `stream`/`group`,
    /// by member, pinned first.
    pub fn instances_of(&self, stream: &str, group: &str) -> BTreeMap<String, Vec<ServingInstance>> {
        let own = self.own();
        // Only the group's entries are copied: a report lists every instance of its replica.
        let of_group = |e: &&RosterEntry| e.stream == stream && e.group == group;
        let mut reports: Vec<(String, Vec<RosterEntry>)> = self
            .seen()
            .iter()
            .filter(|(tag, _)| own.as_ref().is_none_or(|own| own.tag != **tag))
            .map(|(_, seen)| {
                (seen.report.name.clone(), seen.report.instances.iter().filter(of_group).cloned().collect())
            })
            .collect();
        if let Some(own) = own {
            reports.push((own.name, own.roster.entries_of(stream, group)));
        }
        let mut by_member: BTreeMap<String, Vec<ServingInstance>> = BTreeMap::new();
        for (name, instances) in reports {
            for entry in instances {
                let instance = ServingInstance { instance: name.clone(), session: entry.session, report: entry.report };
                by_member.entry(entry.member).or_default().push(instance);
            }
        }
        for instances in by_member.values_mut() {
            instances.sort_by(|a, b| b.report.pinned.cmp(&a.report.pinned).then_with(|| a.instance.cmp(&b.instance)));
        }
        by_member
    }

    fn saw(&self, tag: &str, value: bytes::Bytes) {
        // This replica's own instances are read from its roster, not its entry.
        let own = self.own().is_some_and(|own| own.tag == tag);
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = seen.get_mut(tag).filter(|last| own || last.value == value) {
            last.at = Instant::now();
            return;
        }
        let report = if own { ReplicaReport::default() } else { serde_json::from_slice(&value).unwrap_or_default() };
        seen.insert(tag.to_owned(), Seen { at: Instant::now(), value, report: Arc::new(report) });
    }

    fn forget(&self, tag: &str) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).remove(tag);
    }

    /// Announces this replica (as `name`, with `roster`) until `cancel`,
    /// and follows the others.
    pub async fn run(self, buckets: Buckets, name: String, roster: Arc<Roster>, cancel: CancellationToken) {
        let tag = crate::delivery::pull::new_replica_tag();
        let own = Own { tag: tag.clone(), name: name.clone(), roster: roster.clone() };
        *self.own.lock().unwrap_or_else(|p| p.into_inner()) = Some(own);
        let store = loop {
            match buckets.open_or_create(BucketSpec::expiring(REPLICAS_BUCKET, REPLICA_TTL)).await {
                Ok(store) => break store,
                Err(e) => tracing::debug!(error = %e.report(), "replicas bucket unavailable; retrying"),
            }
            tokio::select! {
                () = tokio::time::sleep(RENEW_EVERY) => {}
                () = cancel.cancelled() => return,
            }
        };
        let mut watch = None;
        let mut renew = tokio::time::interval(RENEW_EVERY);
        // Room for the message's subject and headers beside the entry.
        let max_entry = buckets.js().client().server_info().max_payload.saturating_sub(4096);
        let mut announcement = Announcement::new(name.clone(), roster.clone(), max_entry);
        loop {
            if watch.is_none() {
                watch = store.watch_all().await.ok();
            }
            tokio::select! {
                _ = renew.tick() => {
                    if let Err(e) = store.put(&tag, announcement.value()).await {
                        tracing::debug!(error = %e, "announcing this replica failed");
                    }
                }
                () = roster.changed.notified() => {
                    tokio::time::sleep(CHANGE_DEBOUNCE).await;
                    if let Err(e) = store.put(&tag, announcement.value()).await {
                        tracing::debug!(error = %e, "announcing this replica's instances failed");
                    }
                }
                entry = next_entry(&mut watch) => match entry {
                    Some(entry) if entry.operation == kv::Operation::Put => self.saw(&entry.key, entry.value),
                    Some(entry) => self.forget(&entry.key),
                    None => watch = None,
                },
                () = cancel.cancelled() => {
                    let _ = store.purge(&tag).await;
                    return;
                }
            }
        }
    }
}

/// This replica's entry, serialized again only after its roster changed.
struct Announcement {
    name: String,
    roster: Arc<Roster>,
    /// The most an entry may take (one NATS message, less the subject and headers).
    max_entry: usize,
    last: Option<(u64, bytes::Bytes)>,
    warned: bool,
}

impl Announcement {
    fn new(name: String, roster: Arc<Roster>, max_entry: usize) -> Self {
        Self { name, roster, max_entry, last: None, warned: false }
    }

    fn value(&mut self) -> bytes::Bytes {
        let version = self.roster.version();
        if let Some((_, value)) = self.last.as_ref().filter(|(at, _)| *at == version) {
            return value.clone();
        }
        let mut report = ReplicaReport { name: self.name.clone(), instances: self.roster.entries() };
        let mut value = serde_json::to_vec(&report).unwrap_or_default();
        // An entry too large for one message would not be written at all,
        // and a replica unheard of counts as dead: it is announced without
        // its instances (group views then lack them) rather than not at all.
        if value.len() > self.max_entry {
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    instances = report.instances.len(),
                    bytes = value.len(),
                    max = self.max_entry,
                    "this replica's roster does not fit in one NATS message; announcing it without its instances"
                );
            }
            report.instances.clear();
            value = serde_json::to_vec(&report).unwrap_or_default();
        }
        let value = bytes::Bytes::from(value);
        self.last = Some((version, value.clone()));
        value
    }
}

async fn next_entry(watch: &mut Option<kv::Watch>) -> Option<kv::Entry> {
    match watch {
        Some(watch) => watch.next().await.and_then(Result::ok),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::{GroupName, MemberName, StreamName};
    use crate::names::{MemberRef, Owner};

    fn member(n: usize) -> MemberRef {
        MemberRef {
            stream: StreamName::parse("S").unwrap(),
            group: GroupName::parse("g").unwrap(),
            member: MemberName::parse(&format!("m{n}")).unwrap(),
            owner: Owner::Group,
        }
    }

    fn read(value: &[u8]) -> ReplicaReport {
        serde_json::from_slice(value).unwrap()
    }

    #[test]
    fn an_unchanged_roster_is_announced_with_the_same_bytes_and_a_change_anew() {
        let roster = Arc::new(Roster::default());
        roster.set_pin(&member(1), 1, None, None);
        let mut announcement = Announcement::new("kg-1".into(), roster.clone(), 1 << 20);
        let first = announcement.value();
        assert_eq!(announcement.value().as_ptr(), first.as_ptr(), "not serialized again");
        roster.set_pin(&member(1), 1, Some("p"), Some(4));
        let second = read(&announcement.value());
        assert_eq!(second.name, "kg-1");
        assert_eq!(second.instances.len(), 1);
        assert_eq!(second.instances[0].report.pin.as_deref(), Some("p"));
    }

    #[test]
    fn a_roster_too_large_for_a_message_is_announced_without_its_instances() {
        let roster = Arc::new(Roster::default());
        for n in 0..20 {
            roster.set_pin(&member(n), 1, None, None);
        }
        let mut announcement = Announcement::new("kg-1".into(), roster, 500);
        let report = read(&announcement.value());
        assert_eq!(report.name, "kg-1", "the replica itself is still announced");
        assert!(report.instances.is_empty());
    }
}
