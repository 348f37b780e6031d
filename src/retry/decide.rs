//! What the loop does with one answer: classify it once, ask the companions inside, tell the
//! fleet, then retry or give up.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tracing::Span;

use super::layer::Config;
use super::peek::{Peek, PeekMode, Reply};
use super::policy::DelayRefused;
use super::{RetryEvent, RetryPolicy};
use crate::body::{Held, ReplayBody};
use crate::classify::{Classification, Classify, FailureClass, Unsendable};
use crate::error::{
    error_chain, AttemptRecord, BoxError, DeadlineReached, Error, ErrorKind, GiveUpReason,
    RetryTrail, TimedOut, TimeoutKind,
};
use crate::fleet::{Cost, Fleet, Usage, UsageTap};
use crate::pipeline::body::RetryBody;
use crate::pipeline::{Failed, Judged, Link, Question, Said};
use crate::provider::error_body::context_overflow;
use crate::stream::{CommitReason, OutputTruncated, StreamCommitted, StreamScan};

/// A bound on the re-sends companion layers may ask for within one attempt.
const MAX_COMPANION_RESENDS: u32 = 32;

/// What the loop keeps of one request from one attempt to the next.
pub(super) struct Ctx<S, C> {
    pub(super) service: S,
    pub(super) config: Arc<Config<C>>,
    pub(super) policy_override: Option<Box<RetryPolicy>>,
    pub(super) held: Held,
    // Retries so far: the attempt in flight is number `retries + 1`.
    pub(super) retries: u32,
    pub(super) sent: u32,
    pub(super) consecutive_overloads: u32,
    pub(super) previous: Option<FailureClass>,
    pub(super) resend: Resend,
    pub(super) next: NextSend,
    pub(super) proof: Proof,
    pub(super) trail: RetryTrail,
    pub(super) started: Instant,
    pub(super) deadline: Option<Instant>,
    pub(super) model: Option<Option<String>>,
    pub(super) gate: Gate,
    // Fleet: the pacing epoch of the attempt about to start or in flight, once it has its turn.
    pub(super) paced: Option<u64>,
    // The handle shared with the companion layers inside, made at the first send and kept
    // from one send to the next: what it carries for them is what the next send carries.
    pub(super) link: Option<Link>,
    // Re-sends the companions asked for in this attempt.
    pub(super) resends: u32,
    // The head timeout of the attempt in flight, reckoned when it starts (cut to the
    // deadline), as the companion layers are told it.
    pub(super) attempt_head_timeout: Option<Duration>,
    // When the attempt in flight was sent: the server's count in its answer is of then.
    pub(super) sent_at: Instant,
    // Fleet: the state of this request's scope, when the fleet keeps one per scope.
    pub(super) scoped: Option<Fleet>,
    // Fleet: the request's cost in tokens, once the token pacing asked for it, and what the
    // attempt about to start or in flight took. Boxed, and made only once the token pacing
    // is awake: the path every request takes carries one word.
    pub(super) tokens: Option<Box<Tokens>>,
}

/// Fleet: what a request takes from the token buckets.
#[derive(Debug, Default)]
pub(super) struct Tokens {
    pub(super) cost: Option<Cost>,
    pub(super) charged: Option<Cost>,
}

impl<S, C> Drop for Ctx<S, C> {
    // The attempt's future went first (it is dropped before the context), and with it the
    // companions' hold on the link: the next request may have it.
    fn drop(&mut self) {
        // Usually the service that made the request keeps it for its next one.
        if let Some(link) = self.link.take().filter(Link::is_alone) {
            self.config.links.give_back(link);
        }
    }
}

/// What of the request may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Resend {
    /// Any failure the policy retries.
    Any,
    /// Only a failure that proves the request was not sent (the caller marked it
    /// [`NotReplaySafe`](super::NotReplaySafe)).
    IfNotSent,
    /// Nothing: the body was too large to hold, so the request is sent once, as it streams,
    /// still under the head timeout, the deadline and the fleet's admission.
    Never,
}

