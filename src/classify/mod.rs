//! Deciding which outcomes of an attempt are failures, and which failures are worth a retry.
//!
//! [`DefaultClassifier`] judges each attempt by the table below, in this order: the first row
//! that matches decides. It gives a verdict (success, retry, or no retry) and a
//! [`FailureClass`]; what the retry loop then does with a retryable verdict (replay safety, the
//! `Retry-After` ceiling, the retry count, the deadline, the budget) is decided after it, in the
//! order listed in [`retry`](crate::retry#after-the-verdict).
//!
//! Whatever the classifier says, the loop ends a request on the final word of a companion
//! layer inside it (a credential that could not be had, a signal to switch models, an overload
//! from the last model of a fallback chain): see
//! [`retry`](crate::retry#companion-layers-inside-the-loop). A custom [`Classify`] cannot
//! retry those. The companions read the classifier's verdict: with a custom one, a fallback
//! trigger counts what it calls an overload or a retryable failure, and a key pool tells an
//! exhausted quota from a rate limit by what it calls
//! [`QuotaExhausted`](FailureClass::QuotaExhausted).
//!
//! | # | outcome of the attempt | verdict | class |
//! |---|---|---|---|
//! | 0 | an error that says the request cannot be sent as configured ([`unsendable`]): a connector that does not speak the URL's scheme (hyper-util's `build_http()` pointed at `https://`), a URL without scheme or host, an invalid URI, a scheme the client refuses | no retry; the request ends with [`ErrorKind::Unsendable`](crate::ErrorKind::Unsendable) | [`Unsendable`](FailureClass::Unsendable) |
//! | 1 | an error that proves the server never processed the request ([`never_processed`], see [below](#http2-proofs-that-a-request-was-never-processed)) | retry | [`NotProcessed`](FailureClass::NotProcessed) |
//! | 2 | any other error before a response head: connect error, reset, head timeout, incomplete message | retry | [`Transport`](FailureClass::Transport) |
//! | 3 | 2xx | success (`x-should-retry` is not read) | — |
//! | 4 | `x-should-retry: true` / `false` (other values are ignored) | obeyed, whatever the status; the class is the one rows 4a–10 give | as below |
//! | 4a | a throttle in a cloud dialect, whatever the status: Amazon Bedrock's `ThrottlingException` (in the `x-amzn-ErrorType` header or the body's `__type`; "Too many tokens" included, which is a rate, not a context overflow), Google's `RESOURCE_EXHAUSTED` on a quota that is not per day or billing | retry | `RateLimited` |
//! | 4b | Google's `RESOURCE_EXHAUSTED` whose quota (`quotaId`, `quotaMetric`, `ErrorInfo` metadata) or message names a daily or billing limit, on a 429 | no retry | [`QuotaExhausted`](FailureClass::QuotaExhausted) |
//! | 4c | Bedrock's `ServiceUnavailableException` or `ModelNotReadyException` (a 429 or 5xx); Google's `UNAVAILABLE` on a 5xx whose message says "overloaded" | retry | `Overloaded` |
//! | 5 | 429 whose body names an exhausted quota or spend limit: `insufficient_quota`, `enforced_spend_limit_reached`, `billing_hard_limit_reached`, `billing_not_active` | no retry | [`QuotaExhausted`](FailureClass::QuotaExhausted) |
//! | 6 | 408, 409, 429, 500–599 | retry | `Timeout`, `Conflict`, `RateLimited`, `Server`; `Overloaded` for 529, for a 429 or 5xx whose body says `overloaded_error`, and for a 5xx whose body is OpenAI's overload: a `code` or `type` of `overloaded` or `server_is_overloaded`, or a message that starts "The server is overloaded or not ready yet" (any case) |
//! | 7 | any other 4xx but 401 whose body says `overloaded_error` | retry | `Overloaded` |
//! | 8 | 401 | no retry ([`AuthLayer`] refreshes once) | `Unauthorized` |
//! | 9 | any other 4xx (`400`, `413`) whose body says the context window overflowed: `exceed context limit`, `prompt is too long`, `context_length_exceeded`, `maximum context length`, Google's `exceeds the maximum number of tokens allowed`, Bedrock's `Input is too long for requested model` | no retry ([`ContextOverflowLayer`] repairs what it can) | [`ContextOverflow`](FailureClass::ContextOverflow) |
//! | 10 | any other status | no retry; the response is returned as it is | `Client` (4xx), `Other` (1xx, 3xx) |
//!
//! Bodies are read only for 4xx and 5xx ([`Classify::wants_body`]), up to the peek limit
//! (64 KiB by default); the caller still receives the whole body. A body that is not JSON, or
//! is cut at the peek limit, is searched for the quoted codes only (`"overloaded_error"`, the
//! quota codes, `"server_is_overloaded"`, `"overloaded"`, `"context_length_exceeded"`), which no
//! prose message contains by accident.
//!
//! In-band errors of a `2xx` `text/event-stream` response are judged by
//! [`Classify::classify_sse_event`]; the default maps each to its HTTP twin (see
//! [`stream`](crate::stream#in-band-errors)).
//!
//! # `Retry-After`
//!
//! Every non-2xx verdict carries the wait the server asked for, read by
//! [`headers::parse_retry_after`]. First found wins: `retry-after-ms`, then Amazon Bedrock's
//! `x-amz-retry-after` (milliseconds), then `retry-after` as (fractional) seconds, then
//! `retry-after` as an HTTP-date, read against the response's own
//! `Date` when it has one (so the host's clock skew does not change the wait; the system
//! clock otherwise, or [`DefaultClassifier::with_clock`]). NaN, infinite, negative and
//! unparseable values count as absent, and so does a date in the past or a value longer than
//! 32 characters; a plain number too large for a `Duration` is the longest wait (above any
//! ceiling, so the policy's choice for that applies); a header sent twice counts with its
//! first value. With no such header, Google's error envelope gives the wait in a
//! `google.rpc.RetryInfo` detail's `retryDelay` (`"17s"`, `"1.5s"`: decimal seconds, at most
//! nine fractional digits, 32 characters), under the same ceiling. A `Retry-After` applies only to the sleep
//! right after the response that carried it; the policy clamps it and decides what a wait above
//! its ceiling means ([`RetryPolicy`](crate::RetryPolicy)).
//!
//! # HTTP/2: proofs that a request was never processed
//!
//! The real APIs are HTTPS and negotiate HTTP/2 by ALPN. The layer is protocol-agnostic; what
//! HTTP/2 adds is proof that a request was never processed (gRPC's transparent-retry rule),
//! read from the `h2` error in the failure's source chain (feature `http2`, on by default):
//!
//! | signal | proves not processed? | what the retry loop does |
//! |---|---|---|
//! | `RST_STREAM` with `REFUSED_STREAM` | yes | re-sent at once (no backoff), once per attempt, even when [`NotReplaySafe`](crate::retry::NotReplaySafe); not counted as a retry, no budget drawn; the trail records class `NotProcessed` |
//! | `GOAWAY`, stream above its last stream id | yes (h2 fails exactly those streams with the `GOAWAY` error) | as above |
//! | a request hyper canceled before writing a byte of it (queued on a connection that closed) | yes, on HTTP/1.1 too | as above |
//! | `RST_STREAM` with `INTERNAL_ERROR` or `CANCEL`, a connection dropped mid-stream, a stream at or below the `GOAWAY` id that the connection's end cut | no | ordinary rules: retried as `Transport` unless `NotReplaySafe` |
//!
//! After its one transparent re-send, an attempt that is refused again follows the ordinary
//! rules; a proof still counts as "not sent" ([`Classify::request_not_sent`], which also counts a
//! refused connection, a hyper-util connect error and [`RequestNotSent`]), so even a
//! `NotReplaySafe` request is retried, with backoff. A request allowed no retries
//! ([`NoRetry`](crate::retry::NoRetry), `max_retries(0)`, and the policy's last attempt) keeps
//! no copy and is sent exactly once.
//!
//! hyper-util's legacy client also re-sends by itself, when `retry_canceled_requests` is on (its
//! default), a request that hyper canceled before writing it on a reused connection. That
//! happens below the loop, so the trail counts one attempt for it; it never re-sends anything
//! that may have reached the server (hyper only cancels requests it never started to write), so
//! it is safe with `NotReplaySafe`. `tests/it/http2.rs` runs the key cases against the mock,
//! hashing the body on every attempt: a 429 with `Retry-After`, a 529, a reset before the head
//! and an in-band SSE error over h1+TLS and h2+TLS; `REFUSED_STREAM` and `GOAWAY` over h2+TLS
//! and h2c; `INTERNAL_ERROR` after the head over h2c.
//!
//! # Changing a decision
//!
//! Wrap the default:
//!
//! ```
//! use tower_llm_retry::classify::{Classify, Classification, DefaultClassifier, FailureClass};
//!
//! /// Also retries 404s, which one flaky gateway sends while it warms up.
//! #[derive(Debug, Clone, Default)]
//! struct RetryNotFound(DefaultClassifier);
//!
//! impl Classify for RetryNotFound {
//!     fn classify_response(&self, head: &http::response::Parts, body: Option<&[u8]>) -> Classification {
//!         if head.status == http::StatusCode::NOT_FOUND {
//!             return Classification::retry(FailureClass::Client);
//!         }
//!         self.0.classify_response(head, body)
//!     }
//!
//!     fn classify_error(&self, error: &(dyn std::error::Error + 'static)) -> Classification {
//!         self.0.classify_error(error)
//!     }
//! }
//! ```
//!
#![cfg_attr(feature = "auth", doc = "[`AuthLayer`]: crate::AuthLayer")]
#![cfg_attr(not(feature = "auth"), doc = "[`AuthLayer`]: crate#features")]
#![cfg_attr(
    feature = "overflow",
    doc = "[`ContextOverflowLayer`]: crate::ContextOverflowLayer"
)]
#![cfg_attr(
    not(feature = "overflow"),
    doc = "[`ContextOverflowLayer`]: crate#features"
)]

