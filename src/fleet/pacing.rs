//! The settings of the adaptive pacing.

use std::time::Duration;

use crate::error::ConfigError;

/// Settings of the adaptive pacing of a [`Fleet`](crate::fleet::Fleet), shared by every
/// request sent through it.
///
/// Attempts leave one after another, `1 / rate` apart, in arrival order. Only the head of the
/// line waits on the clock; the others are woken when the one ahead of them goes, so a change
/// of rate reaches the whole line at once.
///
/// The rate adapts the way TCP's window does, and only while someone waits in line (a fleet
/// that sends less than its rate has not shown that the server takes more):
///
/// - **Slow start**: until the first refusal, the rate doubles every second.
/// - A `429` multiplies it by `decrease` (by at most 0.5 for the first one,
///   which ends slow start and its overshoot), once per round: a refusal of an attempt sent
///   before the last decrease is not counted again. After that, each success adds `growth`
///   requests/s.
/// - **Quotas**: a refusal whose `Retry-After` is 10 s or more speaks of a quota spent, to be
///   renewed when the wait is over. The server took the `n` attempts sent since the last
///   renewal and takes no more until the wait ends, so `n / (time since the renewal + wait)`
///   is the rate that spends the quota evenly over its cycle. The rate falls to that (when it
///   is lower than the usual decrease), holds there through the wait and one whole cycle
///   after it, then grows at most 25 % above it per cycle. A server that counts requests per
///   window is then sent its quota spread over the window instead of in a burst at the
///   window's start. A second long `Retry-After` during the wait is the same quota, and only
///   decreases the rate as usual.
/// - **Stated limits**: a response that states its request limit
///   (`anthropic-ratelimit-requests-limit`, `x-ratelimit-limit-requests`) caps the rate at
///   `limit / period` (see [`limit_period`](PacingConfig::limit_period)), even below `min`,
///   so the fleet sends what the server allows from its first answer instead of finding it
///   out by refusals.
///
/// # How long an attempt waits in line
///
/// An attempt waits for its turn no longer than its policy lets a `Retry-After` park it
/// ([`retry_after_max`](crate::RetryPolicy::retry_after_max), 60 s by default), nor past its
/// [`deadline`](crate::RetryPolicy::deadline). As soon as it is known that its turn would come
/// later, it leaves the line and the request ends with
/// [`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong) (or
/// [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded) when the deadline is the
/// nearer bound), nothing more sent (the error's [trail](crate::Error::trail) holds the
/// attempts that failed before):
///
/// - on joining, when the wait expected at the rate of the moment (doubling, during slow
///   start) is longer. With a stated limit of one request a minute, one attempt waits in line
///   and those after it are refused at once, instead of queueing for hours;
/// - at the head of the line, when the instant of its turn is later;
/// - behind others, when its bound comes: the line slowed after it joined, or it may wait
///   less than those ahead of it.
///
/// A wait exactly as long as the bound is let through. Each refusal is a `WARN` event.
///
/// # A head that does not take its turn
///
/// Only the head of the line waits on the clock, so a head that is not polled (a losing
/// `select!` branch kept alive, a caller that stopped polling) could hold up everyone behind
/// it. It does not: the one right behind the head looks again 100 ms after the head's turn
/// came (or after the head was called, if later), and if the head has not taken the turn by
/// then, takes it itself, the schedule kept. Those further back look again when the one ahead
/// of them should have gone, so a run of heads that are not polled is passed over too.
///
/// A head passed over, when it is polled again, does not send at once: its turn went to the
/// one behind it, and sending too would put two attempts in one gap, the burst the pacing is
/// there to prevent. It comes back right behind the head of the moment (after only those
/// passed over that came back before it), ahead of everyone else still waiting; its bound
/// still counts from when it first joined.
///
/// Why a rate and not a burst: a fleet whose requests start together comes back together,
/// and a server's limiter (a token bucket, a window) refuses the part of each burst above its
/// capacity even when the average is well within it. Evenly spaced attempts let the fleet
/// settle at what the server admits.
///
/// The [cooldown gate](crate::fleet::GateConfig) is checked again after the pacing turn: an
/// attempt that finds it closed spends its turn, waits at the gate, then queues again, so
/// the requests the gate held leave it at the pacing rate. An attempt is held at the gate
/// once: one that has waited there is not held again if the gate closes anew while it waits
/// for its turn (holding it again measured worse in the storm bench's S1: 0.91 C of goodput
/// against 0.99 C, with three times the refusals).
///
/// Defaults (what the fleet uses, [`PacingConfig::new`] and [`PacingConfig::default`] alike):
/// [dormant](PacingConfig::dormant) until the server signals a limit; start at 50
/// requests/s, between 1 and 10,000; `decrease` 0.95; `growth` 0.05; stated limits read as
/// per minute; a [burst](PacingConfig::burst) of 1 s. `.dormant(false)` paces from the first
/// attempt; `.burst(Duration::ZERO)` keeps the spacing strict.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacingConfig {
    pub(super) initial: f64,
    pub(super) min: f64,
    pub(super) max: f64,
    pub(super) decrease: f64,
    pub(super) growth: f64,
    pub(super) limit_period: Option<Duration>,
    pub(super) dormant: bool,
    pub(super) burst: Duration,
    pub(super) warm_up: Duration,
}

