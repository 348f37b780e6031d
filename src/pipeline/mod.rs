//! The contract between the retry loop and the companion layers inside it.
//!
//! [`AuthLayer`](crate::AuthLayer), [`ModelFallbackLayer`](crate::ModelFallbackLayer) and
//! [`ContextOverflowLayer`](crate::ContextOverflowLayer) live inside a
//! [`RetryLayer`](crate::RetryLayer) and nowhere else: the loop holds the request, reads the
//! error body once, classifies it once and does every send. A companion keeps nothing of its
//! own. It edits each send on its way in, from what the loop carries for it, and for an
//! answer it has a say on it leaves a [`Companion`] on the attempt, which the loop asks once
//! it has classified the answer. That trait is the whole contract; its docs hold the one
//! ordering rule.
//!
//! Every send carries an [`AttemptContext`], and in it the [`Link`]: the one handle the loop
//! and the companions share for that send. The loop puts in it what it carries from one send
//! to the next ([`Carried`]); a companion puts in it its questions and, for
//! `ModelFallbackLayer`, how far down its chain it sent the attempt. The link travels with
//! the request, not with the response or the error, so a layer placed in between that maps
//! bodies or inspects errors changes nothing, and the inner service's errors reach the loop
//! as they were raised.
//!
//! A handle is one allocation, made once: a `Retry` service gives the next request the
//! handle its last request used, once that one is done, and keeps the handles of finished
//! requests for its clones ([`Links`]), so the path every request takes allocates nothing
//! for it.
//!
//! The machinery the loop and the companions share lives here too, so that none of them
//! depends on another: the response body the loop returns ([`RetryBody`], with the bounded
//! peek and the idle timer), the peek limit.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::Request;
use tower_service::Service;

use crate::body::ReplayBody;
use crate::classify::{Classification, FailureClass};
use crate::error::Error;

pub(crate) mod body;

pub use self::body::RetryBody;
pub(crate) use self::sealed::HttpResponse;

mod sealed {
    /// Splits an `http::Response` so a layer's future can name its inner body type.
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

/// The default bound on how much of an error body is read to classify it.
pub const DEFAULT_PEEK_LIMIT: usize = 64 * 1024;

// Defined here, as part of what the loop carries from one send to the next (`Carried`), and
// re-exported from `overflow`.
/// Response extension: what [`ContextOverflowLayer`](crate::ContextOverflowLayer) changed
/// before the re-send that produced this response.
#[cfg(feature = "overflow")]
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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// This attempt's head timeout, as the loop arms it (cut to the deadline).
    pub(crate) head_timeout: Option<Duration>,
    /// The handle the loop shares with the companion layers for this send.
    pub(crate) link: Option<Link>,
}

impl AttemptContext {
    /// The loop's handle for this send, from a request's extensions: `None` outside a loop.
    #[cfg(any(test, feature = "auth", feature = "overflow"))]
    pub(crate) fn link_of(extensions: &http::Extensions) -> Option<&Link> {
        extensions.get::<AttemptContext>()?.link.as_ref()
    }
}

