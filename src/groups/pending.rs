//! Messages waiting per partition: exact counts from the work-queue
//! stream's subjects (elastic groups) or from the members' consumers
//! (static groups).

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self};
use futures::{StreamExt, TryStreamExt};

use super::config::StaticGroupConfig;
use super::spec::{GroupConfig, GroupKind};
use super::store::GroupAdmin;
use super::view::GroupView;
use super::{GroupError as Error, GroupErrorKind as Kind};
use crate::names::{GroupName, StreamName};
use crate::nats::errors::{is_not_found, unavailable_or_internal};

impl GroupAdmin {
    /// Recounts a static group's backlog for partitions whose serving
    /// instance reports a higher floor than the consumer's ack floor (which
    /// one un-acked message of another partition holds back).
    pub async fn recount_static_pending(
        &self,
        view: &mut GroupView,
        instance_floors: &BTreeMap<u32, u64>,
    ) -> Result<(), Error> {
        if view.kind != GroupKind::Static || instance_floors.is_empty() {
            return Ok(());
        }
        let unreadable = |e| Error::new(Kind::Internal, "a group view's own names").caused_by(e);
        let stream = StreamName::parse(&view.stream).map_err(unreadable)?;
        let group = GroupName::parse(&view.group).map_err(unreadable)?;
        let GroupConfig::Static(config) = self.load(&stream, &group, Some(GroupKind::Static)).await?.config else {
            return Ok(());
        };
        let counts = self.static_pending(stream.as_str(), &config, instance_floors).await?;
        for entry in &mut view.partition_pending {
            if let Some(count) = counts.get(&entry.partition) {
                entry.pending = Some(entry.pending.map_or(*count, |old| old.min(*count)));
            }
        }
        Ok(())
    }

    /// A static group's backlog per partition: messages of the partition
    /// after the given floor, counted by the server through a short-lived
    /// consumer starting there.
    pub(super) async fn static_pending(
        &self,
        stream: &str,
        config: &StaticGroupConfig,
        floor_of: &BTreeMap<u32, u64>,
    ) -> Result<BTreeMap<u32, u64>, Error> {
        let handle =
            self.js.get_stream_no_info(stream).await.map_err(|e| unavailable_or_internal("reading stream", e))?;
        let counts = futures::stream::iter(floor_of.clone())
            .map(|(p, floor)| {
                let handle = handle.clone();
                let filters: Vec<String> = if config.filters.is_empty() || !config.member_mappings.is_empty() {
                    vec![format!("{p}.>")]
                } else {
                    config.filters.iter().map(|f| format!("{p}.{f}")).collect()
                };
                async move {
                    let counter = jetstream::consumer::pull::Config {
                        filter_subjects: filters,
                        deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                            start_sequence: floor + 1,
                        },
                        ack_policy: jetstream::consumer::AckPolicy::None,
                        inactive_threshold: Duration::from_secs(10),
                        memory_storage: true,
                        ..Default::default()
                    };
                    let mut consumer = handle
                        .create_consumer(counter)
                        .await
                        .map_err(|e| unavailable_or_internal("counting backlog", e))?;
                    let info =
                        consumer.info().await.map_err(|e| unavailable_or_internal("counting backlog", e))?.clone();
                    let _ = handle.delete_consumer(&info.name).await;
                    Ok::<_, Error>((p, info.num_pending))
                }
            })
            .buffer_unordered(super::inspect::CONCURRENT_REQUESTS)
            .try_collect::<BTreeMap<u32, u64>>()
            .await?;
        Ok(counts)
    }

    /// Messages a stream stores per leading partition token: an elastic
    /// group's backlog (what is left in its work-queue stream).
    pub(super) async fn subject_counts(&self, wq_stream: &str, partitions: u32) -> Result<BTreeMap<u32, u64>, Error> {
        let handle = match self.js.get_stream(wq_stream).await {
            Ok(h) => h,
            Err(e) if is_not_found(&e) => return Ok(BTreeMap::new()),
            Err(e) => return Err(unavailable_or_internal("reading work-queue stream", e).into()),
        };
        let mut counts = BTreeMap::new();
        if handle.cached_info().state.messages == 0 {
            return Ok(counts);
        }
        let mut subjects =
            handle.info_with_subjects(">").await.map_err(|e| unavailable_or_internal("counting backlog", e))?;
        while let Some(item) = subjects.next().await {
            let (subject, count) = item.map_err(|e| unavailable_or_internal("counting backlog", e))?;
            if let Some(p) = subject.split('.').next().and_then(|t| t.parse::<u32>().ok()).filter(|p| *p < partitions) {
                *counts.entry(p).or_insert(0) += count as u64;
            }
        }
        Ok(counts)
    }
}
