//! A loopback TCP proxy in front of a nats-server that can hold back what
//! the server sends and then cut every connection, so bytes the server
//! already sent (and counted as delivered) never reach the client. That is
//! what a NATS node dying under a client does, on one server and on cue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

struct State {
    /// Server → client bytes are left unread while set.
    held: AtomicBool,
    released: Notify,
    /// Cancelled to cut the connections open now.
    cut: Mutex<CancellationToken>,
}

pub struct CuttableProxy {
    pub port: u16,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl CuttableProxy {
    /// Proxies `127.0.0.1:<port>` to `upstream` (host:port).
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            held: AtomicBool::new(false),
            released: Notify::new(),
            cut: Mutex::new(CancellationToken::new()),
        });
        let accepting = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else { continue };
                let cut = accepting.cut.lock().unwrap().clone();
                tokio::spawn(relay(client, server, accepting.clone(), cut));
            }
        });
        Self { port, state, task }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops passing on what the server sends (held in the proxy).
    pub fn hold_server_bytes(&self) {
        self.state.held.store(true, Ordering::SeqCst);
    }

    /// Closes every open connection, dropping what was held back, and lets
    /// new connections through normally.
    pub fn cut(&self) {
        let old = std::mem::replace(&mut *self.state.cut.lock().unwrap(), CancellationToken::new());
        old.cancel();
        self.state.held.store(false, Ordering::SeqCst);
        self.state.released.notify_waiters();
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.state.cut.lock().unwrap().cancel();
    }
}

async fn relay(client: TcpStream, server: TcpStream, state: Arc<State>, cut: CancellationToken) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    };
    let downstream = async {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let Ok(n) = server_read.read(&mut buffer).await else { return };
            if n == 0 {
                return;
            }
            // Read but held: a cut drops it, as a dying node drops its buffers.
            while state.held.load(Ordering::SeqCst) {
                let released = state.released.notified();
                if !state.held.load(Ordering::SeqCst) {
                    break;
                }
                released.await;
            }
            // A cut releases the hold too; what was held must die with the
            // connection, not slip out before the close is noticed.
            if cut.is_cancelled() {
                return;
            }
            if client_write.write_all(&buffer[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        biased;
        () = cut.cancelled() => {}
        () = upstream => {}
        () = downstream => {}
    }
}
