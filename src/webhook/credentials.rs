//! How keygate authenticates to a webhook endpoint (a registration's
//! `auth`) and the static headers it adds (`headers`). Credentials come
//! from files under the operator's `--webhook-credentials-dir` and from
//! environment variables named `WEBHOOK_AUTH_*`, never from the API: a
//! registration names where a secret is, so no secret is ever stored in KV,
//! shown in a GET answer or logged, and no token can make keygate read its
//! own secrets or any other file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::destination::DestinationPolicy;
use super::transport::{ClientIdentity, PolicyResolver, TlsError, Transport, CONNECT_TIMEOUT, KEYGATE_AGENT};
use super::{WebhookError as Error, WebhookErrorKind as Kind};

/// Environment variables a registration may name start with this.
pub const ENV_PREFIX: &str = "WEBHOOK_AUTH_";
/// Most static headers per registration, and their bytes in all.
pub const MAX_HEADERS: usize = 32;
pub const MAX_HEADER_BYTES: usize = 8 * 1024;
/// A cached OAuth2 token is refreshed this long before it expires (or a
/// fifth of its life, if that is shorter).
const REFRESH_MARGIN: Duration = Duration::from_secs(30);

/// How keygate authenticates to the endpoint: one of these.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum OutboundAuth {
    /// `Authorization: Bearer <the file's contents>`, read again when the
    /// file changes. The file lies under `--webhook-credentials-dir`.
    BearerFile(String),
    /// `Authorization: Bearer <the variable's value>`; the name starts with `WEBHOOK_AUTH_`.
    BearerEnv(String),
    /// OAuth2 client credentials: a token from `token_url`, cached until it expires.
    Oauth2(OAuth2Spec),
    /// A TLS client certificate (PEM files under `--webhook-credentials-dir`).
    Mtls(MtlsSpec),
}

/// OAuth2 client-credentials grant (RFC 6749, 4.4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OAuth2Spec {
    pub token_url: String,
    pub client_id: String,
    /// The environment variable holding the client secret (`WEBHOOK_AUTH_…`).
    pub client_secret_env: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
}

/// A client certificate, its key, and optionally the CA that signed the
/// endpoint's own certificate (else the system's roots).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MtlsSpec {
    pub cert_file: String,
    pub key_file: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
}

/// Headers a registration may not set: HTTP's framing and hop-by-hop
/// headers, credentials (`auth` carries those), the payload's own type, and
/// keygate's and the signature's.
fn refused_header(name: &str) -> Option<&'static str> {
    const FRAMING: [&str; 10] = [
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-type",
        "expect",
    ];
    let lower = name.to_ascii_lowercase();
    if FRAMING.contains(&lower.as_str()) || lower.starts_with("proxy-") {
        Some("it frames the HTTP request (hop-by-hop or payload headers are keygate's to set)")
    } else if lower == "authorization" || lower == "cookie" {
        Some("credentials go in auth (bearer_file, bearer_env, oauth2 or mtls)")
    } else if lower.starts_with("keygate-") || lower.starts_with("webhook-") {
        Some("keygate-* and webhook-* headers are keygate's own")
    } else {
        None
    }
}

/// Checks a registration's static headers.
pub fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), Error> {
    let bad = |m: String| Err(Error::new(Kind::InvalidRegistration, m));
    if headers.len() > MAX_HEADERS {
        return bad(format!("headers takes at most {MAX_HEADERS} headers"));
    }
    let mut bytes = 0;
    for (name, value) in headers {
        if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return bad(format!("header name {name:?} is not a valid HTTP header name"));
        }
        if axum::http::HeaderValue::from_str(value).is_err() {
            return bad(format!("header {name:?} has a value HTTP cannot carry"));
        }
        if let Some(why) = refused_header(name) {
            return bad(format!("header {name:?} is refused: {why}"));
        }
        bytes += name.len() + value.len();
    }
    if bytes > MAX_HEADER_BYTES {
        return bad(format!("headers come to {bytes} bytes; at most {MAX_HEADER_BYTES}"));
    }
    Ok(())
}

