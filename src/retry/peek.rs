//! Reading the start of a response body before the loop decides on it.
//!
//! A response the loop need not read is a read of zero bytes: [`Reply::Untouched`] with the
//! outcome [`Peek::Head`], decided by the same [`decide`](super::decide) as any other.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http_body::Body;
use tokio::time::Sleep;
use tracing::Span;

use crate::classify::{Classification, Classify, SseVerdict};
use crate::error::{BoxError, Error, ErrorKind, TimedOut, TimeoutKind};
use crate::pipeline::body::{IdleTimer, Peeked, Read, RetryBody};
use crate::pipeline::Said;
use crate::stream::{CommitReason, ScanError, StreamScan};

/// A response's body while the loop decides: untouched, or with its start read.
pub(super) enum Reply<R> {
    /// Nothing was read; `sse`: the response is an event stream.
    Untouched { body: R, sse: bool },
    /// The start was read (in the read's state, which holds the body and its idle timer,
    /// handed on to the caller's body).
    Peeked(Box<PeekState<R>>),
}

impl<R> Reply<R> {
    /// What was read of the body; `None` when nothing was.
    pub(super) fn bytes(&self) -> Option<Cow<'_, [u8]>> {
        match self {
            Reply::Untouched { .. } => None,
            Reply::Peeked(peek) => peek.peeked.as_ref().map(Peeked::contiguous),
        }
    }

    /// How many bytes were read.
    pub(super) fn len(&self) -> usize {
        match self {
            Reply::Untouched { .. } => 0,
            Reply::Peeked(peek) => peek.peeked.as_ref().map_or(0, Peeked::len),
        }
    }

    /// The body handed to the caller: the bytes read first, then the rest. `error`: a
    /// failure met while reading, handed up after the bytes that came.
    #[inline(always)]
    pub(super) fn into_body(
        self,
        idle_timeout: Option<std::time::Duration>,
        error: Option<BoxError>,
    ) -> RetryBody<R> {
        match self {
            Reply::Untouched { body, .. } => RetryBody::plain(body, idle_timeout),
            Reply::Peeked(peek) => {
                let PeekState { peeked, idle, .. } = *peek;
                let mut peeked = peeked.expect("the read holds the body");
                if let Some(error) = error {
                    peeked.error = Some(error);
                }
                RetryBody::peeked(peeked, idle)
            }
        }
    }
}

/// Reading the start of a body before deciding.
pub(super) struct PeekState<R> {
    pub(super) head: Option<http::response::Parts>,
    pub(super) peeked: Option<Peeked<R>>,
    pub(super) mode: PeekMode,
    // The questions of the companion layers inside, asked once the body is read.
    pub(super) said: Said,
    // Handed on to the body the caller gets.
    pub(super) idle: IdleTimer,
    // The request's deadline, when it has one: it bounds the read as it bounds the waits.
    pub(super) deadline: Option<Pin<Box<Sleep>>>,
    // An event stream's first-output timeout, when the policy sets one: armed at the head,
    // with the time it was armed for.
    pub(super) first_output: Option<(Pin<Box<Sleep>>, Duration)>,
    pub(super) span: Span,
}

impl<R> PeekState<R> {
    /// Whether the first-output timeout fired (polling it, so that it wakes the read); if it
    /// did, the body is dropped and the read fails with the timeout.
    pub(super) fn poll_first_output(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((timer, after)) = self.first_output.as_mut() else {
            return false;
        };
        if timer.as_mut().poll(cx).is_pending() {
            return false;
        }
        let after = *after;
        if let Some(peeked) = self.peeked.as_mut() {
            peeked.rest = None;
            peeked.error = Some(Box::new(
                Error::new(ErrorKind::IdleTimeout)
                    .with_source(TimedOut::new(TimeoutKind::FirstOutput, after)),
            ));
        }
        true
    }
}

/// Why the loop reads the start of a response body before deciding.
pub(super) enum PeekMode {
    /// An error status: read up to the peek limit, then classify with the bytes.
    ErrorBody,
    /// A 2xx event stream: read up to the first event with visible output.
    Sse(Box<StreamScan>),
    /// A 2xx body read whole (up to the cap), so a truncated one can be retried.
    Envelope(usize),
}

