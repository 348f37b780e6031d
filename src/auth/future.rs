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
use super::{AuthOutcome, Credential, CredentialFuture, TokenSource};
use crate::body::{as_replay_body, Held, PrepareBody, ReplayBody};
use crate::classify::headers::parse_retry_after;
use crate::error::{BoxError, Error, ErrorKind};
use crate::pipeline::body::{IdleTimer, PeekHead};
use crate::pipeline::{Asks, Carried, Inside, Judge, Judged};
use crate::pipeline::{HttpResponse, RetryBody};
use crate::provider::error_body::{body_signal, BodySignal, ErrorBody};

/// A bound on re-sends after rate limits, for sources that keep saying another key is free.
const MAX_ROTATIONS: u32 = 16;

use crate::pipeline::ResBodyOf;

/// Request extension: the credential source of the fallback target this request goes to,
/// used by [`AuthLayer`](crate::AuthLayer) instead of its own.
#[derive(Clone)]
pub(crate) struct TargetCredential(pub(crate) Arc<dyn TokenSource>);

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
        // Inside a retry loop: the credential is being fetched (not ready at once). Boxed:
        // the request waits here only while a token is refreshed.
        Fetching { pending: Box<Pending<S>> },
        // Inside a retry loop: one send, and a question to the loop about a `401` or `429`.
        Loop { #[pin] future: S::Future, keys: Keys },
        // On its own: it buffers, keeps the request and re-sends it itself.
        Alone { future: Pin<Box<Alone<S, B>>> },
    }
}

/// A send inside a retry loop, waiting for its credential.
struct Pending<S> {
    fetch: CredentialFuture,
    send: Option<(S, Request<ReplayBody>)>,
    keys: Keys,
}

/// What a send inside a retry loop knows of its credential.
struct Keys {
    config: Arc<Config>,
    credential: Option<Credential>,
    refreshed: bool,
    rotations: u32,
}

impl Keys {
    /// Sends `req` with the credential.
    fn send<S>(
        &mut self,
        mut service: S,
        mut req: Request<ReplayBody>,
        credential: Credential,
    ) -> S::Future
    where
        S: Service<Request<ReplayBody>>,
    {
        credential.apply(req.headers_mut());
        self.credential = Some(credential);
        service.call(req)
    }

    /// The response handed back, with what the layer did and its question to the loop.
    fn finish<R>(&self, res: Response<R>) -> Response<RetryBody<R>> {
        let (head, body) = res.into_parts();
        let mut res = Response::from_parts(head, RetryBody::plain(body, None));
        let key_index = self.credential.as_ref().and_then(Credential::key_index);
        if self.refreshed || self.rotations > 0 || key_index.is_some() {
            res.extensions_mut().insert(AuthOutcome {
                refreshed: self.refreshed,
                rotations: self.rotations,
                key_index,
            });
        }
        self.ask_loop(&mut res);
        res
    }

