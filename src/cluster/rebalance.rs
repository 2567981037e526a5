//! The pin balancer's loop (docs/scale-out.md): every few seconds, each
//! replica steps down the pins it holds beyond its fair share of a group's
//! (the rules are in `balance.rs`), by a step-down published on the
//! member's control subject to its own instance.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::balance::{fair_share, to_step_down, GroupShare, MIN_TENURE, STEP_DOWN_HOLD};
use super::control::{control_subject, Control};
use super::Cluster;
use crate::names::MemberRef;

/// How often each replica compares its pins with its share (jittered).
const BALANCE_EVERY: Duration = Duration::from_secs(1);

/// Steps down this replica's excess pins until `cancel`.
pub async fn run_balancer(cluster: Cluster, nats: async_nats::Client, cancel: CancellationToken) {
    let slack = cluster.balance_slack;
    let mut counted = cluster.replicas.count();
    loop {
        let wait = BALANCE_EVERY + Duration::from_millis(rand::random::<u64>() % 1000);
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = cancel.cancelled() => return,
        }
        let replicas = cluster.replicas.count();
        if replicas != counted {
            // Standbys holding back while their replica had its share look again.
            counted = replicas;
            cluster.pins.replicas_changed();
        }
        let mut moves = 0;
        for GroupShare { stream, group, served, pinned } in cluster.pins.snapshot() {
            let share = fair_share(served, replicas, slack);
            for member in to_step_down(&pinned, share, Instant::now(), MIN_TENURE) {
                let reason = format!(
                    "rebalancing: this keygate held {} of the group's {served} webhook pins; its share across {replicas} replicas is {share}",
                    pinned.len()
                );
                let who = MemberRef { stream: stream.clone(), group: group.clone(), member, owner: Default::default() };
                let step_down = Control::StepDown {
                    instance: cluster.instance_id.clone(),
                    hold_ms: STEP_DOWN_HOLD.as_millis() as u64,
                    reason,
                };
                let Ok(payload) = serde_json::to_vec(&step_down) else { continue };
                if nats.publish(control_subject(&who), payload.into()).await.is_ok() {
                    metrics::counter!(crate::telemetry::metrics::PIN_REBALANCES, "stream" => stream.to_string(), "group" => group.to_string())
                        .increment(1);
                    moves += 1;
                }
            }
        }
        if moves > 0 {
            tracing::info!(replicas, moves, "stepping down pins over this keygate's share");
        }
    }
}
