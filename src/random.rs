//! The source of randomness behind jitter and the cooldown gate's spread, shared by the
//! retry policy and the fleet.

use std::fmt;
use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// The source of the uniform samples behind jitter.
///
/// Defaults to the thread-local generator; tests give a seeded one, or a fixed value, to assert
/// exact sleeps.
#[derive(Clone)]
pub struct Random {
    source: Option<Arc<dyn Fn() -> f64 + Send + Sync>>,
}

impl Random {
    /// The thread-local generator of the `rand` crate.
    pub fn thread_rng() -> Self {
        Random { source: None }
    }

    /// A deterministic generator seeded with `seed`, shared by every clone of this value.
    pub fn seeded(seed: u64) -> Self {
        let rng = Arc::new(Mutex::new(StdRng::seed_from_u64(seed)));
        Random::from_fn(move || {
            let mut rng = rng.lock().unwrap_or_else(|e| e.into_inner());
            rng.random::<f64>()
        })
    }

    /// Samples from `f`, which must return values in `[0, 1)`; others are clamped into it.
    pub fn from_fn(f: impl Fn() -> f64 + Send + Sync + 'static) -> Self {
        Random {
            source: Some(Arc::new(f)),
        }
    }

    pub(crate) fn sample(&self) -> f64 {
        let u = match &self.source {
            Some(f) => f(),
            None => rand::rng().random::<f64>(),
        };
        if u.is_nan() {
            0.0
        } else {
            u.clamp(0.0, 1.0)
        }
    }
}

impl Default for Random {
    fn default() -> Self {
        Self::thread_rng()
    }
}

impl fmt::Debug for Random {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.source.is_some() {
            "Random(custom)"
        } else {
            "Random(thread_rng)"
        })
    }
}
