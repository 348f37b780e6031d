//! Properties over random input: the parsers never panic and stay bounded, and the SSE gate
//! hands on exactly the bytes it was given, however they were chunked. (The SSE scanner's own
//! properties are unit tests of `stream::sse`.)

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use tower::Layer;
use tower::{service_fn, ServiceExt};
use tower_llm_retry::classify::headers::parse_retry_after;
use tower_llm_retry::classify::{Classify, DefaultClassifier, SseVerdict};
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy};

/// A response body that yields the given chunks as separate frames.
struct Chunks(VecDeque<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|c| Ok(Frame::data(c))))
    }
}

fn split(data: &[u8], cuts: &[usize]) -> VecDeque<Bytes> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
    points.sort_unstable();
    points.dedup();
    let mut out = VecDeque::new();
    let mut last = 0;
    for p in points.into_iter().chain([data.len()]) {
        if p > last {
            out.push_back(Bytes::copy_from_slice(&data[last..p]));
            last = p;
        }
    }
    out
}

fn sse_event() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("event: message_start\ndata: {\"type\":\"message_start\"}\n\n".to_owned()),
        Just("event: ping\ndata: {\"type\": \"ping\"}\n\n".to_owned()),
        Just(": comment\n\n".to_owned()),
        Just("event: content_block_delta\ndata: {\"delta\":{\"text\":\"x\"}}\n\n".to_owned()),
        Just("event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"invalid_request_error\"}}\n\n".to_owned()),
        Just("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\r\n\r\n".to_owned()),
        "[ -~]{0,40}".prop_map(|s| format!("data: {s}\n\n")),
        "[ -~\\n\\r]{0,60}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn retry_after_never_panics_and_is_finite(value in "[ -~]{0,64}", ms in proptest::bool::ANY) {
        let mut headers = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(if ms { "retry-after-ms" } else { "retry-after" }, v);
        }
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        if let Some(d) = parse_retry_after(&headers, now) {
            prop_assert!(d.as_secs_f64().is_finite());
        }
    }

    #[test]
    fn retry_after_plain_seconds_round_trip(secs in 0u64..1_000_000) {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from(secs));
        prop_assert_eq!(parse_retry_after(&headers, SystemTime::now()), Some(Duration::from_secs(secs)));
    }

    #[test]
    fn classifier_never_panics_on_any_body(status in 100u16..600, body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let head = Response::builder().status(status).body(()).unwrap().into_parts().0;
        let c = DefaultClassifier::new().classify_response(&head, Some(&body));
        prop_assert_eq!(c.is_success(), (200..300).contains(&status));
    }

    #[test]
    fn sse_gate_hands_on_exactly_the_input_bytes(
        events in proptest::collection::vec(sse_event(), 0..16),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
        peek_limit in 16usize..4096,
    ) {
        let stream = Bytes::from(events.concat());
        let chunks = split(&stream, &cuts);
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        let out = rt.block_on(async move {
            let svc = service_fn(move |_req: Request<ReplayBody>| {
                let chunks = chunks.clone();
                async move {
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(Chunks(chunks))
                            .unwrap(),
                    )
                }
            });
            let svc = RetryLayer::new()
                .policy(RetryPolicy::never())
                .peek_limit(peek_limit)
                .layer(svc);
            let res = svc
                .oneshot(Request::post("http://llm.test/v1/messages").body(Full::new(Bytes::from_static(b"{}"))).unwrap())
                .await
                .unwrap();
            // Every byte arrives, whatever the stream; one of a known protocol that stops
            // before its terminal event then ends with `IncompleteStream`, counting them all.
            let mut body = res.into_body();
            let mut out = Vec::new();
            let mut cut = None;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => out.extend_from_slice(f.data_ref().unwrap()),
                    Err(e) => {
                        assert_eq!(e.kind(), tower_llm_retry::ErrorKind::IncompleteStream, "{e}");
                        let stream = std::error::Error::source(&e)
                            .and_then(|s| s.downcast_ref::<tower_llm_retry::stream::IncompleteStream>())
                            .unwrap();
                        cut = Some(stream.delivered_bytes());
                        break;
                    }
                }
            }
            (Bytes::from(out), cut)
        });
        prop_assert_eq!(&out.0, &stream);
        if let Some(delivered) = out.1 {
            prop_assert_eq!(delivered, stream.len() as u64);
        }
    }

    #[test]
    fn default_sse_verdict_never_panics(event in proptest::option::of("[a-z_.]{0,30}"), data in "[ -~]{0,200}") {
        let e = tower_llm_retry::stream::SseEvent { event: event.map(Into::into), data: data.into() };
        let v = DefaultClassifier::new().classify_sse_event(&e);
        prop_assert!(matches!(v, SseVerdict::Output | SseVerdict::Preamble | SseVerdict::Error(_)));
    }
}
