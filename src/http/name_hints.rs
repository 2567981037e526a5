//! A 404 for a stream or group whose name differs only in case from one
//! that exists says which ("did you mean ORDERS?"): names are
//! case-sensitive in NATS, and `orders` for `ORDERS` is a newcomer's
//! first typo. Only callers who may see every name get the hint (no
//! authentication configured, or `keygate:admin`), and keygate's own
//! streams are never named.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use crate::app::AppState;
use crate::auth::{Caller, Requirement};
use crate::http::problem::Problem;
use crate::names::StreamName;

/// Largest problem document rewritten (a 404's is a few hundred bytes).
const MAX_PROBLEM_BYTES: usize = 16 * 1024;

/// The path of a request whose 404 answer may carry a hint: the caller
/// may see every name. Read before the request runs (a cheap clone of the
/// URI), looked at only for a 404.
pub fn hint_target(state: &AppState, request: &Request) -> Option<Uri> {
    let may_see_names = state.verifier.is_none()
        || request.extensions().get::<Caller>().is_some_and(|caller| caller.scopes.allows(&Requirement::Admin));
    may_see_names.then(|| request.uri().clone())
}

/// Adds the hint to a 404 answer of a route naming a stream.
pub async fn add_case_hint(state: &AppState, uri: &Uri, response: Response) -> Response {
    if response.status() != StatusCode::NOT_FOUND {
        return response;
    }
    let Some((stream, group)) = named_in(uri.path()) else { return response };
    let Some(hint) = hint(state, stream, group).await else { return response };
    with_hint(response, &hint).await
}

/// The stream (and group) a `/v1/streams/{stream}[/groups/{group}…]` path names.
fn named_in(path: &str) -> Option<(&str, Option<&str>)> {
    let mut segments = path.strip_prefix("/v1/streams/")?.split('/');
    let stream = segments.next().filter(|s| !s.is_empty())?;
    let group = match segments.next() {
        Some("groups") => segments.next().filter(|g| !g.is_empty()),
        _ => None,
    };
    Some((stream, group))
}

/// "did you mean …?" when the stream, or else the group, is missing and a
/// name that differs only in case exists.
async fn hint(state: &AppState, stream: &str, group: Option<&str>) -> Option<String> {
    let streams = &state.runtime.stores.streams;
    let known: Vec<String> = streams.list(false).await.ok()?.into_iter().map(|s| s.name).collect();
    if !known.iter().any(|name| name == stream) {
        let names = known.iter().map(String::as_str).filter(|n| crate::streams::reserved_stream_name(n).is_none());
        return same_but_case(stream, names).map(|name| format!("did you mean stream {name}?"));
    }
    let group = group?;
    let groups = state.runtime.stores.groups.list(&StreamName::parse(stream).ok()?).await.ok()?;
    if groups.iter().any(|g| g.group == group) {
        return None;
    }
    same_but_case(group, groups.iter().map(|g| g.group.as_str())).map(|name| format!("did you mean group {name}?"))
}

/// The one name that equals `wanted` but for case.
fn same_but_case<'a>(wanted: &str, names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut matches = names.filter(|name| *name != wanted && name.eq_ignore_ascii_case(wanted));
    let first = matches.next()?;
    matches.next().is_none().then_some(first)
}

/// The problem document with the hint after its detail.
async fn with_hint(response: Response, hint: &str) -> Response {
    let (parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_PROBLEM_BYTES).await else {
        return Response::from_parts(parts, Body::empty());
    };
    let Ok(mut problem) = serde_json::from_slice::<Problem>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    problem.detail = format!("{}; {hint}", problem.detail);
    let body = serde_json::to_vec(&problem).unwrap_or_default();
    (parts.status, [(header::CONTENT_TYPE, "application/problem+json")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::{named_in, same_but_case};

    #[test]
    fn the_stream_and_group_come_from_the_path() {
        assert_eq!(named_in("/v1/streams/orders/messages"), Some(("orders", None)));
        assert_eq!(named_in("/v1/streams/ORDERS/groups/Billing/members/m1/webhook"), Some(("ORDERS", Some("Billing"))));
        assert_eq!(named_in("/v1/streams/ORDERS/consumers/c"), Some(("ORDERS", None)));
        assert_eq!(named_in("/v1/events"), None);
    }

    #[test]
    fn only_a_single_name_that_differs_in_case_alone_is_suggested() {
        let names = ["ORDERS", "payments", "Payments", "LEDGER"];
        assert_eq!(same_but_case("orders", names.into_iter()), Some("ORDERS"));
        assert_eq!(same_but_case("Ledger", names.into_iter()), Some("LEDGER"));
        assert_eq!(same_but_case("PAYMENTS", names.into_iter()), None, "two candidates: no guess");
        assert_eq!(same_but_case("ORDERS", names.into_iter()), None, "the name itself is no hint");
        assert_eq!(same_but_case("order", names.into_iter()), None);
    }
}
