//! Request bodies that can be sent more than once.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{LengthLimitError, Limited};
use pin_project_lite::pin_project;
use sync_wrapper::SyncWrapper;

use crate::error::{BoxError, Error, ErrorKind};

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

// Small on purpose: every request of the stack, and every future of the client below it,
// holds one and moves it. The common case, buffered bytes without trailers, is a `Bytes`;
// everything else is boxed. A `ReplayBody` is as large as `Full<Bytes>`, so a request
// carrying one is as large as the caller's (checked below): past 256 bytes, every move of
// the request inside the client takes `memcpy`'s slower path.
enum Kind {
    /// Buffered bytes without trailers, not yet polled.
    Bytes(Bytes),
    /// Buffered bytes with trailers, or a streaming body; `None` once a `Bytes` body was
    /// polled.
    Other(Option<Box<Rest>>),
}

enum Rest {
    Buffered {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
    Streaming(Streamed),
}

const _: () = assert!(
    std::mem::size_of::<http::Request<ReplayBody>>()
        <= std::mem::size_of::<http::Request<http_body_util::Full<Bytes>>>()
);

struct Streamed {
    // Wrapped so the body stays `Sync` (reqwest and others ask for it) even though the
    // caller's body need not be; `size_hint` is kept aside because the wrapper only allows
    // access through `&mut`.
    body: SyncWrapper<UnsyncBoxBody<Bytes, BoxError>>,
    hint: SizeHint,
}

impl ReplayBody {
    /// A replayable body with these bytes.
    pub fn new(data: impl Into<Bytes>) -> Self {
        ReplayBody {
            kind: Kind::Bytes(data.into()),
        }
    }

