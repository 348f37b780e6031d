//! Streaming safety: the SSE first-event gate, idle timeouts and the commit point.
//!
//! LLM responses stream, and the commonest failure is not a status line: it is `HTTP 200`,
//! then `event: error` with `overloaded_error` before any output. Retrying at that point is
//! safe, and a retry layer that only reads the status misses it. Retrying *after* output has
//! reached the caller is never safe: tokens would be duplicated, and an agent might run the
//! same tool call twice.
//!
//! So, for a `text/event-stream` response, [`RetryLayer`](crate::RetryLayer) reads events
//! until the first one that carries visible output, and only then hands the response up:
//!
//! ```text
//!  attempt 1: 200 ─ message_start ─ ping ─ error(overloaded_error)      ✗ retried, nothing seen by the caller
//!  attempt 2: 200 ─ message_start ─ ping ─ content_block_start ─ delta ─ delta ─ … ─ message_stop
//!             └────────── peeked (held back) ──────────┘│
//!                                                  commit point: the caller receives every byte
//!                                                  from the first one on; no re-send after it
//! ```
//!
//! - Before the commit point, an in-band error event maps to its HTTP twin (table below) and
//!   goes through the ordinary retry path; a stall longer than the idle timeout, a dropped
//!   connection, or a clean end before any output and before the protocol's terminal event is
//!   retried as a transport failure; no output within the
//!   [first-output timeout](crate::RetryPolicy::first_output_timeout) (off by default:
//!   keep-alives and set-up events do not stop its clock) is retried as a
//!   [`Timeout`](crate::classify::FailureClass::Timeout).
//! - After it, nothing is re-sent: a later error event reaches the caller in the stream as it
//!   was sent, a dropped connection as an [`ErrorKind::ResponseBody`](crate::ErrorKind::ResponseBody)
//!   error, a stall as [`ErrorKind::IdleTimeout`](crate::ErrorKind::IdleTimeout), and a clean
//!   end before the terminal event as [`ErrorKind::IncompleteStream`](crate::ErrorKind::IncompleteStream).
//! - The peek is bounded by the peek limit (64 KiB by default,
//!   [`RetryLayer::peek_limit`](crate::RetryLayer::peek_limit)): a longer preamble without
//!   output ends it and the stream is handed up committed ([`CommitReason::PeekLimit`]), with no
//!   byte lost.
//! - The caller receives the exact bytes the server sent, in the same frames.
//!
//! A response handed up by the gate carries a [`StreamCommitted`] extension saying why
//! ([`CommitReason`]). [`RetryLayer::sse_gate(false)`](crate::RetryLayer::sse_gate) turns the
//! gate off. `cargo run --example streaming --features mock` shows a pre-output overload retried.
//!
//! # Protocols
//!
//! What [`default_sse_verdict`](crate::classify::default_sse_verdict) counts as visible
//! output, and what the end check
//! ([`RetryLayer::stream_end_check`](crate::RetryLayer::stream_end_check), on by default)
//! waits for. `message_start`, `ping`, comments, empty events, role-only chunks and `[DONE]` are not
//! output. [`Classify::classify_sse_event`](crate::classify::Classify::classify_sse_event) can
//! decide otherwise.
//!
//! | protocol ([`StreamProtocol`]) | visible output: the commit point | terminal event |
//! |---|---|---|
//! | Anthropic Messages | `content_block_start`, `content_block_delta` | `message_stop`, or `error`; or a `message_delta` with a `stop_reason`, when the body ends cleanly after it (the answer is complete by its content: only `message_stop` is missing) |
//! | OpenAI Chat Completions | a chunk whose `choices[].delta` has content, a refusal, tool calls or a function call | a chunk with a `finish_reason`, `[DONE]`, or an error chunk (servers that never send `[DONE]` are fine) |
//! | OpenAI Responses | `response.output_item.added`, `response.content_part.added`, any `response.*.delta` | `response.completed`, `response.failed`, `response.incomplete`, or `error` |
//!
//! A stream that ends cleanly without its protocol's terminal event was cut by some hop (a
//! gateway, a load balancer's idle cut); the official SDKs would hand the partial text back as
//! a success. After the commit point that is an [`ErrorKind::IncompleteStream`](crate::ErrorKind::IncompleteStream)
//! body error, whose [`IncompleteStream`] source says how many bytes were delivered (all of
//! them) and the last event; before it the cut is retried like a reset. Streams of other
//! protocols pass through. The scan is incremental and copies nothing.
//!
//! # In-band errors
//!
//! An error event before the commit point (`event: error`, `response.failed`, or a data
//! payload with an `error` member or `"type": "error"`) is judged like its HTTP twin, by the
//! error type or code it names:
//!
//! | names | twin | verdict |
//! |---|---|---|
//! | `overloaded_error`, `server_is_overloaded`, `overloaded`, or a message that starts "The server is overloaded or not ready yet" (OpenAI's, any case) | 529 | retry, class `Overloaded` (it counts toward consecutive overloads and the fallback's overload trigger) |
//! | `rate_limit_error`, `rate_limit_exceeded` | 429 | retry, class `RateLimited` |
//! | `api_error`, `server_error`, `internal_error` | 500 | retry, class `Server` |
//! | `invalid_request_error` | 400 | no retry, class `Client` |
//! | anything else | — | no retry, class `Other` |
//!
//! An error that is not retried, or that comes when no retry is left, is handed up as it came,
//! committed with [`CommitReason::Error`].
//!
//! # Non-streaming bodies
//!
//! Opt-in, [`RetryLayer::buffer_responses(Some(cap))`](crate::RetryLayer::buffer_responses)
//! reads non-streaming 2xx bodies whole inside the loop, so a reset mid-body or a short body
//! (content-length mismatch) is retried as
//! [`FailureClass::TruncatedEnvelope`](crate::classify::FailureClass::TruncatedEnvelope) instead of
//! failing in the caller's hands. Such JSON that stopped at the output limit
//! (`stop_reason: "max_tokens"`, `finish_reason: "length"`) gets an [`OutputTruncated`]
//! extension and is never re-sent; [`ContinuationLayer`] continues it
//! append-only.
//!
#![cfg_attr(
    feature = "continuation",
    doc = "[`ContinuationLayer`]: crate::ContinuationLayer"
)]
#![cfg_attr(
    not(feature = "continuation"),
    doc = "[`ContinuationLayer`]: crate#features"
)]

