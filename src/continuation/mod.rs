//! Continuing an answer that stopped at the output limit, append-only, into one response.
//!
//! A non-streaming text answer that stops at `max_tokens` (Anthropic `stop_reason:
//! "max_tokens"`, OpenAI `finish_reason: "length"`) is only part of the answer. Sending the
//! request again would pay for the same text twice, and prefilling an assistant turn is refused
//! by recent models. [`ContinuationLayer`] instead sends, at once and with no sleep, a
//! follow-up that only appends to the conversation:
//!
//! ```text
//! round 0:  {…, "messages":[ …the caller's messages… ]}                        → "Hel"  (max_tokens)
//! round 1:  {…, "messages":[ …the caller's messages…,
//!                            {"role":"assistant","content":"Hel"},
//!                            {"role":"user","content":"Continue exactly where you stopped…"}]} → "lo" (end_turn)
//! caller:   one response, text "Hello", usage summed, stop_reason of the last round, Continued { rounds: 1 }
//! ```
//!
//! - Every follow-up is the request before it with two turns appended to `messages`; every
//!   other byte is sent as it was, so prompt caches match and each round's prefix is the
//!   previous round's request. The original request is never sent again as it was.
//! - Up to [`max_rounds`](ContinuationLayer::max_rounds) follow-ups (3 by default); the
//!   response then carries [`Continued`] (and [`OutputTruncated`](crate::stream::OutputTruncated)
//!   when even the last round stopped at the limit).
//! - The stitched body is the last round's body with its text preceded by every earlier
//!   round's (Anthropic: merged into the first text block; OpenAI: `choices[0].message.content`),
//!   `usage` summed field by field, and a `content-length` that matches.
//! - A tool call cut at the limit (a `tool_use` block, a `tool_calls` entry) is never continued
//!   and must never be run: the response comes back as it is, with [`TruncatedToolCall`] and
//!   [`OutputTruncated`](crate::stream::OutputTruncated) extensions.
//! - Streaming requests (`"stream": true`) and `text/event-stream` responses pass through
//!   untouched: build their follow-up with [`follow_up_body`] and send it yourself.
//! - A follow-up that fails (an error, a non-2xx status, a body that is not an answer) ends the
//!   continuation: the caller receives the rounds that succeeded, stitched, with
//!   `Continued { complete: false, .. }`; nothing already paid for is thrown away.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_llm_retry::{ContinuationLayer, ReplayBody, RetryLayer};
//! use tower_llm_retry::continuation::{Continued, TruncatedToolCall};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_llm_retry::BoxError> {
//! # let http_client = service_fn(|_req: Request<ReplayBody>| async {
//! #     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! # });
//! let client = ServiceBuilder::new()
//!     .layer(ContinuationLayer::new())
//!     .layer(RetryLayer::new())
//!     .service(http_client);
//!
//! let request = Request::post("https://api.anthropic.com/v1/messages").body(Full::new(
//!     Bytes::from_static(br#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":"Write a long story"}]}"#),
//! ))?;
//! let response = client.oneshot(request).await?;
//! if let Some(continued) = response.extensions().get::<Continued>() {
//!     println!("stitched from {} follow-ups, complete: {}", continued.rounds, continued.complete);
//! }
//! if response.extensions().get::<TruncatedToolCall>().is_some() {
//!     println!("the answer ends in a cut-off tool call: do not run it");
//! }
//! # Ok(()) }
//! ```
//!
//! # Customised
//!
//! ```
//! use tower_llm_retry::ContinuationLayer;
//!
//! let layer = ContinuationLayer::new()
//!     .max_rounds(5)
//!     .prompt("Continue from the exact character where you stopped. Do not repeat anything.")
//!     .response_limit(4 * 1024 * 1024);
//! # let _ = layer;
//! ```
//!
//! # Streaming: the helper
//!
//! ```
//! use tower_llm_retry::continuation::{follow_up_body, DEFAULT_PROMPT};
//!
//! let original = br#"{"model":"claude-sonnet-4-5","stream":true,"messages":[{"role":"user","content":"Hi"}]}"#;
//! // The text the stream produced before `stop_reason: "max_tokens"`.
//! let next = follow_up_body(original, "Hello! How can", DEFAULT_PROMPT).unwrap();
//! assert!(next.starts_with(br#"{"model":"claude-sonnet-4-5","stream":true,"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello! How can"},"#));
//! ```
//!
//! # Resuming a cut stream
//!
//! A streamed text answer can also be cut by the network: a reset, a stall past the idle
//! timeout, a clean end before the protocol's terminal event. After the commit point the
//! request is never sent again, but [`ResumeBody`] can continue it append-only. Wrap the
//! answer's body, give it the service to send the follow-up through (the same stack, so its
//! retries and fallbacks apply) and the original request; it forwards the answer's events
//! whole and, on a cut, sends a follow-up that carries the exact partial text:
//!
//! ```text
//! answer:    message_start ─ content_block_start(0) ─ "Hel" ─ "lo, w"  ✗ reset
//! follow-up: {…, "messages":[ …, {"role":"assistant","content":"Hello, w"}]}      (ResumeWith::Prefill)
//!        or: {…, "messages":[ …, {"role":"assistant","content":"Hello, w"},
//!                                {"role":"user","content":RESUME_PROMPT}]}          (ResumeWith::Instruction)
//! its stream: message_start ─ content_block_start(0) ─ "orld" ─ "!" ─ … ─ message_delta ─ message_stop
//! caller:    message_start ─ content_block_start(0) ─ "Hel" ─ "lo, w" ─ "orld" ─ "!" ─ … ─ message_delta ─ message_stop
//! ```
//!
//! What the caller can rely on:
//!
//! - Exact text: the caller's text is the partial text followed by the continuation's, each
//!   byte once. An event the answer had not finished when it was cut is never forwarded, and
//!   its text is not part of the partial text either.
//! - One message: the continuation's preamble is dropped (Anthropic `message_start`, `ping`,
//!   and its first `content_block_start` when the cut block goes on; OpenAI's role-only first
//!   chunk), its block indices follow the answer's, OpenAI chunk `id`s are the answer's, and
//!   the final usage (Anthropic `message_delta.usage`, OpenAI's `usage` chunk) is the sum of
//!   what both streams reported. The stop reason is the continuation's.
//! - Not the same tail: the model writes the rest anew, so it may phrase it differently from
//!   what the cut stream would have sent.
//! - Text only: a stream with a tool call, a `tool_use`/`server_tool_use` block, thinking, a
//!   refusal or more than one choice is never resumed, nor one that reached its end.
//! - Prefill (Anthropic only; for OpenAI Chat Completions it is an instruction): the partial
//!   text less trailing whitespace (which Anthropic refuses in a final assistant turn); that
//!   whitespace is dropped from the continuation's start where it repeats it. A prefill
//!   answered with `400` is sent again, once, as an instruction.
//! - Failure: when the follow-up fails (an error, any other status, an error event, a stream
//!   that ends early) the body ends with the answer's own error, never with a truncated
//!   success and never with the follow-up's status. A continuation cut after its own output
//!   ends with its error. One continuation per answer.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::service_fn;
//! use tower_llm_retry::continuation::{ResumeBody, ResumeWith};
//!
//! # fn demo(answer: Full<Bytes>) {
//! let request = Request::post("https://api.anthropic.com/v1/messages").body(Bytes::from_static(
//!     br#"{"model":"claude-sonnet-4-5","stream":true,"messages":[{"role":"user","content":"Hi"}]}"#,
//! )).unwrap();
//! // The same client stack the answer came through.
//! let stack = service_fn(|_req: Request<Full<Bytes>>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
//! });
//! let body = ResumeBody::new(answer, stack, request, ResumeWith::Prefill)
//!     .on_outcome(|outcome| println!("{outcome:?}"));
//! # drop(body); }
//! ```
//!
//! # Where it goes
//!
//! Outside [`RetryLayer`](crate::RetryLayer): each follow-up is then a request of its own,
//! retried on its own, and a failure of round 2 never re-sends round 1. Inside it, a retry
//! of a failed follow-up would start over from the original request. It buffers the request
//! body (up to 32 MiB) and reads each successful non-streaming response whole (up to 16 MiB)
//! before handing it on; a larger body passes through untouched.

