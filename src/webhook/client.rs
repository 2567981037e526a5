//! The client that calls webhooks: no redirects, bounded time and bodies,
//! destinations checked on every connection, answers judged into verdicts.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::credentials::{Credentials, OutboundAuth};
use super::destination::DestinationPolicy;
use super::registration::{Registration, MAX_RESPONSE_BODY};
use super::signing::Signer;
use crate::delivery::verdict::{judge, Judgement, Response, RetryPolicy, MAX_RETRY_AFTER};

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

    /// POSTs one message to `url` (the registration's, parsed) and judges the answer.
    pub async fn call(
        &self,
        registration: &Registration,
        url: &reqwest::Url,
        signer: &Signer,
        credentials: &Credentials,
        outbound: &Outbound,
    ) -> Judgement {
        let now = SystemTime::now();
        // With credentials, a 401 means they expired or were rotated: they
        // are fetched again and the message retried, not dead-lettered.
        let with_401;
        let retry_statuses = match &registration.auth {
            Some(_) => {
                with_401 = [registration.retry_statuses.as_slice(), &[401]].concat();
                with_401.as_slice()
            }
            None => registration.retry_statuses.as_slice(),
        };
        let policy = RetryPolicy { max_retry_after: MAX_RETRY_AFTER, retry_statuses };
        let timestamp = now.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let signature = signer.sign(&outbound.id, timestamp, &outbound.body, now);
        if let Some(ip) = url.host_str().and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok()) {
            if !self.policy.host_listed(url.host_str().unwrap_or_default()) {
                if let Some(why) = self.policy.refuse_address(ip) {
                    return judge(&Response::ConnectionError(why), now, policy);
                }
            }
        }
        let authorization = match credentials.authorization().await {
            Ok(value) => value,
            Err(why) => return judge(&Response::ConnectionError(format!("no credentials: {why}")), now, policy),
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
            Err(e) if e.is_timeout() => return judge(&Response::Timeout, now, policy),
            // reqwest names the URL in its errors; its query string is often
            // a token, and this text reaches events and dead letters.
            Err(e) => return judge(&Response::ConnectionError(error_chain(&e.without_url())), now, policy),
        };
        let status = response.status().as_u16();
        if status == 401 {
            credentials.refused().await;
        }
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (retry_after, keygate_ack) = (header("retry-after"), header("keygate-ack"));
        let body = match read_capped(response).await {
            Ok(body) => body,
            Err(e) if e.is_timeout() => return judge(&Response::Timeout, now, policy),
            Err(_) => Vec::new(),
        };
        judge(
            &Response::Http {
                status,
                retry_after: retry_after.as_deref(),
                keygate_ack: keygate_ack.as_deref(),
                body: &body,
            },
            now,
            policy,
        )
    }
}

async fn read_capped(mut response: reqwest::Response) -> Result<Vec<u8>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = MAX_RESPONSE_BODY.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= MAX_RESPONSE_BODY {
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