mod sse;
mod terminal;

#[cfg(feature = "continuation")]
pub(crate) use self::sse::parse_block;
#[cfg(not(fuzzing))]
pub(crate) use self::sse::ScanError;
pub use self::sse::SseEvent;
#[cfg(all(not(fuzzing), feature = "mcp"))]
pub(crate) use self::sse::SseScanner;
// The fuzz targets drive the scanner directly (`cargo fuzz` builds with `--cfg fuzzing`).
#[cfg(fuzzing)]
#[doc(hidden)]
pub use self::sse::{ScanError, SseScanner};
pub(crate) use self::terminal::StreamScan;
pub use self::terminal::{IncompleteStream, StreamProtocol};

use std::borrow::Cow;

use serde::Deserialize;

/// Why a streamed response was handed up to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CommitReason {
    /// The first event carrying visible output arrived.
    FirstOutput,
    /// The peek limit was reached before any output (documented: the stream is handed up
    /// committed, as it is).
    PeekLimit,
    /// The stream ended before any output.
    EndOfStream,
    /// An in-band error that is not retried, or no retry was left.
    Error,
}

/// Response extension on streamed (`text/event-stream`) responses that passed the gate: from
/// here on the request is never re-sent automatically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamCommitted {
    /// Why the gate let the response through.
    pub reason: CommitReason,
    /// How many bytes the gate read (and then handed on) before it decided.
    pub peeked_bytes: usize,
}

impl StreamCommitted {
    pub(crate) fn new(reason: CommitReason, peeked_bytes: usize) -> Self {
        StreamCommitted {
            reason,
            peeked_bytes,
        }
    }
}

/// Response extension on buffered JSON responses that stopped at the output limit
/// (`stop_reason: "max_tokens"`, `finish_reason: "length"`): the caller may ask for an
/// append-only continuation. Such a request is never re-sent automatically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutputTruncated;

/// Whether a response is an event stream: its media type is `text/event-stream`, in any case
/// (media types are case-insensitive), with or without parameters.
#[inline]
pub(crate) fn is_event_stream(head: &http::response::Parts) -> bool {
    head.headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
        })
}

/// Whether a buffered JSON response body stopped at the output limit.
pub(crate) fn output_truncated(body: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Resp<'a> {
        #[serde(borrow, default)]
        stop_reason: Option<Cow<'a, str>>,
        #[serde(default)]
        choices: Vec<Fin<'a>>,
    }
    #[derive(Deserialize)]
    struct Fin<'a> {
        #[serde(borrow, default)]
        finish_reason: Option<Cow<'a, str>>,
    }
    match serde_json::from_slice::<Resp<'_>>(body) {
        Ok(r) => {
            r.stop_reason.as_deref() == Some("max_tokens")
                || r.choices
                    .iter()
                    .any(|c| c.finish_reason.as_deref() == Some("length"))
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_limit_marker() {
        assert!(output_truncated(
            br#"{"type":"message","stop_reason":"max_tokens"}"#
        ));
        assert!(output_truncated(
            br#"{"choices":[{"finish_reason":"length"}]}"#
        ));
        assert!(!output_truncated(br#"{"stop_reason":"end_turn"}"#));
        assert!(!output_truncated(b"not json"));
    }

    #[test]
    fn event_streams_in_any_case_with_parameters() {
        let head = |ct: Option<&str>| {
            let mut b = http::Response::builder();
            if let Some(ct) = ct {
                b = b.header(http::header::CONTENT_TYPE, ct);
            }
            b.body(()).unwrap().into_parts().0
        };
        for yes in [
            "text/event-stream",
            "Text/Event-Stream",
            " text/event-stream ; charset=utf-8",
        ] {
            assert!(is_event_stream(&head(Some(yes))), "{yes}");
        }
        for no in ["text/event-streams", "application/json", "text/plain"] {
            assert!(!is_event_stream(&head(Some(no))), "{no}");
        }
        assert!(!is_event_stream(&head(None)));
    }
}
