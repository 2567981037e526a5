//! What a browser may not make keygate do on a user's behalf.
//!
//! - **DNS rebinding.** In open mode (no verification keys, loopback only) a
//!   page on `evil.test` whose name later resolves to 127.0.0.1 could call
//!   the API from the user's browser. Such requests carry `Host: evil.test`:
//!   open mode answers only requests addressed to a loopback name.
//! - **Cross-site requests.** A page may POST to another origin without a
//!   CORS preflight when the request has no JSON body (step-down, skip,
//!   retry-now, unpin). Requests that change state and carry an `Origin`
//!   other than keygate's own or one allowed (`--cors-allowed-origins`, or
//!   `--ws-allowed-origins` for pages that also open WebSocket members) are
//!   refused.

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method};
use axum::response::{IntoResponse, Response};

use crate::app::AppState;
use crate::http::problem::ApiError;

/// Whether `host` (a `Host` header: name or address, maybe with a port)
/// names this machine's loopback interface.
pub fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => {
            host.rsplit_once(':').map_or(host, |(name, port)| if port.parse::<u16>().is_ok() { name } else { host })
        }
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether a browser `Origin` is keygate's own (the same authority the
/// request was sent to) or one the operator allowed (`*`: any).
pub fn origin_allowed(origin: &str, host: &str, allowed: &[String]) -> bool {
    let same = origin.split_once("://").is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host));
    same || super::cors::allows(allowed, origin)
}

/// The request's `Origin`, when a browser sent one. `null` (a sandboxed
/// frame, a `file:` page, a redirect across sites) is an origin too: an
/// opaque one, never keygate's own.
pub fn origin_of(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()).filter(|o| !o.is_empty())
}

/// The refusal of a rebinding or cross-site request (see the module's
/// doc), if this is one.
pub fn refusal(state: &AppState, request: &Request) -> Option<Response> {
    let headers = request.headers();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let open_on_loopback = state.verifier.is_none() && !state.settings.allow_unauthenticated;
    if open_on_loopback && !is_loopback_host(host) {
        return Some(
            ApiError::OriginNotAllowed(format!(
                "without authentication keygate answers only requests addressed to a loopback name, not {host:?}"
            ))
            .into_response(),
        );
    }
    let changes_state = !matches!(*request.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if let Some(origin) = origin_of(headers).filter(|_| changes_state) {
        let settings = &state.settings;
        let allowed = origin_allowed(origin, host, &settings.ws_allowed_origins)
            || super::cors::allows(&settings.cors_allowed_origins, origin);
        if !allowed {
            return Some(
                ApiError::OriginNotAllowed(format!(
                    "origin {origin} may not change keygate's state (see --cors-allowed-origins)"
                ))
                .into_response(),
            );
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_loopback_names_and_addresses() {
        for host in [
            "localhost",
            "localhost:8080",
            "LOCALHOST.",
            "app.localhost:1",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]:8080",
            "[::1]",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in
            ["evil.test", "evil.test:8080", "127.0.0.1.evil.test", "10.0.0.1:8080", "[fe80::1]", "", "localhost.evil"]
        {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn origins_are_keygates_own_or_configured() {
        assert!(origin_allowed("http://kg:8080", "kg:8080", &[]));
        assert!(!origin_allowed("https://evil.test", "kg:8080", &[]));
        let allowed = vec!["https://app.test".to_owned()];
        assert!(origin_allowed("https://app.test", "kg:8080", &allowed));
        assert!(!origin_allowed("https://app.test.evil", "kg:8080", &allowed));
        assert!(origin_allowed("https://any.test", "kg:8080", &["*".to_owned()]));
    }

    #[test]
    fn an_opaque_null_origin_is_a_cross_site_origin() {
        let mut headers = HeaderMap::new();
        headers.insert(header::ORIGIN, "null".parse().unwrap());
        assert_eq!(origin_of(&headers), Some("null"));
        assert!(!origin_allowed("null", "localhost:8080", &[]));
    }
}
