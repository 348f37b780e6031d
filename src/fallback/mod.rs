//! Falling back to another model when one stays overloaded.
//!
//! When a model answers `529` (or an error whose body says `overloaded_error`) several times in
//! a row, waiting longer rarely helps; another model usually answers at once.
//! [`ModelFallbackLayer`] sits inside [`RetryLayer`](crate::RetryLayer) and reads the number of
//! consecutive overloads of the request from the [`AttemptContext`](crate::AttemptContext)
//! that the retry loop attaches to every attempt. Once it reaches the threshold (3 by default)
//! the next attempt goes to the next model of the chain: the top-level `"model"` of the JSON
//! body is replaced and every other byte is left as it was (see [`json_edit`](crate::json_edit)),
//! so the prompt cache still matches the prefix.
//!
//! Outside `RetryLayer` (or with no `RetryLayer` at all) the layer sees no `AttemptContext`,
//! so it cannot count a request's consecutive overloads and does not fall back as configured;
//! it logs a warning the first time, once per layer.
//!
//! When a [`ContextOverflowLayer`](crate::ContextOverflowLayer) inside this one re-sends a
//! request to its context-window fallback, [`ModelUsed::model`] names that model.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_llm_retry::{ModelFallbackLayer, ModelUsed, ReplayBody, RetryLayer};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let http_client = service_fn(|_req: Request<ReplayBody>| async {
//! #     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! # });
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     // After 3 overloads in a row, Sonnet; after 3 more, Haiku.
//!     .layer(ModelFallbackLayer::new(["claude-sonnet-4-5", "claude-haiku-4-5"])?)
//!     .service(http_client);
//!
//! let request = Request::post("https://api.anthropic.com/v1/messages")
//!     .body(Full::new(Bytes::from_static(br#"{"model":"claude-opus-4-1","max_tokens":1024}"#)))?;
//! let response = client.oneshot(request).await?;
//! let used = response.extensions().get::<ModelUsed>().unwrap();
//! println!("answered by {} (asked for {})", used.model, used.requested);
//! # Ok(()) }
//! ```
//!
//! # Customised
//!
//! ```
//! use std::time::Duration;
//! use tower_llm_retry::fallback::{FallbackMode, ModelFallbackLayer};
//!
//! # fn main() -> Result<(), tower_llm_retry::retry::ConfigError> {
//! // Fall back after 2 overloads, and keep using the fallback for five minutes before the
//! // primary is tried again.
//! let sticky = ModelFallbackLayer::new(["claude-sonnet-4-5"])?
//!     .threshold(2)?
//!     .sticky(Duration::from_secs(300));
//!
//! // An agent that picks models itself: no rewriting, an error that says what to switch to.
//! let signal = ModelFallbackLayer::new(["claude-sonnet-4-5"])?.mode(FallbackMode::Signal);
//! # let _ = (sticky, signal);
//! # Ok(()) }
//! ```
//!
//! In [`FallbackMode::Signal`] the attempt that reaches the threshold ends the request with
//! an [`Error`](crate::Error) of kind [`ErrorKind::FallbackTriggered`](crate::ErrorKind::FallbackTriggered)
//! whose [`fallback_triggered`](crate::Error::fallback_triggered) names both models; the
//! overloaded response is dropped and `RetryLayer` returns the error as it is.
//!
//! # Configuration
//!
//! | setting | default | change with |
//! |---|---|---|
//! | threshold | 3 consecutive overloads of one request | [`threshold(n)`](ModelFallbackLayer::threshold) (at least 1) |
//! | sticky | off: every request starts on its own model | [`sticky(cooldown)`](ModelFallbackLayer::sticky): later requests for that model start at the fallback until the cooldown ends |
//! | mode | [`FallbackMode::Rewrite`]: rewrite the body's `"model"` | [`mode(FallbackMode::Signal)`](ModelFallbackLayer::mode): end the request with [`ErrorKind::FallbackTriggered`](crate::ErrorKind::FallbackTriggered) |
//! | body buffer, on its own | 32 MiB | [`body_limit`](ModelFallbackLayer::body_limit) |
//! | error body read to tell an overload | 64 KiB | [`peek_limit`](ModelFallbackLayer::peek_limit) |
//!
//! # The chain
//!
//! - A request whose model is itself in the chain falls back to the models after it, so one
//!   chain serves requests for any of its models.
//! - The count is of *consecutive* overloads: any other outcome (a 503, a timeout) resets it,
//!   and without [sticky](ModelFallbackLayer::sticky) mode the attempt after such a reset goes
//!   back to the requested model.
//! - When the last model of the chain reaches the threshold too, the chain is exhausted: its
//!   last response goes up unchanged, marked with [`ModelUsed::chain_exhausted`], and
//!   `RetryLayer` returns it (with its [`RetryTrail`](crate::RetryTrail)) instead of retrying.
//! - Every response carries a [`ModelUsed`] extension, and each call runs in an
//!   `llm_fallback` tracing span with the OpenTelemetry fields `gen_ai.request.model` and
//!   `gen_ai.response.model` set to the model actually used.
//! - A body that is not a JSON object with a string `"model"`, or that could not be buffered,
//!   passes through untouched.
//!
//! The retry policy must allow enough attempts for the chain: with the default threshold and a
//! two-model chain, the last model gets its first attempt on the 7th try. Leave
//! [`RetryPolicy::max_consecutive_overloads`](crate::RetryPolicy::max_consecutive_overloads)
//! unset, or set it above `threshold × (chain length + 1)`.
//!
//! On its own, without `RetryLayer` around it, the layer sees every request as a first attempt:
//! only a sticky fallback set by other requests applies.

mod future;
mod layer;
mod service;

pub use self::future::ResponseFuture;
pub use self::layer::ModelFallbackLayer;
pub use self::service::ModelFallback;

/// What [`ModelFallbackLayer`] does once the threshold is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FallbackMode {
    /// The next attempt goes to the next model of the chain: the body's `"model"` is rewritten.
    #[default]
    Rewrite,
    /// The request ends with [`ErrorKind::FallbackTriggered`](crate::ErrorKind::FallbackTriggered)
    /// naming the overloaded model and the next one, and the body is never rewritten: for
    /// callers that manage models themselves.
    Signal,
}

/// Response extension: the model a request was sent to.
///
/// Set by [`ModelFallbackLayer`] on every response to a request whose body names a model.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelUsed {
    /// The model this response came from.
    pub model: String,
    /// The model the caller asked for.
    pub requested: String,
    /// This response is an overload from the last model of the chain, so no model is left to
    /// fall back to; `RetryLayer` returns it without retrying.
    pub chain_exhausted: bool,
}

impl ModelUsed {
    /// Whether the response came from a fallback rather than the requested model.
    pub fn is_fallback(&self) -> bool {
        self.model != self.requested
    }
}
