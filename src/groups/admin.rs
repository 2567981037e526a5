//! Group administration: create or reconcile a group (`PUT`), delete it,
//! and edit elastic membership and mappings by compare-and-set, with the
//! checks the stream must pass first. The same code serves the REST API and
//! the CLI.

use std::time::Duration;

use async_nats::jetstream::{kv, stream};
use bytes::Bytes;

use super::config::{
    config_key, elastic_stream_name, go_json, static_consumer_name, validate_membership, ElasticGroupConfig,
    MemberMapping, ELASTIC_BUCKET, PRIORITY_GROUP, STATIC_BUCKET,
};
use super::inspect::membership_view;
use super::spec::{consumer_of, GroupConfig, GroupKind};
use super::store::{
    cas_error, config_bytes, sorted, GroupAdmin, GroupSettings, StoredGroup, CAS_ATTEMPTS, SETTINGS_BUCKET,
};
use super::view::MembershipView;
use super::{GroupError as Error, GroupErrorKind as Kind};
use crate::names::{GroupName, MemberName, StreamName};
use crate::nats::errors::{is_not_found, jetstream_error_code, unavailable_or_internal};
use crate::partition::{PartitionSpec, SubjectPattern, TransformSpelling};

/// Whether `PUT` created, found or changed the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Created,
    Unchanged,
    Updated,
}

impl GroupAdmin {
    /// Creates a group, or confirms an identical one exists. An elastic
    /// group's membership may differ: it is then updated. Everything is
    /// checked before anything is written, so a refused request changes
    /// nothing.
    pub async fn put(
        &self,
        stream: &StreamName,
        group: &GroupName,
        config: GroupConfig,
        membership_given: bool,
        requested: GroupSettings,
    ) -> Result<PutOutcome, Error> {
        let info = self.stream_info(stream.as_str()).await?;
        let kind = config.kind();
        let other = match kind {
            GroupKind::Static => GroupKind::Elastic,
            GroupKind::Elastic => GroupKind::Static,
        };
        if self.read(other, stream.as_str(), group.as_str()).await?.is_some() {
            return Err(Error::new(
                Kind::ExistsDifferently,
                format!(
                    "group {group} already exists on {stream} as {} group; delete it first",
                    match other {
                        GroupKind::Static => "a static",
                        GroupKind::Elastic => "an elastic",
                    }
                ),
            ));
        }
        let key = config_key(stream.as_str(), group.as_str());
        let existing = self.read(kind, stream.as_str(), group.as_str()).await?;
        let plan = match &existing {
            Some(stored) => plan_reconcile(&stored.config, &config, membership_given)?,
            None => {
                match &config {
                    GroupConfig::Static(c) => {
                        check_static_stream(&info.config, c.max_members)?;
                        self.check_consumer_names_free(stream, group, &config).await?;
                    }
                    GroupConfig::Elastic(c) => check_elastic_filters(&info.config, c)?,
                }
                Reconcile::Create
            }
        };
        // The work-queue stream first: if it cannot be made, KV is untouched.
        let mut made_work_queue = false;
        if let GroupConfig::Elastic(c) = existing.as_ref().map_or(&config, |s| &s.config) {
            made_work_queue = self.ensure_work_queue(stream.as_str(), group.as_str(), c, &info).await?;
        }
        let bucket_name = match kind {
            GroupKind::Static => STATIC_BUCKET,
            GroupKind::Elastic => ELASTIC_BUCKET,
        };
        let written = self.apply(bucket_name, &key, &config, existing.as_ref(), plan, info.config.num_replicas).await;
        let outcome = match written {
            Ok(outcome) => outcome,
            Err(e) => {
                if made_work_queue {
                    let _ = self.js.delete_stream(elastic_stream_name(stream.as_str(), group.as_str())).await;
                }
                return Err(e);
            }
        };
        let current = self.settings(stream, group).await?;
        let settings = GroupSettings::after_put(&current, &requested, outcome == PutOutcome::Created);
        if outcome == PutOutcome::Created || current != settings {
            let settings_store = self.bucket_or_create(SETTINGS_BUCKET, info.config.num_replicas).await?;
            settings_store
                .put(&key, Bytes::from(serde_json::to_vec(&settings).unwrap_or_default()))
                .await
                .map_err(|e| Error::from(unavailable_or_internal("storing group settings", e)))?;
            if outcome == PutOutcome::Unchanged {
                return Ok(PutOutcome::Updated);
            }
        }
        Ok(outcome)
    }

