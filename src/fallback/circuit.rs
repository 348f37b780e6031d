//! A circuit per fallback target, shared by every service of one layer.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;

/// The settings of the circuit [`ModelFallbackLayer::circuit`](super::ModelFallbackLayer::circuit)
/// gives every target of its chain.
///
/// After `failures` failures of the layer's trigger classes within `window`, a target opens
/// for `cooldown`: requests start on the next target at once. Then one request at a time
/// probes it (half-open) while the others keep using the next target; a good probe closes
/// the circuit, a failed one opens it again for twice the last cooldown, up to
/// `max_cooldown`.
///
/// | setting | default |
/// |---|---|
/// | failures | 5 |
/// | window | 30 s |
/// | cooldown | 30 s |
/// | max cooldown | 5 min |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Circuit {
    pub(crate) failures: u32,
    pub(crate) window: Duration,
    pub(crate) cooldown: Duration,
    pub(crate) max_cooldown: Duration,
}

impl Default for Circuit {
    fn default() -> Self {
        Circuit {
            failures: 5,
            window: Duration::from_secs(30),
            cooldown: Duration::from_secs(30),
            max_cooldown: Duration::from_secs(300),
        }
    }
}

impl Circuit {
    /// The defaults: 5 failures in 30 s open a target for 30 s, doubling up to 5 minutes.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many failures within the window open the circuit; at least 1. Defaults to 5.
    pub fn failures(mut self, n: u32) -> Self {
        self.failures = n;
        self
    }

    /// How far back failures count. Defaults to 30 s.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How long an opened circuit stays open before its first probe; more than zero.
    /// Defaults to 30 s.
    pub fn cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = cooldown;
        self
    }

    /// The longest cooldown that failed probes double up to. Set below the cooldown, it is
    /// the cooldown (the bound wins: a failed probe reopens for the cooldown again).
    /// Defaults to 5 minutes.
    pub fn max_cooldown(mut self, max: Duration) -> Self {
        self.max_cooldown = max;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.failures == 0 {
            return Err(ConfigError::new(
                "the circuit's failure count must be at least 1",
            ));
        }
        if self.window.is_zero() {
            return Err(ConfigError::new(
                "the circuit's window must be more than zero",
            ));
        }
        if self.cooldown.is_zero() {
            return Err(ConfigError::new(
                "the circuit's cooldown must be more than zero",
            ));
        }
        Ok(())
    }
}

/// The state of one target's circuit, as [`ModelFallbackLayer::circuit_states`](super::ModelFallbackLayer::circuit_states)
/// reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CircuitState {
    /// Requests go to the target.
    Closed,
    /// Requests skip the target until the cooldown ends.
    Open {
        /// What is left of the cooldown.
        remaining: Duration,
    },
    /// The cooldown ended: one request at a time probes the target.
    HalfOpen {
        /// A probe is in flight.
        probing: bool,
    },
}

impl CircuitState {
    /// Whether requests go to the target (closed), rather than skip it or probe it.
    pub fn is_closed(&self) -> bool {
        matches!(self, CircuitState::Closed)
    }
}

/// How a target may take a request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Closed: go.
    Go,
    /// Half-open: go, as the one probe.
    Probe,
    /// Open, or half-open with a probe in flight: skip it.
    Skip,
}

/// One target's circuit.
pub(crate) struct TargetCircuit {
    /// The success path's only look: a closed circuit is one atomic load.
    closed: AtomicBool,
    inner: Mutex<Inner>,
}

struct Inner {
    state: State,
    // Failures within the window, oldest first (only while closed).
    recent: VecDeque<Instant>,
    // The cooldown of the next opening.
    cooldown: Option<Duration>,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { probing: bool },
}

impl Default for TargetCircuit {
    fn default() -> Self {
        TargetCircuit {
            closed: AtomicBool::new(true),
            inner: Mutex::new(Inner {
                state: State::Closed,
                recent: VecDeque::new(),
                cooldown: None,
            }),
        }
    }
}

impl TargetCircuit {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a request may go to the target now, claiming the probe when it is due.
    pub(crate) fn admit(&self, now: Instant, target: &str) -> Admit {
        if self.closed.load(Ordering::Acquire) {
            return Admit::Go;
        }
        let mut inner = self.lock();
        match inner.state {
            State::Closed => Admit::Go,
            State::Open { until } if now >= until => {
                inner.state = State::HalfOpen { probing: true };
                tracing::info!(target = target, "circuit half-open: probing the target");
                Admit::Probe
            }
            State::HalfOpen { probing: false } => {
                inner.state = State::HalfOpen { probing: true };
                Admit::Probe
            }
            State::Open { .. } | State::HalfOpen { probing: true } => Admit::Skip,
        }
    }

