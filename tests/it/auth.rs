//! AuthLayer against the mock server: the credentials the server saw on each request, the
//! bytes it received, how often the refresh function ran, and what the caller gets back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::task::JoinSet;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::{ApiKeyPool, AuthOutcome, CredentialHeader, RefreshingToken, Token};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{
    ApiKey, AuthLayer, ErrorKind, ReplayBody, RetryLayer, RetryPolicy, RetryTrail,
};

/// A refreshing source that starts with `tok-old` and hands out `tok-new-1`, `tok-new-2`, …,
/// counting its calls; each call takes 10 ms, so concurrent requests pile up behind it.
fn refreshing(fail: bool) -> (RefreshingToken, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if fail {
                Err(std::io::Error::other("identity provider down"))
            } else {
                Ok(Token::new(format!("tok-new-{n}")).expires_in(Duration::from_secs(3600)))
            }
        }
    })
    .initial(Token::new("tok-old").expires_in(Duration::from_secs(3600)))
    .unwrap();
    (source, calls)
}

fn seen_header(server: &MockServer, name: &str) -> Vec<String> {
    server
        .requests()
        .iter()
        .map(|r| r.headers[name].to_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_401_refreshes_once_and_resends_the_same_bytes() {
    let server =
        MockServer::start(Script::new().require_header("authorization", ["Bearer tok-new-1"]))
            .await
            .unwrap();
    let (source, calls) = refreshing(false);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();

    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        seen_header(&server, "authorization"),
        ["Bearer tok-old", "Bearer tok-new-1"]
    );
    let seen = server.requests();
    assert!(seen
        .iter()
        .all(|r| sha256(&r.body) == sha256(BODY.as_bytes())));
    assert!(seen
        .iter()
        .all(|r| r.headers["anthropic-version"] == "2023-06-01"));
    let outcome = res.extensions().get::<AuthOutcome>().unwrap();
    assert!(outcome.refreshed);
    assert_eq!(outcome.rotations, 0);
    // One attempt as far as the retry loop is concerned.
    assert!(res.extensions().get::<RetryTrail>().is_none());
}

#[tokio::test(start_paused = true)]
async fn a_second_401_is_returned_as_is() {
    let server = MockServer::start(Script::new().require_header("authorization", ["nothing"]))
        .await
        .unwrap();
    let (source, calls) = refreshing(false);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(server.request_count(), 2);
    assert!(res.extensions().get::<AuthOutcome>().unwrap().refreshed);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 1);
    assert_eq!(trail.attempts()[0].class, FailureClass::Unauthorized);
    let body: serde_json::Value = serde_json::from_slice(&body_bytes(res).await).unwrap();
    assert_eq!(body["error"]["type"], "authentication_error");
}

#[tokio::test(start_paused = true)]
async fn a_static_key_is_not_resent_after_a_401() {
    let server = MockServer::start(Script::new().require_header("x-api-key", ["sk-other"]))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(ApiKey::new("sk-ant-test").unwrap()))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(seen_header(&server, "x-api-key"), ["sk-ant-test"]);
    assert!(res.extensions().get::<AuthOutcome>().is_none());
}

