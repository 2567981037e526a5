//! Who may call which route: the access rule of every route (one table,
//! used both to enforce and to document), the check that enforces it (run
//! by the `/v1` routes' middleware in src/http/mod.rs),
//! and the OpenAPI security it publishes.

use std::collections::HashMap;

use axum::extract::{MatchedPath, RawPathParams, Request};
use axum::http::{header, Method};
use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::OpenApi;

use crate::app::AppState;
use crate::auth::Requirement;
use crate::http::problem::ApiError;
use crate::names::{GroupName, StreamName};

/// The name of the bearer scheme in the OpenAPI document.
pub const BEARER: &str = "bearer";

/// What a route asks of its caller, before the request's own names are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No token.
    Open,
    /// `keygate:admin`.
    Admin,
    /// `publish:{stream}` from the path.
    PublishPathStream,
    /// `consume:{stream}/{group}` from the path (WebSocket join).
    ConsumePathGroup,
    /// `consume:{stream}/{group}` from the `stream` and `group` query parameters (events).
    ConsumeQueryGroup,
    /// `subscribe:{stream}/{consumer}` from the path (a plain consumer's WebSocket subscriber).
    SubscribePathConsumer,
    /// Some `consume:` or `subscribe:` grant; the handler checks each dead
    /// letter's own group or consumer.
    DeadLetterOwner,
}

impl Access {
    /// The scopes as documented, any one of which admits the caller, with
    /// the request's names as placeholders.
    fn documented_scopes(self) -> &'static [&'static str] {
        match self {
            Self::Open => &[],
            Self::Admin => &[crate::auth::scopes::ADMIN],
            Self::PublishPathStream => &["publish:{stream}"],
            Self::ConsumePathGroup | Self::ConsumeQueryGroup => &["consume:{stream}/{group}"],
            Self::SubscribePathConsumer => &["subscribe:{stream}/{consumer}"],
            Self::DeadLetterOwner => {
                &[crate::auth::scopes::ADMIN, "consume:{stream}/{group}", "subscribe:{stream}/{consumer}"]
            }
        }
    }

    /// Browsers cannot set headers on EventSource or WebSocket requests.
    fn accepts_query_token(self) -> bool {
        matches!(self, Self::ConsumePathGroup | Self::ConsumeQueryGroup | Self::SubscribePathConsumer)
    }
}

/// The access rule of a route template. Anything under `/v1/` not named
/// here is admin-only, so a new route is closed until someone opens it.
pub fn access_for(method: &Method, template: &str) -> Access {
    if !template.starts_with("/v1/") {
        return Access::Open;
    }
    if template == "/v1/events" {
        return Access::ConsumeQueryGroup;
    }
    if *method == Method::GET && template.ends_with("/members/{member}/ws") {
        return Access::ConsumePathGroup;
    }
    if *method == Method::GET && template.ends_with("/subscribers/{subscriber}/ws") {
        return Access::SubscribePathConsumer;
    }
    // Pull members and subscribers: the same scopes as their WebSocket joins.
    let pull = |served: &str| ["fetch", "acks"].iter().any(|op| template.ends_with(&format!("{served}/{op}")));
    if *method == Method::POST && pull("/members/{member}") {
        return Access::ConsumePathGroup;
    }
    if *method == Method::POST && pull("/subscribers/{subscriber}") {
        return Access::SubscribePathConsumer;
    }
    if template == "/v1/dead-letters" || template.starts_with("/v1/dead-letters/") {
        return Access::DeadLetterOwner;
    }
    if *method == Method::POST
        && (template == "/v1/streams/{stream}/messages" || template == "/v1/streams/{stream}/messages/batch")
    {
        return Access::PublishPathStream;
    }
    Access::Admin
}