    async fn apply(
        &self,
        bucket_name: &str,
        key: &str,
        config: &GroupConfig,
        existing: Option<&StoredGroup>,
        plan: Reconcile,
        replicas: usize,
    ) -> Result<PutOutcome, Error> {
        match (plan, existing) {
            (Reconcile::Unchanged, _) => Ok(PutOutcome::Unchanged),
            (Reconcile::Membership(next), Some(stored)) => {
                let store = self.bucket_or_create(bucket_name, replicas).await?;
                store
                    .update(key, Bytes::from(go_json(&next)), stored.revision)
                    .await
                    .map_err(|e| cas_error("updating membership", e))?;
                Ok(PutOutcome::Updated)
            }
            _ => {
                let store = self.bucket_or_create(bucket_name, replicas).await?;
                match store.create(key, config_bytes(config)).await {
                    Ok(_) => Ok(PutOutcome::Created),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Err(Error::new(
                        Kind::ChangedConcurrently,
                        "the group was created concurrently; read it and retry",
                    )),
                    Err(e) => Err(unavailable_or_internal("storing group", e).into()),
                }
            }
        }
    }

    /// Static consumers are named `<group>-<member>`: refuse a group whose
    /// names another group on the stream already uses (`g` + `x-m` and
    /// `g-x` + `m` would share `g-x-m`).
    async fn check_consumer_names_free(
        &self,
        stream: &StreamName,
        group: &GroupName,
        config: &GroupConfig,
    ) -> Result<(), Error> {
        let ours: Vec<String> = member_names(config).map(|m| static_consumer_name(group.as_str(), m)).collect();
        for (other, theirs) in self.static_member_consumers(stream).await? {
            if other != group.as_str() && ours.contains(&theirs) {
                return Err(Error::new(
                    Kind::NameTaken,
                    format!(
                    "consumer {theirs} already belongs to group {other} on {stream}; choose other group or member names"
                ),
                ));
            }
        }
        Ok(())
    }

    /// (group, consumer) of every static group member's consumer on `stream`,
    /// whether or not the consumer exists yet (members create their own).
    pub async fn static_member_consumers(&self, stream: &StreamName) -> Result<Vec<(String, String)>, Error> {
        let mut out = Vec::new();
        for summary in self.list(stream).await? {
            if summary.kind != GroupKind::Static {
                continue;
            }
            let Some(stored) = self.read(GroupKind::Static, stream.as_str(), &summary.group).await? else { continue };
            for member in member_names(&stored.config) {
                out.push((summary.group.clone(), static_consumer_name(&summary.group, member)));
            }
        }
        Ok(out)
    }

