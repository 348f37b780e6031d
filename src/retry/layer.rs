use std::fmt;
use std::sync::Arc;

use http::HeaderName;
use tokio_util::sync::CancellationToken;
use tower_layer::Layer;

use super::{Retry, RetryObserver, RetryPolicy};
use crate::body::DEFAULT_BODY_LIMIT;
use crate::classify::DefaultClassifier;
use crate::fleet::Fleet;
use crate::pipeline::{Links, DEFAULT_PEEK_LIMIT};

/// Applies [`Retry`] to a service: buffers each request body once and retries failed
/// attempts of LLM API calls. See the [module docs](crate::retry).
#[derive(Clone)]
#[must_use]
pub struct RetryLayer<C = DefaultClassifier> {
    pub(crate) config: Config<C>,
}

#[derive(Clone)]
pub(crate) struct Config<C> {
    pub(crate) policy: RetryPolicy,
    pub(crate) classifier: C,
    pub(crate) body_limit: usize,
    pub(crate) peek_limit: usize,
    pub(crate) cancel: Option<CancellationToken>,
    pub(crate) observer: Option<Arc<dyn RetryObserver>>,
    pub(crate) retry_count_header: Option<HeaderName>,
    pub(crate) sse_gate: bool,
    pub(crate) stream_end_check: bool,
    pub(crate) buffer_responses: Option<usize>,
    /// Shared by every service made from this layer and its clones, and by every other layer
    /// given a clone of it.
    pub(crate) fleet: Fleet,
    /// The handles for the companion layers, kept from one request to the next.
    pub(crate) links: Links,
}

impl RetryLayer {
    /// A layer with the [default policy](RetryPolicy::default) and the
    /// [default classifier](DefaultClassifier).
    pub fn new() -> Self {
        RetryLayer {
            config: Config {
                policy: RetryPolicy::default(),
                classifier: DefaultClassifier::new(),
                body_limit: DEFAULT_BODY_LIMIT,
                peek_limit: DEFAULT_PEEK_LIMIT,
                cancel: None,
                observer: None,
                retry_count_header: None,
                sse_gate: true,
                stream_end_check: true,
                buffer_responses: None,
                fleet: Fleet::default(),
                links: Links::default(),
            },
        }
    }
}

impl Default for RetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> RetryLayer<C> {
    /// The retry policy. Defaults to [`RetryPolicy::default`].
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.config.policy = policy;
        self
    }

    /// The classifier that judges each attempt. Defaults to [`DefaultClassifier`].
    pub fn classifier<C2>(self, classifier: C2) -> RetryLayer<C2> {
        let c = self.config;
        RetryLayer {
            config: Config {
                policy: c.policy,
                classifier,
                body_limit: c.body_limit,
                peek_limit: c.peek_limit,
                cancel: c.cancel,
                observer: c.observer,
                retry_count_header: c.retry_count_header,
                sse_gate: c.sse_gate,
                stream_end_check: c.stream_end_check,
                buffer_responses: c.buffer_responses,
                fleet: c.fleet,
                links: Links::default(),
            },
        }
    }

    /// The most request-body bytes buffered for replay. A body whose size hint says up front
    /// that it is larger is passed through once, unbuffered and never retried; one that only
    /// turns out larger while it is read fails with
    /// [`ErrorKind::BodyTooLarge`](crate::ErrorKind::BodyTooLarge) before anything is sent.
    /// Defaults to 32 MiB, Anthropic's request limit.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// The most bytes of an error response body read to classify it. The caller still
    /// receives the whole body. Defaults to 64 KiB.
    pub fn peek_limit(mut self, bytes: usize) -> Self {
        self.config.peek_limit = bytes;
        self
    }

    /// A shutdown signal: once `token` is cancelled, pending retries end at once with
    /// [`ErrorKind::Cancelled`](crate::ErrorKind::Cancelled) and no new retry starts.
    /// Attempts already in flight are left to finish. Defaults to none.
    pub fn cancellation(mut self, token: CancellationToken) -> Self {
        self.config.cancel = Some(token);
        self
    }

    /// Hooks called on every retry, recovery and give-up. Defaults to none.
    pub fn observer(mut self, observer: impl RetryObserver) -> Self {
        self.config.observer = Some(Arc::new(observer));
        self
    }

    /// Sends, in this request header, how many retries came before the attempt: 0 on the
    /// first attempt, 1 on the second, and so on (attempt number − 1), as the official SDKs
    /// do with `x-stainless-retry-count`. Defaults to none.
    pub fn retry_count_header(mut self, name: HeaderName) -> Self {
        self.config.retry_count_header = Some(name);
        self
    }

    /// The [`Fleet`] whose retry budget, cooldown gate and pacing this layer's requests
    /// share, with every other layer (or middleware) given a clone of it. See
    /// [`fleet`](crate::fleet). Defaults to a fleet of the layer's own,
    /// [`Fleet::default`] (the default budget, cooldown gate and dormant pacing, a state per
    /// upstream and credential), built with the layer and shared by its services and its
    /// clones.
    pub fn fleet(mut self, fleet: Fleet) -> Self {
        self.config.fleet = fleet;
        self
    }

    /// The fleet this layer's requests share, to read its state or hand it on.
    pub fn get_fleet(&self) -> &Fleet {
        &self.config.fleet
    }
}

