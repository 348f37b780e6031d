//! Shared test helpers: a hyper-util client behind the retry layer, an observer that records,
//! and body hashing.
#![allow(dead_code, unreachable_pub)]

pub mod json;
pub mod listener;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::retry::{RetryEvent, RetryObserver};
use tower_llm_retry::{ReplayBody, RetryTrail};

pub type HttpClient = Client<HttpConnector, ReplayBody>;

pub fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

pub fn anthropic_request(uri: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(uri)
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

pub const BODY: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":"Hello, world"}]}"#;

pub async fn body_bytes<B>(res: Response<B>) -> Bytes
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    res.into_body().collect().await.unwrap().to_bytes()
}

/// What the observer saw, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    Retry {
        attempt: u32,
        class: FailureClass,
        status: Option<StatusCode>,
        retry_after: Option<Duration>,
        delay: Duration,
        max_retries: u32,
    },
    Recovered(u32),
    GaveUp(RetryTrail),
}

#[derive(Debug, Clone, Default)]
pub struct Recorder(pub Arc<Mutex<Vec<Seen>>>);

impl Recorder {
    pub fn seen(&self) -> Vec<Seen> {
        self.0.lock().unwrap().clone()
    }

    pub fn delays(&self) -> Vec<Duration> {
        self.seen()
            .into_iter()
            .filter_map(|s| match s {
                Seen::Retry { delay, .. } => Some(delay),
                _ => None,
            })
            .collect()
    }
}

impl RetryObserver for Recorder {
    fn on_retry(&self, e: &RetryEvent<'_>) {
        self.0.lock().unwrap().push(Seen::Retry {
            attempt: e.attempt,
            class: e.class,
            status: e.status,
            retry_after: e.retry_after,
            delay: e.delay,
            max_retries: e.max_retries,
        });
    }
    fn on_recovered(&self, total: u32) {
        self.0.lock().unwrap().push(Seen::Recovered(total));
    }
    fn on_give_up(&self, trail: &RetryTrail) {
        self.0.lock().unwrap().push(Seen::GaveUp(trail.clone()));
    }
}

/// Asserts that `sent` is `original` with the value of the top-level `key` replaced by the
/// JSON text `value`, every other byte untouched.
pub fn assert_only_value_changed(original: &[u8], sent: &[u8], key: &str, value: &str) {
    use self::json::value_span;
    let before = value_span(original, key).expect("the original has the key");
    let after = value_span(sent, key).expect("the sent body has the key");
    assert_eq!(before.start, after.start, "the bytes before `{key}` moved");
    assert_eq!(&sent[..after.start], &original[..before.start]);
    assert_eq!(
        std::str::from_utf8(&sent[after.clone()]).unwrap(),
        value,
        "the new value of `{key}`"
    );
    assert_eq!(
        &sent[after.end..],
        &original[before.end..],
        "the bytes after `{key}` changed"
    );
}

/// A retry policy without jitter, so sleeps are exact.
pub fn exact_policy() -> tower_llm_retry::RetryPolicy {
    tower_llm_retry::RetryPolicy::default().jitter(tower_llm_retry::retry::Jitter::none())
}

/// The bytes of a sequence of SSE events, as the server writes them.
pub fn concat(events: &[tower_llm_retry::mock::SseFrame]) -> Bytes {
    let mut out = bytes::BytesMut::new();
    for e in events {
        out.extend_from_slice(&e.bytes());
    }
    out.freeze()
}

/// Reads a body to its end, returning the bytes and the error it ended with, if any.
pub async fn drain<B>(
    mut body: tower_llm_retry::RetryBody<B>,
) -> (Bytes, Option<tower_llm_retry::Error>)
where
    B: http_body::Body + Unpin,
    B::Error: Into<tower_llm_retry::BoxError>,
{
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(d) = f.into_data() {
                    out.extend_from_slice(&d);
                }
            }
            Err(e) => return (out.freeze(), Some(e)),
        }
    }
    (out.freeze(), None)
}

/// A reqwest client builder with reqwest's own retries off. The tests build reqwest with
/// `rustls-no-provider`, whose `build()` panics unless a process-wide rustls provider is
/// installed, even for plain HTTP: this installs `ring`, the mock's provider, first.
pub fn reqwest_builder() -> reqwest::ClientBuilder {
    // Err only when some test installed it already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().retry(reqwest::retry::never())
}

/// Wakes the test when a retry has been planned (the gate has seen the response by then).
#[derive(Debug, Clone, Default)]
pub struct RetryPlanned(pub Arc<tokio::sync::Notify>);

impl RetryObserver for RetryPlanned {
    fn on_retry(&self, _: &RetryEvent<'_>) {
        self.0.notify_one();
    }
}

/// Sends one request that gets the server's first reply, and returns once its retry is
/// planned (so the gate has seen the response), with the instant the server received it.
pub async fn close_with(
    server: &tower_llm_retry::mock::MockServer,
    svc: &tower_llm_retry::retry::Retry<HttpClient>,
    planned: &RetryPlanned,
) -> (
    tokio::task::JoinHandle<Result<StatusCode, tower_llm_retry::ErrorKind>>,
    tokio::time::Instant,
) {
    use tower::ServiceExt;
    let notified = planned.0.notified();
    let svc = svc.clone();
    let req = anthropic_request(&server.url("/v1/messages"), BODY);
    let first = tokio::spawn(async move {
        svc.oneshot(req)
            .await
            .map(|r| r.status())
            .map_err(|e| e.kind())
    });
    notified.await;
    (first, server.requests()[0].received_at)
}
