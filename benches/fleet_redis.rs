//! The fleet across processes, in real time, shortened: a storm against a server with a
//! request limit, met by one fleet, by 4 separate fleets in one process (as 4 processes
//! without coordination would be), and by the same 4 sharing a real Redis; then what Redis
//! on loopback adds to each request.
//!
//! Needs `redis-server` on the PATH (it starts its own on a Unix socket):
//! `cargo bench --bench fleet_redis --features fleet-redis`.
//!
//! The server admits `CAPACITY` requests a second (a token bucket holding one second's worth)
//! and answers the rest `429` with `Retry-After: 1`; every answer states the limit
//! (`anthropic-ratelimit-requests-limit`, per minute). Successes take 20 ms, refusals 2 ms.
//! Its bucket holds 100 ms worth, so a burst above the rate is refused.
//! 64 clients send back to back for `RUN`. Rows: goodput (successes a second against the
//! capacity), attempts per success, request latency p50 / p99, Redis round trips per first
//! attempt (scripts run, counted by Redis).

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
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

#[path = "../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis_server;

const CAPACITY: f64 = 200.0;
const CLIENTS: usize = 64;
const RUN: Duration = Duration::from_secs(6);
/// The bucket holds 100 ms worth: a burst above the rate is refused at once.
const BURST: f64 = CAPACITY / 10.0;

/// The limited server: a token bucket of `CAPACITY` a second.
struct Server {
    bucket: Mutex<(f64, Instant)>,
    limited: bool,
}

impl Server {
    fn new(limited: bool) -> Arc<Self> {
        Arc::new(Server {
            bucket: Mutex::new((BURST, Instant::now())),
            limited,
        })
    }

