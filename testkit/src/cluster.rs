//! A 3-node nats-server cluster with JetStream on loopback (routes between
//! the nodes, a temporary store each), whose nodes can be killed and
//! restarted one at a time. The cluster benchmark includes this file too
//! (with `process.rs` beside it).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::nats::{free_port, nats_server_binary};

pub struct ClusterNode {
    pub name: String,
    pub port: u16,
    cluster_port: u16,
    /// HTTP monitoring (`/connz`): which clients a node serves.
    monitor_port: u16,
    store: tempfile::TempDir,
    child: Option<Child>,
}

pub struct NatsCluster {
    pub nodes: Vec<ClusterNode>,
}

impl NatsCluster {
    /// Starts three nodes and waits until JetStream has a meta leader.
    pub async fn start() -> Self {
        let nodes: Vec<ClusterNode> = (1..=3)
            .map(|i| ClusterNode {
                name: format!("node-{i}"),
                port: free_port(),
                cluster_port: free_port(),
                monitor_port: free_port(),
                store: tempfile::tempdir().unwrap(),
                child: None,
            })
            .collect();
        let mut cluster = Self { nodes };
        for i in 0..cluster.nodes.len() {
            cluster.spawn(i);
        }
        for i in 0..cluster.nodes.len() {
            // A port taken between choosing it and binding it stops the node
            // at once; at start (nobody knows its ports yet) it gets new ones.
            for _ in 0..5 {
                if cluster.wait_accepting(i) {
                    break;
                }
                cluster.kill(i);
                cluster.nodes[i].port = free_port();
                cluster.nodes[i].cluster_port = free_port();
                cluster.nodes[i].monitor_port = free_port();
                cluster.spawn(i);
            }
            cluster.assert_accepting(i);
        }
        cluster.wait_jetstream().await;
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| format!("nats://127.0.0.1:{}", n.cluster_port))
            .collect();
        let node = &mut self.nodes[i];
        let child = Command::new(nats_server_binary())
            .args(["-js", "-a", "127.0.0.1", "-p", &node.port.to_string(), "-n", &node.name])
            .args(["-m", &node.monitor_port.to_string()])
            .args(["--cluster_name", "keygate-test"])
            .args(["--cluster", &format!("nats://127.0.0.1:{}", node.cluster_port)])
            .args(["--routes", &routes.join(",")])
            .arg("-sd")
            .arg(node.store.path())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(node.log_path()).expect("creating the node's log"))
            .spawn()
            .expect("starting nats-server");
        node.child = Some(child);
    }

    /// Whether node `i` accepts connections within 30 s; false as soon as its
    /// process has exited.
    fn wait_accepting(&mut self, i: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.nodes[i].port)).is_ok() {
                return true;
            }
            let exited = self.nodes[i].child.as_mut().is_none_or(|c| c.try_wait().ok().flatten().is_some());
            if exited {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn assert_accepting(&self, i: usize) {
        if std::net::TcpStream::connect(("127.0.0.1", self.nodes[i].port)).is_err() {
            let node = &self.nodes[i];
            let log = std::fs::read_to_string(node.log_path()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!("{} did not start on port {}; its log ends:\n{}", node.name, node.port, tail.join("\n"));
        }
    }

    /// Waits until a JetStream account request answers through every running node.
    pub async fn wait_jetstream(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in self.nodes.iter().filter(|n| n.child.is_some()) {
            loop {
                let ready = async {
                    let client = async_nats::connect(format!("nats://127.0.0.1:{}", node.port)).await.ok()?;
                    async_nats::jetstream::new(client).query_account().await.ok()
                };
                if tokio::time::timeout(Duration::from_secs(2), ready).await.ok().flatten().is_some() {
                    break;
                }
                assert!(Instant::now() < deadline, "JetStream did not become ready on {}", node.name);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// Every node's URL, comma-separated (keygate's `--nats-url`).
    pub fn urls(&self) -> String {
        self.nodes.iter().map(|n| format!("nats://127.0.0.1:{}", n.port)).collect::<Vec<_>>().join(",")
    }

    /// Every node's address, for a client that fails over between them.
    pub fn addrs(&self) -> Vec<async_nats::ServerAddr> {
        self.nodes.iter().map(|n| format!("nats://127.0.0.1:{}", n.port).parse().unwrap()).collect()
    }

    /// The URL of one node.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// The name of the node leading `stream`, as the server says.
    pub async fn leader_of(&self, stream: &str) -> String {
        let client = async_nats::connect(self.addrs()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let leader = async {
                let mut s = js.get_stream(stream).await.ok()?;
                s.info().await.ok()?.cluster.as_ref()?.leader.clone()
            };
            if let Some(leader) = leader.await {
                return leader;
            }
            assert!(Instant::now() < deadline, "{stream} has no leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every replica of each stream is current with its leader:
    /// a node just restarted catches up first, and killing another node
    /// before it has would leave the stream without a quorum to write (an
    /// outage of two nodes, not one).
    pub async fn wait_current(&self, streams: &[&str]) {
        let client = async_nats::connect(self.addrs()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let deadline = Instant::now() + Duration::from_secs(60);
        for stream in streams {
            loop {
                let replicas = async {
                    let mut s = js.get_stream(*stream).await.ok()?;
                    Some(s.info().await.ok()?.cluster.as_ref()?.replicas.clone())
                };
                let replicas = replicas.await.unwrap_or_default();
                if !replicas.is_empty() && replicas.iter().all(|r| r.current && !r.offline) {
                    break;
                }
                assert!(Instant::now() < deadline, "{stream}'s replicas did not catch up: {replicas:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    /// The running node a client connected under `name` is on, if any.
    pub async fn node_serving(&self, name: &str) -> Option<usize> {
        for (i, node) in self.nodes.iter().enumerate().filter(|(_, n)| n.child.is_some()) {
            let url = format!("http://127.0.0.1:{}/connz?limit=1024", node.monitor_port);
            let Ok(answer) = reqwest::get(&url).await else { continue };
            let Ok(connz) = answer.json::<serde_json::Value>().await else { continue };
            let connections = connz["connections"].as_array().cloned().unwrap_or_default();
            if connections.iter().any(|c| c["name"] == name) {
                return Some(i);
            }
        }
        None
    }

    pub fn index_of(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n.name == name).unwrap_or_else(|| panic!("no node {name}"))
    }

    /// SIGKILL one node.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed node again on its port and store.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        self.wait_accepting(i);
        self.assert_accepting(i);
    }
}

impl ClusterNode {
    /// The server's own log, in its store directory (removed with it);
    /// a restart starts it afresh.
    fn log_path(&self) -> std::path::PathBuf {
        self.store.path().join("server.log")
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}
