//! Paused members and subscribers: a flag per member in the KV bucket
//! `keygate-pauses`, which every replica's instances watch. A paused
//! member's instances stop pulling, finish what they hold and release the
//! pin, so no standby takes over; its backlog waits in NATS until it is
//! resumed. docs/operations.md describes the routes.

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::sync::broadcast::{error::RecvError, Receiver};
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use crate::names::MemberRef;
use crate::names::{GroupName, StreamName};
use crate::nats::buckets::{BucketSpec, Buckets, OpenBuckets};
use crate::nats::errors::unavailable_or_internal;
use crate::nats::errors::{BrokerError as Error, BrokerErrorKind as Kind};

/// The bucket of pause flags.
pub const PAUSES_BUCKET: &str = "keygate-pauses";
/// Most characters of a pause's reason.
pub const MAX_REASON: usize = 500;

/// Who paused a member, when, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Pause {
    /// The token's `sub` claim, or `anonymous` when keygate runs without keys.
    pub paused_by: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub since: OffsetDateTime,
    pub reason: Option<String>,
    /// A circuit breaker's pause: how often one replica tries one message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_every_ms: Option<u64>,
    /// When the next probe may start.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub next_probe_at: Option<OffsetDateTime>,
    /// The keygate instance probing now, if one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probing_by: Option<String>,
}

/// Who a circuit breaker's pause names as having paused the member.
pub const BREAKER: &str = "circuit breaker";

impl Pause {
    /// An operator's pause, from now.
    pub fn by(paused_by: String, reason: Option<String>) -> Self {
        Self {
            paused_by,
            since: OffsetDateTime::now_utc(),
            reason,
            probe_every_ms: None,
            next_probe_at: None,
            probing_by: None,
        }
    }

    /// A circuit breaker's pause, probing every `probe_every` when given.
    pub fn by_breaker(reason: String, probe_every: Option<std::time::Duration>) -> Self {
        let now = OffsetDateTime::now_utc();
        Self {
            probe_every_ms: probe_every.map(|d| d.as_millis() as u64),
            next_probe_at: probe_every.map(|d| now + d),
            ..Self::by(BREAKER.to_owned(), Some(reason))
        }
    }
}

/// The flag's key: owner, stream, group (or consumer) and member, all
/// names of `[A-Za-z0-9_-]`, so valid KV key tokens.
pub fn pause_key(who: &MemberRef) -> String {
    format!("{}.{}.{}.{}", who.owner.as_str(), who.stream, who.group, who.member)
}

/// A stored flag's pause (a delete marker, or a flag that does not parse,
/// counts as none).
fn pause_in(entry: Option<kv::Entry>) -> Option<Pause> {
    entry.filter(|e| e.operation == kv::Operation::Put).and_then(|e| serde_json::from_slice(&e.value).ok())
}

/// Pause flags read at once (a request each).
const CONCURRENT_READS: usize = 128;

/// The pause flags.
#[derive(Clone)]
pub struct Pauses {
    js: jetstream::Context,
    buckets: Buckets,
    /// The bucket, kept open for reads (src/nats/buckets.rs).
    open: OpenBuckets,
}

impl Pauses {
    pub fn new(buckets: Buckets) -> Self {
        Self { js: buckets.js().clone(), buckets, open: OpenBuckets::default() }
    }

    async fn bucket(&self, create: bool) -> Result<Option<kv::Store>, Error> {
        if !create {
            return self.buckets.open(PAUSES_BUCKET).await;
        }
        let spec = BucketSpec::state(PAUSES_BUCKET, "keygate: paused members and subscribers");
        self.buckets.open_or_create(spec).await.map(Some)
    }

    /// Whether `who` is paused, and by whom.
    pub async fn get(&self, who: &MemberRef) -> Result<Option<Pause>, Error> {
        Ok(pause_in(self.open.entry(&self.js, PAUSES_BUCKET, &pause_key(who), "reading a pause").await?))
    }

