//! Fleet behaviour: the requests sent on one API key share a retry budget, a cooldown gate and
//! an adaptive pacing, so that they behave as a well-mannered fleet rather than a retry storm.
//! That state is a [`Fleet`]: built once, cloned into every layer that sends on the key, and
//! readable while requests run. By default a fleet keeps it per scope (the upstream and a hash
//! of the credential), so one layer may front several keys and upstreams without one key's
//! `429` holding the others.
//!
//! Per-request retry alone turns an overload into a storm: each failed request retries, the
//! retries add load, and an exact `Retry-After` sends everyone back in the same instant.
//!
//! - **Retry budget** ([`BudgetConfig`], on by default): every first attempt deposits, every
//!   retry withdraws; retries the budget cannot pay for are not made. With the defaults,
//!   retries add at most 20 % to the load, plus 10 a second. The accounting is
//!   [`tower::retry::budget::TpsBudget`].
//! - **Cooldown gate** ([`GateConfig`], on by default for a `Retry-After` of 2 s or more): a
//!   `429` or `529` with `Retry-After`,
//!   or rate-limit headers saying no request is left ([below](#rate-limit-headers)), close the gate until
//!   then; attempts about to be sent wait at the gate instead of hammering, and leave spread
//!   over a window once it reopens. An open gate costs a request one atomic load.
//! - **Adaptive pacing** ([`PacingConfig`], on by default and [dormant](PacingConfig::dormant)
//!   until the server signals a rate limit): attempts leave evenly spaced, in
//!   arrival order, at a rate learned from the answers: slow start until the first refusal,
//!   then a small increase per success and a multiplicative decrease per `429` or overload;
//!   a long `Retry-After` is read as a quota and sets the rate that spreads it over its
//!   cycle. A fleet whose requests start together otherwise comes back together, and a
//!   server's limiter refuses the part of every burst above its capacity even when the
//!   average fits. An attempt waits in line no longer than its policy's Retry-After
//!   ceiling or its deadline
//!   ([`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong)), and a head of
//!   the line that is not polled does not hold up the others.
//!
//! # Sharing
//!
//! A [`Fleet`] is a handle on one state: its clones share it. Every layer given the same
//! fleet ([`RetryLayer::fleet`](crate::RetryLayer::fleet)), the services they make, and their
//! clones, share one budget, one gate and one pace per scope, whichever client they sit in
//! front of. A layer given none builds its own [`Fleet::default`]; its clones keep sharing
//! it, however they are re-configured. Two layers built separately without a fleet share
//! nothing.
//!
//! # The defaults
//!
//! A fleet built by default ([`Fleet::default`], [`Fleet::builder`], and the one a
//! [`RetryLayer::new`](crate::RetryLayer::new) builds for itself) has the budget, the gate
//! (for a `Retry-After` of 2 s or more), a dormant pacing with a burst of 1 s, and a state
//! per scope. Where no limit is met that costs nothing but the bookkeeping: the gate is
//! open, the pacing limits nothing until the server signals a rate limit (a `429` or `529`,
//! or a stated request limit; a random `503` is none), and then starts from the rate it
//! measured over the last second. On the success path, in memory, the defaults cost about
//! 400 instructions a request more than the budget alone (the scope's hash and lookup, the
//! rate-limit headers read on the answer when the pacing or the gate uses them); an open gate
//! is one atomic load, a dormant pacing a load and an atomic add. In the storm bench they turn S1 (1,000 clients against a token
//! bucket) from 5.4 % success at 22 attempts per success into 100 % at 1.01, lose nothing in
//! S4 (an outage) and S5 (random `503`s, no limit), and at the knee (S6, demand at the
//! limit) keep goodput (0.978 C against 0.977 C) and succeed for every request where the
//! budget alone fails 0.6 % (its p99 is 5.5 s, against 2.0 s for the requests the budget
//! alone gets through). The earlier defaults, the budget alone and one state:
//!
//! ```
//! use tower_llm_retry::fleet::Fleet;
//! use tower_llm_retry::RetryLayer;
//!
//! let old = Fleet::builder()
//!     .cooldown_gate(None)
//!     .pacing(None)
//!     .per_scope(false)
//!     .build();
//! let layer = RetryLayer::new().fleet(old);
//! # let _ = layer;
//! ```
//!
//! # Configuration
//!
//! | setting | default | change with |
//! |---|---|---|
//! | retry budget | on: deposits count for 10 s, 10 retries a second whatever the traffic, plus 20 % of first attempts; in any 10 s, at most `10 × 10 + 0.2 × first attempts` retries ([`BudgetConfig::max_retries`]) | [`FleetBuilder::budget`] with [`BudgetConfig::new(ttl, min_per_sec, ratio)`](BudgetConfig::new), or `None` to turn it off |
//! | cooldown gate | on, for a `Retry-After` of 2 s or more (a shorter one, a token bucket's next token, is left to the pacing) | [`FleetBuilder::cooldown_gate`] with [`GateConfig::new`] (every `Retry-After` closes it), or `None` to turn it off |
//! | gate: what closes it | a `429` or `529` with a `Retry-After`, for that wait (at most the request's `retry_after_max`; not one above it that the policy ignores, [`AboveCeiling::UseBackoff`](crate::retry::AboveCeiling::UseBackoff)); rate-limit headers saying no request is left, until their reset | [`GateConfig::min_close`] (2 s in the fleet's default gate; zero in [`GateConfig::new`]: every `Retry-After` closes it), [`GateConfig::rate_limit_headers`] (default on) |
//! | gate: spread on reopening | each waiter adds a random extra in `[0, min(50 % × announced wait, 30 s)]`, from the policy's [`Random`] | [`GateConfig::spread`] |
//! | adaptive pacing | on, dormant: it limits nothing until the server's first `429` or `529` (a `5xx` without it neither wakes nor slows it, and a stated request limit, which the providers send on every answer, only caps it for when it wakes); woken by a refusal, it starts from the rate measured over the last second, halved as at the end of slow start but not below 50/s and not above a stated limit; a response saying at most a tenth of the stated limit is left wakes it at the limit | [`FleetBuilder::pacing`] with [`PacingConfig::new`] (paces from the first attempt), [`PacingConfig::dormant`], or `None` to turn it off |
//! | pacing: rate | starts at 50 requests/s (when not dormant), kept within 1 and 10,000 (a stated limit may cap it lower); slow start doubles it every second until the first refusal | [`PacingConfig::rates`] |
//! | pacing: burst | 1 s in the fleet's default (after a quiet spell, up to `rate × 1 s` attempts leave at once); zero in [`PacingConfig::new`] | [`PacingConfig::burst`] |
//! | pacing: on a `429` or overload | ×0.95, once per round; the first refusal, which ends slow start, at least halves it | [`PacingConfig::decrease`] |
//! | pacing: on a success | +0.05 requests/s, only while someone waits in line | [`PacingConfig::growth`] |
//! | pacing: a `Retry-After` of 10 s or more | read as a quota spent: the rate that spreads it over its cycle, held for a cycle, then at most +25 % a cycle | — |
//! | pacing: a stated request limit | caps the rate at the limit per 60 s | [`PacingConfig::limit_period`] |
//! | state per scope | on: a budget, gate and pace per upstream and credential hash, at most 4,096 scopes (a new one past the bound replaces one no request holds; with all in use, it shares the fleet's own state); off for a fleet given a Redis store, whose store names the scope | [`FleetBuilder::per_scope`] |
//! | pacing: longest wait in line | the request's `retry_after_max` (60 s by default) or its deadline, whichever is nearer; then [`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong), or [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded) for the deadline | [`RetryPolicy::retry_after_max`](crate::RetryPolicy::retry_after_max) |
//!
//! The headers read are listed [below](#rate-limit-headers). A retry the budget refuses is not made: the
//! last response comes back as it is, its [`RetryTrail`](crate::RetryTrail) saying
//! [`GiveUpReason::Budget`](crate::GiveUpReason::Budget); a transport error becomes
//! [`ErrorKind::BudgetExhausted`](crate::ErrorKind::BudgetExhausted). What these settings do
//! to a fleet of 1,000 clients is measured by the storm bench (`cargo bench --bench storm`).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_llm_retry::fleet::{BudgetConfig, Fleet, GateConfig, PacingConfig};
//! use tower_llm_retry::RetryLayer;
//!
//! # fn main() -> Result<(), tower_llm_retry::retry::ConfigError> {
//! // One fleet per API key, built once.
//! let fleet = Fleet::builder()
//!     .budget(Some(BudgetConfig::new(Duration::from_secs(10), 5, 0.1)?))
//!     .cooldown_gate(Some(GateConfig::new().spread(0.5, Duration::from_secs(10))?))
//!     .pacing(Some(PacingConfig::new()))
//!     .build();
//! // Every stack that sends on the key gets a clone of it.
//! let for_hyper = RetryLayer::new().fleet(fleet.clone());
//! let for_reqwest = RetryLayer::new().fleet(fleet.clone());
//! // Its state, for metrics.
//! assert_eq!(fleet.gate_closed_until(), None);
//! assert_eq!(fleet.pace(), Some(PacingConfig::new().get_initial()));
//! # let _ = (for_hyper, for_reqwest);
//! # Ok(()) }
//! ```
//!
//! # Across processes
//!
//! With the `fleet-redis` feature, a fleet given a [`RedisFleet`]
//! ([`FleetBuilder::redis`]) shares its cooldown gate and its retry budget with every
//! process whose fleet names the same scope (an upstream and a hash of a credential) in the
//! same Redis. Nothing on a request's path waits for Redis:
//!
//! - **Gate**: a closing is one script on Redis's own clock that only ever extends the
//!   deadline, and publishes it. Each process holds the gate locally and learns of closings
//!   from its own answers, from the message, and from a poll every second (the backstop).
//!   The spread of the release stays local.
//! - **Budget**: the window of `TpsBudget`, fleet-wide: retries in it stay within
//!   `min_per_sec × ttl + retry_ratio × first attempts` summed over every process. First
//!   attempts are counted locally and flushed every 100 ms; each process holds a small
//!   grant of retries from the fleet's balance (renewed with the flush), so a retry spends
//!   one without a round trip, and a retry the grant cannot pay for is refused.
//! - **When Redis fails**: every call has a deadline (50 ms); after three failures in a row
//!   the fleet keeps to its local state, the budget's reserve divided by the number of
//!   processes last known, reconnects in the background, logs once per change of state,
//!   and on return hands Redis the gate deadline it learnt meanwhile (Redis keeps the later).
//!   Keys or scripts that were lost come back with the next call.
//!
//! - **Pacing**: one shared GCRA schedule per scope: an attempt reserves the next slot, then
//!   sleeps locally for it; the attempts of a process that wait together reserve theirs in
//!   one script, booked at most 400 ms ahead, each process its share. The rate is learnt as in one
//!   process (slow start while attempts queue, `growth` per success, `decrease` per
//!   refusal) but in Redis, so a refusal decreases it once per fleet, not once per process;
//!   successes are reported with the next reservation, at no round trip of their own; a
//!   stated limit caps it. A reservation Redis does not answer within its deadline takes a
//!   turn of the local line instead; out of touch, the local line keeps to this process's
//!   share of the fleet's rate. (The quota reading of a long `Retry-After` stays local.)
//!
//! [`Fleet::redis_state`] says whether the fleet is in touch.
//!
//! Keys (one hash tag per scope, so the scripts stay legal on Redis Cluster):
//! `{prefix}:{{scope}}:gate` (a hash: deadline and announced wait, on Redis's clock),
//! `…:budget` (a hash of deposit and withdrawal counts per slot of the window),
//! `…:budget:flush:<process>` (the number and answer of a process's last budget flush: a
//! flush whose answer was lost to the deadline is sent again under its number and counted
//! once; it expires with the window), `…:procs` (a sorted set of live processes), `…:pace`
//! (a hash: the schedule's next slot, rate, epoch, and the stated cap, which every
//! reservation carries again so a lost schedule comes back capped); closings are published
//! on `…:gate-closed`.
//!
#![cfg_attr(
    feature = "fleet-redis",
    doc = r#"```no_run
