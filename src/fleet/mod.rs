//! Fleet behaviour: every service made from one [`RetryLayer`](crate::RetryLayer) shares a
//! retry budget and, opt-in, a cooldown gate, so that many requests on one API key behave as
//! a well-mannered fleet rather than a retry storm.
//!
//! Per-request retry alone turns an overload into a storm: each failed request retries, the
//! retries add load, and an exact `Retry-After` sends everyone back in the same instant.
//!
//! - **Retry budget** ([`BudgetConfig`], on by default): every first attempt deposits, every
//!   retry withdraws; retries the budget cannot pay for are not made. With the defaults,
//!   retries add at most 20 % to the load, plus 10 a second. The accounting is
//!   [`tower::retry::budget::TpsBudget`].
//! - **Cooldown gate** ([`GateConfig`], off by default): a `429` or `529` with `Retry-After`,
//!   or rate-limit headers saying no request is left ([`ratelimit`]), close the gate until
//!   then; attempts about to be sent wait at the gate instead of hammering, and leave spread
//!   over a window once it reopens. An open gate costs a request one atomic load.
//! - **Adaptive pacing** ([`PacingConfig`], off by default): attempts leave evenly spaced, in
//!   arrival order, at a rate learned from the answers: slow start until the first refusal,
//!   then a small increase per success and a multiplicative decrease per `429` or overload;
//!   a long `Retry-After` is read as a quota and sets the rate that spreads it over its
//!   cycle. A fleet whose requests start together otherwise comes back together, and a
//!   server's limiter refuses the part of every burst above its capacity even when the
//!   average fits.
//!
//! The state lives in an `Arc` created when the layer is built: the services a layer makes,
//! and their clones, share it; two layers built separately do not.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_llm_retry::fleet::{BudgetConfig, GateConfig, PacingConfig};
//! use tower_llm_retry::RetryLayer;
//!
//! # fn main() -> Result<(), tower_llm_retry::retry::ConfigError> {
//! // One layer per API key; every service built from it shares the budget and the gate.
//! let layer = RetryLayer::new()
//!     .budget(Some(BudgetConfig::new(Duration::from_secs(10), 5, 0.1)?))
//!     .cooldown_gate(Some(GateConfig::new().spread(0.5, Duration::from_secs(10))?))
//!     .pacing(Some(PacingConfig::new()));
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! # Why the gate and the pacing are opt-in
//!
//! One gate, and one pace, hold every request of their layer. That is right when the layer's
//! requests share a rate limit (one key, one upstream), and wrong when one layer fronts
//! several providers or keys: a `429` from one would hold the others. Build one layer per key,
//! then turn them on.
//!
//! # Differences from `tower::retry` with a budget
//!
//! - The budget is wired in: deposits on first attempts, a withdrawal before each retry, and
//!   a refusal that is visible in the [`RetryTrail`](crate::RetryTrail)
//!   ([`GiveUpReason::Budget`](crate::GiveUpReason::Budget)).
//! - The gate has no counterpart in `tower::retry`, which knows no HTTP.

mod budget;
mod gate;
mod limit;
pub mod ratelimit;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::StatusCode;
use tokio::time::{Instant, Sleep};

pub use self::budget::BudgetConfig;
pub use self::gate::GateConfig;
pub(crate) use self::gate::{GateStop, GateWait};
pub use self::limit::PacingConfig;
use self::limit::Turn;

use self::budget::SharedBudget;
use self::gate::Gate;
use self::limit::Pacer;
use crate::retry::RetryPolicy;

/// The state every service of one layer shares.
#[derive(Debug)]
pub(crate) struct Fleet {
    budget: Option<(BudgetConfig, SharedBudget)>,
    gate: Option<Gate>,
    pacer: Option<Pacer>,
}

impl Fleet {
    pub(crate) fn new(
        budget: Option<BudgetConfig>,
        gate: Option<GateConfig>,
        pacing: Option<PacingConfig>,
    ) -> Arc<Self> {
        Arc::new(Fleet {
            budget: budget.map(|c| (c, c.build())),
            gate: gate.map(Gate::new),
            pacer: pacing.map(Pacer::new),
        })
    }

    pub(crate) fn budget_config(&self) -> Option<BudgetConfig> {
        self.budget.as_ref().map(|(c, _)| *c)
    }

    pub(crate) fn gate_config(&self) -> Option<GateConfig> {
        self.gate.as_ref().map(|g| g.config.clone())
    }

    /// When the cooldown gate reopens, while it is closed.
    pub(crate) fn gate_closed_until(&self) -> Option<Instant> {
        self.gate.as_ref()?.closed_until()
    }

    pub(crate) fn pacing_config(&self) -> Option<PacingConfig> {
        self.pacer.as_ref().map(|p| p.config())
    }

    /// The current pacing rate, in requests per second, when pacing is on.
    pub(crate) fn pacing_rate(&self) -> Option<f64> {
        self.pacer.as_ref().map(|p| p.rate())
    }

    /// A place in the pacing line for the next attempt, when pacing is on. Dropping it before
    /// its turn leaves the line.
    pub(crate) fn ticket(self: &Arc<Self>) -> Option<Ticket> {
        let n = self.pacer.as_ref()?.ticket();
        Some(Ticket {
            fleet: self.clone(),
            n,
            served: false,
            sleep: None,
        })
    }

    /// An attempt sent in `epoch` succeeded.
    pub(crate) fn paced_success(&self) {
        if let Some(p) = &self.pacer {
            p.on_success();
        }
    }

    /// An attempt sent in `epoch` was refused for load.
    pub(crate) fn paced_refusal(&self, epoch: u64, retry_after: Option<Duration>) {
        if let Some(p) = &self.pacer {
            p.on_refusal(epoch, retry_after);
        }
    }

    /// A first attempt is about to be sent.
    pub(crate) fn deposit(&self) {
        if let Some((_, budget)) = &self.budget {
            budget.deposit();
        }
    }

    /// A retry is planned: may it be made?
    pub(crate) fn withdraw(&self) -> bool {
        self.budget.as_ref().is_none_or(|(_, b)| b.withdraw())
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
        if let Some(pacer) = &self.pacer {
            if let Some(limit) = ratelimit::requests_limit(&head.headers) {
                pacer.on_limit(limit);
            }
        }
        let Some(gate) = &self.gate else {
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

/// A place in the pacing line.
pub(crate) struct Ticket {
    fleet: Arc<Fleet>,
    n: u64,
    served: bool,
    // The head of the line waits for its instant; allocated only then.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Ticket {
    /// Ready with the pacing epoch once the turn has come (the ticket is then used up).
    pub(crate) fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<u64> {
        let pacer = self
            .fleet
            .pacer
            .as_ref()
            .expect("tickets come from a pacer");
        loop {
            match pacer.poll_turn(self.n, cx.waker()) {
                Turn::Go(epoch) => {
                    self.served = true;
                    self.sleep = None;
                    return Poll::Ready(epoch);
                }
                Turn::Queued => return Poll::Pending,
                Turn::Wait(at) => {
                    let sleep = match &mut self.sleep {
                        Some(sleep) => {
                            if sleep.deadline() != at {
                                sleep.as_mut().reset(at);
                            }
                            sleep
                        }
                        None => self.sleep.insert(Box::pin(tokio::time::sleep_until(at))),
                    };
                    std::task::ready!(sleep.as_mut().poll(cx));
                }
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.served {
            if let Some(p) = &self.fleet.pacer {
                p.abandon(self.n);
            }
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("n", &self.n).finish()
    }
}