    async fn ensure_work_queue(
        &self,
        stream: &str,
        group: &str,
        config: &ElasticGroupConfig,
        source: &stream::Info,
    ) -> Result<bool, Error> {
        let name = elastic_stream_name(stream, group);
        let existed = self.js.get_stream(&name).await.is_ok();
        let filters = config.partitioning_filters.clone().unwrap_or_default();
        let transforms: Vec<stream::SubjectTransform> = if filters.is_empty() {
            let all = SubjectPattern::parse(">").expect("> is a valid filter");
            vec![stream::SubjectTransform {
                source: ">".into(),
                destination: all.partition_transform(config.max_members, &[], TransformSpelling::Pcgroups),
            }]
        } else {
            filters
                .iter()
                .map(|pf| {
                    let pattern = SubjectPattern::parse(&pf.filter).expect("validated filter");
                    let wildcards = pf.partitioning_wildcards.clone().unwrap_or_default();
                    stream::SubjectTransform {
                        source: pf.filter.clone(),
                        destination: pattern.partition_transform(
                            config.max_members,
                            &wildcards,
                            TransformSpelling::Pcgroups,
                        ),
                    }
                })
                .collect()
        };
        let wq = stream::Config {
            name: name.clone(),
            retention: stream::RetentionPolicy::WorkQueue,
            num_replicas: source.config.num_replicas,
            storage: source.config.storage,
            max_messages: config.max_buffered_msgs,
            max_bytes: config.max_buffered_bytes,
            discard: stream::DiscardPolicy::New,
            sources: Some(vec![stream::Source {
                name: stream.to_owned(),
                subject_transforms: transforms,
                ..Default::default()
            }]),
            allow_direct: true,
            ..Default::default()
        };
        self.js.create_stream(wq).await.map(|_| !existed).map_err(|e| {
            if jetstream_error_code(&e) == Some(crate::nats::errors::codes::STREAM_NAME_IN_USE) {
                Error::new(
                    Kind::NameTaken,
                    format!(
                        "stream {name} already exists with another configuration; delete it or pick another group name"
                    ),
                )
            } else {
                unavailable_or_internal("creating the group's work-queue stream", e).into()
            }
        })
    }

    /// Deletes a group: its configuration, its member consumers (static) or
    /// work-queue stream (elastic), and keygate's settings for it.
    pub async fn delete(&self, stream: &StreamName, group: &GroupName, kind: Option<GroupKind>) -> Result<(), Error> {
        let stored = self.load(stream, group, kind).await?;
        let key = config_key(stream.as_str(), group.as_str());
        // The configuration goes first: member instances (keygate's and Go's)
        // stop on its deletion instead of recreating what is deleted next.
        let bucket_name = match stored.config.kind() {
            GroupKind::Static => STATIC_BUCKET,
            GroupKind::Elastic => ELASTIC_BUCKET,
        };
        if let Some(store) = self.bucket(bucket_name).await? {
            store.delete(&key).await.map_err(|e| Error::from(unavailable_or_internal("deleting group", e)))?;
        }
        match &stored.config {
            GroupConfig::Static(_) => {
                // Only this group's members' consumers: pcgroups deletes every
                // consumer named `<group>-*`, which can belong to other groups.
                for member in member_names(&stored.config) {
                    let consumer = static_consumer_name(group.as_str(), member);
                    match self.js.delete_consumer_from_stream(&consumer, stream.as_str()).await {
                        Ok(_) => {}
                        Err(e) if is_not_found(&e) => {}
                        Err(e) => return Err(unavailable_or_internal("deleting member consumer", e).into()),
                    }
                }
            }
            GroupConfig::Elastic(_) => {
                match self.js.delete_stream(elastic_stream_name(stream.as_str(), group.as_str())).await {
                    Ok(_) => {}
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(unavailable_or_internal("deleting the group's work-queue stream", e).into()),
                }
            }
        }
        if let Some(settings) = self.bucket(SETTINGS_BUCKET).await? {
            let _ = settings.purge(&key).await;
        }
        Ok(())
    }

    /// Adds members to an elastic group (compare-and-set).
    pub async fn add_members(
        &self,
        stream: &StreamName,
        group: &GroupName,
        add: &[MemberName],
    ) -> Result<MembershipView, Error> {
        if add.is_empty() {
            return Err(Error::new(Kind::InvalidSpec, "members must name at least one member"));
        }
        self.edit_elastic(stream, group, |config| {
            if !config.member_mappings.is_empty() {
                return Err(Error::new(
                    Kind::MembershipFixed,
                    "the group uses member mappings; change them with PUT …/mappings or delete them first",
                ));
            }
            for member in add {
                if !config.members.iter().any(|m| m == member.as_str()) {
                    config.members.push(member.to_string());
                }
            }
            Ok(())
        })
        .await
    }