use tower_llm_retry::fleet::{Fleet, GateConfig, RedisFleet};
use tower_llm_retry::RetryLayer;

# fn main() -> Result<(), tower_llm_retry::retry::ConfigError> {
let store = RedisFleet::from_url("redis://127.0.0.1:6379/")?
    .scope("api.anthropic.com", b"the API key");
let fleet = Fleet::builder()
    .cooldown_gate(Some(GateConfig::new()))
    .redis(store)
    .build();
let layer = RetryLayer::new().fleet(fleet);
# let _ = layer;
# Ok(()) }
```"#
)]
//!
//! # One gate per scope
//!
//! One gate, and one pace, hold every request of their state. That is right when the state's
//! requests share a rate limit (one key, one upstream), and wrong when one state fronts
//! several providers or keys: a `429` from one would hold the others. So a fleet keeps a
//! state per scope by default: the upstream (the request URI's authority) and a hash of the
//! credential header (`authorization`, `x-api-key`, `api-key`, `x-goog-api-key`). A
//! credential set by an inner [`AuthLayer`](crate::AuthLayer) is not seen: such requests are
//! scoped by upstream.
//!
//! # Differences from `tower::retry` with a budget
//!
//! - The budget is wired in: deposits on first attempts, a withdrawal before each retry, and
//!   a refusal that is visible in the [`RetryTrail`](crate::RetryTrail)
//!   ([`GiveUpReason::Budget`](crate::GiveUpReason::Budget)).
//! - The gate has no counterpart in `tower::retry`, which knows no HTTP.
//!
//! # Rate-limit headers
//!
//! | provider | limit | remaining | reset |
//! |---|---|---|---|
//! | Anthropic | `anthropic-ratelimit-requests-limit` | `anthropic-ratelimit-requests-remaining` | `anthropic-ratelimit-requests-reset`: an RFC 3339 instant, `2026-01-01T00:00:10Z` |
//! | OpenAI | `x-ratelimit-limit-requests` | `x-ratelimit-remaining-requests` | `x-ratelimit-reset-requests`: a duration, `1s`, `6m0s`, `547ms`, `2m52.8s` |
//!
//! A value longer than 64 bytes, malformed, negative, overflowing, or a reset more than a day
//! away counts as absent.

mod budget;
mod gate;
mod limit;
#[cfg(feature = "fleet-redis")]
mod redis;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::StatusCode;
use tokio::time::{Instant, Sleep};

pub use self::budget::BudgetConfig;
pub use self::gate::GateConfig;
pub(crate) use self::gate::{GateWait, PastDeadline};
pub use self::limit::PacingConfig;
use self::limit::Turn;
#[cfg(feature = "fleet-redis")]
pub use self::redis::{RedisFleet, RedisState};

use self::budget::SharedBudget;
use self::gate::Gate;
use self::limit::Pacer;
use crate::random::Random;

/// What a request's retry policy tells the fleet, so that the fleet does not depend on the
/// retry module: the longest server wait it honours, whether it ignores a longer one, and the
/// source of the gate's spread.
#[derive(Clone, Copy)]
pub(crate) struct Limits<'a> {
    /// The policy's `Retry-After` ceiling.
    pub(crate) retry_after_max: Duration,
    /// A `Retry-After` above the ceiling is ignored (the policy backs off instead, as the
    /// official SDKs do), so the fleet does not take it as a wait either.
    pub(crate) ignores_above_ceiling: bool,
    pub(crate) random: &'a Random,
}

/// The fleet state that requests on one key share: the retry budget, the cooldown gate and
/// the adaptive pacing, built once and handed to every layer (or middleware) whose requests
/// go out under that key.
///
/// A `Fleet` is a handle: its clones share one state. Hand one to
/// [`RetryLayer::fleet`](crate::RetryLayer::fleet) of every stack that sends on the key (a
/// hyper client and a reqwest-middleware client of one process, say), and they keep one
/// budget, close one gate and keep one pace. A layer given none builds its own
/// ([`Fleet::default`]), shared by the services it makes and by its clones, however they are
/// re-configured.
///
/// The state can be read while requests run: [`gate_closed_until`](Fleet::gate_closed_until),
/// [`pace`](Fleet::pace), [`pacing_refused`](Fleet::pacing_refused),
/// [`budget_stats`](Fleet::budget_stats).
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<FleetState>,
}

/// What the handles of one fleet share.
struct FleetState {
    budget: Option<(BudgetConfig, SharedBudget)>,
    gate: Option<Arc<Gate>>,
    pacer: Option<Arc<Pacer>>,
    /// The state across processes, when the fleet has a Redis store.
    #[cfg(feature = "fleet-redis")]
    redis: Option<self::redis::Link>,
    /// Per scope: the states of each upstream and credential, made on first use.
    scopes: Option<Scopes>,
    /// The scope this state is of, when it is one.
    scope: Option<ScopeName>,
}

/// The states of a fleet kept per scope.
struct Scopes {
    template: FleetBuilder,
    hasher: foldhash::fast::RandomState,
    map: std::sync::RwLock<ScopeMap>,
}

/// The scopes by the foldhash of their upstream and credential: the key is a hash already (of
/// a seeded hasher), so the map does not hash it again.
type ScopeMap = std::collections::HashMap<u64, Fleet, std::hash::BuildHasherDefault<KeyIsHash>>;

/// The hasher of a key that is already a hash: it keeps it.
#[derive(Default)]
struct KeyIsHash(u64);

impl std::hash::Hasher for KeyIsHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed; anything else is folded in, never dropped.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// What names a scope: its upstream, and a hash of the credential (never the credential).
#[derive(Debug, Clone)]
struct ScopeName {
    upstream: String,
    id: String,
}

/// A dormant pacing wakes when a response says at most `1 / LOW_REMAINING` of the stated
/// request limit is left.
const LOW_REMAINING: u64 = 10;

/// The most scopes a fleet keeps apart; requests of scopes beyond share the fleet's own state.
const MAX_SCOPES: usize = 4096;

/// The request headers that carry an API credential, in the order they are preferred.
const CREDENTIAL_HEADERS: [&str; 4] = ["authorization", "x-api-key", "api-key", "x-goog-api-key"];

/// The credential a request carries: the first value of the first of [`CREDENTIAL_HEADERS`]
/// it has. One pass over the (few) request headers, cheaper than a lookup of each name.
fn credential(headers: &http::HeaderMap) -> &[u8] {
    let mut best: Option<(usize, &http::HeaderValue)> = None;
    for (name, value) in headers {
        let Some(rank) = CREDENTIAL_HEADERS.iter().position(|h| *h == name.as_str()) else {
            continue;
        };
        if best.is_none_or(|(r, _)| rank < r) {
            best = Some((rank, value));
        }
    }
    best.map_or(&b""[..], |(_, v)| v.as_bytes())
}

/// Builds a [`Fleet`]; see [`Fleet::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct FleetBuilder {
    budget: Option<BudgetConfig>,
    gate: Option<GateConfig>,
    pacing: Option<PacingConfig>,
    /// `None`: the default, per scope unless the fleet has a Redis store.
    per_scope: Option<bool>,
    #[cfg(feature = "fleet-redis")]
    redis: Option<RedisFleet>,
}