/// Enforces [`access_for`] on a routed request when keygate has keys: the
/// refusal, or the request with its [`Caller`] added.
pub fn authorize(state: &AppState, path: &RawPathParams, request: &mut Request) -> Result<(), ApiError> {
    let Some(verifier) = state.verifier.as_ref() else { return Ok(()) };
    let template = request.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned()).unwrap_or_default();
    let access = access_for(request.method(), &template);
    if access == Access::Open {
        return Ok(());
    }
    // Only GETs (EventSource, WebSocket): a pull client's POST sets its header.
    let query_token = access.accepts_query_token() && request.method() == Method::GET;
    let mut query: HashMap<String, String> = if query_token {
        axum::extract::Query::try_from_uri(request.uri()).map(|q| q.0).unwrap_or_default()
    } else {
        HashMap::new()
    };
    let token = bearer_token(request).or_else(|| query.remove("access_token")).or_else(|| {
        if query_token {
            subprotocol_token(request)
        } else {
            None
        }
    });
    let Some(token) = token else { return Err(ApiError::MissingToken) };
    let caller = verifier.verify(&token).map_err(|refusal| ApiError::Unauthorized(refusal.to_string()))?;
    let path_param = |name: &str| path.iter().find(|(key, _)| *key == name).map(|(_, value)| value.to_owned());
    let requirement = requirement(access, path_param, query)?;
    if !caller.scopes.allows(&requirement) {
        tracing::info!(subject = caller.subject.as_deref().unwrap_or("-"), ?requirement, "refused: missing scope");
        return Err(ApiError::Forbidden { scope: requirement.scope().unwrap_or_default() });
    }
    tracing::debug!(subject = caller.subject.as_deref().unwrap_or("-"), "authorized");
    request.extensions_mut().insert(caller);
    Ok(())
}

/// The request's requirement with its own names filled in. Names are parsed
/// first, so a wildcard character in a name can never widen what is asked.
fn requirement(
    access: Access,
    path_param: impl Fn(&str) -> Option<String>,
    mut query: HashMap<String, String>,
) -> Result<Requirement, ApiError> {
    let stream = |raw: Option<String>| -> Result<Option<String>, ApiError> {
        raw.map(|s| StreamName::parse(&s).map(|n| n.as_str().to_owned())).transpose().map_err(ApiError::from)
    };
    let group = |raw: Option<String>| -> Result<Option<String>, ApiError> {
        raw.map(|s| GroupName::parse(&s).map(|n| n.as_str().to_owned())).transpose().map_err(ApiError::from)
    };
    Ok(match access {
        Access::Open => Requirement::Open,
        Access::Admin => Requirement::Admin,
        Access::DeadLetterOwner => Requirement::SomeConsumption,
        Access::PublishPathStream => Requirement::Publish {
            stream: stream(path_param("stream"))?
                .ok_or_else(|| ApiError::BadRequest("no stream in the path".into()))?,
        },
        Access::ConsumePathGroup => {
            Requirement::Consume { stream: stream(path_param("stream"))?, group: group(path_param("group"))? }
        }
        Access::SubscribePathConsumer => {
            let missing = || ApiError::BadRequest("no stream or consumer in the path".into());
            Requirement::Subscribe {
                stream: stream(path_param("stream"))?.ok_or_else(missing)?,
                consumer: group(path_param("consumer"))?.ok_or_else(missing)?,
            }
        }
        Access::ConsumeQueryGroup => {
            let stream = stream(query.remove("stream"))?;
            // A group without its stream names nothing narrower than every stream.
            let group = if stream.is_some() { group(query.remove("group"))? } else { None };
            Requirement::Consume { stream, group }
        }
    })
}

fn bearer_token(request: &Request) -> Option<String> {
    let value = request.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim().to_owned()).filter(|t| !t.is_empty())
}

/// A WebSocket client's token offered as the subprotocol `bearer.<jwt>`
/// (beside `keygate.v1`, the one keygate answers with).
fn subprotocol_token(request: &Request) -> Option<String> {
    let offered = request.headers().get(header::SEC_WEBSOCKET_PROTOCOL)?.to_str().ok()?;
    offered.split(',').map(str::trim).find_map(|p| p.strip_prefix("bearer.")).map(str::to_owned)
}

