use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tower_layer::Layer;

use super::circuit::{Circuit, CircuitState, TargetCircuit};
use super::{FallbackMode, ModelFallback, Target};
use crate::classify::FailureClass;
use crate::error::ConfigError;
use crate::pipeline::Failed;

/// Applies [`ModelFallback`] to a service: after a number of consecutive overloads, the next
/// attempt goes to the next model of a chain. See the [module docs](crate::fallback).
///
/// All clones of one layer, and every service it builds, share one sticky state and one
/// circuit per target.
#[derive(Clone)]
#[must_use]
pub struct ModelFallbackLayer {
    pub(crate) config: Config,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) chain: Arc<[Target]>,
    pub(crate) triggers: Triggers,
    pub(crate) circuit: Option<Circuit>,
    pub(crate) circuits: Arc<[TargetCircuit]>,
    pub(crate) sticky: Option<Duration>,
    pub(crate) mode: FallbackMode,
    pub(crate) state: Arc<Sticky>,
}

impl ModelFallbackLayer {
    /// A layer falling back along `chain`, in order: model names, or [`Target`]s (a model
    /// on another upstream, with its own credential). Fails when the chain is empty or names
    /// an empty model.
    pub fn new<I, M>(chain: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = M>,
        M: Into<Target>,
    {
        let chain: Vec<Target> = chain.into_iter().map(Into::into).collect();
        if chain.is_empty() {
            return Err(ConfigError::new("the fallback chain names no model"));
        }
        if chain.iter().any(|t| t.model.is_empty()) {
            return Err(ConfigError::new("the fallback chain names an empty model"));
        }
        let circuits: Vec<TargetCircuit> = chain.iter().map(|_| TargetCircuit::default()).collect();
        Ok(ModelFallbackLayer {
            config: Config {
                chain: chain.into(),
                triggers: Triggers::default(),
                circuit: None,
                circuits: circuits.into(),
                sticky: None,
                mode: FallbackMode::Rewrite,
                state: Arc::new(Sticky::default()),
            },
        })
    }

    /// How many consecutive overloads of one request move it to the next model; at least 1.
    /// Defaults to 3.
    pub fn threshold(mut self, n: u32) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::new(
                "the fallback threshold must be at least 1",
            ));
        }
        self.config.triggers.overloads = n;
        Ok(self)
    }

    /// Also moves a request on after `n` consecutive retryable failures of any class: `5xx`,
    /// `408`, `409`, `429`, transport errors, head timeouts, idle stalls and first-output
    /// timeouts before the commit point, truncated bodies. At least 1; 1 falls over after the first failure. Defaults to
    /// off.
    pub fn after_failures(mut self, n: u32) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::new(
                "the failure trigger must count at least 1 failure",
            ));
        }
        self.config.triggers.failures = Some(n);
        Ok(self)
    }

    /// Also moves a request on after `n` consecutive timeouts: no response head within the
    /// policy's [`head_timeout`](crate::RetryPolicy::head_timeout), a body that stalled past
    /// the [`idle_timeout`](crate::RetryPolicy::idle_timeout) before the commit point, an
    /// event stream with no output within the
    /// [`first_output_timeout`](crate::RetryPolicy::first_output_timeout), or a `408`. At
    /// least 1; 1 falls over after the first timeout. Defaults to off.
    pub fn after_timeouts(mut self, n: u32) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::new(
                "the timeout trigger must count at least 1 timeout",
            ));
        }
        self.config.triggers.timeouts = Some(n);
        Ok(self)
    }

    /// Also moves a request on after `n` consecutive attempts that failed to connect: the
    /// connection was refused, the name did not resolve, the TLS handshake failed, or an
    /// inner service said [`RequestNotSent`](crate::classify::RequestNotSent); whatever
    /// [`Classify::request_not_sent`](crate::classify::Classify::request_not_sent) calls an
    /// error before any byte of the request was sent (an HTTP/2 refusal on a connection that
    /// was up is re-sent at once instead, and is not one). At least 1; 1 falls over after
    /// the first. Defaults to off.
    pub fn after_connect_failures(mut self, n: u32) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::new(
                "the connect-failure trigger must count at least 1 failure",
            ));
        }
        self.config.triggers.connects = Some(n);
        Ok(self)
    }

    /// Also moves a request on at once at a rate limit with nowhere to wait: a `429` with no
    /// `Retry-After` (the server names no time at which waiting would help), one above the
    /// policy's [`retry_after_max`](crate::RetryPolicy::retry_after_max) or past what is left
    /// of the request's [deadline](crate::RetryPolicy::deadline) (the retry goes to the next
    /// target instead of giving up), or one met while every key of an [`ApiKeyPool`] inside
    /// rests. At the last target the policy goes on as without the trigger. Defaults to off.
    ///
    #[cfg_attr(feature = "auth", doc = "[`ApiKeyPool`]: crate::auth::ApiKeyPool")]
    #[cfg_attr(not(feature = "auth"), doc = "[`ApiKeyPool`]: crate#features")]
    pub fn on_unwaitable_rate_limit(mut self, on: bool) -> Self {
        self.config.triggers.unwaitable = on;
        self
    }

    /// Gives every target of the chain a circuit, shared by all services of this layer: see
    /// [`Circuit`]. A request for a model that is not in the chain has no circuit for that
    /// model; put the primary first in the chain to give it one. Fails when the circuit's
    /// settings are out of range. Defaults to none.
    pub fn circuit(mut self, circuit: Circuit) -> Result<Self, ConfigError> {
        circuit.validate()?;
        self.config.circuit = Some(circuit);
        Ok(self)
    }

    /// The state of every target's circuit, in chain order: for metrics and readiness. Every
    /// target reads [`CircuitState::Closed`] when no circuit is configured.
    pub fn circuit_states(&self) -> Vec<TargetStatus> {
        let now = Instant::now();
        self.config
            .chain
            .iter()
            .zip(self.config.circuits.iter())
            .map(|(target, circuit)| {
                let (state, cooldown) = circuit.state(now);
                TargetStatus {
                    model: target.model.clone(),
                    upstream: target.get_upstream().cloned(),
                    state,
                    cooldown,
                }
            })
            .collect()
    }

    /// Sticky mode: once a request of a model has fallen back, later requests for that model
    /// start at the same fallback for `cooldown`, and only then try the requested model again.
    /// Only in [`FallbackMode::Rewrite`]. Defaults to off.
    pub fn sticky(mut self, cooldown: Duration) -> Self {
        self.config.sticky = Some(cooldown);
        self
    }

    /// Whether to rewrite the model or signal the caller. Defaults to
    /// [`FallbackMode::Rewrite`].
    pub fn mode(mut self, mode: FallbackMode) -> Self {
        self.config.mode = mode;
        self
    }
}

