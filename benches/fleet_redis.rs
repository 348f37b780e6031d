//! The fleet across processes, in real time, shortened: a storm against a rate-limited
//! server, met by one fleet, by 4 separate fleets in one process (as 4 processes without
//! coordination would be), and by the same 4 sharing a real Redis, side by side in one run;
//! then what Redis on loopback adds to each request.
//!
//! Needs `redis-server` on the PATH (it starts its own on a Unix socket):
//! `cargo bench --bench fleet_redis --features fleet-redis`. About 4 minutes.
//!
//! 200 clients send back to back for `RUN` (20 s a row) against a server that admits
//! `C` = 50 requests a second. Successes take 20 ms, refusals 2 ms. Two servers:
//!
//! - **token bucket**: a bucket holding one second's worth, as in the storm bench's S1; above
//!   it, `429` with `Retry-After` the whole seconds to the next token, at least 1 (so 1). No
//!   rate-limit headers: the rate is learnt from the refusals.
//! - **window**: 500 requests per 10 s window (C on average), counted from the server's
//!   start; above it, `429` with `Retry-After` the whole seconds to the reset. Every answer
//!   states the limit per minute, what is left of the window and the time to its reset
//!   (`x-ratelimit-limit-requests: 3000`, `x-ratelimit-remaining-requests`,
//!   `x-ratelimit-reset-requests: 3.2s`), as OpenAI does.
//!
//! Rows: goodput (successes a second against `C`), attempts per success, the peak of attempts
//! the server saw in one second (against `C`), all counted by the server over the row;
//! request latency p50 / p99 of the successes (a request still under way at the row's end is
//! dropped),
//! Redis round trips per first attempt (scripts run, counted by Redis).
//! With `--features fleet-redis-cluster`, the same storm through 8 fleets on a Redis Cluster
//! of three primaries the bench starts on 127.0.0.1, against one key (so on one node): with
//! the nodes all up, and with the key's node killed from 5 s to 12 s (goodput during the
//! outage, and the time from its return until every fleet is in touch again); and the added
//! latency on the cluster; the same storm and latency on the one node beside them
//! (`FLEET_REDIS_ROWS=cluster` runs this section alone, about 2 minutes).
//! `FLEET_REDIS_ROWS=<text>` runs only the rows whose name holds `<text>`;
//! `FLEET_REDIS_TRACE=1` prints each second of a storm row (attempts, successes, paces).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{Layer, Service, ServiceExt};
use tower_llm_retry::fleet::{Fleet, GateConfig, PacingConfig, RedisFleet, RedisState};
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy};

#[path = "../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis_server;

const CAPACITY: f64 = 50.0;
const CLIENTS: usize = 200;
const RUN: Duration = Duration::from_secs(20);
/// The bucket holds one second's worth, as in the storm bench's S1.
const BURST: f64 = CAPACITY;
const WINDOW: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// No limit at all: the added-latency rows.
    Open,
    Bucket,
    Window,
}

/// The limited server, and the attempts it saw in each second.
struct Server {
    kind: Kind,
    /// Bucket: tokens and when they were counted. Window: requests used and the window's start.
    state: Mutex<(f64, Instant)>,
    started: Instant,
    /// Attempts and successes seen in each second.
    per_second: Vec<AtomicU64>,
    ok_per_second: Vec<AtomicU64>,
}

/// What the server says of one attempt.
struct Verdict {
    ok: bool,
    retry_after: Option<u64>,
    /// Window: remaining, and the time to the reset.
    window: Option<(u64, Duration)>,
}

