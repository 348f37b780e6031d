//! Repairing requests whose `max_tokens` does not fit the context window, and telling the
//! caller when the prompt itself does not.
//!
//! Anthropic rejects a request whose prompt plus `max_tokens` exceeds the model's context
//! window with a `400` that gives the numbers:
//!
//! ```text
//! input length and `max_tokens` exceed context limit: 197000 + 21333 > 200000
//! ```
//!
//! [`ContextOverflowLayer`] reads them and re-sends the request at once (no sleep, and only
//! once) with `max_tokens = max(floor, limit − input − margin)`, at least
//! `thinking.budget_tokens + 1` when extended thinking is on. Only the value of `max_tokens`
//! changes; every other byte of the body is sent as it was, so the prompt cache still matches.
//! The response then carries [`OverflowRepaired`].
//!
//! A prompt that alone is too long (Anthropic's `prompt is too long: 210000 tokens > 200000
//! maximum`, `400` or `413`, or OpenAI's `context_length_exceeded`) cannot be repaired that
//! way. The response goes back as it is, with a [`ContextWindowExceeded`] extension giving the
//! numbers, so the caller can compact the conversation. With a
//! [`context_window_fallback`](ContextOverflowLayer::context_window_fallback) model the
//! request is first re-sent once to that model instead.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_llm_retry::{ContextOverflowLayer, ReplayBody, RetryLayer};
//! use tower_llm_retry::overflow::{ContextWindowExceeded, OverflowRepaired};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let http_client = service_fn(|_req: Request<ReplayBody>| async {
//! #     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! # });
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     .layer(ContextOverflowLayer::new())
//!     .service(http_client);
//!
//! let request = Request::post("https://api.anthropic.com/v1/messages")
//!     .body(Full::new(Bytes::from_static(br#"{"model":"claude-sonnet-4-5","max_tokens":64000}"#)))?;
//! let response = client.oneshot(request).await?;
//! if let Some(OverflowRepaired::MaxTokens { from, to }) = response.extensions().get() {
//!     println!("max_tokens lowered from {from} to {to}");
//! }
//! if let Some(overflow) = response.extensions().get::<ContextWindowExceeded>() {
//!     println!("prompt too long ({:?} tokens, limit {:?}): compact and retry", overflow.input_tokens, overflow.limit);
//! }
//! # Ok(()) }
//! ```
//!
//! # Customised
//!
//! ```
//! use tower_llm_retry::ContextOverflowLayer;
//!
//! let layer = ContextOverflowLayer::new()
//!     .floor(1_024)
//!     .margin(2_000)
//!     .context_window_fallback("claude-sonnet-4-5-1m");
//! # let _ = layer;
//! ```
//!
//! # Configuration
//!
//! | setting | default | change with |
//! |---|---|---|
//! | `floor`: the least `max_tokens` a repair sends | 3,000 tokens | [`floor`](ContextOverflowLayer::floor) |
//! | `margin`: tokens kept free below the limit | 1,000 tokens | [`margin`](ContextOverflowLayer::margin) |
//! | model tried once when the prompt alone is too long | none | [`context_window_fallback`](ContextOverflowLayer::context_window_fallback) |
//! | `400` / `413` body read to recognise an overflow | 64 KiB | the `RetryLayer`'s [`peek_limit`](crate::RetryLayer::peek_limit) |
//!
//! # Where it goes
//!
//! Inside [`RetryLayer`](crate::RetryLayer), which does not retry these `400`s itself: the
//! repair is part of the attempt that met the overflow, not a new attempt. The loop reads the
//! error body and classifies it once (an overflow is the class
//! [`ContextOverflow`](crate::classify::FailureClass::ContextOverflow), with its numbers) and does the
//! re-send the layer asks for. A body that the loop could not buffer, or that is not a JSON
//! object with a numeric `max_tokens`, is never repaired. For a repair without retries, use
//! `RetryLayer` with the [`never`](crate::RetryPolicy::never) policy: the repair is a re-send
//! of the same attempt, and still happens. Without a `RetryLayer` at all, requests pass
//! through untouched.

mod future;
pub(crate) mod layer;
mod service;

pub use self::future::ResponseFuture;
pub use self::service::ContextOverflow;
// The layer is public at the crate root only; imported here for the docs.
#[cfg(doc)]
use self::layer::ContextOverflowLayer;
pub use crate::pipeline::OverflowRepaired;

use crate::provider::error_body::{context_overflow, Overflow};

/// Response extension: this response says the request does not fit the model's context
/// window, and the layer could not repair it. The caller has to shorten the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContextWindowExceeded {
    /// The prompt's size in tokens, when the message gives it.
    pub input_tokens: Option<u64>,
    /// The context window in tokens, when the message gives it.
    pub limit: Option<u64>,
    /// The `max_tokens` the message says was asked for, for an overflow that a smaller
    /// `max_tokens` could not repair.
    pub max_tokens: Option<u64>,
}

impl ContextWindowExceeded {
    /// Reads a context-overflow error body, Anthropic's or OpenAI's; `None` for any other body.
    ///
    /// ```
    /// use tower_llm_retry::overflow::ContextWindowExceeded;
    ///
    /// let body = br#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#;
    /// let overflow = ContextWindowExceeded::from_body(body).unwrap();
    /// assert_eq!((overflow.input_tokens, overflow.limit), (Some(210_000), Some(200_000)));
    /// ```
    pub fn from_body(body: &[u8]) -> Option<Self> {
        context_overflow(body).map(Self::from)
    }
}

impl From<Overflow> for ContextWindowExceeded {
    fn from(o: Overflow) -> Self {
        match o {
            Overflow::MaxTokens {
                input,
                max_tokens,
                limit,
            } => ContextWindowExceeded {
                input_tokens: Some(input),
                limit: Some(limit),
                max_tokens: Some(max_tokens),
            },
            Overflow::Prompt { input, limit } => ContextWindowExceeded {
                input_tokens: input,
                limit,
                max_tokens: None,
            },
        }
    }
}
