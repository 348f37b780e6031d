use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tower_service::Service;
use tracing::Span;

use super::layer::Config;
use super::policy::DelayRefused;
use super::{NotReplaySafe, RetryEvent, RetryPolicy};
use crate::body::{Held, PrepareBody, ReplayBody};
use crate::classify::{Classification, Classify, FailureClass, SseVerdict};
use crate::error::{
    error_chain, AttemptRecord, BoxError, DeadlineReached, Error, ErrorKind, GiveUpReason,
    RetryTrail, TimedOut, TimeoutKind,
};
use crate::fleet::{Fleet, GateWait, PastDeadline, Ticket};
use crate::pipeline::body::{IdleTimer, Peeked, Read, RetryBody};
use crate::pipeline::{
    Asks, AtLevel, AttemptContext, Carried, Failed, HttpResponse, Judged, ResBodyOf,
};
use crate::provider::error_body::ErrorBody;
use crate::stream::{
    is_event_stream, CommitReason, OutputTruncated, ScanError, StreamCommitted, StreamScan,
};

pin_project! {
    /// The response future of [`Retry`](super::Retry).
    ///
    /// Dropping it stops everything at once: the attempt in flight is dropped with it and no
    /// further attempt is made.
    pub struct ResponseFuture<S, B, C>
    where
        S: Service<Request<ReplayBody>>,
        S::Response: HttpResponse,
        B: Body,
        B::Error: Into<BoxError>,
    {
        #[pin]
        state: State<S::Future, B, ResBodyOf<S>>,
        ctx: Ctx<S, C>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, R>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Buffering { #[pin] prepare: PrepareBody<B> },
        // Before an attempt: waiting for the inner service to be ready, watching the caller's
        // cancellation and the deadline once it has to wait.
        Ready { watch: Option<Watch> },
        Calling {
            #[pin] future: F,
            // The head timeout, once armed, and how long it was armed for (the policy's, or
            // less when the deadline is nearer).
            #[pin] timeout: Option<Sleep>,
            armed_for: Duration,
            span: Span,
        },
        // The states off the success path are boxed: it keeps the future small on the path
        // every request takes, at the cost of an allocation on the ones few take.
        Peeking { peek: Box<PeekState<R>> },
        Sleeping {
            sleep: Pin<Box<Sleep>>,
            watch: Watch,
        },
        // Fleet: waiting at the closed cooldown gate before an attempt.
        Gated { wait: Pin<Box<GateWait>>, watch: Watch },
        // Fleet: waiting for this attempt's turn of the adaptive pacing.
        Pacing {
            ticket: Ticket,
            watch: Watch,
        },
        Done,
    }
}

/// What every wait of the loop also watches: the caller's cancellation and the request's
/// deadline. Both are armed only when the loop has to wait, off the success path.
struct Watch {
    cancel: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    deadline: Option<Pin<Box<Sleep>>>,
}

/// Why a wait ended before its time.
enum Stop {
    Cancelled,
    Deadline,
}

impl Watch {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Stop> {
        if let Some(cancel) = self.cancel.as_mut() {
            if cancel.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Stop::Cancelled);
            }
        }
        if let Some(deadline) = self.deadline.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Stop::Deadline);
            }
        }
        Poll::Pending
    }
}

/// Reading the start of a response body before deciding.
struct PeekState<R> {
    head: Option<http::response::Parts>,
    peeked: Option<Peeked<R>>,
    mode: PeekMode,
    // The questions of the companion layers inside, asked once the error body is read.
    asks: Option<Asks>,
    // Handed on to the body the caller gets.
    idle: IdleTimer,
    // The request's deadline, when it has one: it bounds the read as it bounds the waits.
    deadline: Option<Pin<Box<Sleep>>>,
    span: Span,
}

/// Why the loop reads the start of a response body before deciding.
enum PeekMode {
    /// An error status: read up to the peek limit, then classify with the bytes.
    ErrorBody,
    /// A 2xx event stream: read up to the first event with visible output.
    Sse(Box<StreamScan>),
    /// A 2xx body read whole (up to the cap), so a truncated one can be retried.
    Envelope(usize),
}

/// What reading the start of a body ended with.
enum Peek {
    /// The error body is ready to classify.
    ErrorBody,
    /// The stream may go to the caller.
    Commit(CommitReason),
    /// An in-band error event before any output.
    SseError(Classification),
    /// Reading failed (error or idle timeout); the error is kept in the peeked body.
    Failed,
    /// The envelope was read whole.
    Complete,
    /// The envelope is larger than the cap; it goes to the caller as it streams.
    TooLarge,
}

