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
//! table, [`retry`] for the loop and [`stream`] for streamed responses.
//!
//! Three companion layers go inside it, each in its own module, behind a feature of the same
//! name (on by default):
//!
//! ```text
//! caller ──► RetryLayer ──► ModelFallbackLayer ──► ContextOverflowLayer ──► AuthLayer ──► HTTP client
//! ```
//!
//! - [`ModelFallbackLayer`] ([`fallback`]): after 3 consecutive overloads of a request (or
//!   failures of other configured classes: any retryable failure, timeouts, connect failures,
//!   a rate limit with nowhere to wait), the next attempt goes to the next target of a chain, another model or
//!   another upstream, each target with an optional circuit; or, in signal mode, the caller is
//!   told to switch.
//! - [`ContextOverflowLayer`] ([`overflow`]): a `max_tokens` that does not fit the context
//!   window is lowered and the request re-sent at once; a prompt that is too long is handed
//!   back with its numbers.
//! - [`AuthLayer`] ([`auth`]): the credential on every request, one refresh and re-send on
//!   `401` (single-flight), and rotation through a key pool on rate limits.
//!
//! The two that rewrite the body change one top-level JSON value and leave every other byte as
//! it was (keys keep their order, strings their escapes, numbers their form), so prompt caches
//! still match. They live only inside a `RetryLayer`, which buffers the body, reads and
//! classifies each answer once and asks them through one contract; for a companion without
//! retries, use `RetryLayer` with [`RetryPolicy::never`]. Their re-sends (a refresh, a repair,
//! a fallback step) happen within one attempt, so they are not counted as retries.
//!
//! ```
//! # #[cfg(not(all(feature = "auth", feature = "fallback", feature = "overflow")))] fn main() {}
//! # #[cfg(all(feature = "auth", feature = "fallback", feature = "overflow"))]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder};
//! use tower_llm_retry::{ApiKey, AuthLayer, ContextOverflowLayer, ModelFallbackLayer, ReplayBody, RetryLayer};
//!
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
//! Two layers for agents go *outside* it, so that each of their requests is retried on its own
//! (features of the same name, off by default):
//! [`ContinuationLayer`] ([`continuation`]) continues an answer cut at `max_tokens` with
//! append-only follow-ups, and [`McpGateLayer`] ([`mcp`]) keeps MCP tool calls that are not
//! idempotent from running twice.
//!
//! Every service made from one layer (and their clones) shares a retry budget, so a fleet of
//! requests cannot multiply an outage, a cooldown gate that holds every request while the
//! server has said "come back at T", and an adaptive pacing that, from the server's first
//! rate-limit signal, spreads attempts at the rate the server admits; each kept per upstream
//! and credential. Several layers share them when given one [`Fleet`](fleet::Fleet). See
//! [`fleet`].
//!
//! # Defaults
//!
//! Each module lists its own settings, with their defaults and the method that changes each:
//!
//! - the retry loop (retries, backoff, jitter, `Retry-After`, timeouts, deadline, body and
//!   peek limits, the SSE gate): [`retry`](retry#defaults); the presets: [`RetryPolicy`];
//! - the retry budget, the cooldown gate and the pacing: [`fleet`](fleet#configuration);
//! - the companion layers: [`fallback`][fallback-config], [`overflow`][overflow-config],
//!   [`auth`][auth-sources], [`continuation`], [`mcp`].
//!
//! # Conventions
//!
//! - **Attempts** are numbered from 1; what counts retries says so and counts from 0
//!   ([attempt numbers](retry#attempt-numbers)).
//! - **Configuration** types are built by chained setters named after the setting
//!   (`max_retries(n)`). A setting that is read back has a getter named `get_` and the
//!   setting (`get_ttl()`): [`BudgetConfig`](fleet::BudgetConfig),
//!   [`PacingConfig`](fleet::PacingConfig) and `fallback::Target` have them for
//!   theirs; a [`Fleet`](fleet::Fleet) reads its state back by name
//!   ([`budget_stats`](fleet::Fleet::budget_stats), [`pace`](fleet::Fleet::pace), …);
//!   a [`RetryPolicy`] and the layers are not read back (their `Debug` shows them). One
//!   request changes the settings it names with a [`retry::Override`].
//!   A setter returns
//!   `Result<Self, ConfigError>` exactly when its value can be wrong on its own (a multiplier
//!   below 1, a jitter fraction above 1, an empty fallback chain), and fails at that call,
//!   naming the setting. The one exception is `fallback::Circuit`, a value checked
//!   as a whole when [`ModelFallbackLayer::circuit`] takes it. Two settings that bound each other never fail:
//!   the bound wins (an `initial_backoff` above `max_backoff` backs off by `max_backoff`, a
//!   circuit's `max_cooldown` below its `cooldown` does not double it).
//! - **Layers** come in threes: `XLayer` builds the middleware `X<S>`, whose future is
//!   `x::ResponseFuture`.
//! - **Paths**: every public item has one path. The crate root holds what a first stack
//!   names (the layers, [`RetryPolicy`], the bodies, the error and the trail); everything else
//!   lives in its module: [`retry`], [`classify`], [`stream`], [`fleet`], [`auth`],
//!   [`fallback`], [`overflow`], [`continuation`], [`mcp`].
//!
//! # Results and errors
//!
//! - A request that ends with an HTTP response returns it (also when retries ran out, as
//!   `tower::retry` does), with a [`RetryTrail`] extension whenever any attempt failed: per
//!   attempt its class, status, `Retry-After`, sleep, error chain and elapsed time, plus why the
//!   loop stopped ([`GiveUpReason`](retry::GiveUpReason)).
//! - Otherwise the error is one opaque [`Error`]; [`Error::kind`] says what happened
//!   ([`ErrorKind`] lists every kind, each with when it occurs), [`Error::trail`] gives the
//!   attempts, and `source()` the cause. Which give-up ends in which kind is in
//!   [`retry`](retry#after-the-verdict).
//! - An error that [`AuthLayer`] or [`ModelFallbackLayer`] ends a request with
//!   ([`ErrorKind::TokenRefresh`], [`ErrorKind::FallbackTriggered`]) reaches the caller as it
//!   is, with the trail added.
//! - The response body ([`RetryBody`]) fails with a typed [`Error`] too:
//!   [`ErrorKind::ResponseBody`] (the connection failed mid-body; the transport error is the
//!   source), [`ErrorKind::IdleTimeout`] or [`ErrorKind::IncompleteStream`].
//! - The companion layers' error type is [`BoxError`]: the inner service's errors pass through
//!   untouched, and their own are an [`Error`], to downcast.
//! - A body whose `size_hint` says up front that it exceeds the buffer cap is sent once,
//!   streaming, and never retried, still under the head timeout, the deadline and the fleet's
//!   admission. One that only turns out too large while it is read fails with
//!   [`ErrorKind::BodyTooLarge`], and nothing is sent.
//!
//! # Observability
//!
//! - A `tracing` span `llm_retry.attempt` per physical attempt, with OpenTelemetry field names
//!   (`otel.kind = "client"`, `http.request.method`, `server.address`,
//!   `http.request.resend_count` on retries, `http.response.status_code`, `error.type`,
//!   `gen_ai.request.model`). An `INFO` event before each retry, a `WARN` event on giving up.
//!   `cargo run --example otel_tracing --features mock` prints them.
//! - [`RetryObserver`](retry::RetryObserver): `on_retry(&RetryEvent)` before each sleep,
//!   `on_recovered(total_attempts)`, `on_give_up(&RetryTrail)`.
//! - The companion layers log `INFO` events when they act (a refresh after `401`, a key
//!   rotation, a fallback model, a `max_tokens` repair); [`ModelFallbackLayer`] opens an
//!   `llm_fallback` span per call with `gen_ai.request.model` and `gen_ai.response.model`.
//! - Credentials never appear in a span, event, `Debug` output or error message (tested with a
//!   `TRACE`-level subscriber).
//!
//! # Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `auth` | yes | [`auth`]: [`AuthLayer`], the credential on every request, refreshed on `401`, rotated through a key pool |
//! | `google-auth` | no | [`auth::GoogleToken`]: Google OAuth access tokens for Vertex AI, from the metadata server or a user's application-default credentials, through your HTTP client (implies `auth`; no new dependency) |
//! | `fallback` | yes | [`fallback`]: [`ModelFallbackLayer`], a chain of models and upstreams to fail over to |
//! | `overflow` | yes | [`overflow`]: [`ContextOverflowLayer`], a `max_tokens` lowered to fit the context window |
//! | `continuation` | no | [`continuation`]: [`ContinuationLayer`], an answer cut at `max_tokens` continued (for agents) |
//! | `mcp` | no | [`mcp`]: [`McpGateLayer`], MCP tool calls that are not idempotent never run twice (for agents) |
//! | `http2` | yes | the HTTP/2 proofs that a request was never processed ([`classify::never_processed`]), read from `h2`, already in any HTTP/2 client's tree |
//! | `hyper-util` | yes | hyper-util's legacy client errors raised while connecting count as "never sent" ([`classify::request_not_sent`]), so even a `NotReplaySafe` request is retried after them; already in the tree of hyper-util and reqwest users |
//! | `mock` | no | [`mock`]: a scripted, fault-injecting LLM server on 127.0.0.1 for tests, HTTP/1.1 and HTTP/2, plain or TLS (pulls in hyper's server side, `h2`, `rustls`, `rcgen`) |
//! | `reqwest` | no | [`reqwest::ReqwestService`]: the stack on top of a `reqwest::Client` |
//! | `fleet-redis` | no | [`fleet::RedisFleet`]: the fleet's gate, budget and pacing shared across processes through Redis (pulls in `redis`) |
//! | `fleet-redis-cluster` | no | the same on a Redis Cluster or Valkey in cluster mode, `RedisFleet::from_cluster_nodes` and `redis+cluster://` URLs (implies `fleet-redis`; pulls in `redis`'s cluster client: `crc16`, `log`, and `rand` 0.9) |
//! | `reqwest-middleware` | no | [`reqwest_middleware::RetryMiddleware`]: a `reqwest_middleware::Middleware` (implies `reqwest`) |
//! | `async-openai` | no | [`async_openai::HttpService`]: the stack as async-openai's HTTP service, for `Client::with_http_service` (implies `reqwest`; pulls in `async-openai` without a TLS feature) |
//!
//! # Where it plugs in
//!
//! The inner service is anything that implements `Service<http::Request<ReplayBody>>` and
//! returns `http::Response`s: hyper-util's legacy `Client` as it is, a `reqwest::Client`
//! through [`reqwest::ReqwestService`], a `reqwest_middleware` chain through
//! [`reqwest_middleware::RetryMiddleware`], an axum router. The examples `hyper_client`,
//! `reqwest_client`, `reqwest_middleware` and `axum_proxy` show each.
//!
// An item behind a feature that is off is linked to the table of features, which names it.
#![cfg_attr(not(feature = "auth"), doc = "[`auth`]: crate#features")]
#![cfg_attr(not(feature = "auth"), doc = "[`AuthLayer`]: crate#features")]
#![cfg_attr(
    not(feature = "auth"),
    doc = "[`ErrorKind::TokenRefresh`]: crate#features"
)]
#![cfg_attr(not(feature = "fallback"), doc = "[`fallback`]: crate#features")]
#![cfg_attr(
    not(feature = "fallback"),
    doc = "[`ModelFallbackLayer`]: crate#features"
)]
#![cfg_attr(not(feature = "fallback"), doc = "[`Target`]: crate#features")]
#![cfg_attr(not(feature = "fallback"), doc = "[`Circuit`]: crate#features")]
#![cfg_attr(
    not(feature = "fallback"),
    doc = "[`ModelFallbackLayer::circuit`]: crate#features"
)]
#![cfg_attr(
    not(feature = "fallback"),
    doc = "[`ErrorKind::FallbackTriggered`]: crate#features"
)]
#![cfg_attr(not(feature = "overflow"), doc = "[`overflow`]: crate#features")]
#![cfg_attr(
    not(feature = "overflow"),
    doc = "[`ContextOverflowLayer`]: crate#features"
)]
#![cfg_attr(
    not(feature = "continuation"),
    doc = "[`continuation`]: crate#features"
)]
#![cfg_attr(
    not(feature = "continuation"),
    doc = "[`ContinuationLayer`]: crate#features"
)]
#![cfg_attr(not(feature = "mcp"), doc = "[`mcp`]: crate#features")]
#![cfg_attr(not(feature = "mcp"), doc = "[`McpGateLayer`]: crate#features")]
#![cfg_attr(not(feature = "mock"), doc = "[`mock`]: crate#features")]
#![cfg_attr(
    not(feature = "reqwest"),
    doc = "[`reqwest::ReqwestService`]: crate#features"
)]
#![cfg_attr(
    not(feature = "reqwest-middleware"),
    doc = "[`reqwest_middleware::RetryMiddleware`]: crate#features"
)]
#![cfg_attr(
    not(feature = "async-openai"),
    doc = "[`async_openai::HttpService`]: crate#features"
)]
#![cfg_attr(
    not(feature = "google-auth"),
    doc = "[`auth::GoogleToken`]: crate#features"
)]
#![cfg_attr(
    not(feature = "fleet-redis"),
    doc = "[`fleet::RedisFleet`]: crate#features"
)]
#![cfg_attr(feature = "auth", doc = "[auth-sources]: auth#credential-sources")]
#![cfg_attr(not(feature = "auth"), doc = "[auth-sources]: crate#features")]
#![cfg_attr(
    feature = "fallback",
    doc = "[fallback-config]: fallback#configuration"
)]
#![cfg_attr(not(feature = "fallback"), doc = "[fallback-config]: crate#features")]
#![cfg_attr(
    feature = "overflow",
    doc = "[overflow-config]: overflow#configuration"
)]
#![cfg_attr(not(feature = "overflow"), doc = "[overflow-config]: crate#features")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub, missing_debug_implementations, rust_2018_idioms)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "auth")]
#[cfg_attr(docsrs, doc(cfg(feature = "auth")))]
pub mod auth;
mod body;
pub mod classify;
#[cfg(feature = "continuation")]
#[cfg_attr(docsrs, doc(cfg(feature = "continuation")))]
pub mod continuation;
mod error;
#[cfg(feature = "fallback")]
#[cfg_attr(docsrs, doc(cfg(feature = "fallback")))]
pub mod fallback;
pub mod fleet;
mod json_edit;
#[cfg(feature = "mcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "mcp")))]
pub mod mcp;
#[cfg(feature = "overflow")]
#[cfg_attr(docsrs, doc(cfg(feature = "overflow")))]
pub mod overflow;
mod pipeline;
mod provider;
mod random;
pub mod retry;
pub mod stream;
mod time;

