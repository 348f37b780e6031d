//! How many times to retry and how long to wait.

use std::time::Duration;

use crate::error::ConfigError;
use crate::random::Random;

/// The default time to a response head, and between body frames: 600 s, as the official SDKs.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The environment variable [`RetryPolicy::with_env`] reads.
pub const ENV_MAX_RETRIES: &str = "LLM_MAX_RETRIES";

/// How many retries, how long to wait before each, and what to do with a server's
/// `Retry-After`.
///
/// Backoff before retry `n` (1-based) is `min(initial · multiplier^(n−1), max)`, then jittered.
/// When the failed response carried a `Retry-After`, the wait is that value instead, clamped to
/// `[retry_after_min, retry_after_max]`; a value above `retry_after_max` is handled as
/// [`AboveCeiling`] says.
///
/// | preset | retries | backoff | jitter | Retry-After |
/// |---|---|---|---|---|
/// | [`default`](RetryPolicy::default) | 10 | 0.5 s → 32 s | +0–25 % | honoured up to 60 s; above, give up and return the response |
/// | [`sdk_compatible`](RetryPolicy::sdk_compatible) | 2 | 0.5 s → 8 s | ×0.75–1 | honoured when 0 < x ≤ 60 s; otherwise the backoff is used |
/// | [`patient`](RetryPolicy::patient) | 12 (13 attempts) | 5 s → 60 s | ±25 % | clamped to [5 s, 60 s] |
/// | [`interactive`](RetryPolicy::interactive) | 3 | 0.5 s → 8 s | +0–25 % | honoured up to 20 s; above, give up |
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    max_retries: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    multiplier: f64,
    jitter: Jitter,
    retry_after_min: Duration,
    retry_after_max: Duration,
    above_ceiling: AboveCeiling,
    ignore_zero_retry_after: bool,
    backoff_is_floor: bool,
    max_consecutive_overloads: Option<u32>,
    head_timeout: Option<Duration>,
    idle_timeout: Option<Duration>,
    first_output_timeout: Option<Duration>,
    deadline: Option<Duration>,
    random: Random,
}

/// What to do when a server asks for a wait above the policy's `retry_after_max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AboveCeiling {
    /// Stop retrying and return the response: a server cannot park a client for hours.
    GiveUp,
    /// Ignore the value and wait the computed backoff instead (the official SDKs do this).
    UseBackoff,
    /// Wait `retry_after_max`.
    Clamp,
}

/// How the computed backoff is randomised. Jitter only ever changes the sleep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Jitter {
    mode: JitterMode,
    fraction: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JitterMode {
    None,
    Add,
    Subtract,
    Symmetric,
}

impl Jitter {
    /// No jitter: every sleep is exactly the computed backoff.
    pub const fn none() -> Self {
        Jitter {
            mode: JitterMode::None,
            fraction: 0.0,
        }
    }

    /// `backoff × (1 + U[0, fraction])`. The default uses 0.25.
    pub fn add(fraction: f64) -> Result<Self, ConfigError> {
        Self::checked(JitterMode::Add, fraction)
    }

    /// `backoff × (1 − U[0, fraction])`. The official SDKs use 0.25.
    pub fn subtract(fraction: f64) -> Result<Self, ConfigError> {
        Self::checked(JitterMode::Subtract, fraction)
    }

    /// `backoff × (1 + U[−fraction, fraction])`.
    pub fn symmetric(fraction: f64) -> Result<Self, ConfigError> {
        Self::checked(JitterMode::Symmetric, fraction)
    }

    fn checked(mode: JitterMode, fraction: f64) -> Result<Self, ConfigError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(ConfigError::new(format!(
                "jitter fraction must be within [0, 1], got {fraction}"
            )));
        }
        Ok(Jitter { mode, fraction })
    }

    const fn known(mode: JitterMode, fraction: f64) -> Self {
        Jitter { mode, fraction }
    }

    /// The factor the backoff is multiplied by, for a uniform sample `u` in `[0, 1)`.
    fn factor(&self, u: f64) -> f64 {
        match self.mode {
            JitterMode::None => 1.0,
            JitterMode::Add => 1.0 + u * self.fraction,
            JitterMode::Subtract => 1.0 - u * self.fraction,
            JitterMode::Symmetric => 1.0 + (2.0 * u - 1.0) * self.fraction,
        }
    }
}

