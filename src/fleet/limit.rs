//! Adaptive pacing: the rate at which the attempts of one fleet are sent, learned from the
//! server's answers (additive increase, multiplicative decrease, on a rate), its quotas and
//! its stated limits.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::f64::consts::LN_2;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::pacing::{PacingConfig, MIN_RATE};

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
    // rate-limit signal. Read on every attempt.
    awake: AtomicBool,
    // While dormant: the attempts sent, and samples of that count, for the rate to wake at.
    dormant_sends: AtomicU64,
    samples: Mutex<Samples>,
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
            awake: AtomicBool::new(!config.dormant),
            dormant_sends: AtomicU64::new(0),
            samples: Mutex::new(Samples::default()),
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

    /// A refusal (`429`, `529`, an overload) of an attempt sent in `epoch`, with the server's
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
        let now = Instant::now();
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

    /// An attempt went out while the pacing was dormant.
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

    /// A dormant pacing wakes on a refusal for load (`429`, `529`) with the server's
    /// `retry_after`: from the rate measured over the last second, as if slow start had
    /// reached it, the refusal then taken as slow start's end. No-op once awake.
    pub(crate) fn wake_on_refusal(&self, retry_after: Option<Duration>) {
        if self.is_awake() {
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
            self.awake.store(true, Ordering::Release);
            s.epoch
        };
        self.on_refusal(epoch, retry_after);
        tracing::debug!(rate = self.rate(), "pacing woken by a refusal for load");
    }
}

impl Pacer {
    /// A dormant pacing wakes at the stated limit's cap (already taken in by
    /// [`on_limit`](Pacer::on_limit)), when the window is nearly spent. No-op once awake, or
    /// with no limit in force.
    pub(crate) fn wake_on_limit(&self) {
        if self.is_awake() {
            return;
        }
        let mut s = self.lock();
        let Some(cap) = s.stated else {
            return;
        };
        if self.is_awake() {
            return;
        }
        s.rate = cap.min(self.config.max);
        s.slow_start = false;
        s.next_time = Some(Instant::now());
        self.wake_counts(&mut s);
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

/// The shortest Retry-After that informs the rate.
const MIN_INFORMED_WAIT: Duration = Duration::from_secs(10);
/// The longest Retry-After taken into the rate it implies.
const MAX_INFORMED_WAIT: Duration = Duration::from_secs(300);
/// How much the rate may grow per quota cycle after a quota signal.
const QUOTA_GROWTH: f64 = 1.25;
/// How long after its turn came a head of the line may take it before the one behind it
/// goes instead: time enough for a task that is polled to get to it, short enough that one
/// that is not (a losing `select!` branch kept alive) holds the line up for no longer.
const HEAD_GRACE: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    /// Pacing from the first attempt, with no burst: what these tests were written for.
    fn eager() -> PacingConfig {
        PacingConfig::new()
            .dormant(false)
            .burst(Duration::ZERO)
            .unwrap()
    }
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    thread_local! {
        /// Run once by the next `on_limit` between its check of the last limit and its lock.
        static BEFORE_LIMIT_LOCK: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
            const { std::cell::RefCell::new(None) };
    }

    pub(super) fn before_limit_lock() {
        if let Some(f) = BEFORE_LIMIT_LOCK.with(|h| h.borrow_mut().take()) {
            f();
        }
    }

    #[test]
    fn validation() {
        assert!(eager().rates(0.0, 0.0, 1.0).is_err());
        assert!(eager().rates(5.0, 6.0, 10.0).is_err());
        assert!(eager().rates(11.0, 1.0, 10.0).is_err());
        assert!(eager().rates(f64::NAN, 1.0, 10.0).is_err());
        assert!(eager().decrease(1.0).is_err());
        assert!(eager().decrease(0.0).is_err());
        assert!(eager().growth(0.0).is_err());
        assert!(eager().growth(2.0).is_err());
    }

    /// A waker that counts how often it was woken.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (count.clone(), Waker::from(count))
    }

    fn woken(c: &Count) -> usize {
        c.0.load(Ordering::SeqCst)
    }

