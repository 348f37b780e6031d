use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::error::{BoxError, Error, ErrorKind, TimedOut, TimeoutKind};
use crate::fleet::UsageTap;
use crate::stream::StreamScan;

pin_project! {
    /// The response body of [`Retry`](super::Retry).
    ///
    /// Usually the inner service's body, untouched. When the retry loop had to read the start
    /// of the body to judge the response (an error body, or a stream up to its first output),
    /// the frames it read are yielded first, exactly as they arrived, then the rest of the
    /// original body: the bytes the caller sees are the bytes the server sent.
    ///
    /// Errors are typed: [`ErrorKind::ResponseBody`] when reading the inner body failed (its
    /// error is the source), [`ErrorKind::IdleTimeout`] when no frame came for the policy's
    /// idle timeout.
    pub struct RetryBody<B> {
        #[pin]
        kind: Kind<B>,
        idle: IdleTimer,
        // An event stream followed to its protocol's terminal event, and the bytes that went
        // to the caller (counted only then).
        scan: Option<Box<StreamScan>>,
        // Fleet: the tokens the answer took, settled with the usage it reports.
        usage: Option<Box<UsageTap>>,
        delivered: u64,
        done: bool,
    }
}

/// The idle timeout between body frames, for the retry loop's peek and for the body it hands
/// on (which takes the peek's timer over).
///
/// The clock starts when a frame is asked for and is not there yet, so a slow consumer is
/// never blamed on the server, and stops when one comes.
pub(crate) struct IdleTimer {
    timeout: Option<Duration>,
    // Boxed so the body stays `Unpin` whenever the inner one is; allocated only once a
    // frame is not ready at once, then reused.
    sleep: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl IdleTimer {
    pub(crate) fn new(timeout: Option<Duration>) -> Self {
        IdleTimer {
            timeout,
            sleep: None,
            armed: false,
        }
    }

    /// A frame came: the next wait starts a fresh clock.
    pub(crate) fn reset(&mut self) {
        self.armed = false;
    }

    /// Nothing is ready: `Ready` once the body has been idle for the timeout (never, without
    /// one).
    pub(crate) fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(timeout) = self.timeout else {
            return Poll::Pending;
        };
        if !self.armed {
            self.armed = true;
            let deadline = crate::time::after(Instant::now(), timeout);
            match self.sleep.as_mut() {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let sleep = self.sleep.as_mut().expect("armed above");
        sleep.as_mut().poll(cx)
    }

    /// The error for a body that stayed idle.
    pub(crate) fn error(&self) -> Error {
        Error::new(ErrorKind::IdleTimeout).with_source(TimedOut::new(
            TimeoutKind::Idle,
            self.timeout.unwrap_or_default(),
        ))
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Plain { #[pin] body: B },
        // Boxed: the body every layer returns (nested once per layer) stays the size of the
        // inner body and a few words on the path every response takes.
        Peeked { peeked: Box<Peeked<B>> },
    }
}

pub(crate) struct Peeked<B> {
    pub(crate) frames: VecDeque<Bytes>,
    pub(crate) trailers: Option<HeaderMap>,
    pub(crate) error: Option<BoxError>,
    pub(crate) rest: Option<Pin<Box<B>>>,
    len: usize,
}

/// What one read of a [`Peeked`] body produced.
pub(crate) enum Read {
    /// A data frame, now the last of `frames`.
    Data,
    /// The body ended, failed (`error` holds it) or sent trailers.
    End,
}

impl<B> Peeked<B> {
    pub(crate) fn new(body: B) -> Self {
        Peeked {
            frames: VecDeque::new(),
            trailers: None,
            error: None,
            rest: Some(Box::pin(body)),
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.rest.is_none()
    }

    /// The bytes read so far, contiguous (copied only when they came in several frames).
    pub(crate) fn contiguous(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.frames.len() {
            0 => std::borrow::Cow::Borrowed(&[]),
            1 => std::borrow::Cow::Borrowed(&self.frames[0]),
            _ => std::borrow::Cow::Owned(
                self.frames.iter().flat_map(|b| b.iter().copied()).collect(),
            ),
        }
    }
}

impl<B> Peeked<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    /// Reads frames until `limit` bytes are held or the body ends (or fails).
    #[cfg(feature = "continuation")]
    pub(crate) fn poll_fill(&mut self, cx: &mut Context<'_>, limit: usize) -> Poll<()> {
        while self.len < limit && !self.is_finished() {
            if let Read::End = std::task::ready!(self.poll_read(cx)) {
                break;
            }
        }
        Poll::Ready(())
    }

    /// Reads one frame of the inner body and keeps it.
    pub(crate) fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<Read> {
        loop {
            let Some(rest) = self.rest.as_mut() else {
                return Poll::Ready(Read::End);
            };
            match rest.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.rest = None;
                    return Poll::Ready(Read::End);
                }
                Poll::Ready(Some(Err(e))) => {
                    self.rest = None;
                    self.error = Some(e.into());
                    return Poll::Ready(Read::End);
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(mut data) => {
                        let bytes = data.copy_to_bytes(data.remaining());
                        if !bytes.is_empty() {
                            self.len += bytes.len();
                            self.frames.push_back(bytes);
                            return Poll::Ready(Read::Data);
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.trailers = Some(trailers);
                            self.rest = None;
                            return Poll::Ready(Read::End);
                        }
                    }
                },
            }
        }
    }
}

/// Turns an inner body error into the crate's typed error (keeping one that already is).
pub(crate) fn body_error(e: BoxError) -> Error {
    match e.downcast::<Error>() {
        Ok(e) => *e,
        Err(e) => Error::new(ErrorKind::ResponseBody).with_source(e),
    }
}

impl<B> RetryBody<B> {
    pub(crate) fn plain(body: B, idle_timeout: Option<Duration>) -> Self {
        Self::with_kind(Kind::Plain { body }, IdleTimer::new(idle_timeout))
    }

