//! `/v1/dead-letters`: browse, redrive and delete dead letters. Admin sees
//! every letter; a `consume:<stream>/<group>` token its group's, a
//! `subscribe:<stream>/<consumer>` token its consumer's.

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::extract::{Json, Path, Query};
use crate::app::AppState;
use crate::auth::{Caller, Requirement, Scopes};
use crate::dead_letters::{self, DeadLetterQuery, DeadLetterView, Letter, MAX_PAGE};
use crate::http::problem::{ApiError, Problem};

/// A page of dead letters, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeadLetterPage {
    pub dead_letters: Vec<DeadLetterView>,
    /// Pass as `cursor` for the next page; `null` at the end. A page can
    /// be short (even empty) with a cursor: each request reads a bounded
    /// part of the stream.
    pub next_cursor: Option<String>,
}

/// Which letters to redrive: `ids`, or a `filter` (at most `limit` of its
/// letters per request, going on from its `cursor`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RedriveRequest {
    #[schema(max_items = 1000)]
    pub ids: Option<Vec<String>>,
    pub filter: Option<DeadLetterQuery>,
}

/// A letter published again.
#[derive(Debug, Serialize, ToSchema)]
pub struct RedrivenLetter {
    pub id: String,
    /// The stream it went back to.
    pub stream: String,
    /// Its new sequence there.
    pub stream_seq: u64,
    /// When it was redriven.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub at: time::OffsetDateTime,
    /// True when an earlier redrive did it and nothing was published now.
    pub earlier: bool,
}

/// A letter an operation could not handle.
#[derive(Debug, Serialize, ToSchema)]
pub struct FailedLetter {
    pub id: String,
    pub error: Problem,
}

/// What a redrive did, letter by letter, in the letters' order.
#[derive(Debug, Serialize, ToSchema)]
pub struct RedriveAnswer {
    pub redriven: Vec<RedrivenLetter>,
    pub failed: Vec<FailedLetter>,
    /// For a filter: where to go on from; `null` when it is done.
    pub next_cursor: Option<String>,
}

/// What a delete by filter removed.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeleteAnswer {
    pub deleted: Vec<String>,
    /// Where to go on from; `null` when it is done.
    pub next_cursor: Option<String>,
}

/// The caller's scopes for the letters it names; everything when keygate
/// runs without keys.
pub struct Visibility(Option<Scopes>);

impl FromRequestParts<AppState> for Visibility {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if state.verifier.is_none() {
            return Ok(Self(None));
        }
        // The authorization layer put the verified caller here; with keys
        // and no caller, nothing is visible.
        let caller = parts.extensions.get::<Caller>().ok_or(ApiError::MissingToken)?;
        Ok(Self(Some(caller.scopes.clone())))
    }
}

impl Visibility {
    fn allows(&self, requirement: &Requirement) -> bool {
        self.0.as_ref().is_none_or(|scopes| scopes.allows(requirement))
    }

    fn require(&self, requirement: &Requirement) -> Result<(), ApiError> {
        if self.allows(requirement) {
            Ok(())
        } else {
            Err(ApiError::Forbidden { scope: requirement.scope().unwrap_or_default() })
        }
    }

    fn sees(&self, letter: &Letter) -> bool {
        self.allows(&letter.requirement())
    }
}

fn letter_seq(id: &str) -> Result<u64, ApiError> {
    match id.parse::<u64>() {
        Ok(seq) if seq >= 1 && id.bytes().all(|b| b.is_ascii_digit()) => Ok(seq),
        _ => Err(ApiError::BadRequest(format!("{id:?} is not a dead letter id"))),
    }
}

/// A letter the caller may see; 404 for one it may not, as for one that
/// does not exist.
async fn visible_letter(state: &AppState, visibility: &Visibility, id: &str) -> Result<Letter, ApiError> {
    let seq = letter_seq(id)?;
    match state.runtime.stores.dead_letters.get(seq).await? {
        Some(letter) if visibility.sees(&letter) => Ok(letter),
        _ => Err(ApiError::NotFound(format!("no dead letter {id}"))),
    }
}

