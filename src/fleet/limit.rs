//! Adaptive pacing: the rate at which the attempts of one layer are sent, learned from the
//! server's answers (additive increase, multiplicative decrease, on a rate).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::retry::ConfigError;

/// Settings of the adaptive pacing shared by every service of one
/// [`RetryLayer`](crate::RetryLayer).
///
/// Attempts leave one after another, `1 / rate` apart, in arrival order; an attempt whose turn
/// has not come waits for it. The rate adapts the way TCP's window does: until the first
/// refusal each success adds 1 request/s (slow start: the rate doubles every second of
/// successes); after it each success adds `growth` request/s (the rate grows by `growth` of
/// itself per second); a `429` or an overload multiplies it by `decrease` (by at most 0.5 for
/// the first one, which ends slow start and its overshoot), once per round: a refusal of an
/// attempt sent before the last decrease is not counted again.
///
/// Why a rate and not a burst: a fleet whose requests start together comes back together,
/// and a server's limiter (a token bucket, a window) refuses the part of each burst above its
/// capacity even when the average is well within it. Evenly spaced attempts let the fleet
/// settle at what the server admits.
///
/// Defaults: start at 50 requests/s, between 1 and 10,000; `decrease` 0.95; `growth` 0.05.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacingConfig {
    initial: f64,
    min: f64,
    max: f64,
    decrease: f64,
    growth: f64,
}

impl Default for PacingConfig {
    fn default() -> Self {
        PacingConfig {
            initial: 50.0,
            min: 1.0,
            max: 10_000.0,
            decrease: 0.95,
            growth: 0.05,
        }
    }
}