/// A companion layer's question to the loop about one response: the one contract between
/// [`RetryLayer`](crate::RetryLayer)'s loop and the layers inside it.
///
/// A companion leaves one on the attempt's [`Link`] (with [`Link::ask`]) when its inner
/// service answers with a response it has a say on. Once the loop has read the error body
/// (when any companion or the classifier [wants it](Companion::wants_body)) and classified
/// the response, it asks every companion of that send in turn.
///
/// **Ordering.** Companions are asked in the order they asked, which is innermost first (an
/// inner layer's response future completes before the outer one's). The first answer other
/// than [`Judged::Pass`] or [`Judged::Step`] is the loop's answer and the companions further
/// out are not asked; a [`Judged::Step`] is kept unless such an answer comes after it. So a
/// credential refresh (`AuthLayer`, innermost) or an overflow repair wins over a fallback
/// step for the same response, and what an inner companion records in the [`Question`] (every
/// key of a pool resting) is there for the outer ones.
pub(crate) trait Companion: Send + Sync + 'static {
    /// Whether the loop must read the start of the error body for this question, beyond
    /// what the classifier asks for. Defaults to no.
    fn wants_body(&self, _head: &http::response::Parts) -> bool {
        false
    }

    /// Decides, from the loop's classification of the response, what the companion asks of
    /// the loop.
    fn judge(&self, question: &mut Question<'_>) -> Judged;

    /// Told, instead of [`judge`](Companion::judge), that the send failed with no response:
    /// the error as the inner service raised it. What comes next is the loop's alone.
    /// Defaults to nothing.
    fn failed(&self, _error: &(dyn std::error::Error + 'static)) {}
}

/// What a companion is asked about: one response, as the loop classified it.
// Its fields are read by the companions alone: a build without the ones that read a field
// still asks the same question.
pub(crate) struct Question<'a> {
    /// The response head; a companion may add extensions to it.
    #[cfg_attr(not(any(feature = "fallback", feature = "overflow")), allow(dead_code))]
    pub(crate) head: &'a mut http::response::Parts,
    /// The loop's classification of the response, with what it read of the error body.
    #[cfg_attr(
        not(any(feature = "auth", feature = "fallback", feature = "overflow")),
        allow(dead_code)
    )]
    pub(crate) class: &'a Classification,
    /// What the next send carries.
    #[cfg_attr(
        not(any(feature = "auth", feature = "fallback", feature = "overflow")),
        allow(dead_code)
    )]
    pub(crate) carried: &'a mut Carried,
    /// Every key of a pool rests, so a rate limit has nowhere to wait (`AuthLayer` says so
    /// for the companions outside it).
    pub(crate) keys_resting: bool,
    /// The longest `Retry-After` the policy waits for.
    #[cfg_attr(not(feature = "fallback"), allow(dead_code))]
    pub(crate) retry_after_max: Duration,
}

impl Question<'_> {
    /// The failure this response is, as the loop records it; `None` for a success.
    #[cfg(feature = "fallback")]
    pub(crate) fn failure(&self, level: Option<u32>) -> Option<Failed> {
        let class = self.class.class()?;
        Some(Failed::of(
            class,
            self.class,
            false,
            false,
            self.keys_resting,
            self.retry_after_max,
            level,
        ))
    }
}

/// What a companion asks of the loop.
// The loop answers every request of the contract; a build without the companions that make
// some of them never constructs those.
#[cfg_attr(
    not(all(feature = "auth", feature = "fallback", feature = "overflow")),
    allow(dead_code)
)]
pub(crate) enum Judged {
    /// Nothing: the loop goes on as the classifier says.
    Pass,
    /// Send the same attempt again, at once (a fresh credential, the next pool key, a
    /// repaired `max_tokens`). Not a retry: no backoff, no budget, no new attempt number, and
    /// the fleet does not learn from the answer it replaces.
    Resend,
    /// End the request with this error (a signal to switch models).
    Final(Error),
    /// Return this response without a retry, whatever the classifier says (an overload from
    /// the last model of a fallback chain).
    Keep,
    /// Go on as the classifier says, without the failed response's `Retry-After`: the next
    /// attempt goes one target down the fallback chain.
    Step,
}

/// What the loop carries from one send of a request to the next for the companions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Carried {
    /// AuthLayer: this attempt was re-sent with a fresh credential after a `401`.
    pub(crate) refreshed: bool,
    /// AuthLayer: pool keys rotated away from after a `429`, in this attempt.
    pub(crate) rotations: u32,
    /// ContextOverflowLayer: the repair every later send of the request carries.
    #[cfg(feature = "overflow")]
    pub(crate) repair: Option<OverflowRepaired>,
    /// Every failed attempt of the request so far, in order (ModelFallbackLayer replays them
    /// through its triggers to know where the next attempt goes).
    pub(crate) failures: Vec<Failed>,
}

impl Carried {
    /// Whether it carries nothing.
    fn is_empty(&self) -> bool {
        #[cfg(feature = "overflow")]
        if self.repair.is_some() {
            return false;
        }
        !self.refreshed && self.rotations == 0 && self.failures.is_empty()
    }

