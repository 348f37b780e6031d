//! The fleet state of one scope shared across processes through Redis (feature `fleet-redis`).
//!
//! Nothing on a request's path waits for Redis but a pacing turn: the gate is read from a
//! local copy, a first attempt is counted locally, and a retry spends a retry already granted
//! to this process. One background task per fleet talks to Redis: it flushes the counts and
//! renews the grant (every 100 ms while requests flow, every second when idle), publishes
//! closings of the gate, and polls the gate every second (the backstop when a message is
//! lost); between those it sleeps. It ends when the last handle of the fleet is dropped. The
//! closings of the other processes arrive on the store's one subscription, shared by all its
//! scopes (`hub`). Until the task's first poll is answered (or has missed its deadline), the
//! requests of a fleet wait for it at the gate: a process new to a scope does not walk into
//! a gate another closed.
//!
//! With pacing, a second task reserves the slots of the fleet's schedule. The attempts of a
//! process that wait for a slot queue in its line; while one reservation script is in
//! flight, those that come queue behind it, and the next script reserves a slot for each of
//! them, in order (one round trip for many attempts). A slot is booked at most 400 ms
//! ahead (`RESERVE_AHEAD`), and of that, this process's share of the live processes' equal
//! parts: a change of the fleet's rate then reaches the attempts sent within that horizon
//! (booked further ahead, slots would keep the rate of their booking for as long as the line
//! is, and slow start would run away from what is sent), and every process gets its turn.
//! The attempts beyond are asked for again, together, when the schedule has half a horizon
//! left. A script Redis does not answer within its deadline sends its attempts, and those
//! queued behind them, to the local line.
//!
//! The connection is one node's, or a Redis Cluster's (`conn`): the scripts are the same,
//! each naming only keys of its scope's hash tag, so a cluster client runs each on the node
//! of that one slot.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::ConnectionManager;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::budget::{BudgetConfig, SharedBudget};
use super::gate::Gate;
use super::limit::Pacer;
use super::pacing::RemoteOutcome;

mod conn;
mod hub;
mod link;
mod pace;
mod task;
mod tokens;

use self::conn::{cluster_nodes, Conn, Connector};
pub(crate) use self::link::Link;
pub(crate) use self::pace::RemoteTurn;
pub(crate) use self::tokens::RemoteTokens;
use self::{link::*, pace::*, task::*};
use crate::error::ConfigError;

/// Where a fleet keeps its state across processes: one scope (an upstream and a credential)
/// in one Redis. Hand it to [`FleetBuilder::redis`](crate::fleet::FleetBuilder::redis).
///
/// Every process that builds a fleet with the same Redis, prefix and scope shares one
/// cooldown gate, one retry budget and one pacing schedule with the others; the in-process
/// state stays the fallback. See [Across processes](crate::fleet#across-processes).
///
/// Defaults: prefix `llm-retry`, a 50 ms deadline on every Redis call, the gate polled every
/// second, counts flushed every 100 ms, local state after 3 failed calls in a row (fail open),
/// pub/sub on (when built from a URL, a client or a cluster's nodes).
#[derive(Clone)]
pub struct RedisFleet {
    source: Source,
    prefix: String,
    scope: String,
    /// The scope was set: per-scope fleets keep it instead of their own.
    scope_set: bool,
    call_timeout: Duration,
    poll_interval: Duration,
    flush_interval: Duration,
    failures_to_local: u32,
    subscribe: bool,
    fail_closed: bool,
}

#[derive(Clone)]
enum Source {
    /// A client, and the one connection manager the fleets of this store (the scopes of a
    /// per-scope fleet) make from it and share.
    Client(
        redis::Client,
        Arc<Mutex<Option<ConnectionManager>>>,
        Arc<hub::Hub>,
    ),
    Manager(ConnectionManager),
    /// The seed nodes of a Redis Cluster, and the one cluster connection the fleets of this
    /// store make from them and share.
    #[cfg(feature = "fleet-redis-cluster")]
    Cluster(
        Arc<[redis::Client]>,
        Arc<Mutex<Option<redis::cluster_async::ClusterConnection>>>,
        Arc<hub::Hub>,
    ),
}

