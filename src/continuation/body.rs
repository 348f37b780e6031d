use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::error::{BoxError, Error};
use crate::pipeline::RetryBody;

pin_project! {
    /// The response body of [`Continuation`](super::Continuation): the inner service's body
    /// as it came (the bytes it read to judge it yielded first), or the stitched answer, one
    /// buffer.
    pub struct ContinuationBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: RetryBody<B> },
        Stitched { data: Option<Bytes>, len: u64 },
    }
}

impl<B> ContinuationBody<B> {
    pub(crate) fn inner(body: RetryBody<B>) -> Self {
        ContinuationBody {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn stitched(data: Bytes) -> Self {
        let len = data.len() as u64;
        ContinuationBody {
            kind: Kind::Stitched {
                data: Some(data).filter(|d| !d.is_empty()),
                len,
            },
        }
    }
}

impl<B> Body for ContinuationBody<B>
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
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Stitched { data, len } => {
                *len = 0;
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Stitched { data, .. } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Stitched { len, .. } => SizeHint::with_exact(*len),
        }
    }
}

impl<B> std::fmt::Debug for ContinuationBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { body } => f.debug_tuple("ContinuationBody").field(body).finish(),
            Kind::Stitched { len, .. } => f
                .debug_struct("ContinuationBody")
                .field("stitched_len", len)
                .finish(),
        }
    }
}
