//! A [`reqwest_middleware::Middleware`] (feature `reqwest-middleware`), for code built on
//! `reqwest_middleware::ClientWithMiddleware`: add it where `reqwest-retry` would go.
//!
//! ```no_run
//! use reqwest_middleware::ClientBuilder;
//! use tower_llm_retry::reqwest_middleware::RetryMiddleware;
//! use tower_llm_retry::{RetryLayer, RetryPolicy};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let client = ClientBuilder::new(
//!     reqwest::Client::builder().retry(reqwest::retry::never()).build()?,
//! )
//! .with(RetryMiddleware::new(RetryLayer::new().policy(RetryPolicy::default())))
//! .build();
//!
//! let response = client
//!     .post("https://api.anthropic.com/v1/messages")
//!     .header("content-type", "application/json")
//!     .body(r#"{"model":"claude-sonnet-4-5","max_tokens":64}"#)
//!     .send()
//!     .await?;
//! # let _ = response; Ok(()) }
//! ```
//!
//! The same classification, `Retry-After` handling, SSE gate, trail and observer apply as with
//! [`RetryLayer`]: the middleware runs the layer's retry loop around the rest of the
//! middleware chain. The [`RetryTrail`](crate::RetryTrail) and
//! [`StreamCommitted`](crate::stream::StreamCommitted) extensions are on the returned
//! `reqwest::Response` (`response.extensions()`).
//!
//! # Per-request settings
//!
//! [`NotReplaySafe`], [`NoRetry`], an [`Override`] and a per-request [`RetryPolicy`] are read
//! from the middleware `Extensions` (`RequestBuilder::with_extension`, or a middleware earlier
//! in the chain), and from the request's own extensions (those of an `http::Request` turned
//! into a `reqwest::Request` with `try_from`). When both hold a `RetryPolicy` (or an
//! `Override`), the one in the middleware `Extensions` is used.
//!
//! ```no_run
//! use tower_llm_retry::retry::NotReplaySafe;
//!
//! # use reqwest_middleware::{ClientWithMiddleware, Result};
//! # async fn run(client: ClientWithMiddleware) -> Result<()> {
//! let response = client
//!     .post("https://api.example.com/v1/payments")
//!     .body(r#"{"amount":100}"#)
//!     .with_extension(NotReplaySafe)
//!     .send()
//!     .await?;
//! # let _ = response; Ok(()) }
//! ```
//!
//! What reqwest keeps on the `reqwest::Request` goes to every attempt: method, URL, headers,
//! HTTP version and its extensions, among them the timeout of `RequestBuilder::timeout`. That
//! timeout bounds each attempt, not the whole retry loop (for that, see
//! [`RetryPolicy::deadline`]). When it fires, the attempt counts as a transport failure,
//! retried unless the request is [`NotReplaySafe`].
//!
//! Differences to know:
//! - A request whose body is a stream (`reqwest::Body::wrap_stream`) cannot be replayed; it
//!   is sent once, as with `reqwest-retry`.
//! - Errors of this crate come back as `reqwest_middleware::Error::Middleware` wrapping a
//!   [`tower_llm_retry::Error`](crate::Error) (downcast it to read its kind and trail); an error
//!   of the inner chain that was not retried at all comes back as it was.
//! - Each attempt gets its own copy of the request `Extensions`; changes that inner
//!   middleware makes to them are not copied back.

use std::sync::Arc;

use http::Extensions;
use reqwest_middleware::{Middleware, Next};
use tower_service::Service;

use crate::body::ReplayBody;
use crate::classify::{Classify, DefaultClassifier};
use crate::error::{Error, ErrorKind};
use crate::retry::{
    Config, NoRetry, NotReplaySafe, Override, ResponseFuture, RetryLayer, RetryPolicy,
};

/// Runs [`RetryLayer`]'s retry loop around the rest of a reqwest-middleware chain.
///
/// Every clone, and every request, shares the layer's configuration (and its fleet state).
#[derive(Clone)]
pub struct RetryMiddleware<C = DefaultClassifier> {
    config: Arc<Config<C>>,
}

impl<C: Clone> RetryMiddleware<C> {
    /// A middleware that retries as `layer` is configured.
    pub fn new(layer: RetryLayer<C>) -> Self {
        RetryMiddleware {
            config: Arc::new(layer.config),
        }
    }
}

impl Default for RetryMiddleware {
    fn default() -> Self {
        Self::new(RetryLayer::new())
    }
}

impl<C: std::fmt::Debug> std::fmt::Debug for RetryMiddleware<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryMiddleware")
            .field("config", &self.config)
            .finish()
    }
}