pub mod headers;
mod sse;

pub use self::sse::{default_sse_verdict, SseVerdict};

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::StatusCode;

use crate::provider::error_body::{BodySignal, ErrorBody, Overflow};
use crate::stream::SseEvent;

/// The HTTP status Anthropic uses for "overloaded".
pub const STATUS_OVERLOADED: u16 = 529;

/// What went wrong with one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureClass {
    /// No response head: connect error, reset, timeout, incomplete message.
    Transport,
    /// 408 Request Timeout.
    Timeout,
    /// 409 Conflict.
    Conflict,
    /// 429 Too Many Requests (a rate limit, not an exhausted quota).
    RateLimited,
    /// 529, any error whose body says `overloaded_error`, or a 5xx whose body is OpenAI's
    /// overload (`overloaded`, `server_is_overloaded`, "The server is overloaded or not
    /// ready yet.").
    Overloaded,
    /// Any other 5xx.
    Server,
    /// A 429 whose body says the quota or spend limit is exhausted.
    QuotaExhausted,
    /// 401 Unauthorized.
    Unauthorized,
    /// The prompt, or the prompt plus `max_tokens`, does not fit the context window.
    ContextOverflow,
    /// Any other 4xx.
    Client,
    /// A 2xx response whose body failed or ended short while the loop read it whole (only
    /// with [`RetryLayer::buffer_responses`](crate::RetryLayer::buffer_responses)).
    TruncatedEnvelope,
    /// A status outside 2xx, 4xx and 5xx that a classifier chose to call a failure.
    Other,
    /// HTTP/2 proved the server never processed the request: its stream was refused
    /// (`RST_STREAM` with `REFUSED_STREAM`) or was above the last stream id of a `GOAWAY`.
    /// Re-sent at once, once per attempt, even when the request is
    /// [`NotReplaySafe`](crate::retry::NotReplaySafe) (see [`never_processed`]).
    NotProcessed,
    /// The request could not be sent as configured: the client's connector does not speak
    /// the URL's scheme (hyper-util's `build_http()` pointed at `https://`), the URL has no
    /// scheme or host, or the client refused the URI or HTTP version (see [`unsendable`]).
    /// Another attempt would fail the same way, so it is never retried; the request ends
    /// with [`ErrorKind::Unsendable`](crate::ErrorKind::Unsendable).
    Unsendable,
}

