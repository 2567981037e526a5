//! What an instance serves: a partitioned group's member, or a plain
//! consumer's named subscriber. Both run the same instance loop and driver;
//! the target decides how the consumer is joined and how messages are
//! dispatched (lanes in key or partition order, or plain concurrency).

use crate::names::{ConsumerName, GroupName, MemberName, StreamName};
use crate::names::{MemberRef, Owner};
use crate::webhook::{registration_key, SubscriberOptions};

/// One member or subscriber, as an instance serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A group member: it joins the member's consumer as pcgroups does and
    /// keeps key or partition order.
    Member(MemberRef),
    /// A plain consumer's subscriber: it pulls with its own options and
    /// delivers up to `options.concurrency` messages at once, in no order.
    Subscriber { who: MemberRef, options: SubscriberOptions },
}

impl Target {
    /// A group's member.
    pub fn member(stream: StreamName, group: GroupName, member: MemberName) -> Self {
        Self::Member(MemberRef { stream, group, member, owner: Owner::Group })
    }

    /// A plain consumer's subscriber; `None` when the consumer's name is
    /// not also a valid group name (events name it in the group's place).
    pub fn subscriber(
        stream: StreamName,
        consumer: &ConsumerName,
        subscriber: MemberName,
        options: SubscriberOptions,
    ) -> Option<Self> {
        let group = GroupName::parse(consumer.as_str()).ok()?;
        Some(Self::Subscriber { who: MemberRef { stream, group, member: subscriber, owner: Owner::Consumer }, options })
    }

    /// Whom deliveries and events name.
    pub fn who(&self) -> &MemberRef {
        match self {
            Self::Member(who) | Self::Subscriber { who, .. } => who,
        }
    }

    /// Whether this is a group member.
    pub fn is_member(&self) -> bool {
        matches!(self, Self::Member(_))
    }

    /// The key of its fencing token in the fencing bucket: a subscriber's
    /// is apart from a same-named group member's.
    pub fn fencing_key(&self) -> String {
        let who = self.who();
        let key = registration_key(who.stream.as_str(), who.group.as_str(), who.member.as_str());
        match self {
            Self::Member(_) => key,
            Self::Subscriber { .. } => format!("{key}.consumer"),
        }
    }
}

/// A subscriber's options when its registration names none: one delivery
/// at a time, no priority or thresholds.
pub const DEFAULT_SUBSCRIBER_OPTIONS: SubscriberOptions =
    SubscriberOptions { priority: None, min_pending: None, min_ack_pending: None, concurrency: 1 };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subscriber_is_fenced_apart_from_a_same_named_member() {
        let stream = StreamName::parse("ORDERS").unwrap();
        let member =
            Target::member(stream.clone(), GroupName::parse("billing").unwrap(), MemberName::parse("m1").unwrap());
        let consumer = ConsumerName::parse("billing").unwrap();
        let subscriber =
            Target::subscriber(stream, &consumer, MemberName::parse("m1").unwrap(), DEFAULT_SUBSCRIBER_OPTIONS)
                .unwrap();
        assert_eq!(member.fencing_key(), "ORDERS.billing.m1");
        assert_eq!(subscriber.fencing_key(), "ORDERS.billing.m1.consumer");
        assert!(member.is_member() && !subscriber.is_member());
        assert_eq!(subscriber.who().owner, Owner::Consumer);
    }
}
