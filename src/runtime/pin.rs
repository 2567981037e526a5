//! The pin as one instance holds it, for group members and plain
//! consumers' subscribers alike: the state and its transitions (pure), and
//! how a change is told to events and to a WebSocket client.
//! docs/architecture.md, "Why lanes, the handover barrier and fencing tokens".

use async_nats::jetstream::consumer;

use super::Runtime;
use crate::delivery::frames::ServerFrame;
use crate::events::Event;
use crate::names::MemberRef;
use crate::runtime::endpoint::Endpoint;

/// Where an instance stands with its consumer's pin.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PinState {
    /// No pull has brought a pin yet, and nobody else is known to hold it.
    #[default]
    Seeking,
    /// Another client holds the pin; this instance waits for it to move.
    Standby,
    /// This instance holds pin `id`. `token` is its fencing token once
    /// raised: until then nothing is delivered, since a guessed token could
    /// be lower than the previous holder's.
    Pinned { id: String, token: Option<u64> },
}

impl PinState {
    /// The pin id pulls carry.
    pub fn id(&self) -> Option<&str> {
        match self {
            Self::Pinned { id, .. } => Some(id),
            _ => None,
        }
    }

    pub fn is_pinned(&self) -> bool {
        matches!(self, Self::Pinned { .. })
    }

    pub fn is_standby(&self) -> bool {
        matches!(self, Self::Standby)
    }

    /// The fencing token, once raised.
    pub fn token(&self) -> Option<u64> {
        match self {
            Self::Pinned { token, .. } => *token,
            _ => None,
        }
    }

    /// Pinned, with a token still to raise.
    pub fn token_pending(&self) -> bool {
        matches!(self, Self::Pinned { token: None, .. })
    }

    /// A message came with pin `id`; true when that is a pin this instance
    /// did not hold (it is pinned now, with its token still to raise).
    pub fn on_message_pin(&mut self, id: &str) -> bool {
        if self.id() == Some(id) {
            return false;
        }
        *self = Self::Pinned { id: id.to_owned(), token: None };
        true
    }

    /// Records the raised token (ignored unless pinned).
    pub fn set_token(&mut self, raised: u64) {
        if let Self::Pinned { token, .. } = self {
            *token = Some(raised);
        }
    }

    /// The pin is gone; true when this instance held it.
    pub fn lose(&mut self) -> bool {
        let held = self.is_pinned();
        if held {
            *self = Self::Seeking;
        }
        held
    }

    /// Someone else holds the pin; true when this instance was seeking
    /// (a holder does not stand by on hearsay: it loses the pin first).
    pub fn stand_by(&mut self) -> bool {
        let seeking = matches!(self, Self::Seeking);
        if seeking {
            *self = Self::Standby;
        }
        seeking
    }
}

/// Whether the consumer's priority group names a pinned client.
pub fn pinned_to_someone(info: &consumer::Info) -> bool {
    info.priority_groups.iter().any(|g| g.pinned_client_id.as_deref().is_some_and(|id| !id.is_empty()))
}

/// Whether the consumer's priority group pins `pin` (a server that reports
/// no priority groups is taken at its pulls' word).
pub fn pinned_here(info: &consumer::Info, pin: Option<&str>) -> bool {
    info.priority_groups.is_empty() || info.priority_groups.iter().any(|g| g.pinned_client_id.as_deref() == pin)
}

/// Tells events and a WebSocket client that `who` is pinned here (`reason`:
/// why the pin moved, when it is known, as for a rebalance).
pub fn announce_pinned(
    ctx: &Runtime,
    who: &MemberRef,
    endpoint: &Endpoint,
    pin_id: String,
    fencing_token: Option<u64>,
    partitions: Vec<u32>,
    reason: Option<String>,
) {
    let mut event = Event::member_pinned(ctx.about(who), pin_id, fencing_token, partitions.clone());
    event.reason = reason;
    ctx.events.emit(event);
    let instance = ctx.cluster.instance_id.clone();
    endpoint.notify(|| ServerFrame::Pinned { partitions, fencing_token, instance });
}

/// Tells events and a WebSocket client that `who` lost its pin here.
pub fn announce_unpinned(ctx: &Runtime, who: &MemberRef, endpoint: &Endpoint, why: &str, partitions: Vec<u32>) {
    ctx.events.emit(Event::member_unpinned(ctx.about(who), why));
    endpoint.notify(|| ServerFrame::Standby { partitions });
}

/// Tells events and a WebSocket client that `who` stands by here.
pub fn announce_standby(ctx: &Runtime, who: &MemberRef, endpoint: &Endpoint, partitions: Vec<u32>) {
    ctx.events.emit(Event::member_standby(ctx.about(who)));
    endpoint.notify(|| ServerFrame::Standby { partitions });
}

/// Counts a pin gained or lost in `keygate_pin_changes_total`.
pub fn count_pin_change(who: &MemberRef, change: &'static str) {
    metrics::counter!(
        crate::telemetry::metrics::PIN_CHANGES,
        "stream" => who.stream.to_string(),
        "group" => who.group.to_string(),
        "member" => who.member.to_string(),
        "change" => change
    )
    .increment(1);
}

#[cfg(test)]
mod tests {
    use super::PinState;

    #[test]
    fn a_new_pin_id_pins_with_the_token_pending_and_the_same_one_changes_nothing() {
        let mut pin = PinState::default();
        assert!(pin.on_message_pin("a"));
        assert!(pin.token_pending());
        assert_eq!(pin.id(), Some("a"));
        pin.set_token(7);
        assert!(!pin.token_pending());
        assert!(!pin.on_message_pin("a"), "the pin held");
        assert_eq!(pin.token(), Some(7));
        assert!(pin.on_message_pin("b"), "the server re-pinned this instance");
        assert_eq!(pin, PinState::Pinned { id: "b".into(), token: None });
    }

    #[test]
    fn only_a_seeking_instance_stands_by_and_only_a_holder_loses() {
        let mut pin = PinState::default();
        assert!(!pin.lose());
        assert!(pin.stand_by());
        assert!(!pin.stand_by(), "already standing by");
        assert!(pin.on_message_pin("a"), "a standby gains the pin through its pulls");
        assert!(!pin.stand_by(), "a holder loses the pin before it stands by");
        assert!(pin.is_pinned());
        assert!(pin.lose());
        assert_eq!(pin, PinState::Seeking);
        pin.set_token(3);
        assert_eq!(pin.token(), None, "a token is only kept while pinned");
    }
}
