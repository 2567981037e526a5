//! The client that calls webhooks: no redirects, bounded time and bodies,
//! destinations checked on every connection, answers judged into verdicts.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::credentials::{Credentials, OutboundAuth};
use super::destination::DestinationPolicy;
use super::registration::{Registration, MAX_RESPONSE_BODY};
use super::signing::Signer;
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
    http: reqwest::Client,
    policy: Arc<DestinationPolicy>,
}

impl WebhookClient {
    /// A client bound by `policy`.
    pub fn new(policy: Arc<DestinationPolicy>) -> anyhow::Result<Self> {
        let http = super::destination::client_builder(&policy).build()?;
        Ok(Self { http, policy })
    }

    /// `auth`'s credentials for one instance of a registration.
    pub fn credentials(&self, auth: Option<&OutboundAuth>) -> Credentials {
        Credentials::load(auth, &self.policy, &self.http)
    }

    /// POSTs one message to `url` (the registration's, parsed) and judges
    /// the answer, with the outputs an ack's answer asks to publish
    /// (docs/pipelines.md). Outputs refused turn the ack into a retry.
    pub async fn call(
        &self,
        registration: &Registration,
        url: &reqwest::Url,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
    ) -> (Judgement, Vec<Output>) {
        let now = SystemTime::now();
        let max_body = if registration.outputs.is_empty() { MAX_RESPONSE_BODY } else { MAX_OUTPUT_ANSWER };
        let answer = self.exchange(registration, url, signer, credentials, outbound, max_body, now).await;
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
        url: &reqwest::Url,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
        ids: &[&str],
    ) -> BatchJudgement {
        let now = SystemTime::now();
        let max_body = if registration.outputs.is_empty() { MAX_BATCH_ANSWER } else { MAX_BATCH_OUTPUTS_ANSWER };
        let answer = self.exchange(registration, url, signer, credentials, outbound, max_body, now).await;
        judge_batch(&answer.response(), ids, now, retry_policy(registration, &mut Vec::new()))
    }

    /// Signs and sends one request; what came back (the body read up to `max_body`).
    #[allow(clippy::too_many_arguments)]
    async fn exchange(
        &self,
        registration: &Registration,
        url: &reqwest::Url,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
        max_body: usize,
        now: SystemTime,
    ) -> Answer {
        let timestamp = now.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let signature = signer.sign(&outbound.id, timestamp, &outbound.body, now);
        if let Some(ip) = url.host_str().and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok()) {
            if !self.policy.host_listed(url.host_str().unwrap_or_default()) {
                if let Some(why) = self.policy.refuse_address(ip) {
                    return Answer::ConnectionError(why);
                }
            }
        }
        let authorization = match credentials.authorization().await {
            Ok(value) => value,
            Err(why) => return Answer::ConnectionError(format!("no credentials: {why}")),
        };
        let mut request = credentials
            .client()
            .unwrap_or(&self.http)
            .post(url.clone())
            .timeout(Duration::from_millis(registration.timeout_ms))
            .header("webhook-id", &outbound.id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature);
        for (name, value) in registration.headers.iter().chain(outbound.headers.iter().map(|(n, v)| (n, v))) {
            request = request.header(name.as_str(), value.as_str());
        }
        if let Some(value) = authorization {
            request = request.header(reqwest::header::AUTHORIZATION, value);
        }
        let response = match request.body(outbound.body.clone()).send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return Answer::Timeout,
            // reqwest names the URL in its errors; its query string is often
            // a token, and this text reaches events and dead letters.
            Err(e) => return Answer::ConnectionError(error_chain(&e.without_url())),
        };
        let status = response.status().as_u16();
        if status == 401 {
            credentials.refused().await;
        }
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (retry_after, keygate_ack) = (header("retry-after"), header("keygate-ack"));
        let content_type = header("content-type");
        // One byte past the limit tells a body that was cut.
        let (body, truncated) = match read_capped(response, max_body + 1).await {
            Ok(mut body) if body.len() > max_body => {
                body.truncate(max_body);
                (body, true)
            }
            Ok(body) => (body, false),
            Err(e) if e.is_timeout() => return Answer::Timeout,
            Err(_) => (Vec::new(), true),
        };
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

async fn read_capped(mut response: reqwest::Response, max_body: usize) -> Result<Vec<u8>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = max_body.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= max_body {
            break;
        }
    }
    Ok(body)
}

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