impl<C> RetryLayer<C> {
    /// Whether `text/event-stream` responses are held back until their first event with
    /// visible output, so that an in-band error before it can be retried (see
    /// [`stream`](crate::stream)). Defaults to true.
    pub fn sse_gate(mut self, on: bool) -> Self {
        self.config.sse_gate = on;
        self
    }

    /// Whether a `text/event-stream` response of a known protocol (Anthropic Messages, OpenAI
    /// Chat Completions, OpenAI Responses) must reach its terminal event (`message_stop` or a
    /// `message_delta` with a `stop_reason`, a chunk with a `finish_reason`,
    /// `response.completed` …; the table is in [`stream`](crate::stream#protocols)) before its
    /// body may end: a clean
    /// end before it, which a cutting hop produces, is then an
    /// [`ErrorKind::IncompleteStream`](crate::ErrorKind::IncompleteStream) body error after
    /// the commit point (the caller's stream raises instead of ending) and is retried like a
    /// reset before it. Streams of other protocols pass through as they are. The check
    /// follows the events incrementally and copies no bytes. Defaults to true.
    pub fn stream_end_check(mut self, on: bool) -> Self {
        self.config.stream_end_check = on;
        self
    }

    /// Reads successful non-streaming response bodies whole, up to `cap` bytes, inside the
    /// retry loop: a body that fails or ends short (reset mid-body, content-length mismatch)
    /// is then retried as [`FailureClass::TruncatedEnvelope`](crate::classify::FailureClass)
    /// instead of failing in the caller's hands, and JSON that stopped at the output limit gets an
    /// [`OutputTruncated`](crate::stream::OutputTruncated) extension. A body larger than `cap`
    /// is handed on as it streams. Defaults to `None` (bodies stream through untouched).
    pub fn buffer_responses(mut self, cap: Option<usize>) -> Self {
        self.config.buffer_responses = cap;
        self
    }
}

impl<S, C: Clone> Layer<S> for RetryLayer<C> {
    type Service = Retry<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry::from_config(inner, Arc::new(self.config.clone()))
    }
}

impl<C: fmt::Debug> fmt::Debug for RetryLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl<C: fmt::Debug> fmt::Debug for Config<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("policy", &self.policy)
            .field("classifier", &self.classifier)
            .field("body_limit", &self.body_limit)
            .field("peek_limit", &self.peek_limit)
            .field("cancellation", &self.cancel.is_some())
            .field("observer", &self.observer.is_some())
            .field("retry_count_header", &self.retry_count_header)
            .field("sse_gate", &self.sse_gate)
            .field("stream_end_check", &self.stream_end_check)
            .field("buffer_responses", &self.buffer_responses)
            .field("fleet", &self.fleet)
            .finish()
    }
}