    /// Carries nothing.
    fn clear(&mut self) {
        self.refreshed = false;
        self.rotations = 0;
        #[cfg(feature = "overflow")]
        {
            self.repair = None;
        }
        self.failures.clear();
    }

    /// A new attempt (not a re-send of the same one): what was per attempt starts over.
    pub(crate) fn next_attempt(&mut self) {
        self.refreshed = false;
        self.rotations = 0;
    }
}

/// One failed attempt, as the loop saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Failed {
    /// The classifier's class.
    pub(crate) class: FailureClass,
    /// The classifier called it worth a retry.
    pub(crate) retryable: bool,
    /// A head timeout, an idle stall or no output in time before the commit point, or a
    /// `408`.
    pub(crate) timed_out: bool,
    /// The attempt failed to connect: an error before any byte of the request was sent
    /// (refused, DNS, TLS handshake), as [`Classify::request_not_sent`] tells, and not one
    /// HTTP/2 proved unprocessed on a connection that was up.
    ///
    /// [`Classify::request_not_sent`]: crate::classify::Classify::request_not_sent
    pub(crate) connect_failed: bool,
    /// A rate limit with nowhere to wait: no `Retry-After` at all, one above the policy's
    /// ceiling or past the request's deadline, or every key of a pool resting.
    pub(crate) unwaitable: bool,
    /// How far down its fallback chain ModelFallbackLayer sent the attempt.
    pub(crate) level: Option<u32>,
}

impl Failed {
    /// The record of a failed attempt of `class`, from the loop's classification `c`:
    /// `timed_out` when the attempt's error says it timed out, `connect_failed` when it
    /// proves the attempt never got a connection.
    pub(crate) fn of(
        class: FailureClass,
        c: &Classification,
        timed_out: bool,
        connect_failed: bool,
        keys_resting: bool,
        retry_after_max: Duration,
        level: Option<u32>,
    ) -> Self {
        Failed {
            class,
            retryable: c.is_retryable(),
            timed_out: class == FailureClass::Timeout || timed_out,
            connect_failed: connect_failed && class != FailureClass::NotProcessed,
            unwaitable: class == FailureClass::RateLimited
                && (keys_resting || c.retry_after().is_none_or(|ra| ra > retry_after_max)),
            level,
        }
    }
}

/// The handle the loop shares with the companions for one send: what the loop carries to
/// them, and what they leave for it.
#[derive(Clone)]
pub(crate) struct Link(Arc<Shared>);

struct Shared {
    carried: Carried,
    said: Mutex<Said>,
    // Whether anything was said since the last take: the loop locks only then.
    spoken: AtomicBool,
}

/// What the companions left on a send for the loop.
#[derive(Default)]
pub(crate) struct Said {
    /// Their questions, in the order they asked (innermost first).
    pub(crate) companions: Vec<Box<dyn Companion>>,
    /// How far down its fallback chain ModelFallbackLayer sent the send.
    pub(crate) level: Option<u32>,
}

impl Link {
    /// A handle carrying nothing yet.
    pub(crate) fn new() -> Self {
        Link::carrying(Carried::default())
    }

    fn carrying(carried: Carried) -> Self {
        Link(Arc::new(Shared {
            carried,
            said: Mutex::new(Said::default()),
            spoken: AtomicBool::new(false),
        }))
    }

    /// Whether this is the only hold on the handle.
    #[inline(always)]
    pub(crate) fn is_alone(&self) -> bool {
        // No `Weak` is ever made of a handle: one strong count is this one.
        Arc::strong_count(&self.0) == 1
    }

    /// Whether this is the only hold on the handle: then it is emptied for another request,
    /// and true.
    #[inline]
    pub(crate) fn reuse(&mut self) -> bool {
        // What was said on its last send was taken when that send ended.
        if !self.is_alone() {
            return false;
        }
        // The last holder let go with a release (its `Arc` drop): what it wrote is seen here.
        std::sync::atomic::fence(Ordering::Acquire);
        if !self.0.carried.is_empty() {
            self.carried_mut().clear();
        }
        true
    }

