//! The HTTP/1 client webhook calls go over: hyper's pooled client with
//! TLS by rustls, every address checked against the destination policy
//! when a connection is made, one time limit over the whole exchange,
//! answers read up to a bound.
//!
//! Deliveries go to hyper directly rather than through reqwest: reqwest's
//! layers (its redirect policy parsing the URL from the request, another
//! parse of it from the answer, a copy of every request's headers for
//! redirects, a clone of its client per request) were about a fifth of
//! keygate's CPU per delivery, and keygate uses none of what they are for
//! (BENCHMARKS.md, "webhook calls on hyper directly"). Token requests
//! (`credentials.rs`) stay on reqwest: they are rare and want its forms.

use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::header::{HeaderValue, ACCEPT, USER_AGENT};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use super::destination::DestinationPolicy;

/// Idle connections kept per host: at least as many as one registration
/// may have in flight (`registration.rs` asserts it). A pool kept smaller
/// closed connections as deliveries finished and opened new ones for the
/// next, a sixth of delivery CPU under key ordering's 256 in flight
/// (BENCHMARKS.md, the user's order).
pub const POOL_MAX_IDLE_PER_HOST: usize = 1000;

/// How long a new connection may take, TLS handshake included.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an idle connection is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The `user-agent` webhook calls and token requests carry.
pub const KEYGATE_AGENT: &str = concat!("keygate/", env!("CARGO_PKG_VERSION"));

/// A pooled HTTP/1 client for webhook calls.
#[derive(Clone)]
pub struct Transport {
    client: Client<Bounded<HttpsConnector<HttpConnector<PolicyResolver>>>, Full<Bytes>>,
}

/// What the receiver answered: its status, headers and body (up to the
/// bound, with whether it was cut).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Vec<u8>,
    pub truncated: bool,
}

/// Why no answer came.
#[derive(Debug)]
pub enum Failure {
    /// The time limit passed first.
    Timeout,
    /// No connection, or it broke: the error chain. hyper's errors do not
    /// name the URL, whose query string is often a token, and this text
    /// reaches events and dead letters.
    Connection(String),
}

/// What a client certificate file pair or CA file can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{0} is not valid PEM")]
    InvalidPem(&'static str),
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    #[error("the system's certificate verifier: {0}")]
    Verifier(String),
}

/// The certificate a client presents, and the only CAs it trusts, for
/// mutual TLS.
pub struct ClientIdentity<'a> {
    /// The certificate chain and its private key, in PEM.
    pub cert_and_key: &'a [u8],
    /// CA certificates in PEM: when given, the only roots trusted.
    pub only_roots: Option<&'a [u8]>,
}

impl Transport {
    /// A client that trusts the system's roots and presents no certificate.
    pub fn new(policy: &Arc<DestinationPolicy>) -> Result<Self, TlsError> {
        Ok(Self::with_tls(policy, tls_config(None)?, CONNECT_TIMEOUT))
    }

    /// A client presenting `identity`'s certificate.
    pub fn with_identity(policy: &Arc<DestinationPolicy>, identity: ClientIdentity<'_>) -> Result<Self, TlsError> {
        Ok(Self::with_tls(policy, tls_config(Some(identity))?, CONNECT_TIMEOUT))
    }

    fn with_tls(policy: &Arc<DestinationPolicy>, tls: ClientConfig, connect_limit: Duration) -> Self {
        let mut http = HttpConnector::new_with_resolver(PolicyResolver { policy: policy.clone() });
        http.enforce_http(false);
        http.set_nodelay(true);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
            .pool_timer(TokioTimer::new())
            .build(Bounded { inner: https, limit: connect_limit });
        Self { client }
    }

    /// Sends `request` and reads the answer's body up to `max_body` bytes
    /// (and one more, which tells a body that was cut), all within `limit`.
    pub async fn send(
        &self,
        mut request: http::Request<Full<Bytes>>,
        limit: Duration,
        max_body: usize,
    ) -> Result<Reply, Failure> {
        let headers = request.headers_mut();
        headers.entry(USER_AGENT).or_insert(HeaderValue::from_static(KEYGATE_AGENT));
        headers.entry(ACCEPT).or_insert(HeaderValue::from_static("*/*"));
        match tokio::time::timeout(limit, self.exchange(request, max_body)).await {
            Ok(answer) => answer,
            Err(_) => Err(Failure::Timeout),
        }
    }