/// Why [`RetryPolicy::delay`] refused to schedule a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DelayRefused {
    RetryAfterTooLong,
}

impl Default for RetryPolicy {
    /// 10 retries; backoff 0.5 s doubling to 32 s, plus 0–25 % jitter; a `Retry-After` is
    /// honoured as sent up to 60 s, and above that the response is returned without retrying.
    fn default() -> Self {
        RetryPolicy {
            max_retries: 10,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(32),
            multiplier: 2.0,
            jitter: Jitter::known(JitterMode::Add, 0.25),
            retry_after_min: Duration::ZERO,
            retry_after_max: Duration::from_secs(60),
            above_ceiling: AboveCeiling::GiveUp,
            ignore_zero_retry_after: false,
            backoff_is_floor: false,
            max_consecutive_overloads: None,
            head_timeout: Some(DEFAULT_TIMEOUT),
            idle_timeout: Some(DEFAULT_TIMEOUT),
            first_output_timeout: None,
            deadline: None,
            random: Random::default(),
        }
    }
}

impl RetryPolicy {
    /// Reproduces the official Anthropic and OpenAI Python/TypeScript SDKs: 2 retries, backoff
    /// `min(0.5 s · 2^(n−1), 8 s) × U[0.75, 1]`; a `Retry-After` is honoured when
    /// `0 < x ≤ 60 s`, and otherwise ignored in favour of that backoff (the request is still
    /// retried).
    pub fn sdk_compatible() -> Self {
        RetryPolicy {
            max_retries: 2,
            max_backoff: Duration::from_secs(8),
            jitter: Jitter::known(JitterMode::Subtract, 0.25),
            above_ceiling: AboveCeiling::UseBackoff,
            ignore_zero_retry_after: true,
            ..Self::default()
        }
    }

    /// For unattended jobs that would rather wait than fail: 13 attempts (12 retries), backoff
    /// 5 s doubling to 60 s with ±25 % jitter, and any `Retry-After` clamped to [5 s, 60 s]
    /// (a longer one is waited for 60 s, then the request is tried again).
    pub fn patient() -> Self {
        RetryPolicy {
            max_retries: 12,
            initial_backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(60),
            jitter: Jitter::known(JitterMode::Symmetric, 0.25),
            retry_after_min: Duration::from_secs(5),
            retry_after_max: Duration::from_secs(60),
            above_ceiling: AboveCeiling::Clamp,
            ..Self::default()
        }
    }

    /// For a person waiting at a prompt: 3 retries, backoff 0.5 s doubling to 8 s plus 0–25 %
    /// jitter; a `Retry-After` above 20 s returns the response at once so the caller can say
    /// so rather than hang.
    pub fn interactive() -> Self {
        RetryPolicy {
            max_retries: 3,
            max_backoff: Duration::from_secs(8),
            retry_after_max: Duration::from_secs(20),
            ..Self::default()
        }
    }

    /// No retries at all: every request is sent once.
    pub fn never() -> Self {
        RetryPolicy {
            max_retries: 0,
            ..Self::default()
        }
    }

