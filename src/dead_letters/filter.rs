//! Which dead letters a request means (pure): the query of
//! `GET`/`DELETE /v1/dead-letters` and the `filter` of a redrive, checked
//! once into a [`Filter`], the subject that narrows the scan, and the scope
//! a caller needs.

use serde::Deserialize;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use utoipa::{IntoParams, ToSchema};

use super::letter::Letter;
use super::{DeadLetterError as Error, DeadLetterErrorKind as Kind};
use crate::auth::Requirement;
use crate::names::Owner;
use crate::names::{GroupName, MemberName, StreamName};

/// Letters per page when the request names no `limit`.
pub const DEFAULT_LIMIT: usize = 100;

/// What selects dead letters, and where a page starts. Every criterion
/// given must match.
#[derive(Debug, Clone, Default, Deserialize, ToSchema, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DeadLetterQuery {
    /// Letters of this stream.
    #[param(pattern = "^[A-Za-z0-9_-]{1,128}$")]
    #[schema(pattern = "^[A-Za-z0-9_-]{1,128}$")]
    pub stream: Option<String>,
    /// Letters of this group's members.
    #[param(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub group: Option<String>,
    /// Letters of this plain consumer's subscribers (not with `group`).
    #[param(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub consumer: Option<String>,
    /// Letters of this member (or subscriber).
    #[param(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub member: Option<String>,
    /// Letters of messages with this key, exactly.
    pub key: Option<String>,
    /// Letters whose reason contains this text, ignoring case.
    pub reason: Option<String>,
    /// Dead-lettered at or after this time (RFC 3339).
    #[param(value_type = Option<String>, format = DateTime)]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub since: Option<String>,
    /// Dead-lettered at or before this time (RFC 3339).
    #[param(value_type = Option<String>, format = DateTime)]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub until: Option<String>,
    /// Where to go on from: the `next_cursor` of the page before.
    #[param(pattern = "^[0-9]{1,20}$")]
    #[schema(pattern = "^[0-9]{1,20}$")]
    pub cursor: Option<String>,
    /// Most letters in the answer (1 to 1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    #[schema(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
}

/// Where a scan starts: a sequence of the dead-letter stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor(pub u64);

impl Cursor {
    /// The cursor as the API gives it out.
    pub fn token(self) -> String {
        self.0.to_string()
    }
}

/// A checked selection of dead letters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    pub stream: Option<StreamName>,
    /// A group's letters, or a plain consumer's.
    pub owner: Option<(Owner, GroupName)>,
    pub member: Option<MemberName>,
    pub key: Option<String>,
    /// Lower-cased.
    pub reason: Option<String>,
    pub since: Option<OffsetDateTime>,
    pub until: Option<OffsetDateTime>,
}

/// A checked query: the filter, where to start and how many to answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub filter: Filter,
    pub cursor: Option<Cursor>,
    pub limit: usize,
}

impl DeadLetterQuery {
    /// Checks every field; a bad one is a 400 saying which.
    pub fn check(&self, max_limit: usize) -> Result<Selection, Error> {
        let bad = |m: String| Error::new(Kind::InvalidQuery, m);
        let time = |field: &str, value: &Option<String>| {
            value
                .as_deref()
                .map(|v| {
                    OffsetDateTime::parse(v, &Rfc3339)
                        .map_err(|e| bad(format!("{field} must be an RFC 3339 time ({e})")))
                })
                .transpose()
        };
        let owner = match (&self.group, &self.consumer) {
            (Some(_), Some(_)) => return Err(bad("give group or consumer, not both".into())),
            (Some(g), None) => Some((Owner::Group, GroupName::parse(g).map_err(|e| bad(e.to_string()))?)),
            (None, Some(c)) => Some((Owner::Consumer, GroupName::parse(c).map_err(|e| bad(e.to_string()))?)),
            (None, None) => None,
        };
        let filter = Filter {
            stream: self.stream.as_deref().map(StreamName::parse).transpose().map_err(|e| bad(e.to_string()))?,
            owner,
            member: self.member.as_deref().map(MemberName::parse).transpose().map_err(|e| bad(e.to_string()))?,
            key: self.key.clone(),
            reason: self.reason.as_deref().map(str::to_lowercase),
            since: time("since", &self.since)?,
            until: time("until", &self.until)?,
        };
        if let (Some(since), Some(until)) = (filter.since, filter.until) {
            if since > until {
                return Err(bad("since is after until".into()));
            }
        }
        let cursor = match self.cursor.as_deref() {
            None => None,
            Some(c) => match c.parse::<u64>() {
                Ok(seq) if seq >= 1 && c.bytes().all(|b| b.is_ascii_digit()) => Some(Cursor(seq)),
                _ => return Err(bad("cursor must be a next_cursor keygate gave out".into())),
            },
        };
        let limit = match self.limit {
            None => DEFAULT_LIMIT.min(max_limit),
            Some(n) if (1..=max_limit as u32).contains(&n) => n as usize,
            Some(_) => return Err(bad(format!("limit must be between 1 and {max_limit}"))),
        };
        Ok(Selection { filter, cursor, limit })
    }
}

impl Filter {
    /// The dead-letter subjects the filter can match, for the server to
    /// narrow the scan with.
    pub fn subject(&self) -> String {
        let token = |name: Option<&str>| name.unwrap_or("*").to_owned();
        format!(
            "keygate.dlq.{}.{}.{}",
            token(self.stream.as_ref().map(StreamName::as_str)),
            token(self.owner.as_ref().map(|(_, name)| name.as_str())),
            token(self.member.as_ref().map(MemberName::as_str)),
        )
    }

