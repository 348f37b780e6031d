//! Retrying MCP tool calls over streamable HTTP without running a side-effecting tool twice.
//!
//! An agent's MCP client speaks JSON-RPC over HTTP `POST` (the answer a JSON body or an SSE
//! stream). A connection that drops during `tools/call` either loses the call or, blindly
//! retried, runs the tool twice: a second payment, a second e-mail. Tools say what a repeat
//! costs in their annotations (`readOnlyHint`, `idempotentHint`, `destructiveHint`).
//! [`McpGateLayer`] reads each request body and marks it for [`RetryLayer`](crate::RetryLayer):
//!
//! | request | marked | so `RetryLayer` |
//! |---|---|---|
//! | `tools/call` of a tool whose annotations say `readOnlyHint` or `idempotentHint` | an [`Override`](crate::retry::Override) with `max_retries(1)` | retries it at most once |
//! | `tools/call` of any other tool (destructive, not idempotent, unannotated, unknown) | [`NotReplaySafe`](crate::retry::NotReplaySafe) | re-sends it only when nothing can have reached the server (connection refused) |
//! | `initialize`, `tools/list`, `resources/read`, notifications, … | nothing | follows its ordinary policy |
//! | a body too large to read, or one that does not read as JSON-RPC (malformed, cut, nested past the parser's depth) | [`NotReplaySafe`](crate::retry::NotReplaySafe) | sends it once |
//!
//! In a batch, one call that is not replay-safe makes the whole batch so.
//!
//! - Annotations come from [`McpGateLayer::tool`] (the caller's word, first) and from the
//!   `tools/list` responses that pass through, JSON or SSE, read along as the caller reads
//!   them (nothing is held back or changed). A tool without annotations gets the protocol's
//!   defaults: not read-only, not idempotent, so not re-sent.
//! - The session: the `Mcp-Session-Id` a response carries is kept and set on every later
//!   request that lacks it (never on `initialize`, which starts a session); retries send the
//!   same headers, so every attempt carries it. A `404` to a request with the session id
//!   forgets it: the server ended the session, and the next request has to `initialize`.
//! - A reconnect cap for the session: at most 5 re-sends within 60 s by default
//!   ([`McpGateLayer::reconnect`]), counted from the [`RetryTrail`](crate::RetryTrail)s
//!   that come back; once spent, requests go once until the window frees.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_llm_retry::{McpGateLayer, ReplayBody, RetryLayer};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_llm_retry::BoxError> {
//! # let http_client = service_fn(|_req: Request<ReplayBody>| async {
//! #     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! # });
//! let mcp = ServiceBuilder::new()
//!     .layer(McpGateLayer::new()) // outside: it marks what RetryLayer reads
//!     .layer(RetryLayer::new())
//!     .service(http_client);
//!
//! let call = Request::post("https://tools.example.com/mcp")
//!     .header("content-type", "application/json")
//!     .header("accept", "application/json, text/event-stream")
//!     .body(Full::new(Bytes::from_static(
//!         br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"send_email","arguments":{}}}"#,
//!     )))?;
//! let response = mcp.oneshot(call).await?; // never sent twice unless the connection was refused
//! # let _ = response;
//! # Ok(()) }
//! ```
//!
//! # Customised
//!
//! ```
//! use std::time::Duration;
//! use tower_llm_retry::mcp::ToolAnnotations;
//! use tower_llm_retry::{McpGateLayer, RetryPolicy};
//!
//! let policy = RetryPolicy::interactive();
//! let gate = McpGateLayer::new()
//!     .policy(policy.clone()) // the same policy as the RetryLayer inside
//!     .tool("search_docs", ToolAnnotations::read_only())
//!     .tool("upsert_record", ToolAnnotations::idempotent())
//!     .tool("charge_card", ToolAnnotations::destructive())
//!     .learn_annotations(false) // an untrusted server: only the tools above are re-sent
//!     .reconnect(3, Duration::from_secs(30));
//! # let _ = gate;
//! ```
//!
//! # Where it goes
//!
//! Outside [`RetryLayer`](crate::RetryLayer): it marks each request with extensions that
//! `RetryLayer` reads when the request reaches it. Inside, the marks would come too late.
//!
//! ```text
//! MCP client ──► McpGateLayer ──► RetryLayer ──► HTTP client
//! ```
//!
//! It buffers the request body (up to 32 MiB), which `RetryLayer` then takes as it is. The
//! gate counts retries from `RetryLayer`'s policy, so give it the same
//! [`policy`](McpGateLayer::policy). MCP streams carry no LLM output events, so
//! `RetryLayer`'s SSE gate holds an SSE answer back until it ends (or 64 KiB); for tools that
//! stream progress for long, turn it off with [`RetryLayer::sse_gate`](crate::RetryLayer::sse_gate).

