//! Standard Webhooks signatures: `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`
//! with the key from a `whsec_<base64>` secret.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Prefix of keygate's signing secrets.
pub const SECRET_PREFIX: &str = "whsec_";

/// Why a secret cannot sign.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("the secret must be \"whsec_\" followed by base64 of 24 to 64 random bytes")]
    Malformed,
}

/// A signing key, parsed from its `whsec_…` form.
#[derive(Clone)]
pub struct SigningKey(Vec<u8>);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningKey(…)")
    }
}

impl SigningKey {
    /// Parses `whsec_<base64>`.
    pub fn parse(secret: &str) -> Result<Self, SecretError> {
        let encoded = secret.strip_prefix(SECRET_PREFIX).ok_or(SecretError::Malformed)?;
        let key = base64::engine::general_purpose::STANDARD.decode(encoded).map_err(|_| SecretError::Malformed)?;
        if !(24..=64).contains(&key.len()) {
            return Err(SecretError::Malformed);
        }
        Ok(Self(key))
    }

    /// A new random secret in `whsec_…` form.
    pub fn generate() -> String {
        let key: [u8; 32] = rand::random();
        format!("{SECRET_PREFIX}{}", base64::engine::general_purpose::STANDARD.encode(key))
    }

    /// The `webhook-signature` header value.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
    }
}

/// The keys a delivery is signed with: the current one and, during a
/// rotation's overlap, the one before it, so receivers switch without
/// downtime (Standard Webhooks lists several signatures, space-separated).
#[derive(Debug, Clone)]
pub struct Signer {
    current: SigningKey,
    previous: Option<(SigningKey, std::time::SystemTime)>,
}

impl Signer {
    /// `previous` is the rotated-out secret and when its overlap ends.
    pub fn new(current: &str, previous: Option<(&str, std::time::SystemTime)>) -> Result<Self, SecretError> {
        let previous = match previous {
            Some((secret, until)) => Some((SigningKey::parse(secret)?, until)),
            None => None,
        };
        Ok(Self { current: SigningKey::parse(current)?, previous })
    }

    /// The `webhook-signature` header value at `now`: the current key's
    /// signature, then the previous key's while its overlap lasts.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8], now: std::time::SystemTime) -> String {
        let mut signature = self.current.sign(id, timestamp, body);
        if let Some((previous, until)) = &self.previous {
            if now < *until {
                signature.push(' ');
                signature.push_str(&previous.sign(id, timestamp, body));
            }
        }
        signature
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_the_standard_webhooks_test_vector() {
        // The example from the Standard Webhooks specification.
        let key = SigningKey::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signature = key.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn during_an_overlap_both_keys_sign_and_after_it_only_the_new_one() {
        let (old, new) = (SigningKey::generate(), SigningKey::generate());
        let now = std::time::SystemTime::now();
        let until = now + std::time::Duration::from_secs(60);
        let signer = Signer::new(&new, Some((&old, until))).unwrap();
        let both = signer.sign("id", 1, b"x", now);
        let expected = format!(
            "{} {}",
            SigningKey::parse(&new).unwrap().sign("id", 1, b"x"),
            SigningKey::parse(&old).unwrap().sign("id", 1, b"x")
        );
        assert_eq!(both, expected);
        assert_eq!(signer.sign("id", 1, b"x", until), SigningKey::parse(&new).unwrap().sign("id", 1, b"x"));
    }

    #[test]
    fn generated_secrets_parse_and_malformed_ones_do_not() {
        let secret = SigningKey::generate();
        assert!(secret.starts_with("whsec_"));
        assert!(SigningKey::parse(&secret).is_ok());
        assert!(SigningKey::parse("whsec_short").is_err());
        assert!(SigningKey::parse("nope").is_err());
    }
}