impl Server {
    fn new(kind: Kind) -> Arc<Self> {
        let now = Instant::now();
        let tokens = if kind == Kind::Bucket { BURST } else { 0.0 };
        Arc::new(Server {
            kind,
            state: Mutex::new((tokens, now)),
            started: now,
            per_second: (0..RUN.as_secs() + 30).map(|_| AtomicU64::new(0)).collect(),
            ok_per_second: (0..RUN.as_secs() + 30).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    fn admit(&self) -> Verdict {
        let now = Instant::now();
        let second = (now - self.started).as_secs() as usize;
        if let Some(c) = self.per_second.get(second) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        let mut b = self.state.lock().unwrap();
        let v = match self.kind {
            Kind::Open => Verdict {
                ok: true,
                retry_after: None,
                window: None,
            },
            Kind::Bucket => {
                let tokens = (b.0 + (now - b.1).as_secs_f64() * CAPACITY).min(BURST);
                *b = (tokens, now);
                let ok = tokens >= 1.0;
                if ok {
                    b.0 -= 1.0;
                }
                Verdict {
                    ok,
                    retry_after: (!ok).then_some(1),
                    window: None,
                }
            }
            Kind::Window => {
                let quota = CAPACITY * WINDOW.as_secs_f64();
                while now - b.1 >= WINDOW {
                    *b = (0.0, b.1 + WINDOW);
                }
                let ok = b.0 < quota;
                if ok {
                    b.0 += 1.0;
                }
                let reset = WINDOW - (now - b.1);
                Verdict {
                    ok,
                    retry_after: (!ok).then(|| (reset.as_secs_f64().ceil() as u64).max(1)),
                    window: Some(((quota - b.0).max(0.0) as u64, reset)),
                }
            }
        };
        if let (true, Some(c)) = (v.ok, self.ok_per_second.get(second)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        v
    }

    /// Attempts and successes in the first `run`.
    fn totals(&self, run: Duration) -> (u64, u64) {
        let n = run.as_secs() as usize;
        let sum = |v: &[AtomicU64]| v[..n].iter().map(|c| c.load(Ordering::Relaxed)).sum();
        (sum(&self.per_second), sum(&self.ok_per_second))
    }

    /// The most attempts seen in one second of the first `run`.
    fn peak(&self, run: Duration) -> u64 {
        self.per_second[..run.as_secs() as usize]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    }
}

#[derive(Clone)]
struct Sim(Arc<Server>);

impl Service<Request<ReplayBody>> for Sim {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<ReplayBody>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move {
            let v = server.admit();
            if server.kind != Kind::Open {
                let latency = if v.ok { 20 } else { 2 };
                tokio::time::sleep(Duration::from_millis(latency)).await;
            }
            let mut res = Response::builder().status(if v.ok {
                StatusCode::OK
            } else {
                StatusCode::TOO_MANY_REQUESTS
            });
            if let Some(after) = v.retry_after {
                res = res.header("retry-after", after.to_string());
            }
            if let Some((remaining, reset)) = v.window {
                res = res
                    .header(
                        "x-ratelimit-limit-requests",
                        format!("{}", (CAPACITY * 60.0) as u64),
                    )
                    .header("x-ratelimit-remaining-requests", remaining.to_string())
                    .header(
                        "x-ratelimit-reset-requests",
                        format!("{:.3}s", reset.as_secs_f64()),
                    );
            }
            Ok(res.body(Full::new(Bytes::new())).unwrap())
        })
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    GateBudget,
    Pacing,
}

/// A fleet with the gate and the default budget (and the pacing in `Mode::Pacing`), sharing
/// `(url, prefix)`'s Redis scope when given.
fn fleet(mode: Mode, pacing: PacingConfig, redis: Option<(&str, &str)>) -> Fleet {
    // The modes name what is on: "gate + budget" has no pacing at all (not even the
    // fleet's default, dormant one), "pacing" the eager pacing of `PacingConfig::new`.
    let mut b = Fleet::builder()
        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
        .pacing(None);
    if mode == Mode::Pacing {
        b = b.pacing(Some(pacing));
    }
    if let Some((url, prefix)) = redis {
        b = b.redis(
            RedisFleet::from_url(url)
                .unwrap()
                .scope("bench", b"key")
                .prefix(prefix),
        );
    }
    b.build()
}

fn rand_suffix() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

struct Outcome {
    successes: u64,
    first_attempts: u64,
    latencies: Vec<Duration>,
}

async fn wait_connected(fleets: &[Fleet]) {
    let start = Instant::now();
    while !fleets
        .iter()
        .all(|f| matches!(f.redis_state(), None | Some(RedisState::Connected { .. })))
    {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "Redis not reached"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `clients` clients, spread evenly over `fleets`, sending back to back for `run`.
async fn storm(server: Arc<Server>, fleets: &[Fleet], clients: usize, run: Duration) -> Outcome {
    wait_connected(fleets).await;
    let policy = RetryPolicy::default().max_retries(4);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let svc = RetryLayer::new()
            .policy(policy.clone())
            .fleet(fleets[c % fleets.len()].clone())
            .layer(Sim(server.clone()));
        tasks.spawn(async move {
            let mut out = Outcome {
                successes: 0,
                first_attempts: 0,
                latencies: Vec::new(),
            };
            let end = tokio::time::Instant::from_std(start + run);
            while start.elapsed() < run {
                let t = Instant::now();
                let req = Request::post("http://bench/v1/messages")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .unwrap();
                out.first_attempts += 1;
                // The row ends at `run`: a request still under way then is dropped.
                let Ok(res) = tokio::time::timeout_at(end, svc.clone().oneshot(req)).await else {
                    break;
                };
                if let Ok(res) = res {
                    if res.status() == StatusCode::OK {
                        out.successes += 1;
                        out.latencies.push(t.elapsed());
                    }
                }
            }
            out
        });
    }
    let mut all = Outcome {
        successes: 0,
        first_attempts: 0,
        latencies: Vec::new(),
    };
    while let Some(o) = tasks.join_next().await {
        let o = o.unwrap();
        all.successes += o.successes;
        all.first_attempts += o.first_attempts;
        all.latencies.extend(o.latencies);
    }
    all.latencies.sort();
    all
}

fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Clients of the added-latency rows.
const LATENCY_CLIENTS: usize = 64;

#[tokio::main]
async fn main() {
    if !redis_server::installed() {
        eprintln!("redis-server is not installed: nothing to measure");
        return;
    }
    let redis = redis_server::RedisServer::start();
    let url = redis.url();
    // `FLEET_REDIS_ROWS=window` runs only the rows whose name holds it.
    let only = std::env::var("FLEET_REDIS_ROWS").ok();
    // `FLEET_REDIS_TRACE=1` prints each second of each storm row to stderr.
    let trace = std::env::var_os("FLEET_REDIS_TRACE").is_some();
    println!("storm: {CLIENTS} clients for {RUN:?} a row against C = {CAPACITY} requests/s");
    println!(
        "| server | mode | fleets | goodput | attempts/success | peak/s | p50 | p99 | Redis round trips/first attempt |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for kind in [Kind::Bucket, Kind::Window] {
        for mode in [Mode::Pacing, Mode::GateBudget] {
            let server_name = match kind {
                Kind::Bucket => "token bucket, Retry-After",
                _ => "window, limit headers",
            };
            let name = match mode {
                Mode::GateBudget => "gate + budget",
                Mode::Pacing => "gate + budget + pacing",
            };
            for (label, n, shared) in [
                ("1 fleet", 1, false),
                ("4 separate fleets", 4, false),
                ("4 fleets, one Redis", 4, true),
            ] {
                let row = format!("{server_name} | {name} | {label}");
                if !only.as_ref().is_none_or(|o| row.contains(o.as_str())) {
                    continue;
                }
                let prefix = format!("bench-storm-{}", rand_suffix());
                let fleets: Vec<Fleet> = (0..n)
                    .map(|_| {
                        let redis = shared.then_some((url.as_str(), prefix.as_str()));
                        fleet(
                            mode,
                            PacingConfig::new()
                                .dormant(false)
                                .burst(Duration::ZERO)
                                .unwrap(),
                            redis,
                        )
                    })
                    .collect();
                wait_connected(&fleets).await;
                let before = redis.round_trips();
                let server = Server::new(kind);
                let timeline = trace.then(|| {
                    let (server, fleets) = (server.clone(), fleets.clone());
                    tokio::spawn(async move {
                        let start = Instant::now();
                        for second in 0..RUN.as_secs() as usize {
                            tokio::time::sleep_until((start + Duration::from_secs(second as u64 + 1)).into()).await;
                            let paces: Vec<String> = fleets.iter().map(|f| format!("{:.1}", f.pace().unwrap_or(0.0))).collect();
                            let gates = fleets.iter().filter(|f| f.gate_closed_until().is_some()).count();
                            eprintln!(
                                "  {second:>2}s attempts {:>4} ok {:>4} pace [{}] gates closed {gates} closings {:?} refused {:?}",
                                server.per_second[second].load(Ordering::Relaxed),
                                server.ok_per_second[second].load(Ordering::Relaxed),
                                paces.join(" "),
                                fleets.iter().map(|f| f.gate_closings().unwrap_or(0)).sum::<u64>(),
                                fleets.iter().map(|f| f.pacing_refused().unwrap_or(0)).sum::<u64>(),
                            );
                        }
                    })
                });
                let o = storm(server.clone(), &fleets, CLIENTS, RUN).await;
                if let Some(t) = timeline {
                    let _ = t.await;
                }
                let cmds = redis.round_trips().saturating_sub(before);
                let (attempts, successes) = server.totals(RUN);
                println!(
                    "| {row} | {:.2} C | {:.2} | {:.2} C | {:.0} ms | {:.0} ms | {} |",
                    successes as f64 / RUN.as_secs_f64() / CAPACITY,
                    attempts as f64 / successes.max(1) as f64,
                    server.peak(RUN) as f64 / CAPACITY,
                    pct(&o.latencies, 0.5).as_secs_f64() * 1e3,
                    pct(&o.latencies, 0.99).as_secs_f64() * 1e3,
                    if shared {
                        format!("{:.2}", cmds as f64 / o.first_attempts.max(1) as f64)
                    } else {
                        "—".to_owned()
                    },
                );
            }
        }
    }

    #[cfg(feature = "fleet-redis-cluster")]
    cluster::rows(only.as_deref(), &redis).await;

    println!();
    println!(
        "added latency: {LATENCY_CLIENTS} clients back to back against an instant server, 2 s each"
    );
    println!("| fleet | requests/s | p50 | p99 | Redis round trips/request |");
    println!("|---|---|---|---|---|");
    for (label, mode, shared) in [
        ("local, gate + budget", Mode::GateBudget, false),
        ("Redis, gate + budget", Mode::GateBudget, true),
        ("local, pacing", Mode::Pacing, false),
        ("Redis, pacing", Mode::Pacing, true),
    ] {
        if !only.as_ref().is_none_or(|o| label.contains(o.as_str())) {
            continue;
        }
        // A rate no client reaches: what is measured is the admission, not the wait.
        let pacing = PacingConfig::new()
            .dormant(false)
            .burst(Duration::ZERO)
            .unwrap()
            .rates(1.0e6, 1.0, 1.0e6)
            .unwrap();
        let prefix = format!("bench-latency-{}", rand_suffix());
        let f = fleet(
            mode,
            pacing,
            shared.then_some((url.as_str(), prefix.as_str())),
        );
        wait_connected(std::slice::from_ref(&f)).await;
        let before = redis.round_trips();
        let o = storm(
            Server::new(Kind::Open),
            std::slice::from_ref(&f),
            LATENCY_CLIENTS,
            Duration::from_secs(2),
        )
        .await;
        let cmds = redis.round_trips().saturating_sub(before);
        println!(
            "| {label} | {:.0} | {:.0} µs | {:.0} µs | {} |",
            o.successes as f64 / 2.0,
            pct(&o.latencies, 0.5).as_secs_f64() * 1e6,
            pct(&o.latencies, 0.99).as_secs_f64() * 1e6,
            if shared {
                format!("{:.3}", cmds as f64 / o.first_attempts.max(1) as f64)
            } else {
                "—".to_owned()
            },
        );
    }
}

/// The rows on a Redis Cluster of three primaries.
#[cfg(feature = "fleet-redis-cluster")]
mod cluster {
    use super::*;

    /// The fleets of the cluster rows.
    const FLEETS: usize = 8;

    /// Scripts run, summed over the running nodes.
    fn round_trips(cluster: &redis_server::RedisCluster) -> u64 {
        cluster
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .map(|n| n.round_trips())
            .sum()
    }

    fn pacing() -> PacingConfig {
        PacingConfig::new()
            .dormant(false)
            .burst(Duration::ZERO)
            .unwrap()
    }

    /// `node`: the one-node Redis, for the same rows on it, side by side.
    pub(super) async fn rows(only: Option<&str>, node: &redis_server::RedisServer) {
        // `cluster` names the whole section.
        let wanted = |row: &str| only.is_none_or(|o| o == "cluster" || row.contains(o));
        // (mode name, mode, the key's node killed, on the cluster)
        let rows = [
            ("gate + budget + pacing", Mode::Pacing, false, false),
            ("gate + budget + pacing", Mode::Pacing, false, true),
            ("gate + budget", Mode::GateBudget, false, true),
            (
                "gate + budget + pacing, key's node killed 5–12 s",
                Mode::Pacing,
                true,
                true,
            ),
        ];
        let latency = [
            ("one Redis, pacing", Mode::Pacing, false),
            ("cluster, gate + budget", Mode::GateBudget, true),
            ("cluster, pacing", Mode::Pacing, true),
        ];
        let names: Vec<String> = rows
            .iter()
            .map(|(name, _, _, on_cluster)| {
                let store = if *on_cluster {
                    "3-node cluster"
                } else {
                    "one Redis"
                };
                format!("token bucket | {name} | {FLEETS} fleets, {store}")
            })
            .collect();
        if !names.iter().any(|r| wanted(r)) && !latency.iter().any(|(l, _, _)| wanted(l)) {
            return;
        }
        let mut cluster = redis_server::RedisCluster::start(3);
        let url = cluster.url();
        println!();
        println!(
            "storm on a Redis Cluster of 3 primaries: {CLIENTS} clients, {FLEETS} fleets, one key, {RUN:?} a row, C = {CAPACITY}"
        );
        println!(
            "| server | mode | fleets | goodput | attempts/success | peak/s | p50 | p99 | Redis round trips/first attempt |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        let mut outages = Vec::new();
        for ((_, mode, kill, on_cluster), row) in rows.iter().zip(&names) {
            if !wanted(row) {
                continue;
            }
            let prefix = format!("bench-cluster-{}", rand_suffix());
            let at = if *on_cluster { url.clone() } else { node.url() };
            let fleets: Vec<Fleet> = (0..FLEETS)
                .map(|_| fleet(*mode, pacing(), Some((at.as_str(), prefix.as_str()))))
                .collect();
            wait_connected(&fleets).await;
            let key = RedisFleet::from_url(&url)
                .unwrap()
                .scope("bench", b"key")
                .prefix(prefix.as_str())
                .key_names()[0]
                .clone();
            let owner = cluster.owner(&key);
            let server = Server::new(Kind::Bucket);
            let trips = |cluster: &redis_server::RedisCluster| match on_cluster {
                true => round_trips(cluster),
                false => node.round_trips(),
            };
            let before = trips(&cluster);
            let (o, cmds, recovery) = if *kill {
                // The key's node killed at 5 s and started again (empty) at 12 s, on a thread
                // that holds the cluster meanwhile; a sampler notes when every fleet is in
                // touch again. (The killed node's count of scripts dies with it: no round
                // trips for this row.)
                let restarted: Arc<Mutex<Option<Instant>>> = Arc::default();
                let killer = {
                    let restarted = restarted.clone();
                    let key = key.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(5));
                        cluster.nodes[owner].kill();
                        std::thread::sleep(Duration::from_secs(7));
                        cluster.nodes[owner].restart();
                        let at = Instant::now();
                        *restarted.lock().unwrap() = Some(at);
                        // When the node serves its slots again (a node back from a failure
                        // waits before it does, as Redis Cluster does).
                        while !cluster.nodes[owner].answers(&["EXISTS", &key]) {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        (cluster, at.elapsed())
                    })
                };
                let sampler = {
                    let fleets = fleets.clone();
                    tokio::spawn(async move {
                        loop {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            let Some(at) = *restarted.lock().unwrap() else {
                                continue;
                            };
                            let back = fleets.iter().all(|f| {
                                matches!(f.redis_state(), Some(RedisState::Connected { .. }))
                            });
                            if back {
                                return at.elapsed();
                            }
                        }
                    })
                };
                let o = storm(server.clone(), &fleets, CLIENTS, RUN).await;
                let (back, serving) = killer.join().unwrap();
                cluster = back;
                let recovery = tokio::time::timeout(Duration::from_secs(10), sampler).await;
                (o, None, Some((recovery, serving)))
            } else {
                let o = storm(server.clone(), &fleets, CLIENTS, RUN).await;
                (o, Some(trips(&cluster).saturating_sub(before)), None)
            };
            let (attempts, successes) = server.totals(RUN);
            println!(
                "| {row} | {:.2} C | {:.2} | {:.2} C | {:.0} ms | {:.0} ms | {} |",
                successes as f64 / RUN.as_secs_f64() / CAPACITY,
                attempts as f64 / successes.max(1) as f64,
                server.peak(RUN) as f64 / CAPACITY,
                pct(&o.latencies, 0.5).as_secs_f64() * 1e3,
                pct(&o.latencies, 0.99).as_secs_f64() * 1e3,
                cmds.map_or("—".to_owned(), |c| format!(
                    "{:.2}",
                    c as f64 / o.first_attempts.max(1) as f64
                )),
            );
            if let Some((recovery, serving)) = recovery {
                let ok = |from: usize, to: usize| -> f64 {
                    server.ok_per_second[from..to]
                        .iter()
                        .map(|c| c.load(Ordering::Relaxed))
                        .sum::<u64>() as f64
                        / (to - from) as f64
                        / CAPACITY
                };
                let per_second: Vec<String> = (0..RUN.as_secs() as usize)
                    .map(|s| {
                        format!(
                            "{}/{}",
                            server.ok_per_second[s].load(Ordering::Relaxed),
                            server.per_second[s].load(Ordering::Relaxed)
                        )
                    })
                    .collect();
                outages.push(format!(
                    "goodput before the kill (0–5 s) {:.2} C, during the outage (5–12 s) {:.2} C, after (12–20 s) {:.2} C; the node serving its slots again {:.0} ms after its restart, every fleet in touch again {} after it; successes/attempts per second: {}",
                    ok(0, 5),
                    ok(5, 12),
                    ok(12, RUN.as_secs() as usize),
                    serving.as_secs_f64() * 1e3,
                    match recovery {
                        Ok(Ok(d)) => format!("{:.0} ms", d.as_secs_f64() * 1e3),
                        _ => "not within 10 s".to_owned(),
                    },
                    per_second.join(" "),
                ));
            }
        }
        for o in outages {
            println!();
            println!("{o}");
        }

        println!();
        println!(
            "added latency on the cluster: {LATENCY_CLIENTS} clients back to back against an instant server, 2 s each"
        );
        println!("| fleet | requests/s | p50 | p99 | Redis round trips/request |");
        println!("|---|---|---|---|---|");
        for (label, mode, on_cluster) in latency {
            if !wanted(label) {
                continue;
            }
            let pacing = pacing().rates(1.0e6, 1.0, 1.0e6).unwrap();
            let prefix = format!("bench-cluster-latency-{}", rand_suffix());
            let at = if on_cluster { url.clone() } else { node.url() };
            let f = fleet(mode, pacing, Some((at.as_str(), prefix.as_str())));
            wait_connected(std::slice::from_ref(&f)).await;
            let trips = |cluster: &redis_server::RedisCluster| match on_cluster {
                true => round_trips(cluster),
                false => node.round_trips(),
            };
            let before = trips(&cluster);
            let o = storm(
                Server::new(Kind::Open),
                std::slice::from_ref(&f),
                LATENCY_CLIENTS,
                Duration::from_secs(2),
            )
            .await;
            let cmds = trips(&cluster).saturating_sub(before);
            println!(
                "| {label} | {:.0} | {:.0} µs | {:.0} µs | {:.3} |",
                o.successes as f64 / 2.0,
                pct(&o.latencies, 0.5).as_secs_f64() * 1e6,
                pct(&o.latencies, 0.99).as_secs_f64() * 1e6,
                cmds as f64 / o.first_attempts.max(1) as f64,
            );
        }
    }
}
