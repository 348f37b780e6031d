//! Retry storms, simulated: 1,000 closed-loop clients against one rate-limited or failing
//! server, under paused tokio time (minutes of simulated traffic in seconds), side by side for
//! the retry policies a user would pick.
//!
//! Run with `cargo bench --bench storm`. Prints a table, writes `target/bench/storm.json` and
//! draws `docs/storm_s2.svg` (attempts per second in S2, by policy).
//!
//! # The model
//!
//! - 1,000 clients; each sends one logical request, waits for its outcome (success, or the
//!   policy gave up), and sends the next one at once (S1, S2) or at its next 2 s tick (S4).
//!   Clients start at random offsets within the first 2 s.
//! - The server answers a success after 2 s (an LLM reply) and a refusal (429, 503) after
//!   200 ms (a round trip to the provider's edge). Capacity is counted when a request
//!   arrives.
//! - **S1**: token bucket of 100 requests/s, burst 100; over it, `429` with
//!   `retry-after` = whole seconds to the next token (at least 1). 10 simulated minutes.
//! - **S2**: 6,000 requests per minute window (100/s on average); over it, `429` with
//!   `retry-after` = whole seconds to the window's reset. 10 simulated minutes.
//! - **S4**: no rate limit; clients paced to 500 requests/s; every request gets `503`
//!   (no `retry-after`) from 60 s to 120 s. 4 simulated minutes. `C` is the offered 500/s.
//!   Recovery is the first second after the outage from which a client period (2 s) holds
//!   90 % of its offered load in successes.
//! - **S5**: no rate limit; a server that would take 1,000 requests/s (`C`), offered half of
//!   it (clients paced to 500 requests/s, as in S4); 1 % of answers, at random, are `503`
//!   without `retry-after`. 4 simulated minutes. What the fleet features cost where nothing
//!   limits the rate.
//! - **S6**, the knee: S1's token bucket (100 requests/s, burst 100, `429` with
//!   `retry-after`), offered exactly `C` on average: each client starts a request at
//!   exponential intervals of mean 10 s (at once, when its last one took longer), so the
//!   arrivals are Poisson at 100/s and now and then outrun the bucket. 10 simulated minutes.
//! - **Noise**: S5's server and load; 3 %, 8 % or 15 % of the answers refused at random, half
//!   `429`, half `529`, with `retry-after: 1` or without. Only `default` is run, against the
//!   same run with pacing off; printed beside `storm.json`. `STORM_ONLY=noise` runs these
//!   rows alone.
//! - **T1**, tokens: an input-token limit as Anthropic describes it (36 M tokens a minute,
//!   refilled continuously at 600 k a second, starting full; a request takes the tokens of
//!   its messages; over what is left, `429` with `retry-after` = whole seconds until its
//!   tokens are in, at least 1, and the message naming input tokens; every answer states the
//!   limit and what is left, a success its usage). 200 clients, back to back, each prompt
//!   drawn heavy-tailed: 90 % between 1k and 5k tokens, 10 % between 50k and 150k (mean
//!   12.7k: the limit takes about 47 a second, the clients would send up to 100). 10
//!   simulated minutes; goodput is input tokens served a second over the refill, counted from
//!   the 120th second (the full bucket drains in about a minute). Beside the table, the waits
//!   (time to success less the success's own 2 s) of the requests of 100k tokens or more
//!   against those under 5k. Policies: `default_token_pacing` (`RetryLayer::new()`: the
//!   token pacing and the request pacing, both dormant), `request_pacing` (the same, token
//!   pacing off: the request pacing alone), `official_sdk`, `tower_retry`.
//!   `STORM_ONLY=tokens` runs these rows alone.
//! - **T2**, with `--features fleet-redis`: T1 in real time, ten times faster (latencies,
//!   the refill and the minute of the limits scaled; the clients' own backoffs not), 60 s,
//!   its 200 clients split over 4 fleets of `default_token_pacing`: separate (`T2 4 fleets`,
//!   as 4 processes without coordination) or sharing one `redis-server` (`T2 4 fleets, one
//!   Redis`). Figures in T1's units.
//!
//! Besides the table, S1 and S2 report the peak after the first refusal: in S2 the first
//! window admits everything, so until its quota runs out the fleet's demand (1,000 clients
//! with a 2 s reply, 5 C) reaches the server whatever the policy.
//!
//! # The policies
//!
//! - `no_retry`: one attempt.
//! - `tower_retry`: the real `tower::retry::Retry` with its own `ExponentialBackoff`
//!   (`ExponentialBackoffMaker`'s default parameters: 50 ms doubling, no ceiling, jitter up to
//!   +99 %), retrying 429 and 5xx up to 10 times. It knows no `Retry-After`.
//! - `reqwest_retry`: reqwest-retry's documented policy,
//!   `ExponentialBackoff::builder().build_with_max_retries(3)` of the real `retry-policies`
//!   crate (1 s doubling to 30 min, full jitter), on its transient statuses (408, 429, 5xx).
//!   It ignores `Retry-After`. Its jitter comes from the thread RNG, so this row varies a
//!   little from run to run; the others are determined by the seed.
//! - `official_sdk`: the official Anthropic / OpenAI SDKs' published loop: 2 retries,
//!   `min(0.5 s · 2^n, 8 s) × (1 − 0.25 · U)`, a `retry-after` honoured when 0 < x ≤ 60 s.
//! - `old_default`: this crate's layer as shipped before the fleet features were on by
//!   default: default policy, retry budget on, cooldown gate and pacing off, one state
//!   (`Fleet::builder().cooldown_gate(None).pacing(None).per_scope(false)`).
//! - `default`: `RetryLayer::new()` as shipped: default policy, retry budget, the cooldown
//!   gate for a `Retry-After` of 2 s or more, a dormant pacing (no pacing until evidence of a
//!   limit the client's rate meets: a burst of `429`s, a long `Retry-After`, headers saying
//!   little is left; then from the rate measured over the last second, with
//!   a burst of 1 s), a state per scope.
//! - `default_gate_budget`: the budget with the cooldown gate and the adaptive pacing as
//!   configured explicitly (`GateConfig::new().min_close(Duration::ZERO)`,
//!   `PacingConfig::new().dormant(false).burst(Duration::ZERO)`): every `Retry-After` closes
//!   the gate, and the pacing paces from the first attempt, starting at 50 requests/s in slow
//!   start.
//!
//! This crate's rows drive the real `RetryLayer` over an in-memory `tower::Service` that is the
//! simulated server, so the budget and the gate run for real; every client clones one service.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use retry_policies::policies::ExponentialBackoff as ReqwestBackoff;
use retry_policies::{RetryDecision, RetryPolicy as _};
use serde_json::{json, Value};
use tokio::time::{Instant, Sleep};
use tower::retry::backoff::{Backoff, ExponentialBackoff, ExponentialBackoffMaker, MakeBackoff};
use tower::util::rng::HasherRng;
use tower::{Layer, Service, ServiceExt};
use tower_llm_retry::fleet::{BudgetConfig, Fleet, GateConfig, PacingConfig};
use tower_llm_retry::retry::{AttemptContext, Random, Retry};
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy};

