use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use crate::body::ReplayBody;

/// Middleware that moves a request to the next model of a chain once the current one has
/// been overloaded several times in a row.
///
/// Built by [`ModelFallbackLayer`](super::ModelFallbackLayer); see the
/// [module docs](crate::fallback). The inner service's responses (with a
/// [`ModelUsed`](super::ModelUsed) extension) and errors pass through untouched; a
/// switch of model is asked of the retry loop, which re-sends, or ends the request with
/// [`ErrorKind::FallbackTriggered`](crate::ErrorKind::FallbackTriggered).
#[derive(Clone, Debug)]
pub struct ModelFallback<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> ModelFallback<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        ModelFallback { inner, config }
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

impl<S, ResBody> Service<Request<ReplayBody>> for ModelFallback<S>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    #[inline]
    fn call(&mut self, req: Request<ReplayBody>) -> Self::Future {
        ResponseFuture::new(&mut self.inner, self.config.clone(), req)
    }
}
