//! Operators' control requests as a session answers them: every instance
//! answers a roll call; only the pin holder answers status, skip and
//! retry-now, of a partition or, under key ordering, of one key (the
//! protocol is in `cluster/control.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_nats::jetstream::AckKind;

use super::worker::unblocked_event;
use super::Driver;
use crate::cluster::control::{BlockedPartition, Control, ControlReply, MAX_BLOCKED_LISTED};
use crate::runtime::deliver::dead_letter_and_term;
use crate::runtime::lanes::{Blocked, LaneId, Settlement};

impl Driver {
    pub(super) async fn on_control(&mut self, request: Arc<async_nats::Message>) {
        let Ok(control) = serde_json::from_slice::<Control>(&request.payload) else { return };
        if let Control::StepDown { instance, hold_ms, reason } = control {
            if !self.pin.is_pinned() {
                self.handoff = Some((reason, std::time::Instant::now()));
            } else if self.balanced && instance == self.ctx().cluster.instance_id {
                self.step_down(std::time::Duration::from_millis(hold_ms), &reason).await;
            }
            return;
        }
        let Some(reply_to) = request.reply.clone() else { return };
        let answer = match control {
            Control::RollCall => Some(self.answer(false)),
            // Only the pin holder answers the others: the requester gets its word.
            _ if !self.pin.is_pinned() => None,
            Control::Status => Some(self.answer(true)),
            Control::Skip { partition, key } => Some(self.skip(partition, key.as_deref()).await),
            Control::RetryNow { partition, key } => Some(self.retry_now(partition, key.as_deref()).await),
            Control::StepDown { .. } => None,
        };
        let Some(answer) = answer else { return };
        if let Ok(payload) = serde_json::to_vec(&answer) {
            let _ = self.ctx().broker.client.publish(reply_to, payload.into()).await;
        }
    }

    /// This instance's state; `in_full` adds the pin holder's lanes.
    fn answer(&self, in_full: bool) -> ControlReply {
        let mut answer = ControlReply {
            instance: self.ctx().cluster.instance_id.clone(),
            ok: true,
            error: None,
            blocked: Vec::new(),
            blocked_total: 0,
            holding: 0,
            fencing_token: self.shared.fencing.load(Ordering::Relaxed),
            floors: Default::default(),
            session: self.session_id,
            pinned: self.pin.is_pinned(),
            outputs: self.shared.endpoint.declared_outputs().iter().map(|o| o.to_string()).collect(),
        };
        if in_full {
            let state = self.shared.lock();
            answer.holding = state.lanes.holding();
            answer.floors = state.lanes.floors();
            let blocked = state.lanes.blocked();
            answer.blocked_total = blocked.len();
            answer.blocked = blocked_view(blocked);
        }
        answer
    }

    fn refused(&self, error: String) -> ControlReply {
        ControlReply { ok: false, error: Some(error), ..self.answer(true) }
    }

    /// Dead-letters a blocked lane's head so the lane proceeds; a head being
    /// retried right now is dead-lettered when that attempt fails.
    async fn skip(&mut self, partition: u32, key: Option<&str>) -> ControlReply {
        let lane = match self.blocked_lane(partition, key) {
            Ok(lane) => lane,
            Err(why) => return self.refused(why.to_string()),
        };
        let head = self.shared.lock().lanes.blocked_head(&lane);
        let Some((seq, held)) = head else {
            self.shared.lock().skip_requested.insert(lane);
            return self.answer(true);
        };
        match dead_letter_and_term(self.ctx(), self.who(), &held, "skipped by an operator").await {
            Ok(events) => {
                {
                    let mut state = self.shared.lock();
                    state.lanes.skip(&lane, seq, Some(Settlement::Terminated));
                    state.blocked_reported.remove(&lane);
                }
                for e in events {
                    self.ctx().events.emit(e);
                }
                self.ctx().events.emit(unblocked_event(self.ctx().about(self.who()), &lane, seq, None));
                self.answer(true)
            }
            Err(e) => self.refused(format!("could not dead-letter the head: {e}")),
        }
    }