impl Default for PacingConfig {
    fn default() -> Self {
        PacingConfig {
            initial: 50.0,
            min: 1.0,
            max: 10_000.0,
            decrease: 0.95,
            growth: 0.05,
            limit_period: Some(Duration::from_secs(60)),
            dormant: true,
            burst: Duration::from_secs(1),
            warm_up: Duration::ZERO,
        }
    }
}

impl PacingConfig {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// The rate to start from and its bounds, in requests per second:
    /// `0.001 <= min <= initial <= max`, all finite. Defaults to 50, 1 and 10,000.
    pub fn rates(mut self, initial: f64, min: f64, max: f64) -> Result<Self, ConfigError> {
        let ok = [initial, min, max].iter().all(|r| r.is_finite())
            && min >= MIN_RATE
            && min <= initial
            && initial <= max;
        if !ok {
            return Err(ConfigError::new(format!(
                "pacing rates need 0.001 <= min <= initial <= max, got {min}, {initial}, {max}"
            )));
        }
        self.initial = initial;
        self.min = min;
        self.max = max;
        Ok(self)
    }

    /// The factor a refusal multiplies the rate by, in `(0, 1)`. Defaults to 0.95.
    pub fn decrease(mut self, factor: f64) -> Result<Self, ConfigError> {
        if !(factor > 0.0 && factor < 1.0) {
            return Err(ConfigError::new(format!(
                "the decrease factor must be within (0, 1), got {factor}"
            )));
        }
        self.decrease = factor;
        Ok(self)
    }

    /// What each success adds to the rate once the first refusal has been seen, in requests
    /// per second, within `(0, 1]`: the rate grows by about this fraction of itself per second.
    /// Defaults to 0.05.
    pub fn growth(mut self, per_success: f64) -> Result<Self, ConfigError> {
        if !(per_success > 0.0 && per_success <= 1.0) {
            return Err(ConfigError::new(format!(
                "the growth must be within (0, 1], got {per_success}"
            )));
        }
        self.growth = per_success;
        Ok(self)
    }

    /// The period a stated request limit counts over, or `None` to ignore stated limits.
    ///
    /// A response that states its request limit (`anthropic-ratelimit-requests-limit`,
    /// `x-ratelimit-limit-requests`; see [the headers](crate::fleet#rate-limit-headers)) caps the
    /// rate at `limit / period`: the fleet then sends what the server allows spread evenly,
    /// from the first answer, instead of finding it by being refused. Both providers state
    /// requests per minute. Defaults to 60 s.
    pub fn limit_period(mut self, period: Option<Duration>) -> Result<Self, ConfigError> {
        if period.is_some_and(|p| p.is_zero()) {
            return Err(ConfigError::new("the limit period must not be zero"));
        }
        self.limit_period = period;
        Ok(self)
    }

