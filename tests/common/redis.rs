//! A real `redis-server` for the tests of the fleet across processes: started on a Unix
//! socket in a directory of its own, without persistence, killed when dropped.
//!
//! The tests that need it are `#[ignore]`d, so that where it is not installed they show as
//! ignored in the default output, counted at the end, rather than passing without running.
//! They run with `--include-ignored` (see the README's Tests), and fail when it is missing
//! then. Under CI (the `CI` variable set) a test that is not ignored,
//! `redis_server_is_installed_under_ci`, fails when it is not installed.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Whether `redis-server` can be run.
pub fn installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Under CI (the `CI` variable set) `redis-server` must be installed: the tests that need it
/// are ignored by default, and CI runs them.
pub fn assert_installed_under_ci() {
    if std::env::var_os("CI").is_some() {
        assert!(
            installed(),
            "redis-server is not installed, and CI is set: the fleet-redis tests must run"
        );
    }
}

pub struct RedisServer {
    child: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
    /// A cluster node listens on this TCP port of 127.0.0.1 (a cluster needs one, for its
    /// bus) besides the socket.
    cluster_port: Option<u16>,
}

impl RedisServer {
    /// A fresh server.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed: a test that needs it fails rather than passing
    /// without running.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// A fresh single-node Redis Cluster: one node, owning every hash slot, its state ok.
    /// Panics as [`start`](Self::start).
    pub fn start_cluster() -> Self {
        // A free port whose bus port (+10000) is a port too.
        let port = (0..50)
            .filter_map(|_| std::net::TcpListener::bind("127.0.0.1:0").ok())
            .filter_map(|l| l.local_addr().ok())
            .map(|a| a.port())
            .find(|p| *p <= 55_535)
            .expect("a free port");
        let server = Self::start_with(Some(port));
        server.command(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
        for _ in 0..400 {
            let info = match server.command(&["CLUSTER", "INFO"]) {
                redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                redis::Value::VerbatimString { text, .. } => text,
                _ => String::new(),
            };
            if info.contains("cluster_state:ok") {
                return server;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the cluster node did not reach cluster_state:ok within 2 s");
    }

    fn start_with(cluster_port: Option<u16>) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        assert!(
            installed(),
            "redis-server is not installed: this test needs it (see the README's Tests)"
        );
        let dir = std::env::temp_dir().join(format!(
            "tower-llm-retry-redis-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("redis.sock");
        let mut server = RedisServer {
            child: None,
            dir,
            socket,
            cluster_port,
        };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let mut cmd = Command::new("redis-server");
        match self.cluster_port {
            Some(port) => {
                cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--cluster-enabled", "yes", "--cluster-config-file"])
                    .arg(self.dir.join("nodes.conf"));
            }
            None => {
                cmd.args(["--port", "0"]);
            }
        }
        let child = cmd
            .arg("--unixsocket")
            .arg(&self.socket)
            .args([
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        // Ready once it answers a PING.
        for _ in 0..400 {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("redis-server did not come up within 2 s");
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(100)) else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut conn).is_ok()
    }

    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket.display())
    }

    /// The URL of a cluster node's TCP port (the one clients of a cluster use).
    pub fn tcp_url(&self) -> Option<String> {
        Some(format!("redis://127.0.0.1:{}/", self.cluster_port?))
    }

    /// The errors Redis has answered so far, by kind (`INFO errorstats`): `("NOSCRIPT", 1)`.
    pub fn errors(&self) -> Vec<(String, u64)> {
        let text = match self.command(&["INFO", "errorstats"]) {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            _ => String::new(),
        };
        text.lines()
            .filter_map(|l| {
                let (kind, rest) = l.strip_prefix("errorstat_")?.split_once(':')?;
                let count = rest.strip_prefix("count=")?.trim().parse().ok()?;
                Some((kind.to_owned(), count))
            })
            .collect()
    }

    /// Kills it (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same socket, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// The round trips Redis has answered so far: the scripts run (a command a script calls
    /// is not one), the scripts loaded, the subscriptions.
    pub fn round_trips(&self) -> u64 {
        let text = match self.command(&["INFO", "commandstats"]) {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            // Never 0 for an answer not understood: a bound on round trips would then pass
            // without counting anything.
            other => panic!("INFO commandstats answered {other:?}"),
        };
        text.lines()
            .filter(|l| {
                [
                    "cmdstat_evalsha:",
                    "cmdstat_eval:",
                    "cmdstat_script|load:",
                    "cmdstat_subscribe:",
                ]
                .iter()
                .any(|p| l.starts_with(p))
            })
            .filter_map(|l| {
                l.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    }

    /// Runs one command on a connection of its own.
    pub fn command(&self, args: &[&str]) -> redis::Value {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(1))
            .unwrap();
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn).unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
