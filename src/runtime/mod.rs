//! The instance runtime: every place a group member or a plain consumer's
//! subscriber is served (a webhook on every replica, a WebSocket
//! connection, an HTTP pull client) runs one instance of the same driver.
//! - `instance.rs`: pause/probe → join → drive → rejoin, for either target;
//! - `driver/`: one run against the joined consumer: pulls, the pin and its
//!   handover barrier, fencing, and dispatch by lanes (key or partition
//!   order) or by plain concurrency (with the shuffle window);
//! - `lanes.rs`, `pin.rs`, `pull.rs`: the pure cores the driver feeds;
//! - `deliver.rs`: one delivery and what its verdict does;
//! - `outputs.rs`: an answer's outputs, stored before its message is acked;
//! - `runtime/supervisor.rs`, `runtime/pull_instances.rs`: who starts instances.

pub mod barrier;
pub mod config_watch;
pub mod deliver;
pub mod driver;
pub mod endpoint;
pub mod fencing;
pub mod instance;
pub mod join;
pub mod lanes;
pub mod outputs;
pub mod pin;
pub mod pull;
pub mod pull_instances;
pub mod shuffle_window;
pub mod supervisor;
pub mod target;
pub mod window_share;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;

use self::config_watch::ConfigWatch;
use crate::cluster::Cluster;
use crate::events::{About, EventBus};
use crate::groups::{GroupAdmin, GroupConfig};
use crate::names::MemberRef;
use crate::names::{GroupName, StreamName};
use crate::nats::buckets::Buckets;
use crate::nats::outbox::Outbox;
use crate::nats::shared::SharedSubscriptions;
use crate::settings::Settings;
use crate::webhook::{WebhookClient, WebhookStore};

/// What keygate runs on: built whole before serving, shared by the HTTP
/// handlers and every instance.
pub struct Runtime {
    pub broker: Broker,
    pub stores: Stores,
    /// This replica's name, its peers, its instances and its pins.
    pub cluster: Cluster,
    pub events: EventBus,
    /// Calls webhooks, checking every connection against the destination policy.
    pub webhook_client: WebhookClient,
    /// Group configuration, settings and pause updates, watched once for the process.
    pub config_watch: ConfigWatch,
    /// The latest configuration of each group, shared by its instances.
    configs: Mutex<SharedConfigs>,
    /// Most messages held behind one partition's head before pulling slows
    /// to a trickle.
    pub hold_cap: usize,
    /// How long shutdown waits for deliveries in flight.
    pub shutdown_grace: Duration,
}

/// keygate's NATS connection and what it shares over it.
pub struct Broker {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    /// keygate's own buckets, made with the replicas its state takes.
    pub buckets: Buckets,
    /// Where instances' pull requests are published, to leave together.
    pub outbox: Outbox,
    /// Subscriptions shared by the instances of one member (control requests).
    pub subscriptions: SharedSubscriptions,
    /// Connections to NATS made so far: pulls waiting at the server may
    /// not outlive a reconnect, so instances pull again when it changes.
    pub connections: tokio::sync::watch::Receiver<u64>,
    /// Consumer leader elections of the consumers served here (custody).
    pub consumer_leaders: Arc<crate::nats::consumer_leaders::ConsumerLeaders>,
    /// The atomic batches batch publishes may hold open for keys' runs.
    pub run_slots: crate::publish::RunSlots,
}

/// keygate's state in NATS, each behind its own store.
#[derive(Clone)]
pub struct Stores {
    pub groups: GroupAdmin,
    /// Pause flags, read before joining and watched while serving.
    pub pauses: crate::pauses::Pauses,
    /// Group members' webhook registrations.
    pub webhooks: WebhookStore,
    /// Plain consumers' subscribers' webhook registrations.
    pub consumer_webhooks: WebhookStore,
    /// The dead-letter stream, browsed and redriven through the API.
    pub dead_letters: crate::dead_letters::Archive,
    /// Streams, and the shapes publishing needs (publishers' messages and
    /// endpoints' outputs).
    pub streams: crate::streams::Streams,
}

impl Runtime {
    /// Everything keygate runs on, over an established connection
    /// (`connections` counts its reconnects).
    pub fn start(
        settings: &Settings,
        client: async_nats::Client,
        connections: tokio::sync::watch::Receiver<u64>,
    ) -> anyhow::Result<Self> {
        let js = crate::nats::connect::jetstream(client.clone(), settings.nats_timeout);
        let policy = Arc::new(settings.destinations.clone());
        let instance_id = settings
            .instance_id
            .clone()
            .unwrap_or_else(|| format!("keygate-{}", client.new_inbox().rsplit('.').next().unwrap_or("0")));
        let buckets = Buckets::new(js.clone(), settings.state_replicas);
        let stores = Stores {
            groups: GroupAdmin::new(buckets.clone()),
            pauses: crate::pauses::Pauses::new(buckets.clone()),
            webhooks: WebhookStore::new(buckets.clone(), policy.clone()),
            consumer_webhooks: WebhookStore::for_consumers(buckets.clone(), policy.clone()),
            dead_letters: crate::dead_letters::Archive::new(buckets.clone()),
            streams: crate::streams::Streams::new(js.clone()),
        };
        let runtime = Self {
            events: EventBus::new(client.clone()),
            webhook_client: WebhookClient::new(policy)?,
            config_watch: ConfigWatch::new(js.clone()),
            configs: Mutex::default(),
            cluster: Cluster::new(instance_id, settings.pin_balance_slack),
            hold_cap: settings.hold_cap,
            shutdown_grace: settings.delivery_grace,
            stores,
            broker: Broker {
                subscriptions: SharedSubscriptions::new(client.clone(), &[crate::cluster::control::CONTROL_PREFIX]),
                outbox: Outbox::start(client.clone()),
                connections,
                consumer_leaders: crate::nats::consumer_leaders::ConsumerLeaders::start(client.clone()),
                buckets,
                client,
                js,
                run_slots: Default::default(),
            },
        };
        // The configuration watchers start now rather than with the first member.
        for bucket in [crate::groups::config::STATIC_BUCKET, crate::groups::config::ELASTIC_BUCKET] {
            drop(runtime.config_watch.subscribe(bucket));
        }
        Ok(runtime)
    }

    /// The largest message the server accepts.
    pub fn max_payload(&self) -> usize {
        // An atomic load: `server_info()` would copy the whole INFO (its
        // strings and URL lists) on every publish.
        match self.broker.client.max_payload() {
            0 => 1024 * 1024,
            n => n,
        }
    }
}

/// Each group's latest configuration by revision.
pub type SharedConfigs = std::collections::HashMap<(StreamName, GroupName), (u64, Arc<GroupConfig>)>;

impl Runtime {
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