/// Publishes the access table in the document: the bearer scheme, each
/// operation's scope, and its 401/403 answers.
pub fn document_security(doc: &mut OpenApi) {
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        BEARER,
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .bearer_format("JWT")
                .description(Some(
                    "A JWT whose `scope` (space-separated) or `scopes` (array) claim grants: `keygate:admin` \
                     (everything), `publish:<stream>`, `consume:<stream>/<group>` (a group's members and events), \
                     `subscribe:<stream>/<consumer>` (a plain consumer's subscribers; the dead letters of a group or consumer are open to its scope); a trailing `*` is a wildcard \
                     (`publish:*`); pull members' and subscribers' `fetch` and `acks` take the scope of their WebSocket joins. The events and WebSocket routes also take it as the `access_token` query \
                     parameter, or the WebSocket route as the subprotocol `bearer.<jwt>` offered beside `keygate.v1`. Required only when keygate is configured with verification keys.",
                ))
                .build(),
        ),
    );
    for (path, item) in doc.paths.paths.iter_mut() {
        let operations: [(Method, &mut Option<Operation>); 5] = [
            (Method::GET, &mut item.get),
            (Method::PUT, &mut item.put),
            (Method::POST, &mut item.post),
            (Method::DELETE, &mut item.delete),
            (Method::PATCH, &mut item.patch),
        ];
        for (method, operation) in operations {
            let Some(operation) = operation.as_mut() else { continue };
            let scopes = access_for(&method, path).documented_scopes();
            if scopes.is_empty() {
                continue;
            }
            operation.security = Some(scopes.iter().map(|scope| SecurityRequirement::new(BEARER, [*scope])).collect());
            for (status, description) in [
                ("401", "no bearer token, or one that does not verify"),
                ("403", "the token lacks the scope this operation needs"),
            ] {
                operation
                    .responses
                    .responses
                    .entry(status.to_owned())
                    .or_insert_with(|| super::problem_response(description));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_outside_v1_are_open_and_v1_defaults_to_admin() {
        assert_eq!(access_for(&Method::GET, "/healthz"), Access::Open);
        assert_eq!(access_for(&Method::GET, "/metrics"), Access::Open);
        assert_eq!(access_for(&Method::GET, "/v1/streams"), Access::Admin);
        assert_eq!(access_for(&Method::PUT, "/v1/streams/{stream}/groups/{group}"), Access::Admin);
        assert_eq!(access_for(&Method::POST, "/v1/some/new/route"), Access::Admin);
    }

    #[test]
    fn publishing_and_consuming_have_their_own_scopes() {
        assert_eq!(access_for(&Method::POST, "/v1/streams/{stream}/messages"), Access::PublishPathStream);
        assert_eq!(access_for(&Method::POST, "/v1/streams/{stream}/messages/batch"), Access::PublishPathStream);
        assert_eq!(access_for(&Method::GET, "/v1/events"), Access::ConsumeQueryGroup);
        assert_eq!(
            access_for(&Method::GET, "/v1/streams/{stream}/groups/{group}/members/{member}/ws"),
            Access::ConsumePathGroup
        );
    }

    #[test]
    fn names_are_parsed_before_they_become_scopes() {
        let no_path = |_: &str| None;
        let query = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert!(requirement(Access::ConsumeQueryGroup, no_path, query(&[("stream", "o*")])).is_err());
        assert_eq!(
            requirement(Access::ConsumeQueryGroup, no_path, query(&[("stream", "orders"), ("group", "g")])).unwrap(),
            Requirement::Consume { stream: Some("orders".into()), group: Some("g".into()) }
        );
        assert_eq!(
            requirement(Access::ConsumeQueryGroup, no_path, query(&[("group", "g")])).unwrap(),
            Requirement::Consume { stream: None, group: None }
        );
    }
}
