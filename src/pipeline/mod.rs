//! One attempt pipeline: how the companion layers inside a [`RetryLayer`](crate::RetryLayer)
//! leave their decisions to its loop instead of keeping a request of their own.
//!
//! Outside a retry loop, each companion buffers the body, keeps a copy of the request and
//! reads error bodies itself, so that it can re-send on its own. Inside one, the loop already
//! holds the request, reads the error body once and classifies it, so a companion keeps
//! nothing: it edits the request on the way in, and on the way out it asks the loop, through
//! an [`Asks`] extension on the response, what it would have done itself:
//!
//! - [`Judged::Resend`]: send the same attempt again, at once (a fresh credential, the next
//!   pool key, a repaired `max_tokens`). Not a retry: no backoff, no budget, no new attempt
//!   number, and the fleet does not learn from the answer it replaces.
//! - [`Judged::Final`]: end the request with this error (a signal to switch models).
//! - [`Judged::Keep`]: return this response without a retry, whatever the classifier says
//!   (an overload from the last model of a fallback chain).
//! - [`Judged::Step`]: the next attempt goes one target further down the fallback chain, so
//!   the failing target's `Retry-After` does not apply to it.
//!
//! What the loop carries from one send to the next for them travels in [`Carried`], a
//! request extension set only once there is something to carry: the success path of a
//! request sets none. It includes every failed attempt of the request ([`Failed`]), so that
//! a layer learns about failures it never saw a response for (a transport error, a head
//! timeout, an idle stall after a `200`) and can decide from them at the next attempt.
//!
//! The machinery the loop and the companions share lives here too, so that none of them
//! depends on another: the response body every layer returns ([`RetryBody`], with the bounded
//! peek and the idle timer), the [`AttemptContext`] extension, the peek limit.
//!
//! The loop also ends a request at once, before any classifier runs, when an inner layer
//! fails with one of this crate's final errors ([`Error::is_final`]): a credential that could
//! not be had, a signal to switch models. A custom [`Classify`](crate::classify::Classify) cannot retry
//! them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use tower_service::Service;

use crate::body::ReplayBody;
use crate::classify::FailureClass;
use crate::error::Error;
use crate::provider::error_body::ErrorBody;

pub(crate) mod body;

pub use self::body::RetryBody;
pub(crate) use self::sealed::HttpResponse;

/// The default bound on how much of an error body is read to classify it.
pub const DEFAULT_PEEK_LIMIT: usize = 64 * 1024;

// Defined here, as part of what the loop carries from one send to the next (`Carried`), and
// re-exported from `overflow`.
/// Response extension: what [`ContextOverflowLayer`](crate::ContextOverflowLayer) changed
/// before the re-send that produced this response.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OverflowRepaired {
    /// `max_tokens` was lowered to fit the context window.
    MaxTokens {
        /// The value the caller sent.
        from: u64,
        /// The value re-sent.
        to: u64,
    },
    /// The request was re-sent to the
    /// [context-window fallback](crate::ContextOverflowLayer::context_window_fallback) model.
    Model {
        /// The model the caller asked for.
        from: String,
        /// The model re-sent to.
        to: String,
    },
}

/// Request extension set on every attempt, for the layers inside [`RetryLayer`](crate::RetryLayer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptContext {
    /// This attempt's number: 1 for the first, 2 for the first retry, and so on (see
    /// [Attempt numbers](crate::retry#attempt-numbers)).
    pub attempt: u32,
    /// How the previous attempt failed, if there was one.
    pub previous: Option<FailureClass>,
    /// How many attempts in a row, just before this one, were overloaded.
    pub consecutive_overloads: u32,
    /// The most retries the policy allows this request.
    pub max_retries: u32,
    /// The loop carries state for the companion layers in a `Carried` extension too.
    pub(crate) carries: bool,
    /// The longest `Retry-After` the policy waits for.
    pub(crate) retry_after_max: Duration,
    /// This attempt's head timeout, as the loop arms it (cut to the deadline).
    pub(crate) head_timeout: Option<Duration>,
}

/// An inner service's error, with how far down its fallback chain `ModelFallbackLayer` sent
/// the attempt: what a response tells the loop in its `ModelUsed`, an error cannot. The loop
/// takes the level and goes on with the error itself, so nothing outside the loop sees this.
#[derive(Debug)]
pub(crate) struct AtLevel {
    pub(crate) level: u32,
    pub(crate) error: crate::error::BoxError,
}

impl fmt::Display for AtLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for AtLevel {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.error)
    }
}

mod sealed {
    /// Splits an `http::Response` so the retry loop can name its body type.
    pub trait HttpResponse {
        /// The body type.
        type Body;
        /// `http::Response::into_parts`.
        fn into_parts(self) -> (http::response::Parts, Self::Body);
    }

    impl<B> HttpResponse for http::Response<B> {
        type Body = B;
        fn into_parts(self) -> (http::response::Parts, B) {
            http::Response::into_parts(self)
        }
    }
}

