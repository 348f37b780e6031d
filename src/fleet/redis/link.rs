//! The link of one fleet to Redis: what requests read and tell, and the state they share
//! with the background task.

use super::*;

use crate::fleet::gate::FirstRead;

/// The link of one fleet to Redis, held by the fleet's state; dropping it ends the task.
pub(crate) struct Link {
    pub(super) shared: Arc<Shared>,
    pub(super) start: Mutex<Option<Box<Source>>>,
    pub(super) started: OnceLock<()>,
    pub(super) _stop: DropGuard,
}

impl Drop for Link {
    fn drop(&mut self) {
        // Cancelled before the hub looks: its channel goes with the last fleet of the scope.
        self.shared.cancel.cancel();
        if let Some(hub) = self.shared.hub.get() {
            hub.leave();
        }
    }
}

/// What the fleet's handles and its background task share.
pub(super) struct Shared {
    pub(super) keys: Keys,
    pub(super) call_timeout: Duration,
    pub(super) poll_interval: Duration,
    pub(super) flush_interval: Duration,
    pub(super) failures_to_local: u32,
    pub(super) subscribe: bool,
    /// No attempt is admitted while out of touch.
    pub(super) fail_closed: bool,
    pub(super) process: u64,
    pub(super) gate: Option<Arc<Gate>>,
    pub(super) budget: Option<BudgetConfig>,
    pub(super) pacer: Option<Arc<Pacer>>,
    /// The connection, once made: the pacing reserves its slots through it.
    pub(super) conn: OnceLock<Conn>,
    pub(super) reserve: redis::Script,
    pub(super) tokens: redis::Script,
    /// The attempts of this process waiting for a slot of the fleet's schedule, in order.
    pub(super) line: Mutex<std::collections::VecDeque<Waiter>>,
    pub(super) line_wake: Notify,
    /// The fleet's pacing rate as last read (f64 bits; 0: not known).
    pub(super) rate: AtomicU64,
    /// The epoch of the fleet's schedule as last read (0: none yet).
    pub(super) epoch: AtomicU64,
    /// Successes to report with the next reservation; a refusal (the highest epoch) and a
    /// stated limit (f64 bits of its rate) to report.
    pub(super) successes: AtomicU64,
    pub(super) refusal: Mutex<Option<(u64, Option<f64>)>>,
    pub(super) stated: AtomicU64,
    pub(super) stated_pending: AtomicBool,
    pub(super) mode: std::sync::atomic::AtomicU8,
    pub(super) processes: AtomicU32,
    /// Retries granted to this process and not yet spent, and the slot they were counted in.
    pub(super) granted: AtomicU64,
    pub(super) granted_slot: AtomicI64,
    /// Retries spent beyond the grant while it was renewed, to count at the next flush.
    pub(super) debt: AtomicU64,
    /// First attempts not yet flushed; retries asked for since the last flush.
    pub(super) deposits: AtomicU64,
    pub(super) demand: AtomicU64,
    /// A retry found no grant: flush at once.
    pub(super) urgent: AtomicBool,
    /// A reservation missed its deadline: ask Redis at once whether it is there.
    pub(super) probe: AtomicBool,
    /// Out of touch: the budget divided by the number of processes last known.
    pub(super) divided: Mutex<Option<Arc<SharedBudget>>>,
    /// A closing seen here, not yet sent: the deadline and the announced wait.
    pub(super) close: Mutex<Option<(Instant, Duration)>>,
    pub(super) close_pending: AtomicBool,
    /// A background task ended (the fleet was dropped, or the runtime it was started on shut
    /// down): nothing will answer Redis's part again, so the fleet keeps to its local state.
    pub(super) stopped: AtomicBool,
    pub(super) wake: Notify,
    pub(super) cancel: CancellationToken,
    /// Cancelled once the task has first asked Redis for the gate (answered or not): the
    /// first requests wait for it, at most one call deadline.
    pub(super) first_read: CancellationToken,
    /// The same, as one atomic load for the requests after it (the token takes a lock).
    pub(super) first_read_done: AtomicBool,
    /// The subscription shared with the store's other scopes, once joined.
    pub(super) hub: OnceLock<Arc<hub::Hub>>,
    /// The rounds the background task has made: an idle task makes one per poll.
    #[cfg(test)]
    pub(super) rounds: AtomicU64,
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
            fail_closed: store.fail_closed,
            process,
            gate,
            budget,
            pacer,
            conn: OnceLock::new(),
            reserve: redis::Script::new(RESERVE),
            tokens: redis::Script::new(TOKENS),
            line: Mutex::default(),
            line_wake: Notify::new(),
            rate: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
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
            first_read: CancellationToken::new(),
            first_read_done: AtomicBool::new(false),
            hub: OnceLock::new(),
            #[cfg(test)]
            rounds: AtomicU64::new(0),
        });
        let link = Link {
            shared,
            start: Mutex::new(Some(Box::new(store.source))),
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
            if let (Some((seeds, hub)), true) = (source.hub(), self.shared.subscribe) {
                hub.join(&self.shared, seeds, &handle);
                self.shared.hub.set(hub.clone()).ok();
            }
            handle.spawn(run(self.shared.clone(), *source));
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
        if self.shared.mode.load(Ordering::Acquire) != LOCAL
            && self.shared.deposits.fetch_add(1, Ordering::Relaxed) == 0
        {
            // The task sleeps while there is nothing to flush: the first count wakes it.
            self.shared.wake.notify_one();
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
                if s.demand.fetch_add(1, Ordering::Relaxed) == 0 {
                    s.wake.notify_one();
                }
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

    pub(super) fn divided(&self) -> Option<Arc<SharedBudget>> {
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
    /// The wait of a request for the first read of the shared gate (and pacing rate), while
    /// it is to come: a process new to the scope then holds its first requests at a gate
    /// another process closed. At most one call deadline; `None` once read.
    pub(crate) fn first_read(&self) -> Option<FirstRead> {
        let s = &self.shared;
        if s.first_read_done.load(Ordering::Acquire) {
            return None;
        }
        self.ensure_started();
        if self.started.get().is_none() || s.stopped.load(Ordering::Acquire) {
            return None;
        }
        let read = s.first_read.clone();
        let deadline = s.call_timeout;
        Some(Box::pin(async move {
            let _ = tokio::time::timeout(deadline, read.cancelled_owned()).await;
        }))
    }

    /// Whether an attempt may start: always, unless the fleet fails closed and is not in
    /// touch.
    pub(crate) fn admits(&self) -> bool {
        let s = &self.shared;
        if !s.fail_closed {
            return true;
        }
        self.ensure_started();
        s.mode.load(Ordering::Acquire) == CONNECTED
    }

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

    /// Whether no attempt of this process waits for a slot of the fleet's schedule.
    pub(crate) fn line_is_empty(&self) -> bool {
        self.shared
            .line
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    /// An attempt that had a turn of the fleet's schedule succeeded: reported with the next
    /// reservation, at no round trip of its own.
    pub(crate) fn paced_success(&self) {
        self.shared.successes.fetch_add(1, Ordering::Relaxed);
    }

    /// This process's pacing woke on evidence of a limit, with the share of its attempts the
    /// server admitted: the fleet's schedule, if still in slow start, falls to that share of
    /// its rate, whichever line the refused attempt had its turn from (the local one, while
    /// the link was not yet in touch, would report nothing to it).
    pub(crate) fn woke(&self, factor: f64) {
        let epoch = self.shared.epoch.load(Ordering::Relaxed);
        self.paced_refusal(epoch, Some(factor));
    }

    /// An attempt that had a turn of the fleet's schedule in `epoch` was refused for load.
    /// `factor`: the most the rate is to be multiplied by, if less than the usual decrease.
    pub(crate) fn paced_refusal(&self, epoch: u64, factor: Option<f64>) {
        let s = &self.shared;
        let mut refusal = s.refusal.lock().unwrap_or_else(PoisonError::into_inner);
        match &mut *refusal {
            Some((e, f)) if *e >= epoch => {
                // The same round: the steeper fall stands.
                if epoch == *e {
                    *f = min_factor(*f, factor);
                }
            }
            r => *r = Some((epoch, factor)),
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

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLink")
            .field("state", &self.state())
            .field("granted", &self.shared.granted.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

pub(super) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The longest a deadline read from Redis may hold the local gate: a corrupt value must not
/// park a process for ever (each request is held at most its policy's ceiling anyway).
pub(super) const MAX_REMOTE_HOLD: Duration = Duration::from_secs(24 * 60 * 60);

impl Shared {
    /// The first read of the gate was made (answered or not), or never will be.
    pub(super) fn first_read_over(&self) {
        if !self.first_read_done.load(Ordering::Acquire) {
            self.first_read.cancel();
            self.first_read_done.store(true, Ordering::Release);
        }
    }

    /// The fleet's pacing rate, as read from Redis. The local line keeps to this process's
    /// share of it, for the turns it gives when a reservation misses its deadline.
    pub(super) fn learnt_rate(&self, rate: f64) {
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
    pub(super) fn close_local(&self, remaining: Duration, announced: Duration) {
        if let Some(gate) = &self.gate {
            gate.close_spread(
                Instant::now(),
                remaining.min(MAX_REMOTE_HOLD),
                announced.min(MAX_REMOTE_HOLD),
            );
        }
    }

    pub(super) fn set_mode(&self, mode: u8) {
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
pub(super) fn divide(config: BudgetConfig, processes: u32) -> BudgetConfig {
    let n = processes.max(1);
    BudgetConfig::new(
        config.get_ttl(),
        config.get_min_per_sec() / n,
        config.get_retry_ratio(),
    )
    .unwrap_or(config)
}

/// The steeper of two falls of the rate, either given or not.
pub(super) fn min_factor(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
