//! Where the state of a fleet's scope lives: in this process alone, or shared with other
//! processes through Redis (feature `fleet-redis`). The rest of the fleet speaks to one
//! [`Store`] and never asks which.
//!
//! The local state (budget, gate, pacer) is always there: it is what a request reads on its
//! path, and what the fleet falls back to when Redis fails. A Redis store adds the link that
//! keeps it in step with the other processes.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::budget::{BudgetConfig, SharedBudget};
use super::gate::Gate;
use super::limit::Pacer;

/// Marks the epochs of a schedule kept across processes, so that a refusal is reported to
/// the schedule its attempt had its turn from.
pub(crate) const REMOTE_EPOCH: u64 = 1 << 63;

/// What a builder says of the store: the settings a scope's store is made from.
#[derive(Debug, Clone, Default)]
pub(crate) enum StoreConfig {
    /// In this process alone.
    #[default]
    Local,
    /// Shared through Redis.
    #[cfg(feature = "fleet-redis")]
    Redis(Box<super::redis::RedisFleet>),
}

impl StoreConfig {
    /// Whether the state stays in this process.
    pub(crate) fn is_local(&self) -> bool {
        match self {
            StoreConfig::Local => true,
            #[cfg(feature = "fleet-redis")]
            StoreConfig::Redis(_) => false,
        }
    }

    /// The store of the scope of `upstream` and `credential` of a fleet kept per scope: a
    /// Redis store names that scope, unless a scope was set on it.
    pub(crate) fn for_scope(self, upstream: &str, credential: &[u8]) -> Self {
        match self {
            StoreConfig::Local => {
                let _ = (upstream, credential);
                StoreConfig::Local
            }
            #[cfg(feature = "fleet-redis")]
            StoreConfig::Redis(r) => {
                StoreConfig::Redis(Box::new(r.default_scope(upstream, credential)))
            }
        }
    }

    /// The store of one state, over its local budget, gate and pacer.
    pub(crate) fn build(
        self,
        gate: Option<&Arc<Gate>>,
        budget: Option<BudgetConfig>,
        pacer: Option<&Arc<Pacer>>,
    ) -> Store {
        match self {
            StoreConfig::Local => {
                let _ = (gate, budget, pacer);
                Store::Local
            }
            #[cfg(feature = "fleet-redis")]
            StoreConfig::Redis(store) => Store::Redis(super::redis::Link::new(
                *store,
                gate.cloned(),
                budget,
                pacer.cloned(),
            )),
        }
    }
}

/// The store of one state.
#[derive(Debug)]
pub(crate) enum Store {
    /// The local state is the whole state.
    Local,
    /// The local state, kept in step with other processes through Redis.
    #[cfg(feature = "fleet-redis")]
    Redis(super::redis::Link),
}

impl Store {
    /// Whether the state is shared with other processes.
    #[inline]
    pub(crate) fn is_shared(&self) -> bool {
        !matches!(self, Store::Local)
    }

