//! Fleet behaviour: the requests sent on one API key share a retry budget and, opt-in, a
//! cooldown gate and an adaptive pacing, so that they behave as a well-mannered fleet rather
//! than a retry storm. That state is a [`Fleet`]: built once, cloned into every layer that
//! sends on the key, and readable while requests run.
//!
//! Per-request retry alone turns an overload into a storm: each failed request retries, the
//! retries add load, and an exact `Retry-After` sends everyone back in the same instant.
//!
//! - **Retry budget** ([`BudgetConfig`], on by default): every first attempt deposits, every
//!   retry withdraws; retries the budget cannot pay for are not made. With the defaults,
//!   retries add at most 20 % to the load, plus 10 a second. The accounting is
//!   [`tower::retry::budget::TpsBudget`].
//! - **Cooldown gate** ([`GateConfig`], off by default): a `429` or `529` with `Retry-After`,
//!   or rate-limit headers saying no request is left ([below](#rate-limit-headers)), close the gate until
//!   then; attempts about to be sent wait at the gate instead of hammering, and leave spread
//!   over a window once it reopens. An open gate costs a request one atomic load.
//! - **Adaptive pacing** ([`PacingConfig`], off by default): attempts leave evenly spaced, in
//!   arrival order, at a rate learned from the answers: slow start until the first refusal,
//!   then a small increase per success and a multiplicative decrease per `429` or overload;
//!   a long `Retry-After` is read as a quota and sets the rate that spreads it over its
//!   cycle. A fleet whose requests start together otherwise comes back together, and a
//!   server's limiter refuses the part of every burst above its capacity even when the
//!   average fits. An attempt waits in line no longer than its policy's Retry-After
//!   ceiling or its deadline
//!   ([`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong)), and a head of
//!   the line that is not polled does not hold up the others.
//!
//! # Sharing
//!
//! A [`Fleet`] is a handle on one state: its clones share it. Every layer given the same
//! fleet ([`RetryLayer::fleet`](crate::RetryLayer::fleet)), the services they make, and their
//! clones, share one budget, one gate and one pace, whichever client they sit in front of. A
//! layer given none builds its own [`Fleet::default`] (the budget on, gate and pacing off);
//! its clones keep sharing it, however they are re-configured. Two layers built separately
//! without a fleet share nothing.
//!
//! # Configuration
//!
//! | setting | default | change with |
//! |---|---|---|
//! | retry budget | on: deposits count for 10 s, 10 retries a second whatever the traffic, plus 20 % of first attempts; in any 10 s, at most `10 × 10 + 0.2 × first attempts` retries ([`BudgetConfig::max_retries`]) | [`FleetBuilder::budget`] with [`BudgetConfig::new(ttl, min_per_sec, ratio)`](BudgetConfig::new), or `None` to turn it off |
//! | cooldown gate | off | [`FleetBuilder::cooldown_gate`] with [`GateConfig::new`] |
//! | gate: what closes it | a `429` or `529` with a `Retry-After`, for that wait (at most the request's `retry_after_max`); rate-limit headers saying no request is left, until their reset | [`GateConfig::min_close`] (default zero: every `Retry-After` closes it), [`GateConfig::rate_limit_headers`] (default on) |
//! | gate: spread on reopening | each waiter adds a random extra in `[0, min(50 % × announced wait, 30 s)]`, from the policy's [`Random`](crate::retry::Random) | [`GateConfig::spread`] |
//! | adaptive pacing | off | [`FleetBuilder::pacing`] with [`PacingConfig::new`] |
//! | pacing: rate | starts at 50 requests/s, kept within 1 and 10,000 (a stated limit may cap it lower); slow start doubles it every second until the first refusal | [`PacingConfig::rates`] |
//! | pacing: on a `429` or overload | ×0.95, once per round; the first refusal, which ends slow start, at least halves it | [`PacingConfig::decrease`] |
//! | pacing: on a success | +0.05 requests/s, only while someone waits in line | [`PacingConfig::growth`] |
//! | pacing: a `Retry-After` of 10 s or more | read as a quota spent: the rate that spreads it over its cycle, held for a cycle, then at most +25 % a cycle | — |
//! | pacing: a stated request limit | caps the rate at the limit per 60 s | [`PacingConfig::limit_period`] |
//! | pacing: longest wait in line | the request's `retry_after_max` (60 s by default) or its deadline, whichever is nearer; then [`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong), or [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded) for the deadline | [`RetryPolicy::retry_after_max`](crate::RetryPolicy::retry_after_max) |
//!
//! The headers read are listed [below](#rate-limit-headers). A retry the budget refuses is not made: the
//! last response comes back as it is, its [`RetryTrail`](crate::RetryTrail) saying
//! [`GiveUpReason::Budget`](crate::GiveUpReason::Budget); a transport error becomes
//! [`ErrorKind::BudgetExhausted`](crate::ErrorKind::BudgetExhausted). What these settings do
//! to a fleet of 1,000 clients is measured by the storm bench (`cargo bench --bench storm`).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_llm_retry::fleet::{BudgetConfig, Fleet, GateConfig, PacingConfig};
//! use tower_llm_retry::RetryLayer;
//!
//! # fn main() -> Result<(), tower_llm_retry::retry::ConfigError> {
//! // One fleet per API key, built once.
//! let fleet = Fleet::builder()
//!     .budget(Some(BudgetConfig::new(Duration::from_secs(10), 5, 0.1)?))
//!     .cooldown_gate(Some(GateConfig::new().spread(0.5, Duration::from_secs(10))?))
//!     .pacing(Some(PacingConfig::new()))
//!     .build();
//! // Every stack that sends on the key gets a clone of it.
//! let for_hyper = RetryLayer::new().fleet(fleet.clone());
//! let for_reqwest = RetryLayer::new().fleet(fleet.clone());
//! // Its state, for metrics.
//! assert_eq!(fleet.gate_closed_until(), None);
//! assert_eq!(fleet.pace(), Some(PacingConfig::new().initial()));
//! # let _ = (for_hyper, for_reqwest);
//! # Ok(()) }
//! ```
//!
//! # Why the gate and the pacing are opt-in
//!
//! One gate, and one pace, hold every request of their fleet. That is right when the fleet's
//! requests share a rate limit (one key, one upstream), and wrong when one fleet fronts
//! several providers or keys: a `429` from one would hold the others. Build one fleet per key,
//! then turn them on.
//!
//! # Differences from `tower::retry` with a budget
//!
//! - The budget is wired in: deposits on first attempts, a withdrawal before each retry, and
//!   a refusal that is visible in the [`RetryTrail`](crate::RetryTrail)
//!   ([`GiveUpReason::Budget`](crate::GiveUpReason::Budget)).
//! - The gate has no counterpart in `tower::retry`, which knows no HTTP.
//!
//! # Rate-limit headers
//!
//! | provider | limit | remaining | reset |
//! |---|---|---|---|
//! | Anthropic | `anthropic-ratelimit-requests-limit` | `anthropic-ratelimit-requests-remaining` | `anthropic-ratelimit-requests-reset`: an RFC 3339 instant, `2026-01-01T00:00:10Z` |
//! | OpenAI | `x-ratelimit-limit-requests` | `x-ratelimit-remaining-requests` | `x-ratelimit-reset-requests`: a duration, `1s`, `6m0s`, `547ms`, `2m52.8s` |
//!
//! A value longer than 64 bytes, malformed, negative, overflowing, or a reset more than a day
//! away counts as absent.