impl<S> Layer<S> for ModelFallbackLayer {
    type Service = ModelFallback<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ModelFallback::from_config(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for ModelFallbackLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelFallbackLayer")
            .field("chain", &self.chain)
            .field("triggers", &self.triggers)
            .field("circuit", &self.circuit)
            .field("sticky", &self.sticky)
            .field("mode", &self.mode)
            .finish()
    }
}

impl Config {
    /// Where `model` is in the chain, if it is: a request for it falls back to the targets
    /// after it, and uses its circuit.
    pub(crate) fn own(&self, model: &str) -> Option<usize> {
        self.chain.iter().position(|t| t.model == model)
    }

    /// The targets a request for a model at `own` falls back to, in order.
    pub(crate) fn fallbacks(&self, own: Option<usize>) -> &[Target] {
        &self.chain[own.map_or(0, |i| i + 1)..]
    }

    /// The chain index of the target at `level` for a request at `own`: `level` 0 is the
    /// requested model itself.
    pub(crate) fn index(&self, own: Option<usize>, level: usize) -> Option<usize> {
        match level {
            0 => own,
            l => Some(own.map_or(0, |i| i + 1) + l - 1).filter(|&i| i < self.chain.len()),
        }
    }
}

/// One target and its circuit, as [`ModelFallbackLayer::circuit_states`] reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TargetStatus {
    /// The target's model.
    pub model: String,
    /// The target's upstream, when it has its own.
    pub upstream: Option<http::Uri>,
    /// Its circuit's state.
    pub state: CircuitState,
    /// The cooldown of the circuit's current or last opening; `None` while it has not opened
    /// since it last closed.
    pub cooldown: Option<Duration>,
}

/// The failure classes that move a request to the next target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Triggers {
    pub(crate) overloads: u32,
    pub(crate) failures: Option<u32>,
    pub(crate) timeouts: Option<u32>,
    pub(crate) connects: Option<u32>,
    pub(crate) unwaitable: bool,
}

