//! Bad input: each gets a clear error in the route's own envelope with the right status, and
//! the proxy keeps serving.

use std::time::Duration;

use http::Request;
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_llm_retry::mock::{Reply, Script};

use crate::common::*;

/// Sends raw bytes and reads the whole answer (the proxy closes after it).
async fn raw(h: &Harness, bytes: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn anthropic_envelope(v: &serde_json::Value, error_type: &str) {
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], error_type, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
}

fn openai_envelope(v: &serde_json::Value, error_type: &str) {
    assert_eq!(v["error"]["type"], error_type, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    assert!(v.get("type").is_none());
}

#[tokio::test(start_paused = true)]
async fn bad_input_table() {
    let h = start_with(Script::always(Reply::success()), |c| {
        c.max_body_bytes = 1024
    })
    .await;
    let big: &'static str = Box::leak("x".repeat(2048).into_boxed_str());
    struct Case {
        req: Request<Full<bytes::Bytes>>,
        status: u16,
        anthropic: bool,
        error_type: &'static str,
    }
    let post = |path: &str| {
        Request::post(h.url(path))
            .header("content-type", "application/json")
            .header("anthropic-version", "2023-06-01")
    };
    let cases = vec![
        Case {
            req: post("/v1/messages").body(Full::from(big)).unwrap(),
            status: 413,
            anthropic: true,
            error_type: "request_too_large",
        },
        Case {
            req: Request::post(h.url("/v1/chat/completions"))
                .body(Full::from(big))
                .unwrap(),
            status: 413,
            anthropic: false,
            error_type: "invalid_request_error",
        },
        Case {
            req: post("/v1/messages")
                .header("x-llm-retry", "maybe")
                .body(Full::from(MESSAGES))
                .unwrap(),
            status: 400,
            anthropic: true,
            error_type: "invalid_request_error",
        },
        Case {
            req: post("/v1/messages")
                .header("x-llm-retry-policy", "reckless")
                .body(Full::from(MESSAGES))
                .unwrap(),
            status: 400,
            anthropic: true,
            error_type: "invalid_request_error",
        },
        Case {
            req: post("/v1/messages")
                .header(
                    "x-llm-retry-policy",
                    http::HeaderValue::from_bytes(b"\xffpatient").unwrap(),
                )
                .body(Full::from(MESSAGES))
                .unwrap(),
            status: 400,
            anthropic: true,
            error_type: "invalid_request_error",
        },
        Case {
            req: Request::post(h.url("/v2/chat"))
                .body(Full::from("{}"))
                .unwrap(),
            status: 404,
            anthropic: false,
            error_type: "not_found_error",
        },
        Case {
            req: post("/v2/messages").body(Full::from("{}")).unwrap(),
            status: 404,
            anthropic: true,
            error_type: "not_found_error",
        },
        Case {
            req: Request::get(h.url("/")).body(Full::default()).unwrap(),
            status: 404,
            anthropic: false,
            error_type: "not_found_error",
        },
    ];
    for (i, c) in cases.into_iter().enumerate() {
        let res = h.send(c.req).await;
        assert_eq!(res.status(), c.status, "case {i}");
        assert_eq!(header(&res, "content-type"), Some("application/json"));
        let v = json(res).await;
        if c.anthropic {
            anthropic_envelope(&v, c.error_type);
        } else {
            openai_envelope(&v, c.error_type);
        }
    }
    // A chunked body over the cap: refused while reading, nothing sent.
    let mut chunked = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        chunked.extend_from_slice(b"200\r\n");
        chunked.extend_from_slice(&[b'y'; 512]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let answer = raw(&h, &chunked).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("request_too_large"));
    // Garbage on the wire: hyper answers 400 and the proxy stays up.
    let answer = raw(&h, b"\x01\x02 NOT HTTP\r\n\r\n").await;
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
        "{answer}"
    );
    let answer = raw(
        &h,
        b"GET /livez HTTP/1.1\r\nhost: x\r\nx-bad header: 1\r\n\r\n",
    )
    .await;
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
        "{answer}"
    );
    assert_eq!(h.mock.request_count(), 0);
    let res = h
        .send(Request::get(h.url("/livez")).body(Full::default()).unwrap())
        .await;
    assert_eq!(res.status(), 200);
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_upstream_is_a_502_in_the_envelope_after_the_retries() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let h = start_with(Script::always(Reply::success()), |c| {
        for up in &mut c.upstream {
            up.url = format!("http://127.0.0.1:{port}");
            up.max_retries = Some(2);
        }
    })
    .await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 502);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("3"));
    anthropic_envelope(&json(res).await, "api_error");
    let res = h
        .send(
            Request::post(h.url("/v1/chat/completions"))
                .body(Full::from(CHAT_STREAM))
                .unwrap(),
        )
        .await;
    assert_eq!(res.status(), 502);
    openai_envelope(&json(res).await, "server_error");
}

