//! Samples every group's backlog per partition into the
//! `keygate_partition_pending_messages` gauge (Kafka's consumer lag; what
//! MortarMQ calls `partition_depth`).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::groups::GroupAdmin;
use crate::status::observe::Instances;

/// Samples every `every` until `cancel`. Each sample counts through the
/// same path as a group's GET, so it costs what a GET costs per group.
pub async fn sample_backlog(groups: GroupAdmin, nats: async_nats::Client, every: Duration, cancel: CancellationToken) {
    // Partition counts of the groups reported last time, to zero the gauges
    // of a group that disappears instead of leaving its last value behind.
    let mut reported: BTreeMap<(String, String), u32> = BTreeMap::new();
    loop {
        let mut seen = BTreeMap::new();
        match groups.list_all().await {
            Ok(all) => {
                for (stream, group, kind) in all {
                    if cancel.is_cancelled() {
                        return;
                    }
                    let view = match crate::status::observe::observe(
                        &groups,
                        &nats,
                        &stream,
                        &group,
                        Some(kind),
                        Instances::Skip,
                    )
                    .await
                    {
                        Ok(view) => view,
                        Err(e) => {
                            tracing::debug!(%stream, %group, error = %e.report(), "backlog sample skipped a group");
                            continue;
                        }
                    };
                    for p in &view.partition_pending {
                        if let Some(pending) = p.pending {
                            pending_gauge(stream.as_str(), group.as_str(), p.partition).set(pending as f64);
                        }
                    }
                    seen.insert((stream.to_string(), group.to_string()), view.partitions);
                }
                for ((stream, group), partitions) in &reported {
                    if !seen.contains_key(&(stream.clone(), group.clone())) {
                        for p in 0..*partitions {
                            pending_gauge(stream, group, p).set(0.0);
                        }
                    }
                }
                reported = seen;
            }
            Err(e) => tracing::debug!(error = %e.report(), "backlog sample could not list groups"),
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

fn pending_gauge(stream: &str, group: &str, partition: u32) -> metrics::Gauge {
    metrics::gauge!(crate::telemetry::metrics::PARTITION_PENDING,
        "stream" => stream.to_owned(), "group" => group.to_owned(), "partition" => partition.to_string())
}