impl Default for Triggers {
    fn default() -> Self {
        Triggers {
            overloads: 3,
            failures: None,
            timeouts: None,
            connects: None,
            unwaitable: false,
        }
    }
}

/// Failures in a row at one target, by trigger.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Streak {
    overloads: u32,
    failures: u32,
    timeouts: u32,
    connects: u32,
}

/// What one failure comes to under the triggers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counted {
    /// A trigger fired: the next attempt goes to the next target.
    pub(crate) fires: bool,
    /// Which: the overload trigger (at the end of the chain, the response goes back as it is).
    pub(crate) by_overload: bool,
    /// The failure is of a trigger class (it counts against the target's circuit).
    pub(crate) of_trigger_class: bool,
}

impl Triggers {
    /// Counts `f` into `streak`.
    pub(crate) fn count(&self, streak: &mut Streak, f: &Failed) -> Counted {
        let overloaded = f.class == FailureClass::Overloaded;
        // The loop's classification: a custom classifier's verdict counts as it says.
        let retryable = f.retryable;
        streak.overloads = if overloaded { streak.overloads + 1 } else { 0 };
        streak.failures = if retryable { streak.failures + 1 } else { 0 };
        streak.timeouts = if f.timed_out { streak.timeouts + 1 } else { 0 };
        streak.connects = if f.connect_failed {
            streak.connects + 1
        } else {
            0
        };
        let by_overload = overloaded && streak.overloads >= self.overloads;
        let fires = by_overload
            || self.failures.is_some_and(|n| streak.failures >= n)
            || self.timeouts.is_some_and(|n| streak.timeouts >= n)
            || self.connects.is_some_and(|n| streak.connects >= n)
            || (self.unwaitable && f.unwaitable);
        let of_trigger_class = overloaded
            || (self.failures.is_some() && retryable)
            || (self.timeouts.is_some() && f.timed_out)
            || (self.connects.is_some() && f.connect_failed)
            || (self.unwaitable && f.unwaitable);
        if fires {
            *streak = Streak::default();
        }
        Counted {
            fires,
            by_overload,
            of_trigger_class,
        }
    }

    /// Replays a request's failures: the level its next attempt goes to, and the streak
    /// there. A trigger moves one target on from where the failure happened; a failure of no
    /// trigger class sends the request back to its own model; `last` is the deepest level.
    pub(crate) fn replay(&self, failures: &[Failed], last: usize) -> (usize, Streak) {
        self.replay_each(failures, last, |_| {})
    }

    /// [`replay`](Triggers::replay), telling `each` the level of every failed attempt.
    pub(crate) fn replay_each(
        &self,
        failures: &[Failed],
        last: usize,
        mut each: impl FnMut(usize),
    ) -> (usize, Streak) {
        let mut level = 0;
        let mut streak = Streak::default();
        for f in failures {
            let at = f.level.map_or(level, |l| l as usize).min(last);
            each(at);
            let counted = self.count(&mut streak, f);
            level = if counted.fires {
                (at + 1).min(last)
            } else if !counted.of_trigger_class {
                streak = Streak::default();
                0
            } else {
                at
            };
        }
        (level, streak)
    }
}

/// Which fallback each requested model is held at, and until when.
#[derive(Default)]
pub(crate) struct Sticky {
    levels: Mutex<HashMap<String, (usize, Instant)>>,
    // Whether the layer has warned that it runs outside `RetryLayer`.
    warned_outside: AtomicBool,
}

