//! A fault-injecting fake LLM provider for testing retry stacks.
//!
//! [`MockServer`] is a real HTTP server on `127.0.0.1` that answers each
//! request according to a [`Script`]: realistic Anthropic and OpenAI success
//! and error bodies, rate limits with `retry-after`, overload, delays,
//! connections reset or stalled before or during the response, server-sent
//! event streams that fail part-way, and the HTTP/2 stream and connection
//! errors (`REFUSED_STREAM`, `GOAWAY`, `RST_STREAM`).
//!
//! Every request is recorded with its arrival time and HTTP version, so
//! tests can assert how often and how far apart a client retried.
//!
//! # HTTPS and HTTP/2
//!
//! [`MockServer::start`] serves plain TCP and speaks HTTP/1.1 or HTTP/2 with
//! prior knowledge (h2c), whichever each connection starts with.
//! [`MockServer::builder`] adds TLS, with a certificate authority and a
//! certificate for `localhost` and `127.0.0.1` made at start, and can pin
//! the version with [`Protocol`]; over TLS it is negotiated by ALPN. The
//! same scripts run on every combination.
//!
//! Some faults exist only on HTTP/2, and degrade on HTTP/1.1:
//!
//! | reply | HTTP/2 | HTTP/1.1 |
//! | --- | --- | --- |
//! | [`Reply::refused_stream`] | `RST_STREAM` `REFUSED_STREAM`, no response | connection closed, no response |
//! | [`Reply::goaway`] | `GOAWAY` refusing this stream and those after it | connection closed, no response |
//! | [`Reply::reset_stream_after_head`] | head, then `RST_STREAM` `INTERNAL_ERROR` | head, then connection aborted |
//! | [`Reply::sse_then_reset_stream`] | events, then `RST_STREAM` `INTERNAL_ERROR` | events, then connection aborted |
//! | [`Reply::reset`], [`Reply::reset_mid_body`], [`Reply::sse_then_reset`] | the whole connection dropped, every stream on it failing | connection aborted |
//! | [`Reply::raw`] | the whole connection dropped, as [`Reply::reset`] | the given bytes as the whole answer, however malformed, then the connection closed |
//!
//! TLS uses `rustls` with the `ring` provider, named explicitly, so it
//! needs no process-wide default provider.
//!
//! # Time
//!
//! The server runs on the runtime that starts it and waits only with
//! [`tokio::time`]. Run it on the same current-thread runtime as the client
//! under test with time paused (`#[tokio::test(start_paused = true)]`) and
//! scripted delays, retry back-off and timeouts all take virtual time:
//! a test of a one-minute back-off finishes in milliseconds, and the
//! measured gaps between requests are exact.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use tower_llm_retry::mock::{MockServer, Reply, Script};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = MockServer::start(
//!     Script::new()
//!         .then(Reply::overloaded())
//!         .then(Reply::rate_limited("3"))
//!         .otherwise(Reply::success()),
//! )
//! .await?;
//!
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let request = || {
//!     http::Request::post(server.uri("/v1/messages"))
//!         .header("content-type", "application/json")
//!         .body(Full::from(r#"{"model":"claude-test","max_tokens":16}"#))
//! };
//!
//! let response = client.request(request()?).await?;
//! assert_eq!(response.status(), 529);
//!
//! let response = client.request(request()?).await?;
//! assert_eq!(response.status(), 429);
//! assert_eq!(response.headers()["retry-after"], "3");
//!
//! let response = client.request(request()?).await?;
//! assert_eq!(response.status(), 200);
//! let body = response.into_body().collect().await?.to_bytes();
//! let message: serde_json::Value = serde_json::from_slice(&body)?;
//! assert_eq!(message["content"][0]["text"], "Hello!");
//! assert_eq!(message["model"], "claude-test");
//!
//! assert_eq!(server.request_count(), 3);
//! # Ok(())
//! # }
//! ```

mod http2;
mod json;
mod script;
mod server;
pub mod sse;
mod tls;

pub use self::script::{Capacity, Reply, Script, SseFrame};
pub use self::server::{MockServer, MockServerBuilder, Protocol, RecordedRequest};
