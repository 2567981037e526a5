//! Broker errors classified at the boundary: what is the caller's fault,
//! what is worth retrying, what is keygate's own. async-nats gives every
//! call an error kind, some holding the server's JetStream error (with its
//! `ErrorCode`), some wrapping the request error underneath as the source;
//! keygate reads those, never the error's text.

use async_nats::error::Error as NatsError;
use async_nats::jetstream::{self, context, kv, stream, ErrorCode};

use crate::error::Error;

/// What went wrong with the broker, below any domain: keygate's buckets,
/// scans and stream reads. Domains take these in with `?`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerErrorKind {
    /// The stream read does not exist (or was deleted meanwhile).
    StreamNotFound,
    /// NATS or JetStream did not answer, or said "not now".
    Unavailable,
    /// Anything else the server or client answered; the cause is kept.
    Internal,
    Other(crate::error::Class),
}
crate::error::domain_kind!(BrokerErrorKind { StreamNotFound => NotFound });

pub type BrokerError = Error<BrokerErrorKind>;

/// What keygate needs to know of a broker error, read from its kind.
pub trait NatsFailure: std::error::Error + 'static {
    /// The JetStream API error the server answered with, if it did.
    fn jetstream(&self) -> Option<jetstream::Error>;
    /// Nobody answered: a time-out, no responders, JetStream offline.
    fn unanswered(&self) -> bool;
    /// The kind itself says the stream, consumer or message does not exist.
    fn missing(&self) -> bool;
}

/// How one async-nats error kind reads.
pub trait KindClass {
    fn jetstream(&self) -> Option<jetstream::Error>;
    fn unanswered(&self) -> bool;
    fn missing(&self) -> bool;
}

impl<K> NatsFailure for NatsError<K>
where
    K: KindClass + Clone + std::fmt::Debug + std::fmt::Display + PartialEq + 'static,
{
    fn jetstream(&self) -> Option<jetstream::Error> {
        self.kind().jetstream().or_else(|| sources(self).find_map(|s| underneath(s).and_then(|(js, _, _)| js)))
    }

    fn unanswered(&self) -> bool {
        self.kind().unanswered() || sources(self).any(|s| underneath(s).is_some_and(|(_, unanswered, _)| unanswered))
    }

    fn missing(&self) -> bool {
        self.kind().missing() || sources(self).any(|s| underneath(s).is_some_and(|(_, _, missing)| missing))
    }
}

fn sources<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(err.source(), |e| e.source())
}

