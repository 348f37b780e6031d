//! The request-body memory budget: the bytes of request bodies the proxy holds at once, over
//! every request being read or served.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;

/// The bytes every held request body may take together.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    limit: usize,
    used: AtomicUsize,
    gauge: Gauge,
}

impl BodyBudget {
    /// A budget of `limit` bytes, its use shown on `gauge`.
    pub(crate) fn new(limit: usize, gauge: Gauge) -> Arc<Self> {
        Arc::new(BodyBudget {
            limit,
            used: AtomicUsize::new(0),
            gauge,
        })
    }

    /// The bytes not held now.
    pub(crate) fn left(&self) -> usize {
        self.limit.saturating_sub(self.used.load(Ordering::Acquire))
    }

    /// An empty reservation, grown as a body arrives.
    pub(crate) fn reserve(self: &Arc<Self>) -> Reservation {
        Reservation {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

/// Bytes of the budget one request holds, given back when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl Reservation {
    /// Takes `n` more bytes; `false`, and nothing taken, when fewer than `n` are left.
    pub(crate) fn grow(&mut self, n: usize) -> bool {
        let b = &self.budget;
        let taken = b
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&u| u <= b.limit)
            })
            .is_ok();
        if taken {
            self.bytes += n;
            b.gauge.inc_by(n as i64);
        }
        taken
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
            self.budget.gauge.dec_by(self.bytes as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_limit_and_gives_back_on_drop() {
        let gauge = Gauge::default();
        let budget = BodyBudget::new(10, gauge.clone());
        let mut a = budget.reserve();
        assert!(a.grow(6));
        let mut b = budget.reserve();
        assert!(!b.grow(5), "6 + 5 is over 10");
        assert!(b.grow(4));
        assert_eq!((budget.left(), gauge.get()), (0, 10));
        assert!(!b.grow(1));
        drop(a);
        assert_eq!((budget.left(), gauge.get()), (6, 4));
        drop(b);
        assert_eq!((budget.left(), gauge.get()), (10, 0));
    }
}