#[cfg(feature = "fleet-redis")]
#[path = "../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis_server;

const CLIENTS: usize = 1_000;
const SUCCESS_LATENCY: Duration = Duration::from_secs(2);
const ERROR_LATENCY: Duration = Duration::from_millis(200);
const S4_PERIOD: Duration = Duration::from_secs(2);
const S6_PERIOD: Duration = Duration::from_secs(10);
/// S5: the share of answers that are a `503`.
const S5_FAILURES: f64 = 0.01;
const S4_OUTAGE: (u64, u64) = (60, 120);
const SEED: u64 = 42;
/// T1: the clients.
const T_CLIENTS: usize = 200;
/// T1: the input-token limit, per minute (Anthropic's ITPM), and its refill a second.
const T_LIMIT: f64 = 36_000_000.0;
const T_REFILL: f64 = T_LIMIT / 60.0;
/// T1: goodput is counted from here, once the bucket that starts full has drained.
const T_WARMUP: u64 = 120;
/// T2: real time over the model's time.
const T2_SCALE: f64 = 0.1;
/// T1: the mean prompt (0.9 × 3,000 + 0.1 × 100,000 tokens).
const T_MEAN_TOKENS: f64 = 12_700.0;
/// T1: the requests counted as the largest.
const T_LARGE: u64 = 100_000;

/// A request's input tokens, as the simulated server counts them.
#[derive(Debug, Clone, Copy)]
struct Tokens(u64);

/// T1's prompt sizes: 90 % between 1k and 5k tokens, 10 % between 50k and 150k.
fn prompt_tokens(rng: &mut StdRng) -> u64 {
    if rng.random::<f64>() < 0.9 {
        rng.random_range(1_000..=5_000)
    } else {
        rng.random_range(50_000..=150_000)
    }
}