struct Ctx<S, C> {
    service: S,
    config: Arc<Config<C>>,
    policy_override: Option<Box<RetryPolicy>>,
    held: Held,
    // Retries so far: the attempt in flight is number `retries + 1`.
    retries: u32,
    sent: u32,
    consecutive_overloads: u32,
    previous: Option<FailureClass>,
    replay_safe: bool,
    // The body was too large to hold: the request is sent once, as it streams, and never
    // retried, but still under the head timeout, the deadline and the fleet's admission.
    one_shot: bool,
    // HTTP/2 proved this attempt was never processed, and it was re-sent for that once
    // already; and whether the next send is such a re-send (same attempt, no sleep).
    transparent_used: bool,
    transparent_next: bool,
    trail: RetryTrail,
    started: Instant,
    deadline: Option<Instant>,
    model: Option<Option<String>>,
    // Fleet: this attempt already waited at the gate (it is not held twice, even when the
    // gate closes again while it waits for its pacing turn).
    gate_passed: bool,
    // Fleet: the pacing epoch of the attempt about to start or in flight, once it has its turn.
    paced: Option<u64>,
    // A copy of the request is kept for a retry of this attempt (not only for a companion's
    // re-send of it).
    kept: bool,
    // The companion layers inside: what the next send carries for them, whether the next send
    // is a re-send of the same attempt they asked for, how many they asked for in this
    // attempt, and whether this attempt moved the request down a fallback chain.
    // Boxed, and only once there is something to carry: off the success path.
    carried: Option<Box<Carried>>,
    resend_next: bool,
    resends: u32,
    stepped: bool,
    // For the record of this attempt's failure: every key of a pool rests (AuthLayer said
    // so), and how far down its chain ModelFallbackLayer sent it.
    keys_resting: bool,
    served_level: Option<u32>,
    // The head timeout of the attempt in flight, reckoned when it starts (cut to the
    // deadline), as the companion layers are told it.
    attempt_head_timeout: Option<Duration>,
    // Fleet: the state of this request's scope, when the fleet keeps one per scope.
    scoped: Option<Fleet>,
}

/// A bound on the re-sends companion layers may ask for within one attempt.
const MAX_COMPANION_RESENDS: u32 = 32;

/// What the companion layers' questions about a response came to.
enum Answer {
    /// Go on as the classifier says.
    Go,
    /// The same attempt again, at once.
    Resend,
    /// End the request with this error.
    Final(Error),
    /// Return the response without a retry.
    Keep,
}

/// What the loop does after judging an attempt.
enum Verdict {
    Success,
    Retry(Duration),
    GiveUp(GiveUpReason),
    Cancel,
}

impl<S, B, C> std::fmt::Debug for ResponseFuture<S, B, C>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body,
    B::Error: Into<BoxError>,
{
    // The request head holds credentials: show only where the loop is.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Buffering { .. } => "buffering",
            State::Ready { .. } => "ready",
            State::Calling { .. } => "calling",
            State::Peeking { .. } => "peeking",
            State::Sleeping { .. } => "sleeping",
            State::Gated { .. } => "gated",
            State::Pacing { .. } => "pacing",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("attempt", &(self.ctx.retries + 1))
            .finish()
    }
}

impl<S, B, C> ResponseFuture<S, B, C>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    #[inline]
    pub(crate) fn new(service: S, config: Arc<Config<C>>, req: Request<B>) -> Self {
        let (parts, body) = req.into_parts();
        let policy_override = super::policy::per_request(&parts.extensions, &config.policy);
        let replay_safe = parts.extensions.get::<NotReplaySafe>().is_none();
        let scoped = config.fleet.for_request(&parts);
        let started = Instant::now();
        let deadline = policy_override
            .as_ref()
            .unwrap_or(&config.policy)
            .get_deadline()
            .and_then(|d| started.checked_add(d));
        // One expression, which lets the compiler build the future where it is returned: a
        // `Ctx` built aside and moved in was one more copy of it.
        let limit = config.body_limit;
        ResponseFuture {
            state: State::Buffering {
                prepare: PrepareBody::new(body, limit),
            },
            ctx: Ctx {
                service,
                config,
                policy_override: policy_override.map(Box::new),
                held: Held::new(parts),
                retries: 0,
                sent: 0,
                consecutive_overloads: 0,
                previous: None,
                replay_safe,
                one_shot: false,
                transparent_used: false,
                transparent_next: false,
                trail: RetryTrail::default(),
                started,
                deadline,
                model: None,
                gate_passed: false,
                paced: None,
                kept: false,
                carried: None,
                resend_next: false,
                resends: 0,
                stepped: false,
                keys_resting: false,
                served_level: None,
                attempt_head_timeout: None,
                scoped,
            },
        }
    }
}

