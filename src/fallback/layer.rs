use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tower_layer::Layer;

use super::{FallbackMode, ModelFallback};
use crate::body::DEFAULT_BODY_LIMIT;
use crate::retry::{ConfigError, DEFAULT_PEEK_LIMIT};

/// Applies [`ModelFallback`] to a service: after a number of consecutive overloads, the next
/// attempt goes to the next model of a chain. See the [module docs](crate::fallback).
///
/// All clones of one layer, and every service it builds, share one sticky state.
#[derive(Clone)]
#[must_use]
pub struct ModelFallbackLayer {
    pub(crate) config: Config,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) chain: Arc<[String]>,
    pub(crate) threshold: u32,
    pub(crate) sticky: Option<Duration>,
    pub(crate) mode: FallbackMode,
    pub(crate) body_limit: usize,
    pub(crate) peek_limit: usize,
    pub(crate) state: Arc<Sticky>,
}

impl ModelFallbackLayer {
    /// A layer falling back along `chain`, in order. Fails when the chain is empty or names
    /// an empty model.
    pub fn new<I, M>(chain: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = M>,
        M: Into<String>,
    {
        let chain: Vec<String> = chain.into_iter().map(Into::into).collect();
        if chain.is_empty() {
            return Err(ConfigError::new("the fallback chain names no model"));
        }
        if chain.iter().any(String::is_empty) {
            return Err(ConfigError::new("the fallback chain names an empty model"));
        }
        Ok(ModelFallbackLayer {
            config: Config {
                chain: chain.into(),
                threshold: 3,
                sticky: None,
                mode: FallbackMode::Rewrite,
                body_limit: DEFAULT_BODY_LIMIT,
                peek_limit: DEFAULT_PEEK_LIMIT,
                state: Arc::new(Sticky::default()),
            },
        })
    }

    /// How many consecutive overloads of one request move it to the next model; at least 1.
    /// Defaults to 3.
    pub fn threshold(mut self, n: u32) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::new(
                "the fallback threshold must be at least 1",
            ));
        }
        self.config.threshold = n;
        Ok(self)
    }

    /// Sticky mode: once a request of a model has fallen back, later requests for that model
    /// start at the same fallback for `cooldown`, and only then try the requested model again.
    /// Only in [`FallbackMode::Rewrite`]. Defaults to off.
    pub fn sticky(mut self, cooldown: Duration) -> Self {
        self.config.sticky = Some(cooldown);
        self
    }

    /// Whether to rewrite the model or signal the caller. Defaults to
    /// [`FallbackMode::Rewrite`].
    pub fn mode(mut self, mode: FallbackMode) -> Self {
        self.config.mode = mode;
        self
    }

    /// The most request-body bytes buffered when the layer is used without `RetryLayer`
    /// around it; a larger body passes through untouched. Defaults to 32 MiB.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// The most bytes of an error body read to tell whether it is an overload; the caller
    /// still receives the whole body. Defaults to 64 KiB.
    pub fn peek_limit(mut self, bytes: usize) -> Self {
        self.config.peek_limit = bytes;
        self
    }
}

impl<S> Layer<S> for ModelFallbackLayer {
    type Service = ModelFallback<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ModelFallback::from_config(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for ModelFallbackLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelFallbackLayer")
            .field("chain", &self.chain)
            .field("threshold", &self.threshold)
            .field("sticky", &self.sticky)
            .field("mode", &self.mode)
            .field("body_limit", &self.body_limit)
            .field("peek_limit", &self.peek_limit)
            .finish()
    }
}

impl Config {
    /// The models a request for `model` falls back to, in order.
    pub(crate) fn fallbacks_for(&self, model: &str) -> &[String] {
        match self.chain.iter().position(|m| m == model) {
            Some(i) => &self.chain[i + 1..],
            None => &self.chain,
        }
    }
}

/// Which fallback each requested model is held at, and until when.
#[derive(Default)]
pub(crate) struct Sticky {
    levels: Mutex<HashMap<String, (usize, Instant)>>,
    // Whether the layer has warned that it runs outside `RetryLayer`.
    warned_outside: AtomicBool,
}

impl Sticky {
    /// Warns, once per layer, that a request came with no `AttemptContext`: the layer is not
    /// inside `RetryLayer`, so it never sees an overload count and never falls back.
    pub(crate) fn warn_outside_once(&self) {
        if !self.warned_outside.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "ModelFallbackLayer saw a request without an AttemptContext: it must sit inside \
                 RetryLayer to count overloads; until then it does not fall back as configured"
            );
        }
    }

    /// How far down its chain requests for `model` start now; 0 for the model itself.
    pub(crate) fn level(&self, model: &str, now: Instant) -> usize {
        let mut levels = self.levels.lock().unwrap_or_else(PoisonError::into_inner);
        match levels.get(model) {
            Some(&(level, until)) if until > now => level,
            Some(_) => {
                levels.remove(model);
                0
            }
            None => 0,
        }
    }

    /// Holds requests for `model` at `level` or further until `until`.
    pub(crate) fn raise(&self, model: &str, level: usize, until: Instant) {
        let mut levels = self.levels.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = levels.entry(model.to_owned()).or_insert((0, until));
        entry.0 = entry.0.max(level);
        entry.1 = until;
    }
}