    /// A replayable empty body.
    pub fn empty() -> Self {
        Self::new(Bytes::new())
    }

    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let kind = match trailers {
            None => Kind::Bytes(data),
            Some(trailers) => Kind::Other(Some(Box::new(Rest::Buffered {
                data: Some(data),
                trailers: Some(trailers),
            }))),
        };
        ReplayBody { kind }
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
            kind: Kind::Other(Some(Box::new(Rest::Streaming(Streamed {
                body: SyncWrapper::new(body.map_err(Into::into).boxed_unsync()),
                hint,
            })))),
        }
    }

    /// The buffered bytes and trailers, while this body is replayable.
    fn replayable(&self) -> Option<(&Bytes, Option<&HeaderMap>)> {
        match &self.kind {
            Kind::Bytes(data) => Some((data, None)),
            Kind::Other(Some(rest)) => match &**rest {
                Rest::Buffered {
                    data: Some(data),
                    trailers,
                } => Some((data, trailers.as_ref())),
                _ => None,
            },
            Kind::Other(None) => None,
        }
    }

    /// The buffered bytes, when this body is replayable.
    ///
    /// Layers that rewrite the body (a model name, `max_tokens`) read it from here.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        self.replayable().map(|(data, _)| data)
    }

    /// Whether this body can be sent again, that is, it was buffered.
    pub fn is_replayable(&self) -> bool {
        self.replayable().is_some()
    }

    /// A replayable body with `data` in place of these bytes and the same trailers: what a
    /// layer sends after rewriting one field. `None` for a body that is not replayable.
    #[cfg(any(
        test,
        feature = "fallback",
        feature = "overflow",
        feature = "continuation"
    ))]
    pub(crate) fn with_data(&self, data: Bytes) -> Option<Self> {
        self.replayable()
            .map(|(_, trailers)| Self::buffered(data, trailers.cloned()))
    }

    /// A second handle on the same bytes, without copying them; `None` for a one-shot
    /// streaming body, or for a buffered body that has already been polled.
    pub fn try_clone(&self) -> Option<Self> {
        match &self.kind {
            // The common case, kept apart from `replayable` so it is a reference count bump.
            Kind::Bytes(data) => Some(ReplayBody {
                kind: Kind::Bytes(data.clone()),
            }),
            _ => self
                .replayable()
                .map(|(data, trailers)| Self::buffered(data.clone(), trailers.cloned())),
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
        let (len, trailers) = match &self.kind {
            Kind::Bytes(data) => (Some(data.len()), false),
            Kind::Other(None) => (None, false),
            Kind::Other(Some(rest)) => match &**rest {
                Rest::Buffered { data, trailers } => {
                    (data.as_ref().map(Bytes::len), trailers.is_some())
                }
                Rest::Streaming(streamed) => {
                    return f
                        .debug_struct("ReplayBody")
                        .field("streaming", &true)
                        .field("size_hint", &streamed.hint)
                        .finish();
                }
            },
        };
        f.debug_struct("ReplayBody")
            .field("len", &len)
            .field("trailers", &trailers)
            .finish()
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let kind = &mut self.get_mut().kind;
        match kind {
            Kind::Bytes(_) => {
                let Kind::Bytes(data) = std::mem::replace(kind, Kind::Other(None)) else {
                    unreachable!("matched above")
                };
                Poll::Ready((!data.is_empty()).then(|| Ok(Frame::data(data))))
            }
            Kind::Other(None) => Poll::Ready(None),
            Kind::Other(Some(rest)) => match &mut **rest {
                Rest::Buffered { data, trailers } => {
                    if let Some(data) = data.take() {
                        if !data.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                    }
                    Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
                }
                Rest::Streaming(streamed) => Pin::new(streamed.body.get_mut()).poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Bytes(data) => data.is_empty(),
            Kind::Other(None) => true,
            Kind::Other(Some(rest)) => match &**rest {
                Rest::Buffered { data, trailers } => {
                    data.as_ref().is_none_or(Bytes::is_empty) && trailers.is_none()
                }
                Rest::Streaming(_) => false,
            },
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Bytes(data) => SizeHint::with_exact(data.len() as u64),
            Kind::Other(None) => SizeHint::with_exact(0),
            Kind::Other(Some(rest)) => match &**rest {
                Rest::Buffered { data, .. } => {
                    SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
                }
                Rest::Streaming(streamed) => streamed.hint,
            },
        }
    }
}

/// A request kept for sending, perhaps more than once: the head from the start, the body once
/// [`PrepareBody`] has it.
pub(crate) struct Held {
    head: Head,
    body: Option<ReplayBody>,
}

enum Head {
    /// The caller's own head, until the first send takes it.
    Original(http::request::Parts),
    /// What later sends rebuild the head from.
    Kept(KeptHead),
    Gone,
}

impl Held {
    pub(crate) fn new(parts: http::request::Parts) -> Self {
        Held {
            head: Head::Original(parts),
            body: None,
        }
    }

    pub(crate) fn set_body(&mut self, body: ReplayBody) {
        self.body = Some(body);
    }

    /// The kept body, while one is kept.
    #[cfg(feature = "continuation")]
    pub(crate) fn body(&self) -> Option<&ReplayBody> {
        self.body.as_ref()
    }

    /// The kept body's bytes, when it is buffered; empty otherwise.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.body
            .as_ref()
            .and_then(ReplayBody::as_bytes)
            .map_or(&[][..], |b| &b[..])
    }

    /// Whether a request is still kept that can be sent again.
    pub(crate) fn can_resend(&self) -> bool {
        !matches!(self.head, Head::Gone)
            && self.body.as_ref().is_some_and(ReplayBody::is_replayable)
    }

    /// The kept request, to send. When `keep` and the body is replayable a copy stays kept.
    /// The original goes, not the copy: over loopback HTTP that measured 15 % more requests
    /// per second (the `overhead` bench's client and server).
    pub(crate) fn send(&mut self, keep: bool) -> http::Request<ReplayBody> {
        let body = self
            .body
            .take()
            .expect("the body is kept until the last send");
        let copy = if keep { body.try_clone() } else { None };
        let parts = match std::mem::replace(&mut self.head, Head::Gone) {
            Head::Original(parts) => {
                if copy.is_some() {
                    self.head = Head::Kept(KeptHead::of(&parts));
                }
                parts
            }
            Head::Kept(kept) => {
                let parts = kept.parts();
                if copy.is_some() {
                    self.head = Head::Kept(kept);
                }
                parts
            }
            Head::Gone => panic!("the request head is kept until the last send"),
        };
        self.body = copy;
        request(parts, body)
    }
}

/// A request head kept for a re-send.
///
/// Cloning `Parts` would cost an allocation for each header name and value the caller built
/// at run time (a `Bytes` turns shared on its first clone), two for the map, and as many
/// frees: on the success path, where the copy is never sent, that was more than a third of
/// the layer's cost. Here every header is written into one buffer instead, and the map is
/// rebuilt only for a re-send, which few requests make. The URI's parts are already shared
/// (parsing split them), so it is cloned as it is; extensions are cloned (nothing when none).
struct KeptHead {
    method: http::Method,
    uri: http::Uri,
    version: http::Version,
    extensions: http::Extensions,
    headers: Headers,
}