impl FleetBuilder {
    /// The retry budget: retries beyond it are not made, and the trail says so. `None` turns
    /// it off. Defaults to [`BudgetConfig::default`]: a 10 s window, 10 retries a second plus
    /// 20 % of first attempts.
    pub fn budget(mut self, budget: Option<BudgetConfig>) -> Self {
        self.budget = budget;
        self
    }

    /// The cooldown gate: a `429` / `529` with `Retry-After`, or rate-limit headers saying
    /// nothing is left, hold every attempt until then, and release them spread out. See
    /// [`GateConfig`]. An open gate costs a request one atomic load. Defaults to on, as
    /// `GateConfig::new().min_close(2 s)`: a shorter `Retry-After` (a token bucket's next
    /// token) is left to the pacing. `None` turns it off.
    pub fn cooldown_gate(mut self, gate: Option<GateConfig>) -> Self {
        self.gate = gate;
        self
    }

    /// Adaptive pacing: attempts leave evenly spaced at a rate that grows with successes and
    /// shrinks on `429` / overload, the rest waiting their turn in arrival order. See
    /// [`PacingConfig`]. Defaults to `Some(PacingConfig::new().dormant(true))`: no pacing
    /// until the server first signals a rate limit, then from the rate measured over the
    /// last second (see [`PacingConfig::dormant`]); `None` turns it off.
    pub fn pacing(mut self, pacing: Option<PacingConfig>) -> Self {
        self.pacing = pacing;
        self
    }