/// A Messages request whose content the server counts as `tokens` (4 characters a token).
fn token_body(tokens: u64) -> Bytes {
    let mut s = String::with_capacity(tokens as usize * 4 + 100);
    s.push_str(
        r#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":""#,
    );
    s.extend(std::iter::repeat_n('a', tokens as usize * 4));
    s.push_str(r#""}]}"#);
    Bytes::from(s)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    S1,
    S2,
    S4,
    S5,
    S6,
    /// S2 with the rate-limit headers real APIs send on every answer. Not one of the
    /// scenarios of `storm.json`: reported beside it.
    S2Headers,
    /// Noise: S5's load and capacity, a share (in %) of the answers refused at random, half
    /// `429`, half `529`, with `retry-after: 1` or without. Reported beside `storm.json`.
    Noise(u8, bool),
    /// T1: an input-token bucket as Anthropic describes it; 200 clients, heavy-tailed prompts.
    T1,
    /// T2: T1 in real time, ten times faster, the clients split over 4 fleets: separate
    /// (false) or sharing one Redis (true). Needs `--features fleet-redis`.
    #[cfg_attr(not(feature = "fleet-redis"), allow(dead_code))]
    T2(bool),
}

impl Scenario {
    const ALL: [Scenario; 5] = [
        Scenario::S1,
        Scenario::S2,
        Scenario::S4,
        Scenario::S5,
        Scenario::S6,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::S1 => "S1",
            Scenario::S2 => "S2",
            Scenario::S2Headers => "S2 + headers",
            Scenario::S4 => "S4",
            Scenario::S5 => "S5",
            Scenario::S6 => "S6",
            Scenario::Noise(3, false) => "noise 3 %",
            Scenario::Noise(8, false) => "noise 8 %",
            Scenario::Noise(15, false) => "noise 15 %",
            Scenario::Noise(3, true) => "noise 3 % + retry-after",
            Scenario::Noise(8, true) => "noise 8 % + retry-after",
            Scenario::Noise(15, true) => "noise 15 % + retry-after",
            Scenario::Noise(..) => "noise",
            Scenario::T1 => "T1",
            Scenario::T2(false) => "T2 4 fleets",
            Scenario::T2(true) => "T2 4 fleets, one Redis",
        }
    }

    /// The clients: 200 in the token scenarios.
    fn clients(self) -> usize {
        match self {
            Scenario::T1 | Scenario::T2(_) => T_CLIENTS,
            _ => CLIENTS,
        }
    }

    /// The token scenarios.
    fn is_tokens(self) -> bool {
        matches!(self, Scenario::T1 | Scenario::T2(_))
    }

    /// Real time over simulated time: T2 runs ten times faster than T1's model.
    fn scale(self) -> f64 {
        match self {
            Scenario::T2(_) => T2_SCALE,
            _ => 1.0,
        }
    }

    /// The seconds (of the run's clock) before goodput is counted.
    fn warmup(self) -> u64 {
        (T_WARMUP as f64 * self.scale()) as u64
    }

    fn seconds(self) -> u64 {
        match self {
            Scenario::S1 | Scenario::S2 | Scenario::S2Headers | Scenario::S6 | Scenario::T1 => 600,
            Scenario::S4 | Scenario::S5 | Scenario::Noise(..) => 240,
            Scenario::T2(_) => (600.0 * T2_SCALE) as u64,
        }
    }

    /// The rate the ratios are taken against: the server's capacity, or in S4 (no limit) the
    /// offered load.
    fn capacity(self) -> f64 {
        match self {
            Scenario::S1 | Scenario::S2 | Scenario::S2Headers | Scenario::S6 => 100.0,
            Scenario::S4 => 500.0,
            Scenario::S5 | Scenario::Noise(..) => 1_000.0,
            // Tokens a second.
            Scenario::T1 | Scenario::T2(_) => T_REFILL / self.scale(),
        }
    }

    /// The period of each client's ticks, when the clients are paced (the others send their
    /// next request as soon as the last one ends); in S6 the mean of exponential gaps.
    fn period(self) -> Option<Duration> {
        match self {
            Scenario::S4 | Scenario::S5 | Scenario::Noise(..) => Some(S4_PERIOD),
            Scenario::S6 => Some(S6_PERIOD),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    NoRetry,
    TowerRetry,
    ReqwestRetry,
    OfficialSdk,
    OldDefault,
    Default,
    DefaultGateBudget,
    /// The default with pacing off: what the noise rows are measured against. Not one of
    /// [`Policy::ALL`].
    DefaultNoPacing,
    /// The token rows: the default (request pacing and token pacing, both dormant).
    TokenPacing,
    /// The token rows: today's request pacing alone (the default, token pacing off).
    RequestPacing,
}

impl Policy {
    const ALL: [Policy; 7] = [
        Policy::NoRetry,
        Policy::TowerRetry,
        Policy::ReqwestRetry,
        Policy::OfficialSdk,
        Policy::OldDefault,
        Policy::Default,
        Policy::DefaultGateBudget,
    ];

    fn name(self) -> &'static str {
        match self {
            Policy::NoRetry => "no_retry",
            Policy::TowerRetry => "tower_retry",
            Policy::ReqwestRetry => "reqwest_retry",
            Policy::OfficialSdk => "official_sdk",
            Policy::OldDefault => "old_default",
            Policy::Default => "default",
            Policy::DefaultGateBudget => "default_gate_budget",
            Policy::DefaultNoPacing => "default_no_pacing",
            Policy::TokenPacing => "default_token_pacing",
            Policy::RequestPacing => "request_pacing",
        }
    }

    fn color(self) -> &'static str {
        match self {
            Policy::NoRetry => "#7f7f7f",
            Policy::TowerRetry => "#d62728",
            Policy::ReqwestRetry => "#ff7f0e",
            Policy::OfficialSdk => "#9467bd",
            Policy::OldDefault => "#17becf",
            Policy::Default => "#1f77b4",
            Policy::DefaultGateBudget => "#2ca02c",
            Policy::DefaultNoPacing => "#8c564b",
            Policy::TokenPacing => "#e377c2",
            Policy::RequestPacing => "#bcbd22",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The simulated server.

enum Limiter {
    TokenBucket {
        tokens: f64,
        at: Instant,
    },
    Window {
        started: Instant,
        used: u32,
    },
    Outage,
    /// S5: no limit; a share of the answers fail at random.
    Flaky(Box<StdRng>),
    /// Noise: no limit; a share of the answers refused at random, `429` or `529`.
    Noise {
        rng: Box<StdRng>,
        share: f64,
        retry_after: Option<u64>,
    },
    /// T1: an input-token bucket, refilled continuously, starting full.
    InputTokens {
        level: f64,
        at: Instant,
    },
}

/// What the server answers one attempt.
#[derive(Debug, Clone, Copy)]
struct Reply {
    status: StatusCode,
    retry_after: Option<u64>,
    latency: Duration,
    /// S2 + headers: the limit, what remains of it, and the time to the reset.
    limits: Option<(u32, u32, Duration)>,
    /// T1: the input-token limit and what is left, stated on every answer; the tokens
    /// counted, reported as usage on a success (on a refusal: the message names input
    /// tokens).
    input_tokens: Option<(u64, u64, u64)>,
}

impl Reply {
    fn ok() -> Self {
        Reply {
            status: StatusCode::OK,
            retry_after: None,
            latency: SUCCESS_LATENCY,
            limits: None,
            input_tokens: None,
        }
    }

    fn refused(status: StatusCode, retry_after: Option<u64>) -> Self {
        Reply {
            status,
            retry_after,
            latency: ERROR_LATENCY,
            limits: None,
            input_tokens: None,
        }
    }

    fn is_success(&self) -> bool {
        self.status.is_success()
    }
}

#[derive(Default)]
struct Stats {
    attempts: Vec<u32>,
    first_attempts: Vec<u32>,
    successes: Vec<u32>,
    outage_retries: u64,
    /// The second of the first refusal, if any, and how many there were.
    first_refusal: Option<usize>,
    refusals: u64,
    per_client: Vec<u32>,
    latencies: Vec<f64>,
    logical: u64,
    succeeded: u64,
    /// T1: the input tokens of the successes that ended after the warm-up.
    ok_tokens: u64,
    /// T1: each success's tokens and its wait (its latency less the success's own).
    waits: Vec<(u64, f64)>,
}

struct Sim {
    scenario: Scenario,
    start: Instant,
    limiter: Mutex<Limiter>,
    stats: Mutex<Stats>,
}

impl Sim {
    fn new(scenario: Scenario, seed: u64) -> Arc<Self> {
        let start = Instant::now();
        let limiter = match scenario {
            Scenario::S1 | Scenario::S6 => Limiter::TokenBucket {
                tokens: 100.0,
                at: start,
            },
            Scenario::S2 | Scenario::S2Headers => Limiter::Window {
                started: start,
                used: 0,
            },
            Scenario::S4 => Limiter::Outage,
            Scenario::S5 => Limiter::Flaky(Box::new(StdRng::seed_from_u64(seed ^ 0x5eed_0503))),
            Scenario::Noise(percent, retry_after) => Limiter::Noise {
                rng: Box::new(StdRng::seed_from_u64(seed ^ 0x5eed_0429)),
                share: f64::from(percent) / 100.0,
                retry_after: retry_after.then_some(1),
            },
            Scenario::T1 | Scenario::T2(_) => Limiter::InputTokens {
                level: T_LIMIT,
                at: start,
            },
        };
        let secs = scenario.seconds() as usize + 1;
        Arc::new(Sim {
            scenario,
            start,
            limiter: Mutex::new(limiter),
            stats: Mutex::new(Stats {
                attempts: vec![0; secs],
                first_attempts: vec![0; secs],
                successes: vec![0; secs],
                per_client: vec![0; scenario.clients()],
                ..Stats::default()
            }),
        })
    }

    fn second(&self, at: Instant) -> usize {
        (at - self.start).as_secs() as usize
    }

    /// Admits or refuses one attempt (`attempt` 0 is a first attempt) of `tokens`, now.
    fn decide(&self, attempt: u32, tokens: u64) -> Reply {
        let now = Instant::now();
        let sec = self.second(now);
        {
            let mut stats = self.stats.lock().unwrap();
            if let Some(n) = stats.attempts.get_mut(sec) {
                *n += 1;
            }
            if attempt == 0 {
                if let Some(n) = stats.first_attempts.get_mut(sec) {
                    *n += 1;
                }
            } else if self.in_outage(now) {
                stats.outage_retries += 1;
            }
        }
        let reply = self.limit(now, tokens);
        if !reply.is_success() {
            let mut stats = self.stats.lock().unwrap();
            stats.first_refusal.get_or_insert(sec);
            stats.refusals += 1;
        }
        reply
    }

    /// What the limiter says to an attempt arriving `now`.
    fn limit(&self, now: Instant, cost: u64) -> Reply {
        let mut limiter = self.limiter.lock().unwrap();
        match &mut *limiter {
            Limiter::InputTokens { level, at } => {
                let scale = self.scenario.scale();
                let refill = T_REFILL / scale;
                *level = (*level + (now - *at).as_secs_f64() * refill).min(T_LIMIT);
                *at = now;
                let cost_f = cost as f64;
                let mut reply = if cost_f <= *level {
                    *level -= cost_f;
                    Reply::ok()
                } else {
                    let wait = ((cost_f - *level) / refill).ceil().max(1.0) as u64;
                    Reply::refused(StatusCode::TOO_MANY_REQUESTS, Some(wait))
                };
                reply.latency = reply.latency.mul_f64(scale);
                reply.input_tokens = Some((T_LIMIT as u64, level.max(0.0) as u64, cost));
                reply
            }
            Limiter::TokenBucket { tokens, at } => {
                const RATE: f64 = 100.0;
                const BURST: f64 = 100.0;
                *tokens = (*tokens + (now - *at).as_secs_f64() * RATE).min(BURST);
                *at = now;
                if *tokens >= 1.0 {
                    *tokens -= 1.0;
                    Reply::ok()
                } else {
                    let wait = ((1.0 - *tokens) / RATE).ceil().max(1.0) as u64;
                    Reply::refused(StatusCode::TOO_MANY_REQUESTS, Some(wait))
                }
            }
            Limiter::Window { started, used } => {
                const WINDOW: Duration = Duration::from_secs(60);
                const QUOTA: u32 = 6_000;
                while now - *started >= WINDOW {
                    *started += WINDOW;
                    *used = 0;
                }
                let mut reply = if *used < QUOTA {
                    *used += 1;
                    Reply::ok()
                } else {
                    let reset = (*started + WINDOW - now).as_secs_f64().ceil().max(1.0) as u64;
                    Reply::refused(StatusCode::TOO_MANY_REQUESTS, Some(reset))
                };
                if self.scenario == Scenario::S2Headers {
                    reply.limits = Some((QUOTA, QUOTA - *used, *started + WINDOW - now));
                }
                reply
            }
            Limiter::Outage if self.in_outage(now) => {
                Reply::refused(StatusCode::SERVICE_UNAVAILABLE, None)
            }
            Limiter::Outage => Reply::ok(),
            Limiter::Flaky(rng) => {
                if rng.random::<f64>() < S5_FAILURES {
                    Reply::refused(StatusCode::SERVICE_UNAVAILABLE, None)
                } else {
                    Reply::ok()
                }
            }
            Limiter::Noise {
                rng,
                share,
                retry_after,
            } => {
                let draw = rng.random::<f64>();
                if draw < *share / 2.0 {
                    Reply::refused(StatusCode::TOO_MANY_REQUESTS, *retry_after)
                } else if draw < *share {
                    let overloaded = StatusCode::from_u16(529).expect("a valid status");
                    Reply::refused(overloaded, *retry_after)
                } else {
                    Reply::ok()
                }
            }
        }
    }

    fn in_outage(&self, at: Instant) -> bool {
        self.scenario == Scenario::S4
            && (S4_OUTAGE.0..S4_OUTAGE.1).contains(&(at - self.start).as_secs())
    }

    /// One attempt: the decision now, the answer after its latency.
    async fn exchange(&self, attempt: u32, tokens: u64) -> Reply {
        let reply = self.decide(attempt, tokens);
        tokio::time::sleep(reply.latency).await;
        reply
    }

    fn completed(&self, client: usize, started: Instant, ok: bool, tokens: u64) {
        let now = Instant::now();
        let mut stats = self.stats.lock().unwrap();
        stats.logical += 1;
        if ok && self.scenario.is_tokens() && self.second(now) as u64 >= self.scenario.warmup() {
            stats.ok_tokens += tokens;
            // In the model's seconds.
            let scale = self.scenario.scale();
            let own = SUCCESS_LATENCY.mul_f64(scale);
            let wait = (now - started).saturating_sub(own).as_secs_f64() / scale;
            stats.waits.push((tokens, wait));
        }
        if ok {
            stats.succeeded += 1;
            stats.per_client[client] += 1;
            // In the model's seconds (T2 runs faster).
            let scale = self.scenario.scale();
            stats.latencies.push((now - started).as_secs_f64() / scale);
            let sec = self.second(now);
            if let Some(n) = stats.successes.get_mut(sec) {
                *n += 1;
            }
        }
    }
}

fn retryable(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// The simulated server as a `tower::Service`, for the real `RetryLayer` and `tower::retry`.
#[derive(Clone)]
struct SimService(Arc<Sim>);

/// The attempt number `tower::retry`'s requests carry (the `RetryLayer` sets its own).
#[derive(Debug, Clone, Copy)]
struct TowerAttempt(u32);

impl Service<Request<ReplayBody>> for SimService {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = SimFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReplayBody>) -> SimFuture {
        let attempt = req
            .extensions()
            .get::<AttemptContext>()
            // Counted from 1; the simulation counts retries from 0.
            .map(|c| c.attempt - 1)
            .or_else(|| req.extensions().get::<TowerAttempt>().map(|a| a.0))
            .unwrap_or(0);
        let tokens = req.extensions().get::<Tokens>().map_or(0, |t| t.0);
        let reply = self.0.decide(attempt, tokens);
        SimFuture {
            sleep: Box::pin(tokio::time::sleep(reply.latency)),
            reply,
        }
    }
}

struct SimFuture {
    sleep: Pin<Box<Sleep>>,
    reply: Reply,
}

impl Future for SimFuture {
    type Output = Result<Response<Full<Bytes>>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        std::task::ready!(self.sleep.as_mut().poll(cx));
        let body = match self.reply.input_tokens {
            Some((_, _, counted)) if self.reply.is_success() => Bytes::from(format!(
                r#"{{"type":"message","content":[],"usage":{{"input_tokens":{counted},"output_tokens":100}}}}"#
            )),
            Some(_) => Bytes::from(format!(
                r#"{{"type":"error","error":{{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of {T_LIMIT} input tokens per minute."}}}}"#
            )),
            None => Bytes::new(),
        };
        let mut res = Response::new(Full::new(body));
        if let Some((limit, remaining, _)) = self.reply.input_tokens {
            let h = res.headers_mut();
            h.insert(
                "content-type",
                http::HeaderValue::from_static("application/json"),
            );
            h.insert("anthropic-ratelimit-input-tokens-limit", limit.into());
            h.insert(
                "anthropic-ratelimit-input-tokens-remaining",
                remaining.into(),
            );
        }
        *res.status_mut() = self.reply.status;
        if let Some(secs) = self.reply.retry_after {
            res.headers_mut()
                .insert(http::header::RETRY_AFTER, secs.into());
        }
        if let Some((limit, remaining, reset)) = self.reply.limits {
            // OpenAI's names and formats (`x-ratelimit-reset-requests: 52.8s`).
            let h = res.headers_mut();
            h.insert("x-ratelimit-limit-requests", limit.into());
            h.insert("x-ratelimit-remaining-requests", remaining.into());
            let reset = format!("{:.3}s", reset.as_secs_f64());
            h.insert(
                "x-ratelimit-reset-requests",
                http::HeaderValue::from_str(&reset).expect("a valid header value"),
            );
        }
        Poll::Ready(Ok(res))
    }
}

// ---------------------------------------------------------------------------------------------
// The policies.

/// `tower::retry::Policy` with tower's `ExponentialBackoff`, retrying 429 and 5xx.
#[derive(Clone)]
struct TowerPolicy {
    backoff: ExponentialBackoff<HasherRng<Seeded>>,
    retries_left: u32,
}

/// A hasher seeded per request, so `HasherRng` jitter differs between requests yet is
/// reproducible.
#[derive(Clone)]
struct Seeded(u64);

impl BuildHasher for Seeded {
    type Hasher = std::hash::DefaultHasher;
    fn build_hasher(&self) -> Self::Hasher {
        let mut h = std::hash::DefaultHasher::new();
        h.write_u64(self.0);
        h
    }
}

impl TowerPolicy {
    fn new(seed: u64) -> Self {
        // `ExponentialBackoffMaker::default()`'s parameters, with a seeded generator.
        let mut maker = ExponentialBackoffMaker::new(
            Duration::from_millis(50),
            Duration::from_millis(u64::MAX),
            0.99,
            HasherRng::with_hasher(Seeded(seed)),
        )
        .expect("valid backoff");
        TowerPolicy {
            backoff: maker.make_backoff(),
            retries_left: 10,
        }
    }
}

impl tower::retry::Policy<Request<ReplayBody>, Response<Full<Bytes>>, Infallible> for TowerPolicy {
    type Future = Sleep;

    fn retry(
        &mut self,
        _req: &mut Request<ReplayBody>,
        result: &mut Result<Response<Full<Bytes>>, Infallible>,
    ) -> Option<Sleep> {
        match result {
            Ok(res) if retryable(res.status()) && self.retries_left > 0 => {
                self.retries_left -= 1;
                Some(self.backoff.next_backoff())
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Request<ReplayBody>) -> Option<Request<ReplayBody>> {
        let n = req.extensions().get::<TowerAttempt>().map_or(0, |a| a.0);
        let mut clone = Request::new(req.body().try_clone()?);
        clone.extensions_mut().insert(TowerAttempt(n + 1));
        if let Some(t) = req.extensions().get::<Tokens>() {
            clone.extensions_mut().insert(*t);
        }
        Some(clone)
    }
}

enum Runner {
    NoRetry,
    Tower,
    Reqwest(ReqwestBackoff),
    Sdk,
    Layer(Retry<SimService>),
}

const BODY: &[u8] = br#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[]}"#;

impl Runner {
    fn new(policy: Policy, sim: &Arc<Sim>, seed: u64) -> Self {
        let ours = || RetryPolicy::default().random(Random::seeded(seed));
        match policy {
            Policy::NoRetry => Runner::NoRetry,
            Policy::TowerRetry => Runner::Tower,
            Policy::ReqwestRetry => {
                Runner::Reqwest(ReqwestBackoff::builder().build_with_max_retries(3))
            }
            Policy::OfficialSdk => Runner::Sdk,
            Policy::OldDefault => Runner::Layer(
                RetryLayer::new()
                    .policy(ours())
                    .fleet(
                        Fleet::builder()
                            .cooldown_gate(None)
                            .pacing(None)
                            .per_scope(false)
                            .build(),
                    )
                    .layer(SimService(sim.clone())),
            ),
            Policy::Default => Runner::Layer(
                RetryLayer::new()
                    .policy(ours())
                    .layer(SimService(sim.clone())),
            ),
            Policy::TokenPacing => Runner::Layer(
                RetryLayer::new()
                    .policy(ours())
                    .layer(SimService(sim.clone())),
            ),
            Policy::RequestPacing => Runner::Layer(
                RetryLayer::new()
                    .policy(ours())
                    .fleet(Fleet::builder().token_pacing(None).build())
                    .layer(SimService(sim.clone())),
            ),
            Policy::DefaultNoPacing => Runner::Layer(
                RetryLayer::new()
                    .policy(ours())
                    .fleet(Fleet::builder().pacing(None).build())
                    .layer(SimService(sim.clone())),
            ),
            Policy::DefaultGateBudget => Runner::Layer(
                RetryLayer::new()
                    .policy(ours())
                    .fleet(
                        Fleet::builder()
                            .budget(Some(BudgetConfig::default()))
                            .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                            .pacing(Some(
                                PacingConfig::new()
                                    .dormant(false)
                                    .burst(Duration::ZERO)
                                    .unwrap(),
                            ))
                            .build(),
                    )
                    .layer(SimService(sim.clone())),
            ),
        }
    }

    /// One logical request; true when it succeeded.
    async fn run(
        &self,
        sim: &Arc<Sim>,
        rng: &mut StdRng,
        request_seed: u64,
        tokens: Option<u64>,
    ) -> bool {
        let n = tokens.unwrap_or(0);
        let body = || tokens.map_or_else(|| Bytes::from_static(BODY), token_body);
        match self {
            Runner::NoRetry => sim.exchange(0, n).await.is_success(),
            Runner::Tower => {
                let svc = tower::retry::Retry::new(
                    TowerPolicy::new(request_seed),
                    SimService(sim.clone()),
                );
                let mut req = Request::new(ReplayBody::new(body()));
                req.extensions_mut().insert(Tokens(n));
                let res = svc.oneshot(req).await;
                res.is_ok_and(|r| r.status().is_success())
            }
            Runner::Reqwest(policy) => {
                let started = SystemTime::now();
                let mut past = 0;
                loop {
                    let reply = sim.exchange(past, n).await;
                    if reply.is_success() {
                        return true;
                    }
                    if !retryable(reply.status) {
                        return false;
                    }
                    match policy.should_retry(started, past) {
                        RetryDecision::Retry { execute_after } => {
                            let wait = execute_after
                                .duration_since(SystemTime::now())
                                .unwrap_or_default();
                            tokio::time::sleep(wait).await;
                            past += 1;
                        }
                        RetryDecision::DoNotRetry => return false,
                    }
                }
            }
            Runner::Sdk => {
                const MAX_RETRIES: u32 = 2;
                let mut retry = 0;
                loop {
                    let reply = sim.exchange(retry, n).await;
                    if reply.is_success() {
                        return true;
                    }
                    if !(retryable(reply.status) || reply.status == StatusCode::CONFLICT)
                        || retry == MAX_RETRIES
                    {
                        return false;
                    }
                    let wait = match reply.retry_after {
                        Some(s) if s > 0 && s <= 60 => Duration::from_secs(s),
                        _ => {
                            let base = (0.5 * 2f64.powi(retry as i32)).min(8.0);
                            Duration::from_secs_f64(base * (1.0 - 0.25 * rng.random::<f64>()))
                        }
                    };
                    tokio::time::sleep(wait).await;
                    retry += 1;
                }
            }
            Runner::Layer(svc) => {
                let req = Request::post("https://api.anthropic.com/v1/messages")
                    .extension(Tokens(n))
                    .body(Full::new(body()))
                    .expect("valid request");
                let res = svc.clone().oneshot(req).await;
                res.is_ok_and(|r| r.status().is_success())
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One run, and its figures.

struct Outcome {
    scenario: Scenario,
    policy: Policy,
    success_rate: Option<f64>,
    goodput: f64,
    attempts_per_success: Option<f64>,
    peak: f64,
    p50: Option<f64>,
    p99: Option<f64>,
    jain: Option<f64>,
    outage_retries: Option<u64>,
    recovery: Option<f64>,
    budget_allowance: Option<u64>,
    /// The peak attempts in any whole second after the one of the first refusal, over the
    /// capacity: what the policy does once the server has said something.
    peak_after_refusal: Option<f64>,
    refusals: u64,
    attempts_per_sec: Vec<u32>,
    /// T1: each success's tokens and wait.
    waits: Vec<(u64, f64)>,
}

fn simulate(scenario: Scenario, policy: Policy, seed: u64) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    let sim = rt.block_on(async {
        let sim = Sim::new(scenario, seed);
        let runner = Arc::new(Runner::new(policy, &sim, seed));
        drive(scenario, &sim, &[runner], seed).await;
        sim
    });
    drop(rt);
    figures(scenario, policy, &sim)
}

/// Runs the clients of `scenario` against `sim` to its end, client `i` through
/// `runners[i % runners.len()]`.
async fn drive(scenario: Scenario, sim: &Arc<Sim>, runners: &[Arc<Runner>], seed: u64) {
    let end = sim.start + Duration::from_secs(scenario.seconds());
    let mut offsets = StdRng::seed_from_u64(seed);
    for client in 0..scenario.clients() {
        // Within the first 2 s, or over a client's period when it is longer.
        let spread = scenario.period().map_or(2.0, |p| p.as_secs_f64().max(2.0));
        let offset = Duration::from_secs_f64(offsets.random::<f64>() * spread * scenario.scale());
        let sim = sim.clone();
        let runner = runners[client % runners.len()].clone();
        let mut rng = StdRng::seed_from_u64(seed ^ (client as u64 + 1).wrapping_mul(0x9E37));
        tokio::spawn(async move {
            tokio::time::sleep(offset).await;
            let mut k = 0u64;
            loop {
                let started = Instant::now();
                if started >= end {
                    break;
                }
                let request_seed = seed ^ ((client as u64) << 32 | k);
                let tokens = scenario.is_tokens().then(|| prompt_tokens(&mut rng));
                let ok = runner.run(&sim, &mut rng, request_seed, tokens).await;
                if Instant::now() <= end {
                    sim.completed(client, started, ok, tokens.unwrap_or(0));
                }
                k += 1;
                if let Some(period) = scenario.period() {
                    // S6: Poisson arrivals, exponential gaps of mean `period` between a
                    // client's starts, so that demand at `C` fluctuates around it.
                    let gap = if scenario == Scenario::S6 {
                        period.mul_f64(-(1.0 - rng.random::<f64>()).ln())
                    } else {
                        period
                    };
                    tokio::time::sleep_until(started + gap).await;
                }
            }
        });
    }
    tokio::time::sleep_until(end).await;
}

/// T2: the token scenario in real time, ten times faster, its clients split over 4 fleets,
/// separate or sharing one Redis (`redis`: its URL).
#[cfg(feature = "fleet-redis")]
fn simulate_fleets(redis: Option<&str>, seed: u64) -> Outcome {
    use tower_llm_retry::fleet::{RedisFleet, RedisState, TokenPacingConfig};
    let scenario = Scenario::T2(redis.is_some());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let sim = rt.block_on(async {
        let sim = Sim::new(scenario, seed);
        // A minute of the model is 6 s of the run.
        let minute = Duration::from_secs_f64(60.0 * T2_SCALE);
        let fleets: Vec<Fleet> = (0..4)
            .map(|_| {
                let b = Fleet::builder()
                    .pacing(Some(
                        PacingConfig::new().limit_period(Some(minute)).unwrap(),
                    ))
                    .token_pacing(Some(TokenPacingConfig::new().limit_period(minute).unwrap()));
                match redis {
                    Some(url) => b
                        .redis(
                            RedisFleet::from_url(url)
                                .unwrap()
                                .scope("api.anthropic.com", b"bench-key"),
                        )
                        .build(),
                    None => b.build(),
                }
            })
            .collect();
        for _ in 0..200 {
            let connected = fleets.iter().all(|f| {
                !matches!(f.redis_state(), Some(s) if !matches!(s, RedisState::Connected { .. }))
            });
            if connected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let runners: Vec<Arc<Runner>> = fleets
            .into_iter()
            .enumerate()
            .map(|(i, fleet)| {
                Arc::new(Runner::Layer(
                    RetryLayer::new()
                        .policy(RetryPolicy::default().random(Random::seeded(seed + i as u64)))
                        .fleet(fleet)
                        .layer(SimService(sim.clone())),
                ))
            })
            .collect();
        drive(scenario, &sim, &runners, seed).await;
        sim
    });
    drop(rt);
    figures(scenario, Policy::TokenPacing, &sim)
}

fn figures(scenario: Scenario, policy: Policy, sim: &Sim) -> Outcome {
    let stats = sim.stats.lock().unwrap();
    let c = scenario.capacity();
    let secs = scenario.seconds() as f64;
    let attempts: u64 = stats.attempts.iter().map(|&n| u64::from(n)).sum();
    let ok = stats.succeeded;
    let mut lat = stats.latencies.clone();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| -> Option<f64> {
        if lat.is_empty() {
            return None;
        }
        let i = ((p * lat.len() as f64).ceil() as usize).clamp(1, lat.len()) - 1;
        Some(lat[i])
    };
    let sum: f64 = stats.per_client.iter().map(|&x| f64::from(x)).sum();
    let sum_sq: f64 = stats.per_client.iter().map(|&x| f64::from(x).powi(2)).sum();
    let clients = scenario.clients() as f64;
    let jain = (sum_sq > 0.0).then(|| sum * sum / (clients * sum_sq));
    let (outage_retries, recovery, budget_allowance) = if scenario == Scenario::S4 {
        let end = S4_OUTAGE.1 as usize;
        // Recovery: the first second after the outage from which one client period (2 s)
        // holds 90 % of a period's offered load in successes. Taken per period, not per
        // second: the clients tick every 2 s, so per-second counts carry a 2-s beat whose
        // phase is an accident of the run's start.
        let period = S4_PERIOD.as_secs() as usize;
        let recovered = stats.successes[end..]
            .windows(period)
            .position(|w| w.iter().map(|&n| f64::from(n)).sum::<f64>() >= 0.9 * c * period as f64)
            .map(|i| i as f64);
        let allowance = matches!(
            policy,
            Policy::OldDefault | Policy::Default | Policy::DefaultGateBudget
        )
        .then(|| {
            // What the budget can pay for over the outage: its reserve for every ttl window
            // the outage touches, and its ratio of the first attempts it remembers.
            let b = BudgetConfig::default();
            let ttl = b.get_ttl().as_secs() as usize;
            let start = S4_OUTAGE.0 as usize;
            let firsts: u64 = stats.first_attempts[start - ttl..end]
                .iter()
                .map(|&n| u64::from(n))
                .sum();
            let windows = (end - start).div_ceil(ttl) as u64 + 1;
            b.max_retries(0) * windows + (f64::from(b.get_retry_ratio()) * firsts as f64) as u64
        });
        (Some(stats.outage_retries), recovered, allowance)
    } else {
        (None, None, None)
    };
    Outcome {
        scenario,
        policy,
        success_rate: (stats.logical > 0).then(|| ok as f64 / stats.logical as f64),
        goodput: match scenario {
            // Input tokens served a second, after the warm-up, over the refill.
            Scenario::T1 | Scenario::T2(_) => {
                stats.ok_tokens as f64 / (secs - scenario.warmup() as f64) / c
            }
            _ => ok as f64 / secs / c,
        },
        waits: stats.waits.clone(),
        attempts_per_success: (ok > 0).then(|| attempts as f64 / ok as f64),
        // T1: against the requests a second the token capacity takes at the mean size.
        peak: f64::from(stats.attempts.iter().copied().max().unwrap_or(0))
            / match scenario {
                Scenario::T1 | Scenario::T2(_) => c / T_MEAN_TOKENS,
                _ => c,
            },
        p50: pct(0.5),
        p99: pct(0.99),
        jain,
        outage_retries,
        recovery,
        budget_allowance,
        refusals: stats.refusals,
        peak_after_refusal: stats.first_refusal.map(|first| {
            let after = (first + 1).min(stats.attempts.len());
            f64::from(stats.attempts[after..].iter().copied().max().unwrap_or(0)) / c
        }),
        attempts_per_sec: stats.attempts.clone(),
    }
}

// ---------------------------------------------------------------------------------------------
// Output.

fn round(x: f64, places: i32) -> f64 {
    let f = 10f64.powi(places);
    (x * f).round() / f
}

fn opt(x: Option<f64>, places: i32) -> Value {
    x.map_or(Value::Null, |x| json!(round(x, places)))
}

fn cell(x: Option<f64>, places: usize) -> String {
    x.map_or_else(|| "—".to_owned(), |x| format!("{x:.places$}"))
}

fn to_json(o: &Outcome) -> Value {
    json!({
        "scenario": o.scenario.name(),
        "policy": o.policy.name(),
        "success_rate": opt(o.success_rate, 4),
        "goodput_over_capacity": round(o.goodput, 4),
        "attempts_per_success": opt(o.attempts_per_success, 3),
        "peak_over_capacity": round(o.peak, 3),
        "p50_s": opt(o.p50, 3),
        "p99_s": opt(o.p99, 3),
        "jain_fairness": opt(o.jain, 4),
        "outage_retries": o.outage_retries,
    })
}

fn table(outcomes: &[Outcome], scenarios: &[Scenario]) -> String {
    let mut out = String::new();
    for &scenario in scenarios {
        let _ = writeln!(out, "\n{}", scenario.name());
        let _ = writeln!(
            out,
            "| policy | success | goodput / C | attempts / success | peak 1 s / C | p50 s | p99 s | Jain |{}",
            if scenario == Scenario::S4 { " outage retries | recovery s |" } else { "" }
        );
        let _ = writeln!(
            out,
            "|---|---:|---:|---:|---:|---:|---:|---:|{}",
            if scenario == Scenario::S4 {
                "---:|---:|"
            } else {
                ""
            }
        );
        for o in outcomes.iter().filter(|o| o.scenario == scenario) {
            let _ = write!(
                out,
                "| `{}` | {} | {:.3} | {} | {:.2} | {} | {} | {} |",
                o.policy.name(),
                o.success_rate
                    .map_or_else(|| "—".to_owned(), |s| format!("{:.1} %", s * 100.0)),
                o.goodput,
                cell(o.attempts_per_success, 2),
                o.peak,
                cell(o.p50, 1),
                cell(o.p99, 1),
                cell(o.jain, 3),
            );
            if scenario == Scenario::S4 {
                let _ = write!(
                    out,
                    " {} | {} |",
                    o.outage_retries.unwrap_or(0),
                    o.recovery
                        .map_or_else(|| "not within the run".to_owned(), |r| format!("{r:.0}"))
                );
            }
            out.push('\n');
        }
    }
    out
}

/// Attempts per second in S2, one polyline per policy, on a log scale.
fn svg(outcomes: &[Outcome]) -> String {
    let (w, h) = (960.0, 480.0);
    let (left, right, top, bottom) = (70.0, 190.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let secs = Scenario::S2.seconds() as f64;
    let c = Scenario::S2.capacity();
    let y_max = 5.0; // 10^5 attempts/s
    let x = |t: f64| left + t / secs * pw;
    let y = |v: f64| top + ph - ((v.max(1.0)).log10() / y_max).min(1.0) * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">S2, per-minute window (C = 100 req/s): attempts per second, by policy</text>"#,
        left + pw / 2.0
    );
    for p in 0..=5 {
        let v = 10f64.powi(p);
        let yy = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0,
            v as u64
        );
    }
    for m in 0..=10 {
        let t = f64::from(m) * 60.0;
        let xx = x(t);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{top}" y2="{}" stroke="#eee"/><text x="{xx:.1}" y="{}" text-anchor="middle">{m}</text>"##,
            top + ph,
            top + ph + 16.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">simulated minutes</text>"#,
        left + pw / 2.0,
        h - 10.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">attempts per second (log scale)</text>"#,
        top + ph / 2.0
    );
    let cy = y(c);
    let _ = writeln!(
        s,
        r##"<line x1="{left}" x2="{}" y1="{cy:.1}" y2="{cy:.1}" stroke="black" stroke-dasharray="6 4"/><text x="{}" y="{:.1}">C</text>"##,
        left + pw,
        left + pw + 4.0,
        cy + 4.0
    );
    for (i, o) in outcomes
        .iter()
        .filter(|o| o.scenario == Scenario::S2)
        .enumerate()
    {
        let points: Vec<String> = o
            .attempts_per_sec
            .iter()
            .take(Scenario::S2.seconds() as usize)
            .enumerate()
            .map(|(t, &n)| format!("{:.1},{:.1}", x(t as f64 + 0.5), y(f64::from(n))))
            .collect();
        // The SDK's line lies under `default` here (both honour the Retry-After as sent):
        // dash it so that both show.
        let dash = if o.policy == Policy::OfficialSdk {
            r#" stroke-dasharray="4 4""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.3"{dash} points="{}"/>"#,
            o.policy.color(),
            points.join(" ")
        );
        let ly = top + 10.0 + i as f64 * 20.0;
        let lx = left + pw + 24.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            lx + 20.0,
            o.policy.color(),
            lx + 26.0,
            ly + 4.0,
            o.policy.name()
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The token rows' policies.
const T_POLICIES: [Policy; 4] = [
    Policy::TokenPacing,
    Policy::RequestPacing,
    Policy::OfficialSdk,
    Policy::TowerRetry,
];

/// The token rows, and the waits of their largest requests.
fn tokens(seed: u64) -> (Vec<Outcome>, String) {
    let outcomes: Vec<Outcome> = T_POLICIES
        .into_iter()
        .map(|policy| {
            let wall = std::time::Instant::now();
            let o = simulate(Scenario::T1, policy, seed);
            eprintln!(
                "storm: T1 {:<20} simulated {} s in {:.1} s",
                policy.name(),
                Scenario::T1.seconds(),
                wall.elapsed().as_secs_f64()
            );
            o
        })
        .collect();
    #[cfg(feature = "fleet-redis")]
    let outcomes = {
        let mut outcomes = outcomes;
        let mut redis = redis_server::RedisServer::start();
        for url in [None, Some(redis.url())] {
            let wall = std::time::Instant::now();
            let o = simulate_fleets(url.as_deref(), seed);
            eprintln!(
                "storm: {} simulated {} s in {:.1} s",
                o.scenario.name(),
                o.scenario.seconds(),
                wall.elapsed().as_secs_f64()
            );
            outcomes.push(o);
        }
        redis.kill();
        outcomes
    };
    let scenarios: Vec<Scenario> =
        outcomes
            .iter()
            .map(|o| o.scenario)
            .fold(Vec::new(), |mut v, s| {
                if !v.contains(&s) {
                    v.push(s);
                }
                v
            });
    let mut out = table(&outcomes, &scenarios);
    out.push_str(
        "\n| row | requests of 100k+ tokens served | their wait p50 / p99 (s) | under 5k: wait p50 / p99 (s) | (p99 of 100k+ − p99 under 5k) ÷ their refill | p99 of wait ÷ own refill |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for o in &outcomes {
        let pct = |v: &mut Vec<f64>, p: f64| -> Option<f64> {
            if v.is_empty() {
                return None;
            }
            v.sort_by(f64::total_cmp);
            let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
            Some(v[i])
        };
        let mut small: Vec<f64> = o
            .waits
            .iter()
            .filter(|(t, _)| *t <= 5_000)
            .map(|(_, w)| *w)
            .collect();
        let small_p50 = pct(&mut small, 0.5).unwrap_or(0.0);
        let small_p99 = pct(&mut small, 0.99);
        let large: Vec<(u64, f64)> = o
            .waits
            .iter()
            .copied()
            .filter(|(t, _)| *t >= T_LARGE)
            .collect();
        let mut waits: Vec<f64> = large.iter().map(|(_, w)| *w).collect();
        let refill = |t: u64| t as f64 / T_REFILL;
        let mut ratio: Vec<f64> = large.iter().map(|(t, w)| w / refill(*t)).collect();
        // What the largest wait beyond the small ones, at the same percentile, over the time
        // their own tokens take to refill (their mean size over the refill).
        let mean_large =
            large.iter().map(|(t, _)| *t as f64).sum::<f64>() / large.len().max(1) as f64;
        let large_p99 = pct(&mut waits, 0.99);
        let excess = large_p99
            .zip(small_p99)
            .map(|(l, s)| (l - s).max(0.0) / refill(mean_large as u64));
        let _ = writeln!(
            out,
            "| {} `{}` | {} | {} / {} | {} / {} | {} | {} |",
            o.scenario.name(),
            o.policy.name(),
            large.len(),
            cell(pct(&mut waits, 0.5), 2),
            cell(large_p99, 2),
            cell(Some(small_p50), 2),
            cell(small_p99, 2),
            cell(excess, 2),
            cell(pct(&mut ratio, 0.99), 1),
        );
    }
    (outcomes, out)
}

/// The noise rows: the default against the same run with pacing off.
fn noise(seed: u64) -> String {
    let mut out = String::from(
        "| scenario | goodput (C) | vs pacing off | attempts / success | p50 (s) | p99 (s) | pacing off: goodput, attempts / success, p50, p99 |\n|---|---|---|---|---|---|---|\n",
    );
    for retry_after in [false, true] {
        for percent in [3, 8, 15] {
            let scenario = Scenario::Noise(percent, retry_after);
            let on = simulate(scenario, Policy::Default, seed);
            let off = simulate(scenario, Policy::DefaultNoPacing, seed);
            let _ = writeln!(
                out,
                "| {} | {:.3} | {:.3} | {} | {} | {} | {:.3}, {}, {}, {} |",
                scenario.name(),
                on.goodput,
                on.goodput / off.goodput,
                cell(on.attempts_per_success, 3),
                cell(on.p50, 2),
                cell(on.p99, 2),
                off.goodput,
                cell(off.attempts_per_success, 3),
                cell(off.p50, 2),
                cell(off.p99, 2),
            );
        }
    }
    out
}

fn main() {
    let seed = std::env::var("STORM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED);
    // `STORM_ONLY=noise`: the noise rows alone; `=tokens`: the token rows alone.
    if std::env::var("STORM_ONLY").is_ok_and(|v| v == "noise") {
        println!("{}", noise(seed));
        return;
    }
    if std::env::var("STORM_ONLY").is_ok_and(|v| v == "tokens") {
        println!("{}", tokens(seed).1);
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut outcomes = Vec::new();
    for scenario in Scenario::ALL {
        for policy in Policy::ALL {
            let wall = std::time::Instant::now();
            let o = simulate(scenario, policy, seed);
            eprintln!(
                "storm: {} {:<20} simulated {} s in {:.1} s",
                scenario.name(),
                policy.name(),
                scenario.seconds(),
                wall.elapsed().as_secs_f64()
            );
            outcomes.push(o);
        }
    }
    println!("{}", table(&outcomes, &Scenario::ALL));
    // S2 again, the server now sending the rate-limit headers real APIs send on every answer
    // (limit, remaining, reset): only the fleet features read them.
    let with_headers: Vec<Outcome> = [Policy::Default, Policy::DefaultGateBudget]
        .into_iter()
        .map(|policy| simulate(Scenario::S2Headers, policy, seed))
        .collect();
    println!("{}", table(&with_headers, &[Scenario::S2Headers]));
    // Random refusals at a few percent, capacity well above demand: the default's goodput
    // against the same run with pacing off.
    println!("{}", noise(seed));
    // An input-token limit: token pacing against today's request pacing and the others.
    let (token_rows, token_table) = tokens(seed);
    println!("{token_table}");
    outcomes.extend(token_rows);
    for o in outcomes
        .iter()
        .chain(&with_headers)
        .filter(|o| !matches!(o.scenario, Scenario::S4 | Scenario::S5) && !o.scenario.is_tokens())
    {
        if let Some(peak) = o.peak_after_refusal {
            println!(
                "{} {}: peak {:.2} C over the run, {:.2} C after the first refusal; {} refusals",
                o.scenario.name(),
                o.policy.name(),
                o.peak,
                peak,
                o.refusals
            );
        }
    }
    for o in outcomes.iter().filter(|o| o.budget_allowance.is_some()) {
        println!(
            "S4 {}: {} retries during the outage; the default budget allows at most {} over it",
            o.policy.name(),
            o.outage_retries.unwrap_or(0),
            o.budget_allowance.unwrap_or(0)
        );
    }

    let dir: PathBuf = root.join("target").join("bench");
    std::fs::create_dir_all(&dir).expect("create target/bench");
    let json = Value::Array(outcomes.iter().map(to_json).collect());
    let path = dir.join("storm.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&json).expect("json") + "\n",
    )
    .expect("write storm.json");
    let chart = root.join("docs").join("storm_s2.svg");
    std::fs::create_dir_all(chart.parent().expect("docs")).expect("create docs");
    std::fs::write(&chart, svg(&outcomes)).expect("write storm_s2.svg");
    println!("wrote {} and {}", path.display(), chart.display());
}