    async fn exchange(&self, request: http::Request<Full<Bytes>>, max_body: usize) -> Result<Reply, Failure> {
        let response = self.client.request(request).await.map_err(|e| {
            if timed_out(&e) {
                Failure::Timeout
            } else {
                Failure::Connection(error_chain(&e))
            }
        })?;
        let (parts, mut body) = response.into_parts();
        let mut read = Vec::new();
        let mut truncated = false;
        while let Some(frame) = body.frame().await {
            // A body broken off counts as cut, and none of it is read.
            let Ok(frame) = frame else {
                return Ok(Reply {
                    status: parts.status.as_u16(),
                    headers: parts.headers,
                    body: Vec::new(),
                    truncated: true,
                });
            };
            if let Ok(chunk) = frame.into_data() {
                let room = (max_body + 1).saturating_sub(read.len());
                read.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if read.len() > max_body {
                    read.truncate(max_body);
                    truncated = true;
                    break;
                }
            }
        }
        Ok(Reply { status: parts.status.as_u16(), headers: parts.headers, body: read, truncated })
    }
}

/// A connector whose connections (lookup, TCP connect and TLS handshake)
/// must be made within `limit`: hyper's own connect limit stops at TCP,
/// and a receiver that accepts but never finishes the handshake would
/// hold a delivery for its whole time limit. The box is per connection,
/// not per request (hyper wants an `Unpin` future).
#[derive(Clone)]
struct Bounded<C> {
    inner: C,
    limit: Duration,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower::Service<http::Uri> for Bounded<C>
where
    C: tower::Service<http::Uri> + Send + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<C::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (connecting, limit) = (self.inner.call(uri), self.limit);
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out").into()),
            }
        })
    }
}

/// TLS as reqwest set it up for keygate before: the system's verifier (or
/// only the given CAs), and a client certificate when one is given.
fn tls_config(identity: Option<ClientIdentity<'_>>) -> Result<ClientConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
    let only_roots = identity.as_ref().and_then(|i| i.only_roots);
    let builder = match only_roots {
        Some(pem) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem) {
                roots.add(cert.map_err(|_| TlsError::InvalidPem("the CA file"))?)?;
            }
            let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::Verifier(e.to_string()))?;
            builder.with_webpki_verifier(verifier)
        }
        None => {
            let verifier =
                rustls_platform_verifier::Verifier::new(provider).map_err(|e| TlsError::Verifier(e.to_string()))?;
            builder.dangerous().with_custom_certificate_verifier(Arc::new(verifier))
        }
    };
    // ALPN (HTTP/1.1) is the connector's to set.
    let config = match identity {
        Some(identity) => {
            let chain = CertificateDer::pem_slice_iter(identity.cert_and_key)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| TlsError::InvalidPem("the client certificate"))?;
            let key = PrivateKeyDer::from_pem_slice(identity.cert_and_key)
                .map_err(|_| TlsError::InvalidPem("the client key"))?;
            if chain.is_empty() {
                return Err(TlsError::InvalidPem("the client certificate"));
            }
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(config)
}

/// A resolver that drops addresses the policy refuses, so a name that
/// later resolves elsewhere is not called.
#[derive(Clone)]
pub struct PolicyResolver {
    pub policy: Arc<DestinationPolicy>,
}

impl PolicyResolver {
    /// The addresses `host` resolves to that the policy allows; an error
    /// when there are none.
    pub async fn allowed(&self, host: &str) -> Result<Vec<SocketAddr>, BoxError> {
        let found: Vec<SocketAddr> = tokio::net::lookup_host((host, 0)).await?.collect();
        let listed = self.policy.host_listed(host);
        let allowed: Vec<SocketAddr> =
            found.into_iter().filter(|a| listed || self.policy.refuse_address(a.ip()).is_none()).collect();
        if allowed.is_empty() {
            return Err(format!("destination {host} not allowed by the webhook destination policy").into());
        }
        Ok(allowed)
    }
}

impl tower::Service<Name> for PolicyResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let resolver = self.clone();
        Box::pin(async move { resolver.allowed(name.as_str()).await.map(Vec::into_iter) })
    }
}

