//! Credentials: one on every request, refreshed once on `401`, rotated on rate limits.
//!
//! [`AuthLayer`] takes its credentials from a [`TokenSource`] and sets the credential header
//! on every request it sends, marked sensitive
//! ([`HeaderValue::set_sensitive`](http::HeaderValue::set_sensitive)) so that HTTP/2 never
//! indexes it and `Debug` never prints it. Inside [`RetryLayer`](crate::RetryLayer) that is
//! every attempt, so a retry after a long backoff carries the credential current at that time.
//!
//! - **`401`**: the layer tells the source, which drops the rejected credential if it is
//!   still the current one, then fetches a fresh one and re-sends the very same bytes, once.
//!   A second `401` is returned as it is. With [`RefreshingToken`] the refresh is
//!   single-flight: a thousand concurrent `401`s cause one call of the refresh function.
//! - **`401` with a key pool**: the key is set aside for a quarantine (1 min, doubling each
//!   time it is answered `401` again on its return, at most 1 h;
//!   [`quarantine`](ApiKeyPool::quarantine)), then tried again. A `401` to a request carrying
//!   a header that can cause it whatever the key (`openai-organization`, `openai-project`,
//!   `anthropic-beta`; [`request_scoped_headers`](ApiKeyPool::request_scoped_headers)) sets
//!   no key aside and is returned as it is: the key is judged on a request without one.
//! - **`429` with a key pool**: when the body shows a rate limit (not an exhausted quota),
//!   the key rests for the `Retry-After` and the request is re-sent at once with the next
//!   usable key of the [`ApiKeyPool`]. When every key rests, the `429` goes back up, and
//!   `RetryLayer` waits and retries as usual.
//! - A credential that cannot be had ends the request with
//!   [`ErrorKind::TokenRefresh`](crate::ErrorKind::TokenRefresh), which `RetryLayer` returns
//!   at once rather than retrying.
//!
//! A request that [`ModelFallbackLayer`] moves to a
//! [`Target`] with a [credential]
//! of its own is sent with that target's source instead of the layer's (refreshes and
//! rotations included): the primary's credential never goes to another upstream.
//!
//! Re-sends happen within one `RetryLayer` attempt; what the layer did is on the response as
//! an [`AuthOutcome`] extension, and in `INFO` tracing events (which never carry a credential).
//!
//! # Credential sources
//!
//! | source | what it does | defaults |
//! |---|---|---|
//! | [`ApiKey::new(key)`](ApiKey::new), [`ApiKey::with_header(key, CredentialHeader::Bearer)`](ApiKey::with_header) | one static key, as `x-api-key` or `authorization: Bearer …`; a `401` is returned as it is | — |
//! | [`ApiKeyPool::new([k1, k2, …])`](ApiKeyPool::new) | keys in turn; on a rate-limit `429` (not an exhausted quota) the key rests for the `Retry-After` and the request is re-sent at once with the next usable key; when every key rests, the `429` goes to `RetryLayer`'s ordinary backoff | a rest without `Retry-After`: 5 s ([`default_rest`](ApiKeyPool::default_rest)); at most a day; a key answered `401`: 1 min doubling to 1 h ([`quarantine`](ApiKeyPool::quarantine)); no key set aside for a `401` to a request with `openai-organization`, `openai-project` or `anthropic-beta` ([`request_scoped_headers`](ApiKeyPool::request_scoped_headers)) |
//! | [`RefreshingToken::new(async closure)`](RefreshingToken::new) | a token fetched by your function, sent as `authorization: Bearer …`: single-flight (1,000 concurrent `401`s → one call, no background task), refreshed ahead of expiry (from the advisory window on, one request refreshes and the rest keep the current token; from the mandatory window on, requests wait); after a failure every waiter gets `TokenRefresh` and refreshing rests; a refresh survives a request that gives up on it | windows 120 s and 30 s ([`refresh_windows`](RefreshingToken::refresh_windows)); rest 1 s doubling to 30 s ([`failure_backoff`](RefreshingToken::failure_backoff)); timeout 30 s ([`refresh_timeout`](RefreshingToken::refresh_timeout)) |
//! | `GoogleToken::metadata_server(client)`, `GoogleToken::authorized_user(client, json)` (feature `google-auth`) | a [`RefreshingToken`] whose closure fetches Google OAuth access tokens (Vertex AI) through `client`: from the metadata server, or by exchanging the refresh token of `gcloud auth application-default login`'s file; a service-account key (which needs signing) goes in a `RefreshingToken::new` closure of your own | [`RefreshingToken`]'s; the token URL: Google's ([`token_url`][google-token-url]) |
//!
//! The layer keeps no copy of the request and reads no body: the retry loop around it holds
//! the request, classifies each answer once (a `429` whose body names an exhausted quota is
//! [`QuotaExhausted`](crate::classify::FailureClass::QuotaExhausted), and no other key helps), reads
//! `Retry-After` (an HTTP-date against the response's `Date`) and does the re-send the layer
//! asks for. Responses carry
//! [`AuthOutcome { refreshed, rotations, key_index }`](AuthOutcome) when the layer re-sent or
//! used a pool. No credential appears in a span, an event, an error message or the `Debug`
//! output of any type of this crate (tested at `TRACE` level across the whole stack).
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_llm_retry::{ApiKey, AuthLayer};
//! use tower_llm_retry::{ReplayBody, RetryLayer};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let http_client = service_fn(|req: Request<ReplayBody>| async move {
//! #     assert!(req.headers()["x-api-key"].is_sensitive());
//! #     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
//! # });
//! # std::env::set_var("ANTHROPIC_API_KEY", "sk-ant-api03-example");
//! let key = std::env::var("ANTHROPIC_API_KEY")?;
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     .layer(AuthLayer::new(ApiKey::new(&key)?))
//!     .service(http_client);
//!
//! let request = Request::post("https://api.anthropic.com/v1/messages")
//!     .body(Full::new(Bytes::from_static(br#"{"model":"claude-sonnet-4-5","max_tokens":64}"#)))?;
//! let response = client.oneshot(request).await?;
//! # let _ = response;
//! # Ok(()) }
//! ```
//!
//! # Customised
//!
//! ```
//! use std::time::Duration;
//! use tower_llm_retry::AuthLayer;
//! use tower_llm_retry::auth::{ApiKeyPool, CredentialHeader, RefreshingToken, Token};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Several keys for one provider, moved between on rate limits.
//! let pool = AuthLayer::new(ApiKeyPool::new(["sk-ant-api03-a", "sk-ant-api03-b"])?);
//!
//! // An OAuth token from an async function, refreshed ahead of expiry and on 401.
//! # async fn exchange_refresh_token() -> std::io::Result<(String, u64)> { Ok(("t".into(), 3600)) }
//! let oauth = AuthLayer::new(
//!     RefreshingToken::new(|| async {
//!         let (token, expires_in) = exchange_refresh_token().await?;
//!         Ok::<_, std::io::Error>(Token::new(token).expires_in(Duration::from_secs(expires_in)))
//!     })
//!     .header(CredentialHeader::Bearer)
//!     .refresh_windows(Duration::from_secs(300), Duration::from_secs(60))?,
//! );
//! # let _ = (pool, oauth);
//! # Ok(()) }
//! ```
//!
//! # Where it goes
//!
//! Inside [`RetryLayer`](crate::RetryLayer), innermost, right above the HTTP client, so that
//! every request that leaves carries the credential current at that moment. It is built on
//! `Service<Request<ReplayBody>>`, the request type the loop sends. For credentials without
//! retries, use `RetryLayer` with the [`never`](crate::RetryPolicy::never) policy: the
//! refresh after a `401` and the move to another key after a `429` are re-sends of the same
//! attempt, and still happen. Without a `RetryLayer` at all, the layer puts a credential on
//! each request and never re-sends.
//!
#![cfg_attr(
    feature = "fallback",
    doc = "[`ModelFallbackLayer`]: crate::ModelFallbackLayer"
)]
#![cfg_attr(
    not(feature = "fallback"),
    doc = "[`ModelFallbackLayer`]: crate#features"
)]
#![cfg_attr(feature = "fallback", doc = "[`Target`]: crate::fallback::Target")]
#![cfg_attr(not(feature = "fallback"), doc = "[`Target`]: crate#features")]
#![cfg_attr(
    feature = "fallback",
    doc = "[credential]: crate::fallback::Target::credential"
)]
#![cfg_attr(not(feature = "fallback"), doc = "[credential]: crate#features")]
#![cfg_attr(
    feature = "google-auth",
    doc = "[google-token-url]: GoogleToken::token_url"
)]
#![cfg_attr(
    not(feature = "google-auth"),
    doc = "[google-token-url]: crate#features"
)]

