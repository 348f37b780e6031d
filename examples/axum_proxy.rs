//! An axum app whose handler forwards `POST /v1/messages` to an upstream LLM API through the
//! retry stack, kept in the router's `State` as a `BoxCloneSyncService`, and streams the
//! (SSE) response back to its own caller.
//!
//! ```text
//! cargo run --example axum_proxy --features mock
//! ```
//!
//! Here the upstream is the crate's mock server; point `app` at a real API (with a TLS
//! connector on the client) to use it for real.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{HeaderName, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::{BoxError, ReplayBody, RetryLayer, RetryPolicy};

/// The upstream LLM call: any request body in, a streaming axum body out.
pub type LlmService = BoxCloneSyncService<Request, Response, BoxError>;

/// What every handler shares: the retrying client stack and where it points.
#[derive(Clone)]
pub struct AppState {
    llm: LlmService,
    upstream: String,
}

/// The headers forwarded to the upstream API; everything else (host, connection, cookies)
/// stays here.
const FORWARDED: &[&str] = &[
    "content-type",
    "accept",
    "x-api-key",
    "authorization",
    "anthropic-version",
    "anthropic-beta",
];

/// The proxy: `POST /v1/messages` goes to `{upstream}/v1/messages` with retries.
pub fn app(upstream: impl Into<String>, policy: RetryPolicy) -> Router {
    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let stack = ServiceBuilder::new()
        .map_err(BoxError::from)
        .map_response(|res: http::Response<_>| res.map(Body::new))
        .layer(RetryLayer::new().policy(policy))
        .service(client);
    let state = AppState {
        llm: BoxCloneSyncService::new(stack),
        upstream: upstream.into(),
    };
    Router::new()
        .route("/v1/messages", post(forward))
        .with_state(state)
}

async fn forward(State(state): State<AppState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    // The path and the query (`?beta=true` and the like) as the client sent them.
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let base = state.upstream.trim_end_matches('/');
    let mut upstream = http::Request::post(format!("{base}{path}"));
    for name in FORWARDED {
        let name = HeaderName::from_static(name);
        for value in parts.headers.get_all(&name) {
            upstream = upstream.header(&name, value);
        }
    }
    let upstream = match upstream.body(body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    match state.llm.oneshot(upstream).await {
        // Status, headers and the body stream exactly as the upstream sent them.
        Ok(res) => res,
        Err(e) => {
            let kind = e
                .downcast_ref::<tower_llm_retry::Error>()
                .map_or("upstream", |e| e.kind().as_str());
            (StatusCode::BAD_GATEWAY, format!("upstream failed: {kind}")).into_response()
        }
    }
}

#[allow(dead_code)]
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    use http_body_util::BodyExt;
    use tower_llm_retry::mock::{sse, MockServer, Reply, Script};

    let upstream = MockServer::start(
        Script::new()
            .then(Reply::overloaded().header("retry-after", "1"))
            .then(Reply::sse(sse::anthropic_message(&[
                "Proxied ", "and ", "retried.",
            ]))),
    )
    .await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = app(
        upstream.url(""),
        RetryPolicy::default().initial_backoff(Duration::from_millis(200)),
    );
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let client =
        Client::builder(TokioExecutor::new()).build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::post(format!("http://{addr}/v1/messages"))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-example")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[]}"#,
        )))?;
    let res = client.request(req).await?;
    println!("proxy answered {}", res.status());
    let body = res.into_body().collect().await?.to_bytes();
    print!("{}", String::from_utf8_lossy(&body));
    println!(
        "the upstream saw {} requests (a 529, then the stream)",
        upstream.request_count()
    );
    server.abort();
    Ok(())
}
