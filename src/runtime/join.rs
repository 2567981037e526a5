//! A member's consumer, created exactly as pcgroups creates it so Go and
//! keygate instances of one member share it.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};

use crate::groups::config::PRIORITY_GROUP;
use crate::groups::spec::{consumer_of, filter_subjects_of};
use crate::groups::{GroupConfig, GroupKind};
use crate::nats::errors::jetstream_error_code;

/// The server's "consumer already exists" code (different configuration).
const CONSUMER_EXISTS: u64 = 10148;
/// The server's "filtered consumer not unique on workqueue stream" code.
const FILTER_OVERLAP: u64 = 10100;

/// Why joining failed.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The member owns no partitions now.
    #[error("the member owns no partitions")]
    NoPartitions,
    /// Another member's consumer still holds some of these partitions
    /// (elastic rebalance in progress): retry after ack wait + 500 ms.
    #[error("another member still consumes some of these partitions")]
    Overlap,
    #[error("creating the member's consumer: {0}")]
    Other(String),
}

/// The pinned TTL pcgroups uses: the ack wait, at least one second.
pub fn pinned_ttl(ack_wait: Duration) -> Duration {
    ack_wait.max(Duration::from_secs(1))
}

/// The pull expiry pcgroups uses: half the ack wait, at least one second.
/// The pin holder pulls with it: each of its pulls renews the pin, so one
/// must reach the server well within the pinned TTL.
pub fn pull_expiry(ack_wait: Duration) -> Duration {
    (ack_wait / 2).max(Duration::from_secs(1))
}

/// How long a standby's pull waits at the server: the pinned TTL. A
/// standby's pull renews no pin; it only has to be waiting when the pin
/// comes free, so it is renewed half as often as the holder's (a thousand
/// idle members' standbys cost half as much). The first message it brings
/// makes it the holder, and its next pull is a holder's.
pub fn standby_pull_expiry(ack_wait: Duration) -> Duration {
    pinned_ttl(ack_wait)
}

/// The consumer configuration of `member` (pcgroups' fields and defaults).
pub fn member_config(config: &GroupConfig, group: &str, member: &str, ack_wait: Duration) -> consumer::pull::Config {
    let (_, name) = consumer_of(config, "", group, member);
    let mut c = consumer::pull::Config {
        filter_subjects: filter_subjects_of(config, member),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait,
        priority_groups: vec![PRIORITY_GROUP.to_owned()],
        priority_policy: consumer::PriorityPolicy::PinnedClient,
        priority_timeout: pinned_ttl(ack_wait),
        ..Default::default()
    };
    match config.kind() {
        GroupKind::Static => c.durable_name = Some(name),
        GroupKind::Elastic => {
            c.name = Some(name);
            c.inactive_threshold = ack_wait;
        }
    }
    c
}

/// Creates the member's consumer (or finds the identical one another
/// instance created). Elastic: an existing consumer with another
/// configuration belongs to the member's previous assignment; pcgroups
/// deletes it at once, keygate first gives its pinned instance (which may
/// still be finishing deliveries, and deletes it itself) up to ack wait +
/// 500 ms, then deletes it.
pub async fn join(
    js: &jetstream::Context,
    config: &GroupConfig,
    stream: &str,
    group: &str,
    member: &str,
    ack_wait: Duration,
) -> Result<(String, String), JoinError> {
    let mut wanted = member_config(config, group, member, ack_wait);
    if wanted.filter_subjects.is_empty() {
        return Err(JoinError::NoPartitions);
    }
    let (stream_name, consumer_name) = consumer_of(config, stream, group, member);
    let handle = js.get_stream_no_info(&stream_name).await.map_err(|e| JoinError::Other(e.to_string()))?;
    let patience = tokio::time::Instant::now() + ack_wait + Duration::from_millis(500);
    let mut deletes = 0;
    let mut adopted_start = false;
    loop {
        let error = match handle.create_consumer_strict(wanted.clone()).await {
            Ok(_) => return Ok((stream_name, consumer_name)),
            Err(e) => e,
        };
        let exists = jetstream_error_code(&error) == Some(CONSUMER_EXISTS)
            || error.kind() == jetstream::stream::ConsumerCreateStrictErrorKind::AlreadyExists;
        match jetstream_error_code(&error) {
            Some(FILTER_OVERLAP) => return Err(JoinError::Overlap),
            // A seek made the static consumer again at another start
            // (src/seek.rs): join it as it is, once.
            _ if exists && config.kind() == GroupKind::Static && !adopted_start => {
                adopted_start = true;
                if let Ok(info) = handle.consumer_info(&consumer_name).await {
                    wanted.deliver_policy = info.config.deliver_policy;
                }
            }
            _ if exists && config.kind() == GroupKind::Elastic => {
                if tokio::time::Instant::now() < patience {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
                if deletes == 3 {
                    return Err(JoinError::Other("the consumer kept changing while joining".into()));
                }
                deletes += 1;
                let _ = handle.delete_consumer(&consumer_name).await;
            }
            _ => return Err(JoinError::Other(error.to_string())),
        }
    }
}

/// Deletes the member's consumer if it still has `filters` (the pinned
/// instance's part of a rebalance): a consumer another instance already
/// recreated with the new filters is left alone.
pub async fn delete_if_unchanged(js: &jetstream::Context, stream: &str, consumer: &str, filters: &[String]) {
    let Ok(handle) = js.get_stream_no_info(stream).await else { return };
    match handle.consumer_info(consumer).await {
        Ok(info) if info.config.filter_subjects == filters => {
            let _ = handle.delete_consumer(consumer).await;
        }
        _ => {}
    }
}
