//! ModelFallbackLayer inside RetryLayer, against the mock server: which model each attempt
//! went to, byte for byte, and what the caller gets back.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::fallback::{FallbackMode, FallbackTriggered, ModelUsed};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::GiveUpReason;
use tower_llm_retry::{
    ContextOverflowLayer, ErrorKind, ModelFallbackLayer, RetryLayer, RetryPolicy, RetryTrail,
};

/// Pretty-printed, with a nested `"model"` that must never change.
const OPUS: &str = r#"{
  "model" : "claude-opus-4-1",
  "max_tokens": 8192,
  "system": [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
  "messages": [{"role": "user", "content": "Name a \"model\" of car. \u00e9"}],
  "metadata": {"model": "not this one"}
}"#;

const OPUS_MODEL: &str = "claude-opus-4-1";
const SONNET: &str = "claude-sonnet-4-5";
const HAIKU: &str = "claude-haiku-4-5";

fn models_sent(server: &MockServer) -> Vec<String> {
    server
        .requests()
        .iter()
        .map(|r| r.json().unwrap()["model"].as_str().unwrap().to_owned())
        .collect()
}

async fn start(script: Script) -> MockServer {
    MockServer::start(script).await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn three_overloads_send_the_fourth_attempt_to_the_fallback() {
    let server = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(ModelFallbackLayer::new([SONNET, HAIKU]).unwrap())
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();

    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        models_sent(&server),
        [OPUS_MODEL, OPUS_MODEL, OPUS_MODEL, SONNET]
    );
    let seen = server.requests();
    for r in &seen[..3] {
        assert_eq!(sha256(&r.body), sha256(OPUS.as_bytes()));
    }
    assert_only_value_changed(
        OPUS.as_bytes(),
        &seen[3].body,
        "model",
        "\"claude-sonnet-4-5\"",
    );
    // Headers are the caller's, on every attempt.
    assert!(seen
        .iter()
        .all(|r| r.headers["anthropic-version"] == "2023-06-01"));

    let used = res.extensions().get::<ModelUsed>().unwrap();
    assert_eq!(used.model, SONNET);
    assert_eq!(used.requested, OPUS_MODEL);
    assert!(used.is_fallback());
    assert!(!used.chain_exhausted);
    assert_eq!(
        res.extensions()
            .get::<RetryTrail>()
            .unwrap()
            .total_attempts(),
        4
    );
    let body: serde_json::Value = serde_json::from_slice(&body_bytes(res).await).unwrap();
    assert_eq!(
        body["model"], SONNET,
        "the mock echoes the model it was sent"
    );
}

#[tokio::test(start_paused = true)]
async fn another_failure_resets_the_count() {
    let server = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::status(503))
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(ModelFallbackLayer::new([SONNET]).unwrap())
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // Four overloads in five attempts, never three in a row: the primary every time.
    assert_eq!(models_sent(&server), [OPUS_MODEL; 5]);
    assert!(server
        .requests()
        .iter()
        .all(|r| sha256(&r.body) == sha256(OPUS.as_bytes())));
    assert!(!res.extensions().get::<ModelUsed>().unwrap().is_fallback());
}

#[tokio::test(start_paused = true)]
async fn the_chain_is_followed_model_by_model() {
    let server = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(
            ModelFallbackLayer::new([SONNET, HAIKU])
                .unwrap()
                .threshold(2)
                .unwrap(),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        models_sent(&server),
        [OPUS_MODEL, OPUS_MODEL, SONNET, SONNET, HAIKU]
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_for_a_chain_model_falls_back_to_the_models_after_it() {
    let server = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(
            ModelFallbackLayer::new([SONNET, HAIKU])
                .unwrap()
                .threshold(1)
                .unwrap(),
        )
        .service(http_client());
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":10}"#;
    svc.oneshot(anthropic_request(&server.url("/v1/messages"), body))
        .await
        .unwrap();
    assert_eq!(models_sent(&server), [SONNET, HAIKU]);
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_chain_returns_the_last_response_with_the_trail() {
    let server = start(Script::always(Reply::overloaded())).await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(
            ModelFallbackLayer::new([SONNET])
                .unwrap()
                .threshold(2)
                .unwrap(),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 529);
    assert_eq!(
        models_sent(&server),
        [OPUS_MODEL, OPUS_MODEL, SONNET, SONNET]
    );
    let used = res.extensions().get::<ModelUsed>().unwrap().clone();
    assert_eq!(used.model, SONNET);
    assert!(used.chain_exhausted);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 4);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::NotRetryable));
    assert!(trail
        .attempts()
        .iter()
        .all(|a| a.class == FailureClass::Overloaded));
    // The body is the server's, unchanged.
    let body: serde_json::Value = serde_json::from_slice(&body_bytes(res).await).unwrap();
    assert_eq!(body["error"]["type"], "overloaded_error");
}

