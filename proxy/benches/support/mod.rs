//! What the proxy's benches share: a load generator's client, the release binary started as
//! a child, and the figures read from `/proc` about it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(512)
        .build(tcp)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// The release binary, killed when dropped.
pub struct ProxyProcess(pub Child);

impl ProxyProcess {
    /// Starts the proxy on the configuration file `config`, logging at `log` and above.
    pub fn start(config: &Path, log: &str) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"))
            .arg("--config")
            .arg(config)
            .env("LLM_RETRY_PROXY_LOG", log)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the proxy");
        ProxyProcess(child)
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CPU time (user + system) a process has used, from `/proc/{pid}/stat`.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on Linux.
    Some(Duration::from_millis(ticks * 10))
}

/// `VmHWM` (peak) or `VmRSS` (now) of a process, in KiB.
pub fn rss_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
