//! A streamed request whose first attempt fails in-band (`HTTP 200`, then `event: error`
//! `overloaded_error` before any output). The layer retries it transparently: the caller only
//! ever sees the clean second stream, and after the first token nothing would be re-sent.
//!
//! ```text
//! cargo run --example streaming --features mock
//! ```

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{sse, MockServer, Reply, Script, SseFrame};
use tower_llm_retry::retry::{RetryEvent, RetryObserver};
use tower_llm_retry::stream::StreamCommitted;
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

#[derive(Debug)]
struct Print(Instant);

impl RetryObserver for Print {
    fn on_retry(&self, e: &RetryEvent<'_>) {
        println!(
            "{:>6.2}s  attempt {} failed before any output ({}), retrying in {:.2?}",
            self.0.elapsed().as_secs_f64(),
            e.attempt,
            e.class,
            e.delay
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let start = Instant::now();
    let failing = vec![
        sse::anthropic_message(&[])[0].clone(), // message_start
        SseFrame::new("ping", r#"{"type": "ping"}"#),
        sse::anthropic_error("overloaded_error").after(Duration::from_millis(100)),
    ];
    let good: Vec<SseFrame> = sse::anthropic_message(&["Streams ", "survive ", "overloads."])
        .into_iter()
        .map(|e| e.after(Duration::from_millis(150)))
        .collect();
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse(failing))
            .then(Reply::sse(good)),
    )
    .await?;

    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let stack = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().initial_backoff(Duration::from_millis(300)))
                .observer(Print(start)),
        )
        .service(client);

    let req = Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"claude-sonnet-4-5","max_tokens":256,"stream":true,"messages":[{"role":"user","content":"Hi"}]}"#,
        )))?;
    let res = stack.oneshot(req).await?;
    let commit = res.extensions().get::<StreamCommitted>().copied();
    let attempts = res
        .extensions()
        .get::<RetryTrail>()
        .map_or(1, |t| t.total_attempts());
    println!(
        "{:>6.2}s  response handed up: {} after {attempts} attempts, committed: {:?}",
        start.elapsed().as_secs_f64(),
        res.status(),
        commit.map(|c| c.reason)
    );

    let mut body = res.into_body();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            let text = String::from_utf8_lossy(&data);
            let first = text.lines().next().unwrap_or("");
            println!("{:>6.2}s  {first}", start.elapsed().as_secs_f64());
        }
    }
    println!(
        "server saw {} requests; the caller saw one clean stream",
        server.request_count()
    );
    Ok(())
}
