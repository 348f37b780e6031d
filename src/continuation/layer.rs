use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::{Continuation, DEFAULT_PROMPT};
use crate::body::DEFAULT_BODY_LIMIT;

/// The default bound on a response body read to judge and stitch it: 16 MiB.
const DEFAULT_RESPONSE_LIMIT: usize = 16 * 1024 * 1024;

/// Applies [`Continuation`] to a service: a non-streaming answer that stopped at the output
/// limit is continued with append-only follow-ups and handed back as one response. See the
/// [module docs](crate::continuation).
#[derive(Clone)]
#[must_use]
pub struct ContinuationLayer {
    pub(crate) config: Config,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) max_rounds: u32,
    pub(crate) prompt: Arc<str>,
    pub(crate) body_limit: usize,
    pub(crate) response_limit: usize,
}

impl ContinuationLayer {
    /// A layer with at most 3 follow-ups and the [default prompt](DEFAULT_PROMPT).
    pub fn new() -> Self {
        ContinuationLayer {
            config: Config {
                max_rounds: 3,
                prompt: Arc::from(DEFAULT_PROMPT),
                body_limit: DEFAULT_BODY_LIMIT,
                response_limit: DEFAULT_RESPONSE_LIMIT,
            },
        }
    }

    /// The most follow-ups sent for one request; a model that keeps stopping at the limit
    /// costs at most `rounds + 1` requests. `0` turns continuation off (truncated tool calls
    /// are still marked). Defaults to 3.
    pub fn max_rounds(mut self, rounds: u32) -> Self {
        self.config.max_rounds = rounds;
        self
    }

    /// The text of the user turn that asks for the rest of the answer. An empty prompt turns
    /// continuation off. Defaults to [`DEFAULT_PROMPT`].
    pub fn prompt(mut self, text: impl Into<String>) -> Self {
        self.config.prompt = Arc::from(text.into());
        self
    }

    /// The most request-body bytes buffered; a larger body passes through once, untouched and
    /// never continued. Defaults to 32 MiB.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// The most bytes of a successful response read to judge and stitch it; a larger answer
    /// is handed on as it streams, not continued. Defaults to 16 MiB.
    pub fn response_limit(mut self, bytes: usize) -> Self {
        self.config.response_limit = bytes;
        self
    }
}

impl Default for ContinuationLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for ContinuationLayer {
    type Service = Continuation<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Continuation::from_config(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for ContinuationLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContinuationLayer")
            .field("max_rounds", &self.max_rounds)
            .field("prompt", &self.prompt)
            .field("body_limit", &self.body_limit)
            .field("response_limit", &self.response_limit)
            .finish()
    }
}