    /// Shares the budget and the gate with every process whose fleet has the same Redis
    /// store and scope; see [Across processes](crate::fleet#across-processes). The
    /// in-process state stays the fallback. Defaults to none: the state is this process's.
    #[cfg(feature = "fleet-redis")]
    pub fn redis(mut self, store: RedisFleet) -> Self {
        self.redis = Some(store);
        self
    }

    /// Keeps a state of its own (budget, gate, pacing, and, with a Redis store, its Redis
    /// scope) for each scope of the requests: their upstream (the authority of the request's
    /// URI) and credential (the value of `authorization`, `x-api-key`, `api-key` or
    /// `x-goog-api-key`, hashed, never kept). One fleet may then front several keys and
    /// upstreams without one key's `429` holding the others. A credential set by an inner
    /// layer ([`AuthLayer`](crate::AuthLayer)) is not seen: such requests are scoped by
    /// upstream. The read-outs of the fleet itself are those of requests with no upstream (or
    /// past the bound with every scope in use), whose state stays in the process; [`Fleet::scopes`] and
    /// [`Fleet::scope_for`] reach the others. A scope set on the Redis store with
    /// [`RedisFleet::scope`] applies to every scope.
    ///
    /// On a request's path the scope costs a hash of the authority and the credential
    /// (foldhash, not a cryptographic hash: the credential is never stored) and one map
    /// lookup under a read lock; only the first request of a scope allocates. The map holds
    /// at most 4,096 scopes. A new scope past the bound takes the place of one that no
    /// request holds at that moment (what it learnt is forgotten), so credentials that
    /// rotate do not fill it for good; when all are in use, its requests share the fleet's
    /// own state (one budget, gate and pace for all of them, as with `per_scope(false)`).
    /// A flood of distinct credentials costs a bounded amount of memory (about 4,096 small
    /// states).
    /// Defaults to true, but for a fleet given a Redis store ([`FleetBuilder::redis`]),
    /// whose store names its scope already (call `per_scope(true)` to key its state by
    /// request as well); false keeps one state for every request.
    pub fn per_scope(mut self, yes: bool) -> Self {
        self.per_scope = Some(yes);
        self
    }

