//! keygate's domain errors, built the way async-nats builds its own: each
//! domain (publishing, streams, groups, consumers, members, dead letters,
//! webhooks, instances, the broker underneath) has a kind enum, and `Error<Kind>`
//! carries the kind a caller matches, the message a caller reads and the
//! cause underneath (async-nats's error, a parser's) for the log.
//!
//! Every kind says its [`Class`]: whose fault the error is and whether
//! retrying may help. That is all the HTTP edge (`http/problem.rs`) reads
//! to choose a status, in one place; the CLI prints the message.

use std::fmt;
use std::sync::Arc;

/// Whose fault an error is, and whether retrying may succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// The input is malformed or invalid.
    Invalid,
    /// The target is keygate's or the server's own state, which no caller
    /// may write through the data path.
    Reserved,
    /// The stream, group, consumer or member does not exist.
    NotFound,
    /// The request conflicts with what exists.
    Conflict,
    /// A payload or batch larger than allowed.
    TooLarge,
    /// The caller holds as many of a bounded resource as it may.
    TooMany,
    /// Well-formed input that cannot be applied (the server refused it).
    Unprocessable,
    /// NATS or JetStream is unavailable; retrying may succeed.
    Unavailable,
    /// Anything else: keygate's own fault. The detail is for its log.
    Internal,
}

/// The kinds of one domain's errors.
pub trait Kind: Copy + Eq + fmt::Debug + Send + Sync + 'static {
    /// Whose fault an error of this kind is.
    fn class(self) -> Class;
    /// The kind an error of another domain takes when it surfaces while
    /// doing this domain's work (a stream that is missing while creating a
    /// group): its class is kept, and so are its message and cause.
    fn from_class(class: Class) -> Self;
}

/// An error of one domain: its kind, what happened in words a caller can
/// act on, and the cause underneath, if any.
#[derive(Clone)]
pub struct Error<K> {
    kind: K,
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl<K: Kind> Error<K> {
    pub fn new(kind: K, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), source: None }
    }

    /// The same error with `source` as its cause (kept for the log, never
    /// shown to a caller).
    pub fn caused_by(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    pub fn kind(&self) -> K {
        self.kind
    }

    pub fn class(&self) -> Class {
        self.kind.class()
    }

    /// What happened, without the cause: what a caller is told.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error as one of another domain's, class, message and cause
    /// kept.
    pub fn into_domain<K2: Kind>(self) -> Error<K2> {
        Error { kind: K2::from_class(self.kind.class()), message: self.message, source: self.source }
    }

    /// The same kind and cause with another message.
    pub fn with_message(self, message: impl Into<String>) -> Self {
        Self { message: message.into(), ..self }
    }

    /// The message followed by every cause underneath: what the log gets.
    pub fn report(&self) -> String {
        let mut report = self.message.clone();
        let mut next: Option<&(dyn std::error::Error + 'static)> = self.source.as_deref().map(|s| s as _);
        while let Some(cause) = next {
            report.push_str(": ");
            report.push_str(&cause.to_string());
            next = cause.source();
        }
        report
    }
}

impl<K: Kind> fmt::Display for Error<K> {
    /// The message; `{:#}` adds the causes underneath (for logs).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            f.write_str(&self.report())
        } else {
            f.write_str(&self.message)
        }
    }
}

impl<K: Kind> fmt::Debug for Error<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("source", &self.source)
            .finish()
    }
}

impl<K: Kind> std::error::Error for Error<K> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as _)
    }
}

/// Two errors are equal when their kinds and messages are (the causes are
/// not comparable).
impl<K: Kind> PartialEq for Error<K> {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

/// Lets `?` carry errors of other domains into this one where its work
/// calls theirs (kind from the class, message and cause kept). Each domain
/// lists what flows into it, beside its kind; a blanket impl would overlap
/// `From<T> for T`.
macro_rules! flows_into {
    ($into:ty: $($from:ty),+ $(,)?) => {
        $(
            impl From<$crate::error::Error<$from>> for $crate::error::Error<$into> {
                fn from(e: $crate::error::Error<$from>) -> Self {
                    e.into_domain()
                }
            }
        )+
    };
}
pub(crate) use flows_into;

/// Implements [`Kind`] for a domain's kind enum: the class of each variant
/// (a variant that holds a class, like `Other(Class)`, has that class), and
/// which variants stand for another domain's unavailable, internal and
/// other errors.
macro_rules! domain_kind {
    ($kind:ty { $($variant:ident => $class:ident),* $(,)? }) => {
        impl $crate::error::Kind for $kind {
            fn class(self) -> $crate::error::Class {
                match self {
                    $(Self::$variant => $crate::error::Class::$class,)*
                    Self::Unavailable => $crate::error::Class::Unavailable,
                    Self::Internal => $crate::error::Class::Internal,
                    Self::Other(class) => class,
                }
            }
            fn from_class(class: $crate::error::Class) -> Self {
                match class {
                    $crate::error::Class::Unavailable => Self::Unavailable,
                    $crate::error::Class::Internal => Self::Internal,
                    other => Self::Other(other),
                }
            }
        }
    };
}
pub(crate) use domain_kind;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Probe {
        Missing,
        Unavailable,
        Internal,
        Other(Class),
    }
    domain_kind!(Probe { Missing => NotFound });

    #[test]
    fn the_cause_reaches_the_report_and_not_the_message() {
        let io = std::io::Error::other("connection reset");
        let err = Error::new(Probe::Internal, "reading stream").caused_by(io);
        assert_eq!(err.to_string(), "reading stream");
        assert_eq!(format!("{err:#}"), "reading stream: connection reset");
        assert!(std::error::Error::source(&err).is_some());
    }

    #[test]
    fn an_error_crossing_domains_keeps_its_class_message_and_cause() {
        let err = Error::new(Probe::Missing, "stream ORDERS not found").caused_by(std::io::Error::other("x"));
        let crossed: Error<Probe> = err.clone().into_domain();
        assert_eq!(crossed.kind(), Probe::Other(Class::NotFound));
        assert_eq!(crossed.class(), Class::NotFound);
        assert_eq!(crossed.message(), err.message());
        assert_eq!(crossed.report(), err.report());
        assert_eq!(Error::<Probe>::new(Probe::Unavailable, "x").into_domain::<Probe>().kind(), Probe::Unavailable);
    }
}