    /// Whether the pacing sleeps until the server first signals a rate limit.
    ///
    /// Dormant, it limits nothing: attempts leave as they come, and the pacing only counts
    /// them (one atomic add per attempt, and a timestamp every 16th). It wakes
    /// only on evidence of a limit the scope's own rate meets ([`PacingWake`]; see
    /// [the rule](crate::fleet#noise-or-a-limit)): a burst of `429`s, a `429` whose
    /// `Retry-After` is longer than the retry's own backoff and 1 s, or when the server says its
    /// request window is nearly spent. A random `429`, an overload (`529`, a `503`
    /// overloaded) or another `5xx` does not wake it, and an overload does not slow it once
    /// awake.
    ///
    /// - Woken by a `429`, it starts from the rate it measured over the last second
    ///   (attempts counted since the newest timestamp at least a second old, over the time
    ///   since; over a whole second when the fleet is younger than that), treated as the
    ///   rate at the end of slow start: the refusal halves it, though not below `initial`
    ///   (a fleet that sent a few attempts has measured nothing of what the server takes),
    ///   a long `Retry-After` is read as a quota of the attempts sent over the last minute
    ///   (or since the first, when the fleet is younger), and the rate goes on from there
    ///   as after any first refusal (`growth` per success, `decrease` per refusal).
    /// - A stated request limit alone does not wake it (the providers state it on every
    ///   answer): it caps the rate it wakes at, and every rate after. A response saying at
    ///   most a tenth of the limit is left wakes it at the limit's cap (`limit / period`).
    ///
    /// So a client that never meets a limit is never slowed, and one that does is paced
    /// from what it was actually sending rather than from [`initial`](PacingConfig::rates).
    /// Across processes (the `fleet-redis` feature), each process wakes on its own answers;
    /// once awake, it takes its turns from the fleet's shared schedule, whose rate is learnt
    /// in Redis (on a fresh scope from `initial`, in slow start), not from what this process
    /// measured.
    /// False paces from the first attempt, at `initial`. Defaults to true.
    pub fn dormant(mut self, yes: bool) -> Self {
        self.dormant = yes;
        self
    }

    /// The turns a quiet spell leaves in hand, as a span of time: after a spell with no one
    /// in line, up to `burst × rate` attempts may leave at once before the spacing resumes,
    /// as a token bucket of that depth lets them. A server's limiter that allows a burst
    /// (a token bucket's depth, a window's quota) takes it; evenly spaced attempts alone
    /// would turn every burst of demand into a queue (in the storm bench's S6, demand at the
    /// limit, the fleet's default pacing with a gate closed by every `Retry-After`: 0.935 C
    /// of goodput without it, 0.966 C with 1 s). At most 60 s. Zero: at most one gap's turn
    /// is made up (the schedule is kept when a turn is taken a little late). Defaults to 1 s.
    pub fn burst(mut self, span: Duration) -> Result<Self, ConfigError> {
        if span > Duration::from_secs(60) {
            return Err(ConfigError::new(format!(
                "the pacing burst must be at most 60 s, got {span:?}"
            )));
        }
        self.burst = span;
        Ok(self)
    }

    /// How long a [dormant](PacingConfig::dormant) pacing paces a scope it meets for the
    /// first time, before any evidence of a limit: a warm-up.
    ///
    /// Dormant pacing waits for the server's evidence, and a scope's first attempts go out
    /// before any answer can bring it: when many clients start together (a restart, a
    /// deploy, replicas scaled out against one key) they all go at once, and against a limit
    /// all but the limit's worth come back refused, however the pacing reacts after. With a
    /// warm-up, a new scope's attempts leave from its first one at
    /// [`initial`](PacingConfig::rates), the rate doubling every second while someone waits
    /// in line (slow start), with no burst in hand and, across processes, on the fleet's
    /// shared schedule. Refusals during the warm-up do not slow it (random ones would ratchet
    /// it down); evidence of a limit, by the same rule as for a dormant pacing
    /// ([`PacingWake`]), wakes the pacing for good from the warm-up's rate, the refusal
    /// ending slow start. Once `span` has passed since the scope's first attempt and no one
    /// waits in line, a warm-up that met no evidence ends: the pacing sleeps as if it had
    /// never paced.
    ///
    /// The cost falls on a scope's first moments only: a burst of `n` attempts at a new scope
    /// takes about `log2(1 + n · ln 2 / initial)` seconds to leave (1,000 attempts at 50/s:
    /// 3.9 s) instead of going at once, and a steady demand above `initial` waits in line
    /// until slow start has doubled past it. Measured through the proxy (its bench
    /// `fleet`, a 20/s token bucket, 100 clients per process starting together), it is what
    /// keeps the first second from costing as many refused attempts as there are clients.
    /// Ignored when the pacing is not dormant. Zero turns it off. Defaults to zero.
    pub fn warm_up(mut self, span: Duration) -> Self {
        self.warm_up = span;
        self
    }