impl FailureClass {
    /// A short, stable, lower-case name, used as the `error.type` of tracing spans.
    pub fn as_str(&self) -> &'static str {
        match self {
            FailureClass::Transport => "transport",
            FailureClass::Timeout => "timeout",
            FailureClass::Conflict => "conflict",
            FailureClass::RateLimited => "rate_limited",
            FailureClass::Overloaded => "overloaded",
            FailureClass::Server => "server",
            FailureClass::QuotaExhausted => "quota_exhausted",
            FailureClass::Unauthorized => "unauthorized",
            FailureClass::ContextOverflow => "context_overflow",
            FailureClass::Client => "client",
            FailureClass::TruncatedEnvelope => "truncated_envelope",
            FailureClass::Other => "other",
            FailureClass::NotProcessed => "not_processed",
            FailureClass::Unsendable => "unsendable",
        }
    }

    /// The class a status gets when nothing else (headers, body) says more.
    pub fn from_status(status: StatusCode) -> Option<Self> {
        Some(match status.as_u16() {
            200..=299 => return None,
            STATUS_OVERLOADED => FailureClass::Overloaded,
            408 => FailureClass::Timeout,
            409 => FailureClass::Conflict,
            429 => FailureClass::RateLimited,
            401 => FailureClass::Unauthorized,
            500..=599 => FailureClass::Server,
            400..=499 => FailureClass::Client,
            _ => FailureClass::Other,
        })
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The verdict on one attempt.
#[derive(Clone, Copy)]
pub struct Classification {
    class: Option<FailureClass>,
    retryable: bool,
    retry_after: Option<Duration>,
    // What the error body says of a context overflow, with its numbers, as the classifier
    // read it: the companion layers read the body through the classification, parsed once.
    overflow: Option<Overflow>,
}

impl PartialEq for Classification {
    // The verdict: what the body said beside it is not part of it.
    fn eq(&self, other: &Self) -> bool {
        self.class == other.class
            && self.retryable == other.retryable
            && self.retry_after == other.retry_after
    }
}

impl Eq for Classification {}

impl fmt::Debug for Classification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Classification")
            .field("class", &self.class)
            .field("retryable", &self.retryable)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl Classification {
    /// The attempt succeeded.
    pub const fn success() -> Self {
        Classification {
            class: None,
            retryable: false,
            retry_after: None,
            overflow: None,
        }
    }

    /// The attempt failed and may be retried.
    pub const fn retry(class: FailureClass) -> Self {
        Classification {
            class: Some(class),
            retryable: true,
            retry_after: None,
            overflow: None,
        }
    }

    /// The attempt failed and must not be retried.
    pub const fn fail(class: FailureClass) -> Self {
        Classification {
            class: Some(class),
            retryable: false,
            retry_after: None,
            overflow: None,
        }
    }

    /// Records the wait the server asked for.
    pub const fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// The failure class, or `None` for a success.
    pub const fn class(&self) -> Option<FailureClass> {
        self.class
    }

    /// Whether the attempt succeeded.
    pub const fn is_success(&self) -> bool {
        self.class.is_none()
    }

    /// Whether the attempt failed in a way worth retrying.
    pub const fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The wait the server asked for, if any.
    pub const fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The context overflow the error body describes, when the class is
    /// [`ContextOverflow`](FailureClass::ContextOverflow) and the body was read.
    pub(crate) fn overflow(&self) -> Option<Overflow> {
        self.overflow
    }

    /// Records what the error body says of a context overflow.
    pub(crate) fn with_overflow(mut self, overflow: Option<Overflow>) -> Self {
        self.overflow = overflow;
        self
    }
}

/// Judges the outcome of one attempt.
///
/// The retry loop calls [`Classify::wants_body`] with each response head; when it answers
/// true, up to the peek limit (64 KiB by default) of the body is read and handed to
/// [`Classify::classify_response`]. The caller still receives the whole body, byte for byte.
pub trait Classify: Send + Sync + 'static {
    /// Judges a response.
    fn classify_response(
        &self,
        head: &http::response::Parts,
        body: Option<&[u8]>,
    ) -> Classification;

    /// Judges an error of the inner service (no response head was received).
    fn classify_error(&self, error: &(dyn std::error::Error + 'static)) -> Classification;

    /// Whether the start of the body is needed to judge this response. Defaults to true for
    /// 4xx and 5xx statuses.
    fn wants_body(&self, head: &http::response::Parts) -> bool {
        head.status.is_client_error() || head.status.is_server_error()
    }

    /// Whether this error proves the request never reached the server (the connection was
    /// refused, or a service said so with [`RequestNotSent`]). Only such failures are retried
    /// for requests marked [`NotReplaySafe`](crate::retry::NotReplaySafe).
    fn request_not_sent(&self, error: &(dyn std::error::Error + 'static)) -> bool {
        request_not_sent(error)
    }

    /// Judges one event of a `text/event-stream` response before the commit point. Defaults
    /// to [`default_sse_verdict`].
    fn classify_sse_event(&self, event: &SseEvent<'_>) -> SseVerdict {
        default_sse_verdict(event)
    }
}

impl<C: Classify + ?Sized> Classify for Arc<C> {
    fn classify_sse_event(&self, event: &SseEvent<'_>) -> SseVerdict {
        (**self).classify_sse_event(event)
    }
    fn classify_response(
        &self,
        head: &http::response::Parts,
        body: Option<&[u8]>,
    ) -> Classification {
        (**self).classify_response(head, body)
    }
    fn classify_error(&self, error: &(dyn std::error::Error + 'static)) -> Classification {
        (**self).classify_error(error)
    }
    fn wants_body(&self, head: &http::response::Parts) -> bool {
        (**self).wants_body(head)
    }
    fn request_not_sent(&self, error: &(dyn std::error::Error + 'static)) -> bool {
        (**self).request_not_sent(error)
    }
}

/// The wall clock the classifier reads to turn an HTTP-date `Retry-After` into a wait.
pub type WallClock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// The classifier for LLM APIs described in the [module docs](self).
#[derive(Clone)]
pub struct DefaultClassifier {
    clock: Option<WallClock>,
}

impl DefaultClassifier {
    /// A classifier reading the system clock.
    pub fn new() -> Self {
        DefaultClassifier { clock: None }
    }

    /// Uses `clock` instead of the system clock for HTTP-date `Retry-After` values, so tests
    /// can fix "now".
    pub fn with_clock(clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        DefaultClassifier {
            clock: Some(Arc::new(clock)),
        }
    }

    /// "Now" for an HTTP-date `Retry-After` of this response: the injected clock when there
    /// is one; else the response's own `Date` ([`headers::server_now`]).
    fn now(&self, headers: &http::HeaderMap) -> SystemTime {
        match &self.clock {
            Some(clock) => clock(),
            None => headers::server_now(headers),
        }
    }
}

impl Default for DefaultClassifier {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for DefaultClassifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DefaultClassifier")
            .field("custom_clock", &self.clock.is_some())
            .finish()
    }
}

impl Classify for DefaultClassifier {
    fn classify_response(
        &self,
        head: &http::response::Parts,
        body: Option<&[u8]>,
    ) -> Classification {
        let status = head.status;
        if status.is_success() {
            return Classification::success();
        }
        // `now` is read only for an HTTP-date: the usual seconds cost no clock or `Date` parse.
        let retry_after =
            headers::parse_retry_after_with(&head.headers, || self.now(&head.headers));
        let parsed = body.map(ErrorBody::parse);
        // Bedrock's error type in its header outranks what the body says.
        let signal = crate::provider::cloud::aws_header_signal(&head.headers)
            .unwrap_or_else(|| parsed.map_or(BodySignal::Other, |b| b.signal));
        // A header's wait first; else the body's (Google's `RetryInfo`).
        let retry_after = retry_after.or_else(|| parsed.and_then(|b| b.retry_after));
        let class = match FailureClass::from_status(status) {
            // A throttle, whatever the status says.
            Some(_) if signal == BodySignal::Throttled => FailureClass::RateLimited,
            Some(FailureClass::Client | FailureClass::Server | FailureClass::RateLimited)
                if signal == BodySignal::Overloaded =>
            {
                FailureClass::Overloaded
            }
            // OpenAI's overload is a 503; its codes on another status are not read as one.
            Some(FailureClass::Server) if signal == BodySignal::ServerOverloaded => {
                FailureClass::Overloaded
            }
            Some(FailureClass::RateLimited) if signal == BodySignal::QuotaExhausted => {
                FailureClass::QuotaExhausted
            }
            Some(FailureClass::Client) if signal == BodySignal::ContextOverflow => {
                FailureClass::ContextOverflow
            }
            Some(class) => class,
            None => FailureClass::Other,
        };
        let verdict = match headers::parse_should_retry(&head.headers) {
            Some(true) => Classification::retry(class),
            Some(false) => Classification::fail(class),
            None => match class {
                FailureClass::Timeout
                | FailureClass::Conflict
                | FailureClass::RateLimited
                | FailureClass::Overloaded
                | FailureClass::Server => Classification::retry(class),
                _ => Classification::fail(class),
            },
        };
        let overflow = match class {
            FailureClass::ContextOverflow => parsed.and_then(|b| b.overflow),
            _ => None,
        };
        verdict
            .with_retry_after(retry_after)
            .with_overflow(overflow)
    }

    fn classify_error(&self, error: &(dyn std::error::Error + 'static)) -> Classification {
        if unsendable(error).is_some() {
            return Classification::fail(FailureClass::Unsendable);
        }
        if never_processed(error) {
            return Classification::retry(FailureClass::NotProcessed);
        }
        Classification::retry(FailureClass::Transport)
    }
}

/// An error a service may return (anywhere in its source chain) to say the request was never
/// sent, so even a request marked [`NotReplaySafe`](crate::retry::NotReplaySafe) may be retried.
#[derive(Debug, Default)]
pub struct RequestNotSent {
    _priv: (),
}

impl RequestNotSent {
    /// Creates the marker error.
    pub fn new() -> Self {
        RequestNotSent { _priv: () }
    }
}

impl fmt::Display for RequestNotSent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("request was not sent")
    }
}

impl std::error::Error for RequestNotSent {}

/// The cause of a request that cannot be sent as configured, found in an error's source
/// chain: the error [`ErrorKind::Unsendable`](crate::ErrorKind::Unsendable) carries as its
/// source, its [`cause`](Unsendable::cause) a sentence that says what to change. A service
/// may return one itself (anywhere in its source chain) to end a request at once.
#[derive(Debug)]
pub struct Unsendable {
    cause: &'static str,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl Unsendable {
    /// An error saying the request cannot be sent because of `cause`.
    pub fn new(cause: &'static str) -> Self {
        Unsendable {
            cause,
            source: None,
        }
    }

    /// The cause, and what to do about it.
    pub fn cause(&self) -> &'static str {
        self.cause
    }

    /// Wraps the inner service's error, naming its cause.
    pub(crate) fn wrap(error: Box<dyn std::error::Error + Send + Sync>) -> Self {
        let cause = unsendable(&*error).unwrap_or(GENERIC_UNSENDABLE);
        Unsendable {
            cause,
            source: Some(error),
        }
    }
}

impl fmt::Display for Unsendable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request cannot be sent as configured: {}", self.cause)
    }
}

