//! The client that calls webhooks: no redirects, bounded time and bodies,
//! destinations checked on every connection, answers judged into verdicts.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, AUTHORIZATION};
use http::Uri;
use http_body_util::Full;

use super::credentials::{Credentials, OutboundAuth};
use super::destination::DestinationPolicy;
use super::registration::{Registration, MAX_RESPONSE_BODY};
use super::signing::Signer;
use super::transport::{Failure, Reply, Transport};
use crate::delivery::batch_verdict::{judge_batch, BatchJudgement, MAX_BATCH_ANSWER, MAX_BATCH_OUTPUTS_ANSWER};
use crate::delivery::outputs::{read_outputs, with_outputs, Output, MAX_OUTPUT_ANSWER};
use crate::delivery::verdict::{judge, Judgement, Response, RetryPolicy, Verdict, MAX_RETRY_AFTER};

/// One call to make.
#[derive(Debug, Clone)]
pub struct Outbound {
    /// `webhook-id`: stable across retries.
    pub id: String,
    pub body: Bytes,
    /// Headers besides the signature ones.
    pub headers: Vec<(String, String)>,
}

/// The client that calls webhooks: no redirects, bounded time and bodies,
/// destinations checked on every connection.
#[derive(Clone)]
pub struct WebhookClient {
    transport: Transport,
    /// For token requests (OAuth 2 client credentials).
    tokens: reqwest::Client,
    policy: Arc<DestinationPolicy>,
}

impl WebhookClient {
    /// A client bound by `policy`.
    pub fn new(policy: Arc<DestinationPolicy>) -> anyhow::Result<Self> {
        let transport = Transport::new(&policy)?;
        let tokens = super::credentials::token_client(&policy)?;
        Ok(Self { transport, tokens, policy })
    }

    /// `auth`'s credentials for one instance of a registration.
    pub fn credentials(&self, auth: Option<&OutboundAuth>) -> Credentials {
        Credentials::load(auth, &self.policy, &self.tokens)
    }

    /// POSTs one message to `uri` (the registration's URL, parsed) and judges
    /// the answer, with the outputs an ack's answer asks to publish
    /// (docs/pipelines.md). Outputs refused turn the ack into a retry.
    pub async fn call(
        &self,
        registration: &Registration,
        uri: &Uri,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
    ) -> (Judgement, Vec<Output>) {
        let now = SystemTime::now();
        let max_body = if registration.outputs.is_empty() { MAX_RESPONSE_BODY } else { MAX_OUTPUT_ANSWER };
        let answer = self.exchange(registration, uri, signer, credentials, outbound, max_body, now).await;
        let judgement = judge(&answer.response(), now, retry_policy(registration, &mut Vec::new()));
        match &answer {
            Answer::Http { content_type, body, truncated, .. } if judgement.verdict == Verdict::Ack => {
                match read_outputs(content_type.as_deref(), body, *truncated) {
                    Ok(publish) => with_outputs(judgement, publish, &registration.outputs),
                    Err(refusal) => {
                        let reason = format!("{}, but {refusal}", judgement.reason);
                        (Judgement { verdict: Verdict::Nak { delay: None }, reason, ..judgement }, Vec::new())
                    }
                }
            }
            _ => (judgement, Vec::new()),
        }
    }

    /// POSTs one batch (whose messages' ids are `ids`, in order) and judges
    /// each message's verdict from the answer.
    #[allow(clippy::too_many_arguments)]
    pub async fn call_batch(
        &self,
        registration: &Registration,
        uri: &Uri,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
        ids: &[&str],
    ) -> BatchJudgement {
        let now = SystemTime::now();
        let max_body = if registration.outputs.is_empty() { MAX_BATCH_ANSWER } else { MAX_BATCH_OUTPUTS_ANSWER };
        let answer = self.exchange(registration, uri, signer, credentials, outbound, max_body, now).await;
        judge_batch(&answer.response(), ids, now, retry_policy(registration, &mut Vec::new()))
    }

