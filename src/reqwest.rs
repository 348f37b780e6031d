//! Running the stack on top of [`reqwest`] (feature `reqwest`).
//!
//! [`ReqwestService`] turns a `reqwest::Client` into a
//! `Service<http::Request<ReplayBody>>`, so [`RetryLayer`](crate::RetryLayer) and the other
//! layers sit on top of it. Each attempt hands reqwest the buffered bytes as a
//! `reqwest::Body::from(Bytes)` (never a streaming body, so nothing is copied and nothing can
//! be half-consumed); response bodies stream through, so SSE works.
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_llm_retry::reqwest::ReqwestService;
//! use tower_llm_retry::RetryLayer;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // Turn reqwest's own retries off, or attempts multiply: this layer is the retry authority.
//! let client = reqwest::Client::builder()
//!     .retry(reqwest::retry::never())
//!     .build()?;
//! let llm = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     .service(ReqwestService::new(client));
//!
//! let request = http::Request::post("https://api.anthropic.com/v1/messages")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"model":"claude-sonnet-4-5","max_tokens":64}"#)))?;
//! let response = llm.oneshot(request).await?;
//! # let _ = response; Ok(()) }
//! ```
//!
//! reqwest's features (TLS backend, HTTP/2, proxies) are the application's choice: this crate
//! depends on reqwest without default features, and Cargo unifies them with yours.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tower_service::Service;

use crate::body::ReplayBody;

/// A `reqwest::Client` as a `Service<http::Request<ReplayBody>>`.
///
/// Its response body is `reqwest::Body`, which streams. Errors are `reqwest::Error`; a
/// connect error (`is_connect()`) is recognised as "request never sent", so even requests
/// marked [`NotReplaySafe`](crate::retry::NotReplaySafe) are retried after one.
#[derive(Debug, Clone, Default)]
pub struct ReqwestService {
    client: reqwest::Client,
}

impl ReqwestService {
    /// Wraps `client`. Build it with `.retry(reqwest::retry::never())` so reqwest does not
    /// retry underneath this crate.
    pub fn new(client: reqwest::Client) -> Self {
        ReqwestService { client }
    }

    /// The wrapped client.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }
}

/// The future of [`ReqwestService`]. reqwest's own future cannot be named, so it is boxed;
/// reqwest boxes its request future internally anyway.
pub type ReqwestFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<reqwest::Body>, reqwest::Error>> + Send>>;

impl Service<http::Request<ReplayBody>> for ReqwestService {
    type Response = http::Response<reqwest::Body>;
    type Error = reqwest::Error;
    type Future = ReqwestFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<ReplayBody>) -> Self::Future {
        let req = match reqwest::Request::try_from(req.map(into_reqwest_body)) {
            Ok(req) => req,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        let pending = self.client.execute(req);
        Box::pin(async move { pending.await.map(http::Response::from) })
    }
}

/// The buffered bytes as a plain reqwest body; a one-shot pass-through body is wrapped.
pub(crate) fn into_reqwest_body(body: ReplayBody) -> reqwest::Body {
    match body.as_bytes() {
        Some(bytes) => reqwest::Body::from(bytes.clone()),
        None => reqwest::Body::wrap(body),
    }
}