    /// The fleet, its state new. With a Redis store, its background task starts on the
    /// Tokio runtime this is called on, or, without one, on the first request's.
    pub fn build(self) -> Fleet {
        #[cfg(feature = "fleet-redis")]
        let per_scope = self.per_scope.unwrap_or(self.redis.is_none());
        #[cfg(not(feature = "fleet-redis"))]
        let per_scope = self.per_scope.unwrap_or(true);
        let scopes = per_scope.then(|| Scopes {
            template: FleetBuilder {
                per_scope: Some(false),
                ..self.clone()
            },
            hasher: foldhash::fast::RandomState::default(),
            map: std::sync::RwLock::new(ScopeMap::default()),
        });
        #[allow(unused_mut)]
        let mut root = self;
        // The fleet's own state, of the requests that have no scope, stays in the process.
        #[cfg(feature = "fleet-redis")]
        if scopes.is_some() {
            root.redis = None;
        }
        root.build_state(scopes, None)
    }

    fn build_state(self, scopes: Option<Scopes>, scope: Option<ScopeName>) -> Fleet {
        let gate = self.gate.map(|g| Arc::new(Gate::new(g)));
        let pacer = self.pacing.map(|p| Arc::new(Pacer::new(p)));
        Fleet {
            inner: Arc::new(FleetState {
                budget: self.budget.map(|c| (c, c.build())),
                #[cfg(feature = "fleet-redis")]
                redis: self.redis.map(|store| {
                    self::redis::Link::new(store, gate.clone(), self.budget, pacer.clone())
                }),
                gate,
                pacer,
                scopes,
                scope,
            }),
        }
    }
}

impl Default for FleetBuilder {
    fn default() -> Self {
        FleetBuilder {
            budget: Some(BudgetConfig::default()),
            gate: Some(default_gate()),
            pacing: Some(default_pacing()),
            per_scope: None,
            #[cfg(feature = "fleet-redis")]
            redis: None,
        }
    }
}

/// The fleet's default gate: a `Retry-After` under 2 s (a token bucket's next token) is left
/// to the pacing; a longer one holds every request.
fn default_gate() -> GateConfig {
    GateConfig::new().min_close(DEFAULT_MIN_CLOSE)
}

/// The fleet's default pacing: dormant until the server signals a limit, with a burst of 1 s.
fn default_pacing() -> PacingConfig {
    PacingConfig::new()
        .dormant(true)
        .burst(Duration::from_secs(1))
        .expect("a burst within bounds")
}

/// The shortest `Retry-After` that closes the fleet's default gate.
const DEFAULT_MIN_CLOSE: Duration = Duration::from_secs(2);

impl Default for Fleet {
    /// The defaults of [`Fleet::builder`]: what a layer given no fleet builds.
    fn default() -> Self {
        Fleet::builder().build()
    }
}

/// What the retry budget of a fleet has counted since the fleet was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct BudgetStats {
    /// First attempts, each a deposit.
    pub first_attempts: u64,
    /// Retries the budget paid for.
    pub retries: u64,
    /// Retries the budget refused (each a request that gave up with
    /// [`GiveUpReason::Budget`](crate::GiveUpReason::Budget)).
    pub refused: u64,
}

impl Fleet {
    /// A builder with the defaults: the default budget, the default cooldown gate, a
    /// [dormant](PacingConfig::dormant) pacing, a state per scope
    /// ([`FleetBuilder::per_scope`]). `Fleet::builder().cooldown_gate(None).pacing(None)
    /// .per_scope(false)` is the fleet of earlier versions: the budget alone, one state.
    pub fn builder() -> FleetBuilder {
        FleetBuilder::default()
    }

    /// Whether `self` and `other` are handles of one fleet.
    pub fn ptr_eq(&self, other: &Fleet) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The budget's settings, when it is on.
    pub fn budget_config(&self) -> Option<BudgetConfig> {
        self.inner.budget.as_ref().map(|(c, _)| *c)
    }

    /// What the budget has counted, when it is on.
    pub fn budget_stats(&self) -> Option<BudgetStats> {
        self.inner.budget.as_ref().map(|(_, b)| b.stats())
    }

    /// The gate's settings, when it is on.
    pub fn gate_config(&self) -> Option<GateConfig> {
        self.inner.gate.as_ref().map(|g| g.config.clone())
    }

    /// When the cooldown gate reopens, while it is closed; `None` when it is open (or off).
    /// Waiters leave from then on, spread out.
    pub fn gate_closed_until(&self) -> Option<Instant> {
        self.inner.gate.as_ref()?.closed_until()
    }

    /// How many times the gate was closed, or its closing extended, when it is on.
    pub fn gate_closings(&self) -> Option<u64> {
        self.inner.gate.as_ref().map(|g| g.closings())
    }

    /// The pacing's settings, when it is on.
    pub fn pacing_config(&self) -> Option<PacingConfig> {
        self.inner.pacer.as_ref().map(|p| p.config())
    }

    /// The current pacing rate, in requests per second, when pacing is on and awake (not
    /// [dormant](PacingConfig::dormant)): the fleet's, across processes, while a Redis store
    /// is in touch.
    pub fn pace(&self) -> Option<f64> {
        let pacer = self.inner.pacer.as_ref()?;
        if !pacer.is_awake() {
            return None;
        }
        #[cfg(feature = "fleet-redis")]
        if let Some(rate) = self.inner.redis.as_ref().and_then(|l| l.pace()) {
            return Some(rate);
        }
        Some(pacer.rate())
    }

    /// How many attempts gave up because their pacing turn would come later than they may
    /// wait, when pacing is on.
    pub fn pacing_refused(&self) -> Option<u64> {
        self.inner.pacer.as_ref().map(|p| p.refused())
    }

