//! What a run watches besides its pulls: the group's configuration and
//! keygate's settings of it (members), and pause flags; and how a change
//! of either ends the run.

use std::sync::Arc;

use async_nats::jetstream::kv::{Entry, Operation};
use futures::StreamExt;
use tokio::sync::broadcast::{error::RecvError, Receiver};
use tokio_stream::wrappers::{errors::BroadcastStreamRecvError, BroadcastStream};

use super::{Driver, Ended};
use crate::groups::config::config_key;
use crate::groups::spec::filter_subjects_of;
use crate::groups::GroupSettings;

/// The channels a run listens to besides its pulls.
pub struct Watches {
    /// The group's configuration changes (members).
    pub configs: Option<Receiver<Arc<Entry>>>,
    /// keygate's settings of groups (members).
    pub settings: Option<Receiver<Arc<Entry>>>,
    /// Pause flags.
    pub pauses: Receiver<Arc<Entry>>,
}

impl Driver {
    /// A change of the group's configuration ends the session when it
    /// changes what this member consumes.
    pub(super) fn on_config_update(&self, update: Result<Arc<Entry>, RecvError>) -> Option<Ended> {
        let key = config_key(self.who().stream.as_str(), self.who().group.as_str());
        let entry = match update {
            Ok(entry) if entry.key == key => entry,
            // Missed updates: read the configuration again.
            Err(RecvError::Lagged(_)) => return Some(Ended::Rejoin { pinned: false }),
            Ok(_) | Err(RecvError::Closed) => return None,
        };
        if entry.operation != Operation::Put {
            return Some(Ended::Rejoin { pinned: false });
        }
        let joined = self.joined.member()?;
        if entry.revision <= joined.revision {
            return None;
        }
        let member = self.who().member.as_str();
        let config = &joined.config;
        let changed = match crate::groups::store::parse_stored(config.kind(), &entry.value) {
            Ok(next) => {
                next.partitions() != config.partitions()
                    || filter_subjects_of(&next, member) != filter_subjects_of(config, member)
            }
            Err(_) => true,
        };
        changed.then_some(Ended::Rejoin { pinned: self.pin.is_pinned() })
    }

    /// A change of keygate's settings of this group (its ordering, its ack
    /// wait) ends the session, which joins again with them.
    pub(super) fn on_settings_update(&self, update: Result<Arc<Entry>, RecvError>) -> Option<Ended> {
        let key = config_key(self.who().stream.as_str(), self.who().group.as_str());
        let entry = match update {
            Ok(entry) if entry.key == key => entry,
            Err(RecvError::Lagged(_)) => return Some(Ended::Rejoin { pinned: self.pin.is_pinned() }),
            Ok(_) | Err(RecvError::Closed) => return None,
        };
        let next: GroupSettings = match entry.operation {
            Operation::Put => serde_json::from_slice(&entry.value).unwrap_or_default(),
            Operation::Delete | Operation::Purge => GroupSettings::default(),
        };
        let current = &self.joined.member()?.settings;
        let changed = next.ordering() != current.ordering() || next.ack_wait_ms != current.ack_wait_ms;
        changed.then_some(Ended::Rejoin { pinned: self.pin.is_pinned() })
    }
}

/// A broadcast stream's item as the channel's own `recv` tells it.
pub(super) fn received<T>(item: Option<Result<T, BroadcastStreamRecvError>>) -> Result<T, RecvError> {
    match item {
        Some(Ok(value)) => Ok(value),
        Some(Err(BroadcastStreamRecvError::Lagged(missed))) => Err(RecvError::Lagged(missed)),
        None => Err(RecvError::Closed),
    }
}

/// The next item of a stream the run may not have: never, without one.
pub(super) async fn next_of<T: Clone + Send + 'static>(
    stream: &mut Option<BroadcastStream<T>>,
) -> Option<Result<T, RecvError>> {
    match stream {
        Some(stream) => Some(received(stream.next().await)),
        None => std::future::pending().await,
    }
}