    /// What to ask the loop about this response. After a `401`, the source is told at once,
    /// and a fresh credential means a re-send; after a `429`, the key rests and the next one
    /// is tried, unless the body says the quota is gone.
    fn ask_loop<R>(&self, res: &mut Response<R>) {
        let Some(credential) = self.credential.clone() else {
            return;
        };
        match res.status() {
            StatusCode::UNAUTHORIZED => {
                let fresh = self.config.source.invalidate(&credential);
                if fresh && !self.refreshed {
                    Asks::push(res.extensions_mut(), Arc::new(Refresh(credential)));
                }
            }
            StatusCode::TOO_MANY_REQUESTS
                if self.config.source.rotates() && self.rotations < MAX_ROTATIONS =>
            {
                let rotate = Rotate {
                    config: self.config.clone(),
                    credential,
                };
                Asks::push(res.extensions_mut(), Arc::new(rotate));
            }
            _ => {}
        }
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
    pub(crate) fn new(service: S, config: Arc<Config>, req: Request<B>) -> Self {
        let (parts, body) = req.into_parts();
        // A fallback target on another upstream brings its own credential source.
        let config = match parts.extensions.get::<TargetCredential>() {
            Some(TargetCredential(source)) => Arc::new(Config {
                source: source.clone(),
                ..(*config).clone()
            }),
            None => config,
        };
        let prepare = match (Inside::of(&parts), as_replay_body(body)) {
            (Inside::Loop(carried), Ok(body)) => {
                let mut keys = Keys {
                    config,
                    credential: None,
                    refreshed: carried.refreshed,
                    rotations: carried.rotations,
                };
                let req = Request::from_parts(parts, body);
                let mut fetch = keys.config.source.credential();
                let kind = match fetch.try_ready() {
                    // The service was polled ready before `call`.
                    Some(Ok(credential)) => Kind::Loop {
                        future: keys.send(service, req, credential),
                        keys,
                    },
                    Some(Err(e)) => Kind::Fetching {
                        pending: Box::new(Pending {
                            fetch: CredentialFuture::ready(Err(e)),
                            send: Some((service, req)),
                            keys,
                        }),
                    },
                    None => Kind::Fetching {
                        pending: Box::new(Pending {
                            fetch,
                            send: Some((service, req)),
                            keys,
                        }),
                    },
                };
                return ResponseFuture { kind };
            }
            (_, Ok(body)) => PrepareBody::replay(body),
            (_, Err(body)) => PrepareBody::read(body, config.body_limit),
        };
        ResponseFuture {
            kind: Kind::Alone {
                future: Box::pin(Alone::new(service, config, parts, prepare)),
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

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project().kind.project() {
                KindProj::Fetching { pending } => {
                    let credential =
                        ready!(Pin::new(&mut pending.fetch).poll(cx)).map_err(token_error)?;
                    let (service, req) = pending.send.take().expect("sent once");
                    let config = pending.keys.config.clone();
                    let mut keys = std::mem::replace(
                        &mut pending.keys,
                        Keys {
                            config,
                            credential: None,
                            refreshed: false,
                            rotations: 0,
                        },
                    );
                    // The service was polled ready before `call`, and nothing else used it.
                    let future = keys.send(service, req, credential);
                    self.as_mut()
                        .project()
                        .kind
                        .set(Kind::Loop { future, keys });
                }
                KindProj::Loop { future, keys } => {
                    let res = ready!(future.poll(cx)).map_err(Into::into)?;
                    return Poll::Ready(Ok(keys.finish(res)));
                }
                KindProj::Alone { future } => return future.as_mut().poll(cx),
            }
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
    // Never the request head or the credential.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (refreshed, rotations) = match &self.kind {
            Kind::Fetching { pending } => (pending.keys.refreshed, pending.keys.rotations),
            Kind::Loop { keys, .. } => (keys.refreshed, keys.rotations),
            Kind::Alone { future } => (future.ctx.refreshed, future.ctx.rotations),
        };
        f.debug_struct("ResponseFuture")
            .field("refreshed", &refreshed)
            .field("rotations", &rotations)
            .finish_non_exhaustive()
    }
}

pin_project! {
    /// The layer on its own: buffering, a copy of the request, its own peek and re-sends.
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
                credential: None,
                sends: 0,
                refreshed: false,
                rotations: 0,
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

/// A `401` with a fresh credential to hand: re-send once.
struct Refresh(Credential);

impl Judge for Refresh {
    fn wants_body(&self, _: &http::response::Parts) -> bool {
        false
    }

    fn judge(
        &self,
        _: &mut http::response::Parts,
        _: Option<&ErrorBody>,
        carried: &mut Carried,
    ) -> Judged {
        carried.refreshed = true;
        tracing::info!(
            key_index = self.0.key_index(),
            "credential rejected (401); re-sending once with a fresh one"
        );
        Judged::Resend
    }
}

/// A `429` on a key of a rotating pool: rest it and re-send with the next, unless the quota
/// itself is gone.
struct Rotate {
    config: Arc<Config>,
    credential: Credential,
}

impl Judge for Rotate {
    fn wants_body(&self, _: &http::response::Parts) -> bool {
        true
    }

    fn judge(
        &self,
        head: &mut http::response::Parts,
        body: Option<&ErrorBody>,
        carried: &mut Carried,
    ) -> Judged {
        if body.is_some_and(|b| b.signal == BodySignal::QuotaExhausted) {
            return Judged::Pass;
        }
        let retry_after = parse_retry_after(&head.headers, SystemTime::now());
        if !self
            .config
            .source
            .rate_limited(&self.credential, retry_after)
        {
            // No key left to move to: the layers outside learn that this rate limit has
            // nowhere to wait (a fallback target may take it).
            carried.keys_resting = true;
            return Judged::Pass;
        }
        carried.rotations += 1;
        tracing::info!(
            key_index = self.credential.key_index(),
            retry_after_ms = retry_after.map(|d| d.as_millis() as u64),
            "API key rate-limited (429); re-sending at once with the next key"
        );
        Judged::Resend
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
