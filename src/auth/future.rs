use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::Config;
use super::{AuthOutcome, Credential, CredentialFuture, TokenSource};
use crate::body::ReplayBody;
use crate::classify::FailureClass;
use crate::error::{BoxError, Error, ErrorKind};
use crate::pipeline::{AttemptContext, Carried, Companion, Judged, Link, Question};

/// A bound on re-sends after rate limits, for sources that keep saying another key is free.
const MAX_ROTATIONS: u32 = 16;

/// Request extension: the credential source of the fallback target this request goes to,
/// used by [`AuthLayer`](crate::AuthLayer) instead of its own.
#[derive(Clone)]
pub(crate) struct TargetCredential(pub(crate) Arc<dyn TokenSource>);

pin_project! {
    /// The response future of [`Auth`](super::Auth).
    pub struct ResponseFuture<S>
    where
        S: Service<Request<ReplayBody>>,
    {
        #[pin]
        kind: Kind<S>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<S>
    where
        S: Service<Request<ReplayBody>>,
    {
        // The credential is being fetched (not ready at once). Boxed: the request waits here
        // only while a token is refreshed.
        Fetching { pending: Box<Pending<S>> },
        // One send, and a question to the loop about a `401` or `429`.
        Calling { #[pin] future: S::Future, keys: Keys },
    }
}

/// A send waiting for its credential.
struct Pending<S> {
    fetch: CredentialFuture,
    send: Option<(S, Request<ReplayBody>)>,
    keys: Keys,
}

/// What a send knows of its credential.
struct Keys {
    config: Arc<Config>,
    /// The retry loop's handle for this send; none outside a loop.
    link: Option<Link>,
    credential: Option<Credential>,
    refreshed: bool,
    rotations: u32,
    /// The request carried a header that can itself cause a `401`.
    request_scoped: bool,
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
        self.request_scoped = self.config.source.blames_request(req.headers());
        credential.apply(req.headers_mut());
        self.credential = Some(credential);
        service.call(req)
    }

    /// The response handed back, with what the layer did; its question to the loop is left
    /// on the link.
    fn finish<R>(&self, mut res: Response<R>) -> Response<R> {
        let key_index = self.credential.as_ref().and_then(Credential::key_index);
        if self.refreshed || self.rotations > 0 || key_index.is_some() {
            res.extensions_mut().insert(AuthOutcome {
                refreshed: self.refreshed,
                rotations: self.rotations,
                key_index,
            });
        }
        self.ask_loop(&res);
        res
    }

    /// What to ask the loop about this response. After a `401`, the source is told at once,
    /// and a fresh credential means a re-send; after a `429`, the key rests and the next one
    /// is tried, unless the loop classified it as an exhausted quota.
    fn ask_loop<R>(&self, res: &Response<R>) {
        let Some(credential) = self.credential.clone() else {
            return;
        };
        match res.status() {
            // Maybe the request's doing, not the key's: the key is judged on another request.
            StatusCode::UNAUTHORIZED if self.request_scoped => {
                tracing::info!(
                    key_index = credential.key_index(),
                    "401 to a request carrying a header that can cause it; no key set aside"
                );
            }
            StatusCode::UNAUTHORIZED => {
                let fresh = self.config.source.invalidate(&credential);
                if let (true, false, Some(link)) = (fresh, self.refreshed, &self.link) {
                    link.ask(Refresh(credential));
                }
            }
            StatusCode::TOO_MANY_REQUESTS
                if self.config.source.rotates() && self.rotations < MAX_ROTATIONS =>
            {
                if let Some(link) = &self.link {
                    link.ask(Rotate {
                        config: self.config.clone(),
                        credential,
                    });
                }
            }
            _ => {}
        }
    }
}

impl<S> ResponseFuture<S>
where
    S: Service<Request<ReplayBody>>,
{
    #[inline]
    pub(crate) fn new(service: S, config: Arc<Config>, req: Request<ReplayBody>) -> Self {
        // A fallback target on another upstream brings its own credential source.
        let config = match req.extensions().get::<TargetCredential>() {
            Some(TargetCredential(source)) => Arc::new(Config {
                source: source.clone(),
            }),
            None => config,
        };
        let link = AttemptContext::link_of(req.extensions()).cloned();
        let (refreshed, rotations) = link.as_ref().map_or((false, 0), |link| {
            let Carried {
                refreshed,
                rotations,
                ..
            } = link.carried();
            (*refreshed, *rotations)
        });
        let mut keys = Keys {
            config,
            link,
            credential: None,
            refreshed,
            rotations,
            request_scoped: false,
        };
        let mut fetch = keys.config.source.credential();
        let kind = match fetch.try_ready() {
            // The service was polled ready before `call`.
            Some(Ok(credential)) => Kind::Calling {
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
        ResponseFuture { kind }
    }
}

impl<S, ResBody> Future for ResponseFuture<S>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<Response<ResBody>, BoxError>;

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
                            link: None,
                            credential: None,
                            refreshed: false,
                            rotations: 0,
                            request_scoped: false,
                        },
                    );
                    // The service was polled ready before `call`, and nothing else used it.
                    let future = keys.send(service, req, credential);
                    self.as_mut()
                        .project()
                        .kind
                        .set(Kind::Calling { future, keys });
                }
                KindProj::Calling { future, keys } => {
                    let res = ready!(future.poll(cx)).map_err(Into::into)?;
                    return Poll::Ready(Ok(keys.finish(res)));
                }
            }
        }
    }
}

impl<S> std::fmt::Debug for ResponseFuture<S>
where
    S: Service<Request<ReplayBody>>,
{
    // Never the request head or the credential.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = match &self.kind {
            Kind::Fetching { pending } => &pending.keys,
            Kind::Calling { keys, .. } => keys,
        };
        f.debug_struct("ResponseFuture")
            .field("refreshed", &keys.refreshed)
            .field("rotations", &keys.rotations)
            .finish_non_exhaustive()
    }
}

/// A `401` with a fresh credential to hand: re-send once.
struct Refresh(Credential);

impl Companion for Refresh {
    fn judge(&self, q: &mut Question<'_>) -> Judged {
        q.carried.refreshed = true;
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

impl Companion for Rotate {
    fn judge(&self, q: &mut Question<'_>) -> Judged {
        // An exhausted quota is the account's, not the key's: no other key helps.
        if q.class.class() == Some(FailureClass::QuotaExhausted) {
            return Judged::Pass;
        }
        // The loop's reading of the wait: an HTTP-date against the response's `Date`.
        let retry_after = q.class.retry_after();
        if !self
            .config
            .source
            .rate_limited(&self.credential, retry_after)
        {
            // No key left to move to: the layers outside learn that this rate limit has
            // nowhere to wait (a fallback target may take it).
            q.keys_resting = true;
            return Judged::Pass;
        }
        q.carried.rotations += 1;
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
