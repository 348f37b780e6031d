//! What the companion layers write to tracing: every circuit transition of a fallback target,
//! and the one warning of a fallback layer placed outside the retry loop. Here, not with the
//! other companion tests, because tracing caches per callsite, process-wide, whether it is
//! enabled (see the binary's docs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::fallback::Circuit;
use tower_llm_retry::mock::{MockServer, RecordedRequest, Reply, Script};
use tower_llm_retry::{ModelFallbackLayer, ReplayBody, RetryLayer, RetryPolicy};

const PRIMARY: &str = "claude-opus-4-1";
const FALLBACK: &str = "claude-sonnet-4-5";
const REQUEST: &str = r#"{"model":"claude-opus-4-1","max_tokens":1024,"messages":[{"role":"user","content":"Name a car."}]}"#;
const OPUS_BODY: &str = REQUEST;
const SONNET: &str = FALLBACK;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Requests for the primary get `primary(request)`; the fallback always succeeds.
fn by_model(primary: impl Fn(&RecordedRequest) -> Reply + Send + Sync + 'static) -> Script {
    Script::new().when(move |req| {
        (req.json().unwrap()["model"].as_str() == Some(PRIMARY)).then(|| primary(req))
    })
}

fn chain() -> ModelFallbackLayer {
    ModelFallbackLayer::new([PRIMARY, FALLBACK]).unwrap()
}

/// The retry loop with `layer` inside it, over a plain client.
fn retried(
    layer: &ModelFallbackLayer,
) -> tower_llm_retry::retry::Retry<tower_llm_retry::fallback::ModelFallback<HttpClient>> {
    let policy: RetryPolicy = exact_policy()
        .head_timeout(Some(Duration::from_secs(5)))
        .idle_timeout(Some(Duration::from_secs(20)));
    ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy))
        .layer(layer.clone())
        .service(http_client())
}

#[tokio::test(start_paused = true)]
async fn every_circuit_transition_is_a_tracing_event() {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let healthy = Arc::new(AtomicBool::new(false));
    let flag = healthy.clone();
    let server = MockServer::start(by_model(move |_| match flag.load(Ordering::SeqCst) {
        true => Reply::success(),
        false => Reply::status(503),
    }))
    .await
    .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .circuit(Circuit::new().failures(1).cooldown(Duration::from_secs(10)))
        .unwrap();
    let svc = retried(&layer);
    let start = Instant::now();
    for at in [0, 10, 30] {
        tokio::time::sleep_until(start + Duration::from_secs(at)).await;
        healthy.store(at == 30, Ordering::SeqCst);
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    let text = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    let transitions: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            [
                "circuit opened",
                "circuit half-open",
                "circuit reopened",
                "circuit closed",
            ]
            .into_iter()
            .find(|t| l.contains(t))
        })
        .collect();
    assert_eq!(
        transitions,
        [
            "circuit opened",
            "circuit half-open",
            "circuit reopened",
            "circuit half-open",
            "circuit closed"
        ],
        "{text}"
    );
    assert!(
        text.contains("target=\"claude-opus-4-1\"") || text.contains("target=claude-opus-4-1"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_layer_outside_retry_layer_warns_once() {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = MockServer::start(Script::new()).await.unwrap();
    let outside = ServiceBuilder::new()
        .layer(ModelFallbackLayer::new([SONNET]).unwrap())
        .layer(RetryLayer::new())
        .service(http_client());
    for _ in 0..3 {
        let req = anthropic_request(&server.url("/v1/messages"), OPUS_BODY)
            .map(|_| ReplayBody::new(OPUS_BODY.as_bytes()));
        let res = outside.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    let warned = |text: &str| text.matches("must sit inside RetryLayer").count();
    let text = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    assert_eq!(warned(&text), 1, "{text}");

    // Inside, where it belongs, it says nothing.
    capture.0.lock().unwrap().clear();
    let inside = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(ModelFallbackLayer::new([SONNET]).unwrap())
        .service(http_client());
    let res = inside
        .oneshot(anthropic_request(&server.url("/v1/messages"), OPUS_BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let text = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    assert_eq!(warned(&text), 0, "{text}");
}
