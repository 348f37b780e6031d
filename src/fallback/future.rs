use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use super::layer::Config;
use super::{FallbackMode, ModelUsed};
use crate::body::{as_replay_body, PrepareBody, ReplayBody};
use crate::classify::error_body::ErrorBody;
use crate::classify::{is_overloaded, overloaded_by};
use crate::error::{BoxError, Error, ErrorKind, FallbackTriggered};
use crate::json_edit;
use crate::overflow::OverflowRepaired;
use crate::pipeline::{Asks, Carried, Inside, Judge, Judged};
use crate::retry::body::{IdleTimer, PeekHead};
use crate::retry::{AttemptContext, HttpResponse, RetryBody};

use crate::retry::ResBodyOf;

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
    pub(crate) fn new(mut service: S, config: Arc<Config>, req: Request<B>) -> Self {
        let (parts, body) = req.into_parts();
        let overloads = match parts.extensions.get::<AttemptContext>() {
            Some(c) => c.consecutive_overloads,
            None => {
                config.state.warn_outside_once();
                0
            }
        };
        let mut planner = Planner {
            config,
            overloads,
            level: None,
            plan: None,
            span: Span::none(),
        };
        let prepare = match (Inside::of(&parts), as_replay_body(body)) {
            (Inside::Loop(carried), Ok(body)) => {
                planner.level = Some(carried.fallback_level as usize);
                let body = planner.plan(body);
                let future = {
                    let _enter = planner.span.enter();
                    // The service was polled ready before `call`.
                    service.call(Request::from_parts(parts, body))
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
                let (head, body) = result.map_err(Into::into)?.into_parts();
                let judge = planner.judge_for(&head);
                let mut res = planner.finish(head, RetryBody::plain(body, None), false);
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

/// The model of an attempt, and what the answer means for the next.
struct Planner {
    config: Arc<Config>,
    /// Overloads in a row just before this attempt, from the retry loop.
    overloads: u32,
    /// Inside a retry loop: how far down the chain the loop says this attempt goes.
    level: Option<usize>,
    plan: Option<Plan>,
    span: Span,
}

/// Which model this attempt goes to.
struct Plan {
    requested: String,
    sent: String,
    /// How far down the chain `sent` is: 0 for the requested model.
    level: usize,
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
                    let body = ctx.p.plan(body);
                    let parts = ctx
                        .parts
                        .take()
                        .expect("the request head is kept until sent");
                    let future = {
                        let _enter = ctx.p.span.enter();
                        ctx.service.call(Request::from_parts(parts, body))
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
                            return Poll::Ready(Err(e.into()));
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
                    ));
                }
                StateProj::Peeking { peek } => {
                    let (head, peeked) = ready!(peek.poll(cx, ctx.p.config.peek_limit));
                    let overloaded = is_overloaded(head.status, Some(&peeked.contiguous()));
                    this.state.set(State::Done);
                    return Poll::Ready(ctx.p.finish(
                        head,
                        RetryBody::peeked(peeked, IdleTimer::new(None)),
                        overloaded,
                    ));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// Inside a retry loop: after an overload, at the threshold, the next attempt goes one model
/// down the chain (the loop carries the level), the caller is told to switch (signal mode),
/// or, at the end of the chain, the response goes back without a retry.
struct FallbackJudge {
    config: Arc<Config>,
    requested: String,
    sent: String,
    level: usize,
    next: Option<String>,
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
        let overloaded = overloaded_by(head.status, body.map(|b| b.signal));
        if !overloaded || carried.overloads_at_level + 1 < self.config.threshold {
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
                    "model overloaded; the next attempt falls back"
                );
                Judged::Step
            }
            (_, None) => {
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
        }
    }
}

impl Planner {
    /// The model after the one `plan` sends to, if the chain goes on.
    fn next(&self, plan: &Plan) -> Option<&str> {
        let fallbacks = self.config.fallbacks_for(&plan.requested);
        fallbacks.get(plan.level).map(String::as_str)
    }

    /// Picks the model for this attempt and rewrites the body for it.
    fn plan(&mut self, body: ReplayBody) -> ReplayBody {
        let Some(bytes) = body.as_bytes() else {
            return body;
        };
        let Some(requested) = json_edit::read_value::<String>(bytes, "model") else {
            return body;
        };
        let config = &self.config;
        let fallbacks = config.fallbacks_for(&requested);
        let mut level = 0;
        if config.mode == FallbackMode::Rewrite {
            // The level the retry loop carries (see `FallbackJudge`).
            level = self.level.unwrap_or(0);
            if config.sticky.is_some() {
                level = level.max(config.state.level(&requested, Instant::now()));
            }
            level = level.min(fallbacks.len());
        }
        let rewritten = match level {
            0 => None,
            _ => json_edit::replace_value(bytes, "model", &fallbacks[level - 1])
                .and_then(|data| body.with_data(data)),
        };
        let (body, sent) = match rewritten {
            Some(rewritten) => (rewritten, fallbacks[level - 1].clone()),
            None => {
                level = 0;
                (body, requested.clone())
            }
        };
        self.span = tracing::debug_span!(
            "llm_fallback",
            "gen_ai.request.model" = sent.as_str(),
            "gen_ai.response.model" = tracing::field::Empty,
        );
        if level > 0 {
            tracing::info!(
                parent: &self.span,
                from = requested.as_str(),
                to = sent.as_str(),
                consecutive_overloads = self.overloads,
                "falling back to another model"
            );
        }
        self.plan = Some(Plan {
            requested,
            sent,
            level,
        });
        body
    }

    /// Whether this attempt's overload would reach the threshold, alone (without a loop,
    /// there are no earlier attempts).
    fn reaches_threshold(&self) -> bool {
        self.config.threshold == 1
    }

    /// Inside a retry loop: the question about an error response, which may be an overload.
    fn judge_for(&self, head: &http::response::Parts) -> Option<FallbackJudge> {
        let plan = self.plan.as_ref()?;
        if !(head.status.is_client_error() || head.status.is_server_error()) {
            return None;
        }
        Some(FallbackJudge {
            config: self.config.clone(),
            requested: plan.requested.clone(),
            sent: plan.sent.clone(),
            level: plan.level,
            next: self.next(plan).map(str::to_owned),
            span: self.span.clone(),
        })
    }

    /// Whether the body must be read to tell an overload that matters.
    fn needs_body(&self, head: &http::response::Parts) -> bool {
        self.plan.is_some()
            && self.reaches_threshold()
            && !is_overloaded(head.status, None)
            && (head.status.is_client_error() || head.status.is_server_error())
    }

    fn finish<R>(
        &mut self,
        head: http::response::Parts,
        body: RetryBody<R>,
        overloaded: bool,
    ) -> Result<Response<RetryBody<R>>, BoxError> {
        let Some(plan) = self.plan.take() else {
            return Ok(Response::from_parts(head, body));
        };
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
                    let signal = FallbackTriggered::new(plan.sent, next.as_str());
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
        // A layer inside (ContextOverflowLayer's context-window fallback) may have re-sent
        // the request to another model: the response came from that one.
        let model = match head.extensions.get::<OverflowRepaired>() {
            Some(OverflowRepaired::Model { to, .. }) => to.clone(),
            _ => plan.sent,
        };
        let mut res = Response::from_parts(head, body);
        res.extensions_mut().insert(ModelUsed {
            model,
            requested: plan.requested,
            chain_exhausted: exhausted,
        });
        Ok(res)
    }
}