impl reqwest::dns::Resolve for PolicyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let resolver = self.clone();
        Box::pin(async move {
            let addrs: reqwest::dns::Addrs = Box::new(resolver.allowed(name.as_str()).await?.into_iter());
            Ok(addrs)
        })
    }
}

/// Whether `e` or one of its sources is a connect that timed out.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(s) = source {
        if s.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut) {
            return true;
        }
        source = s.source();
    }
    false
}

/// An error and its sources, joined.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::post;
    use http::Uri;

    /// A receiver on loopback answering `answer` to every POST; its URI.
    async fn receiver(answer: axum::Router) -> Uri {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, answer).await });
        format!("http://127.0.0.1:{port}/hook").parse().unwrap()
    }

    fn transport() -> Transport {
        Transport::new(&Arc::new(DestinationPolicy::default())).unwrap()
    }

    fn post_to(uri: &Uri) -> http::Request<Full<Bytes>> {
        http::Request::post(uri.clone()).body(Full::new(Bytes::from_static(b"{}"))).unwrap()
    }

    #[tokio::test]
    async fn answers_are_read_up_to_the_bound_and_a_longer_one_is_marked_cut() {
        let uri = receiver(axum::Router::new().route("/hook", post(|| async { "x".repeat(10) }))).await;
        let whole = transport().send(post_to(&uri), Duration::from_secs(5), 10).await.unwrap();
        assert_eq!((whole.status, whole.body.len(), whole.truncated), (200, 10, false));
        let cut = transport().send(post_to(&uri), Duration::from_secs(5), 9).await.unwrap();
        assert_eq!((cut.body.len(), cut.truncated), (9, true));
    }

    #[tokio::test]
    async fn an_answer_later_than_the_limit_is_a_timeout() {
        let slow = post(|| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            "late"
        });
        let uri = receiver(axum::Router::new().route("/hook", slow)).await;
        let answer = transport().send(post_to(&uri), Duration::from_millis(200), 100).await;
        assert!(matches!(answer, Err(Failure::Timeout)), "{answer:?}");
    }

    #[tokio::test]
    async fn a_closed_port_is_a_connection_failure_that_names_the_cause() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let uri: Uri = format!("http://127.0.0.1:{port}/hook").parse().unwrap();
        match transport().send(post_to(&uri), Duration::from_secs(5), 100).await {
            Err(Failure::Connection(why)) => assert!(why.contains("refused"), "{why}"),
            other => panic!("expected a connection failure, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn keygate_names_itself_unless_the_registration_sets_a_user_agent() {
        let echo = post(|headers: http::HeaderMap| async move {
            let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            format!("{}|{}", get("user-agent"), get("accept"))
        });
        let uri = receiver(axum::Router::new().route("/hook", echo)).await;
        let plain = transport().send(post_to(&uri), Duration::from_secs(5), 100).await.unwrap();
        assert_eq!(String::from_utf8(plain.body).unwrap(), format!("{KEYGATE_AGENT}|*/*"));
        let mut own = post_to(&uri);
        own.headers_mut().insert(USER_AGENT, HeaderValue::from_static("billing-hooks/2"));
        let own = transport().send(own, Duration::from_secs(5), 100).await.unwrap();
        assert_eq!(String::from_utf8(own.body).unwrap(), "billing-hooks/2|*/*");
    }

    #[tokio::test]
    async fn a_tls_handshake_that_never_finishes_is_a_timeout_at_the_connect_limit() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        // Accepts, then says nothing: the client's hello is never answered.
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let policy = Arc::new(DestinationPolicy::default());
        let transport = Transport::with_tls(&policy, tls_config(None).unwrap(), Duration::from_millis(300));
        let uri: Uri = format!("https://localhost:{port}/hook").parse().unwrap();
        let started = std::time::Instant::now();
        let answer = transport.send(post_to(&uri), Duration::from_secs(30), 100).await;
        assert!(matches!(answer, Err(Failure::Timeout)), "{answer:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "ended by the connect limit, not the request's");
    }

    #[test]
    fn a_client_certificate_file_without_a_certificate_or_key_is_invalid_pem() {
        let policy = Arc::new(DestinationPolicy::default());
        let identity = ClientIdentity { cert_and_key: b"not pem", only_roots: None };
        assert!(matches!(Transport::with_identity(&policy, identity), Err(TlsError::InvalidPem(_))));
    }
}
