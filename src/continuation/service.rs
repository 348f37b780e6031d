use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use super::ContinuationBody;
use crate::body::ReplayBody;
use crate::error::BoxError;

/// Middleware that continues a non-streaming answer stopped at the output limit with
/// append-only follow-ups, and returns one stitched response.
///
/// Built by [`ContinuationLayer`](super::ContinuationLayer); see the
/// [module docs](crate::continuation). Errors of the inner service pass through untouched
/// (on the first request; a follow-up's error ends the continuation with what it has); the
/// layer's own (body errors when it buffers the request) are an [`Error`](crate::Error), boxed.
#[derive(Clone, Debug)]
pub struct Continuation<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Continuation<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        Continuation { inner, config }
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

impl<S, B, ResBody> Service<Request<B>> for Continuation<S>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ContinuationBody<ResBody>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(inner, self.config.clone(), req)
    }
}
