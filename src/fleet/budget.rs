//! The retry budget: tower's `TpsBudget`, with settings that are checked instead of asserted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower::retry::budget::{Budget, TpsBudget};

use super::BudgetStats;
use crate::error::ConfigError;

/// Settings of the retry budget of a [`Fleet`](crate::fleet::Fleet), shared by every request
/// sent through it.
///
/// Every first attempt deposits into the budget and every retry withdraws from it, so retries
/// can add at most `retry_ratio` to the load of first attempts, plus `min_per_sec` retries a
/// second for a fleet that sends little. In any window of `ttl`, at most
/// [`max_retries`](BudgetConfig::max_retries) retries are allowed. A retry the budget refuses is
/// not made: the last response is returned with a [`RetryTrail`](crate::RetryTrail) whose
/// [`gave_up`](crate::RetryTrail::gave_up) is [`GiveUpReason::Budget`](crate::retry::GiveUpReason),
/// or, when the last attempt got no response, the error is
/// [`ErrorKind::BudgetExhausted`](crate::ErrorKind::BudgetExhausted).
///
/// The accounting is [`tower::retry::budget::TpsBudget`]'s; the defaults are its defaults
/// (those of linkerd and Finagle): a 10 s window, 10 retries a second, 20 %.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetConfig {
    ttl: Duration,
    min_per_sec: u32,
    retry_ratio: f32,
}

impl BudgetConfig {
    /// A budget that remembers deposits for `ttl` (1 to 60 s), allows `min_per_sec` retries a
    /// second whatever the traffic, and `retry_ratio` retries per first attempt on top (0 to
    /// 1000; 0.2 is one retry per five requests).
    pub fn new(ttl: Duration, min_per_sec: u32, retry_ratio: f32) -> Result<Self, ConfigError> {
        if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(60) {
            return Err(ConfigError::new(format!(
                "budget ttl must be within [1 s, 60 s], got {ttl:?}"
            )));
        }
        if !(0.0..=1000.0).contains(&retry_ratio) {
            return Err(ConfigError::new(format!(
                "budget retry ratio must be within [0, 1000], got {retry_ratio}"
            )));
        }
        if min_per_sec >= i32::MAX as u32 {
            return Err(ConfigError::new(format!(
                "budget minimum retries per second is too large: {min_per_sec}"
            )));
        }
        Ok(BudgetConfig {
            ttl,
            min_per_sec,
            retry_ratio,
        })
    }

    /// How long a deposit counts.
    pub fn get_ttl(&self) -> Duration {
        self.ttl
    }

    /// Retries allowed each second whatever the traffic.
    pub fn get_min_per_sec(&self) -> u32 {
        self.min_per_sec
    }

    /// Retries allowed per first attempt.
    pub fn get_retry_ratio(&self) -> f32 {
        self.retry_ratio
    }

    /// The most retries this budget allows within one `ttl`, when `first_attempts` first
    /// attempts were made in it: `min_per_sec × ttl + retry_ratio × first_attempts`, rounded
    /// down the way `TpsBudget` rounds.
    pub fn max_retries(&self, first_attempts: u64) -> u64 {
        let (deposit, withdraw) = self.amounts();
        let reserve = u64::from(self.min_per_sec) * self.ttl.as_secs() * withdraw;
        (reserve + first_attempts * deposit) / withdraw
    }

    // The units `TpsBudget::new` uses for one deposit and one withdrawal.
    fn amounts(&self) -> (u64, u64) {
        let r = self.retry_ratio;
        if r == 0.0 {
            (0, 1)
        } else if r <= 1.0 {
            (1, (1.0 / r) as u64)
        } else {
            (1000, (1000.0 / r) as u64)
        }
    }

    pub(crate) fn build(&self) -> SharedBudget {
        SharedBudget {
            inner: TpsBudget::new(self.ttl, self.min_per_sec, self.retry_ratio),
            first_attempts: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }
}

impl Default for BudgetConfig {
    /// A 10 s window, 10 retries a second, and 20 % of first attempts.
    fn default() -> Self {
        BudgetConfig {
            ttl: Duration::from_secs(10),
            min_per_sec: 10,
            retry_ratio: 0.2,
        }
    }
}

/// The budget itself, shared through the fleet's `Arc`.
#[derive(Debug)]
pub(crate) struct SharedBudget {
    inner: TpsBudget,
    first_attempts: AtomicU64,
    retries: AtomicU64,
    refused: AtomicU64,
}

impl SharedBudget {
    pub(crate) fn deposit(&self) {
        self.first_attempts.fetch_add(1, Ordering::Relaxed);
        self.inner.deposit();
    }

    pub(crate) fn withdraw(&self) -> bool {
        let ok = self.inner.withdraw();
        self.count(ok);
        ok
    }

    /// Counts a retry paid for (or refused) by another budget in this one's stats.
    pub(crate) fn count(&self, paid: bool) {
        let counter = if paid { &self.retries } else { &self.refused };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> BudgetStats {
        BudgetStats {
            first_attempts: self.first_attempts.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(BudgetConfig::new(Duration::from_millis(999), 1, 0.2).is_err());
        assert!(BudgetConfig::new(Duration::from_secs(61), 1, 0.2).is_err());
        assert!(BudgetConfig::new(Duration::from_secs(10), 1, -0.1).is_err());
        assert!(BudgetConfig::new(Duration::from_secs(10), 1, f32::NAN).is_err());
        assert!(BudgetConfig::new(Duration::from_secs(10), 1, 1001.0).is_err());
        assert!(BudgetConfig::new(Duration::from_secs(10), u32::MAX, 0.2).is_err());
        assert!(BudgetConfig::new(Duration::from_secs(60), 0, 0.0).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn max_retries_matches_tps_budget() {
        for (min, ratio, deposits) in [(1, 0.1, 100), (10, 0.2, 37), (0, 0.0, 50), (2, 3.0, 7)] {
            let cfg = BudgetConfig::new(Duration::from_secs(10), min, ratio).unwrap();
            let budget = cfg.build();
            for _ in 0..deposits {
                budget.deposit();
            }
            let mut allowed = 0;
            while budget.withdraw() {
                allowed += 1;
            }
            assert_eq!(allowed, cfg.max_retries(deposits), "{cfg:?}, {deposits}");
        }
    }
}