mod budget;
mod gate;
mod limit;
mod ratelimit;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::StatusCode;
use tokio::time::{Instant, Sleep};

pub use self::budget::BudgetConfig;
pub use self::gate::GateConfig;
pub(crate) use self::gate::{GateWait, PastDeadline};
pub use self::limit::PacingConfig;
use self::limit::Turn;

use self::budget::SharedBudget;
use self::gate::Gate;
use self::limit::Pacer;
use crate::retry::RetryPolicy;

/// The fleet state that requests on one key share: the retry budget, the cooldown gate and
/// the adaptive pacing, built once and handed to every layer (or middleware) whose requests
/// go out under that key.
///
/// A `Fleet` is a handle: its clones share one state. Hand one to
/// [`RetryLayer::fleet`](crate::RetryLayer::fleet) of every stack that sends on the key (a
/// hyper client and a reqwest-middleware client of one process, say), and they keep one
/// budget, close one gate and keep one pace. A layer given none builds its own
/// ([`Fleet::default`]), shared by the services it makes and by its clones, however they are
/// re-configured.
///
/// The state can be read while requests run: [`gate_closed_until`](Fleet::gate_closed_until),
/// [`pace`](Fleet::pace), [`pacing_refused`](Fleet::pacing_refused),
/// [`budget_stats`](Fleet::budget_stats).
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<FleetState>,
}

