use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::combinators::Collect;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tower_service::Service;
use tracing::Span;

use super::body::{Peeked, RetryBody};
use super::layer::Config;
use super::policy::DelayRefused;
use super::{AttemptContext, NoRetry, NotReplaySafe, RetryEvent, RetryPolicy};
use crate::body::ReplayBody;
use crate::classify::{Classification, Classify, FailureClass};
use crate::error::{
    error_chain, AttemptRecord, BoxError, Error, ErrorKind, GiveUpReason, RetryTrail,
};
use crate::fleet::GateWait;

pub use self::sealed::HttpResponse;

mod sealed {
    /// Splits an `http::Response` so the retry loop can name its body type.
    pub trait HttpResponse {
        /// The body type.
        type Body;
        /// `http::Response::into_parts`.
        fn into_parts(self) -> (http::response::Parts, Self::Body);
    }

    impl<B> HttpResponse for http::Response<B> {
        type Body = B;
        fn into_parts(self) -> (http::response::Parts, B) {
            http::Response::into_parts(self)
        }
    }
}

type ResBodyOf<S> = <<S as Service<Request<ReplayBody>>>::Response as HttpResponse>::Body;

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
        Buffering { #[pin] collect: Collect<Limited<B>> },
        Passthrough { #[pin] future: F },
        Ready,
        Calling { #[pin] future: F, span: Span },
        Peeking { head: Option<http::response::Parts>, peeked: Option<Peeked<R>>, span: Span },
        Sleeping {
            #[pin] sleep: Sleep,
            #[pin] cancel: Option<WaitForCancellationFutureOwned>,
        },
        // Fleet: waiting at the closed cooldown gate before an attempt.
        Gated { #[pin] wait: GateWait },
        Done,
    }
}

struct Ctx<S, C> {
    service: S,
    config: Arc<Config<C>>,
    policy_override: Option<RetryPolicy>,
    parts: Option<http::request::Parts>,
    body: Option<ReplayBody>,
    attempt: u32,
    sent: u32,
    consecutive_overloads: u32,
    previous: Option<FailureClass>,
    replay_safe: bool,
    trail: RetryTrail,
    started: Instant,
    model: Option<Option<String>>,
    // Fleet: this attempt already waited at the gate.
    gate_passed: bool,
}

/// What the loop does after judging an attempt.
enum Next<T> {
    Retry(Duration),
    Finish(T),
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
            State::Passthrough { .. } => "passthrough",
            State::Ready => "ready",
            State::Calling { .. } => "calling",
            State::Peeking { .. } => "peeking",
            State::Sleeping { .. } => "sleeping",
            State::Gated { .. } => "gated",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("attempt", &self.ctx.attempt)
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
    pub(crate) fn new(service: S, config: Arc<Config<C>>, req: Request<B>) -> Self {
        let (parts, body) = req.into_parts();
        let mut policy_override = parts.extensions.get::<RetryPolicy>().cloned();
        if parts.extensions.get::<NoRetry>().is_some() {
            policy_override = Some(
                policy_override
                    .unwrap_or_else(|| config.policy.clone())
                    .max_retries(0),
            );
        }
        let replay_safe = parts.extensions.get::<NotReplaySafe>().is_none();
        let over_cap = body.size_hint().lower() > config.body_limit as u64;
        let mut ctx = Ctx {
            service,
            config,
            policy_override,
            parts: Some(parts),
            body: None,
            attempt: 0,
            sent: 0,
            consecutive_overloads: 0,
            previous: None,
            replay_safe,
            trail: RetryTrail::default(),
            started: Instant::now(),
            model: None,
            gate_passed: false,
        };
        let state = if over_cap {
            // Too big to hold: send it once, as it streams, and never retry it.
            let parts = ctx.parts.take().expect("parts are set above");
            let req =
                Request::from_parts(parts, ReplayBody::streaming(StreamingData { inner: body }));
            State::Passthrough {
                future: ctx.service.call(req),
            }
        } else {
            let limit = ctx.config.body_limit;
            State::Buffering {
                collect: Limited::new(body, limit).collect(),
            }
        };
        ResponseFuture { state, ctx }
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
                StateProj::Buffering { collect } => {
                    let result = ready!(collect.poll(cx));
                    match result {
                        Ok(collected) => {
                            let trailers = collected.trailers().cloned();
                            let data = collected.to_bytes();
                            ctx.body = Some(ReplayBody::buffered(data, trailers));
                            // Fleet: wait at the cooldown gate while it is closed.
                            if let Some(wait) = ctx.gate_wait() {
                                this.state.set(State::Gated { wait });
                                continue;
                            }
                            // The service was polled ready before `call`; the first attempt
                            // uses that readiness.
                            let (future, span) = ctx.start_attempt();
                            this.state.set(State::Calling { future, span });
                        }
                        Err(e) => {
                            this.state.set(State::Done);
                            let kind = if e.is::<LengthLimitError>() {
                                ErrorKind::BodyTooLarge
                            } else {
                                ErrorKind::BodyRead
                            };
                            return Poll::Ready(Err(Error::new(kind).with_source(e)));
                        }
                    }
                }
                StateProj::Passthrough { future } => {
                    let result = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(match result {
                        Ok(res) => Ok(res.map(RetryBody::plain)),
                        Err(e) => Err(Error::new(ErrorKind::Service).with_source(e)),
                    });
                }
                StateProj::Ready => {
                    if ctx.is_cancelled() {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.cancelled()));
                    }
                    // Fleet: wait at the cooldown gate while it is closed.
                    if let Some(wait) = ctx.gate_wait() {
                        this.state.set(State::Gated { wait });
                        continue;
                    }
                    if let Err(e) = ready!(ctx.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        let err = Error::new(ErrorKind::Service)
                            .with_source(e)
                            .with_trail(ctx.finished_trail());
                        return Poll::Ready(Err(err));
                    }
                    let (future, span) = ctx.start_attempt();
                    this.state.set(State::Calling { future, span });
                }
                StateProj::Calling { future, span } => {
                    let result = {
                        let _enter = span.enter();
                        ready!(future.poll(cx))
                    };
                    let span = std::mem::replace(span, Span::none());
                    match result {
                        Ok(res) => {
                            let (head, body) = res.into_parts();
                            span.record("http.response.status_code", head.status.as_u16());
                            if ctx.config.classifier.wants_body(&head) {
                                this.state.set(State::Peeking {
                                    head: Some(head),
                                    peeked: Some(Peeked::new(body)),
                                    span,
                                });
                                continue;
                            }
                            let c = ctx.config.classifier.classify_response(&head, None);
                            match ctx.judge_response(&head, c, &span) {
                                Next::Retry(delay) => {
                                    drop(body);
                                    let state = ctx.sleep(delay);
                                    this.state.set(state);
                                }
                                Next::Cancel => {
                                    this.state.set(State::Done);
                                    return Poll::Ready(Err(ctx.cancelled()));
                                }
                                Next::Finish(trail) => {
                                    this.state.set(State::Done);
                                    let mut res =
                                        Response::from_parts(head, RetryBody::plain(body));
                                    if let Some(trail) = trail {
                                        res.extensions_mut().insert(trail);
                                    }
                                    return Poll::Ready(Ok(res));
                                }
                            }
                        }
                        Err(e) => {
                            let e: BoxError = e.into();
                            match ctx.judge_error(&*e, &span) {
                                Next::Retry(delay) => {
                                    let state = ctx.sleep(delay);
                                    this.state.set(state);
                                }
                                Next::Cancel => {
                                    this.state.set(State::Done);
                                    return Poll::Ready(Err(ctx.cancelled().with_source(e)));
                                }
                                Next::Finish(kind) => {
                                    this.state.set(State::Done);
                                    let err = Error::new(kind)
                                        .with_source(e)
                                        .with_trail(ctx.finished_trail());
                                    return Poll::Ready(Err(err));
                                }
                            }
                        }
                    }
                }
                StateProj::Peeking { head, peeked, span } => {
                    let limit = ctx.config.peek_limit;
                    ready!(peeked
                        .as_mut()
                        .expect("peek state holds the body")
                        .poll_fill(cx, limit));
                    let head = head.take().expect("peek state holds the head");
                    let peeked = peeked.take().expect("peek state holds the body");
                    let span = std::mem::replace(span, Span::none());
                    let c = ctx
                        .config
                        .classifier
                        .classify_response(&head, Some(&peeked.contiguous()));
                    match ctx.judge_response(&head, c, &span) {
                        Next::Retry(delay) => {
                            drop(peeked);
                            let state = ctx.sleep(delay);
                            this.state.set(state);
                        }
                        Next::Cancel => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.cancelled()));
                        }
                        Next::Finish(trail) => {
                            this.state.set(State::Done);
                            let mut res = Response::from_parts(head, RetryBody::peeked(peeked));
                            if let Some(trail) = trail {
                                res.extensions_mut().insert(trail);
                            }
                            return Poll::Ready(Ok(res));
                        }
                    }
                }
                StateProj::Sleeping { sleep, cancel } => {
                    if let Some(cancel) = cancel.as_pin_mut() {
                        if cancel.poll(cx).is_ready() {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(ctx.cancelled()));
                        }
                    }
                    ready!(sleep.poll(cx));
                    this.state.set(State::Ready);
                }
                // Fleet: the gate reopened (or this request's wait is over); go through Ready
                // to poll the service ready after the wait.
                StateProj::Gated { wait } => {
                    if ready!(wait.poll(cx)).is_err() {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(ctx.cancelled()));
                    }
                    ctx.gate_passed = true;
                    this.state.set(State::Ready);
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S, C> Ctx<S, C>
where
    S: Service<Request<ReplayBody>>,
    C: Classify,
{
    fn policy(&self) -> &RetryPolicy {
        self.policy_override.as_ref().unwrap_or(&self.config.policy)
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

    fn finished_trail(&mut self) -> RetryTrail {
        let mut trail = std::mem::take(&mut self.trail);
        trail.set_total_attempts(self.sent);
        trail
    }

    fn start_attempt(&mut self) -> (S::Future, Span) {
        self.sent += 1;
        // Fleet: first attempts pay into the shared retry budget.
        if self.attempt == 0 {
            self.config.fleet.deposit();
        }
        self.gate_passed = false;
        let last = self.attempt >= self.policy().get_max_retries();
        let (mut parts, body) = if last {
            // No retry can follow, so the stored request need not be kept.
            (
                self.parts
                    .take()
                    .expect("request head is kept until the last attempt"),
                self.body
                    .take()
                    .expect("body is kept until the last attempt"),
            )
        } else {
            let body = self
                .body
                .as_ref()
                .and_then(ReplayBody::try_clone)
                .expect("a buffered body can be cloned");
            (
                self.parts
                    .clone()
                    .expect("request head is kept until the last attempt"),
                body,
            )
        };
        parts.extensions.insert(AttemptContext {
            attempt: self.attempt,
            previous: self.previous,
            consecutive_overloads: self.consecutive_overloads,
            max_retries: self.policy().get_max_retries(),
        });
        if let Some(name) = &self.config.attempt_header {
            parts
                .headers
                .insert(name.clone(), HeaderValue::from(self.attempt));
        }
        let span = tracing::debug_span!(
            "llm_retry.attempt",
            "http.request.method" = %parts.method,
            "server.address" = parts.uri.host().unwrap_or(""),
            "http.request.resend_count" = tracing::field::Empty,
            "http.response.status_code" = tracing::field::Empty,
            "error.type" = tracing::field::Empty,
            "gen_ai.request.model" = tracing::field::Empty,
        );
        if !span.is_disabled() {
            if self.attempt > 0 {
                span.record("http.request.resend_count", self.attempt);
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
        (future, span)
    }

    fn sleep<F, B, R>(&mut self, delay: Duration) -> State<F, B, R>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        self.attempt += 1;
        State::Sleeping {
            sleep: tokio::time::sleep(delay),
            cancel: self.config.cancel.clone().map(|t| t.cancelled_owned()),
        }
    }

    fn record(
        &mut self,
        c: &Classification,
        status: Option<http::StatusCode>,
        error: Option<String>,
    ) {
        let class = c.class().unwrap_or(FailureClass::Other);
        self.trail.push(AttemptRecord {
            attempt: self.attempt,
            class,
            status,
            retry_after: c.retry_after(),
            delay: None,
            error,
            elapsed: self.started.elapsed(),
        });
    }

    /// Decides between a retry (and its sleep) and giving up, for a failed attempt.
    fn plan(&mut self, c: &Classification, not_sent: bool) -> Result<Duration, GiveUpReason> {
        if !c.is_retryable() {
            return Err(GiveUpReason::NotRetryable);
        }
        if !self.replay_safe && !not_sent {
            return Err(GiveUpReason::NotReplaySafe);
        }
        let policy = self.policy();
        if self.attempt >= policy.get_max_retries() {
            return Err(GiveUpReason::MaxRetries);
        }
        if let Some(limit) = policy.get_max_consecutive_overloads() {
            if self.consecutive_overloads >= limit {
                return Err(GiveUpReason::MaxConsecutiveOverloads);
            }
        }
        if self.is_cancelled() {
            return Err(GiveUpReason::Cancelled);
        }
        let delay = match policy.delay(self.attempt + 1, c.retry_after()) {
            Ok(d) => d,
            Err(DelayRefused::RetryAfterTooLong) => return Err(GiveUpReason::RetryAfterTooLong),
        };
        // Fleet: the shared retry budget has the last word.
        if !self.config.fleet.withdraw() {
            return Err(GiveUpReason::Budget);
        }
        Ok(delay)
    }

    /// Fleet: the wait at the cooldown gate before the next attempt, if it is closed.
    fn gate_wait(&self) -> Option<GateWait> {
        if self.gate_passed {
            return None;
        }
        GateWait::start(
            &self.config.fleet,
            self.policy(),
            self.config.cancel.as_ref(),
        )
    }

    fn note_class(&mut self, class: Option<FailureClass>) {
        if class == Some(FailureClass::Overloaded) {
            self.consecutive_overloads += 1;
        } else {
            self.consecutive_overloads = 0;
        }
        self.previous = class;
    }

    fn judge_response(
        &mut self,
        head: &http::response::Parts,
        c: Classification,
        span: &Span,
    ) -> Next<Option<RetryTrail>> {
        // Fleet: a Retry-After or exhausted rate-limit headers may close the gate.
        self.config
            .fleet
            .observe(head, c.retry_after(), self.policy());
        if c.is_success() {
            if self.attempt > 0 {
                if let Some(observer) = &self.config.observer {
                    observer.on_recovered(self.attempt + 1);
                }
                tracing::debug!(parent: span, attempts = self.attempt + 1, "LLM request recovered");
                return Next::Finish(Some(self.finished_trail()));
            }
            return Next::Finish(None);
        }
        let class = c.class().unwrap_or(FailureClass::Other);
        span.record("error.type", class.as_str());
        self.note_class(c.class());
        self.record(&c, Some(head.status), None);
        match self.plan(&c, false) {
            Ok(delay) => {
                self.announce_retry(&c, Some(head.status), None, delay, span);
                Next::Retry(delay)
            }
            Err(GiveUpReason::Cancelled) => Next::Cancel,
            Err(reason) => {
                self.give_up(&c, reason, span);
                Next::Finish(Some(self.finished_trail()))
            }
        }
    }

    fn judge_error(
        &mut self,
        error: &(dyn std::error::Error + 'static),
        span: &Span,
    ) -> Next<ErrorKind> {
        let classifier = &self.config.classifier;
        let c = classifier.classify_error(error);
        let not_sent = classifier.request_not_sent(error);
        let class = c.class().unwrap_or(FailureClass::Transport);
        span.record("error.type", class.as_str());
        self.note_class(Some(class));
        self.record(&c, None, Some(error_chain(error)));
        match self.plan(&c, not_sent) {
            Ok(delay) => {
                self.announce_retry(&c, None, Some(error), delay, span);
                Next::Retry(delay)
            }
            Err(GiveUpReason::Cancelled) => Next::Cancel,
            Err(reason) => {
                self.give_up(&c, reason, span);
                Next::Finish(match reason {
                    GiveUpReason::MaxRetries
                    | GiveUpReason::RetryAfterTooLong
                    | GiveUpReason::MaxConsecutiveOverloads => ErrorKind::Exhausted,
                    GiveUpReason::Budget => ErrorKind::BudgetExhausted,
                    _ => ErrorKind::Service,
                })
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
            attempt = self.attempt,
            "error.type" = class.as_str(),
            status = status.map(|s| s.as_u16()),
            delay_ms = delay.as_millis() as u64,
            max_retries,
            "retrying LLM request"
        );
        if let Some(observer) = &self.config.observer {
            observer.on_retry(&RetryEvent {
                attempt: self.attempt,
                retry: self.attempt + 1,
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
        if c.is_retryable() || self.attempt > 0 {
            let class = c.class().unwrap_or(FailureClass::Other);
            tracing::warn!(
                parent: span,
                attempts = self.attempt + 1,
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

/// The top-level `"model"` of a JSON request body, for the tracing span.
fn request_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Model {
        model: Option<String>,
    }
    serde_json::from_slice::<Model>(body).ok()?.model
}

pin_project! {
    /// Adapts a caller's body to `Bytes` data and boxed errors for the pass-through path.
    struct StreamingData<B> {
        #[pin]
        inner: B,
    }
}

impl<B> Body for StreamingData<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        use bytes::Buf;
        self.project().inner.poll_frame(cx).map(|f| {
            f.map(|r| {
                r.map(|frame| frame.map_data(|mut d| d.copy_to_bytes(d.remaining())))
                    .map_err(Into::into)
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
