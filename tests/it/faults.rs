//! The fault matrix over real sockets: the mock for what hyper can send, a raw TCP listener
//! for what it would refuse to. Each case asserts the outcome, how many requests the server
//! saw and how much virtual time passed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{sse, MockServer, Reply, Script};
use tower_llm_retry::retry::{GiveUpReason, Jitter};
use tower_llm_retry::{Error, ErrorKind, RetryBody, RetryLayer, RetryPolicy, RetryTrail};

/// Two retries, no jitter, 10 s timeouts: sleeps of 0.5 s and 1 s.
fn layer() -> RetryLayer {
    RetryLayer::new().policy(
        RetryPolicy::default()
            .max_retries(2)
            .jitter(Jitter::none())
            .head_timeout(Some(Duration::from_secs(10)))
            .idle_timeout(Some(Duration::from_secs(10))),
    )
}

/// What a raw connection does after reading one request.
#[derive(Clone)]
enum Raw {
    /// Send a TCP reset.
    Reset,
    /// Write these bytes, then reset.
    WriteThenReset(&'static [u8]),
    /// Write these bytes, then close normally.
    WriteThenClose(Vec<u8>),
    /// Write these bytes, then never send anything more.
    WriteThenStall(&'static [u8]),
}

/// A listener that answers every request with `action` and counts the requests it read.
async fn raw_server(action: Raw) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/messages", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let action = action.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                if read_request(&mut sock).await.is_none() {
                    return;
                }
                seen.fetch_add(1, Ordering::SeqCst);
                match action {
                    Raw::Reset => {
                        sock.set_zero_linger().unwrap();
                    }
                    Raw::WriteThenReset(bytes) => {
                        sock.write_all(bytes).await.unwrap();
                        sock.flush().await.unwrap();
                        tokio::task::yield_now().await;
                        sock.set_zero_linger().unwrap();
                    }
                    Raw::WriteThenClose(bytes) => {
                        let _ = sock.write_all(&bytes).await;
                        let _ = sock.shutdown().await;
                    }
                    Raw::WriteThenStall(bytes) => {
                        sock.write_all(bytes).await.unwrap();
                        std::future::pending::<()>().await;
                    }
                }
            });
        }
    });
    (url, count)
}

/// Reads one HTTP/1.1 request with a content-length body.
async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            while buf.len() < end + 4 + len {
                let n = sock.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(());
        }
    }
}

async fn send(url: &str) -> Result<http::Response<RetryBody<hyper::body::Incoming>>, Error> {
    ServiceBuilder::new()
        .layer(layer())
        .service(http_client())
        .oneshot(anthropic_request(url, BODY))
        .await
}

/// Asserts a transport failure on every one of the three attempts.
fn assert_exhausted(err: Error, seen: usize, want_seen: usize) {
    assert_eq!(err.kind(), ErrorKind::Exhausted, "{err:?}");
    let trail = err.trail().unwrap();
    assert_eq!(trail.total_attempts(), 3);
    assert!(trail
        .attempts()
        .iter()
        .all(|a| a.class == FailureClass::Transport));
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    assert_eq!(seen, want_seen);
}

#[tokio::test(start_paused = true)]
async fn connection_refused() {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let start = Instant::now();
    let err = send(&format!("http://{addr}/v1/messages"))
        .await
        .unwrap_err();
    assert_exhausted(err, 0, 0);
    assert_eq!(start.elapsed(), Duration::from_millis(1500));
}

