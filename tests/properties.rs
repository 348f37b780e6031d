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

/// A `Retry-After` value: anything printable, numbers plain or not, HTTP-dates.
fn retry_after_value() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ -~]{0,64}",
        " ?[+]?[0-9]{0,12}(\\.[0-9]{0,6})? ?",
        "[0-9]{30,36}",
        prop_oneof![
            Just("inf"),
            Just("NaN"),
            Just("-1"),
            Just("1e3"),
            Just("0x10"),
            Just("1.2.3"),
            Just("Fri, 31 Dec 9999 23:59:59 GMT"),
            Just("Thu, 01 Jan 1970 00:00:00 GMT"),
            Just("Wed, 01 Jan 2027 00:00:00 GMT"),
        ]
        .prop_map(str::to_owned),
    ]
}

/// A plain decimal number, as the parser reads one: digits with at most one dot, an
/// optional `+`, at most 32 characters.
fn plain_decimal(s: &str) -> Option<f64> {
    let digits = s.strip_prefix('+').unwrap_or(s);
    let ok = !s.is_empty()
        && s.len() <= 32
        && digits.chars().any(|c| c.is_ascii_digit())
        && digits.chars().all(|c| c.is_ascii_digit() || c == '.')
        && digits.matches('.').count() <= 1;
    ok.then(|| digits.parse().unwrap())
}

/// An SSE event name: none, a known one, or anything.
fn sse_event_name() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(prop_oneof![
        "[a-z_.]{0,30}",
        prop_oneof![
            Just("content_block_start"),
            Just("content_block_delta"),
            Just("error"),
            Just("response.failed"),
            Just("message_start"),
            Just("ping"),
            Just("content_block_stop"),
            Just("message_delta"),
            Just("message_stop"),
        ]
        .prop_map(str::to_owned),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn retry_after_never_panics_and_is_a_number_or_a_future_date(value in retry_after_value(), ms in proptest::bool::ANY) {
        let mut headers = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(if ms { "retry-after-ms" } else { "retry-after" }, v);
        }
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let parsed = parse_retry_after(&headers, now);
        let trimmed = value.trim_matches(|c| c == ' ' || c == '\t');
        match plain_decimal(trimmed) {
            // A plain decimal number is that many seconds (milliseconds), a number too large
            // for a `Duration` its largest value.
            Some(n) => {
                let secs = if ms { n / 1000.0 } else { n };
                let expected = Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX);
                prop_assert_eq!(parsed, Some(expected), "{:?}", value);
            }
            // Anything else is an HTTP-date still to come, or absent: never "inf", "NaN",
            // "1e3" or a negative number.
            None => {
                let date = (!ms)
                    .then(|| httpdate::parse_http_date(trimmed).ok())
                    .flatten()
                    .and_then(|when| when.duration_since(now).ok());
                prop_assert_eq!(parsed, date, "{:?}", value);
            }
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
    fn default_sse_verdict_follows_the_event_name(event in sse_event_name(), data in "[ -~]{0,200}") {
        let e = tower_llm_retry::stream::SseEvent { event: event.clone().map(Into::into), data: data.clone().into() };
        let v = DefaultClassifier::new().classify_sse_event(&e);
        match event.as_deref() {
            Some("content_block_start" | "content_block_delta") => prop_assert_eq!(v, SseVerdict::Output),
            Some("error" | "response.failed") => prop_assert!(matches!(v, SseVerdict::Error(_)), "{:?}", v),
            Some("message_start" | "ping" | "content_block_stop" | "message_delta" | "message_stop") => {
                prop_assert_eq!(v, SseVerdict::Preamble)
            }
            // An unknown event (or none) whose data is not a JSON object shows nothing.
            Some(n) if n.starts_with("response.") => {}
            _ if !data.trim().starts_with('{') => prop_assert_eq!(v, SseVerdict::Preamble),
            _ => {}
        }
    }
}
