//! One attempt pipeline: the companion layers inside `RetryLayer` leave their re-sends and
//! final words to its loop. What is final stays final under a classifier that would retry
//! everything; a companion's re-send is the same attempt (no backoff, no budget, not in the
//! trail, the fleet does not learn from the answer it replaces); a repair made once is carried
//! by every later attempt. Real HTTP on 127.0.0.1, paused time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::{ApiKeyPool, AuthOutcome, RefreshingToken, Token};
use tower_llm_retry::classify::{Classification, Classify, FailureClass};
use tower_llm_retry::fallback::{FallbackMode, ModelUsed};
use tower_llm_retry::fleet::{Fleet, GateConfig};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::overflow::OverflowRepaired;
use tower_llm_retry::retry::{GiveUpReason, NoRetry};
use tower_llm_retry::{
    AuthLayer, ContextOverflowLayer, ErrorKind, ModelFallbackLayer, RetryLayer, RetryTrail,
};

/// A classifier that retries every failure, with or without a response: the contracts of the
/// companion layers must hold without its help.
#[derive(Clone, Copy, Debug)]
struct RetryEverything;

impl Classify for RetryEverything {
    fn classify_response(
        &self,
        head: &http::response::Parts,
        _body: Option<&[u8]>,
    ) -> Classification {
        if head.status.is_success() {
            return Classification::success();
        }
        let class = FailureClass::from_status(head.status).unwrap_or(FailureClass::Other);
        Classification::retry(class)
    }

    fn classify_error(&self, _error: &(dyn std::error::Error + 'static)) -> Classification {
        Classification::retry(FailureClass::Transport)
    }
}

fn retry_everything() -> RetryLayer<RetryEverything> {
    RetryLayer::new()
        .policy(exact_policy())
        .classifier(RetryEverything)
}

#[tokio::test(start_paused = true)]
async fn a_failed_refresh_ends_the_request_under_a_classifier_that_retries_everything() {
    let server = MockServer::start(Script::always(Reply::unauthorized()))
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Err::<Token, _>(std::io::Error::other("identity provider down")) }
    });
    let svc = ServiceBuilder::new()
        .layer(retry_everything())
        .layer(AuthLayer::new(source))
        .service(http_client());
    let started = Instant::now();
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();

    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(server.request_count(), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(started.elapsed(), Duration::ZERO);
    let trail = err.trail().expect("the trail of the one attempt");
    assert_eq!(trail.total_attempts(), 1);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::NotRetryable));
}

#[tokio::test(start_paused = true)]
async fn a_fallback_signal_ends_the_request_under_a_classifier_that_retries_everything() {
    let server = MockServer::start(Script::always(Reply::overloaded()))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(retry_everything())
        .layer(
            ModelFallbackLayer::new(["claude-haiku-4-5"])
                .unwrap()
                .mode(FallbackMode::Signal),
        )
        .service(http_client());
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();

    assert_eq!(err.kind(), ErrorKind::FallbackTriggered);
    // Three overloads, the threshold, and not one attempt more.
    assert_eq!(server.request_count(), 3);
    let trail = err.trail().unwrap();
    assert_eq!(trail.total_attempts(), 3);
    assert!(trail
        .attempts()
        .iter()
        .all(|a| a.class == FailureClass::Overloaded));
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_chain_returns_the_overload_under_a_classifier_that_retries_everything() {
    let server = MockServer::start(Script::always(Reply::overloaded()))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(retry_everything())
        .layer(ModelFallbackLayer::new(["claude-haiku-4-5"]).unwrap())
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();

    assert_eq!(res.status().as_u16(), 529);
    // Three on the requested model, three on the last of the chain, then the answer as it is
    // (the policy would allow eleven).
    let models: Vec<String> = server
        .requests()
        .iter()
        .map(|r| r.json().unwrap()["model"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        models,
        [
            "claude-sonnet-4-5",
            "claude-sonnet-4-5",
            "claude-sonnet-4-5",
            "claude-haiku-4-5",
            "claude-haiku-4-5",
            "claude-haiku-4-5",
        ]
    );
    let used = res.extensions().get::<ModelUsed>().unwrap();
    assert!(used.chain_exhausted);
    assert_eq!(used.model, "claude-haiku-4-5");
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 6);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::NotRetryable));
}

