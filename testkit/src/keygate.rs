//! keygate as its own process, for tests that SIGKILL it and benchmarks
//! that measure its memory: started from the binary cargo built beside the
//! test or benchmark, killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::app::eventually;
use crate::nats::{free_port, NatsEndpoint};

/// The keygate binary of the profile the caller was built with: cargo puts
/// a package's binaries beside the `deps/` folder of its test and benchmark
/// executables (`KEYGATE_TEST_BIN` overrides it).
pub fn keygate_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("KEYGATE_TEST_BIN") {
        return path.into();
    }
    let exe = std::env::current_exe().expect("the running executable's path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("a target/<profile>/deps executable");
    let binary = profile_dir.join("keygate");
    assert!(binary.is_file(), "{} is missing: cargo builds it with the tests and benchmarks", binary.display());
    binary
}

/// How to start one keygate process.
pub struct Launch<'a> {
    pub nats: NatsEndpoint,
    pub instance_id: Option<&'a str>,
    /// `KEYGATE_LOG`.
    pub log_filter: &'a str,
    pub extra: &'a [&'a str],
    /// Where standard output (the logs) goes.
    pub logs: Stdio,
    /// Environment variables besides `KEYGATE_LOG`.
    pub env: &'a [(&'a str, &'a str)],
}

impl Launch<'_> {
    pub fn plain(nats: NatsEndpoint) -> Self {
        Self { nats, instance_id: None, log_filter: "warn", extra: &[], logs: Stdio::null(), env: &[] }
    }
}

/// The counter of acks and terms sent without a verdict (docs/guarantees.md).
pub const ACKS_WITHOUT_VERDICT: &str = "keygate_acks_without_verdict_total";

/// A metric's value in the `/metrics` page of the keygate at `base`
/// (summed over labels; 0 when absent).
pub async fn metric_at(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with(name) && (l.as_bytes().get(name.len()) == Some(&b' ') || l[name.len()..].starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub struct KeygateProcess {
    child: Child,
    pub base: String,
}

impl KeygateProcess {
    /// keygate against `nats_url` (no credentials), named `instance_id`, logging warnings.
    pub fn start(nats_url: &str, instance_id: &str) -> Self {
        Self::launch(Launch { instance_id: Some(instance_id), ..Launch::plain(NatsEndpoint::open(nats_url)) })
    }

    /// Starts with a log filter, extra flags, and standard output (where logs go) sent to `logs`.
    pub fn start_logging(nats_url: &str, instance_id: &str, filter: &str, extra: &[&str], logs: Stdio) -> Self {
        Self::launch(Launch {
            nats: NatsEndpoint::open(nats_url),
            instance_id: Some(instance_id),
            log_filter: filter,
            extra,
            logs,
            env: &[],
        })
    }

    /// A benchmark's keygate: logs at `info`, the level users run (its log
    /// subscriber records what that level enables, at a cost), written to
    /// nowhere; no backlog sampling, so what is measured is delivery.
    pub fn for_bench(nats: &NatsEndpoint, instance_id: Option<&str>) -> Self {
        Self::launch(Launch {
            instance_id,
            log_filter: "info",
            extra: &["--backlog-sample-secs", "0"],
            ..Launch::plain(nats.clone())
        })
    }

    pub fn launch(launch: Launch<'_>) -> Self {
        let port = free_port();
        let mut command = Command::new(keygate_binary());
        command.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
        launch.nats.command(&mut command);
        if let Some(id) = launch.instance_id {
            command.args(["--instance-id", id]);
        }
        // To see what processes did in a run that failed:
        // KEYGATE_TEST_LOG_DIR keeps each one's log there, filtered by
        // KEYGATE_TEST_PROCESS_LOG (default: the launch's own filter).
        let (filter, logs) = match std::env::var_os("KEYGATE_TEST_LOG_DIR") {
            Some(dir) => {
                let name = format!("{}-{port}.log", launch.instance_id.unwrap_or("keygate"));
                let file = std::fs::File::create(std::path::Path::new(&dir).join(name)).expect("a log file");
                let filter = std::env::var("KEYGATE_TEST_PROCESS_LOG").unwrap_or_else(|_| launch.log_filter.to_owned());
                (filter, Stdio::from(file))
            }
            None => (launch.log_filter.to_owned(), launch.logs),
        };
        let child = command
            .args(launch.extra)
            .env("KEYGATE_LOG", filter)
            .envs(launch.env.iter().copied())
            .stdout(logs)
            .stderr(Stdio::null())
            .spawn()
            .expect("starting keygate");
        Self { child, base: format!("http://127.0.0.1:{port}") }
    }

    pub async fn wait_ready(&self, http: &reqwest::Client) {
        let url = format!("{}/readyz", self.base);
        eventually(Duration::from_secs(20), || async {
            let r = http.get(&url).send().await.ok()?;
            (r.status() == 200).then_some(())
        })
        .await;
    }

    /// PUTs `body` at `path` until it is stored (200 or 201), retrying 503s
    /// for up to 30 s: a cluster that has just formed may refuse the first
    /// placements, and keygate's buckets may still be electing leaders. Any
    /// other answer fails the test, with the problem it came with.
    pub async fn put_until_stored(&self, http: &reqwest::Client, path: &str, body: &serde_json::Value) -> u16 {
        let url = format!("{}{path}", self.base);
        eventually(Duration::from_secs(30), || async {
            let answer = http.put(&url).json(body).send().await.ok()?;
            let status = answer.status().as_u16();
            let problem = answer.text().await.unwrap_or_default();
            assert!(matches!(status, 200 | 201 | 503), "PUT {path} answered {status}: {problem}");
            (status != 503).then_some(status)
        })
        .await
    }

    /// A metric's value in this keygate's `/metrics` (summed over labels).
    pub async fn metric(&self, http: &reqwest::Client, name: &str) -> f64 {
        metric_at(http, &self.base, name).await
    }

    /// Messages this keygate acked or terminated without a verdict: must be 0.
    pub async fn acks_without_verdict(&self, http: &reqwest::Client) -> f64 {
        self.metric(http, ACKS_WITHOUT_VERDICT).await
    }

    /// The WebSocket URL of a group member.
    pub fn ws(&self, stream: &str, group: &str, member: &str) -> String {
        format!("{}/v1/streams/{stream}/groups/{group}/members/{member}/ws", self.base.replacen("http", "ws", 1))
    }

    /// Resident memory of the keygate process, in MiB.
    pub fn rss_mib(&self) -> f64 {
        self.status_field("VmRSS:") / 1024.0
    }

    /// OS threads of the keygate process.
    pub fn threads(&self) -> u64 {
        self.status_field("Threads:") as u64
    }

    /// CPU time the keygate process has used (user and system), in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // Fields after the command name (which may hold spaces, in parentheses).
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        let per_second = Command::new("getconf").arg("CLK_TCK").output().ok();
        let per_second =
            per_second.and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok()).unwrap_or(100.0);
        ticks / per_second
    }

    /// Open file descriptors of the keygate process.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id())).map(|d| d.count()).unwrap_or(0)
    }

    fn status_field(&self, field: &str) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    /// SIGTERM, then waits for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        let mut child = std::mem::replace(&mut self.child, Command::new("true").spawn().unwrap());
        tokio::task::spawn_blocking(move || child.wait()).await.unwrap().unwrap()
    }

    /// Takes the process's standard output (when started with a pipe).
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.stdout.take()
    }

    /// SIGKILL: no shutdown, no acks, no unpin.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for KeygateProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