    /// The frames read so far, then the rest, under `idle` (the peek's own timer, handed on).
    pub(crate) fn peeked(peeked: Peeked<B>, mut idle: IdleTimer) -> Self {
        idle.reset();
        Self::with_kind(
            Kind::Peeked {
                peeked: Box::new(peeked),
            },
            idle,
        )
    }

    fn with_kind(kind: Kind<B>, idle: IdleTimer) -> Self {
        RetryBody {
            kind,
            idle,
            scan: None,
            usage: None,
            delivered: 0,
            done: false,
        }
    }

    /// Reads the usage the answer reports as it goes to the caller, to settle the tokens it
    /// took.
    pub(crate) fn tap_usage(mut self, tap: UsageTap) -> Self {
        self.usage = Some(Box::new(tap));
        self
    }

    /// Follows the stream to its terminal event: a clean end before it is an
    /// [`ErrorKind::IncompleteStream`] error. `scan` has seen every peeked frame already.
    pub(crate) fn follow_stream(mut self, scan: Box<StreamScan>) -> Self {
        self.scan = Some(scan);
        self
    }
}

/// Whether the body has nothing more to give.
fn kind_ended<B: Body>(kind: &Kind<B>) -> bool {
    match kind {
        Kind::Plain { body } => body.is_end_stream(),
        Kind::Peeked { peeked } => {
            peeked.frames.is_empty()
                && peeked.trailers.is_none()
                && peeked.error.is_none()
                && peeked.rest.as_ref().is_none_or(|r| r.is_end_stream())
        }
    }
}

fn poll_inner<B>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match body.poll_frame(cx) {
        Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(
            frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
        ))),
        Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
        Poll::Ready(None) => Poll::Ready(None),
        Poll::Pending => Poll::Pending,
    }
}

impl<B> Body for RetryBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let mut this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        let polled = match this.kind.as_mut().project() {
            KindProj::Plain { body } => poll_inner(body, cx),
            KindProj::Peeked { peeked } => {
                if let Some(data) = peeked.frames.pop_front() {
                    // Already followed by the scan while the retry loop peeked.
                    peeked.len -= data.len();
                    *this.delivered += data.len() as u64;
                    if let Some(tap) = this.usage.as_mut() {
                        tap.follow(&data);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                if let Some(trailers) = peeked.trailers.take() {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
                if let Some(err) = peeked.error.take() {
                    *this.done = true;
                    return Poll::Ready(Some(Err(body_error(err))));
                }
                match peeked.rest.as_mut() {
                    None => Poll::Ready(None),
                    Some(rest) => {
                        let polled = poll_inner(rest.as_mut(), cx);
                        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
                            peeked.rest = None;
                        }
                        polled
                    }
                }
            }
        };
        match polled {
            Poll::Ready(item) => {
                this.idle.reset();
                if matches!(item, None | Some(Err(_))) {
                    *this.done = true;
                }
                if let Some(tap) = this.usage.as_mut() {
                    match &item {
                        Some(Ok(frame)) => {
                            if let Some(data) = frame.data_ref() {
                                tap.follow(data);
                            }
                            if kind_ended(this.kind.as_ref().get_ref()) {
                                tap.end();
                            }
                        }
                        None => tap.end(),
                        Some(Err(_)) => {}
                    }
                }
                if let Some(scan) = this.scan.as_mut() {
                    match &item {
                        Some(Ok(frame)) => {
                            if let Some(data) = frame.data_ref() {
                                *this.delivered += data.len() as u64;
                                scan.follow(data);
                            }
                        }
                        // A clean end before the protocol's terminal event: a cut.
                        None => {
                            if let Some(cut) = scan.end(*this.delivered) {
                                let err = Error::new(ErrorKind::IncompleteStream).with_source(cut);
                                return Poll::Ready(Some(Err(err)));
                            }
                        }
                        Some(Err(_)) => {}
                    }
                }
                Poll::Ready(item.map(|r| r.map_err(body_error)))
            }
            Poll::Pending => {
                std::task::ready!(this.idle.poll_idle(cx));
                *this.done = true;
                Poll::Ready(Some(Err(this.idle.error())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        if self.done {
            return true;
        }
        // A stream still waiting for its terminal event may end in `IncompleteStream`: its
        // end is known only at the poll that finds it (hyper, trusting a `true` here, would
        // end the response cleanly and the cut would never be raised).
        if self.scan.as_ref().is_some_and(|scan| !scan.settled()) {
            return false;
        }
        kind_ended(&self.kind)
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Plain { body } => body.size_hint(),
            Kind::Peeked { peeked } => {
                let held = peeked.len() as u64;
                let rest = peeked
                    .rest
                    .as_ref()
                    .map_or_else(|| SizeHint::with_exact(0), |r| r.size_hint());
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(held));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(held));
                }
                hint
            }
        }
    }
}

impl<B> fmt::Debug for RetryBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RetryBody");
        if let Kind::Peeked { peeked } = &self.kind {
            d.field("peeked_bytes", &peeked.len());
        }
        d.field("idle_timeout", &self.idle.timeout);
        d.finish_non_exhaustive()
    }
}