/// What the handles of one fleet share.
struct FleetState {
    budget: Option<(BudgetConfig, SharedBudget)>,
    gate: Option<Gate>,
    pacer: Option<Pacer>,
}

/// Builds a [`Fleet`]; see [`Fleet::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct FleetBuilder {
    budget: Option<BudgetConfig>,
    gate: Option<GateConfig>,
    pacing: Option<PacingConfig>,
}

impl FleetBuilder {
    /// The retry budget: retries beyond it are not made, and the trail says so. `None` turns
    /// it off. Defaults to [`BudgetConfig::default`]: a 10 s window, 10 retries a second plus
    /// 20 % of first attempts.
    pub fn budget(mut self, budget: Option<BudgetConfig>) -> Self {
        self.budget = budget;
        self
    }

    /// The cooldown gate: a `429` / `529` with `Retry-After`, or rate-limit headers saying
    /// nothing is left, hold every attempt until then, and release them spread out. See
    /// [`GateConfig`]. Defaults to `None` (off).
    pub fn cooldown_gate(mut self, gate: Option<GateConfig>) -> Self {
        self.gate = gate;
        self
    }

    /// Adaptive pacing: attempts leave evenly spaced at a rate that grows with successes and
    /// shrinks on `429` / overload, the rest waiting their turn in arrival order. See
    /// [`PacingConfig`]. Defaults to `None` (off).
    pub fn pacing(mut self, pacing: Option<PacingConfig>) -> Self {
        self.pacing = pacing;
        self
    }

    /// The fleet, its state new.
    pub fn build(self) -> Fleet {
        Fleet {
            inner: Arc::new(FleetState {
                budget: self.budget.map(|c| (c, c.build())),
                gate: self.gate.map(Gate::new),
                pacer: self.pacing.map(Pacer::new),
            }),
        }
    }
}

impl Default for FleetBuilder {
    fn default() -> Self {
        FleetBuilder {
            budget: Some(BudgetConfig::default()),
            gate: None,
            pacing: None,
        }
    }
}

impl Default for Fleet {
    /// The default budget, no gate, no pacing: what a layer given no fleet builds.
    fn default() -> Self {
        Fleet::builder().build()
    }
}

/// What the retry budget of a fleet has counted since the fleet was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct BudgetStats {
    /// First attempts, each a deposit.
    pub first_attempts: u64,
    /// Retries the budget paid for.
    pub retries: u64,
    /// Retries the budget refused (each a request that gave up with
    /// [`GiveUpReason::Budget`](crate::GiveUpReason::Budget)).
    pub refused: u64,
}

impl Fleet {
    /// A builder with the defaults: the default budget, no gate, no pacing.
    pub fn builder() -> FleetBuilder {
        FleetBuilder::default()
    }

    /// Whether `self` and `other` are handles of one fleet.
    pub fn ptr_eq(&self, other: &Fleet) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The budget's settings, when it is on.
    pub fn budget_config(&self) -> Option<BudgetConfig> {
        self.inner.budget.as_ref().map(|(c, _)| *c)
    }

    /// What the budget has counted, when it is on.
    pub fn budget_stats(&self) -> Option<BudgetStats> {
        self.inner.budget.as_ref().map(|(_, b)| b.stats())
    }

    /// The gate's settings, when it is on.
    pub fn gate_config(&self) -> Option<GateConfig> {
        self.inner.gate.as_ref().map(|g| g.config.clone())
    }

    /// When the cooldown gate reopens, while it is closed; `None` when it is open (or off).
    /// Waiters leave from then on, spread out.
    pub fn gate_closed_until(&self) -> Option<Instant> {
        self.inner.gate.as_ref()?.closed_until()
    }

