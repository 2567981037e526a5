//! How many replicas keygate gives its own state (its KV buckets and the
//! dead-letter stream). Streams and buckets created for a user's stream
//! follow that stream's replicas instead, as pcgroups does.

/// The replicas for keygate's own state when `--state-replicas` is not
/// given: 3 when the server keygate talks to reports a cluster of three or
/// more servers (JetStream's usual R3) and 1 otherwise. Asked when a bucket
/// is created, so the connection is up and the server has said who its
/// peers are. Existing buckets keep the replicas they were created with.
pub fn default_for(info: &async_nats::ServerInfo) -> usize {
    // `connect_urls` lists the client URLs of every server in the cluster.
    let servers = info.connect_urls.len().max(1);
    if servers >= 3 {
        3
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_servers_or_more_mean_r3_fewer_mean_r1() {
        let with = |urls: usize| async_nats::ServerInfo {
            connect_urls: (0..urls).map(|i| format!("127.0.0.1:{}", 4222 + i)).collect(),
            ..Default::default()
        };
        assert_eq!(default_for(&with(0)), 1);
        assert_eq!(default_for(&with(2)), 1);
        assert_eq!(default_for(&with(3)), 3);
        assert_eq!(default_for(&with(5)), 3);
    }
}
