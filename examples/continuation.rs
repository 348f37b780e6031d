//! Continues an answer that stopped at `max_tokens`, against a local mock server that cuts its
//! answer twice, then shows a truncated tool call being handed back unrun.
//!
//! ```text
//! cargo run --example continuation --features mock,continuation
//! ```

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::continuation::{Continued, TruncatedToolCall};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{ContinuationLayer, ReplayBody, RetryLayer};

fn answer(content: Value, stop: &str) -> Reply {
    Reply::success().json(json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": content, "stop_reason": stop, "stop_sequence": null,
        "usage": {"input_tokens": 25, "output_tokens": 12}
    }))
}

fn text(t: &str) -> Value {
    json!([{"type": "text", "text": t}])
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), tower_llm_retry::BoxError> {
    let server = MockServer::start(
        Script::new()
            .then(answer(text("Foxes are small omnivores "), "max_tokens"))
            .then(answer(text("of the dog family, found on "), "max_tokens"))
            .then(answer(text("every continent but Antarctica."), "end_turn"))
            .then(answer(
                json!([{"type": "text", "text": "Removing the files."},
                       {"type": "tool_use", "id": "toolu_1", "name": "delete_files", "input": {}}]),
                "max_tokens",
            )),
    )
    .await?;

    let http = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let client = ServiceBuilder::new()
        .layer(ContinuationLayer::new())
        .layer(RetryLayer::new())
        .service(http);

    let request = || {
        Request::post(server.uri("/v1/messages"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"model":"claude-sonnet-4-5","max_tokens":12,"messages":[{"role":"user","content":"Tell me about foxes."}]}"#,
            )))
    };

    let response = client.clone().oneshot(request()?).await?;
    let continued = *response.extensions().get::<Continued>().expect("continued");
    let body: Value = serde_json::from_slice(&response.into_body().collect().await?.to_bytes())?;
    println!(
        "answer after {} follow-ups (complete: {}):\n  {}",
        continued.rounds, continued.complete, body["content"][0]["text"]
    );
    println!(
        "  stop_reason {}, usage {}",
        body["stop_reason"], body["usage"]
    );
    for (i, req) in server.requests().iter().enumerate() {
        let messages = req.json()?["messages"].as_array().map_or(0, Vec::len);
        println!(
            "  request {i}: {} bytes, {messages} messages",
            req.body.len()
        );
    }

    let response = client.oneshot(request()?).await?;
    if let Some(call) = response.extensions().get::<TruncatedToolCall>() {
        println!(
            "cut-off tool call {:?} returned as is, not continued, not to be run",
            call.name.as_deref().unwrap_or("?")
        );
    }
    println!("{} requests in all", server.request_count());
    Ok(())
}