    /// The handle on the state that a request like `req` uses: its scope's, when the fleet
    /// keeps one per scope ([`FleetBuilder::per_scope`]), made now if it was not yet; the
    /// fleet itself otherwise.
    pub fn scope_for<B>(&self, req: &http::Request<B>) -> Fleet {
        self.for_request(req.uri(), req.headers())
            .unwrap_or_else(|| self.clone())
    }

    /// The scopes made so far, when the fleet keeps one per scope.
    pub fn scopes(&self) -> Vec<Fleet> {
        match &self.inner.scopes {
            Some(s) => s.read().values().cloned().collect(),
            None => Vec::new(),
        }
    }

    /// The upstream of the scope this handle is of, when it is one.
    pub fn scope_upstream(&self) -> Option<&str> {
        self.inner.scope.as_ref().map(|s| s.upstream.as_str())
    }

    /// The id of the scope this handle is of, when it is one: a hash of its upstream and
    /// credential (the name of its state in Redis, with a store).
    pub fn scope_id(&self) -> Option<&str> {
        self.inner.scope.as_ref().map(|s| s.id.as_str())
    }

    /// The state of a request to `uri` with `headers`: its scope's when the fleet keeps one
    /// per scope, `None` when the fleet's own.
    pub(crate) fn for_request(&self, uri: &http::Uri, headers: &http::HeaderMap) -> Option<Fleet> {
        let scopes = self.inner.scopes.as_ref()?;
        // Without any `user:password@`: the upstream is shown in read-outs and logs, and names
        // the scope in Redis, so the key leaves it out too.
        let authority = uri.authority()?.as_str();
        let upstream = authority
            .rsplit_once('@')
            .map_or(authority, |(_, host)| host);
        let credential = credential(headers);
        let key = {
            use std::hash::BuildHasher;
            scopes.hasher.hash_one((upstream, credential))
        };
        if let Some(f) = scopes.read().get(&key) {
            return Some(f.clone());
        }
        let mut map = scopes.write();
        if let Some(f) = map.get(&key) {
            return Some(f.clone());
        }
        if map.len() >= MAX_SCOPES {
            // Full: a scope no request holds makes room (its state is what a new scope would
            // start from anyway, less what it learnt), so rotating credentials (hourly bearer
            // tokens) do not fill the map for good. With every scope in use, the request
            // shares the fleet's own state.
            let idle = map
                .iter()
                .find(|(_, f)| Arc::strong_count(&f.inner) == 1)
                .map(|(k, _)| *k)?;
            map.remove(&idle);
        }
        let id = scope_id(upstream, credential);
        #[allow(unused_mut)]
        let mut template = scopes.template.clone();
        #[cfg(feature = "fleet-redis")]
        {
            template.redis = template
                .redis
                .map(|r| r.default_scope(upstream, credential));
        }
        let fleet = template.build_state(
            None,
            Some(ScopeName {
                upstream: upstream.to_owned(),
                id,
            }),
        );
        map.insert(key, fleet.clone());
        Some(fleet)
    }

    /// The state of the link to Redis, when the fleet has a Redis store.
    #[cfg(feature = "fleet-redis")]
    pub fn redis_state(&self) -> Option<RedisState> {
        self.inner.redis.as_ref().map(|l| l.state())
    }

    fn gate(&self) -> Option<&Gate> {
        self.inner.gate.as_deref()
    }

    fn pacer(&self) -> Option<&Pacer> {
        self.inner.pacer.as_deref()
    }

    /// A place in the pacing line for the next attempt, when pacing is on. It waits for its
    /// turn no longer than the policy's Retry-After ceiling, nor past `deadline`. Dropping it
    /// before its turn leaves the line.
    pub(crate) fn ticket(&self, limits: Limits<'_>, deadline: Option<Instant>) -> Option<Ticket> {
        let pacer = self.pacer()?;
        // Dormant, the pacing only counts what goes out, until the server signals a limit.
        if !pacer.is_awake() {
            pacer.dormant_send();
            return None;
        }
        let now = Instant::now();
        // A ceiling set to "forever" must not overflow the instant.
        let ceiling = now + limits.retry_after_max.min(MAX_PACING_WAIT);
        let give_up_at = deadline.map_or(ceiling, |d| d.min(ceiling));
        // Across processes, a turn of the fleet's schedule; the local line otherwise.
        #[cfg(feature = "fleet-redis")]
        let remote = self
            .inner
            .redis
            .as_ref()
            .and_then(|l| l.reserve(give_up_at.saturating_duration_since(now)));
        #[cfg(feature = "fleet-redis")]
        let n = remote.is_none().then(|| pacer.ticket());
        #[cfg(not(feature = "fleet-redis"))]
        let n = Some(pacer.ticket());
        Some(Ticket {
            fleet: self.clone(),
            n,
            #[cfg(feature = "fleet-redis")]
            remote,
            done: false,
            joined: false,
            since: now,
            give_up_at,
            by_deadline: deadline.is_some_and(|d| d <= ceiling),
            sleep: None,
        })
    }

    /// The current pacing rate, for the retry loop's trace events.
    pub(crate) fn pacing_rate(&self) -> Option<f64> {
        self.pace()
    }

    /// An attempt that had a pacing turn succeeded.
    pub(crate) fn paced_success(&self) {
        #[cfg(feature = "fleet-redis")]
        if let Some(link) = self.inner.redis.as_ref().filter(|l| l.paces()) {
            link.paced_success();
            return;
        }
        if let Some(p) = self.pacer() {
            p.on_success();
        }
    }

    /// An attempt sent in `epoch` was refused for load.
    pub(crate) fn paced_refusal(&self, epoch: u64, retry_after: Option<Duration>) {
        #[cfg(feature = "fleet-redis")]
        if epoch & self::redis::REMOTE_EPOCH != 0 {
            if let Some(link) = &self.inner.redis {
                link.paced_refusal(epoch & !self::redis::REMOTE_EPOCH);
            }
            return;
        }
        if let Some(p) = self.pacer() {
            p.on_refusal(epoch, retry_after);
        }
    }

