//! Request bodies that can be sent more than once.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use sync_wrapper::SyncWrapper;

use crate::error::BoxError;

/// Anthropic's request size limit, used as the default buffering cap.
pub const DEFAULT_BODY_LIMIT: usize = 32 * 1024 * 1024;

/// A request body that every attempt of a retried request sends.
///
/// Almost always this is the caller's body, read once into [`Bytes`]: cloning it with
/// [`ReplayBody::try_clone`] bumps a reference count, and each attempt yields the very same
/// bytes (and trailers, if the original had any) as one data frame.
///
/// The one exception is a body whose `size_hint` said up front that it is over the buffering
/// cap. Such a request is passed through once, streaming, and never retried; its
/// `ReplayBody` cannot be cloned ([`ReplayBody::is_replayable`] is false).
pub struct ReplayBody {
    kind: Kind,
}

enum Kind {
    Buffered {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
    Streaming {
        // Wrapped so the body stays `Sync` (reqwest and others ask for it) even though the
        // caller's body need not be; `size_hint` is kept aside because the wrapper only allows
        // access through `&mut`.
        body: SyncWrapper<UnsyncBoxBody<Bytes, BoxError>>,
        hint: SizeHint,
    },
}

impl ReplayBody {
    /// A replayable body with these bytes.
    pub fn new(data: impl Into<Bytes>) -> Self {
        Self::buffered(data.into(), None)
    }

    /// A replayable empty body.
    pub fn empty() -> Self {
        Self::new(Bytes::new())
    }

    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        ReplayBody {
            kind: Kind::Buffered {
                data: Some(data),
                trailers,
            },
        }
    }

    /// A one-shot body that streams `body` through without buffering it.
    pub fn streaming<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        use http_body_util::BodyExt;
        let hint = body.size_hint();
        ReplayBody {
            kind: Kind::Streaming {
                body: SyncWrapper::new(body.map_err(Into::into).boxed_unsync()),
                hint,
            },
        }
    }

    /// The buffered bytes, when this body is replayable.
    ///
    /// Layers that rewrite the body (a model name, `max_tokens`) read it from here.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        match &self.kind {
            Kind::Buffered { data, .. } => data.as_ref(),
            Kind::Streaming { .. } => None,
        }
    }

    /// Whether this body can be sent again, that is, it was buffered.
    pub fn is_replayable(&self) -> bool {
        matches!(self.kind, Kind::Buffered { data: Some(_), .. })
    }

    /// A second handle on the same bytes, without copying them; `None` for a one-shot
    /// streaming body, or for a buffered body that has already been polled.
    pub fn try_clone(&self) -> Option<Self> {
        match &self.kind {
            Kind::Buffered {
                data: Some(data),
                trailers,
            } => Some(Self::buffered(data.clone(), trailers.clone())),
            _ => None,
        }
    }
}

impl Default for ReplayBody {
    fn default() -> Self {
        Self::empty()
    }
}

impl From<Bytes> for ReplayBody {
    fn from(data: Bytes) -> Self {
        Self::new(data)
    }
}

impl From<&'static str> for ReplayBody {
    fn from(data: &'static str) -> Self {
        Self::new(Bytes::from_static(data.as_bytes()))
    }
}

impl From<String> for ReplayBody {
    fn from(data: String) -> Self {
        Self::new(Bytes::from(data))
    }
}

impl From<Vec<u8>> for ReplayBody {
    fn from(data: Vec<u8>) -> Self {
        Self::new(Bytes::from(data))
    }
}

impl fmt::Debug for ReplayBody {
    // Never the bytes: a body can carry secrets, and a request log must not leak them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Buffered { data, trailers } => f
                .debug_struct("ReplayBody")
                .field("len", &data.as_ref().map(Bytes::len))
                .field("trailers", &trailers.is_some())
                .finish(),
            Kind::Streaming { hint, .. } => f
                .debug_struct("ReplayBody")
                .field("streaming", &true)
                .field("size_hint", hint)
                .finish(),
        }
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().kind {
            Kind::Buffered { data, trailers } => {
                if let Some(data) = data.take() {
                    if !data.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            Kind::Streaming { body, .. } => Pin::new(body.get_mut()).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { data, trailers } => {
                data.as_ref().is_none_or(Bytes::is_empty) && trailers.is_none()
            }
            Kind::Streaming { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Streaming { hint, .. } => *hint,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn clone_shares_bytes() {
        let original = Bytes::from(vec![7u8; 4096]);
        let body = ReplayBody::new(original.clone());
        let copy = body.try_clone().unwrap();
        assert_eq!(copy.as_bytes().unwrap().as_ptr(), original.as_ptr());
        let collected = copy.collect().await.unwrap().to_bytes();
        assert_eq!(collected.as_ptr(), original.as_ptr());
        assert_eq!(body.size_hint().exact(), Some(4096));
    }

    #[tokio::test]
    async fn empty_body_is_end_stream() {
        let body = ReplayBody::empty();
        assert!(body.is_end_stream());
        assert!(body.collect().await.unwrap().to_bytes().is_empty());
    }

    #[tokio::test]
    async fn trailers_are_replayed() {
        let mut t = HeaderMap::new();
        t.insert("x-checksum", "abc".parse().unwrap());
        let body = ReplayBody::buffered(Bytes::from_static(b"hi"), Some(t.clone()));
        let again = body.try_clone().unwrap();
        let c = again.collect().await.unwrap();
        assert_eq!(c.trailers(), Some(&t));
    }

    #[test]
    fn debug_hides_bytes() {
        let body = ReplayBody::from("secret-key-material");
        let s = format!("{body:?}");
        assert!(!s.contains("secret"), "{s}");
    }

    #[tokio::test]
    async fn streaming_is_not_replayable() {
        let body = ReplayBody::streaming(http_body_util::Full::new(Bytes::from_static(b"x")));
        assert!(!body.is_replayable());
        assert!(body.try_clone().is_none());
        assert_eq!(body.size_hint().exact(), Some(1));
        assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"x");
    }
}
