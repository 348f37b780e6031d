//! Unit tests of `body`.

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
