//! The cooldown gate: one "closed until" instant shared by every request of a fleet.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::{Duration, SystemTime};

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use super::{Fleet, Limits};
use crate::classify::WallClock;
use crate::error::ConfigError;
use crate::random::Random;

/// Settings of the cooldown gate of a [`Fleet`](crate::fleet::Fleet), shared by every request
/// sent through it.
///
/// A `429` or `529` carrying a `Retry-After`, or a response whose rate-limit headers say no
/// request is left until a reset, closes the gate until that instant (at most the reporting
/// request's [`retry_after_max`](crate::RetryPolicy::retry_after_max) away). While it is closed,
/// every attempt about to be sent waits: until the gate reopens, plus a random extra in
/// `[0, spread]`, where `spread` is [`spread_fraction`](GateConfig::spread) of the wait the
/// server announced, at most [`max_spread`](GateConfig::spread). So a fleet does not come back
/// in one instant. A request never waits at the gate longer than its policy's
/// `retry_after_max` plus that extra, and the layer's cancellation token ends the wait at
/// once. The random extra comes from the policy's [`Random`], so tests can fix it.
///
/// Absolute instants the server sends (a `Retry-After` HTTP-date, an RFC 3339 reset) are
/// read against the response's `Date` where it has one, so the host's clock skew does not
/// move the deadline; against the system clock (or the [`wall_clock`](GateConfig::wall_clock)
/// set) otherwise.
///
/// Defaults (what the fleet uses, [`GateConfig::new`] and [`GateConfig::default`] alike):
/// closed by a `Retry-After` of 2 s or more; spread 50 % of the announced wait, at most 30 s;
/// rate-limit headers read; the system clock for RFC 3339 reset instants when the response
/// has no `Date`.
#[derive(Clone)]
pub struct GateConfig {
    spread_fraction: f64,
    max_spread: Duration,
    rate_limit_headers: bool,
    min_close: Duration,
    clock: Option<WallClock>,
}

impl GateConfig {
    /// The defaults, the fleet's: closed by a `Retry-After` of 2 s or more, spread 50 % of
    /// the announced wait, at most 30 s, rate-limit headers read.
    pub fn new() -> Self {
        GateConfig {
            spread_fraction: 0.5,
            max_spread: Duration::from_secs(30),
            rate_limit_headers: true,
            min_close: DEFAULT_MIN_CLOSE,
            clock: None,
        }
    }

    /// How far apart waiters leave once the gate reopens: each adds a random extra in
    /// `[0, min(fraction × announced wait, max, 1 day)]`. `fraction` must be within `[0, 10]`.
    /// Defaults to 0.5 and 30 s.
    pub fn spread(mut self, fraction: f64, max: Duration) -> Result<Self, ConfigError> {
        if !(0.0..=10.0).contains(&fraction) {
            return Err(ConfigError::new(format!(
                "gate spread fraction must be within [0, 10], got {fraction}"
            )));
        }
        self.spread_fraction = fraction;
        self.max_spread = max;
        Ok(self)
    }

    /// The shortest `Retry-After` that closes the gate for everyone; a shorter one is left to
    /// the request that received it (and, when on, to the
    /// [pacing](crate::fleet::PacingConfig), which slows the fleet without
    /// stopping it). Rate-limit headers close the gate whatever their wait. Zero: every
    /// `Retry-After` closes it. Defaults to 2 s.
    pub fn min_close(mut self, wait: Duration) -> Self {
        self.min_close = wait;
        self
    }

    pub(crate) fn get_min_close(&self) -> Duration {
        self.min_close
    }

    /// Whether `anthropic-ratelimit-requests-*` and `x-ratelimit-*-requests` headers saying
    /// no request is left close the gate until the reset, before any `429`. Defaults to true.
    pub fn rate_limit_headers(mut self, yes: bool) -> Self {
        self.rate_limit_headers = yes;
        self
    }

    /// The wall clock against which RFC 3339 reset instants and `Retry-After` HTTP-dates are
    /// read, instead of the response's `Date`, so tests can fix "now". Defaults to none: the
    /// response's `Date`, or the system clock when it has none.
    pub fn wall_clock(mut self, clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    pub(crate) fn reads_rate_limit_headers(&self) -> bool {
        self.rate_limit_headers
    }

    pub(crate) fn has_wall_clock(&self) -> bool {
        self.clock.is_some()
    }

    pub(crate) fn now(&self) -> SystemTime {
        match &self.clock {
            Some(clock) => clock(),
            None => SystemTime::now(),
        }
    }

    fn spread_for(&self, announced: Duration) -> Duration {
        // At most the longest hold: a huge `Retry-After` with a large fraction and no
        // maximum would otherwise hold a waiter for ages past the gate's reopening.
        crate::time::mul_f64(announced, self.spread_fraction)
            .min(self.max_spread)
            .min(MAX_HOLD)
    }
}

/// The shortest `Retry-After` that closes the default gate: a shorter one (a token bucket's
/// next token) is left to the pacing; a longer one holds every request.
const DEFAULT_MIN_CLOSE: Duration = Duration::from_secs(2);

impl Default for GateConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for GateConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GateConfig")
            .field("spread_fraction", &self.spread_fraction)
            .field("max_spread", &self.max_spread)
            .field("rate_limit_headers", &self.rate_limit_headers)
            .field("min_close", &self.min_close)
            .field("custom_clock", &self.clock.is_some())
            .finish()
    }
}