    /// This policy, with `max_retries` read from `LLM_MAX_RETRIES` when it is set:
    /// `RetryPolicy::default().with_env()?`.
    ///
    /// A value that is not a whole number up to 1,000 is an error, not silently ignored.
    pub fn with_env(self) -> Result<Self, ConfigError> {
        match std::env::var(ENV_MAX_RETRIES) {
            Ok(v) => self.with_max_retries_str(&v),
            Err(std::env::VarError::NotPresent) => Ok(self),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError::new(format!(
                "{ENV_MAX_RETRIES} is not valid unicode"
            ))),
        }
    }

    fn with_max_retries_str(self, v: &str) -> Result<Self, ConfigError> {
        match v.trim().parse::<u32>() {
            Ok(n) if n <= 1000 => Ok(self.max_retries(n)),
            _ => Err(ConfigError::new(format!(
                "{ENV_MAX_RETRIES} must be a whole number from 0 to 1000, got {v:?}"
            ))),
        }
    }

    /// The most retries after the first attempt. Defaults to 10.
    pub fn max_retries(mut self, n: u32) -> Self {
        self.max_retries = n;
        self
    }

    /// The backoff before the first retry. Defaults to 500 ms. Larger than
    /// [`max_backoff`](Self::max_backoff), every backoff is `max_backoff`: the bound wins.
    pub fn initial_backoff(mut self, d: Duration) -> Self {
        self.initial_backoff = d;
        self
    }

    /// The largest computed backoff, before jitter. Defaults to 32 s.
    pub fn max_backoff(mut self, d: Duration) -> Self {
        self.max_backoff = d;
        self
    }

    /// The growth factor of the backoff; must be finite and at least 1. Defaults to 2.
    pub fn multiplier(mut self, m: f64) -> Result<Self, ConfigError> {
        if !m.is_finite() || m < 1.0 {
            return Err(ConfigError::new(format!(
                "backoff multiplier must be finite and >= 1, got {m}"
            )));
        }
        self.multiplier = m;
        Ok(self)
    }

    /// How the backoff is randomised. Defaults to [`Jitter::add(0.25)`](Jitter::add).
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// Where jitter samples come from. Defaults to the thread-local generator.
    pub fn random(mut self, random: Random) -> Self {
        self.random = random;
        self
    }

    /// The shortest wait a `Retry-After` can cause. Defaults to zero. Above
    /// [`retry_after_max`](Self::retry_after_max), the ceiling wins.
    pub fn retry_after_min(mut self, d: Duration) -> Self {
        self.retry_after_min = d;
        self
    }

    /// The ceiling for a `Retry-After`. Defaults to 60 s.
    pub fn retry_after_max(mut self, d: Duration) -> Self {
        self.retry_after_max = d;
        self
    }

    /// What to do with a `Retry-After` above the ceiling. Defaults to
    /// [`AboveCeiling::GiveUp`].
    pub fn above_ceiling(mut self, action: AboveCeiling) -> Self {
        self.above_ceiling = action;
        self
    }

    /// Whether `Retry-After: 0` is ignored in favour of the computed backoff, as the official
    /// SDKs do. Defaults to false (a zero wait is honoured).
    pub fn ignore_zero_retry_after(mut self, yes: bool) -> Self {
        self.ignore_zero_retry_after = yes;
        self
    }

    /// Whether the computed backoff is a floor under a `Retry-After`
    /// (`max(retry_after, backoff)`). Defaults to false: the server's value is used as sent.
    pub fn backoff_is_floor(mut self, yes: bool) -> Self {
        self.backoff_is_floor = yes;
        self
    }

    /// Stop after this many consecutive overloaded attempts (class
    /// [`Overloaded`](crate::classify::FailureClass::Overloaded): a 529, `overloaded_error`,
    /// OpenAI's 503 overloaded, an in-band overload before output), so a fallback can take
    /// over sooner; `Some(0)` retries no overload. Only an overload stops
    /// the request: any other failure is retried as usual, and starts the count over.
    /// Defaults to `None` (no such limit).
    pub fn max_consecutive_overloads(mut self, n: Option<u32>) -> Self {
        self.max_consecutive_overloads = n;
        self
    }

    /// How long one attempt may wait for its response head; a stall past it is a retryable
    /// transport failure. `None` waits forever. Defaults to 600 s.
    pub fn head_timeout(mut self, d: Option<Duration>) -> Self {
        self.head_timeout = d;
        self
    }

    /// How long a response body may go without a frame. Before a stream's commit point this
    /// is retried; after it the body fails with
    /// [`ErrorKind::IdleTimeout`](crate::ErrorKind::IdleTimeout). `None` waits forever.
    /// Defaults to 600 s.
    pub fn idle_timeout(mut self, d: Option<Duration>) -> Self {
        self.idle_timeout = d;
        self
    }

    /// How long an event stream may take, from its response head, to its first output (the
    /// commit point: the first event that shows output, see [`stream`](crate::stream)). An
    /// attempt with no output by then is a timeout before the commit point: it fails with
    /// class [`Timeout`](crate::classify::FailureClass::Timeout) (its error a
    /// [`TimedOut`](crate::retry::TimedOut) of kind
    /// [`FirstOutput`](crate::retry::TimeoutKind::FirstOutput)), is retried like any
    /// retryable failure, and counts toward a fallback layer's timeout trigger
    /// ([`after_timeouts`]) as a head timeout does. When no retry is left, the caller gets
    /// the response, whose body yields the events that came, then fails with
    /// [`ErrorKind::IdleTimeout`](crate::ErrorKind::IdleTimeout). Keep-alive and set-up
    /// events (`ping`, `message_start`, a role-only chunk) do not stop the clock; the idle
    /// timeout still applies between them. Never after output: a stream that has shown
    /// output is bounded by the idle timeout alone. When the [deadline](Self::deadline) is
    /// nearer, it ends the read first, with
    /// [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded). Only with the SSE
    /// gate on ([`RetryLayer::sse_gate`](crate::RetryLayer::sse_gate), the default); bodies
    /// that are not event streams are not timed. `None`: no such limit. Defaults to `None`.
    ///
    #[cfg_attr(
        feature = "fallback",
        doc = "[`after_timeouts`]: crate::ModelFallbackLayer::after_timeouts"
    )]
    #[cfg_attr(not(feature = "fallback"), doc = "[`after_timeouts`]: crate#features")]
    pub fn first_output_timeout(mut self, d: Option<Duration>) -> Self {
        self.first_output_timeout = d;
        self
    }

    /// A total time budget for one logical request, from the call: no attempt starts after
    /// it, a retry whose sleep would reach it is not made, the head timeout of the last
    /// attempt is cut to what remains, and the loop's read of the start of an answer (an
    /// error body, an event stream before its first output) ends at it with
    /// [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded). A body handed to
    /// the caller is the caller's: the deadline no longer applies to it. Defaults to none.
    pub fn deadline(mut self, d: Option<Duration>) -> Self {
        self.deadline = d;
        self
    }

    /// The head timeout, if any.
    pub(crate) fn get_head_timeout(&self) -> Option<Duration> {
        self.head_timeout
    }

    /// The idle timeout, if any.
    pub(crate) fn get_idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout
    }

    /// The first-output timeout, if any.
    pub(crate) fn get_first_output_timeout(&self) -> Option<Duration> {
        self.first_output_timeout
    }

    /// The total deadline, if any.
    pub(crate) fn get_deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// The most retries after the first attempt, as [`max_retries`](Self::max_retries) set
    /// it (a configuration that falls back along a chain checks its budget with it).
    pub fn get_max_retries(&self) -> u32 {
        self.max_retries
    }

    /// The ceiling for a `Retry-After`.
    pub(crate) fn get_retry_after_max(&self) -> Duration {
        self.retry_after_max
    }

    /// What the fleet is told of this policy.
    pub(crate) fn fleet_limits(&self) -> crate::fleet::Limits<'_> {
        crate::fleet::Limits {
            retry_after_max: self.retry_after_max,
            ignores_above_ceiling: self.above_ceiling == AboveCeiling::UseBackoff,
            random: &self.random,
            backoff: self.base_backoff(1),
        }
    }

    /// The same, for the answer to attempt `retry` (1-based: the first retry's backoff is
    /// the first attempt's).
    pub(crate) fn fleet_limits_for(&self, retry: u32) -> crate::fleet::Limits<'_> {
        crate::fleet::Limits {
            backoff: self.base_backoff(retry),
            ..self.fleet_limits()
        }
    }

    /// The limit of consecutive overloads, if any.
    pub(crate) fn get_max_consecutive_overloads(&self) -> Option<u32> {
        self.max_consecutive_overloads
    }

    /// The un-jittered backoff before retry `n` (1-based).
    fn base_backoff(&self, n: u32) -> Duration {
        let exp = n.saturating_sub(1).min(1023) as i32;
        let secs = self.initial_backoff.as_secs_f64() * self.multiplier.powi(exp);
        let max = self.max_backoff.as_secs_f64();
        if !secs.is_finite() || secs >= max {
            return self.max_backoff;
        }
        Duration::try_from_secs_f64(secs).unwrap_or(self.max_backoff)
    }

    /// The jittered backoff before retry `n` (1-based).
    pub(crate) fn backoff(&self, n: u32) -> Duration {
        let base = self.base_backoff(n);
        if self.jitter.mode == JitterMode::None {
            return base;
        }
        let factor = self.jitter.factor(self.random.sample());
        crate::time::mul_f64(base, factor)
    }

    /// The sleep before retry `n` (1-based), given the `Retry-After` of the response that
    /// failed just before it.
    pub(crate) fn delay(
        &self,
        n: u32,
        retry_after: Option<Duration>,
    ) -> Result<Duration, DelayRefused> {
        let retry_after = retry_after.filter(|d| !(self.ignore_zero_retry_after && d.is_zero()));
        let Some(ra) = retry_after else {
            return Ok(self.backoff(n));
        };
        let ra = if ra > self.retry_after_max {
            match self.above_ceiling {
                AboveCeiling::GiveUp => return Err(DelayRefused::RetryAfterTooLong),
                AboveCeiling::UseBackoff => return Ok(self.backoff(n)),
                AboveCeiling::Clamp => self.retry_after_max,
            }
        } else {
            // A floor set above the ceiling: the ceiling wins.
            ra.max(self.retry_after_min).min(self.retry_after_max)
        };
        if self.backoff_is_floor {
            Ok(ra.max(self.backoff(n)))
        } else {
            Ok(ra)
        }
    }
}

