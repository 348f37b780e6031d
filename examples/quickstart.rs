//! Sends requests through `RetryLayer` and hyper-util's client to a local mock LLM server that
//! fails in the ways real APIs do, and prints what the layer did.
//!
//! ```text
//! cargo run --example quickstart --features mock
//! ```

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{ReplayBody, RetryEvent, RetryLayer, RetryObserver, RetryPolicy, RetryTrail};

/// Prints one line per retry, with the time since the example started.
#[derive(Debug, Clone)]
struct Timeline {
    start: Instant,
}

impl RetryObserver for Timeline {
    fn on_retry(&self, e: &RetryEvent<'_>) {
        let what = match (e.status, e.error) {
            (Some(status), _) => format!(
                "{} {}",
                status.as_u16(),
                status
                    .canonical_reason()
                    .unwrap_or(if status.as_u16() == 529 {
                        "Overloaded"
                    } else {
                        ""
                    })
            ),
            (None, Some(err)) => format!("error: {}", innermost(err)),
            (None, None) => "failed".to_owned(),
        };
        let hint = e
            .retry_after
            .map(|d| format!(", server asked for {:.1?}", d))
            .unwrap_or_default();
        println!(
            "  {:>6.2}s  attempt {}  {:<32} class {:<12} sleep {:.2?}{hint}",
            self.start.elapsed().as_secs_f64(),
            e.attempt,
            what,
            e.class.as_str(),
            e.delay,
        );
    }
}

fn innermost(mut err: &(dyn std::error::Error + 'static)) -> String {
    while let Some(next) = err.source() {
        err = next;
    }
    err.to_string()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let start = Instant::now();

    // A local server on 127.0.0.1 that plays a script: one request after another.
    let server = MockServer::start(
        Script::new()
            // Request 1: a rate limit, an overload, an outage, a dropped connection, then success.
            .then(Reply::rate_limited("1"))
            .then(Reply::overloaded())
            .then(Reply::status(503))
            .then(Reply::reset())
            .then(Reply::success())
            // Request 2: the account is out of credit; no wait will fix that.
            .then(Reply::openai_error(
                429,
                "insufficient_quota",
                "You exceeded your current quota",
            ))
            // Request 3: the server asks for a two-minute wait; not worth holding the caller.
            // (The fleet's cooldown gate, on by default, would now hold the other requests
            // of this key for up to the policy's 60 s ceiling, instead of letting them
            // hammer a server that said to wait.)
            .then(Reply::rate_limited("120")),
    )
    .await?;

    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let stack = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                // The default policy, with shorter backoff so the demo is quick.
                .policy(RetryPolicy::default().initial_backoff(Duration::from_millis(200)))
                .observer(Timeline { start }),
        )
        .service(client);

    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":256,"messages":[{"role":"user","content":"Hello"}]}"#;
    let mut summary = Vec::new();
    for n in 1..=3 {
        println!("request {n}");
        let req = Request::post(server.url("/v1/messages"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))?;
        let sent = Instant::now();
        let res = stack.clone().oneshot(req).await?;
        let status = res.status();
        let trail = res.extensions().get::<RetryTrail>().cloned();
        let bytes = res.into_body().collect().await?.to_bytes();
        let attempts = trail.as_ref().map_or(1, |t| t.total_attempts());
        let why = trail
            .as_ref()
            .and_then(|t| t.gave_up())
            .map(|r| format!(" (stopped: {r:?})"))
            .unwrap_or_default();
        println!(
            "  {:>6.2}s  -> {status} after {attempts} attempt(s){why}, {} body bytes",
            start.elapsed().as_secs_f64(),
            bytes.len()
        );
        summary.push((n, status, attempts, sent.elapsed(), why));
    }

    let received = server.requests();
    let first = &received[0].body;
    let first_attempts = summary[0].2 as usize;
    let identical = received[..first_attempts].iter().all(|r| r.body == *first);
    println!();
    println!("summary");
    println!("  request  status  attempts  time");
    for (n, status, attempts, took, why) in &summary {
        println!(
            "  {n:>7}  {:>6}  {attempts:>8}  {:>5.2}s{why}",
            status.as_u16(),
            took.as_secs_f64()
        );
    }
    println!(
        "  the server received {} requests; the {first_attempts} attempts of request 1 carried identical bodies: {identical}",
        received.len()
    );
    Ok(())
}