impl Source {
    /// How the background task gets its connection, and the connection it was given.
    fn connector(self) -> (Option<Connector>, Option<Conn>) {
        match self {
            Source::Client(client, cell, _) => (Some(Connector::Node(client, cell)), None),
            Source::Manager(m) => (None, Some(Conn::Node(m))),
            #[cfg(feature = "fleet-redis-cluster")]
            Source::Cluster(seeds, cell, _) => (Some(Connector::Cluster(seeds, cell)), None),
        }
    }

    /// The nodes a subscription may be made on, and the store's one subscription.
    fn hub(&self) -> Option<(Arc<[redis::Client]>, &Arc<hub::Hub>)> {
        match self {
            Source::Client(client, _, hub) => Some((Arc::from([client.clone()]), hub)),
            Source::Manager(_) => None,
            #[cfg(feature = "fleet-redis-cluster")]
            Source::Cluster(seeds, _, hub) => Some((seeds.clone(), hub)),
        }
    }
}

impl RedisFleet {
    /// A fleet store at `url` (`redis://host:port/db`, `rediss://…`, `redis+unix:///path`),
    /// or on the Redis Cluster whose seed nodes `url` lists
    /// (`redis+cluster://[user:password@]host1:port1,host2:port2`, `rediss+cluster://…`;
    /// feature `fleet-redis-cluster`), as [`from_cluster_nodes`](Self::from_cluster_nodes)
    /// with the URL's credentials on every node. Nothing is connected yet: the fleet connects
    /// in the background once it is used, and keeps to its local state until then. The URL
    /// is never logged.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        if let Some(nodes) = cluster_nodes(url) {
            #[cfg(feature = "fleet-redis-cluster")]
            return Self::from_cluster_nodes(nodes?);
            #[cfg(not(feature = "fleet-redis-cluster"))]
            {
                let _ = nodes?;
                return Err(ConfigError::new(
                    "a Redis Cluster URL needs the `fleet-redis-cluster` feature",
                ));
            }
        }
        // The error would quote the URL, and a URL may carry a password.
        let client = redis::Client::open(url).map_err(|_| ConfigError::new("invalid Redis URL"))?;
        Ok(Self::from_client(client))
    }

    /// A fleet store through `client`: one managed connection for the scripts, one for
    /// pub/sub, shared by every scope of the fleets built from this store and its clones.
    pub fn from_client(client: redis::Client) -> Self {
        Self::with_source(Source::Client(client, Arc::default(), Arc::default()))
    }

    /// A fleet store on a Redis Cluster (or Valkey in cluster mode), given some of its nodes
    /// (`redis://host:port/`, `rediss://…`): the client learns the others, and which owns
    /// which hash slot, from them. Every scope's keys share one hash slot (its hash tag), so
    /// each script runs on the one node that owns it; a node that is lost takes only the
    /// coordination of the scopes on its slots with it (they keep to their local state until
    /// its slots answer again), and a slot that moves is followed (`MOVED`, `ASK`).
    ///
    /// The closings of the gate are published with `PUBLISH`, which a cluster delivers to
    /// the subscribers of every node: the store's one subscription is made on a seed node, on
    /// the next one when that node is lost. The seed nodes' URLs are never logged.
    #[cfg(feature = "fleet-redis-cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fleet-redis-cluster")))]
    pub fn from_cluster_nodes<I>(nodes: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let seeds = nodes
            .into_iter()
            .map(|url| redis::Client::open(url.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            // The error would quote the URL, and a URL may carry a password.
            .map_err(|_| ConfigError::new("invalid Redis URL among the cluster's nodes"))?;
        if seeds.is_empty() {
            return Err(ConfigError::new(
                "a Redis Cluster needs at least one seed node",
            ));
        }
        Ok(Self::with_source(Source::Cluster(
            seeds.into(),
            Arc::default(),
            Arc::default(),
        )))
    }

    /// A fleet store through a connection manager of the caller's. A connection manager
    /// cannot subscribe, so the other processes' closings of the gate are learnt from the
    /// poll (every second) and from this process's own answers only.
    pub fn from_manager(manager: ConnectionManager) -> Self {
        let mut store = Self::with_source(Source::Manager(manager));
        store.subscribe = false;
        store
    }

    fn with_source(source: Source) -> Self {
        RedisFleet {
            source,
            prefix: "llm-retry".to_owned(),
            scope: scope_hash("", b""),
            scope_set: false,
            call_timeout: Duration::from_millis(50),
            poll_interval: Duration::from_secs(1),
            flush_interval: Duration::from_millis(100),
            failures_to_local: 3,
            subscribe: true,
            fail_closed: false,
        }
    }

    /// The scope: the upstream (its authority, `api.anthropic.com`) and the credential the
    /// requests go out with. Only a hash of the two reaches Redis, never the credential.
    /// Defaults to one scope for everything in this Redis and prefix.
    pub fn scope(mut self, upstream: &str, credential: &[u8]) -> Self {
        self.scope = scope_hash(upstream, credential);
        self.scope_set = true;
        self
    }

    /// The store of a scope of a per-scope fleet: its own scope, unless one was set.
    pub(crate) fn default_scope(mut self, upstream: &str, credential: &[u8]) -> Self {
        if !self.scope_set {
            self.scope = scope_hash(upstream, credential);
        }
        self
    }

    /// The start of every key and channel name. Defaults to `llm-retry`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The deadline of every Redis call, within `[1 ms, 10 s]`. A call that misses it
    /// counts as a failure. Defaults to 50 ms.
    pub fn call_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(10) {
            return Err(ConfigError::new(format!(
                "the Redis call timeout must be within [1 ms, 10 s], got {timeout:?}"
            )));
        }
        self.call_timeout = timeout;
        Ok(self)
    }

    /// How often the gate is read from Redis, within `[10 ms, 60 s]`: the longest a closing
    /// whose message was lost takes to reach this process. Defaults to 1 s.
    pub fn poll_interval(mut self, every: Duration) -> Result<Self, ConfigError> {
        if every < Duration::from_millis(10) || every > Duration::from_secs(60) {
            return Err(ConfigError::new(format!(
                "the Redis poll interval must be within [10 ms, 60 s], got {every:?}"
            )));
        }
        self.poll_interval = every;
        Ok(self)
    }

    /// Whether closings of the gate are also learnt from pub/sub messages, as they happen.
    /// Without, they are learnt from the poll. The fleets built from this store and its
    /// clones share one subscription, whatever their number of scopes. Defaults to true
    /// (false from [`from_manager`](RedisFleet::from_manager)).
    pub fn subscribe(mut self, on: bool) -> Self {
        self.subscribe = on && self.source.hub().is_some();
        self
    }

    /// Whether the fleet admits no attempt while it is out of touch with Redis (fail closed),
    /// instead of going on with its local state (fail open).
    ///
    /// Failing open, an outage of Redis costs coordination only: each process keeps to its
    /// own gate and its share of the budget and of the pacing, so the fleet as a whole may
    /// exceed a limit it would have kept (by the gate closings it does not learn of, and by
    /// the processes that went since it last counted them). Failing closed, it never does,
    /// and pays with availability: while Redis (for a cluster, the node that owns the scope's
    /// slot) is out of reach, every attempt of the scope ends at once with
    /// [`ErrorKind::FleetUnreachable`](crate::ErrorKind::FleetUnreachable), and nothing is
    /// sent (a retry is not admitted either: the request ends with that error, its trail
    /// listing the attempts made). For users who must never exceed a paid limit, and would
    /// rather refuse than risk it; a caller that would rather wait retries the error itself.
    ///
    /// Out of touch means what [`RedisState::Local`] and [`RedisState::Connecting`] say: a
    /// process that has not yet been in touch refuses too (after waiting for the first read
    /// of the gate, one call deadline, when the fleet has a gate), and the attempts made
    /// while the fleet finds out that Redis went (three failed calls, each within its
    /// deadline) are admitted. Defaults to false (fail open).
    pub fn fail_closed(mut self, on: bool) -> Self {
        self.fail_closed = on;
        self
    }

    /// The hash that names this scope in Redis.
    pub fn scope_id(&self) -> &str {
        &self.scope
    }

    /// The keys of this scope, all in one hash slot (`{scope}` is their hash tag): the gate,
    /// the budget, the process list, the pacing schedule. And the channel closings are
    /// published on.
    pub fn key_names(&self) -> [String; 5] {
        let k = Keys::new(&self.prefix, &self.scope);
        [k.gate, k.budget, k.procs, k.pace, k.channel]
    }
}

