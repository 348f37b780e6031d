//! The fleet's pacing schedule in Redis: the turns the attempts of a process wait for, and
//! the task that reserves them.

use super::*;

/// An attempt waiting for a slot of the fleet's schedule.
pub(super) struct Waiter {
    pub(super) give_up_at: Instant,
    pub(super) tx: tokio::sync::oneshot::Sender<Result<Reserved, ()>>,
}

pub(super) enum Reserved {
    Go(Duration, u64),
    TooFar(Duration),
}

/// An attempt's turn of the fleet's pacing schedule: the reservation, then a local sleep
/// until its slot.
pub(crate) struct RemoteTurn {
    pub(super) reserve: Option<tokio::sync::oneshot::Receiver<Result<Reserved, ()>>>,
    pub(super) sleep: Option<(std::pin::Pin<Box<tokio::time::Sleep>>, u64)>,
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

/// How far ahead a slot of the fleet's schedule is booked: a change of rate reaches the
/// attempts sent after this much. The attempts further back wait in their process's line,
/// asked for together when the schedule has half of it left.
pub(super) const RESERVE_AHEAD: Duration = Duration::from_millis(400);

/// The most attempts one script reserves slots for.
pub(super) const MAX_BATCH: usize = 128;

/// The reservations of one fleet: while one script is in flight, the attempts that come
/// queue in the process's line, and the next script reserves slots for all of them.
pub(super) async fn reserve_slots(shared: Arc<Shared>) {
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
        shared.epoch.fetch_max(epoch, Ordering::Relaxed);
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
pub(super) struct Reservation {
    pub(super) epoch: u64,
    pub(super) rate: f64,
    /// When to ask again for those told to (µs).
    pub(super) later: u64,
    /// Each attempt's code (1 booked, 0 refused, 2 later) and wait (µs).
    pub(super) slots: Vec<(i64, u64)>,
}

/// The reply of [`RESERVE`] for `n` attempts.
pub(super) fn parse_reservation(reply: &[redis::Value], n: usize) -> Option<Reservation> {
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
pub(super) fn fail_all(shared: &Shared, batch: Vec<Waiter>) {
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
