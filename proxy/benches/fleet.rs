//! `cargo bench -p tower-llm-retry-proxy --bench fleet`: the fleet across processes, through
//! the proxy. About 2½ minutes, in real time.
//!
//! Needs `redis-server` on the PATH (it starts its own on a Unix socket); without it the rows
//! with Redis are skipped, with a notice. The proxies are the release binary, started as
//! children in front of the crate's mock upstream, which runs in this process.
//!
//! - **CPU per process**: one proxy, with and without `redis_url`; its CPU time (user +
//!   system, from `/proc/<pid>/stat`) over 10 s idle after one request, then over 10 s at 50
//!   requests/s, in cores.
//! - **The storm**: 2 and 4 proxies, with one Redis and with none (independent replicas), in
//!   front of one upstream whose token bucket admits `CAPACITY` requests a second (and holds
//!   one second's worth); above it `429` with `Retry-After` the whole seconds to the next
//!   token, at least 1. 100 clients per proxy send back to back for 20 s, all with the same
//!   key (one tenant, one scope). Goodput (successes a second against `CAPACITY`), attempts
//!   the upstream saw per success, and the peak of attempts in one second after the first
//!   (against `CAPACITY`).
//!
//! `PROXY_FLEET_ROWS=<text>` runs only the rows whose name holds `<text>`.
//! Writes `target/bench/proxy-fleet.json`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use serde_json::json;
use tower_llm_retry::mock::{Capacity, MockServer, Script};

#[allow(dead_code)]
mod support;
use support::{client, cpu_time, free_port, target_dir, HttpClient, ProxyProcess};

#[path = "../../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis_server;

const CAPACITY: f64 = 20.0;
const CLIENTS_PER_PROXY: usize = 100;
const STORM: Duration = Duration::from_secs(20);
const BODY: &str =
    r#"{"model":"claude-bench","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;