// Real time: a thousand connections to the mock on a loaded machine can leave the runtime
// idle while bytes are in flight, and paused time would then jump to the head timeouts
// (retries this test does not expect). Nothing here waits on the clock but the refresh's
// 10 ms.
#[tokio::test]
async fn a_thousand_concurrent_401s_cause_one_refresh() {
    let server =
        MockServer::start(Script::new().require_header("authorization", ["Bearer tok-new-1"]))
            .await
            .unwrap();
    let (source, calls) = refreshing(false);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let url = server.url("/v1/messages");
    let mut all = JoinSet::new();
    for _ in 0..1000 {
        let req = anthropic_request(&url, BODY);
        all.spawn(svc.clone().oneshot(req));
    }
    while let Some(res) = all.join_next().await {
        let res = res.unwrap().unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.extensions().get::<AuthOutcome>().unwrap().refreshed);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let seen = seen_header(&server, "authorization");
    assert_eq!(seen.len(), 2000);
    assert_eq!(seen.iter().filter(|v| *v == "Bearer tok-old").count(), 1000);
    assert_eq!(
        seen.iter().filter(|v| *v == "Bearer tok-new-1").count(),
        1000
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_refresh_is_a_typed_error_for_every_waiter_and_backs_off() {
    let server = MockServer::start(Script::new().require_header("authorization", ["never"]))
        .await
        .unwrap();
    let (source, calls) = refreshing(true);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let url = server.url("/v1/messages");
    let mut all = JoinSet::new();
    for _ in 0..20 {
        all.spawn(svc.clone().oneshot(anthropic_request(&url, BODY)));
    }
    while let Some(res) = all.join_next().await {
        let err = res.unwrap().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TokenRefresh);
        // Not retried by the retry loop: one attempt, the 401.
        assert_eq!(err.trail().unwrap().total_attempts(), 1);
        let cause = std::error::Error::source(&err).unwrap().to_string();
        assert_eq!(cause, "identity provider down");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(server.request_count(), 20);

    // Within the backoff, a request fails at once: no refresh, nothing sent.
    let err = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(server.request_count(), 20);

    // After it (1 s), one more try.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let err = svc
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(server.request_count(), 20);
}

fn limit_key(key: &'static str, retry_after: &'static str) -> Script {
    Script::new().when(move |req| {
        (req.headers["x-api-key"] == key).then(|| Reply::rate_limited(retry_after))
    })
}

#[tokio::test(start_paused = true)]
async fn a_rate_limited_key_is_swapped_at_once() {
    let server = MockServer::start(limit_key("sk-a", "30")).await.unwrap();
    let pool = ApiKeyPool::new(["sk-a", "sk-b"]).unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(pool))
        .service(http_client());
    let url = server.url("/v1/messages");
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen_header(&server, "x-api-key"), ["sk-a", "sk-b"]);
    assert_eq!(seen[1].received_at - seen[0].received_at, Duration::ZERO);
    assert_eq!(sha256(&seen[0].body), sha256(&seen[1].body));
    let outcome = *res.extensions().get::<AuthOutcome>().unwrap();
    assert!(!outcome.refreshed);
    assert_eq!(outcome.rotations, 1);
    assert_eq!(outcome.key_index, Some(1));
    assert!(res.extensions().get::<RetryTrail>().is_none());

    // While sk-a rests, the next request goes straight to sk-b.
    let res = svc.oneshot(anthropic_request(&url, BODY)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(seen_header(&server, "x-api-key")[2], "sk-b");
}

#[tokio::test(start_paused = true)]
async fn when_every_key_rests_the_429_takes_the_ordinary_retry_path() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("2"))
            .then(Reply::rate_limited("2")),
    )
    .await
    .unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(exact_policy())
                .observer(recorder.clone()),
        )
        .layer(AuthLayer::new(ApiKeyPool::new(["sk-a", "sk-b"]).unwrap()))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(seen_header(&server, "x-api-key"), ["sk-a", "sk-b", "sk-a"]);
    let seen = server.requests();
    assert_eq!(seen[1].received_at - seen[0].received_at, Duration::ZERO);
    assert_eq!(
        seen[2].received_at - seen[1].received_at,
        Duration::from_secs(2)
    );
    assert_eq!(recorder.delays(), [Duration::from_secs(2)]);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 2);
    assert_eq!(
        trail.attempts()[0].retry_after,
        Some(Duration::from_secs(2))
    );
    assert_eq!(
        res.extensions().get::<AuthOutcome>().unwrap().key_index,
        Some(0)
    );
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_quota_is_not_rotated() {
    let server = MockServer::start(Script::always(Reply::openai_error(
        429,
        "insufficient_quota",
        "You exceeded your current quota",
    )))
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(ApiKeyPool::new(["sk-a", "sk-b"]).unwrap()))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(server.request_count(), 1);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.attempts()[0].class, FailureClass::QuotaExhausted);
    // The caller still gets the body the layer read.
    let body: serde_json::Value = serde_json::from_slice(&body_bytes(res).await).unwrap();
    assert_eq!(body["error"]["code"], "insufficient_quota");
}

