//! `cargo bench -p tower-llm-retry-proxy --bench proxy`: what the proxy adds, measured against
//! the mock direct and against two floors, in the same run.
//!
//! The mock runs in this process. In front of it, each its own child process (so its CPU
//! time and peak RSS are its own): the proxy (the release binary, its default configuration,
//! logs at `warn`: a worker thread per core); the same with `worker_threads = 1` (`proxy1`,
//! one event loop as nginx's one worker); a bare pass-through proxy made of the
//! same hyper server and hyper-util client, with nothing else (this binary again, see
//! `support/floor.rs`); and nginx `proxy_pass` with upstream keep-alive and one worker,
//! when `nginx` is on `PATH` (skipped with a notice when it is not). A load generator
//! (hyper-util client, HTTP/1.1) sends 1 KiB JSON and 20-event SSE requests to each in turn:
//!
//! - open loop at 1,000, 5,000 and 10,000 requests/s (latency from each request's scheduled
//!   time, so a stall is not hidden): p50 / p99, and what each adds over direct;
//! - time to the first SSE byte at 1,000/s;
//! - closed loop, 64 connections: throughput, and CPU per request (the process's user +
//!   system time over the requests it served), before any overload;
//! - the highest rate (stepped) whose p99 stays under 5 ms, then an overload step far past
//!   what any of them serves;
//! - each process's peak RSS (`VmHWM`), overload steps included.
//!
//! Writes `target/bench/proxy.json`. `PROXY_BENCH_ONLY=closed` runs the closed loop alone,
//! three times over, and writes nothing.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Request;
use http_body_util::{BodyExt, Full};
use serde_json::json;
use tower_llm_retry::mock::{sse, MockServer, Reply, Script};

mod support;
use support::{client, cpu_time, free_port, rss_kib, target_dir, HttpClient, ProxyProcess};
#[path = "support/floor.rs"]
mod floor;

const JSON_BODY: &str =
    r#"{"model":"claude-bench","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
const SSE_BODY: &str = r#"{"model":"claude-bench","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

fn script() -> Script {
    let text = "x".repeat(1024 - 200);
    let json_reply = Reply::status(200).json(json!({
        "id": "msg_bench", "type": "message", "role": "assistant", "model": "claude-bench",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 200}
    }));
    let words: Vec<String> = (0..15).map(|i| format!("word{i} ")).collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let events = sse::anthropic_message(&words); // 5 + 15 deltas
    assert_eq!(events.len(), 20);
    Script::new().when(move |req| {
        let stream = req.body.windows(13).any(|w| w == b"\"stream\":true");
        Some(if stream {
            Reply::sse(events.clone())
        } else {
            json_reply.clone()
        })
    })
}

async fn one(client: &HttpClient, base: &str, body: &'static str) -> Option<(Duration, Duration)> {
    let start = Instant::now();
    let req = Request::post(format!("{base}/v1/messages"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-bench")
        .body(Full::from(body))
        .ok()?;
    let res = client.request(req).await.ok()?;
    if !res.status().is_success() {
        return None;
    }
    let mut body = res.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.ok()?;
        if first.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
            first = Some(start.elapsed());
        }
    }
    Some((first.unwrap_or_else(|| start.elapsed()), start.elapsed()))
}

struct Run {
    total: Vec<Duration>,
    first_byte: Vec<Duration>,
    lag: Vec<Duration>,
    errors: u64,
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Requests at `rate` per second for `secs`, latency from each one's scheduled start.
async fn open_loop(
    client: &HttpClient,
    base: &str,
    body: &'static str,
    rate: f64,
    secs: f64,
) -> Run {
    let n = (rate * secs) as u64;
    let t0 = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let at = t0 + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at).await;
        let client = client.clone();
        let base = base.to_owned();
        tasks.spawn(async move {
            // tokio's timer has a 1 ms grain: the lag between the scheduled instant and the
            // start is the generator's, the same on both paths, and reported apart.
            let lag = at.elapsed();
            // A request still unanswered after 10 s is counted as failed: an overloaded
            // path must not hold the bench for minutes.
            tokio::time::timeout(Duration::from_secs(10), one(&client, &base, body))
                .await
                .ok()
                .flatten()
                .map(|(f, t)| (f, t, lag))
        });
    }
    let mut run = Run {
        total: Vec::new(),
        first_byte: Vec::new(),
        lag: Vec::new(),
        errors: 0,
    };
    while let Some(r) = tasks.join_next().await {
        match r.ok().flatten() {
            Some((f, t, lag)) => {
                run.first_byte.push(f);
                run.total.push(t);
                run.lag.push(lag);
            }
            None => run.errors += 1,
        }
    }
    run
}