/// Request extension: changes the settings it names of the policy that applies to one
/// request, and nothing else.
///
/// The policy that applies is the layer's, or a whole [`RetryPolicy`] the request carries as
/// an extension (a preset chosen per request). Each setting an `Override` names replaces that
/// setting of it; every other one (backoff, jitter, the `Retry-After` handling, the limit of
/// consecutive overloads) stays as it is. [`NoRetry`](super::NoRetry) on the same request
/// wins over [`max_retries`](Override::max_retries).
///
/// ```
/// use std::time::Duration;
/// use http::Request;
/// use tower_llm_retry::retry::Override;
///
/// let mut request = Request::post("https://api.anthropic.com/v1/messages").body(()).unwrap();
/// // This request: at most one retry, and done within 30 s; the layer's backoff as ever.
/// request.extensions_mut().insert(
///     Override::new()
///         .max_retries(1)
///         .deadline(Some(Duration::from_secs(30))),
/// );
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Override {
    max_retries: Option<u32>,
    retry_after_max: Option<Duration>,
    head_timeout: Option<Option<Duration>>,
    idle_timeout: Option<Option<Duration>>,
    deadline: Option<Option<Duration>>,
}

impl Override {
    /// An override that names no setting: the policy applies as it is.
    pub fn new() -> Self {
        Self::default()
    }