#[tokio::test(start_paused = true)]
async fn raw_transport_faults_are_retried_then_exhausted() {
    let mut big_header = b"HTTP/1.1 200 OK\r\nx-filler: ".to_vec();
    big_header.extend(std::iter::repeat_n(b'a', 1 << 20));
    big_header.extend_from_slice(b"\r\ncontent-length: 0\r\n\r\n");
    let cases: Vec<(&str, Raw)> = vec![
        ("reset before the head", Raw::Reset),
        (
            "reset mid-head",
            Raw::WriteThenReset(b"HTTP/1.1 200 OK\r\ncontent-ty"),
        ),
        (
            "half-written head, then close",
            Raw::WriteThenClose(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n".to_vec()),
        ),
        (
            "malformed status line",
            Raw::WriteThenClose(b"HTTP/1.1 two-hundred OK\r\n\r\n".to_vec()),
        ),
        (
            "garbage instead of HTTP",
            Raw::WriteThenClose(b"\x00\x01\x02 hello\r\n\r\n".to_vec()),
        ),
        ("a 1 MiB header", Raw::WriteThenClose(big_header)),
    ];
    for (name, action) in cases {
        let (url, count) = raw_server(action).await;
        let start = Instant::now();
        let err = send(&url).await.expect_err(name);
        assert_exhausted(err, count.load(Ordering::SeqCst), 3);
        assert_eq!(start.elapsed(), Duration::from_millis(1500), "{name}");
    }
}

#[tokio::test(start_paused = true)]
async fn stall_before_the_head_times_out_on_every_attempt() {
    let (url, count) = raw_server(Raw::WriteThenStall(b"")).await;
    let start = Instant::now();
    let err = send(&url).await.unwrap_err();
    let trail = err.trail().unwrap().clone();
    assert_exhausted(err, count.load(Ordering::SeqCst), 3);
    // Three 10 s head timeouts and the 0.5 s + 1 s sleeps between them.
    assert_eq!(start.elapsed(), Duration::from_millis(31_500));
    assert!(trail.attempts()[2]
        .error
        .as_deref()
        .unwrap()
        .contains("no response head within 10s"));
}

#[tokio::test(start_paused = true)]
async fn stall_mid_head_times_out() {
    let (url, count) = raw_server(Raw::WriteThenStall(b"HTTP/1.1 200 OK\r\ncontent-")).await;
    let err = send(&url).await.unwrap_err();
    assert_exhausted(err, count.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn stall_mid_body_is_an_idle_timeout_once_handed_up() {
    let (url, count) = raw_server(Raw::WriteThenStall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"id\":",
    ))
    .await;
    let res = send(&url).await.unwrap();
    let start = Instant::now();
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(&bytes[..], b"{\"id\":");
    assert_eq!(err.unwrap().kind(), ErrorKind::IdleTimeout);
    assert_eq!(start.elapsed(), Duration::from_secs(10));
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn reset_mid_body_reaches_the_caller_as_a_typed_error() {
    // Non-streaming.
    let server = MockServer::start(Script::always(Reply::reset_mid_body(200, "{\"id\":\"msg")))
        .await
        .unwrap();
    let res = send(&server.url("/v1/messages")).await.unwrap();
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(&bytes[..], b"{\"id\":\"msg");
    assert_eq!(err.unwrap().kind(), ErrorKind::ResponseBody);
    assert_eq!(server.request_count(), 1);

    // Streaming, after output.
    let events = sse::anthropic_message(&["a"])[..3].to_vec();
    let server = MockServer::start(Script::always(Reply::sse_then_reset(events)))
        .await
        .unwrap();
    let res = send(&server.url("/v1/messages")).await.unwrap();
    let (_, err) = drain(res.into_body()).await;
    assert_eq!(err.unwrap().kind(), ErrorKind::ResponseBody);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn duplicate_and_conflicting_retry_after() {
    let recorder = Recorder::default();
    let server = MockServer::start(
        Script::new()
            .then(
                Reply::status(429)
                    .header("retry-after", "2")
                    .header("retry-after", "50"),
            )
            .then(
                Reply::status(429)
                    .header("retry-after", "30")
                    .header("retry-after-ms", "100")
                    .header("retry-after-ms", "9000"),
            )
            .then(
                Reply::status(429)
                    .header("retry-after", "junk")
                    .header("retry-after", "4"),
            )
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let res = ServiceBuilder::new()
        .layer(
            layer()
                .policy(RetryPolicy::default().jitter(Jitter::none()))
                .observer(recorder.clone()),
        )
        .service(http_client())
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    // First value wins; ms beats seconds; an unparseable first value means no Retry-After.
    assert_eq!(
        recorder.delays(),
        [
            Duration::from_secs(2),
            Duration::from_millis(100),
            Duration::from_secs(2)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn ten_mib_error_body_is_peeked_not_buffered_and_handed_on_intact() {
    let body: Vec<u8> = (0..10 * 1024 * 1024)
        .map(|i| b'a' + (i % 26) as u8)
        .collect();
    let server = MockServer::start(Script::always(Reply::status(503).body(body.clone())))
        .await
        .unwrap();
    let start = Instant::now();
    let res = send(&server.url("/v1/messages")).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(server.request_count(), 3);
    assert_eq!(start.elapsed(), Duration::from_millis(1500));
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none());
    assert_eq!(sha256(&bytes), sha256(&body));
}

#[tokio::test(start_paused = true)]
async fn hostile_retry_after_never_sleeps_past_the_ceiling() {
    let values: &[(&str, &str)] = &[
        ("retry-after", "86400"),
        ("retry-after", "99999999999999999999"),
        ("retry-after", "-5"),
        ("retry-after", "1.5"),
        ("retry-after", "0"),
        ("retry-after", "nan"),
        ("retry-after", "inf"),
        ("retry-after", "Fri, 01 Jan 2100 00:00:00 GMT"),
        ("retry-after", "Thu, 01 Jan 1970 00:00:00 GMT"),
        ("retry-after", "soon-ish"),
        ("retry-after-ms", "1e308"),
        ("retry-after-ms", "18446744073709551616000"),
    ];
    let presets = [
        ("default", RetryPolicy::default()),
        ("sdk_compatible", RetryPolicy::sdk_compatible()),
        ("patient", RetryPolicy::patient()),
        ("interactive", RetryPolicy::interactive()),
    ];
    for (preset, policy) in presets {
        for (name, value) in values {
            let recorder = Recorder::default();
            let server = MockServer::start(
                Script::new()
                    .then(Reply::status(429).header(name, value))
                    .then(Reply::success()),
            )
            .await
            .unwrap();
            let start = Instant::now();
            let res = ServiceBuilder::new()
                .layer(
                    RetryLayer::new()
                        .policy(policy.clone())
                        .observer(recorder.clone()),
                )
                .service(http_client())
                .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
                .await
                .unwrap();
            let waited = start.elapsed();
            assert!(
                waited <= Duration::from_secs(60) + Duration::from_millis(1),
                "{preset} {name}: {value} waited {waited:?}"
            );
            match res.status().as_u16() {
                // Retried: after a sleep within the ceiling.
                200 => assert_eq!(server.request_count(), 2, "{preset} {name}: {value}"),
                // Not retried: only a too-long wait may cause that, and only for give-up presets.
                429 => {
                    assert_eq!(server.request_count(), 1);
                    assert!(
                        matches!(preset, "default" | "interactive"),
                        "{preset} {name}: {value}"
                    );
                    let trail = res.extensions().get::<RetryTrail>().unwrap();
                    assert_eq!(trail.gave_up(), Some(GiveUpReason::RetryAfterTooLong));
                }
                other => panic!("{preset} {name}: {value}: status {other}"),
            }
            for d in recorder.delays() {
                assert!(
                    d <= Duration::from_secs(60),
                    "{preset} {name}: {value}: slept {d:?}"
                );
            }
        }
    }
}
