//! A place in a fleet's pacing line: the local line, or a turn of the schedule shared
//! through the fleet's store.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use super::limit::Turn;
use super::pacing::RemoteOutcome;
use super::store::{RemoteTurn, REMOTE_EPOCH};
use super::Fleet;

/// The longest an attempt waits in the pacing line, whatever its policy's ceiling.
pub(super) const MAX_PACING_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

/// A place in the pacing line.
pub(crate) struct Ticket {
    pub(super) fleet: Fleet,
    /// Its place in the local line, once it joined it.
    pub(super) n: Option<u64>,
    /// Its turn of the schedule shared through the store, while it waits for it.
    pub(super) remote: Option<RemoteTurn>,
    /// Served, or given up: out of the line.
    pub(super) done: bool,
    /// Polled once: the expected wait is judged as it joins.
    pub(super) joined: bool,
    pub(super) since: Instant,
    /// The latest instant its turn may come.
    pub(super) give_up_at: Instant,
    /// That instant is the request's deadline.
    pub(super) by_deadline: bool,
    // The instant to look again (its turn, a check on the head, its bound); allocated only
    // when it has to wait.
    pub(super) sleep: Option<Pin<Box<Sleep>>>,
}

impl Ticket {
    /// The turn came: a warm-up counts the attempt as it goes, for the share of refusals a
    /// burst shows (counted on joining, those queued behind would dilute it).
    fn sent(&self) {
        if let Some(pacer) = self.fleet.pacer().filter(|p| p.is_warming()) {
            pacer.dormant_send();
        }
    }

    /// Ready with the pacing epoch once the turn has come (the ticket is then used up), or
    /// with the refusal once it is known that the turn would come after the ticket's bound:
    /// on joining, when the wait expected at the rate of the moment is longer; at the head,
    /// when its instant is later; behind others, when the bound comes. The ticket has then
    /// left the line.
    pub(crate) fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Result<u64, PacingRefused>> {
        if let Some(remote) = &mut self.remote {
            let outcome = std::task::ready!(remote.poll(cx));
            self.remote = None;
            match outcome {
                RemoteOutcome::Go(epoch) => {
                    self.done = true;
                    self.sent();
                    return Poll::Ready(Ok(epoch | REMOTE_EPOCH));
                }
                RemoteOutcome::TooFar(wait) => {
                    let left = self.give_up_at.saturating_duration_since(Instant::now());
                    return Poll::Ready(Err(self.refuse(Some(wait), left)));
                }
                // Redis did not answer in time: the local line, at once.
                RemoteOutcome::Failed => {}
            }
        }
        let pacer = self.fleet.pacer().expect("tickets come from a pacer");
        let n = *self.n.get_or_insert_with(|| pacer.ticket());
        loop {
            let joining = !std::mem::replace(&mut self.joined, true);
            let turn = pacer.poll_turn(n, cx.waker());
            let now = Instant::now();
            let left = self.give_up_at.saturating_duration_since(now);
            let wake_at = match turn {
                Turn::Go(epoch) => {
                    self.done = true;
                    self.sleep = None;
                    self.sent();
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
        let refused_total = match self.n {
            Some(n) => pacer.refuse(n),
            None => pacer.count_refused(),
        };
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
        if let (false, Some(n), Some(p)) = (self.done, self.n, self.fleet.pacer()) {
            p.abandon(n);
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

    use crate::fleet::{Limits, PacingConfig};
    use crate::random::Random;

    fn limits(retry_after_max: Duration, random: &Random) -> Limits<'_> {
        Limits {
            retry_after_max,
            ignores_above_ceiling: false,
            random,
            backoff: Duration::ZERO,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_ticket_whose_turn_is_past_its_bound_is_refused_on_joining_and_counted() {
        // One turn a second; a policy that lets an attempt wait 2 s.
        let fleet = Fleet::builder()
            .budget(None)
            .pacing(Some(
                PacingConfig::new()
                    .dormant(false)
                    .burst(Duration::ZERO)
                    .unwrap()
                    .rates(1.0, 1.0, 1.0)
                    .unwrap(),
            ))
            .build();
        let random = Random::default();
        let policy = limits(Duration::from_secs(2), &random);
        let mut cx = Context::from_waker(Waker::noop());
        let secs = Duration::from_secs;
        let mut first = fleet.ticket(policy, None).unwrap();
        assert_eq!(first.poll_turn(&mut cx), Poll::Ready(Ok(0)));
        // The head's turn is 1 s off; the next is expected in 2 s, exactly the bound.
        let mut head = fleet.ticket(policy, None).unwrap();
        assert!(head.poll_turn(&mut cx).is_pending());
        let mut behind = fleet.ticket(policy, None).unwrap();
        assert!(behind.poll_turn(&mut cx).is_pending());
        // The one after would wait 3 s.
        let mut late = fleet.ticket(policy, None).unwrap();
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
        let forever = limits(Duration::MAX, &random);
        let soon = Instant::now() + Duration::from_millis(2_500);
        let mut hurried = fleet.ticket(forever, Some(soon)).unwrap();
        match hurried.poll_turn(&mut cx) {
            Poll::Ready(Err(refused)) => assert!(refused.by_deadline()),
            other => panic!("expected a refusal by the deadline, got {other:?}"),
        }
        assert_eq!(fleet.pacing_refused(), Some(2));
        // A ceiling of "forever" neither overflows nor refuses.
        let mut patient = fleet.ticket(forever, None).unwrap();
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