impl std::error::Error for Unsendable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| &**e as &(dyn std::error::Error + 'static))
    }
}

/// The cause a custom classifier's [`FailureClass::Unsendable`] gets when the error names none
/// this crate knows.
const GENERIC_UNSENDABLE: &str = "the classifier judged the request unsendable";

/// The messages of errors that say a request cannot be sent as configured, with the cause
/// reported for each. The clients' error types that carry them are private (hyper-util's
/// `ConnectError`) or carry them as plain I/O errors (hyper-rustls), so their text is the
/// only thing to go by; each is compared whole (or, where the message ends with the URL's
/// scheme, by its fixed start).
const UNSENDABLE_MESSAGES: &[(&str, bool, &str)] = &[
    // hyper-util's `HttpConnector` (with `enforce_http`, as `build_http()` builds it).
    (
        "invalid URL, scheme is not http",
        false,
        "the client's connector speaks only http:// and the URL is not http:// \
         (hyper-util's `build_http()`); for https://, build the client on an HTTPS connector \
         such as hyper-rustls",
    ),
    (
        "invalid URL, scheme is missing",
        false,
        "the URL has no scheme; use an absolute URL such as https://api.anthropic.com/v1/messages",
    ),
    ("invalid URL, host is missing", false, "the URL has no host"),
    // hyper-rustls's `HttpsConnector` built `https_only()`.
    (
        "unsupported scheme ",
        true,
        "the client's HTTPS connector does not speak the URL's scheme (built `https_only`, \
         it takes https:// only)",
    ),
    // rustls-pki-types, through hyper-rustls's server-name resolver, before it connects: the
    // URL's host is neither an IP address nor a valid DNS name (`https://999.1.1.1`).
    (
        "invalid dns name",
        false,
        "the URL's host is neither an IP address nor a valid DNS name, so the TLS connector \
         cannot name the server; fix the host in the URL",
    ),
    // hyper-util's legacy client, before it connects.
    (
        "client error (UserAbsoluteUriRequired)",
        false,
        "the client needs an absolute URL (scheme and host) and the request's URI has none",
    ),
    (
        "client error (UserUnsupportedVersion)",
        false,
        "the request asks for an HTTP version the client's connection does not speak \
         (HTTP/2 on an HTTP/1 connection: enable HTTP/2 in the client or leave the version)",
    ),
    // reqwest, for a scheme other than http and https (or not https with `https_only`).
    (
        "URL scheme is not allowed",
        false,
        "the client does not allow the URL's scheme",
    ),
];

