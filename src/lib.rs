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
//! Three companion layers go inside it, each in its own module:
//!
//! ```text
//! caller ──► RetryLayer ──► ModelFallbackLayer ──► ContextOverflowLayer ──► AuthLayer ──► HTTP client
//! ```
//!
//! - [`ModelFallbackLayer`] ([`fallback`]): after 3 consecutive overloads of a request, the
//!   next attempt goes to the next model of a chain; or, in signal mode, the caller is told to
//!   switch.
//! - [`ContextOverflowLayer`] ([`overflow`]): a `max_tokens` that does not fit the context
//!   window is lowered and the request re-sent at once; a prompt that is too long is handed
//!   back with its numbers.
//! - [`AuthLayer`] ([`auth`]): the credential on every request, one refresh and re-send on
//!   `401` (single-flight), and rotation through a key pool on rate limits.
//!
//! The two that rewrite the body change one top-level JSON value and leave every other byte as
//! it was ([`json_edit`]), so prompt caches still match. Each also works on its own, buffering
//! the body itself.
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder};
//! use tower_llm_retry::{ApiKey, AuthLayer, ContextOverflowLayer, ModelFallbackLayer, ReplayBody, RetryLayer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let http_client = service_fn(|_req: Request<ReplayBody>| async {
//! #     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! # });
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     .layer(ModelFallbackLayer::new(["claude-sonnet-4-5"])?)
//!     .layer(ContextOverflowLayer::new())
//!     .layer(AuthLayer::new(ApiKey::new("sk-ant-api03-...")?))
//!     .service(http_client);
//! # let _ = client;
//! # Ok(()) }
//! ```
//!
//! Every service made from one layer (and their clones) shares a retry budget, so a fleet of
//! requests cannot multiply an outage, and, opt-in, a cooldown gate that holds every request
//! while the server has said "come back at T" and releases them spread out. Several layers
//! share them when given one [`Fleet`]. See [`fleet`].
//!
//! # Defaults
//!
//! | setting | default |
//! |---|---|
//! | retries | 10 |
//! | backoff | 0.5 s doubling to 32 s, plus 0–25 % jitter |
//! | `Retry-After` | honoured as sent up to 60 s; above, the response is returned without retry |
//! | body buffering cap | 32 MiB (each layer) |
//! | error-body peek | 64 KiB (each layer) |
//! | model fallback | after 3 consecutive overloads; not sticky; rewrite mode |
//! | `max_tokens` repair | `max(3,000, limit − input − 1,000)`, at least `thinking.budget_tokens + 1`; once, at once |
//! | token refresh | ahead of expiry: advisory 120 s, mandatory 30 s; after a failure, 1 s doubling to 30 s |
//! | rate-limited pool key | rests for the `Retry-After`, or 5 s without one |
//! | retry budget, shared by the layer's [`Fleet`] | on: 10 retries/s plus 20 % of first attempts, over 10 s |
//! | cooldown gate, shared by the layer's [`Fleet`] | off ([`FleetBuilder::cooldown_gate`]) |
//! | adaptive pacing, shared by the layer's [`Fleet`] | off ([`FleetBuilder::pacing`]) |
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `http2` (default) | the HTTP/2 proofs that a request was never processed ([`classify::never_processed`]) |
//! | `mock` | [`mock`]: a scripted, fault-injecting LLM server on 127.0.0.1 for tests, HTTP/1.1 and HTTP/2, plain or TLS |
//! | `reqwest` | [`reqwest::ReqwestService`]: the stack on top of a `reqwest::Client` |
//! | `fleet-redis` | `fleet::RedisFleet`: the fleet's gate, budget and pacing shared across processes through Redis |
//! | `reqwest-middleware` | [`reqwest_middleware::RetryMiddleware`]: a `reqwest_middleware::Middleware` |
//!
//! # Where it plugs in
//!
//! - hyper-util's legacy `Client` is a `Service<Request<ReplayBody>>` as it is (example
//!   `hyper_client`).
//! - reqwest: wrap the client in [`reqwest::ReqwestService`], or add
//!   [`reqwest_middleware::RetryMiddleware`] to a `reqwest_middleware::ClientBuilder`
//!   (examples `reqwest_client`, `reqwest_middleware`).
//! - axum: keep the stack in the router state as a `tower::util::BoxCloneSyncService` and
//!   forward to it from a handler, streaming the response back (example `axum_proxy`).

#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub, missing_debug_implementations, rust_2018_idioms)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod auth;
pub mod body;
pub mod classify;
pub mod continuation;
mod error;
pub mod fallback;
pub mod fleet;
pub mod json_edit;
pub mod mcp;
pub mod overflow;
pub mod retry;
pub mod stream;
mod time;

#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub mod mock;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod reqwest;
#[cfg(feature = "reqwest-middleware")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest-middleware")))]
pub mod reqwest_middleware;

pub use crate::auth::{
    ApiKey, ApiKeyPool, Auth, AuthLayer, AuthOutcome, CredentialHeader, RefreshingToken, Token,
    TokenSource,
};
pub use crate::body::ReplayBody;
pub use crate::classify::{Classification, Classify, DefaultClassifier, FailureClass};
pub use crate::continuation::{Continuation, ContinuationLayer, Continued, TruncatedToolCall};
pub use crate::error::{
    AttemptRecord, BoxError, Error, ErrorKind, FallbackTriggered, GiveUpReason, RetryTrail,
    TimedOut, TimeoutKind,
};
pub use crate::fallback::{FallbackMode, ModelFallback, ModelFallbackLayer, ModelUsed};
pub use crate::fleet::{BudgetConfig, BudgetStats, Fleet, FleetBuilder, GateConfig, PacingConfig};
#[cfg(feature = "fleet-redis")]
pub use crate::fleet::{RedisFleet, RedisState};
pub use crate::mcp::{McpGate, McpGateLayer};
pub use crate::overflow::{
    ContextOverflow, ContextOverflowLayer, ContextOverflowService, OverflowRepaired,
};
pub use crate::retry::{
    AttemptContext, NoRetry, NotReplaySafe, Retry, RetryBody, RetryEvent, RetryLayer,
    RetryObserver, RetryPolicy,
};
pub use crate::stream::{CommitReason, OutputTruncated, StreamCommitted};
