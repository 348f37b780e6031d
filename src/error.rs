//! The crate's error type and the record of failed attempts.

use std::fmt;
use std::time::Duration;

use http::StatusCode;

use crate::classify::FailureClass;

/// A type-erased error, as used by tower and hyper.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The error returned by the services of this crate.
///
/// It is opaque: ask [`Error::kind`] what happened, walk
/// [`std::error::Error::source`] for the underlying cause, and read [`Error::trail`] for
/// every attempt that was made. Its `Display` and `Debug` output never contain request
/// headers or bodies, so it is safe to log.
pub struct Error {
    inner: Box<Inner>,
}

struct Inner {
    kind: ErrorKind,
    source: Option<BoxError>,
    trail: Option<RetryTrail>,
}

/// What kind of failure an [`Error`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The inner service failed on every allowed attempt. The source is the last failure and
    /// [`Error::trail`] lists them all.
    Exhausted,
    /// The inner service failed and the failure was not retried: the classifier judged it not
    /// retryable, or the request was marked not replay-safe and may have reached the server.
    Service,
    /// The request body grew past the buffering cap while it was read. Nothing was sent.
    BodyTooLarge,
    /// Reading the request body failed. Nothing was sent.
    BodyRead,
    /// The cancellation token fired while a retry was pending. No further attempt was made.
    Cancelled,
    /// The fleet's retry budget refused a retry of a failed attempt.
    BudgetExhausted,
    /// A credential could not be obtained or refreshed.
    #[cfg(feature = "auth")]
    #[cfg_attr(docsrs, doc(cfg(feature = "auth")))]
    TokenRefresh,
    /// A response body went quiet for longer than the idle timeout, or (when no retry was
    /// left) an event stream showed no output within the first-output timeout; the source, a
    /// [`TimedOut`](crate::retry::TimedOut), says which.
    IdleTimeout,
    /// Reading the response body failed after it was handed to the caller (for a stream:
    /// after the commit point, when nothing is re-sent).
    ResponseBody,
    /// The model was overloaded often enough that the caller should switch to another one.
    /// The source is a [`FallbackTriggered`](crate::fallback::FallbackTriggered) naming both.
    #[cfg(feature = "fallback")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fallback")))]
    FallbackTriggered,
    /// The request's deadline ([`RetryPolicy::deadline`](crate::RetryPolicy::deadline))
    /// passed, or would pass, while it waited to start an attempt (at the cooldown gate, in
    /// the pacing line, or for the inner service to be ready), or while the loop was still
    /// reading the start of an answer's body to judge it (an error body, an event stream
    /// before its first output). No attempt was started after it. The source's message names
    /// the deadline; the trail lists the attempts made, the one whose answer was being read
    /// included, and [gives up](RetryTrail::gave_up) with
    /// [`GiveUpReason::Deadline`].
    DeadlineExceeded,
    /// An event stream of a known protocol (Anthropic Messages, OpenAI Chat Completions or
    /// Responses) ended cleanly after the commit point without its terminal event: a hop cut
    /// it. The caller has read every byte the server sent; the source is an
    /// [`IncompleteStream`](crate::stream::IncompleteStream) saying how many and the last
    /// event. (Before the commit point the same cut is retried like a reset.)
    IncompleteStream,
    /// The attempt's turn in the fleet's [pacing](crate::fleet::PacingConfig) line would come
    /// later than the request may wait: its policy's
    /// [`retry_after_max`](crate::RetryPolicy::retry_after_max). (When the request's
    /// [`deadline`](crate::RetryPolicy::deadline) is the nearer bound, the error is
    /// [`DeadlineExceeded`](ErrorKind::DeadlineExceeded).) Nothing more was sent;
    /// [`Error::trail`] lists the attempts that failed before, if any.
    PacingWaitTooLong,
    /// The request cannot be sent as configured, so it was tried once and never retried:
    /// the client's connector does not speak the URL's scheme (hyper-util's `build_http()`
    /// pointed at `https://`), the URL has no scheme or host or is not a valid URI, or the
    /// client refused it before connecting. Nothing reached the server. The source is an
    /// [`Unsendable`](crate::classify::Unsendable) whose [`cause`](crate::classify::Unsendable::cause)
    /// says what to change, over the client's own error; [`Error::trail`] holds the one
    /// attempt (class [`Unsendable`](crate::classify::FailureClass::Unsendable)).
    Unsendable,
    /// The fleet keeps its state in Redis, is set to [fail
    /// closed](crate::fleet::RedisFleet::fail_closed), and is out of touch with Redis: the
    /// attempt was not admitted, and nothing more was sent. [`Error::trail`] lists the
    /// attempts made before, if any.
    #[cfg(feature = "fleet-redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fleet-redis")))]
    FleetUnreachable,
}

