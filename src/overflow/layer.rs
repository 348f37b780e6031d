use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::ContextOverflow;

/// Applies [`ContextOverflow`] to a service: a request whose `max_tokens` does not fit
/// the context window is re-sent once with a smaller one. See the
/// [module docs](crate::overflow).
#[derive(Clone)]
#[must_use]
pub struct ContextOverflowLayer {
    pub(crate) config: Config,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) floor: u64,
    pub(crate) margin: u64,
    pub(crate) context_window_fallback: Option<String>,
}

impl ContextOverflowLayer {
    /// A layer with the default floor (3,000 tokens) and margin (1,000 tokens).
    pub fn new() -> Self {
        ContextOverflowLayer {
            config: Config {
                floor: 3_000,
                margin: 1_000,
                context_window_fallback: None,
            },
        }
    }

    /// The least `max_tokens` a repair sends: an answer shorter than this is not worth having.
    /// When even this much does not fit, the request is not re-sent with a smaller
    /// `max_tokens`. A repair sends at least 1 whatever the floor. Defaults to 3,000.
    pub fn floor(mut self, tokens: u64) -> Self {
        self.config.floor = tokens;
        self
    }

    /// Tokens kept free below the context limit, since token counts vary a little from one
    /// request to the next. Defaults to 1,000.
    pub fn margin(mut self, tokens: u64) -> Self {
        self.config.margin = tokens;
        self
    }

    /// A model with a larger context window, tried once when the overflow cannot be repaired
    /// by lowering `max_tokens` (the prompt itself is too long). Defaults to none.
    pub fn context_window_fallback(mut self, model: impl Into<String>) -> Self {
        self.config.context_window_fallback = Some(model.into());
        self
    }
}

impl Default for ContextOverflowLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for ContextOverflowLayer {
    type Service = ContextOverflow<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ContextOverflow::from_config(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for ContextOverflowLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextOverflowLayer")
            .field("floor", &self.floor)
            .field("margin", &self.margin)
            .field("context_window_fallback", &self.context_window_fallback)
            .finish()
    }
}
