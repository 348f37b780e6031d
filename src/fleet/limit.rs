//! Adaptive pacing: the rate at which the attempts of one fleet are sent, learned from the
//! server's answers (additive increase, multiplicative decrease, on a rate), its quotas and
//! its stated limits.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::f64::consts::LN_2;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::pacing::{PacingConfig, PacingWake, MIN_RATE};

struct State {
    rate: f64,
    /// The earliest instant the next turn may be taken.
    next_time: Option<Instant>,
    /// Tickets are handed out in arrival order and called to the head in that order.
    next_ticket: u64,
    /// The first ticket not yet called to the head.
    serving: u64,
    /// Tickets not yet called whose holders left the line.
    abandoned: BTreeSet<u64>,
    /// The ticket whose turn is next, and the instant it was called to the head.
    head: Option<(u64, Instant)>,
    /// Heads passed over that came back: called next, ahead of everyone who came after them.
    returned: VecDeque<u64>,
    /// The holders behind the head, woken when they reach it or the place right behind it.
    waiting: BTreeMap<u64, Waker>,
    /// Heads passed over because they did not take their turn in time.
    passed: u64,
    /// Bumped by every decrease.
    epoch: u64,
    slow_start: bool,
    /// The cap a stated request limit sets, if a response stated one.
    stated: Option<f64>,
    /// Turns taken since `since` (the first turn, or the end of the last Retry-After), for
    /// the rate a quota's Retry-After implies.
    sent: u64,
    since: Option<Instant>,
    /// What the last quota signal taught, if any.
    quota: Option<Quota>,
    last_turn: Option<Instant>,
}

/// A quota learned from a long Retry-After: the rate it allows over its cycle.
#[derive(Debug, Clone, Copy)]
struct Quota {
    rate: f64,
    cycle: Duration,
    /// No growth before this instant: one whole cycle at the quota's rate.
    hold_until: Instant,
}

impl Quota {
    /// The highest rate allowed at `now`: none during the hold, then 25 % above the quota's
    /// rate, and 25 % more for each further cycle without a quota signal.
    fn ceiling(&self, now: Instant) -> Option<f64> {
        let past = now.checked_duration_since(self.hold_until)?;
        let cycles = (past.as_secs_f64() / self.cycle.as_secs_f64()).floor();
        Some(self.rate * QUOTA_GROWTH.powf(cycles.min(64.0) + 1.0))
    }
}

impl State {
    /// The highest rate allowed: the configured maximum, or a stated limit below it.
    fn ceiling(&self, config: &PacingConfig) -> f64 {
        self.stated.map_or(config.max, |c| c.min(config.max))
    }

    /// Whether anyone is in line: the pacing, not the demand, is what limits the sending.
    fn has_line(&self) -> bool {
        self.head.is_some()
    }

    fn head_ticket(&self) -> Option<u64> {
        self.head.map(|(t, _)| t)
    }

    /// The first ticket not yet called that is still in line, moving past those that left.
    fn first_uncalled(&mut self) -> Option<u64> {
        while self.abandoned.remove(&self.serving) {
            self.serving += 1;
        }
        (self.serving < self.next_ticket).then_some(self.serving)
    }

    /// The ticket right behind the head.
    fn on_deck(&mut self) -> Option<u64> {
        match self.returned.front() {
            Some(&t) => Some(t),
            None => self.first_uncalled(),
        }
    }

    /// The head and the one right behind it.
    fn front(&mut self) -> (Option<u64>, Option<u64>) {
        (self.head_ticket(), self.on_deck())
    }

    /// Calls the next in line to the head, as of `at`, when there is no head: heads passed
    /// over that came back first, then the others in arrival order.
    fn call_next(&mut self, at: Instant) {
        if self.head.is_some() {
            return;
        }
        let next = match self.returned.pop_front() {
            Some(t) => Some(t),
            None => {
                let t = self.first_uncalled();
                if t.is_some() {
                    self.serving += 1;
                }
                t
            }
        };
        self.head = next.map(|t| (t, at));
    }

    /// How many are ahead of `ticket` in line (0: it is the head), or `None` when it holds no
    /// place: it was passed over at the head and has not come back.
    fn position(&self, ticket: u64) -> Option<u64> {
        let head = self.head_ticket()?;
        if head == ticket {
            return Some(0);
        }
        if let Some(i) = self.returned.iter().position(|&t| t == ticket) {
            return Some(1 + i as u64);
        }
        if ticket < self.serving {
            return None;
        }
        let left = self.abandoned.range(self.serving..ticket).count() as u64;
        Some(1 + self.returned.len() as u64 + (ticket - self.serving) - left)
    }

