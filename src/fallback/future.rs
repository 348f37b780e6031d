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
use crate::body::{PrepareBody, ReplayBody};
use crate::classify::is_overloaded;
use crate::error::{BoxError, Error, ErrorKind, FallbackTriggered};
use crate::json_edit;
use crate::overflow::OverflowRepaired;
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
    config: Arc<Config>,
    parts: Option<http::request::Parts>,
    /// Overloads in a row just before this attempt, from the retry loop.
    overloads: u32,
    plan: Option<Plan>,
    span: Span,
}

/// Which model this attempt goes to.
struct Plan {
    requested: String,
    sent: String,
    /// How far down the chain `sent` is: 0 for the requested model.
    level: usize,
    /// The model after `sent`, if the chain goes on.
    next: Option<String>,
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body,
    B::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("model", &self.ctx.plan.as_ref().map(|p| &p.sent))
            .finish_non_exhaustive()
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
    pub(crate) fn new(service: S, config: Arc<Config>, req: Request<B>) -> Self {
        let (parts, body) = req.into_parts();
        let overloads = match parts.extensions.get::<AttemptContext>() {
            Some(c) => c.consecutive_overloads,
            None => {
                config.state.warn_outside_once();
                0
            }
        };
        let prepare = PrepareBody::new(body, config.body_limit);
        ResponseFuture {
            state: State::Preparing { prepare },
            ctx: Ctx {
                service,
                config,
                parts: Some(parts),
                overloads,
                plan: None,
                span: Span::none(),
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
                    let body = ctx.plan(body);
                    let parts = ctx
                        .parts
                        .take()
                        .expect("the request head is kept until sent");
                    let future = {
                        let _enter = ctx.span.enter();
                        ctx.service.call(Request::from_parts(parts, body))
                    };
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let result = {
                        let _enter = ctx.span.enter();
                        ready!(future.poll(cx))
                    };
                    let (head, body) = match result {
                        Ok(res) => res.into_parts(),
                        Err(e) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e.into()));
                        }
                    };
                    if ctx.needs_body(&head) {
                        this.state.set(State::Peeking {
                            peek: PeekHead::new(head, body),
                        });
                        continue;
                    }
                    let overloaded = is_overloaded(head.status, None);
                    this.state.set(State::Done);
                    return Poll::Ready(ctx.finish(head, RetryBody::plain(body, None), overloaded));
                }
                StateProj::Peeking { peek } => {
                    let (head, peeked) = ready!(peek.poll(cx, ctx.config.peek_limit));
                    let overloaded = is_overloaded(head.status, Some(&peeked.contiguous()));
                    this.state.set(State::Done);
                    return Poll::Ready(ctx.finish(
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

impl<S> Ctx<S> {
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
            level = (self.overloads / config.threshold) as usize;
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
            next: fallbacks.get(level).cloned(),
            requested,
            sent,
            level,
        });
        body
    }

    /// Whether this attempt's overload would reach the threshold.
    fn reaches_threshold(&self) -> bool {
        (self.overloads + 1) % self.config.threshold == 0
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
            match (self.config.mode, &plan.next) {
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
