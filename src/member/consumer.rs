//! A member's consumer, created exactly as pcgroups creates it so Go and
//! keygate instances of one member share it.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};

use crate::groups::admin::{consumer_of, filter_subjects_of};
use crate::groups::config::PRIORITY_GROUP;
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
pub fn pull_expiry(ack_wait: Duration) -> Duration {
    (ack_wait / 2).max(Duration::from_secs(1))
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
/// configuration is deleted and created again, as pcgroups does.
pub async fn join(
    js: &jetstream::Context,
    config: &GroupConfig,
    stream: &str,
    group: &str,
    member: &str,
    ack_wait: Duration,
) -> Result<(String, String), JoinError> {
    let wanted = member_config(config, group, member, ack_wait);
    if wanted.filter_subjects.is_empty() {
        return Err(JoinError::NoPartitions);
    }
    let (stream_name, consumer_name) = consumer_of(config, stream, group, member);
    let handle = js.get_stream_no_info(&stream_name).await.map_err(|e| JoinError::Other(e.to_string()))?;
    for _ in 0..3 {
        match handle.create_consumer_strict(wanted.clone()).await {
            Ok(_) => return Ok((stream_name, consumer_name)),
            Err(e) => match jetstream_error_code(&e) {
                Some(FILTER_OVERLAP) => return Err(JoinError::Overlap),
                Some(CONSUMER_EXISTS) if config.kind() == GroupKind::Elastic => {
                    let _ = handle.delete_consumer(&consumer_name).await;
                }
                _ if e.kind() == jetstream::stream::ConsumerCreateStrictErrorKind::AlreadyExists
                    && config.kind() == GroupKind::Elastic =>
                {
                    let _ = handle.delete_consumer(&consumer_name).await;
                }
                _ => return Err(JoinError::Other(e.to_string())),
            },
        }
    }
    Err(JoinError::Other("the consumer kept changing while joining".into()))
}
