//! HTTP as the RFCs say, at both ends: methods the proxy never forwards, paths that could
//! leave the base path, and upstream answers whose framing or status cannot be passed on.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_llm_retry::mock::{Reply, Script};

use crate::common::*;

/// Sends raw bytes and reads what comes back within 5 s (or until the proxy closes).
async fn raw(h: &Harness, bytes: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// TRACE would echo the held key back; CONNECT would make a tunnel; a method of WebDAV or
/// a made-up one is no API's. Each is a 405 with `Allow`, in the route's envelope, and the
/// upstream sees nothing.
#[tokio::test(start_paused = true)]
async fn trace_connect_and_unknown_methods_are_a_405_and_nothing_is_sent() {
    let h = start(Script::always(Reply::success())).await;
    for method in ["TRACE", "PROPFIND", "FOO"] {
        let req = Request::builder()
            .method(method)
            .uri(h.url("/v1/messages"))
            .header("x-api-key", "sk-client")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = h.send(req).await;
        assert_eq!(res.status(), 405, "{method}");
        assert_eq!(
            header(&res, "allow"),
            Some("GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS")
        );
        assert_eq!(
            header(&res, "x-llm-retry-error"),
            Some("method_not_allowed")
        );
        let v = json(res).await;
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    let answer = raw(
        &h,
        b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nhost: api.anthropic.com:443\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 405 "), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nallow: get, post, put, patch, delete, head, options\r\n"),
        "{answer}"
    );
    // The methods the APIs use still go through.
    for method in ["GET", "POST", "DELETE", "OPTIONS"] {
        let req = Request::builder()
            .method(method)
            .uri(h.url("/v1/models"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        assert_eq!(h.send(req).await.status(), 200, "{method}");
    }
    let seen: Vec<String> = h
        .mock
        .requests()
        .iter()
        .map(|r| r.method.to_string())
        .collect();
    assert_eq!(seen, ["GET", "POST", "DELETE", "OPTIONS"]);
}

/// `..` and `.` segments, plain or percent-encoded in any case, and encoded slashes: a 400,
/// nothing sent upstream (where a path-normalising server would resolve them).
#[tokio::test(start_paused = true)]
async fn dot_segments_and_encoded_slashes_are_a_400_and_nothing_is_sent() {
    let h = start(Script::always(Reply::success())).await;
    for path in [
        "/v1/messages/../../admin",
        "/v1/%2e%2e/admin",
        "/v1/%2E%2e/admin",
        "/v1/.%2E/admin",
        "/v1/./messages",
        "/anthropic/..%2f..%2fadmin",
        "/v1/messages%2F..%2Fadmin",
        "/v1/a%5c..",
    ] {
        let res = h
            .send(h.post(path, MESSAGES).body(Full::from(MESSAGES)).unwrap())
            .await;
        assert_eq!(res.status(), 400, "{path}");
        assert_eq!(
            header(&res, "x-llm-retry-error"),
            Some("bad_path"),
            "{path}"
        );
    }
    // The same through raw bytes, as no client library would send them.
    let answer = raw(
        &h,
        b"POST /v1/messages/../../admin HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert_eq!(h.mock.request_count(), 0);
    // A dot inside a segment is only a dot.
    let res = h
        .send(
            Request::get(h.url("/v1/models/claude-3.5..x"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
    assert_eq!(res.status(), 200);
    assert_eq!(h.mock.requests()[0].uri.path(), "/v1/models/claude-3.5..x");
}

/// An answer framed chunked that also states `Content-Length: 5`: chunked wins (RFC 9112
/// §6.3) and the length goes, so the client gets the whole body and knows where it ends.
#[tokio::test(start_paused = true)]
async fn chunked_with_a_content_length_reaches_the_client_whole() {
    let body = br#"{"id":"msg_1","type":"message","content":[]}"#;
    let mut answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5\r\n\
transfer-encoding: chunked\r\n\r\n"
        .to_vec();
    for part in body.chunks(7) {
        answer.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        answer.extend_from_slice(part);
        answer.extend_from_slice(b"\r\n");
    }
    answer.extend_from_slice(b"0\r\n\r\n");
    let h = start(Script::always(Reply::raw(answer))).await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "content-length"), None);
    let (frames, end) = frames(res).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(sha256(&joined(&frames)), sha256(body));
    assert_eq!(h.mock.request_count(), 1);
}

/// A `101 Switching Protocols` to a POST that asked for no upgrade: a 502 in the envelope,
/// and the client's connection serves its next request.
#[tokio::test(start_paused = true)]
async fn an_unasked_101_is_a_502_and_the_connection_serves_on() {
    let script = Script::new()
        .then(Reply::raw(
            &b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"[..],
        ))
        .otherwise(Reply::success());
    let h = start(script).await;
    let tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let (mut conn, driver) =
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(driver);
    let res = conn
        .send_request(
            h.post("/v1/messages", MESSAGES)
                .body(Full::from(MESSAGES))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 502);
    assert_eq!(header(&res, "x-llm-retry-error"), Some("upstream"));
    let v: serde_json::Value =
        serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "api_error", "{v}");
    conn.ready().await.unwrap();
    let res = conn
        .send_request(
            h.post("/v1/messages", MESSAGES)
                .body(Full::from(MESSAGES))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(h.mock.request_count(), 2);
}

/// An answer whose chunked framing is broken before its first body byte: the proxy has not
/// sent its head yet, so the client gets a 502 in the envelope, not a bare close.
#[tokio::test(start_paused = true)]
async fn a_bad_first_chunk_is_a_502_in_the_envelope() {
    let h = start(Script::always(Reply::raw(
        &b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\nzz-not-a-size\r\n"[..],
    )))
    .await;
    let req = h
        .post("/v1/messages", MESSAGES)
        .header("x-llm-retry", "off")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 502);
    assert_eq!(header(&res, "x-llm-retry-error"), Some("upstream"));
    let v = json(res).await;
    assert_eq!(v["error"]["type"], "api_error", "{v}");
    assert_eq!(h.mock.request_count(), 1);
}

/// Decision: an answer labelled `text/event-stream` whose bytes are no SSE at all is relayed
/// byte for byte (the proxy does not judge an upstream's payload; the client's SDK rejects
/// it), and the stream's end is the upstream's.
#[tokio::test(start_paused = true)]
async fn an_event_stream_of_random_bytes_is_relayed_byte_for_byte() {
    // Bytes of a fixed xorshift: no line is an SSE field, some are not UTF-8.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    let reply = Reply::status(200)
        .header("content-type", "text/event-stream")
        .body(noise.clone());
    let h = start(Script::always(reply)).await;
    let res = h.messages(MESSAGES_STREAM).await;
    assert_eq!(res.status(), 200);
    let (frames, end) = frames(res).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(sha256(&joined(&frames)), sha256(&noise));
}