/// How much later a closing must put a closed gate's reopening to count as an extension in
/// [`Gate::closings`]: more than the difference of two processes' clocks.
const SAME_CLOSING: Duration = Duration::from_millis(100);

/// The gate's shared state.
pub(crate) struct Gate {
    pub(crate) config: GateConfig,
    // The one thing an open gate costs a request: a load of this flag. It is only ever
    // changed under the lock, so a close is never lost.
    maybe_closed: AtomicBool,
    closed: Mutex<Closed>,
    // Closings and extensions, for the read-outs.
    closings: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct Closed {
    until: Instant,
    spread: Duration,
    announced: Duration,
}

impl Gate {
    pub(crate) fn new(config: GateConfig) -> Self {
        Gate {
            config,
            maybe_closed: AtomicBool::new(false),
            closed: Mutex::new(Closed {
                until: Instant::now(),
                spread: Duration::ZERO,
                announced: Duration::ZERO,
            }),
            closings: AtomicU64::new(0),
        }
    }

    /// Closes the gate for `wait` from `now`, unless it already stays closed longer; returns
    /// the new deadline when it moved.
    pub(crate) fn close(&self, now: Instant, wait: Duration) -> Option<Instant> {
        self.close_spread(now, wait, wait)
    }

    /// Closes the gate for `wait` from `now`, its waiters spread as for a wait `announced`
    /// (a closing learnt from another process, part of whose wait is over already).
    pub(crate) fn close_spread(
        &self,
        now: Instant,
        wait: Duration,
        announced: Duration,
    ) -> Option<Instant> {
        if wait.is_zero() {
            return None;
        }
        // A wait past what any request is held is held that long: a huge Retry-After still
        // closes the gate.
        let wait = wait.min(MAX_HOLD);
        let until = now + wait;
        let mut closed = self.lock();
        if until > closed.until {
            // A closing that moves a closed gate's reopening by less than clocks differ
            // between processes is the same closing come back (its announcement through the
            // shared store): in force, not counted again.
            let open = closed.until <= now;
            if open || until > closed.until + SAME_CLOSING {
                self.closings.fetch_add(1, Ordering::Relaxed);
            }
            *closed = Closed {
                until,
                spread: self.config.spread_for(announced.max(wait)),
                announced: announced.max(wait),
            };
            self.maybe_closed.store(true, Ordering::Release);
            return Some(until);
        }
        None
    }

    /// The wait the closing in force was announced with, while closed.
    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    pub(crate) fn announced(&self) -> Option<Duration> {
        self.closed_at(Instant::now()).map(|c| c.announced)
    }

    pub(crate) fn closings(&self) -> u64 {
        self.closings.load(Ordering::Relaxed)
    }

    /// When the gate is closed at `now`: the instant it reopens and the spread of its waiters.
    fn closed_at(&self, now: Instant) -> Option<Closed> {
        if !self.maybe_closed.load(Ordering::Acquire) {
            return None;
        }
        let closed = self.lock();
        if closed.until <= now {
            self.maybe_closed.store(false, Ordering::Release);
            return None;
        }
        Some(*closed)
    }

    pub(crate) fn is_open_fast(&self) -> bool {
        !self.maybe_closed.load(Ordering::Acquire)
    }

    /// The instant the gate reopens, if it is closed now.
    pub(crate) fn closed_until(&self) -> Option<Instant> {
        self.closed_at(Instant::now()).map(|c| c.until)
    }

