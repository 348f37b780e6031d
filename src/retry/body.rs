use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::error::BoxError;

pin_project! {
    /// The response body of [`Retry`](super::Retry).
    ///
    /// Usually the inner service's body, untouched. When the retry loop had to read the start
    /// of the body to judge the response, the frames it read are yielded first, exactly as
    /// they arrived, then the rest of the original body: the bytes the caller sees are the
    /// bytes the server sent.
    pub struct RetryBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Plain { #[pin] body: B },
        Peeked { peeked: Peeked<B> },
    }
}

pub(crate) struct Peeked<B> {
    pub(crate) frames: VecDeque<Bytes>,
    pub(crate) trailers: Option<HeaderMap>,
    pub(crate) error: Option<BoxError>,
    pub(crate) rest: Option<Pin<Box<B>>>,
}

impl<B> Peeked<B> {
    pub(crate) fn new(body: B) -> Self {
        Peeked {
            frames: VecDeque::new(),
            trailers: None,
            error: None,
            rest: Some(Box::pin(body)),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.frames.iter().map(Bytes::len).sum()
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
    pub(crate) fn poll_fill(&mut self, cx: &mut Context<'_>, limit: usize) -> Poll<()> {
        loop {
            if self.len() >= limit || self.error.is_some() || self.trailers.is_some() {
                return Poll::Ready(());
            }
            let Some(rest) = self.rest.as_mut() else {
                return Poll::Ready(());
            };
            match rest.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.rest = None;
                }
                Poll::Ready(Some(Err(e))) => {
                    self.rest = None;
                    self.error = Some(e.into());
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(mut data) => {
                        let bytes = data.copy_to_bytes(data.remaining());
                        if !bytes.is_empty() {
                            self.frames.push_back(bytes);
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.trailers = Some(trailers);
                            self.rest = None;
                        }
                    }
                },
            }
        }
    }
}

impl<B> RetryBody<B> {
    pub(crate) fn plain(body: B) -> Self {
        RetryBody {
            kind: Kind::Plain { body },
        }
    }

    pub(crate) fn peeked(peeked: Peeked<B>) -> Self {
        RetryBody {
            kind: Kind::Peeked { peeked },
        }
    }
}

impl<B> Body for RetryBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Plain { body } => match body.poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(
                    frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
                ))),
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            KindProj::Peeked { peeked } => {
                if let Some(data) = peeked.frames.pop_front() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                if let Some(trailers) = peeked.trailers.take() {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
                if let Some(err) = peeked.error.take() {
                    return Poll::Ready(Some(Err(err)));
                }
                let Some(rest) = peeked.rest.as_mut() else {
                    return Poll::Ready(None);
                };
                match rest.as_mut().poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(
                        frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
                    ))),
                    Poll::Ready(Some(Err(e))) => {
                        peeked.rest = None;
                        Poll::Ready(Some(Err(e.into())))
                    }
                    Poll::Ready(None) => {
                        peeked.rest = None;
                        Poll::Ready(None)
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Plain { body } => body.is_end_stream(),
            Kind::Peeked { peeked } => {
                peeked.frames.is_empty()
                    && peeked.trailers.is_none()
                    && peeked.error.is_none()
                    && peeked.rest.as_ref().is_none_or(|r| r.is_end_stream())
            }
        }
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
        d.finish_non_exhaustive()
    }
}
