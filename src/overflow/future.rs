use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use serde::Deserialize;
use tower_service::Service;

use super::layer::Config;
use super::{ContextWindowExceeded, OverflowRepaired};
use crate::body::{as_replay_body, Held, PrepareBody, ReplayBody};
use crate::error::BoxError;
use crate::json_edit;
use crate::pipeline::body::{IdleTimer, PeekHead};
use crate::pipeline::{Asks, Carried, Inside, Judge, Judged};
use crate::pipeline::{HttpResponse, RetryBody};
use crate::provider::error_body::{context_overflow, ErrorBody, Overflow};

use crate::pipeline::ResBodyOf;

pin_project! {
    /// The response future of [`ContextOverflow`](super::ContextOverflow).
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
        // Inside a retry loop: one send, and a question to the loop about a `400`.
        Loop { #[pin] future: S::Future, ctx: LoopCtx },
        // On its own: it buffers, keeps the request and re-sends it itself.
        Alone { future: Pin<Box<Alone<S, B>>> },
    }
}

struct LoopCtx {
    config: Arc<Config>,
    /// The body sent, for the repair.
    sent: Option<Bytes>,
    /// The repair this send carries (boxed: rare, and the future stays small).
    repaired: Option<Box<OverflowRepaired>>,
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
        let (parts, body) = req.into_parts();
        let prepare = match (Inside::of(&parts), as_replay_body(body)) {
            (Inside::Loop(carried), Ok(body)) => {
                // Every send after a repair carries it.
                let body = carried
                    .repair
                    .as_ref()
                    .and_then(|r| apply(&body, r))
                    .unwrap_or(body);
                let sent = body.as_bytes().cloned();
                // The service was polled ready before `call`.
                let future = service.call(crate::body::request(parts, body));
                let ctx = LoopCtx {
                    config,
                    sent,
                    repaired: carried.repair.map(Box::new),
                };
                return ResponseFuture {
                    kind: Kind::Loop { future, ctx },
                };
            }
            (_, Ok(body)) => PrepareBody::replay(body),
            (_, Err(body)) => PrepareBody::read(body, config.body_limit),
        };
        let alone = Alone::new(service, config, parts, prepare);
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
            KindProj::Loop { future, ctx } => {
                let (head, body) = ready!(future.poll(cx)).map_err(Into::into)?.into_parts();
                let overflow_status = matches!(
                    head.status,
                    StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE
                );
                let mut res = Response::from_parts(head, RetryBody::plain(body, None));
                if let Some(repaired) = ctx.repaired.take() {
                    res.extensions_mut().insert(*repaired);
                }
                if overflow_status {
                    let judge = OverflowJudge {
                        config: ctx.config.clone(),
                        sent: ctx.sent.take(),
                    };
                    Asks::push(res.extensions_mut(), Arc::new(judge));
                }
                Poll::Ready(Ok(res))
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
        let repaired = match &self.kind {
            Kind::Loop { ctx, .. } => ctx.repaired.is_some(),
            Kind::Alone { future } => future.ctx.repaired.is_some(),
        };
        f.debug_struct("ResponseFuture")
            .field("repaired", &repaired)
            .finish_non_exhaustive()
    }
}

pin_project! {
    /// The layer on its own: buffering, a copy of the request, its own peek and re-send.
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
        // The inner service is polled ready again before the re-send.
        Resending,
        Done,
    }
}

struct Ctx<S> {
    service: S,
    config: Arc<Config>,
    /// The request, kept while a re-send is still possible.
    held: Held,
    repaired: Option<OverflowRepaired>,
}

impl<S, B> Alone<S, B>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    fn new(
        service: S,
        config: Arc<Config>,
        parts: http::request::Parts,
        prepare: PrepareBody<B>,
    ) -> Self {
        Alone {
            state: State::Preparing { prepare },
            ctx: Ctx {
                service,
                config,
                held: Held::new(parts),
                repaired: None,
            },
        }
    }
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
                    ctx.held.set_body(body);
                    // The service was polled ready before `call`.
                    let future = ctx.service.call(ctx.held.send(true));
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let (head, body) = match ready!(future.poll(cx)) {
                        Ok(res) => res.into_parts(),
                        Err(e) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e.into()));
                        }
                    };
                    if matches!(
                        head.status,
                        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE
                    ) {
                        this.state.set(State::Peeking {
                            peek: PeekHead::new(head, body),
                        });
                        continue;
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(ctx.finish(head, RetryBody::plain(body, None), None)));
                }
                StateProj::Peeking { peek } => {
                    let (head, peeked) = ready!(peek.poll(cx, ctx.config.peek_limit));
                    let overflow = context_overflow(&peeked.contiguous());
                    if let Some(overflow) = overflow {
                        if let Some(body) = ctx.repair(overflow) {
                            // The overflow response is dropped; its replacement is re-sent now.
                            ctx.held.set_body(body);
                            this.state.set(State::Resending);
                            continue;
                        }
                    }
                    this.state.set(State::Done);
                    let overflow = overflow.map(ContextWindowExceeded::from);
                    return Poll::Ready(Ok(ctx.finish(
                        head,
                        RetryBody::peeked(peeked, IdleTimer::new(None)),
                        overflow,
                    )));
                }
                StateProj::Resending => {
                    if let Err(e) = ready!(ctx.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e.into()));
                    }
                    let future = ctx.service.call(ctx.held.send(false));
                    this.state.set(State::Calling { future });
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

#[derive(Deserialize)]
struct Thinking {
    budget_tokens: Option<u64>,
}