/// What the next send is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NextSend {
    /// A new attempt: counted, paid into the budget when first, admitted by the fleet.
    Attempt,
    /// The same attempt again, which HTTP/2 proved was never processed: counted as sent,
    /// neither paid nor admitted again.
    Unprocessed,
    /// The same attempt again, asked for by a companion: not counted, paid or admitted.
    Companion,
}

/// Whether this attempt already had its re-send for an HTTP/2 proof that it was never
/// processed (one an attempt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Proof {
    Unused,
    Spent,
}

/// Fleet: whether this attempt waits at the cooldown gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Gate {
    /// It waits while the gate is closed.
    Wait,
    /// It waited already (it is not held twice, even when the gate closes again while it
    /// waits for its pacing turn), or it goes one target down a fallback chain, past the
    /// gate the failing target closed.
    Passed,
}

/// What the loop does next, once it decided on an answer.
pub(super) enum Next<R> {
    /// Hand this to the caller.
    Respond(Response<RetryBody<R>>),
    /// End the request with this error.
    Fail(Error),
    /// Retry after this sleep.
    Sleep(Duration),
    /// Send the same attempt again, at once.
    Resend,
}

/// What the loop does after judging an attempt.
enum Verdict {
    Success,
    Retry(Duration),
    GiveUp(GiveUpReason),
    Cancel,
}

/// What the answer comes to before the retry policy has its say.
enum Answer {
    /// Go on as the classifier says.
    Go,
    /// The same attempt again, at once.
    Resend,
    /// End the request with this error.
    Final(Error),
    /// Return the response without a retry.
    Keep,
    /// The deadline passed while the body was read: record the attempt and end.
    Cut,
    /// A request sent once: the answer goes to the caller as it is.
    OneShot,
}

/// What the companions said of an attempt, for the record of its failure.
#[derive(Debug, Clone, Copy, Default)]
struct Remark {
    /// The next attempt goes one target down a fallback chain: the failing target's
    /// `Retry-After` does not apply to it.
    stepped: bool,
    /// Every key of a pool rests.
    keys_resting: bool,
    /// How far down its fallback chain the attempt went.
    level: Option<u32>,
}