mod body;
mod future;
pub(crate) mod layer;
mod rpc;
mod service;

pub use self::body::McpBody;
pub use self::future::ResponseFuture;
pub use self::service::McpGate;
// The layer is public at the crate root only; imported here for the docs.
#[cfg(doc)]
use self::layer::McpGateLayer;

use serde::Deserialize;

/// What an MCP tool says about itself (`annotations` in `tools/list`), as far as re-sending a
/// call is concerned. `None` is "not said": the protocol's defaults are not read-only,
/// destructive, not idempotent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct ToolAnnotations {
    /// `readOnlyHint`: the tool does not change its environment.
    #[serde(default)]
    pub read_only_hint: Option<bool>,
    /// `destructiveHint`: the tool may destroy or overwrite (meaningful when not read-only).
    #[serde(default)]
    pub destructive_hint: Option<bool>,
    /// `idempotentHint`: calling it again with the same arguments has no further effect.
    #[serde(default)]
    pub idempotent_hint: Option<bool>,
}

impl ToolAnnotations {
    /// Nothing said: the protocol's defaults, not re-sent.
    pub fn new() -> Self {
        Self::default()
    }

    /// A tool that only reads: `readOnlyHint: true`.
    pub fn read_only() -> Self {
        Self::new().read_only_hint(true)
    }

    /// A tool that changes things, but the same way each time: `readOnlyHint: false`,
    /// `idempotentHint: true`.
    pub fn idempotent() -> Self {
        Self::new().read_only_hint(false).idempotent_hint(true)
    }

    /// A tool whose repeat does harm: `readOnlyHint: false`, `destructiveHint: true`,
    /// `idempotentHint: false`.
    pub fn destructive() -> Self {
        Self::new()
            .read_only_hint(false)
            .destructive_hint(true)
            .idempotent_hint(false)
    }

    /// Sets `readOnlyHint`.
    pub fn read_only_hint(mut self, value: bool) -> Self {
        self.read_only_hint = Some(value);
        self
    }

    /// Sets `destructiveHint`.
    pub fn destructive_hint(mut self, value: bool) -> Self {
        self.destructive_hint = Some(value);
        self
    }

    /// Sets `idempotentHint`.
    pub fn idempotent_hint(mut self, value: bool) -> Self {
        self.idempotent_hint = Some(value);
        self
    }

    /// Whether a call may be sent again: read-only, or idempotent.
    ///
    /// ```
    /// use tower_llm_retry::mcp::ToolAnnotations;
    ///
    /// assert!(ToolAnnotations::read_only().is_replay_safe());
    /// assert!(ToolAnnotations::idempotent().destructive_hint(true).is_replay_safe());
    /// assert!(!ToolAnnotations::destructive().is_replay_safe());
    /// assert!(!ToolAnnotations::new().is_replay_safe());
    /// ```
    pub fn is_replay_safe(&self) -> bool {
        self.read_only_hint == Some(true) || self.idempotent_hint == Some(true)
    }
}
