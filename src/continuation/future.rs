use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderValue, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::Config;
use super::stitch::{self, Round};
use super::{ContinuationBody, Continued, TruncatedToolCall};
use crate::body::{Held, PrepareBody, ReplayBody};
use crate::error::BoxError;
use crate::pipeline::body::{IdleTimer, Peeked};
use crate::pipeline::{HttpResponse, ResBodyOf, RetryBody};
use crate::stream::{is_event_stream, OutputTruncated};

pin_project! {
    /// The response future of [`Continuation`](super::Continuation).
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
        Reading { head: Option<http::response::Parts>, peeked: Option<Peeked<R>> },
        // The inner service is polled ready again before each follow-up.
        Resending,
        Done,
    }
}

struct Ctx<S> {
    service: S,
    config: Arc<Config>,
    /// The request last sent, kept while a follow-up can still be built from it.
    held: Held,
    /// The request can be continued at all (a buffered JSON body with `messages`, no stream).
    eligible: bool,
    /// The bodies of the answers so far, oldest first, and the head of the last.
    bodies: Vec<Bytes>,
    head: Option<http::response::Parts>,
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
            .field("answers", &self.ctx.bodies.len())
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
                eligible: false,
                bodies: Vec::new(),
                head: None,
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
    type Output = Result<Response<ContinuationBody<ResBody>>, BoxError>;

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
                    let config = &ctx.config;
                    ctx.eligible = config.max_rounds > 0
                        && !config.prompt.is_empty()
                        && body
                            .as_bytes()
                            .is_some_and(|b| stitch::request_is_continuable(b));
                    ctx.held.set_body(body);
                    // The service was polled ready before `call`.
                    let future = ctx.service.call(ctx.held.send(ctx.eligible));
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let result = ready!(future.poll(cx));
                    let first = ctx.bodies.is_empty();
                    let (head, body) = match result {
                        Ok(res) => res.into_parts(),
                        Err(e) if first => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e.into()));
                        }
                        Err(e) => {
                            let e: BoxError = e.into();
                            tracing::warn!(error = %e, "a continuation follow-up failed");
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(ctx.stitched(false, None)));
                        }
                    };
                    let readable = head.status.is_success() && !is_event_stream(&head);
                    if first && (!ctx.eligible || !readable) {
                        this.state.set(State::Done);
                        let body = ContinuationBody::inner(RetryBody::plain(body, None));
                        return Poll::Ready(Ok(Response::from_parts(head, body)));
                    }
                    if !readable {
                        tracing::warn!(status = %head.status, "a continuation follow-up failed");
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(ctx.stitched(false, None)));
                    }
                    this.state.set(State::Reading {
                        head: Some(head),
                        peeked: Some(Peeked::new(body)),
                    });
                }
                StateProj::Reading { head, peeked } => {
                    let limit = ctx.config.response_limit;
                    ready!(peeked
                        .as_mut()
                        .expect("the read state holds the body")
                        .poll_fill(cx, limit.saturating_add(1)));
                    let head = head.take().expect("the read state holds the head");
                    let peeked = peeked.take().expect("the read state holds the body");
                    this.state.set(State::Done);
                    match ctx.answer(head, peeked) {
                        Some(res) => return Poll::Ready(Ok(res)),
                        None => this.state.set(State::Resending),
                    }
                }
                StateProj::Resending => {
                    if let Err(e) = ready!(ctx.service.poll_ready(cx)) {
                        let e: BoxError = e.into();
                        tracing::warn!(error = %e, "a continuation follow-up failed");
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(ctx.stitched(false, None)));
                    }
                    let mut req = ctx.held.send(true);
                    // The body grew; the length is the body's own.
                    req.headers_mut().remove(CONTENT_LENGTH);
                    let future = ctx.service.call(req);
                    this.state.set(State::Calling { future });
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S> Ctx<S> {
    /// Judges a successful answer read whole (or as far as the limit): the response for the
    /// caller, or `None` when the follow-up is held, to be sent now.
    fn answer<R>(
        &mut self,
        head: http::response::Parts,
        peeked: Peeked<R>,
    ) -> Option<Response<ContinuationBody<R>>> {
        let first = self.bodies.is_empty();
        let whole = peeked.is_finished() && peeked.error.is_none() && peeked.trailers.is_none();
        let round = whole
            .then(|| stitch::read_round(&peeked.contiguous()))
            .flatten();
        let Some(round) = round else {
            if first {
                // Not an answer this layer reads: as it came.
                return Some(Response::from_parts(
                    head,
                    ContinuationBody::inner(RetryBody::peeked(peeked, IdleTimer::new(None))),
                ));
            }
            tracing::warn!("a continuation follow-up did not return an answer");
            return Some(self.stitched(false, None));
        };
        if first && (!round.at_limit || round.tool_call.is_some() || !self.can_continue(&round)) {
            let mut res = Response::from_parts(
                head,
                ContinuationBody::inner(RetryBody::peeked(peeked, IdleTimer::new(None))),
            );
            if round.at_limit {
                res.extensions_mut().insert(OutputTruncated);
            }
            if let Some(call) = round.tool_call {
                res.extensions_mut().insert(call);
            }
            return Some(res);
        }
        let bytes = Bytes::copy_from_slice(&peeked.contiguous());
        self.bodies.push(bytes);
        self.head = Some(head);
        if let Some(call) = round.tool_call {
            return Some(self.stitched(false, Some(call)));
        }
        if !round.at_limit {
            return Some(self.stitched(true, None));
        }
        match self.follow_up(&round) {
            Some(body) => {
                self.held.set_body(body);
                None
            }
            None => Some(self.stitched(false, None)),
        }
    }

    /// Whether a follow-up can be sent after this answer.
    fn can_continue(&self, round: &Round) -> bool {
        round.continuable && self.follow_up(round).is_some()
    }

    /// The follow-up to the request last sent, while rounds are left.
    fn follow_up(&self, round: &Round) -> Option<ReplayBody> {
        let sent = self.bodies.len().saturating_sub(1);
        if !round.continuable || sent >= self.config.max_rounds as usize {
            return None;
        }
        let body = self.held.body()?;
        let data = stitch::append_turns(body.as_bytes()?, &round.text, &self.config.prompt)?;
        body.with_data(data)
    }

    /// The answers so far as one response.
    fn stitched<R>(
        &mut self,
        complete: bool,
        tool_call: Option<TruncatedToolCall>,
    ) -> Response<ContinuationBody<R>> {
        let mut head = self.head.take().expect("a stitched response has an answer");
        let data = stitch::stitch(&self.bodies).unwrap_or_else(|| {
            // Not reached for bodies `read_round` accepted; the last answer is still whole.
            self.bodies.last().cloned().unwrap_or_default()
        });
        head.headers.remove(TRANSFER_ENCODING);
        head.headers
            .insert(CONTENT_LENGTH, HeaderValue::from(data.len() as u64));
        let rounds = u32::try_from(self.bodies.len() - 1).unwrap_or(u32::MAX);
        tracing::debug!(rounds, complete, "answer continued");
        let mut res = Response::from_parts(head, ContinuationBody::stitched(data));
        res.extensions_mut().insert(Continued { rounds, complete });
        if !complete {
            res.extensions_mut().insert(OutputTruncated);
        }
        if let Some(call) = tool_call {
            res.extensions_mut().insert(call);
        }
        res
    }
}