    /// Drops a member from an elastic group (compare-and-set).
    pub async fn drop_member(
        &self,
        stream: &StreamName,
        group: &GroupName,
        member: &MemberName,
    ) -> Result<MembershipView, Error> {
        self.edit_elastic(stream, group, |config| {
            if !config.member_mappings.is_empty() {
                return Err(Error::new(
                    Kind::MembershipFixed,
                    "the group uses member mappings; change them with PUT …/mappings or delete them first",
                ));
            }
            let before = config.members.len();
            config.members.retain(|m| m != member.as_str());
            if config.members.len() == before {
                return Err(Error::new(Kind::MemberNotFound, format!("member {member} is not in group {group}")));
            }
            Ok(())
        })
        .await
    }

    /// Replaces an elastic group's membership with explicit mappings.
    pub async fn set_mappings(
        &self,
        stream: &StreamName,
        group: &GroupName,
        mappings: Vec<MemberMapping>,
    ) -> Result<MembershipView, Error> {
        if mappings.is_empty() {
            return Err(Error::new(Kind::InvalidSpec, "mappings must not be empty; DELETE …/mappings removes them"));
        }
        let mut replaced = Vec::new();
        let mut view = self
            .edit_elastic(stream, group, |config| {
                replaced = std::mem::take(&mut config.members);
                config.member_mappings = mappings.clone();
                validate_membership(config.max_members, &config.members, &config.member_mappings)
                    .map_err(|e| Error::new(Kind::InvalidSpec, e.to_string()))
            })
            .await?;
        let mut note = "mappings replace the group's member list: its members are exactly the mapped ones \
            (DELETE …/mappings?members=… goes back to balanced members)"
            .to_owned();
        if !replaced.is_empty() {
            note.push_str(&format!("; no longer in the member list: {}", replaced.join(", ")));
        }
        view.note = Some(note);
        Ok(view)
    }

    /// Removes an elastic group's mappings; `members` become its balanced
    /// members in the same edit. Removing them with no members named is
    /// refused, since it would leave every partition without an owner (and
    /// members cannot be added while mappings are set). A group without
    /// mappings is left as it is.
    pub async fn delete_mappings(
        &self,
        stream: &StreamName,
        group: &GroupName,
        members: &[MemberName],
    ) -> Result<MembershipView, Error> {
        self.edit_elastic(stream, group, |config| {
            // Nothing to delete (a retried call finds its own edit done):
            // the members named only ever take over from mappings.
            if config.member_mappings.is_empty() {
                return Ok(());
            }
            if members.is_empty() {
                return Err(Error::new(
                    Kind::MembershipFixed,
                    format!(
                        "deleting the mappings would leave group {group} with no members, so no partition would \
                         have an owner; name the members that take over in the same call: \
                         DELETE …/mappings?members=m1,m2"
                    ),
                ));
            }
            config.member_mappings.clear();
            config.members.clear();
            for member in members {
                if !config.members.iter().any(|m| m == member.as_str()) {
                    config.members.push(member.to_string());
                }
            }
            validate_membership(config.max_members, &config.members, &config.member_mappings)
                .map_err(|e| Error::new(Kind::InvalidSpec, e.to_string()))
        })
        .await
    }