#[tokio::test(start_paused = true)]
async fn a_refresh_is_not_an_attempt_and_happens_for_a_request_allowed_no_retries() {
    let server =
        MockServer::start(Script::new().require_header("authorization", ["Bearer tok-new"]))
            .await
            .unwrap();
    let source = RefreshingToken::new(|| async {
        Ok::<_, std::io::Error>(Token::new("tok-new").expires_in(Duration::from_secs(3600)))
    })
    .initial(Token::new("tok-old").expires_in(Duration::from_secs(3600)))
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut().insert(NoRetry);
    let started = Instant::now();
    let res = svc.oneshot(req).await.unwrap();

    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
    assert_eq!(started.elapsed(), Duration::ZERO);
    let seen = server.requests();
    assert_eq!(sha256(&seen[0].body), sha256(BODY.as_bytes()));
    assert_eq!(sha256(&seen[1].body), sha256(BODY.as_bytes()));
    assert!(res.extensions().get::<AuthOutcome>().unwrap().refreshed);
    // One attempt, as far as the loop is concerned.
    assert!(res.extensions().get::<RetryTrail>().is_none());
}

#[tokio::test(start_paused = true)]
async fn a_repair_is_carried_by_every_later_attempt() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::context_overflow(197_000, 21_333, 200_000))
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":21333,"messages":[]}"#;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(ContextOverflowLayer::new())
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), body))
        .await
        .unwrap();

    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 3);
    assert_eq!(sha256(&seen[0].body), sha256(body.as_bytes()));
    // The repair went out at once, and the retry after the overload kept it.
    assert_eq!(seen[1].received_at, seen[0].received_at);
    assert_only_value_changed(body.as_bytes(), &seen[1].body, "max_tokens", "3000");
    assert_eq!(sha256(&seen[2].body), sha256(&seen[1].body));
    assert_eq!(
        res.extensions().get::<OverflowRepaired>(),
        Some(&OverflowRepaired::MaxTokens {
            from: 21_333,
            to: 3_000
        })
    );
    // Two attempts: the repair's re-send is part of the first.
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 2);
    assert_eq!(trail.attempts()[0].class, FailureClass::Overloaded);
}

#[tokio::test(start_paused = true)]
async fn a_rotated_429_does_not_close_the_gate_for_the_other_keys() {
    let server = MockServer::start(
        Script::new()
            .when(|req| (req.headers["x-api-key"] == "sk-a").then(|| Reply::rate_limited("30"))),
    )
    .await
    .unwrap();
    let fleet = Fleet::builder()
        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
        .build();
    let fleet_layer = RetryLayer::new()
        .policy(exact_policy())
        .fleet(fleet.clone());
    let svc = ServiceBuilder::new()
        .layer(fleet_layer)
        .layer(AuthLayer::new(ApiKeyPool::new(["sk-a", "sk-b"]).unwrap()))
        .service(http_client());
    let url = server.url("/v1/messages");
    let started = Instant::now();
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The scope the request used (the upstream's, the credential being set inside) did not
    // close its gate: read it directly, not summed over the fleet.
    let scope = fleet.scope_for(&anthropic_request(&url, BODY));
    assert_eq!(
        scope.scope_upstream(),
        Some(server.addr().to_string().as_str())
    );
    assert_eq!(scope.gate_closings(), Some(0));
    assert_eq!(scope.gate_closed_until(), None);
    // The 429 was the pool's to handle: the next request is not held at the gate.
    let res = svc.oneshot(anthropic_request(&url, BODY)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(server.request_count(), 3);
    // The fleet's read-outs report over its scopes (here the upstream's, the credential
    // being set inside): both requests counted, and no closing.
    assert_eq!(fleet.budget_stats().unwrap().first_attempts, 2);
    assert_eq!(fleet.gate_closings(), Some(0));
    assert_eq!(fleet.gate_closed_until(), None);
    assert_eq!(fleet.scopes().len(), 1);
    assert_eq!(scope.budget_stats().unwrap().first_attempts, 2);
}

#[tokio::test(start_paused = true)]
async fn a_rewritten_body_goes_out_with_its_own_content_length() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::context_overflow(197_000, 21_333, 200_000))
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":21333,"messages":[]}"#;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(
            ModelFallbackLayer::new(["claude-haiku-4-5"])
                .unwrap()
                .threshold(1)
                .unwrap(),
        )
        .layer(ContextOverflowLayer::new())
        .service(http_client());
    let mut req = anthropic_request(&server.url("/v1/messages"), body);
    req.headers_mut()
        .insert(http::header::CONTENT_LENGTH, body.len().into());
    let res = svc.oneshot(req).await.unwrap();

    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 3);
    // Each body arrived whole (a stale length would cut or stall it), and says so.
    for r in &seen {
        assert!(r.json().is_ok(), "{:?}", String::from_utf8_lossy(&r.body));
        assert_eq!(
            r.headers["content-length"],
            r.body.len().to_string().as_str()
        );
    }
    assert_only_value_changed(body.as_bytes(), &seen[1].body, "max_tokens", "3000");
    assert_eq!(seen[2].json().unwrap()["model"], "claude-haiku-4-5");
    assert_eq!(seen[2].json().unwrap()["max_tokens"], 3000);
}
