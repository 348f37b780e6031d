use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use super::{RetryBody, RetryLayer};
use crate::body::ReplayBody;
use crate::classify::{Classify, DefaultClassifier};
use crate::error::{BoxError, Error, ErrorKind};
use crate::pipeline::Link;

/// Middleware that buffers each request body once and retries failed attempts.
///
/// Built by [`RetryLayer`]; see the [module docs](crate::retry).
pub struct Retry<S, C = DefaultClassifier> {
    inner: S,
    config: Arc<Config<C>>,
    // The handle for the companion layers this service last gave a request: the next
    // request takes it again once that one is done, with no lock and no allocation.
    spare: Option<Link>,
}

impl<S> Retry<S> {
    /// Wraps `inner` with the default policy and classifier.
    pub fn new(inner: S) -> Self {
        Self::from_config(inner, Arc::new(RetryLayer::new().config))
    }

    /// A [`RetryLayer`] with the defaults, to configure.
    pub fn layer() -> RetryLayer {
        RetryLayer::new()
    }
}

impl<S, C> Retry<S, C> {
    pub(crate) fn from_config(inner: S, config: Arc<Config<C>>) -> Self {
        Retry {
            inner,
            config,
            spare: None,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, C> Clone for Retry<S, C> {
    fn clone(&self) -> Self {
        // A clone's requests have their own handles.
        Retry {
            inner: self.inner.clone(),
            config: self.config.clone(),
            spare: None,
        }
    }
}

impl<S: fmt::Debug, C: fmt::Debug> fmt::Debug for Retry<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, C, B, ResBody> Service<Request<B>> for Retry<S, C>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    C: Classify,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<RetryBody<ResBody>>;
    type Error = Error;
    type Future = ResponseFuture<S, B, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| Error::new(ErrorKind::Service).with_source(e))
    }

    #[inline]
    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The clone that was polled ready goes with this request; the fresh clone stays here
        // and is polled ready for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let link = match self.spare.take() {
            Some(mut link) => match link.reuse() {
                true => link,
                false => self.config.links.take(),
            },
            None => self.config.links.take(),
        };
        self.spare = Some(link.clone());
        ResponseFuture::new(inner, self.config.clone(), req, Some(link))
    }
}
