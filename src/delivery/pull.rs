//! An HTTP pull client as a member's endpoint (docs/pull.md): deliveries
//! wait in an outbox until a fetch takes them, then for the client's
//! verdict by ack id until their visibility timeout runs out.
//!
//! The lanes decide what may go out, exactly as for a webhook or a
//! WebSocket: a fetch only hands out what the lanes already released, so
//! one key (or partition) never has two messages out at once.

use super::SettleError;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{oneshot, watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::frames::{message_frame, ClientFrame, MessageFrame, ServerFrame};
use super::message::Held;
use super::verdict::Backoff;
use super::websocket::{client_judgement, ClientAnswer};
use crate::names::{MemberRef, StreamName};

/// Hex digits naming the replica at the start of every ack id.
pub const REPLICA_TAG_LEN: usize = 16;
/// Hex digits of a whole ack id: the replica's tag, then a random nonce.
pub const ACK_ID_LEN: usize = 32;

/// The replica an ack id was handed out by; `None` when `ack_id` is not one.
pub fn replica_of(ack_id: &str) -> Option<&str> {
    let well_formed = ack_id.len() == ACK_ID_LEN && ack_id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    well_formed.then(|| &ack_id[..REPLICA_TAG_LEN])
}

/// A fresh random replica tag (subject-safe: lowercase hex).
pub fn new_replica_tag() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// One message as a fetch hands it out.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PulledMessage {
    #[serde(flatten)]
    pub message: MessageFrame,
    /// Names this delivery in `…/acks`; valid until the verdict or the
    /// visibility timeout, whichever comes first (a redelivery has a new one).
    pub ack_id: String,
}

/// A delivery the lanes released.
struct Entry {
    /// The frame, until a fetch takes it.
    frame: Option<MessageFrame>,
    verdict: oneshot::Sender<ClientFrame>,
    /// When the visibility timeout runs out, once fetched.
    visible_until: watch::Sender<Option<Instant>>,
    /// The visibility the fetch chose (a `progress` extends by it again).
    visibility: Duration,
}

#[derive(Default)]
struct Outbox {
    /// Ack ids of deliveries no fetch has taken yet, oldest first.
    queued: VecDeque<String>,
    entries: HashMap<String, Entry>,
}

/// Where the instance stands, for fetch answers.
#[derive(Debug, Clone, Default)]
pub struct PullStatus {
    pub pinned: bool,
    pub partitions: Vec<u32>,
}

/// The endpoint of one pull instance: shared by every fetch of the member
/// that reaches this replica.
pub struct PullEndpoint {
    replica: String,
    outbox: Mutex<Outbox>,
    /// Woken when a delivery is queued.
    offered: Notify,
    /// Cancelled when the instance stops: waiting deliveries give up.
    closed: CancellationToken,
    pinned: AtomicBool,
    partitions: Mutex<Vec<u32>>,
    pub max_attempts: u64,
    pub backoff: Backoff,
    pub max_in_flight: Option<usize>,
    /// Streams the clients' acks may publish to (docs/pipelines.md).
    pub outputs: Vec<StreamName>,
}

/// Why a delivery handed out goes back to the next holder.
const EXPIRED: &str = "the visibility timeout ran out before a verdict";
const STOPPED: &str = "the pull instance stopped before a verdict";

impl PullEndpoint {
    pub fn new(replica: String, closed: CancellationToken, max_attempts: u64, max_in_flight: Option<usize>) -> Self {
        Self {
            replica,
            outbox: Mutex::default(),
            offered: Notify::new(),
            closed,
            pinned: AtomicBool::new(false),
            partitions: Mutex::default(),
            max_attempts,
            backoff: Backoff::default(),
            max_in_flight,
            outputs: Vec::new(),
        }
    }

