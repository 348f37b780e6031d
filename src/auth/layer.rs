use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::{Auth, TokenSource};
use crate::body::DEFAULT_BODY_LIMIT;
use crate::pipeline::DEFAULT_PEEK_LIMIT;

/// Applies [`Auth`] to a service: puts a credential on every request, refreshes it once on
/// `401`, and moves to another key of a pool on a rate limit. See the
/// [module docs](crate::auth).
///
/// All clones of one layer, and every service it builds, share one [`TokenSource`].
#[derive(Clone)]
#[must_use]
pub struct AuthLayer {
    pub(crate) config: Config,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) source: Arc<dyn TokenSource>,
    pub(crate) body_limit: usize,
    pub(crate) peek_limit: usize,
}

impl AuthLayer {
    /// A layer taking its credentials from `source`.
    pub fn new(source: impl TokenSource) -> Self {
        AuthLayer {
            config: Config {
                source: Arc::new(source),
                body_limit: DEFAULT_BODY_LIMIT,
                peek_limit: DEFAULT_PEEK_LIMIT,
            },
        }
    }

    /// The most request-body bytes buffered when the layer is used without `RetryLayer`
    /// around it; a larger body is sent once with its credential and never re-sent.
    /// Defaults to 32 MiB.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// The most bytes of a `429` body read to tell a rate limit from an exhausted quota, when
    /// the source rotates keys; the caller still receives the whole body. Defaults to 64 KiB.
    pub fn peek_limit(mut self, bytes: usize) -> Self {
        self.config.peek_limit = bytes;
        self
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Auth::from_config(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for AuthLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    // The source holds secrets: only its shape is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthLayer")
            .field("rotates", &self.source.rotates())
            .field("body_limit", &self.body_limit)
            .field("peek_limit", &self.peek_limit)
            .finish_non_exhaustive()
    }
}
