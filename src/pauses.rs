//! Paused members and subscribers: a flag per member in the KV bucket
//! `keygate-pauses`, which every replica's instances watch. A paused
//! member's instances stop pulling, finish what they hold and release the
//! pin, so no standby takes over; its backlog waits in NATS until it is
//! resumed. docs/operations.md describes the routes.

use std::sync::Arc;

use async_nats::jetstream::{self, kv};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::sync::broadcast::{error::RecvError, Receiver};
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use crate::error::Error;
use crate::member_ref::MemberRef;
use crate::nats::errors::unavailable_or_internal;

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
}

/// The flag's key: owner, stream, group (or consumer) and member, all
/// names of `[A-Za-z0-9_-]`, so valid KV key tokens.
pub fn pause_key(who: &MemberRef) -> String {
    format!("{}.{}.{}.{}", who.owner.as_str(), who.stream, who.group, who.member)
}

/// The pause flags.
#[derive(Clone)]
pub struct Pauses {
    js: jetstream::Context,
}

impl Pauses {
    pub fn new(js: jetstream::Context) -> Self {
        Self { js }
    }

    async fn bucket(&self, create: bool) -> Result<Option<kv::Store>, Error> {
        match self.js.get_key_value(PAUSES_BUCKET).await {
            Ok(store) => return Ok(Some(store)),
            Err(_) if !create => return Ok(None),
            Err(_) => {}
        }
        let config = kv::Config {
            bucket: PAUSES_BUCKET.into(),
            description: "keygate: paused members and subscribers".into(),
            history: 1,
            num_replicas: crate::nats::replicas::state_replicas(&self.js),
            ..Default::default()
        };
        match self.js.create_key_value(config).await {
            Ok(store) => Ok(Some(store)),
            Err(e) => self
                .js
                .get_key_value(PAUSES_BUCKET)
                .await
                .map(Some)
                .map_err(|_| unavailable_or_internal("the pauses bucket", e)),
        }
    }

    /// Whether `who` is paused, and by whom.
    pub async fn get(&self, who: &MemberRef) -> Result<Option<Pause>, Error> {
        let Some(store) = self.bucket(false).await? else { return Ok(None) };
        let entry = store.get(pause_key(who)).await.map_err(|e| unavailable_or_internal("reading a pause", e))?;
        Ok(entry.and_then(|bytes| serde_json::from_slice(&bytes).ok()))
    }

    /// Pauses `who`; a member already paused keeps its first pause, which
    /// is answered with `false`.
    pub async fn pause(&self, who: &MemberRef, pause: Pause) -> Result<(Pause, bool), Error> {
        let store = self.bucket(true).await?.ok_or_else(|| Error::Internal("no pauses bucket".into()))?;
        let bytes: bytes::Bytes = serde_json::to_vec(&pause).map_err(|e| Error::Internal(e.to_string()))?.into();
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

    /// Resumes `who`; answers the pause lifted, `None` when it was not paused.
    pub async fn resume(&self, who: &MemberRef) -> Result<Option<Pause>, Error> {
        let Some(lifted) = self.get(who).await? else { return Ok(None) };
        let Some(store) = self.bucket(false).await? else { return Ok(None) };
        store.purge(pause_key(who)).await.map_err(|e| unavailable_or_internal("lifting a pause", e))?;
        Ok(Some(lifted))
    }
}

/// What a watched update of the bucket means for one member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseUpdate {
    Paused,
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
            kv::Operation::Put => PauseUpdate::Paused,
            kv::Operation::Delete | kv::Operation::Purge => PauseUpdate::Resumed,
        },
        Ok(_) => PauseUpdate::Other,
        Err(RecvError::Lagged(_) | RecvError::Closed) => PauseUpdate::Unknown,
    }
}

/// Waits while `who` is paused; true when `cancel` ends the wait. `updates`
/// must have been taken before the flag was last read.
pub async fn wait_while_paused(
    pauses: &Pauses,
    who: &MemberRef,
    mut updates: Receiver<Arc<kv::Entry>>,
    cancel: &CancellationToken,
) -> bool {
    let key = pause_key(who);
    loop {
        // Unreadable counts as paused: look again soon.
        if let Ok(None) = pauses.get(who).await {
            return false;
        }
        let recheck = tokio::time::sleep(RECHECK);
        tokio::pin!(recheck);
        loop {
            let update = tokio::select! {
                () = cancel.cancelled() => return true,
                () = &mut recheck => break,
                update = updates.recv() => update,
            };
            match pause_update(&key, update) {
                PauseUpdate::Resumed => return false,
                PauseUpdate::Paused | PauseUpdate::Other => {}
                PauseUpdate::Unknown => {
                    // A closed watch answers at once: wait out the recheck.
                    tokio::select! {
                        () = cancel.cancelled() => return true,
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
    use crate::member_ref::Owner;
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
