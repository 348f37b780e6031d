//! Retrying LLM API calls: buffer the body once, judge every attempt, back off, honour
//! `Retry-After`, never re-send what is unsafe to re-send.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use bytes::Bytes;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_llm_retry::{ReplayBody, RetryLayer};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_llm_retry::Error> {
//! // Any `Service<Request<ReplayBody>>` that returns `http::Response`s: a hyper-util client,
//! // a reqwest adapter, an axum router, or, here, a function.
//! let upstream = service_fn(|_req: Request<ReplayBody>| async {
//!     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! });
//!
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     .service(upstream);
//!
//! let request = Request::post("https://api.anthropic.com/v1/messages")
//!     .body(Full::new(Bytes::from_static(br#"{"model":"claude-sonnet-4-5","max_tokens":64}"#)))
//!     .unwrap();
//! let response = client.oneshot(request).await?;
//! assert!(response.status().is_success());
//! # Ok(()) }
//! ```
//!
//! # Customised
//!
//! ```
//! use std::time::Duration;
//! use http::HeaderName;
//! use tokio_util::sync::CancellationToken;
//! use tower_llm_retry::{RetryLayer, RetryPolicy, RetryObserver, RetryEvent};
//!
//! #[derive(Debug)]
//! struct LogRetries;
//! impl RetryObserver for LogRetries {
//!     fn on_retry(&self, e: &RetryEvent<'_>) {
//!         eprintln!("attempt {} failed ({}), retrying in {:?}", e.attempt, e.class, e.delay);
//!     }
//! }
//!
//! let shutdown = CancellationToken::new();
//! let layer = RetryLayer::new()
//!     .policy(
//!         RetryPolicy::default()
//!             .max_retries(4)
//!             .initial_backoff(Duration::from_millis(250))
//!             .retry_after_max(Duration::from_secs(30)),
//!     )
//!     .body_limit(8 * 1024 * 1024)
//!     .attempt_header(HeaderName::from_static("x-stainless-retry-count"))
//!     .observer(LogRetries)
//!     .cancellation(shutdown.clone());
//! # let _ = layer;
//! ```
//!
//! # What happens to one request
//!
//! 1. The body is read once into [`Bytes`](bytes::Bytes), under the body limit. Every attempt
//!    sends the same bytes and headers, plus an [`AttemptContext`] extension (and, opt-in, an
//!    attempt-count header).
//! 2. Each attempt's outcome goes to the [`Classify`](crate::classify::Classify)
//!    implementation. For 4xx and 5xx responses the start of the body (64 KiB by default) is
//!    read first, so that `overloaded_error` or an exhausted quota can be told apart; the
//!    caller still receives the whole body.
//! 3. A retryable failure sleeps for the server's `Retry-After` or the policy's backoff, then
//!    tries again; the inner service is polled ready before each attempt.
//! 4. The result is the last response (with a [`RetryTrail`] extension if
//!    any attempt failed), or an [`Error`](crate::Error) whose kind says why.
//!
//! # Differences from `tower::retry`
//!
//! - No `Clone` bound on the request: the body is buffered once into a [`ReplayBody`](crate::ReplayBody)
//!   whose clone is a reference-count bump.
//! - Knows HTTP and LLM APIs: `Retry-After` (milliseconds, seconds, HTTP-date),
//!   `x-should-retry`, 529 and `overloaded_error`, exhausted quotas.
//! - Sleeps are part of the layer, with jitter, and can be cut short by a shutdown token.
//! - A final failed response is returned as a response, as in `tower::retry`, but with the
//!   trail of every attempt attached.
//!
//! # Replay safety
//!
//! Mark a request with [`NotReplaySafe`] when sending it twice would do harm: it is then
//! retried only when the failure proves nothing reached the server (the connection was
//! refused). [`NoRetry`] turns retries off for one request, and a [`RetryPolicy`] in the
//! request extensions replaces the layer's policy for that request.

pub(crate) mod body;
mod future;
mod layer;
mod policy;
mod service;

use std::time::Duration;

use http::StatusCode;

pub use self::body::RetryBody;
pub(crate) use self::future::ResBodyOf;
pub use self::future::{HttpResponse, ResponseFuture};
#[cfg(feature = "reqwest-middleware")]
pub(crate) use self::layer::Config;
pub use self::layer::{RetryLayer, DEFAULT_PEEK_LIMIT};
pub use self::policy::{
    AboveCeiling, ConfigError, Jitter, Random, RetryPolicy, DEFAULT_TIMEOUT, ENV_MAX_RETRIES,
};
pub use self::service::Retry;

use crate::classify::FailureClass;
use crate::error::RetryTrail;

/// Request extension set on every attempt, for the layers inside [`RetryLayer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptContext {
    /// This attempt's number: 0 for the first, 1 for the first retry, and so on.
    pub attempt: u32,
    /// How the previous attempt failed, if there was one.
    pub previous: Option<FailureClass>,
    /// How many attempts in a row, just before this one, were overloaded.
    pub consecutive_overloads: u32,
    /// The most retries the policy allows this request.
    pub max_retries: u32,
}

/// Request extension: send this request once, never retry it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoRetry;

/// Request extension: this request must not be sent twice (it starts a payment, say). It is
/// retried only when the failure proves nothing reached the server, such as a refused
/// connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotReplaySafe;

/// A retry about to happen, as told to [`RetryObserver::on_retry`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RetryEvent<'a> {
    /// The attempt that failed: 0 for the first.
    pub attempt: u32,
    /// The retry about to be made: 1 for the first.
    pub retry: u32,
    /// How the attempt failed.
    pub class: FailureClass,
    /// The response status, when the attempt got a response.
    pub status: Option<StatusCode>,
    /// The error, when the attempt got no response.
    pub error: Option<&'a (dyn std::error::Error + 'static)>,
    /// The wait the server asked for, if any.
    pub retry_after: Option<Duration>,
    /// The sleep before the retry.
    pub delay: Duration,
    /// The most retries the policy allows.
    pub max_retries: u32,
}

/// Hooks into the retry loop, for metrics and logs.
///
/// Every method has an empty default. They are called synchronously from the request's
/// future, so they must not block.
pub trait RetryObserver: Send + Sync + 'static {
    /// Before each sleep that precedes a retry.
    fn on_retry(&self, event: &RetryEvent<'_>) {
        let _ = event;
    }

    /// After a success that needed retries; `total_attempts` counts the first attempt too.
    fn on_recovered(&self, total_attempts: u32) {
        let _ = total_attempts;
    }

    /// When the loop stops on a failure it could have retried, or on any failure after retries.
    fn on_give_up(&self, trail: &RetryTrail) {
        let _ = trail;
    }
}

impl<O: RetryObserver + ?Sized> RetryObserver for std::sync::Arc<O> {
    fn on_retry(&self, event: &RetryEvent<'_>) {
        (**self).on_retry(event)
    }
    fn on_recovered(&self, total_attempts: u32) {
        (**self).on_recovered(total_attempts)
    }
    fn on_give_up(&self, trail: &RetryTrail) {
        (**self).on_give_up(trail)
    }
}
