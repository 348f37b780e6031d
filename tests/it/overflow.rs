//! ContextOverflowLayer against the mock server: the exact Anthropic message repaired by the
//! formula and re-sent at once, byte for byte; overflows it cannot repair handed back with
//! their numbers.

use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, RecordedRequest, Reply, Script};
use tower_llm_retry::overflow::{ContextWindowExceeded, OverflowRepaired};
use tower_llm_retry::{ContextOverflowLayer, RetryBody, RetryLayer, RetryPolicy, RetryTrail};

type Response = http::Response<RetryBody<Incoming>>;

const BODY: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":64000,
 "messages":[{"role":"user","content":"a long conversation …"}],"stream":false}"#;

const THINKING: &str = r#"{"model":"claude-sonnet-4-5", "max_tokens": 64000, "thinking": {"type": "enabled", "budget_tokens": 49500}, "messages": []}"#;

async fn run(
    script: Script,
    layer: ContextOverflowLayer,
    body: &'static str,
) -> (MockServer, Response) {
    let server = MockServer::start(script).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(layer)
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), body))
        .await
        .unwrap();
    (server, res)
}

fn gap(seen: &[RecordedRequest]) -> Duration {
    seen[1].received_at - seen[0].received_at
}

#[tokio::test(start_paused = true)]
async fn max_tokens_overflow_is_repaired_and_resent_at_once() {
    let script = Script::new()
        .then(Reply::context_overflow(150_000, 64_000, 200_000))
        .then(Reply::success());
    let (server, res) = run(script, ContextOverflowLayer::new(), BODY).await;

    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(sha256(&seen[0].body), sha256(BODY.as_bytes()));
    // max(3,000, 200,000 − 150,000 − 1,000) = 49,000; nothing else changed.
    assert_only_value_changed(BODY.as_bytes(), &seen[1].body, "max_tokens", "49000");
    assert_eq!(gap(&seen), Duration::ZERO, "re-sent without a sleep");
    assert_eq!(
        res.extensions().get::<OverflowRepaired>(),
        Some(&OverflowRepaired::MaxTokens {
            from: 64_000,
            to: 49_000
        })
    );
    assert!(res.extensions().get::<ContextWindowExceeded>().is_none());
    // The repair is part of the first attempt: the retry loop saw one success.
    assert!(res.extensions().get::<RetryTrail>().is_none());
}

#[tokio::test(start_paused = true)]
async fn the_floor_and_the_margin_apply() {
    let script = Script::new()
        .then(Reply::context_overflow(196_000, 64_000, 200_000))
        .then(Reply::success());
    let (server, res) = run(script, ContextOverflowLayer::new(), BODY).await;
    assert_eq!(res.status(), StatusCode::OK);
    // 200,000 − 196,000 − 1,000 = 3,000, the floor.
    assert_only_value_changed(
        BODY.as_bytes(),
        &server.requests()[1].body,
        "max_tokens",
        "3000",
    );

    let script = Script::new()
        .then(Reply::context_overflow(150_000, 64_000, 200_000))
        .then(Reply::success());
    let layer = ContextOverflowLayer::new().floor(1_024).margin(5_000);
    let (server, _) = run(script, layer, BODY).await;
    assert_only_value_changed(
        BODY.as_bytes(),
        &server.requests()[1].body,
        "max_tokens",
        "45000",
    );
}

#[tokio::test(start_paused = true)]
async fn max_tokens_stays_above_the_thinking_budget() {
    let script = Script::new()
        .then(Reply::context_overflow(150_000, 64_000, 200_000))
        .then(Reply::success());
    let (server, res) = run(script, ContextOverflowLayer::new(), THINKING).await;
    assert_eq!(res.status(), StatusCode::OK);
    // The formula gives 49,000, but thinking needs 49,500 + 1.
    assert_only_value_changed(
        THINKING.as_bytes(),
        &server.requests()[1].body,
        "max_tokens",
        "49501",
    );
}

#[tokio::test(start_paused = true)]
async fn an_overflow_the_floor_cannot_fit_is_not_resent() {
    let script = Script::new().then(Reply::context_overflow(199_500, 64_000, 200_000));
    let (server, res) = run(script, ContextOverflowLayer::new(), BODY).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(server.request_count(), 1);
    let overflow = *res.extensions().get::<ContextWindowExceeded>().unwrap();
    assert_eq!(overflow.input_tokens, Some(199_500));
    assert_eq!(overflow.limit, Some(200_000));
    assert_eq!(overflow.max_tokens, Some(64_000));
}