impl fmt::Debug for RedisFleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Neither the URL (it may carry a password) nor anything of the credential.
        f.debug_struct("RedisFleet")
            .field("prefix", &self.prefix)
            .field("scope", &self.scope)
            .field("call_timeout", &self.call_timeout)
            .field("poll_interval", &self.poll_interval)
            .field("subscribe", &self.subscribe)
            .field("fail_closed", &self.fail_closed)
            .finish_non_exhaustive()
    }
}

/// The state of a fleet's link to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RedisState {
    /// Not yet in touch: the local state is used, undivided.
    Connecting,
    /// In touch: the gate and the budget are the fleet's, across `processes` processes.
    Connected {
        /// The processes that have been in touch within the last three polls.
        processes: u32,
    },
    /// Out of touch after repeated failures: the local state is used, the budget divided by
    /// the `processes` last known. Reconnecting in the background.
    Local {
        /// The number of processes last known.
        processes: u32,
    },
}

/// The hex hash naming a scope: the credential never leaves the process.
pub(crate) fn scope_hash(upstream: &str, credential: &[u8]) -> String {
    let mut h = sha1_smol::Sha1::new();
    h.update(b"tower-llm-retry fleet scope\0");
    h.update(upstream.as_bytes());
    h.update(b"\0");
    h.update(credential);
    let hex = h.digest().to_string();
    hex[..32].to_owned()
}