    /// Whether each of `who` is paused (`None` in, `None` out), the flags
    /// read concurrently; a flag that cannot be read counts as none.
    pub async fn get_many(&self, who: &[Option<MemberRef>]) -> Vec<Option<Pause>> {
        let store = match self.open.open(&self.js, PAUSES_BUCKET).await {
            Ok(Some(store)) => store,
            Ok(None) | Err(_) => return vec![None; who.len()],
        };
        // Each read owns its store and member: with borrows inside, the
        // handler's future would not be `Send`.
        let reads = who.iter().cloned().map(|who| {
            let store = store.clone();
            async move {
                let Some(who) = who else { return Ok(None) };
                store.entry(pause_key(&who)).await.map(pause_in)
            }
        });
        let read: Vec<Result<Option<Pause>, _>> =
            futures::stream::iter(reads).buffered(CONCURRENT_READS).collect().await;
        if read.iter().any(Result::is_err) {
            // The bucket may be gone: the next view opens it afresh.
            self.open.forget(PAUSES_BUCKET);
        }
        read.into_iter().map(|r| r.ok().flatten()).collect()
    }

    /// Every pause flag of `stream`/`group`'s members, by [`pause_key`], in
    /// one scan of the group's keys (src/nats/kv_scan.rs) instead of a read
    /// per member. `None` when that scan fails: then
    /// [`get_many`](Self::get_many) reads them one by one.
    pub async fn of_group(&self, stream: &StreamName, group: &GroupName) -> Option<HashMap<String, Pause>> {
        let filter = format!("{}.{stream}.{group}.*", crate::names::Owner::Group.as_str());
        let flags = self.open.live_entries(&self.js, PAUSES_BUCKET, &filter).await.ok()?;
        // A flag that does not parse counts as none, as one read alone.
        Some(flags.into_iter().filter_map(|(key, value)| Some((key, serde_json::from_slice(&value).ok()?))).collect())
    }

    /// Pauses `who`; a member already paused keeps its first pause, which
    /// is answered with `false`.
    pub async fn pause(&self, who: &MemberRef, pause: Pause) -> Result<(Pause, bool), Error> {
        let store = self.bucket(true).await?.ok_or_else(|| Error::new(Kind::Internal, "no pauses bucket"))?;
        let bytes: bytes::Bytes =
            serde_json::to_vec(&pause).map_err(|e| Error::new(Kind::Internal, "encoding a pause").caused_by(e))?.into();
        loop {
            match store.create(pause_key(who), bytes.clone()).await {
                Ok(_) => return Ok((pause, true)),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    if let Some(existing) = self.get(who).await? {
                        return Ok((existing, false));
                    }
                    // Resumed in between: pause again.
                }
                Err(e) => return Err(unavailable_or_internal("storing a pause", e)),
            }
        }
    }

    /// Claims the next probe of a breaker's pause for `instance`, when it is
    /// due; `lease` later another instance may claim it (this one died).
    /// Compare-and-set: one instance wins.
    pub async fn claim_probe(
        &self,
        who: &MemberRef,
        instance: &str,
        lease: std::time::Duration,
    ) -> Result<bool, Error> {
        let Some(store) = self.bucket(false).await? else { return Ok(false) };
        let key = pause_key(who);
        let entry = store.entry(&key).await.map_err(|e| unavailable_or_internal("reading a pause", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else { return Ok(false) };
        let Ok(mut pause) = serde_json::from_slice::<Pause>(&entry.value) else { return Ok(false) };
        let now = OffsetDateTime::now_utc();
        if pause.probe_every_ms.is_none() || pause.next_probe_at.is_none_or(|at| at > now) {
            return Ok(false);
        }
        pause.probing_by = Some(instance.to_owned());
        pause.next_probe_at = Some(now + lease);
        let bytes =
            serde_json::to_vec(&pause).map_err(|e| Error::new(Kind::Internal, "encoding a pause").caused_by(e))?;
        Ok(store.update(&key, bytes.into(), entry.revision).await.is_ok())
    }

    /// The probe failed: stay paused, the next probe due an interval from now.
    pub async fn probe_failed(&self, who: &MemberRef) -> Result<(), Error> {
        let Some(store) = self.bucket(false).await? else { return Ok(()) };
        let Some(mut pause) = self.get(who).await? else { return Ok(()) };
        let Some(every) = pause.probe_every_ms else { return Ok(()) };
        pause.probing_by = None;
        pause.next_probe_at = Some(OffsetDateTime::now_utc() + std::time::Duration::from_millis(every));
        let bytes =
            serde_json::to_vec(&pause).map_err(|e| Error::new(Kind::Internal, "encoding a pause").caused_by(e))?;
        store.put(pause_key(who), bytes.into()).await.map_err(|e| unavailable_or_internal("storing a pause", e))?;
        Ok(())
    }

    /// Resumes `who`; answers the pause lifted, `None` when it was not paused.
    pub async fn resume(&self, who: &MemberRef) -> Result<Option<Pause>, Error> {
        let Some(lifted) = self.get(who).await? else { return Ok(None) };
        let Some(store) = self.bucket(false).await? else { return Ok(None) };
        store.purge(pause_key(who)).await.map_err(|e| unavailable_or_internal("lifting a pause", e))?;
        Ok(Some(lifted))
    }
}

/// What a watched update of the bucket means for one member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseUpdate {
    /// Paused; `probing_by` names the instance that claimed a probe.
    Paused {
        probing_by: Option<String>,
    },
    Resumed,
    /// Updates were missed, or the watch ended: read the flag again.
    Unknown,
    /// Another member's.
    Other,
}