impl<S, C> Ctx<S, C>
where
    S: tower_service::Service<Request<ReplayBody>>,
    C: Classify,
{
    /// Decides on a response: `reply` is its body as read (nothing, when `outcome` is
    /// [`Peek::Head`]), `said` what the companions left on its send.
    // Inlined: the response and its body are large, and the path every request takes should
    // not copy them into a call and back out.
    #[inline(always)]
    pub(super) fn decide<R>(
        &mut self,
        mut head: http::response::Parts,
        mut reply: Reply<R>,
        mode: Option<PeekMode>,
        outcome: Peek,
        said: Said,
        span: Span,
    ) -> Next<R>
    where
        R: Body,
    {
        let status = head.status;
        // The one classification of the answer, with the error body as read.
        let classify = |head: &http::response::Parts, bytes: Option<&[u8]>| {
            let c = self.config.classifier.classify_response(head, bytes);
            match (c.class(), c.overflow(), bytes) {
                // A custom classifier's context overflow: the numbers, for the repair.
                (Some(FailureClass::ContextOverflow), None, Some(bytes)) => {
                    c.with_overflow(context_overflow(bytes))
                }
                _ => c,
            }
        };
        let (mut c, commit, error) = match &outcome {
            Peek::Head => (classify(&head, None), None, None),
            Peek::ErrorBody => (classify(&head, reply.bytes().as_deref()), None, None),
            Peek::CutByDeadline => match mode {
                Some(PeekMode::ErrorBody) => {
                    (classify(&head, reply.bytes().as_deref()), None, None)
                }
                _ => (Classification::retry(FailureClass::Timeout), None, None),
            },
            Peek::SseError(c) => (*c, Some(CommitReason::Error), None),
            Peek::Commit(reason) => (Classification::success(), Some(*reason), None),
            Peek::Complete | Peek::TooLarge => (Classification::success(), None, None),
            Peek::Failed | Peek::NoOutput => {
                let class = match (&outcome, &mode) {
                    (Peek::NoOutput, _) => FailureClass::Timeout,
                    (_, Some(PeekMode::Envelope(_))) => FailureClass::TruncatedEnvelope,
                    _ => FailureClass::Transport,
                };
                let error = match &mut reply {
                    Reply::Peeked(peek) => peek.peeked.as_mut().and_then(|p| p.error.take()),
                    Reply::Untouched { .. } => None,
                };
                (Classification::retry(class), None, error)
            }
        };
        let mut remark = Remark {
            level: said.level,
            ..Remark::default()
        };
        let answer = match outcome {
            Peek::CutByDeadline => Answer::Cut,
            _ if said.companions.is_empty() && self.resend != Resend::Never => Answer::Go,
            _ => match self.ask(&said, &mut head, &c, &mut remark) {
                // Sent once: the companions still mark the response (an overflow's numbers),
                // and nothing they ask of the loop can be done.
                _ if self.resend == Resend::Never => Answer::OneShot,
                answer => answer,
            },
        };
        // Fleet: a Retry-After or exhausted rate-limit headers may close the gate. It learns
        // from every answer but one a companion replaces or ends.
        if !matches!(answer, Answer::Resend | Answer::Final(_)) {
            // A 429's message may name the token limit it was for.
            let named = match (status, &reply) {
                (http::StatusCode::TOO_MANY_REQUESTS, Reply::Peeked(_)) => reply
                    .bytes()
                    .as_deref()
                    .and_then(crate::provider::error_body::token_limit_of),
                _ => None,
            };
            self.fleet().observe(
                &head,
                c.retry_after(),
                self.policy().fleet_limits_for(self.retries + 1),
                named,
                self.sent_at,
            );
        }
        match answer {
            Answer::Go => {}
            Answer::Keep => c = kept(c),
            Answer::Resend => return Next::Resend,
            Answer::Final(err) => {
                return Next::Fail(self.final_error(err, Some(status), &span, remark));
            }
            Answer::Cut => {
                self.note_cut_by_deadline(&c, status);
                return Next::Fail(self.deadline_exceeded());
            }
            Answer::OneShot => {
                // Sent once and never retried: nothing to judge, but the pacing learns too.
                self.pacing_feedback(&c);
                let body = reply.into_body(self.policy().get_idle_timeout(), None);
                let body = match self.tokens.as_mut().and_then(|t| t.charged.take()) {
                    Some(charged) => self.settle_tokens(charged, status, body),
                    None => body,
                };
                return Next::Respond(Response::from_parts(head, body));
            }
        }
        let error_ref = error
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static));
        let verdict = self.judge(&c, Some(status), error_ref, false, &span, remark);
        match verdict {
            Verdict::Retry(delay) => {
                if let Some(charged) = self.tokens.as_mut().and_then(|t| t.charged.take()) {
                    self.refund_tokens(charged);
                }
                Next::Sleep(delay)
            }
            Verdict::Cancel => Next::Fail(self.cancelled()),
            verdict => {
                let truncated = matches!(outcome, Peek::Complete)
                    && reply
                        .bytes()
                        .is_some_and(|b| crate::stream::output_truncated(&b));
                let peeked_bytes = reply.len();
                let sse = matches!(reply, Reply::Untouched { sse: true, .. });
                // A failure handed up as it happened: the caller reads the bytes that came,
                // then the error.
                let mut body = reply.into_body(self.policy().get_idle_timeout(), error);
                if self.config.stream_end_check {
                    match (mode, commit) {
                        // A committed stream is followed to its terminal event, from where
                        // the peek's scan left it.
                        (Some(PeekMode::Sse(mut scan)), Some(_)) => {
                            scan.widen();
                            body = body.follow_stream(scan);
                        }
                        // With the gate off, a stream is still followed to its end.
                        (None, _) if status.is_success() && sse => {
                            body = body.follow_stream(Box::new(StreamScan::new()));
                        }
                        _ => {}
                    }
                }
                let body = match self.tokens.as_mut().and_then(|t| t.charged.take()) {
                    Some(charged) => self.settle_tokens(charged, status, body),
                    None => body,
                };
                let mut res = self.respond(head, body, &verdict);
                if let Some(reason) = commit {
                    res.extensions_mut()
                        .insert(StreamCommitted::new(reason, peeked_bytes));
                }
                if truncated {
                    res.extensions_mut().insert(OutputTruncated);
                }
                Next::Respond(res)
            }
        }
    }

    /// Decides on an attempt that failed without a response head. `level`: how far down a
    /// fallback chain it went.
    pub(super) fn decide_error<R>(&mut self, e: BoxError, said: Said, span: Span) -> Next<R> {
        said.failed(&*e);
        let level = said.level;
        if self.resend == Resend::Never {
            self.paced = None;
            return Next::Fail(finish_error(ErrorKind::Service, e, None));
        }
        // An inner layer's final word ends the request whatever the classifier would say.
        let (c, not_sent) = match final_class(&*e) {
            Some(class) => (Classification::fail(class), false),
            None => (
                self.config.classifier.classify_error(&*e),
                self.config.classifier.request_not_sent(&*e),
            ),
        };
        let remark = Remark {
            level,
            ..Remark::default()
        };
        match self.judge(&c, None, Some(&*e), not_sent, &span, remark) {
            Verdict::Retry(delay) => {
                // A transport failure may have reached the server: its tokens stay taken.
                if let Some(t) = self.tokens.as_mut() {
                    t.charged = None;
                }
                Next::Sleep(delay)
            }
            Verdict::Cancel => Next::Fail(self.cancelled().with_source(e)),
            Verdict::GiveUp(reason) => {
                let trail = Some(self.finished_trail());
                // Not sendable as configured: its own kind, over a cause that says what to
                // change.
                if c.class() == Some(FailureClass::Unsendable)
                    && matches!(
                        reason,
                        GiveUpReason::NotRetryable | GiveUpReason::NotReplaySafe
                    )
                {
                    let e: BoxError = Box::new(Unsendable::wrap(e));
                    return Next::Fail(finish_error(ErrorKind::Unsendable, e, trail));
                }
                Next::Fail(finish_error(give_up_kind(reason), e, trail))
            }
            // A classifier that calls an error a success still leaves no response to return.
            Verdict::Success => {
                let trail = Some(self.finished_trail());
                Next::Fail(finish_error(ErrorKind::Service, e, trail))
            }
        }
    }

    /// Whether, and how, the start of this response's body must be read before deciding.
    /// `sse`: the response is an event stream.
    #[inline]
    pub(super) fn peek_mode(
        &self,
        head: &http::response::Parts,
        sse: bool,
        said: &Said,
    ) -> Option<PeekMode> {
        if self.resend == Resend::Never {
            // Sent once: read only for the companions' sake.
            return said.wants_body(head).then_some(PeekMode::ErrorBody);
        }
        if self.config.classifier.wants_body(head) || said.wants_body(head) {
            return Some(PeekMode::ErrorBody);
        }
        if !head.status.is_success() {
            return None;
        }
        if sse {
            return self
                .config
                .sse_gate
                .then(|| PeekMode::Sse(Box::new(StreamScan::with_limit(self.config.peek_limit))));
        }
        self.config.buffer_responses.map(PeekMode::Envelope)
    }

    /// Asks the companions' questions about a response, in the order [`Companion`] gives. A
    /// re-send is granted while a copy of the request is kept, within
    /// [`MAX_COMPANION_RESENDS`] an attempt.
    ///
    /// [`Companion`]: crate::pipeline::Companion
    fn ask(
        &mut self,
        said: &Said,
        head: &mut http::response::Parts,
        c: &Classification,
        remark: &mut Remark,
    ) -> Answer {
        if said.companions.is_empty() {
            return Answer::Go;
        }
        let mut carried = self
            .link
            .as_ref()
            .map(|l| l.carried().clone())
            .unwrap_or_default();
        let mut question = Question {
            head,
            class: c,
            carried: &mut carried,
            keys_resting: false,
            retry_after_max: self.longest_wait(),
        };
        let judged = said.ask(&mut question);
        remark.keys_resting = question.keys_resting;
        match judged {
            Judged::Pass => Answer::Go,
            Judged::Step => {
                remark.stepped = true;
                Answer::Go
            }
            Judged::Keep => Answer::Keep,
            Judged::Final(err) => Answer::Final(err),
            Judged::Resend
                if self.resends < MAX_COMPANION_RESENDS
                    && self.held.can_resend()
                    && !self.is_cancelled() =>
            {
                self.resends += 1;
                *self.link_mut().carried_mut() = carried;
                self.next = NextSend::Companion;
                tracing::debug!(
                    attempt = self.retries + 1,
                    status = head.status.as_u16(),
                    "a layer inside asked to re-send the attempt at once"
                );
                Answer::Resend
            }
            Judged::Resend => Answer::Go,
        }
    }

    /// The link to the companions, made on first use.
    fn link_mut(&mut self) -> &mut Link {
        self.link.get_or_insert_with(Link::new)
    }

    pub(super) fn policy(&self) -> &RetryPolicy {
        self.policy_override
            .as_deref()
            .unwrap_or(&self.config.policy)
    }

    pub(super) fn is_cancelled(&self) -> bool {
        self.config
            .cancel
            .as_ref()
            .is_some_and(|t| t.is_cancelled())
    }

    pub(super) fn cancelled(&mut self) -> Error {
        self.trail.set_gave_up(GiveUpReason::Cancelled);
        Error::new(ErrorKind::Cancelled).with_trail(self.finished_trail())
    }

    /// The longest `Retry-After` this request can still wait: the policy's ceiling, cut to
    /// what is left of the deadline. A rate limit that asks for more has nowhere to wait.
    pub(super) fn longest_wait(&self) -> Duration {
        let ceiling = self.policy().get_retry_after_max();
        self.deadline.map_or(ceiling, |d| {
            ceiling.min(d.saturating_duration_since(Instant::now()))
        })
    }

    /// Whether the request's deadline has passed: no attempt may start.
    pub(super) fn deadline_passed(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The error for a request whose deadline passed, or would pass, before its next attempt
    /// could start.
    pub(super) fn deadline_exceeded(&mut self) -> Error {
        self.trail.set_gave_up(GiveUpReason::Deadline);
        let limit = self.policy().get_deadline().unwrap_or_default();
        tracing::warn!(
            attempts = self.sent,
            deadline_ms = limit.as_millis() as u64,
            "LLM request deadline reached"
        );
        let trail = self.finished_trail();
        if let Some(observer) = &self.config.observer {
            observer.on_give_up(&trail);
        }
        Error::new(ErrorKind::DeadlineExceeded)
            .with_source(DeadlineReached(limit))
            .with_trail(trail)
    }

    /// Records the attempt whose answer was still being read when the deadline passed.
    fn note_cut_by_deadline(&mut self, c: &Classification, status: http::StatusCode) {
        let class = c.class().unwrap_or(FailureClass::Timeout);
        let limit = self.policy().get_deadline().unwrap_or_default();
        let cut = DeadlineReached(limit);
        self.trail.push(AttemptRecord {
            attempt: self.retries + 1,
            class,
            status: Some(status),
            retry_after: c.retry_after(),
            delay: None,
            error: Some(error_chain(&cut)),
            elapsed: self.started.elapsed(),
        });
    }

    /// Fleet: the state this request shares, its scope's or the layer's.
    pub(super) fn fleet(&self) -> &Fleet {
        self.scoped.as_ref().unwrap_or(&self.config.fleet)
    }

    /// Fleet: the tokens the attempt took. A success settles them with the usage its body
    /// reports as the caller reads it; any other answer gives them back (the providers do
    /// not count a refused request against the limit).
    fn settle_tokens<R>(
        &mut self,
        charged: Cost,
        status: http::StatusCode,
        body: RetryBody<R>,
    ) -> RetryBody<R> {
        if status.is_success() {
            return body.tap_usage(UsageTap::new(self.fleet().clone(), charged));
        }
        self.refund_tokens(charged);
        body
    }

    /// Fleet: gives back the tokens of an attempt the server did not serve.
    pub(super) fn refund_tokens(&self, charged: Cost) {
        let none = Usage {
            input: Some(0),
            output: Some(0),
        };
        self.fleet().settle_tokens(charged, none);
    }

    /// Fleet: tells the pacing how the attempt that had a turn ended.
    fn pacing_feedback(&mut self, c: &Classification) {
        let Some(epoch) = self.paced.take() else {
            return;
        };
        if c.is_success() {
            self.fleet().paced_success();
        } else if c.class() == Some(FailureClass::RateLimited) {
            // A rate limit slows the pacing. An overload does not: it is the server's state,
            // not this client's limit, and the budget and the gate shed load already.
            self.fleet().paced_refusal(epoch, c.retry_after());
        }
    }

    /// The request gives up: its turn (or its tokens) would come later than it may wait.
    /// The error carries the trail; the observer hears of it when a retry was made.
    pub(super) fn pacing_wait_too_long(
        &mut self,
        refused: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        self.trail.set_gave_up(GiveUpReason::PacingWaitTooLong);
        let trail = self.finished_trail();
        if self.retries > 0 {
            if let Some(observer) = &self.config.observer {
                observer.on_give_up(&trail);
            }
        }
        Error::new(ErrorKind::PacingWaitTooLong)
            .with_source(refused)
            .with_trail(trail)
    }

    pub(super) fn finished_trail(&mut self) -> RetryTrail {
        let mut trail = std::mem::take(&mut self.trail);
        trail.set_total_attempts(self.sent);
        trail
    }

    /// Builds the response handed to the caller, with the trail when any attempt failed.
    #[inline(always)]
    fn respond<R>(
        &mut self,
        head: http::response::Parts,
        body: RetryBody<R>,
        verdict: &Verdict,
    ) -> Response<RetryBody<R>> {
        let mut res = Response::from_parts(head, body);
        // A first attempt that succeeded has no trail, unless it waited for tokens.
        if matches!(verdict, Verdict::GiveUp(_))
            || self.sent > 1
            || self.trail.token_wait().is_some()
        {
            res.extensions_mut().insert(self.finished_trail());
        }
        res
    }

    /// Whether a copy of the request is kept for a retry of this attempt (not only for a
    /// companion's re-send of it).
    fn keeps_copy(&self) -> bool {
        self.resend != Resend::Never && self.retries < self.policy().get_max_retries()
    }

    /// Decides between a retry (and its sleep) and giving up, for a failed attempt.
    fn plan(
        &mut self,
        c: &Classification,
        not_sent: bool,
        stepped: bool,
    ) -> Result<Duration, GiveUpReason> {
        if !c.is_retryable() {
            return Err(GiveUpReason::NotRetryable);
        }
        // HTTP/2 proved the server never processed this attempt: it is re-sent at once, once
        // per attempt, also when it is not replay-safe, without counting as a retry or
        // drawing on the budget (gRPC's transparent retry). Only while a copy is kept: a
        // request allowed no retries is sent exactly once.
        if c.class() == Some(FailureClass::NotProcessed)
            && self.proof == Proof::Unused
            && self.keeps_copy()
            && self.held.can_resend()
            && !self.is_cancelled()
        {
            self.proof = Proof::Spent;
            self.next = NextSend::Unprocessed;
            return Ok(Duration::ZERO);
        }
        if self.resend == Resend::IfNotSent && !not_sent {
            return Err(GiveUpReason::NotReplaySafe);
        }
        let policy = self.policy();
        if self.retries >= policy.get_max_retries() {
            return Err(GiveUpReason::MaxRetries);
        }
        if let Some(limit) = policy.get_max_consecutive_overloads() {
            // Only an overload counts toward it (the count starts over at any other failure):
            // with a limit of 0, overloads are not retried and other failures still are.
            if self.consecutive_overloads > 0 && self.consecutive_overloads >= limit {
                return Err(GiveUpReason::MaxConsecutiveOverloads);
            }
        }
        if self.is_cancelled() {
            return Err(GiveUpReason::Cancelled);
        }
        let retry_after = if stepped { None } else { c.retry_after() };
        let delay = match policy.delay(self.retries + 1, retry_after) {
            Ok(d) => d,
            Err(DelayRefused::RetryAfterTooLong) => return Err(GiveUpReason::RetryAfterTooLong),
        };
        if let Some(dl) = self.deadline {
            // The retry would start after the sleep, or after the gate reopens (it is held
            // there at most the policy's ceiling); neither may reach the deadline. A sum past
            // what `Instant` can hold is past any deadline.
            let now = Instant::now();
            let after_sleep = now.checked_add(delay);
            let after_gate = self.fleet().closed_until().filter(|_| !stepped);
            let after_gate = after_gate.map(|until| {
                now.checked_add(policy.get_retry_after_max())
                    .map_or(until, |cap| until.min(cap))
            });
            if after_sleep.is_none_or(|t| t >= dl) || after_gate.is_some_and(|t| t >= dl) {
                return Err(GiveUpReason::Deadline);
            }
        }
        // Fleet: the shared retry budget has the last word.
        if !self.fleet().withdraw() {
            return Err(GiveUpReason::Budget);
        }
        // A retry on the next target of a fallback chain does not wait at the gate the
        // failing target's Retry-After closed.
        if stepped {
            self.gate = Gate::Passed;
        }
        Ok(delay)
    }

    /// Records a failed attempt: its class, and for the companion layers what else they
    /// decide on (whether it timed out, whether it failed to connect, whether a rate limit
    /// had nowhere to wait, how far down a fallback chain it went).
    fn note_class(
        &mut self,
        class: FailureClass,
        c: &Classification,
        error: Option<&(dyn std::error::Error + 'static)>,
        not_sent: bool,
        remark: Remark,
    ) {
        if class == FailureClass::Overloaded {
            self.consecutive_overloads += 1;
        } else {
            self.consecutive_overloads = 0;
        }
        let failed = Failed::of(
            class,
            c,
            error.is_some_and(timed_out),
            // Not sent, and not for an HTTP/2 proof (which comes on a connection that was up,
            // whatever a custom classifier calls it).
            not_sent && !error.is_some_and(crate::classify::never_processed),
            remark.keys_resting,
            self.longest_wait(),
            remark.level,
        );
        self.link_mut().carried_mut().failures.push(failed);
        self.previous = Some(class);
    }

    /// Ends the request with an inner layer's final error, the trail recording the attempt.
    fn final_error(
        &mut self,
        err: Error,
        status: Option<http::StatusCode>,
        span: &Span,
        remark: Remark,
    ) -> Error {
        let class = final_class(&err).unwrap_or(FailureClass::Other);
        let c = Classification::fail(class);
        let _ = self.judge(&c, status, Some(&err), false, span, remark);
        let trail = self.finished_trail();
        err.with_trail(trail)
    }

    /// Judges one attempt: records a failure, then decides what comes next.
    #[inline(always)]
    fn judge(
        &mut self,
        c: &Classification,
        status: Option<http::StatusCode>,
        error: Option<&(dyn std::error::Error + 'static)>,
        not_sent: bool,
        span: &Span,
        remark: Remark,
    ) -> Verdict {
        self.pacing_feedback(c);
        if c.is_success() {
            if self.sent > 1 {
                if let Some(observer) = &self.config.observer {
                    observer.on_recovered(self.sent);
                }
                tracing::debug!(parent: span, attempts = self.sent, "LLM request recovered");
            }
            return Verdict::Success;
        }
        let class = c.class().unwrap_or(FailureClass::Other);
        span.record("error.type", class.as_str());
        self.note_class(class, c, error, not_sent, remark);
        self.trail.push(AttemptRecord {
            attempt: self.retries + 1,
            class,
            status,
            retry_after: c.retry_after(),
            delay: None,
            error: error.map(error_chain),
            elapsed: self.started.elapsed(),
        });
        // A step down a fallback chain leaves the failing target's Retry-After behind.
        match self.plan(c, not_sent, remark.stepped) {
            Ok(delay) => {
                self.announce_retry(c, status, error, delay, span);
                Verdict::Retry(delay)
            }
            Err(GiveUpReason::Cancelled) => Verdict::Cancel,
            Err(reason) => {
                self.give_up(c, reason, span);
                Verdict::GiveUp(reason)
            }
        }
    }

    fn announce_retry(
        &mut self,
        c: &Classification,
        status: Option<http::StatusCode>,
        error: Option<&(dyn std::error::Error + 'static)>,
        delay: Duration,
        span: &Span,
    ) {
        if let Some(last) = self.trail.last_mut() {
            last.delay = Some(delay);
        }
        let class = c.class().unwrap_or(FailureClass::Other);
        let max_retries = self.policy().get_max_retries();
        tracing::info!(
            parent: span,
            attempt = self.retries + 1,
            "error.type" = class.as_str(),
            status = status.map(|s| s.as_u16()),
            delay_ms = delay.as_millis() as u64,
            max_retries,
            "retrying LLM request"
        );
        if let Some(observer) = &self.config.observer {
            observer.on_retry(&RetryEvent {
                attempt: self.retries + 1,
                class,
                status,
                error,
                retry_after: c.retry_after(),
                delay,
                max_retries,
            });
        }
    }

    fn give_up(&mut self, c: &Classification, reason: GiveUpReason, span: &Span) {
        self.trail.set_gave_up(reason);
        // A plain "no" (a 404, say) on a first attempt is no give-up: there was nothing to try.
        if c.is_retryable() || self.retries > 0 {
            let class = c.class().unwrap_or(FailureClass::Other);
            tracing::warn!(
                parent: span,
                attempts = self.retries + 1,
                "error.type" = class.as_str(),
                reason = ?reason,
                "giving up on LLM request"
            );
            if let Some(observer) = &self.config.observer {
                let mut trail = self.trail.clone();
                trail.set_total_attempts(self.sent);
                observer.on_give_up(&trail);
            }
        }
    }
}

/// The error for an attempt that failed without a response and is not retried.
///
/// An inner layer's own final error (a credential that could not be refreshed, a signal to
/// switch models) reaches the caller as it is, with the trail added; anything else is wrapped
/// in an error of `kind`.
pub(super) fn finish_error(kind: ErrorKind, e: BoxError, trail: Option<RetryTrail>) -> Error {
    let err = match e.downcast::<Error>() {
        Ok(inner) if kind == ErrorKind::Service && inner.is_final() => *inner,
        Ok(inner) => Error::new(kind).with_source(*inner),
        Err(e) => Error::new(kind).with_source(e),
    };
    match trail {
        Some(trail) => err.with_trail(trail),
        None => err,
    }
}

/// The class of an inner layer's final error ([`Error::is_final`]), anywhere in `error`'s
/// source chain: such an error ends the request before any classifier runs.
fn final_class(error: &(dyn std::error::Error + 'static)) -> Option<FailureClass> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(e) = e.downcast_ref::<Error>() {
            match e.kind() {
                #[cfg(feature = "auth")]
                ErrorKind::TokenRefresh => return Some(FailureClass::Unauthorized),
                #[cfg(feature = "fallback")]
                ErrorKind::FallbackTriggered => return Some(FailureClass::Overloaded),
                _ => {}
            }
        }
        next = e.source();
    }
    None
}

/// Whether an attempt's error says it timed out: no head in time, or a body that stalled or
/// showed no output in time before the commit point.
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.downcast_ref::<TimedOut>().is_some_and(|t| {
            matches!(
                t.kind(),
                TimeoutKind::Head | TimeoutKind::Idle | TimeoutKind::FirstOutput
            )
        }) {
            return true;
        }
        next = e.source();
    }
    false
}

/// A classification turned into "no retry", keeping its class and Retry-After.
fn kept(c: Classification) -> Classification {
    match c.class() {
        Some(class) if c.is_retryable() => {
            Classification::fail(class).with_retry_after(c.retry_after())
        }
        _ => c,
    }
}

fn give_up_kind(reason: GiveUpReason) -> ErrorKind {
    match reason {
        GiveUpReason::MaxRetries
        | GiveUpReason::RetryAfterTooLong
        | GiveUpReason::MaxConsecutiveOverloads
        | GiveUpReason::Deadline => ErrorKind::Exhausted,
        GiveUpReason::Budget => ErrorKind::BudgetExhausted,
        GiveUpReason::Cancelled => ErrorKind::Cancelled,
        _ => ErrorKind::Service,
    }
}