    /// How many times the gate was closed, or its closing extended, when it is on.
    pub fn gate_closings(&self) -> Option<u64> {
        self.inner.gate.as_ref().map(|g| g.closings())
    }

    /// The pacing's settings, when it is on.
    pub fn pacing_config(&self) -> Option<PacingConfig> {
        self.inner.pacer.as_ref().map(|p| p.config())
    }

    /// The current pacing rate, in requests per second, when pacing is on.
    pub fn pace(&self) -> Option<f64> {
        self.inner.pacer.as_ref().map(|p| p.rate())
    }

    /// How many attempts gave up because their pacing turn would come later than they may
    /// wait, when pacing is on.
    pub fn pacing_refused(&self) -> Option<u64> {
        self.inner.pacer.as_ref().map(|p| p.refused())
    }

    fn gate(&self) -> Option<&Gate> {
        self.inner.gate.as_ref()
    }

    fn pacer(&self) -> Option<&Pacer> {
        self.inner.pacer.as_ref()
    }

    /// A place in the pacing line for the next attempt, when pacing is on. It waits for its
    /// turn no longer than `policy`'s Retry-After ceiling, nor past `deadline`. Dropping it
    /// before its turn leaves the line.
    pub(crate) fn ticket(&self, policy: &RetryPolicy, deadline: Option<Instant>) -> Option<Ticket> {
        let pacer = self.pacer()?;
        let now = Instant::now();
        // A ceiling set to "forever" must not overflow the instant.
        let ceiling = now + policy.get_retry_after_max().min(MAX_PACING_WAIT);
        Some(Ticket {
            fleet: self.clone(),
            n: pacer.ticket(),
            done: false,
            joined: false,
            since: now,
            give_up_at: deadline.map_or(ceiling, |d| d.min(ceiling)),
            by_deadline: deadline.is_some_and(|d| d <= ceiling),
            sleep: None,
        })
    }

    /// The current pacing rate, for the retry loop's trace events.
    pub(crate) fn pacing_rate(&self) -> Option<f64> {
        self.pace()
    }

    /// An attempt sent in `epoch` succeeded.
    pub(crate) fn paced_success(&self) {
        if let Some(p) = self.pacer() {
            p.on_success();
        }
    }

    /// An attempt sent in `epoch` was refused for load.
    pub(crate) fn paced_refusal(&self, epoch: u64, retry_after: Option<Duration>) {
        if let Some(p) = self.pacer() {
            p.on_refusal(epoch, retry_after);
        }
    }

    /// A first attempt is about to be sent.
    pub(crate) fn deposit(&self) {
        if let Some((_, budget)) = &self.inner.budget {
            budget.deposit();
        }
    }

    /// A retry is planned: may it be made?
    pub(crate) fn withdraw(&self) -> bool {
        self.inner.budget.as_ref().is_none_or(|(_, b)| b.withdraw())
    }

    /// Tells the fleet what a response said. The gate: a `429` / `529` with `Retry-After`, or
    /// rate-limit headers saying no request is left (the wait is capped at `policy`'s
    /// Retry-After ceiling). The pacing: a stated request limit.
    pub(crate) fn observe(
        &self,
        head: &http::response::Parts,
        retry_after: Option<Duration>,
        policy: &RetryPolicy,
    ) {
        // Pacing: a stated request limit caps the rate.
        if let Some(pacer) = self.pacer() {
            if let Some(limit) = ratelimit::requests_limit(&head.headers) {
                pacer.on_limit(limit);
            }
        }
        let Some(gate) = self.gate() else {
            return;
        };
        let ceiling = policy.get_retry_after_max();
        let status = head.status.as_u16();
        if status == StatusCode::TOO_MANY_REQUESTS.as_u16()
            || status == crate::classify::STATUS_OVERLOADED
        {
            if let Some(wait) = retry_after.filter(|w| *w >= gate.config.get_min_close()) {
                gate.close(Instant::now(), wait.min(ceiling));
            }
        }
        if gate.config.reads_rate_limit_headers() {
            let h = &head.headers;
            if h.contains_key(ratelimit::ANTHROPIC_REQUESTS_REMAINING)
                || h.contains_key(ratelimit::OPENAI_REQUESTS_REMAINING)
            {
                if let Some(wait) = ratelimit::requests_exhausted_for(h, gate.config.now()) {
                    gate.close(Instant::now(), wait.min(ceiling));
                }
            }
        }
    }
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.inner;
        f.debug_struct("Fleet")
            .field("budget", &s.budget.as_ref().map(|(c, b)| (c, b.stats())))
            .field("gate", &s.gate)
            .field("pacer", &s.pacer)
            .finish()
    }
}