pub(crate) mod api_key;
mod credential;
mod future;
#[cfg(feature = "google-auth")]
mod google;
pub(crate) mod layer;
mod refresh;
mod service;

// The layer and `ApiKey` are public at the crate root only; imported here for the docs.
pub use self::api_key::ApiKeyPool;
pub use self::credential::{
    Credential, CredentialFuture, CredentialHeader, InvalidCredential, TokenSource,
};
pub use self::future::ResponseFuture;
#[cfg(feature = "fallback")]
pub(crate) use self::future::TargetCredential;
#[cfg(feature = "google-auth")]
#[cfg_attr(docsrs, doc(cfg(feature = "google-auth")))]
pub use self::google::{GoogleToken, METADATA_TOKEN_URL, OAUTH_TOKEN_URL};
pub use self::refresh::{RefreshingToken, Token};
pub use self::service::Auth;
#[cfg(doc)]
use self::{api_key::ApiKey, layer::AuthLayer};

/// Response extension: what [`AuthLayer`] did to get this response.
///
/// Set when the layer re-sent the request, or when the credential came from an
/// [`ApiKeyPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct AuthOutcome {
    /// A `401` was answered by re-sending with a fresh credential.
    pub refreshed: bool,
    /// How many times a rate-limited key was swapped for another and the request re-sent.
    pub rotations: u32,
    /// Which key of the pool this response came from, counting from 0.
    pub key_index: Option<usize>,
}
