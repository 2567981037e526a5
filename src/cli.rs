//! Admin commands mirroring pcgroups' `cg` CLI (`static …`, `elastic …`)
//! plus `streams ls`. They talk to NATS directly through the same code the
//! REST API runs, so they work on groups made by Go pcgroups too.

use std::io::{BufRead as _, Write as _};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use comfy_table::{presets, Table};
use serde::Serialize;
use serde_json::{json, Value};

use crate::config::NatsAuth;
use crate::error::ApiError;
use crate::groups::view::{GroupView, MembershipView};
use crate::groups::{GroupAdmin, GroupKind, GroupSpec};
use crate::names::{GroupName, MemberName, StreamName};
use crate::nats::connect::{connect_once, jetstream};
use crate::streams::Streams;

/// Where the admin commands find NATS, and how they print.
#[derive(Debug, Args)]
pub struct AdminArgs {
    /// NATS server or cluster URLs, comma-separated. Default: the embedded
    /// server of a `keygate serve` using --data-dir, else nats://127.0.0.1:4222.
    #[arg(long, global = true, env = "KEYGATE_NATS_URL")]
    pub nats_url: Option<String>,
    /// The data directory of a `keygate serve` running its embedded nats-server.
    #[arg(long, global = true, env = "KEYGATE_DATA_DIR", default_value = "./keygate-data")]
    pub data_dir: PathBuf,
    /// Token for --nats-url.
    #[arg(long, global = true, env = "KEYGATE_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// User for --nats-url.
    #[arg(long, global = true, env = "KEYGATE_NATS_USER")]
    pub nats_user: Option<String>,
    /// Password for --nats-url.
    #[arg(long, global = true, env = "KEYGATE_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    /// A .creds file (JWT + NKey) for --nats-url.
    #[arg(long, global = true, env = "KEYGATE_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// Print JSON (the REST API's shapes) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// `keygate static …`
#[derive(Debug, Subcommand)]
pub enum StaticCommand {
    /// List the static groups defined on a stream.
    #[command(visible_alias = "list")]
    Ls { stream: String },
    /// A static group: configuration, members, pins and backlog.
    Info { stream: String, group: String },
    /// Create a static group.
    #[command(subcommand)]
    Create(StaticCreate),
    /// Delete a static group (its configuration and its members' consumers).
    #[command(visible_alias = "delete")]
    Rm {
        stream: String,
        group: String,
        /// Do not ask for confirmation.
        #[arg(short, long)]
        force: bool,
    },
    /// Whether a member belongs to the group, what it owns and who serves it.
    #[command(visible_alias = "minfo")]
    MemberInfo { stream: String, group: String, member: String },
    /// Unpin a member's current instance so another one takes over.
    #[command(visible_alias = "sd")]
    StepDown { stream: String, group: String, member: String },
}

/// `keygate static create …`
#[derive(Debug, Subcommand)]
pub enum StaticCreate {
    /// Members share the partitions evenly.
    Balanced {
        stream: String,
        group: String,
        /// The partition count (pcgroups' max members).
        max_members: u32,
        /// Member names.
        #[arg(required = true)]
        members: Vec<String>,
        /// Subject filters (without the partition token), repeatable.
        #[arg(long = "filter")]
        filters: Vec<String>,
    },
    /// Members own explicit partitions: `<member>:<p1>,<p2>,…`.
    Mapped {
        stream: String,
        group: String,
        /// The partition count (pcgroups' max members).
        max_members: u32,
        /// `<member>:<p1>,<p2>,…`, covering every partition exactly once.
        #[arg(required = true)]
        mappings: Vec<String>,
        /// Subject filters (without the partition token), repeatable.
        #[arg(long = "filter")]
        filters: Vec<String>,
    },
}

/// `keygate elastic …`
#[derive(Debug, Subcommand)]
pub enum ElasticCommand {
    /// List the elastic groups defined on a stream.
    #[command(visible_alias = "list")]
    Ls { stream: String },
    /// An elastic group: configuration, members, pins and backlog.
    Info { stream: String, group: String },
    /// Create an elastic group (members are added afterwards).
    Create {
        stream: String,
        group: String,
        /// The partition count (pcgroups' max members).
        max_members: u32,
        /// Subject filters sourced from the stream, repeatable (default: every subject, hashed whole).
        #[arg(long = "filter")]
        filters: Vec<String>,
        /// For each --filter in order, the `*` positions hashed, e.g. `1,2` (default: all of its `*`).
        #[arg(long = "wildcards")]
        wildcards: Vec<String>,
        /// Most messages buffered in the work-queue stream (0: unlimited).
        #[arg(long, default_value_t = 0)]
        max_buffered_msgs: i64,
        /// Most bytes buffered in the work-queue stream (0: unlimited).
        #[arg(long, default_value_t = 0)]
        max_buffered_bytes: i64,
    },
    /// Delete an elastic group (its configuration and work-queue stream).
    #[command(visible_alias = "delete")]
    Rm {
        stream: String,
        group: String,
        /// Do not ask for confirmation.
        #[arg(short, long)]
        force: bool,
    },
    /// Add members; partitions rebalance live.
    Add {
        stream: String,
        group: String,
        #[arg(required = true)]
        members: Vec<String>,
    },
    /// Drop members; partitions rebalance live.
    Drop {
        stream: String,
        group: String,
        #[arg(required = true)]
        members: Vec<String>,
    },
    /// Replace membership with explicit mappings `<member>:<p1>,<p2>,…`.
    CreateMapping {
        stream: String,
        group: String,
        #[arg(required = true)]
        mappings: Vec<String>,
    },
    /// Remove the explicit mappings.
    DeleteMapping { stream: String, group: String },
    /// Whether a member belongs to the group, what it owns and who serves it.
    #[command(visible_alias = "minfo")]
    MemberInfo { stream: String, group: String, member: String },
    /// Unpin a member's current instance so another one takes over.
    #[command(visible_alias = "sd")]
    StepDown { stream: String, group: String, member: String },
}

/// `keygate streams …`
#[derive(Debug, Subcommand)]
pub enum StreamsCommand {
    /// Streams with their partitions, messages and state.
    #[command(visible_alias = "list")]
    Ls {
        /// Include the streams behind KV buckets and object stores.
        #[arg(long)]
        all: bool,
    },
}

/// One admin command.
#[derive(Debug)]
pub enum AdminCommand {
    Static(StaticCommand),
    Elastic(ElasticCommand),
    Streams(StreamsCommand),
}

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
    let nats = tokio::time::timeout(Duration::from_secs(10), connect_once(&url, &auth))
        .await
        .with_context(|| format!("timed out connecting to NATS at {url}"))??;
    let js = jetstream(nats.clone(), Duration::from_secs(5));
    let admin =
        Admin { groups: GroupAdmin::new(js.clone()), streams: Streams::new(js), nats: nats.clone(), json: args.json };
    let result = match command {
        AdminCommand::Static(c) => admin.static_command(c).await,
        AdminCommand::Elastic(c) => admin.elastic_command(c).await,
        AdminCommand::Streams(StreamsCommand::Ls { all }) => admin.streams_ls(all).await,
    };
    let _ = nats.flush().await;
    result
}