#[tokio::test(start_paused = true)]
async fn sticky_mode_keeps_later_requests_on_the_fallback_for_the_cooldown() {
    let server = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .otherwise(Reply::success()),
    )
    .await;
    let layer = ModelFallbackLayer::new([SONNET])
        .unwrap()
        .sticky(Duration::from_secs(300));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(layer)
        .service(http_client());
    let url = server.url("/v1/messages");
    svc.clone()
        .oneshot(anthropic_request(&url, OPUS))
        .await
        .unwrap();
    // A later request starts on the fallback, and a clone of the stack shares that.
    tokio::time::sleep(Duration::from_secs(200)).await;
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, OPUS))
        .await
        .unwrap();
    assert!(res.extensions().get::<ModelUsed>().unwrap().is_fallback());
    // After the cooldown, the primary again.
    tokio::time::sleep(Duration::from_secs(101)).await;
    let res = svc.oneshot(anthropic_request(&url, OPUS)).await.unwrap();
    assert!(!res.extensions().get::<ModelUsed>().unwrap().is_fallback());
    assert_eq!(
        models_sent(&server),
        [OPUS_MODEL, OPUS_MODEL, OPUS_MODEL, SONNET, SONNET, OPUS_MODEL]
    );
}

#[tokio::test(start_paused = true)]
async fn without_sticky_mode_the_next_request_tries_the_primary() {
    let server = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .otherwise(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(ModelFallbackLayer::new([SONNET]).unwrap())
        .service(http_client());
    let url = server.url("/v1/messages");
    svc.clone()
        .oneshot(anthropic_request(&url, OPUS))
        .await
        .unwrap();
    svc.oneshot(anthropic_request(&url, OPUS)).await.unwrap();
    assert_eq!(
        models_sent(&server),
        [OPUS_MODEL, OPUS_MODEL, OPUS_MODEL, SONNET, OPUS_MODEL]
    );
}

#[tokio::test(start_paused = true)]
async fn signal_mode_ends_the_request_with_the_models_to_switch() {
    let server = start(Script::always(Reply::overloaded())).await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(
            ModelFallbackLayer::new([SONNET])
                .unwrap()
                .mode(FallbackMode::Signal),
        )
        .service(http_client());
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FallbackTriggered);
    let signal = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<FallbackTriggered>())
        .unwrap();
    assert_eq!(
        (signal.from.as_str(), signal.to.as_str()),
        (OPUS_MODEL, SONNET)
    );
    // Three attempts, all to the requested model, and no sleep after the third.
    assert_eq!(models_sent(&server), [OPUS_MODEL; 3]);
    let trail = err.trail().unwrap();
    assert_eq!(trail.total_attempts(), 3);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::NotRetryable));
    assert_eq!(trail.attempts()[2].delay, None);
}

#[tokio::test(start_paused = true)]
async fn an_overloaded_error_body_counts_as_an_overload() {
    // A 500 whose body says overloaded_error: the layer reads the body to tell.
    let overloaded_500 = Reply::anthropic_error(500, "overloaded_error", "Overloaded");
    let server = start(Script::always(overloaded_500)).await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(
            ModelFallbackLayer::new([SONNET])
                .unwrap()
                .threshold(1)
                .unwrap()
                .mode(FallbackMode::Signal),
        )
        .service(http_client());
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FallbackTriggered);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_body_without_a_model_passes_through() {
    let server = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(ModelFallbackLayer::new([SONNET]).unwrap())
        .service(http_client());
    let body = r#"{"max_tokens":10,"messages":[]}"#;
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), body))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.extensions().get::<ModelUsed>().is_none());
    assert!(server
        .requests()
        .iter()
        .all(|r| &r.body[..] == body.as_bytes()));
}

