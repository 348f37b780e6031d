//! The stack as the HTTP service of [`async_openai`] (feature `async-openai`).
//!
//! async-openai (0.43, its feature `middleware`) sends every request through a
//! `tower::Service<HttpRequestFactory, Response = reqwest::Response>` given to
//! `Client::with_http_service`. [`HttpService`] is that service around a stack of this crate
//! over [`ReqwestService`](crate::reqwest::ReqwestService):
//!
//! ```no_run
//! use async_openai::config::OpenAIConfig;
//! use async_openai::Client;
//! use tower::ServiceBuilder;
//! use tower_llm_retry::async_openai::HttpService;
//! use tower_llm_retry::reqwest::ReqwestService;
//! use tower_llm_retry::RetryLayer;
//!
//! # fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let http = reqwest::Client::builder().retry(reqwest::retry::never()).build()?;
//! let stack = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     .service(ReqwestService::new(http));
//! let client = Client::with_config(OpenAIConfig::new()).with_http_service(HttpService::new(stack));
//! # let _ = client; Ok(()) }
//! ```
//!
//! `with_http_service` replaces async-openai's own stack, and with it its retry layer
//! (`OpenAIRetryLayer`, 3 retries of `429`, `5xx` and connect errors, always on otherwise):
//! this crate's loop is the only one, so attempts do not multiply. Streams (`create_stream`)
//! go through the SSE gate: an in-band error before the first output is retried, a failure
//! after it reaches async-openai's stream as an error.
//!
//! The factory is built once per call; the request it makes (method, URL, headers, body, and
//! reqwest's per-request timeout, which then bounds each attempt) goes down the stack, whose
//! [`RetryLayer`](crate::RetryLayer) buffers the body and replays the same bytes on every
//! attempt, multipart uploads included (up to the layer's body limit).
//!
//! Errors come back as `OpenAIError::Boxed` holding the stack's error: downcast it to
//! [`tower_llm_retry::Error`](crate::Error) to read its kind and trail. An error building the
//! request is async-openai's own, as it made it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use bytes::Bytes;
use tower_layer::Layer;
use tower_service::Service;

use crate::error::BoxError;

/// A stack over `http::Request<reqwest::Body>` as async-openai's
/// `Service<HttpRequestFactory, Response = reqwest::Response>`.
///
/// The response's URL (`reqwest::Response::url`) is the request's: the stack below does not
/// report where redirects ended.
#[derive(Debug, Clone)]
pub struct HttpService<S> {
    inner: S,
}

impl<S> HttpService<S> {
    /// Wraps `inner`, typically [`RetryLayer`](crate::RetryLayer) (and the companion layers)
    /// over [`ReqwestService`](crate::reqwest::ReqwestService).
    pub fn new(inner: S) -> Self {
        HttpService { inner }
    }

    /// The wrapped stack.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the stack.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Builds [`HttpService`], as the outermost layer of a `ServiceBuilder`.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpServiceLayer {
    _priv: (),
}

impl HttpServiceLayer {
    /// The layer.
    pub fn new() -> Self {
        HttpServiceLayer { _priv: () }
    }
}

impl<S> Layer<S> for HttpServiceLayer {
    type Service = HttpService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpService::new(inner)
    }
}

/// The future of [`HttpService`]: async-openai's request factory is itself a boxed future.
pub type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<reqwest::Response, OpenAIError>> + Send + 'static>>;

impl<S, B> Service<HttpRequestFactory> for HttpService<S>
where
    S: Service<http::Request<reqwest::Body>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: http_body::Body + Send + Sync + 'static,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
{
    type Response = reqwest::Response;
    type Error = OpenAIError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| OpenAIError::Boxed(e.into()))
    }

    fn call(&mut self, factory: HttpRequestFactory) -> Self::Future {
        // The instance polled ready goes with this request; the clone stays for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let request = factory.build().await?;
            let url = request.url().clone();
            let request = http::Request::<reqwest::Body>::try_from(request)?;
            let response = inner
                .call(request)
                .await
                .map_err(|e| OpenAIError::Boxed(e.into()))?;
            let (parts, body) = response.into_parts();
            Ok(into_reqwest_response(parts, reqwest::Body::wrap(body), url))
        })
    }
}

fn into_reqwest_response(
    mut parts: http::response::Parts,
    body: reqwest::Body,
    url: reqwest::Url,
) -> reqwest::Response {
    use reqwest::ResponseBuilderExt;
    // reqwest keeps a response's URL in an extension only its builder can set.
    let (with_url, ()) = http::Response::builder()
        .url(url)
        .body(())
        .unwrap_or_default()
        .into_parts();
    parts.extensions.extend(with_url.extensions);
    reqwest::Response::from(http::Response::from_parts(parts, body))
}
