//! Operators' control requests as a session answers them: every instance
//! answers a roll call; only the pin holder answers status, skip and
//! retry-now (the protocol is in `member/control.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_nats::jetstream::AckKind;

use super::Session;
use crate::events::Event;
use crate::member::control::{BlockedPartition, Control, ControlReply};
use crate::member::deliver::dead_letter_and_term;
use crate::member::lanes::{Blocked, Settlement};

impl Session {
    pub(super) async fn on_control(&mut self, request: Arc<async_nats::Message>) {
        let Some(reply_to) = request.reply.clone() else { return };
        let Ok(control) = serde_json::from_slice::<Control>(&request.payload) else { return };
        let answer = match control {
            Control::RollCall => Some(self.answer(false)),
            // Only the pin holder answers the others: the requester gets its word.
            _ if !self.pin.is_pinned() => None,
            Control::Status => Some(self.answer(true)),
            Control::Skip { partition } => Some(self.skip(partition).await),
            Control::RetryNow { partition } => Some(self.retry_now(partition).await),
        };
        let Some(answer) = answer else { return };
        if let Ok(payload) = serde_json::to_vec(&answer) {
            let _ = self.ctx().nats.publish(reply_to, payload.into()).await;
        }
    }

    /// This instance's state; `in_full` adds the pin holder's lanes.
    fn answer(&self, in_full: bool) -> ControlReply {
        let mut answer = ControlReply {
            instance: self.ctx().instance_id.clone(),
            ok: true,
            error: None,
            blocked: Vec::new(),
            holding: 0,
            fencing_token: self.shared.fencing.load(Ordering::Relaxed),
            floors: Default::default(),
            session: self.session_id,
            pinned: self.pin.is_pinned(),
        };
        if in_full {
            let state = self.shared.lock();
            answer.holding = state.lanes.holding();
            answer.floors = state.lanes.floors();
            answer.blocked = blocked_view(state.lanes.blocked());
        }
        answer
    }

    fn refused(&self, error: String) -> ControlReply {
        ControlReply { ok: false, error: Some(error), ..self.answer(true) }
    }

    /// Dead-letters a blocked partition's head so the partition proceeds;
    /// a head being retried right now is dead-lettered when that attempt fails.
    async fn skip(&mut self, partition: u32) -> ControlReply {
        let head = self.shared.lock().lanes.blocked_head(partition);
        let Some((seq, held)) = head else {
            let mut state = self.shared.lock();
            if !state.lanes.blocked().contains_key(&partition) {
                drop(state);
                return self.refused(format!("partition {partition} is not blocked"));
            }
            state.skip_requested.insert(partition);
            drop(state);
            return self.answer(true);
        };
        match dead_letter_and_term(self.ctx(), self.who(), &held, "skipped by an operator").await {
            Ok(events) => {
                {
                    let mut state = self.shared.lock();
                    state.lanes.skip(partition, seq, Some(Settlement::Terminated));
                    state.blocked_reported.remove(&partition);
                }
                for e in events {
                    self.ctx().events.emit(e);
                }
                self.ctx().events.emit(Event::partition_unblocked(self.ctx().about(self.who()), partition, seq, None));
                self.answer(true)
            }
            Err(e) => self.refused(format!("could not dead-letter the head: {e}")),
        }
    }

    /// Asks the server to redeliver a blocked partition's head now.
    async fn retry_now(&mut self, partition: u32) -> ControlReply {
        let head = self.shared.lock().lanes.blocked_head(partition);
        let Some((_, held)) = head else {
            return self.refused(format!("partition {partition} is not blocked"));
        };
        match held.message.ack_with(AckKind::Nak(None)).await {
            Ok(()) => self.answer(true),
            Err(e) => self.refused(format!("could not ask for redelivery: {e}")),
        }
    }
}

fn blocked_view(blocked: std::collections::BTreeMap<u32, Blocked>) -> Vec<BlockedPartition> {
    blocked
        .into_iter()
        .map(|(partition, b)| BlockedPartition {
            partition,
            seq: b.seq,
            since: time::OffsetDateTime::from(b.since),
            attempts: b.attempts,
            last_error: b.last_error,
        })
        .collect()
}
