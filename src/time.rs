//! Saturating time arithmetic.
//!
//! Durations reach the loop from configuration (`Duration::MAX` is a natural way to say "no
//! limit") and from servers (`Retry-After`, `expires_in`). `Instant + Duration` and
//! `Duration::mul_f64` panic on overflow, so every such sum goes through here and saturates.

use std::time::Duration;

use tokio::time::Instant;

/// The furthest ahead an instant is set: about 30 years, as tokio does for a sleep of
/// `Duration::MAX`. Far enough to mean "never" for any request.
pub(crate) const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `now + d`, saturating at [`FAR_FUTURE`] from `now`.
pub(crate) fn after(now: Instant, d: Duration) -> Instant {
    now + d.min(FAR_FUTURE)
}

/// `d × factor`, saturating at `Duration::MAX`; a negative or NaN factor gives zero.
pub(crate) fn mul_f64(d: Duration, factor: f64) -> Duration {
    let secs = d.as_secs_f64() * factor;
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates() {
        let now = Instant::now();
        assert_eq!(after(now, Duration::MAX), now + FAR_FUTURE);
        assert_eq!(
            after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        assert_eq!(mul_f64(Duration::MAX, 1.25), Duration::MAX);
        assert_eq!(mul_f64(Duration::from_secs(2), 0.5), Duration::from_secs(1));
        assert_eq!(mul_f64(Duration::from_secs(2), -1.0), Duration::ZERO);
        assert_eq!(mul_f64(Duration::from_secs(2), f64::NAN), Duration::ZERO);
        assert_eq!(
            mul_f64(Duration::from_secs(2), f64::INFINITY),
            Duration::MAX
        );
    }
}
