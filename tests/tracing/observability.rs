//! The observer and tracing see every attempt exactly once, and never a credential.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{GiveUpReason, Jitter};
use tower_llm_retry::{RetryLayer, RetryPolicy, RetryTrail};

const API_KEY: &str = "sk-ant-api03-SECRETKEYMATERIAL";
const BEARER: &str = "Bearer eyJSECRETBEARERTOKEN";

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// A TRACE-level subscriber that drops everything, for the tests that do not capture.
///
/// tracing caches, process-wide, whether a callsite is enabled, judged by the subscriber of
/// the thread that reaches it first. A test thread without a subscriber would cache "never"
/// for the callsites the capturing test below asserts on; with this one it caches "yes".
fn discard_all_tracing() -> tracing::subscriber::DefaultGuard {
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(std::io::sink)
        .finish();
    tracing::subscriber::set_default(subscriber)
}

fn secret_request(uri: &str) -> Request<Full<Bytes>> {
    Request::post(uri)
        .header("x-api-key", API_KEY)
        .header("authorization", BEARER)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn observer_sees_each_retry_then_the_recovery() {
    let _tracing = discard_all_tracing();
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::rate_limited("2"))
            .then(Reply::reset())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().max_retries(5).jitter(Jitter::none()))
                .observer(recorder.clone()),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let retry = |attempt, class, status: Option<u16>, retry_after, delay_ms| Seen::Retry {
        attempt,
        class,
        status: status.map(|s| StatusCode::from_u16(s).unwrap()),
        retry_after,
        delay: Duration::from_millis(delay_ms),
        max_retries: 5,
    };
    assert_eq!(
        recorder.seen(),
        [
            retry(1, FailureClass::Server, Some(503), None, 500),
            retry(
                2,
                FailureClass::RateLimited,
                Some(429),
                Some(Duration::from_secs(2)),
                2000
            ),
            retry(3, FailureClass::Transport, None, None, 2000),
            Seen::Recovered(4),
        ]
    );
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 4);
    assert_eq!(trail.retries(), 3);
    assert_eq!(trail.gave_up(), None);
    let records = trail.attempts();
    assert_eq!(records.len(), 3);
    assert_eq!(
        records.iter().map(|r| r.attempt).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(
        records.iter().map(|r| r.delay).collect::<Vec<_>>(),
        [
            Some(Duration::from_millis(500)),
            Some(Duration::from_secs(2)),
            Some(Duration::from_secs(2))
        ]
    );
    // Elapsed is measured from the start: each attempt ends after the sleeps before it.
    assert_eq!(
        records.iter().map(|r| r.elapsed).collect::<Vec<_>>(),
        [
            Duration::ZERO,
            Duration::from_millis(500),
            Duration::from_millis(2500)
        ]
    );
    assert_eq!(trail.total_delay(), Duration::from_millis(4500));
    assert!(records[2]
        .error
        .as_deref()
        .unwrap()
        .contains("connection closed"));
}

#[tokio::test(start_paused = true)]
async fn give_up_reports_the_whole_trail_once() {
    let _tracing = discard_all_tracing();
    let server = MockServer::start(Script::always(Reply::overloaded()))
        .await
        .unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().max_retries(2).jitter(Jitter::none()))
                .observer(recorder.clone()),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    let seen = recorder.seen();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[2], Seen::GaveUp(trail.clone()));
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    assert_eq!(trail.total_attempts(), 3);
    assert!(trail
        .attempts()
        .iter()
        .all(|a| a.class == FailureClass::Overloaded));
    assert_eq!(trail.attempts()[2].delay, None);
}

#[tokio::test(start_paused = true)]
async fn spans_carry_otel_fields_and_no_credentials() {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::reset())
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::default().jitter(Jitter::none())))
        .service(http_client());
    let res = svc
        .clone()
        .oneshot(secret_request(&server.url("/v1/messages")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The server did get the credentials: they were sent, just never logged.
    assert_eq!(server.requests()[3].headers["x-api-key"], API_KEY);

    // An exhausted request too, for its error text.
    let down = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::default().max_retries(1)))
        .service(http_client());
    let err = svc
        .clone()
        .oneshot(secret_request(&down.url("/v1/messages")))
        .await
        .unwrap_err();

    let mut text = capture.text();
    text.push_str(&format!("{err:?} {err} {:?} {:?}", err.trail(), svc));
    text.push_str(&format!("{:?}", res.extensions().get::<RetryTrail>()));
    assert!(text.contains("llm_retry.attempt"), "{text}");
    assert!(text.contains("http.request.resend_count=3"), "{text}");
    assert!(
        text.contains("gen_ai.request.model=\"claude-sonnet-4-5\"")
            || text.contains("gen_ai.request.model=claude-sonnet-4-5"),
        "{text}"
    );
    assert!(
        text.contains("error.type=\"overloaded\"") || text.contains("error.type=overloaded"),
        "{text}"
    );
    assert!(text.contains("http.response.status_code=529"), "{text}");
    assert!(text.contains("retrying LLM request"), "{text}");
    assert!(text.contains("giving up on LLM request"), "{text}");
    assert!(!text.contains("SECRET"), "a credential leaked:\n{text}");
}
