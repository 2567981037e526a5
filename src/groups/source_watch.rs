//! A watchdog for elastic groups' work-queue streams on clustered JetStream.
//! Such a stream sources its group's stream. After leader changes, the
//! server's source consumer can stay down (the stream reports the source
//! never active, or not for long, with no lag) until the work-queue stream
//! gets a new leader, which rebuilds its sources (nats-server pull request
//! 8323 and its discussion; seen here in the cluster test). The group then
//! gets no new messages. The watchdog asks the server to step the leader
//! down when a source stays inactive across two checks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::config::elastic_stream_name;
use super::GroupAdmin;
use super::GroupKind;

/// How often the work-queue streams are checked.
const EVERY: Duration = Duration::from_secs(5);
/// A source quiet for this long is suspect (a live one hears heartbeats every few seconds).
const QUIET: Duration = Duration::from_secs(10);
/// At least this long between two step-downs of one stream.
const SPACING: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
struct StepDownResponse {
    #[serde(default)]
    success: bool,
}

pub async fn watch_sources(groups: GroupAdmin, js: jetstream::Context, cancel: CancellationToken) {
    // Streams found quiet on the previous check, and when each was last stepped down.
    let mut suspects: HashMap<String, Instant> = HashMap::new();
    let mut stepped_down: HashMap<String, Instant> = HashMap::new();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(EVERY) => {}
        }
        let Ok(all) = groups.list_all().await else { continue };
        for (stream, group, kind) in all {
            if kind != GroupKind::Elastic {
                continue;
            }
            let name = elastic_stream_name(stream.as_str(), group.as_str());
            let Ok(mut work_queue) = js.get_stream(&name).await else { continue };
            let Ok(info) = work_queue.info().await else { continue };
            let clustered = info.cluster.as_ref().is_some_and(|c| !c.replicas.is_empty());
            let quiet = info.sources.iter().any(|s| s.active.is_none_or(|a| a > QUIET));
            if !clustered || !quiet {
                suspects.remove(&name);
                continue;
            }
            let first_seen = *suspects.entry(name.clone()).or_insert_with(Instant::now);
            let recently = stepped_down.get(&name).is_some_and(|at| at.elapsed() < SPACING);
            if first_seen.elapsed() < EVERY || recently {
                continue;
            }
            let subject = format!("STREAM.LEADER.STEPDOWN.{name}");
            let answer: Result<StepDownResponse, _> = js.request(subject, &()).await;
            let success = answer.as_ref().is_ok_and(|r| r.success);
            tracing::warn!(
                stream = %stream, group = %group, work_queue = %name, success,
                "the elastic group's source stayed inactive; asked its work-queue stream's leader to step down"
            );
            metrics::counter!(crate::telemetry::metrics::SOURCE_RESTARTS, "stream" => stream.to_string(), "group" => group.to_string())
                .increment(1);
            stepped_down.insert(name.clone(), Instant::now());
            suspects.remove(&name);
        }
    }
}