/// An upstream the proxy cannot send to as configured (a host that is neither an IP address
/// nor a DNS name, which the TLS connector cannot name): a `500` at once, in the envelope,
/// naming the cause, after one attempt that sent nothing. (It was the `502` of an unreachable
/// upstream, after every retry.)
#[tokio::test(start_paused = true)]
async fn an_upstream_that_cannot_be_sent_to_is_a_500_at_once_naming_the_cause() {
    let h = start_with(Script::always(Reply::success()), |c| {
        for up in &mut c.upstream {
            up.url = "https://999.1.1.1".into();
        }
    })
    .await;
    let start = tokio::time::Instant::now();
    let res = h.messages(MESSAGES).await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(res.status(), 500);
    assert_eq!(
        header(&res, "x-llm-retry-error"),
        Some("upstream_unsendable")
    );
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("1"));
    let body = json(res).await;
    anthropic_envelope(&body, "api_error");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("cannot be sent to as the proxy is configured")
            && message.contains("neither an IP address nor a valid DNS name"),
        "{message}"
    );
    let res = h
        .send(
            Request::post(h.url("/v1/chat/completions"))
                .body(Full::from(CHAT_STREAM))
                .unwrap(),
        )
        .await;
    assert_eq!(res.status(), 500);
    assert_eq!(
        header(&res, "x-llm-retry-error"),
        Some("upstream_unsendable")
    );
    openai_envelope(&json(res).await, "server_error");
    assert_eq!(h.mock.request_count(), 0);
    let m = h.proxy.metrics().render();
    let line = "llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"500\"} 1";
    assert!(m.contains(line), "missing {line}:\n{m}");
}

#[tokio::test(start_paused = true)]
async fn a_stalled_body_is_a_408_and_gives_its_slot_back() {
    let h = start_with(Script::always(Reply::success()), |c| {
        c.max_concurrent_requests = 1;
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.write_all(
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\n\
          content-length: 100\r\n\r\n{\"model\"",
    )
    .await
    .unwrap();
    let started = tokio::time::Instant::now();
    // The answer comes once the body has gone 30 s without a byte; the proxy then closes
    // the connection (the rest of that body will not be read).
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(3600), s.read_to_end(&mut out))
        .await
        .expect("a stalled body is answered")
        .unwrap();
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    let answer = String::from_utf8_lossy(&out);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("x-llm-retry-error: body_timeout"),
        "{answer}"
    );
    assert!(answer.contains("x-should-retry: true"), "{answer}");
    let body = &answer[answer.find("\r\n\r\n").unwrap() + 4..];
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    anthropic_envelope(&v, "invalid_request_error");
    // The one slot is free again, and nothing went upstream for the stalled request.
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
    assert_eq!(h.mock.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_sends_no_request_is_closed() {
    let h = start(Script::always(Reply::success())).await;
    // Nothing at all, and half of HTTP/2's preface: both closed at the header timeout.
    for first in [&b""[..], b"PRI * HTTP/2.0\r\n"] {
        let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
        s.write_all(first).await.unwrap();
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(3600), s.read(&mut buf))
            .await
            .expect("the proxy closes a silent connection")
            .unwrap_or(0);
        assert_eq!(n, 0, "{:?}", &buf[..n]);
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }
    // A connection that made a request is left to the protocol's own timeouts: it is still
    // open, and serves a second request, long after.
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_secs(20)).await;
    s.write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}
