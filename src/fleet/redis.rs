//! The fleet state of one scope shared across processes through Redis (feature `fleet-redis`).
//!
//! Nothing on a request's path waits for Redis but a pacing turn: the gate is read from a
//! local copy, a first attempt is counted locally, and a retry spends a retry already granted
//! to this process. One background task per fleet talks to Redis: it flushes the counts and
//! renews the grant (every 100 ms while requests flow), publishes closings of the gate,
//! listens for those of the other processes, and polls the gate every second (the backstop
//! when a message is lost). It ends when the last handle of the fleet is dropped.
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

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::budget::{BudgetConfig, SharedBudget};
use super::gate::Gate;
use super::limit::Pacer;
use super::store::RemoteOutcome;
use crate::error::ConfigError;

/// Where a fleet keeps its state across processes: one scope (an upstream and a credential)
/// in one Redis. Hand it to [`FleetBuilder::redis`](crate::fleet::FleetBuilder::redis).
///
/// Every process that builds a fleet with the same Redis, prefix and scope shares one
/// cooldown gate, one retry budget and one pacing schedule with the others; the in-process
/// state stays the fallback. See [Across processes](crate::fleet#across-processes).
///
/// Defaults: prefix `llm-retry`, a 50 ms deadline on every Redis call, the gate polled every
/// second, counts flushed every 100 ms, local state after 3 failed calls in a row, pub/sub on
/// (when built from a URL or a client).
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
}

#[derive(Clone)]
enum Source {
    /// A client, and the one connection manager the fleets of this store (the scopes of a
    /// per-scope fleet) make from it and share.
    Client(redis::Client, Arc<Mutex<Option<ConnectionManager>>>),
    Manager(ConnectionManager),
}

impl RedisFleet {
    /// A fleet store at `url` (`redis://host:port/db`, `rediss://…`, `redis+unix:///path`).
    /// Nothing is connected yet: the fleet connects in the background once it is used, and
    /// keeps to its local state until then. The URL is never logged.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        // The error would quote the URL, and a URL may carry a password.
        let client = redis::Client::open(url).map_err(|_| ConfigError::new("invalid Redis URL"))?;
        Ok(Self::from_client(client))
    }

    /// A fleet store through `client`: one managed connection for the scripts, one for
    /// pub/sub.
    pub fn from_client(client: redis::Client) -> Self {
        Self::with_source(Source::Client(client, Arc::default()))
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
    /// Without, they are learnt from the poll. Defaults to true (false from
    /// [`from_manager`](RedisFleet::from_manager)).
    pub fn subscribe(mut self, on: bool) -> Self {
        self.subscribe = on && matches!(self.source, Source::Client(..));
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
            channel: k("gate-closed"),
        }
    }
}

/// Closes the gate on Redis's clock, only ever later, and publishes the new deadline.
/// Returns Redis's time, the deadline in force and the wait it was announced with.
const CLOSE: &str = include_str!("redis_scripts/close.lua");

/// Reads the gate and says this process is alive. Returns Redis's time, the gate's deadline
/// and announced wait (0 when open), the number of live processes and the pacing rate (an
/// empty string when there is none yet).
const POLL: &str = include_str!("redis_scripts/poll.lua");

/// The fleet-wide budget: deposits and withdrawals counted in slots of Redis's clock over
/// one window, as `TpsBudget` counts them in one process. Adds this process's deposits (and
/// the retries it made beyond its grant, if any), takes back the grant it holds, and grants
/// up to `want` anew from what the window allows: `reserve + ratio × deposits −
/// withdrawals`. Returns the grant and the slot it is counted in.
const BUDGET: &str = include_str!("redis_scripts/budget.lua");

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
const RESERVE: &str = include_str!("redis_scripts/reserve.lua");

/// A refusal of an attempt sent in epoch `ARGV[1]`: the fleet's rate decreases once per
/// epoch, whichever process saw it (by at most half the first time, which ends slow start).
const REFUSE: &str = include_str!("redis_scripts/refuse.lua");

/// A stated request limit: the cap of the fleet's rate.
const LIMIT: &str = include_str!("redis_scripts/limit.lua");

const CONNECTING: u8 = 0;
const CONNECTED: u8 = 1;
const LOCAL: u8 = 2;

/// The fewest retries a process asks to hold, and the most.
const MIN_GRANT: u64 = 2;
const MAX_GRANT: u64 = 64;

/// The link of one fleet to Redis, held by the fleet's state; dropping it ends the task.
pub(crate) struct Link {
    shared: Arc<Shared>,
    start: Mutex<Option<Source>>,
    started: OnceLock<()>,
    _stop: DropGuard,
}