    /// The instant from which the head may take its turn: its turn's, or the instant it was
    /// called, when that is later.
    fn head_due(&self) -> Option<Instant> {
        let (_, called) = self.head?;
        Some(self.next_time.map_or(called, |t| t.max(called)))
    }

    /// Passes over each head, other than `poller`, that has not taken its turn within
    /// [`HEAD_GRACE`] after it came; the next is called as of the instant the last one
    /// lapsed, so a run of heads that are not polled is passed over as if each had been
    /// looked at in time. The wakers of those passed over go to `discard`.
    fn pass_stale_heads(&mut self, now: Instant, poller: u64, discard: &mut Vec<Waker>) -> u64 {
        let mut passed = 0;
        while let (Some(head), Some(due)) = (self.head_ticket(), self.head_due()) {
            let lapsed = due + HEAD_GRACE;
            if head == poller || now < lapsed {
                break;
            }
            self.head = None;
            discard.extend(self.waiting.remove(&head));
            self.passed += 1;
            passed += 1;
            self.call_next(lapsed);
        }
        passed
    }

    /// The holders to wake when the front of the line changed from `before`: a new head (to
    /// go, or wait for its instant) and a new one right behind it (to watch the head's turn),
    /// other than `poller`, who is looking already.
    fn notify(
        &mut self,
        before: (Option<u64>, Option<u64>),
        poller: Option<u64>,
    ) -> [Option<Waker>; 2] {
        let after = self.front();
        let mut take = |now: Option<u64>, was: Option<u64>| {
            let t = now.filter(|&t| now != was && Some(t) != poller)?;
            self.waiting.remove(&t)
        };
        [take(after.0, before.0), take(after.1, before.1)]
    }
}

/// How long `turns` turns take, from one at `rate`: at that rate, or, during slow start, at a
/// rate that doubles every second up to `ceiling`.
fn time_for(turns: u64, rate: f64, ceiling: f64, slow_start: bool) -> f64 {
    let n = turns as f64;
    if !slow_start || rate >= ceiling {
        return n / rate;
    }
    // Doubling every second, `rate · (2^t − 1) / ln 2` turns are taken in the first t seconds.
    let to_ceiling = (ceiling - rate) / LN_2;
    if n <= to_ceiling {
        (1.0 + n * LN_2 / rate).log2()
    } else {
        (ceiling / rate).log2() + (n - to_ceiling) / ceiling
    }
}

/// The shared pacer.
pub(crate) struct Pacer {
    config: PacingConfig,
    state: Mutex<State>,
    // The last stated limit taken in (0: none), so that answers repeating it, as every
    // answer does, cost a load and not the lock. Written only under the lock, with the cap.
    stated_limit: AtomicU64,
    // Attempts that gave up because their turn would come later than they may wait.
    refused: AtomicU64,
    // Set once the pacing paces: from the start, or, when dormant, from the server's first
    // rate-limit signal, or while it warms a new scope up. Read on every attempt.
    awake: AtomicBool,
    // Set while a dormant pacing warms a new scope up: it paces, with no evidence of a limit
    // yet (see `PacingConfig::warm_up`). Read on every attempt while awake.
    warming: AtomicBool,
    // When the warm-up may end, if no one waits then: set by its first attempt.
    warm_until: std::sync::OnceLock<Instant>,
    // The factor a warm-up woken by a burst of refusals fell by, for the fleet's shared
    // schedule to fall by too (taken as the wake is told to the store).
    wake_factor: Mutex<Option<f64>>,
    // While dormant: the attempts sent, and samples of that count, for the rate to wake at.
    dormant_sends: AtomicU64,
    samples: Mutex<Samples>,
    // What woke it: 0 for nothing (asleep, or pacing from the start), else a cause's index + 1.
    woken_by: AtomicU8,
    // While dormant: the recent 429s, each with the count of attempts sent before it came,
    // for the share of refusals a burst shows.
    refusals: Mutex<VecDeque<(Instant, u64)>>,
}

impl fmt::Debug for Pacer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (rate, passed) = {
            let s = self.lock();
            (s.rate, s.passed)
        };
        f.debug_struct("Pacer")
            .field("config", &self.config)
            .field("rate", &rate)
            .field("refused", &self.refused())
            .field("passed", &passed)
            .finish()
    }
}

