//! The fleet's token buckets in Redis: a take books an attempt's tokens in arrival order
//! and says when they are in hand; the attempt then sleeps locally until then. The answer's
//! usage gives back what it did not use, without waiting for Redis.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::*;
use crate::fleet::tokens::{TokenArgs, TokensOutcome};

type Call = Pin<Box<dyn Future<Output = Option<Vec<redis::Value>>> + Send>>;

/// An attempt's tokens from the fleet's buckets: the booking, then a local sleep until they
/// are in hand.
pub(crate) struct RemoteTokens {
    call: Option<Call>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    levels: [Option<f64>; 3],
}

impl RemoteTokens {
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<TokensOutcome> {
        if let Some(call) = &mut self.call {
            let reply = std::task::ready!(call.as_mut().poll(cx));
            self.call = None;
            let Some((code, wait, levels)) = reply.as_deref().and_then(parse) else {
                return Poll::Ready(TokensOutcome::Failed);
            };
            self.levels = levels;
            if code == 0 {
                return Poll::Ready(TokensOutcome::TooFar(wait, levels));
            }
            // The timer counts whole milliseconds (see the pacing's turns).
            if wait < Duration::from_micros(500) {
                return Poll::Ready(TokensOutcome::Go(levels));
            }
            self.sleep = Some(Box::pin(tokio::time::sleep(wait)));
        }
        match &mut self.sleep {
            Some(sleep) => {
                std::task::ready!(sleep.as_mut().poll(cx));
                Poll::Ready(TokensOutcome::Go(self.levels))
            }
            None => Poll::Ready(TokensOutcome::Failed),
        }
    }
}

/// The reply of [`TOKENS`]: the code, the wait and the levels.
fn parse(reply: &[redis::Value]) -> Option<(i64, Duration, [Option<f64>; 3])> {
    let int = |v: &redis::Value| match v {
        redis::Value::Int(i) => Some(*i),
        _ => None,
    };
    if reply.len() != 5 {
        return None;
    }
    let code = int(&reply[0])?;
    let wait = Duration::from_micros(u64::try_from(int(&reply[1])?).unwrap_or(0));
    let level = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse::<f64>().ok(),
        _ => None,
    };
    Some((
        code,
        wait,
        [level(&reply[2]), level(&reply[3]), level(&reply[4])],
    ))
}

impl Link {
    /// The script call for `op` with `args`, under the call deadline; `None` when out of
    /// touch.
    fn tokens_call(&self, op: &'static str, args: &TokenArgs, max_wait: Duration) -> Option<Call> {
        self.ensure_started();
        let s = &self.shared;
        if s.mode.load(Ordering::Acquire) != CONNECTED || s.stopped.load(Ordering::Acquire) {
            return None;
        }
        let mut conn = s.conn.get()?.clone();
        let (script, args) = (s.tokens.clone(), *args);
        let (key, log) = (s.keys.tokens.clone(), s.keys.tokens_log.clone());
        let timeout = s.call_timeout;
        Some(Box::pin(async move {
            let mut inv = script.prepare_invoke();
            inv.key(&key).key(&log).arg(op).arg(ms(max_wait));
            for a in args {
                match a {
                    Some(a) => inv
                        .arg(a.cap)
                        .arg(a.refill / 1e3)
                        .arg(a.amount)
                        .arg(a.start)
                        .arg(a.floor.unwrap_or(-1.0))
                        .arg(a.floor_age.as_secs_f64() * 1e3),
                    None => inv.arg(0).arg(0).arg(0).arg(0).arg(-1).arg(0),
                };
            }
            let call = inv.invoke_async::<Vec<redis::Value>>(&mut conn);
            tokio::time::timeout(timeout, call).await.ok()?.ok()
        }))
    }

    /// Books tokens from the fleet's buckets for an attempt that may wait `max_wait` for
    /// them; `None` when out of touch (the local bucket is used then).
    pub(crate) fn reserve_tokens(
        &self,
        args: &TokenArgs,
        max_wait: Duration,
    ) -> Option<RemoteTokens> {
        Some(RemoteTokens {
            call: Some(self.tokens_call("take", args, max_wait)?),
            sleep: None,
            levels: [None; 3],
        })
    }

    /// Gives back to the fleet's buckets what an answer did not use, in the background.
    pub(crate) fn give_tokens(&self, args: &TokenArgs) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Some(call) = self.tokens_call("give", args, Duration::ZERO) {
            runtime.spawn(call);
        }
    }
}