impl<S> Ctx<S> {
    /// The body to re-send for this overflow, if there is a repair and no re-send yet.
    fn repair(&mut self, overflow: Overflow) -> Option<ReplayBody> {
        let body = self.held.body()?;
        let repair = plan_repair(&self.config, body.as_bytes()?, overflow)?;
        let repaired = apply(body, &repair)?;
        self.repaired = Some(repair);
        Some(repaired)
    }
}

/// The repair for an overflow of a request with body `bytes`, if there is one: a smaller
/// `max_tokens` that fits, or else the context-window fallback model.
fn plan_repair(config: &Config, bytes: &[u8], overflow: Overflow) -> Option<OverflowRepaired> {
    if let Overflow::MaxTokens { input, limit, .. } = overflow {
        if let Some((from, to)) = smaller_max_tokens(config, bytes, input, limit) {
            tracing::info!(
                input_tokens = input,
                context_limit = limit,
                from,
                to,
                "max_tokens exceeds the context window; re-sending with less"
            );
            return Some(OverflowRepaired::MaxTokens { from, to });
        }
    }
    let to = config.context_window_fallback.as_deref()?;
    let from = json_edit::read_value::<String>(bytes, "model")?;
    if from == to {
        return None;
    }
    tracing::info!(
        from = from.as_str(),
        to,
        "the request does not fit the context window; re-sending to a larger one"
    );
    Some(OverflowRepaired::Model {
        from,
        to: to.to_owned(),
    })
}

/// `body` with `repair` made: one top-level value replaced, every other byte as it was.
fn apply(body: &ReplayBody, repair: &OverflowRepaired) -> Option<ReplayBody> {
    let bytes = body.as_bytes()?;
    let data = match repair {
        OverflowRepaired::MaxTokens { to, .. } => json_edit::replace_value(bytes, "max_tokens", to),
        OverflowRepaired::Model { to, .. } => json_edit::replace_value(bytes, "model", to),
    }?;
    body.with_data(data)
}

/// Inside a retry loop: a `400` or `413` that may be a context overflow, judged once the loop
/// has read its body.
struct OverflowJudge {
    config: Arc<Config>,
    sent: Option<Bytes>,
}

impl Judge for OverflowJudge {
    fn wants_body(&self, _: &http::response::Parts) -> bool {
        true
    }

    fn judge(
        &self,
        head: &mut http::response::Parts,
        body: Option<&ErrorBody>,
        carried: &mut Carried,
    ) -> Judged {
        let Some(overflow) = body.and_then(|b| b.overflow) else {
            return Judged::Pass;
        };
        // One repair a request: a second overflow goes back with its numbers.
        if carried.repair.is_none() {
            let repair = (self.sent.as_ref()).and_then(|b| plan_repair(&self.config, b, overflow));
            if let Some(repair) = repair {
                carried.repair = Some(repair);
                return Judged::Resend;
            }
        }
        let overflow = ContextWindowExceeded::from(overflow);
        tracing::debug!(
            input_tokens = overflow.input_tokens,
            context_limit = overflow.limit,
            "the request does not fit the context window"
        );
        head.extensions.insert(overflow);
        Judged::Pass
    }
}

/// `max_tokens` as sent and as it should be, when lowering it makes the request fit.
fn smaller_max_tokens(config: &Config, bytes: &[u8], input: u64, limit: u64) -> Option<(u64, u64)> {
    let from: u64 = json_edit::read_value(bytes, "max_tokens")?;
    // At least one token whatever the floor: the APIs refuse `max_tokens: 0`.
    let mut to = limit
        .saturating_sub(input)
        .saturating_sub(config.margin)
        .max(config.floor)
        .max(1);
    let budget = json_edit::read_value::<Thinking>(bytes, "thinking").and_then(|t| t.budget_tokens);
    if let Some(budget) = budget {
        to = to.max(budget.saturating_add(1));
    }
    // Only a smaller value that fits is worth a request.
    (to < from && input.saturating_add(to) <= limit).then_some((from, to))
}

impl<S> Ctx<S> {
    fn finish<R>(
        &mut self,
        head: http::response::Parts,
        body: RetryBody<R>,
        overflow: Option<ContextWindowExceeded>,
    ) -> Response<RetryBody<R>> {
        let mut res = Response::from_parts(head, body);
        if let Some(repaired) = self.repaired.take() {
            res.extensions_mut().insert(repaired);
        }
        if let Some(overflow) = overflow {
            tracing::debug!(
                input_tokens = overflow.input_tokens,
                context_limit = overflow.limit,
                "the request does not fit the context window"
            );
            res.extensions_mut().insert(overflow);
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(floor: u64, margin: u64) -> Config {
        Config {
            floor,
            margin,
            context_window_fallback: None,
            body_limit: crate::body::DEFAULT_BODY_LIMIT,
            peek_limit: crate::pipeline::DEFAULT_PEEK_LIMIT,
        }
    }

    #[test]
    fn a_repair_never_sends_zero_tokens() {
        let body = br#"{"model":"m","max_tokens":4096,"messages":[]}"#;
        // No room left after the margin, and a floor of 0: one token, not zero.
        assert_eq!(
            smaller_max_tokens(&config(0, 1_000), body, 199_000, 200_000),
            Some((4096, 1))
        );
        // The usual case: what is left below the limit, less the margin.
        assert_eq!(
            smaller_max_tokens(&config(3_000, 1_000), body, 190_000, 200_000),
            None,
            "9,000 left is more than was asked for: nothing to repair"
        );
        assert_eq!(
            smaller_max_tokens(&config(1_000, 1_000), body, 197_000, 200_000),
            Some((4096, 2_000))
        );
        // Not even the floor fits: no repair.
        assert_eq!(
            smaller_max_tokens(&config(3_000, 1_000), body, 198_000, 200_000),
            None
        );
    }
}
