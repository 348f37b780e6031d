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

use super::decide::{finish_error, Ctx, Gate, Next, NextSend, Proof, Resend};
use super::layer::Config;
use super::peek::{poll_peek, Peek, PeekState, Reply};
use super::NotReplaySafe;
use crate::body::{Held, PrepareBody, ReplayBody};
use crate::classify::Classify;
use crate::error::{BoxError, Error, ErrorKind, RetryTrail, TimedOut, TimeoutKind};
use crate::fleet::{Cost, GateWait, PastDeadline, Ticket, TokenTicket};
use crate::pipeline::body::{IdleTimer, Peeked, RetryBody};
use crate::pipeline::{AttemptContext, HttpResponse, Link, ResBodyOf, Said};
use crate::stream::is_event_stream;

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
    pub(super) enum State<F, B, R>
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
        Peeking { peek: Option<Box<PeekState<R>>> },
        Sleeping {
            sleep: Pin<Box<Sleep>>,
            watch: Watch,
        },
        // Fleet: waiting at the closed cooldown gate before an attempt.
        Gated { wait: Pin<Box<GateWait>>, watch: Watch },
        // Fleet: waiting for this attempt's tokens, in line.
        Tokens {
            ticket: Box<TokenTicket>,
            watch: Watch,
        },
        // Fleet: waiting for this attempt's turn of the adaptive pacing.
        Pacing {
            ticket: Ticket,
            watch: Watch,
        },
        Done,
    }
}

/// Moves the loop to what a decision says, returning when the request ends. A macro, so
/// that the response goes from the decision to the caller without a copy in between.
macro_rules! go {
    ($state:expr, $ctx:expr, $next:expr) => {
        match $next {
            Next::Respond(res) => return Poll::Ready(Ok(res)),
            Next::Fail(e) => return Poll::Ready(Err(e)),
            Next::Sleep(delay) => {
                let state = $ctx.sleep(delay);
                $state.set(state);
            }
            Next::Resend => $state.set(State::Ready { watch: None }),
        }
    };
}

/// What every wait of the loop also watches: the caller's cancellation and the request's
/// deadline. Both are armed only when the loop has to wait, off the success path.
pub(super) struct Watch {
    cancel: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    deadline: Option<Pin<Box<Sleep>>>,
}

