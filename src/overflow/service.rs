use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use crate::body::ReplayBody;

/// Middleware that re-sends, once and at once, a request whose `max_tokens` does not fit the
/// context window, with a smaller `max_tokens`.
///
/// Built by [`ContextOverflowLayer`](super::ContextOverflowLayer); see the
/// [module docs](crate::overflow). An overflow it cannot repair goes back with a
/// [`ContextWindowExceeded`](super::ContextWindowExceeded) extension. The inner service's
/// responses and errors pass through untouched: the repair is the retry loop's re-send.
#[derive(Clone, Debug)]
pub struct ContextOverflow<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> ContextOverflow<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        ContextOverflow { inner, config }
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

impl<S, ResBody> Service<Request<ReplayBody>> for ContextOverflow<S>
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
