use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{HeaderName, HeaderValue, AUTHORIZATION};
use http::HeaderMap;
use tokio::time::Instant;

use crate::error::BoxError;

/// Where a credential goes in the request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CredentialHeader {
    /// `authorization: Bearer <secret>`: OAuth access tokens, OpenAI keys.
    Bearer,
    /// The secret as the whole value of this header, as Anthropic's `x-api-key`.
    Header(HeaderName),
}

impl CredentialHeader {
    /// `x-api-key: <secret>`, as the Anthropic API expects an API key.
    pub fn x_api_key() -> Self {
        CredentialHeader::Header(HeaderName::from_static("x-api-key"))
    }
}

impl Default for CredentialHeader {
    /// [`CredentialHeader::x_api_key`].
    fn default() -> Self {
        Self::x_api_key()
    }
}

/// A secret could not be made into a credential: it is empty or not a valid HTTP header value.
///
/// The message never contains the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidCredential {
    reason: &'static str,
}

impl InvalidCredential {
    pub(crate) fn new(reason: &'static str) -> Self {
        InvalidCredential { reason }
    }
}

impl fmt::Display for InvalidCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason)
    }
}

impl std::error::Error for InvalidCredential {}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The longest a key rests or refreshing backs off, whatever a server or a setting asks: a day,
/// as the cooldown gate's hold.
pub(super) const MAX_REST: Duration = Duration::from_secs(24 * 60 * 60);

/// `now + wait`, with `wait` first capped at `cap`. The waits come from servers (`Retry-After`,
/// `expires_in`) and settings, and `Instant + Duration` panics past the end of the clock. The
/// caps are a day or a year, far inside any clock's range; `now` is only a fallback that cannot
/// panic.
pub(super) fn capped_add(now: Instant, wait: Duration, cap: Duration) -> Instant {
    now.checked_add(wait.min(cap)).unwrap_or(now)
}

/// One credential, ready to be put on a request: the header, its value (marked sensitive, so
/// HTTP/2 never indexes it and `Debug` never prints it) and, for a token, when it expires.
///
/// Two `Credential`s are equal when one is a clone of the other: that is how a
/// [`TokenSource`] tells whether the credential a server rejected is still its current one.
#[derive(Clone)]
pub struct Credential {
    header: HeaderName,
    value: HeaderValue,
    expires_at: Option<Instant>,
    key_index: Option<usize>,
    id: u64,
}

