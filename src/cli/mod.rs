//! Admin commands mirroring pcgroups' `cg` CLI (`static …`, `elastic …`)
//! plus `streams ls` and `dlq …` (dead letters). They talk to NATS directly through the same code the
//! REST API runs, so they work on groups made by Go pcgroups too.

mod args;
mod commands;
mod dlq;
pub mod render;
pub mod serve;

use std::time::Duration;

use anyhow::Context as _;

pub use args::{
    AdminArgs, AdminCommand, DlqCommand, DlqFilter, ElasticCommand, StaticCommand, StaticCreate, StreamsCommand,
};

use crate::groups::spec::{Mapping, PartitioningFilterSpec};
use crate::groups::{GroupAdmin, GroupKind, GroupSpec};
use crate::names::{GroupName, MemberName, StreamName};
use crate::nats::connect::NatsAuth;
use crate::nats::connect::{connect_once, jetstream};
use crate::streams::Streams;

/// Runs an admin command, printing its result to standard output.
pub async fn run(args: &AdminArgs, command: AdminCommand) -> anyhow::Result<()> {
    let embedded =
        |file: &str| std::fs::read_to_string(args.data_dir.join("nats").join(file)).ok().map(|u| u.trim().to_owned());
    // Without a URL the commands talk to `keygate serve`'s embedded server,
    // with the token it wrote for its owner.
    let token = match &args.nats_url {
        Some(_) => args.nats_token.clone(),
        None => args.nats_token.clone().or_else(|| embedded(crate::nats::embedded::TOKEN_FILE)),
    };
    let auth = NatsAuth {
        token,
        user: args.nats_user.clone(),
        password: args.nats_password.clone(),
        creds_file: args.nats_creds.clone(),
    };
    let url = args
        .nats_url
        .clone()
        .unwrap_or_else(|| embedded(crate::nats::embedded::URL_FILE).unwrap_or_else(|| "nats://127.0.0.1:4222".into()));
    // Run away from the serving directory, the commands find no embedded
    // server's address and try the default one: say where they looked.
    let hint = || match &args.nats_url {
        Some(_) => String::new(),
        None if embedded(crate::nats::embedded::URL_FILE).is_some() => " (is `keygate serve` running?)".to_owned(),
        None => format!(
            " (no `keygate serve` data in {}: run from its directory, or pass --data-dir or --nats-url)",
            args.data_dir.join("nats").display()
        ),
    };
    let nats = tokio::time::timeout(Duration::from_secs(10), connect_once(&url, &auth))
        .await
        .with_context(|| format!("timed out connecting to NATS at {url}{}", hint()))?
        .with_context(|| format!("connecting to NATS at {url}{}", hint()))?;
    let js = jetstream(nats.clone(), Duration::from_secs(5));
    // Admin commands make buckets with the replicas the cluster suggests.
    let buckets = crate::nats::buckets::Buckets::new(js.clone(), None);
    let admin = Admin {
        groups: GroupAdmin::new(buckets.clone()),
        streams: Streams::new(js.clone()),
        dead_letters: crate::dead_letters::Archive::new(buckets),
        js,
        nats: nats.clone(),
        json: args.json,
    };
    let result = match command {
        AdminCommand::Static(c) => admin.static_command(c).await,
        AdminCommand::Elastic(c) => admin.elastic_command(c).await,
        AdminCommand::Streams(StreamsCommand::Ls { all }) => admin.streams_ls(all).await,
        AdminCommand::Dlq(c) => admin.dlq_command(c).await,
    };
    let _ = nats.flush().await;
    result
}

struct Admin {
    groups: GroupAdmin,
    streams: Streams,
    dead_letters: crate::dead_letters::Archive,
    js: async_nats::jetstream::Context,
    nats: async_nats::Client,
    json: bool,
}

impl Admin {
    async fn static_command(&self, command: StaticCommand) -> anyhow::Result<()> {
        let kind = GroupKind::Static;
        match command {
            StaticCommand::Ls { stream } => self.ls(&stream, kind).await,
            StaticCommand::Info { stream, group } => self.info(&stream, &group, kind).await,
            StaticCommand::Create(StaticCreate::Balanced { stream, group, max_members, members, filters }) => {
                let members = members.iter().map(|m| MemberName::parse(m)).collect::<Result<Vec<_>, _>>()?;
                let spec =
                    GroupSpec { members: Some(members), filters: Some(filters), ..GroupSpec::new(kind, max_members) };
                self.create(&stream, &group, spec).await
            }
            StaticCommand::Create(StaticCreate::Mapped { stream, group, max_members, mappings, filters }) => {
                let mappings = Some(parse_mappings(&mappings)?);
                let spec = GroupSpec { mappings, filters: Some(filters), ..GroupSpec::new(kind, max_members) };
                self.create(&stream, &group, spec).await
            }
            StaticCommand::Rm { stream, group, force } => self.rm(&stream, &group, kind, force).await,
            StaticCommand::MemberInfo { stream, group, member } => {
                self.member_info(&stream, &group, &member, kind).await
            }
            StaticCommand::StepDown { stream, group, member } => self.step_down(&stream, &group, &member).await,
        }
    }

