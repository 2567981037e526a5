//! Core NATS subscriptions shared inside the process: every listener of a
//! subject gets the messages through one subscription (a thousand member
//! connections of a hundred members cost a hundred subscriptions).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use tokio::sync::broadcast;

/// Messages buffered per listener before it lags.
const CAPACITY: usize = 256;

/// Shared subscriptions by subject.
#[derive(Clone)]
pub struct SharedSubscriptions {
    nats: async_nats::Client,
    subjects: Arc<Mutex<HashMap<String, broadcast::Sender<async_nats::Message>>>>,
}

impl SharedSubscriptions {
    pub fn new(nats: async_nats::Client) -> Self {
        Self { nats, subjects: Arc::default() }
    }

    /// Messages on `subject` from now on.
    pub async fn subscribe(
        &self,
        subject: &str,
    ) -> Result<broadcast::Receiver<async_nats::Message>, async_nats::SubscribeError> {
        if let Some(sender) = self.lock().get(subject) {
            return Ok(sender.subscribe());
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
            while let Some(message) = subscription.next().await {
                if sender.send(message).is_err() {
                    // Nobody listens: unsubscribe, unless someone arrived
                    // between the send and this lock.
                    let mut subjects = registry.lock().unwrap_or_else(|p| p.into_inner());
                    if sender.receiver_count() == 0 {
                        subjects.remove(&subject);
                        break;
                    }
                }
            }
        });
        Ok(receiver)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, broadcast::Sender<async_nats::Message>>> {
        self.subjects.lock().unwrap_or_else(|p| p.into_inner())
    }
}