    fn outbox(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the message for a fetch and waits for the client's verdict.
    /// Queued, it waits as long as the instance lives (keygate keeps it
    /// alive); fetched, until its visibility timeout. Either way, no verdict
    /// is a NAK without delay: the lane sends it again, before anything
    /// later of its key.
    pub async fn call(&self, who: &MemberRef, held: &Held, fencing_token: u64) -> ClientAnswer {
        let ack_id = format!("{}{:016x}", self.replica, rand::random::<u64>());
        let (verdict, mut answer) = oneshot::channel();
        let (visible_until, mut deadline) = watch::channel(None);
        {
            let frame = Some(message_frame(who, held, fencing_token));
            let entry = Entry { frame, verdict, visible_until, visibility: Duration::ZERO };
            let mut outbox = self.outbox();
            outbox.entries.insert(ack_id.clone(), entry);
            outbox.queued.push_back(ack_id.clone());
        }
        self.offered.notify_waiters();
        let (answer, lost) = loop {
            let until = *deadline.borrow_and_update();
            let expiry = async move {
                match until {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                verdict = &mut answer => break (verdict.ok(), STOPPED),
                () = self.closed.cancelled() => break (None, STOPPED),
                changed = deadline.changed() => {
                    // The entry is gone: settled just now (its verdict is sent first).
                    if changed.is_err() { break (answer.try_recv().ok(), STOPPED) }
                }
                () = expiry => {
                    let expired = self.outbox().entries.remove(&ack_id).is_some();
                    break if expired { (None, EXPIRED) } else { (answer.try_recv().ok(), STOPPED) };
                }
            }
        };
        let mut outbox = self.outbox();
        if outbox.entries.remove(&ack_id).is_some() {
            outbox.queued.retain(|queued| *queued != ack_id);
        }
        drop(outbox);
        client_judgement(answer, lost)
    }

    /// Up to `max` queued deliveries, waiting at most `wait` for the first;
    /// each becomes visible to no one else for `visibility`.
    pub async fn fetch(&self, max: usize, wait: Duration, visibility: Duration) -> Vec<PulledMessage> {
        let give_up = Instant::now() + wait;
        loop {
            let offered = self.offered.notified();
            tokio::pin!(offered);
            offered.as_mut().enable();
            let taken = self.take(max, visibility);
            if !taken.is_empty() || self.closed.is_cancelled() {
                return taken;
            }
            tokio::select! {
                () = offered => {}
                () = tokio::time::sleep_until(give_up) => return self.take(max, visibility),
                () = self.closed.cancelled() => return Vec::new(),
            }
        }
    }

    fn take(&self, max: usize, visibility: Duration) -> Vec<PulledMessage> {
        let until = Instant::now() + visibility;
        let mut outbox = self.outbox();
        let Outbox { queued, entries } = &mut *outbox;
        let mut taken = Vec::new();
        while taken.len() < max {
            let Some(ack_id) = queued.pop_front() else { break };
            let Some(entry) = entries.get_mut(&ack_id) else { continue };
            let Some(message) = entry.frame.take() else { continue };
            entry.visibility = visibility;
            entry.visible_until.send_replace(Some(until));
            taken.push(PulledMessage { message, ack_id });
        }
        taken
    }

    /// Applies a client's verdict to the delivery its ack id names; a
    /// `progress` starts that delivery's visibility timeout again.
    pub fn settle(&self, frame: ClientFrame) -> Result<(), SettleError> {
        let ack_id = frame.id().to_owned();
        let unknown = || SettleError::NotHandedOut(ack_id.clone());
        let mut outbox = self.outbox();
        let handed_out = outbox.entries.get(&ack_id).is_some_and(|entry| entry.frame.is_none());
        if !handed_out {
            return Err(unknown());
        }
        if let ClientFrame::Progress { .. } = frame {
            if let Some(entry) = outbox.entries.get(&ack_id) {
                entry.visible_until.send_replace(Some(Instant::now() + entry.visibility));
            }
            return Ok(());
        }
        let entry = outbox.entries.remove(&ack_id).ok_or_else(unknown)?;
        drop(outbox);
        entry.verdict.send(frame).map_err(|_| unknown())
    }

    /// Gives up every waiting delivery: each goes back to the server.
    pub fn close(&self) {
        self.closed.cancel();
    }

    /// Deliveries handed out and waiting for a verdict.
    pub fn handed_out(&self) -> usize {
        self.outbox().entries.values().filter(|entry| entry.frame.is_none()).count()
    }

    /// Follows the pin and assignment frames a WebSocket client would get.
    pub fn notify(&self, frame: ServerFrame) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        match frame {
            ServerFrame::Pinned { partitions: now, .. } => {
                self.pinned.store(true, Ordering::Relaxed);
                *partitions = now;
            }
            ServerFrame::Standby { partitions: now } => {
                self.pinned.store(false, Ordering::Relaxed);
                *partitions = now;
            }
            ServerFrame::Assigned { partitions: gained } => {
                partitions.extend(gained);
                partitions.sort_unstable();
                partitions.dedup();
            }
            ServerFrame::Revoked { partitions: lost } => partitions.retain(|p| !lost.contains(p)),
            _ => {}
        }
    }

    pub fn status(&self) -> PullStatus {
        PullStatus {
            pinned: self.pinned.load(Ordering::Relaxed) && !self.closed.is_cancelled(),
            partitions: self.partitions.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_ids_name_their_replica_and_nothing_else_parses() {
        assert_eq!(new_replica_tag().len(), REPLICA_TAG_LEN);
        let tag = "0123456789abcdef";
        let id = format!("{tag}{:016x}", 7u64);
        assert_eq!(replica_of(&id), Some(tag));
        for bad in ["", "abc", &id[1..], &format!("{id}0"), &id.to_uppercase(), "keygate.>.0123456789abcdef012345"] {
            assert_eq!(replica_of(bad), None, "{bad:?}");
        }
    }
}