mod body;
mod future;
pub(crate) mod layer;
mod resume;
mod resume_body;
mod service;
mod stitch;

pub use self::body::ContinuationBody;
pub use self::future::ResponseFuture;
pub use self::resume_body::ResumeBody;
pub use self::service::Continuation;
// The layer is public at the crate root only; imported here for the docs.
#[cfg(doc)]
use self::layer::ContinuationLayer;

use bytes::Bytes;

/// The user turn that asks for the rest of the answer, unless
/// [`ContinuationLayer::prompt`] says otherwise.
pub const DEFAULT_PROMPT: &str = "Your previous answer was cut off at the output limit. Continue exactly where it stopped, from the next character, without repeating anything and without any preamble.";

/// The user turn of a [`ResumeWith::Instruction`] follow-up, unless
/// [`ResumeBody::prompt`] says otherwise.
pub const RESUME_PROMPT: &str = "Your previous answer was cut off mid-stream. Continue exactly where it stopped, from the next character, without repeating anything and without any preamble.";

/// How a [`ResumeBody`] sends the partial text back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResumeWith {
    /// As the last message, an assistant turn the model goes on from (Anthropic Messages; an
    /// instruction for OpenAI Chat Completions, which has no prefill). A `400` answer to it
    /// is retried once as an instruction.
    Prefill,
    /// As an assistant turn followed by a user turn asking for the rest, from the next
    /// character ([`RESUME_PROMPT`]).
    Instruction,
}