    async fn elastic_command(&self, command: ElasticCommand) -> anyhow::Result<()> {
        let kind = GroupKind::Elastic;
        match command {
            ElasticCommand::Ls { stream } => self.ls(&stream, kind).await,
            ElasticCommand::Info { stream, group } => self.info(&stream, &group, kind).await,
            ElasticCommand::Create {
                stream,
                group,
                max_members,
                filters,
                wildcards,
                max_buffered_msgs,
                max_buffered_bytes,
            } => {
                let spec = GroupSpec {
                    partitioning_filters: partitioning_filters(&filters, &wildcards)?,
                    max_buffered_msgs: Some(max_buffered_msgs),
                    max_buffered_bytes: Some(max_buffered_bytes),
                    ..GroupSpec::new(kind, max_members)
                };
                self.create(&stream, &group, spec).await
            }
            ElasticCommand::Rm { stream, group, force } => self.rm(&stream, &group, kind, force).await,
            ElasticCommand::Add { stream, group, members } => {
                let (stream, group) = names(&stream, &group)?;
                let members = members.iter().map(|m| MemberName::parse(m)).collect::<Result<Vec<_>, _>>()?;
                let view = self.groups.add_members(&stream, &group, &members).await?;
                self.print_membership("added", &view)
            }
            ElasticCommand::Drop { stream, group, members } => {
                let (stream, group) = names(&stream, &group)?;
                let mut view = None;
                for member in &members {
                    let member = MemberName::parse(member)?;
                    view = Some(self.groups.drop_member(&stream, &group, &member).await?);
                }
                self.print_membership("dropped", &view.expect("members are required"))
            }
            ElasticCommand::CreateMapping { stream, group, mappings } => {
                let (stream, group) = names(&stream, &group)?;
                let mappings = parse_mappings(&mappings)?
                    .into_iter()
                    .map(|m| crate::groups::config::MemberMapping {
                        member: m.member.to_string(),
                        partitions: Some(m.partitions),
                    })
                    .collect();
                let view = self.groups.set_mappings(&stream, &group, mappings).await?;
                self.print_membership("mapped", &view)
            }
            ElasticCommand::DeleteMapping { stream, group, members } => {
                let (stream, group) = names(&stream, &group)?;
                let members = members.iter().map(|m| MemberName::parse(m)).collect::<Result<Vec<_>, _>>()?;
                let view = self.groups.delete_mappings(&stream, &group, &members).await?;
                self.print_membership("mappings deleted", &view)
            }
            ElasticCommand::MemberInfo { stream, group, member } => {
                self.member_info(&stream, &group, &member, kind).await
            }
            ElasticCommand::StepDown { stream, group, member } => self.step_down(&stream, &group, &member).await,
        }
    }
}

fn names(stream: &str, group: &str) -> anyhow::Result<(StreamName, GroupName)> {
    Ok((StreamName::parse(stream)?, GroupName::parse(group)?))
}

/// `<member>:<p1>,<p2>,…` as cg takes them.
fn parse_mappings(args: &[String]) -> anyhow::Result<Vec<Mapping>> {
    args.iter()
        .map(|arg| {
            let (member, partitions) =
                arg.split_once(':').with_context(|| format!("mapping {arg:?} is not <member>:<p1>,<p2>,…"))?;
            let partitions = partitions
                .split(',')
                .map(|p| p.trim().parse::<u32>().with_context(|| format!("mapping {arg:?}: {p:?} is not a partition")))
                .collect::<anyhow::Result<Vec<u32>>>()?;
            Ok(Mapping { member: MemberName::parse(member)?, partitions })
        })
        .collect()
}

/// Elastic partitioning filters from `--filter` and, by position, `--wildcards`.
fn partitioning_filters(
    filters: &[String],
    wildcards: &[String],
) -> anyhow::Result<Option<Vec<PartitioningFilterSpec>>> {
    anyhow::ensure!(wildcards.len() <= filters.len(), "more --wildcards than --filter");
    if filters.is_empty() {
        return Ok(None);
    }
    filters
        .iter()
        .enumerate()
        .map(|(i, filter)| {
            let positions: Vec<u32> = match wildcards.get(i) {
                Some(list) => list
                    .split([',', ' '])
                    .filter(|s| !s.is_empty())
                    .map(|w| w.parse::<u32>().with_context(|| format!("--wildcards {list:?}: {w:?} is not a position")))
                    .collect::<anyhow::Result<_>>()?,
                None => (1..=filter.split('.').filter(|t| *t == "*").count() as u32).collect(),
            };
            let wildcards = (!positions.is_empty()).then_some(positions);
            Ok(PartitioningFilterSpec { filter: filter.clone(), wildcards })
        })
        .collect::<anyhow::Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_parse_as_cg_writes_them() {
        let parsed = parse_mappings(&["m1:0,1".into(), "m2:2".into()]).unwrap();
        assert_eq!(parsed[0].member.as_str(), "m1");
        assert_eq!(parsed[0].partitions, vec![0, 1]);
        assert_eq!(parsed[1].partitions, vec![2]);
        assert!(parse_mappings(&["m1".into()]).is_err());
        assert!(parse_mappings(&["m1:x".into()]).is_err());
        assert!(parse_mappings(&["bad name:1".into()]).is_err());
    }

    #[test]
    fn elastic_filters_default_to_every_wildcard_of_the_filter() {
        assert_eq!(partitioning_filters(&[], &[]).unwrap(), None);
        let given = partitioning_filters(&["orders.*.*".into(), "audit.>".into()], &["2".into()]).unwrap().unwrap();
        assert_eq!(given[0], PartitioningFilterSpec { filter: "orders.*.*".into(), wildcards: Some(vec![2]) });
        assert_eq!(given[1], PartitioningFilterSpec { filter: "audit.>".into(), wildcards: None });
        let defaulted = partitioning_filters(&["orders.*.*".into()], &[]).unwrap().unwrap();
        assert_eq!(defaulted[0], PartitioningFilterSpec { filter: "orders.*.*".into(), wildcards: Some(vec![1, 2]) });
        assert!(partitioning_filters(&["a.*".into()], &["1".into(), "2".into()]).is_err());
    }
}
