//! The client's deadline (the SDKs' advertised timeout, `x-llm-retry-deadline`, the upstream's
//! `deadline_secs`) bounds the retry loop; a client that hangs up is logged and counted.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower_llm_retry::mock::{sse, Reply, Script, SseFrame};
use tower_llm_retry_proxy::Config;

use crate::common::*;

/// A persistent `503` that is no overload: a plain server error, retried by every preset.
fn unavailable() -> Reply {
    Reply::anthropic_error(503, "api_error", "Service unavailable")
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// What the client saw of a request against a persistent `503`.
struct GaveUp {
    status: u16,
    should_retry: Option<String>,
    gave_up: Option<String>,
    attempts_header: Option<String>,
    /// From the request sent to its answer's head.
    took: Duration,
    /// The attempts the mock saw.
    attempts: usize,
}

async fn against_unavailable(
    headers: &[(&str, &str)],
    tweak: impl FnOnce(&mut Config),
) -> (Harness, GaveUp) {
    let h = start_with(Script::always(unavailable()), tweak).await;
    let mut req = h.post("/v1/messages", MESSAGES);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let t0 = Instant::now();
    let res = h.send(req.body(Full::from(MESSAGES)).unwrap()).await;
    let took = t0.elapsed();
    let got = GaveUp {
        status: res.status().as_u16(),
        should_retry: header(&res, "x-should-retry").map(str::to_owned),
        gave_up: header(&res, "x-llm-retry-gave-up").map(str::to_owned),
        attempts_header: header(&res, "x-llm-retry-attempts").map(str::to_owned),
        took,
        attempts: h.mock.request_count(),
    };
    let _ = res.into_body().collect().await;
    (h, got)
}

/// The default policy's sleeps are 0.5 s doubling to 32 s, plus 0–25 % jitter, so attempt
/// `n` (from 1) is sent within these bounds of the first: a loop bounded by `d` makes
/// exactly the attempts whose earliest start is below `d`, as long as `d` falls between two
/// of these windows (the latest start of one, the earliest of the next).
fn attempt_window(n: usize) -> (Duration, Duration) {
    let sum: f64 = (0..n.saturating_sub(1))
        .map(|i| 0.5 * 2f64.powi(i as i32))
        .sum();
    (secs(sum), secs(sum * 1.25))
}

/// The loop gave up for the deadline after exactly `attempts`, answering with the last one's
/// `503` at once, told the SDK not to retry, and did so before `bound`.
fn assert_gave_up_for_the_deadline(got: &GaveUp, attempts: usize, bound: f64, case: &str) {
    let (earliest, latest) = attempt_window(attempts);
    let (next, _) = attempt_window(attempts + 1);
    // The case's bound falls between two windows, so the count is exact whatever the jitter.
    assert!(
        latest < secs(bound) && secs(bound) < next,
        "{case}: a bad case"
    );
    assert_eq!(got.attempts, attempts, "{case}: attempts the mock saw");
    assert_eq!(got.status, 503, "{case}");
    assert_eq!(got.should_retry.as_deref(), Some("false"), "{case}");
    assert_eq!(got.gave_up.as_deref(), Some("deadline"), "{case}");
    assert_eq!(
        got.attempts_header.as_deref(),
        Some(attempts.to_string().as_str()),
        "{case}"
    );
    assert!(
        earliest <= got.took && got.took <= latest,
        "{case}: answered after {:?}, not within [{earliest:?}, {latest:?}]",
        got.took
    );
    assert!(got.took < secs(bound), "{case}");
}

#[tokio::test(start_paused = true)]
async fn an_sdks_advertised_timeout_bounds_the_loop() {
    // Without it the default policy makes 11 attempts over about 160 s. The Python SDKs send
    // `x-stainless-read-timeout: 60` for `timeout=60`: 57 s (60 less 5 %) for the loop, and
    // the next retry after the seventh attempt (31.5 s to 39.4 s) would start after 63 s.
    let (h, got) = against_unavailable(&[("x-stainless-read-timeout", "60")], |_| {}).await;
    assert_gave_up_for_the_deadline(&got, 7, 57.0, "x-stainless-read-timeout: 60");
    // The SDK's header is forwarded as sent; the mock saw one request's bodies.
    for r in h.mock.requests() {
        assert_eq!(r.headers["x-stainless-read-timeout"], "60");
        assert_eq!(sha256(&r.body), sha256(MESSAGES.as_bytes()));
    }
    let m = h.proxy.metrics().render();
    for line in [
        "llm_retry_proxy_give_ups_total{upstream=\"anthropic\",reason=\"deadline\"} 1",
        "llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"503\"} 1",
        "llm_retry_proxy_attempts_total{upstream=\"anthropic\"} 7",
    ] {
        assert!(m.contains(line), "missing {line}:\n{m}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_proxys_own_deadline_header_bounds_the_loop_and_is_stripped() {
    // 6 s less the 1 s floor of the margin: 5 s, between the fourth attempt (3.5 s to
    // 4.4 s) and the fifth (7.5 s on). (With 5 s, 4 s would fall inside the fourth's window
    // and the count would depend on the jitter.)
    let (h, got) = against_unavailable(&[("x-llm-retry-deadline", "6")], |_| {}).await;
    assert_gave_up_for_the_deadline(&got, 4, 5.0, "x-llm-retry-deadline: 6");
    assert!(h
        .mock
        .requests()
        .iter()
        .all(|r| !r.headers.contains_key("x-llm-retry-deadline")));

    // 5 s: 4 s for the loop, inside the fourth attempt's window, so the jitter decides
    // whether it is made; the answer comes by 4 s either way.
    let (_h, got) = against_unavailable(&[("x-llm-retry-deadline", "5")], |_| {}).await;
    assert!((3..=4).contains(&got.attempts), "{}", got.attempts);
    assert_eq!(got.status, 503);
    assert_eq!(got.should_retry.as_deref(), Some("false"));
    assert_eq!(got.gave_up.as_deref(), Some("deadline"));
    let (earliest, _) = attempt_window(got.attempts);
    assert!(
        earliest <= got.took && got.took <= secs(4.0),
        "{:?} after {} attempts",
        got.took,
        got.attempts
    );
}

#[tokio::test(start_paused = true)]
async fn deadline_secs_alone_bounds_the_loop_less_the_margin() {
    // 30 s less 5 % (1.5 s): 28.5 s, after the sixth attempt (15.5 s to 19.4 s).
    let (_h, got) = against_unavailable(&[], |c| c.upstream[0].deadline_secs = Some(30)).await;
    assert_gave_up_for_the_deadline(&got, 6, 28.5, "deadline_secs = 30");

    // The margin, to the instant: attempts that take 3 s each, and 10 s less its 1 s floor.
    // The third attempt (sent at 7.5 s to 7.75 s) is cut at 9 s.
    let h = start_with(
        Script::always(unavailable().delay(Duration::from_secs(3))),
        |c| c.upstream[0].deadline_secs = Some(10),
    )
    .await;
    let t0 = Instant::now();
    let res = h.messages(MESSAGES).await;
    assert_eq!(t0.elapsed(), Duration::from_secs(9));
    assert_eq!(res.status(), 502);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(h.mock.request_count(), 3);
}

#[tokio::test(start_paused = true)]
async fn the_smallest_deadline_wins() {
    // (case, headers, client_deadline, attempts, the loop's bound in seconds)
    type Case = (
        &'static str,
        &'static [(&'static str, &'static str)],
        bool,
        usize,
        f64,
    );
    let cases: [Case; 6] = [
        // Anthropic's `x-stainless-timeout` below the read timeout and `deadline_secs`.
        (
            "x-stainless-timeout",
            &[
                ("x-stainless-read-timeout", "60"),
                ("x-stainless-timeout", "12"),
            ],
            true,
            5,
            11.0,
        ),
        // Fractional seconds, as the SDKs write a float.
        (
            "fractional",
            &[("x-stainless-read-timeout", "6.0")],
            true,
            4,
            5.0,
        ),
        // Ours below the SDK's.
        (
            "ours",
            &[
                ("x-stainless-read-timeout", "60"),
                ("x-llm-retry-deadline", "6"),
            ],
            true,
            4,
            5.0,
        ),
        // The SDK's below ours.
        (
            "the sdk's",
            &[
                ("x-stainless-read-timeout", "6"),
                ("x-llm-retry-deadline", "60"),
            ],
            true,
            4,
            5.0,
        ),
        // `deadline_secs` below the SDK's.
        (
            "deadline_secs",
            &[("x-stainless-read-timeout", "60")],
            true,
            6,
            28.5,
        ),
        // `client_deadline = false`: the SDK's is not honoured, ours still is.
        (
            "client_deadline = false",
            &[
                ("x-stainless-read-timeout", "6"),
                ("x-llm-retry-deadline", "12"),
            ],
            false,
            5,
            11.0,
        ),
    ];
    for (case, headers, honour, attempts, bound) in cases {
        let (_h, got) = against_unavailable(headers, |c| {
            c.upstream[0].deadline_secs = Some(30);
            c.upstream[0].client_deadline = honour;
        })
        .await;
        assert_gave_up_for_the_deadline(&got, attempts, bound, case);
    }
}

#[tokio::test(start_paused = true)]
async fn a_preset_picked_by_header_keeps_the_client_deadline() {
    // `patient` alone would make 13 attempts over about ten minutes (5 s doubling to 60 s,
    // ±25 % jitter). With the SDK's 6 s the loop has 5 s: the first sleep (3.75 s to 6.25 s)
    // allows a second attempt or not, and no third.
    let (_h, got) = against_unavailable(
        &[
            ("x-llm-retry-policy", "patient"),
            ("x-stainless-read-timeout", "6"),
        ],
        |_| {},
    )
    .await;
    assert_eq!(got.status, 503);
    assert_eq!(got.should_retry.as_deref(), Some("false"));
    assert_eq!(got.gave_up.as_deref(), Some("deadline"));
    assert!(got.took < secs(5.0), "{:?}", got.took);
    assert!((1..=2).contains(&got.attempts), "{}", got.attempts);
}

#[tokio::test(start_paused = true)]
async fn a_senseless_sdk_timeout_is_ignored_and_ours_refused() {
    for bad in ["soon", "0", "-5", "NaN", "inf", "1e9", "NOT_GIVEN"] {
        // The SDKs' headers are not ours: the request goes ahead, bounded by `deadline_secs`
        // alone (a `0` read as a deadline would end it before its first attempt).
        let (h, got) = against_unavailable(
            &[
                ("x-stainless-read-timeout", bad),
                ("x-stainless-timeout", bad),
            ],
            |c| c.upstream[0].deadline_secs = Some(30),
        )
        .await;
        assert_gave_up_for_the_deadline(&got, 6, 28.5, bad);
        assert_eq!(h.mock.requests()[0].headers["x-stainless-timeout"], bad);

        // Ours: a 400 in the route's envelope, nothing sent.
        let h = start(Script::always(Reply::success())).await;
        let req = h
            .post("/v1/messages", MESSAGES)
            .header("x-llm-retry-deadline", bad)
            .body(Full::from(MESSAGES))
            .unwrap();
        let res = h.send(req).await;
        assert_eq!(res.status(), 400, "{bad}");
        assert_eq!(header(&res, "x-llm-retry-error"), Some("bad_header"));
        let body = json(res).await;
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("x-llm-retry-deadline"), "{message}");
        assert_eq!(h.mock.request_count(), 0);
    }
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_passes_during_an_attempt_ends_it_not_to_be_retried() {
    // Each attempt takes 3 s to answer: with 6 s (5 s for the loop) the second attempt's head
    // timeout is cut to what is left, and the loop ends as the upstream's failure (a `502`,
    // as any deadline that stops a retry after a failed attempt), at 5 s.
    let h = start(Script::always(unavailable().delay(Duration::from_secs(3)))).await;
    let req = h
        .post("/v1/messages", MESSAGES)
        .header("x-stainless-read-timeout", "6")
        .body(Full::from(MESSAGES))
        .unwrap();
    let t0 = Instant::now();
    let res = h.send(req).await;
    assert_eq!(t0.elapsed(), Duration::from_secs(5));
    assert_eq!(res.status(), 502);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(header(&res, "x-llm-retry-error"), Some("upstream"));
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    assert_eq!(h.mock.request_count(), 2);
    let m = h.proxy.metrics().render();
    assert!(
        m.contains("llm_retry_proxy_give_ups_total{upstream=\"anthropic\",reason=\"deadline\"} 1"),
        "{m}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_without_output_by_the_deadline_is_a_504_not_to_retry() {
    // The head at once, the first event after 10 s: the loop reads a stream up to its first
    // output before it answers, and that read ends at the deadline (6 s less 1 s).
    let events: Vec<SseFrame> = sse::anthropic_message(&["late"])
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            if i == 0 {
                e.after(Duration::from_secs(10))
            } else {
                e
            }
        })
        .collect();
    let h = start(Script::always(Reply::sse(events))).await;
    let req = h
        .post("/v1/messages", MESSAGES_STREAM)
        .header("x-llm-retry-deadline", "6")
        .body(Full::from(MESSAGES_STREAM))
        .unwrap();
    let t0 = Instant::now();
    let res = h.send(req).await;
    assert_eq!(t0.elapsed(), Duration::from_secs(5));
    assert_eq!(res.status(), 504);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(header(&res, "x-llm-retry-error"), Some("deadline"));
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("1"));
    assert_eq!(json(res).await["error"]["type"], "api_error");
    assert_eq!(h.mock.request_count(), 1);
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines_with(&self, needle: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}

fn capture() -> (Captured, tracing::subscriber::DefaultGuard) {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // One thread runs the client, the proxy and the mock: all of it is captured.
    (logs, tracing::subscriber::set_default(subscriber))
}

/// The `requests_total` samples of the Anthropic upstream, sorted (a family renders its
/// samples in no set order).
fn request_samples(h: &Harness) -> Vec<String> {
    let mut samples: Vec<String> = h
        .proxy
        .metrics()
        .render()
        .lines()
        .filter(|l| l.starts_with("llm_retry_proxy_requests_total{upstream=\"anthropic\""))
        .map(str::to_owned)
        .collect();
    samples.sort_unstable();
    samples
}

fn http2_client() -> HttpClient {
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build(tcp)
}

#[tokio::test(start_paused = true)]
async fn a_client_that_hangs_up_while_the_proxy_backs_off_is_counted_and_stops_the_loop() {
    // HTTP/1.1: the connection closes. HTTP/2: the stream is reset, the connection lives on.
    for (protocol, client) in [("HTTP/1.1", client()), ("HTTP/2", http2_client())] {
        let (logs, _guard) = capture();
        let h = start(Script::always(unavailable())).await;
        let req = h
            .post("/v1/messages", MESSAGES)
            .body(Full::from(MESSAGES))
            .unwrap();
        let c = client.clone();
        let call = tokio::spawn(async move { c.request(req).await });
        while h.mock.request_count() < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The proxy is now sleeping before its first retry (0.5 s to 0.625 s): the client
        // goes.
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        let seen = h.mock.request_count();
        assert_eq!(seen, 1, "{protocol}");
        // Far past every backoff of the default policy: no further attempt.
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert_eq!(
            h.mock.request_count(),
            seen,
            "{protocol}: the loop went on without its client"
        );
        assert_eq!(
            request_samples(&h),
            ["llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"client_gone\"} 1"],
            "{protocol}"
        );
        let m = h.proxy.metrics().render();
        for line in [
            "llm_retry_proxy_attempts_total{upstream=\"anthropic\"} 1",
            "llm_retry_proxy_in_flight 0",
        ] {
            assert!(m.contains(line), "{protocol}: missing {line}:\n{m}");
        }
        let lines = logs.lines_with("client gone");
        assert_eq!(lines.len(), 1, "{protocol}: {lines:?}");
        let line = &lines[0];
        assert!(line.contains("before the response head"), "{line}");
        assert!(line.contains("upstream=anthropic"), "{line}");
        assert!(line.contains("path=/v1/messages"), "{line}");
        assert!(!line.contains("sk-client"), "{line}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_that_drops_a_stream_midway_is_counted_once() {
    let (logs, _guard) = capture();
    let events: Vec<SseFrame> = sse::anthropic_message(&["a", "b", "c", "d"])
        .into_iter()
        .map(|e| e.after(Duration::from_secs(1)))
        .collect();
    let h = start(Script::always(Reply::sse(events.clone()))).await;

    // A stream read to its end: counted by its status when it ends.
    let res = h.messages(MESSAGES_STREAM).await;
    let (frames, end) = frames(res).await;
    end.unwrap();
    assert_eq!(sha256(&joined(&frames)), sha256(&concat(&events)));
    // Let the proxy's side finish with the body.
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        request_samples(&h),
        ["llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"200\"} 1"]
    );

    // A stream dropped after its first frames: no `200` for it, one `client_gone`.
    let res = h.messages(MESSAGES_STREAM).await;
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(!first.is_empty());
    // Counted when it ends, not at its head.
    assert_eq!(request_samples(&h).len(), 1);
    drop(body);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        request_samples(&h),
        [
            "llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"200\"} 1",
            "llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"client_gone\"} 1",
        ]
    );
    assert_eq!(h.mock.request_count(), 2);
    let m = h.proxy.metrics().render();
    assert!(m.contains("llm_retry_proxy_in_flight 0"), "{m}");
    // Not a cut of the upstream's.
    assert!(!m.contains("stream_aborts_total{"), "{m}");
    let lines = logs.lines_with("client gone");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("before the end of the response") && lines[0].contains("status=200"),
        "{}",
        lines[0]
    );
    assert!(!lines[0].contains("sk-client"), "{}", lines[0]);
}
