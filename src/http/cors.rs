//! CORS answers for browser pages served from other origins, which may call
//! the REST API only when the operator names their origin
//! (`--cors-allowed-origins`; none by default, so no CORS answer at all).
//! Requests carry bearer tokens in `Authorization`, never cookies, so
//! credentials mode stays off and `*` is safe to offer.

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

/// How long a browser may reuse a preflight answer (Chromium caps it at 2 h).
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// Request headers a page may send: the API's own, W3C trace context and
/// the CloudEvents binary-mode attributes a publisher sets.
const ALLOWED_HEADERS: [&str; 14] = [
    "authorization",
    "content-type",
    "idempotency-key",
    "x-request-id",
    "traceparent",
    "tracestate",
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-subject",
    "ce-time",
    "ce-dataschema",
    "ce-partitionkey",
];

/// Answer headers a page may read.
const EXPOSED_HEADERS: [HeaderName; 3] = [super::REQUEST_ID, header::RETRY_AFTER, header::WWW_AUTHENTICATE];

/// A `--cors-allowed-origins` entry that is not an origin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an origin like https://app.example.com (no path, no trailing slash)")]
pub struct NotAnOrigin(String);

/// Checks one `--cors-allowed-origins` entry: `*`, or an origin as a browser
/// sends it (`scheme://host[:port]`, no path), kept in lower case.
pub fn parse_origin(text: &str) -> Result<String, NotAnOrigin> {
    let origin = text.trim().to_ascii_lowercase();
    if origin == "*" {
        return Ok(origin);
    }
    let Some((scheme, authority)) = origin.split_once("://") else {
        return Err(NotAnOrigin(text.to_owned()));
    };
    let valid_authority = !authority.is_empty()
        && authority.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    if !matches!(scheme, "http" | "https") || !valid_authority {
        return Err(NotAnOrigin(text.to_owned()));
    }
    Ok(origin)
}

/// The CORS layer for `allowed` origins (already checked by
/// [`parse_origin`]); `None` when there are none.
pub fn layer(allowed: &[String]) -> Option<CorsLayer> {
    if allowed.is_empty() {
        return None;
    }
    let allowed = allowed.to_vec();
    let origins = AllowOrigin::predicate(move |origin: &HeaderValue, _| {
        origin.to_str().is_ok_and(|origin| allows(&allowed, origin))
    });
    Some(
        CorsLayer::new()
            .allow_origin(origins)
            .allow_methods([Method::GET, Method::HEAD, Method::POST, Method::PUT, Method::DELETE])
            .allow_headers(ALLOWED_HEADERS.map(HeaderName::from_static))
            .expose_headers(EXPOSED_HEADERS)
            .max_age(PREFLIGHT_MAX_AGE),
    )
}

/// Whether a browser's `Origin` is one of `allowed` (`*`: any).
pub fn allows(allowed: &[String], origin: &str) -> bool {
    allowed.iter().any(|a| a == "*" || a.eq_ignore_ascii_case(origin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_a_scheme_and_an_authority_only() {
        assert_eq!(parse_origin("https://App.Example.com").unwrap(), "https://app.example.com");
        assert_eq!(parse_origin("http://127.0.0.1:8080").unwrap(), "http://127.0.0.1:8080");
        assert_eq!(parse_origin("http://[::1]:80").unwrap(), "http://[::1]:80");
        assert_eq!(parse_origin("*").unwrap(), "*");
        for bad in ["app.example.com", "https://app.example.com/", "ftp://x", "https://", "https://a b", "null"] {
            assert!(parse_origin(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn allowed_origins_match_exactly_or_by_wildcard() {
        let allowed = vec!["https://app.test".to_owned()];
        assert!(allows(&allowed, "https://app.test"));
        assert!(allows(&allowed, "HTTPS://APP.TEST"));
        assert!(!allows(&allowed, "https://app.test.evil"));
        assert!(!allows(&allowed, "http://app.test"));
        assert!(allows(&["*".to_owned()], "https://any.test"));
        assert!(layer(&[]).is_none());
    }
}