    /// Asks the server to redeliver a blocked lane's head now.
    async fn retry_now(&mut self, partition: u32, key: Option<&str>) -> ControlReply {
        let lane = match self.blocked_lane(partition, key) {
            Ok(lane) => lane,
            Err(why) => return self.refused(why.to_string()),
        };
        let head = self.shared.lock().lanes.blocked_head(&lane);
        let Some((_, held)) = head else {
            return self.refused(format!("the head of {} is being delivered right now", describe(&lane)));
        };
        match held.message.ack_with(AckKind::Nak(None)).await {
            Ok(()) => self.answer(true),
            Err(e) => self.refused(format!("could not ask for redelivery: {e}")),
        }
    }

    /// The blocked lane an operator means: the named key of the partition,
    /// or, with none named, the partition's only blocked lane.
    fn blocked_lane(&self, partition: u32, key: Option<&str>) -> Result<LaneId, NotBlocked> {
        let state = self.shared.lock();
        let of_partition: Vec<LaneId> = state
            .lanes
            .blocked()
            .into_iter()
            .map(|(lane, _)| lane)
            .filter(|lane| lane.partition == partition)
            .collect();
        pick_lane(partition, key, of_partition)
    }
}

/// Why a skip or retry-now names no blocked lane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum NotBlocked {
    #[error("key {key:?} of partition {partition} is not blocked")]
    Key { partition: u32, key: String },
    #[error("partition {0} is not blocked")]
    Partition(u32),
    #[error(
        "partition {partition} has {blocked} blocked keys; name one (…/partitions/{partition}/keys/{{key}}/skip, \
         or a body {{\"key\": …}})"
    )]
    Ambiguous { partition: u32, blocked: usize },
}

/// Which of a partition's blocked lanes a skip or retry-now names (pure).
fn pick_lane(partition: u32, key: Option<&str>, mut blocked: Vec<LaneId>) -> Result<LaneId, NotBlocked> {
    match key {
        Some(key) => blocked
            .into_iter()
            .find(|lane| lane.key.key() == Some(key))
            .ok_or_else(|| NotBlocked::Key { partition, key: key.to_owned() }),
        None => match blocked.len() {
            0 => Err(NotBlocked::Partition(partition)),
            1 => Ok(blocked.remove(0)),
            n => Err(NotBlocked::Ambiguous { partition, blocked: n }),
        },
    }
}

fn describe(lane: &LaneId) -> String {
    match lane.key.key() {
        Some(key) => format!("key {key:?} of partition {}", lane.partition),
        None => format!("partition {}", lane.partition),
    }
}

fn blocked_view(blocked: Vec<(LaneId, Blocked)>) -> Vec<BlockedPartition> {
    let mut by_age = blocked;
    by_age.sort_by_key(|(_, b)| b.since);
    by_age
        .into_iter()
        .take(MAX_BLOCKED_LISTED)
        .map(|(lane, b)| BlockedPartition {
            partition: lane.partition,
            key: lane.key.key().map(str::to_owned),
            seq: b.seq,
            since: time::OffsetDateTime::from(b.since),
            attempts: b.attempts,
            last_error: b.last_error,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::lanes::LaneKey;

    fn key(partition: u32, key: &str) -> LaneId {
        LaneId { partition, key: LaneKey::Key(key.into()) }
    }

    #[test]
    fn an_operator_names_a_key_or_the_partitions_only_blocked_lane() {
        assert_eq!(pick_lane(3, None, vec![LaneId::partition(3)]), Ok(LaneId::partition(3)));
        assert_eq!(pick_lane(3, Some("a"), vec![key(3, "a"), key(3, "b")]), Ok(key(3, "a")));
        assert_eq!(pick_lane(3, None, vec![key(3, "b")]), Ok(key(3, "b")));
        assert_eq!(
            pick_lane(3, None, vec![key(3, "a"), key(3, "b")]),
            Err(NotBlocked::Ambiguous { partition: 3, blocked: 2 })
        );
        assert!(pick_lane(3, None, vec![key(3, "a"), key(3, "b")]).unwrap_err().to_string().contains("2 blocked keys"));
        assert_eq!(pick_lane(3, Some("c"), vec![key(3, "a")]), Err(NotBlocked::Key { partition: 3, key: "c".into() }));
        assert_eq!(pick_lane(3, None, vec![]).unwrap_err().to_string(), "partition 3 is not blocked");
    }
}