#[derive(Debug, Clone)]
struct Keys {
    gate: String,
    budget: String,
    procs: String,
    pace: String,
    tokens: String,
    tokens_log: String,
    channel: String,
}

impl Keys {
    fn new(prefix: &str, scope: &str) -> Self {
        let k = |what: &str| format!("{prefix}:{{{scope}}}:{what}");
        Keys {
            gate: k("gate"),
            budget: k("budget"),
            procs: k("procs"),
            pace: k("pace"),
            tokens: k("tokens"),
            tokens_log: k("tokens-log"),
            channel: k("gate-closed"),
        }
    }
}

/// Closes the gate on Redis's clock, only ever later, and publishes the new deadline.
/// Returns Redis's time, the deadline in force and the wait it was announced with.
const CLOSE: &str = include_str!("scripts/close.lua");

/// Reads the gate and says this process is alive. Returns Redis's time, the gate's deadline
/// and announced wait (0 when open), the number of live processes and the pacing rate (an
/// empty string when there is none yet).
const POLL: &str = include_str!("scripts/poll.lua");

/// The fleet-wide budget: deposits and withdrawals counted in slots of Redis's clock over
/// one window, as `TpsBudget` counts them in one process. Adds this process's deposits (and
/// the retries it made beyond its grant, if any), takes back the grant it holds, and grants
/// up to `want` anew from what the window allows: `reserve + ratio × deposits −
/// withdrawals`. Returns the grant and the slot it is counted in.
const BUDGET: &str = include_str!("scripts/budget.lua");

