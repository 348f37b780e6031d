use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::{Auth, TokenSource};

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
}

impl AuthLayer {
    /// A layer taking its credentials from `source`.
    pub fn new(source: impl TokenSource) -> Self {
        AuthLayer {
            config: Config {
                source: Arc::new(source),
            },
        }
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
            .finish_non_exhaustive()
    }
}