    /// A first attempt is about to be sent.
    pub(crate) fn deposit(&self) {
        if let Some((_, budget)) = &self.inner.budget {
            budget.deposit();
        }
        #[cfg(feature = "fleet-redis")]
        if let Some(link) = &self.inner.redis {
            if self.inner.budget.is_some() {
                link.deposit();
            } else {
                // No budget to count for: the link still starts on the first request's
                // runtime (a fleet built outside one has no task yet to learn the others'
                // closings).
                link.ensure_started();
            }
        }
    }

    /// A retry is planned: may it be made?
    pub(crate) fn withdraw(&self) -> bool {
        let Some((_, budget)) = &self.inner.budget else {
            return true;
        };
        #[cfg(feature = "fleet-redis")]
        if let Some(link) = &self.inner.redis {
            return link.withdraw(budget);
        }
        budget.withdraw()
    }

    /// Closes the gate for `wait` from now, and tells the other processes.
    fn close_gate(&self, gate: &Gate, wait: Duration) {
        let until = gate.close(Instant::now(), wait);
        #[cfg(feature = "fleet-redis")]
        if let (Some(until), Some(link)) = (until, &self.inner.redis) {
            link.closed(until, wait);
        }
        #[cfg(not(feature = "fleet-redis"))]
        let _ = until;
    }

    /// Tells the fleet what a response said. The gate: a `429` / `529` with `Retry-After`, or
    /// rate-limit headers saying no request is left (the wait is capped at `policy`'s
    /// Retry-After ceiling). The pacing: a stated request limit.
    pub(crate) fn observe(
        &self,
        head: &http::response::Parts,
        retry_after: Option<Duration>,
        limits: Limits<'_>,
    ) {
        let ceiling = limits.retry_after_max;
        // A Retry-After above the ceiling of a policy that ignores it (as the official SDKs
        // do) is not taken as a wait by the fleet either.
        let honoured = |w: &Duration| *w <= ceiling || !limits.ignores_above_ceiling;
        let retry_after = retry_after.filter(honoured);
        // Read only for what uses them: the pacing, and a gate that reads rate-limit headers.
        let counts = match self.pacer().is_some()
            || self
                .gate()
                .is_some_and(|g| g.config.reads_rate_limit_headers())
        {
            true => crate::provider::ratelimit::RequestCounts::read(&head.headers),
            false => crate::provider::ratelimit::RequestCounts::default(),
        };
        // Pacing: a refusal for load wakes a dormant pacing (a 5xx without it does not); a
        // stated request limit caps the rate. The limit alone does not wake it (the providers
        // state theirs on every answer, and a client well within it is not to be slowed), but
        // a window nearly spent does: at most a tenth of the limit left.
        if let Some(pacer) = self.pacer() {
            if !pacer.is_awake() {
                let status = head.status;
                if status == StatusCode::TOO_MANY_REQUESTS
                    || status.as_u16() == crate::classify::STATUS_OVERLOADED
                {
                    pacer.wake_on_refusal(retry_after.map(|w| w.min(ceiling)));
                }
            }
            if let Some(limit) = counts.limit() {
                pacer.on_limit(limit);
                if !pacer.is_awake()
                    && counts
                        .remaining()
                        .is_some_and(|left| left.saturating_mul(LOW_REMAINING) <= limit)
                {
                    pacer.wake_on_limit();
                }
                #[cfg(feature = "fleet-redis")]
                if let (Some(link), Some(cap)) = (&self.inner.redis, pacer.config().cap_for(limit))
                {
                    link.stated_limit(cap);
                }
            }
        }
        let Some(gate) = self.gate() else {
            return;
        };
        let status = head.status.as_u16();
        let h = &head.headers;
        // Absolute times from the server are read against the server's own clock, its
        // `Date`, where it sent one: the host's clock skew then does not move the deadline.
        // (A wall clock set on the gate config, for tests, is used instead.)
        // Parsed only when an absolute time is read: not on the success path.
        let server_now = || {
            if gate.config.has_wall_clock() {
                None
            } else {
                crate::classify::headers::server_date(h)
            }
        };
        if status == StatusCode::TOO_MANY_REQUESTS.as_u16()
            || status == crate::classify::STATUS_OVERLOADED
        {
            let server_now = retry_after_is_a_date(h).then(server_now).flatten();
            let retry_after = match server_now {
                Some(now) => crate::classify::headers::parse_retry_after(h, now),
                _ => retry_after,
            }
            .filter(honoured);
            if let Some(wait) = retry_after.filter(|w| *w >= gate.config.get_min_close()) {
                self.close_gate(gate, wait.min(ceiling));
            }
        }
        if gate.config.reads_rate_limit_headers() && counts.states_remaining() {
            let now = server_now().unwrap_or_else(|| gate.config.now());
            if let Some(wait) = crate::provider::ratelimit::requests_exhausted_for(h, now) {
                self.close_gate(gate, wait.min(ceiling));
            }
        }
    }
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.inner;
        let mut d = f.debug_struct("Fleet");
        d.field("budget", &s.budget.as_ref().map(|(c, b)| (c, b.stats())))
            .field("gate", &s.gate)
            .field("pacer", &s.pacer);
        #[cfg(feature = "fleet-redis")]
        d.field("redis", &s.redis);
        if let Some(scope) = &s.scope {
            d.field("scope", scope);
        }
        if let Some(scopes) = &s.scopes {
            d.field("scopes", &scopes.read().len());
        }
        d.finish()
    }
}

/// Whether the wait a response asks for is an HTTP-date (`retry-after` with no
/// `retry-after-ms` before it, and not a number of seconds).
fn retry_after_is_a_date(h: &http::HeaderMap) -> bool {
    if h.contains_key(crate::classify::headers::RETRY_AFTER_MS) {
        return false;
    }
    h.get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| httpdate::parse_http_date(v.trim()).is_ok())
}