    fn fixed(rate: f64) -> Pacer {
        Pacer::new(eager().rates(rate, 1.0, rate).unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_head_waits_on_the_clock_and_the_next_is_woken_when_it_goes() {
        let p = fixed(10.0);
        let t0 = Instant::now();
        let tickets: Vec<_> = (0..4).map(|_| p.ticket()).collect();
        let wakers: Vec<_> = (0..4).map(|_| counting()).collect();
        assert_eq!(p.poll_turn(tickets[0], &wakers[0].1), Turn::Go(0));
        // Behind the head: queued, to be woken (its only instant is a check on the head).
        assert!(matches!(
            p.poll_turn(tickets[2], &wakers[2].1),
            Turn::Queued { .. }
        ));
        // The head waits for its instant, 1 / rate after the last turn.
        assert_eq!(
            p.poll_turn(tickets[1], &wakers[1].1),
            Turn::Wait(t0 + Duration::from_millis(100))
        );
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(matches!(
            p.poll_turn(tickets[2], &wakers[2].1),
            Turn::Queued { .. }
        ));
        assert_eq!(woken(&wakers[2].0), 0);
        assert_eq!(p.poll_turn(tickets[1], &wakers[1].1), Turn::Go(0));
        // Ticket 2 is now the head and was told so, once.
        assert_eq!(woken(&wakers[2].0), 1);
        assert!(matches!(
            p.poll_turn(tickets[3], &wakers[3].1),
            Turn::Queued { .. }
        ));
        // Ticket 2 leaves the line before its turn: ticket 3 is the head, and is woken.
        p.abandon(tickets[2]);
        assert_eq!(woken(&wakers[3].0), 1);
        assert_eq!(
            p.poll_turn(tickets[3], &wakers[3].1),
            Turn::Wait(t0 + Duration::from_millis(200))
        );
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(p.poll_turn(tickets[3], &wakers[3].1), Turn::Go(0));
    }

    #[tokio::test(start_paused = true)]
    async fn turns_keep_their_schedule_when_taken_a_little_late() {
        let p = fixed(300.0);
        let t0 = Instant::now();
        let gap = Duration::from_secs_f64(1.0 / 300.0);
        let (_, w) = counting();
        let first = p.ticket();
        let second = p.ticket();
        assert_eq!(p.poll_turn(first, &w), Turn::Go(0));
        // The timer fires on the millisecond, a little after the turn's instant; the turn
        // after is still one gap after the instant, not after the late wake-up.
        tokio::time::advance(Duration::from_millis(4)).await;
        assert_eq!(p.poll_turn(second, &w), Turn::Go(0));
        let third = p.ticket();
        assert_eq!(p.poll_turn(third, &w), Turn::Wait(t0 + gap * 2));
        // After a quiet spell longer than a gap, the schedule starts again from now.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(p.poll_turn(third, &w), Turn::Go(0));
        let fourth = p.ticket();
        assert_eq!(
            p.poll_turn(fourth, &w),
            Turn::Wait(t0 + Duration::from_millis(1004) + gap)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn slow_start_doubles_every_second_of_line_and_ends_halving_at_a_refusal() {
        let p = Pacer::new(eager().rates(10.0, 1.0, 1_000.0).unwrap());
        let (_, w) = counting();
        // A line of many: each turn after the first doubles the rate by 2^(time since the
        // last turn).
        let tickets: Vec<_> = (0..100).map(|_| p.ticket()).collect();
        assert_eq!(p.poll_turn(tickets[0], &w), Turn::Go(0));
        for &t in &tickets[1..11] {
            let Turn::Wait(at) = p.poll_turn(t, &w) else {
                panic!("the head waits for its instant");
            };
            tokio::time::advance(at - Instant::now()).await;
            assert_eq!(p.poll_turn(t, &w), Turn::Go(0));
        }
        // Ten turns, each 1 / rate apart: the rate doubled for each second that passed.
        let mut want = 10.0f64;
        for _ in 0..10 {
            want *= (1.0 / want).exp2();
        }
        let rate = p.rate();
        assert!((rate - want).abs() < 1e-6, "{rate} against {want}");
        // Successes do not add to slow start's doubling.
        p.on_success();
        assert_eq!(p.rate(), rate);
        // The first refusal halves it and ends slow start.
        p.on_refusal(0, None);
        assert_eq!(p.rate(), rate * 0.5);
        // Growth is then the configured step per success, while anyone waits in line.
        p.on_success();
        assert_eq!(p.rate(), rate * 0.5 + 0.05);
        // Attempts sent before that decrease do not count again; later ones do, by 0.95.
        p.on_refusal(0, None);
        assert_eq!(p.rate(), rate * 0.5 + 0.05);
        p.on_refusal(1, None);
        assert!((p.rate() - (rate * 0.5 + 0.05) * 0.95).abs() < 1e-9);
    }

    #[test]
    fn the_rate_grows_only_while_someone_waits_in_line() {
        let p = Pacer::new(
            eager()
                .rates(10.0, 2.0, 12.0)
                .unwrap()
                .decrease(0.5)
                .unwrap()
                .growth(0.5)
                .unwrap(),
        );
        let (_, w) = counting();
        p.on_refusal(0, None);
        assert_eq!(p.rate(), 5.0);
        // Nobody in line: the fleet sends less than its rate, which proves nothing.
        p.on_success();
        assert_eq!(p.rate(), 5.0);
        let _a = p.ticket();
        let b = p.ticket();
        assert!(matches!(p.poll_turn(b, &w), Turn::Queued { .. }));
        p.on_success();
        assert_eq!(p.rate(), 5.5);
        // Never above max, never below min.
        for _ in 0..100 {
            p.on_success();
        }
        assert_eq!(p.rate(), 12.0);
        for e in 1..=10 {
            p.on_refusal(e, None);
        }
        assert_eq!(p.rate(), 2.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_quota_retry_after_sets_the_rate_that_spreads_it_and_holds_it_a_cycle() {
        let p = Pacer::new(eager().rates(500.0, 1.0, 500.0).unwrap());
        let (_, w) = counting();
        let t0 = Instant::now();
        // 6,000 turns in 12 s (at 500/s), then a 429 whose Retry-After is 48 s: the quota is
        // spent and renews at 60 s.
        let mut last = None;
        for _ in 0..6_000 {
            let t = p.ticket();
            loop {
                match p.poll_turn(t, &w) {
                    Turn::Go(e) => break last = Some(e),
                    Turn::Wait(at) => tokio::time::advance(at - Instant::now()).await,
                    Turn::Queued { .. } => unreachable!("one ticket at a time"),
                }
            }
        }
        let elapsed = Instant::now() - t0;
        assert!(elapsed.as_secs_f64() > 11.99 && elapsed.as_secs_f64() < 12.0);
        p.on_refusal(last.unwrap(), Some(Duration::from_secs(48)));
        let cycle = elapsed + Duration::from_secs(48);
        let quota = 6_000.0 / cycle.as_secs_f64();
        assert!((p.rate() - quota).abs() < 1e-9, "{}", p.rate());
        // Someone waits in line, yet the rate holds through the wait and one cycle after it.
        let _a = p.ticket();
        let b = p.ticket();
        assert!(matches!(p.poll_turn(b, &w), Turn::Queued { .. }));
        tokio::time::advance(Duration::from_secs(48) + cycle - Duration::from_millis(1)).await;
        p.on_success();
        assert!((p.rate() - quota).abs() < 1e-9);
        // Then it grows, up to 25 % above the quota's rate in the next cycle.
        tokio::time::advance(Duration::from_millis(1)).await;
        for _ in 0..10_000 {
            p.on_success();
        }
        assert!((p.rate() - quota * 1.25).abs() < 1e-9, "{}", p.rate());
        // And 25 % more in the cycle after that.
        tokio::time::advance(cycle).await;
        for _ in 0..10_000 {
            p.on_success();
        }
        assert!(
            (p.rate() - quota * 1.25 * 1.25).abs() < 1e-6,
            "{}",
            p.rate()
        );
    }

    #[test]
    fn a_short_retry_after_is_no_quota() {
        let p = fixed(100.0);
        let (_, w) = counting();
        let t = p.ticket();
        assert_eq!(p.poll_turn(t, &w), Turn::Go(0));
        p.on_refusal(0, Some(Duration::from_secs(1)));
        // Only the halving that ends slow start.
        assert_eq!(p.rate(), 50.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stated_limit_caps_the_rate_in_slow_start_and_after() {
        let p = Pacer::new(eager().rates(50.0, 1.0, 1_000.0).unwrap());
        let (_, w) = counting();
        // 600 requests a minute: 10/s, below the rate it starts from.
        p.on_limit(600);
        assert_eq!(p.rate(), 10.0);
        // Slow start does not take it above the cap, however long the line.
        let tickets: Vec<_> = (0..50).map(|_| p.ticket()).collect();
        for &t in &tickets[..30] {
            loop {
                match p.poll_turn(t, &w) {
                    Turn::Go(_) => break,
                    Turn::Wait(at) => tokio::time::advance(at - Instant::now()).await,
                    Turn::Queued { .. } => unreachable!("served in order"),
                }
            }
        }
        assert_eq!(p.rate(), 10.0);
        // Nor does growth after a refusal.
        p.on_refusal(0, None);
        assert_eq!(p.rate(), 5.0);
        for _ in 0..1_000 {
            p.on_success();
        }
        assert_eq!(p.rate(), 10.0);
        // A higher stated limit raises the cap, not the rate.
        p.on_limit(6_000);
        assert_eq!(p.rate(), 10.0);
        p.on_success();
        assert!((p.rate() - 10.05).abs() < 1e-9);
    }

    #[test]
    fn stated_limits_can_be_ignored_and_the_period_changed() {
        let p = Pacer::new(eager().limit_period(None).unwrap());
        p.on_limit(60);
        assert_eq!(p.rate(), 50.0);
        let p = Pacer::new(eager().limit_period(Some(Duration::from_secs(1))).unwrap());
        p.on_limit(20);
        assert_eq!(p.rate(), 20.0);
        assert!(eager().limit_period(Some(Duration::ZERO)).is_err());
    }

    /// Takes `n` turns one after another, as fast as the rate allows; the last turn's epoch.
    async fn take_turns(p: &Pacer, n: usize) -> u64 {
        let (_, w) = counting();
        let mut last = 0;
        for _ in 0..n {
            let t = p.ticket();
            loop {
                match p.poll_turn(t, &w) {
                    Turn::Go(e) => break last = e,
                    Turn::Wait(at) => tokio::time::advance(at - Instant::now()).await,
                    Turn::Queued { .. } => unreachable!("one ticket at a time"),
                }
            }
        }
        last
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_quota_refusal_during_the_wait_is_the_same_quota() {
        let p = Pacer::new(eager().rates(500.0, 1.0, 500.0).unwrap());
        let epoch = take_turns(&p, 6_000).await;
        p.on_refusal(epoch, Some(Duration::from_secs(48)));
        let quota = p.rate();
        assert!((quota - 100.0).abs() < 0.01, "{quota}");
        // An attempt sent after that decrease is refused too, with the wait that is left:
        // only the usual decrease, not a quota of one attempt.
        let epoch = take_turns(&p, 1).await;
        p.on_refusal(epoch, Some(Duration::from_secs(47)));
        assert!((p.rate() - quota * 0.95).abs() < 1e-9, "{}", p.rate());
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_without_a_quota_keeps_the_quota_count() {
        let p = Pacer::new(eager().rates(500.0, 1.0, 500.0).unwrap());
        // 5,000 turns, a plain 429 (no Retry-After), 1,000 more, then the quota's 429 with
        // 48 s to wait: the quota counts all 6,000 since the first turn.
        let epoch = take_turns(&p, 5_000).await;
        p.on_refusal(epoch, None);
        let epoch = take_turns(&p, 1_000).await;
        p.on_refusal(epoch, Some(Duration::from_secs(48)));
        let rate = p.rate();
        // 10 s at 500/s, 4 s at 250/s after the halving (less the first turn's gap), plus the
        // 48 s wait.
        let want = 6_000.0 / (10.0 + 4.0 - 0.004 + 48.0);
        assert!((rate - want).abs() < 0.01, "{rate} against {want}");
    }

    #[test]
    fn a_stated_limit_below_min_is_kept_and_rates_have_a_floor() {
        let p = Pacer::new(eager());
        // 30 requests a minute: 0.5/s, below the default minimum of 1/s.
        p.on_limit(30);
        assert_eq!(p.rate(), 0.5);
        p.on_refusal(0, None);
        assert!(p.rate() <= 0.5);
        assert!(eager().rates(1e-20, 1e-20, 1.0).is_err());
        assert!(eager().rates(0.001, 0.001, 1.0).is_ok());
    }

    #[test]
    fn two_stated_limits_arriving_together_leave_the_later_one_in_force() {
        let p = Arc::new(Pacer::new(eager()));
        // One answer states 600 a minute; while it is between its check and the lock, another
        // states 60 a minute and is taken in whole.
        let other = p.clone();
        BEFORE_LIMIT_LOCK.with(|h| *h.borrow_mut() = Some(Box::new(move || other.on_limit(60))));
        p.on_limit(600);
        // Whichever went second under the lock is in force, and the record of the last limit
        // taken in agrees with it ...
        let (cap, last) = (p.lock().stated, p.stated_limit.load(Ordering::Relaxed));
        assert_eq!(
            cap,
            Some(last as f64 / 60.0),
            "{cap:?} in force, {last} recorded"
        );
        // ... so every later answer, which states 60 again, puts 1/s in force.
        p.on_limit(60);
        assert_eq!(p.lock().stated, Some(1.0));
        assert_eq!(p.rate(), 1.0);
    }

    /// The `check` and `wait` of a ticket behind the head.
    fn queued(p: &Pacer, ticket: u64, w: &Waker) -> (Option<Instant>, Duration) {
        match p.poll_turn(ticket, w) {
            Turn::Queued { check, wait } => (check, wait),
            turn => panic!("{ticket} is behind the head, not {turn:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_that_does_not_take_its_turn_is_passed_over_after_the_grace() {
        // A turn every 250 ms.
        let p = fixed(4.0);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let [first, stale, b, c] = [(); 4].map(|_| p.ticket());
        let (stale_count, stale_w) = counting();
        let (b_count, b_w) = counting();
        let (c_count, c_w) = counting();
        assert_eq!(p.poll_turn(first, &stale_w), Turn::Go(0));
        // The head waits for its turn at 250 ms, then is not polled again.
        assert_eq!(p.poll_turn(stale, &stale_w), Turn::Wait(t0 + ms(250)));
        // The one right behind it looks again when the head's grace is over; the one after
        // when that one should have gone. Both expect their turns on the schedule.
        assert_eq!(queued(&p, b, &b_w), (Some(t0 + ms(350)), ms(500)));
        assert_eq!(queued(&p, c, &c_w), (Some(t0 + ms(600)), ms(750)));
        // Within the grace the turn is still the head's.
        tokio::time::advance(ms(349)).await;
        assert_eq!(queued(&p, b, &b_w), (Some(t0 + ms(350)), ms(151)));
        // Then the one behind takes it, and the schedule holds: the next turn is at 500 ms.
        tokio::time::advance(ms(1)).await;
        assert_eq!(p.poll_turn(b, &b_w), Turn::Go(0));
        assert_eq!(p.lock().passed, 1);
        assert_eq!(woken(&c_count), 1);
        assert_eq!(p.poll_turn(c, &c_w), Turn::Wait(t0 + ms(500)));
        // Polled again, the head passed over does not go at once: it comes back right
        // behind the head of the moment, and is told when its turn is next.
        assert_eq!(queued(&p, stale, &stale_w), (Some(t0 + ms(600)), ms(400)));
        let d = p.ticket();
        assert_eq!(queued(&p, d, &b_w), (Some(t0 + ms(850)), ms(650)));
        tokio::time::advance(ms(150)).await;
        assert_eq!(p.poll_turn(c, &c_w), Turn::Go(0));
        assert_eq!(woken(&stale_count), 1);
        assert_eq!(p.poll_turn(stale, &stale_w), Turn::Wait(t0 + ms(750)));
        tokio::time::advance(ms(250)).await;
        assert_eq!(p.poll_turn(stale, &stale_w), Turn::Go(0));
        assert_eq!(woken(&b_count), 1);
        assert_eq!(p.poll_turn(d, &b_w), Turn::Wait(t0 + ms(1_000)));
        assert_eq!(p.lock().passed, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_of_heads_not_polled_is_passed_over_by_the_first_that_looks() {
        // A turn every 100 ms. The head, and the one behind it, are polled once and then not
        // again; the third looks when the second should have gone.
        let p = fixed(10.0);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let [first, s1, s2, live] = [(); 4].map(|_| p.ticket());
        let (_, w) = counting();
        assert_eq!(p.poll_turn(first, &w), Turn::Go(0));
        assert_eq!(p.poll_turn(s1, &w), Turn::Wait(t0 + ms(100)));
        assert_eq!(queued(&p, s2, &w).0, Some(t0 + ms(200)));
        assert_eq!(queued(&p, live, &w).0, Some(t0 + ms(300)));
        // The first lapsed at 200 ms; the second was called to the head then and lapsed at
        // 300 ms. The third passes both over and goes.
        tokio::time::advance(ms(300)).await;
        assert_eq!(p.poll_turn(live, &w), Turn::Go(0));
        assert_eq!(p.lock().passed, 2);
        // Polled again, they come back in the order they look, and take the next turns; a
        // newcomer queues behind them.
        assert_eq!(p.poll_turn(s2, &w), Turn::Wait(t0 + ms(400)));
        assert_eq!(queued(&p, s1, &w).1, ms(200));
        let newcomer = p.ticket();
        assert_eq!(queued(&p, newcomer, &w).1, ms(300));
    }

    #[tokio::test(start_paused = true)]
    async fn the_expected_wait_counts_slow_starts_doubling() {
        let p = Pacer::new(eager().rates(10.0, 1.0, 1_000.0).unwrap());
        let t0 = Instant::now();
        let (_, w) = counting();
        let tickets: Vec<_> = (0..101).map(|_| p.ticket()).collect();
        assert_eq!(p.poll_turn(tickets[0], &w), Turn::Go(0));
        // 99 ahead of the last, behind a head whose turn is at 100 ms: at a rate doubling
        // every second, 99 turns take log2(1 + 99 ln 2 / 10) s, not 9.9 s.
        let (check, wait) = queued(&p, tickets[100], &w);
        let want = 0.1 + (1.0 + 99.0 * LN_2 / 10.0).log2();
        assert!((wait.as_secs_f64() - want).abs() < 1e-6, "{wait:?}");
        // It looks again when the one ahead of it would go at the rate of the moment.
        let check = check.unwrap() - t0;
        assert!(
            (check.as_secs_f64() - (0.1 + 9.8 + 0.1)).abs() < 1e-6,
            "{check:?}"
        );
        // Once slow start is over, the wait is at the rate (halved by the refusal).
        p.on_refusal(0, None);
        let (_, wait) = queued(&p, tickets[100], &w);
        assert!(
            (wait.as_secs_f64() - (0.1 + 99.0 / 5.0)).abs() < 1e-6,
            "{wait:?}"
        );
        // Up to a ceiling, then at it: a stated 1,200 a minute (20/s).
        let p = Pacer::new(eager().rates(10.0, 1.0, 1_000.0).unwrap());
        p.on_limit(1_200);
        let tickets: Vec<_> = (0..101).map(|_| p.ticket()).collect();
        assert_eq!(p.poll_turn(tickets[0], &w), Turn::Go(0));
        let (_, wait) = queued(&p, tickets[100], &w);
        let to_ceiling = 10.0 / LN_2;
        let want = 0.1 + 1.0 + (99.0 - to_ceiling) / 20.0;
        assert!((wait.as_secs_f64() - want).abs() < 1e-6, "{wait:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn leaving_the_line_when_passed_over_or_come_back_frees_the_place() {
        let p = fixed(10.0);
        let (_, w) = counting();
        let [first, a, b, c] = [(); 4].map(|_| p.ticket());
        assert_eq!(p.poll_turn(first, &w), Turn::Go(0));
        assert!(matches!(p.poll_turn(a, &w), Turn::Wait(_)));
        assert!(matches!(p.poll_turn(b, &w), Turn::Queued { .. }));
        assert!(matches!(p.poll_turn(c, &w), Turn::Queued { .. }));
        // `a` does not take its turn; `b` takes it when the grace is over.
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(p.poll_turn(b, &w), Turn::Go(0));
        assert_eq!(p.lock().front(), (Some(c), None));
        // Passed over and not come back, `a` holds no place: leaving changes nothing.
        p.abandon(a);
        assert_eq!(p.lock().front(), (Some(c), None));
        // Come back, then gone again: the place behind the head is free once more.
        assert!(matches!(p.poll_turn(a, &w), Turn::Queued { .. }));
        assert_eq!(p.lock().front(), (Some(c), Some(a)));
        p.abandon(a);
        assert_eq!(p.lock().front(), (Some(c), None));
        assert!(p.lock().waiting.is_empty());
        // A refusal leaves the line too, and is counted.
        assert_eq!(p.refused(), 0);
        assert_eq!(p.refuse(c), 1);
        assert_eq!(p.lock().front(), (None, None));
        assert_eq!(p.refused(), 1);
    }

    /// A dormant pacing that counted `n` attempts, one every `every`.
    async fn dormant_after(n: u64, every: Duration) -> Pacer {
        let p = Pacer::new(eager().dormant(true));
        for _ in 0..n {
            assert!(!p.is_awake());
            p.dormant_send();
            tokio::time::advance(every).await;
        }
        p
    }

    #[tokio::test(start_paused = true)]
    async fn a_dormant_pacing_wakes_at_the_rate_it_measured_halved() {
        // 500/s for 12 s; a refusal with a short Retry-After.
        let p = dormant_after(6_000, Duration::from_millis(2)).await;
        p.wake_on_refusal(Some(Duration::from_secs(1)));
        assert!(p.is_awake());
        assert!((p.rate() - 250.0).abs() < 1e-6, "{}", p.rate());
        // Out of slow start: the next refusal is the usual decrease.
        let t = p.ticket();
        let (_, w) = counting();
        let Turn::Go(epoch) = p.poll_turn(t, &w) else {
            panic!("the first turn after the wake goes at once");
        };
        p.on_refusal(epoch, None);
        assert!((p.rate() - 250.0 * 0.95).abs() < 1e-6, "{}", p.rate());
    }

    #[tokio::test(start_paused = true)]
    async fn a_dormant_pacing_woken_by_a_quota_reads_it_from_everything_it_counted() {
        // 6,000 in 12 s, then the window's 429 with 48 s to its reset: 6,000 per 60 s.
        let p = dormant_after(6_000, Duration::from_millis(2)).await;
        p.wake_on_refusal(Some(Duration::from_secs(48)));
        assert!((p.rate() - 100.0).abs() < 1e-6, "{}", p.rate());
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_lived_fleet_reads_a_quota_from_its_last_minute_not_its_lifetime() {
        // An hour at 5/s (18,000), then 12 s at 500/s (6,000), then a 429 with 48 s to the
        // reset: read against the last minute (48 s at 5/s and the 6,000), not the hour.
        let p = dormant_after(18_000, Duration::from_millis(200)).await;
        for _ in 0..6_000 {
            p.dormant_send();
            tokio::time::advance(Duration::from_millis(2)).await;
        }
        p.wake_on_refusal(Some(Duration::from_secs(48)));
        // (6,000 + 240) over the 60 s counted and the 48 s to wait: about 58/s; over the
        // whole life it would be about 6/s.
        let rate = p.rate();
        assert!((50.0..70.0).contains(&rate), "{rate}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_young_or_slow_dormant_fleet_wakes_no_lower_than_initial() {
        // 3 attempts, then a 429: three in a second is no measure of the server.
        let p = dormant_after(3, Duration::from_millis(10)).await;
        p.wake_on_refusal(None);
        assert_eq!(p.rate(), 50.0);
        // None counted at all: the same.
        let p = Pacer::new(eager().dormant(true));
        p.wake_on_refusal(None);
        assert_eq!(p.rate(), 50.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stated_limit_caps_a_dormant_pacing_without_waking_it() {
        // 200 attempts a second, while every answer states 600 a minute (10/s).
        let p = dormant_after(200, Duration::from_millis(5)).await;
        p.on_limit(600);
        assert!(
            !p.is_awake(),
            "a client within its stated limit is not slowed"
        );
        // Woken by a refusal, it starts from the cap, not from what it measured (200/s),
        // halved as every wake is.
        p.wake_on_refusal(None);
        assert!(p.is_awake());
        assert_eq!(p.rate(), 5.0);
        assert!(Pacer::new(eager()).is_awake());
        assert!(eager().burst(Duration::from_secs(61)).is_err());
    }

    #[test]
    fn a_nearly_spent_limit_wakes_a_dormant_pacing_at_its_cap() {
        let p = Pacer::new(eager().dormant(true));
        // No limit in force: nothing to wake at.
        p.wake_on_limit();
        assert!(!p.is_awake());
        p.on_limit(600);
        p.wake_on_limit();
        assert!(p.is_awake());
        assert_eq!(p.rate(), 10.0);
    }
}