/// The response body type of an inner service, named through [`HttpResponse`].
pub(crate) type ResBodyOf<S> =
    <<S as Service<Request<ReplayBody>>>::Response as HttpResponse>::Body;

/// Request extension: what the retry loop carries from one send of a request to the next for
/// the companion layers inside it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Carried {
    /// AuthLayer: this attempt was re-sent with a fresh credential after a `401`.
    pub(crate) refreshed: bool,
    /// AuthLayer: pool keys rotated away from after a `429`, in this attempt.
    pub(crate) rotations: u32,
    /// ContextOverflowLayer: the repair every later send of the request carries.
    pub(crate) repair: Option<OverflowRepaired>,
    /// Every failed attempt of the request so far, in order (ModelFallbackLayer replays them
    /// through its triggers to know where the next attempt goes).
    pub(crate) failures: Vec<Failed>,
    /// AuthLayer, for the judges outside it in the same question: every key of the pool
    /// rests, so a rate limit has nowhere to wait. Never carried to the next send.
    pub(crate) keys_resting: bool,
}

/// One failed attempt, as the loop saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Failed {
    /// The classifier's class.
    pub(crate) class: FailureClass,
    /// A head timeout, an idle stall before the commit point, or a `408`.
    pub(crate) timed_out: bool,
    /// A rate limit with nowhere to wait: a `Retry-After` above the policy's ceiling, or every
    /// key of a pool resting.
    pub(crate) unwaitable: bool,
    /// How far down its fallback chain ModelFallbackLayer sent the attempt, when a response
    /// came back through it.
    pub(crate) level: Option<u32>,
}

impl Carried {
    /// A new attempt (not a re-send of the same one): what was per attempt starts over.
    pub(crate) fn next_attempt(&mut self) {
        self.refreshed = false;
        self.rotations = 0;
    }

    /// Records a failed attempt.
    pub(crate) fn note_failure(&mut self, failed: Failed) {
        self.failures.push(failed);
    }
}

/// Where a companion layer's request comes from.
pub(crate) enum Inside {
    /// A retry loop: the companion keeps nothing and asks the loop.
    Loop(Carried),
    /// No loop around it: it buffers, keeps a copy and re-sends itself.
    Alone,
}

impl Inside {
    /// Reads where `parts` comes from.
    pub(crate) fn of(parts: &http::request::Parts) -> Self {
        match parts.extensions.get::<AttemptContext>() {
            None => Inside::Alone,
            Some(ctx) if ctx.carries => Inside::Loop(
                parts
                    .extensions
                    .get::<Carried>()
                    .cloned()
                    .unwrap_or_default(),
            ),
            Some(_) => Inside::Loop(Carried::default()),
        }
    }
}

/// A companion's question to the loop about one response.
pub(crate) trait Judge: Send + Sync + 'static {
    /// Whether the error body must be read before [`judge`](Judge::judge).
    fn wants_body(&self, head: &http::response::Parts) -> bool;

    /// Decides, with the error body the loop read (when it read one), what the companion
    /// would have done. `carried` is what the next send will carry.
    fn judge(
        &self,
        head: &mut http::response::Parts,
        body: Option<&ErrorBody>,
        carried: &mut Carried,
    ) -> Judged;
}

/// What a companion asks of the loop.
pub(crate) enum Judged {
    /// Nothing: the loop goes on as the classifier says.
    Pass,
    /// Send the same attempt again, at once.
    Resend,
    /// End the request with this error.
    Final(Error),
    /// Return this response without a retry.
    Keep,
    /// Go on as the classifier says, without the failed response's `Retry-After`: the next
    /// attempt goes one target down the fallback chain.
    Step,
}

/// Response extension: the questions of the companions a response passed through, innermost
/// first.
#[derive(Clone, Default)]
pub(crate) struct Asks(Vec<Arc<dyn Judge>>);

impl Asks {
    /// Adds `judge` to the questions on `res`.
    pub(crate) fn push(extensions: &mut http::Extensions, judge: Arc<dyn Judge>) {
        match extensions.get_mut::<Asks>() {
            Some(asks) => asks.0.push(judge),
            None => {
                extensions.insert(Asks(vec![judge]));
            }
        }
    }

    pub(crate) fn wants_body(&self, head: &http::response::Parts) -> bool {
        self.0.iter().any(|j| j.wants_body(head))
    }

    /// Asks each in turn; the first answer other than [`Judged::Pass`] or [`Judged::Step`]
    /// is the answer, and a step is kept unless another answer ends the question.
    pub(crate) fn judge(
        &self,
        head: &mut http::response::Parts,
        body: Option<&ErrorBody>,
        carried: &mut Carried,
    ) -> Judged {
        let mut answer = Judged::Pass;
        for judge in &self.0 {
            match judge.judge(head, body, carried) {
                Judged::Pass => {}
                Judged::Step => answer = Judged::Step,
                other => return other,
            }
        }
        answer
    }
}

impl fmt::Debug for Asks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Asks").field("len", &self.0.len()).finish()
    }
}