/// Why a webhook's outbound credentials cannot be had. Never names a
/// secret: only files, variable names and what the token endpoint did.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    #[error(
        "credential files need keygate started with --webhook-credentials-dir (the only place it reads them from)"
    )]
    NoCredentialsDir,
    #[error("the credentials directory is not readable: {0}")]
    UnreadableDir(String),
    #[error("{0} cannot be read")]
    Unreadable(String),
    #[error("{0} is not a file in the credentials directory")]
    OutsideDir(String),
    #[error("{0} is empty")]
    Empty(String),
    #[error("environment variable names must be WEBHOOK_AUTH_<A-Z0-9_>; {0:?} is not")]
    EnvName(String),
    #[error("the environment variable {0} is not set on this keygate")]
    EnvUnset(String),
    /// The token endpoint did not answer (the error without its URL).
    #[error("the token endpoint did not answer: {0}")]
    TokenUnanswered(String),
    #[error("the token endpoint answered {0}")]
    TokenRefused(reqwest::StatusCode),
    #[error("the token endpoint's answer has no access_token")]
    NoAccessToken,
    #[error("{0} is not valid PEM")]
    InvalidPem(&'static str),
    #[error("the TLS client could not be built: {0}")]
    TlsClient(String),
}

/// A file a registration names, inside the credentials directory.
fn credential_file(policy: &DestinationPolicy, path: &str) -> Result<PathBuf, CredentialError> {
    let dir = policy.credentials_dir.as_ref().ok_or(CredentialError::NoCredentialsDir)?;
    let dir = dir.canonicalize().map_err(|e| CredentialError::UnreadableDir(e.to_string()))?;
    let path = Path::new(path);
    let full = if path.is_absolute() { path.to_path_buf() } else { dir.join(path) };
    // Resolved, so neither `..` nor a symbolic link leads out of it.
    let resolved = full.canonicalize().map_err(|_| CredentialError::Unreadable(path.display().to_string()))?;
    if !resolved.starts_with(&dir) || !resolved.is_file() {
        return Err(CredentialError::OutsideDir(path.display().to_string()));
    }
    Ok(resolved)
}

fn check_env_name(name: &str) -> Result<(), CredentialError> {
    let shaped = name.len() > ENV_PREFIX.len()
        && name.starts_with(ENV_PREFIX)
        && name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if shaped {
        Ok(())
    } else {
        Err(CredentialError::EnvName(name.to_owned()))
    }
}

impl OutboundAuth {
    /// Checks what the registration names: files inside the credentials
    /// directory, variable names of the allowed shape, a token URL the
    /// destination policy allows. Secrets themselves are not read here.
    pub async fn check(&self, policy: &DestinationPolicy) -> Result<(), Error> {
        let refuse = |kind: Kind| move |e: &dyn std::fmt::Display| Error::new(kind, e.to_string());
        let invalid = |e: CredentialError| Error::new(Kind::InvalidRegistration, e.to_string());
        match self {
            Self::BearerFile(path) => {
                credential_file(policy, path).map(|_| ()).map_err(|e| refuse(Kind::CredentialRefused)(&e))
            }
            Self::BearerEnv(name) => check_env_name(name).map_err(invalid),
            Self::Oauth2(spec) => {
                check_env_name(&spec.client_secret_env).map_err(invalid)?;
                if spec.client_id.is_empty() || spec.client_id.len() > 256 {
                    return Err(Error::new(Kind::InvalidRegistration, "client_id must be 1 to 256 characters"));
                }
                policy.check_url(&spec.token_url).await.map(|_| ()).map_err(|e| refuse(Kind::DestinationRefused)(&e))
            }
            Self::Mtls(spec) => {
                for file in [Some(&spec.cert_file), Some(&spec.key_file), spec.ca_file.as_ref()].into_iter().flatten() {
                    credential_file(policy, file).map_err(|e| refuse(Kind::CredentialRefused)(&e))?;
                }
                Ok(())
            }
        }
    }
}

/// A bearer token read from a file, kept until the file changes.
#[derive(Default)]
pub struct FileToken {
    read: Option<(SystemTime, u64, String)>,
}

/// An OAuth2 token and when it must be refreshed.
#[derive(Default)]
pub struct CachedToken {
    token: Option<(String, Instant)>,
}

/// A registration's credentials as one instance uses them.
pub enum Credentials {
    None,
    BearerFile {
        path: String,
        policy: Arc<DestinationPolicy>,
        cache: Mutex<FileToken>,
    },
    BearerEnv(String),
    OAuth2 {
        spec: OAuth2Spec,
        http: reqwest::Client,
        cache: tokio::sync::Mutex<CachedToken>,
    },
    /// A client of its own, presenting the certificate.
    Mtls(Transport),
    /// The credentials could not be loaded: every delivery fails with this.
    Broken(CredentialError),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "Credentials::None",
            Self::BearerFile { .. } => "Credentials::BearerFile",
            Self::BearerEnv(_) => "Credentials::BearerEnv",
            Self::OAuth2 { .. } => "Credentials::OAuth2",
            Self::Mtls(_) => "Credentials::Mtls",
            Self::Broken(_) => "Credentials::Broken",
        })
    }
}