    async fn edit_elastic(
        &self,
        stream: &StreamName,
        group: &GroupName,
        mut change: impl FnMut(&mut ElasticGroupConfig) -> Result<(), Error>,
    ) -> Result<MembershipView, Error> {
        for _ in 0..CAS_ATTEMPTS {
            let stored = self.load(stream, group, None).await?;
            let GroupConfig::Elastic(mut config) = stored.config else {
                return Err(Error::new(
                    Kind::MembershipFixed,
                    format!(
                    "group {group} is a static group: its membership is fixed; delete and recreate it to change members"
                ),
                ));
            };
            change(&mut config)?;
            let store =
                self.bucket(ELASTIC_BUCKET).await?.ok_or_else(|| Error::new(Kind::NotFound, "group not found"))?;
            let key = config_key(stream.as_str(), group.as_str());
            match store.update(&key, Bytes::from(go_json(&config)), stored.revision).await {
                Ok(revision) => {
                    let config = GroupConfig::Elastic(config);
                    return Ok(membership_view(&config, revision));
                }
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    // Someone else edited first: back off a little, re-read, re-apply.
                    let jitter = Duration::from_millis(rand::random_range(1..20));
                    tokio::time::sleep(jitter).await;
                    continue;
                }
                Err(e) => return Err(unavailable_or_internal("updating group", e).into()),
            }
        }
        Err(Error::new(Kind::ChangedConcurrently, format!("group {group} kept changing concurrently; retry")))
    }

    /// Unpins a member's current instance so another can take over.
    pub async fn step_down(&self, stream: &StreamName, group: &GroupName, member: &MemberName) -> Result<(), Error> {
        let stored = self.load(stream, group, None).await?;
        if !stored.config.has_member(member.as_str()) {
            return Err(Error::new(Kind::MemberNotFound, format!("member {member} is not in group {group}")));
        }
        let (stream_name, consumer) = consumer_of(&stored.config, stream.as_str(), group.as_str(), member.as_str());
        let handle = self
            .js
            .get_stream_no_info(&stream_name)
            .await
            .map_err(|e| Error::from(unavailable_or_internal("step-down", e)))?;
        handle.unpin_consumer(&consumer, PRIORITY_GROUP).await.map_err(|e| {
            if is_not_found(&e) {
                Error::new(Kind::NoConsumer, format!("member {member} has no consumer: no instance is serving it"))
            } else {
                unavailable_or_internal("step-down", e).into()
            }
        })
    }
}

/// What `PUT` of an existing group does.
#[derive(Debug, Clone, PartialEq)]
enum Reconcile {
    Create,
    Unchanged,
    Membership(ElasticGroupConfig),
}

/// Compares an existing group with a `PUT`: the partition count, filters
/// and buffer limits never change; an elastic group's membership may.
fn plan_reconcile(have: &GroupConfig, want: &GroupConfig, membership_given: bool) -> Result<Reconcile, Error> {
    let recreate = "delete and recreate the group to change it";
    if have.partitions() != want.partitions() {
        return Err(Error::new(
            Kind::ExistsDifferently,
            format!("the group has {} partitions; the partition count never changes: {recreate}", have.partitions()),
        ));
    }
    match (have, want) {
        (GroupConfig::Static(have), GroupConfig::Static(want)) => {
            if have.filters != want.filters {
                return Err(Error::new(Kind::ExistsDifferently, format!("the group's filters differ: {recreate}")));
            }
            if membership_given && (have.members != want.members || have.member_mappings != want.member_mappings) {
                return Err(Error::new(
                    Kind::MembershipFixed,
                    format!("a static group's membership is fixed: {recreate}"),
                ));
            }
            Ok(Reconcile::Unchanged)
        }
        (GroupConfig::Elastic(have), GroupConfig::Elastic(want)) => {
            if have.partitioning_filters != want.partitioning_filters {
                return Err(Error::new(
                    Kind::ExistsDifferently,
                    format!("the group's partitioning filters differ: {recreate}"),
                ));
            }
            if have.max_buffered_msgs != want.max_buffered_msgs || have.max_buffered_bytes != want.max_buffered_bytes {
                return Err(Error::new(
                    Kind::ExistsDifferently,
                    format!("the group's buffer limits differ: {recreate}"),
                ));
            }
            let same_members = sorted(&have.members) == sorted(&want.members);
            if !membership_given || (same_members && have.member_mappings == want.member_mappings) {
                return Ok(Reconcile::Unchanged);
            }
            let mut next = have.clone();
            next.members = want.members.clone();
            next.member_mappings = want.member_mappings.clone();
            Ok(Reconcile::Membership(next))
        }
        _ => Err(Error::new(Kind::ExistsDifferently, "the group exists with another kind")),
    }
}

