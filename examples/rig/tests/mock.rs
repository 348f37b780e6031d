//! rig's Anthropic client over `RetryMiddleware`, against the crate's mock on 127.0.0.1 under
//! paused time.

use std::time::Duration;

use rig_core::client::CompletionClient;
use rig_core::completion::{AssistantContent, CompletionModel};
use rig_core::providers::anthropic;
use sha2::{Digest, Sha256};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::reqwest_middleware::RetryMiddleware;
use tower_llm_retry::retry::Jitter;
use tower_llm_retry::{RetryLayer, RetryPolicy};

#[tokio::test(start_paused = true)]
async fn rate_limit_then_success_through_rig() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("2"))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let http = reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder()
            .retry(reqwest::retry::never())
            .build()
            .unwrap(),
    )
    .with(RetryMiddleware::new(
        RetryLayer::new().policy(RetryPolicy::default().jitter(Jitter::none())),
    ))
    .build();
    let client = anthropic::Client::builder()
        .api_key("sk-ant-mock")
        .base_url(server.url(""))
        .http_client(http)
        .build()
        .unwrap();
    let model = client.completion_model("claude-sonnet-4-5");
    let request = model.completion_request("Hello").max_tokens(64).build();
    let response = model.completion(request).await.unwrap();

    let text: String = response
        .choice
        .into_iter()
        .filter_map(|c| match c {
            AssistantContent::Text(t) => Some(t.text),
            _ => None,
        })
        .collect();
    assert_eq!(text, "Hello!");
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2, "one 429, one retry: rig sent the call once");
    assert_eq!(
        reqs[1].received_at - reqs[0].received_at,
        Duration::from_secs(2)
    );
    let first: [u8; 32] = Sha256::digest(&reqs[0].body).into();
    for r in &reqs {
        assert_eq!(r.uri.path(), "/v1/messages");
        assert_eq!(r.headers["x-api-key"], "sk-ant-mock");
        let hash: [u8; 32] = Sha256::digest(&r.body).into();
        assert_eq!(hash, first);
        assert_eq!(r.json().unwrap()["model"], "claude-sonnet-4-5");
    }
}