    /// How long a waiter arriving at `now` waits, given the latest instant it may still be
    /// held to (`cap`): until the gate reopens or `cap`, whichever is sooner, plus its share
    /// of the spread. `None` when the gate is open, or `cap` has passed.
    fn wait_for(
        &self,
        now: Instant,
        cap: Instant,
        deadline: Option<Instant>,
        random: &Random,
    ) -> Result<Option<Instant>, PastDeadline> {
        let Some(closed) = self.closed_at(now) else {
            return Ok(None);
        };
        if cap <= now {
            return Ok(None);
        }
        // The gate only ever extends: a request whose deadline comes before its wait ends can
        // never start in time, so it is told at once instead of after a wait in vain.
        if deadline.is_some_and(|d| closed.until.min(cap) >= d) {
            return Err(PastDeadline);
        }
        let extra = crate::time::mul_f64(closed.spread, random.sample());
        let until = closed.until.min(cap).checked_add(extra).unwrap_or(cap);
        // The spread never pushes a request past its deadline: it leaves when the gate opens.
        Ok(Some(match deadline {
            Some(d) if until >= d => closed.until.min(cap),
            _ => until,
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Closed> {
        self.closed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate")
            .field("config", &self.config)
            .field("closed_until", &self.closed_until())
            .finish()
    }
}

/// The longest a request is held at the gate, whatever its policy's ceiling.
const MAX_HOLD: Duration = Duration::from_secs(24 * 60 * 60);

/// The gate stays closed past the request's deadline: the request cannot start in time.
/// (The caller's cancellation is watched by the retry loop itself, as for its other waits.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PastDeadline;

/// A request's wait for the first read of a gate shared across processes (a store's
/// `first_read`): the type lives here, where it is waited for, so the stores name it from here.
pub(crate) type FirstRead = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

pin_project! {
    /// A request waiting at the closed gate, as a state of the retry loop's future.
    pub(crate) struct GateWait {
        #[pin]
        sleep: Sleep,
        // The first read of the gate shared across processes, to wait for first.
        first: Option<FirstRead>,
        fleet: Fleet,
        cap: Instant,
        deadline: Option<Instant>,
        random: Random,
    }
}

impl GateWait {
    /// The wait at the gate before an attempt, `Ok(None)` when the gate is open, or
    /// [`PastDeadline`] when it stays closed past `deadline`.
    pub(crate) fn start(
        fleet: &Fleet,
        limits: Limits<'_>,
        deadline: Option<Instant>,
    ) -> Result<Option<Self>, PastDeadline> {
        let Some(gate) = fleet.gate() else {
            return Ok(None);
        };
        let first = fleet.first_read();
        if gate.is_open_fast() && first.is_none() {
            return Ok(None);
        }
        let now = Instant::now();
        // A ceiling set to "forever" must not switch the gate off by overflowing.
        let cap = now + limits.retry_after_max.min(MAX_HOLD);
        if first.is_some() {
            // A process new to the scope: what the others closed is read before the gate is.
            return Ok(Some(GateWait {
                sleep: tokio::time::sleep_until(now),
                first,
                fleet: fleet.clone(),
                cap,
                deadline,
                random: limits.random.clone(),
            }));
        }
        let Some(until) = gate.wait_for(now, cap, deadline, limits.random)? else {
            return Ok(None);
        };
        tracing::debug!(
            wait_ms = (until - now).as_millis() as u64,
            "waiting at the cooldown gate"
        );
        Ok(Some(GateWait {
            sleep: tokio::time::sleep_until(until),
            first: None,
            fleet: fleet.clone(),
            cap,
            deadline,
            random: limits.random.clone(),
        }))
    }
}

impl fmt::Debug for GateWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GateWait")
            .field("until", &self.sleep.deadline())
            .finish()
    }
}

impl Future for GateWait {
    type Output = Result<(), PastDeadline>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Some(first) = this.first.as_mut() {
            ready!(first.as_mut().poll(cx));
            *this.first = None;
        }
        loop {
            ready!(this.sleep.as_mut().poll(cx));
            // Closed again meanwhile (another request's 429): wait again, with a fresh share
            // of the new spread, but never past this request's cap.
            let gate = this.fleet.gate().expect("a gate wait needs a gate");
            let now = Instant::now();
            match gate.wait_for(now, *this.cap, *this.deadline, this.random)? {
                Some(until) => this.sleep.as_mut().reset(until),
                None => return Poll::Ready(Ok(())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A closing counts once: the same closing come back a few milliseconds later (as its
    /// announcement through the shared store does, on another clock) moves the deadline but
    /// is not counted; an extension past that, or a closing of an open gate, is.
    #[tokio::test(start_paused = true)]
    async fn a_closing_come_back_on_another_clock_is_not_counted_again() {
        let gate = Gate::new(GateConfig::new());
        let now = Instant::now();
        assert_eq!(
            gate.close(now, Duration::from_secs(3)),
            Some(now + Duration::from_secs(3))
        );
        assert_eq!(gate.closings(), 1);
        let echo = Duration::from_millis(3_002);
        assert_eq!(gate.close_spread(now, echo, echo), Some(now + echo));
        assert_eq!(gate.closings(), 1);
        assert_eq!(gate.closed_until(), Some(now + echo));
        // Not later: nothing moves.
        assert_eq!(gate.close(now, Duration::from_secs(2)), None);
        // Later by more than clocks differ: an extension, counted.
        let longer = Duration::from_secs(4);
        assert_eq!(gate.close(now, longer), Some(now + longer));
        assert_eq!(gate.closings(), 2);
        // Open again, any closing counts.
        tokio::time::advance(Duration::from_secs(5)).await;
        let now = Instant::now();
        assert!(gate.close(now, Duration::from_millis(50)).is_some());
        assert_eq!(gate.closings(), 3);
    }
}
