//! Connection-level limits against real sockets: the idle timeout of HTTP/2 connections, the
//! connection cap, and the write timeout of a client that does not read.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower_llm_retry::mock::{Reply, Script, SseFrame};

use crate::common::*;

const LIVEZ: &[u8] = b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n";

/// Sends `GET /livez` on `s` and returns the first bytes of the answer.
async fn livez(s: &mut TcpStream) -> String {
    s.write_all(LIVEZ).await.unwrap();
    let mut buf = [0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf))
        .await
        .expect("answered at once")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Whether the proxy closed `s` (end of stream or reset) within a second.
async fn closed_at_once(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
        Err(_) => false,
        Ok(Ok(n)) => n == 0,
        Ok(Err(_)) => true,
    }
}

#[tokio::test(start_paused = true)]
async fn an_idle_http2_connection_is_closed_after_the_idle_timeout() {
    let h = start(Script::always(Reply::success())).await;
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let res = send
        .send_request(
            Request::get(h.url("/livez"))
                .body(Empty::<Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "ok\n");
    let idle_since = tokio::time::Instant::now();
    // The client answers the proxy's keep-alive pings all along (every 20 s): only the idle
    // timeout closes the connection, 30 s after its last stream ended.
    tokio::time::timeout(Duration::from_secs(3600), conn)
        .await
        .expect("the proxy closes an idle HTTP/2 connection")
        .unwrap()
        .expect("closed with GOAWAY, not cut");
    assert_eq!(idle_since.elapsed(), Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn an_http2_connection_with_a_stream_open_is_not_idle() {
    // A connection with a stream open is not idle: a response that takes longer than the
    // idle timeout is delivered whole, and the connection closes 30 s after it ends.
    // No pings here: under paused time the clock can jump to a ping's deadline before its
    // answer, already on the socket, is read (the pings on an idle connection are above).
    let h = start_with(
        Script::always(Reply::sse(vec![
            SseFrame::data("one"),
            SseFrame::data("two").after(Duration::from_secs(50)),
        ])),
        |c| c.http2_keep_alive_secs = 0,
    )
    .await;
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    // No request body: the stream is what matters here.
    let req = Request::get(h.url("/v1/models"))
        .header("x-api-key", "sk-client")
        .header("anthropic-version", "2023-06-01")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let started = tokio::time::Instant::now();
    let res = send.send_request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "data: one\n\ndata: two\n\n");
    assert_eq!(started.elapsed(), Duration::from_secs(50));
    let idle_since = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(3600), conn)
        .await
        .expect("closed once idle")
        .unwrap()
        .unwrap();
    assert_eq!(idle_since.elapsed(), Duration::from_secs(30));
    drop(send);
}

/// Writes a Messages request of `body` on `s` without reading its answer.
async fn post_messages(s: &mut TcpStream, body: &str) {
    let head = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         anthropic-version: 2023-06-01\r\nx-api-key: sk-client\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn at_the_connection_cap_a_silent_then_an_idle_connection_gives_its_place_else_a_new_one_is_closed(
) {
    let slow = Reply::success().delay(Duration::from_secs(10));
    let h = start_with(Script::always(slow), |c| c.max_connections = 3).await;
    // Three connections that say nothing fill the cap.
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(h.addr).await.unwrap());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // A new client is served: the oldest silent connection made room for it, at once.
    let mut fresh = TcpStream::connect(h.addr).await.unwrap();
    let answer = livez(&mut fresh).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        closed_at_once(&mut silent[0]).await,
        "the oldest silent one"
    );
    assert!(!closed_at_once(&mut silent[1]).await);
    assert!(!closed_at_once(&mut silent[2]).await);
    // Now every connection within the cap has made a request and waits for the next: a new
    // one takes the place of the one idle longest (`fresh`, whose request ended first), and
    // the others go on being served.
    let mut served = silent.split_off(1);
    for s in &mut served {
        let answer = livez(s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let mut next = TcpStream::connect(h.addr).await.unwrap();
    let answer = livez(&mut next).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed_at_once(&mut fresh).await, "the one idle longest");
    for s in &mut served {
        let answer = livez(s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    // With a request in flight on each, none is idle: one more is closed at once, and the
    // requests in flight are answered.
    drop((served, next));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut busy = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(h.addr).await.unwrap();
        post_messages(&mut s, MESSAGES).await;
        busy.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.mock.request_count(), 3);
    let mut over = TcpStream::connect(h.addr).await.unwrap();
    let _ = over.write_all(LIVEZ).await;
    assert!(closed_at_once(&mut over).await, "over the cap");
    for s in &mut busy {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
            .await
            .expect("answered")
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    }
    // Answered, they are idle: the next new one is served in the place of one of them.
    let mut next = TcpStream::connect(h.addr).await.unwrap();
    let answer = livez(&mut next).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(start_paused = true)]
async fn a_client_that_does_not_read_is_cut_at_the_write_timeout_and_frees_its_slot() {
    // 64 MiB of events: far more than the sockets' buffers hold.
    let chunk = Bytes::from(format!("data: {}\n\n", "x".repeat(64 * 1024 - 8)));
    let frames = (0..1024).map(|_| SseFrame::raw(chunk.clone())).collect();
    let h = start_with(
        Script::new()
            .then(Reply::sse(frames))
            .then(Reply::success()),
        |c| c.max_concurrent_requests = 1,
    )
    .await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut reader = socket.connect(h.addr).await.unwrap();
    post_messages(&mut reader, MESSAGES_STREAM).await;
    // The stream fills the buffers and waits on the client: it holds the one slot.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.mock.request_count(), 1);
    assert_eq!(h.messages(MESSAGES).await.status(), 503);
    // 30 s after the proxy's writes first waited, the connection is cut and the slot free.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
    assert_eq!(h.mock.request_count(), 2);
    // What the client reads now ends short of the 64 MiB: the proxy cut it.
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    assert!(got < 64 << 20, "{got}");
}

#[tokio::test(start_paused = true)]
async fn an_http2_stream_the_client_does_not_read_is_cut_at_the_write_timeout() {
    // Over HTTP/2 the client's flow-control window, not the socket, stops the stream: the
    // socket stays writable and only the response's own wait shows the client is not reading.
    let chunk = Bytes::from(format!("data: {}\n\n", "x".repeat(16 * 1024 - 8)));
    let frames = (0..64).map(|_| SseFrame::raw(chunk.clone())).collect();
    let h = start_with(
        Script::new()
            .then(Reply::sse(frames))
            .then(Reply::success()),
        |c| {
            c.max_concurrent_requests = 1;
            c.http2_keep_alive_secs = 0;
        },
    )
    .await;
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(16 * 1024)
        .adaptive_window(false)
        .handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let req = Request::get(h.url("/v1/models"))
        .header("x-api-key", "sk-client")
        .header("anthropic-version", "2023-06-01")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let started = tokio::time::Instant::now();
    // The head is in, the body is not read: the stream holds the one slot.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.messages(MESSAGES).await.status(), 503);
    // The connection is cut once the response has waited 30 s on the client, and the slot
    // is free.
    tokio::time::timeout(Duration::from_secs(3600), conn)
        .await
        .expect("the proxy cuts the connection")
        .unwrap()
        .expect_err("cut, not closed cleanly");
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
    drop(res);
}

#[tokio::test(start_paused = true)]
async fn an_overload_answer_closes_its_connection_at_once() {
    let h = std::sync::Arc::new(
        start_with(
            Script::always(Reply::success().delay(Duration::from_secs(10))),
            |c| c.max_concurrent_requests = 1,
        )
        .await,
    );
    // One request holds the one slot for 10 s.
    let slow = {
        let h = h.clone();
        tokio::spawn(async move { h.messages(MESSAGES).await.status() })
    };
    while h.mock.request_count() < 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The next is refused with 503 and Retry-After at once, and its connection closes with
    // the answer: a refused client does not keep its buffers in the proxy.
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let head = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         anthropic-version: 2023-06-01\r\nx-api-key: sk-client\r\ncontent-length: {}\r\n\r\n{MESSAGES}",
        MESSAGES.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let started = tokio::time::Instant::now();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(3600), s.read_to_end(&mut out))
        .await
        .expect("the connection ends")
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(10),
        "{:?}",
        started.elapsed()
    );
    let answer = String::from_utf8_lossy(&out).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("\r\nretry-after: 1\r\n"), "{answer}");
    assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
    assert!(answer.contains("overloaded_error"), "{answer}");
    // Nothing went upstream for it, and the request in flight is served.
    assert_eq!(h.mock.request_count(), 1);
    assert_eq!(slow.await.unwrap(), 200);
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
}