/// What [`Classify::classify_error`] of [`DefaultClassifier`] calls
/// [`FailureClass::Unsendable`]: the cause, when somewhere in `error`'s source chain is an
/// [`Unsendable`], an error of an invalid URI (`http::uri::InvalidUri`), or the error a client
/// raises before it connects because of the URL or its connector: hyper-util's `HttpConnector`
/// refusing a scheme other than http:// ("invalid URL, scheme is not http", the error of
/// `build_http()` pointed at `https://`), a URL without scheme or host, hyper-rustls's
/// `https_only` connector refusing http://, hyper-rustls refusing a host that is neither an IP
/// address nor a valid DNS name, hyper-util's client refusing a URI that is not
/// absolute or an HTTP version its connection does not speak, reqwest refusing a scheme or
/// failing to build the request. A timeout, refusal or reset is never one of these. Each
/// error's message is read up to 64 bytes, so a hostile or huge message costs nothing.
pub fn unsendable(error: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(u) = e.downcast_ref::<Unsendable>() {
            return Some(u.cause);
        }
        if e.is::<http::uri::InvalidUri>() || e.is::<http::uri::InvalidUriParts>() {
            return Some("the URL is not a valid URI");
        }
        #[cfg(feature = "reqwest")]
        if e.downcast_ref::<reqwest::Error>()
            .is_some_and(reqwest::Error::is_builder)
        {
            // A builder error's own source (a bad scheme) may say more.
            let deeper = e.source().and_then(unsendable);
            return Some(deeper.unwrap_or("reqwest could not build the request from its URL"));
        }
        let mut text = Capped::new();
        if fmt::write(&mut text, format_args!("{e}")).is_ok() {
            let text = text.as_str();
            for &(message, prefix, cause) in UNSENDABLE_MESSAGES {
                let hit = if prefix {
                    text.starts_with(message)
                } else {
                    text == message
                };
                if hit {
                    return Some(cause);
                }
            }
        }
        next = e.source();
    }
    None
}

