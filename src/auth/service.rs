use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use crate::body::ReplayBody;
use crate::error::BoxError;

/// Middleware that puts a credential on every request, refreshes it once on `401`, and moves
/// to another key of a pool on a rate limit.
///
/// Built by [`AuthLayer`](super::AuthLayer); see the [module docs](crate::auth). Errors of
/// the inner service pass through untouched (boxed); the layer's own,
/// [`ErrorKind::TokenRefresh`](crate::ErrorKind::TokenRefresh), is an [`Error`](crate::Error),
/// boxed. Responses are the inner service's, with an [`AuthOutcome`](super::AuthOutcome)
/// extension when the layer re-sent or used a pool.
#[derive(Clone, Debug)]
pub struct Auth<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Auth<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        Auth { inner, config }
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

impl<S, ResBody> Service<Request<ReplayBody>> for Auth<S>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = BoxError;
    type Future = ResponseFuture<S>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    #[inline]
    fn call(&mut self, req: Request<ReplayBody>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(inner, self.config.clone(), req)
    }
}