/// The longest pause between two attempts to reach Redis again.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Reserves slots of the fleet's pacing schedule (GCRA: one theoretical arrival time per
/// scope) for the `n` attempts of one process that wait for one, in their order, one slot
/// each. A slot is booked only within the horizon (`ARGV[6]` ms ahead) and, of it, only this
/// process's share (one of the live processes' equal parts, at least one slot): a rate learnt now
/// then reaches the slots sent soon, instead of slots booked seconds ahead at the rate of
/// their booking, and every process gets its turn. An attempt whose slot would come later
/// than it may wait (`ARGV[8 + i]` ms) is refused; the others are asked for again when the
/// schedule has half a horizon left (after a quarter of one at the soonest).
///
/// The rate is learnt as in one process: while the schedule is booked ahead it doubles every
/// second until the first refusal (slow start), then grows by `growth` per success reported;
/// a stated limit caps it. The limit this process last saw stated (`ARGV[8]`, 0 for none)
/// caps a schedule Redis no longer holds (restarted, flushed, expired after an idle hour),
/// which the limit's own script, sent only when the limit changes, would not reach again.
/// Returns the epoch, the rate, when to ask again (µs; 0: nothing left) and, per attempt, a
/// code (1 booked, 0 refused, 2 later) and the wait (µs, from `ARGV[9]` on).
const RESERVE: &str = include_str!("scripts/reserve.lua");

/// Takes tokens from the scope's token buckets, in arrival order, or gives back what an
/// answer did not use. Returns a code, the wait and each bucket's level.
const TOKENS: &str = include_str!("scripts/tokens.lua");

/// A refusal of an attempt sent in epoch `ARGV[1]`: the fleet's rate decreases once per
/// epoch, whichever process saw it (by at most half the first time, which ends slow start).
const REFUSE: &str = include_str!("scripts/refuse.lua");

/// A stated request limit: the cap of the fleet's rate.
const LIMIT: &str = include_str!("scripts/limit.lua");

const CONNECTING: u8 = 0;
const CONNECTED: u8 = 1;
const LOCAL: u8 = 2;

/// The fewest retries a process asks to hold, and the most.
const MIN_GRANT: u64 = 2;
const MAX_GRANT: u64 = 64;

/// The tests' real `redis-server`, shared with the integration tests.
#[cfg(test)]
#[allow(dead_code, unreachable_pub)]
#[path = "../../../tests/common/redis.rs"]
mod test_server;

#[cfg(test)]
mod tests {
    use super::*;

    use crate::fleet::GateConfig;

    fn link(redis: &test_server::RedisServer, scope: &str) -> Link {
        let store = RedisFleet::from_url(&redis.url())
            .unwrap()
            .scope("127.0.0.1", scope.as_bytes());
        let gate = Arc::new(Gate::new(GateConfig::new()));
        Link::new(store, Some(gate), Some(BudgetConfig::default()), None)
    }

