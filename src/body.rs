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
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A head as the kept copy rebuilds it equals the caller's, header for header, in order,
    /// sensitive flags and extensions included.
    #[test]
    fn kept_head_rebuilds_the_same_head() {
        #[derive(Clone, Debug, PartialEq)]
        struct Mark(u32);
        let mut key = http::HeaderValue::from_static("sk-ant-secret");
        key.set_sensitive(true);
        let (mut parts, ()) = http::Request::builder()
            .method(http::Method::from_bytes(b"PROPFIND").unwrap())
            .uri("https://user@api.example.com:8443/v1/messages?beta=true")
            .version(http::Version::HTTP_2)
            .header("content-type", "application/json")
            .header("x-api-key", key)
            .header("anthropic-beta", "a")
            .header("accept", "text/event-stream")
            .header("anthropic-beta", "b\tc")
            .header(
                "x-obs-text",
                http::HeaderValue::from_bytes(&[b'a', 0xe9, 0xff]).unwrap(),
            )
            .header("x-empty", "")
            .extension(Mark(7))
            .body(())
            .unwrap()
            .into_parts();
        parts
            .headers
            .append("accept", "application/json".parse().unwrap());
        let kept = KeptHead::of(&parts);
        assert!(matches!(kept.headers, Headers::Packed { .. }));
        for _ in 0..2 {
            let again = kept.parts();
            assert_eq!(again.method, parts.method);
            assert_eq!(again.uri, parts.uri);
            assert_eq!(again.uri.to_string(), parts.uri.to_string());
            assert_eq!(again.version, parts.version);
            assert_eq!(again.extensions.get::<Mark>(), Some(&Mark(7)));
            let pairs = |m: &HeaderMap| -> Vec<(String, Vec<u8>, bool)> {
                m.iter()
                    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec(), v.is_sensitive()))
                    .collect()
            };
            assert_eq!(pairs(&again.headers), pairs(&parts.headers));
            assert!(again.headers["x-api-key"].is_sensitive());
        }
    }

    /// Lengths above one and two bytes survive the packing, and the map kept as it is (for a
    /// value made unchecked) rebuilds the same map.
    #[test]
    fn kept_head_takes_long_headers_and_keeps_a_map_as_it_is() {
        let long_name = format!("x-{}", "n".repeat(300));
        let long_value = "v".repeat(70_000);
        let (mut parts, ()) = http::Request::builder()
            .header(long_name.as_str(), long_value.as_str())
            .header("x-short", "s")
            .body(())
            .unwrap()
            .into_parts();
        parts.headers.append("x-short", "t".parse().unwrap());
        let kept = KeptHead::of(&parts);
        assert!(matches!(kept.headers, Headers::Packed { .. }));
        let again = kept.parts().headers;
        assert_eq!(again[long_name.as_str()].as_bytes(), long_value.as_bytes());
        let shorts: Vec<_> = again.get_all("x-short").iter().collect();
        assert_eq!(shorts, ["s", "t"]);
        assert_eq!(again.len(), 3);
        let map = Headers::Map(parts.headers.clone());
        assert_eq!(map.map(), parts.headers);
    }

    /// Sends from a `Held`: the caller's head first, then the rebuilt one as long as a copy is
    /// kept; `can_resend` says whether one is.
    #[test]
    fn held_sends_the_original_then_the_kept_head() {
        let (parts, ()) = http::Request::post("https://api.example.com/v1/messages")
            .header("x-api-key", "k")
            .header("content-length", "99")
            .body(())
            .unwrap()
            .into_parts();
        let mut held = Held::new(parts);
        assert!(!held.can_resend(), "no body yet");
        held.set_body(ReplayBody::new(Bytes::from_static(b"hello")));
        assert!(held.can_resend());
        for _ in 0..3 {
            let req = held.send(true);
            assert_eq!(req.headers()["x-api-key"], "k");
            // The declared length is the body's, on every send.
            assert_eq!(req.headers()["content-length"], "5");
            assert_eq!(req.body().as_bytes().map(|b| &b[..]), Some(&b"hello"[..]));
            assert!(held.can_resend());
        }
        let last = held.send(false);
        assert_eq!(last.uri(), "https://api.example.com/v1/messages");
        assert!(
            !held.can_resend(),
            "nothing kept after a send that keeps nothing"
        );
    }

    /// The word-at-a-time check agrees with `HeaderValue::from_bytes` for every byte, at every
    /// position of values of every length up to three words.
    #[test]
    fn value_check_agrees_with_http() {
        for len in 0..=24 {
            for at in 0..len.max(1) {
                for b in 0..=255u8 {
                    let mut value = vec![b'a'; len];
                    if len > 0 {
                        value[at] = b;
                    }
                    assert_eq!(
                        is_value(&value),
                        http::HeaderValue::from_bytes(&value).is_ok(),
                        "byte {b:#x} at {at} of {len}"
                    );
                }
            }
        }
        // Many odd bytes at once, near the edges (0x00, 0x09, 0x1f, 0x20, 0x7e..0x80, 0xff).
        let edges = [
            0x00u8, 0x01, 0x09, 0x0a, 0x1f, 0x20, 0x21, 0x7e, 0x7f, 0x80, 0xfe, 0xff,
        ];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let value: Vec<u8> = (0..17)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    if seed.is_multiple_of(4) {
                        edges[(seed >> 8) as usize % edges.len()]
                    } else {
                        b'a' + (seed >> 8) as u8 % 26
                    }
                })
                .collect();
            assert_eq!(
                is_value(&value),
                http::HeaderValue::from_bytes(&value).is_ok(),
                "{value:?}"
            );
        }
    }

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

    /// Polls `body` once, by hand, as a client does frame by frame.
    fn poll_once(body: &mut ReplayBody) -> Option<Frame<Bytes>> {
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        match Pin::new(body).poll_frame(&mut cx) {
            Poll::Ready(frame) => frame.map(|f| f.expect("a buffered body does not fail")),
            Poll::Pending => panic!("a buffered body is always ready"),
        }
    }

    #[test]
    fn a_polled_body_is_spent_with_or_without_trailers() {
        let mut t = HeaderMap::new();
        t.insert("x-checksum", "abc".parse().unwrap());
        for trailers in [None, Some(t.clone())] {
            let mut body = ReplayBody::buffered(Bytes::from_static(b"hi"), trailers.clone());
            assert!(body.is_replayable());
            assert_eq!(body.size_hint().exact(), Some(2));
            assert!(!body.is_end_stream());
            let frame = poll_once(&mut body).expect("the data frame");
            assert_eq!(&frame.into_data().unwrap()[..], b"hi");
            if let Some(t) = &trailers {
                // The data is out, the trailers are still to come: not replayable any more.
                assert!(!body.is_end_stream(), "the trailers are still to come");
                assert!(!body.is_replayable());
                assert!(body.as_bytes().is_none());
                assert!(body.try_clone().is_none());
                assert_eq!(body.size_hint().exact(), Some(0));
                assert!(format!("{body:?}").contains("len: None, trailers: true"));
                let frame = poll_once(&mut body).expect("the trailers frame");
                assert_eq!(frame.into_trailers().unwrap(), *t);
            }
            // Spent: nothing more, nothing to send again, and it says so.
            assert!(poll_once(&mut body).is_none());
            assert!(body.is_end_stream());
            assert!(!body.is_replayable());
            assert!(body.try_clone().is_none());
            assert!(body.as_bytes().is_none());
            assert!(body.with_data(Bytes::from_static(b"x")).is_none());
            assert_eq!(body.size_hint().exact(), Some(0));
            assert!(format!("{body:?}").contains("len: None, trailers: false"));
        }
        // Empty data with trailers: the trailers alone, then the end.
        let mut body = ReplayBody::buffered(Bytes::new(), Some(t.clone()));
        assert!(!body.is_end_stream());
        let frame = poll_once(&mut body).expect("the trailers frame");
        assert_eq!(frame.into_trailers().unwrap(), t);
        assert!(poll_once(&mut body).is_none());
        assert!(body.is_end_stream());
        // An empty body ends at its first poll, and is spent after it too.
        let mut body = ReplayBody::empty();
        assert!(body.is_replayable());
        assert!(poll_once(&mut body).is_none());
        assert!(!body.is_replayable());
    }

    #[test]
    fn with_data_keeps_the_trailers() {
        let mut t = HeaderMap::new();
        t.insert("x-checksum", "abc".parse().unwrap());
        let body = ReplayBody::buffered(Bytes::from_static(b"hi"), Some(t.clone()));
        let mut rewritten = body.with_data(Bytes::from_static(b"bye")).unwrap();
        assert_eq!(rewritten.as_bytes().unwrap(), &Bytes::from_static(b"bye"));
        poll_once(&mut rewritten).expect("the data frame");
        let frame = poll_once(&mut rewritten).expect("the trailers frame");
        assert_eq!(frame.into_trailers().unwrap(), t);
        let plain = ReplayBody::new(Bytes::from_static(b"hi"));
        let rewritten = plain.with_data(Bytes::from_static(b"bye")).unwrap();
        assert!(format!("{rewritten:?}").contains("trailers: false"));
    }

    #[test]
    fn debug_hides_bytes() {
        let body = ReplayBody::from("secret-key-material");
        let s = format!("{body:?}");
        assert!(!s.contains("secret"), "{s}");
    }

    #[tokio::test]
    async fn prepare_reuses_a_replay_body() {
        let original = Bytes::from(vec![3u8; 1024]);
        let body = PrepareBody::new(ReplayBody::new(original.clone()), 4096)
            .await
            .unwrap();
        // A ReplayBody is read like any body of one frame: same buffer, no copy.
        assert_eq!(body.as_bytes().unwrap().as_ptr(), original.as_ptr());
        // Over the limit, it goes once, as it streams, like any body.
        let body = PrepareBody::new(ReplayBody::new(original), 16)
            .await
            .unwrap();
        assert!(!body.is_replayable());
    }

    #[tokio::test]
    async fn prepare_buffers_other_bodies_under_the_limit() {
        let full = http_body_util::Full::new(Bytes::from_static(b"hello"));
        let body = PrepareBody::new(full, 16).await.unwrap();
        assert_eq!(&body.as_bytes().unwrap()[..], b"hello");
        let full = http_body_util::Full::new(Bytes::from_static(b"hello"));
        let body = PrepareBody::new(full, 4).await.unwrap();
        assert!(!body.is_replayable());
        // No size hint: the cap is found while reading.
        let err = PrepareBody::new(Unsized(vec![b"abc", b"def"]), 4)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::BodyTooLarge);
    }

    struct Unsized(Vec<&'static [u8]>);

    impl Body for Unsized {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            if self.0.is_empty() {
                return Poll::Ready(None);
            }
            let chunk = self.0.remove(0);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(chunk)))))
        }
    }

    #[tokio::test]
    async fn streaming_is_not_replayable() {
        let body = ReplayBody::streaming(http_body_util::Full::new(Bytes::from_static(b"x")));
        assert!(!body.is_replayable());
        assert!(body.try_clone().is_none());
        assert_eq!(body.size_hint().exact(), Some(1));
        assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"x");
    }

    #[tokio::test]
    async fn prepare_joins_frames_in_order_and_keeps_every_trailer() {
        let mut first = HeaderMap::new();
        first.insert("x-checksum", "abc".parse().unwrap());
        let mut second = HeaderMap::new();
        second.insert("x-signature", "def".parse().unwrap());
        let body = Frames(
            vec![
                Frame::data(Bytes::from_static(b"{\"a\":")),
                Frame::data(Bytes::new()),
                Frame::data(Bytes::from_static(b"1}")),
                Frame::trailers(first),
                Frame::trailers(second),
            ]
            .into(),
        );
        let mut prepared = PrepareBody::new(body, 64).await.unwrap();
        assert_eq!(&prepared.as_bytes().unwrap()[..], br#"{"a":1}"#);
        // One data frame, then the trailers merged, as every attempt will send them.
        let data = prepared
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap();
        assert_eq!(&data[..], br#"{"a":1}"#);
        let trailers = prepared
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_trailers()
            .unwrap();
        assert_eq!(trailers["x-checksum"], "abc");
        assert_eq!(trailers["x-signature"], "def");
        assert!(prepared.frame().await.is_none());
        // A body of a single frame becomes the buffer as it is, with no copy.
        let original = Bytes::from(vec![7u8; 100]);
        let prepared = PrepareBody::new(http_body_util::Full::new(original.clone()), 1_000)
            .await
            .unwrap();
        assert_eq!(prepared.as_bytes().unwrap().as_ptr(), original.as_ptr());
        // No frame at all: an empty body.
        let prepared = PrepareBody::new(http_body_util::Empty::<Bytes>::new(), 16)
            .await
            .unwrap();
        assert!(prepared.as_bytes().unwrap().is_empty());
    }

    /// A body of the given frames, all ready, with no size hint.
    struct Frames(std::collections::VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }
}
