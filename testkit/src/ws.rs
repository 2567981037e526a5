//! A WebSocket member client for tests.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub struct WsClient {
    socket: WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>,
    /// Frames read while looking for another type.
    pub seen: Vec<Value>,
}

/// The URL of a member's WebSocket, `http://` base turned into `ws://`.
pub fn member_url(base: &str, stream: &str, group: &str, member: &str, query: &str) -> String {
    let base = base.replacen("http://", "ws://", 1);
    let query = if query.is_empty() { String::new() } else { format!("?{query}") };
    format!("{base}/v1/streams/{stream}/groups/{group}/members/{member}/ws{query}")
}

impl WsClient {
    pub async fn connect(url: &str) -> Self {
        Self::connect_with(url, &[]).await.unwrap_or_else(|status| panic!("WebSocket refused: {status}"))
    }

    /// Connects with extra request headers; the HTTP status when refused.
    pub async fn connect_with(url: &str, headers: &[(&str, &str)]) -> Result<Self, u16> {
        let mut request = url.into_client_request().unwrap();
        for (name, value) in headers {
            request
                .headers_mut()
                .insert(axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
        }
        match tokio_tungstenite::connect_async(request).await {
            Ok((socket, _)) => Ok(Self { socket, seen: Vec::new() }),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => Err(response.status().as_u16()),
            Err(e) => panic!("connecting: {e}"),
        }
    }

    pub fn from_socket(socket: WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>) -> Self {
        Self { socket, seen: Vec::new() }
    }

    /// The next JSON frame, `Some(None)` when none came within `limit`,
    /// `None` once the connection is closed or broken.
    pub async fn next_frame_or_idle(&mut self, limit: Duration) -> Option<Option<Value>> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let Ok(read) = tokio::time::timeout_at(deadline, self.socket.next()).await else { return Some(None) };
            match read?.ok()? {
                Message::Text(text) => return Some(serde_json::from_str(text.as_str()).ok()),
                Message::Close(_) => return None,
                _ => continue,
            }
        }
    }

    /// Acks `id`; false when the connection is gone.
    pub async fn try_ack(&mut self, id: &Value) -> bool {
        let frame = json!({"type": "ack", "id": id});
        self.socket.send(Message::Text(frame.to_string().into())).await.is_ok()
    }

    /// The next JSON frame (pings are answered by the library while reading).
    pub async fn next_frame(&mut self, limit: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let read = tokio::time::timeout_at(deadline, self.socket.next()).await.ok()??;
            match read.ok()? {
                Message::Text(text) => return Some(serde_json::from_str(text.as_str()).unwrap()),
                Message::Close(_) => return None,
                _ => continue,
            }
        }
    }

    /// The next frame of `kind`, keeping the others in `seen`.
    pub async fn next_of(&mut self, kind: &str, limit: Duration) -> Value {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let frame = self
                .next_frame(left)
                .await
                .unwrap_or_else(|| panic!("no {kind} frame within {limit:?}; saw {:?}", self.seen));
            if frame["type"] == kind {
                return frame;
            }
            self.seen.push(frame);
        }
    }

    /// The next message frame, or `None` when none comes within `limit`.
    pub async fn maybe_message(&mut self, limit: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let frame = self.next_frame(left).await?;
            if frame["type"] == "message" {
                return Some(frame);
            }
            self.seen.push(frame);
        }
    }

    pub async fn send(&mut self, frame: Value) {
        self.socket.send(Message::Text(frame.to_string().into())).await.unwrap();
    }

    pub async fn ack(&mut self, id: &Value) {
        self.send(json!({"type":"ack","id":id})).await;
    }

    /// Waits for the server's Close frame; returns its code.
    pub async fn closed(&mut self, limit: Duration) -> Option<u16> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, self.socket.next()).await.ok()? {
                Some(Ok(Message::Close(frame))) => return Some(frame.map_or(1005, |f| u16::from(f.code))),
                Some(Ok(_)) => continue,
                _ => return None,
            }
        }
    }

    pub async fn close(mut self) {
        let _ = self.socket.close(None).await;
    }
}