/// What reading the start of a body ended with.
pub(super) enum Peek {
    /// Nothing was read: the head alone decides (a read of zero bytes).
    Head,
    /// The error body is ready to classify.
    ErrorBody,
    /// The stream may go to the caller.
    Commit(CommitReason),
    /// An in-band error event before any output.
    SseError(Classification),
    /// Reading failed (error or idle timeout); the error is kept in the peeked body.
    Failed,
    /// An event stream showed no output within the first-output timeout; the error is kept
    /// in the peeked body.
    NoOutput,
    /// The envelope was read whole.
    Complete,
    /// The envelope is larger than the cap; it goes to the caller as it streams.
    TooLarge,
    /// The request's deadline passed while the body was read.
    CutByDeadline,
}

/// What the scan of a stream's events found.
fn verdict_of<C: Classify>(
    classifier: &C,
) -> impl FnMut(&crate::stream::SseEvent<'_>) -> Option<Option<Classification>> + '_ {
    move |event| match classifier.classify_sse_event(event) {
        SseVerdict::Output => Some(None),
        SseVerdict::Error(c) => Some(Some(c)),
        _ => None,
    }
}

/// Reads the start of a body as `mode` asks, under the idle timeout.
pub(super) fn poll_peek<R, C>(
    peeked: &mut Peeked<R>,
    mode: &mut PeekMode,
    idle: &mut IdleTimer,
    peek_limit: usize,
    stream_end_check: bool,
    classifier: &C,
    cx: &mut Context<'_>,
) -> Poll<Peek>
where
    R: Body,
    R::Error: Into<BoxError>,
    C: Classify,
{
    loop {
        let done = peeked.is_finished();
        match mode {
            PeekMode::ErrorBody if done || peeked.len() >= peek_limit => {
                return Poll::Ready(Peek::ErrorBody)
            }
            PeekMode::Sse(_) if done && peeked.error.is_some() => return Poll::Ready(Peek::Failed),
            PeekMode::Sse(scan) if done => {
                // The last event may be complete only now: a lone `\r` ended it.
                match scan.finish(verdict_of(classifier)) {
                    Ok(Some(None)) => return Poll::Ready(Peek::Commit(CommitReason::FirstOutput)),
                    Ok(Some(Some(c))) => return Poll::Ready(Peek::SseError(c)),
                    Ok(None) | Err(_) => {}
                }
                // A clean end before any output and before the protocol's terminal event: cut,
                // as a reset would be, and retried like one (nothing was shown yet).
                if stream_end_check {
                    if let Some(cut) = scan.end(peeked.len() as u64) {
                        peeked.error = Some(Box::new(
                            Error::new(ErrorKind::IncompleteStream).with_source(cut),
                        ));
                        return Poll::Ready(Peek::Failed);
                    }
                }
                return Poll::Ready(Peek::Commit(CommitReason::EndOfStream));
            }
            PeekMode::Sse(_) if peeked.len() >= peek_limit => {
                return Poll::Ready(Peek::Commit(CommitReason::PeekLimit))
            }
            PeekMode::Envelope(_) if done && peeked.error.is_some() => {
                return Poll::Ready(Peek::Failed)
            }
            PeekMode::Envelope(_) if done => return Poll::Ready(Peek::Complete),
            PeekMode::Envelope(cap) if peeked.len() > *cap => return Poll::Ready(Peek::TooLarge),
            _ => {}
        }
        match peeked.poll_read(cx) {
            Poll::Ready(Read::End) => {}
            Poll::Ready(Read::Data) => {
                idle.reset();
                if let PeekMode::Sse(scanner) = mode {
                    let frame = peeked.frames.back().expect("a frame was just read");
                    match scanner.push(frame, verdict_of(classifier)) {
                        Ok(Some(None)) => {
                            return Poll::Ready(Peek::Commit(CommitReason::FirstOutput))
                        }
                        Ok(Some(Some(c))) => return Poll::Ready(Peek::SseError(c)),
                        Ok(None) => {}
                        Err(ScanError::TooLong) => {
                            return Poll::Ready(Peek::Commit(CommitReason::PeekLimit))
                        }
                    }
                }
            }
            Poll::Pending => {
                ready!(idle.poll_idle(cx));
                // The body stalled. An error body is judged on what came; a stream or an
                // envelope failed, and its caller (if it gets it) sees an idle timeout.
                if let PeekMode::ErrorBody = mode {
                    return Poll::Ready(Peek::ErrorBody);
                }
                peeked.rest = None;
                peeked.error = Some(Box::new(idle.error()));
                return Poll::Ready(Peek::Failed);
            }
        }
    }
}
