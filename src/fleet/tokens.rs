//! Pacing by tokens: the token buckets a fleet admits requests against once a provider says
//! its token limit is nearly spent (a request's cost is `token_cost.rs`'s).
//!
//! The buckets are those the providers describe: a limit per minute, refilled continuously
//! (`limit / 60` tokens a second), at most `limit` in hand. A request takes its estimated
//! input tokens from the input bucket, the output it may produce (`max_tokens`) from the
//! output bucket, and both from the combined one (OpenAI's single token limit counts the
//! two), each bucket only once it is awake. The usage the answer reports settles the
//! charge: what was over-estimated comes back, what was under-estimated is taken.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;
use crate::provider::ratelimit::{TokenHeaders, TokenKind};

use super::token_cost::{Cost, InputCounter, Usage};

/// A dormant token pacing wakes when at most `1 / LOW_REMAINING` of a stated token limit is
/// left (as the request pacing does for the request limit).
const LOW_REMAINING: u64 = 10;

/// Settings of the token pacing of a [`Fleet`](crate::fleet::Fleet): see
/// [Pacing by tokens](crate::fleet#pacing-by-tokens).
///
/// Defaults: [dormant](TokenPacingConfig::dormant) until a token limit is stated as nearly
/// spent or a `429` names a token limit; limits read as per minute; the built-in estimate
/// of a request's input tokens.
#[derive(Clone)]
pub struct TokenPacingConfig {
    dormant: bool,
    period: Duration,
    counter: Option<InputCounter>,
}

impl Default for TokenPacingConfig {
    fn default() -> Self {
        TokenPacingConfig {
            dormant: true,
            period: Duration::from_secs(60),
            counter: None,
        }
    }
}

impl std::fmt::Debug for TokenPacingConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenPacingConfig")
            .field("dormant", &self.dormant)
            .field("period", &self.period)
            .field("counter", &self.counter.is_some())
            .finish()
    }
}

impl TokenPacingConfig {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the token pacing limits nothing until the server shows a token limit is
    /// met: a response stating that at most a tenth of a token limit is left, or a `429`
    /// that names a token limit (its token headers read 0, or its message names input or
    /// output tokens). A `429` for the request limit does not wake it. False admits against
    /// the stated limits from the first answer that states them. Defaults to true.
    pub fn dormant(mut self, yes: bool) -> Self {
        self.dormant = yes;
        self
    }

    /// The period a stated token limit counts over: the bucket refills `limit / period`
    /// tokens a second. Both providers state tokens per minute. At least 1 s. Defaults to
    /// 60 s.
    pub fn limit_period(mut self, period: Duration) -> Result<Self, ConfigError> {
        if period < Duration::from_secs(1) {
            return Err(ConfigError::new(format!(
                "the token limit period must be at least 1 s, got {period:?}"
            )));
        }
        self.period = period;
        Ok(self)
    }

    /// A count of a request's input tokens of the caller's own (a tokenizer, say), in place
    /// of the built-in estimate (a quarter of the body's bytes, see
    /// [the estimate](crate::fleet#the-estimate)); it returns `None` to fall back to it. It
    /// is called once per request, on the buffered body, only while the token pacing is
    /// awake. Defaults to none.
    pub fn input_counter<F>(mut self, count: F) -> Self
    where
        F: Fn(&[u8]) -> Option<u64> + Send + Sync + 'static,
    {
        self.counter = Some(Arc::new(count));
        self
    }

    pub(crate) fn counter(&self) -> Option<&InputCounter> {
        self.counter.as_ref()
    }

    /// Whether it sleeps until the server shows a token limit is met.
    pub fn get_dormant(&self) -> bool {
        self.dormant
    }

    /// The period a stated token limit counts over.
    pub fn get_limit_period(&self) -> Duration {
        self.period
    }
}

