//! Core NATS subscriptions shared inside the process: every listener of a
//! subject gets the messages through one subscription (a thousand member
//! connections of a hundred members cost a hundred subscriptions). Subjects
//! under a routed prefix, whose traffic is rare, share one wildcard
//! subscription for all of them and are told apart here by subject.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use tokio::sync::{broadcast, OnceCell};

/// Messages buffered per listener before it lags. A broadcast channel
/// allocates every slot up front and there is one channel per member
/// subject, so slots hold pointers.
const CAPACITY: usize = 64;

type Registry = Arc<Mutex<HashMap<String, broadcast::Sender<Arc<async_nats::Message>>>>>;

/// Shared subscriptions by subject.
#[derive(Clone)]
pub struct SharedSubscriptions {
    nats: async_nats::Client,
    subjects: Registry,
    /// Prefixes served by one wildcard subscription each, started on first use.
    routed: Arc<[(&'static str, OnceCell<()>)]>,
}

impl SharedSubscriptions {
    /// `routed_prefixes` end with a dot; each gets one `<prefix>>` subscription.
    pub fn new(nats: async_nats::Client, routed_prefixes: &[&'static str]) -> Self {
        let routed = routed_prefixes.iter().map(|p| (*p, OnceCell::new())).collect();
        Self { nats, subjects: Arc::default(), routed }
    }

    /// Messages on `subject` from now on.
    pub async fn subscribe(
        &self,
        subject: &str,
    ) -> Result<broadcast::Receiver<Arc<async_nats::Message>>, async_nats::SubscribeError> {
        if let Some(sender) = self.lock().get(subject) {
            return Ok(sender.subscribe());
        }
        if let Some((prefix, started)) = self.routed.iter().find(|(prefix, _)| subject.starts_with(prefix)) {
            started.get_or_try_init(|| self.route(prefix)).await?;
            let mut subjects = self.lock();
            if let Some(sender) = subjects.get(subject) {
                return Ok(sender.subscribe());
            }
            let (sender, receiver) = broadcast::channel(CAPACITY);
            subjects.insert(subject.to_owned(), sender.clone());
            // The entry goes when its last listener does, not when a message
            // next arrives: a subject used once (a fresh member name) would
            // otherwise stay for ever.
            let registry = self.subjects.clone();
            let subject = subject.to_owned();
            tokio::spawn(async move { while !forget_when_unheard(&registry, &subject, &sender).await {} });
            return Ok(receiver);
        }
        let mut subscription = self.nats.subscribe(subject.to_owned()).await?;
        let (sender, receiver) = {
            let mut subjects = self.lock();
            if let Some(sender) = subjects.get(subject) {
                // Another listener subscribed meanwhile: share its subscription.
                return Ok(sender.subscribe());
            }
            let (sender, receiver) = broadcast::channel(CAPACITY);
            subjects.insert(subject.to_owned(), sender.clone());
            (sender, receiver)
        };
        let registry = self.subjects.clone();
        let subject = subject.to_owned();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    message = subscription.next() => {
                        let Some(message) = message else { break };
                        let _ = sender.send(Arc::new(detached(message)));
                    }
                    // Nobody listens any more: unsubscribe (dropping it).
                    forgotten = forget_when_unheard(&registry, &subject, &sender) => if forgotten { break },
                }
            }
        });
        Ok(receiver)
    }

    /// One subscription for every subject under `prefix`, handing each
    /// message to the listeners of its subject.
    async fn route(&self, prefix: &str) -> Result<(), async_nats::SubscribeError> {
        let mut subscription = self.nats.subscribe(format!("{prefix}>")).await?;
        let registry = self.subjects.clone();
        tokio::spawn(async move {
            while let Some(message) = subscription.next().await {
                let subjects = registry.lock().unwrap_or_else(|p| p.into_inner());
                let subject = message.subject.as_str().to_owned();
                let Some(sender) = subjects.get(&subject) else { continue };
                let _ = sender.send(Arc::new(detached(message)));
            }
        });
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, broadcast::Sender<Arc<async_nats::Message>>>> {
        self.subjects.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Subjects with an entry (for tests and leak checks).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no subject has an entry.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// Waits until `sender` has no listeners, then removes its entry; false when
/// a listener arrived in between (the entry stays, wait again).
async fn forget_when_unheard(
    registry: &Registry,
    subject: &str,
    sender: &broadcast::Sender<Arc<async_nats::Message>>,
) -> bool {
    sender.closed().await;
    let mut subjects = registry.lock().unwrap_or_else(|p| p.into_inner());
    if sender.receiver_count() > 0 {
        return false;
    }
    if subjects.get(subject).is_some_and(|s| s.same_channel(sender)) {
        subjects.remove(subject);
    }
    true
}

/// The message with its own copies of subject, reply and payload. A received
/// message borrows the connection's read buffer, and a broadcast slot keeps
/// its last message until overwritten: without the copy, every idle channel
/// would pin a read-buffer block of up to 64 KiB.
fn detached(message: async_nats::Message) -> async_nats::Message {
    async_nats::Message {
        subject: async_nats::Subject::from(message.subject.as_str()),
        reply: message.reply.map(|reply| async_nats::Subject::from(reply.as_str())),
        payload: bytes::Bytes::copy_from_slice(&message.payload),
        ..message
    }
}
