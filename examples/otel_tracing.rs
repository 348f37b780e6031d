//! The spans and events the layer emits, printed by a plain `tracing-subscriber` fmt layer.
//! Their field names follow the OpenTelemetry HTTP and GenAI semantic conventions
//! (`http.request.method`, `server.address`, `http.response.status_code`,
//! `http.request.resend_count`, `error.type`, `gen_ai.request.model`), so a
//! `tracing-opentelemetry` layer exports them as they are; no network is used here.
//!
//! ```text
//! cargo run --example otel_tracing --features mock
//! ```

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy};
use tracing_subscriber::fmt::format::FmtSpan;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter("tower_llm_retry=debug")
        .with_span_events(FmtSpan::CLOSE)
        .with_target(false)
        .with_ansi(false)
        .init();

    let server = MockServer::start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::rate_limited("0.2"))
            .then(Reply::success()),
    )
    .await?;
    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let llm = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().initial_backoff(Duration::from_millis(100))),
        )
        .service(client);
    let req = http::Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-ant-never-printed")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[]}"#,
        )))?;
    let res = llm.oneshot(req).await?;
    println!("final status: {}", res.status());
    Ok(())
}