struct Admin {
    groups: GroupAdmin,
    streams: Streams,
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
                let spec = json!({"kind":"static","partitions":max_members,"members":members,"filters":filters});
                self.create(&stream, &group, spec).await
            }
            StaticCommand::Create(StaticCreate::Mapped { stream, group, max_members, mappings, filters }) => {
                let spec = json!({"kind":"static","partitions":max_members,"mappings":parse_mappings(&mappings)?,"filters":filters});
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
                let spec = json!({
                    "kind": "elastic",
                    "partitions": max_members,
                    "partitioning_filters": partitioning_filters(&filters, &wildcards)?,
                    "max_buffered_msgs": max_buffered_msgs,
                    "max_buffered_bytes": max_buffered_bytes,
                });
                self.create(&stream, &group, spec).await
            }
            ElasticCommand::Rm { stream, group, force } => self.rm(&stream, &group, kind, force).await,
            ElasticCommand::Add { stream, group, members } => {
                let (stream, group) = names(&stream, &group)?;
                let members = members.iter().map(|m| MemberName::parse(m)).collect::<Result<Vec<_>, _>>()?;
                let view = self.groups.add_members(&stream, &group, &members).await.map_err(api)?;
                self.print_membership("added", &view)
            }
            ElasticCommand::Drop { stream, group, members } => {
                let (stream, group) = names(&stream, &group)?;
                let mut view = None;
                for member in &members {
                    let member = MemberName::parse(member)?;
                    view = Some(self.groups.drop_member(&stream, &group, &member).await.map_err(api)?);
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
                let view = self.groups.set_mappings(&stream, &group, mappings).await.map_err(api)?;
                self.print_membership("mapped", &view)
            }
            ElasticCommand::DeleteMapping { stream, group } => {
                let (stream, group) = names(&stream, &group)?;
                let view = self.groups.delete_mappings(&stream, &group).await.map_err(api)?;
                self.print_membership("mappings deleted", &view)
            }
            ElasticCommand::MemberInfo { stream, group, member } => {
                self.member_info(&stream, &group, &member, kind).await
            }
            ElasticCommand::StepDown { stream, group, member } => self.step_down(&stream, &group, &member).await,
        }
    }

    async fn ls(&self, stream: &str, kind: GroupKind) -> anyhow::Result<()> {
        let stream = StreamName::parse(stream)?;
        let groups: Vec<String> = self
            .groups
            .list(&stream)
            .await
            .map_err(api)?
            .into_iter()
            .filter(|g| g.kind == kind)
            .map(|g| g.group)
            .collect();
        if self.json {
            return print_json(&groups);
        }
        if groups.is_empty() {
            println!("no {} groups on stream {stream}", kind.as_str());
        } else {
            println!("{} groups on stream {stream}: {}", kind.as_str(), groups.join(", "));
        }
        Ok(())
    }

    async fn view(&self, stream: &str, group: &str, kind: GroupKind) -> anyhow::Result<GroupView> {
        let (stream, group) = names(stream, group)?;
        crate::member::observe::observe(&self.groups, &self.nats, &stream, &group, Some(kind), true).await.map_err(api)
    }

    async fn info(&self, stream: &str, group: &str, kind: GroupKind) -> anyhow::Result<()> {
        let view = self.view(stream, group, kind).await?;
        if self.json {
            return print_json(&view);
        }
        println!(
            "{} group {}/{}: {} partitions, ack wait {} ms",
            kind.as_str(),
            view.stream,
            view.group,
            view.partitions,
            view.ack_wait_ms
        );
        if let Some(filters) = &view.filters {
            println!("filters: {}", if filters.is_empty() { "(every subject)".to_owned() } else { filters.join(" ") });
        }
        if let Some(pfs) = &view.partitioning_filters {
            match pfs {
                None => println!("partitioning filters: none (whole subject hashed)"),
                Some(list) => {
                    for pf in list {
                        println!(
                            "partitioning filter: {} wildcards {:?}",
                            pf.filter,
                            pf.wildcards.as_deref().unwrap_or_default()
                        );
                    }
                }
            }
            println!(
                "work-queue stream: {} (max buffered msgs {}, bytes {})",
                view.work_queue_stream.as_deref().unwrap_or("-"),
                view.max_buffered_msgs.unwrap_or(0),
                view.max_buffered_bytes.unwrap_or(0)
            );
        }
        if view.assignment.is_empty() {
            println!("no members or mappings defined");
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
                m.pinned_since.map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
                m.num_pending.to_string(),
                m.num_ack_pending.to_string(),
            ]);
        }
        println!("{members}");
        let mut backlog = table(&["PARTITION", "MEMBER", "PENDING"]);
        for p in &view.partition_pending {
            backlog.add_row(vec![
                p.partition.to_string(),
                p.member.clone().unwrap_or_else(|| "-".into()),
                p.pending.map_or_else(|| "?".into(), |n| n.to_string()),
            ]);
        }
        println!("{backlog}");
        for b in &view.blocked {
            println!(
                "BLOCKED partition {} (member {}): seq {} since {} after {} attempts: {}",
                b.partition, b.member, b.seq, b.since, b.attempts, b.last_error
            );
        }
        Ok(())
    }

    async fn create(&self, stream: &str, group: &str, spec: Value) -> anyhow::Result<()> {
        let (stream, group) = names(stream, group)?;
        let spec: GroupSpec = serde_json::from_value(spec).context("invalid group")?;
        let kind = spec.kind;
        let config = spec.into_config().map_err(api)?;
        let outcome = self.groups.put(&stream, &group, config, true, None).await.map_err(api)?;
        let view = crate::member::observe::observe(&self.groups, &self.nats, &stream, &group, Some(kind), false)
            .await
            .map_err(api)?;
        if self.json {
            return print_json(&view);
        }
        let what = match outcome {
            crate::groups::admin::PutOutcome::Created => "created",
            crate::groups::admin::PutOutcome::Unchanged => "unchanged:",
            crate::groups::admin::PutOutcome::Updated => "updated",
        };
        println!("{what} {} group {stream}/{group} with {} partitions", kind.as_str(), view.partitions);
        for m in &view.assignment {
            println!("  {}: partitions {}", m.member, ranges(&m.partitions));
        }
        Ok(())
    }

    async fn rm(&self, stream: &str, group: &str, kind: GroupKind, force: bool) -> anyhow::Result<()> {
        let (stream, group) = names(stream, group)?;
        if !force
            && !confirm(&format!(
                "WARNING: deleting {} group {stream}/{group} stops every member consuming it. Are you sure? (y/n): ",
                kind.as_str()
            ))?
        {
            anyhow::bail!("operation canceled");
        }
        self.groups.delete(&stream, &group, Some(kind)).await.map_err(api)?;
        if self.json {
            return print_json(&json!({"deleted": format!("{stream}/{group}")}));
        }
        println!("deleted {} group {stream}/{group}", kind.as_str());
        Ok(())
    }

    async fn member_info(&self, stream: &str, group: &str, member: &str, kind: GroupKind) -> anyhow::Result<()> {
        let member = MemberName::parse(member)?;
        let view = self.view(stream, group, kind).await?;
        let state = view.assignment.iter().find(|m| m.member == member.as_str());
        if self.json {
            return print_json(&json!({"member": member.as_str(), "in_membership": state.is_some(), "state": state}));
        }
        let Some(state) = state else {
            println!("member {member} is not part of the group's membership");
            return Ok(());
        };
        println!("member {member} is part of the group's membership, partitions {}", ranges(&state.partitions));
        match (&state.serving_instance, &state.pinned_client_id, state.active) {
            (Some(instance), _, _) => println!("member {member} is active, served by keygate instance {instance}"),
            (None, Some(pin), _) => println!("member {member} is active, pinned client {pin}"),
            (None, None, true) => println!("member {member} is active"),
            (None, None, false) => {
                println!("***Warning*** member {member} is part of the group's membership but has NO active instance")
            }
        }
        println!("pending {}, ack pending {}", state.num_pending, state.num_ack_pending);
        Ok(())
    }

    async fn step_down(&self, stream: &str, group: &str, member: &str) -> anyhow::Result<()> {
        let (stream, group) = names(stream, group)?;
        let member = MemberName::parse(member)?;
        self.groups.step_down(&stream, &group, &member).await.map_err(api)?;
        if self.json {
            return print_json(&json!({"stepped_down": member.as_str()}));
        }
        println!("member {member} of {stream}/{group} stepped down: its pin is released for another instance");
        Ok(())
    }

    fn print_membership(&self, what: &str, view: &MembershipView) -> anyhow::Result<()> {
        if self.json {
            return print_json(view);
        }
        println!(
            "{what}; members now: {}",
            if view.members.is_empty() { "(none)".to_owned() } else { view.members.join(", ") }
        );
        for owned in &view.ownership {
            println!("  {}: partitions {}", owned.member, ranges(&owned.partitions));
        }
        Ok(())
    }

    async fn streams_ls(&self, all: bool) -> anyhow::Result<()> {
        let streams = self.streams.list(all).await.map_err(api)?;
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
            println!("no streams");
        } else {
            println!("{out}");
        }
        Ok(())
    }
}