#[tokio::test(start_paused = true)]
async fn a_single_key_takes_the_ordinary_path() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("1")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(ApiKeyPool::new(["sk-only"]).unwrap()))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[1].received_at - seen[0].received_at,
        Duration::from_secs(1)
    );
}

#[tokio::test(start_paused = true)]
async fn the_credential_is_set_on_every_attempt_and_marked_sensitive() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::overloaded()),
    )
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(
            ApiKey::with_header("sk-proj-test", CredentialHeader::Bearer).unwrap(),
        ))
        .map_request(|req: Request<ReplayBody>| {
            assert!(req.headers()["authorization"].is_sensitive());
            req
        })
        .service(http_client());
    // A caller's own value for the header is replaced, not doubled.
    let mut req = anthropic_request(&server.url("/v1/chat/completions"), BODY);
    req.headers_mut()
        .insert("authorization", "Bearer stale".parse().unwrap());
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen_header(&server, "authorization"),
        ["Bearer sk-proj-test"; 3]
    );
    assert!(server
        .requests()
        .iter()
        .all(|r| r.headers.get_all("authorization").iter().count() == 1));
}

#[tokio::test(start_paused = true)]
async fn refreshes_within_the_attempt_with_the_never_policy() {
    let server =
        MockServer::start(Script::new().require_header("authorization", ["Bearer tok-new-1"]))
            .await
            .unwrap();
    let (source, calls) = refreshing(false);
    // No retries: the refresh after the 401 is a re-send of the same attempt.
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::never()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let seen = server.requests();
    assert_eq!(sha256(&seen[0].body), sha256(&seen[1].body));
}

#[tokio::test(start_paused = true)]
async fn a_body_too_large_to_buffer_gets_its_credential_but_no_resend() {
    let server =
        MockServer::start(Script::new().require_header("authorization", ["Bearer tok-new-1"]))
            .await
            .unwrap();
    let (source, calls) = refreshing(false);
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::never())
                .body_limit(16),
        )
        .layer(AuthLayer::new(source.clone()))
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(seen_header(&server, "authorization"), ["Bearer tok-old"]);
    // The rejected token was still dropped: the next request gets a fresh one.
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::never()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        seen_header(&server, "authorization"),
        ["Bearer tok-old", "Bearer tok-new-1"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_token_near_expiry_is_refreshed_before_it_is_sent() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let url = server.url("/v1/messages");
    // 100 s left: inside the advisory window (120 s); 20 s left: inside the mandatory one (30 s).
    for left in [100, 20] {
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        let source = RefreshingToken::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, std::io::Error>(Token::new("tok-renewed")) }
        })
        .initial(Token::new("tok-aging").expires_in(Duration::from_secs(left)))
        .unwrap();
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new())
            .layer(AuthLayer::new(source))
            .service(http_client());
        let res = svc.oneshot(anthropic_request(&url, BODY)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{left} s left");
    }
    assert_eq!(
        seen_header(&server, "authorization"),
        ["Bearer tok-renewed", "Bearer tok-renewed"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_refresh_reaches_the_caller_as_it_is_for_a_body_sent_once() {
    // A body over the retry layer's limit is sent once, streaming, past the retry loop. The
    // credential layer's own final error still reaches the caller as a TokenRefresh, not
    // wrapped as a service error.
    let server = MockServer::start(Script::new().require_header("authorization", ["never"]))
        .await
        .unwrap();
    // No token yet, and the first fetch fails: the request cannot even be sent.
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Err::<Token, _>(std::io::Error::other("identity provider down")) }
    });
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()).body_limit(16))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let big = Full::new(Bytes::from(vec![b'x'; 64]));
    let req = Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(big)
        .unwrap();
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(
        std::error::Error::source(&err).unwrap().to_string(),
        "identity provider down"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(server.request_count(), 0);
}

/// A source that starts with `tok-old` and whose every call takes `latency` (forever when
/// `None`), handing out `tok-new-1`, `tok-new-2`, …, counting its calls.
fn slow_refreshing(latency: Option<Duration>) -> (RefreshingToken, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            match latency {
                Some(latency) => tokio::time::sleep(latency).await,
                None => std::future::pending().await,
            }
            Ok::<_, std::io::Error>(
                Token::new(format!("tok-new-{n}")).expires_in(Duration::from_secs(3600)),
            )
        }
    })
    .initial(Token::new("tok-old").expires_in(Duration::from_secs(3600)))
    .unwrap();
    (source, calls)
}

