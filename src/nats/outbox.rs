//! Publishes from many tasks, sent together: the member instances' pull
//! requests. Each instance used to publish its own, and async-nats wrote
//! each publish to the socket on its own (its connection task runs right
//! after the task that woke it), so a thousand idle instances renewing
//! their pulls cost a system call each, twice: keygate's write and the
//! server's read. Queued here, the publishes of every instance woken by
//! one burst of replies leave in one write.

use bytes::Bytes;
use tokio::sync::mpsc;

/// Publishes waiting to go out; beyond that, a publish goes out directly.
const QUEUED: usize = 16_384;

struct Publish {
    subject: String,
    reply: String,
    payload: Bytes,
}

/// A queue of publishes drained by one task; dropped with its last clone.
#[derive(Clone)]
pub struct Outbox {
    nats: async_nats::Client,
    queue: mpsc::Sender<Publish>,
}

impl Outbox {
    /// Starts the task that sends what is queued, through `nats`.
    pub fn start(nats: async_nats::Client) -> Self {
        let (queue, queued) = mpsc::channel(QUEUED);
        tokio::spawn(send_queued(nats.clone(), queued));
        Self { nats, queue }
    }

    /// Publishes `payload` on `subject`, answers to `reply`; an error only
    /// when the connection cannot take it (a full queue goes out directly).
    pub async fn publish_with_reply(
        &self,
        subject: String,
        reply: String,
        payload: Bytes,
    ) -> Result<(), async_nats::PublishError> {
        match self.queue.try_send(Publish { subject, reply, payload }) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(p) | mpsc::error::TrySendError::Closed(p)) => {
                self.nats.publish_with_reply(p.subject, p.reply, p.payload).await
            }
        }
    }
}

/// Woken by the first publish of a burst, it lets the other tasks of the
/// burst run first (they are queued behind it), then hands everything
/// queued to the connection without yielding, so the connection's task
/// writes it at once.
async fn send_queued(nats: async_nats::Client, mut queued: mpsc::Receiver<Publish>) {
    while let Some(first) = queued.recv().await {
        tokio::task::yield_now().await;
        let mut next = Some(first);
        while let Some(p) = next {
            if let Err(e) = nats.publish_with_reply(p.subject, p.reply, p.payload).await {
                // The pull never reaches the server: its instance pulls again at its deadline.
                tracing::debug!(error = %e, "sending a queued publish");
            }
            next = queued.try_recv().ok();
        }
    }
}