    /// What the next send carries, to change.
    pub(crate) fn carried_mut(&mut self) -> &mut Carried {
        &mut self.unique().carried
    }

    fn unique(&mut self) -> &mut Shared {
        if Arc::get_mut(&mut self.0).is_none() {
            *self = Link::carrying(self.0.carried.clone());
        }
        Arc::get_mut(&mut self.0).expect("a handle no one else holds")
    }

    /// What the loop carries for this send.
    pub(crate) fn carried(&self) -> &Carried {
        &self.0.carried
    }

    /// Leaves `companion`'s question about this send's response for the loop.
    #[cfg(any(test, feature = "auth", feature = "fallback", feature = "overflow"))]
    pub(crate) fn ask(&self, companion: impl Companion) {
        self.said().companions.push(Box::new(companion));
    }

    /// Records how far down its fallback chain this send goes.
    #[cfg(feature = "fallback")]
    pub(crate) fn record_level(&self, level: u32) {
        self.said().level = Some(level);
    }

    /// Takes what the companions left on this send, leaving nothing for the next one.
    #[inline]
    pub(crate) fn take_said(&self) -> Said {
        if !self.0.spoken.swap(false, Ordering::Acquire) {
            return Said::default();
        }
        std::mem::take(&mut *self.0.said.lock().unwrap_or_else(PoisonError::into_inner))
    }

    #[cfg(any(test, feature = "auth", feature = "fallback", feature = "overflow"))]
    fn said(&self) -> std::sync::MutexGuard<'_, Said> {
        let said = self.0.said.lock().unwrap_or_else(PoisonError::into_inner);
        self.0.spoken.store(true, Ordering::Release);
        said
    }
}

/// The handles of finished requests, kept for the next ones, so that a request costs no
/// allocation for its handle once the service has served as many at once. One per `Retry`
/// service, bounded.
#[derive(Default)]
pub(crate) struct Links(Mutex<Vec<Link>>);

impl Links {
    /// The most handles kept.
    const KEPT: usize = 64;

    /// A handle carrying nothing: a kept one, or a new one.
    #[inline]
    pub(crate) fn take(&self) -> Link {
        let kept = self.0.lock().ok().and_then(|mut links| links.pop());
        kept.unwrap_or_else(Link::new)
    }

    /// Keeps a finished request's handle for a later one, when no one else holds it.
    #[inline]
    pub(crate) fn give_back(&self, mut link: Link) {
        if !link.reuse() {
            return;
        }
        if let Ok(mut links) = self.0.lock() {
            if links.len() < Self::KEPT {
                links.push(link);
            }
        }
    }
}

impl Clone for Links {
    // A service's own: a clone starts with none.
    fn clone(&self) -> Self {
        Links::default()
    }
}

impl fmt::Debug for Links {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Links").finish_non_exhaustive()
    }
}

impl PartialEq for Link {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Link {}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link").finish_non_exhaustive()
    }
}

impl Said {
    /// Whether the error body must be read before the companions are asked.
    #[inline]
    pub(crate) fn wants_body(&self, head: &http::response::Parts) -> bool {
        self.companions.iter().any(|c| c.wants_body(head))
    }

    /// Tells each companion, in turn, that the send failed with no response.
    pub(crate) fn failed(&self, error: &(dyn std::error::Error + 'static)) {
        for companion in &self.companions {
            companion.failed(error);
        }
    }

    /// Asks each companion in turn, as [`Companion`] says: the first answer other than
    /// [`Judged::Pass`] or [`Judged::Step`] is the answer, and a step is kept unless another
    /// answer ends the question.
    pub(crate) fn ask(&self, question: &mut Question<'_>) -> Judged {
        let mut answer = Judged::Pass;
        for companion in &self.companions {
            match companion.judge(question) {
                Judged::Pass => {}
                Judged::Step => answer = Judged::Step,
                other => return other,
            }
        }
        answer
    }
}

impl fmt::Debug for Said {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Said")
            .field("companions", &self.companions.len())
            .field("level", &self.level)
            .finish()
    }
}