/// One request with the shared key: whether it succeeded.
async fn one(client: &HttpClient, base: &str) -> bool {
    let Ok(req) = Request::post(format!("{base}/v1/messages"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-bench")
        .body(Full::from(BODY))
    else {
        return false;
    };
    let Ok(res) = client.request(req).await else {
        return false;
    };
    let ok = res.status().is_success();
    ok && res.into_body().collect().await.is_ok()
}

/// Writes a proxy's configuration in front of `upstream`, and starts it: its process and base
/// URL, once it answers `/readyz`.
async fn proxy(
    dir: &std::path::Path,
    name: &str,
    upstream: &str,
    redis: Option<(&str, &str)>,
) -> (ProxyProcess, String) {
    let port = free_port();
    let config: PathBuf = dir.join(format!("proxy-fleet-{name}.toml"));
    let mut f = std::fs::File::create(&config).expect("config");
    let mut text = format!("listen = \"127.0.0.1:{port}\"\nmax_concurrent_requests = 4096\n");
    if let Some((url, prefix)) = redis {
        text += &format!("redis_url = \"{url}\"\nredis_prefix = \"{prefix}\"\n");
    }
    text += &format!(
        "\n[[upstream]]\nname = \"anthropic\"\nkind = \"anthropic\"\nurl = \"{upstream}\"\n"
    );
    f.write_all(text.as_bytes()).expect("config");
    drop(f);
    // A refusal given up on is a warning each: the storm would print hundreds.
    let process = ProxyProcess::start(&config, "error");
    let base = format!("http://127.0.0.1:{port}");
    let c = client();
    for _ in 0..200 {
        let ready = Request::get(format!("{base}/readyz"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        if c.request(ready)
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return (process, base);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the proxy {name} did not answer");
}

fn cores(a: Option<Duration>, b: Option<Duration>, over: Duration) -> Option<f64> {
    Some((b? - a?).as_secs_f64() / over.as_secs_f64())
}

fn show(c: Option<f64>) -> String {
    c.map_or("?".into(), |c| format!("{c:.3}"))
}

/// CPU per process, idle and at 50 requests/s.
async fn cpu_row(
    dir: &std::path::Path,
    redis: Option<&redis_server::RedisServer>,
) -> serde_json::Value {
    let mock = MockServer::start(Script::new()).await.expect("mock");
    let upstream = mock.url("").trim_end_matches('/').to_owned();
    let url = redis.map(|r| r.url());
    let name = if redis.is_some() { "cpu-redis" } else { "cpu" };
    let (p, base) = proxy(
        dir,
        name,
        &upstream,
        url.as_deref().map(|u| (u, "proxy-fleet-cpu")),
    )
    .await;
    let c = client();
    assert!(one(&c, &base).await, "the first request failed");
    let window = Duration::from_secs(10);
    let t0 = cpu_time(p.0.id());
    tokio::time::sleep(window).await;
    let idle = cores(t0, cpu_time(p.0.id()), window);

    let rate = 50.0;
    let t0 = cpu_time(p.0.id());
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..(rate * window.as_secs_f64()) as u64 {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let (c, base) = (c.clone(), base.clone());
        tasks.spawn(async move { one(&c, &base).await });
    }
    let mut errors = 0;
    while let Some(r) = tasks.join_next().await {
        errors += u64::from(!r.unwrap_or(false));
    }
    let busy = cores(t0, cpu_time(p.0.id()), start.elapsed());
    println!(
        "  {:<14} idle {} cores | 50 requests/s {} cores | errors {errors}",
        if redis.is_some() {
            "with Redis"
        } else {
            "without Redis"
        },
        show(idle),
        show(busy)
    );
    json!({"redis": redis.is_some(), "idle_cores": idle, "cores_at_50rps": busy, "errors": errors})
}

/// The storm: `processes` proxies, sharing `redis` or not, 100 clients each.
async fn storm_row(
    dir: &std::path::Path,
    processes: usize,
    redis: Option<&redis_server::RedisServer>,
) -> serde_json::Value {
    let mock = MockServer::start(
        Script::new().capacity(Capacity::token_bucket(CAPACITY, CAPACITY as u32)),
    )
    .await
    .expect("mock");
    let upstream = mock.url("").trim_end_matches('/').to_owned();
    let url = redis.map(|r| r.url());
    // A prefix of its own per row: no row starts with another's gate or schedule.
    let prefix = format!("proxy-fleet-storm-{processes}");
    let mut proxies = Vec::new();
    for i in 0..processes {
        proxies.push(
            proxy(
                dir,
                &format!("storm-{i}"),
                &upstream,
                url.as_deref().map(|u| (u, prefix.as_str())),
            )
            .await,
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let seconds = STORM.as_secs() as usize + 1;
    // Successes in each second of the row.
    let ok: Arc<Vec<AtomicU64>> = Arc::new((0..seconds).map(|_| AtomicU64::new(0)).collect());
    let failed = Arc::new(AtomicU64::new(0));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for (_, base) in &proxies {
        for _ in 0..CLIENTS_PER_PROXY {
            let (stop, ok, failed, base) = (stop.clone(), ok.clone(), failed.clone(), base.clone());
            let c = client();
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if one(&c, &base).await {
                        let second = start.elapsed().as_secs() as usize;
                        if let Some(n) = ok.get(second) {
                            n.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        // A client that is refused tries again a little later, not at once.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }));
        }
    }
    tokio::time::sleep_until(start + STORM).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = STORM;
    for t in tasks {
        t.abort();
    }
    let ok_per_second: Vec<u64> = ok[..STORM.as_secs() as usize]
        .iter()
        .map(|n| n.load(Ordering::Relaxed))
        .collect();
    let successes: u64 = ok_per_second.iter().sum();
    let failures = failed.load(Ordering::Relaxed);
    drop(proxies);

    let mut per_second = vec![0u64; seconds];
    let mut attempts = 0u64;
    for r in mock.requests() {
        let Some(at) = r.received_at.checked_duration_since(start) else {
            continue;
        };
        if at < elapsed {
            attempts += 1;
            if let Some(c) = per_second.get_mut(at.as_secs() as usize) {
                *c += 1;
            }
        }
    }
    let goodput = successes as f64 / elapsed.as_secs_f64() / CAPACITY;
    let per_success = attempts as f64 / successes.max(1) as f64;
    // The first second holds every client's first request at once, before any refusal has
    // woken the (dormant) pacing: the steady state is what follows.
    let later = |v: &[u64]| v[1..STORM.as_secs() as usize].iter().sum::<u64>();
    let per_success_later = later(&per_second) as f64 / later(&ok_per_second).max(1) as f64;
    let peak = per_second[1..STORM.as_secs() as usize]
        .iter()
        .copied()
        .max()
        .unwrap_or(0) as f64
        / CAPACITY;
    let mode = if redis.is_some() {
        "one Redis"
    } else {
        "no Redis"
    };
    println!(
        "  {processes} proxies, {mode:<9}: goodput {goodput:.3} | attempts per success {per_success:.2} (after the first second {per_success_later:.2}) | first second {} attempts | peak after the first second {peak:.2}x | failed {failures}",
        per_second[0]
    );
    json!({
        "processes": processes, "redis": redis.is_some(), "goodput": goodput,
        "attempts_per_success": per_success,
        "attempts_per_success_after_first_second": per_success_later, "peak_after_first_second": peak,
        "successes": successes, "attempts": attempts, "failed_requests": failures,
        "attempts_per_second": per_second, "successes_per_second": ok_per_second,
    })
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(bench());
}

async fn bench() {
    let only = std::env::var("PROXY_FLEET_ROWS").ok();
    let run = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir).expect("target/bench");
    let redis = if redis_server::installed() {
        Some(redis_server::RedisServer::start())
    } else {
        println!("redis-server is not installed: the rows with Redis are skipped");
        None
    };
    let mut report = json!({
        "machine_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "capacity": CAPACITY,
    });

    if run("cpu") {
        println!("CPU per process, 10 s idle after one request, then 10 s at 50 requests/s:");
        let mut rows = vec![cpu_row(&dir, None).await];
        if let Some(r) = &redis {
            rows.push(cpu_row(&dir, Some(r)).await);
        }
        report["cpu"] = json!(rows);
    }
    if run("storm") {
        println!(
            "storm: capacity {CAPACITY} requests/s, {CLIENTS_PER_PROXY} clients per proxy, one key, {} s:",
            STORM.as_secs()
        );
        let mut rows = Vec::new();
        for processes in [2, 4] {
            rows.push(storm_row(&dir, processes, None).await);
            if let Some(r) = &redis {
                rows.push(storm_row(&dir, processes, Some(r)).await);
            }
        }
        report["storm"] = json!(rows);
    }
    let out = dir.join("proxy-fleet.json");
    std::fs::write(&out, serde_json::to_string_pretty(&report).expect("json")).expect("write");
    println!("wrote {}", out.display());
}
