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
//! - [`Judged::Step`]: the next attempt goes one model further down the fallback chain.
//!
//! What the loop carries from one send to the next for them travels in [`Carried`], a
//! request extension set only once there is something to carry: the success path of a
//! request sets none.
//!
//! The loop also ends a request at once, before any classifier runs, when an inner layer
//! fails with one of this crate's final errors ([`Error::is_final`]): a credential that could
//! not be had, a signal to switch models. A custom [`Classify`](crate::Classify) cannot retry
//! them.

use std::fmt;
use std::sync::Arc;

use crate::classify::error_body::ErrorBody;
use crate::error::Error;
use crate::overflow::OverflowRepaired;
use crate::retry::AttemptContext;

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
    /// ModelFallbackLayer: how many models down its chain the next attempt goes.
    pub(crate) fallback_level: u32,
    /// ModelFallbackLayer: overloads in a row at the current level.
    pub(crate) overloads_at_level: u32,
}

impl Carried {
    /// A new attempt (not a re-send of the same one): what was per attempt starts over.
    pub(crate) fn next_attempt(&mut self) {
        self.refreshed = false;
        self.rotations = 0;
    }

    /// The loop's rule for the fallback level: it lasts while the overloads do. An overload
    /// counts at the level, unless it just moved the request down the chain; any other
    /// failure sends the next attempt back to the requested model.
    pub(crate) fn note_overload(&mut self, overloaded: bool, stepped: bool) {
        if !overloaded {
            self.fallback_level = 0;
            self.overloads_at_level = 0;
        } else if stepped {
            self.fallback_level += 1;
            self.overloads_at_level = 0;
        } else {
            self.overloads_at_level += 1;
        }
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
    /// Go on as the classifier says; the next attempt goes one model down the chain.
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