/// One bucket's part of a booking in the store: its limit, its refill (tokens a second), the
/// amount, and the level to start from where the store holds no bucket yet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TokenArg {
    pub(crate) cap: f64,
    pub(crate) refill: f64,
    pub(crate) amount: f64,
    pub(crate) start: f64,
    /// What the server last said is left, refilled to now, when it said so since the last
    /// booking: the store's bucket is lowered to it, as this process's is, less what the
    /// fleet booked since the server said so.
    pub(crate) floor: Option<f64>,
    /// How long ago the server said so.
    pub(crate) floor_age: Duration,
}

/// A booking's parts, by kind (`None`: the kind is not paced).
pub(crate) type TokenArgs = [Option<TokenArg>; 3];

/// How a booking in the store ended.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
pub(crate) enum TokensOutcome {
    /// The tokens are in hand; the buckets' levels after.
    Go([Option<f64>; 3]),
    /// They would come later than the attempt may wait: nothing was booked.
    TooFar(Duration, [Option<f64>; 3]),
    /// The store did not answer in time: the local bucket.
    Failed,
}

/// What woke a dormant token pacing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TokenWake {
    /// A response stated that at most a tenth of a token limit is left.
    NearlySpent,
    /// A `429` whose token headers read 0, or whose message names a token limit.
    TokenRefusal,
}

impl TokenWake {
    /// A short name: `nearly_spent`, `token_refusal`.
    pub fn as_str(&self) -> &'static str {
        match self {
            TokenWake::NearlySpent => "nearly_spent",
            TokenWake::TokenRefusal => "token_refusal",
        }
    }
}

/// A token bucket as a provider describes it.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    capacity: f64,
    /// Tokens a second.
    refill: f64,
    /// May be below zero: an answer reported more than the estimate took.
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(limit: u64, period: Duration, level: f64, now: Instant) -> Self {
        let capacity = limit as f64;
        Bucket {
            capacity,
            refill: capacity / period.as_secs_f64(),
            level: level.min(capacity),
            at: now,
        }
    }

    fn refill_to(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.refill).min(self.capacity);
        self.at = now;
    }

    /// What a request of `cost` needs in hand, and takes: its cost, or a full bucket when it
    /// is larger than the bucket (the server either refuses it, and the tokens come back, or
    /// counts fewer than its limit, and the usage settles the difference).
    fn need(&self, cost: u64) -> f64 {
        (cost as f64).min(self.capacity)
    }

    /// How long until `need` is in hand.
    fn time_to(&self, need: f64) -> Duration {
        if self.level >= need {
            return Duration::ZERO;
        }
        secs((need - self.level) / self.refill)
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::from_secs(24 * 60 * 60))
}

/// How long the tokens a process took are remembered by when: an answer's count, made when
/// its attempt was sent, is taken as of then (an answer comes well within this).
const TAKEN_FOR: Duration = Duration::from_secs(2);

/// The most takes remembered: at a higher rate, less than [`TAKEN_FOR`] is.
const TAKEN_MOST: usize = 256;

/// The tokens one kind's bucket gave out: their running total, and the total after each
/// take of the last [`TAKEN_FOR`].
#[derive(Default)]
struct Taken {
    total: f64,
    /// The total after the newest take forgotten.
    base: f64,
    log: VecDeque<(Instant, f64)>,
}

impl Taken {
    fn record(&mut self, now: Instant, amount: f64) {
        self.total += amount;
        while let Some(&(at, total)) = self.log.front() {
            if now.saturating_duration_since(at) <= TAKEN_FOR && self.log.len() < TAKEN_MOST {
                break;
            }
            self.base = total;
            self.log.pop_front();
        }
        self.log.push_back((now, self.total));
    }

    /// What was taken after `at`: not in a count the server made then. For an `at` older
    /// than the takes remembered, those remembered only.
    fn since(&self, at: Instant) -> f64 {
        let before = self.log.iter().rev().find(|(t, _)| *t <= at);
        self.total - before.map_or(self.base, |&(_, total)| total)
    }
}

/// One request in the line.
struct Waiter {
    ticket: u64,
    cost: Cost,
    waker: Option<Waker>,
    /// At the head: when its tokens are (or were) in hand, as last reckoned.
    due: Option<Instant>,
}

