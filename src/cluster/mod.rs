//! What keygate replicas share with each other: who is alive and what it
//! serves (`replicas.rs`, `roster.rs`), pin balancing across replicas
//! (`balance.rs` pure, `rebalance.rs` its loop), and leases that make one
//! replica run a singleton duty (`cluster/lease.rs`). docs/scale-out.md.

pub mod balance;
pub mod control;
pub mod lease;
pub mod rebalance;
pub mod replicas;
pub mod roster;

use std::sync::Arc;

/// This replica's place in the cluster, shared by its instances, its
/// handlers and the balancer: its name, the live replicas, the instances it
/// runs and the webhook pins it holds.
#[derive(Clone)]
pub struct Cluster {
    /// Names this keygate process in events, rosters and control requests.
    pub instance_id: String,
    /// The live keygate replicas and their instances.
    pub replicas: replicas::Replicas,
    /// This process's member instances, published with its replica entry.
    pub roster: Arc<roster::Roster>,
    /// Webhook members served and pinned here, for pin balancing.
    pub pins: Arc<balance::PinLedger>,
    /// Pins a replica may hold beyond its fair share before it steps some down.
    pub balance_slack: usize,
}

impl Cluster {
    /// A replica named `instance_id` that knows of no other yet.
    pub fn new(instance_id: String, balance_slack: usize) -> Self {
        Self {
            instance_id,
            replicas: Default::default(),
            roster: Default::default(),
            pins: Default::default(),
            balance_slack,
        }
    }
}