/// A message buffer that refuses to grow past 64 bytes (the write then fails), so reading an
/// error's message is bounded.
struct Capped {
    buf: [u8; 64],
    len: usize,
}

impl Capped {
    const fn new() -> Self {
        Capped {
            buf: [0; 64],
            len: 0,
        }
    }

    fn as_str(&self) -> &str {
        // Only whole `&str`s are copied in, so the bytes are UTF-8.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

impl fmt::Write for Capped {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len.checked_add(s.len()).ok_or(fmt::Error)?;
        let dst = self.buf.get_mut(self.len..end).ok_or(fmt::Error)?;
        dst.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// Whether HTTP/2 proved that the server never processed the request (the rule gRPC uses for
/// its transparent retries): somewhere in the source chain, an `h2` error the server caused
/// that is a `RST_STREAM` with `REFUSED_STREAM` on the request's stream, or a `GOAWAY` whose
/// last stream id is below it (h2 fails exactly those streams with the `GOAWAY`; a stream at
/// or below it that the connection's end cuts fails with a broken pipe, which proves
/// nothing). `RST_STREAM` with `INTERNAL_ERROR` or `CANCEL` after the request was sent proves
/// nothing either. A request hyper canceled before it wrote a byte of it (queued on a
/// connection that closed) is proof too, on HTTP/1.1 as on HTTP/2.
///
/// The HTTP/2 proofs need the `http2` feature (on by default).
pub fn never_processed(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        // hyper cancels only requests it never started to write (queued on a connection
        // that closed, or that was not ready), on HTTP/1.1 and HTTP/2 alike.
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        #[cfg(feature = "http2")]
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_remote()
                && (h2.is_go_away()
                    || (h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM)));
        }
        next = e.source();
    }
    false
}