    async fn connected(link: &Link) {
        for _ in 0..400 {
            if matches!(link.state(), RedisState::Connected { .. }) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("not in touch within 2 s: {:?}", link.state());
    }

    /// Idle, the background task wakes for the poll (every second) and the grant's renewal
    /// (every second): a handful of rounds in 2 s, not a loop that spins.
    #[tokio::test]
    #[ignore = "needs redis-server; run as the README's Tests say"]
    async fn an_idle_link_wakes_only_for_its_polls() {
        let redis = test_server::RedisServer::start();
        let link = link(&redis, "idle");
        connected(&link).await;
        // A request was served: a first attempt counted and flushed.
        link.deposit();
        for _ in 0..400 {
            if link.shared.deposits.load(Ordering::Relaxed) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(link.shared.deposits.load(Ordering::Relaxed), 0, "flushed");
        let before = link.shared.rounds.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rounds = link.shared.rounds.load(Ordering::Relaxed) - before;
        // 2 polls and 2 renewals at most (and a little room): a spinning task makes
        // hundreds of thousands.
        assert!(rounds <= 10, "{rounds} rounds in 2 s idle");
        assert!(matches!(link.state(), RedisState::Connected { .. }));
    }

    #[test]
    fn the_scope_is_a_hash_and_every_key_shares_its_hash_tag() {
        let store = RedisFleet::from_url("redis://127.0.0.1:1/")
            .unwrap()
            .scope("api.anthropic.com", b"sk-ant-api03-secret")
            .prefix("p");
        let id = store.scope_id().to_owned();
        assert_eq!(id.len(), 32);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        for name in store.key_names() {
            assert!(name.starts_with(&format!("p:{{{id}}}:")), "{name}");
            assert!(!name.contains("secret"));
        }
        assert!(!format!("{store:?}").contains("secret"));
        // Another credential, another upstream: other scopes.
        let other = RedisFleet::from_url("redis://127.0.0.1:1/")
            .unwrap()
            .scope("api.anthropic.com", b"sk-ant-api03-other");
        assert_ne!(other.scope_id(), id);
        let upstream = RedisFleet::from_url("redis://127.0.0.1:1/")
            .unwrap()
            .scope("api.openai.com", b"sk-ant-api03-secret");
        assert_ne!(upstream.scope_id(), id);
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(scope_hash("ab", b"c"), scope_hash("a", b"bc"));
    }

    #[cfg(feature = "fleet-redis-cluster")]
    #[test]
    fn a_cluster_is_named_by_its_seed_nodes_and_never_quoted() {
        let store = RedisFleet::from_url("redis+cluster://:hunter2@10.0.0.1:7000,10.0.0.2:7000")
            .unwrap()
            .scope("api.anthropic.com", b"sk-ant-api03-secret");
        assert!(matches!(&store.source, Source::Cluster(seeds, ..) if seeds.len() == 2));
        assert!(store.subscribe);
        assert!(!format!("{store:?}").contains("hunter2"));
        let nodes = [
            "redis://:hunter2@10.0.0.1:7000/",
            "redis://:hunter2@10.0.0.2:7000/",
        ];
        assert!(RedisFleet::from_cluster_nodes(nodes).is_ok());
        let e = RedisFleet::from_cluster_nodes(["redis://:hunter2@h:1/", "nonsense://:hunter2@h"])
            .unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(RedisFleet::from_cluster_nodes(Vec::<String>::new()).is_err());
    }

    #[test]
    fn a_bad_url_is_a_config_error_that_does_not_quote_it() {
        let err = RedisFleet::from_url("nonsense://user:hunter2@host").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
        assert!(RedisFleet::from_url("redis://127.0.0.1/")
            .unwrap()
            .call_timeout(Duration::ZERO)
            .is_err());
        assert!(RedisFleet::from_url("redis://127.0.0.1/")
            .unwrap()
            .poll_interval(Duration::from_secs(61))
            .is_err());
    }

    #[test]
    fn a_reservation_reply_is_read_whole_or_not_at_all() {
        use redis::Value::{BulkString, Int};
        let reply = [
            Int(3),
            BulkString(b"47.5".to_vec()),
            Int(150_000),
            Int(1),
            Int(0),
            Int(1),
            Int(21_052),
            Int(2),
            Int(410_000),
            Int(0),
            Int(61_000_000),
        ];
        let r = parse_reservation(&reply, 4).unwrap();
        assert_eq!((r.epoch, r.rate, r.later), (3, 47.5, 150_000));
        assert_eq!(
            r.slots,
            [(1, 0), (1, 21_052), (2, 410_000), (0, 61_000_000)]
        );
        // A reply for another number of attempts, or of another shape, is no reply.
        assert!(parse_reservation(&reply, 3).is_none());
        let mut bad = reply.clone();
        bad[1] = Int(47);
        assert!(parse_reservation(&bad, 4).is_none());
    }

    #[test]
    fn the_divided_budget_divides_the_reserve() {
        let c = BudgetConfig::new(Duration::from_secs(10), 10, 0.2).unwrap();
        assert_eq!(divide(c, 4).get_min_per_sec(), 2);
        assert_eq!(divide(c, 0).get_min_per_sec(), 10);
        assert_eq!(divide(c, 4).get_retry_ratio(), 0.2);
    }
}
