use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use serde::Deserialize;
use tower_service::Service;

use super::layer::Config;
use super::{ContextOverflow, OverflowRepaired};
use crate::body::{Held, PrepareBody, ReplayBody};
use crate::classify::error_body::{context_overflow, Overflow};
use crate::error::BoxError;
use crate::json_edit;
use crate::retry::body::{IdleTimer, PeekHead};
use crate::retry::{HttpResponse, RetryBody};

use crate::retry::ResBodyOf;

pin_project! {
    /// The response future of [`ContextOverflowService`](super::ContextOverflowService).
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

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body,
    B::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("repaired", &self.ctx.repaired)
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
        let prepare = PrepareBody::new(body, config.body_limit);
        ResponseFuture {
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
                    let overflow = overflow.map(ContextOverflow::from);
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
        let bytes = body.as_bytes()?;
        if let Overflow::MaxTokens { input, limit, .. } = overflow {
            if let Some((from, to)) = self.smaller_max_tokens(bytes, input, limit) {
                let repaired = json_edit::replace_value(bytes, "max_tokens", &to)
                    .and_then(|data| body.with_data(data));
                if let Some(repaired) = repaired {
                    tracing::info!(
                        input_tokens = input,
                        context_limit = limit,
                        from,
                        to,
                        "max_tokens exceeds the context window; re-sending with less"
                    );
                    self.repaired = Some(OverflowRepaired::MaxTokens { from, to });
                    return Some(repaired);
                }
            }
        }
        let to = self.config.context_window_fallback.as_deref()?;
        let from = json_edit::read_value::<String>(bytes, "model")?;
        if from == to {
            return None;
        }
        let repaired =
            json_edit::replace_value(bytes, "model", to).and_then(|data| body.with_data(data))?;
        tracing::info!(
            from = from.as_str(),
            to,
            "the request does not fit the context window; re-sending to a larger one"
        );
        self.repaired = Some(OverflowRepaired::Model {
            from,
            to: to.to_owned(),
        });
        Some(repaired)
    }

    /// `max_tokens` as sent and as it should be, when lowering it makes the request fit.
    fn smaller_max_tokens(&self, bytes: &[u8], input: u64, limit: u64) -> Option<(u64, u64)> {
        let from: u64 = json_edit::read_value(bytes, "max_tokens")?;
        let config = &self.config;
        let mut to = limit
            .saturating_sub(input)
            .saturating_sub(config.margin)
            .max(config.floor);
        let budget =
            json_edit::read_value::<Thinking>(bytes, "thinking").and_then(|t| t.budget_tokens);
        if let Some(budget) = budget {
            to = to.max(budget.saturating_add(1));
        }
        // Only a smaller value that fits is worth a request.
        (to < from && input.saturating_add(to) <= limit).then_some((from, to))
    }

    fn finish<R>(
        &mut self,
        head: http::response::Parts,
        body: RetryBody<R>,
        overflow: Option<ContextOverflow>,
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
