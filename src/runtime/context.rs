//! What every member instance and subscriber of this keygate process
//! shares: its NATS handles, the event bus, webhook client and stores, and
//! one copy of each group's configuration.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;

use super::config_watch::ConfigWatch;
use crate::delivery::webhook::{WebhookClient, WebhookStore};
use crate::events::{About, EventBus};
use crate::groups::{GroupAdmin, GroupConfig};
use crate::member_ref::MemberRef;
use crate::names::{GroupName, StreamName};
use crate::nats::shared::SharedSubscriptions;

/// What every instance shares.
pub struct InstanceContext {
    pub js: jetstream::Context,
    pub nats: async_nats::Client,
    pub events: EventBus,
    pub webhooks: WebhookClient,
    pub webhook_store: WebhookStore,
    /// Plain consumers' subscribers' webhook registrations.
    pub consumer_webhook_store: WebhookStore,
    pub groups: GroupAdmin,
    /// Pause flags, read before joining and watched while serving.
    pub pauses: crate::pauses::Pauses,
    /// This replica's name, its peers, its instances and its pins.
    pub cluster: crate::cluster::Cluster,
    /// Most messages held behind one partition's head before pulling slows
    /// to a trickle.
    pub hold_cap: usize,
    /// How long shutdown waits for deliveries in flight.
    pub shutdown_grace: Duration,
    /// Group configuration updates, watched once for the process.
    pub config_watch: ConfigWatch,
    /// Subscriptions shared by the instances of one member (control requests).
    pub subscriptions: SharedSubscriptions,
    /// Where instances' pull requests are published, to leave together.
    pub outbox: crate::nats::outbox::Outbox,
    /// Connections to NATS made so far: pulls waiting at the server may
    /// not outlive a reconnect, so instances pull again when it changes.
    pub connections: tokio::sync::watch::Receiver<u64>,
    /// The latest configuration of each group, shared by its instances.
    pub configs: Mutex<SharedConfigs>,
}

/// Each group's latest configuration by revision.
pub type SharedConfigs = std::collections::HashMap<(StreamName, GroupName), (u64, Arc<GroupConfig>)>;

impl InstanceContext {
    /// One shared copy of a group's configuration per revision: a thousand
    /// connections of a group's members hold one, not a thousand.
    pub(crate) fn share_config(&self, who: &MemberRef, revision: u64, config: GroupConfig) -> Arc<GroupConfig> {
        let mut configs = self.configs.lock().unwrap_or_else(|p| p.into_inner());
        let key = (who.stream.clone(), who.group.clone());
        match configs.get(&key) {
            Some((known, shared)) if *known == revision => shared.clone(),
            _ => {
                let shared = Arc::new(config);
                configs.insert(key, (revision, shared.clone()));
                shared
            }
        }
    }

    /// Events about `who` seen by this keygate.
    pub fn about<'a>(&'a self, who: &'a MemberRef) -> About<'a> {
        About { who, instance: &self.cluster.instance_id }
    }
}
