//! Soak: thousands of logical requests, 64 at a time, through the full stack (retry, model
//! fallback, overflow repair, auth) against the mock with seeded random faults. Every request
//! must end in a response or a typed error, every attempt must carry the caller's bytes (but
//! for the documented `model` / `max_tokens` edits), no request may exceed the policy's
//! attempts, retries must stay within the budget, and no task may be left behind.
//!
//! `soak_ci` (1,000 requests) runs with the suite; `soak_full` (10,000) with
//! `cargo test --test it soak_full -- --ignored`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::json::{read_value, replace_value};
use crate::common::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::fleet::{BudgetConfig, Fleet};
use tower_llm_retry::mock::{sse, MockServer, Reply, Script, SseFrame};
use tower_llm_retry::retry::Random;
use tower_llm_retry::{
    ApiKey, AuthLayer, ContextOverflowLayer, ErrorKind, ModelFallbackLayer, RetryLayer,
    RetryPolicy, RetryTrail,
};

const CONCURRENCY: usize = 64;
const MAX_RETRIES: u32 = 6;
const MODEL: &str = "claude-sonnet-4-5";
const FALLBACK: &str = "claude-haiku-4-5";
const MAX_TOKENS: u64 = 8192;
const API_KEY: &str = "sk-ant-soak-key";

fn body(i: usize, stream: bool) -> Bytes {
    Bytes::from(format!(
        r#"{{"model":"{MODEL}","max_tokens":{MAX_TOKENS},"stream":{stream},"metadata":{{"user_id":"req-{i}"}},"messages":[{{"role":"user","content":"Question number {i}: what is {i} squared?"}}]}}"#
    ))
}

/// One random server behaviour: most succeed, the rest fail in every way the stack handles.
fn random_reply(rng: &mut StdRng) -> Reply {
    let roll = rng.random_range(0..100);
    match roll {
        0..=59 => Reply::success(),
        60..=67 => Reply::sse(sse::anthropic_message(&["Forty", "-two"])),
        68..=74 => Reply::rate_limited(["1", "2", "0.5"][rng.random_range(0..3)]),
        75..=80 => Reply::overloaded(),
        81..=84 => Reply::status(503),
        85..=87 => Reply::reset(),
        88 => Reply::stall(),
        89..=93 => Reply::sse(vec![
            sse::anthropic_message(&[])[0].clone(),
            SseFrame::new("ping", r#"{"type": "ping"}"#),
            sse::anthropic_error("overloaded_error"),
        ]),
        94..=96 => Reply::context_overflow(190_000, MAX_TOKENS, 195_000),
        _ => Reply::sse_then_reset(vec![sse::anthropic_message(&[])[0].clone()]),
    }
}

#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    non_2xx: usize,
    errors: HashMap<ErrorKind, usize>,
    body_errors: usize,
    retries: u64,
    max_attempts: u32,
    /// Each request's attempts as its trail tells them (`None`: an error with no trail), by
    /// request index: one entry per request that ended.
    attempts: HashMap<usize, Option<u32>>,
}