impl Scopes {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, ScopeMap> {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, ScopeMap> {
        self.map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The hex hash naming a scope: the credential never leaves the process.
fn scope_id(upstream: &str, credential: &[u8]) -> String {
    #[cfg(feature = "fleet-redis")]
    {
        self::redis::scope_hash(upstream, credential)
    }
    #[cfg(not(feature = "fleet-redis"))]
    {
        // Within one process: a keyed hash, not kept anywhere else.
        use std::hash::BuildHasher;
        static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
            std::sync::OnceLock::new();
        let h = KEY
            .get_or_init(Default::default)
            .hash_one((upstream, credential));
        format!("{h:016x}")
    }
}

/// The longest an attempt waits in the pacing line, whatever its policy's ceiling.
const MAX_PACING_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

/// A place in the pacing line.
pub(crate) struct Ticket {
    fleet: Fleet,
    /// Its place in the local line, once it joined it.
    n: Option<u64>,
    /// Its turn of the fleet's schedule across processes, while it waits for it.
    #[cfg(feature = "fleet-redis")]
    remote: Option<self::redis::RemoteTurn>,
    /// Served, or given up: out of the line.
    done: bool,
    /// Polled once: the expected wait is judged as it joins.
    joined: bool,
    since: Instant,
    /// The latest instant its turn may come.
    give_up_at: Instant,
    /// That instant is the request's deadline.
    by_deadline: bool,
    // The instant to look again (its turn, a check on the head, its bound); allocated only
    // when it has to wait.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Ticket {
    /// Ready with the pacing epoch once the turn has come (the ticket is then used up), or
    /// with the refusal once it is known that the turn would come after the ticket's bound:
    /// on joining, when the wait expected at the rate of the moment is longer; at the head,
    /// when its instant is later; behind others, when the bound comes. The ticket has then
    /// left the line.
    pub(crate) fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Result<u64, PacingRefused>> {
        #[cfg(feature = "fleet-redis")]
        if let Some(remote) = &mut self.remote {
            let outcome = std::task::ready!(remote.poll(cx));
            self.remote = None;
            match outcome {
                self::redis::RemoteOutcome::Go(epoch) => {
                    self.done = true;
                    return Poll::Ready(Ok(epoch | self::redis::REMOTE_EPOCH));
                }
                self::redis::RemoteOutcome::TooFar(wait) => {
                    let left = self.give_up_at.saturating_duration_since(Instant::now());
                    return Poll::Ready(Err(self.refuse(Some(wait), left)));
                }
                // Redis did not answer in time: the local line, at once.
                self::redis::RemoteOutcome::Failed => {}
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

    /// The scope's credential: `authorization` first, then the API-key headers in order,
    /// the first value of each, whatever order the request has them in.
    #[test]
    fn credential_prefers_in_order() {
        let mut h = http::HeaderMap::new();
        assert_eq!(credential(&h), b"");
        h.insert("content-type", "application/json".parse().unwrap());
        h.insert("x-goog-api-key", "g".parse().unwrap());
        assert_eq!(credential(&h), b"g");
        h.insert("api-key", "azure".parse().unwrap());
        assert_eq!(credential(&h), b"azure");
        h.append("x-api-key", "first".parse().unwrap());
        h.append("x-api-key", "second".parse().unwrap());
        assert_eq!(credential(&h), b"first");
        h.insert("authorization", "Bearer t".parse().unwrap());
        assert_eq!(credential(&h), b"Bearer t");
        // The rank decides, not the order in the map.
        let mut h = http::HeaderMap::new();
        h.insert("authorization", "Bearer first".parse().unwrap());
        h.insert("x-api-key", "k".parse().unwrap());
        h.insert("x-goog-api-key", "g".parse().unwrap());
        assert_eq!(credential(&h), b"Bearer first");
        h.remove("authorization");
        assert_eq!(credential(&h), b"k");
    }

    /// A scope is the upstream without its userinfo plus the credential: the same key through
    /// `user:password@` shares one scope, named without it; another key gets its own.
    #[test]
    fn scopes_leave_userinfo_out() {
        let fleet = Fleet::builder().build();
        let req = |uri: &str, key: &str| {
            http::Request::get(uri)
                .header("x-api-key", key)
                .body(())
                .unwrap()
        };
        let plain = fleet.scope_for(&req("https://api.example.com/v1/messages", "k1"));
        let alice = fleet.scope_for(&req("https://alice:pw@api.example.com/v1/messages", "k1"));
        let bob = fleet.scope_for(&req("https://bob:pw@api.example.com/v1/messages", "k1"));
        let other = fleet.scope_for(&req("https://alice:pw@api.example.com/v1/messages", "k2"));
        assert!(Arc::ptr_eq(&plain.inner, &alice.inner));
        assert!(Arc::ptr_eq(&plain.inner, &bob.inner));
        assert!(!Arc::ptr_eq(&plain.inner, &other.inner));
        assert_eq!(alice.scope_upstream(), Some("api.example.com"));
        assert_eq!(other.scope_upstream(), Some("api.example.com"));
        assert_ne!(plain.scope_id(), other.scope_id());
        assert_eq!(fleet.scopes().len(), 2);
    }

    fn limits(retry_after_max: Duration, random: &Random) -> Limits<'_> {
        Limits {
            retry_after_max,
            ignores_above_ceiling: false,
            random,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_ticket_whose_turn_is_past_its_bound_is_refused_on_joining_and_counted() {
        // One turn a second; a policy that lets an attempt wait 2 s.
        let fleet = Fleet::builder()
            .budget(None)
            .pacing(Some(PacingConfig::new().rates(1.0, 1.0, 1.0).unwrap()))
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