enum Headers {
    /// Per header: a flag byte (1 when sensitive), the name's and the value's lengths as
    /// `u32` (little-endian), the name, the value.
    Packed { bytes: Vec<u8>, count: usize },
    /// A value `HeaderValue::from_bytes` would refuse (one made unchecked): kept as a map.
    Map(HeaderMap),
}

impl KeptHead {
    fn of(parts: &http::request::Parts) -> Self {
        KeptHead {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            version: parts.version,
            extensions: parts.extensions.clone(),
            headers: Headers::of(&parts.headers),
        }
    }

    fn parts(&self) -> http::request::Parts {
        let (mut parts, ()) = http::Request::new(()).into_parts();
        parts.method = self.method.clone();
        parts.uri = self.uri.clone();
        parts.version = self.version;
        parts.extensions = self.extensions.clone();
        parts.headers = self.headers.map();
        parts
    }
}

impl Headers {
    fn of(map: &HeaderMap) -> Self {
        // One pass; the guess at the size is generous for the usual few short headers.
        let mut bytes = Vec::with_capacity(64 + 48 * map.len());
        for (name, value) in map {
            let name = name.as_str().as_bytes();
            let (Ok(name_len), Ok(value_len)) =
                (u32::try_from(name.len()), u32::try_from(value.len()))
            else {
                return Headers::Map(map.clone());
            };
            if !is_value(value.as_bytes()) {
                return Headers::Map(map.clone());
            }
            bytes.push(u8::from(value.is_sensitive()));
            bytes.extend_from_slice(&name_len.to_le_bytes());
            bytes.extend_from_slice(&value_len.to_le_bytes());
            bytes.extend_from_slice(name);
            bytes.extend_from_slice(value.as_bytes());
        }
        Headers::Packed {
            bytes,
            count: map.len(),
        }
    }

    fn map(&self) -> HeaderMap {
        let (mut rest, count) = match self {
            Headers::Packed { bytes, count } => (&bytes[..], *count),
            Headers::Map(map) => return map.clone(),
        };
        let mut map = HeaderMap::with_capacity(count);
        while let [flag, rest_after_flag @ ..] = rest {
            let (lengths, after) = rest_after_flag.split_at(8);
            let name_len =
                u32::from_le_bytes(lengths[..4].try_into().expect("four bytes")) as usize;
            let value_len =
                u32::from_le_bytes(lengths[4..].try_into().expect("four bytes")) as usize;
            let (name, after) = after.split_at(name_len);
            let (value, after) = after.split_at(value_len);
            let name = http::HeaderName::from_bytes(name).expect("a name a HeaderMap held");
            let mut value =
                http::HeaderValue::from_bytes(value).expect("a value checked when kept");
            value.set_sensitive(*flag == 1);
            map.append(name, value);
            rest = after;
        }
        map
    }
}

/// Whether `HeaderValue::from_bytes` takes `bytes`: no control byte but a tab, no DEL.
/// Eight bytes at a time, as this runs on every request.
fn is_value(bytes: &[u8]) -> bool {
    const LOW: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let x = u64::from_ne_bytes(chunk.try_into().expect("eight bytes"));
        // A byte below 0x20 (its high bit clear, and clear after subtracting 0x20), or 0x7f.
        let below = x.wrapping_sub(LOW * 0x20) & !x & HIGH;
        let del = (x ^ (LOW * 0x7f)).wrapping_sub(LOW) & !(x ^ (LOW * 0x7f)) & HIGH;
        if below | del != 0 && !chunk.iter().all(|&b| is_value_byte(b)) {
            return false;
        }
    }
    chunks.remainder().iter().all(|&b| is_value_byte(b))
}

fn is_value_byte(b: u8) -> bool {
    b >= 32 && b != 127 || b == b'\t'
}

/// The request of `parts` and `body`, its `content-length` (when it has one) saying the
/// length of `body`: a layer that rewrote the body (a fallback model, a repaired
/// `max_tokens`) must not send the caller's length with other bytes.
pub(crate) fn request(
    mut parts: http::request::Parts,
    body: ReplayBody,
) -> http::Request<ReplayBody> {
    if let (Some(declared), Some(bytes)) = (
        parts.headers.get(http::header::CONTENT_LENGTH),
        body.as_bytes(),
    ) {
        let declared = declared
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared != Some(bytes.len() as u64) {
            parts.headers.insert(
                http::header::CONTENT_LENGTH,
                http::HeaderValue::from(bytes.len()),
            );
        }
    }
    http::Request::from_parts(parts, body)
}

