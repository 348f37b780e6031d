//! The whole stack over hyper-util against a local mock LLM server: RetryLayer, then
//! ModelFallbackLayer, ContextOverflowLayer and AuthLayer, printing what each layer did.
//!
//! ```text
//! cargo run --example full_stack --features mock
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::{ApiKeyPool, AuthOutcome, RefreshingToken, Token};
use tower_llm_retry::fallback::ModelUsed;
use tower_llm_retry::mock::{MockServer, RecordedRequest, Reply, Script};
use tower_llm_retry::overflow::{ContextWindowExceeded, OverflowRepaired};
use tower_llm_retry::{
    AuthLayer, ContextOverflowLayer, ModelFallbackLayer, ReplayBody, RetryLayer, RetryPolicy,
    RetryTrail,
};

const BODY: &str = r#"{"model":"claude-opus-4-1","max_tokens":64000,"messages":[{"role":"user","content":"Summarise our conversation so far."}]}"#;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let start = Instant::now();
    // The layers' own account of what they do: INFO events (never a credential).
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_target(false)
        .with_ansi(false)
        .without_time()
        .compact()
        .init();

    // The provider: only the fresh token is accepted; then three overloads, a request whose
    // max_tokens does not fit, and a prompt that is too long whatever max_tokens says.
    let server = MockServer::start(
        Script::new()
            .require_header("authorization", ["Bearer tok-fresh"])
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::context_overflow(150_000, 64_000, 200_000))
            .then(Reply::success())
            .then(Reply::prompt_too_long(212_000, 200_000)),
    )
    .await?;

    // A token that the server no longer accepts; the refresh function gets a new one.
    let refreshes = Arc::new(AtomicUsize::new(0));
    let counter = refreshes.clone();
    let token = RefreshingToken::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            Ok::<_, std::io::Error>(Token::new("tok-fresh").expires_in(Duration::from_secs(3600)))
        }
    })
    .initial(Token::new("tok-expired"))?;

    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let llm = ServiceBuilder::new()
        // The default policy, with shorter backoff so the demo is quick.
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().initial_backoff(Duration::from_millis(100))),
        )
        .layer(ModelFallbackLayer::new([
            "claude-sonnet-4-5",
            "claude-haiku-4-5",
        ])?)
        .layer(ContextOverflowLayer::new())
        .layer(AuthLayer::new(token))
        .service(client);

    for n in 1..=2 {
        println!("request {n}");
        let req = Request::post(server.url("/v1/messages"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))?;
        let res = llm.clone().oneshot(req).await?;
        println!(
            "  {:>5.2}s  -> {}",
            start.elapsed().as_secs_f64(),
            res.status()
        );
        let ext = res.extensions();
        if let Some(used) = ext.get::<ModelUsed>() {
            println!(
                "           fallback   answered by {} (asked for {})",
                used.model, used.requested
            );
        }
        if let Some(OverflowRepaired::MaxTokens { from, to }) = ext.get::<OverflowRepaired>() {
            println!(
                "           overflow   max_tokens lowered from {from} to {to} and re-sent at once"
            );
        }
        if let Some(overflow) = ext.get::<ContextWindowExceeded>() {
            println!(
                "           overflow   the prompt does not fit ({} tokens, limit {}): compact it",
                overflow.input_tokens.unwrap_or_default(),
                overflow.limit.unwrap_or_default()
            );
        }
        if let Some(trail) = ext.get::<RetryTrail>() {
            println!(
                "           retry      {} attempt(s) in all",
                trail.total_attempts()
            );
        }
    }
    println!(
        "the expired token met a 401 on the first attempt; the refresh function ran {} time(s)",
        refreshes.load(Ordering::SeqCst)
    );

    println!();
    println!("what the server received");
    print_requests(&server.requests());

    // A pool of two keys: the first is rate-limited, the request moves to the second at once.
    println!();
    println!("a key pool");
    let pool_server = MockServer::start(Script::new().when(|req| {
        (req.headers["x-api-key"] == "sk-ant-first").then(|| Reply::rate_limited("30"))
    }))
    .await?;
    let pooled = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(AuthLayer::new(ApiKeyPool::new([
            "sk-ant-first",
            "sk-ant-second",
        ])?))
        .service(Client::builder(TokioExecutor::new()).build_http::<ReplayBody>());
    let req = Request::post(pool_server.url("/v1/messages"))
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))?;
    let res = pooled.oneshot(req).await?;
    let auth = res
        .extensions()
        .get::<AuthOutcome>()
        .copied()
        .unwrap_or_default();
    println!(
        "  -> {} from key #{}, after {} rotation(s), {} request(s) at the server",
        res.status(),
        auth.key_index.unwrap_or(0),
        auth.rotations,
        pool_server.request_count()
    );
    Ok(())
}

fn print_requests(requests: &[RecordedRequest]) {
    println!("  #  credential  model              max_tokens");
    for (i, r) in requests.iter().enumerate() {
        let json = r.json().unwrap_or_default();
        // Which token, never the token itself.
        let credential = match r.headers.get("authorization").map(|v| v.as_bytes()) {
            Some(b"Bearer tok-fresh") => "fresh",
            Some(_) => "expired",
            None => "none",
        };
        println!(
            "  {:<2} {:<11} {:<18} {}",
            i + 1,
            credential,
            json["model"].as_str().unwrap_or("-"),
            json["max_tokens"]
        );
    }
}