impl ErrorKind {
    /// A short, stable, lower-case name, used as the `error.type` of tracing spans.
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorKind::Exhausted => "exhausted",
            ErrorKind::Service => "service",
            ErrorKind::BodyTooLarge => "body_too_large",
            ErrorKind::BodyRead => "body_read",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::BudgetExhausted => "budget_exhausted",
            #[cfg(feature = "auth")]
            ErrorKind::TokenRefresh => "token_refresh",
            ErrorKind::IdleTimeout => "idle_timeout",
            ErrorKind::ResponseBody => "response_body",
            #[cfg(feature = "fallback")]
            ErrorKind::FallbackTriggered => "fallback_triggered",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
            ErrorKind::IncompleteStream => "incomplete_stream",
            ErrorKind::PacingWaitTooLong => "pacing_wait_too_long",
            ErrorKind::Unsendable => "unsendable",
            #[cfg(feature = "fleet-redis")]
            ErrorKind::FleetUnreachable => "fleet_unreachable",
        }
    }

    fn description(&self) -> &'static str {
        match self {
            ErrorKind::Exhausted => "every allowed attempt failed",
            ErrorKind::Service => "the inner service failed and the failure was not retried",
            ErrorKind::BodyTooLarge => "request body exceeds the buffering limit",
            ErrorKind::BodyRead => "failed to read the request body",
            ErrorKind::Cancelled => "request cancelled before it could be retried",
            ErrorKind::BudgetExhausted => "retry budget exhausted",
            #[cfg(feature = "auth")]
            ErrorKind::TokenRefresh => "failed to obtain a credential",
            ErrorKind::IdleTimeout => "response body idle timeout",
            ErrorKind::ResponseBody => "failed to read the response body",
            #[cfg(feature = "fallback")]
            ErrorKind::FallbackTriggered => "the model is overloaded; switch to a fallback model",
            ErrorKind::DeadlineExceeded => "the request's deadline passed",
            ErrorKind::IncompleteStream => "the event stream ended without its terminal event",
            ErrorKind::PacingWaitTooLong => {
                "the turn in the pacing line is further off than the request may wait"
            }
            ErrorKind::Unsendable => "the request cannot be sent as configured",
            #[cfg(feature = "fleet-redis")]
            ErrorKind::FleetUnreachable => {
                "the fleet's shared state is unreachable and the fleet fails closed"
            }
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Error {
    pub(crate) fn new(kind: ErrorKind) -> Self {
        Error {
            inner: Box::new(Inner {
                kind,
                source: None,
                trail: None,
            }),
        }
    }

    pub(crate) fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.inner.source = Some(source.into());
        self
    }

    pub(crate) fn with_trail(mut self, trail: RetryTrail) -> Self {
        self.inner.trail = Some(trail);
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// Every failed attempt that led to this error, when any attempt was made.
    pub fn trail(&self) -> Option<&RetryTrail> {
        self.inner.trail.as_ref()
    }

    /// Takes the underlying cause out of this error, for callers that want to inspect
    /// or downcast it by value.
    pub fn into_source(self) -> Option<BoxError> {
        self.inner.source
    }

    /// Errors that an inner layer raises as its final word on the request: the retry loop
    /// neither retries them nor wraps them, so the caller sees their own kind.
    pub(crate) fn is_final(&self) -> bool {
        match self.kind() {
            #[cfg(feature = "auth")]
            ErrorKind::TokenRefresh => true,
            #[cfg(feature = "fallback")]
            ErrorKind::FallbackTriggered => true,
            _ => false,
        }
    }
}

/// The source of an [`ErrorKind::FallbackTriggered`] error: which model was overloaded and
/// which one to use instead.
///
/// Returned by [`ModelFallbackLayer`](crate::ModelFallbackLayer) in
/// [signal mode](crate::fallback::FallbackMode::Signal), for callers that pick models
/// themselves.
#[cfg(feature = "fallback")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FallbackTriggered {
    /// The model that was overloaded.
    pub from: String,
    /// The next model of the fallback chain.
    pub to: String,
}