    /// The most retries after the first attempt, as [`RetryPolicy::max_retries`]. Defaults
    /// to the policy's.
    pub fn max_retries(mut self, n: u32) -> Self {
        self.max_retries = Some(n);
        self
    }

    /// The ceiling for a `Retry-After`, as [`RetryPolicy::retry_after_max`]. Defaults to the
    /// policy's.
    pub fn retry_after_max(mut self, d: Duration) -> Self {
        self.retry_after_max = Some(d);
        self
    }

    /// How long one attempt may wait for its response head, as
    /// [`RetryPolicy::head_timeout`]; `None` waits forever. Defaults to the policy's.
    pub fn head_timeout(mut self, d: Option<Duration>) -> Self {
        self.head_timeout = Some(d);
        self
    }

    /// How long a response body may go without a frame, as [`RetryPolicy::idle_timeout`];
    /// `None` waits forever. Defaults to the policy's.
    pub fn idle_timeout(mut self, d: Option<Duration>) -> Self {
        self.idle_timeout = Some(d);
        self
    }

    /// A total time budget for the request, as [`RetryPolicy::deadline`]; `None` removes the
    /// policy's. Defaults to the policy's.
    pub fn deadline(mut self, d: Option<Duration>) -> Self {
        self.deadline = Some(d);
        self
    }