    fn admit(&self) -> bool {
        if !self.limited {
            return true;
        }
        let mut b = self.bucket.lock().unwrap();
        let now = Instant::now();
        let tokens = (b.0 + (now - b.1).as_secs_f64() * CAPACITY).min(BURST);
        *b = (tokens, now);
        if tokens >= 1.0 {
            b.0 -= 1.0;
            true
        } else {
            false
        }
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
            let limited = server.limited;
            let ok = server.admit();
            if limited {
                let latency = if ok { 20 } else { 2 };
                tokio::time::sleep(Duration::from_millis(latency)).await;
            }
            let mut res = Response::builder().status(if ok {
                StatusCode::OK
            } else {
                StatusCode::TOO_MANY_REQUESTS
            });
            if limited {
                res = res.header(
                    "anthropic-ratelimit-requests-limit",
                    format!("{}", (CAPACITY * 60.0) as u64),
                );
            }
            if !ok {
                res = res.header("retry-after", "1");
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
    let mut b = Fleet::builder().cooldown_gate(Some(GateConfig::new()));
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
    attempts: u64,
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

/// `CLIENTS` clients, spread evenly over `fleets`, sending back to back for `run`.
async fn storm(server: Arc<Server>, fleets: &[Fleet], run: Duration) -> Outcome {
    wait_connected(fleets).await;
    let policy = RetryPolicy::default().max_retries(4);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..CLIENTS {
        let svc = RetryLayer::new()
            .policy(policy.clone())
            .fleet(fleets[c % fleets.len()].clone())
            .layer(Sim(server.clone()));
        tasks.spawn(async move {
            let mut out = Outcome {
                successes: 0,
                attempts: 0,
                first_attempts: 0,
                latencies: Vec::new(),
            };
            while start.elapsed() < run {
                let t = Instant::now();
                let req = Request::post("http://bench/v1/messages")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .unwrap();
                let res = svc.clone().oneshot(req).await;
                out.first_attempts += 1;
                match res {
                    Ok(res) => {
                        out.attempts += res
                            .extensions()
                            .get::<RetryTrail>()
                            .map_or(1, |t| u64::from(t.total_attempts()));
                        if res.status() == StatusCode::OK {
                            out.successes += 1;
                            out.latencies.push(t.elapsed());
                        }
                    }
                    Err(e) => {
                        out.attempts += e.trail().map_or(1, |t| u64::from(t.total_attempts()));
                    }
                }
            }
            out
        });
    }
    let mut all = Outcome {
        successes: 0,
        attempts: 0,
        first_attempts: 0,
        latencies: Vec::new(),
    };
    while let Some(o) = tasks.join_next().await {
        let o = o.unwrap();
        all.successes += o.successes;
        all.attempts += o.attempts;
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

/// Round trips to Redis so far: the scripts run (a command a script calls is not one), the
/// scripts loaded, the subscriptions.
fn commands(redis: &redis_server::RedisServer) -> u64 {
    let text = match redis.command(&["INFO", "commandstats"]) {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        redis::Value::VerbatimString { text, .. } => text,
        _ => return 0,
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
            let calls = l.split("calls=").nth(1)?.split(',').next()?;
            calls.parse::<u64>().ok()
        })
        .sum()
}

#[tokio::main]
async fn main() {
    let Some(redis) = redis_server::RedisServer::start() else {
        eprintln!("redis-server is not installed: nothing to measure");
        return;
    };
    let url = redis.url();
    println!(
        "storm: {CLIENTS} clients for {RUN:?} against {CAPACITY} requests/s (429 Retry-After 1 s above)"
    );
    println!(
        "| mode | fleets | goodput | attempts/success | p50 | p99 | Redis round trips/first attempt |"
    );
    println!("|---|---|---|---|---|---|---|");
    for mode in [Mode::GateBudget, Mode::Pacing] {
        let name = match mode {
            Mode::GateBudget => "gate + budget",
            Mode::Pacing => "gate + budget + pacing",
        };
        for (label, n, shared) in [
            ("1 fleet", 1, false),
            ("4 separate fleets", 4, false),
            ("4 fleets, one Redis", 4, true),
        ] {
            let prefix = format!("bench-storm-{}", rand_suffix());
            let fleets: Vec<Fleet> = (0..n)
                .map(|_| {
                    let redis = shared.then_some((url.as_str(), prefix.as_str()));
                    fleet(mode, PacingConfig::new(), redis)
                })
                .collect();
            wait_connected(&fleets).await;
            let before = commands(&redis);
            let o = storm(Server::new(true), &fleets, RUN).await;
            let cmds = commands(&redis).saturating_sub(before);
            println!(
                "| {name} | {label} | {:.2} C | {:.2} | {:.0} ms | {:.0} ms | {} |",
                o.successes as f64 / RUN.as_secs_f64() / CAPACITY,
                o.attempts as f64 / o.successes.max(1) as f64,
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

    println!();
    println!("added latency: {CLIENTS} clients back to back against an instant server, 2 s each");
    println!("| fleet | requests/s | p50 | p99 | Redis round trips/request |");
    println!("|---|---|---|---|---|");
    for (label, mode, shared) in [
        ("local, gate + budget", Mode::GateBudget, false),
        ("Redis, gate + budget", Mode::GateBudget, true),
        ("local, pacing", Mode::Pacing, false),
        ("Redis, pacing", Mode::Pacing, true),
    ] {
        // A rate no client reaches: what is measured is the admission, not the wait.
        let pacing = PacingConfig::new().rates(1.0e6, 1.0, 1.0e6).unwrap();
        let prefix = format!("bench-latency-{}", rand_suffix());
        let f = fleet(
            mode,
            pacing,
            shared.then_some((url.as_str(), prefix.as_str())),
        );
        wait_connected(std::slice::from_ref(&f)).await;
        let before = commands(&redis);
        let o = storm(
            Server::new(false),
            std::slice::from_ref(&f),
            Duration::from_secs(2),
        )
        .await;
        let cmds = commands(&redis).saturating_sub(before);
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