/// What the fleet's handles and its background task share.
struct Shared {
    keys: Keys,
    call_timeout: Duration,
    poll_interval: Duration,
    flush_interval: Duration,
    failures_to_local: u32,
    subscribe: bool,
    process: u64,
    gate: Option<Arc<Gate>>,
    budget: Option<BudgetConfig>,
    pacer: Option<Arc<Pacer>>,
    /// The connection, once made: the pacing reserves its slots through it.
    conn: OnceLock<ConnectionManager>,
    reserve: redis::Script,
    /// The attempts of this process waiting for a slot of the fleet's schedule, in order.
    line: Mutex<std::collections::VecDeque<Waiter>>,
    line_wake: Notify,
    /// The fleet's pacing rate as last read (f64 bits; 0: not known).
    rate: AtomicU64,
    /// Successes to report with the next reservation; a refusal (the highest epoch) and a
    /// stated limit (f64 bits of its rate) to report.
    successes: AtomicU64,
    refusal: Mutex<Option<u64>>,
    stated: AtomicU64,
    stated_pending: AtomicBool,
    mode: std::sync::atomic::AtomicU8,
    processes: AtomicU32,
    /// Retries granted to this process and not yet spent, and the slot they were counted in.
    granted: AtomicU64,
    granted_slot: AtomicI64,
    /// Retries spent beyond the grant while it was renewed, to count at the next flush.
    debt: AtomicU64,
    /// First attempts not yet flushed; retries asked for since the last flush.
    deposits: AtomicU64,
    demand: AtomicU64,
    /// A retry found no grant: flush at once.
    urgent: AtomicBool,
    /// A reservation missed its deadline: ask Redis at once whether it is there.
    probe: AtomicBool,
    /// Out of touch: the budget divided by the number of processes last known.
    divided: Mutex<Option<Arc<SharedBudget>>>,
    /// A closing seen here, not yet sent: the deadline and the announced wait.
    close: Mutex<Option<(Instant, Duration)>>,
    close_pending: AtomicBool,
    /// A background task ended (the fleet was dropped, or the runtime it was started on shut
    /// down): nothing will answer Redis's part again, so the fleet keeps to its local state.
    stopped: AtomicBool,
    wake: Notify,
    cancel: CancellationToken,
}

impl Link {
    pub(crate) fn new(
        store: RedisFleet,
        gate: Option<Arc<Gate>>,
        budget: Option<BudgetConfig>,
        pacer: Option<Arc<Pacer>>,
    ) -> Self {
        let cancel = CancellationToken::new();
        let process = rand::random::<u64>();
        let shared = Arc::new(Shared {
            keys: Keys::new(&store.prefix, &store.scope),
            call_timeout: store.call_timeout,
            poll_interval: store.poll_interval,
            flush_interval: store.flush_interval,
            failures_to_local: store.failures_to_local,
            subscribe: store.subscribe,
            process,
            gate,
            budget,
            pacer,
            conn: OnceLock::new(),
            reserve: redis::Script::new(RESERVE),
            line: Mutex::default(),
            line_wake: Notify::new(),
            rate: AtomicU64::new(0),
            successes: AtomicU64::new(0),
            refusal: Mutex::new(None),
            stated: AtomicU64::new(0),
            stated_pending: AtomicBool::new(false),
            mode: std::sync::atomic::AtomicU8::new(CONNECTING),
            processes: AtomicU32::new(1),
            granted: AtomicU64::new(0),
            granted_slot: AtomicI64::new(0),
            debt: AtomicU64::new(0),
            deposits: AtomicU64::new(0),
            demand: AtomicU64::new(0),
            urgent: AtomicBool::new(false),
            probe: AtomicBool::new(false),
            divided: Mutex::new(None),
            close: Mutex::new(None),
            close_pending: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            wake: Notify::new(),
            cancel: cancel.clone(),
        });
        let link = Link {
            shared,
            start: Mutex::new(Some(store.source)),
            started: OnceLock::new(),
            _stop: cancel.drop_guard(),
        };
        link.ensure_started();
        link
    }

    /// Starts the background task, once, as soon as there is a runtime to run it on.
    pub(crate) fn ensure_started(&self) {
        if self.started.get().is_some() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut start = self.start.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(source) = start.take() {
            handle.spawn(run(self.shared.clone(), source));
            if self.shared.pacer.is_some() {
                handle.spawn(reserve_slots(self.shared.clone()));
            }
            let _ = self.started.set(());
        }
    }

    pub(crate) fn state(&self) -> RedisState {
        let processes = self.shared.processes.load(Ordering::Relaxed);
        match self.shared.mode.load(Ordering::Acquire) {
            CONNECTED => RedisState::Connected { processes },
            LOCAL => RedisState::Local { processes },
            _ => RedisState::Connecting,
        }
    }

    /// A first attempt: counted for the next flush. Out of touch, it is counted by the
    /// divided local budget only: a backlog flushed on return would credit the fleet's window
    /// with first attempts made before it.
    pub(crate) fn deposit(&self) {
        self.ensure_started();
        if self.shared.mode.load(Ordering::Acquire) != LOCAL {
            self.shared.deposits.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(divided) = self.divided() {
            divided.deposit();
        }
    }

    /// A retry is planned: spends a retry granted to this process while in touch, or asks
    /// the local budget (`local`, divided when the number of processes is known) when not.
    pub(crate) fn withdraw(&self, local: &SharedBudget) -> bool {
        self.ensure_started();
        let s = &self.shared;
        match s.mode.load(Ordering::Acquire) {
            CONNECTED => {
                s.demand.fetch_add(1, Ordering::Relaxed);
                let ok = s
                    .granted
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| g.checked_sub(1))
                    .is_ok();
                if !ok {
                    // The next retry should find a grant.
                    s.urgent.store(true, Ordering::Release);
                    s.wake.notify_one();
                }
                local.count(ok);
                ok
            }
            _ => match self.divided() {
                Some(divided) => {
                    let ok = divided.withdraw();
                    local.count(ok);
                    ok
                }
                None => local.withdraw(),
            },
        }
    }