/// The longest an attempt waits in the pacing line, whatever its policy's ceiling.
const MAX_PACING_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

/// A place in the pacing line.
pub(crate) struct Ticket {
    fleet: Fleet,
    n: u64,
    /// Served, or given up: out of the line.
    done: bool,
    /// Polled once: the expected wait is judged as it joins.
    joined: bool,
    since: Instant,
    /// The latest instant its turn may come.
    give_up_at: Instant,
    /// That instant is the request's deadline.
    by_deadline: bool,
    // The instant to look again (its turn, a check on the head, its bound); allocated only
    // when it has to wait.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Ticket {
    /// Ready with the pacing epoch once the turn has come (the ticket is then used up), or
    /// with the refusal once it is known that the turn would come after the ticket's bound:
    /// on joining, when the wait expected at the rate of the moment is longer; at the head,
    /// when its instant is later; behind others, when the bound comes. The ticket has then
    /// left the line.
    pub(crate) fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Result<u64, PacingRefused>> {
        let pacer = self.fleet.pacer().expect("tickets come from a pacer");
        loop {
            let joining = !std::mem::replace(&mut self.joined, true);
            let turn = pacer.poll_turn(self.n, cx.waker());
            let now = Instant::now();
            let left = self.give_up_at.saturating_duration_since(now);
            let wake_at = match turn {
                Turn::Go(epoch) => {
                    self.done = true;
                    self.sleep = None;
                    return Poll::Ready(Ok(epoch));
                }
                Turn::Wait(at) if at > self.give_up_at => {
                    let wait = at.saturating_duration_since(now);
                    return Poll::Ready(Err(self.refuse(Some(wait), left)));
                }
                Turn::Wait(at) => at,
                Turn::Queued { wait, .. } if joining && wait > left => {
                    return Poll::Ready(Err(self.refuse(Some(wait), left)));
                }
                Turn::Queued { .. } if left.is_zero() => {
                    return Poll::Ready(Err(self.refuse(None, left)));
                }
                Turn::Queued { check, .. } => {
                    check.map_or(self.give_up_at, |c| c.min(self.give_up_at))
                }
            };
            let sleep = match &mut self.sleep {
                Some(sleep) => {
                    if sleep.deadline() != wake_at {
                        sleep.as_mut().reset(wake_at);
                    }
                    sleep
                }
                None => self
                    .sleep
                    .insert(Box::pin(tokio::time::sleep_until(wake_at))),
            };
            std::task::ready!(sleep.as_mut().poll(cx));
        }
    }

    /// Leaves the line, counted as given up.
    fn refuse(&mut self, expected: Option<Duration>, left: Duration) -> PacingRefused {
        self.done = true;
        self.sleep = None;
        let pacer = self.fleet.pacer().expect("tickets come from a pacer");
        let refused_total = pacer.refuse(self.n);
        let refused = PacingRefused {
            expected,
            left,
            bound: self.give_up_at.saturating_duration_since(self.since),
            by_deadline: self.by_deadline,
        };
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        tracing::warn!(
            expected_ms = expected.map(ms),
            bound_ms = ms(refused.bound),
            rate = pacer.rate(),
            refused_total,
            "giving up on LLM request: its pacing turn is further off than it may wait"
        );
        refused
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            if let Some(p) = self.fleet.pacer() {
                p.abandon(self.n);
            }
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("n", &self.n)
            .field("give_up_at", &self.give_up_at)
            .finish()
    }
}