#[cfg(feature = "async-openai")]
#[cfg_attr(docsrs, doc(cfg(feature = "async-openai")))]
pub mod async_openai;
#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub mod mock;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod reqwest;
#[cfg(feature = "reqwest-middleware")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest-middleware")))]
pub mod reqwest_middleware;

// The names a first stack needs; everything else has its one path in its module.
#[cfg(feature = "auth")]
#[cfg_attr(docsrs, doc(cfg(feature = "auth")))]
pub use crate::auth::api_key::ApiKey;
#[cfg(feature = "auth")]
#[cfg_attr(docsrs, doc(cfg(feature = "auth")))]
pub use crate::auth::layer::AuthLayer;
pub use crate::body::ReplayBody;
#[cfg(feature = "continuation")]
#[cfg_attr(docsrs, doc(cfg(feature = "continuation")))]
pub use crate::continuation::layer::ContinuationLayer;
pub use crate::error::{BoxError, ConfigError, Error, ErrorKind, RetryTrail};
#[cfg(feature = "fallback")]
#[cfg_attr(docsrs, doc(cfg(feature = "fallback")))]
pub use crate::fallback::layer::ModelFallbackLayer;
#[cfg(feature = "mcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "mcp")))]
pub use crate::mcp::layer::McpGateLayer;
#[cfg(feature = "overflow")]
#[cfg_attr(docsrs, doc(cfg(feature = "overflow")))]
pub use crate::overflow::layer::ContextOverflowLayer;
pub use crate::pipeline::RetryBody;
pub use crate::retry::layer::RetryLayer;
pub use crate::retry::policy::RetryPolicy;