impl Credentials {
    /// The credentials `auth` names; `http` is the client for token
    /// requests (with the destination checks every webhook call has).
    pub fn load(auth: Option<&OutboundAuth>, policy: &Arc<DestinationPolicy>, http: &reqwest::Client) -> Self {
        match auth {
            None => Self::None,
            Some(OutboundAuth::BearerFile(path)) => {
                Self::BearerFile { path: path.clone(), policy: policy.clone(), cache: Mutex::default() }
            }
            Some(OutboundAuth::BearerEnv(name)) => Self::BearerEnv(name.clone()),
            Some(OutboundAuth::Oauth2(spec)) => {
                Self::OAuth2 { spec: spec.clone(), http: http.clone(), cache: tokio::sync::Mutex::default() }
            }
            Some(OutboundAuth::Mtls(spec)) => match mtls_client(spec, policy) {
                Ok(client) => Self::Mtls(client),
                Err(why) => Self::Broken(why),
            },
        }
    }

    /// The client to send with, when it is not the shared one.
    pub fn client(&self) -> Option<&Transport> {
        match self {
            Self::Mtls(client) => Some(client),
            _ => None,
        }
    }

    /// The `Authorization` header value, if any; `Err` says why the
    /// credentials cannot be had (the delivery fails and is retried).
    pub async fn authorization(&self) -> Result<Option<String>, CredentialError> {
        match self {
            Self::None | Self::Mtls(_) => Ok(None),
            Self::Broken(why) => Err(why.clone()),
            Self::BearerEnv(name) => match std::env::var(name) {
                Ok(token) if !token.trim().is_empty() => Ok(Some(format!("Bearer {}", token.trim()))),
                _ => Err(CredentialError::EnvUnset(name.clone())),
            },
            Self::BearerFile { path, policy, cache } => {
                let file = credential_file(policy, path)?;
                let meta = std::fs::metadata(&file).map_err(|_| CredentialError::Unreadable(path.clone()))?;
                let stamp = (meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), meta.len());
                let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
                match &cache.read {
                    Some((modified, len, token)) if (*modified, *len) == stamp => Ok(Some(format!("Bearer {token}"))),
                    _ => {
                        let token =
                            std::fs::read_to_string(&file).map_err(|_| CredentialError::Unreadable(path.clone()))?;
                        let token = token.trim().to_owned();
                        if token.is_empty() {
                            return Err(CredentialError::Empty(path.clone()));
                        }
                        cache.read = Some((stamp.0, stamp.1, token.clone()));
                        Ok(Some(format!("Bearer {token}")))
                    }
                }
            }
            Self::OAuth2 { spec, http, cache } => {
                let mut cache = cache.lock().await;
                if let Some((token, until)) = &cache.token {
                    if Instant::now() < *until {
                        return Ok(Some(format!("Bearer {token}")));
                    }
                }
                let (token, lifetime) = fetch_token(spec, http).await?;
                let margin = REFRESH_MARGIN.min(lifetime / 5);
                cache.token = Some((token.clone(), Instant::now() + lifetime - margin));
                Ok(Some(format!("Bearer {token}")))
            }
        }
    }

    /// The endpoint refused the credentials (401): fetch a new token next time.
    pub async fn refused(&self) {
        if let Self::OAuth2 { cache, .. } = self {
            cache.lock().await.token = None;
        }
    }
}

/// A token by the client-credentials grant, and how long it lives.
async fn fetch_token(spec: &OAuth2Spec, http: &reqwest::Client) -> Result<(String, Duration), CredentialError> {
    let secret = std::env::var(&spec.client_secret_env)
        .map_err(|_| CredentialError::EnvUnset(spec.client_secret_env.clone()))?;
    let mut form = vec![("grant_type", "client_credentials"), ("client_id", spec.client_id.as_str())];
    form.push(("client_secret", secret.as_str()));
    if let Some(scope) = &spec.scope {
        form.push(("scope", scope.as_str()));
    }
    let response = http
        .post(&spec.token_url)
        .timeout(Duration::from_secs(10))
        .form(&form)
        .send()
        .await
        // Without the URL: its query may carry credentials.
        .map_err(|e| CredentialError::TokenUnanswered(e.without_url().to_string()))?;
    let status = response.status();
    let body = response.bytes().await.map_err(|e| CredentialError::TokenUnanswered(e.without_url().to_string()))?;
    if !status.is_success() {
        return Err(CredentialError::TokenRefused(status));
    }
    #[derive(Deserialize)]
    struct TokenAnswer {
        access_token: String,
        expires_in: Option<u64>,
    }
    let answer: TokenAnswer = serde_json::from_slice(&body).map_err(|_| CredentialError::NoAccessToken)?;
    // Without expires_in (it is optional), refresh every five minutes.
    Ok((answer.access_token, Duration::from_secs(answer.expires_in.unwrap_or(300))))
}