#[tokio::test(start_paused = true)]
async fn a_prompt_too_long_is_handed_back_with_its_numbers() {
    for status in [400, 413] {
        let mut reply = Reply::prompt_too_long(210_000, 200_000);
        if status == 413 {
            reply = Reply::anthropic_error(
                413,
                "request_too_large",
                "prompt is too long: 210000 tokens > 200000 maximum",
            );
        }
        let (server, res) = run(Script::always(reply), ContextOverflowLayer::new(), BODY).await;
        assert_eq!(res.status().as_u16(), status);
        assert_eq!(server.request_count(), 1, "not re-sent, not retried");
        let overflow = *res.extensions().get::<ContextWindowExceeded>().unwrap();
        assert_eq!(
            (overflow.input_tokens, overflow.limit),
            (Some(210_000), Some(200_000))
        );
        assert!(res.extensions().get::<OverflowRepaired>().is_none());
        // The caller still reads the whole body, as the server sent it.
        let body: serde_json::Value = serde_json::from_slice(&body_bytes(res).await).unwrap();
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt is too long"));
    }
}

#[tokio::test(start_paused = true)]
async fn openai_context_length_exceeded_is_handed_back() {
    let reply = Reply::openai_error(
        400,
        "context_length_exceeded",
        "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.",
    );
    let (server, res) = run(Script::always(reply), ContextOverflowLayer::new(), BODY).await;
    assert_eq!(server.request_count(), 1);
    let overflow = *res.extensions().get::<ContextWindowExceeded>().unwrap();
    assert_eq!(
        (overflow.input_tokens, overflow.limit),
        (Some(130_000), Some(128_000))
    );
}

#[tokio::test(start_paused = true)]
async fn a_context_window_fallback_is_tried_once() {
    let script = Script::new()
        .then(Reply::prompt_too_long(210_000, 200_000))
        .then(Reply::success());
    let layer = ContextOverflowLayer::new().context_window_fallback("claude-sonnet-4-5-1m");
    let (server, res) = run(script, layer, BODY).await;
    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 2);
    assert_only_value_changed(
        BODY.as_bytes(),
        &seen[1].body,
        "model",
        "\"claude-sonnet-4-5-1m\"",
    );
    assert_eq!(gap(&seen), Duration::ZERO);
    assert_eq!(
        res.extensions().get::<OverflowRepaired>(),
        Some(&OverflowRepaired::Model {
            from: "claude-sonnet-4-5".into(),
            to: "claude-sonnet-4-5-1m".into()
        })
    );
}

#[tokio::test(start_paused = true)]
async fn a_repair_that_still_overflows_is_returned_after_one_resend() {
    let script = Script::always(Reply::context_overflow(150_000, 64_000, 200_000));
    let (server, res) = run(script, ContextOverflowLayer::new(), BODY).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(server.request_count(), 2);
    assert!(res.extensions().get::<OverflowRepaired>().is_some());
    assert!(res.extensions().get::<ContextWindowExceeded>().is_some());
}

#[tokio::test(start_paused = true)]
async fn other_400s_pass_through() {
    let reply = Reply::anthropic_error(400, "invalid_request_error", "messages: field required");
    let (server, res) = run(Script::always(reply), ContextOverflowLayer::new(), BODY).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(server.request_count(), 1);
    assert!(res.extensions().get::<ContextWindowExceeded>().is_none());
}

#[tokio::test(start_paused = true)]
async fn repairs_within_the_attempt_with_the_never_policy() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::context_overflow(150_000, 64_000, 200_000))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    // No retries: the repair is a re-send of the same attempt.
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::never()))
        .layer(ContextOverflowLayer::new())
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_only_value_changed(
        BODY.as_bytes(),
        &server.requests()[1].body,
        "max_tokens",
        "49000",
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_too_large_to_buffer_is_sent_once() {
    let server = MockServer::start(Script::always(Reply::context_overflow(
        150_000, 64_000, 200_000,
    )))
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::never())
                .body_limit(16),
        )
        .layer(ContextOverflowLayer::new())
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let seen = server.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(sha256(&seen[0].body), sha256(BODY.as_bytes()));
    // Not repaired, but still recognised for the caller.
    assert!(res.extensions().get::<ContextWindowExceeded>().is_some());
}