async fn soak(n: usize, seed: u64) -> (Tally, Duration) {
    let handle = tokio::runtime::Handle::current();
    let tasks_before = handle.metrics().num_alive_tasks();

    let mut rng = StdRng::seed_from_u64(seed);
    let mut script = Script::new();
    for _ in 0..n * 3 {
        script = script.then(random_reply(&mut rng));
    }
    let server = MockServer::start(script.otherwise(Reply::success()))
        .await
        .unwrap();
    let budget = BudgetConfig::default();
    let stack = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(
                    RetryPolicy::default()
                        .max_retries(MAX_RETRIES)
                        .random(Random::seeded(seed))
                        .head_timeout(Some(Duration::from_secs(30)))
                        .idle_timeout(Some(Duration::from_secs(30))),
                )
                .fleet(Fleet::builder().budget(Some(budget)).build()),
        )
        .layer(ModelFallbackLayer::new([FALLBACK]).unwrap())
        .layer(ContextOverflowLayer::new())
        .layer(AuthLayer::new(ApiKey::new(API_KEY).unwrap()))
        .service(http_client());

    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY {
        let stack = stack.clone();
        let next = next.clone();
        let tally = tally.clone();
        let url = server.url("/v1/messages");
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return;
                }
                let req = http::Request::post(&url)
                    .header("content-type", "application/json")
                    .body(Full::new(body(i, i.is_multiple_of(2))))
                    .unwrap();
                let outcome = stack.clone().oneshot(req).await;
                match outcome {
                    Ok(res) => {
                        let trail = res.extensions().get::<RetryTrail>().cloned();
                        let attempts = trail.as_ref().map_or(1, RetryTrail::total_attempts);
                        let retries = trail.as_ref().map_or(0, |t| u64::from(t.retries()));
                        let status = res.status();
                        let drained = res.into_body().collect().await;
                        let mut t = tally.lock().unwrap();
                        assert!(
                            t.attempts.insert(i, Some(attempts)).is_none(),
                            "{i} ended twice"
                        );
                        t.retries += retries;
                        t.max_attempts = t.max_attempts.max(attempts);
                        match drained {
                            Err(_) => t.body_errors += 1,
                            Ok(_) if status.is_success() => t.ok += 1,
                            Ok(_) => t.non_2xx += 1,
                        }
                    }
                    Err(e) => {
                        let mut t = tally.lock().unwrap();
                        let attempts = e.trail().map(RetryTrail::total_attempts);
                        assert!(t.attempts.insert(i, attempts).is_none(), "{i} ended twice");
                        if let Some(trail) = e.trail() {
                            t.retries += u64::from(trail.retries());
                            t.max_attempts = t.max_attempts.max(trail.total_attempts());
                        }
                        *t.errors.entry(e.kind()).or_default() += 1;
                    }
                }
            }
        });
    }
    // Every request ends: the workers finish within a bounded virtual time.
    let joined = tokio::time::timeout(Duration::from_secs(6 * 3600), async {
        while let Some(r) = workers.join_next().await {
            r.unwrap();
        }
    })
    .await;
    assert!(
        joined.is_ok(),
        "the soak did not finish in bounded virtual time"
    );
    let elapsed = start.elapsed();

    // Every attempt carried the caller's bytes, but for the documented edits.
    let received = server.requests();
    let mut per_request: HashMap<String, usize> = HashMap::new();
    for r in &received {
        let metadata: serde_json::Value = read_value(&r.body, "metadata").expect("metadata");
        let id = metadata["user_id"].as_str().unwrap().to_owned();
        let i: usize = id.trim_start_matches("req-").parse().unwrap();
        let model: String = read_value(&r.body, "model").unwrap();
        assert!(model == MODEL || model == FALLBACK, "{model}");
        let max_tokens: u64 = read_value(&r.body, "max_tokens").unwrap();
        assert!(max_tokens <= MAX_TOKENS);
        let restored = replace_value(&r.body, "model", MODEL).unwrap();
        let restored = replace_value(&restored, "max_tokens", &MAX_TOKENS).unwrap();
        assert_eq!(
            sha256(&restored),
            sha256(&body(i, i.is_multiple_of(2))),
            "request {i}"
        );
        assert_eq!(r.headers["x-api-key"], API_KEY);
        *per_request.entry(id).or_default() += 1;
    }
    // An attempt is at most two requests on the wire (an overflow repair re-sends once).
    for (id, count) in &per_request {
        assert!(
            *count <= 2 * (MAX_RETRIES as usize + 1),
            "{id} reached the server {count} times"
        );
    }

    let tally = Arc::try_unwrap(tally).unwrap().into_inner().unwrap();
    let accounted =
        tally.ok + tally.non_2xx + tally.body_errors + tally.errors.values().sum::<usize>();
    assert_eq!(
        accounted, n,
        "every request ends in a response or a typed error"
    );
    // The caller's account against the server's: every request reached it, each as many
    // times as its trail says it made attempts (twice for one an overflow repair re-sent).
    assert_eq!(tally.attempts.len(), n);
    assert_eq!(
        per_request.len(),
        n,
        "requests that never reached the server"
    );
    for (i, attempts) in &tally.attempts {
        let wire = per_request[&format!("req-{i}")];
        if let Some(a) = attempts {
            let a = *a as usize;
            assert!(
                a <= wire && wire <= 2 * a,
                "request {i}: {a} attempts in its trail, {wire} on the wire"
            );
        }
    }
    assert!(tally.max_attempts <= MAX_RETRIES + 1);
    // Retries within the budget: its reserve for every window of the run, plus its share of
    // the first attempts.
    let windows = elapsed.as_secs().div_ceil(budget.get_ttl().as_secs()) + 1;
    let allowed = windows * u64::from(budget.get_min_per_sec()) * budget.get_ttl().as_secs()
        + (n as f64 * f64::from(budget.get_retry_ratio())) as u64;
    assert!(
        tally.retries <= allowed,
        "{} retries > {allowed} allowed",
        tally.retries
    );

    // No task left running once the server and the client are gone.
    drop(stack);
    server.shutdown();
    drop(server);
    for _ in 0..100 {
        if handle.metrics().num_alive_tasks() <= tasks_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        handle.metrics().num_alive_tasks(),
        tasks_before,
        "tasks leaked"
    );
    (tally, elapsed)
}

fn report(n: usize, tally: &Tally, elapsed: Duration) {
    println!(
        "soak: {n} requests, {} ok, {} non-2xx, {} body errors, errors {:?}, {} retries, max {} attempts, {:.0} s virtual",
        tally.ok,
        tally.non_2xx,
        tally.body_errors,
        tally.errors,
        tally.retries,
        tally.max_attempts,
        elapsed.as_secs_f64()
    );
}

#[tokio::test(start_paused = true)]
async fn soak_ci() {
    let (tally, elapsed) = soak(1_000, 7).await;
    report(1_000, &tally, elapsed);
    assert!(tally.ok > 900, "{tally:?}");
}

#[tokio::test(start_paused = true)]
#[ignore = "the full-size soak: cargo test --test it soak_full -- --ignored"]
async fn soak_full() {
    let (tally, elapsed) = soak(10_000, 11).await;
    report(10_000, &tally, elapsed);
    assert!(tally.ok > 9_000, "{tally:?}");
}
