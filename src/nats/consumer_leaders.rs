//! Consumer leader elections, as the server announces them: a count per
//! consumer keygate serves, raised by every
//! `$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.<stream>.<consumer>`.
//!
//! Custody (delivery/custody.rs) reads it. A new consumer leader works from
//! the replicated state, which can lag: keep-alives sent while no leader
//! was there went nowhere, and deliveries the old leader made may be
//! unknown to it. It may therefore give a message to another instance while
//! the instance that received it before the election still holds it and
//! its keep-alives look on time; that instance's later ack would settle
//! the other copy too. So a message that arrived before an election of its
//! consumer's leader is no longer settled by the instance that has it.
//!
//! The server sends the advisory before the new leader starts delivering,
//! so it normally arrives first. Only consumers someone watches are
//! counted: the map is as large as the set of consumers served here, not
//! the account's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use futures::StreamExt;

/// Where the server announces a consumer's new leader.
const LEADER_ELECTED: &str = "$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED";

/// Elections counted per watched consumer.
#[derive(Default)]
pub struct ConsumerLeaders {
    /// Weak: a consumer nobody watches any more is dropped at the next watch.
    elections: Mutex<HashMap<(String, String), Weak<AtomicU64>>>,
}

impl ConsumerLeaders {
    /// Starts listening for elections on `client`; runs until the client closes.
    pub fn start(client: async_nats::Client) -> Arc<Self> {
        let leaders = Arc::new(Self::default());
        let listening = leaders.clone();
        tokio::spawn(async move {
            let mut advisories = match client.subscribe(format!("{LEADER_ELECTED}.>")).await {
                Ok(subscription) => subscription,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot follow consumer leader elections; a settlement after one may reach a copy given elsewhere");
                    return;
                }
            };
            while let Some(advisory) = advisories.next().await {
                if let Some((stream, consumer)) = consumer_of(&advisory.subject) {
                    listening.elected(stream, consumer);
                }
            }
        });
        leaders
    }

    /// The election count of one consumer, shared with everyone watching it.
    pub fn watch(&self, stream: &str, consumer: &str) -> Arc<AtomicU64> {
        let mut elections = self.elections.lock().unwrap_or_else(|p| p.into_inner());
        elections.retain(|_, count| count.strong_count() > 0);
        let key = (stream.to_owned(), consumer.to_owned());
        if let Some(count) = elections.get(&key).and_then(Weak::upgrade) {
            return count;
        }
        let count = Arc::new(AtomicU64::new(0));
        elections.insert(key, Arc::downgrade(&count));
        count
    }

    fn elected(&self, stream: &str, consumer: &str) {
        let elections = self.elections.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = elections.get(&(stream.to_owned(), consumer.to_owned())).and_then(Weak::upgrade) {
            count.fetch_add(1, Ordering::AcqRel);
            tracing::debug!(
                stream,
                consumer,
                "consumer leader elected: messages received before it are no longer settled here"
            );
        }
    }
}

/// The stream and consumer an advisory's subject names (neither name can
/// hold a dot).
fn consumer_of(subject: &str) -> Option<(&str, &str)> {
    let rest = subject.strip_prefix(LEADER_ELECTED)?.strip_prefix('.')?;
    let (stream, consumer) = rest.split_once('.')?;
    (!stream.is_empty() && !consumer.is_empty() && !consumer.contains('.')).then_some((stream, consumer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subject_names_the_stream_and_consumer() {
        assert_eq!(consumer_of("$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.ORD.enrich-m1"), Some(("ORD", "enrich-m1")));
        assert_eq!(consumer_of("$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.ORD"), None);
        assert_eq!(consumer_of("$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.ORD.a.b"), None);
        assert_eq!(consumer_of("$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.ORD"), None);
    }

    #[test]
    fn an_election_counts_for_its_watchers_only_and_unwatched_consumers_are_forgotten() {
        let leaders = ConsumerLeaders::default();
        let watched = leaders.watch("ORD", "g-m1");
        let again = leaders.watch("ORD", "g-m1");
        let other = leaders.watch("ORD", "g-m2");
        leaders.elected("ORD", "g-m1");
        leaders.elected("PAY", "g-m1");
        assert_eq!((watched.load(Ordering::Acquire), again.load(Ordering::Acquire)), (1, 1));
        assert_eq!(other.load(Ordering::Acquire), 0);
        drop(other);
        drop(leaders.watch("ORD", "g-m3"));
        let _still = leaders.watch("ORD", "g-m1");
        assert_eq!(leaders.elections.lock().unwrap().len(), 1, "only g-m1 is still watched");
    }
}
