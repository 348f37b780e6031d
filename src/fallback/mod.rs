//! Failover: moving a request to the next target of a chain when the current one fails in
//! a way that waiting will not fix.
//!
//! When a model answers `529` (or an error whose body says `overloaded_error`, or OpenAI's
//! `503` whose body says the server is overloaded) several times in
//! a row, waiting longer rarely helps; another model usually answers at once.
//! [`ModelFallbackLayer`] sits inside [`RetryLayer`](crate::RetryLayer) and decides, from what
//! the retry loop carries for it (every failed attempt of the request, its class, whether it
//! timed out), where each attempt goes. Once a trigger fires (by default: 3 overloads in a
//! row) the next attempt goes to the next target of the chain: the top-level `"model"` of the
//! JSON body is replaced and every other byte is left as it was (keys in their order, strings
//! with their escapes), so the prompt cache still matches the prefix. A target
//! can also be another upstream with its own credential ([`Target`]), and each target can
//! have a [`Circuit`] shared by every request of the layer.
//!
//! The triggers and circuits read the loop's
//! [`Classification`](crate::classify::Classification) of each attempt, so a custom
//! [`Classify`](crate::classify::Classify) changes failover as it changes retries. The layer works only inside `RetryLayer`: a step down the chain is the loop's
//! next attempt. With the [`never`](crate::RetryPolicy::never) policy there is no next
//! attempt, but the circuits still send each request past a target whose circuit is open,
//! and they still learn from its one attempt. Outside `RetryLayer` the layer sees no
//! `AttemptContext`, so it cannot count a request's consecutive overloads and does not fall
//! back as configured; it logs a warning the first time, once per layer.
//!
//! When a [`ContextOverflowLayer`] inside this one re-sends a
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
//! use tower_llm_retry::{ModelFallbackLayer, ReplayBody, RetryLayer};
//! use tower_llm_retry::fallback::ModelUsed;
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
//! use tower_llm_retry::ModelFallbackLayer;
//! use tower_llm_retry::fallback::FallbackMode;
//!
//! # fn main() -> Result<(), tower_llm_retry::ConfigError> {
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
//! whose source, a [`FallbackTriggered`], names both models; the
//! overloaded response is dropped and `RetryLayer` returns the error as it is.
//!
//! # Configuration
//!
//! | setting | default | change with |
//! |---|---|---|
//! | chain | — | [`new([...])`](ModelFallbackLayer::new): model names or [`Target`]s |
//! | overload trigger | 3 consecutive overloads of one request | [`threshold(n)`](ModelFallbackLayer::threshold) (at least 1) |
//! | failure trigger | off | [`after_failures(n)`](ModelFallbackLayer::after_failures): `n` consecutive retryable failures of any class |
//! | timeout trigger | off | [`after_timeouts(n)`](ModelFallbackLayer::after_timeouts): `n` consecutive head timeouts, idle stalls before the commit point, first-output timeouts, or `408`s |
//! | connect-failure trigger | off | [`after_connect_failures(n)`](ModelFallbackLayer::after_connect_failures): `n` consecutive attempts that failed to connect |
//! | rate limit with nowhere to wait | off | [`on_unwaitable_rate_limit(true)`](ModelFallbackLayer::on_unwaitable_rate_limit) |
//! | circuit per target | none | [`circuit(Circuit)`](ModelFallbackLayer::circuit); state through [`circuit_states`](ModelFallbackLayer::circuit_states) |
//! | sticky | off: every request starts on its own model | [`sticky(cooldown)`](ModelFallbackLayer::sticky): later requests for that model start at the fallback until the cooldown ends |
//! | mode | [`FallbackMode::Rewrite`]: rewrite the body's `"model"` | [`mode(FallbackMode::Signal)`](ModelFallbackLayer::mode): end the request with [`ErrorKind::FallbackTriggered`](crate::ErrorKind::FallbackTriggered) |
//! | error body read to tell an overload | 64 KiB | the `RetryLayer`'s [`peek_limit`](crate::RetryLayer::peek_limit) |
//!
//! Every setting is a plain number, duration, flag or URL, so a configuration file maps onto
//! the builder one key to one call.
//!
//! # Triggers
//!
//! | failure of an attempt | moves the request on |
//! |---|---|
//! | an overload ([`FailureClass::Overloaded`](crate::classify::FailureClass::Overloaded)): `529`; an error body saying `overloaded_error`; OpenAI's `5xx` whose body has a `code` or `type` of `overloaded` or `server_is_overloaded`, or the message "The server is overloaded or not ready yet."; an in-band `error` or `response.failed` event naming one of these before the first output | after `threshold` in a row (default 3) |
//! | `5xx`, `408`, `409`, `429`, a transport error, a head timeout, an idle stall or no output in time before the commit point, a truncated body | with [`after_failures(n)`](ModelFallbackLayer::after_failures), after `n` in a row |
//! | a head timeout, an idle stall before the commit point, no first output within the policy's [`first_output_timeout`](crate::RetryPolicy::first_output_timeout), a `408` | with [`after_timeouts(n)`](ModelFallbackLayer::after_timeouts), after `n` in a row |
//! | a connect failure: refused, DNS, TLS handshake, anything [`Classify::request_not_sent`](crate::classify::Classify::request_not_sent) calls unsent (not an HTTP/2 refusal on a live connection, which is re-sent at once) | with [`after_connect_failures(n)`](ModelFallbackLayer::after_connect_failures), after `n` in a row |
//! | `429` with nowhere to wait: no `Retry-After`, one above the policy's [`retry_after_max`](crate::RetryPolicy::retry_after_max) or past the request's [deadline](crate::RetryPolicy::deadline), or every key of an [`ApiKeyPool`] inside resting | with [`on_unwaitable_rate_limit(true)`](ModelFallbackLayer::on_unwaitable_rate_limit), at once (the retry goes to the next target instead of giving up or waiting) |
//! | `400` validation, `401`, `403`, `404`, an exhausted quota, a context overflow | never |
//! | anything after a stream's commit point | never: nothing is re-sent after output |
//!
//! - The counts are of *consecutive* failures of one request. A failure of no configured
//!   trigger class (a `503` when only the overload trigger is on) resets them and sends the
//!   next attempt back to the requested model (or the first target whose circuit takes it).
//! - The retry after a trigger sleeps the policy's backoff, not the failing target's
//!   `Retry-After`, and does not wait at the [fleet](crate::fleet)'s cooldown gate that
//!   `Retry-After` closed. First attempts of other requests still wait at a closed gate,
//!   whichever target they would go to: the gate is the fleet's, not a target's.
//! - A context window overflow is [`ContextOverflowLayer`]'s:
//!   with a [`context_window_fallback`]
//!   model, placed inside this layer, it re-sends the request once to that model within the
//!   same attempt, and [`ModelUsed::model`] names it. The two meet there and nowhere else: an
//!   overflow is never a trigger of this layer (a smaller-context fallback would fail the
//!   same way).
//!
//! # Circuits
//!
//! With [`circuit(Circuit)`](ModelFallbackLayer::circuit) each target of the chain has a
//! circuit, shared by every service and clone of the layer:
//!
//! | state | requests | leaves it |
//! |---|---|---|
//! | closed | go to the target; the success path reads one atomic flag, takes no lock | after `failures` failures of the layer's trigger classes within `window` (default 5 in 30 s): open |
//! | open | skip it for the next target at once, with no wait on it | when the cooldown ends (default 30 s): half-open |
//! | half-open | one request at a time probes the target; the others keep skipping it | a good probe closes it; a failed one reopens it with the cooldown doubled, up to `max_cooldown` (default 5 min) |
//!
//! Every transition is a tracing event (`WARN` for opened and reopened, `INFO` for half-open
//! and closed), and [`circuit_states`](ModelFallbackLayer::circuit_states) reads the state of
//! every target for metrics and readiness. A request whose model is not in the chain has no
//! circuit for that model: list the primary first to give it one. Circuits apply in
//! [`FallbackMode::Rewrite`]. When every circuit from the request's level on is open, the
//! request goes where the triggers sent it. A response head counts as an answer: a `200`
//! event stream that then fails before its first output moves the request on, but does not
//! count against the circuit.
//!
//! [Sticky mode](ModelFallbackLayer::sticky) is the older, blunter form of the same idea: one
//! request's fallback holds every request for that model on the fallback until the cooldown
//! ends, and then sends them all back at once. A circuit with `failures(1)` and the same
//! cooldown does what sticky mode does, but probes with one request and doubles the cooldown
//! while the target stays down; prefer it.
//!
//! # Targets on other upstreams
//!
//! ```
//! # #[cfg(not(feature = "auth"))] fn main() {}
//! # #[cfg(feature = "auth")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tower_llm_retry::ApiKey;
//! use tower_llm_retry::ModelFallbackLayer;
//! use tower_llm_retry::fallback::{Circuit, Target};
//!
//! let layer = ModelFallbackLayer::new([
//!     // The primary, on the request's own upstream, with the AuthLayer's credential.
//!     Target::new("claude-sonnet-4-5"),
//!     // The same model through a second gateway, with a key of its own.
//!     Target::new("claude-sonnet-4-5")
//!         .upstream("https://gateway.example.com/anthropic")?
//!         .credential(ApiKey::new("sk-gateway")?),
//! ])?
//! .after_failures(2)?
//! .circuit(Circuit::new().failures(5).window(Duration::from_secs(30)))?;
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! A target's [`upstream`](Target::upstream) replaces the request URI's scheme, authority and
//! path prefix (the path and query follow the prefix); its
//! [`credential`] is used by the [`AuthLayer`]
//! inside this layer in place of its own, so the primary's key never goes to the other
//! upstream. Without an `AuthLayer` inside, a target's credential source is not applied.
//! [`ModelUsed`] says which model and upstream served and how many attempts each target took.
//!
//! # Interactive callers
//!
//! A person at the keyboard should not wait out a retry schedule on a target that has
//! stopped answering. The recommended setup, for streaming requests:
//!
//! ```
//! use std::time::Duration;
//! use tower::ServiceBuilder;
//! use tower_llm_retry::ModelFallbackLayer;
//! use tower_llm_retry::fallback::Circuit;
//! use tower_llm_retry::{RetryLayer, RetryPolicy};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = RetryPolicy::interactive()
//!     .head_timeout(Some(Duration::from_secs(10)))
//!     .deadline(Some(Duration::from_secs(30)));
//! let stack = ServiceBuilder::new()
//!     .layer(RetryLayer::new().policy(policy))
//!     .layer(
//!         ModelFallbackLayer::new(["claude-sonnet-4-5", "claude-haiku-4-5"])?
//!             .after_timeouts(1)?
//!             .after_failures(2)?
//!             .circuit(Circuit::new())?,
//!     );
//! # let _ = stack;
//! # Ok(()) }
//! ```
//!
//! - A primary that stalls is left after its first head timeout (10 s); one that fails twice
//!   in a row (a `503`, a reset) after the second; an overloaded one after 3 overloads.
//! - Once the primary's circuit opens (5 such failures within 30 s), requests start on the
//!   fallback at once, and one request at a time finds out whether the primary is back.
//! - The [deadline](crate::RetryPolicy::deadline) covers the whole call, fallbacks included:
//!   no attempt starts after it, no retry is made whose sleep would reach it, and each
//!   attempt's head timeout is cut to what is left of it. The worst case until the caller has
//!   a response head (or, for a stream, its first output) or an error is the deadline,
//!   30 s; without it, the interactive policy's 4 attempts of up to 10 s each and their
//!   backoffs (0.5, 1 and 2 s, each up to 25 % more) could take 44.4 s, and up to 60 s more
//!   where servers ask for a `Retry-After` (honoured up to 20 s). After that point the
//!   deadline no longer applies: each gap between a stream's frames is bounded by the
//!   [idle timeout](crate::RetryPolicy::idle_timeout).
//! - The test `the_interactive_recipe_falls_over_after_one_timeout_and_ends_at_its_deadline`
//!   runs exactly this setup against stalled servers: the primary is left at 10 s, the
//!   fallback answers at 10.5 s, and with both stalled the call ends at 30 s.
//!
//! # The chain
//!
//! - A request whose model is itself in the chain falls back to the targets after it, so one
//!   chain serves requests for any of its models.
//! - When the last target of the chain reaches the overload threshold too, the chain is
//!   exhausted: its last response goes up unchanged, marked with
//!   [`ModelUsed::chain_exhausted`], and `RetryLayer` returns it (with its
//!   [`RetryTrail`](crate::RetryTrail)) instead of retrying. Other triggers at the last target
//!   let the retry policy go on there.
//! - Every response carries a [`ModelUsed`] extension, and each call runs in an
//!   `llm_fallback` tracing span with the OpenTelemetry fields `gen_ai.request.model` (the
//!   caller's) and `gen_ai.response.model` (the model this layer sent the request to; a
//!   [`ContextOverflowLayer`] inside that moved it to its
//!   context-window fallback says so in [`ModelUsed::model`], which names the model that
//!   served).
//! - A body that is not a JSON object with a string `"model"`, or that could not be buffered,
//!   passes through untouched, to the request's own upstream.
//!
//! The retry policy must allow enough attempts for the chain: with the default threshold and a
//! two-model chain, the last model gets its first attempt on the 7th try. Every step down the
//! chain is a retry of the loop: it counts against
//! [`RetryPolicy::max_retries`](crate::RetryPolicy::max_retries) like any other (and draws on
//! the fleet's retry budget), so the `k`-th target is reached only when `max_retries` is at
//! least the trigger's count times `k` (with a trigger of `n`, its first attempt is retry
//! `n × k`). With the [`sdk_compatible`](crate::RetryPolicy::sdk_compatible) policy's 2
//! retries, the default threshold of 3 can never fire: use `threshold(1)` or `threshold(2)`,
//! or more retries. Leave
//! [`RetryPolicy::max_consecutive_overloads`](crate::RetryPolicy::max_consecutive_overloads)
//! unset, or set it above `threshold × (chain length + 1)`.
//!
#![cfg_attr(
    feature = "overflow",
    doc = "[`ContextOverflowLayer`]: crate::ContextOverflowLayer"
)]
#![cfg_attr(
    not(feature = "overflow"),
    doc = "[`ContextOverflowLayer`]: crate#features"
)]
#![cfg_attr(feature = "auth", doc = "[`ApiKeyPool`]: crate::auth::ApiKeyPool")]
#![cfg_attr(not(feature = "auth"), doc = "[`ApiKeyPool`]: crate#features")]
#![cfg_attr(
    feature = "overflow",
    doc = "[`context_window_fallback`]: crate::ContextOverflowLayer::context_window_fallback"
)]
#![cfg_attr(
    not(feature = "overflow"),
    doc = "[`context_window_fallback`]: crate#features"
)]
#![cfg_attr(feature = "auth", doc = "[`credential`]: Target::credential")]
#![cfg_attr(not(feature = "auth"), doc = "[`credential`]: crate#features")]
#![cfg_attr(feature = "auth", doc = "[`AuthLayer`]: crate::AuthLayer")]
#![cfg_attr(not(feature = "auth"), doc = "[`AuthLayer`]: crate#features")]