/// A Messages request to the proxy at `base`.
fn messages_to(base: &str) -> Request<http_body_util::Full<Bytes>> {
    Request::post(format!("{base}/v1/messages"))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-test")
        .header("anthropic-version", "2023-06-01")
        .body(http_body_util::Full::from(MESSAGES))
        .unwrap()
}

/// Sends `rounds` requests on each of `clients` (a connection each), one request at a time
/// over all of them, and checks each answer is the upstream's own bytes.
async fn one_at_a_time(base: &str, clients: &[HttpClient], rounds: usize, reply: &[u8]) {
    for _ in 0..rounds {
        for client in clients {
            let res = client.request(messages_to(base)).await.unwrap();
            assert_eq!(res.status(), 200);
            let got = res.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(sha256(&got), sha256(reply));
        }
    }
}

/// A client that keeps its one connection alive between requests.
fn kept_alive() -> HttpClient {
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1)
        .build(tcp)
}

// Real time: the workers' runtimes keep their own clocks.
#[tokio::test]
async fn on_workers_a_connection_and_the_upstream_connections_of_its_requests_stay_on_one_thread() {
    use std::sync::Arc;
    use tower_llm_retry_proxy::{Proxy, Workers};

    let reply = br#"{"id":"msg_1","type":"message","content":[]}"#;
    // On the test's one thread (`serve`): four client connections, one request at a time,
    // share one pool, so the upstream sees one connection.
    let mock = tower_llm_retry::mock::MockServer::start(Script::always(
        Reply::status(200).body(&reply[..]),
    ))
    .await
    .unwrap();
    let config = config_for(&mock);
    let h = serve(mock, config).await;
    let clients: Vec<HttpClient> = (0..4).map(|_| kept_alive()).collect();
    one_at_a_time(&h.url(""), &clients, 3, reply).await;
    assert_eq!(h.mock.request_count(), 12);
    assert_eq!(h.mock.connection_count(), 1);

    // On two workers: the four connections go two to each, and each worker opens its own
    // upstream connection, reused for all six requests it carries.
    let mock = tower_llm_retry::mock::MockServer::start(Script::always(
        Reply::status(200).body(&reply[..]),
    ))
    .await
    .unwrap();
    let config = config_for(&mock);
    let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let workers = Arc::new(Workers::start(2).unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn({
        let workers = workers.clone();
        let proxy = Proxy::new(config).unwrap();
        async move {
            proxy
                .serve_on(
                    listener,
                    async move {
                        let _ = stopped.await;
                    },
                    &workers,
                )
                .await
        }
    });
    let clients: Vec<HttpClient> = (0..4).map(|_| kept_alive()).collect();
    one_at_a_time(&base, &clients, 3, reply).await;
    assert_eq!(mock.request_count(), 12);
    assert_eq!(workers.connections(), [2, 2]);
    assert_eq!(mock.connection_count(), 2);

    // A request in flight when the shutdown comes is answered; then every connection ends
    // and no worker counts one.
    mock.push(
        Reply::status(200)
            .body(&reply[..])
            .delay(Duration::from_millis(300)),
    );
    let slow = {
        let client = clients[0].clone();
        let base = base.clone();
        tokio::spawn(async move {
            let req = messages_to(&base);
            let res = client.request(req).await.unwrap();
            (
                res.status(),
                res.into_body().collect().await.unwrap().to_bytes(),
            )
        })
    };
    while mock.request_count() < 13 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop.send(());
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(sha256(&body), sha256(reply));
    served.await.unwrap().unwrap();
    drop(clients);
    assert_eq!(workers.connections(), [0, 0]);
}