pin_project! {
    /// Turns the caller's body into a [`ReplayBody`], for every layer that may send a request
    /// more than once.
    ///
    /// The body is read into memory under `limit`: one whose size hint says up front that it
    /// is over the limit becomes a one-shot streaming body (not replayable, so sent once), and
    /// one that only turns out too large while it is read fails with
    /// [`ErrorKind::BodyTooLarge`]. A body of one frame (`Full`, a `ReplayBody`, hyper's small
    /// bodies) becomes the buffer as it is, with no copy.
    #[project = PrepareProj]
    pub(crate) enum PrepareBody<B>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Ready { body: Option<ReplayBody> },
        Collecting {
            #[pin] body: Limited<B>,
            // The first data frame; a body sent as one frame (`Full`, hyper's small bodies)
            // becomes the buffer as it is, with no copy and no allocation.
            first: Option<Bytes>,
            // Any further frames, joined into one buffer (one copy) at the end.
            rest: Vec<Bytes>,
            trailers: Option<HeaderMap>,
        },
    }
}

impl<B> PrepareBody<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    /// Reads `body` under `limit`.
    pub(crate) fn new(body: B, limit: usize) -> Self {
        match body {
            body if body.size_hint().lower() > limit as u64 => PrepareBody::Ready {
                body: Some(ReplayBody::streaming(StreamingData { inner: body })),
            },
            body => PrepareBody::Collecting {
                body: Limited::new(body, limit),
                first: None,
                rest: Vec::new(),
                trailers: None,
            },
        }
    }
}

impl<B> Future for PrepareBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<ReplayBody, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let result = match self.as_mut().project() {
            PrepareProj::Ready { body } => {
                return Poll::Ready(Ok(body
                    .take()
                    .expect("PrepareBody polled after completion")))
            }
            PrepareProj::Collecting {
                mut body,
                first,
                rest,
                trailers,
            } => loop {
                let frame = match ready!(body.as_mut().poll_frame(cx)) {
                    Some(Ok(frame)) => frame,
                    Some(Err(e)) => break Err(body_error(e)),
                    None => {
                        let data = join(first.take(), std::mem::take(rest));
                        break Ok(ReplayBody::buffered(data, trailers.take()));
                    }
                };
                match frame.into_data() {
                    Ok(mut data) => {
                        let data = data.copy_to_bytes(data.remaining());
                        if data.is_empty() {
                            continue;
                        }
                        match first {
                            None => *first = Some(data),
                            Some(_) => rest.push(data),
                        }
                    }
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            match trailers {
                                Some(held) => held.extend(t),
                                None => *trailers = Some(t),
                            }
                        }
                    }
                }
            },
        };
        // Done: the caller's body is dropped now, and a further poll panics as documented.
        self.set(PrepareBody::Ready { body: None });
        Poll::Ready(result)
    }
}

/// The frames of a body as one buffer: the first as it is when it is the only one, else all
/// of them copied once into a buffer of the exact size.
fn join(first: Option<Bytes>, rest: Vec<Bytes>) -> Bytes {
    let Some(first) = first else {
        return Bytes::new();
    };
    if rest.is_empty() {
        return first;
    }
    let len = first.len() + rest.iter().map(Bytes::len).sum::<usize>();
    let mut buf = bytes::BytesMut::with_capacity(len);
    buf.extend_from_slice(&first);
    for chunk in &rest {
        buf.extend_from_slice(chunk);
    }
    buf.freeze()
}

/// The error for a request body that could not be buffered.
pub(crate) fn body_error(e: BoxError) -> Error {
    let kind = if e.is::<LengthLimitError>() {
        ErrorKind::BodyTooLarge
    } else {
        ErrorKind::BodyRead
    };
    Error::new(kind).with_source(e)
}

pin_project! {
    /// Adapts a caller's body to `Bytes` data and boxed errors for the pass-through path.
    pub(crate) struct StreamingData<B> {
        #[pin]
        pub(crate) inner: B,
    }
}

impl<B> Body for StreamingData<B>
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
        self.project().inner.poll_frame(cx).map(|f| {
            f.map(|r| {
                r.map(|frame| frame.map_data(|mut d| d.copy_to_bytes(d.remaining())))
                    .map_err(Into::into)
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests;
