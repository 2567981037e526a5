//! `ApiError`: the one place HTTP statuses are chosen, rendered as RFC 9457
//! `application/problem+json`. Domain errors (`crate::error::Error<Kind>`)
//! become one here, by their kind's class; the rest are the HTTP layer's own (tokens, scopes, origins,
//! methods, media types).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// An RFC 9457 problem document.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Problem {
    /// A URI naming the kind of problem.
    #[serde(rename = "type")]
    pub problem_type: String,
    /// Short, human-readable summary of the kind of problem.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What went wrong in this occurrence.
    pub detail: String,
}

/// Every error an API handler can answer with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// 400: malformed or invalid input.
    #[error("{0}")]
    BadRequest(String),
    /// 401: the request carries no bearer token.
    #[error("this request needs a bearer token (Authorization: Bearer <JWT>)")]
    MissingToken,
    /// 401: a bearer token that does not verify.
    #[error("{0}")]
    Unauthorized(String),
    /// 403: a verified token without the scope this request needs.
    #[error("this request needs the scope `{scope}`")]
    Forbidden { scope: String },
    /// 403: the target is keygate's or the server's own state, which no
    /// token may write through the data path.
    #[error("{0}")]
    Reserved(String),
    /// 403: a browser origin not allowed to open WebSocket members.
    #[error("{0}")]
    OriginNotAllowed(String),
    /// 404: the stream, group, member or route is unknown.
    #[error("{0}")]
    NotFound(String),
    /// 405: the route exists but not for this method.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// 409: the request conflicts with what exists.
    #[error("{0}")]
    Conflict(String),
    /// 413: the payload is larger than the server accepts.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// 429: the caller holds as many of a bounded resource as it may.
    #[error("{0}")]
    TooMany(String),
    /// 415: the request body is not JSON.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// 422: well-formed input that cannot be applied.
    #[error("{0}")]
    Unprocessable(String),
    /// 503: NATS or JetStream is unavailable; retrying may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// 500: anything else. The detail is logged, never sent.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// The status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::MissingToken | Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } | Self::Reserved(_) | Self::OriginNotAllowed(_) => StatusCode::FORBIDDEN,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn slug(&self) -> &'static str {
        match self {
            Self::BadRequest(_) => "invalid-request",
            Self::MissingToken | Self::Unauthorized(_) => "unauthorized",
            Self::Forbidden { .. } => "forbidden",
            Self::Reserved(_) => "reserved",
            Self::OriginNotAllowed(_) => "origin-not-allowed",
            Self::NotFound(_) => "not-found",
            Self::MethodNotAllowed(_) => "method-not-allowed",
            Self::Conflict(_) => "conflict",
            Self::PayloadTooLarge(_) => "payload-too-large",
            Self::UnsupportedMediaType(_) => "unsupported-media-type",
            Self::TooMany(_) => "too-many",
            Self::Unprocessable(_) => "unprocessable",
            Self::Unavailable(_) => "unavailable",
            Self::Internal(_) => "internal",
        }
    }

    /// The problem document for this error.
    pub fn problem(&self) -> Problem {
        let status = self.status();
        let detail = match self {
            Self::Internal(cause) => {
                tracing::error!(%cause, "internal error");
                "keygate hit an internal error; the cause is in its log".to_owned()
            }
            other => other.to_string(),
        };
        Problem {
            problem_type: format!("https://keygate.dev/problems/{}", self.slug()),
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            status: status.as_u16(),
            detail,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let problem = self.problem();
        let status = self.status();
        let body = serde_json::to_vec(&problem).unwrap_or_default();
        let mut response = (status, [(header::CONTENT_TYPE, "application/problem+json")], body).into_response();
        // RFC 6750: tell the client what kind of credential would work.
        let challenge = match &self {
            Self::MissingToken => Some("Bearer realm=\"keygate\"".to_owned()),
            Self::Unauthorized(detail) => Some(format!(
                "Bearer realm=\"keygate\", error=\"invalid_token\", error_description=\"{}\"",
                detail.replace(['"', '\\'], "'")
            )),
            Self::Forbidden { scope } => {
                Some(format!("Bearer realm=\"keygate\", error=\"insufficient_scope\", scope=\"{scope}\""))
            }
            _ => None,
        };
        if let Some(value) = challenge.and_then(|c| header::HeaderValue::from_str(&c).ok()) {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, value);
        }
        response
    }
}

impl From<axum::extract::rejection::JsonRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::JsonRejection) -> Self {
        use axum::extract::rejection::JsonRejection as J;
        match &rejection {
            J::MissingJsonContentType(_) => Self::UnsupportedMediaType(
                "the request body must be JSON with `Content-Type: application/json`".to_owned(),
            ),
            J::JsonDataError(_) | J::JsonSyntaxError(_) => Self::BadRequest(json_refusal(&rejection)),
            _ if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::PayloadTooLarge("the request body is larger than keygate accepts".to_owned())
            }
            other => Self::BadRequest(other.body_text()),
        }
    }
}

/// Why a JSON body was refused, in JSON's words (http/json_errors.rs),
/// from the parser's error under axum's rejection.
fn json_refusal(rejection: &axum::extract::rejection::JsonRejection) -> String {
    use crate::http::json_errors::{data, syntax};
    type PathError = serde_path_to_error::Error<serde_json::Error>;
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = cause {
        if let Some(at) = error.downcast_ref::<PathError>() {
            return match at.inner().classify() {
                serde_json::error::Category::Data => data(&at.path().to_string(), at.inner()),
                _ => syntax(at.inner()),
            };
        }
        if let Some(error) = error.downcast_ref::<serde_json::Error>() {
            return match error.classify() {
                serde_json::error::Category::Data => data(".", error),
                _ => syntax(error),
            };
        }
        cause = error.source();
    }
    rejection.body_text()
}

impl From<axum::extract::rejection::BytesRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::BytesRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Self::PayloadTooLarge("the request body is larger than keygate accepts".to_owned())
        } else {
            Self::BadRequest(rejection.body_text())
        }
    }
}

impl From<axum::extract::rejection::PathRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::PathRejection) -> Self {
        use axum::extract::rejection::PathRejection as P;
        // axum's own text starts "Invalid URL: ", which after ours read twice.
        let detail = match &rejection {
            P::FailedToDeserializePathParams(e) => e.kind().to_string(),
            other => other.body_text(),
        };
        Self::BadRequest(format!("invalid path: {detail}"))
    }
}

impl From<axum::extract::rejection::QueryRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::QueryRejection) -> Self {
        Self::BadRequest(format!("invalid query: {}", rejection.body_text()))
    }
}

/// A domain error answers by its class; the caller reads its message, and
/// an internal error's causes go to the log only.
impl<K: crate::error::Kind> From<crate::error::Error<K>> for ApiError {
    fn from(e: crate::error::Error<K>) -> Self {
        use crate::error::Class as C;
        let detail = e.message().to_owned();
        match e.class() {
            C::Invalid => Self::BadRequest(detail),
            C::Reserved => Self::Reserved(detail),
            C::NotFound => Self::NotFound(detail),
            C::Conflict => Self::Conflict(detail),
            C::TooLarge => Self::PayloadTooLarge(detail),
            C::TooMany => Self::TooMany(detail),
            C::Unprocessable => Self::Unprocessable(detail),
            C::Unavailable => Self::Unavailable(detail),
            C::Internal => Self::Internal(e.report()),
        }
    }
}

impl From<crate::names::NameError> for ApiError {
    fn from(e: crate::names::NameError) -> Self {
        Self::BadRequest(e.to_string())
    }
}