#[tokio::test(start_paused = true)]
async fn a_refresh_survives_requests_that_time_out_waiting_for_it() {
    let server =
        MockServer::start(Script::new().require_header("authorization", ["Bearer tok-new-1"]))
            .await
            .unwrap();
    // The identity provider takes 300 ms; every caller gives up after 100 ms.
    let (source, calls) = slow_refreshing(Some(Duration::from_millis(300)));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let url = server.url("/v1/messages");
    let patience = Duration::from_millis(100);
    let start = tokio::time::Instant::now();
    // The first request is answered 401, the second finds no token: both wait for the
    // refresh, and give up.
    for _ in 0..2 {
        let req = svc.clone().oneshot(anthropic_request(&url, BODY));
        assert!(tokio::time::timeout(patience, req).await.is_err());
    }
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The refresh finished while nobody waited; the next request is sent with its token at
    // once.
    let res = tokio::time::timeout(patience, svc.oneshot(anthropic_request(&url, BODY)))
        .await
        .expect("the refreshed token is there for the next request")
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        seen_header(&server, "authorization"),
        ["Bearer tok-old", "Bearer tok-new-1"]
    );
    let seen = server.requests();
    assert_eq!(
        seen[1].received_at - seen[0].received_at,
        Duration::from_millis(350)
    );
}

#[tokio::test(start_paused = true)]
async fn a_hung_identity_provider_fails_the_request_after_the_refresh_timeout() {
    let server = MockServer::start(Script::new().require_header("authorization", ["never"]))
        .await
        .unwrap();
    let (source, calls) = slow_refreshing(None);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    let url = server.url("/v1/messages");
    let start = tokio::time::Instant::now();
    let err = tokio::time::timeout(
        Duration::from_secs(120),
        svc.clone().oneshot(anthropic_request(&url, BODY)),
    )
    .await
    .expect("the refresh gave up by itself")
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(start.elapsed(), Duration::from_secs(30));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(server.request_count(), 1);
    // Within the backoff (1 s) a request fails at once, without calling the provider.
    let err = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // After it, the next request tries again (and gives up on its own, 100 ms later).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let next = svc.oneshot(anthropic_request(&url, BODY));
    assert!(tokio::time::timeout(Duration::from_millis(100), next)
        .await
        .is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_huge_retry_after_rests_the_key_for_at_most_a_day() {
    const DAY: Duration = Duration::from_secs(24 * 60 * 60);
    // 1e19 s: a number the Retry-After parser takes, past what the clock can add.
    let server = MockServer::start(limit_key("sk-a", "10000000000000000000"))
        .await
        .unwrap();
    let pool = ApiKeyPool::new(["sk-a", "sk-b"]).unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(pool))
        .service(http_client());
    let url = server.url("/v1/messages");
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(seen_header(&server, "x-api-key"), ["sk-a", "sk-b"]);
    // sk-a rests: the next request goes to sk-b. A day later, sk-a is tried again.
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    tokio::time::sleep(DAY).await;
    let res = svc.oneshot(anthropic_request(&url, BODY)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen_header(&server, "x-api-key"),
        ["sk-a", "sk-b", "sk-b", "sk-a", "sk-b"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_token_that_never_seems_to_expire_is_sent_and_kept() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let url = server.url("/v1/messages");
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    // An identity provider that says `"expires_in": 18446744073709551615`.
    let source = RefreshingToken::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            Ok::<_, std::io::Error>(
                Token::new("tok-forever").expires_in(Duration::from_secs(u64::MAX)),
            )
        }
    });
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(source))
        .service(http_client());
    for _ in 0..3 {
        let res = svc
            .clone()
            .oneshot(anthropic_request(&url, BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        seen_header(&server, "authorization"),
        ["Bearer tok-forever"; 3]
    );
}

#[tokio::test(start_paused = true)]
async fn a_keys_rest_reads_an_http_date_against_the_responses_date() {
    // The server's clock says 00:00:00 and asks for 00:01:00: a minute of rest, whatever the
    // host's clock says (months later, which would make the date past and the rest the
    // default 5 s).
    let server = MockServer::start(Script::new().when(|req| {
        (req.headers["x-api-key"] == "sk-a").then(|| {
            Reply::rate_limited("Thu, 01 Jan 2026 00:01:00 GMT")
                .header("date", "Thu, 01 Jan 2026 00:00:00 GMT")
        })
    }))
    .await
    .unwrap();
    let pool = ApiKeyPool::new(["sk-a", "sk-b"]).unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(pool))
        .service(http_client());
    let url = server.url("/v1/messages");
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // Ten seconds on, past the default rest, sk-a still rests.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // A minute on, it is tried again.
    tokio::time::sleep(Duration::from_secs(51)).await;
    let res = svc.oneshot(anthropic_request(&url, BODY)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen_header(&server, "x-api-key"),
        ["sk-a", "sk-b", "sk-b", "sk-a", "sk-b"]
    );
}