fn names(stream: &str, group: &str) -> anyhow::Result<(StreamName, GroupName)> {
    Ok((StreamName::parse(stream)?, GroupName::parse(group)?))
}

/// API errors already say what went wrong in words meant for people.
fn api(e: ApiError) -> anyhow::Error {
    anyhow::anyhow!("{}", e.problem().detail)
}

/// `<member>:<p1>,<p2>,…` as cg takes them.
fn parse_mappings(args: &[String]) -> anyhow::Result<Vec<crate::groups::spec::Mapping>> {
    args.iter()
        .map(|arg| {
            let (member, partitions) =
                arg.split_once(':').with_context(|| format!("mapping {arg:?} is not <member>:<p1>,<p2>,…"))?;
            let partitions = partitions
                .split(',')
                .map(|p| p.trim().parse::<u32>().with_context(|| format!("mapping {arg:?}: {p:?} is not a partition")))
                .collect::<anyhow::Result<Vec<u32>>>()?;
            Ok(crate::groups::spec::Mapping { member: MemberName::parse(member)?, partitions })
        })
        .collect()
}

/// Elastic partitioning filters from `--filter` and, by position, `--wildcards`.
fn partitioning_filters(filters: &[String], wildcards: &[String]) -> anyhow::Result<Option<Vec<Value>>> {
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
            Ok(json!({"filter": filter, "wildcards": if positions.is_empty() { Value::Null } else { json!(positions) }}))
        })
        .collect::<anyhow::Result<Vec<Value>>>()
        .map(Some)
}

fn confirm(question: &str) -> anyhow::Result<bool> {
    print!("{question}");
    std::io::stdout().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(answer.trim() == "y")
}

fn table(headers: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(presets::NOTHING).set_header(headers.to_vec());
    table
}

fn yes_no(value: bool) -> &'static str {
    if value {
        "yes"
    } else {
        "no"
    }
}

/// Partitions as compact ranges: `0-3,7,9-10`.
fn ranges(partitions: &[u32]) -> String {
    let mut sorted = partitions.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_print_as_compact_ranges() {
        assert_eq!(ranges(&[]), "-");
        assert_eq!(ranges(&[3, 0, 1, 2, 7, 9, 10]), "0-3,7,9-10");
        assert_eq!(ranges(&[5]), "5");
    }

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
        assert_eq!(given[0], json!({"filter":"orders.*.*","wildcards":[2]}));
        assert_eq!(given[1], json!({"filter":"audit.>","wildcards":null}));
        let defaulted = partitioning_filters(&["orders.*.*".into()], &[]).unwrap().unwrap();
        assert_eq!(defaulted[0], json!({"filter":"orders.*.*","wildcards":[1,2]}));
        assert!(partitioning_filters(&["a.*".into()], &["1".into(), "2".into()]).is_err());
    }
}
