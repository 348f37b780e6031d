//! The `axum_proxy` example's app, end to end: a real axum server in front of the mock
//! upstream, both on 127.0.0.1, under paused time.

#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/axum_proxy.rs"]
mod app;

use std::time::Duration;

use crate::common::sha256;
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_llm_retry::mock::{sse, MockServer, Reply, Script};
use tower_llm_retry::retry::Jitter;
use tower_llm_retry::RetryPolicy;

const BODY: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

async fn serve(
    upstream: &MockServer,
    policy: RetryPolicy,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = app::app(upstream.url(""), policy);
    let task = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    (addr, task)
}

#[tokio::test(start_paused = true)]
async fn proxy_retries_upstream_overload_and_streams_sse_back() {
    let events = sse::anthropic_message(&["Proxied ", "and ", "retried."]);
    let mut want = BytesMut::new();
    for e in &events {
        want.extend_from_slice(&e.bytes());
    }
    let upstream = MockServer::start(
        Script::new()
            .then(Reply::overloaded().header("retry-after", "2"))
            .then(Reply::sse(events)),
    )
    .await
    .unwrap();
    let (addr, task) = serve(&upstream, RetryPolicy::default().jitter(Jitter::none())).await;

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("http://{addr}/v1/messages?beta=true"))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-test")
        .header("cookie", "session=private")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, want.freeze());

    let seen = upstream.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[1].received_at - seen[0].received_at,
        Duration::from_secs(2)
    );
    for r in &seen {
        // The query goes with the path.
        assert_eq!(
            r.uri.path_and_query().unwrap().as_str(),
            "/v1/messages?beta=true"
        );
        assert_eq!(sha256(&r.body), sha256(BODY.as_bytes()));
        assert_eq!(r.headers["x-api-key"], "sk-test");
        assert!(
            r.headers.get("cookie").is_none(),
            "only the API headers are forwarded"
        );
    }
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn proxy_maps_an_exhausted_upstream_to_502() {
    let upstream = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let (addr, task) = serve(
        &upstream,
        RetryPolicy::default().max_retries(1).jitter(Jitter::none()),
    )
    .await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("http://{addr}/v1/messages"))
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), 502);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"upstream failed: exhausted");
    assert_eq!(upstream.request_count(), 2);
    task.abort();
}