/// What [`Pacer::poll_turn`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Go now; the attempt belongs to this epoch.
    Go(u64),
    /// At the head of the line: go at this instant (look again then).
    Wait(Instant),
    /// Behind others: the waker given is woken when this ticket reaches the head, or the
    /// place right behind it.
    Queued {
        /// When to look again all the same, to pass over a head ahead that has not taken its
        /// turn (`None`: too far off to say).
        check: Option<Instant>,
        /// How long until this ticket's turn, at the rate of the moment (doubling, during
        /// slow start).
        wait: Duration,
    },
}

impl Pacer {
    pub(crate) fn new(config: PacingConfig) -> Self {
        let warming = config.dormant && !config.warm_up.is_zero();
        Pacer {
            config,
            state: Mutex::new(State {
                rate: config.initial,
                next_time: None,
                next_ticket: 0,
                serving: 0,
                abandoned: BTreeSet::new(),
                head: None,
                returned: VecDeque::new(),
                waiting: BTreeMap::new(),
                passed: 0,
                epoch: 0,
                slow_start: true,
                sent: 0,
                since: None,
                quota: None,
                last_turn: None,
                stated: None,
            }),
            stated_limit: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            awake: AtomicBool::new(!config.dormant || warming),
            warming: AtomicBool::new(warming),
            warm_until: std::sync::OnceLock::new(),
            wake_factor: Mutex::new(None),
            dormant_sends: AtomicU64::new(0),
            samples: Mutex::new(Samples::default()),
            woken_by: AtomicU8::new(0),
            refusals: Mutex::new(VecDeque::new()),
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

    /// How many attempts gave up because their turn would come later than they may wait.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// A place in line.
    pub(crate) fn ticket(&self) -> u64 {
        let mut s = self.lock();
        let t = s.next_ticket;
        s.next_ticket += 1;
        s.call_next(Instant::now());
        t
    }

    /// Whether `ticket`'s turn has come. Turns are `1 / rate` apart and taken in ticket
    /// order. Only the head of the line waits on the clock, for the instant the current rate
    /// gives; the others wait to be woken when the one ahead of them goes, so a change of
    /// rate reaches the whole line at once and the line moves at the rate of the moment.
    ///
    /// A head that does not take its turn within [`HEAD_GRACE`] after it came is passed over
    /// by the next one that looks (the one right behind it looks then); polled again, it
    /// comes back right behind the head of the moment.
    pub(crate) fn poll_turn(&self, ticket: u64, waker: &Waker) -> Turn {
        let now = Instant::now();
        let mut s = self.lock();
        let before = s.front();
        // Wakers are dropped after the lock is released.
        let mut discard = Vec::new();
        let passed = s.pass_stale_heads(now, ticket, &mut discard);
        let position = match s.position(ticket) {
            Some(p) => p,
            None => {
                s.returned.push_back(ticket);
                s.call_next(now);
                s.position(ticket)
                    .expect("a ticket that came back is in line")
            }
        };
        let turn = if position == 0 {
            discard.extend(s.waiting.remove(&ticket));
            let gap = Duration::from_secs_f64(1.0 / s.rate);
            // Turns keep to their schedule even when taken a little late (a timer fires on a
            // millisecond), so the average rate is the rate; after a quiet spell longer than
            // a gap the schedule starts again from now.
            let window = self.credit_window(gap);
            let head = match s.next_time {
                Some(t) if t + window > now => t,
                _ => now.checked_sub(window - gap).unwrap_or(now),
            };
            if head <= now {
                // Slow start: while the line is longer than the rate lets through and no
                // refusal has come, the rate doubles every second.
                if s.slow_start && s.on_deck().is_some() {
                    if let Some(last) = s.last_turn {
                        let dt = now
                            .saturating_duration_since(last)
                            .min(Duration::from_secs(1));
                        let ceiling = s.ceiling(&self.config);
                        s.rate = (s.rate * dt.as_secs_f64().exp2()).min(ceiling);
                    }
                }
                s.last_turn = Some(now);
                s.head = None;
                s.next_time = Some(head + Duration::from_secs_f64(1.0 / s.rate));
                s.sent += 1;
                s.since.get_or_insert(now);
                s.call_next(now);
                Turn::Go(s.epoch)
            } else {
                Turn::Wait(head)
            }
        } else {
            match s.waiting.get_mut(&ticket) {
                Some(w) if w.will_wake(waker) => {}
                Some(w) => discard.push(std::mem::replace(w, waker.clone())),
                None => {
                    s.waiting.insert(ticket, waker.clone());
                }
            }
            let due = s.head_due().expect("a line has a head");
            // The one right behind the head looks when the head's grace is over; those
            // further back when the one ahead of them should have gone, at the rate of the
            // moment (they are woken sooner when the line moves faster).
            let check = Duration::try_from_secs_f64((position - 1) as f64 / s.rate)
                .ok()
                .and_then(|ahead| due.checked_add(ahead + HEAD_GRACE));
            let gap = Duration::from_secs_f64(1.0 / s.rate);
            let window = self.credit_window(gap);
            let head = match s.next_time {
                Some(t) if t + window > now => t,
                _ => now.checked_sub(window - gap).unwrap_or(now),
            };
            let lead = if head >= now {
                (head - now).as_secs_f64()
            } else {
                -(now - head).as_secs_f64()
            };
            let after = time_for(position, s.rate, s.ceiling(&self.config), s.slow_start);
            let wait =
                Duration::try_from_secs_f64((lead + after).max(0.0)).unwrap_or(Duration::MAX);
            Turn::Queued { check, wait }
        };
        let wakes = s.notify(before, Some(ticket));
        drop(s);
        drop(discard);
        if passed > 0 {
            tracing::debug!(
                passed,
                "passed over the head of the pacing line: it did not take its turn"
            );
        }
        for w in wakes.into_iter().flatten() {
            w.wake();
        }
        turn
    }

    /// The holder of `ticket` left the line before its turn.
    pub(crate) fn abandon(&self, ticket: u64) {
        let mut s = self.lock();
        let before = s.front();
        let own = s.waiting.remove(&ticket);
        if s.head_ticket() == Some(ticket) {
            s.head = None;
            s.call_next(Instant::now());
        } else if let Some(i) = s.returned.iter().position(|&t| t == ticket) {
            s.returned.remove(i);
        } else if ticket >= s.serving {
            s.abandoned.insert(ticket);
        }
        // Otherwise it was passed over at the head and had not come back: it held no place.
        let wakes = s.notify(before, None);
        drop(s);
        drop(own);
        for w in wakes.into_iter().flatten() {
            w.wake();
        }
    }

    /// The holder of `ticket` gives up: its turn would come later than it may wait. It leaves
    /// the line; returns how many have given up so, in all.
    pub(crate) fn refuse(&self, ticket: u64) -> u64 {
        self.abandon(ticket);
        self.count_refused()
    }

    /// Counts an attempt that gave up on a turn of a schedule kept elsewhere (the fleet's,
    /// across processes); returns how many have given up so, in all.
    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    pub(crate) fn count_refused(&self) -> u64 {
        self.refused.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Sets the rate (within the configured bounds and any stated limit), out of slow start:
    /// the share of the fleet's rate this process keeps to when it loses touch with the
    /// others.
    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    pub(crate) fn set_rate(&self, rate: f64) {
        let mut s = self.lock();
        let ceiling = s.ceiling(&self.config);
        s.rate = rate.clamp(MIN_RATE, self.config.max).min(ceiling);
        s.slow_start = false;
    }

    /// A success. The rate grows only while someone is waiting in line (a fleet that sends
    /// less than its rate has not shown that the server takes more), and after a quota signal
    /// only as its ceiling allows.
    pub(crate) fn on_success(&self) {
        let mut s = self.lock();
        if !s.has_line() {
            return;
        }
        let ceiling = match s.quota {
            Some(q) => match q.ceiling(Instant::now()) {
                Some(c) => c.min(s.ceiling(&self.config)),
                None => return,
            },
            None => s.ceiling(&self.config),
        };
        if !s.slow_start && s.rate < ceiling {
            s.rate = (s.rate + self.config.growth).min(ceiling);
        }
    }

    /// A refusal (`429`) of an attempt sent in `epoch`, with the server's
    /// Retry-After if it gave one.
    ///
    /// A long Retry-After says more than "slower": it is a quota spent, to be renewed when
    /// the wait is over. The server took the `sent` attempts since the last renewal and takes
    /// no more for `retry_after`, so `sent / (elapsed + retry_after)` is the rate that spends
    /// the quota evenly over its cycle. The rate falls to that (when lower than the usual
    /// decrease) and holds there for one whole cycle after the renewal, then grows at most
    /// 25 % above it per cycle: a server that counts a quota per window is sent its quota
    /// spread over the window instead of in a burst at the window's start.
    pub(crate) fn on_refusal(&self, epoch: u64, retry_after: Option<Duration>) {
        self.on_refusal_by(epoch, retry_after, None);
    }

    /// [`on_refusal`](Pacer::on_refusal), the rate multiplied by at most `factor` (the share
    /// of its attempts the server admitted, when a burst of refusals measured it).
    fn on_refusal_by(&self, epoch: u64, retry_after: Option<Duration>, factor: Option<f64>) {
        let now = Instant::now();
        let mut s = self.lock();
        if epoch < s.epoch {
            return;
        }
        s.epoch += 1;
        // Leaving slow start, the rate has overshot by up to a round of doubling: halve it,
        // as TCP does, before the gentle decreases take over.
        // Measured, what the server admitted says how far (the refusal that ends slow start
        // only: the fleet's others are the usual decrease).
        let factor = if s.slow_start {
            self.config.decrease.min(0.5).min(factor.unwrap_or(1.0))
        } else {
            self.config.decrease
        };
        s.slow_start = false;
        let mut rate = s.rate * factor;
        let wait = retry_after.unwrap_or_default().min(MAX_INFORMED_WAIT);
        // A short Retry-After (a token bucket's next token, rounded up to a second) is no
        // quota. Nor is one that comes while the last quota's wait lasts: that quota is
        // already known, and the few turns since would read as a tiny one.
        let renewing = s.since.is_some_and(|since| since > now);
        if let Some(since) = s.since.filter(|_| wait >= MIN_INFORMED_WAIT && !renewing) {
            let cycle = now.saturating_duration_since(since) + wait;
            let informed = s.sent as f64 / cycle.as_secs_f64();
            rate = rate.min(informed);
            s.quota = Some(Quota {
                rate: informed.max(self.config.min),
                cycle,
                hold_until: now + wait + cycle,
            });
            s.sent = 0;
            s.since = Some(now + wait);
        }
        s.rate = rate.clamp(self.config.min, self.config.max);
        // A stated limit stands even below `min`.
        let ceiling = s.ceiling(&self.config);
        s.rate = s.rate.min(ceiling);
    }

    /// A response stated the request limit: `limit` per the configured period.
    pub(crate) fn on_limit(&self, limit: u64) {
        let Some(cap) = self.config.cap_for(limit) else {
            return;
        };
        // The rate never grows past the stated cap, so the same limit again changes nothing:
        // a load, not the lock.
        if self.stated_limit.load(Ordering::Relaxed) == limit {
            return;
        }
        #[cfg(test)]
        tests::before_limit_lock();
        // Not clamped to `min`: a key allowed fewer requests than that is paced at its limit.
        let mut s = self.lock();
        // The record of the last limit and the cap in force change together, under the lock:
        // were the record swapped before it, two limits arriving together could leave the
        // record saying one and the cap the other, and every later answer, matching the record,
        // would leave the stale cap in force.
        if self.stated_limit.load(Ordering::Relaxed) == limit {
            return;
        }
        self.stated_limit.store(limit, Ordering::Relaxed);
        s.stated = Some(cap);
        if s.rate > cap {
            s.rate = cap;
        }
    }
}

/// Timestamps of the count of attempts a dormant pacing saw go out.
#[derive(Debug, Default)]
struct Samples {
    /// The instant of the first attempt.
    first: Option<Instant>,
    /// `(instant, attempts before it)`, oldest first: the newest at least [`RATE_WINDOW`]
    /// old, and those after it.
    ring: VecDeque<(Instant, u64)>,
    /// The same, at least a second apart, over the last [`QUOTA_WINDOW`]: what a quota's
    /// `Retry-After` is read against, so a process that has run for hours is not read as
    /// having spent its quota over all of them.
    coarse: VecDeque<(Instant, u64)>,
}

/// Dormant pacing: it counts, then wakes on the server's first rate-limit signal.
impl Pacer {
    /// How far behind its schedule the line may fall and still take the turns it missed at
    /// once: one gap, or the configured burst.
    fn credit_window(&self, gap: Duration) -> Duration {
        gap.max(self.config.burst)
    }

    /// Whether the pacing paces (it is not dormant): one load.
    #[inline]
    pub(crate) fn is_awake(&self) -> bool {
        self.awake.load(Ordering::Acquire)
    }

    /// Whether the pacing warms a new scope up: it paces, with no evidence of a limit yet.
    #[inline]
    pub(crate) fn is_warming(&self) -> bool {
        self.warming.load(Ordering::Acquire)
    }

    /// Whether the pacing paces for good: from the start, or woken by evidence of a limit
    /// (awake, and not warming up).
    #[inline]
    pub(crate) fn is_woken(&self) -> bool {
        self.is_awake() && !self.is_warming()
    }

    /// Starts the warm-up's span at its first attempt, with no turns in hand: that attempt
    /// goes now, the next a gap after. No-op after the first.
    pub(crate) fn start_warm_up(&self) {
        if self.warm_until.get().is_some() {
            return;
        }
        let mut s = self.lock();
        let now = Instant::now();
        if self.warm_until.set(now + self.config.warm_up).is_ok() && s.next_time.is_none() {
            s.next_time = Some(now);
        }
    }

    /// The factor a warm-up woken by a burst of refusals fell by, once: for the fleet's
    /// shared schedule to fall by too.
    pub(crate) fn take_wake_factor(&self) -> Option<f64> {
        self.wake_factor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Whether the pacing limits anything now: woken, or warming up a scope that has sent
    /// within its span or still has someone in line.
    pub(crate) fn paces(&self) -> bool {
        if self.is_woken() {
            return true;
        }
        self.is_warming()
            && self
                .warm_until
                .get()
                .is_some_and(|&until| Instant::now() < until || self.lock().has_line())
    }

    /// Ends a warm-up that met no evidence, once its span is over and no one waits in line
    /// (here, nor, by `others_idle`, in a line kept elsewhere: the fleet's shared schedule):
    /// the pacing sleeps, as if it had never paced. Whether it did.
    pub(crate) fn end_warm_up(&self, others_idle: impl FnOnce() -> bool) -> bool {
        let Some(&until) = self.warm_until.get() else {
            self.start_warm_up();
            return false;
        };
        if Instant::now() < until || !others_idle() {
            return false;
        }
        let mut s = self.lock();
        if !self.is_warming() || s.has_line() {
            return false;
        }
        // Woken later, it starts from what it measures then, not from the warm-up's rate.
        s.rate = self.config.initial;
        s.slow_start = true;
        s.next_time = None;
        s.last_turn = None;
        self.warming.store(false, Ordering::Release);
        self.awake.store(false, Ordering::Release);
        drop(s);
        tracing::debug!("pacing warm-up over with no sign of a limit: dormant");
        true
    }

    /// An attempt went out while the pacing was dormant (or warming up: counted the same, for
    /// the evidence of a limit).
    #[inline]
    pub(crate) fn dormant_send(&self) {
        let n = self.dormant_sends.fetch_add(1, Ordering::Relaxed);
        if n.is_multiple_of(SAMPLE_EVERY) {
            self.sample(n);
        }
    }

    #[cold]
    fn sample(&self, before: u64) {
        let now = Instant::now();
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        samples.first.get_or_insert(now);
        let ring = &mut samples.ring;
        if ring
            .back()
            .is_some_and(|&(t, _)| now.saturating_duration_since(t) < SAMPLE_SPACING)
        {
            return;
        }
        ring.push_back((now, before));
        // One sample a whole window old is enough to measure the last second from.
        while ring.len() > 1 && ring[1].0 + RATE_WINDOW <= now {
            ring.pop_front();
        }
        if ring.len() > MAX_SAMPLES {
            ring.pop_front();
        }
        let coarse = &mut samples.coarse;
        if coarse
            .back()
            .is_none_or(|&(t, _)| now.saturating_duration_since(t) >= RATE_WINDOW)
        {
            coarse.push_back((now, before));
        }
        while coarse.front().is_some_and(|&(t, _)| t + QUOTA_WINDOW < now) {
            coarse.pop_front();
        }
    }

    /// The attempts counted over the last [`QUOTA_WINDOW`] (or since the first, when the
    /// fleet is younger), and since when.
    fn quota_counts(&self) -> (u64, Option<Instant>) {
        let total = self.dormant_sends.load(Ordering::Relaxed);
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let young = samples
            .first
            .zip(samples.coarse.front())
            .is_some_and(|(first, &(oldest, _))| first >= oldest);
        match samples.coarse.front() {
            Some(&(at, before)) if !young => (total.saturating_sub(before), Some(at)),
            _ => (total, samples.first),
        }
    }

    /// The rate attempts went out at over the last second, as of `now`: those counted since
    /// the newest sample at least a second old, over the time since it (or over a second,
    /// when the fleet is younger), and when the first went out. `None` before any attempt.
    fn measured(&self, now: Instant) -> Option<(f64, Instant)> {
        let total = self.dormant_sends.load(Ordering::Relaxed);
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let first = samples.first?;
        let &(at, before) = samples
            .ring
            .iter()
            .rev()
            .find(|&&(t, _)| t + RATE_WINDOW <= now)
            .or_else(|| samples.ring.front())?;
        let span = now.saturating_duration_since(at).max(RATE_WINDOW);
        Some((
            total.saturating_sub(before) as f64 / span.as_secs_f64(),
            first,
        ))
    }

    /// Takes what the dormant pacing counted into the state it wakes with: the quota
    /// reading of a long `Retry-After` counts every attempt since the first.
    fn wake_counts(&self, s: &mut State) {
        let (sent, since) = self.quota_counts();
        s.sent = sent;
        s.since = since.or(s.since);
    }

    /// What woke the pacing, if it was dormant and woke.
    pub(crate) fn woken_by(&self) -> Option<PacingWake> {
        match self.woken_by.load(Ordering::Acquire) {
            0 => None,
            n => PacingWake::ALL.get(usize::from(n) - 1).copied(),
        }
    }

    fn set_woken_by(&self, cause: PacingWake) {
        // The index is below 4.
        self.woken_by
            .store(cause.index() as u8 + 1, Ordering::Release);
    }

    /// A `429` came while the pacing was dormant: whether the newest `429`s of the last
    /// [`BURST_WINDOW`] make a burst (then `Some` share of the attempts the server admitted), at least [`BURST_REFUSALS`] of them and at least a
    /// [`BURST_SHARE`]th of the attempts sent since the first of them came. Attempts sent,
    /// not answers: refusals come back faster than replies, and would otherwise be all the
    /// answers of a first moment. A steady background of
    /// random refusals, even at 15 %, does not: over a few dozen answers its share stays
    /// well below a quarter. A server refusing the part of the demand above its limit does.
    pub(crate) fn refusal_burst(&self) -> Option<f64> {
        let now = Instant::now();
        let sent = self.dormant_sends.load(Ordering::Relaxed);
        let mut r = self.refusals.lock().unwrap_or_else(PoisonError::into_inner);
        while r.front().is_some_and(|&(t, _)| t + BURST_WINDOW <= now) {
            r.pop_front();
        }
        // The refused attempt itself was sent before it came back.
        r.push_back((now, sent.saturating_sub(1)));
        while r.len() > MAX_BURST_REFUSALS {
            r.pop_front();
        }
        // The newest `n` of them, for every `n` from the fewest that count: a burst after a
        // spell of noise is not diluted by the spell. The largest share refused of those
        // that count says what the server admits.
        r.iter()
            .rev()
            .enumerate()
            .filter_map(|(i, &(_, before))| {
                let n = i as u64 + 1;
                let sent = sent.saturating_sub(before);
                (n >= BURST_REFUSALS && n * BURST_SHARE >= sent)
                    .then(|| 1.0 - n as f64 / sent.max(n) as f64)
            })
            .reduce(f64::min)
    }

    /// A dormant pacing wakes on a `429` that shows a limit (`cause`) with the server's
    /// `retry_after`: from the rate measured over the last second, as if slow start had
    /// reached it, the refusal then taken as slow start's end. A warm-up wakes from its own
    /// rate, the refusal ending its slow start. No-op once woken.
    ///
    /// `admitted` is the share of the attempts the server admitted, when a burst of refusals
    /// measured it: a warm-up's rate, in slow start, may be several times what the server
    /// takes by then, and it falls to that share of it (within [`MIN_WAKE_FACTOR`] and a
    /// half) instead of halving and decreasing slowly from there.
    pub(crate) fn wake_on_refusal(
        &self,
        retry_after: Option<Duration>,
        cause: PacingWake,
        admitted: Option<f64>,
    ) {
        if self.is_woken() {
            return;
        }
        if self.is_warming() {
            let factor = admitted.map(|a| a.clamp(MIN_WAKE_FACTOR, 0.5));
            let epoch = {
                let s = self.lock();
                if !self.is_warming() {
                    return;
                }
                self.set_woken_by(cause);
                self.warming.store(false, Ordering::Release);
                *self
                    .wake_factor
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = factor;
                s.epoch
            };
            self.on_refusal_by(epoch, retry_after, factor);
            tracing::debug!(rate = self.rate(), %cause, "pacing warm-up woken by a rate limit");
            return;
        }
        let epoch = {
            let mut s = self.lock();
            if self.is_awake() {
                return;
            }
            let measured = self.measured(Instant::now());
            // What a fleet that sent only a few attempts measures says nothing of what the
            // server takes: once halved, the rate is not below `initial`, the pace an eager
            // pacing starts from.
            let floor = self.config.initial / self.config.decrease.min(0.5);
            let rate = measured.map_or(floor, |(r, _)| r.max(floor));
            s.rate = rate
                .clamp(self.config.min, self.config.max)
                .min(s.ceiling(&self.config));
            s.slow_start = true;
            // The turns start from now: no credit of turns not taken while it slept.
            s.next_time = Some(Instant::now());
            self.wake_counts(&mut s);
            self.set_woken_by(cause);
            self.awake.store(true, Ordering::Release);
            s.epoch
        };
        self.on_refusal(epoch, retry_after);
        tracing::debug!(rate = self.rate(), %cause, "pacing woken by a rate limit");
    }
}

impl Pacer {
    /// A dormant pacing wakes at the stated limit's cap (already taken in by
    /// [`on_limit`](Pacer::on_limit)), when the window is nearly spent. No-op once awake, or
    /// with no limit in force.
    pub(crate) fn wake_on_limit(&self) {
        if self.is_woken() {
            return;
        }
        let mut s = self.lock();
        let Some(cap) = s.stated else {
            return;
        };
        if self.is_woken() {
            return;
        }
        if self.is_warming() {
            // The warm-up's turns go on, at the cap from now.
            s.rate = s.rate.min(cap);
            s.slow_start = false;
            self.set_woken_by(PacingWake::RateLimitHeaders);
            self.warming.store(false, Ordering::Release);
            drop(s);
            tracing::debug!(
                rate = cap,
                "pacing warm-up woken by a nearly spent request limit"
            );
            return;
        }
        s.rate = cap.min(self.config.max);
        s.slow_start = false;
        s.next_time = Some(Instant::now());
        self.wake_counts(&mut s);
        self.set_woken_by(PacingWake::RateLimitHeaders);
        self.awake.store(true, Ordering::Release);
        drop(s);
        tracing::debug!(rate = cap, "pacing woken by a nearly spent request limit");
    }
}

/// A dormant pacing timestamps its count of attempts every this many.
const SAMPLE_EVERY: u64 = 16;
/// ... and no more often than this.
const SAMPLE_SPACING: Duration = Duration::from_millis(50);
/// The window a dormant pacing measures the rate it wakes at over.
const RATE_WINDOW: Duration = Duration::from_secs(1);
/// The window a quota's `Retry-After` is read against, when it wakes a dormant pacing: the
/// minute most stated limits count over.
const QUOTA_WINDOW: Duration = Duration::from_secs(60);
/// The most timestamps kept (at one per [`SAMPLE_SPACING`], a window holds about 20).
const MAX_SAMPLES: usize = 64;

/// The least a warm-up's rate is multiplied by when a burst of refusals wakes it: a burst
/// measured over a few attempts says only roughly what the server admits.
const MIN_WAKE_FACTOR: f64 = 0.2;

/// The window a dormant pacing looks for a burst of `429`s in.
const BURST_WINDOW: Duration = Duration::from_secs(10);
/// The fewest `429`s that make a burst ...
const BURST_REFUSALS: u64 = 16;
/// ... and the share of the answers they must be at least one in this many of.
const BURST_SHARE: u64 = 4;
/// The most `429`s a burst is measured over.
const MAX_BURST_REFUSALS: usize = 64;

/// The shortest Retry-After that informs the rate.
pub(super) const MIN_INFORMED_WAIT: Duration = Duration::from_secs(10);
/// The longest Retry-After taken into the rate it implies.
const MAX_INFORMED_WAIT: Duration = Duration::from_secs(300);
/// How much the rate may grow per quota cycle after a quota signal.
const QUOTA_GROWTH: f64 = 1.25;
/// How long after its turn came a head of the line may take it before the one behind it
/// goes instead: time enough for a task that is polled to get to it, short enough that one
/// that is not (a losing `select!` branch kept alive) holds the line up for no longer.
const HEAD_GRACE: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests;