#[cfg(feature = "fallback")]
impl FallbackTriggered {
    pub(crate) fn new(from: impl Into<String>, to: impl Into<String>) -> Self {
        FallbackTriggered {
            from: from.into(),
            to: to.into(),
        }
    }
}

#[cfg(feature = "fallback")]
impl fmt::Display for FallbackTriggered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "model `{}` is overloaded; fall back to `{}`",
            self.from, self.to
        )
    }
}

#[cfg(feature = "fallback")]
impl std::error::Error for FallbackTriggered {}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("tower_llm_retry::Error");
        d.field("kind", &self.inner.kind);
        if let Some(source) = &self.inner.source {
            d.field("source", source);
        }
        if let Some(trail) = &self.inner.trail {
            d.field("attempts", &trail.attempts().len());
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.inner.kind.description())?;
        if let Some(trail) = &self.inner.trail {
            let n = trail.attempts().len();
            if n > 0 {
                write!(f, " ({n} failed attempt{})", if n == 1 { "" } else { "s" })?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_ref()
            .map(|e| &**e as &(dyn std::error::Error + 'static))
    }
}

/// Formats an error and its chain of sources as `outer: inner: innermost`.
pub(crate) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut next = err.source();
    while let Some(e) = next {
        let s = e.to_string();
        // Many error types repeat their source in their own message; skip exact repeats.
        if !out.ends_with(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        next = e.source();
    }
    out
}

/// Why the retry loop stopped on a failed attempt instead of trying again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GiveUpReason {
    /// The classifier judged the last failure not retryable.
    NotRetryable,
    /// The policy's maximum number of retries was reached.
    MaxRetries,
    /// The server asked for a wait longer than the policy's Retry-After ceiling.
    RetryAfterTooLong,
    /// The request was marked not replay-safe and may have reached the server.
    NotReplaySafe,
    /// The policy's limit of consecutive overloads was reached.
    MaxConsecutiveOverloads,
    /// The fleet's retry budget refused the retry.
    Budget,
    /// The cancellation token fired.
    Cancelled,
    /// The next retry could not start before the request's deadline.
    Deadline,
    /// The attempt's turn in the fleet's pacing line would come later than the request may
    /// wait ([`ErrorKind::PacingWaitTooLong`]).
    PacingWaitTooLong,
}

/// A per-attempt timeout fired: no response head in time, or a body went quiet. (The
/// request's deadline is not one of them: it ends the request with
/// [`ErrorKind::DeadlineExceeded`].)
///
/// Found as the source (or in the source chain) of the failure it caused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut {
    what: TimeoutKind,
    after: Duration,
}

/// Which timeout a [`TimedOut`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TimeoutKind {
    /// No response head arrived in time.
    Head,
    /// No body frame arrived in time.
    Idle,
    /// An event stream showed no output in time after its head
    /// ([`RetryPolicy::first_output_timeout`](crate::RetryPolicy::first_output_timeout)).
    FirstOutput,
}

impl TimedOut {
    pub(crate) fn new(what: TimeoutKind, after: Duration) -> Self {
        TimedOut { what, after }
    }

    /// Which timeout fired.
    pub fn kind(&self) -> TimeoutKind {
        self.what
    }

    /// The timeout that was exceeded.
    pub fn after(&self) -> Duration {
        self.after
    }
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.what {
            TimeoutKind::Head => write!(f, "no response head within {:?}", self.after),
            TimeoutKind::Idle => write!(f, "response body idle for {:?}", self.after),
            TimeoutKind::FirstOutput => {
                write!(f, "no output in the event stream within {:?}", self.after)
            }
        }
    }
}

impl std::error::Error for TimedOut {}

/// The source of an [`ErrorKind::DeadlineExceeded`] error, and the cause recorded for an
/// attempt whose answer the deadline cut off. Not public: the kind says what happened, this
/// only puts the deadline in the message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeadlineReached(pub(crate) Duration);

impl fmt::Display for DeadlineReached {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request deadline of {:?} reached", self.0)
    }
}

impl std::error::Error for DeadlineReached {}

