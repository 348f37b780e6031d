use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, SystemTime};

use http::{Request, Response, Uri};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use super::circuit::Admit;
use super::layer::{Config, Counted, Streak};
use super::{FallbackMode, ModelUsed, TargetAttempts};
use crate::auth::TargetCredential;
use crate::body::{as_replay_body, PrepareBody, ReplayBody};
use crate::classify::headers::parse_retry_after;
use crate::classify::{is_overloaded, overloaded_by, FailureClass};
use crate::error::{BoxError, Error, ErrorKind, FallbackTriggered};
use crate::json_edit;
use crate::overflow::OverflowRepaired;
use crate::pipeline::body::{IdleTimer, PeekHead};
use crate::pipeline::{Asks, Carried, Failed, Inside, Judge, Judged};
use crate::pipeline::{AtLevel, AttemptContext, HttpResponse, RetryBody};
use crate::provider::error_body::{BodySignal, ErrorBody};

use crate::pipeline::ResBodyOf;

pin_project! {
    /// The response future of [`ModelFallback`](super::ModelFallback).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<ReplayBody>>,
        S::Response: HttpResponse,
        B: Body,
        B::Error: Into<BoxError>,
    {
        #[pin]
        kind: Kind<S, B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<S, B>
    where
        S: Service<Request<ReplayBody>>,
        S::Response: HttpResponse,
        B: Body,
        B::Error: Into<BoxError>,
    {
        // Inside a retry loop: the model planned, one send, and a question to the loop about
        // an error response.
        Loop { #[pin] future: S::Future, planner: Planner },
        // On its own: it buffers the body and reads error bodies itself.
        Alone { future: Pin<Box<Alone<S, B>>> },
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    #[inline]
    pub(crate) fn new(mut service: S, config: Arc<Config>, req: Request<B>) -> Self {
        let (mut parts, body) = req.into_parts();
        let ctx = parts.extensions.get::<AttemptContext>().copied();
        let overloads = match ctx {
            Some(c) => c.consecutive_overloads,
            None => {
                config.state.warn_outside_once();
                0
            }
        };
        let mut planner = Planner {
            config,
            overloads,
            inside: None,
            plan: None,
            span: Span::none(),
        };
        let prepare = match (Inside::of(&parts), as_replay_body(body)) {
            (Inside::Loop(carried), Ok(body)) => {
                let ctx = ctx.unwrap_or_default();
                planner.inside = Some(InLoop {
                    failures: carried.failures,
                    retry_after_max: ctx.retry_after_max,
                    head_timeout: ctx.head_timeout,
                });
                let body = planner.plan(&mut parts, body);
                let future = {
                    let _enter = planner.span.enter();
                    // The service was polled ready before `call`.
                    service.call(crate::body::request(parts, body))
                };
                return ResponseFuture {
                    kind: Kind::Loop { future, planner },
                };
            }
            (_, Ok(body)) => PrepareBody::replay(body),
            (_, Err(body)) => PrepareBody::read(body, planner.config.body_limit),
        };
        let alone = Alone {
            state: State::Preparing { prepare },
            ctx: Ctx {
                service,
                parts: Some(parts),
                p: planner,
            },
        };
        ResponseFuture {
            kind: Kind::Alone {
                future: Box::pin(alone),
            },
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response<RetryBody<ResBody>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Loop { future, planner } => {
                let result = {
                    let _enter = planner.span.enter();
                    ready!(future.poll(cx))
                };
                let (head, body) = match result {
                    Ok(res) => res.into_parts(),
                    Err(e) => {
                        let e = e.into();
                        // The loop records where the attempt went, so the next one moves on
                        // from there (a circuit may have sent it past its planned target).
                        return Poll::Ready(Err(match planner.failed_without_response(&*e) {
                            Some(level) => Box::new(AtLevel { level, error: e }),
                            None => e,
                        }));
                    }
                };
                let judge = planner.judge_for(&head);
                let mut res = planner.finish(head, RetryBody::plain(body, None), false, None);
                if let (Ok(res), Some(judge)) = (&mut res, judge) {
                    Asks::push(res.extensions_mut(), Arc::new(judge));
                }
                Poll::Ready(res)
            }
            KindProj::Alone { future } => future.as_mut().poll(cx),
        }
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body,
    B::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let planner = match &self.kind {
            Kind::Loop { planner, .. } => planner,
            Kind::Alone { future } => &future.ctx.p,
        };
        f.debug_struct("ResponseFuture")
            .field("model", &planner.plan.as_ref().map(|p| &p.sent))
            .finish_non_exhaustive()
    }
}

pin_project! {
    /// The layer on its own: it buffers the body and reads error bodies itself.
    struct Alone<S, B>
    where
        S: Service<Request<ReplayBody>>,
        S::Response: HttpResponse,
        B: Body,
        B::Error: Into<BoxError>,
    {
        #[pin]
        state: State<S::Future, B, ResBodyOf<S>>,
        ctx: Ctx<S>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, R>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Preparing { #[pin] prepare: PrepareBody<B> },
        Calling { #[pin] future: F },
        Peeking { peek: PeekHead<R> },
        Done,
    }
}

struct Ctx<S> {
    service: S,
    parts: Option<http::request::Parts>,
    p: Planner,
}

/// The target of an attempt, and what the answer means for the next.
struct Planner {
    config: Arc<Config>,
    /// Overloads in a row just before this attempt, from the retry loop.
    overloads: u32,
    /// Inside a retry loop: what the loop carried.
    inside: Option<InLoop>,
    plan: Option<Plan>,
    span: Span,
}

/// Which target this attempt goes to.
struct Plan {
    requested: String,
    sent: String,
    /// How far down the chain `sent` is: 0 for the requested model.
    level: usize,
    /// Where the requested model is in the chain, if it is.
    own: Option<usize>,
    /// How many fallbacks the request has.
    last: usize,
    /// The upstream the request was moved to, if it was.
    upstream: Option<Uri>,
    /// What the target's circuit is still to be told.
    verdict: Verdict,
    /// When the attempt was sent, while a circuit watches the target.
    sent_at: Option<Instant>,
}

impl<S, B, ResBody> Future for Alone<S, B>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response<RetryBody<ResBody>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let ctx = this.ctx;
        loop {
            match this.state.as_mut().project() {
                StateProj::Preparing { prepare } => {
                    let body = match ready!(prepare.poll(cx)) {
                        Ok(body) => body,
                        Err(e) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e.into()));
                        }
                    };
                    let mut parts = ctx
                        .parts
                        .take()
                        .expect("the request head is kept until sent");
                    let body = ctx.p.plan(&mut parts, body);
                    let future = {
                        let _enter = ctx.p.span.enter();
                        ctx.service.call(crate::body::request(parts, body))
                    };
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let result = {
                        let _enter = ctx.p.span.enter();
                        ready!(future.poll(cx))
                    };
                    let (head, body) = match result {
                        Ok(res) => res.into_parts(),
                        Err(e) => {
                            this.state.set(State::Done);
                            let e = e.into();
                            ctx.p.failed_without_response(&*e);
                            return Poll::Ready(Err(e));
                        }
                    };
                    if ctx.p.needs_body(&head) {
                        this.state.set(State::Peeking {
                            peek: PeekHead::new(head, body),
                        });
                        continue;
                    }
                    let overloaded = is_overloaded(head.status, None);
                    this.state.set(State::Done);
                    return Poll::Ready(ctx.p.finish(
                        head,
                        RetryBody::plain(body, None),
                        overloaded,
                        None,
                    ));
                }
                StateProj::Peeking { peek } => {
                    let (head, peeked) = ready!(peek.poll(cx, ctx.p.config.peek_limit));
                    let parsed = ErrorBody::parse(&peeked.contiguous());
                    let overloaded = overloaded_by(head.status, Some(parsed.signal));
                    this.state.set(State::Done);
                    return Poll::Ready(ctx.p.finish(
                        head,
                        RetryBody::peeked(peeked, IdleTimer::new(None)),
                        overloaded,
                        Some(&parsed),
                    ));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// Inside a retry loop: at a trigger, the next attempt goes one target down the chain (the
/// loop carries the failures it is replayed from), the caller is told to switch (signal
/// mode), or, at the end of the chain after overloads, the response goes back without a
/// retry. It also tells the target's circuit how the attempt went.
struct FallbackJudge {
    config: Arc<Config>,
    requested: String,
    sent: String,
    level: usize,
    /// How many fallbacks the request has.
    last: usize,
    next: Option<String>,
    retry_after_max: Duration,
    verdict: Verdict,
    span: Span,
}

impl Judge for FallbackJudge {
    fn wants_body(&self, head: &http::response::Parts) -> bool {
        !is_overloaded(head.status, None)
    }

    fn judge(
        &self,
        head: &mut http::response::Parts,
        body: Option<&ErrorBody>,
        carried: &mut Carried,
    ) -> Judged {
        let triggers = &self.config.triggers;
        let failed = failure_of(
            head,
            body,
            carried.keys_resting,
            self.retry_after_max,
            self.level,
        );
        let (_, mut streak) = triggers.replay(&carried.failures, self.last);
        let counted = match failed {
            Some(f) => triggers.count(&mut streak, &f),
            None => Counted {
                fires: false,
                by_overload: false,
                of_trigger_class: false,
            },
        };
        self.verdict.resolve(counted.of_trigger_class);
        if !counted.fires {
            return Judged::Pass;
        }
        match (self.config.mode, &self.next) {
            (FallbackMode::Signal, Some(next)) => {
                tracing::info!(
                    parent: &self.span,
                    from = self.sent.as_str(),
                    to = next.as_str(),
                    "model overloaded; signalling the caller to fall back"
                );
                let signal = FallbackTriggered::new(self.sent.clone(), next.as_str());
                Judged::Final(Error::new(ErrorKind::FallbackTriggered).with_source(signal))
            }
            (FallbackMode::Rewrite, Some(next)) => {
                if let Some(cooldown) = self.config.sticky {
                    let until = crate::time::after(Instant::now(), cooldown);
                    self.config
                        .state
                        .raise(&self.requested, self.level + 1, until);
                }
                tracing::debug!(
                    parent: &self.span,
                    from = self.sent.as_str(),
                    to = next.as_str(),
                    "error.type" = failed.map_or("", |f| f.class.as_str()),
                    "the next attempt falls back"
                );
                Judged::Step
            }
            (_, None) if counted.by_overload => {
                tracing::warn!(
                    parent: &self.span,
                    model = self.sent.as_str(),
                    requested = self.requested.as_str(),
                    "every model of the fallback chain is overloaded"
                );
                if let Some(used) = head.extensions.get_mut::<ModelUsed>() {
                    used.chain_exhausted = true;
                }
                Judged::Keep
            }
            // Other triggers at the last target: the policy goes on there.
            (_, None) => Judged::Pass,
        }
    }
}

/// The failure an error response is, as the fallback triggers see it; `None` for a response
/// that is no failure.
fn failure_of(
    head: &http::response::Parts,
    body: Option<&ErrorBody>,
    keys_resting: bool,
    retry_after_max: Duration,
    level: usize,
) -> Option<Failed> {
    let class = if overloaded_by(head.status, body.map(|b| b.signal)) {
        FailureClass::Overloaded
    } else if body.is_some_and(|b| b.signal == BodySignal::QuotaExhausted) {
        FailureClass::QuotaExhausted
    } else if body.is_some_and(|b| b.signal == BodySignal::ContextOverflow) {
        FailureClass::ContextOverflow
    } else {
        FailureClass::from_status(head.status)?
    };
    let unwaitable = class == FailureClass::RateLimited
        && (keys_resting
            || parse_retry_after(&head.headers, SystemTime::now())
                .is_some_and(|ra| ra > retry_after_max));
    Some(Failed {
        class,
        timed_out: class == FailureClass::Timeout,
        unwaitable,
        level: Some(level as u32),
    })
}

/// What an attempt tells its target's circuit, once: a probe that ends with no answer frees
/// the probe slot.
struct Verdict {
    config: Arc<Config>,
    /// The target's index in the chain, when a circuit watches it.
    index: Option<usize>,
    probe: bool,
    told: AtomicBool,
}

impl Verdict {
    fn none(config: Arc<Config>) -> Self {
        Verdict {
            config,
            index: None,
            probe: false,
            told: AtomicBool::new(true),
        }
    }

    /// Tells the circuit: a failure of a trigger class, or an answer.
    fn resolve(&self, failure: bool) {
        let Some(i) = self.index else { return };
        if self.told.swap(true, Ordering::AcqRel) {
            return;
        }
        let (Some(circuit), Some(target)) = (&self.config.circuit, self.config.chain.get(i)) else {
            return;
        };
        let state = &self.config.circuits[i];
        if failure {
            state.failed(self.probe, Instant::now(), circuit, &target.model);
        } else {
            state.succeeded(self.probe, &target.model);
        }
    }

    /// Hands the duty on (to the judge that will see the error body).
    fn take(&mut self) -> Verdict {
        let config = self.config.clone();
        std::mem::replace(self, Verdict::none(config))
    }
}

impl Drop for Verdict {
    fn drop(&mut self) {
        if self.probe && !*self.told.get_mut() {
            if let Some(i) = self.index {
                self.config.circuits[i].release_probe();
            }
        }
    }
}

/// What a send inside a retry loop knows from the loop.
struct InLoop {
    /// Every failed attempt of the request so far.
    failures: Vec<Failed>,
    retry_after_max: Duration,
    head_timeout: Option<Duration>,
}

impl Planner {
    /// The target after the one `plan` sends to, if the chain goes on.
    fn next(&self, plan: &Plan) -> Option<&str> {
        let fallbacks = self.config.fallbacks(plan.own);
        fallbacks.get(plan.level).map(|t| t.model.as_str())
    }

    /// The first level at or after `level` whose circuit takes the request now, and whether
    /// as its probe; `level` itself when every circuit is open.
    fn admit(&self, own: Option<usize>, level: usize, last: usize) -> (usize, Verdict) {
        let config = &self.config;
        if config.circuit.is_none() || config.mode == FallbackMode::Signal {
            return (level, Verdict::none(config.clone()));
        }
        let now = Instant::now();
        for l in level..=last {
            let Some(i) = config.index(own, l) else {
                return (l, Verdict::none(config.clone()));
            };
            let probe = match config.circuits[i].admit(now, &config.chain[i].model) {
                Admit::Go => false,
                Admit::Probe => true,
                Admit::Skip => continue,
            };
            let verdict = Verdict {
                config: config.clone(),
                index: Some(i),
                probe,
                told: AtomicBool::new(false),
            };
            return (l, verdict);
        }
        (level, Verdict::none(config.clone()))
    }

    /// Picks the target for this attempt and moves the request to it.
    fn plan(&mut self, parts: &mut http::request::Parts, body: ReplayBody) -> ReplayBody {
        let Some(bytes) = body.as_bytes() else {
            return body;
        };
        let Some(requested) = json_edit::read_value::<String>(bytes, "model") else {
            return body;
        };
        let config = self.config.clone();
        let own = config.own(&requested);
        let fallbacks = config.fallbacks(own);
        let last = fallbacks.len();
        let mut wanted = 0;
        if config.mode == FallbackMode::Rewrite {
            if let Some(inside) = &self.inside {
                wanted = config.triggers.replay(&inside.failures, last).0;
            }
            if config.sticky.is_some() {
                wanted = wanted.max(config.state.level(&requested, Instant::now()));
            }
            wanted = wanted.min(last);
        }
        let (mut level, mut verdict) = self.admit(own, wanted, last);
        let body = match level {
            0 => body,
            l if fallbacks[l - 1].model == requested => body,
            l => match json_edit::replace_value(bytes, "model", &fallbacks[l - 1].model)
                .and_then(|data| body.with_data(data))
            {
                Some(rewritten) => rewritten,
                None => {
                    level = 0;
                    verdict = Verdict::none(config.clone());
                    body
                }
            },
        };
        let sent = match level {
            0 => requested.clone(),
            l => fallbacks[l - 1].model.clone(),
        };
        let target = config.index(own, level).map(|i| &config.chain[i]);
        let mut upstream = None;
        if let Some(target) = target.filter(|t| t.moves_request()) {
            if let Some(up) = &target.upstream {
                if let Some(uri) = up.rewrite(&parts.uri) {
                    parts.uri = uri;
                    if parts.headers.contains_key(http::header::HOST) {
                        if let Some(host) = up.host() {
                            parts.headers.insert(http::header::HOST, host);
                        }
                    }
                    upstream = Some(up.base.clone());
                }
            }
            if let Some(source) = &target.credential {
                parts.extensions.insert(TargetCredential(source.clone()));
            }
        }
        self.span = tracing::debug_span!(
            "llm_fallback",
            "gen_ai.request.model" = sent.as_str(),
            "gen_ai.response.model" = tracing::field::Empty,
        );
        if level > wanted {
            tracing::info!(
                parent: &self.span,
                requested = requested.as_str(),
                to = sent.as_str(),
                skipped = level - wanted,
                "skipping targets whose circuits are open"
            );
        } else if level > 0 {
            tracing::info!(
                parent: &self.span,
                from = requested.as_str(),
                to = sent.as_str(),
                consecutive_overloads = self.overloads,
                "falling back to another model"
            );
        }
        let sent_at = verdict.index.map(|_| Instant::now());
        self.plan = Some(Plan {
            requested,
            sent,
            level,
            own,
            last,
            upstream,
            verdict,
            sent_at,
        });
        body
    }

    /// Whether this attempt's overload would reach the threshold, alone (without a loop,
    /// there are no earlier attempts).
    fn reaches_threshold(&self) -> bool {
        self.config.triggers.overloads == 1
    }

    /// Inside a retry loop: the question about an error response.
    fn judge_for(&mut self, head: &http::response::Parts) -> Option<FallbackJudge> {
        if !(head.status.is_client_error() || head.status.is_server_error()) {
            return None;
        }
        let retry_after_max = self.inside.as_ref()?.retry_after_max;
        let next = self.next(self.plan.as_ref()?).map(str::to_owned);
        let plan = self.plan.as_mut()?;
        Some(FallbackJudge {
            config: self.config.clone(),
            requested: plan.requested.clone(),
            sent: plan.sent.clone(),
            level: plan.level,
            last: plan.last,
            next,
            retry_after_max,
            verdict: plan.verdict.take(),
            span: self.span.clone(),
        })
    }

    /// The attempt failed before a response head: a transport failure of the target, for the
    /// failure trigger's circuit; an inner layer's own final error tells it nothing.
    /// Returns the level the attempt was sent at, when a plan sent it.
    fn failed_without_response(&mut self, e: &(dyn std::error::Error + 'static)) -> Option<u32> {
        let plan = self.plan.take()?;
        let final_error = e.downcast_ref::<Error>().is_some_and(Error::is_final);
        if !final_error {
            plan.verdict
                .resolve(self.config.triggers.failures.is_some());
        }
        Some(plan.level as u32)
    }

    /// Whether the body must be read to tell an overload that matters.
    fn needs_body(&self, head: &http::response::Parts) -> bool {
        self.plan.is_some()
            && (self.reaches_threshold()
                || self
                    .plan
                    .as_ref()
                    .is_some_and(|p| p.verdict.index.is_some()))
            && !is_overloaded(head.status, None)
            && (head.status.is_client_error() || head.status.is_server_error())
    }

    fn finish<R>(
        &mut self,
        head: http::response::Parts,
        body: RetryBody<R>,
        overloaded: bool,
        error_body: Option<&ErrorBody>,
    ) -> Result<Response<RetryBody<R>>, BoxError> {
        let Some(plan) = self.plan.take() else {
            return Ok(Response::from_parts(head, body));
        };
        // On its own, the layer judges the response itself; inside a loop, the judge has the
        // circuit's verdict on an error response, and anything else is an answer.
        if self.inside.is_none() && (head.status.is_client_error() || head.status.is_server_error())
        {
            let failed = match overloaded {
                true => Some(Failed {
                    class: FailureClass::Overloaded,
                    timed_out: false,
                    unwaitable: false,
                    level: None,
                }),
                false => failure_of(&head, error_body, false, Duration::MAX, plan.level),
            };
            let of_trigger_class = failed.is_some_and(|f| {
                self.config
                    .triggers
                    .count(&mut Streak::default(), &f)
                    .of_trigger_class
            });
            plan.verdict.resolve(of_trigger_class);
        } else {
            plan.verdict.resolve(false);
        }
        let mut exhausted = false;
        if overloaded && self.reaches_threshold() {
            let next = self.next(&plan).map(str::to_owned);
            match (self.config.mode, &next) {
                (FallbackMode::Signal, Some(next)) => {
                    tracing::info!(
                        parent: &self.span,
                        from = plan.sent.as_str(),
                        to = next.as_str(),
                        consecutive_overloads = self.overloads + 1,
                        "model overloaded; signalling the caller to fall back"
                    );
                    let signal = FallbackTriggered::new(plan.sent.clone(), next.as_str());
                    return Err(Error::new(ErrorKind::FallbackTriggered)
                        .with_source(signal)
                        .into());
                }
                (FallbackMode::Rewrite, Some(next)) => {
                    if let Some(cooldown) = self.config.sticky {
                        let until = crate::time::after(Instant::now(), cooldown);
                        self.config
                            .state
                            .raise(&plan.requested, plan.level + 1, until);
                    }
                    tracing::debug!(
                        parent: &self.span,
                        from = plan.sent.as_str(),
                        to = next.as_str(),
                        "model overloaded; the next attempt falls back"
                    );
                }
                (_, None) => {
                    exhausted = true;
                    tracing::warn!(
                        parent: &self.span,
                        model = plan.sent.as_str(),
                        requested = plan.requested.as_str(),
                        "every model of the fallback chain is overloaded"
                    );
                }
            }
        }
        self.span
            .record("gen_ai.response.model", plan.sent.as_str());
        let attempts = self.attempts(&plan);
        // A layer inside (ContextOverflowLayer's context-window fallback) may have re-sent
        // the request to another model: the response came from that one.
        let model = match head.extensions.get::<OverflowRepaired>() {
            Some(OverflowRepaired::Model { to, .. }) => to.clone(),
            _ => plan.sent.clone(),
        };
        let mut res = Response::from_parts(head, body);
        res.extensions_mut().insert(ModelUsed {
            model,
            requested: plan.requested.clone(),
            chain_exhausted: exhausted,
            upstream: plan.upstream.clone(),
            attempts,
            level: plan.level as u32,
        });
        Ok(res)
    }

    /// Every target the request went to, with its number of attempts, when it took more than
    /// one attempt; none (no allocation) for a request answered by its first.
    fn attempts(&self, plan: &Plan) -> Vec<TargetAttempts> {
        let Some(inside) = self.inside.as_ref().filter(|i| !i.failures.is_empty()) else {
            return Vec::new();
        };
        let mut out: Vec<TargetAttempts> = Vec::new();
        let fallbacks = self.config.fallbacks(plan.own);
        let mut count = |level: usize| {
            let (model, upstream) = match level {
                0 => {
                    let own = plan.own.map(|i| &self.config.chain[i]);
                    (
                        plan.requested.clone(),
                        own.and_then(|t| t.get_upstream().cloned()),
                    )
                }
                l => {
                    let t = &fallbacks[l - 1];
                    (t.model.clone(), t.get_upstream().cloned())
                }
            };
            match out
                .iter_mut()
                .find(|t| t.model == model && t.upstream == upstream)
            {
                Some(t) => t.attempts += 1,
                None => out.push(TargetAttempts {
                    model,
                    upstream,
                    attempts: 1,
                }),
            }
        };
        self.config
            .triggers
            .replay_each(&inside.failures, plan.last, &mut count);
        count(plan.level);
        out
    }
}

impl Drop for Planner {
    // The loop dropped the attempt in flight: at its head timeout, the target timed out.
    fn drop(&mut self) {
        let (Some(plan), Some(inside)) = (self.plan.take(), self.inside.as_ref()) else {
            return;
        };
        let triggers = &self.config.triggers;
        let (Some(sent_at), Some(timeout)) = (plan.sent_at, inside.head_timeout) else {
            return;
        };
        if (triggers.timeouts.is_some() || triggers.failures.is_some())
            && Instant::now().saturating_duration_since(sent_at) >= timeout
        {
            plan.verdict.resolve(true);
        }
    }
}
