//! Headless Chromium driven over the DevTools protocol (a WebSocket), for
//! end-to-end tests of the pages keygate serves.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    page: WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>,
    next_id: u64,
}

impl Browser {
    /// Starts `chromium` (or `$KEYGATE_CHROMIUM`) headless with a fresh profile.
    pub async fn launch() -> Self {
        let binary = std::env::var("KEYGATE_CHROMIUM").unwrap_or_else(|_| "chromium".into());
        let profile = tempfile::tempdir().unwrap();
        let child = Command::new(&binary)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1280,900",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {binary} ({e}): install Debian's chromium (./scripts/test does)"));
        let port = wait_for_port(&profile.path().join("DevToolsActivePort")).await;
        let http = super::http_client();
        let targets: Value =
            http.get(format!("http://127.0.0.1:{port}/json/list")).send().await.unwrap().json().await.unwrap();
        let url = targets
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .expect("a page target")
            .to_owned();
        let (page, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        Self { child, _profile: profile, page, next_id: 0 }
    }

    /// One DevTools command; its `result`.
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let command = json!({"id": id, "method": method, "params": params});
        self.page.send(Message::Text(command.to_string().into())).await.unwrap();
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(20), self.page.next())
                .await
                .expect("DevTools answered")
                .unwrap()
                .unwrap();
            let Message::Text(text) = frame else { continue };
            let value: Value = serde_json::from_str(text.as_str()).unwrap();
            if value["id"] == id {
                assert!(value["error"].is_null(), "{method}: {value}");
                return value["result"].clone();
            }
        }
    }

    /// Loads `url` and waits until the document is complete.
    pub async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.eval("document.readyState").await != "complete" {
            assert!(Instant::now() < deadline, "{url} did not load");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Evaluates JavaScript in the page; its value.
    pub async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call("Runtime.evaluate", json!({"expression": expression, "returnByValue": true, "awaitPromise": true}))
            .await;
        assert!(result["exceptionDetails"].is_null(), "{expression}: {result}");
        result["result"]["value"].clone()
    }

    /// Saves a PNG of the page.
    pub async fn screenshot(&mut self, path: &Path) {
        let shot = self.call("Page.captureScreenshot", json!({"format": "png"})).await;
        let png = base64::engine::general_purpose::STANDARD.decode(shot["data"].as_str().unwrap()).unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

async fn wait_for_port(file: &Path) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(port) = std::fs::read_to_string(file).ok().and_then(|t| t.lines().next()?.parse().ok()) {
            return port;
        }
        assert!(Instant::now() < deadline, "chromium did not open its DevTools port");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