/// The reqwest client for token requests: no
/// redirects, no resends of its own, no proxy, a bounded connect, the
/// destination checked on each lookup. Deliveries go over
/// `transport.rs`.
///
/// keygate alone decides when a request is sent again, so reqwest's retry
/// layer, which resends on HTTP/2 refusals, is off. Over HTTP/1, all this
/// client speaks, it never resent, but it copied every request in case it
/// would.
pub fn token_client(policy: &Arc<DestinationPolicy>) -> reqwest::Result<reqwest::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .retry(reqwest::retry::never().max_retries_per_request(0))
        .connect_timeout(CONNECT_TIMEOUT)
        .no_proxy()
        .user_agent(KEYGATE_AGENT)
        .dns_resolver(Arc::new(PolicyResolver { policy: policy.clone() }))
        .build()
}

/// A client presenting the certificate, with the shared client's limits.
fn mtls_client(spec: &MtlsSpec, policy: &Arc<DestinationPolicy>) -> Result<Transport, CredentialError> {
    let read = |path: &str| -> Result<Vec<u8>, CredentialError> {
        let file = credential_file(policy, path)?;
        std::fs::read(file).map_err(|_| CredentialError::Unreadable(path.to_owned()))
    };
    let mut cert_and_key = read(&spec.cert_file)?;
    cert_and_key.push(b'\n');
    cert_and_key.extend(read(&spec.key_file)?);
    let only_roots = spec.ca_file.as_deref().map(read).transpose()?;
    let identity = ClientIdentity { cert_and_key: &cert_and_key, only_roots: only_roots.as_deref() };
    Transport::with_identity(policy, identity).map_err(|e| match e {
        TlsError::InvalidPem(what) => CredentialError::InvalidPem(what),
        other => CredentialError::TlsClient(other.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_headers_refuse_framing_credentials_and_keygates_own() {
        let with = |name: &str| BTreeMap::from([(name.to_owned(), "v".to_owned())]);
        for refused in [
            "Connection",
            "Host",
            "Content-Type",
            "Transfer-Encoding",
            "Proxy-Authorization",
            "Authorization",
            "Cookie",
            "keygate-key",
            "Webhook-Signature",
            "bad name",
        ] {
            assert!(check_headers(&with(refused)).is_err(), "{refused}");
        }
        assert!(check_headers(&with("X-Tenant")).is_ok());
        assert!(check_headers(&BTreeMap::from([("X-A".to_owned(), "line\nbreak".to_owned())])).is_err());
        let many: BTreeMap<String, String> = (0..33).map(|n| (format!("x-{n}"), "v".to_owned())).collect();
        assert!(check_headers(&many).is_err());
    }

    #[test]
    fn credential_files_stay_inside_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "t").unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        let policy = DestinationPolicy { credentials_dir: Some(dir.path().to_path_buf()), ..Default::default() };
        assert!(credential_file(&policy, "token").is_ok());
        assert!(credential_file(&policy, dir.path().join("token").to_str().unwrap()).is_ok());
        assert!(credential_file(&policy, "../token").is_err());
        assert!(credential_file(&policy, outside.path().to_str().unwrap()).is_err());
        assert!(credential_file(&policy, "/etc/passwd").is_err());
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).unwrap();
            assert!(credential_file(&policy, "link").is_err(), "a link out of the directory");
        }
        assert!(credential_file(&DestinationPolicy::default(), "token").is_err(), "no directory, no files");
    }

    #[test]
    fn only_webhook_auth_variables_may_be_named() {
        assert!(check_env_name("WEBHOOK_AUTH_BILLING").is_ok());
        for refused in ["KEYGATE_AUTH_HS256_SECRET", "WEBHOOK_AUTH_", "HOME", "WEBHOOK_AUTH_a", "WEBHOOK_AUTH_X-Y"] {
            assert!(check_env_name(refused).is_err(), "{refused}");
        }
    }
}