/// Classifies one update from a watch of [`PAUSES_BUCKET`] for `key`.
pub fn pause_update(key: &str, update: Result<Arc<kv::Entry>, RecvError>) -> PauseUpdate {
    match update {
        Ok(entry) if entry.key == key => match entry.operation {
            kv::Operation::Put => PauseUpdate::Paused {
                probing_by: serde_json::from_slice::<Pause>(&entry.value).ok().and_then(|p| p.probing_by),
            },
            kv::Operation::Delete | kv::Operation::Purge => PauseUpdate::Resumed,
        },
        Ok(_) => PauseUpdate::Other,
        Err(RecvError::Lagged(_) | RecvError::Closed) => PauseUpdate::Unknown,
    }
}

/// How a wait for a paused member ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    Resumed,
    Cancelled,
    /// This instance claimed a breaker's probe: serve one message.
    Probe,
}

/// Waits while `who` is paused, claiming a breaker's probe for `instance`
/// when one is due (`lease`: how long the claim holds). `updates` must
/// have been taken before the flag was last read.
pub async fn wait_while_paused(
    pauses: &Pauses,
    who: &MemberRef,
    probe: Option<(&str, std::time::Duration)>,
    mut updates: Receiver<Arc<kv::Entry>>,
    cancel: &CancellationToken,
) -> Waited {
    let key = pause_key(who);
    loop {
        let mut recheck_in = RECHECK;
        match pauses.get(who).await {
            Ok(None) => return Waited::Resumed,
            Ok(Some(pause)) => {
                if let (Some((instance, lease)), Some(at)) = (probe, pause.next_probe_at) {
                    let due = at - OffsetDateTime::now_utc();
                    if due <= time::Duration::ZERO {
                        if let Ok(true) = pauses.claim_probe(who, instance, lease).await {
                            return Waited::Probe;
                        }
                    } else {
                        recheck_in = recheck_in.min(due.unsigned_abs());
                    }
                }
            }
            // Unreadable counts as paused: look again soon.
            Err(_) => {}
        }
        let recheck = tokio::time::sleep(recheck_in);
        tokio::pin!(recheck);
        loop {
            let update = tokio::select! {
                () = cancel.cancelled() => return Waited::Cancelled,
                () = &mut recheck => break,
                update = updates.recv() => update,
            };
            match pause_update(&key, update) {
                PauseUpdate::Resumed => return Waited::Resumed,
                // A new pause (a probe failed, another claimed one): read it.
                PauseUpdate::Paused { .. } => break,
                PauseUpdate::Other => {}
                PauseUpdate::Unknown => {
                    // A closed watch answers at once: wait out the recheck.
                    tokio::select! {
                        () = cancel.cancelled() => return Waited::Cancelled,
                        () = &mut recheck => {}
                    }
                    break;
                }
            }
        }
    }
}

/// How often a paused instance reads its flag again, whatever its watch says.
const RECHECK: std::time::Duration = std::time::Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::Owner;
    use crate::names::{GroupName, MemberName, StreamName};

    #[test]
    fn a_group_member_and_a_subscriber_of_one_name_have_their_own_flags() {
        let who = |owner| MemberRef {
            stream: StreamName::parse("S").unwrap(),
            group: GroupName::parse("billing").unwrap(),
            member: MemberName::parse("m1").unwrap(),
            owner,
        };
        assert_eq!(pause_key(&who(Owner::Group)), "group.S.billing.m1");
        assert_eq!(pause_key(&who(Owner::Consumer)), "consumer.S.billing.m1");
    }
}