/// The default test of [`Classify::request_not_sent`]: somewhere in the source chain, a
/// [`RequestNotSent`], an I/O error `ConnectionRefused`, or (feature `hyper-util`, on by
/// default) a hyper-util legacy client error raised while connecting (before any byte of the
/// request was written). Adapters need no
/// special case: a reqwest connect error carries one of these in its source chain.
pub fn request_not_sent(error: &(dyn std::error::Error + 'static)) -> bool {
    if never_processed(error) {
        return true;
    }
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<RequestNotSent>() {
            return true;
        }
        #[cfg(feature = "hyper-util")]
        if let Some(client) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
            if client.is_connect() {
                return true;
            }
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(status: u16, headers: &[(&str, &str)]) -> http::response::Parts {
        let mut b = http::Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn classify(status: u16, headers: &[(&str, &str)], body: &str) -> Classification {
        DefaultClassifier::new().classify_response(&head(status, headers), Some(body.as_bytes()))
    }

    /// An error with a message and an optional source, as clients build them.
    #[derive(Debug)]
    struct Msg(String, Option<Box<dyn std::error::Error + Send + Sync>>);

    impl fmt::Display for Msg {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for Msg {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    fn msg(text: &str) -> Msg {
        Msg(text.to_owned(), None)
    }

    #[test]
    fn unsendable_causes() {
        let cases: &[(&str, Option<&str>)] = &[
            ("invalid URL, scheme is not http", Some("HTTPS connector")),
            ("invalid URL, scheme is missing", Some("no scheme")),
            ("invalid URL, host is missing", Some("no host")),
            ("unsupported scheme http", Some("https_only")),
            ("unsupported scheme ftp", Some("https_only")),
            (
                "client error (UserAbsoluteUriRequired)",
                Some("absolute URL"),
            ),
            (
                "client error (UserUnsupportedVersion)",
                Some("HTTP version"),
            ),
            ("URL scheme is not allowed", Some("scheme")),
            // Near misses, and what a timeout, refusal or reset says.
            ("invalid URL, scheme is not https", None),
            ("Invalid URL, scheme is not http", None),
            ("invalid URL, scheme is not http ", None),
            ("unsupported scheme", None),
            ("client error (Connect)", None),
            ("client error (SendRequest)", None),
            ("connection refused", None),
            ("operation timed out", None),
            ("connection reset by peer", None),
            ("", None),
        ];
        for &(text, want) in cases {
            let got = unsendable(&msg(text));
            match want {
                Some(part) => assert!(
                    got.is_some_and(|c| c.contains(part)),
                    "{text:?}: {got:?} should say {part:?}"
                ),
                None => assert_eq!(got, None, "{text:?}"),
            }
            // The class follows.
            let c = DefaultClassifier::new().classify_error(&msg(text));
            if want.is_some() {
                assert_eq!(c.class(), Some(FailureClass::Unsendable), "{text:?}");
                assert!(!c.is_retryable(), "{text:?}");
            } else {
                assert_eq!(c.class(), Some(FailureClass::Transport), "{text:?}");
                assert!(c.is_retryable(), "{text:?}");
            }
        }
    }

    #[test]
    fn unsendable_is_found_deep_in_the_chain() {
        let inner = Msg("invalid URL, scheme is not http".to_owned(), None);
        let outer = Msg("client error (Connect)".to_owned(), Some(Box::new(inner)));
        let top = Msg("request failed".to_owned(), Some(Box::new(outer)));
        assert!(unsendable(&top).is_some_and(|c| c.contains("build_http")));
        // An invalid URI, by type.
        let invalid = "http://exa mple.com".parse::<http::Uri>().unwrap_err();
        assert_eq!(unsendable(&invalid), Some("the URL is not a valid URI"));
        // A service's own marker.
        let own = Msg("x".to_owned(), Some(Box::new(Unsendable::new("my cause"))));
        assert_eq!(unsendable(&own), Some("my cause"));
    }

    #[test]
    fn unsendable_reads_a_bounded_message() {
        // Longer than the buffer: never matched, never panics, whatever it starts with.
        for len in [63, 64, 65, 1000, 1 << 20] {
            let mut text = "unsupported scheme ".to_owned();
            while text.len() < len {
                text.push('é');
            }
            let got = unsendable(&msg(&text));
            assert_eq!(got.is_some(), text.len() <= 64, "{len}");
        }
        // Multi-byte characters across the cap's edge.
        let text = "\u{1F600}".repeat(40);
        assert_eq!(unsendable(&msg(&text)), None);
    }

    #[test]
    fn unsendable_wraps_its_source() {
        let e: Box<dyn std::error::Error + Send + Sync> =
            Box::new(msg("invalid URL, host is missing"));
        let wrapped = Unsendable::wrap(e);
        assert_eq!(wrapped.cause(), "the URL has no host");
        assert_eq!(
            wrapped.to_string(),
            "request cannot be sent as configured: the URL has no host"
        );
        let source = std::error::Error::source(&wrapped).unwrap();
        assert_eq!(source.to_string(), "invalid URL, host is missing");
        // A cause the crate does not know still names itself.
        let e: Box<dyn std::error::Error + Send + Sync> = Box::new(msg("something else"));
        assert_eq!(Unsendable::wrap(e).cause(), GENERIC_UNSENDABLE);
    }

    #[test]
    fn status_table() {
        use FailureClass::*;
        let cases: &[(u16, Option<FailureClass>, bool)] = &[
            (200, None, false),
            (204, None, false),
            (408, Some(Timeout), true),
            (409, Some(Conflict), true),
            (429, Some(RateLimited), true),
            (500, Some(Server), true),
            (502, Some(Server), true),
            (503, Some(Server), true),
            (504, Some(Server), true),
            (529, Some(Overloaded), true),
            (401, Some(Unauthorized), false),
            (400, Some(Client), false),
            (403, Some(Client), false),
            (404, Some(Client), false),
            (413, Some(Client), false),
            (422, Some(Client), false),
            (304, Some(Other), false),
        ];
        for &(status, class, retry) in cases {
            let c = classify(status, &[], "");
            assert_eq!(c.class(), class, "status {status}");
            assert_eq!(c.is_retryable(), retry, "status {status}");
        }
    }

    #[test]
    fn should_retry_header_overrides() {
        let c = classify(503, &[("x-should-retry", "false")], "");
        assert!(!c.is_retryable());
        assert_eq!(c.class(), Some(FailureClass::Server));
        let c = classify(400, &[("x-should-retry", "true")], "");
        assert!(c.is_retryable());
        assert_eq!(c.class(), Some(FailureClass::Client));
        // Never on a success.
        assert!(classify(200, &[("x-should-retry", "true")], "").is_success());
    }

    #[test]
    fn bodies_refine_the_class() {
        let c = classify(
            429,
            &[],
            r#"{"error":{"type":"insufficient_quota","code":"insufficient_quota"}}"#,
        );
        assert_eq!(c.class(), Some(FailureClass::QuotaExhausted));
        assert!(!c.is_retryable());
        let c = classify(
            500,
            &[],
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        assert_eq!(c.class(), Some(FailureClass::Overloaded));
        assert!(c.is_retryable());
        // OpenAI's overload: a 5xx is an overload; the same body on a 4xx is not.
        let openai = r#"{"error":{"message":"The server is overloaded or not ready yet.","type":"server_error","param":null,"code":null}}"#;
        for status in [500, 502, 503] {
            let c = classify(status, &[], openai);
            assert_eq!(c.class(), Some(FailureClass::Overloaded), "{status}");
            assert!(c.is_retryable());
        }
        let c = classify(
            503,
            &[],
            r#"{"error":{"message":"busy","type":"server_error","code":"server_is_overloaded"}}"#,
        );
        assert_eq!(c.class(), Some(FailureClass::Overloaded));
        assert_eq!(
            classify(400, &[], openai).class(),
            Some(FailureClass::Client)
        );
        assert_eq!(
            classify(429, &[], openai).class(),
            Some(FailureClass::RateLimited)
        );
        let c = classify(503, &[("x-should-retry", "false")], openai);
        assert_eq!(
            (c.class(), c.is_retryable()),
            (Some(FailureClass::Overloaded), false)
        );
        // Any other 503 body is a plain server error.
        let c = classify(
            503,
            &[],
            r#"{"error":{"message":"Service Unavailable","type":"server_error","code":null}}"#,
        );
        assert_eq!(c.class(), Some(FailureClass::Server));
        let c = classify(
            400,
            &[],
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 1 + 2 > 3"}}"#,
        );
        assert_eq!(c.class(), Some(FailureClass::ContextOverflow));
        assert!(!c.is_retryable());
    }

    #[test]
    fn retry_after_is_carried() {
        let c = classify(429, &[("retry-after", "7")], "");
        assert_eq!(c.retry_after(), Some(Duration::from_secs(7)));
    }

    #[test]
    fn http_date_uses_injected_clock() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let c = DefaultClassifier::with_clock(move || now).classify_response(
            &head(429, &[("retry-after", "Thu, 01 Jan 2026 00:00:05 GMT")]),
            None,
        );
        assert_eq!(c.retry_after(), Some(Duration::from_secs(5)));
    }

    #[test]
    fn http_date_is_read_against_the_response_date() {
        // The server's clock says 00:00:00 and asks for 00:00:05: five seconds, whatever the
        // host's clock says (here it is months later, which would make the date "past").
        let c = classify(
            429,
            &[
                ("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
                ("retry-after", "Thu, 01 Jan 2026 00:00:05 GMT"),
            ],
            "",
        );
        assert_eq!(c.retry_after(), Some(Duration::from_secs(5)));
        // A date before the server's own now is no wait.
        let c = classify(
            429,
            &[
                ("date", "Thu, 01 Jan 2026 00:00:09 GMT"),
                ("retry-after", "Thu, 01 Jan 2026 00:00:05 GMT"),
            ],
            "",
        );
        assert_eq!(c.retry_after(), None);
        // An injected clock still wins over the `Date`.
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600 + 2);
        let c = DefaultClassifier::with_clock(move || now).classify_response(
            &head(
                429,
                &[
                    ("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
                    ("retry-after", "Thu, 01 Jan 2026 00:00:05 GMT"),
                ],
            ),
            None,
        );
        assert_eq!(c.retry_after(), Some(Duration::from_secs(3)));
    }

    #[test]
    fn garbage_date_falls_back_to_the_system_clock() {
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3600));
        let c = classify(
            429,
            &[
                ("date", "yesterday, roughly"),
                ("retry-after", later.as_str()),
            ],
            "",
        );
        let wait = c
            .retry_after()
            .expect("a date an hour ahead of the system clock");
        assert!(
            wait > Duration::from_secs(3590) && wait <= Duration::from_secs(3600),
            "{wait:?}"
        );
        // Seconds never read the `Date` at all.
        let c = classify(429, &[("date", "garbage"), ("retry-after", "7")], "");
        assert_eq!(c.retry_after(), Some(Duration::from_secs(7)));
    }

    #[test]
    fn not_sent_detection() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(request_not_sent(&refused));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(!request_not_sent(&reset));
        assert!(request_not_sent(&RequestNotSent::new()));
    }
}
