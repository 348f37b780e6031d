//! Tower middleware that makes HTTP calls to LLM APIs survive rate limits, overload, outages
//! and flaky networks, without ever re-sending what is not safe to re-send.
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_llm_retry::Error> {
//! # let http_client = service_fn(|_req: Request<ReplayBody>| async {
//! #     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! # });
//! // `http_client` is any `Service<Request<ReplayBody>, Response = Response<_>>`, such as
//! // hyper-util's legacy `Client`.
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new().policy(RetryPolicy::default()))
//!     .service(http_client);
//!
//! let request = Request::post("https://api.anthropic.com/v1/messages")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"model":"claude-sonnet-4-5","max_tokens":1024}"#)))
//!     .unwrap();
//! let response = client.oneshot(request).await?;
//! if let Some(trail) = response.extensions().get::<tower_llm_retry::RetryTrail>() {
//!     println!("needed {} attempts", trail.total_attempts());
//! }
//! # Ok(()) }
//! ```
//!
//! # What it does
//!
//! [`RetryLayer`] reads the request body once (up to 32 MiB), then sends byte-identical
//! attempts until one succeeds or the [`RetryPolicy`] says stop. It understands what LLM APIs
//! say when they fail: `429` with `Retry-After` in milliseconds, seconds or as an HTTP-date,
//! `529` and `overloaded_error`, `x-should-retry`, exhausted quotas (not worth a retry), and
//! `401` / context-overflow `400`s (left to dedicated layers). See [`classify`] for the full
//! table and [`retry`] for the loop.
//!
//! Every service made from one layer (and their clones) shares a retry budget, so a fleet of
//! requests cannot multiply an outage, and, opt-in, a cooldown gate that holds every request
//! while the server has said "come back at T" and releases them spread out. See [`fleet`].
//!
//! # Defaults
//!
//! | setting | default |
//! |---|---|
//! | retries | 10 |
//! | backoff | 0.5 s doubling to 32 s, plus 0–25 % jitter |
//! | `Retry-After` | honoured as sent up to 60 s; above, the response is returned without retry |
//! | body buffering cap | 32 MiB |
//! | error-body peek | 64 KiB |
//! | retry budget, shared by the layer's services | on: 10 retries/s plus 20 % of first attempts, over 10 s |
//! | cooldown gate, shared by the layer's services | off ([`RetryLayer::cooldown_gate`]) |
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `mock` | [`mock`]: a scripted, fault-injecting LLM server on 127.0.0.1 for tests |

#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub, missing_debug_implementations, rust_2018_idioms)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod body;
pub mod classify;
mod error;
pub mod fleet;
pub mod retry;

#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub mod mock;

pub use crate::body::ReplayBody;
pub use crate::classify::{Classification, Classify, DefaultClassifier, FailureClass};
pub use crate::error::{AttemptRecord, BoxError, Error, ErrorKind, GiveUpReason, RetryTrail};
pub use crate::fleet::{BudgetConfig, GateConfig};
pub use crate::retry::{
    AttemptContext, NoRetry, NotReplaySafe, Retry, RetryBody, RetryEvent, RetryLayer,
    RetryObserver, RetryPolicy,
};
