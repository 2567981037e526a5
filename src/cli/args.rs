//! The admin commands' arguments, as clap parses them (the names follow
//! pcgroups' `cg`).

use std::path::PathBuf;

use clap::{Args, Subcommand};

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
    /// Remove the explicit mappings; the members named become the group's
    /// balanced members (required while mappings are set: without them no
    /// partition would have an owner).
    DeleteMapping { stream: String, group: String, members: Vec<String> },
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

/// Which dead letters: every flag given must match.
#[derive(Debug, Clone, Default, Args)]
pub struct DlqFilter {
    /// Letters of this stream.
    #[arg(long)]
    pub stream: Option<String>,
    /// Letters of this group's members.
    #[arg(long, conflicts_with = "consumer")]
    pub group: Option<String>,
    /// Letters of this plain consumer's subscribers.
    #[arg(long)]
    pub consumer: Option<String>,
    /// Letters of this member (or subscriber).
    #[arg(long)]
    pub member: Option<String>,
    /// Letters of messages with this key.
    #[arg(long)]
    pub key: Option<String>,
    /// Letters whose reason contains this text, ignoring case.
    #[arg(long)]
    pub reason: Option<String>,
    /// Dead-lettered at or after this RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
    /// Dead-lettered at or before this RFC 3339 time.
    #[arg(long)]
    pub until: Option<String>,
}

/// `keygate dlq …`: the dead-letter stream.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Dead letters, oldest first.
    #[command(visible_alias = "list")]
    Ls {
        #[command(flatten)]
        filter: DlqFilter,
        /// Most letters to print.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Go on from the cursor an earlier `ls` printed.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// One dead letter, with its payload and headers.
    Show { id: String },
    /// Publish letters again to their streams, by id or every one a filter selects.
    Redrive {
        ids: Vec<String>,
        #[command(flatten)]
        filter: DlqFilter,
    },
    /// Delete letters, by id or every one a filter selects.
    #[command(visible_alias = "delete")]
    Rm {
        ids: Vec<String>,
        #[command(flatten)]
        filter: DlqFilter,
        /// Do not ask for confirmation.
        #[arg(short, long)]
        force: bool,
    },
}

/// One admin command.
#[derive(Debug)]
pub enum AdminCommand {
    Static(StaticCommand),
    Elastic(ElasticCommand),
    Streams(StreamsCommand),
    Dlq(DlqCommand),
}
