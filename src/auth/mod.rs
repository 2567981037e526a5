//! Bearer-token (JWT) verification: which keys are trusted, which claims
//! are checked, and which scopes a verified caller holds.

pub mod scopes;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

pub use scopes::{Requirement, Scopes};

/// Where verification keys come from and which claims must match.
#[derive(Clone, Default)]
pub struct AuthSettings {
    /// Shared secret for HS256 tokens.
    pub hs256_secret: Option<String>,
    /// A PEM public key (RSA, EC P-256/P-384 or Ed25519).
    pub public_key_pem: Option<PathBuf>,
    /// A JWKS document (`{"keys":[…]}`) on disk.
    pub jwks_file: Option<PathBuf>,
    /// Required `iss`, when set.
    pub issuer: Option<String>,
    /// Required `aud`, when set.
    pub audience: Option<String>,
    /// Clock skew tolerated on `exp` and `nbf`.
    pub leeway: Duration,
}

/// Shows the settings without the HS256 secret.
impl std::fmt::Debug for AuthSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthSettings")
            .field("hs256_secret", &self.hs256_secret.as_ref().map(|_| "(redacted)"))
            .field("public_key_pem", &self.public_key_pem)
            .field("jwks_file", &self.jwks_file)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("leeway", &self.leeway)
            .finish()
    }
}

impl AuthSettings {
    /// Whether any verification key is configured.
    pub fn has_keys(&self) -> bool {
        self.hs256_secret.is_some() || self.public_key_pem.is_some() || self.jwks_file.is_some()
    }
}

/// Who a verified token says the caller is.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The `sub` claim, when present (logged, never trusted for access).
    pub subject: Option<String>,
    pub scopes: Scopes,
}

/// Why a token was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("the token has expired")]
    Expired,
    #[error("the token is not valid yet (nbf)")]
    NotYetValid,
    #[error("the token's issuer is not accepted")]
    WrongIssuer,
    #[error("the token's audience is not accepted")]
    WrongAudience,
    #[error("the token lacks the required claim `{0}`")]
    MissingClaim(String),
    #[error("no trusted key matches the token's algorithm {alg:?}{}", kid.as_ref().map(|k| format!(" and key id `{k}`")).unwrap_or_default())]
    NoMatchingKey { alg: Algorithm, kid: Option<String> },
    #[error("the token's signature does not verify")]
    BadSignature,
    #[error("the token is malformed")]
    Malformed,
}

/// One trusted key and the algorithms it may verify.
struct TrustedKey {
    kid: Option<String>,
    key: DecodingKey,
    algorithms: Vec<Algorithm>,
}

/// Verifies bearer tokens against the configured keys and claims.
pub struct Verifier {
    keys: Vec<TrustedKey>,
    validation: Validation,
}

/// The claims keygate reads; everything else is ignored.
#[derive(Debug, Deserialize)]
struct Claims {
    sub: Option<String>,
    #[serde(default)]
    scope: Option<ScopeClaim>,
    #[serde(default)]
    scopes: Option<Vec<String>>,
}

/// `scope` is a space-separated string by RFC 8693; some issuers send an array.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ScopeClaim {
    Spaced(String),
    List(Vec<String>),
}

impl Verifier {
    /// A verifier for `settings`, or `None` when no key is configured.
    pub fn load(settings: &AuthSettings) -> anyhow::Result<Option<Self>> {
        if !settings.has_keys() {
            return Ok(None);
        }
        let mut keys = Vec::new();
        if let Some(secret) = &settings.hs256_secret {
            anyhow::ensure!(secret.len() >= 32, "the HS256 secret must be at least 32 bytes long");
            keys.push(TrustedKey {
                kid: None,
                key: DecodingKey::from_secret(secret.as_bytes()).context("the HS256 secret")?,
                algorithms: vec![Algorithm::HS256],
            });
        }
        if let Some(path) = &settings.public_key_pem {
            let pem = std::fs::read(path).with_context(|| format!("reading the public key {}", path.display()))?;
            keys.push(pem_key(&pem).with_context(|| format!("the public key {}", path.display()))?);
        }
        if let Some(path) = &settings.jwks_file {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading the JWKS file {}", path.display()))?;
            keys.extend(jwks_keys(&text).with_context(|| format!("the JWKS file {}", path.display()))?);
        }
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = settings.leeway.as_secs();
        validation.validate_nbf = true;
        validation.validate_aud = settings.audience.is_some();
        let mut required = vec!["exp"];
        if let Some(issuer) = &settings.issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        if let Some(audience) = &settings.audience {
            validation.set_audience(&[audience]);
            required.push("aud");
        }
        validation.set_required_spec_claims(&required);
        Ok(Some(Self { keys, validation }))
    }

