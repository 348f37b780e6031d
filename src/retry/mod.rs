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
//! use tower_llm_retry::{RetryLayer, RetryPolicy};
//! use tower_llm_retry::retry::{RetryEvent, RetryObserver};
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
//!     .retry_count_header(HeaderName::from_static("x-stainless-retry-count"))
//!     .observer(LogRetries)
//!     .cancellation(shutdown.clone());
//! # let _ = layer;
//! ```
//!
//! # What happens to one request
//!
//! 1. The body is read once into [`Bytes`](bytes::Bytes), under the body limit. Every attempt
//!    sends the same bytes and headers, plus an [`AttemptContext`] extension (and, opt-in, a
//!    retry-count header).
//! 2. Each attempt's outcome goes to the [`Classify`](crate::classify::Classify)
//!    implementation (the default's table is in [`classify`](crate::classify)). For 4xx and 5xx
//!    responses the start of the body (64 KiB by default) is read first, so that
//!    `overloaded_error` or an exhausted quota can be told apart; the caller still receives the
//!    whole body. A `text/event-stream` response is held back until its first output (see
//!    [`stream`](crate::stream)).
//! 3. A retryable failure goes through the checks [below](#after-the-verdict), sleeps for the
//!    server's `Retry-After` or the policy's backoff, then tries again; the inner service is
//!    polled ready before each attempt.
//! 4. The result is the last response (with a [`RetryTrail`] extension if any attempt failed),
//!    or an [`Error`](crate::Error) whose kind says why.
//!
//! # Attempt numbers
//!
//! Attempts are numbered from 1: the first attempt is attempt 1, the first retry attempt 2.
//! Every `attempt` in the crate counts this way ([`AttemptContext::attempt`],
//! [`AttemptRecord::attempt`](crate::retry::AttemptRecord::attempt), [`RetryEvent::attempt`], the
//! `attempt` field of the log events). What counts retries says so in its name and counts
//! from 0: [`RetryPolicy::max_retries`], the [retry-count header](RetryLayer::retry_count_header)
//! (attempt − 1, as the official SDKs' `x-stainless-retry-count`), and the span field
//! `http.request.resend_count`. A [`RetryTrail`]'s
//! [`total_attempts`](crate::RetryTrail::total_attempts) counts every request sent, including
//! the immediate re-send of one the server provably never processed.
//!
//! # Companion layers inside the loop
//!
//! [`AuthLayer`], [`ModelFallbackLayer`] and
//! [`ContextOverflowLayer`] inside a `RetryLayer` keep no copy of
//! the request and read no error body of their own: they edit each send on its way in, and
//! ask the loop about the answer. The loop reads the error body once, classifies it once (the
//! classifier parses it, and the companions read that [`Classification`](crate::classify::Classification),
//! so a custom [`Classify`](crate::classify::Classify) steers them too), and does what they ask:
//!
//! - re-send the same attempt at once (a fresh credential after a `401`, the next pool key
//!   after a `429`, a repaired `max_tokens`): not a retry, so no backoff, no budget, no new
//!   attempt number, and the fleet does not learn from the answer it replaces;
//! - end the request with the layer's final error ([`ErrorKind::TokenRefresh`],
//!   [`ErrorKind::FallbackTriggered`]), or return the
//!   response without a retry (an overload from the last model of a fallback chain): these hold
//!   whatever the classifier says, so a custom [`Classify`](crate::classify::Classify) cannot
//!   retry them;
//! - send the next attempt one model further down the fallback chain.
//!
//! A repair is carried by every later attempt of the request. The companions are
//! `Service<Request<ReplayBody>>`s that return their inner service's responses and errors
//! as they are, so the stack's body type is one [`RetryBody`] around the HTTP client's. What
//! they tell the loop travels on a handle in the request's [`AttemptContext`], so a layer in
//! between that maps response bodies or inspects errors changes nothing. They work only
//! inside the loop: to use one without retries, use `RetryLayer` with the
//! [`never`](RetryPolicy::never) policy; its re-sends of the same attempt still happen.
//!
//! # Defaults
//!
//! | setting | default | change with |
//! |---|---|---|
//! | retries | 10 | [`RetryPolicy::max_retries`], or `LLM_MAX_RETRIES` (0 to 1,000) through [`RetryPolicy::with_env`] |
//! | backoff before retry *n* | `min(0.5 s · 2^(n−1), 32 s)`: 0.5, 1, 2, 4, 8, 16, 32, 32 … s | [`initial_backoff`](RetryPolicy::initial_backoff), [`max_backoff`](RetryPolicy::max_backoff), [`multiplier`](RetryPolicy::multiplier) |
//! | jitter | `+U[0, 25 %]` of the backoff (only the sleep, never the request) | [`RetryPolicy::jitter`] with [`Jitter`]`::{none, add, subtract, symmetric}`; [`Random::seeded`] for tests |
//! | `Retry-After` | honoured as sent, from 0 up to 60 s; the backoff is no floor under it | [`retry_after_min`](RetryPolicy::retry_after_min), [`retry_after_max`](RetryPolicy::retry_after_max), [`backoff_is_floor`](RetryPolicy::backoff_is_floor), [`ignore_zero_retry_after`](RetryPolicy::ignore_zero_retry_after) |
//! | `Retry-After` above 60 s | give up and return the response | [`above_ceiling`](RetryPolicy::above_ceiling) with [`AboveCeiling`]`::{GiveUp, UseBackoff, Clamp}` |
//! | consecutive overloads | no limit | [`max_consecutive_overloads`](RetryPolicy::max_consecutive_overloads) |
//! | time to response head, per attempt | 600 s; a stall is retried as `Transport` | [`head_timeout`](RetryPolicy::head_timeout) |
//! | idle time between body frames | 600 s; retried before a stream's commit point, [`IdleTimeout`](crate::ErrorKind::IdleTimeout) after | [`idle_timeout`](RetryPolicy::idle_timeout) |
//! | time from an event stream's head to its first output (the commit point), per attempt | none; when set, a stream with no output by then is retried as `Timeout` (never after output) | [`first_output_timeout`](RetryPolicy::first_output_timeout) |
//! | total deadline | none; when set, no attempt starts after it, a retry whose sleep would reach it is not made, every wait (gate, pacing line, `poll_ready`) ends at it, each attempt's head timeout is cut to what is left, and the read of an answer's start (an error body, a stream before its first output) ends at it | [`deadline`](RetryPolicy::deadline) |
//! | request body buffer | 32 MiB (Anthropic's request limit) | [`RetryLayer::body_limit`] |
//! | error body, or SSE preamble, read before deciding | 64 KiB (the caller still gets all of it) | [`RetryLayer::peek_limit`] |
//! | retry-count header | none | [`RetryLayer::retry_count_header`] (`x-stainless-retry-count`, as the official SDKs) |
//! | SSE first-event gate | on for `text/event-stream` | [`RetryLayer::sse_gate`] |
//! | stream end check (a clean cut before the terminal event is an error) | on | [`RetryLayer::stream_end_check`] |
//! | read 2xx bodies whole inside the loop, retrying truncated ones | off | [`RetryLayer::buffer_responses`] |
//! | classifier | [`DefaultClassifier`](crate::classify::DefaultClassifier) | [`RetryLayer::classifier`] |
//! | shutdown token | none | [`RetryLayer::cancellation`] |
//! | observer | none | [`RetryLayer::observer`] |
//! | retry budget, shared by every layer given one fleet | on | [`RetryLayer::fleet`] with [`FleetBuilder::budget`](crate::fleet::FleetBuilder::budget); settings in [`fleet`](crate::fleet#configuration) |
//! | cooldown gate, shared likewise | on, for a `Retry-After` of 2 s or more | [`FleetBuilder::cooldown_gate`](crate::fleet::FleetBuilder::cooldown_gate); settings in [`fleet`](crate::fleet#configuration) |
//! | adaptive pacing, shared likewise | on, dormant until the server signals a rate limit | [`FleetBuilder::pacing`](crate::fleet::FleetBuilder::pacing); settings in [`fleet`](crate::fleet#configuration) |
//!
//! The presets ([`RetryPolicy::sdk_compatible`], [`patient`](RetryPolicy::patient),
//! [`interactive`](RetryPolicy::interactive), [`never`](RetryPolicy::never)) and what each does
//! with a `Retry-After` are listed on [`RetryPolicy`].
//!
//! # After the verdict
//!
//! A failed attempt is recorded in the trail, then the loop decides, in this order (the first
//! that applies wins):
//!
//! 1. Not retryable by the classifier: stop ([`GiveUpReason::NotRetryable`]).
//! 2. Class [`NotProcessed`](crate::classify::FailureClass::NotProcessed), the first such
//!    failure of this attempt, a copy of the request kept, no shutdown signalled: re-sent at
//!    once, also when [`NotReplaySafe`]; no sleep, not counted as a retry, nothing drawn from
//!    the budget (see [`classify`](crate::classify#http2-proofs-that-a-request-was-never-processed)).
//! 3. [`NotReplaySafe`] and the failure does not prove the request was never sent
//!    ([`Classify::request_not_sent`](crate::classify::Classify::request_not_sent)): stop.
//! 4. Retries used up (`max_retries`): stop.
//! 5. The policy's limit of consecutive overloads reached: stop.
//! 6. The shutdown token fired: stop with [`ErrorKind::Cancelled`](crate::ErrorKind::Cancelled).
//! 7. The sleep: the `Retry-After` clamped to `[retry_after_min, retry_after_max]`, or the
//!    jittered backoff. A `Retry-After` above the ceiling gives up under
//!    [`AboveCeiling::GiveUp`] (the default), and is replaced by the backoff or the ceiling under
//!    the others. A retryable verdict does not override this: `x-should-retry: true` with a
//!    `Retry-After` of an hour still gives up under the default policy.
//! 8. The deadline: a retry that would start at or after it (after the sleep, or after the
//!    cooldown gate reopens) is not made.
//! 9. The fleet's retry budget refuses the retry: stop.
//!
//! Otherwise the loop sleeps; the sleep, and the waits at the gate, in the pacing line and for
//! the service to be ready, end early on the shutdown token ([`ErrorKind::Cancelled`](crate::ErrorKind::Cancelled))
//! or the deadline ([`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded)).
//!
//! When the loop stops on a response, that response is returned with a [`RetryTrail`] whose
//! [`gave_up`](RetryTrail::gave_up) says why. When it stops on an error, the error's kind is
//! [`Exhausted`](crate::ErrorKind::Exhausted) for retries used up, an overlong `Retry-After`,
//! too many overloads and the deadline; [`BudgetExhausted`](crate::ErrorKind::BudgetExhausted)
//! for the budget; [`Service`](crate::ErrorKind::Service) for a failure that was not retried (a
//! final error of an inner layer is returned as it is).
//!
//! Dropping the response future stops everything at once: the attempt in flight is dropped with
//! it. The shutdown token ([`RetryLayer::cancellation`]) ends waits at once and lets an attempt
//! already in flight finish; no further attempt starts.
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
//! retried only when the failure proves nothing reached the server (a refused connection, or
//! one of the HTTP/2 proofs in [`classify`](crate::classify)). [`NoRetry`] turns retries off for
//! one request.
//!
//! # Per request
//!
//! An [`Override`] in the request extensions changes the settings it names (the number of
//! retries, the timeouts, the deadline, the `Retry-After` ceiling) for that request, and
//! leaves every other setting of the layer's policy as it is. A whole [`RetryPolicy`] in the
//! extensions replaces the layer's policy for that request (a preset picked per request, as
//! the proxy's `x-llm-retry-policy` header does); an `Override` then applies on top of it.
//!
#![cfg_attr(feature = "auth", doc = "[`AuthLayer`]: crate::AuthLayer")]
#![cfg_attr(not(feature = "auth"), doc = "[`AuthLayer`]: crate#features")]
#![cfg_attr(
    feature = "fallback",
    doc = "[`ModelFallbackLayer`]: crate::ModelFallbackLayer"
)]
#![cfg_attr(
    not(feature = "fallback"),
    doc = "[`ModelFallbackLayer`]: crate#features"
)]
#![cfg_attr(
    feature = "overflow",
    doc = "[`ContextOverflowLayer`]: crate::ContextOverflowLayer"
)]
#![cfg_attr(
    not(feature = "overflow"),
    doc = "[`ContextOverflowLayer`]: crate#features"
)]
#![cfg_attr(
    feature = "auth",
    doc = "[`ErrorKind::TokenRefresh`]: crate::ErrorKind::TokenRefresh"
)]
#![cfg_attr(
    not(feature = "auth"),
    doc = "[`ErrorKind::TokenRefresh`]: crate#features"
)]
#![cfg_attr(
    feature = "fallback",
    doc = "[`ErrorKind::FallbackTriggered`]: crate::ErrorKind::FallbackTriggered"
)]
#![cfg_attr(
    not(feature = "fallback"),
    doc = "[`ErrorKind::FallbackTriggered`]: crate#features"
)]