    /// A first attempt is about to be sent (`counted`: and the budget counts it).
    #[inline]
    pub(crate) fn deposit(&self, counted: bool) {
        match self {
            Store::Local => {
                let _ = counted;
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => {
                if counted {
                    link.deposit();
                } else {
                    // No budget to count for: the link still starts on the first request's
                    // runtime (a fleet built outside one has no task yet to learn the
                    // others' closings).
                    link.ensure_started();
                }
            }
        }
    }

    /// May a retry be made, paid from `budget`?
    pub(crate) fn withdraw(&self, budget: &SharedBudget) -> bool {
        match self {
            Store::Local => budget.withdraw(),
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.withdraw(budget),
        }
    }

    /// The local gate was closed until `until` for `wait`: the other processes are told.
    pub(crate) fn closed(&self, until: Instant, wait: Duration) {
        match self {
            Store::Local => {
                let _ = (until, wait);
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.closed(until, wait),
        }
    }

    /// A response stated a request limit, capping the pacing at `cap` requests a second.
    pub(crate) fn stated_limit(&self, cap: f64) {
        match self {
            Store::Local => {
                let _ = cap;
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.stated_limit(cap),
        }
    }

    /// The pacing rate shared across processes, while the store knows one.
    pub(crate) fn pace(&self) -> Option<f64> {
        match self {
            Store::Local => None,
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.pace(),
        }
    }

    /// An attempt that had a turn succeeded: true when the store took the report (its
    /// schedule is shared), false when it is the local pacer's.
    #[inline]
    pub(crate) fn paced_success(&self) -> bool {
        match self {
            Store::Local => false,
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => {
                let shared = link.paces();
                if shared {
                    link.paced_success();
                }
                shared
            }
        }
    }

    /// An attempt sent in `epoch` was refused for load: true when the epoch was one of the
    /// shared schedule (reported to it, when the store still has one), false when it is the
    /// local pacer's.
    /// `factor`: the most the shared rate is to be multiplied by (a warm-up woken by a burst
    /// of refusals), if less than the usual decrease.
    pub(crate) fn paced_refusal(&self, epoch: u64, factor: Option<f64>) -> bool {
        if epoch & REMOTE_EPOCH == 0 {
            return false;
        }
        match self {
            Store::Local => {
                let _ = factor;
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.paced_refusal(epoch & !REMOTE_EPOCH, factor),
        }
        true
    }

    /// This process's pacing woke on evidence of a limit, the server having admitted
    /// `factor` of its attempts: the shared schedule is told, when there is one.
    pub(crate) fn woke(&self, factor: f64) {
        match self {
            Store::Local => {
                let _ = factor;
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => {
                if link.paces() {
                    link.woke(factor);
                }
            }
        }
    }

    /// Whether no attempt of this process waits for a turn of the shared schedule (always,
    /// when there is none).
    pub(crate) fn line_is_empty(&self) -> bool {
        match self {
            Store::Local => true,
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.line_is_empty(),
        }
    }

    /// A turn of the shared schedule for an attempt that may wait `max_wait`, when the store
    /// has one; `None`: the local line.
    pub(crate) fn reserve(&self, max_wait: Duration) -> Option<RemoteTurn> {
        match self {
            Store::Local => {
                let _ = max_wait;
                None
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.reserve(max_wait),
        }
    }

    /// Tokens booked from the buckets the store shares, for an attempt that may wait
    /// `max_wait`; `None`: this process's buckets.
    pub(crate) fn reserve_tokens(
        &self,
        args: &super::tokens::TokenArgs,
        max_wait: Duration,
    ) -> Option<RemoteTokens> {
        match self {
            Store::Local => {
                let _ = (args, max_wait);
                None
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.reserve_tokens(args, max_wait),
        }
    }

    /// Gives back to the buckets the store shares what an answer did not use.
    pub(crate) fn give_tokens(&self, args: &super::tokens::TokenArgs) {
        match self {
            Store::Local => {
                let _ = args;
            }
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.give_tokens(args),
        }
    }

    /// The wait for the first read of the shared gate, while it is to come.
    pub(crate) fn first_read(&self) -> Option<FirstRead> {
        match self {
            Store::Local => None,
            #[cfg(feature = "fleet-redis")]
            Store::Redis(link) => link.first_read(),
        }
    }

    /// Whether an attempt may start (see [`RedisFleet::fail_closed`](super::RedisFleet::fail_closed)).
    #[cfg(feature = "fleet-redis")]
    #[inline]
    pub(crate) fn admits(&self) -> bool {
        match self {
            Store::Local => true,
            Store::Redis(link) => link.admits(),
        }
    }

    /// The state of the link to Redis, when the store is one.
    #[cfg(feature = "fleet-redis")]
    pub(crate) fn redis_state(&self) -> Option<super::redis::RedisState> {
        match self {
            Store::Local => None,
            Store::Redis(link) => Some(link.state()),
        }
    }
}

pub(crate) use super::gate::FirstRead;
#[cfg(feature = "fleet-redis")]
pub(crate) use super::redis::{RemoteTokens, RemoteTurn};

/// Tokens from a shared bucket: none without a store that shares one.
#[cfg(not(feature = "fleet-redis"))]
#[derive(Debug)]
pub(crate) enum RemoteTokens {}

#[cfg(not(feature = "fleet-redis"))]
impl RemoteTokens {
    pub(crate) fn poll(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<super::tokens::TokensOutcome> {
        match *self {}
    }
}

/// A turn of a shared schedule: none without a store that shares one.
#[cfg(not(feature = "fleet-redis"))]
#[derive(Debug)]
pub(crate) enum RemoteTurn {}

#[cfg(not(feature = "fleet-redis"))]
impl RemoteTurn {
    pub(crate) fn poll(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<super::pacing::RemoteOutcome> {
        match *self {}
    }
}

/// The hex hash naming a scope: the credential never leaves the process.
pub(crate) fn scope_id(upstream: &str, credential: &[u8]) -> String {
    #[cfg(feature = "fleet-redis")]
    {
        super::redis::scope_hash(upstream, credential)
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