    /// `policy` with the settings this override names replaced.
    fn apply(&self, mut policy: RetryPolicy) -> RetryPolicy {
        if let Some(n) = self.max_retries {
            policy.max_retries = n;
        }
        if let Some(d) = self.retry_after_max {
            policy.retry_after_max = d;
        }
        if let Some(d) = self.head_timeout {
            policy.head_timeout = d;
        }
        if let Some(d) = self.idle_timeout {
            policy.idle_timeout = d;
        }
        if let Some(d) = self.deadline {
            policy.deadline = d;
        }
        policy
    }
}

/// The policy of one request when its extensions change the layer's: a whole [`RetryPolicy`]
/// it carries, or `layer`, with its [`Override`] and then its [`NoRetry`](super::NoRetry)
/// applied. `None` when they change nothing, so the layer's applies without a copy.
#[inline]
pub(crate) fn per_request(
    extensions: &http::Extensions,
    layer: &RetryPolicy,
) -> Option<RetryPolicy> {
    // Most requests carry no extension at all: three lookups and a call saved.
    if extensions.is_empty() {
        return None;
    }
    carried_policy(extensions, layer)
}

fn carried_policy(extensions: &http::Extensions, layer: &RetryPolicy) -> Option<RetryPolicy> {
    let whole = extensions.get::<RetryPolicy>();
    let changes = extensions.get::<Override>();
    let no_retry = extensions.get::<super::NoRetry>().is_some();
    if whole.is_none() && changes.is_none() && !no_retry {
        return None;
    }
    let mut policy = whole.unwrap_or(layer).clone();
    if let Some(changes) = changes {
        policy = changes.apply(policy);
    }
    if no_retry {
        policy.max_retries = 0;
    }
    Some(policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(v: &[f64]) -> Vec<Duration> {
        v.iter().map(|s| Duration::from_secs_f64(*s)).collect()
    }

    #[test]
    fn crossed_bounds_are_settled_by_the_bound() {
        let p = RetryPolicy::default()
            .jitter(Jitter::none())
            .initial_backoff(Duration::from_secs(10))
            .max_backoff(Duration::from_secs(2));
        let got: Vec<_> = (1..=3).map(|n| p.delay(n, None).unwrap()).collect();
        assert_eq!(got, secs(&[2.0, 2.0, 2.0]));
        let p = RetryPolicy::default()
            .retry_after_min(Duration::from_secs(90))
            .retry_after_max(Duration::from_secs(60));
        let ra = Some(Duration::from_secs(5));
        assert_eq!(p.delay(1, ra).unwrap(), Duration::from_secs(60));
    }

    #[test]
    fn default_sequence_without_jitter() {
        let p = RetryPolicy::default().jitter(Jitter::none());
        let got: Vec<_> = (1..=10).map(|n| p.delay(n, None).unwrap()).collect();
        assert_eq!(
            got,
            secs(&[0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 32.0, 32.0, 32.0])
        );
        // Huge retry numbers neither overflow nor panic.
        assert_eq!(p.delay(u32::MAX, None).unwrap(), Duration::from_secs(32));
    }

    #[test]
    fn jitter_bands() {
        let p = RetryPolicy::default().random(Random::from_fn(|| 0.999_999));
        let d = p.delay(1, None).unwrap();
        assert!(d > Duration::from_millis(624) && d <= Duration::from_millis(625));
        let p = RetryPolicy::sdk_compatible().random(Random::from_fn(|| 0.999_999));
        let d = p.delay(5, None).unwrap();
        assert!(
            d >= Duration::from_secs(6) && d < Duration::from_millis(6001),
            "{d:?}"
        );
        let p = RetryPolicy::patient().random(Random::from_fn(|| 0.0));
        assert_eq!(p.delay(1, None).unwrap(), Duration::from_millis(3750));
    }

    #[test]
    fn retry_after_handling() {
        let p = RetryPolicy::default().jitter(Jitter::none());
        let ra = |s| Some(Duration::from_secs(s));
        assert_eq!(p.delay(3, ra(7)), Ok(Duration::from_secs(7)));
        assert_eq!(p.delay(3, ra(0)), Ok(Duration::ZERO));
        assert_eq!(p.delay(1, ra(60)), Ok(Duration::from_secs(60)));
        assert_eq!(p.delay(1, ra(61)), Err(DelayRefused::RetryAfterTooLong));
        let floor = p.clone().backoff_is_floor(true);
        assert_eq!(floor.delay(3, ra(1)), Ok(Duration::from_secs(2)));

        let sdk = RetryPolicy::sdk_compatible().jitter(Jitter::none());
        assert_eq!(sdk.delay(1, ra(0)), Ok(Duration::from_millis(500)));
        assert_eq!(sdk.delay(2, ra(61)), Ok(Duration::from_secs(1)));
        assert_eq!(sdk.delay(2, ra(60)), Ok(Duration::from_secs(60)));

        let patient = RetryPolicy::patient().jitter(Jitter::none());
        assert_eq!(patient.delay(1, ra(1)), Ok(Duration::from_secs(5)));
        assert_eq!(patient.delay(1, ra(86_400)), Ok(Duration::from_secs(60)));
    }

    #[test]
    fn config_validation() {
        assert!(Jitter::add(1.5).is_err());
        assert!(Jitter::add(f64::NAN).is_err());
        assert!(RetryPolicy::default().multiplier(0.5).is_err());
        assert!(RetryPolicy::default().multiplier(f64::INFINITY).is_err());
        assert!(RetryPolicy::default().with_max_retries_str("x").is_err());
        assert!(RetryPolicy::default().with_max_retries_str("-1").is_err());
        assert_eq!(
            RetryPolicy::default()
                .with_max_retries_str(" 4 ")
                .unwrap()
                .get_max_retries(),
            4
        );
    }

    #[test]
    fn an_override_replaces_what_it_names_and_nothing_else() {
        let layer = RetryPolicy::patient().deadline(Some(Duration::from_secs(90)));
        let mut ext = http::Extensions::new();
        assert!(per_request(&ext, &layer).is_none());

        ext.insert(Override::new().max_retries(1).head_timeout(None));
        let p = per_request(&ext, &layer).unwrap();
        assert_eq!((p.max_retries, p.head_timeout), (1, None));
        // The rest is the layer's.
        let untouched = |p: &RetryPolicy| {
            (
                p.initial_backoff,
                p.max_backoff,
                p.jitter,
                p.retry_after_min,
                p.retry_after_max,
                p.above_ceiling,
                p.idle_timeout,
                p.deadline,
            )
        };
        assert_eq!(untouched(&p), untouched(&layer));

        // On top of a whole policy the request carries; `NoRetry` wins over the count.
        ext.insert(RetryPolicy::interactive());
        let p = per_request(&ext, &layer).unwrap();
        assert_eq!((p.max_retries, p.max_backoff), (1, Duration::from_secs(8)));
        ext.insert(super::super::NoRetry);
        assert_eq!(per_request(&ext, &layer).unwrap().max_retries, 0);

        let p = Override::new()
            .deadline(None)
            .idle_timeout(Some(Duration::from_secs(5)))
            .retry_after_max(Duration::from_secs(2))
            .apply(layer.clone());
        assert_eq!(
            (p.deadline, p.idle_timeout, p.retry_after_max, p.max_retries),
            (
                None,
                Some(Duration::from_secs(5)),
                Duration::from_secs(2),
                12
            )
        );
    }

    #[test]
    fn seeded_random_is_deterministic() {
        let a = Random::seeded(7);
        let b = Random::seeded(7);
        for _ in 0..10 {
            let (x, y) = (a.sample(), b.sample());
            assert_eq!(x, y);
            assert!((0.0..1.0).contains(&x));
        }
    }
}