/// What became of a continuation a [`ResumeBody`] sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResumeOutcome {
    /// The continuation reached its terminal event: the caller has the whole answer.
    Resumed,
    /// The continuation failed: the caller's stream ended with an error.
    Failed,
}

/// Response extension: this response was stitched from more than one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Continued {
    /// How many follow-ups are part of this response (the first answer not counted). `0` when
    /// the first follow-up failed.
    pub rounds: u32,
    /// Whether the last round ended on its own, not at the output limit. `false` when the
    /// round limit was reached, a follow-up failed, or the last round ends in a truncated tool
    /// call.
    pub complete: bool,
}

/// Response extension: the answer stopped at the output limit inside a tool call (an
/// Anthropic `tool_use` block, an OpenAI `tool_calls` entry). Its arguments are incomplete:
/// the call must not be run, and it was not continued.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TruncatedToolCall {
    /// The tool's name, when the answer got that far.
    pub name: Option<String>,
    /// The call's id, when the answer got that far.
    pub id: Option<String>,
}

/// The body of the follow-up to a request whose answer stopped at the output limit: `original`
/// with two turns appended to its `messages` array, the partial answer as an assistant turn
/// and `prompt` as a user turn. Every other byte of `original` is kept as it was.
///
/// For streamed answers, which the layer does not continue: collect the text the stream
/// produced, then send this body (with the same headers) yourself. `None` when `original` is
/// not a JSON object with one `messages` array, or `partial` or `prompt` is empty (an empty
/// assistant turn is refused).
///
/// ```
/// use tower_llm_retry::continuation::follow_up_body;
///
/// let body = follow_up_body(br#"{"messages":[{"role":"user","content":"Hi"}]}"#, "Hel", "Go on").unwrap();
/// assert_eq!(
///     &body[..],
///     br#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hel"},{"role":"user","content":"Go on"}]}"#
/// );
/// ```
pub fn follow_up_body(original: &[u8], partial: &str, prompt: &str) -> Option<Bytes> {
    stitch::append_turns(original, partial, prompt)
}