    /// How long a dormant pacing paces a new scope before any evidence of a limit.
    pub fn get_warm_up(&self) -> Duration {
        self.warm_up
    }

    /// The span of turns a quiet spell leaves in hand.
    pub fn get_burst(&self) -> Duration {
        self.burst
    }

    /// Whether the pacing sleeps until the server first signals a rate limit.
    pub fn get_dormant(&self) -> bool {
        self.dormant
    }

    /// The rate it starts from.
    pub fn get_initial(&self) -> f64 {
        self.initial
    }

    /// The period a stated request limit counts over, if stated limits are read.
    pub fn get_limit_period(&self) -> Option<Duration> {
        self.limit_period
    }

    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    pub(crate) fn get_min(&self) -> f64 {
        self.min
    }

    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    pub(crate) fn get_max(&self) -> f64 {
        self.max
    }

    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    pub(crate) fn get_growth(&self) -> f64 {
        self.growth
    }

    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    pub(crate) fn get_decrease(&self) -> f64 {
        self.decrease
    }

    /// The rate cap a stated limit of `limit` requests sets, if stated limits are read.
    pub(crate) fn cap_for(&self, limit: u64) -> Option<f64> {
        let period = self.limit_period?;
        Some((limit as f64 / period.as_secs_f64()).clamp(MIN_RATE, self.max))
    }
}

/// What woke a [dormant](PacingConfig::dormant) pacing: the evidence that the scope's own rate
/// meets a limit. A few random `429`s, and overloads (`529`, OpenAI's `503` overloaded: the
/// server's state, not this client's limit), are none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PacingWake {
    /// Rate-limit headers said at most a tenth of the stated request limit is left.
    RateLimitHeaders,
    /// A `429` whose `Retry-After` is longer than the retry's own backoff would have been,
    /// and than 1 s.
    LongRetryAfter,
    /// A `429` whose `Retry-After` of 10 s or more speaks of a quota spent, renewed when the
    /// wait is over.
    QuotaReset,
    /// A burst of `429`s: at least 16 within 10 s, and at least a quarter of the attempts sent
    /// since the first of them came back, well above the background share of random
    /// refusals.
    RefusalShare,
}

impl PacingWake {
    /// Every cause, in the order of [`PacingWake::index`].
    pub const ALL: [PacingWake; 4] = [
        PacingWake::RateLimitHeaders,
        PacingWake::LongRetryAfter,
        PacingWake::QuotaReset,
        PacingWake::RefusalShare,
    ];

    /// A short name: `rate_limit_headers`, `long_retry_after`, `quota_reset`,
    /// `refusal_share`.
    pub fn as_str(&self) -> &'static str {
        match self {
            PacingWake::RateLimitHeaders => "rate_limit_headers",
            PacingWake::LongRetryAfter => "long_retry_after",
            PacingWake::QuotaReset => "quota_reset",
            PacingWake::RefusalShare => "refusal_share",
        }
    }

    /// The cause's place in [`PacingWake::ALL`].
    pub fn index(&self) -> usize {
        match self {
            PacingWake::RateLimitHeaders => 0,
            PacingWake::LongRetryAfter => 1,
            PacingWake::QuotaReset => 2,
            PacingWake::RefusalShare => 3,
        }
    }
}

impl std::fmt::Display for PacingWake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The lowest rate there is (one request in 1,000 s), so that `1 / rate` stays a duration.
pub(super) const MIN_RATE: f64 = 0.001;

/// How a turn of the shared schedule came out.
#[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RemoteOutcome {
    /// Booked: go in this epoch of the shared schedule.
    Go(u64),
    /// Refused: the turn would come this far off, beyond what the attempt may wait.
    TooFar(Duration),
    /// No answer in time: the local line.
    Failed,
}
