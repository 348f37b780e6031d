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
    /// Settings of its own, on the command line.
    extra: Vec<String>,
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
        let server = Self::start_with(Some(free_cluster_port()));
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
        Self::start_with_settings(cluster_port, &[])
    }

    fn start_with_settings(cluster_port: Option<u16>, extra: &[&str]) -> Self {
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
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
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
            .args(&self.extra)
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

    /// Whether it runs.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts it again on the same socket, empty (a cluster node keeps its identity and its
    /// slots, from its `nodes.conf`).
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

    /// Whether it answers `args` without an error (a cluster node rejoining its cluster
    /// answers `CLUSTERDOWN` for a while).
    pub fn answers(&self, args: &[&str]) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(100)) else {
            return false;
        };
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query::<redis::Value>(&mut conn).is_ok()
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

/// A free port of 127.0.0.1 whose cluster bus port (+10000) is a port too.
fn free_cluster_port() -> u16 {
    (0..50)
        .filter_map(|_| std::net::TcpListener::bind("127.0.0.1:0").ok())
        .filter_map(|l| l.local_addr().ok())
        .map(|a| a.port())
        .find(|p| *p <= 55_535)
        .expect("a free port")
}

fn text(v: redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        redis::Value::VerbatimString { text, .. } => text,
        redis::Value::SimpleString(s) => s,
        other => panic!("not text: {other:?}"),
    }
}

/// A real Redis Cluster of primaries on 127.0.0.1, without replicas, each node owning an
/// equal range of the hash slots; torn down when dropped.
///
/// Its nodes serve their slots while another is down (`cluster-require-full-coverage no`,
/// as a cluster without replicas must be set for one lost node to cost only its own slots),
/// and a node restarted keeps its identity and slots (from its `nodes.conf`), empty.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// A fresh cluster of `n` primaries, its state ok on every node.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed, or the cluster does not form within 10 s.
    pub fn start(n: usize) -> Self {
        let settings = [
            "--cluster-require-full-coverage",
            "no",
            "--cluster-node-timeout",
            "1000",
        ];
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| RedisServer::start_with_settings(Some(free_cluster_port()), &settings))
            .collect();
        let cluster = RedisCluster { nodes };
        let per = 16_384 / n;
        for (i, node) in cluster.nodes.iter().enumerate() {
            let last = if i + 1 == n {
                16_383
            } else {
                (i + 1) * per - 1
            };
            node.command(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &(i * per).to_string(),
                &last.to_string(),
            ]);
        }
        for node in &cluster.nodes[1..] {
            let port = cluster.nodes[0].cluster_port.unwrap().to_string();
            node.command(&["CLUSTER", "MEET", "127.0.0.1", &port]);
        }
        cluster.wait_ok(Duration::from_secs(10));
        cluster
    }

    /// Waits until every running node says the cluster is ok and knows every node.
    ///
    /// # Panics
    ///
    /// When that takes longer than `limit`.
    pub fn wait_ok(&self, limit: Duration) {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            let ok = self.nodes.iter().filter(|n| n.is_running()).all(|node| {
                let info = text(node.command(&["CLUSTER", "INFO"]));
                let known = text(node.command(&["CLUSTER", "NODES"]))
                    .lines()
                    .filter(|l| {
                        let f: Vec<&str> = l.split(' ').collect();
                        f.get(7) == Some(&"connected") && !f[2].contains("fail")
                    })
                    .count();
                info.contains("cluster_state:ok") && known == self.nodes.len()
            });
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the cluster was not ok on every node within {limit:?}");
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…`: every node a seed.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.cluster_port.unwrap()))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The TCP port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].cluster_port.unwrap()
    }

    /// The hash slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        let node = self.nodes.iter().find(|n| n.is_running()).unwrap();
        match node.command(&["CLUSTER", "KEYSLOT", key]) {
            redis::Value::Int(s) => s as u16,
            other => panic!("{other:?}"),
        }
    }

    /// The node that owns the slot of `key`, as the running nodes agree.
    pub fn owner(&self, key: &str) -> usize {
        let slot = self.slot(key);
        let node = self.nodes.iter().find(|n| n.is_running()).unwrap();
        let port = text(node.command(&["CLUSTER", "NODES"]))
            .lines()
            .find_map(|l| {
                let fields: Vec<&str> = l.split(' ').collect();
                let owns = fields[8..].iter().any(|r| match r.split_once('-') {
                    Some((a, b)) => {
                        a.parse::<u16>().is_ok_and(|a| a <= slot)
                            && b.parse::<u16>().is_ok_and(|b| slot <= b)
                    }
                    None => r.parse::<u16>() == Ok(slot),
                });
                let port = fields[1].split(['@', ':']).nth(1)?.parse::<u16>().ok()?;
                owns.then_some(port)
            })
            .expect("an owner");
        self.nodes
            .iter()
            .position(|n| n.cluster_port == Some(port))
            .unwrap()
    }

    /// The id of node `i`.
    pub fn id(&self, i: usize) -> String {
        text(self.nodes[i].command(&["CLUSTER", "MYID"]))
    }

    /// Moves `slot` from node `from` to node `to` as `redis-cli --cluster reshard` does:
    /// importing and migrating marks, its keys moved a few at a time (`MIGRATE`; between
    /// batches the slot is half moved, and clients are sent `ASK`), then the slot given to
    /// `to` on every node. `between` runs after each batch.
    pub fn migrate_slot(&self, slot: u16, from: usize, to: usize, mut between: impl FnMut()) {
        let (s, from_id, to_id) = (slot.to_string(), self.id(from), self.id(to));
        self.nodes[to].command(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &from_id]);
        self.nodes[from].command(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &to_id]);
        between();
        loop {
            let keys: Vec<String> =
                match self.nodes[from].command(&["CLUSTER", "GETKEYSINSLOT", &s, "1"]) {
                    redis::Value::Array(keys) => keys.into_iter().map(text).collect(),
                    other => panic!("{other:?}"),
                };
            if keys.is_empty() {
                break;
            }
            let port = self.port(to).to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "1000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            self.nodes[from].command(&args);
            between();
        }
        for node in [to, from].into_iter().chain(0..self.nodes.len()) {
            if self.nodes[node].is_running() {
                self.nodes[node].command(&["CLUSTER", "SETSLOT", &s, "NODE", &to_id]);
            }
        }
    }
}