/// How long after its tokens are in hand a head that has not taken them is passed over by
/// the one behind it (as the request pacing's line does).
const PASS_OVER: Duration = Duration::from_millis(100);

struct State {
    /// The buckets of the kinds awake.
    buckets: [Option<Bucket>; 3],
    woken_by: Option<TokenWake>,
    /// What the server last said is left, and when, not yet told to the store.
    told: [Option<(f64, Instant)>; 3],
    /// What each bucket gave out, by when.
    taken: [Taken; 3],
    next_ticket: u64,
    /// Head-of-line order: only the first may take tokens.
    line: VecDeque<Waiter>,
}

/// The token pacing of one fleet state.
pub(crate) struct TokenPacer {
    config: TokenPacingConfig,
    /// Whether a bucket is awake: read on every request without the lock.
    awake: std::sync::atomic::AtomicBool,
    /// The limits stated so far, by kind (0: none): kept on every answer without the lock.
    stated: [AtomicU64; 3],
    state: Mutex<State>,
    waited: AtomicU64,
    refused: AtomicU64,
}

/// What the head of the line is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// The tokens are taken.
    Go,
    /// At the head: the tokens are in hand at this instant.
    Wait(Instant),
    /// Behind others: the expected wait, judged from the tokens of those ahead, and, right
    /// behind the head, when to look again whether the head took its tokens.
    Queued {
        wait: Duration,
        check: Option<Instant>,
    },
}

/// Wakes the head and the one right behind it: the line moved.
fn wake_front(line: &mut VecDeque<Waiter>) {
    for w in line.iter_mut().take(2) {
        if let Some(waker) = w.waker.take() {
            waker.wake();
        }
    }
}