impl<S, B, C, ResBody> Future for ResponseFuture<S, B, C>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    C: Classify,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response<RetryBody<ResBody>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let ctx = this.ctx;
        loop {
            match this.state.as_mut().project() {
                StateProj::Buffering { prepare } => match ready!(prepare.poll(cx)) {
                    Ok(body) => {
                        // Too big to hold: it is sent once, as it streams, and never retried.
                        ctx.one_shot = !body.is_replayable();
                        ctx.held.set_body(body);
                        match ctx.admit() {
                            Ok(Some(wait)) => {
                                this.state.set(wait);
                                continue;
                            }
                            Ok(None) => {}
                            Err(stop) => {
                                this.state.set(State::Done);
                                return Poll::Ready(Err(ctx.stopped(stop)));
                            }
                        }
                        if ctx.deadline_passed() {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.deadline_exceeded()));
                        }
                        // The service was polled ready before `call`; the first attempt
                        // uses that readiness.
                        let state = ctx.start_attempt();
                        this.state.set(state);
                    }
                    Err(e) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e));
                    }
                },
                StateProj::Ready { watch } => {
                    if watch.is_none() {
                        if ctx.is_cancelled() {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.cancelled()));
                        }
                        // A companion's re-send of the same attempt, and a re-send HTTP/2
                        // proved the server never processed, were admitted with it.
                        let admission = match ctx.resend_next || ctx.transparent_next {
                            true => Ok(None),
                            false => ctx.admit(),
                        };
                        match admission {
                            Ok(Some(wait)) => {
                                this.state.set(wait);
                                continue;
                            }
                            Ok(None) => {}
                            Err(stop) => {
                                this.state.set(State::Done);
                                return Poll::Ready(Err(ctx.stopped(stop)));
                            }
                        }
                        // No attempt starts after the deadline, whatever it waited for.
                        if ctx.deadline_passed() {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.deadline_exceeded()));
                        }
                    }
                    match ctx.service.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => {
                            this.state.set(State::Done);
                            let trail = Some(ctx.finished_trail());
                            return Poll::Ready(Err(finish_error(
                                ErrorKind::Service,
                                e.into(),
                                trail,
                            )));
                        }
                        Poll::Pending => {
                            // A service that is not ready is a wait like any other: the
                            // caller's cancellation and the deadline end it.
                            let watch = watch.get_or_insert_with(|| ctx.watch());
                            let stop = ready!(watch.poll(cx));
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.stopped(stop)));
                        }
                    }
                    let state = ctx.start_attempt();
                    this.state.set(state);
                }
                StateProj::Calling {
                    future,
                    mut timeout,
                    armed_for,
                    span,
                } => {
                    let polled = {
                        let _enter = span.enter();
                        future.poll(cx)
                    };
                    let result = match polled {
                        Poll::Ready(r) => r.map_err(Into::into),
                        Poll::Pending => {
                            // The timer starts the first time the attempt has to wait, so an
                            // answer that is ready at once never touches the timer wheel.
                            if timeout.is_none() {
                                match ctx.attempt_head_timeout {
                                    Some(d) => {
                                        *armed_for = d;
                                        timeout.set(Some(tokio::time::sleep(d)));
                                    }
                                    None => return Poll::Pending,
                                }
                            }
                            let fired = timeout.as_pin_mut().is_some_and(|t| t.poll(cx).is_ready());
                            if !fired {
                                return Poll::Pending;
                            }
                            Err(Box::new(TimedOut::new(TimeoutKind::Head, *armed_for)) as BoxError)
                        }
                    };
                    // Where a fallback chain sent a failed attempt, as a response would have
                    // said in its `ModelUsed`; the error goes on as the service raised it.
                    let result = result.map_err(|e| match e.downcast::<AtLevel>() {
                        Ok(at) => {
                            ctx.served_level = Some(at.level);
                            at.error
                        }
                        Err(e) => e,
                    });
                    let span = std::mem::replace(span, Span::none());
                    match result {
                        Ok(res) if ctx.one_shot => {
                            // Sent once and never retried: nothing to peek or judge, but the
                            // fleet still learns from the answer.
                            let (head, body) = res.into_parts();
                            span.record("http.response.status_code", head.status.as_u16());
                            let c = ctx.config.classifier.classify_response(&head, None);
                            ctx.fleet().observe(
                                &head,
                                c.retry_after(),
                                ctx.policy().fleet_limits(),
                            );
                            ctx.pacing_feedback(&c);
                            this.state.set(State::Done);
                            let body = RetryBody::plain(body, ctx.policy().get_idle_timeout());
                            return Poll::Ready(Ok(Response::from_parts(head, body)));
                        }
                        Err(e) if ctx.one_shot => {
                            ctx.paced = None;
                            this.state.set(State::Done);
                            return Poll::Ready(Err(finish_error(ErrorKind::Service, e, None)));
                        }
                        Ok(res) => {
                            let (mut head, body) = res.into_parts();
                            span.record("http.response.status_code", head.status.as_u16());
                            ctx.served_level = served_level(&head);
                            let asks = head.extensions.remove::<Asks>();
                            let sse = is_event_stream(&head);
                            if let Some(mode) = ctx.peek_mode(&head, sse, asks.as_ref()) {
                                this.state.set(State::Peeking {
                                    peek: Box::new(PeekState {
                                        head: Some(head),
                                        peeked: Some(Peeked::new(body)),
                                        mode,
                                        asks,
                                        idle: IdleTimer::new(ctx.policy().get_idle_timeout()),
                                        deadline: ctx
                                            .deadline
                                            .map(|d| Box::pin(tokio::time::sleep_until(d))),
                                        span,
                                    }),
                                });
                                continue;
                            }
                            let answer = match &asks {
                                Some(asks) => ctx.answer(asks, &mut head, None),
                                None => Answer::Go,
                            };
                            let mut c = ctx.config.classifier.classify_response(&head, None);
                            match answer {
                                Answer::Go => {}
                                Answer::Keep => c = kept(c),
                                Answer::Resend => {
                                    drop((head, body));
                                    this.state.set(State::Ready { watch: None });
                                    continue;
                                }
                                Answer::Final(err) => {
                                    this.state.set(State::Done);
                                    let status = Some(head.status);
                                    return Poll::Ready(Err(ctx.final_error(err, status, &span)));
                                }
                            }
                            // Fleet: a Retry-After or exhausted rate-limit headers may close
                            // the gate.
                            ctx.fleet().observe(
                                &head,
                                c.retry_after(),
                                ctx.policy().fleet_limits(),
                            );
                            match ctx.judge(&c, Some(head.status), None, false, &span) {
                                Verdict::Retry(delay) => {
                                    drop(body);
                                    let state = ctx.sleep(delay);
                                    this.state.set(state);
                                }
                                Verdict::Cancel => {
                                    this.state.set(State::Done);
                                    return Poll::Ready(Err(ctx.cancelled()));
                                }
                                verdict => {
                                    this.state.set(State::Done);
                                    let mut body =
                                        RetryBody::plain(body, ctx.policy().get_idle_timeout());
                                    // With the gate off, a stream is still followed to its end.
                                    if ctx.config.stream_end_check
                                        && head.status.is_success()
                                        && sse
                                    {
                                        body = body.follow_stream(Box::new(StreamScan::new()));
                                    }
                                    return Poll::Ready(Ok(ctx.respond(head, body, &verdict)));
                                }
                            }
                        }
                        Err(e) => {
                            // An inner layer's final word ends the request whatever the
                            // classifier would say.
                            let (c, not_sent) = match final_class(&*e) {
                                Some(class) => (Classification::fail(class), false),
                                None => (
                                    ctx.config.classifier.classify_error(&*e),
                                    ctx.config.classifier.request_not_sent(&*e),
                                ),
                            };
                            match ctx.judge(&c, None, Some(&*e), not_sent, &span) {
                                Verdict::Retry(delay) => {
                                    let state = ctx.sleep(delay);
                                    this.state.set(state);
                                }
                                Verdict::Cancel => {
                                    this.state.set(State::Done);
                                    return Poll::Ready(Err(ctx.cancelled().with_source(e)));
                                }
                                Verdict::GiveUp(reason) => {
                                    this.state.set(State::Done);
                                    let trail = Some(ctx.finished_trail());
                                    return Poll::Ready(Err(finish_error(
                                        give_up_kind(reason),
                                        e,
                                        trail,
                                    )));
                                }
                                Verdict::Success => {
                                    // A classifier that calls an error a success still
                                    // leaves no response to return.
                                    this.state.set(State::Done);
                                    let trail = Some(ctx.finished_trail());
                                    return Poll::Ready(Err(finish_error(
                                        ErrorKind::Service,
                                        e,
                                        trail,
                                    )));
                                }
                            }
                        }
                    }
                }
                StateProj::Peeking { peek } => {
                    let PeekState {
                        head,
                        peeked,
                        mode,
                        asks,
                        idle,
                        deadline,
                        span,
                    } = &mut **peek;
                    // A body that stalls after its head does not hold the request past its
                    // deadline: the attempt is recorded as it stands, and the request ends.
                    if deadline
                        .as_mut()
                        .is_some_and(|d| d.as_mut().poll(cx).is_ready())
                    {
                        let head = head.take().expect("peek state holds the head");
                        let peeked = peeked.take().expect("peek state holds the body");
                        let c = match mode {
                            PeekMode::ErrorBody => ctx
                                .config
                                .classifier
                                .classify_response(&head, Some(&peeked.contiguous())),
                            _ => Classification::retry(FailureClass::Timeout),
                        };
                        ctx.fleet()
                            .observe(&head, c.retry_after(), ctx.policy().fleet_limits());
                        ctx.note_cut_by_deadline(&c, head.status);
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.deadline_exceeded()));
                    }
                    let body = peeked.as_mut().expect("peek state holds the body");
                    let outcome = ready!(poll_peek(
                        body,
                        mode,
                        idle,
                        ctx.config.peek_limit,
                        ctx.config.stream_end_check,
                        &ctx.config.classifier,
                        cx,
                    ));
                    let mode = std::mem::replace(mode, PeekMode::ErrorBody);
                    let mut head = head.take().expect("peek state holds the head");
                    let mut peeked = peeked.take().expect("peek state holds the body");
                    let span = std::mem::replace(span, Span::none());
                    let idle = std::mem::replace(idle, IdleTimer::new(None));
                    let status = Some(head.status);
                    // The companions inside decide from the error body as read here, parsed
                    // once for all of them.
                    let answer = match (&outcome, asks.take()) {
                        (Peek::ErrorBody, Some(asks)) => {
                            let bytes = peeked.contiguous();
                            let parsed = ErrorBody::parse(&bytes);
                            ctx.answer(&asks, &mut head, Some(&parsed))
                        }
                        (_, Some(asks)) => ctx.answer(&asks, &mut head, None),
                        (_, None) => Answer::Go,
                    };
                    let keep = match answer {
                        Answer::Go => false,
                        Answer::Keep => true,
                        Answer::Resend => {
                            drop((head, peeked));
                            this.state.set(State::Ready { watch: None });
                            continue;
                        }
                        Answer::Final(err) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.final_error(err, status, &span)));
                        }
                    };
                    let (c, commit, error) = match outcome {
                        Peek::ErrorBody => {
                            let c = ctx
                                .config
                                .classifier
                                .classify_response(&head, Some(&peeked.contiguous()));
                            (c, None, None)
                        }
                        Peek::SseError(c) => (c, Some(CommitReason::Error), None),
                        Peek::Commit(reason) => (Classification::success(), Some(reason), None),
                        Peek::Complete | Peek::TooLarge => (Classification::success(), None, None),
                        Peek::Failed => {
                            let class = match mode {
                                PeekMode::Envelope(_) => FailureClass::TruncatedEnvelope,
                                _ => FailureClass::Transport,
                            };
                            (Classification::retry(class), None, peeked.error.take())
                        }
                    };
                    let c = if keep { kept(c) } else { c };
                    // Fleet: a Retry-After or exhausted rate-limit headers may close the gate.
                    ctx.fleet()
                        .observe(&head, c.retry_after(), ctx.policy().fleet_limits());
                    let verdict =
                        ctx.judge(&c, status, error.as_deref().map(|e| e as _), false, &span);
                    match verdict {
                        Verdict::Retry(delay) => {
                            drop(peeked);
                            let state = ctx.sleep(delay);
                            this.state.set(state);
                        }
                        Verdict::Cancel => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.cancelled()));
                        }
                        verdict => {
                            this.state.set(State::Done);
                            // A failure handed up as it happened: the caller reads the bytes
                            // that came, then the error.
                            if let Some(error) = error {
                                peeked.error = Some(error);
                            }
                            let truncated = matches!(outcome, Peek::Complete)
                                && crate::stream::output_truncated(&peeked.contiguous());
                            let peeked_bytes = peeked.len();
                            let mut body = RetryBody::peeked(peeked, idle);
                            // A committed stream is followed to its terminal event, from
                            // where the peek's scan left it.
                            if let (PeekMode::Sse(mut scan), Some(_)) = (mode, commit) {
                                if ctx.config.stream_end_check {
                                    scan.widen();
                                    body = body.follow_stream(scan);
                                }
                            }
                            let mut res = ctx.respond(head, body, &verdict);
                            if let Some(reason) = commit {
                                res.extensions_mut()
                                    .insert(StreamCommitted::new(reason, peeked_bytes));
                            }
                            if truncated {
                                res.extensions_mut().insert(OutputTruncated);
                            }
                            return Poll::Ready(Ok(res));
                        }
                    }
                }
                StateProj::Sleeping { sleep, watch } => {
                    if let Poll::Ready(stop) = watch.poll(cx) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.stopped(stop)));
                    }
                    ready!(sleep.as_mut().poll(cx));
                    this.state.set(State::Ready { watch: None });
                }
                // Fleet: the gate reopened (or this request's wait is over); go through Ready
                // to poll the service ready after the wait.
                StateProj::Gated { wait, watch } => {
                    if let Poll::Ready(stop) = watch.poll(cx) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.stopped(stop)));
                    }
                    if let Err(PastDeadline) = ready!(wait.as_mut().poll(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.deadline_exceeded()));
                    }
                    ctx.gate_passed = true;
                    this.state.set(State::Ready { watch: None });
                }
                // Fleet: this attempt's turn came; go through Ready to poll the service ready.
                StateProj::Pacing { ticket, watch } => {
                    if let Poll::Ready(stop) = watch.poll(cx) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.stopped(stop)));
                    }
                    match ready!(ticket.poll_turn(cx)) {
                        Ok(epoch) => {
                            ctx.paced = Some(epoch);
                            this.state.set(State::Ready { watch: None });
                        }
                        // The turn would come after the deadline: the deadline's error.
                        Err(refused) if refused.by_deadline() => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.deadline_exceeded()));
                        }
                        // The turn would come later than this request may wait.
                        Err(refused) => {
                            this.state.set(State::Done);
                            ctx.trail.set_gave_up(GiveUpReason::PacingWaitTooLong);
                            let trail = ctx.finished_trail();
                            if ctx.retries > 0 {
                                if let Some(observer) = &ctx.config.observer {
                                    observer.on_give_up(&trail);
                                }
                            }
                            let err = Error::new(ErrorKind::PacingWaitTooLong).with_source(refused);
                            return Poll::Ready(Err(err.with_trail(trail)));
                        }
                    }
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// Reads the start of a body as `mode` asks, under the idle timeout.
fn poll_peek<R, C>(
    peeked: &mut Peeked<R>,
    mode: &mut PeekMode,
    idle: &mut IdleTimer,
    peek_limit: usize,
    stream_end_check: bool,
    classifier: &C,
    cx: &mut Context<'_>,
) -> Poll<Peek>
where
    R: Body,
    R::Error: Into<BoxError>,
    C: Classify,
{
    loop {
        let done = peeked.is_finished();
        match mode {
            PeekMode::ErrorBody if done || peeked.len() >= peek_limit => {
                return Poll::Ready(Peek::ErrorBody)
            }
            PeekMode::Sse(_) if done && peeked.error.is_some() => return Poll::Ready(Peek::Failed),
            PeekMode::Sse(scan) if done => {
                // The last event may be complete only now: a lone `\r` ended it.
                let last = scan.finish(|event| match classifier.classify_sse_event(event) {
                    SseVerdict::Output => Some(None),
                    SseVerdict::Error(c) => Some(Some(c)),
                    _ => None,
                });
                match last {
                    Ok(Some(None)) => return Poll::Ready(Peek::Commit(CommitReason::FirstOutput)),
                    Ok(Some(Some(c))) => return Poll::Ready(Peek::SseError(c)),
                    Ok(None) | Err(_) => {}
                }
                // A clean end before any output and before the protocol's terminal event: cut,
                // as a reset would be, and retried like one (nothing was shown yet).
                if stream_end_check {
                    if let Some(cut) = scan.end(peeked.len() as u64) {
                        peeked.error = Some(Box::new(
                            Error::new(ErrorKind::IncompleteStream).with_source(cut),
                        ));
                        return Poll::Ready(Peek::Failed);
                    }
                }
                return Poll::Ready(Peek::Commit(CommitReason::EndOfStream));
            }
            PeekMode::Sse(_) if peeked.len() >= peek_limit => {
                return Poll::Ready(Peek::Commit(CommitReason::PeekLimit))
            }
            PeekMode::Envelope(_) if done && peeked.error.is_some() => {
                return Poll::Ready(Peek::Failed)
            }
            PeekMode::Envelope(_) if done => return Poll::Ready(Peek::Complete),
            PeekMode::Envelope(cap) if peeked.len() > *cap => return Poll::Ready(Peek::TooLarge),
            _ => {}
        }
        match peeked.poll_read(cx) {
            Poll::Ready(Read::End) => {}
            Poll::Ready(Read::Data) => {
                idle.reset();
                if let PeekMode::Sse(scanner) = mode {
                    let frame = peeked.frames.back().expect("a frame was just read");
                    let found =
                        scanner.push(frame, |event| match classifier.classify_sse_event(event) {
                            SseVerdict::Output => Some(None),
                            SseVerdict::Error(c) => Some(Some(c)),
                            _ => None,
                        });
                    match found {
                        Ok(Some(None)) => {
                            return Poll::Ready(Peek::Commit(CommitReason::FirstOutput))
                        }
                        Ok(Some(Some(c))) => return Poll::Ready(Peek::SseError(c)),
                        Ok(None) => {}
                        Err(ScanError::TooLong) => {
                            return Poll::Ready(Peek::Commit(CommitReason::PeekLimit))
                        }
                    }
                }
            }
            Poll::Pending => {
                ready!(idle.poll_idle(cx));
                // The body stalled. An error body is judged on what came; a stream or an
                // envelope failed, and its caller (if it gets it) sees an idle timeout.
                if let PeekMode::ErrorBody = mode {
                    return Poll::Ready(Peek::ErrorBody);
                }
                peeked.rest = None;
                peeked.error = Some(Box::new(idle.error()));
                return Poll::Ready(Peek::Failed);
            }
        }
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

impl<S, C> Ctx<S, C>
where
    S: Service<Request<ReplayBody>>,
    C: Classify,
{
    fn policy(&self) -> &RetryPolicy {
        self.policy_override
            .as_deref()
            .unwrap_or(&self.config.policy)
    }

    fn is_cancelled(&self) -> bool {
        self.config
            .cancel
            .as_ref()
            .is_some_and(|t| t.is_cancelled())
    }

    fn cancelled(&mut self) -> Error {
        self.trail.set_gave_up(GiveUpReason::Cancelled);
        Error::new(ErrorKind::Cancelled).with_trail(self.finished_trail())
    }

    /// Whether the request's deadline has passed: no attempt may start.
    fn deadline_passed(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The error for a request whose deadline passed, or would pass, before its next attempt
    /// could start.
    fn deadline_exceeded(&mut self) -> Error {
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

    /// The error for a wait that ended before its time.
    fn stopped(&mut self, stop: Stop) -> Error {
        match stop {
            Stop::Cancelled => self.cancelled(),
            Stop::Deadline => self.deadline_exceeded(),
        }
    }

    /// What a wait watches besides its own end.
    fn watch(&self) -> Watch {
        Watch {
            cancel: self.cancel_wait(),
            deadline: self.deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
        }
    }

    /// Fleet: the state this request shares, its scope's or the layer's.
    fn fleet(&self) -> &Fleet {
        self.scoped.as_ref().unwrap_or(&self.config.fleet)
    }

    /// Fleet: tells the pacing how the attempt that had a turn ended.
    fn pacing_feedback(&mut self, c: &Classification) {
        let Some(epoch) = self.paced.take() else {
            return;
        };
        if c.is_success() {
            self.fleet().paced_success();
        } else if matches!(
            c.class(),
            Some(FailureClass::RateLimited | FailureClass::Overloaded)
        ) {
            // A refusal for load slows the pacing.
            self.fleet().paced_refusal(epoch, c.retry_after());
        }
    }

    fn finished_trail(&mut self) -> RetryTrail {
        let mut trail = std::mem::take(&mut self.trail);
        trail.set_total_attempts(self.sent);
        trail
    }

    /// The head timeout of the attempt about to start, cut to the deadline.
    fn head_timeout(&self) -> Option<Duration> {
        let timeout = self.policy().get_head_timeout();
        match self.deadline {
            None => timeout,
            Some(dl) => {
                let left = dl.saturating_duration_since(Instant::now());
                Some(timeout.map_or(left, |t| t.min(left)))
            }
        }
    }

    /// Whether, and how, the start of this response's body must be read before deciding.
    /// `sse`: whether the response is an event stream.
    fn peek_mode(
        &self,
        head: &http::response::Parts,
        sse: bool,
        asks: Option<&Asks>,
    ) -> Option<PeekMode> {
        if self.config.classifier.wants_body(head) || asks.is_some_and(|a| a.wants_body(head)) {
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

    fn start_attempt<F, B, R>(&mut self) -> State<F, B, R>
    where
        S: Service<Request<ReplayBody>, Future = F>,
        B: Body,
        B::Error: Into<BoxError>,
    {
        // A companion's re-send is the same attempt: not counted, paid or admitted again. A
        // re-send HTTP/2 proved never processed is the same attempt too, though a send of
        // its own: counted as sent, neither paid nor admitted again.
        let proof = std::mem::take(&mut self.transparent_next);
        if !std::mem::take(&mut self.resend_next) {
            self.sent += 1;
            // Fleet: first attempts pay into the shared retry budget.
            if self.retries == 0 && !proof {
                self.fleet().deposit();
            }
            if !proof {
                self.gate_passed = false;
            }
        }
        let last = self.one_shot || self.retries >= self.policy().get_max_retries();
        self.kept = !last;
        // The first attempt sends the caller's own request. A copy is kept while a retry can
        // follow, and on the last attempt too, for a companion layer's re-send.
        let (mut parts, body) = self.held.send(!self.one_shot).into_parts();
        let carries = self
            .carried
            .as_deref()
            .is_some_and(|c| *c != Carried::default());
        self.attempt_head_timeout = self.head_timeout();
        parts.extensions.insert(AttemptContext {
            attempt: self.retries + 1,
            previous: self.previous,
            consecutive_overloads: self.consecutive_overloads,
            max_retries: self.policy().get_max_retries(),
            carries,
            retry_after_max: self.policy().get_retry_after_max(),
            head_timeout: self.attempt_head_timeout,
        });
        if carries {
            parts
                .extensions
                .insert(self.carried.as_deref().cloned().unwrap_or_default());
        }
        if let Some(name) = &self.config.retry_count_header {
            parts
                .headers
                .insert(name.clone(), HeaderValue::from(self.retries));
        }
        let span = tracing::debug_span!(
            "llm_retry.attempt",
            "otel.kind" = "client",
            "http.request.method" = %parts.method,
            "server.address" = parts.uri.host().unwrap_or(""),
            "http.request.resend_count" = tracing::field::Empty,
            "http.response.status_code" = tracing::field::Empty,
            "error.type" = tracing::field::Empty,
            "gen_ai.request.model" = tracing::field::Empty,
        );
        if !span.is_disabled() {
            if self.retries > 0 {
                span.record("http.request.resend_count", self.retries);
            }
            let model = self
                .model
                .get_or_insert_with(|| body.as_bytes().and_then(|b| request_model(b)));
            if let Some(model) = model {
                span.record("gen_ai.request.model", model.as_str());
            }
        }
        let future = {
            let _enter = span.enter();
            self.service.call(Request::from_parts(parts, body))
        };
        State::Calling {
            future,
            timeout: None,
            armed_for: Duration::ZERO,
            span,
        }
    }

    fn sleep<F, B, R>(&mut self, delay: Duration) -> State<F, B, R>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        if self.transparent_next {
            // The same attempt again, at once (the send takes the flag).
            return State::Ready { watch: None };
        }
        self.retries += 1;
        self.transparent_used = false;
        self.resends = 0;
        if let Some(carried) = self.carried.as_mut() {
            carried.next_attempt();
        }
        State::Sleeping {
            sleep: Box::pin(tokio::time::sleep(delay)),
            watch: self.watch(),
        }
    }

    /// The caller's cancellation, as a future to wait on beside a wait of the loop's own.
    fn cancel_wait(&self) -> Option<Pin<Box<WaitForCancellationFutureOwned>>> {
        self.config
            .cancel
            .clone()
            .map(|t| Box::pin(t.cancelled_owned()))
    }

    /// Builds the response handed to the caller, with the trail when any attempt failed.
    fn respond<R>(
        &mut self,
        head: http::response::Parts,
        body: RetryBody<R>,
        verdict: &Verdict,
    ) -> Response<RetryBody<R>> {
        let mut res = Response::from_parts(head, body);
        if matches!(verdict, Verdict::GiveUp(_)) || self.sent > 1 {
            res.extensions_mut().insert(self.finished_trail());
        }
        res
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
            && !self.transparent_used
            && self.kept
            && self.held.can_resend()
            && !self.is_cancelled()
        {
            self.transparent_used = true;
            self.transparent_next = true;
            return Ok(Duration::ZERO);
        }
        if !self.replay_safe && !not_sent {
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
            self.gate_passed = true;
        }
        Ok(delay)
    }

    /// Fleet: the wait before the next attempt, if any: at the cooldown gate while it is
    /// closed, then for a turn of the pacing. A pacing turn taken before the gate closed is
    /// spent: the attempt queues again after the gate, or everyone held would leave it at once.
    ///
    /// A wait that cannot end before the deadline is refused at once.
    fn admit<F, B, R>(&mut self) -> Result<Option<State<F, B, R>>, Stop>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        if let Some(wait) = self.gate_wait()? {
            self.paced = None;
            return Ok(Some(State::Gated {
                wait: Box::pin(wait),
                watch: self.watch(),
            }));
        }
        if self.paced.is_some() {
            return Ok(None);
        }
        let Some(ticket) = self
            .fleet()
            .ticket(self.policy().fleet_limits(), self.deadline)
        else {
            return Ok(None);
        };
        tracing::trace!(rate = self.fleet().pacing_rate(), "joining the pacing line");
        Ok(Some(State::Pacing {
            ticket,
            watch: self.watch(),
        }))
    }

    /// Fleet: the wait at the cooldown gate before the next attempt, if it is closed.
    fn gate_wait(&self) -> Result<Option<GateWait>, Stop> {
        if self.gate_passed {
            return Ok(None);
        }
        GateWait::start(self.fleet(), self.policy().fleet_limits(), self.deadline)
            .map_err(|PastDeadline| Stop::Deadline)
    }

    /// Records a failed attempt: its class, and for the companion layers what else they
    /// decide on (whether it timed out, whether a rate limit had nowhere to wait, how far
    /// down a fallback chain it went).
    fn note_class(
        &mut self,
        class: FailureClass,
        c: &Classification,
        error: Option<&(dyn std::error::Error + 'static)>,
    ) {
        if class == FailureClass::Overloaded {
            self.consecutive_overloads += 1;
        } else {
            self.consecutive_overloads = 0;
        }
        let unwaitable = class == FailureClass::RateLimited
            && (std::mem::take(&mut self.keys_resting)
                || c.retry_after()
                    .is_some_and(|ra| ra > self.policy().get_retry_after_max()));
        self.carried.get_or_insert_default().note_failure(Failed {
            class,
            timed_out: class == FailureClass::Timeout || error.is_some_and(timed_out),
            unwaitable,
            level: self.served_level.take(),
        });
        self.previous = Some(class);
    }

    /// Asks the companion layers' questions about a response. A re-send is granted while a
    /// copy of the request is kept, within [`MAX_COMPANION_RESENDS`] an attempt.
    fn answer(
        &mut self,
        asks: &Asks,
        head: &mut http::response::Parts,
        body: Option<&ErrorBody>,
    ) -> Answer {
        let mut carried = self.carried.as_deref().cloned().unwrap_or_default();
        let judged = asks.judge(head, body, &mut carried);
        self.keys_resting = std::mem::take(&mut carried.keys_resting);
        match judged {
            Judged::Pass => Answer::Go,
            Judged::Step => {
                self.stepped = true;
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
                self.carried = Some(Box::new(carried));
                self.resend_next = true;
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

    /// Ends the request with an inner layer's final error, the trail recording the attempt.
    fn final_error(&mut self, err: Error, status: Option<http::StatusCode>, span: &Span) -> Error {
        let class = final_class(&err).unwrap_or(FailureClass::Other);
        let _ = self.judge(
            &Classification::fail(class),
            status,
            Some(&err),
            false,
            span,
        );
        let trail = self.finished_trail();
        err.with_trail(trail)
    }

    /// Judges one attempt: records a failure, then decides what comes next.
    fn judge(
        &mut self,
        c: &Classification,
        status: Option<http::StatusCode>,
        error: Option<&(dyn std::error::Error + 'static)>,
        not_sent: bool,
        span: &Span,
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
        // A step down a fallback chain leaves the failing target's Retry-After behind.
        let stepped = std::mem::take(&mut self.stepped);
        self.note_class(class, c, error);
        self.trail.push(AttemptRecord {
            attempt: self.retries + 1,
            class,
            status,
            retry_after: c.retry_after(),
            delay: None,
            error: error.map(error_chain),
            elapsed: self.started.elapsed(),
        });
        match self.plan(c, not_sent, stepped) {
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
fn finish_error(kind: ErrorKind, e: BoxError, trail: Option<RetryTrail>) -> Error {
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
                ErrorKind::TokenRefresh => return Some(FailureClass::Unauthorized),
                ErrorKind::FallbackTriggered => return Some(FailureClass::Overloaded),
                _ => {}
            }
        }
        next = e.source();
    }
    None
}

/// Whether an attempt's error says it timed out: no head in time, or a body that stalled
/// before the commit point.
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.downcast_ref::<TimedOut>()
            .is_some_and(|t| matches!(t.kind(), TimeoutKind::Head | TimeoutKind::Idle))
        {
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

/// The top-level `"model"` of a JSON request body, for the tracing span.
fn request_model(body: &[u8]) -> Option<String> {
    crate::json_edit::read_value(body, "model")
}

/// How far down its fallback chain ModelFallbackLayer sent the attempt this response answers.
fn served_level(head: &http::response::Parts) -> Option<u32> {
    head.extensions
        .get::<crate::fallback::ModelUsed>()
        .map(|used| used.level)
}

#[cfg(test)]
mod tests;
