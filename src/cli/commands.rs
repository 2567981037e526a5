//! What each admin command does and prints.

use std::io::{BufRead as _, Write as _};

use serde_json::json;

use super::render::{out, print_json, ranges, table, timestamp, yes_no};
use super::{names, Admin};
use crate::groups::admin::PutOutcome;
use crate::groups::view::{GroupView, MembershipView};
use crate::groups::{GroupKind, GroupSettings, GroupSpec};
use crate::names::{MemberName, StreamName};
use crate::status::observe::Instances;

impl Admin {
    pub(super) async fn ls(&self, stream: &str, kind: GroupKind) -> anyhow::Result<()> {
        let stream = StreamName::parse(stream)?;
        let groups: Vec<String> =
            self.groups.list(&stream).await?.into_iter().filter(|g| g.kind == kind).map(|g| g.group).collect();
        if self.json {
            return print_json(&groups);
        }
        if groups.is_empty() {
            out!("no {} groups on stream {stream}", kind.as_str());
        } else {
            out!("{} groups on stream {stream}: {}", kind.as_str(), groups.join(", "));
        }
        Ok(())
    }

    pub(super) async fn view(&self, stream: &str, group: &str, kind: GroupKind) -> anyhow::Result<GroupView> {
        let (stream, group) = names(stream, group)?;
        crate::status::observe::observe(&self.groups, &self.nats, &stream, &group, Some(kind), Instances::RollCall)
            .await
            .map_err(Into::into)
    }

    pub(super) async fn info(&self, stream: &str, group: &str, kind: GroupKind) -> anyhow::Result<()> {
        let view = self.view(stream, group, kind).await?;
        if self.json {
            return print_json(&view);
        }
        out!(
            "{} group {}/{}: {} partitions, ack wait {} ms, ordered by {}",
            kind.as_str(),
            view.stream,
            view.group,
            view.partitions,
            view.ack_wait_ms,
            view.ordering.as_str()
        );
        if let Some(filters) = &view.filters {
            out!("filters: {}", if filters.is_empty() { "(every subject)".to_owned() } else { filters.join(" ") });
        }
        if let Some(pfs) = &view.partitioning_filters {
            match pfs {
                None => out!("partitioning filters: none (whole subject hashed)"),
                Some(list) => {
                    for pf in list {
                        out!(
                            "partitioning filter: {} wildcards {:?}",
                            pf.filter,
                            pf.wildcards.as_deref().unwrap_or_default()
                        );
                    }
                }
            }
            out!(
                "work-queue stream: {} (max buffered msgs {}, bytes {})",
                view.work_queue_stream.as_deref().unwrap_or("-"),
                view.max_buffered_msgs.unwrap_or(0),
                view.max_buffered_bytes.unwrap_or(0)
            );
        }
        if view.assignment.is_empty() {
            out!("no members or mappings defined");
        }
        let mut members = table(&[
            "MEMBER",
            "PARTITIONS",
            "CONSUMER",
            "ACTIVE",
            "SERVED BY",
            "PINNED SINCE",
            "PENDING",
            "ACK PENDING",
        ]);
        for m in &view.assignment {
            members.add_row(vec![
                m.member.clone(),
                ranges(&m.partitions),
                if m.consumer_exists { m.consumer.clone() } else { format!("{} (none)", m.consumer) },
                yes_no(m.active).to_owned(),
                m.serving_instance.clone().or_else(|| m.pinned_client_id.clone()).unwrap_or_else(|| "-".into()),
                m.pinned_since.map(timestamp).unwrap_or_else(|| "-".into()),
                m.num_pending.to_string(),
                m.num_ack_pending.to_string(),
            ]);
        }
        out!("{members}");
        let mut backlog = table(&["PARTITION", "MEMBER", "PENDING"]);
        for p in &view.partition_pending {
            backlog.add_row(vec![
                p.partition.to_string(),
                p.member.clone().unwrap_or_else(|| "-".into()),
                p.pending.map_or_else(|| "?".into(), |n| n.to_string()),
            ]);
        }
        out!("{backlog}");
        for b in &view.blocked {
            let key = b.key.as_ref().map(|k| format!(" key {k:?}")).unwrap_or_default();
            out!(
                "BLOCKED partition {}{key} (member {}): seq {} since {} after {} attempts: {}",
                b.partition,
                b.member,
                b.seq,
                timestamp(b.since),
                b.attempts,
                b.last_error
            );
        }
        if view.blocked_total > view.blocked.len() {
            out!("… and {} more blocked", view.blocked_total - view.blocked.len());
        }
        Ok(())
    }

