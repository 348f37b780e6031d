//! The background task of a fleet's link: flushes, grants, closings, polls and messages.

use super::*;

/// What the background task holds between rounds.
pub(super) struct Task {
    pub(super) shared: Arc<Shared>,
    pub(super) connector: Option<Connector>,
    pub(super) conn: Option<Conn>,
    pub(super) close: redis::Script,
    pub(super) poll: redis::Script,
    pub(super) budget: redis::Script,
    pub(super) refuse: redis::Script,
    pub(super) limit: redis::Script,
    pub(super) failures: u32,
    /// When to try Redis again while out of touch, and the backoff.
    pub(super) retry_at: Instant,
    pub(super) backoff: Duration,
    pub(super) next_poll: Instant,
    pub(super) next_flush: Instant,
    pub(super) last_flush: Instant,
    /// A flush whose answer never came: Redis may have run it. It is sent again as it was,
    /// under its number, before any other, and the script runs a number once.
    pub(super) in_doubt: Option<Flush>,
    pub(super) flushes: u64,
}

/// One flush of the budget: what it counts, and its number.
#[derive(Debug, Clone, Copy)]
pub(super) struct Flush {
    pub(super) id: u64,
    pub(super) deposits: u64,
    pub(super) demand: u64,
    pub(super) debt: u64,
    pub(super) held: u64,
    pub(super) slot_of_held: i64,
}

/// Held by each background task: when one ends, however it ends (the fleet dropped, its
/// runtime shut down, a panic), the fleet keeps to its local state and every attempt waiting
/// for a slot is sent to the local line (its sender dropped), so none waits for an answer
/// that will not come.
pub(super) struct Stopped(pub(super) Arc<Shared>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let s = &self.0;
        s.first_read_over();
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

pub(super) async fn run(shared: Arc<Shared>, source: Source) {
    let _stopped = Stopped(shared.clone());
    let (connector, conn) = source.connector();
    let now = Instant::now();
    let mut task = Task {
        shared: shared.clone(),
        connector,
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
    loop {
        let wake_at = task.next_wake();
        tokio::select! {
            biased;
            () = shared.cancel.cancelled() => return,
            () = shared.wake.notified() => {}
            () = tokio::time::sleep_until(wake_at) => {}
        }
        #[cfg(test)]
        shared.rounds.fetch_add(1, Ordering::Relaxed);
        task.round().await;
        // A round without a poll (out of touch, its backoff) ends the first requests' wait
        // too: they do not wait for a reconnection.
        shared.first_read_over();
    }
}

/// A closing published by a process: `process remaining_ms announced_ms`.
pub(super) fn on_message(shared: &Shared, msg: &redis::Msg) {
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
    pub(super) fn next_wake(&self) -> Instant {
        let s = &self.shared;
        if s.mode.load(Ordering::Acquire) != CONNECTED {
            return self.retry_at.max(Instant::now());
        }
        let mut at = self.next_poll;
        if s.budget.is_some() {
            // A flush is due at `next_flush` only while there is something to flush (see
            // `exchange`); idle, only the grant's renewal is. Waking at a `next_flush` long
            // past, to find nothing due, would spin. A count that comes meanwhile wakes the
            // task (`Link::deposit`, `Link::withdraw`).
            let flush_at = match self.flush_wanted() {
                true => self.next_flush,
                false => self.last_flush + self.refresh_every(),
            };
            at = at.min(flush_at);
        }
        at
    }

    /// Whether there are counts to flush, or too small a grant.
    pub(super) fn flush_wanted(&self) -> bool {
        let s = &self.shared;
        s.deposits.load(Ordering::Relaxed) > 0
            || s.demand.load(Ordering::Relaxed) > 0
            || s.granted.load(Ordering::Relaxed) < MIN_GRANT
    }

    pub(super) fn connection(&mut self) -> Option<Conn> {
        if self.conn.is_none() {
            self.conn = self.connector.as_ref()?.connect(self.shared.call_timeout);
        }
        if let Some(conn) = &self.conn {
            let _ = self.shared.conn.set(conn.clone());
        }
        self.conn.clone()
    }

    /// One round: whatever is due. Out of touch, one attempt per backoff.
    pub(super) async fn round(&mut self) {
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
    pub(super) async fn exchange(
        &mut self,
        conn: &mut Conn,
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
        if let (Some((epoch, factor)), Some(pacer)) = (refusal, &s.pacer) {
            let c = pacer.config();
            let mut inv = self.refuse.prepare_invoke();
            inv.key(&s.keys.pace)
                .arg(epoch)
                .arg(c.get_decrease())
                .arg(c.get_min())
                .arg(c.get_initial())
                .arg(c.get_max())
                .arg(factor.unwrap_or(1.0));
            called = true;
            let rate: String = match self.call(inv, conn).await {
                Ok(rate) => rate,
                Err(()) => {
                    // Sent again next round, unless a later refusal replaces it.
                    let mut refusal = s.refusal.lock().unwrap_or_else(PoisonError::into_inner);
                    match &mut *refusal {
                        Some((e, f)) if *e >= epoch => {
                            if epoch == *e {
                                *f = super::link::min_factor(*f, factor);
                            }
                        }
                        r => *r = Some((epoch, factor)),
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
            let polled = self.poll_gate(conn).await;
            // The first requests wait for this read, not for the rest of the round.
            s.first_read_over();
            polled?;
            self.next_poll = Instant::now() + s.poll_interval;
        }
        if s.budget.is_some() {
            let active = self.flush_wanted();
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
    pub(super) fn refresh_every(&self) -> Duration {
        let ttl = self
            .shared
            .budget
            .map_or(Duration::from_secs(10), |b| b.get_ttl());
        (ttl / 2).min(Duration::from_secs(1))
    }

    pub(super) async fn call<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
        conn: &mut Conn,
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

    pub(super) async fn send_close(
        &self,
        conn: &mut Conn,
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

    pub(super) async fn poll_gate(&self, conn: &mut Conn) -> Result<(), ()> {
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
    pub(super) async fn flush(&mut self, conn: &mut Conn) -> Result<(), ()> {
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