/// The URL the last attempt ended at (after redirects), carried across the conversion to
/// `http::Response` and back.
#[derive(Clone)]
struct FinalUrl(reqwest::Url);

/// The rest of the chain as a tower service, one run per attempt.
struct NextService<'a> {
    next: Next<'a>,
    extensions: Extensions,
}

impl<'a> Service<http::Request<ReplayBody>> for NextService<'a> {
    type Response = http::Response<reqwest::Body>;
    type Error = reqwest_middleware::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send + 'a>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<ReplayBody>) -> Self::Future {
        let next = self.next.clone();
        let mut extensions = self.extensions.clone();
        Box::pin(async move {
            let req = reqwest::Request::try_from(req.map(crate::reqwest::into_reqwest_body))?;
            let res = next.run(req, &mut extensions).await?;
            let url = FinalUrl(res.url().clone());
            let mut res = http::Response::from(res);
            res.extensions_mut().insert(url);
            Ok(res)
        })
    }
}

impl<'a> Clone for NextService<'a> {
    fn clone(&self) -> Self {
        NextService {
            next: self.next.clone(),
            extensions: self.extensions.clone(),
        }
    }
}

#[async_trait::async_trait]
impl<C> Middleware for RetryMiddleware<C>
where
    C: Classify + Clone,
{
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let bytes = req
            .body()
            .and_then(|b| b.as_bytes())
            .map(bytes::Bytes::copy_from_slice);
        let bytes = match (req.body(), bytes) {
            (None, _) => bytes::Bytes::new(),
            (Some(_), Some(bytes)) => bytes,
            // A streaming body: nothing to replay, so send it once.
            (Some(_), None) => return next.run(req, extensions).await,
        };
        // reqwest keeps its per-request settings (the timeout) and any extensions of the
        // `http::Request` it was made from in private extensions; only this conversion
        // reaches them, and the conversion back in `NextService` hands them to every attempt.
        let (mut parts, _) = http::Request::<reqwest::Body>::try_from(req)?.into_parts();
        add_markers(extensions, &mut parts.extensions);
        let http_req = http::Request::from_parts(parts, http_body_util::Full::new(bytes));
        let svc = NextService {
            next,
            extensions: extensions.clone(),
        };
        // The chain's service is always ready: the retry loop runs on it directly, with no
        // `Retry` service (whose `call` would clone the chain only to drop the clone).
        match ResponseFuture::new(svc, self.config.clone(), http_req, None).await {
            Ok(res) => {
                use reqwest::ResponseBuilderExt;
                let (mut parts, body) = res.into_parts();
                let url = parts.extensions.remove::<FinalUrl>();
                let mut builder = http::Response::builder()
                    .status(parts.status)
                    .version(parts.version);
                if let Some(FinalUrl(url)) = url {
                    builder = builder.url(url);
                }
                if let Some(headers) = builder.headers_mut() {
                    *headers = parts.headers;
                }
                if let Some(ext) = builder.extensions_mut() {
                    ext.extend(parts.extensions);
                }
                let res = builder
                    .body(reqwest::Body::wrap(body))
                    .map_err(reqwest_middleware::Error::middleware)?;
                Ok(reqwest::Response::from(res))
            }
            Err(err) => Err(into_middleware_error(err)),
        }
    }
}

/// Adds the markers set the reqwest-middleware way (`RequestBuilder::with_extension`, or an
/// earlier middleware) to those the request itself carries. A `RetryPolicy` or an `Override` in
/// `from` wins.
fn add_markers(from: &Extensions, to: &mut Extensions) {
    if from.get::<NotReplaySafe>().is_some() {
        to.insert(NotReplaySafe);
    }
    if from.get::<NoRetry>().is_some() {
        to.insert(NoRetry);
    }
    if let Some(policy) = from.get::<RetryPolicy>() {
        to.insert(policy.clone());
    }
    if let Some(changes) = from.get::<Override>() {
        to.insert(*changes);
    }
}

fn into_middleware_error(err: Error) -> reqwest_middleware::Error {
    // An inner failure that was never retried goes back exactly as the chain raised it.
    if err.kind() == ErrorKind::Service && err.trail().is_none_or(|t| t.total_attempts() <= 1) {
        match err
            .into_source()
            .map(|s| s.downcast::<reqwest_middleware::Error>())
        {
            Some(Ok(inner)) => return *inner,
            Some(Err(other)) => {
                return reqwest_middleware::Error::middleware(
                    Error::new(ErrorKind::Service).with_source(other),
                )
            }
            None => return reqwest_middleware::Error::middleware(Error::new(ErrorKind::Service)),
        }
    }
    reqwest_middleware::Error::middleware(err)
}