impl Sticky {
    /// Warns, once per layer, that a request came with no `AttemptContext`: the layer is not
    /// inside `RetryLayer`, so it never sees an overload count and never falls back.
    pub(crate) fn warn_outside_once(&self) {
        if !self.warned_outside.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "ModelFallbackLayer saw a request without an AttemptContext: it must sit inside \
                 RetryLayer to count overloads; until then it does not fall back as configured"
            );
        }
    }

    /// How far down its chain requests for `model` start now; 0 for the model itself.
    pub(crate) fn level(&self, model: &str, now: Instant) -> usize {
        let mut levels = self.levels.lock().unwrap_or_else(PoisonError::into_inner);
        match levels.get(model) {
            Some(&(level, until)) if until > now => level,
            Some(_) => {
                levels.remove(model);
                0
            }
            None => 0,
        }
    }

    /// Holds requests for `model` at `level` or further until `until`.
    pub(crate) fn raise(&self, model: &str, level: usize, until: Instant) {
        let mut levels = self.levels.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = levels.entry(model.to_owned()).or_insert((0, until));
        entry.0 = entry.0.max(level);
        entry.1 = until;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(class: FailureClass) -> Failed {
        // As the default classifier judges each class.
        let retryable = matches!(
            class,
            FailureClass::Transport
                | FailureClass::Timeout
                | FailureClass::Conflict
                | FailureClass::RateLimited
                | FailureClass::Overloaded
                | FailureClass::Server
                | FailureClass::TruncatedEnvelope
        );
        Failed {
            class,
            retryable,
            timed_out: false,
            connect_failed: false,
            unwaitable: false,
            level: None,
        }
    }

    #[test]
    fn a_replay_steps_at_each_trigger_and_goes_home_on_other_failures() {
        let triggers = Triggers::default();
        let o = failed(FailureClass::Overloaded);
        let s = failed(FailureClass::Server);
        assert_eq!(triggers.replay(&[o, o], 2).0, 0);
        assert_eq!(triggers.replay(&[o, o, o], 2).0, 1);
        assert_eq!(triggers.replay(&[o, o, o, o, o, o], 2).0, 2);
        assert_eq!(triggers.replay(&[o; 9], 2).0, 2, "never past the chain");
        // A 503 is no trigger class here: back to the requested model, count restarted.
        assert_eq!(triggers.replay(&[o, o, o, s], 2).0, 0);
        assert_eq!(triggers.replay(&[o, o, s, o], 2).0, 0);
    }

    #[test]
    fn a_replay_moves_on_from_where_the_failure_happened() {
        let triggers = Triggers {
            failures: Some(1),
            ..Triggers::default()
        };
        // The first attempt was sent straight to level 1 (a circuit skipped level 0).
        let at = |level| Failed {
            level: Some(level),
            ..failed(FailureClass::Server)
        };
        assert_eq!(triggers.replay(&[at(1)], 2).0, 2);
        let mut seen = Vec::new();
        triggers.replay_each(&[at(0), failed(FailureClass::Transport)], 3, |l| {
            seen.push(l)
        });
        assert_eq!(
            seen,
            [0, 1],
            "a failure without a level happened where the replay was"
        );
    }

    #[test]
    fn timeouts_and_unwaitable_rate_limits_count_only_when_configured() {
        let timeout = Failed {
            timed_out: true,
            ..failed(FailureClass::Transport)
        };
        let unwaitable = Failed {
            unwaitable: true,
            ..failed(FailureClass::RateLimited)
        };
        let none = Triggers::default();
        assert!(
            !none
                .count(&mut Streak::default(), &timeout)
                .of_trigger_class
        );
        assert!(!none.count(&mut Streak::default(), &unwaitable).fires);
        let on = Triggers {
            timeouts: Some(2),
            unwaitable: true,
            ..Triggers::default()
        };
        let mut streak = Streak::default();
        assert!(!on.count(&mut streak, &timeout).fires);
        assert!(on.count(&mut streak, &timeout).fires);
        assert!(on.count(&mut Streak::default(), &unwaitable).fires);
        // Never a trigger: a failure the loop does not retry.
        let all = Triggers {
            overloads: 1,
            failures: Some(1),
            timeouts: Some(1),
            connects: Some(1),
            unwaitable: true,
        };
        for class in [
            FailureClass::QuotaExhausted,
            FailureClass::Unauthorized,
            FailureClass::ContextOverflow,
            FailureClass::Client,
        ] {
            let c = all.count(&mut Streak::default(), &failed(class));
            assert!(!c.fires && !c.of_trigger_class, "{class:?}");
        }
    }

    #[test]
    fn connect_failures_count_in_a_row_only_when_configured() {
        let refused = Failed {
            connect_failed: true,
            ..failed(FailureClass::Transport)
        };
        let reset = failed(FailureClass::Transport);
        let none = Triggers::default();
        let c = none.count(&mut Streak::default(), &refused);
        assert!(!c.fires && !c.of_trigger_class);
        let two = Triggers {
            connects: Some(2),
            ..Triggers::default()
        };
        let mut streak = Streak::default();
        assert!(!two.count(&mut streak, &refused).fires);
        assert!(two.count(&mut streak, &refused).fires);
        // A reset after the request went out is no connect failure: the count starts over,
        // and the request goes home.
        assert_eq!(two.replay(&[refused, reset, refused], 1).0, 0);
        assert_eq!(two.replay(&[refused, refused], 1).0, 1);
    }
}