/// `conns` clients each sending back to back for `secs`: requests per second.
async fn closed_loop(base: &str, body: &'static str, conns: usize, secs: f64) -> (f64, u64) {
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (done, errors, stop) = (done.clone(), errors.clone(), stop.clone());
        let base = base.to_owned();
        // One client each: one connection each, reused.
        let client = client();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match one(&client, &base, body).await {
                    Some(_) => done.fetch_add(1, Ordering::Relaxed),
                    None => errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let n0 = done.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    for t in tasks {
        let _ = t.await;
    }
    (n0 as f64 / elapsed, errors.load(Ordering::Relaxed))
}

fn main() {
    // This binary is also the bare pass-through proxy, in a process of its own.
    floor::bare_if_asked();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(bench());
}

/// One path the load goes through: direct to the mock, or a proxy process in front of it.
struct Path {
    name: &'static str,
    base: String,
    pid: Option<u32>,
}

/// The open-loop rates whose p50 / p99 are reported.
const RATES: [f64; 3] = [1000.0, 5000.0, 10000.0];

/// The overload step: far past what any of the paths serves on two cores.
const OVERLOAD_RATE: f64 = 20000.0;

fn mib(kib: Option<u64>) -> Option<f64> {
    kib.map(|k| k as f64 / 1024.0)
}

fn show(x: Option<f64>, digits: usize) -> String {
    x.map_or("–".into(), |x| format!("{x:.digits$}"))
}

async fn bench() {
    let mock = MockServer::start(script()).await.expect("mock");
    let direct = mock.url("").trim_end_matches('/').to_owned();
    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir).expect("target/bench");
    let config = dir.join("proxy-bench.toml");
    let port = free_port();
    let mut f = std::fs::File::create(&config).expect("config");
    writeln!(
        f,
        "listen = \"127.0.0.1:{port}\"\n\n[[upstream]]\nname = \"anthropic\"\nkind = \"anthropic\"\nurl = \"{direct}\"\n"
    )
    .expect("config");
    let proxy_proc = ProxyProcess::start(&config, "warn");
    // The same proxy on one worker thread, as nginx has one worker process: the CPU per
    // request of one event loop against another.
    let config1 = dir.join("proxy-bench-1.toml");
    let port1 = free_port();
    std::fs::write(
        &config1,
        format!(
            "listen = \"127.0.0.1:{port1}\"\nworker_threads = 1\n\n[[upstream]]\nname = \"anthropic\"\nkind = \"anthropic\"\nurl = \"{direct}\"\n"
        ),
    )
    .expect("config");
    let proxy1_proc = ProxyProcess::start(&config1, "warn");
    let bare = floor::start_bare(free_port(), &direct);
    let nginx = floor::start_nginx(free_port(), &mock.addr().to_string(), &dir);
    let mut paths = vec![Path {
        name: "direct",
        base: direct.clone(),
        pid: None,
    }];
    for f in [Some(&bare), nginx.as_ref()].into_iter().flatten() {
        paths.push(Path {
            name: f.name,
            base: f.base.clone(),
            pid: Some(f.child.id()),
        });
    }
    paths.push(Path {
        name: "proxy",
        base: format!("http://{}", SocketAddr::from(([127, 0, 0, 1], port))),
        pid: Some(proxy_proc.0.id()),
    });
    paths.push(Path {
        name: "proxy1",
        base: format!("http://{}", SocketAddr::from(([127, 0, 0, 1], port1))),
        pid: Some(proxy1_proc.0.id()),
    });
    let c = client();
    for p in &paths {
        let mut up = false;
        for _ in 0..100 {
            if one(&c, &p.base, JSON_BODY).await.is_some() {
                up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(up, "{} did not answer", p.name);
        // Warm the path.
        let _ = open_loop(&c, &p.base, JSON_BODY, 500.0, 0.5).await;
    }
    let n = paths.len();

    // `PROXY_BENCH_ONLY=closed`: the closed loop alone, three times over, for a quick
    // comparison of CPU per request; nothing written.
    if std::env::var("PROXY_BENCH_ONLY").is_ok_and(|v| v == "closed") {
        for round in 1..=3 {
            println!("closed loop, 64 connections, 1 KiB JSON, 3 s (round {round} of 3):");
            for p in &paths {
                let cpu0 = p.pid.and_then(cpu_time);
                let (rps, errors) = closed_loop(&p.base, JSON_BODY, 64, 3.0).await;
                let cpu = match (cpu0, p.pid.and_then(cpu_time)) {
                    (Some(a), Some(b)) if rps > 0.0 => {
                        Some((b - a).as_secs_f64() * 1e6 / (rps * 3.0))
                    }
                    _ => None,
                };
                println!(
                    "  {:<6} {rps:.0} /s | errors {errors} | CPU per request {} µs",
                    p.name,
                    show(cpu, 1)
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        return;
    }

    // [path][rate] -> (p50, p99, errors); the generator's lag at each rate.
    let mut open = vec![Vec::new(); n];
    let mut lags = Vec::new();
    for &rate in &RATES {
        println!("open loop, 1 KiB JSON at {rate} requests/s for 2 s:");
        let mut lag = Duration::ZERO;
        for (i, p) in paths.iter().enumerate() {
            let mut r = open_loop(&c, &p.base, JSON_BODY, rate, 2.0).await;
            let (p50, p99) = (pct(&mut r.total, 0.5), pct(&mut r.total, 0.99));
            lag = lag.max(pct(&mut r.lag, 0.99));
            println!(
                "  {:<6} p50 {:.3} ms p99 {:.3} ms | errors {}",
                p.name,
                ms(p50),
                ms(p99),
                r.errors
            );
            open[i].push((p50, p99, r.errors));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        println!("  (generator lag behind schedule, p99: {:.3} ms)", ms(lag));
        lags.push(lag);
    }

    println!("open loop, 20-event SSE at 1,000 requests/s for 2 s, time to the first byte:");
    let mut sse = Vec::new();
    for p in &paths {
        let mut r = open_loop(&c, &p.base, SSE_BODY, 1000.0, 2.0).await;
        let (f50, f99, t99) = (
            pct(&mut r.first_byte, 0.5),
            pct(&mut r.first_byte, 0.99),
            pct(&mut r.total, 0.99),
        );
        println!(
            "  {:<6} first byte p50 {:.3} p99 {:.3} ms | whole stream p99 {:.3} ms | errors {}",
            p.name,
            ms(f50),
            ms(f99),
            ms(t99),
            r.errors
        );
        sse.push((f50, f99, t99, r.errors));
    }

    println!("closed loop, 64 connections, 1 KiB JSON, 3 s:");
    let mut closed = Vec::new();
    for p in &paths {
        let cpu0 = p.pid.and_then(cpu_time);
        let (rps, errors) = closed_loop(&p.base, JSON_BODY, 64, 3.0).await;
        let cpu = match (cpu0, p.pid.and_then(cpu_time)) {
            (Some(a), Some(b)) if rps > 0.0 => Some((b - a).as_secs_f64() * 1e6 / (rps * 3.0)),
            _ => None,
        };
        println!(
            "  {:<6} {rps:.0} /s | errors {errors} | CPU per request {} µs",
            p.name,
            show(cpu, 1)
        );
        closed.push((rps, errors, cpu));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let steady: Vec<Option<u64>> = paths
        .iter()
        .map(|p| p.pid.and_then(|pid| rss_kib(pid, "VmHWM:")))
        .collect();

    println!(
        "highest rate with p99 under 5 ms (1 KiB JSON, 1 s per step, a failed step run twice):"
    );
    let mut best = vec![0.0f64; n];
    for (i, p) in paths.iter().enumerate() {
        for rate in [
            1000.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0, 8000.0, 10000.0,
        ] {
            // A step on a machine shared with other work can fail by accident: a failed step
            // is run once more before the search stops.
            let mut ok = false;
            for _ in 0..2 {
                let mut r = open_loop(&c, &p.base, JSON_BODY, rate, 1.0).await;
                let p99 = pct(&mut r.total, 0.99);
                ok = p99 < Duration::from_millis(5) && r.errors == 0;
                println!(
                    "  {:<6} {rate:>6} /s: p99 {:.3} ms, errors {}",
                    p.name,
                    ms(p99),
                    r.errors
                );
                if ok {
                    break;
                }
            }
            if !ok {
                break;
            }
            best[i] = rate;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    println!("overload, 1 KiB JSON at {OVERLOAD_RATE} requests/s for 1 s (a refusal is an error):");
    let mut overload = Vec::new();
    for p in &paths {
        let mut r = open_loop(&c, &p.base, JSON_BODY, OVERLOAD_RATE, 1.0).await;
        let p99 = pct(&mut r.total, 0.99);
        println!(
            "  {:<6} served {} p99 {:.3} ms, errors {}",
            p.name,
            r.total.len(),
            ms(p99),
            r.errors
        );
        overload.push((r.total.len(), p99, r.errors));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let peak: Vec<Option<u64>> = paths
        .iter()
        .map(|p| p.pid.and_then(|pid| rss_kib(pid, "VmHWM:")))
        .collect();
    drop(proxy_proc);
    drop(proxy1_proc);
    drop(bare);
    drop(nginx);

    // The table: each path, and each proxy's figures over each floor's.
    let proxies = [n - 2, n - 1];
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let added = |i: usize, k: usize| ms(open[i][k].1.saturating_sub(open[0][k].1));
    println!();
    println!(
        "| | direct | {} |",
        paths[1..]
            .iter()
            .map(|p| p.name)
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---:|".repeat(n));
    let row = |label: &str, f: &dyn Fn(usize) -> String| {
        let cells: Vec<String> = (0..n).map(f).collect();
        println!("| {label} | {} |", cells.join(" | "));
    };
    row("closed loop, requests/s", &|i| {
        format!("{:.0}", closed[i].0)
    });
    row("CPU per request, µs", &|i| show(closed[i].2, 1));
    for (k, rate) in RATES.iter().enumerate() {
        row(&format!("p50 / p99 at {rate}/s, ms"), &|i| {
            format!("{:.3} / {:.3}", ms(open[i][k].0), ms(open[i][k].1))
        });
        row(&format!("added p99 at {rate}/s, ms"), &|i| {
            if i == 0 {
                "–".into()
            } else {
                format!("{:.3}", added(i, k))
            }
        });
    }
    row("SSE first byte p50 / p99, ms", &|i| {
        format!("{:.3} / {:.3}", ms(sse[i].0), ms(sse[i].1))
    });
    row("highest rate, p99 < 5 ms", &|i| format!("{:.0}", best[i]));
    row(
        &format!("served / failed at {OVERLOAD_RATE}/s for 1 s"),
        &|i| format!("{} / {}", overload[i].0, overload[i].2),
    );
    row("peak RSS, MiB", &|i| show(mib(peak[i]), 1));
    println!();
    for proxy in proxies {
        for f in 1..proxies[0] {
            println!(
                "{} / {}: CPU per request {}×, closed-loop throughput {}×, peak RSS {}×",
                paths[proxy].name,
                paths[f].name,
                show(ratio(closed[proxy].2, closed[f].2), 2),
                show(Some(closed[proxy].0 / closed[f].0), 2),
                show(ratio(mib(peak[proxy]), mib(peak[f])), 2),
            );
        }
    }

    let per_path: serde_json::Map<String, serde_json::Value> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let rates: serde_json::Map<String, serde_json::Value> = RATES
                .iter()
                .enumerate()
                .map(|(k, rate)| {
                    (
                        format!("{rate}"),
                        json!({
                            "p50_ms": ms(open[i][k].0), "p99_ms": ms(open[i][k].1),
                            "added_p99_ms": added(i, k), "errors": open[i][k].2,
                        }),
                    )
                })
                .collect();
            (
                p.name.to_owned(),
                json!({
                    "open_loop_json": rates,
                    "sse_first_byte_p50_ms": ms(sse[i].0),
                    "sse_first_byte_p99_ms": ms(sse[i].1),
                    "sse_first_byte_added_p99_ms": ms(sse[i].1.saturating_sub(sse[0].1)),
                    "sse_whole_stream_p99_ms": ms(sse[i].2),
                    "sse_errors": sse[i].3,
                    "max_rate_p99_under_5ms": best[i],
                    "overload": {"rate": OVERLOAD_RATE, "served": overload[i].0,
                                 "p99_ms": ms(overload[i].1), "errors": overload[i].2},
                    "closed_loop_64_rps": closed[i].0,
                    "closed_loop_errors": closed[i].1,
                    "cpu_us_per_request": closed[i].2,
                    "peak_rss_mib": mib(peak[i]),
                    "peak_rss_before_overload_mib": mib(steady[i]),
                }),
            )
        })
        .collect();
    let report = json!({
        "machine_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "generator_lag_p99_ms": lags.iter().map(|l| ms(*l)).collect::<Vec<_>>(),
        "paths": per_path,
    });
    let out = dir.join("proxy.json");
    std::fs::write(&out, serde_json::to_string_pretty(&report).expect("json")).expect("write");
    println!("wrote {}", out.display());
}