/// Why an attempt left the pacing line: its turn would come later than it may wait. The
/// source of an [`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong) error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PacingRefused {
    /// How far off its turn was, when that was known (not when its bound ran out in line).
    expected: Option<Duration>,
    /// What was left of its bound.
    left: Duration,
    /// How long it could wait in all, from joining.
    bound: Duration,
    /// The bound was the request's deadline (not its policy's ceiling).
    by_deadline: bool,
}

impl PacingRefused {
    /// Whether the bound that ran out was the request's deadline.
    pub(crate) fn by_deadline(&self) -> bool {
        self.by_deadline
    }
}

impl std::fmt::Display for PacingRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.expected {
            Some(turn) => write!(
                f,
                "pacing turn {turn:?} away, with {:?} left of the {:?} the request may wait",
                self.left, self.bound
            ),
            None => write!(
                f,
                "no pacing turn within the {:?} the request may wait",
                self.bound
            ),
        }
    }
}

impl std::error::Error for PacingRefused {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    #[tokio::test(start_paused = true)]
    async fn a_ticket_whose_turn_is_past_its_bound_is_refused_on_joining_and_counted() {
        // One turn a second; a policy that lets an attempt wait 2 s.
        let fleet = Fleet::builder()
            .budget(None)
            .pacing(Some(PacingConfig::new().rates(1.0, 1.0, 1.0).unwrap()))
            .build();
        let policy = RetryPolicy::default().retry_after_max(Duration::from_secs(2));
        let mut cx = Context::from_waker(Waker::noop());
        let secs = Duration::from_secs;
        let mut first = fleet.ticket(&policy, None).unwrap();
        assert_eq!(first.poll_turn(&mut cx), Poll::Ready(Ok(0)));
        // The head's turn is 1 s off; the next is expected in 2 s, exactly the bound.
        let mut head = fleet.ticket(&policy, None).unwrap();
        assert!(head.poll_turn(&mut cx).is_pending());
        let mut behind = fleet.ticket(&policy, None).unwrap();
        assert!(behind.poll_turn(&mut cx).is_pending());
        // The one after would wait 3 s.
        let mut late = fleet.ticket(&policy, None).unwrap();
        let refused = PacingRefused {
            expected: Some(secs(3)),
            left: secs(2),
            bound: secs(2),
            by_deadline: false,
        };
        assert_eq!(late.poll_turn(&mut cx), Poll::Ready(Err(refused)));
        assert_eq!(
            refused.to_string(),
            "pacing turn 3s away, with 2s left of the 2s the request may wait"
        );
        assert_eq!(fleet.pacing_refused(), Some(1));
        // A deadline nearer than the ceiling bounds the wait instead.
        let forever = RetryPolicy::default().retry_after_max(Duration::MAX);
        let soon = Instant::now() + Duration::from_millis(2_500);
        let mut hurried = fleet.ticket(&forever, Some(soon)).unwrap();
        match hurried.poll_turn(&mut cx) {
            Poll::Ready(Err(refused)) => assert!(refused.by_deadline()),
            other => panic!("expected a refusal by the deadline, got {other:?}"),
        }
        assert_eq!(fleet.pacing_refused(), Some(2));
        // A ceiling of "forever" neither overflows nor refuses.
        let mut patient = fleet.ticket(&forever, None).unwrap();
        assert!(patient.poll_turn(&mut cx).is_pending());
        // Those refused left the line: the others keep their turns, one a second.
        tokio::time::advance(secs(1)).await;
        assert_eq!(head.poll_turn(&mut cx), Poll::Ready(Ok(0)));
        tokio::time::advance(secs(1)).await;
        assert_eq!(behind.poll_turn(&mut cx), Poll::Ready(Ok(0)));
        tokio::time::advance(secs(1)).await;
        assert_eq!(patient.poll_turn(&mut cx), Poll::Ready(Ok(0)));
        assert_eq!(fleet.pacing_refused(), Some(2));
    }

    #[test]
    fn the_refusal_reads_when_the_bound_ran_out_in_line() {
        let refused = PacingRefused {
            expected: None,
            left: Duration::ZERO,
            bound: Duration::from_secs(5),
            by_deadline: false,
        };
        assert_eq!(
            refused.to_string(),
            "no pacing turn within the 5s the request may wait"
        );
    }
}