/// Why a wait ended before its time.
pub(super) enum Stop {
    Cancelled,
    Deadline,
    /// The fleet fails closed, and cannot reach its shared state.
    #[cfg(feature = "fleet-redis")]
    Unreachable,
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
            State::Tokens { .. } => "tokens",
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
    /// `link`: the handle its sends share with the companion layers, when the service has
    /// one to give; else it takes one at its first send.
    #[inline]
    pub(crate) fn new(
        service: S,
        config: Arc<Config<C>>,
        req: Request<B>,
        link: Option<Link>,
    ) -> Self {
        let (parts, body) = req.into_parts();
        let policy_override = super::policy::per_request(&parts.extensions, &config.policy);
        let resend = match parts.extensions.get::<NotReplaySafe>() {
            None => Resend::Any,
            Some(_) => Resend::IfNotSent,
        };
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
                resend,
                next: NextSend::Attempt,
                proof: Proof::Unused,
                trail: RetryTrail::default(),
                started,
                deadline,
                model: None,
                gate: Gate::Wait,
                paced: None,
                link,
                resends: 0,
                attempt_head_timeout: None,
                sent_at: started,
                scoped,
                tokens: None,
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
                        if !body.is_replayable() {
                            ctx.resend = Resend::Never;
                        }
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
                        let admission = match ctx.next {
                            NextSend::Attempt => ctx.admit(),
                            NextSend::Unprocessed | NextSend::Companion => Ok(None),
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
                    let span = std::mem::replace(span, Span::none());
                    // The attempt is over: its future goes (and with it the companions' hold
                    // on the link), then what they left on the link is read.
                    this.state.set(State::Done);
                    let said = ctx.link.as_ref().map(Link::take_said).unwrap_or_default();
                    let next = match result {
                        Err(e) => ctx.decide_error(e, said, span),
                        Ok(res) => {
                            let (head, body) = res.into_parts();
                            span.record("http.response.status_code", head.status.as_u16());
                            let sse = is_event_stream(&head);
                            match ctx.peek_mode(&head, sse, &said) {
                                Some(mode) => {
                                    let peek = ctx.peek(head, body, mode, said, span);
                                    this.state.set(State::Peeking { peek: Some(peek) });
                                    continue;
                                }
                                // A response that need not be read is a read of zero bytes.
                                None => ctx.decide(
                                    head,
                                    Reply::Untouched { body, sse },
                                    None,
                                    Peek::Head,
                                    said,
                                    span,
                                ),
                            }
                        }
                    };
                    go!(this.state, ctx, next);
                }
                StateProj::Peeking { peek } => {
                    let read = &mut **peek.as_mut().expect("peek state holds the read");
                    // A body that stalls after its head does not hold the request past its
                    // deadline: the attempt is recorded as it stands, and the request ends.
                    let cut = read
                        .deadline
                        .as_mut()
                        .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                    let outcome = match cut {
                        true => Peek::CutByDeadline,
                        false => match poll_peek(
                            read.peeked.as_mut().expect("peek state holds the body"),
                            &mut read.mode,
                            &mut read.idle,
                            ctx.config.peek_limit,
                            ctx.config.stream_end_check,
                            &ctx.config.classifier,
                            cx,
                        ) {
                            Poll::Ready(outcome) => outcome,
                            // Output that is ready wins over a first-output timeout that
                            // fired at the same time.
                            Poll::Pending if read.poll_first_output(cx) => Peek::NoOutput,
                            Poll::Pending => return Poll::Pending,
                        },
                    };
                    let mut peek = peek.take().expect("peek state holds the read");
                    let head = peek.head.take().expect("peek state holds the head");
                    let mode = std::mem::replace(&mut peek.mode, super::peek::PeekMode::ErrorBody);
                    let said = std::mem::take(&mut peek.said);
                    let span = std::mem::replace(&mut peek.span, Span::none());
                    this.state.set(State::Done);
                    // The read goes on boxed: the body and its timer are taken out only for
                    // the caller's body.
                    let reply = Reply::Peeked(peek);
                    let next = ctx.decide(head, reply, Some(mode), outcome, said, span);
                    go!(this.state, ctx, next);
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
                    ctx.gate = Gate::Passed;
                    this.state.set(State::Ready { watch: None });
                }
                // Fleet: this attempt's tokens were taken; go through Ready for its pacing
                // turn and to poll the service ready.
                StateProj::Tokens { ticket, watch } => {
                    if let Poll::Ready(stop) = watch.poll(cx) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.stopped(stop)));
                    }
                    match ready!(ticket.poll_turn(cx)) {
                        Ok(waited) => {
                            ctx.tokens.get_or_insert_with(Default::default).charged =
                                Some(ticket.cost());
                            if !waited.is_zero() {
                                ctx.trail.add_token_wait(waited);
                            }
                            this.state.set(State::Ready { watch: None });
                        }
                        Err(refused) if refused.by_deadline() => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.deadline_exceeded()));
                        }
                        Err(refused) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.pacing_wait_too_long(refused)));
                        }
                    }
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
                            return Poll::Ready(Err(ctx.pacing_wait_too_long(refused)));
                        }
                    }
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// The transitions of the loop: from a decision to the next state, and into each wait.
impl<S, C> Ctx<S, C>
where
    S: Service<Request<ReplayBody>>,
    C: Classify,
{
    /// The state that reads the start of a response's body before deciding.
    fn peek<R>(
        &self,
        head: http::response::Parts,
        body: R,
        mode: super::peek::PeekMode,
        said: Said,
        span: Span,
    ) -> Box<PeekState<R>> {
        // The first-output clock starts at the head, for event streams only.
        let first_output = match mode {
            super::peek::PeekMode::Sse(_) => self
                .policy()
                .get_first_output_timeout()
                .map(|d| (Box::pin(tokio::time::sleep(d)), d)),
            _ => None,
        };
        Box::new(PeekState {
            head: Some(head),
            peeked: Some(Peeked::new(body)),
            mode,
            said,
            idle: IdleTimer::new(self.policy().get_idle_timeout()),
            deadline: self.deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            first_output,
            span,
        })
    }

    /// The error for a wait that ended before its time.
    fn stopped(&mut self, stop: Stop) -> Error {
        match stop {
            Stop::Cancelled => self.cancelled(),
            Stop::Deadline => self.deadline_exceeded(),
            #[cfg(feature = "fleet-redis")]
            Stop::Unreachable => {
                Error::new(ErrorKind::FleetUnreachable).with_trail(self.finished_trail())
            }
        }
    }

    /// What a wait watches besides its own end.
    fn watch(&self) -> Watch {
        Watch {
            cancel: self.cancel_wait(),
            deadline: self.deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
        }
    }

    /// The caller's cancellation, as a future to wait on beside a wait of the loop's own.
    fn cancel_wait(&self) -> Option<Pin<Box<WaitForCancellationFutureOwned>>> {
        self.config
            .cancel
            .clone()
            .map(|t| Box::pin(t.cancelled_owned()))
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

    fn start_attempt<B, R>(&mut self) -> State<S::Future, B, R>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        // A companion's re-send is the same attempt: not counted, paid or admitted again. A
        // re-send HTTP/2 proved never processed is the same attempt too, though a send of
        // its own: counted as sent, neither paid nor admitted again.
        match std::mem::replace(&mut self.next, NextSend::Attempt) {
            NextSend::Attempt => {
                self.sent += 1;
                // Fleet: first attempts pay into the shared retry budget.
                if self.retries == 0 {
                    self.fleet().deposit();
                }
                self.gate = Gate::Wait;
            }
            NextSend::Unprocessed => self.sent += 1,
            NextSend::Companion => {}
        }
        // The first attempt sends the caller's own request. A copy is kept while a retry can
        // follow, and on the last attempt too, for a companion layer's re-send.
        let (mut parts, body) = self.held.send(self.resend != Resend::Never).into_parts();
        self.attempt_head_timeout = self.head_timeout();
        self.sent_at = Instant::now();
        // What the companions said of the last send was taken when it ended.
        let links = &self.config.links;
        let link = self.link.get_or_insert_with(|| links.take()).clone();
        parts.extensions.insert(AttemptContext {
            attempt: self.retries + 1,
            previous: self.previous,
            consecutive_overloads: self.consecutive_overloads,
            max_retries: self.policy().get_max_retries(),
            head_timeout: self.attempt_head_timeout,
            link: Some(link),
        });
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

    fn sleep<B, R>(&mut self, delay: Duration) -> State<S::Future, B, R>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        if self.next == NextSend::Unprocessed {
            // The same attempt again, at once (the send takes it).
            return State::Ready { watch: None };
        }
        self.retries += 1;
        self.proof = Proof::Unused;
        self.resends = 0;
        if let Some(link) = self.link.as_mut() {
            let carried = link.carried();
            if carried.refreshed || carried.rotations > 0 {
                link.carried_mut().next_attempt();
            }
        }
        State::Sleeping {
            sleep: Box::pin(tokio::time::sleep(delay)),
            watch: self.watch(),
        }
    }

    /// Fleet: the wait before the next attempt, if any: at the cooldown gate while it is
    /// closed, then for a turn of the pacing. A pacing turn taken before the gate closed is
    /// spent: the attempt queues again after the gate, or everyone held would leave it at once.
    ///
    /// A wait that cannot end before the deadline is refused at once.
    fn admit<B, R>(&mut self) -> Result<Option<State<S::Future, B, R>>, Stop>
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
        // After the gate, which waits for the first read of the shared state.
        #[cfg(feature = "fleet-redis")]
        if !self.fleet().admits() {
            return Err(Stop::Unreachable);
        }
        if self.paced.is_some() {
            return Ok(None);
        }
        // Tokens first, then the request's turn: a turn is not spent waiting for tokens.
        let fleet = self.scoped.as_ref().unwrap_or(&self.config.fleet);
        if fleet.tokens_awake() && self.tokens.as_ref().is_none_or(|t| t.charged.is_none()) {
            let tokens = self.tokens.get_or_insert_with(Default::default);
            let (held, cost) = (&self.held, &mut tokens.cost);
            let limits = match &self.policy_override {
                Some(p) => p.fleet_limits(),
                None => self.config.policy.fleet_limits(),
            };
            let ticket = fleet.token_ticket(
                |counter| *cost.get_or_insert_with(|| Cost::of_request(held.bytes(), counter)),
                limits,
                self.deadline,
            );
            if let Some(ticket) = ticket {
                return Ok(Some(State::Tokens {
                    ticket: Box::new(ticket),
                    watch: self.watch(),
                }));
            }
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
        if self.gate == Gate::Passed {
            return Ok(None);
        }
        GateWait::start(self.fleet(), self.policy().fleet_limits(), self.deadline)
            .map_err(|PastDeadline| Stop::Deadline)
    }
}

/// The top-level `"model"` of a JSON request body, for the tracing span.
fn request_model(body: &[u8]) -> Option<String> {
    crate::json_edit::read_value(body, "model")
}

#[cfg(test)]
mod tests;