/// One failed attempt, as recorded in a [`RetryTrail`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct AttemptRecord {
    /// Which attempt this was: 1 for the first, 2 for the first retry, and so on.
    pub attempt: u32,
    /// How the failure was classified.
    pub class: FailureClass,
    /// The response status, when the attempt got a response.
    pub status: Option<StatusCode>,
    /// The wait the server asked for, when it sent a valid `Retry-After`.
    pub retry_after: Option<Duration>,
    /// The sleep taken after this attempt, when it was retried.
    pub delay: Option<Duration>,
    /// The error and its sources (`outer: inner`), when the attempt failed without a response.
    pub error: Option<String>,
    /// Time from the start of the logical request to the end of this attempt.
    pub elapsed: Duration,
}

/// Every failed attempt of one logical request, oldest first.
///
/// Attached as a response extension to every response for which at least one attempt failed,
/// and carried by [`Error::trail`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RetryTrail {
    attempts: Vec<AttemptRecord>,
    gave_up: Option<GiveUpReason>,
    total_attempts: u32,
    token_wait: Option<Duration>,
}

impl RetryTrail {
    pub(crate) fn push(&mut self, record: AttemptRecord) {
        self.attempts.push(record);
    }

    pub(crate) fn last_mut(&mut self) -> Option<&mut AttemptRecord> {
        self.attempts.last_mut()
    }

    pub(crate) fn set_gave_up(&mut self, reason: GiveUpReason) {
        self.gave_up = Some(reason);
    }

    pub(crate) fn set_total_attempts(&mut self, n: u32) {
        self.total_attempts = n;
    }

    pub(crate) fn add_token_wait(&mut self, waited: Duration) {
        self.token_wait = Some(self.token_wait.unwrap_or_default() + waited);
    }

    /// How long the request waited in line for tokens, over all its attempts, when it
    /// waited (the fleet's [token pacing](crate::fleet#pacing-by-tokens) was awake and the
    /// tokens were not in hand); `None` when it never waited for them.
    pub fn token_wait(&self) -> Option<Duration> {
        self.token_wait
    }

    /// The failed attempts, oldest first.
    pub fn attempts(&self) -> &[AttemptRecord] {
        &self.attempts
    }

    /// Why the loop stopped on a failure, or `None` when the last attempt succeeded.
    pub fn gave_up(&self) -> Option<GiveUpReason> {
        self.gave_up
    }

    /// How many physical attempts were made in all, successful or not.
    pub fn total_attempts(&self) -> u32 {
        self.total_attempts
    }

    /// How many retries were made (attempts after the first).
    pub fn retries(&self) -> u32 {
        self.total_attempts.saturating_sub(1)
    }

    /// The sum of the sleeps taken between attempts.
    pub fn total_delay(&self) -> Duration {
        self.attempts.iter().filter_map(|a| a.delay).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_send_sync_static() {
        fn assert_bounds<T: Send + Sync + 'static + std::error::Error>() {}
        assert_bounds::<Error>();
    }

    #[test]
    fn display_and_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let err = Error::new(ErrorKind::Exhausted).with_source(io);
        assert_eq!(err.to_string(), "every allowed attempt failed");
        assert_eq!(err.kind(), ErrorKind::Exhausted);
        let src = std::error::Error::source(&err).unwrap();
        assert_eq!(src.to_string(), "reset by peer");
    }

    #[cfg(feature = "fallback")]
    #[test]
    fn fallback_triggered_names_both_models() {
        let err = Error::new(ErrorKind::FallbackTriggered).with_source(FallbackTriggered::new(
            "claude-opus-4-1",
            "claude-sonnet-4-5",
        ));
        assert_eq!(err.kind(), ErrorKind::FallbackTriggered);
        assert!(err.is_final());
        let f = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<FallbackTriggered>())
            .unwrap();
        assert_eq!(
            (f.from.as_str(), f.to.as_str()),
            ("claude-opus-4-1", "claude-sonnet-4-5")
        );
        assert_eq!(ErrorKind::FallbackTriggered.as_str(), "fallback_triggered");
    }

    #[test]
    fn chain_skips_repeats() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("connect failed")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::other("refused"));
        assert_eq!(error_chain(&e), "connect failed: refused");
    }
}

/// A configuration value was out of range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    message: String,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}