impl TokenPacer {
    pub(crate) fn new(config: TokenPacingConfig) -> Self {
        TokenPacer {
            config,
            awake: std::sync::atomic::AtomicBool::new(false),
            stated: Default::default(),
            state: Mutex::new(State {
                buckets: [None; 3],
                woken_by: None,
                told: [None; 3],
                taken: Default::default(),
                next_ticket: 0,
                line: VecDeque::new(),
            }),
            waited: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn config(&self) -> &TokenPacingConfig {
        &self.config
    }

    /// Whether any bucket is awake.
    pub(crate) fn is_awake(&self) -> bool {
        self.awake.load(Ordering::Acquire)
    }

    fn stated(&self, kind: TokenKind) -> Option<u64> {
        Some(self.stated[kind.index()].load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    pub(crate) fn woken_by(&self) -> Option<TokenWake> {
        self.lock().woken_by
    }

    /// What an answer said: its token headers, and, for a `429`, the token limit it named
    /// (`named`: from its body's message). `refusal`: the answer is a `429`. `sent_at`: when
    /// the attempt it answers was sent, which its count is taken as of.
    pub(crate) fn observe(
        &self,
        headers: &TokenHeaders,
        refusal: bool,
        named: Option<TokenKind>,
        sent_at: Instant,
    ) {
        for kind in TokenKind::ALL {
            if let Some(limit) = headers.window(kind).limit {
                self.stated[kind.index()].store(limit, Ordering::Relaxed);
            }
        }
        let low = TokenKind::ALL
            .into_iter()
            .find(|k| headers.window(*k).nearly_spent(LOW_REMAINING));
        // Asleep, an answer that neither refuses nor says a limit is nearly spent only states
        // limits: kept above, without the lock (the path of every success).
        if !self.is_awake() && !refusal && low.is_none() && self.config.dormant {
            return;
        }
        let now = Instant::now();
        let period = self.config.period;
        let mut s = self.lock();
        let State {
            buckets,
            told,
            taken,
            ..
        } = &mut *s;
        for kind in TokenKind::ALL {
            let w = headers.window(kind);
            let k = kind.index();
            if let Some(b) = &mut buckets[k] {
                b.refill_to(now);
                if let Some(limit) = w.limit {
                    let capacity = limit as f64;
                    b.level += capacity - b.capacity;
                    b.capacity = capacity;
                    b.refill = capacity / period.as_secs_f64();
                }
                // The server's count takes in every client of the limit; ours, the requests
                // admitted that it has not counted yet: the lower of the two. The server's
                // is of when the attempt was sent: refilled since, less what this process
                // took since.
                if let Some(left) = w.remaining {
                    let age = now.saturating_duration_since(sent_at).as_secs_f64();
                    let counted = (left as f64 + age * b.refill).min(b.capacity);
                    b.level = b.level.min(counted - taken[k].since(sent_at));
                    told[k] = Some((left as f64, sent_at));
                }
            }
        }
        // Evidence of a token limit met: a 429 whose headers read 0 or whose message names
        // tokens, or a window nearly spent; a 429 of the request limit is none.
        let refused = refusal.then(|| headers.exhausted().or(named)).flatten();
        let (wake, cause) = match (refused, low) {
            (Some(k), _) => (k, TokenWake::TokenRefusal),
            (None, Some(k)) => (k, TokenWake::NearlySpent),
            (None, None) if !self.config.dormant => match headers.states_a_limit() {
                true => (TokenKind::Input, TokenWake::NearlySpent),
                false => return,
            },
            (None, None) => return,
        };
        // The kind named, if its limit is known; else every kind whose limit is.
        let kinds: Vec<TokenKind> = match self.stated(wake) {
            Some(_) if self.config.dormant => vec![wake],
            _ => TokenKind::ALL
                .into_iter()
                .filter(|k| self.stated(*k).is_some())
                .collect(),
        };
        let mut woke = false;
        for kind in kinds {
            let k = kind.index();
            let Some(limit) = self.stated(kind) else {
                continue;
            };
            let w = headers.window(kind);
            // What the server says is left; a refusal that does not say, nothing.
            let left = match (refused == Some(kind), w.remaining) {
                (_, Some(left)) => left as f64,
                (true, None) => 0.0,
                (false, None) => limit as f64,
            };
            match &mut s.buckets[k] {
                Some(b) if refused == Some(kind) => b.level = b.level.min(left),
                Some(_) => {}
                None => {
                    s.buckets[k] = Some(Bucket::new(limit, period, left, now));
                    // The store may hold a bucket made from another process's count,
                    // which did not see this one's requests so far.
                    s.told[k] = Some((left, sent_at));
                    woke = true;
                }
            }
        }
        if woke {
            self.awake.store(true, Ordering::Release);
        }
        if woke && s.woken_by.is_none() {
            s.woken_by = Some(cause);
            tracing::info!(cause = cause.as_str(), "token pacing woke");
        }
        // The level changed: the head may look again.
        if let Some(w) = s.line.front_mut().and_then(|w| w.waker.take()) {
            w.wake();
        }
    }

    /// Joins the line with `cost`.
    pub(crate) fn join(&self, cost: Cost) -> u64 {
        let mut s = self.lock();
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        s.line.push_back(Waiter {
            ticket,
            cost,
            waker: None,
            due: None,
        });
        ticket
    }

    /// Takes the tokens of `ticket` when it is at the head and they are in hand.
    pub(crate) fn poll_admit(&self, ticket: u64, waker: &Waker) -> Admit {
        let now = Instant::now();
        let mut s = self.lock();
        let State {
            buckets,
            line,
            taken,
            ..
        } = &mut *s;
        let Some(pos) = line.iter().position(|w| w.ticket == ticket) else {
            return Admit::Go;
        };
        for b in buckets.iter_mut().flatten() {
            b.refill_to(now);
        }
        // Right behind a head that has not taken its tokens, in hand for a while (a future
        // kept alive but no longer polled): it passes the head over, which comes back right
        // behind it. The others look again when the one ahead of them moves.
        let mut pos = pos;
        let mut check = None;
        if pos == 1 {
            let head_wait = wait_for(buckets, line[0].cost);
            let mut due = *line[0].due.get_or_insert(now + head_wait);
            if !head_wait.is_zero() {
                // Its tokens are not in hand (the level fell since it looked): not late.
                due = due.max(now + head_wait);
                line[0].due = Some(due);
            }
            if head_wait.is_zero() && now >= due + PASS_OVER {
                line.swap(0, 1);
                pos = 0;
            } else {
                check = Some(due + PASS_OVER);
            }
        }
        // Behind others: wait to be woken; the expected wait is the time the tokens of
        // everyone ahead, and its own, take to come.
        if pos > 0 {
            let wait = TokenKind::ALL
                .into_iter()
                .filter_map(|k| {
                    let b = buckets[k.index()]?;
                    let need: f64 = line
                        .iter()
                        .take(pos + 1)
                        .map(|w| b.need(w.cost.of(k)))
                        .sum();
                    Some(b.time_to(need))
                })
                .max()
                .unwrap_or(Duration::ZERO);
            line[pos].waker = Some(waker.clone());
            return Admit::Queued { wait, check };
        }
        let cost = line[0].cost;
        let wait = wait_for(buckets, cost);
        line[0].due = Some(now + wait);
        if !wait.is_zero() {
            line[0].waker = Some(waker.clone());
            return Admit::Wait(now + wait);
        }
        for kind in TokenKind::ALL {
            if let Some(b) = &mut buckets[kind.index()] {
                let need = b.need(cost.of(kind));
                b.level -= need;
                taken[kind.index()].record(now, need);
            }
        }
        line.pop_front();
        wake_front(line);
        Admit::Go
    }

    /// Leaves the line (given up, or dropped).
    pub(crate) fn leave(&self, ticket: u64) {
        let mut s = self.lock();
        let Some(pos) = s.line.iter().position(|w| w.ticket == ticket) else {
            return;
        };
        s.line.remove(pos);
        if pos <= 1 {
            wake_front(&mut s.line);
        }
    }

    /// Gives back `cost` (an attempt the server refused, which it does not count), or takes
    /// more (when `usage` says the estimate was short).
    pub(crate) fn settle(&self, charged: Cost, usage: Usage) {
        let now = Instant::now();
        let mut s = self.lock();
        let used = usage.cost(charged);
        for kind in TokenKind::ALL {
            if let Some(b) = &mut s.buckets[kind.index()] {
                b.refill_to(now);
                // A request larger than the bucket took a full one: the server serves at
                // most that much, or refuses it.
                let back = b.need(charged.of(kind)) - used.of(kind) as f64;
                b.level = (b.level + back).min(b.capacity);
            }
        }
        if let Some(w) = s.line.front_mut().and_then(|w| w.waker.take()) {
            w.wake();
        }
    }

    /// What a booking of `cost` asks of the store (`give`: the give-back of `charged` for
    /// `usage` instead).
    pub(crate) fn args(&self, cost: Cost, give: Option<Usage>) -> TokenArgs {
        let now = Instant::now();
        let mut s = self.lock();
        let mut args = [None; 3];
        let State { buckets, told, .. } = &mut *s;
        for kind in TokenKind::ALL {
            if let Some(b) = &mut buckets[kind.index()] {
                b.refill_to(now);
                // Told with a booking, not with a give-back, which goes in the background
                // and may reach the store after the next booking.
                let told = match give {
                    None => told[kind.index()].take(),
                    Some(_) => None,
                };
                let floor_age =
                    told.map_or(Duration::ZERO, |(_, at)| now.saturating_duration_since(at));
                let floor = told
                    .map(|(left, _)| (left + floor_age.as_secs_f64() * b.refill).min(b.capacity));
                let amount = match give {
                    None => b.need(cost.of(kind)),
                    Some(usage) => b.need(cost.of(kind)) - usage.cost(cost).of(kind) as f64,
                };
                args[kind.index()] = Some(TokenArg {
                    cap: b.capacity,
                    refill: b.refill,
                    amount,
                    start: b.level,
                    floor,
                    floor_age,
                });
            }
        }
        args
    }

    /// The levels the store holds, as it answered: this process's buckets mirror them.
    pub(crate) fn learn_levels(&self, levels: [Option<f64>; 3]) {
        let now = Instant::now();
        let mut s = self.lock();
        for (b, level) in s.buckets.iter_mut().zip(levels) {
            if let (Some(b), Some(level)) = (b, level) {
                b.refill_to(now);
                b.level = level.min(b.capacity);
            }
        }
    }

    pub(crate) fn count_waited(&self) {
        self.waited.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// A read-out of the state.
    pub(crate) fn stats(&self) -> TokenPacingStats {
        let now = Instant::now();
        let s = self.lock();
        let mut stats = TokenPacingStats {
            waiting: s.line.len(),
            waited: self.waited.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            awake: usize::from(s.buckets.iter().any(Option::is_some)),
            ..TokenPacingStats::default()
        };
        for kind in TokenKind::ALL {
            let k = kind.index();
            stats.buckets[k] = s.buckets[k].map(|mut b| {
                b.refill_to(now);
                TokenBucketStats {
                    per_minute: b.refill * 60.0,
                    capacity: b.capacity,
                    level: b.level,
                }
            });
        }
        stats
    }
}

/// How long until every awake bucket holds what `cost` needs of it.
fn wait_for(buckets: &[Option<Bucket>; 3], cost: Cost) -> Duration {
    TokenKind::ALL
        .into_iter()
        .filter_map(|k| buckets[k.index()].map(|b| b.time_to(b.need(cost.of(k)))))
        .max()
        .unwrap_or(Duration::ZERO)
}

impl std::fmt::Debug for TokenPacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenPacer")
            .field("stats", &self.stats())
            .finish()
    }
}

/// One awake token bucket, as the fleet believes it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TokenBucketStats {
    /// Tokens per minute believed: the refill.
    pub per_minute: f64,
    /// The most it holds: the stated limit.
    pub capacity: f64,
    /// What it holds now; below zero while it owes for answers that used more than their
    /// estimate.
    pub level: f64,
}

/// The token pacing's state, read with [`Fleet::token_pacing`](crate::fleet::Fleet::token_pacing).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct TokenPacingStats {
    /// The bucket of each kind, in the order of [`TokenKind::ALL`]; `None` while it sleeps.
    pub buckets: [Option<TokenBucketStats>; 3],
    /// Requests in line for tokens now.
    pub waiting: usize,
    /// Requests that waited for tokens, so far.
    pub waited: u64,
    /// Requests that gave up because their tokens would come later than they may wait.
    pub refused: u64,
    /// States (the fleet's own and its scopes) whose token pacing is awake.
    pub awake: usize,
}

impl TokenPacingStats {
    /// The bucket of `kind`, when it is awake.
    pub fn bucket(&self, kind: TokenKind) -> Option<TokenBucketStats> {
        self.buckets[kind.index()]
    }

