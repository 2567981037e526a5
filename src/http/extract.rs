//! Extractors whose rejections are problem+json (axum's own answer with
//! plain text).

use axum::extract::{FromRequest, FromRequestParts};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::http::problem::ApiError;

/// JSON body; a bad body or content type is a problem+json 400/415/413.
#[derive(Debug)]
pub struct Json<T>(pub T);

impl<S, T> FromRequest<S> for Json<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned,
{
    type Rejection = ApiError;

    /// axum's `Json` reads every body through serde_path_to_error, whose
    /// bookkeeping the publish path paid on each request. A body sent as
    /// plain `application/json` is read with serde_json alone; only when
    /// that fails is it read again by axum's, for the refusal naming where
    /// the body is wrong. Any other content type goes to axum's checks.
    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        let plain_json = request
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"application/json"));
        if !plain_json {
            return Ok(Self(axum::Json::<T>::from_request(request, state).await?.0));
        }
        let body = bytes::Bytes::from_request(request, state)
            .await
            .map_err(|e| ApiError::from(axum::extract::rejection::JsonRejection::from(e)))?;
        match serde_json::from_slice(&body) {
            Ok(value) => Ok(Self(value)),
            Err(_) => Ok(Self(axum::Json::<T>::from_bytes(&body)?.0)),
        }
    }
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// Path parameters; a bad one is a problem+json 400.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

/// Query parameters; a bad one is a problem+json 400.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

/// A JSON body that may be left out: a request with no body at all, or a
/// JSON `null`, is `None`; any other body must be valid JSON of `T`.
#[derive(Debug)]
pub struct OptionalJson<T>(pub Option<T>);

impl<S, T> FromRequest<S> for OptionalJson<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
        let headers = request.headers();
        let empty = !headers.contains_key(CONTENT_TYPE)
            && headers.get(CONTENT_LENGTH).is_none_or(|length| length.as_bytes() == b"0");
        if empty {
            return Ok(Self(None));
        }
        let Json(value) = Json::<Option<T>>::from_request(request, state).await?;
        Ok(Self(value))
    }
}