/// A request with `openai-organization: org`, a header the mock answers `401` to whatever the
/// key unless it is `org-mine`.
fn with_org(url: &str, org: &str) -> Request<Full<Bytes>> {
    let mut req = anthropic_request(url, BODY);
    req.headers_mut()
        .insert("openai-organization", org.parse().unwrap());
    req
}

#[tokio::test(start_paused = true)]
async fn a_401_caused_by_the_clients_organization_header_sets_no_key_aside() {
    let server = MockServer::start(Script::new().when(|req| {
        (req.headers
            .get("openai-organization")
            .is_some_and(|o| o != "org-mine"))
        .then(Reply::unauthorized)
    }))
    .await
    .unwrap();
    let pool = Arc::new(ApiKeyPool::new(["sk-a", "sk-b", "sk-c"]).unwrap());
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(pool.clone()))
        .service(http_client());
    let url = server.url("/v1/messages");
    for _ in 0..2 {
        let res = svc
            .clone()
            .oneshot(with_org(&url, "org-other"))
            .await
            .unwrap();
        // Returned as it is: not re-sent with another key.
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    }
    assert_eq!(server.request_count(), 2);
    assert!(format!("{pool:?}").contains("rejected: 0"), "{pool:?}");
    // Every key is still in rotation: the next requests, good headers, take them in turn.
    for req in [
        anthropic_request(&url, BODY),
        with_org(&url, "org-mine"),
        anthropic_request(&url, BODY),
        anthropic_request(&url, BODY),
    ] {
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(
        seen_header(&server, "x-api-key"),
        ["sk-a", "sk-b", "sk-c", "sk-a", "sk-b", "sk-c"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_revoked_key_is_set_aside_and_tried_again_after_a_doubling_quarantine() {
    let server = MockServer::start(Script::new().require_header("x-api-key", ["sk-b"]))
        .await
        .unwrap();
    let pool = ApiKeyPool::new(["sk-a", "sk-b"])
        .unwrap()
        .quarantine(Duration::from_secs(60), Duration::from_secs(100));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .layer(AuthLayer::new(pool))
        .service(http_client());
    let url = server.url("/v1/messages");
    let send = || async {
        let res = svc
            .clone()
            .oneshot(anthropic_request(&url, BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    };
    // sk-a: 401, set aside, the request re-sent once with sk-b; the next goes to sk-b.
    send().await;
    send().await;
    assert_eq!(seen_header(&server, "x-api-key"), ["sk-a", "sk-b", "sk-b"]);
    // Just short of its quarantine sk-a is still aside; at its end it is tried again, is
    // answered 401 again, and is set aside for twice as long, capped at 100 s.
    tokio::time::sleep(Duration::from_secs(59)).await;
    send().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    send().await;
    assert_eq!(
        seen_header(&server, "x-api-key")[3..],
        ["sk-b", "sk-a", "sk-b"]
    );
    tokio::time::sleep(Duration::from_secs(99)).await;
    send().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    send().await;
    assert_eq!(
        seen_header(&server, "x-api-key")[6..],
        ["sk-b", "sk-a", "sk-b"]
    );
}