    /// Verifies `token` and returns its caller.
    pub fn verify(&self, token: &str) -> Result<Caller, TokenError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| TokenError::Malformed)?;
        let candidates = self.keys.iter().filter(|key| {
            key.algorithms.contains(&header.alg)
                && match (&key.kid, &header.kid) {
                    (Some(ours), Some(theirs)) => ours == theirs,
                    _ => true,
                }
        });
        let mut refusal = TokenError::NoMatchingKey { alg: header.alg, kid: header.kid.clone() };
        for candidate in candidates {
            let mut validation = self.validation.clone();
            validation.algorithms = vec![header.alg];
            match jsonwebtoken::decode::<Claims>(token, &candidate.key, &validation) {
                Ok(data) => {
                    let (spaced, listed) = match data.claims.scope {
                        Some(ScopeClaim::Spaced(s)) => (Some(s), None),
                        Some(ScopeClaim::List(l)) => (None, Some(l)),
                        None => (None, None),
                    };
                    let mut scopes = data.claims.scopes.unwrap_or_default();
                    scopes.extend(listed.unwrap_or_default());
                    return Ok(Caller {
                        subject: data.claims.sub,
                        scopes: Scopes::from_claims(spaced.as_deref(), Some(&scopes)),
                    });
                }
                Err(e) => {
                    refusal = match e.kind() {
                        ErrorKind::ExpiredSignature => TokenError::Expired,
                        ErrorKind::ImmatureSignature => TokenError::NotYetValid,
                        ErrorKind::InvalidIssuer => TokenError::WrongIssuer,
                        ErrorKind::InvalidAudience => TokenError::WrongAudience,
                        ErrorKind::MissingRequiredClaim(claim) => TokenError::MissingClaim(claim.clone()),
                        ErrorKind::InvalidSignature => TokenError::BadSignature,
                        _ => TokenError::Malformed,
                    };
                    // A bad signature may only mean "another key": try the rest.
                    if refusal != TokenError::BadSignature {
                        return Err(refusal);
                    }
                }
            }
        }
        Err(refusal)
    }
}

/// Parses one family's PEM public key.
type PemParser = fn(&[u8]) -> jsonwebtoken::errors::Result<DecodingKey>;

/// A PEM public key of whichever family it is.
fn pem_key(pem: &[u8]) -> anyhow::Result<TrustedKey> {
    let attempts: [(PemParser, &[Algorithm]); 3] = [
        (DecodingKey::from_rsa_pem, &[Algorithm::RS256, Algorithm::RS384, Algorithm::RS512]),
        (DecodingKey::from_ec_pem, &[Algorithm::ES256, Algorithm::ES384]),
        (DecodingKey::from_ed_pem, &[Algorithm::EdDSA]),
    ];
    for (parse, algorithms) in attempts {
        if let Ok(key) = parse(pem) {
            return Ok(TrustedKey { kid: None, key, algorithms: algorithms.to_vec() });
        }
    }
    anyhow::bail!("not a PEM RSA, EC or Ed25519 public key")
}

/// The verification keys of a JWKS document (keys for encryption are skipped).
fn jwks_keys(text: &str) -> anyhow::Result<Vec<TrustedKey>> {
    let set: jsonwebtoken::jwk::JwkSet = serde_json::from_str(text).context("not a JWKS document")?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        if matches!(jwk.common.public_key_use, Some(jsonwebtoken::jwk::PublicKeyUse::Encryption)) {
            continue;
        }
        let key = DecodingKey::from_jwk(jwk)
            .with_context(|| format!("key {}", jwk.common.key_id.as_deref().unwrap_or("without kid")))?;
        let algorithms = match jwk.common.key_algorithm.map(|a| a.to_string().parse::<Algorithm>()) {
            Some(Ok(algorithm)) => vec![algorithm],
            _ => key.family().algorithms().to_vec(),
        };
        keys.push(TrustedKey { kid: jwk.common.key_id.clone(), key, algorithms });
    }
    anyhow::ensure!(!keys.is_empty(), "no signature verification keys in the JWKS document");
    Ok(keys)
}