/// Every member a configuration names (balanced or mapped).
fn member_names(config: &GroupConfig) -> impl Iterator<Item = &str> {
    config.members().iter().map(String::as_str).chain(config.mappings().iter().map(|m| m.member.as_str()))
}

/// What the stream stores: its subjects, or what its transform makes of them.
fn stored_patterns(stream: &stream::Config) -> Vec<SubjectPattern> {
    match &stream.subject_transform {
        Some(t) => {
            let dest: Vec<String> = t
                .destination
                .split('.')
                .map(|token| if token.starts_with("{{") { "*".to_owned() } else { token.to_owned() })
                .collect();
            SubjectPattern::parse(&dest.join(".")).into_iter().collect()
        }
        None => stream.subjects.iter().filter_map(|s| SubjectPattern::parse(s).ok()).collect(),
    }
}

/// An elastic group's filters must match something the stream stores: over
/// a partition-stamped stream, `orders.*` matches nothing (it stores
/// `<p>.orders.<key>`).
fn check_elastic_filters(stream: &stream::Config, config: &ElasticGroupConfig) -> Result<(), Error> {
    let stored = stored_patterns(stream);
    for pf in config.partitioning_filters.iter().flatten() {
        let Ok(filter) = SubjectPattern::parse(&pf.filter) else { continue };
        if !stored.iter().any(|s| s.overlaps(&filter)) {
            let stored_text: Vec<String> = stored.iter().map(SubjectPattern::as_string).collect();
            return Err(Error::new(Kind::StreamUnsuitable, format!(
                "filter {:?} matches nothing stream {} stores ({}); a partition-stamped stream stores <partition>.<subject>",
                pf.filter,
                stream.name,
                stored_text.join(", ")
            )));
        }
    }
    Ok(())
}