mod circuit;
mod future;
pub(crate) mod layer;
mod service;
mod target;

pub use self::circuit::{Circuit, CircuitState};
pub use self::future::ResponseFuture;
// The layer is public at the crate root only; imported here for the docs.
#[cfg(doc)]
use self::layer::ModelFallbackLayer;
pub use self::layer::TargetStatus;
pub use self::service::ModelFallback;
pub use self::target::Target;
pub use crate::error::FallbackTriggered;

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
    /// The upstream this response came from, when its target has one of its own
    /// ([`Target::upstream`]); `None` for the request's own URI.
    pub upstream: Option<http::Uri>,
    /// Every target the request went to, in order of first use, with how many attempts each
    /// took, when the request took more than one attempt; empty when its first attempt
    /// answered (one attempt, at `model`).
    pub attempts: Vec<TargetAttempts>,
}

/// How many attempts of a request went to one target, in [`ModelUsed::attempts`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TargetAttempts {
    /// The target's model.
    pub model: String,
    /// The target's upstream, when it has one of its own.
    pub upstream: Option<http::Uri>,
    /// Attempts sent to it.
    pub attempts: u32,
}

impl ModelUsed {
    /// Whether the response came from a fallback rather than the requested model.
    pub fn is_fallback(&self) -> bool {
        self.model != self.requested
    }
}