    /// Signs and sends one request; what came back (the body read up to `max_body`).
    #[allow(clippy::too_many_arguments)]
    async fn exchange(
        &self,
        registration: &Registration,
        uri: &Uri,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
        max_body: usize,
        now: SystemTime,
    ) -> Answer {
        let timestamp = now.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let signature = signer.sign(&outbound.id, timestamp, &outbound.body, now);
        let host = uri.host().unwrap_or_default();
        if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse() {
            if !self.policy.host_listed(host) {
                if let Some(why) = self.policy.refuse_address(ip) {
                    return Answer::ConnectionError(why);
                }
            }
        }
        let authorization = match credentials.authorization().await {
            Ok(value) => value,
            Err(why) => return Answer::ConnectionError(format!("no credentials: {why}")),
        };
        let request = match request(uri, timestamp, signature, registration, outbound, authorization) {
            Ok(request) => request,
            Err(why) => return Answer::ConnectionError(why),
        };
        let transport = credentials.client().unwrap_or(&self.transport);
        let limit = Duration::from_millis(registration.timeout_ms);
        let reply = match transport.send(request, limit, max_body).await {
            Ok(reply) => reply,
            Err(Failure::Timeout) => return Answer::Timeout,
            Err(Failure::Connection(why)) => return Answer::ConnectionError(why),
        };
        if reply.status == 401 {
            credentials.refused().await;
        }
        let header = |name: &str| reply.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (retry_after, keygate_ack) = (header("retry-after"), header("keygate-ack"));
        let content_type = header("content-type");
        let Reply { status, body, truncated, .. } = reply;
        Answer::Http { status, retry_after, keygate_ack, content_type, body, truncated }
    }
}

/// What came back from one call, owned.
enum Answer {
    Http {
        status: u16,
        retry_after: Option<String>,
        keygate_ack: Option<String>,
        content_type: Option<String>,
        body: Vec<u8>,
        /// The body went on past the read limit (or broke off).
        truncated: bool,
    },
    Timeout,
    ConnectionError(String),
}

impl Answer {
    fn response(&self) -> Response<'_> {
        match self {
            Self::Http { status, retry_after, keygate_ack, body, .. } => Response::Http {
                status: *status,
                retry_after: retry_after.as_deref(),
                keygate_ack: keygate_ack.as_deref(),
                body,
            },
            Self::Timeout => Response::Timeout,
            Self::ConnectionError(why) => Response::ConnectionError(why.clone()),
        }
    }
}

/// The registration's retry rules. With credentials, a 401 means they
/// expired or were rotated: they are fetched again and the message
/// retried, not dead-lettered (`with_401` holds that list).
fn retry_policy<'a>(registration: &'a Registration, with_401: &'a mut Vec<u16>) -> RetryPolicy<'a> {
    let retry_statuses = match &registration.auth {
        Some(_) => {
            *with_401 = [registration.retry_statuses.as_slice(), &[401]].concat();
            with_401.as_slice()
        }
        None => registration.retry_statuses.as_slice(),
    };
    RetryPolicy { max_retry_after: MAX_RETRY_AFTER, retry_statuses }
}

/// The POST a delivery makes: the signature headers, the registration's
/// static headers, the delivery's own, and the credentials'. Headers were
/// checked when registered or made safe when built; one that is still not
/// valid fails the attempt with its name.
fn request(
    uri: &Uri,
    timestamp: i64,
    signature: String,
    registration: &Registration,
    outbound: &Outbound,
    authorization: Option<String>,
) -> Result<http::Request<Full<Bytes>>, String> {
    let mut request =
        http::Request::post(uri.clone()).body(Full::new(outbound.body.clone())).map_err(|e| e.to_string())?;
    let headers = request.headers_mut();
    let invalid = |name: &str| format!("the header {name} is not a valid HTTP header");
    let value = |name: &str, v: &str| HeaderValue::from_str(v).map_err(|_| invalid(name));
    headers.insert(HeaderName::from_static("webhook-id"), value("webhook-id", &outbound.id)?);
    headers.insert(HeaderName::from_static("webhook-timestamp"), HeaderValue::from(timestamp));
    headers.insert(HeaderName::from_static("webhook-signature"), value("webhook-signature", &signature)?);
    for (name, v) in registration.headers.iter().chain(outbound.headers.iter().map(|(n, v)| (n, v))) {
        let header = HeaderName::from_bytes(name.as_bytes()).map_err(|_| invalid(name))?;
        headers.append(header, value(name, v)?);
    }
    if let Some(v) = authorization {
        headers.insert(AUTHORIZATION, value("authorization", &v)?);
    }
    Ok(request)
}