    /// Whether `letter` is selected.
    pub fn matches(&self, letter: &Letter) -> bool {
        self.stream.as_ref().is_none_or(|s| s.as_str() == letter.stream)
            && self.owner.as_ref().is_none_or(|(owner, name)| *owner == letter.owner && name.as_str() == letter.name)
            && self.member.as_ref().is_none_or(|m| m.as_str() == letter.member)
            && self.key.as_ref().is_none_or(|k| letter.key.as_ref() == Some(k))
            && self.reason.as_ref().is_none_or(|r| letter.reason.to_lowercase().contains(r.as_str()))
            && self.since.is_none_or(|t| letter.time >= t)
            && self.until.is_none_or(|t| letter.time <= t)
    }

    /// The scope a caller needs to act on everything the filter may select:
    /// one group's or one consumer's letters need that group's `consume:`
    /// or that consumer's `subscribe:`; anything wider needs admin.
    pub fn requirement(&self) -> Requirement {
        match (&self.stream, &self.owner) {
            (Some(stream), Some((Owner::Group, group))) => {
                Requirement::Consume { stream: Some(stream.to_string()), group: Some(group.to_string()) }
            }
            (Some(stream), Some((Owner::Consumer, consumer))) => {
                Requirement::Subscribe { stream: stream.to_string(), consumer: consumer.to_string() }
            }
            _ => Requirement::Admin,
        }
    }

    /// Whether nothing narrows the selection.
    pub fn is_everything(&self) -> bool {
        *self == Filter::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn query(json: serde_json::Value) -> DeadLetterQuery {
        serde_json::from_value(json).unwrap()
    }

    fn letter(owner: Owner, key: Option<&str>, reason: &str, time: OffsetDateTime) -> Letter {
        Letter {
            seq: 1,
            msg_id: String::new(),
            owner,
            stream: "S".into(),
            name: "g".into(),
            member: "m1".into(),
            subject: "s.k".into(),
            key: key.map(str::to_owned),
            partition: Some(0),
            stream_seq: Some(1),
            attempts: Some(1),
            reason: reason.into(),
            time,
            headers: vec![],
            payload: Bytes::new(),
        }
    }

    #[test]
    fn a_query_is_checked_field_by_field() {
        for bad in [
            serde_json::json!({"group": "g", "consumer": "c"}),
            serde_json::json!({"stream": "a.b"}),
            serde_json::json!({"member": "*"}),
            serde_json::json!({"since": "yesterday"}),
            serde_json::json!({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}),
            serde_json::json!({"cursor": "0"}),
            serde_json::json!({"cursor": "+5"}),
            serde_json::json!({"limit": 0}),
            serde_json::json!({"limit": 1001}),
        ] {
            assert!(query(bad.clone()).check(1000).is_err(), "{bad}");
        }
        let selection = query(serde_json::json!({"stream":"S","consumer":"c","cursor":"17","limit":5,"reason":"HTTP"}))
            .check(1000)
            .unwrap();
        assert_eq!(selection.cursor, Some(Cursor(17)));
        assert_eq!(selection.limit, 5);
        assert_eq!(selection.filter.reason.as_deref(), Some("http"));
        assert_eq!(selection.filter.subject(), "keygate.dlq.S.c.*");
        assert_eq!(query(serde_json::json!({})).check(1000).unwrap().limit, DEFAULT_LIMIT);
        assert!(query(serde_json::json!({})).check(1000).unwrap().filter.is_everything());
    }

    #[test]
    fn filters_match_owner_key_reason_and_time() {
        let noon = OffsetDateTime::parse("2026-06-01T12:00:00Z", &Rfc3339).unwrap();
        let group_letter = letter(Owner::Group, Some("alice"), "gave up after 3 attempts: HTTP 500", noon);
        let check = |json: serde_json::Value| query(json).check(1000).unwrap().filter.matches(&group_letter);
        assert!(check(serde_json::json!({})));
        assert!(check(serde_json::json!({"stream":"S","group":"g","member":"m1","key":"alice"})));
        assert!(!check(serde_json::json!({"consumer":"g"})), "a consumer of the group's name is another owner");
        assert!(!check(serde_json::json!({"key":"alic"})));
        assert!(check(serde_json::json!({"reason":"http 5"})));
        assert!(!check(serde_json::json!({"reason":"skipped"})));
        assert!(check(serde_json::json!({"since":"2026-06-01T12:00:00Z","until":"2026-06-01T12:00:00Z"})));
        assert!(!check(serde_json::json!({"since":"2026-06-01T12:00:01Z"})));
        assert!(!check(serde_json::json!({"until":"2026-06-01T11:59:59+00:00"})));
    }

    #[test]
    fn only_one_groups_or_consumers_letters_are_open_to_its_scope() {
        let requirement = |json: serde_json::Value| query(json).check(1000).unwrap().filter.requirement();
        assert_eq!(
            requirement(serde_json::json!({"stream":"S","group":"g","key":"k"})),
            Requirement::Consume { stream: Some("S".into()), group: Some("g".into()) }
        );
        assert_eq!(
            requirement(serde_json::json!({"stream":"S","consumer":"c"})),
            Requirement::Subscribe { stream: "S".into(), consumer: "c".into() }
        );
        assert_eq!(requirement(serde_json::json!({"group":"g"})), Requirement::Admin, "every stream's group g");
        assert_eq!(requirement(serde_json::json!({"stream":"S"})), Requirement::Admin);
    }
}
