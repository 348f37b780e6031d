use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::SystemTime;

use http::{Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::Config;
use super::{AuthOutcome, Credential, CredentialFuture};
use crate::body::{Held, PrepareBody, ReplayBody};
use crate::classify::error_body::{body_signal, BodySignal};
use crate::classify::headers::parse_retry_after;
use crate::error::{BoxError, Error, ErrorKind};
use crate::retry::body::{IdleTimer, PeekHead};
use crate::retry::{HttpResponse, RetryBody};

/// A bound on re-sends after rate limits, for sources that keep saying another key is free.
const MAX_ROTATIONS: u32 = 16;

use crate::retry::ResBodyOf;

pin_project! {
    /// The response future of [`Auth`](super::Auth).
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
        Fetching { fetch: CredentialFuture },
        // The inner service is polled ready again before a re-send.
        Ready,
        Calling { #[pin] future: F },
        Peeking { peek: PeekHead<R> },
        Done,
    }
}

struct Ctx<S> {
    service: S,
    config: Arc<Config>,
    /// The request, kept while a re-send is still possible.
    held: Held,
    /// The credential on the request in flight.
    credential: Option<Credential>,
    sends: u32,
    refreshed: bool,
    rotations: u32,
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>>,
    S::Response: HttpResponse,
    B: Body,
    B::Error: Into<BoxError>,
{
    // Never the request head or the credential.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("sends", &self.ctx.sends)
            .field("refreshed", &self.ctx.refreshed)
            .field("rotations", &self.ctx.rotations)
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
                credential: None,
                sends: 0,
                refreshed: false,
                rotations: 0,
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
                StateProj::Preparing { prepare } => match ready!(prepare.poll(cx)) {
                    Ok(body) => {
                        ctx.held.set_body(body);
                        let fetch = ctx.config.source.credential();
                        this.state.set(State::Fetching { fetch });
                    }
                    Err(e) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e.into()));
                    }
                },
                StateProj::Fetching { fetch } => match ready!(Pin::new(fetch).poll(cx)) {
                    Ok(credential) => {
                        ctx.credential = Some(credential);
                        if ctx.sends == 0 {
                            // The service was polled ready before `call`.
                            let future = ctx.send();
                            this.state.set(State::Calling { future });
                        } else {
                            this.state.set(State::Ready);
                        }
                    }
                    Err(e) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(token_error(e)));
                    }
                },
                StateProj::Ready => {
                    if let Err(e) = ready!(ctx.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e.into()));
                    }
                    let future = ctx.send();
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
                    match head.status {
                        StatusCode::UNAUTHORIZED if ctx.refresh_after_401() => {
                            drop((head, body));
                            let fetch = ctx.config.source.credential();
                            this.state.set(State::Fetching { fetch });
                        }
                        StatusCode::TOO_MANY_REQUESTS if ctx.may_rotate() => {
                            this.state.set(State::Peeking {
                                peek: PeekHead::new(head, body),
                            });
                        }
                        _ => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(ctx.finish(head, RetryBody::plain(body, None))));
                        }
                    }
                }
                StateProj::Peeking { peek } => {
                    let (head, peeked) = ready!(peek.poll(cx, ctx.config.peek_limit));
                    let quota = body_signal(&peeked.contiguous()) == BodySignal::QuotaExhausted;
                    if !quota && ctx.rotate_after_429(&head) {
                        drop((head, peeked));
                        let fetch = ctx.config.source.credential();
                        this.state.set(State::Fetching { fetch });
                        continue;
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(
                        ctx.finish(head, RetryBody::peeked(peeked, IdleTimer::new(None)))
                    ));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S> Ctx<S>
where
    S: Service<Request<ReplayBody>>,
{
    /// Sends the request with the current credential.
    fn send(&mut self) -> S::Future {
        self.sends += 1;
        let more = !self.refreshed || self.config.source.rotates();
        let mut req = self.held.send(more);
        if let Some(credential) = &self.credential {
            credential.apply(req.headers_mut());
        }
        self.service.call(req)
    }
}

impl<S> Ctx<S> {
    fn can_resend(&self) -> bool {
        self.held.can_resend()
    }

    /// After a `401`: tells the source, and decides whether to re-send with a fresh credential.
    fn refresh_after_401(&mut self) -> bool {
        let Some(rejected) = &self.credential else {
            return false;
        };
        let fresh = self.config.source.invalidate(rejected);
        if !fresh || self.refreshed || !self.can_resend() {
            return false;
        }
        self.refreshed = true;
        tracing::info!(
            key_index = rejected.key_index(),
            "credential rejected (401); re-sending once with a fresh one"
        );
        true
    }

    fn may_rotate(&self) -> bool {
        self.config.source.rotates() && self.can_resend() && self.rotations < MAX_ROTATIONS
    }

    /// After a rate limit: rests the key, and decides whether to re-send with another.
    fn rotate_after_429(&mut self, head: &http::response::Parts) -> bool {
        let Some(limited) = &self.credential else {
            return false;
        };
        let retry_after = parse_retry_after(&head.headers, SystemTime::now());
        if !self.config.source.rate_limited(limited, retry_after) {
            return false;
        }
        self.rotations += 1;
        tracing::info!(
            key_index = limited.key_index(),
            retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
            "API key rate-limited (429); re-sending at once with the next key"
        );
        true
    }

    fn finish<R>(
        &mut self,
        head: http::response::Parts,
        body: RetryBody<R>,
    ) -> Response<RetryBody<R>> {
        let mut res = Response::from_parts(head, body);
        let key_index = self.credential.as_ref().and_then(Credential::key_index);
        if self.refreshed || self.rotations > 0 || key_index.is_some() {
            res.extensions_mut().insert(AuthOutcome {
                refreshed: self.refreshed,
                rotations: self.rotations,
                key_index,
            });
        }
        res
    }
}

/// The error for a credential that could not be had: always of kind
/// [`ErrorKind::TokenRefresh`], with the source's error as its cause.
fn token_error(e: BoxError) -> BoxError {
    match e.downcast::<Error>() {
        Ok(err) if err.kind() == ErrorKind::TokenRefresh => err,
        Ok(err) => Error::new(ErrorKind::TokenRefresh).with_source(*err).into(),
        Err(e) => Error::new(ErrorKind::TokenRefresh).with_source(e).into(),
    }
}