    /// Adds another state's read-out: the counts and the buckets' figures summed.
    pub(crate) fn add(&mut self, other: &TokenPacingStats) {
        self.waiting += other.waiting;
        self.waited += other.waited;
        self.refused += other.refused;
        self.awake += other.awake;
        for (mine, theirs) in self.buckets.iter_mut().zip(other.buckets) {
            if let Some(t) = theirs {
                let m = mine.get_or_insert_with(TokenBucketStats::default);
                m.per_minute += t.per_minute;
                m.capacity += t.capacity;
                m.level += t.level;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> TokenHeaders {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        TokenHeaders::read(&h, std::time::SystemTime::now)
    }

    /// A token 429 wakes it, sized from the stated limit, empty; a request 429 does not,
    /// nor a limit with plenty left.
    #[tokio::test(start_paused = true)]
    async fn only_token_evidence_wakes_it() {
        let p = TokenPacer::new(TokenPacingConfig::new());
        let stated = headers(&[
            ("anthropic-ratelimit-input-tokens-limit", "60000"),
            ("anthropic-ratelimit-input-tokens-remaining", "50000"),
        ]);
        p.observe(&stated, false, None, Instant::now());
        assert!(!p.is_awake());
        let request_429 = headers(&[
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-input-tokens-limit", "60000"),
            ("anthropic-ratelimit-input-tokens-remaining", "50000"),
        ]);
        p.observe(&request_429, true, None, Instant::now());
        assert!(!p.is_awake());
        let token_429 = headers(&[
            ("anthropic-ratelimit-input-tokens-limit", "60000"),
            ("anthropic-ratelimit-input-tokens-remaining", "0"),
        ]);
        p.observe(&token_429, true, None, Instant::now());
        assert_eq!(p.woken_by(), Some(TokenWake::TokenRefusal));
        let b = p.stats().bucket(TokenKind::Input).unwrap();
        assert_eq!(
            (b.per_minute, b.capacity, b.level),
            (60_000.0, 60_000.0, 0.0)
        );
        // A refusal states what is left: the bucket starts there.
        let p = TokenPacer::new(TokenPacingConfig::new());
        p.observe(&stated, true, Some(TokenKind::Input), Instant::now());
        assert_eq!(p.stats().bucket(TokenKind::Input).unwrap().level, 50_000.0);
        assert!(p.stats().bucket(TokenKind::Output).is_none());
        // A message alone names the limit too.
        let p = TokenPacer::new(TokenPacingConfig::new());
        p.observe(&stated, false, None, Instant::now());
        p.observe(&headers(&[]), true, Some(TokenKind::Input), Instant::now());
        assert!(p.is_awake());
        // Nearly spent wakes it at what is left.
        let p = TokenPacer::new(TokenPacingConfig::new());
        p.observe(
            &headers(&[
                ("anthropic-ratelimit-input-tokens-limit", "60000"),
                ("anthropic-ratelimit-input-tokens-remaining", "6000"),
            ]),
            false,
            None,
            Instant::now(),
        );
        assert_eq!(p.woken_by(), Some(TokenWake::NearlySpent));
        assert_eq!(p.stats().bucket(TokenKind::Input).unwrap().level, 6000.0);
    }

    /// An answer's count is of when its attempt was sent: refilled since, less what was
    /// taken since (the requests admitted after it, which the server had not seen), before
    /// the bucket is lowered to it. A count older than the takes remembered takes off those
    /// remembered.
    #[tokio::test(start_paused = true)]
    async fn an_answers_count_is_of_when_its_attempt_was_sent() {
        let p = TokenPacer::new(TokenPacingConfig::new().dormant(false));
        let said = |left: &str| {
            headers(&[
                ("anthropic-ratelimit-input-tokens-limit", "60000"),
                ("anthropic-ratelimit-input-tokens-remaining", left),
            ])
        };
        p.observe(&said("60000"), false, None, Instant::now());
        let level = || p.stats().bucket(TokenKind::Input).unwrap().level;
        assert_eq!(level(), 60_000.0);
        let take = |input| {
            let t = p.join(Cost {
                input,
                output: 0,
                shared: false,
            });
            assert_eq!(p.poll_admit(t, Waker::noop()), Admit::Go);
        };
        // An attempt is sent; 100 ms later two more take 10,000 each.
        let sent = Instant::now();
        take(5_000);
        tokio::time::advance(Duration::from_millis(100)).await;
        take(10_000);
        take(10_000);
        assert_eq!(level(), 35_100.0);
        // Its answer (another client spent 20,000): 35,000 left when it was sent, 200 tokens
        // refilled since, and the 20,000 taken since are not in it: 15,200.
        tokio::time::advance(Duration::from_millis(100)).await;
        p.observe(&said("35000"), false, None, sent);
        assert_eq!(level(), 15_200.0);
        // A count newer than every take: only the refill since.
        tokio::time::advance(Duration::from_secs(1)).await;
        let now = Instant::now();
        p.observe(&said("10000"), false, None, now);
        assert_eq!(level(), 10_000.0);
        // Past the takes remembered (2 s): those remembered, the one since.
        tokio::time::advance(Duration::from_secs(3)).await;
        take(1_000);
        p.observe(&said("5000"), false, None, now);
        assert_eq!(level(), 5_000.0 + 3_000.0 - 1_000.0);
    }

    /// Head of line: a large request at the head is not passed by the small ones behind it;
    /// a request larger than the bucket goes alone when it is full, and the bucket owes.
    #[tokio::test(start_paused = true)]
    async fn head_of_line_and_the_oversized_request() {
        let p = TokenPacer::new(TokenPacingConfig::new());
        p.observe(
            &headers(&[
                ("anthropic-ratelimit-input-tokens-limit", "6000"),
                ("anthropic-ratelimit-input-tokens-remaining", "0"),
            ]),
            true,
            None,
            Instant::now(),
        );
        let w = Waker::noop();
        let big = p.join(Cost {
            input: 3000,
            output: 0,
            shared: false,
        });
        let small = p.join(Cost {
            input: 10,
            output: 0,
            shared: false,
        });
        let start = Instant::now();
        assert_eq!(
            p.poll_admit(big, w),
            Admit::Wait(start + Duration::from_secs(30))
        );
        assert!(matches!(p.poll_admit(small, w), Admit::Queued { .. }));
        tokio::time::advance(Duration::from_secs(1)).await;
        // 100 tokens in hand: enough for the small one, but it stays behind.
        assert!(matches!(p.poll_admit(small, w), Admit::Queued { .. }));
        tokio::time::advance(Duration::from_secs(29)).await;
        assert_eq!(p.poll_admit(big, w), Admit::Go);
        assert_eq!(
            p.poll_admit(small, w),
            Admit::Wait(Instant::now() + Duration::from_millis(100))
        );
        p.leave(small);
        // Larger than the bucket: waits for a full one, then goes and the bucket owes.
        let huge = p.join(Cost {
            input: 9000,
            output: 0,
            shared: false,
        });
        assert_eq!(
            p.poll_admit(huge, w),
            Admit::Wait(Instant::now() + Duration::from_secs(60))
        );
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(p.poll_admit(huge, w), Admit::Go);
        assert_eq!(p.stats().bucket(TokenKind::Input).unwrap().level, 0.0);
        // Usage settles: it took a full bucket, 4000 were used.
        p.settle(
            Cost {
                input: 9000,
                output: 0,
                shared: false,
            },
            Usage {
                input: Some(4000),
                output: None,
            },
        );
        assert_eq!(p.stats().bucket(TokenKind::Input).unwrap().level, 2000.0);
        let _ = start;
    }

    /// A head that is no longer polled (a future kept alive, not driven) does not hold the
    /// line: 100 ms after its tokens are in hand the one behind it passes it over, and the
    /// head comes back right behind it.
    #[tokio::test(start_paused = true)]
    async fn a_head_that_is_not_polled_is_passed_over() {
        let p = TokenPacer::new(TokenPacingConfig::new());
        p.observe(
            &headers(&[
                ("anthropic-ratelimit-input-tokens-limit", "6000"),
                ("anthropic-ratelimit-input-tokens-remaining", "0"),
            ]),
            true,
            None,
            Instant::now(),
        );
        let w = Waker::noop();
        let cost = |input| Cost {
            input,
            output: 0,
            shared: false,
        };
        let stuck = p.join(cost(1000));
        let next = p.join(cost(100));
        let start = Instant::now();
        assert_eq!(
            p.poll_admit(stuck, w),
            Admit::Wait(start + Duration::from_secs(10))
        );
        let check = start + Duration::from_secs(10) + PASS_OVER;
        assert!(matches!(
            p.poll_admit(next, w),
            Admit::Queued { check: Some(c), .. } if c == check
        ));
        // The head's tokens are in hand; it is not polled.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(matches!(p.poll_admit(next, w), Admit::Queued { .. }));
        tokio::time::advance(PASS_OVER).await;
        assert_eq!(p.poll_admit(next, w), Admit::Go);
        // The head, polled again, is the head again, and waits for what it needs now.
        assert_eq!(p.stats().waiting, 1);
        assert!(matches!(p.poll_admit(stuck, w), Admit::Wait(_)));
    }
}