/// How an error wrapped as the source of another reads: async-nats wraps
/// the error of the call underneath (a KV bucket's stream lookup, a
/// request) as the source, with its own kind. The chain is walked by
/// [`sources`], so each level only reads its own kind.
fn underneath(source: &(dyn std::error::Error + 'static)) -> Option<(Option<jetstream::Error>, bool, bool)> {
    if let Some(e) = source.downcast_ref::<jetstream::Error>() {
        return Some((Some(e.clone()), NOT_NOW.contains(&e.error_code()), false));
    }
    if source.downcast_ref::<std::io::Error>().is_some() {
        return Some((None, true, false));
    }
    macro_rules! read_as {
        ($($ty:ty),+ $(,)?) => {
            $(if let Some(e) = source.downcast_ref::<$ty>() {
                let kind = e.kind();
                return Some((kind.jetstream(), kind.unanswered(), kind.missing()));
            })+
        };
    }
    read_as!(
        async_nats::RequestError,
        context::RequestError,
        context::PublishError,
        context::GetStreamError,
        context::CreateStreamError,
        context::ConsumerInfoError,
        context::KeyValueError,
        context::CreateKeyValueError,
        stream::ConsumerError,
        stream::DirectGetError,
        stream::LastRawMessageError,
        kv::EntryError,
        kv::WatchError,
    );
    None
}

/// Implements [`KindClass`] for a kind enum: which variant holds the
/// JetStream error, which mean no answer, which mean missing.
macro_rules! kind_class {
    ($kind:ty $(, jetstream: $js:path)? $(, unanswered: [$($un:path),+ $(,)?])? $(, missing: [$($nf:path),+ $(,)?])? $(,)?) => {
        impl KindClass for $kind {
            fn jetstream(&self) -> Option<jetstream::Error> {
                match self {
                    $($js(e) => Some(e.clone()),)?
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
            fn unanswered(&self) -> bool {
                false $($(|| matches!(self, $un))+)?
            }
            fn missing(&self) -> bool {
                false $($(|| matches!(self, $nf))+)?
            }
        }
    };
}

use context::{
    AccountErrorKind as Account, ConsumerInfoErrorKind as ConsumerInfo, CreateKeyValueErrorKind as CreateKv,
    CreateStreamErrorKind as CreateStream, GetStreamByNameErrorKind as StreamByName, GetStreamErrorKind as GetStream,
    KeyValueErrorKind as GetKv, PublishErrorKind as JsPublish, RequestErrorKind as JsRequest,
    UpdateKeyValueErrorKind as UpdateKv,
};
use stream::{
    ConsumerCreateStrictErrorKind as ConsumerStrict, ConsumerErrorKind as Consumer,
    ConsumerUpdateErrorKind as ConsumerUpdate, DeleteMessageErrorKind as DeleteMessage,
    DirectGetErrorKind as DirectGet, LastRawMessageErrorKind as LastRaw, PurgeErrorKind as Purge,
};

kind_class! { async_nats::RequestErrorKind, unanswered: [async_nats::RequestErrorKind::TimedOut, async_nats::RequestErrorKind::NoResponders] }
kind_class! { async_nats::client::SubscribeErrorKind }
kind_class! { async_nats::client::FlushErrorKind }
kind_class! { async_nats::client::PublishErrorKind }
kind_class! { JsRequest, unanswered: [JsRequest::TimedOut, JsRequest::NoResponders] }
// "No stream found" is the server's no-responders answer to a publish:
// nothing stores the subject now, which is also what a KV bucket's stream
// says while it elects a leader right after it was created.
kind_class! { JsPublish, unanswered: [JsPublish::TimedOut, JsPublish::BrokenPipe, JsPublish::StreamNotFound], missing: [JsPublish::StreamNotFound] }
kind_class! { Account, jetstream: Account::JetStream, unanswered: [Account::TimedOut, Account::JetStreamUnavailable] }
kind_class! { ConsumerInfo, jetstream: ConsumerInfo::JetStream, unanswered: [ConsumerInfo::TimedOut, ConsumerInfo::NoResponders, ConsumerInfo::Offline], missing: [ConsumerInfo::NotFound, ConsumerInfo::StreamNotFound] }
kind_class! { CreateStream, jetstream: CreateStream::JetStream, unanswered: [CreateStream::TimedOut, CreateStream::JetStreamUnavailable], missing: [CreateStream::NotFound] }
kind_class! { GetStream, jetstream: GetStream::JetStream }
kind_class! { StreamByName, jetstream: StreamByName::JetStream, missing: [StreamByName::NotFound] }
kind_class! { GetKv }
kind_class! { CreateKv, unanswered: [CreateKv::TimedOut] }
kind_class! { UpdateKv, unanswered: [UpdateKv::TimedOut], missing: [UpdateKv::NotFound] }
kind_class! { Consumer, jetstream: Consumer::JetStream, unanswered: [Consumer::TimedOut] }
kind_class! { ConsumerStrict, jetstream: ConsumerStrict::JetStream, unanswered: [ConsumerStrict::TimedOut] }
kind_class! { ConsumerUpdate, jetstream: ConsumerUpdate::JetStream, unanswered: [ConsumerUpdate::TimedOut], missing: [ConsumerUpdate::DoesNotExist] }
kind_class! { DeleteMessage, jetstream: DeleteMessage::JetStream, unanswered: [DeleteMessage::TimedOut] }
// A direct get nobody answered comes as a 503 status reply (no responders:
// the bucket's stream has no leader yet), not as a kind of its own.
impl KindClass for DirectGet {
    fn jetstream(&self) -> Option<jetstream::Error> {
        None
    }
    fn unanswered(&self) -> bool {
        match self {
            DirectGet::TimedOut => true,
            DirectGet::ErrorResponse(status, _) => status.as_u16() == 503,
            _ => false,
        }
    }
    fn missing(&self) -> bool {
        matches!(self, DirectGet::NotFound)
    }
}
kind_class! { LastRaw, jetstream: LastRaw::JetStream, missing: [LastRaw::NoMessageFound] }
kind_class! { Purge, jetstream: Purge::JetStream, unanswered: [Purge::TimedOut] }
kind_class! { kv::EntryErrorKind, unanswered: [kv::EntryErrorKind::TimedOut] }
kind_class! { kv::UpdateErrorKind, unanswered: [kv::UpdateErrorKind::TimedOut] }
kind_class! { kv::CreateErrorKind }
kind_class! { kv::PutErrorKind }
kind_class! { kv::WatchErrorKind, unanswered: [kv::WatchErrorKind::TimedOut] }
kind_class! { kv::StatusErrorKind, jetstream: kv::StatusErrorKind::JetStream, unanswered: [kv::StatusErrorKind::TimedOut] }
kind_class! { kv::WatcherErrorKind }

/// JetStream error codes meaning "not now": no meta leader, no peers to
/// place replicas on, no resources yet, a leader change.
const NOT_NOW: [ErrorCode; 6] = [
    ErrorCode::CLUSTER_NOT_AVAILABLE,
    ErrorCode::CLUSTER_NO_PEERS,
    ErrorCode::INSUFFICIENT_RESOURCES,
    ErrorCode::CLUSTER_NOT_LEADER,
    ErrorCode::CLUSTER_NOT_ACTIVE,
    ErrorCode::JETSTREAM_NOT_ENABLED,
];

/// Whether retrying may succeed: nobody answered, or JetStream said "not now".
pub fn is_transient(err: &impl NatsFailure) -> bool {
    err.unanswered() || err.jetstream().is_some_and(|e| NOT_NOW.contains(&e.error_code()))
}

/// Maps an error from a NATS request to `Unavailable` when NATS or
/// JetStream is not answering (retrying may succeed), otherwise to
/// `Internal`; either way async-nats's error is kept as the cause.
pub fn unavailable_or_internal(what: &str, err: impl NatsFailure + Send + Sync) -> BrokerError {
    if is_transient(&err) {
        tracing::warn!(error = %err, "{what}: NATS did not answer");
        Error::new(BrokerErrorKind::Unavailable, format!("{what}: NATS or JetStream did not answer; retry later"))
            .caused_by(err)
    } else {
        Error::new(BrokerErrorKind::Internal, what).caused_by(err)
    }
}

/// The error for a failed read of stream `stream`: not found when it does
/// not exist (also when it was deleted between two requests of one call),
/// unavailable when NATS does not answer, else internal.
pub fn stream_read_error(stream: &str, err: impl NatsFailure + Send + Sync) -> BrokerError {
    if is_not_found(&err) {
        Error::new(BrokerErrorKind::StreamNotFound, format!("stream {stream} not found")).caused_by(err)
    } else {
        unavailable_or_internal("reading stream", err)
    }
}

/// The JetStream API error code the server answered with, if any.
pub fn jetstream_error_code(err: &impl NatsFailure) -> Option<u64> {
    err.jetstream().map(|e| e.error_code().0)
}

/// Whether the stream or consumer asked for does not exist.
pub fn is_not_found(err: &impl NatsFailure) -> bool {
    err.missing() || matches!(jetstream_error_code(err), Some(codes::STREAM_NOT_FOUND | codes::CONSUMER_NOT_FOUND))
}

/// JetStream error codes keygate reacts to.
pub mod codes {
    use async_nats::jetstream::ErrorCode;

    pub const STREAM_NOT_FOUND: u64 = ErrorCode::STREAM_NOT_FOUND.0;
    pub const CONSUMER_NOT_FOUND: u64 = ErrorCode::CONSUMER_NOT_FOUND.0;
    /// Stream name already in use with a different configuration.
    pub const STREAM_NAME_IN_USE: u64 = ErrorCode::STREAM_NAME_EXIST.0;
    pub const SUBJECT_OVERLAP: u64 = ErrorCode::STREAM_SUBJECT_OVERLAP.0;
    /// No servers to place the stream's replicas on yet (a cluster that
    /// is forming, or a node down): retry.
    pub const NO_SUITABLE_PEERS: u64 = ErrorCode::CLUSTER_NO_PEERS.0;
    /// JetStream is temporarily unavailable (no meta leader): retry.
    pub const JETSTREAM_UNAVAILABLE: u64 = ErrorCode::CLUSTER_NOT_AVAILABLE.0;
    /// The stream's byte limit is more than the server's storage can reserve.
    pub const STORAGE_RESOURCES_EXCEEDED: u64 = ErrorCode::STORAGE_RESOURCES_EXCEEDED.0;
    /// Likewise for memory storage.
    pub const MEMORY_RESOURCES_EXCEEDED: u64 = ErrorCode::MEMORY_RESOURCES_EXCEEDED.0;
    /// More replicas than the cluster has servers.
    pub const REPLICAS_EXCEED_CLUSTER: u64 = ErrorCode::STREAM_REPLICAS_NOT_SUPPORTED.0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kv_read_nobody_answered_is_transient() {
        let no_responders = DirectGet::ErrorResponse(async_nats::StatusCode::NO_RESPONDERS, "no responders".into());
        let entry = kv::EntryError::with_source(kv::EntryErrorKind::Other, stream::DirectGetError::new(no_responders));
        assert!(is_transient(&entry));
        let refused = DirectGet::ErrorResponse(async_nats::StatusCode::REQUEST_TERMINATED, "terminated".into());
        let entry = kv::EntryError::with_source(kv::EntryErrorKind::Other, stream::DirectGetError::new(refused));
        assert!(!is_transient(&entry));
    }

    #[test]
    fn a_kv_write_nobody_stored_is_transient() {
        let unstored = context::PublishError::new(JsPublish::StreamNotFound);
        let put = kv::PutError::with_source(kv::PutErrorKind::Ack, unstored);
        assert!(is_transient(&put), "a bucket electing its leader answers no stream found");
    }
}