    pub(super) async fn create(&self, stream: &str, group: &str, spec: GroupSpec) -> anyhow::Result<()> {
        let (stream, group) = names(stream, group)?;
        let kind = spec.kind;
        let settings = GroupSettings::requested_by(&spec);
        let config = spec.into_config()?;
        let outcome = self.groups.put(&stream, &group, config, true, settings).await?;
        let view =
            crate::status::observe::observe(&self.groups, &self.nats, &stream, &group, Some(kind), Instances::Skip)
                .await?;
        if self.json {
            return print_json(&view);
        }
        let what = match outcome {
            PutOutcome::Created => "created",
            PutOutcome::Unchanged => "unchanged:",
            PutOutcome::Updated => "updated",
        };
        out!("{what} {} group {stream}/{group} with {} partitions", kind.as_str(), view.partitions);
        for m in &view.assignment {
            out!("  {}: partitions {}", m.member, ranges(&m.partitions));
        }
        Ok(())
    }

    pub(super) async fn rm(&self, stream: &str, group: &str, kind: GroupKind, force: bool) -> anyhow::Result<()> {
        let (stream, group) = names(stream, group)?;
        if !force
            && !confirm(&format!(
                "WARNING: deleting {} group {stream}/{group} stops every member consuming it. Are you sure? (y/n): ",
                kind.as_str()
            ))?
        {
            anyhow::bail!("operation canceled");
        }
        self.groups.delete(&stream, &group, Some(kind)).await?;
        if self.json {
            return print_json(&json!({"deleted": format!("{stream}/{group}")}));
        }
        out!("deleted {} group {stream}/{group}", kind.as_str());
        Ok(())
    }

    pub(super) async fn member_info(
        &self,
        stream: &str,
        group: &str,
        member: &str,
        kind: GroupKind,
    ) -> anyhow::Result<()> {
        let member = MemberName::parse(member)?;
        let view = self.view(stream, group, kind).await?;
        let state = view.assignment.iter().find(|m| m.member == member.as_str());
        if self.json {
            return print_json(&json!({"member": member.as_str(), "in_membership": state.is_some(), "state": state}));
        }
        let Some(state) = state else {
            out!("member {member} is not part of the group's membership");
            return Ok(());
        };
        out!("member {member} is part of the group's membership, partitions {}", ranges(&state.partitions));
        match (&state.serving_instance, &state.pinned_client_id, state.active) {
            (Some(instance), _, _) => out!("member {member} is active, served by keygate instance {instance}"),
            (None, Some(pin), _) => out!("member {member} is active, pinned client {pin}"),
            (None, None, true) => out!("member {member} is active"),
            (None, None, false) => {
                out!("***Warning*** member {member} is part of the group's membership but has NO active instance")
            }
        }
        out!("pending {}, ack pending {}", state.num_pending, state.num_ack_pending);
        Ok(())
    }

    pub(super) async fn step_down(&self, stream: &str, group: &str, member: &str) -> anyhow::Result<()> {
        let (stream, group) = names(stream, group)?;
        let member = MemberName::parse(member)?;
        self.groups.step_down(&stream, &group, &member).await?;
        if self.json {
            return print_json(&json!({"stepped_down": member.as_str()}));
        }
        out!("member {member} of {stream}/{group} stepped down: its pin is released for another instance");
        Ok(())
    }

    pub(super) fn print_membership(&self, what: &str, view: &MembershipView) -> anyhow::Result<()> {
        if self.json {
            return print_json(view);
        }
        out!(
            "{what}; members now: {}",
            if view.members.is_empty() { "(none)".to_owned() } else { view.members.join(", ") }
        );
        for owned in &view.ownership {
            out!("  {}: partitions {}", owned.member, ranges(&owned.partitions));
        }
        Ok(())
    }

    pub(super) async fn streams_ls(&self, all: bool) -> anyhow::Result<()> {
        let streams = self.streams.list(all).await?;
        if self.json {
            return print_json(&streams);
        }
        let mut out = table(&[
            "STREAM",
            "SUBJECTS",
            "PARTITIONS",
            "MESSAGES",
            "BYTES",
            "SEQUENCES",
            "CONSUMERS",
            "STORAGE",
            "REPLICAS",
        ]);
        for s in &streams {
            out.add_row(vec![
                s.name.clone(),
                s.subjects.join(" "),
                s.partitions.map_or_else(|| "-".into(), |p| p.to_string()),
                s.messages.to_string(),
                s.bytes.to_string(),
                if s.messages == 0 { "-".into() } else { format!("{}..{}", s.first_seq, s.last_seq) },
                s.consumers.to_string(),
                format!("{:?}", s.storage).to_lowercase(),
                s.replicas.to_string(),
            ]);
        }
        if streams.is_empty() {
            out!("no streams");
        } else {
            out!("{out}");
        }
        Ok(())
    }
}

pub(super) fn confirm(question: &str) -> anyhow::Result<bool> {
    print!("{question}");
    std::io::stdout().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(answer.trim() == "y")
}
