//! keygate's KV buckets whose entries expire on their own (presence,
//! leases): opened, or made when missing. Two replicas making one at once
//! both end up with the same bucket.

use std::time::Duration;

use async_nats::jetstream::{self, kv};

/// The bucket `name`, keeping one value per key for at most `max_age`.
pub async fn expiring_bucket(js: &jetstream::Context, name: &str, max_age: Duration) -> Result<kv::Store, String> {
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    let config = kv::Config {
        bucket: name.into(),
        history: 1,
        max_age,
        num_replicas: super::replicas::state_replicas(js),
        ..Default::default()
    };
    match js.create_key_value(config).await {
        Ok(store) => Ok(store),
        Err(created) => js.get_key_value(name).await.map_err(|_| created.to_string()),
    }
}