mod decide;
mod future;
pub(crate) mod layer;
mod peek;
pub(crate) mod policy;
mod service;

use std::time::Duration;

use http::StatusCode;

pub use self::future::ResponseFuture;
pub use crate::body::DEFAULT_BODY_LIMIT;
pub use crate::error::{AttemptRecord, GiveUpReason, TimedOut, TimeoutKind};
pub(crate) use crate::pipeline::RetryBody;
pub use crate::pipeline::{AttemptContext, DEFAULT_PEEK_LIMIT};
// Sealed: it appears in the bounds of the response futures, but cannot be named or implemented
// outside the crate.
#[cfg(feature = "reqwest-middleware")]
pub(crate) use self::layer::Config;
pub(crate) use self::layer::RetryLayer;
pub(crate) use self::policy::RetryPolicy;
pub use self::policy::{AboveCeiling, Jitter, Override, DEFAULT_TIMEOUT, ENV_MAX_RETRIES};
pub use self::service::Retry;
// Shared with the fleet, which does not depend on this module: re-exported here, where the
// policy that takes it is.
pub use crate::random::Random;

use crate::classify::FailureClass;
use crate::error::RetryTrail;

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
    /// The attempt that failed: 1 for the first. The retry about to be made is attempt
    /// `attempt + 1`.
    pub attempt: u32,
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
