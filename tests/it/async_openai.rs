//! async-openai's `Client::with_http_service` over the stack (`async_openai::HttpService`),
//! driven through async-openai's chat API against the mock over 127.0.0.1 under paused time.

use std::time::Duration;

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::ChatCompletionResponseStream;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessage, CreateChatCompletionRequest, CreateChatCompletionRequestArgs,
};
use async_openai::Client;
use futures_util::StreamExt;
use tower::ServiceBuilder;
use tower_llm_retry::async_openai::HttpService;
use tower_llm_retry::mock::{sse, MockServer, Reply, Script, SseFrame};
use tower_llm_retry::reqwest::ReqwestService;
use tower_llm_retry::retry::Jitter;
use tower_llm_retry::{Error, ErrorKind, RetryLayer, RetryPolicy};

use crate::common::*;

fn request() -> CreateChatCompletionRequest {
    CreateChatCompletionRequestArgs::default()
        .model("gpt-4o-mini")
        .max_completion_tokens(64u32)
        .messages([ChatCompletionRequestUserMessage::from("Hello, world").into()])
        .build()
        .unwrap()
}

fn client(server: &MockServer, policy: RetryPolicy) -> Client<OpenAIConfig> {
    let stack = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy))
        .service(ReqwestService::new(reqwest_builder().build().unwrap()));
    Client::with_config(config(server)).with_http_service(HttpService::new(stack))
}

fn config(server: &MockServer) -> OpenAIConfig {
    OpenAIConfig::new()
        .with_api_base(server.url("/v1"))
        .with_api_key("sk-test")
}

fn policy() -> RetryPolicy {
    RetryPolicy::default().jitter(Jitter::none())
}

/// The hash of every body the server received, each checked against `sent`.
fn assert_bodies(server: &MockServer, sent: &[u8]) {
    let reqs = server.requests();
    assert!(!reqs.is_empty());
    for r in &reqs {
        assert_eq!(r.uri.path(), "/v1/chat/completions");
        assert_eq!(sha256(&r.body), sha256(sent));
    }
}

#[tokio::test(start_paused = true)]
async fn rate_limit_then_success_sends_identical_bodies_and_waits_retry_after() {
    let server = MockServer::start(
        Script::new()
            .then(
                Reply::openai_error(429, "rate_limit_exceeded", "Slow down")
                    .header("retry-after", "2"),
            )
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let response = client(&server, policy())
        .chat()
        .create(request())
        .await
        .unwrap();
    assert_eq!(response.model, "gpt-4o-mini");
    assert_eq!(server.request_count(), 2);
    assert_bodies(&server, &serde_json::to_vec(&request()).unwrap());
    let reqs = server.requests();
    assert_eq!(
        reqs[1].received_at - reqs[0].received_at,
        Duration::from_secs(2)
    );
}

#[tokio::test(start_paused = true)]
async fn its_own_retry_layer_does_not_run() {
    // One retry allowed: the server sees exactly two attempts, and async-openai gets the
    // last answer (its own layer, had it run too, would have sent each call 4 times).
    let server = MockServer::start(Script::always(Reply::openai_error(
        503,
        "server_error",
        "The server is overloaded",
    )))
    .await
    .unwrap();
    let err = client(&server, policy().max_retries(1))
        .chat()
        .create(request())
        .await
        .unwrap_err();
    assert!(matches!(err, OpenAIError::ApiError(_)), "{err:?}");
    assert_eq!(server.request_count(), 2);
    assert_bodies(&server, &serde_json::to_vec(&request()).unwrap());

    // The same answers through async-openai's default client: its layer's 3 retries.
    let server = MockServer::start(Script::always(Reply::openai_error(
        503,
        "server_error",
        "The server is overloaded",
    )))
    .await
    .unwrap();
    let err = Client::with_config(config(&server))
        .chat()
        .create(request())
        .await
        .unwrap_err();
    assert!(matches!(err, OpenAIError::ApiError(_)), "{err:?}");
    assert_eq!(server.request_count(), 4);
}

#[tokio::test(start_paused = true)]
async fn stack_errors_downcast_to_the_crate_error() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let err = client(&server, policy().max_retries(2))
        .chat()
        .create(request())
        .await
        .unwrap_err();
    let OpenAIError::Boxed(boxed) = err else {
        panic!("not the stack's error: {err:?}");
    };
    let err = boxed.downcast::<Error>().unwrap();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    assert_eq!(err.trail().unwrap().total_attempts(), 3);
    assert_eq!(server.request_count(), 3);
}

fn streamed_request() -> Vec<u8> {
    let mut request = request();
    request.stream = Some(true);
    serde_json::to_vec(&request).unwrap()
}

#[tokio::test(start_paused = true)]
async fn stream_error_before_output_is_retried() {
    let good = sse::openai_chat(&["Hi", " there"]);
    let bad = vec![
        good[0].clone(),
        SseFrame::data(
            r#"{"error":{"message":"The server is overloaded","type":"server_error","param":null,"code":null}}"#,
        ),
    ];
    let server = MockServer::start(Script::new().then(Reply::sse(bad)).then(Reply::sse(good)))
        .await
        .unwrap();
    let stream = client(&server, policy())
        .chat()
        .create_stream(request())
        .await
        .unwrap();
    let (text, err) = collect_stream(stream).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(text, "Hi there");
    assert_eq!(server.request_count(), 2);
    assert_bodies(&server, &streamed_request());
}

#[tokio::test(start_paused = true)]
async fn stream_cut_after_output_is_an_error() {
    let partial = sse::openai_chat(&["Hi", " there"])[..2].to_vec();
    let server = MockServer::start(Script::always(Reply::sse_then_reset(partial)))
        .await
        .unwrap();
    let stream = client(&server, policy())
        .chat()
        .create_stream(request())
        .await
        .unwrap();
    let (text, err) = collect_stream(stream).await;
    assert_eq!(text, "Hi");
    assert!(
        matches!(err, Some(OpenAIError::StreamError(_))),
        "the stream ends in an error: {err:?}"
    );
    assert_eq!(server.request_count(), 1);
}

/// The text of every chunk until the stream ends, and the error it ended with, if any.
async fn collect_stream(mut stream: ChatCompletionResponseStream) -> (String, Option<OpenAIError>) {
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(chunk) => {
                for choice in chunk.choices {
                    text.push_str(choice.delta.content.as_deref().unwrap_or(""));
                }
            }
            Err(e) => return (text, Some(e)),
        }
    }
    (text, None)
}