/// A static group needs a stream stamped with the same partition count.
fn check_static_stream(stream: &stream::Config, partitions: u32) -> Result<(), Error> {
    let stamped = stream.subject_transform.as_ref().and_then(|t| PartitionSpec::from_transform(&t.destination));
    match stamped {
        Some(spec) if spec.partitions == partitions => Ok(()),
        Some(spec) => Err(Error::new(
            Kind::StreamUnsuitable,
            format!(
                "stream {} is stamped with {} partitions; a static group over it must have {}",
                stream.name, spec.partitions, spec.partitions
            ),
        )),
        None => {
            let pre_stamped =
                !stream.subjects.is_empty() && stream.subjects.iter().all(|s| s.starts_with("*.") || s == ">");
            if pre_stamped {
                Ok(())
            } else {
                Err(Error::new(
                    Kind::StreamUnsuitable,
                    format!(
                        "stream {} is not partition-stamped: create it with \"partitions\", or use an elastic group",
                        stream.name
                    ),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elastic(json: &str) -> GroupConfig {
        super::super::store::parse_stored(GroupKind::Elastic, json.as_bytes()).unwrap()
    }

    fn fixed(json: &str) -> GroupConfig {
        super::super::store::parse_stored(GroupKind::Static, json.as_bytes()).unwrap()
    }

    #[test]
    fn the_partition_count_filters_and_kind_never_change() {
        let have = fixed(r#"{"max_members":4,"filters":["a.*"],"members":["m1"]}"#);
        for want in [
            fixed(r#"{"max_members":5,"filters":["a.*"],"members":["m1"]}"#),
            fixed(r#"{"max_members":4,"filters":["b.*"],"members":["m1"]}"#),
            elastic(r#"{"max_members":4,"partitioning_filters":null}"#),
        ] {
            assert!(
                matches!(plan_reconcile(&have, &want, false), Err(e) if e.kind() == Kind::ExistsDifferently || e.kind() == Kind::MembershipFixed),
                "{want:?}"
            );
        }
    }

    #[test]
    fn a_static_groups_membership_is_fixed_unless_the_put_leaves_it_out() {
        let have = fixed(r#"{"max_members":4,"members":["m1","m2"]}"#);
        let other = fixed(r#"{"max_members":4,"members":["m1","m3"]}"#);
        assert_eq!(plan_reconcile(&have, &other, false).unwrap(), Reconcile::Unchanged);
        assert!(
            matches!(plan_reconcile(&have, &other, true), Err(e) if e.kind() == Kind::ExistsDifferently || e.kind() == Kind::MembershipFixed)
        );
        assert_eq!(plan_reconcile(&have, &have, true).unwrap(), Reconcile::Unchanged);
    }

    #[test]
    fn an_elastic_groups_membership_is_reconciled_in_any_order() {
        let have =
            elastic(r#"{"max_members":4,"partitioning_filters":null,"max_buffered_msg":10,"members":["a","b"]}"#);
        let reordered =
            elastic(r#"{"max_members":4,"partitioning_filters":null,"max_buffered_msg":10,"members":["b","a"]}"#);
        assert_eq!(plan_reconcile(&have, &reordered, true).unwrap(), Reconcile::Unchanged);
        let grown =
            elastic(r#"{"max_members":4,"partitioning_filters":null,"max_buffered_msg":10,"members":["a","b","c"]}"#);
        match plan_reconcile(&have, &grown, true).unwrap() {
            Reconcile::Membership(next) => {
                assert_eq!(next.members, ["a", "b", "c"]);
                assert_eq!(next.max_buffered_msgs, 10, "the rest of the stored value is kept");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(plan_reconcile(&have, &grown, false).unwrap(), Reconcile::Unchanged, "membership not given");
        let buffered =
            elastic(r#"{"max_members":4,"partitioning_filters":null,"max_buffered_msg":11,"members":["a","b"]}"#);
        assert!(
            matches!(plan_reconcile(&have, &buffered, true), Err(e) if e.kind() == Kind::ExistsDifferently || e.kind() == Kind::MembershipFixed)
        );
    }

    fn stream(subjects: &[&str], transform: Option<(&str, &str)>) -> stream::Config {
        stream::Config {
            name: "S".into(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            subject_transform: transform.map(|(source, destination)| stream::SubjectTransform {
                source: source.into(),
                destination: destination.into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_static_group_needs_a_stream_stamped_with_its_partition_count() {
        let stamped = stream(&["orders.*"], Some(("orders.*", "{{partition(4,1)}}.orders.{{wildcard(1)}}")));
        assert!(check_static_stream(&stamped, 4).is_ok());
        assert!(matches!(check_static_stream(&stamped, 8), Err(e) if e.message().contains("4 partitions")));
        assert!(check_static_stream(&stream(&["*.orders.*"], None), 8).is_ok(), "stamped by its publishers");
        assert!(
            matches!(check_static_stream(&stream(&["orders.*"], None), 4), Err(e) if e.kind() == Kind::StreamUnsuitable)
        );
    }

    #[test]
    fn elastic_filters_must_match_what_the_stream_stores() {
        let filters = |filter: &str| {
            serde_json::from_value::<ElasticGroupConfig>(serde_json::json!({
                "max_members": 4,
                "partitioning_filters": [{"filter": filter, "partitioning_wildcards": [1]}]
            }))
            .unwrap()
        };
        let plain = stream(&["orders.*"], None);
        assert!(check_elastic_filters(&plain, &filters("orders.*")).is_ok());
        let stamped = stream(&["orders.*"], Some(("orders.*", "{{partition(4,1)}}.orders.{{wildcard(1)}}")));
        assert!(
            matches!(check_elastic_filters(&stamped, &filters("orders.*")), Err(e) if e.kind() == Kind::StreamUnsuitable)
        );
        assert!(check_elastic_filters(&stamped, &filters("*.orders.*")).is_ok(), "<partition>.orders.<key>");
    }
}