    fn divided(&self) -> Option<Arc<SharedBudget>> {
        self.shared
            .divided
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The gate closed here until `until`, announced as `announced`: tell the others.
    pub(crate) fn closed(&self, until: Instant, announced: Duration) {
        self.ensure_started();
        let s = &self.shared;
        let mut close = s.close.lock().unwrap_or_else(PoisonError::into_inner);
        if close.is_none_or(|(u, _)| until > u) {
            *close = Some((until, announced));
        }
        drop(close);
        s.close_pending.store(true, Ordering::Release);
        s.wake.notify_one();
    }
}

impl Link {
    /// The fleet's pacing rate, while in touch and known.
    pub(crate) fn pace(&self) -> Option<f64> {
        let s = &self.shared;
        if s.mode.load(Ordering::Acquire) != CONNECTED {
            return None;
        }
        let bits = s.rate.load(Ordering::Relaxed);
        (bits != 0).then(|| f64::from_bits(bits))
    }

    /// Whether the fleet's pacing schedule is the one in use.
    pub(crate) fn paces(&self) -> bool {
        self.shared.pacer.is_some() && self.shared.mode.load(Ordering::Acquire) == CONNECTED
    }

    /// A turn of the fleet's schedule, for an attempt that may wait `max_wait` for it; `None`
    /// when out of touch (the local line is used then). The attempt joins this process's line
    /// of attempts waiting for a slot: they are reserved together, one script for all of them.
    pub(crate) fn reserve(&self, max_wait: Duration) -> Option<RemoteTurn> {
        self.ensure_started();
        let s = &self.shared;
        s.pacer.as_ref()?;
        if s.mode.load(Ordering::Acquire) != CONNECTED
            || s.conn.get().is_none()
            || s.stopped.load(Ordering::Acquire)
        {
            return None;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let waiter = Waiter {
            give_up_at: Instant::now() + max_wait,
            tx,
        };
        s.line
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(waiter);
        s.line_wake.notify_one();
        Some(RemoteTurn {
            reserve: Some(rx),
            sleep: None,
        })
    }

    /// An attempt that had a turn of the fleet's schedule succeeded: reported with the next
    /// reservation, at no round trip of its own.
    pub(crate) fn paced_success(&self) {
        self.shared.successes.fetch_add(1, Ordering::Relaxed);
    }

    /// An attempt that had a turn of the fleet's schedule in `epoch` was refused for load.
    pub(crate) fn paced_refusal(&self, epoch: u64) {
        let s = &self.shared;
        let mut refusal = s.refusal.lock().unwrap_or_else(PoisonError::into_inner);
        if refusal.is_none_or(|e| epoch > e) {
            *refusal = Some(epoch);
        }
        drop(refusal);
        s.wake.notify_one();
    }

    /// A response stated the request limit: `cap` requests a second.
    pub(crate) fn stated_limit(&self, cap: f64) {
        let s = &self.shared;
        if s.stated.swap(cap.to_bits(), Ordering::AcqRel) != cap.to_bits() {
            s.stated_pending.store(true, Ordering::Release);
            s.wake.notify_one();
        }
    }
}

/// An attempt waiting for a slot of the fleet's schedule.
struct Waiter {
    give_up_at: Instant,
    tx: tokio::sync::oneshot::Sender<Result<Reserved, ()>>,
}

enum Reserved {
    Go(Duration, u64),
    TooFar(Duration),
}

/// An attempt's turn of the fleet's pacing schedule: the reservation, then a local sleep
/// until its slot.
pub(crate) struct RemoteTurn {
    reserve: Option<tokio::sync::oneshot::Receiver<Result<Reserved, ()>>>,
    sleep: Option<(std::pin::Pin<Box<tokio::time::Sleep>>, u64)>,
}

impl RemoteTurn {
    pub(crate) fn poll(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<RemoteOutcome> {
        use std::future::Future;
        use std::task::Poll;
        if let Some(reserve) = &mut self.reserve {
            let reserved = std::task::ready!(std::pin::Pin::new(reserve).poll(cx));
            self.reserve = None;
            // The sender gone (the fleet dropped): the local line.
            match reserved.unwrap_or(Err(())) {
                // The timer counts whole milliseconds: a shorter sleep would end up to a
                // millisecond late, so a slot less than half of one away is taken at once.
                Ok(Reserved::Go(wait, epoch)) if wait < Duration::from_micros(500) => {
                    return Poll::Ready(RemoteOutcome::Go(epoch));
                }
                Ok(Reserved::Go(wait, epoch)) => {
                    self.sleep = Some((Box::pin(tokio::time::sleep(wait)), epoch));
                }
                Ok(Reserved::TooFar(wait)) => return Poll::Ready(RemoteOutcome::TooFar(wait)),
                Err(()) => return Poll::Ready(RemoteOutcome::Failed),
            }
        }
        match &mut self.sleep {
            Some((sleep, epoch)) => {
                std::task::ready!(sleep.as_mut().poll(cx));
                Poll::Ready(RemoteOutcome::Go(*epoch))
            }
            None => Poll::Ready(RemoteOutcome::Failed),
        }
    }
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLink")
            .field("state", &self.state())
            .field("granted", &self.shared.granted.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The longest a deadline read from Redis may hold the local gate: a corrupt value must not
/// park a process for ever (each request is held at most its policy's ceiling anyway).
const MAX_REMOTE_HOLD: Duration = Duration::from_secs(24 * 60 * 60);

impl Shared {
    /// The fleet's pacing rate, as read from Redis. The local line keeps to this process's
    /// share of it, for the turns it gives when a reservation misses its deadline.
    fn learnt_rate(&self, rate: f64) {
        if !(rate.is_finite() && rate > 0.0) {
            return;
        }
        if self.rate.swap(rate.to_bits(), Ordering::Relaxed) != rate.to_bits() {
            if let Some(pacer) = &self.pacer {
                let n = self.processes.load(Ordering::Relaxed).max(1);
                pacer.set_rate(rate / f64::from(n));
            }
        }
    }

    /// Closes the local gate for `remaining` from now, spread as for `announced`.
    fn close_local(&self, remaining: Duration, announced: Duration) {
        if let Some(gate) = &self.gate {
            gate.close_spread(
                Instant::now(),
                remaining.min(MAX_REMOTE_HOLD),
                announced.min(MAX_REMOTE_HOLD),
            );
        }
    }

    fn set_mode(&self, mode: u8) {
        // A fleet whose background task is gone does not come back in touch.
        if mode == CONNECTED && self.stopped.load(Ordering::Acquire) {
            return;
        }
        let was = self.mode.swap(mode, Ordering::AcqRel);
        if was == mode {
            return;
        }
        let processes = self.processes.load(Ordering::Relaxed);
        match mode {
            CONNECTED => {
                *self.divided.lock().unwrap_or_else(PoisonError::into_inner) = None;
                tracing::info!(
                    processes,
                    "fleet state shared through Redis: in touch, the gate and the budget are the fleet's"
                );
            }
            LOCAL => {
                // The pacing goes on locally at this process's share of the fleet's rate.
                let rate = self.rate.load(Ordering::Relaxed);
                if let (Some(pacer), true) = (&self.pacer, rate != 0) {
                    pacer.set_rate(f64::from_bits(rate) / f64::from(processes.max(1)));
                }
                // Unflushed first attempts are dropped (see `Link::deposit`): the fleet's
                // window is undercounted, never overcounted.
                self.deposits.store(0, Ordering::Relaxed);
                // The grant is spent by those still using it, then the divided budget.
                let divided = self.budget.map(|c| divide(c, processes).build());
                *self.divided.lock().unwrap_or_else(PoisonError::into_inner) =
                    divided.map(Arc::new);
                tracing::warn!(
                    processes,
                    "fleet state shared through Redis: out of touch, using local state (budget divided by the processes last known), reconnecting"
                );
            }
            _ => {}
        }
    }
}

/// `config` for one of `processes`: its reserve divided among them (its ratio applies to
/// each process's own first attempts already).
fn divide(config: BudgetConfig, processes: u32) -> BudgetConfig {
    let n = processes.max(1);
    BudgetConfig::new(
        config.get_ttl(),
        config.get_min_per_sec() / n,
        config.get_retry_ratio(),
    )
    .unwrap_or(config)
}

/// How far ahead a slot of the fleet's schedule is booked: a change of rate reaches the
/// attempts sent after this much. The attempts further back wait in their process's line,
/// asked for together when the schedule has half of it left.
const RESERVE_AHEAD: Duration = Duration::from_millis(400);

/// The most attempts one script reserves slots for.
const MAX_BATCH: usize = 128;

/// The reservations of one fleet: while one script is in flight, the attempts that come
/// queue in the process's line, and the next script reserves slots for all of them.
async fn reserve_slots(shared: Arc<Shared>) {
    let _stopped = Stopped(shared.clone());
    let Some(config) = shared.pacer.as_ref().map(|p| p.config()) else {
        return;
    };
    let mut ask_at: Option<Instant> = None;
    loop {
        let waiting = !shared
            .line
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        let due = ask_at.is_none_or(|at| Instant::now() >= at);
        if !(waiting && due) {
            let at = ask_at.unwrap_or_else(Instant::now);
            tokio::select! {
                biased;
                () = shared.cancel.cancelled() => return,
                () = shared.line_wake.notified() => {}
                () = tokio::time::sleep_until(at), if ask_at.is_some() => ask_at = None,
            }
            continue;
        }
        ask_at = None;
        let now = Instant::now();
        let batch: Vec<Waiter> = {
            let mut line = shared.line.lock().unwrap_or_else(PoisonError::into_inner);
            line.retain(|w| !w.tx.is_closed());
            let n = line.len().min(MAX_BATCH);
            line.drain(..n).collect()
        };
        if batch.is_empty() {
            continue;
        }
        let conn = shared.conn.get().cloned();
        let (Some(mut conn), true) = (conn, shared.mode.load(Ordering::Acquire) == CONNECTED)
        else {
            // Out of touch: the local line, for these and those behind them.
            fail_all(&shared, batch);
            continue;
        };
        let successes = shared.successes.swap(0, Ordering::AcqRel);
        let mut inv = shared.reserve.prepare_invoke();
        inv.key(&shared.keys.pace)
            .key(&shared.keys.procs)
            .arg(config.get_initial())
            .arg(config.get_min())
            .arg(config.get_max())
            .arg(config.get_growth())
            .arg(successes)
            .arg(ms(RESERVE_AHEAD))
            .arg(shared.processes.load(Ordering::Relaxed).max(1))
            .arg(f64::from_bits(shared.stated.load(Ordering::Acquire)));
        for w in &batch {
            inv.arg(w.give_up_at.saturating_duration_since(now).as_secs_f64() * 1e3);
        }
        let call = inv.invoke_async::<Vec<redis::Value>>(&mut conn);
        let reply = match tokio::time::timeout(shared.call_timeout, call).await {
            Ok(Ok(reply)) => parse_reservation(&reply, batch.len()),
            _ => None,
        };
        let Some(Reservation {
            epoch,
            rate,
            later,
            slots,
        }) = reply
        else {
            shared.successes.fetch_add(successes, Ordering::AcqRel);
            // Let the task find out whether Redis is still there.
            shared.probe.store(true, Ordering::Release);
            shared.wake.notify_one();
            fail_all(&shared, batch);
            continue;
        };
        shared.learnt_rate(rate);
        let mut again = Vec::new();
        for (w, (code, wait)) in batch.into_iter().zip(slots) {
            let wait = Duration::from_micros(wait);
            match code {
                1 => {
                    let _ = w.tx.send(Ok(Reserved::Go(wait, epoch)));
                }
                0 => {
                    let _ = w.tx.send(Ok(Reserved::TooFar(wait)));
                }
                _ => again.push(w),
            }
        }
        if !again.is_empty() {
            let mut line = shared.line.lock().unwrap_or_else(PoisonError::into_inner);
            for w in again.into_iter().rev() {
                line.push_front(w);
            }
            ask_at = Some(Instant::now() + Duration::from_micros(later));
        }
    }
}

/// What [`RESERVE`] answered for the attempts of one script.
#[derive(Debug, PartialEq)]
struct Reservation {
    epoch: u64,
    rate: f64,
    /// When to ask again for those told to (µs).
    later: u64,
    /// Each attempt's code (1 booked, 0 refused, 2 later) and wait (µs).
    slots: Vec<(i64, u64)>,
}

/// The reply of [`RESERVE`] for `n` attempts.
fn parse_reservation(reply: &[redis::Value], n: usize) -> Option<Reservation> {
    let int = |v: &redis::Value| match v {
        redis::Value::Int(i) => Some(*i),
        _ => None,
    };
    if reply.len() != 3 + 2 * n {
        return None;
    }
    let epoch = u64::try_from(int(&reply[0])?).ok()?;
    let rate = match &reply[1] {
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse::<f64>().ok()?,
        _ => return None,
    };
    let later = u64::try_from(int(&reply[2])?).unwrap_or(0);
    let slots = reply[3..]
        .chunks(2)
        .map(|c| Some((int(&c[0])?, u64::try_from(int(&c[1])?).unwrap_or(0))))
        .collect::<Option<Vec<_>>>()?;
    Some(Reservation {
        epoch,
        rate,
        later,
        slots,
    })
}

/// Sends `batch`, and every attempt still in the line, to the local line.
fn fail_all(shared: &Shared, batch: Vec<Waiter>) {
    let rest: Vec<Waiter> = shared
        .line
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .drain(..)
        .collect();
    for w in batch.into_iter().chain(rest) {
        let _ = w.tx.send(Err(()));
    }
}

/// What the background task holds between rounds.
struct Task {
    shared: Arc<Shared>,
    client: Option<(redis::Client, Arc<Mutex<Option<ConnectionManager>>>)>,
    conn: Option<ConnectionManager>,
    close: redis::Script,
    poll: redis::Script,
    budget: redis::Script,
    refuse: redis::Script,
    limit: redis::Script,
    failures: u32,
    /// When to try Redis again while out of touch, and the backoff.
    retry_at: Instant,
    backoff: Duration,
    next_poll: Instant,
    next_flush: Instant,
    last_flush: Instant,
    /// A flush whose answer never came: Redis may have run it. It is sent again as it was,
    /// under its number, before any other, and the script runs a number once.
    in_doubt: Option<Flush>,
    flushes: u64,
}

/// One flush of the budget: what it counts, and its number.
#[derive(Debug, Clone, Copy)]
struct Flush {
    id: u64,
    deposits: u64,
    demand: u64,
    debt: u64,
    held: u64,
    slot_of_held: i64,
}

/// Held by each background task: when one ends, however it ends (the fleet dropped, its
/// runtime shut down, a panic), the fleet keeps to its local state and every attempt waiting
/// for a slot is sent to the local line (its sender dropped), so none waits for an answer
/// that will not come.
struct Stopped(Arc<Shared>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let s = &self.0;
        if s.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        if s.cancel.is_cancelled() {
            // The fleet was dropped: nobody to tell.
            s.mode.store(LOCAL, Ordering::Release);
        } else {
            s.set_mode(LOCAL);
        }
        let waiting: Vec<Waiter> = s
            .line
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect();
        drop(waiting);
    }
}

async fn run(shared: Arc<Shared>, source: Source) {
    let _stopped = Stopped(shared.clone());
    let (client, conn) = match source {
        Source::Client(c, cell) => (Some((c, cell)), None),
        Source::Manager(m) => (None, Some(m)),
    };
    let now = Instant::now();
    let mut task = Task {
        shared: shared.clone(),
        client,
        conn,
        close: redis::Script::new(CLOSE),
        poll: redis::Script::new(POLL),
        budget: redis::Script::new(BUDGET),
        refuse: redis::Script::new(REFUSE),
        limit: redis::Script::new(LIMIT),
        failures: 0,
        retry_at: now,
        backoff: Duration::from_millis(100),
        next_poll: now,
        next_flush: now,
        last_flush: now,
        in_doubt: None,
        flushes: 0,
    };
    let mut messages: Option<redis::aio::PubSubStream> = None;
    let mut resubscribe_at = now;
    loop {
        let in_touch = shared.mode.load(Ordering::Acquire) == CONNECTED;
        let unsubscribed = messages.is_none() && shared.subscribe && in_touch;
        let mut wake_at = task.next_wake();
        if unsubscribed {
            wake_at = wake_at.min(resubscribe_at);
        }
        tokio::select! {
            biased;
            () = shared.cancel.cancelled() => return,
            msg = next_message(&mut messages) => match msg {
                Some(msg) => on_message(&shared, &msg),
                // The connection went: subscribe again once in touch.
                None => messages = None,
            },
            () = shared.wake.notified() => {}
            () = tokio::time::sleep_until(wake_at) => {}
        }
        let was_in_touch = in_touch;
        task.round().await;
        // Pub/sub: subscribed once in touch (at once when touch comes back), again after the
        // stream ends. A message missed meanwhile is made up for by the poll.
        let in_touch = shared.mode.load(Ordering::Acquire) == CONNECTED;
        if in_touch && !was_in_touch {
            resubscribe_at = Instant::now();
        }
        if messages.is_none() && shared.subscribe && in_touch && Instant::now() >= resubscribe_at {
            if let Some((client, _)) = &task.client {
                messages = subscribe(client, &shared).await;
                if messages.is_none() {
                    resubscribe_at = Instant::now() + Duration::from_millis(500);
                }
            }
        }
    }
}

async fn next_message(messages: &mut Option<redis::aio::PubSubStream>) -> Option<redis::Msg> {
    match messages {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

async fn subscribe(client: &redis::Client, shared: &Shared) -> Option<redis::aio::PubSubStream> {
    let attempt = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(&shared.keys.channel).await?;
        Ok::<_, redis::RedisError>(pubsub.into_on_message())
    };
    match tokio::time::timeout(shared.call_timeout * 4, attempt).await {
        Ok(Ok(stream)) => Some(stream),
        _ => None,
    }
}

/// A closing published by a process: `process remaining_ms announced_ms`.
fn on_message(shared: &Shared, msg: &redis::Msg) {
    let Ok(text) = std::str::from_utf8(msg.get_payload_bytes()) else {
        return;
    };
    let mut parts = text.split(' ').map(str::parse::<u64>);
    let (Some(Ok(process)), Some(Ok(remaining)), Some(Ok(announced))) =
        (parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    if process == shared.process {
        return;
    }
    shared.close_local(
        Duration::from_millis(remaining),
        Duration::from_millis(announced),
    );
}

impl Task {
    fn next_wake(&self) -> Instant {
        let s = &self.shared;
        if s.mode.load(Ordering::Acquire) != CONNECTED {
            return self.retry_at.max(Instant::now());
        }
        let mut at = self.next_poll;
        if s.budget.is_some() {
            at = at.min(self.next_flush);
        }
        at
    }

    fn connection(&mut self) -> Option<ConnectionManager> {
        if self.conn.is_none() {
            let (client, cell) = self.client.clone()?;
            let mut cell = cell.lock().unwrap_or_else(PoisonError::into_inner);
            if cell.is_none() {
                let t = self.shared.call_timeout;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(t))
                    .set_response_timeout(Some(t))
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(50))
                    .set_max_delay(Duration::from_secs(1));
                *cell = ConnectionManager::new_lazy_with_config(client, config).ok();
            }
            self.conn = cell.clone();
        }
        if let Some(conn) = &self.conn {
            let _ = self.shared.conn.set(conn.clone());
        }
        self.conn.clone()
    }

    /// One round: whatever is due. Out of touch, one attempt per backoff.
    async fn round(&mut self) {
        let now = Instant::now();
        let connected = self.shared.mode.load(Ordering::Acquire) == CONNECTED;
        if !connected && now < self.retry_at {
            return;
        }
        let Some(mut conn) = self.connection() else {
            return;
        };
        let result = self.exchange(&mut conn, connected, now).await;
        let s = self.shared.clone();
        match result {
            // A round with nothing due says nothing of Redis.
            Ok(false) => {}
            Ok(true) => {
                self.failures = 0;
                self.backoff = Duration::from_millis(100);
                if s.mode.load(Ordering::Acquire) != CONNECTED {
                    s.set_mode(CONNECTED);
                    // Merge: a deadline learnt while out of touch goes to Redis (which keeps
                    // the later of the two).
                    if let Some(until) = s.gate.as_ref().and_then(|g| g.closed_until()) {
                        let announced = s
                            .gate
                            .as_ref()
                            .map_or(Duration::ZERO, |g| g.announced().unwrap_or_default());
                        let _ = self.send_close(&mut conn, until, announced).await;
                    }
                }
            }
            Err(()) => {
                self.failures += 1;
                let mode = s.mode.load(Ordering::Acquire);
                if mode != LOCAL && self.failures >= s.failures_to_local {
                    s.set_mode(LOCAL);
                }
                if s.mode.load(Ordering::Acquire) != CONNECTED {
                    self.retry_at = Instant::now() + self.backoff;
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// The calls due this round: `Ok(true)` when some were made, `Err` when one failed or
    /// missed its deadline.
    async fn exchange(
        &mut self,
        conn: &mut ConnectionManager,
        connected: bool,
        now: Instant,
    ) -> Result<bool, ()> {
        let s = self.shared.clone();
        let mut called = false;
        if s.close_pending.swap(false, Ordering::AcqRel) {
            let pending = s
                .close
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some((until, announced)) = pending {
                called = true;
                if let Err(()) = self.send_close(conn, until, announced).await {
                    // Sent again next round, unless a later closing replaces it.
                    let mut close = s.close.lock().unwrap_or_else(PoisonError::into_inner);
                    if close.is_none_or(|(u, _)| until > u) {
                        *close = Some((until, announced));
                    }
                    s.close_pending.store(true, Ordering::Release);
                    return Err(());
                }
            }
        }
        // The pacing: a refusal, a stated limit.
        let refusal = s
            .refusal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let (Some(epoch), Some(pacer)) = (refusal, &s.pacer) {
            let c = pacer.config();
            let mut inv = self.refuse.prepare_invoke();
            inv.key(&s.keys.pace)
                .arg(epoch)
                .arg(c.get_decrease())
                .arg(c.get_min())
                .arg(c.get_initial())
                .arg(c.get_max());
            called = true;
            let rate: String = match self.call(inv, conn).await {
                Ok(rate) => rate,
                Err(()) => {
                    // Sent again next round, unless a later refusal replaces it.
                    let mut refusal = s.refusal.lock().unwrap_or_else(PoisonError::into_inner);
                    if refusal.is_none_or(|e| epoch > e) {
                        *refusal = Some(epoch);
                    }
                    return Err(());
                }
            };
            if let Ok(rate) = rate.parse::<f64>() {
                s.learnt_rate(rate);
            }
        }
        if s.stated_pending.swap(false, Ordering::AcqRel) {
            let cap = f64::from_bits(s.stated.load(Ordering::Acquire));
            let mut inv = self.limit.prepare_invoke();
            inv.key(&s.keys.pace).arg(cap);
            called = true;
            match self.call::<String>(inv, conn).await {
                Ok(rate) => {
                    if let Ok(rate) = rate.parse::<f64>() {
                        s.learnt_rate(rate);
                    }
                }
                Err(()) => {
                    s.stated_pending.store(true, Ordering::Release);
                    return Err(());
                }
            }
        }
        // Out of touch, the poll is the probe.
        let probe = s.probe.swap(false, Ordering::AcqRel);
        if !connected || now >= self.next_poll || probe {
            called = true;
            self.poll_gate(conn).await?;
            self.next_poll = Instant::now() + s.poll_interval;
        }
        if s.budget.is_some() {
            let active = s.deposits.load(Ordering::Relaxed) > 0
                || s.demand.load(Ordering::Relaxed) > 0
                || s.granted.load(Ordering::Relaxed) < MIN_GRANT;
            let stale = now.duration_since(self.last_flush) >= self.refresh_every();
            let urgent = s.urgent.swap(false, Ordering::AcqRel);
            if (active && now >= self.next_flush) || stale || urgent || !connected {
                called = true;
                self.flush(conn).await?;
            }
        }
        Ok(called)
    }

    /// How long a grant may be held unspent: it is counted in one slot of the window, and
    /// must be renewed before that slot leaves it.
    fn refresh_every(&self) -> Duration {
        let ttl = self
            .shared
            .budget
            .map_or(Duration::from_secs(10), |b| b.get_ttl());
        (ttl / 2).min(Duration::from_secs(1))
    }

    async fn call<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
        conn: &mut ConnectionManager,
    ) -> Result<T, ()> {
        match tokio::time::timeout(self.shared.call_timeout, invocation.invoke_async(conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                tracing::trace!(error = e.category(), "fleet Redis call failed");
                Err(())
            }
            Err(_) => Err(()),
        }
    }

    async fn send_close(
        &self,
        conn: &mut ConnectionManager,
        until: Instant,
        announced: Duration,
    ) -> Result<(), ()> {
        let s = &self.shared;
        let remaining = until.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Ok(());
        }
        let mut inv = self.close.prepare_invoke();
        inv.key(&s.keys.gate)
            .arg(&s.keys.channel)
            .arg(ms(remaining))
            .arg(ms(announced))
            .arg(s.process);
        let (now_ms, until_ms, wait_ms): (i64, i64, i64) = self.call(inv, conn).await?;
        // A later deadline another process set stands.
        if until_ms > now_ms {
            s.close_local(
                Duration::from_millis((until_ms - now_ms) as u64),
                Duration::from_millis(wait_ms.max(0) as u64),
            );
        }
        Ok(())
    }

    async fn poll_gate(&self, conn: &mut ConnectionManager) -> Result<(), ()> {
        let s = &self.shared;
        let mut inv = self.poll.prepare_invoke();
        inv.key(&s.keys.gate)
            .key(&s.keys.procs)
            .key(&s.keys.pace)
            .arg(s.process)
            .arg(ms(s.poll_interval * 3));
        let (now_ms, until_ms, wait_ms, n, rate): (i64, i64, i64, i64, String) =
            self.call(inv, conn).await?;
        if let Ok(rate) = rate.parse::<f64>() {
            s.learnt_rate(rate);
        }
        s.processes.store(
            u32::try_from(n.max(1)).unwrap_or(u32::MAX),
            Ordering::Relaxed,
        );
        if until_ms > now_ms {
            s.close_local(
                Duration::from_millis((until_ms - now_ms) as u64),
                Duration::from_millis(wait_ms.max(0) as u64),
            );
        }
        Ok(())
    }

    /// Flushes the first attempts counted and renews the grant. The grant stays spendable
    /// while the call is in flight; what was spent of it meanwhile is taken from the new
    /// grant, and what the new grant cannot cover is counted at the next flush.
    ///
    /// A call that gets no answer in time may still run in Redis: it is not counted again
    /// with the next, but sent again as it was, under its number, which the script applies
    /// once (and answers again with what it granted then).
    async fn flush(&mut self, conn: &mut ConnectionManager) -> Result<(), ()> {
        let s = self.shared.clone();
        let Some(config) = s.budget else {
            return Ok(());
        };
        let flush = match self.in_doubt {
            Some(flush) => flush,
            None => {
                self.flushes += 1;
                Flush {
                    id: self.flushes,
                    deposits: s.deposits.swap(0, Ordering::AcqRel),
                    demand: s.demand.swap(0, Ordering::AcqRel),
                    debt: s.debt.swap(0, Ordering::AcqRel),
                    held: s.granted.load(Ordering::Acquire),
                    slot_of_held: s.granted_slot.load(Ordering::Acquire),
                }
            }
        };
        let want = (flush.demand * 2).clamp(MIN_GRANT, MAX_GRANT);
        let slot_ms = (ms(config.get_ttl()) / 10).max(1);
        let reserve = f64::from(config.get_min_per_sec()) * config.get_ttl().as_secs_f64();
        let mut inv = self.budget.prepare_invoke();
        inv.key(&s.keys.budget)
            .key(format!("{}:flush:{}", s.keys.budget, s.process))
            .arg(slot_ms)
            .arg(10)
            .arg(reserve)
            .arg(f64::from(config.get_retry_ratio()))
            .arg(flush.deposits)
            .arg(flush.held)
            .arg(flush.slot_of_held)
            .arg(want)
            .arg(flush.debt)
            .arg(flush.id);
        let result: Result<(i64, i64), ()> = self.call(inv, conn).await;
        self.next_flush = Instant::now() + s.flush_interval;
        self.last_flush = Instant::now();
        let Ok((grant, slot)) = result else {
            // Counted or not, Redis knows which: the same flush goes again.
            self.in_doubt = Some(flush);
            return Err(());
        };
        self.in_doubt = None;
        let grant = u64::try_from(grant).unwrap_or(0);
        let held = flush.held;
        // Redis took back `held` and granted `grant`: this process holds `grant` less what it
        // spent of `held` meanwhile (already gone from `granted`).
        let mut now = s.granted.load(Ordering::Acquire);
        let shortfall = loop {
            let target = now + grant;
            let (next, short) = if target >= held {
                (target - held, 0)
            } else {
                (0, held - target)
            };
            match s
                .granted
                .compare_exchange(now, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break short,
                Err(actual) => now = actual,
            }
        };
        if shortfall > 0 {
            s.debt.fetch_add(shortfall, Ordering::AcqRel);
        }
        s.granted_slot.store(slot, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