/// Lists dead letters, oldest first, filtered and paged by cursor.
#[utoipa::path(
    get,
    path = "/v1/dead-letters",
    tag = "dead-letters",
    params(DeadLetterQuery),
    responses(
        (status = 200, description = "a page of letters", body = DeadLetterPage),
        (status = 400, description = "invalid filter", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn list_dead_letters(
    State(state): State<AppState>,
    visibility: Visibility,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Json<DeadLetterPage>, ApiError> {
    let selection = query.check(MAX_PAGE)?;
    visibility.require(&selection.filter.requirement())?;
    let page = state.runtime.stores.dead_letters.page(&selection).await?;
    let marks = state.runtime.stores.dead_letters.redriven(&page.letters).await?;
    let dead_letters = page.letters.iter().zip(marks).map(|(letter, mark)| letter.view(mark)).collect();
    Ok(Json(DeadLetterPage { dead_letters, next_cursor: page.next.map(|c| c.token()) }))
}

/// One dead letter.
#[utoipa::path(
    get,
    path = "/v1/dead-letters/{id}",
    tag = "dead-letters",
    params(("id" = String, Path, description = "The letter's id", pattern = "^[0-9]{1,20}$")),
    responses(
        (status = 200, description = "the letter", body = DeadLetterView),
        (status = 404, description = "no such letter (or not one this token may see)", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn get_dead_letter(
    State(state): State<AppState>,
    visibility: Visibility,
    Path(id): Path<String>,
) -> Result<Json<DeadLetterView>, ApiError> {
    let letter = visible_letter(&state, &visibility, &id).await?;
    let mark = state.runtime.stores.dead_letters.redriven(std::slice::from_ref(&letter)).await?.pop().flatten();
    Ok(Json(letter.view(mark)))
}

/// Deletes one dead letter.
#[utoipa::path(
    delete,
    path = "/v1/dead-letters/{id}",
    tag = "dead-letters",
    params(("id" = String, Path, description = "The letter's id", pattern = "^[0-9]{1,20}$")),
    responses(
        (status = 204, description = "deleted"),
        (status = 404, description = "no such letter (or not one this token may see)", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_dead_letter(
    State(state): State<AppState>,
    visibility: Visibility,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let letter = visible_letter(&state, &visibility, &id).await?;
    if !state.runtime.stores.dead_letters.delete(&letter).await? {
        return Err(ApiError::NotFound(format!("no dead letter {id}")));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Deletes the letters a filter selects, at most `limit` per request. A
/// filter must name something: deleting every letter takes a criterion
/// that matches them all (`since=1970-01-01T00:00:00Z`).
#[utoipa::path(
    delete,
    path = "/v1/dead-letters",
    tag = "dead-letters",
    params(DeadLetterQuery),
    responses(
        (status = 200, description = "what was deleted", body = DeleteAnswer),
        (status = 400, description = "invalid or empty filter", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn delete_dead_letters(
    State(state): State<AppState>,
    visibility: Visibility,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Json<DeleteAnswer>, ApiError> {
    let selection = query.check(MAX_PAGE)?;
    if selection.filter.is_everything() {
        return Err(ApiError::BadRequest(
            "name at least one criterion (stream, group, consumer, member, key, reason, since or until)".into(),
        ));
    }
    visibility.require(&selection.filter.requirement())?;
    let page = state.runtime.stores.dead_letters.page(&selection).await?;
    let mut deleted = Vec::with_capacity(page.letters.len());
    for letter in &page.letters {
        if state.runtime.stores.dead_letters.delete(letter).await? {
            deleted.push(letter.id());
        }
    }
    Ok(Json(DeleteAnswer { deleted, next_cursor: page.next.map(|c| c.token()) }))
}

/// Publishes dead letters again to the streams they came from, under their
/// subjects (so their keys), with their headers and `keygate-redriven-from`.
/// Each goes after everything its key already has in the stream. A letter
/// is redriven once: asking again answers the earlier redrive.
#[utoipa::path(
    post,
    path = "/v1/dead-letters/redrive",
    tag = "dead-letters",
    request_body = RedriveRequest,
    responses(
        (status = 200, description = "what was redriven, and what could not be", body = RedriveAnswer),
        (status = 400, description = "neither or both of ids and filter, or an invalid one", body = Problem, content_type = "application/problem+json")
    )
)]
pub async fn redrive_dead_letters(
    State(state): State<AppState>,
    visibility: Visibility,
    Json(request): Json<RedriveRequest>,
) -> Result<Json<RedriveAnswer>, ApiError> {
    let mut failed = Vec::new();
    let (letters, next_cursor) = match (request.ids, request.filter) {
        (Some(ids), None) => {
            if ids.is_empty() || ids.len() > MAX_PAGE {
                return Err(ApiError::BadRequest(format!("ids must hold 1 to {MAX_PAGE} ids")));
            }
            let mut letters = Vec::with_capacity(ids.len());
            for id in &ids {
                match visible_letter(&state, &visibility, id).await {
                    Ok(letter) => letters.push(letter),
                    Err(e @ (ApiError::NotFound(_) | ApiError::BadRequest(_))) => {
                        failed.push(FailedLetter { id: id.clone(), error: e.problem() })
                    }
                    Err(e) => return Err(e),
                }
            }
            (letters, None)
        }
        (None, Some(filter)) => {
            let selection = filter.check(MAX_PAGE)?;
            visibility.require(&selection.filter.requirement())?;
            let page = state.runtime.stores.dead_letters.page(&selection).await?;
            (page.letters, page.next.map(|c| c.token()))
        }
        _ => return Err(ApiError::BadRequest("give ids or filter, one of them".into())),
    };
    let outcomes = dead_letters::redrive_in_order(
        &state.runtime.broker.js,
        &state.runtime.stores.dead_letters,
        &state.runtime.stores.streams,
        state.runtime.max_payload(),
        letters,
    )
    .await?;
    let mut redriven = Vec::with_capacity(outcomes.len());
    for (letter, outcome) in outcomes {
        match outcome {
            Ok(done) => redriven.push(RedrivenLetter {
                id: letter.id(),
                stream: done.redriven.stream,
                stream_seq: done.redriven.stream_seq,
                at: done.redriven.at,
                earlier: done.earlier,
            }),
            Err(e) => failed.push(FailedLetter { id: letter.id(), error: ApiError::from(e).problem() }),
        }
    }
    Ok(Json(RedriveAnswer { redriven, failed, next_cursor }))
}
