//! A place in a fleet's line for tokens.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use super::store::RemoteTokens;
use super::token_cost::Cost;
use super::tokens::{Admit, TokensOutcome};
use super::Fleet;

/// A place in the line for tokens: head-of-line order, bounded like the pacing line (the
/// request's `retry_after_max` or its deadline).
pub(crate) struct TokenTicket {
    pub(super) fleet: Fleet,
    /// Its place in the local line, once it joined it.
    pub(super) n: Option<u64>,
    /// Its booking in the buckets the store shares, while it waits for it.
    pub(super) remote: Option<RemoteTokens>,
    pub(super) cost: Cost,
    pub(super) since: Instant,
    pub(super) give_up_at: Instant,
    pub(super) by_deadline: bool,
    pub(super) joined: bool,
    pub(super) done: bool,
    pub(super) sleep: Option<Pin<Box<Sleep>>>,
}

impl TokenTicket {
    /// Ready once the tokens are taken, with how long it waited, or with the refusal once it
    /// is known that they would come after the ticket's bound: on joining, when the tokens of
    /// those ahead and its own take longer to come; at the head, when their instant is later;
    /// behind others, when the bound comes.
    pub(crate) fn poll_turn(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Duration, TokensRefused>> {
        let tokens = self
            .fleet
            .tokens()
            .expect("token tickets come from a token pacer");
        if let Some(remote) = &mut self.remote {
            let outcome = std::task::ready!(remote.poll(cx));
            self.remote = None;
            let now = Instant::now();
            match outcome {
                TokensOutcome::Go(levels) => {
                    tokens.learn_levels(levels);
                    self.done = true;
                    self.cost.shared = true;
                    let waited = now.saturating_duration_since(self.since);
                    if !waited.is_zero() {
                        tokens.count_waited();
                    }
                    return Poll::Ready(Ok(waited));
                }
                TokensOutcome::TooFar(wait, levels) => {
                    tokens.learn_levels(levels);
                    let left = self.give_up_at.saturating_duration_since(now);
                    return Poll::Ready(Err(self.refuse(Some(wait), left)));
                }
                // The store did not answer in time: this process's line, at once.
                TokensOutcome::Failed => {}
            }
        }
        let n = *self.n.get_or_insert_with(|| tokens.join(self.cost));
        loop {
            let joining = !std::mem::replace(&mut self.joined, true);
            let now = Instant::now();
            let left = self.give_up_at.saturating_duration_since(now);
            let wake_at = match tokens.poll_admit(n, cx.waker()) {
                Admit::Go => {
                    self.done = true;
                    self.sleep = None;
                    let waited = now.saturating_duration_since(self.since);
                    if !waited.is_zero() {
                        tokens.count_waited();
                    }
                    return Poll::Ready(Ok(waited));
                }
                Admit::Wait(at) if at > self.give_up_at => {
                    return Poll::Ready(Err(self.refuse(Some(at - now), left)));
                }
                Admit::Wait(at) => at,
                Admit::Queued { wait, .. } if joining && wait > left => {
                    return Poll::Ready(Err(self.refuse(Some(wait), left)));
                }
                Admit::Queued { .. } if left.is_zero() => {
                    return Poll::Ready(Err(self.refuse(None, left)));
                }
                // Woken when the line moves; right behind the head, it looks again when the
                // head should have taken its tokens; its bound otherwise.
                Admit::Queued { check, .. } => {
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

    fn refuse(&mut self, expected: Option<Duration>, left: Duration) -> TokensRefused {
        self.done = true;
        self.sleep = None;
        if let Some(t) = self.fleet.tokens() {
            if let Some(n) = self.n {
                t.leave(n);
            }
            t.count_refused();
        }
        let refused = TokensRefused {
            input: self.cost.input,
            output: self.cost.output,
            expected,
            left,
            bound: self.give_up_at.saturating_duration_since(self.since),
            by_deadline: self.by_deadline,
        };
        tracing::warn!(
            input_tokens = self.cost.input,
            output_tokens = self.cost.output,
            "giving up on LLM request: its tokens come later than it may wait"
        );
        refused
    }

    /// What it takes from the buckets.
    pub(crate) fn cost(&self) -> Cost {
        self.cost
    }
}

impl Drop for TokenTicket {
    fn drop(&mut self) {
        if let (false, Some(n), Some(t)) = (self.done, self.n, self.fleet.tokens()) {
            t.leave(n);
        }
    }
}

impl std::fmt::Debug for TokenTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenTicket")
            .field("n", &self.n)
            .field("cost", &self.cost)
            .field("give_up_at", &self.give_up_at)
            .finish()
    }
}

/// Why a request left the line for tokens: they would come later than it may wait. The
/// source of an [`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong) error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TokensRefused {
    input: u64,
    output: u64,
    expected: Option<Duration>,
    left: Duration,
    bound: Duration,
    by_deadline: bool,
}

impl TokensRefused {
    /// Whether the bound that ran out was the request's deadline.
    pub(crate) fn by_deadline(&self) -> bool {
        self.by_deadline
    }
}

impl std::fmt::Display for TokensRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tokens for {} input and {} output ",
            self.input, self.output
        )?;
        match self.expected {
            Some(wait) => write!(
                f,
                "come in {wait:?}, with {:?} left of the {:?} the request may wait",
                self.left, self.bound
            ),
            None => write!(
                f,
                "did not come within the {:?} the request may wait",
                self.bound
            ),
        }
    }
}

impl std::error::Error for TokensRefused {}

/// The bytes of an answer kept at each end to read its usage: Anthropic's stream reports
/// the input in its first event and the output in its last; a JSON answer ends with it.
const USAGE_WINDOW: usize = 4096;

/// Watches the body of an answer that took tokens, and settles them with the usage it
/// reports once it is read, or dropped: the input as soon as it is seen, the output only
/// when the body was read to its end (a stream cut short keeps its reservation).
pub(crate) struct UsageTap {
    fleet: Fleet,
    charged: Cost,
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    ended: bool,
}

impl UsageTap {
    pub(crate) fn new(fleet: Fleet, charged: Cost) -> Self {
        UsageTap {
            fleet,
            charged,
            head: Vec::new(),
            tail: std::collections::VecDeque::new(),
            ended: false,
        }
    }

    /// A frame went to the caller.
    pub(crate) fn follow(&mut self, data: &[u8]) {
        let room = USAGE_WINDOW - self.head.len();
        let (first, rest) = data.split_at(room.min(data.len()));
        self.head.extend_from_slice(first);
        if rest.len() >= USAGE_WINDOW {
            self.tail.clear();
            self.tail.extend(&rest[rest.len() - USAGE_WINDOW..]);
        } else {
            let over = (self.tail.len() + rest.len()).saturating_sub(USAGE_WINDOW);
            self.tail.drain(..over);
            self.tail.extend(rest);
        }
    }

    /// The body ended.
    pub(crate) fn end(&mut self) {
        self.ended = true;
    }
}

impl Drop for UsageTap {
    fn drop(&mut self) {
        let mut usage = super::Usage::default();
        super::read_usage(&self.head, &mut usage);
        let tail = self.tail.make_contiguous();
        super::read_usage(tail, &mut usage);
        if !self.ended {
            usage.output = None;
        }
        self.fleet.settle_tokens(self.charged, usage);
    }
}

impl std::fmt::Debug for UsageTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageTap")
            .field("charged", &self.charged)
            .finish_non_exhaustive()
    }
}