impl PacingConfig {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// The rate to start from and its bounds, in requests per second:
    /// `0 < min <= initial <= max`, all finite. Defaults to 50, 1 and 10,000.
    pub fn rates(mut self, initial: f64, min: f64, max: f64) -> Result<Self, ConfigError> {
        let ok = [initial, min, max].iter().all(|r| r.is_finite())
            && min > 0.0
            && min <= initial
            && initial <= max;
        if !ok {
            return Err(ConfigError::new(format!(
                "pacing rates need 0 < min <= initial <= max, got {min}, {initial}, {max}"
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

    /// The rate it starts from.
    pub fn initial(&self) -> f64 {
        self.initial
    }
}

struct State {
    rate: f64,
    /// The earliest instant the next turn may be taken.
    next_time: Option<Instant>,
    /// Tickets are handed out in arrival order and served in that order.
    next_ticket: u64,
    serving: u64,
    /// Tickets whose holders left the line before their turn.
    abandoned: BTreeSet<u64>,
    /// Bumped by every decrease.
    epoch: u64,
    slow_start: bool,
}

impl State {
    fn skip_abandoned(&mut self) {
        while self.abandoned.remove(&self.serving) {
            self.serving += 1;
        }
    }
}

/// The shared pacer.
pub(crate) struct Pacer {
    config: PacingConfig,
    state: Mutex<State>,
}

impl fmt::Debug for Pacer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pacer")
            .field("config", &self.config)
            .field("rate", &self.rate())
            .finish()
    }
}

/// What [`Pacer::poll_turn`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Go now; the attempt belongs to this epoch.
    Go(u64),
    /// Not yet: look again at this instant (a later estimate if the rate fell meanwhile).
    Wait(Instant),
}

impl Pacer {
    pub(crate) fn new(config: PacingConfig) -> Self {
        Pacer {
            config,
            state: Mutex::new(State {
                rate: config.initial,
                next_time: None,
                next_ticket: 0,
                serving: 0,
                abandoned: BTreeSet::new(),
                epoch: 0,
                slow_start: true,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn config(&self) -> PacingConfig {
        self.config
    }

    /// The current rate, in requests per second.
    pub(crate) fn rate(&self) -> f64 {
        self.lock().rate
    }

    /// A place in line.
    pub(crate) fn ticket(&self) -> u64 {
        let mut s = self.lock();
        let t = s.next_ticket;
        s.next_ticket += 1;
        t
    }

    /// Whether `ticket`'s turn has come. Turns are `1 / rate` apart and taken in ticket
    /// order; a waiter's estimate follows the current rate, so a slowdown reaches the whole
    /// line at once rather than only those who arrive after it.
    pub(crate) fn poll_turn(&self, ticket: u64) -> Turn {
        let now = Instant::now();
        let mut s = self.lock();
        s.skip_abandoned();
        let gap = Duration::from_secs_f64(1.0 / s.rate);
        let head = s.next_time.map_or(now, |t| t.max(now));
        if ticket <= s.serving && head <= now {
            s.serving = s.serving.max(ticket) + 1;
            s.next_time = Some(head + gap);
            return Turn::Go(s.epoch);
        }
        let ahead = ticket.saturating_sub(s.serving) as u32;
        Turn::Wait(head + gap * ahead)
    }

    /// The holder of `ticket` left the line before its turn.
    pub(crate) fn abandon(&self, ticket: u64) {
        let mut s = self.lock();
        if ticket >= s.serving {
            s.abandoned.insert(ticket);
            s.skip_abandoned();
        }
    }

    /// A success.
    pub(crate) fn on_success(&self) {
        let mut s = self.lock();
        let step = if s.slow_start {
            1.0
        } else {
            self.config.growth
        };
        s.rate = (s.rate + step).min(self.config.max);
    }

    /// A refusal (`429`, `529`, an overload) of an attempt sent in `epoch`.
    pub(crate) fn on_refusal(&self, epoch: u64) {
        let mut s = self.lock();
        if epoch < s.epoch {
            return;
        }
        s.epoch += 1;
        // Leaving slow start, the rate has overshot by up to a round of doubling: halve it,
        // as TCP does, before the gentle decreases take over.
        let factor = if s.slow_start {
            self.config.decrease.min(0.5)
        } else {
            self.config.decrease
        };
        s.slow_start = false;
        s.rate = (s.rate * factor).max(self.config.min);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(PacingConfig::new().rates(0.0, 0.0, 1.0).is_err());
        assert!(PacingConfig::new().rates(5.0, 6.0, 10.0).is_err());
        assert!(PacingConfig::new().rates(11.0, 1.0, 10.0).is_err());
        assert!(PacingConfig::new().rates(f64::NAN, 1.0, 10.0).is_err());
        assert!(PacingConfig::new().decrease(1.0).is_err());
        assert!(PacingConfig::new().decrease(0.0).is_err());
        assert!(PacingConfig::new().growth(0.0).is_err());
        assert!(PacingConfig::new().growth(2.0).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn turns_are_spaced_by_the_rate_in_ticket_order() {
        let p = Pacer::new(PacingConfig::new().rates(10.0, 1.0, 100.0).unwrap());
        let t0 = Instant::now();
        let tickets: Vec<_> = (0..4).map(|_| p.ticket()).collect();
        // The first goes at once; the others are told when to look again.
        assert_eq!(p.poll_turn(tickets[0]), Turn::Go(0));
        assert_eq!(
            p.poll_turn(tickets[2]),
            Turn::Wait(t0 + Duration::from_millis(200))
        );
        assert_eq!(
            p.poll_turn(tickets[1]),
            Turn::Wait(t0 + Duration::from_millis(100))
        );
        tokio::time::advance(Duration::from_millis(100)).await;
        // Not ticket 2's turn while ticket 1 has not gone.
        assert!(matches!(p.poll_turn(tickets[2]), Turn::Wait(_)));
        assert_eq!(p.poll_turn(tickets[1]), Turn::Go(0));
        // Ticket 2 leaves the line: ticket 3 moves up.
        p.abandon(tickets[2]);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(p.poll_turn(tickets[3]), Turn::Go(0));
        // A slowdown pushes back the estimate of everyone in line.
        let t = p.ticket();
        let behind = p.ticket();
        let before = p.poll_turn(behind);
        p.on_refusal(0);
        let after = p.poll_turn(behind);
        match (before, after) {
            (Turn::Wait(b), Turn::Wait(a)) => assert!(a > b),
            other => panic!("{other:?}"),
        }
        // After a quiet spell, the head of the line goes at once, and the next waits its gap.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(p.poll_turn(t), Turn::Go(1));
        assert!(matches!(p.poll_turn(behind), Turn::Wait(_)));
    }

    #[test]
    fn increase_and_decrease() {
        let p = Pacer::new(
            PacingConfig::new()
                .rates(10.0, 2.0, 12.0)
                .unwrap()
                .decrease(0.5)
                .unwrap()
                .growth(0.5)
                .unwrap(),
        );
        // Slow start: one request/s per success, up to the maximum.
        for _ in 0..5 {
            p.on_success();
        }
        assert_eq!(p.rate(), 12.0);
        p.on_refusal(0);
        assert_eq!(p.rate(), 6.0);
        // Attempts sent before that decrease do not count again.
        p.on_refusal(0);
        assert_eq!(p.rate(), 6.0);
        // Then growth is the configured step.
        p.on_success();
        assert_eq!(p.rate(), 6.5);
        // Never below min.
        for e in 1..=10 {
            p.on_refusal(e);
        }
        assert_eq!(p.rate(), 2.0);
    }
}
