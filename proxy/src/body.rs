//! The response body the proxy sends: the upstream's frames as received, and, when a stream
//! fails after its commit point, the protocol's own terminal error followed by an aborted
//! connection, so that no SDK mistakes a cut stream for a complete answer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use tokio::sync::OwnedSemaphorePermit;
use tower_llm_retry::BoxError;

use crate::budget::Reservation;
use crate::envelope::StreamStyle;

/// How long the error frame is given to leave before the connection is aborted. hyper drops
/// what it has buffered when a body fails, so the frame must be written out first.
const FLUSH_GRACE: Duration = Duration::from_millis(20);

/// Told when a stream is cut after its commit point, with the error's kind.
pub type OnAbort = Box<dyn FnOnce(&'static str) + Send>;

/// How a response body ended, as told to [`ProxyBody::on_end`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Sent to its end, or to the error that cut it.
    Complete,
    /// Dropped before its end: the client hung up (or the drain cut it).
    Dropped,
}

/// Told once how a body ended.
pub type OnEnd = Box<dyn FnOnce(Ended) + Send>;

/// The body of every response the proxy sends.
pub struct ProxyBody {
    inner: UnsyncBoxBody<Bytes, BoxError>,
    style: Option<StreamStyle>,
    at_boundary: bool,
    state: State,
    on_abort: Option<OnAbort>,
    on_end: Option<OnEnd>,
    // Held until the body is dropped: a stream counts against the concurrency cap while it
    // runs.
    _permit: Option<OwnedSemaphorePermit>,
    // The request body's share of the body budget, held as long as the permit: the retry
    // loop, and a continuation, keep the request body until the response body is dropped.
    _reservation: Option<Reservation>,
}

enum State {
    Streaming,
    /// The error frame was handed to hyper; the error follows once it had time to leave.
    Flushing(Option<BoxError>, Pin<Box<tokio::time::Sleep>>),
    Done,
}

impl ProxyBody {
    /// A complete body.
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        Self::new(
            Full::new(bytes.into())
                .map_err(|e| match e {})
                .boxed_unsync(),
            None,
            None,
        )
    }

    /// An upstream body; `style` is set for an event stream, whose failure after the commit
    /// point ends with that protocol's error event.
    pub fn upstream(
        inner: UnsyncBoxBody<Bytes, BoxError>,
        style: Option<StreamStyle>,
        permit: Option<OwnedSemaphorePermit>,
        on_abort: Option<OnAbort>,
    ) -> Self {
        let mut body = Self::new(inner, style, permit);
        body.on_abort = on_abort;
        body
    }

    fn new(
        inner: UnsyncBoxBody<Bytes, BoxError>,
        style: Option<StreamStyle>,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Self {
        ProxyBody {
            inner,
            style,
            at_boundary: true,
            state: State::Streaming,
            on_abort: None,
            on_end: None,
            _permit: permit,
            _reservation: None,
        }
    }

    /// Holds the request body's share of the body budget until this body is dropped.
    pub(crate) fn holding(mut self, reservation: Reservation) -> Self {
        self._reservation = Some(reservation);
        self
    }

    /// Calls `f` once, when the body ends or is dropped, with how it ended.
    pub fn on_end(mut self, f: OnEnd) -> Self {
        self.on_end = Some(f);
        self
    }

    fn ended(&mut self, how: Ended) {
        if let Some(f) = self.on_end.take() {
            f(how);
        }
    }
}

impl Drop for ProxyBody {
    fn drop(&mut self) {
        // hyper stops polling a body that says it is at its end, and drops it: only a body
        // still streaming, with more to come, was cut short by its reader.
        let how = match self.state {
            State::Streaming if !self.inner.is_end_stream() => Ended::Dropped,
            _ => Ended::Complete,
        };
        self.ended(how);
    }
}

/// The kind of a body error, as the library names it.
pub fn error_kind(e: &BoxError) -> &'static str {
    e.downcast_ref::<tower_llm_retry::Error>()
        .map_or("response_body", |e| e.kind().as_str())
}

fn ends_event(data: &[u8]) -> bool {
    data.ends_with(b"\n\n") || data.ends_with(b"\r\n\r\n") || data.ends_with(b"\r\r")
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match &mut this.state {
            State::Done => return Poll::Ready(None),
            State::Flushing(err, sleep) => {
                std::task::ready!(sleep.as_mut().poll(cx));
                let err = err.take();
                this.state = State::Done;
                this.ended(Ended::Complete);
                return Poll::Ready(err.map(Err));
            }
            State::Streaming => {}
        }
        match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    if !data.is_empty() {
                        this.at_boundary = ends_event(data);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                this.state = State::Done;
                this.ended(Ended::Complete);
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                let kind = error_kind(&e);
                tracing::warn!(
                    error.type = kind,
                    "upstream body failed after the response head"
                );
                if let Some(f) = this.on_abort.take() {
                    f(kind);
                }
                let Some(style) = this.style else {
                    this.state = State::Done;
                    this.ended(Ended::Complete);
                    return Poll::Ready(Some(Err(e)));
                };
                let message = format!(
                    "the upstream stream failed after output was sent ({kind}); \
                     the response is incomplete"
                );
                let event = style.error_event(&message);
                let frame = if this.at_boundary {
                    event
                } else {
                    let mut b = Vec::with_capacity(event.len() + 2);
                    b.extend_from_slice(b"\n\n");
                    b.extend_from_slice(&event);
                    Bytes::from(b)
                };
                this.state = State::Flushing(Some(e), Box::pin(tokio::time::sleep(FLUSH_GRACE)));
                Poll::Ready(Some(Ok(Frame::data(frame))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self.state {
            State::Streaming => self.inner.is_end_stream(),
            State::Flushing(..) => false,
            State::Done => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            State::Streaming => self.inner.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

impl fmt::Debug for ProxyBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyBody")
            .field("style", &self.style)
            .finish_non_exhaustive()
    }
}