#[tokio::test(start_paused = true)]
async fn works_with_the_never_policy() {
    let server = start(Script::new()).await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::never()))
        .layer(ModelFallbackLayer::new([SONNET]).unwrap())
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        res.extensions().get::<ModelUsed>().unwrap().model,
        OPUS_MODEL
    );
    assert_eq!(sha256(&server.requests()[0].body), sha256(OPUS.as_bytes()));
}

#[tokio::test(start_paused = true)]
async fn model_used_names_the_model_a_context_window_fallback_went_to() {
    // The fallback layer sends the requested model; the overflow layer inside it re-sends the
    // request to a larger-context model, and that is the model the response came from.
    let server = start(
        Script::new()
            .then(Reply::prompt_too_long(210_000, 200_000))
            .then(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(ModelFallbackLayer::new([SONNET]).unwrap())
        .layer(ContextOverflowLayer::new().context_window_fallback("claude-opus-4-1-1m"))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(models_sent(&server), [OPUS_MODEL, "claude-opus-4-1-1m"]);
    let used = res.extensions().get::<ModelUsed>().unwrap();
    assert_eq!(used.model, "claude-opus-4-1-1m");
    assert_eq!(used.requested, OPUS_MODEL);
    assert!(used.is_fallback());
}

#[test]
fn configuration_is_validated() {
    assert!(ModelFallbackLayer::new(Vec::<String>::new()).is_err());
    assert!(ModelFallbackLayer::new([""]).is_err());
    assert!(ModelFallbackLayer::new([SONNET])
        .unwrap()
        .threshold(0)
        .is_err());
}

/// Calls a `400` whose body carries the marker `Overloaded` an overload, as a gateway that
/// wraps the provider's overloads in its own `400`s would need.
#[derive(Debug, Clone, Default)]
struct GatewayOverloads(tower_llm_retry::classify::DefaultClassifier);

impl tower_llm_retry::classify::Classify for GatewayOverloads {
    fn classify_response(
        &self,
        head: &http::response::Parts,
        body: Option<&[u8]>,
    ) -> tower_llm_retry::classify::Classification {
        let marked = body.is_some_and(|b| b.windows(10).any(|w| w == b"Overloaded"));
        if head.status == StatusCode::BAD_REQUEST && marked {
            return tower_llm_retry::classify::Classification::retry(FailureClass::Overloaded);
        }
        self.0.classify_response(head, body)
    }

    fn classify_error(
        &self,
        error: &(dyn std::error::Error + 'static),
    ) -> tower_llm_retry::classify::Classification {
        self.0.classify_error(error)
    }
}

#[tokio::test(start_paused = true)]
async fn a_custom_classifier_steers_the_fallback_trigger() {
    let script = || {
        Script::new()
            .then(Reply::status(400).body(r#"{"error":{"message":"upstream Overloaded"}}"#))
            .then(Reply::success())
    };
    // The classifier calls the marked 400 an overload: with a threshold of 1, the retry goes
    // to the fallback model.
    let server = start(script()).await;
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(exact_policy())
                .classifier(GatewayOverloads::default()),
        )
        .layer(
            ModelFallbackLayer::new([SONNET])
                .unwrap()
                .threshold(1)
                .unwrap(),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(models_sent(&server), [OPUS_MODEL, SONNET]);
    let used = res.extensions().get::<ModelUsed>().unwrap();
    assert_eq!(used.model, SONNET);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.attempts()[0].class, FailureClass::Overloaded);

    // The default classifier calls it a plain 400: no retry, no fallback.
    let server = start(script()).await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(
            ModelFallbackLayer::new([SONNET])
                .unwrap()
                .threshold(1)
                .unwrap(),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(models_sent(&server), [OPUS_MODEL]);
}