impl Credential {
    /// A credential for `secret`, placed as `header` says. Surrounding whitespace (a trailing
    /// newline from a file) is trimmed; an empty secret, or one that is not a valid header
    /// value, is an error.
    pub fn new(header: &CredentialHeader, secret: &str) -> Result<Self, InvalidCredential> {
        let secret = secret.trim();
        if secret.is_empty() {
            return Err(InvalidCredential::new("the credential is empty"));
        }
        let (name, value) = match header {
            CredentialHeader::Bearer => (
                AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {secret}")),
            ),
            CredentialHeader::Header(name) => (name.clone(), HeaderValue::from_str(secret)),
        };
        let mut value = value.map_err(|_| {
            InvalidCredential::new("the credential is not a valid HTTP header value")
        })?;
        value.set_sensitive(true);
        Ok(Credential {
            header: name,
            value,
            expires_at: None,
            key_index: None,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// This credential, expiring at `at` (on the [`tokio::time`] clock).
    pub fn expires_at(mut self, at: Instant) -> Self {
        self.expires_at = Some(at);
        self
    }

    /// When this credential expires, if it does.
    pub fn expiry(&self) -> Option<Instant> {
        self.expires_at
    }

    /// Which key of an [`ApiKeyPool`](super::ApiKeyPool) this is, counting from 0.
    pub fn key_index(&self) -> Option<usize> {
        self.key_index
    }

    /// The header this credential is sent in.
    pub fn header_name(&self) -> &HeaderName {
        &self.header
    }

    pub(crate) fn with_key_index(mut self, index: usize) -> Self {
        self.key_index = Some(index);
        self
    }

    /// Time left before expiry; `None` for a credential that does not expire.
    pub(crate) fn remaining(&self, now: Instant) -> Option<Duration> {
        self.expires_at.map(|at| at.saturating_duration_since(now))
    }

    /// Puts the credential on a request, replacing any value the header had.
    pub(crate) fn apply(&self, headers: &mut HeaderMap) {
        headers.insert(self.header.clone(), self.value.clone());
    }
}

impl PartialEq for Credential {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for Credential {}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credential")
            .field("header", &self.header)
            .field("value", &"<redacted>")
            .field("expires_at", &self.expires_at)
            .field("key_index", &self.key_index)
            .finish()
    }
}

/// The future returned by [`TokenSource::credential`]: ready at once for a cached credential,
/// boxed only when one has to be fetched.
#[must_use = "futures do nothing unless polled"]
pub struct CredentialFuture {
    kind: FutureKind,
}

type BoxCredentialFuture = Pin<Box<dyn Future<Output = Result<Credential, BoxError>> + Send>>;

enum FutureKind {
    Ready(Option<Result<Credential, BoxError>>),
    Pending(BoxCredentialFuture),
}

impl CredentialFuture {
    /// A future that is ready with `result`.
    pub fn ready(result: Result<Credential, BoxError>) -> Self {
        CredentialFuture {
            kind: FutureKind::Ready(Some(result)),
        }
    }

    /// A future that fetches the credential with `future`.
    pub fn new<F>(future: F) -> Self
    where
        F: Future<Output = Result<Credential, BoxError>> + Send + 'static,
    {
        CredentialFuture {
            kind: FutureKind::Pending(Box::pin(future)),
        }
    }
}

impl CredentialFuture {
    /// The result, when it is there without waiting.
    pub(crate) fn try_ready(&mut self) -> Option<Result<Credential, BoxError>> {
        match &mut self.kind {
            FutureKind::Ready(result) => result.take(),
            FutureKind::Pending(_) => None,
        }
    }
}

impl Future for CredentialFuture {
    type Output = Result<Credential, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().kind {
            FutureKind::Ready(result) => Poll::Ready(
                result
                    .take()
                    .expect("CredentialFuture polled after completion"),
            ),
            FutureKind::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for CredentialFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ready = matches!(self.kind, FutureKind::Ready(_));
        f.debug_struct("CredentialFuture")
            .field("ready", &ready)
            .finish()
    }
}

/// Where [`AuthLayer`](super::AuthLayer) gets the credential for each request, and what it
/// tells when the server rejects or rate-limits one.
///
/// The crate ships three: [`ApiKey`](super::ApiKey) (one static key),
/// [`ApiKeyPool`](super::ApiKeyPool) (several keys, rotated on rate limits) and
/// [`RefreshingToken`](super::RefreshingToken) (a token fetched by an async closure, refreshed
/// ahead of expiry and on `401`, single-flight). Wrap a source in an `Arc` to share it between
/// several stacks, or to keep a handle on it.
pub trait TokenSource: Send + Sync + 'static {
    /// The credential to send now. Called for every request sent, so it should answer from a
    /// cache with [`CredentialFuture::ready`] whenever it can. An error ends the request with
    /// [`ErrorKind::TokenRefresh`](crate::ErrorKind::TokenRefresh).
    fn credential(&self) -> CredentialFuture;

    /// The server answered `401` to `rejected`. Stop using it if it is still the current
    /// credential (a concurrent request may already have replaced it), and return whether a
    /// request sent now would carry a different one, so that re-sending it once is worthwhile.
    /// Defaults to doing nothing and returning false: a static key stays what it is.
    fn invalidate(&self, rejected: &Credential) -> bool {
        let _ = rejected;
        false
    }

    /// Whether a `401` to a request with these headers may be the request's doing rather
    /// than the credential's (a header naming an organization the credential does not belong
    /// to, say). When it is, such a `401` goes back as it is: the source is not told
    /// ([`invalidate`](Self::invalidate) is not called) and nothing is re-sent. Defaults to
    /// false: every `401` is the credential's.
    fn blames_request(&self, request: &HeaderMap) -> bool {
        let _ = request;
        false
    }

    /// Whether this source holds several credentials to move between on rate limits. When it
    /// does, the start of a `429` body is read to tell a rate limit from an exhausted quota.
    /// Defaults to false.
    fn rotates(&self) -> bool {
        false
    }

    /// The server rate-limited `limited` (a `429` that is not an exhausted quota), asking for
    /// `retry_after` when it said. Rest that credential for that long and return whether
    /// another one is usable now; if so the request is re-sent at once with it. Defaults to
    /// false: the `429` goes back to the caller, or to `RetryLayer`.
    fn rate_limited(&self, limited: &Credential, retry_after: Option<Duration>) -> bool {
        let _ = (limited, retry_after);
        false
    }
}

impl<T: TokenSource + ?Sized> TokenSource for Arc<T> {
    fn credential(&self) -> CredentialFuture {
        (**self).credential()
    }
    fn invalidate(&self, rejected: &Credential) -> bool {
        (**self).invalidate(rejected)
    }
    fn blames_request(&self, request: &HeaderMap) -> bool {
        (**self).blames_request(request)
    }
    fn rotates(&self) -> bool {
        (**self).rotates()
    }
    fn rate_limited(&self, limited: &Credential, retry_after: Option<Duration>) -> bool {
        (**self).rate_limited(limited, retry_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `apply` leaves the request with exactly the credential, sensitive: a caller's equal but
    /// plain value is replaced, repeats collapse to one, another value is replaced, and an
    /// already applied one stays as it is.
    #[test]
    fn apply_leaves_exactly_the_credential() {
        let c = Credential::new(&CredentialHeader::x_api_key(), "sk-ant-k").unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "sk-ant-k".parse().unwrap());
        c.apply(&mut h);
        assert!(h["x-api-key"].is_sensitive());
        h.append("x-api-key", "sk-ant-k".parse().unwrap());
        c.apply(&mut h);
        assert_eq!(h.get_all("x-api-key").iter().count(), 1);
        h.insert("x-api-key", "sk-ant-other".parse().unwrap());
        c.apply(&mut h);
        assert_eq!(h["x-api-key"], "sk-ant-k");
        c.apply(&mut h);
        assert_eq!(h.get_all("x-api-key").iter().count(), 1);
        assert!(h["x-api-key"].is_sensitive());
        let mut empty = HeaderMap::new();
        c.apply(&mut empty);
        assert_eq!(empty["x-api-key"], "sk-ant-k");
    }

    #[test]
    fn values_are_sensitive_and_never_printed() {
        let c = Credential::new(&CredentialHeader::x_api_key(), " sk-ant-SECRET\n").unwrap();
        let mut h = HeaderMap::new();
        c.apply(&mut h);
        assert_eq!(h["x-api-key"], "sk-ant-SECRET");
        assert!(h["x-api-key"].is_sensitive());
        assert!(!format!("{c:?} {h:?}").contains("SECRET"));

        let b = Credential::new(&CredentialHeader::Bearer, "tok-SECRET").unwrap();
        b.apply(&mut h);
        assert_eq!(h["authorization"], "Bearer tok-SECRET");
        assert!(h["authorization"].is_sensitive());
    }

    #[test]
    fn invalid_secrets_are_refused_without_echo() {
        for bad in ["", "  ", "sk\nSECRET", "sk\u{7f}SECRET"] {
            let err = Credential::new(&CredentialHeader::x_api_key(), bad).unwrap_err();
            assert!(!err.to_string().contains("SECRET"));
        }
    }

    #[test]
    fn equality_is_identity() {
        let h = CredentialHeader::x_api_key();
        let a = Credential::new(&h, "same").unwrap();
        let b = Credential::new(&h, "same").unwrap();
        assert_eq!(a, a.clone());
        assert_ne!(a, b);
    }
}