    /// A response from the target that is no failure of a trigger class.
    pub(crate) fn succeeded(&self, probe: bool, target: &str) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let mut inner = self.lock();
        if probe && matches!(inner.state, State::HalfOpen { .. }) {
            inner.state = State::Closed;
            inner.recent.clear();
            inner.cooldown = None;
            self.closed.store(true, Ordering::Release);
            tracing::info!(target = target, "circuit closed: the probe succeeded");
        }
    }

    /// A failure of a trigger class at the target.
    pub(crate) fn failed(&self, probe: bool, now: Instant, config: &Circuit, target: &str) {
        let mut inner = self.lock();
        match inner.state {
            State::Closed => {
                let since = now.checked_sub(config.window);
                while inner
                    .recent
                    .front()
                    .is_some_and(|&t| since.is_some_and(|s| t <= s))
                {
                    inner.recent.pop_front();
                }
                inner.recent.push_back(now);
                if inner.recent.len() >= config.failures as usize {
                    let cooldown = config.cooldown;
                    inner.cooldown = Some(cooldown);
                    inner.recent.clear();
                    inner.state = State::Open {
                        until: crate::time::after(now, cooldown),
                    };
                    self.closed.store(false, Ordering::Release);
                    tracing::warn!(
                        target = target,
                        failures = config.failures,
                        window_ms = config.window.as_millis() as u64,
                        cooldown_ms = cooldown.as_millis() as u64,
                        "circuit opened: requests skip the target"
                    );
                }
            }
            State::HalfOpen { .. } if probe => {
                let last = inner.cooldown.unwrap_or(config.cooldown);
                // A `max_cooldown` set below the cooldown is the cooldown: no doubling.
                let cooldown = last
                    .saturating_mul(2)
                    .min(config.max_cooldown.max(config.cooldown));
                inner.cooldown = Some(cooldown);
                inner.state = State::Open {
                    until: crate::time::after(now, cooldown),
                };
                tracing::warn!(
                    target = target,
                    cooldown_ms = cooldown.as_millis() as u64,
                    "circuit reopened: the probe failed"
                );
            }
            // Answers to requests sent before the circuit opened decide nothing.
            State::Open { .. } | State::HalfOpen { .. } => {}
        }
    }

    /// A probe that ended without an answer (the caller went away): the next request probes.
    pub(crate) fn release_probe(&self) {
        let mut inner = self.lock();
        if let State::HalfOpen { probing: true } = inner.state {
            inner.state = State::HalfOpen { probing: false };
        }
    }

    /// The state now.
    pub(crate) fn state(&self, now: Instant) -> (CircuitState, Option<Duration>) {
        let inner = self.lock();
        let state = match inner.state {
            State::Closed => CircuitState::Closed,
            State::Open { until } if until > now => CircuitState::Open {
                remaining: until - now,
            },
            State::Open { .. } => CircuitState::HalfOpen { probing: false },
            State::HalfOpen { probing } => CircuitState::HalfOpen { probing },
        };
        (state, inner.cooldown)
    }
}

impl fmt::Debug for TargetCircuit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TargetCircuit")
            .field("state", &self.lock().state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Circuit {
        Circuit::new()
            .failures(2)
            .window(Duration::from_secs(10))
            .cooldown(Duration::from_secs(5))
            .max_cooldown(Duration::from_secs(12))
    }

    #[test]
    fn opens_after_f_failures_within_the_window_only() {
        let c = TargetCircuit::default();
        let t0 = Instant::now();
        c.failed(false, t0, &config(), "t");
        // The second failure comes after the first left the window.
        c.failed(false, t0 + Duration::from_secs(10), &config(), "t");
        assert_eq!(c.admit(t0 + Duration::from_secs(10), "t"), Admit::Go);
        c.failed(false, t0 + Duration::from_secs(11), &config(), "t");
        assert_eq!(c.admit(t0 + Duration::from_secs(11), "t"), Admit::Skip);
        assert_eq!(
            c.state(t0 + Duration::from_secs(12)).0,
            CircuitState::Open {
                remaining: Duration::from_secs(4)
            }
        );
    }

    #[test]
    fn one_probe_at_a_time_and_the_cooldown_doubles_up_to_the_bound() {
        let cfg = config();
        let c = TargetCircuit::default();
        let t0 = Instant::now();
        c.failed(false, t0, &cfg, "t");
        c.failed(false, t0, &cfg, "t");
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(c.admit(t1, "t"), Admit::Probe);
        assert_eq!(c.admit(t1, "t"), Admit::Skip);
        c.failed(true, t1, &cfg, "t");
        assert_eq!(c.state(t1).1, Some(Duration::from_secs(10)));
        let t2 = t1 + Duration::from_secs(10);
        assert_eq!(c.admit(t2 - Duration::from_millis(1), "t"), Admit::Skip);
        assert_eq!(c.admit(t2, "t"), Admit::Probe);
        c.failed(true, t2, &cfg, "t");
        assert_eq!(c.state(t2).1, Some(Duration::from_secs(12)), "bounded");
        let t3 = t2 + Duration::from_secs(12);
        assert_eq!(c.admit(t3, "t"), Admit::Probe);
        c.release_probe();
        assert_eq!(
            c.admit(t3, "t"),
            Admit::Probe,
            "a dropped probe frees the slot"
        );
        c.succeeded(true, "t");
        assert_eq!(c.state(t3).0, CircuitState::Closed);
        assert_eq!(c.admit(t3, "t"), Admit::Go);
    }

    #[test]
    fn validation() {
        assert!(Circuit::new().validate().is_ok());
        assert!(Circuit::new().failures(0).validate().is_err());
        assert!(Circuit::new().cooldown(Duration::ZERO).validate().is_err());
        assert!(Circuit::new().window(Duration::ZERO).validate().is_err());
        // Two bounds set across each other settle on the bound.
        assert!(Circuit::new()
            .max_cooldown(Duration::from_secs(1))
            .validate()
            .is_ok());
    }

    #[test]
    fn a_max_cooldown_below_the_cooldown_reopens_for_the_cooldown() {
        let cfg = config()
            .cooldown(Duration::from_secs(5))
            .max_cooldown(Duration::from_secs(1));
        let c = TargetCircuit::default();
        let t0 = Instant::now();
        c.failed(false, t0, &cfg, "t");
        c.failed(false, t0, &cfg, "t");
        assert_eq!(c.admit(t0, "t"), Admit::Skip);
        // The probe after the 5 s cooldown fails: open for 5 s again, not 1 s, not 10 s.
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(c.admit(t1, "t"), Admit::Probe);
        c.failed(true, t1, &cfg, "t");
        assert_eq!(
            c.state(t1).0,
            CircuitState::Open {
                remaining: Duration::from_secs(5)
            }
        );
    }
}
