//! The fake provider itself: every scripted reply and fault, observed through a real
//! HTTP client on the same paused-time runtime.

#![cfg(feature = "mock")]

use std::error::Error as _;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, Error as ClientError};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower_llm_retry::mock::{sse, Capacity, MockServer, Reply, Script, SseFrame};

use crate::common::listener::refuses;

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn post(
    client: &HttpClient,
    server: &MockServer,
    path: &str,
    body: &'static str,
) -> Result<Response<Incoming>, ClientError> {
    let request = Request::post(server.uri(path))
        .header("content-type", "application/json")
        .body(Full::from(body))
        .unwrap();
    client.request(request).await
}

async fn body_bytes(response: Response<Incoming>) -> Bytes {
    response.into_body().collect().await.unwrap().to_bytes()
}

async fn body_json(response: Response<Incoming>) -> Value {
    serde_json::from_slice(&body_bytes(response).await).unwrap()
}

fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(err) = source {
        text.push_str(": ");
        text.push_str(&err.to_string());
        source = err.source();
    }
    text
}

/// Lets spawned tasks run until they settle, without moving the clock much.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn default_success_bodies_follow_the_path() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let client = client();

    let response = post(&client, &server, "/v1/messages", r#"{"model":"claude-x"}"#)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "application/json");
    let body = body_bytes(response).await;
    assert!(body.starts_with(br#"{"id":"msg_"#), "{body:?}");
    let message: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["model"], "claude-x");
    assert_eq!(
        message["content"],
        json!([{"type": "text", "text": "Hello!"}])
    );
    assert_eq!(message["stop_reason"], "end_turn");
    assert!(message["id"].as_str().unwrap().starts_with("msg_"));

    let response = post(&client, &server, "/v1/chat/completions", "{}")
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "application/json");
    let completion = body_json(response).await;
    assert_eq!(completion["object"], "chat.completion");
    assert_eq!(completion["choices"][0]["message"]["role"], "assistant");
    assert_eq!(completion["choices"][0]["message"]["content"], "Hello!");
    assert_eq!(completion["choices"][0]["finish_reason"], "stop");
    assert!(completion["id"].as_str().unwrap().starts_with("chatcmpl-"));

    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn steps_run_in_order_then_otherwise() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::openai_error(500, "server_error", "boom"))
            .otherwise(Reply::status(204)),
    )
    .await
    .unwrap();
    let client = client();

    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status().as_u16(), 529);
    // Byte for byte, in the field order the real API uses.
    assert_eq!(
        body_bytes(response).await,
        r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
    );

    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status().as_u16(), 500);
    assert_eq!(
        body_json(response).await,
        json!({"error": {"message": "boom", "type": "server_error", "param": null, "code": "server_error"}})
    );

    for _ in 0..2 {
        let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
        assert_eq!(response.status().as_u16(), 204);
        assert!(body_bytes(response).await.is_empty());
    }

    // Steps pushed at runtime run before the fallback again.
    server.push(Reply::anthropic_error(
        401,
        "authentication_error",
        "invalid x-api-key",
    ));
    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status().as_u16(), 401);
    assert_eq!(
        body_json(response).await["error"]["type"],
        "authentication_error"
    );
    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status().as_u16(), 204);

    let always = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    for _ in 0..3 {
        let response = post(&client, &always, "/v1/messages", "{}").await.unwrap();
        assert_eq!(response.status().as_u16(), 503);
    }
}

#[tokio::test(start_paused = true)]
async fn headers_arrive_including_duplicates() {
    let server = MockServer::start(Script::always(
        Reply::rate_limited("7")
            .header("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")
            .header("x-request-id", "req_123"),
    ))
    .await
    .unwrap();

    let response = post(&client(), &server, "/v1/messages", "{}")
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: Vec<_> = response
        .headers()
        .get_all("retry-after")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert_eq!(retry_after, ["7", "Wed, 21 Oct 2015 07:28:00 GMT"]);
    assert_eq!(response.headers()["x-request-id"], "req_123");
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(
        body_json(response).await["error"]["type"],
        "rate_limit_error"
    );
}

#[tokio::test(start_paused = true)]
async fn json_and_body_replace_the_payload() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(200).json(json!({"ok": true})))
            .then(Reply::success().body("plain")),
    )
    .await
    .unwrap();
    let client = client();

    let response = post(&client, &server, "/x", "{}").await.unwrap();
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(body_json(response).await, json!({"ok": true}));

    let response = post(&client, &server, "/x", "{}").await.unwrap();
    assert_eq!(body_bytes(response).await, "plain");
}

#[tokio::test(start_paused = true)]
async fn delay_before_head_takes_exactly_that_long() {
    let delay = Duration::from_secs(5);
    let server = MockServer::start(Script::new().then(Reply::success().delay(delay)))
        .await
        .unwrap();

    let sent = Instant::now();
    let response = post(&client(), &server, "/v1/messages", "{}")
        .await
        .unwrap();
    let answered = Instant::now();
    assert_eq!(response.status(), StatusCode::OK);

    let received = server.requests()[0].received_at;
    assert_eq!(received, sent, "no virtual time passes on the way in");
    assert_eq!(answered - received, delay);
}

#[tokio::test(start_paused = true)]
async fn reset_fails_the_request_and_is_recorded() {
    let server = MockServer::start(Script::new().then(Reply::reset()))
        .await
        .unwrap();
    let client = client();

    let err = post(&client, &server, "/v1/messages", r#"{"n":1}"#)
        .await
        .unwrap_err();
    assert!(!err.is_connect(), "{err:?}");
    let hyper_err = err
        .source()
        .and_then(|e| e.downcast_ref::<hyper::Error>())
        .expect("a hyper error");
    assert!(hyper_err.is_incomplete_message(), "{}", error_chain(&err));
    assert!(
        error_chain(&err).contains("connection closed before message completed"),
        "{}",
        error_chain(&err)
    );

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].body, r#"{"n":1}"#);

    // The next request gets a fresh connection and the default success.
    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn stall_never_answers() {
    let server = MockServer::start(Script::new().then(Reply::stall()))
        .await
        .unwrap();
    let client = client();

    let start = Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        post(&client, &server, "/v1/messages", "{}"),
    )
    .await;
    assert!(outcome.is_err(), "stalled request was answered");
    assert_eq!(start.elapsed(), Duration::from_secs(30));
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn reset_mid_body_fails_after_the_first_bytes() {
    let server = MockServer::start(Script::new().then(Reply::reset_mid_body(
        200,
        r#"{"id":"msg_01","content":[{"ty"#,
    )))
    .await
    .unwrap();

    let response = post(&client(), &server, "/v1/messages", "{}")
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();

    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(
        frame.into_data().unwrap(),
        r#"{"id":"msg_01","content":[{"ty"#
    );

    let err = loop {
        match body.frame().await {
            Some(Ok(frame)) => assert!(frame.data_ref().is_none_or(|d| d.is_empty())),
            Some(Err(err)) => break err,
            None => panic!("body ended cleanly after a reset"),
        }
    };
    assert!(
        error_chain(&err).contains("error reading a body from connection"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn stall_mid_body_sends_the_first_bytes_then_nothing() {
    let server = MockServer::start(Script::new().then(Reply::stall_mid_body(200, "partial")))
        .await
        .unwrap();

    let response = post(&client(), &server, "/v1/messages", "{}")
        .await
        .unwrap();
    let mut body = response.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "partial");

    let next = tokio::time::timeout(Duration::from_secs(30), body.frame()).await;
    assert!(next.is_err(), "stalled body produced {next:?}");
}

#[tokio::test(start_paused = true)]
async fn sse_frames_arrive_after_their_delays() {
    let events: Vec<SseFrame> = sse::anthropic_message(&["Hel", "lo"])
        .into_iter()
        .enumerate()
        .map(|(i, event)| event.after(Duration::from_millis(100 * i as u64)))
        .collect();
    let expected: Vec<Bytes> = events.iter().map(SseFrame::bytes).collect();
    let server = MockServer::start(Script::new().then(Reply::sse(events)))
        .await
        .unwrap();

    let start = Instant::now();
    let response = post(&client(), &server, "/v1/messages", "{}")
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO, "head is not delayed");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");

    let mut body = response.into_body();
    let mut received = Vec::new();
    let mut last = start;
    while let Some(frame) = body.frame().await {
        let data = frame.unwrap().into_data().unwrap();
        let now = Instant::now();
        received.push((now - last, data));
        last = now;
    }

    assert_eq!(received.len(), expected.len());
    for (i, ((gap, data), want)) in received.iter().zip(&expected).enumerate() {
        assert_eq!(*gap, Duration::from_millis(100 * i as u64), "event {i}");
        assert_eq!(data, want, "event {i}");
    }
    let all: Vec<u8> = received.iter().flat_map(|(_, b)| b.to_vec()).collect();
    assert_eq!(all, expected.concat());

    let text = String::from_utf8(expected.concat()).unwrap();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn sse_then_reset_fails_after_the_events() {
    let mut events = sse::openai_chat(&["Hi"]);
    events.truncate(2);
    let expected: Vec<u8> = events.iter().flat_map(|e| e.bytes()).collect();
    let server = MockServer::start(Script::new().then(Reply::sse_then_reset(events)))
        .await
        .unwrap();

    let response = post(&client(), &server, "/v1/chat/completions", "{}")
        .await
        .unwrap();
    let mut body = response.into_body();
    let mut received = Vec::new();
    let err = loop {
        match body.frame().await {
            Some(Ok(frame)) => received.extend_from_slice(&frame.into_data().unwrap()),
            Some(Err(err)) => break err,
            None => panic!("body ended cleanly after a reset"),
        }
    };
    assert_eq!(received, expected);
    assert!(
        error_chain(&err).contains("error reading a body from connection"),
        "{}",
        error_chain(&err)
    );

    let text = String::from_utf8(received).unwrap();
    let first: Value =
        serde_json::from_str(text.lines().next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
}

#[tokio::test(start_paused = true)]
async fn sse_then_stall_keeps_the_stream_open() {
    let events = vec![
        SseFrame::new("ping", "{}"),
        sse::anthropic_error("overloaded_error").after(Duration::from_secs(1)),
    ];
    let server = MockServer::start(Script::new().then(Reply::sse_then_stall(events)))
        .await
        .unwrap();

    let response = post(&client(), &server, "/v1/messages", "{}")
        .await
        .unwrap();
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "event: ping\ndata: {}\n\n");
    let second = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(
        second,
        "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"
    );
    let next = tokio::time::timeout(Duration::from_secs(30), body.frame()).await;
    assert!(next.is_err(), "stalled stream produced {next:?}");
}

#[test]
fn sse_event_bytes() {
    assert_eq!(SseFrame::new("a", "b").bytes(), "event: a\ndata: b\n\n");
    assert_eq!(SseFrame::data("[DONE]").bytes(), "data: [DONE]\n\n");
    assert_eq!(SseFrame::data("x\ny").bytes(), "data: x\ndata: y\n\n");
    assert_eq!(SseFrame::raw("data: {").bytes(), "data: {");

    let chunks = sse::openai_chat(&["a", "b"]);
    assert_eq!(chunks.last().unwrap().bytes(), "data: [DONE]\n\n");
    let contents: Vec<Value> = chunks[..chunks.len() - 1]
        .iter()
        .map(|e| {
            let bytes = e.bytes();
            let text = std::str::from_utf8(&bytes).unwrap();
            let chunk: Value =
                serde_json::from_str(text.strip_prefix("data: ").unwrap().trim_end()).unwrap();
            chunk["choices"][0]["delta"]["content"].clone()
        })
        .collect();
    assert_eq!(contents, [json!(""), json!("a"), json!("b"), Value::Null]);
}

#[tokio::test(start_paused = true)]
async fn capacity_rejects_bursts_and_recovers() {
    // One token every two seconds, two at once.
    let server = MockServer::start(
        Script::new()
            .capacity(Capacity::token_bucket(0.5, 2))
            .then(Reply::status(201)),
    )
    .await
    .unwrap();
    let client = client();

    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status().as_u16(), 201, "the first step runs");
    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status().as_u16(), 200);

    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "2");
    assert_eq!(
        body_json(response).await["error"]["type"],
        "rate_limit_error"
    );

    tokio::time::advance(Duration::from_millis(1500)).await;
    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        response.headers()["retry-after"],
        "1",
        "rounded up, at least one"
    );

    tokio::time::advance(Duration::from_millis(500)).await;
    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    // Refill never exceeds the burst.
    tokio::time::advance(Duration::from_secs(60)).await;
    for _ in 0..2 {
        let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let response = post(&client, &server, "/v1/messages", "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);

    // Rejected requests are recorded too.
    assert_eq!(server.request_count(), 8);
}

#[tokio::test(start_paused = true)]
async fn recorded_requests_match_what_was_sent() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let client = client();

    let body = r#"{"model":"claude-x","messages":[{"role":"user","content":"hi"}]}"#;
    let request = Request::post(server.uri("/v1/messages?beta=true"))
        .header("x-api-key", "sk-test")
        .header("anthropic-version", "2023-06-01")
        .body(Full::from(body))
        .unwrap();
    client.request(request).await.unwrap();
    let request = Request::get(server.url("v1/models").parse::<http::Uri>().unwrap())
        .body(Full::default())
        .unwrap();
    client.request(request).await.unwrap();

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].method, http::Method::POST);
    assert_eq!(requests[0].uri.path(), "/v1/messages");
    assert_eq!(requests[0].uri.query(), Some("beta=true"));
    assert_eq!(requests[0].headers["x-api-key"], "sk-test");
    assert_eq!(requests[0].headers["anthropic-version"], "2023-06-01");
    assert_eq!(requests[0].body, body);
    assert_eq!(requests[0].json().unwrap()["model"], "claude-x");
    assert_eq!(requests[1].method, http::Method::GET);
    assert_eq!(requests[1].uri.path(), "/v1/models");
    assert!(requests[1].body.is_empty());
    assert!(requests[0].received_at <= requests[1].received_at);

    assert_eq!(
        server.url("/v1/messages"),
        format!("http://{}/v1/messages", server.addr())
    );
}

/// Opens a raw connection and sends one request on it, so that no client
/// task is involved.
async fn raw_request(server: &MockServer) -> TcpStream {
    let mut stream = TcpStream::connect(server.addr()).await.unwrap();
    stream
        .write_all(b"POST /v1/messages HTTP/1.1\r\nhost: mock\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .unwrap();
    stream
}

async fn wait_for_requests(server: &MockServer, n: usize) {
    for _ in 0..100 {
        if server.request_count() >= n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("expected {n} requests, got {}", server.request_count());
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_every_task() {
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();

    let server = MockServer::start(
        Script::new()
            .then(Reply::stall())
            .then(Reply::stall_mid_body(200, "x"))
            .then(Reply::sse_then_stall(vec![SseFrame::data("a")])),
    )
    .await
    .unwrap();
    let mut streams = Vec::new();
    for n in 1..=3 {
        streams.push(raw_request(&server).await);
        wait_for_requests(&server, n).await;
    }
    // An idle connection too.
    streams.push(TcpStream::connect(server.addr()).await.unwrap());
    settle().await;
    assert_eq!(metrics.num_alive_tasks(), before + 5);

    server.shutdown();
    settle().await;
    assert_eq!(metrics.num_alive_tasks(), before);

    // The connections were closed, not merely abandoned.
    for mut stream in streams {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(1), stream.read_to_end(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(_)) | Ok(Err(_))),
            "connection still open"
        );
    }
    assert!(refuses(server.addr()));
}

#[tokio::test(start_paused = true)]
async fn drop_ends_every_task() {
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();

    let server = MockServer::start(Script::always(Reply::stall()))
        .await
        .unwrap();
    let addr = server.addr();
    let _stream = raw_request(&server).await;
    wait_for_requests(&server, 1).await;
    settle().await;
    assert_eq!(metrics.num_alive_tasks(), before + 2);

    drop(server);
    settle().await;
    assert_eq!(metrics.num_alive_tasks(), before);
    assert!(refuses(addr));
}

#[tokio::test(start_paused = true)]
async fn shutdown_fails_in_flight_client_requests() {
    let server = MockServer::start(Script::always(Reply::stall()))
        .await
        .unwrap();
    let client = client();
    let in_flight = post(&client, &server, "/v1/messages", "{}");
    tokio::pin!(in_flight);

    tokio::select! {
        _ = &mut in_flight => panic!("stalled request was answered"),
        () = wait_for_requests(&server, 1) => {}
    }
    server.shutdown();
    let err = tokio::time::timeout(Duration::from_secs(1), in_flight)
        .await
        .expect("shutdown closes the connection")
        .unwrap_err();
    assert!(!err.is_connect(), "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn a_silence_holds_the_stream_quiet_before_it_is_cut() {
    let first = SseFrame::new("ping", "{}");
    let events = vec![first.clone(), SseFrame::silence(Duration::from_secs(30))];
    let server = MockServer::start(Script::new().then(Reply::sse_then_reset(events)))
        .await
        .unwrap();

    let t0 = Instant::now();
    let response = post(&client(), &server, "/v1/messages", "{}")
        .await
        .unwrap();
    let mut body = response.into_body();
    let got = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(got, first.bytes());
    assert_eq!(t0.elapsed(), Duration::ZERO);
    // Nothing is written for the silence: the next thing the client sees is the cut.
    let end = body.frame().await.unwrap();
    assert!(end.is_err(), "{end:?}");
    assert_eq!(t0.elapsed(), Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn reject_prefill_refuses_an_assistant_message_last_in_either_shape() {
    let server = MockServer::start(Script::new().reject_prefill())
        .await
        .unwrap();
    let client = client();
    const PREFILL: &str = r#"{"model":"m","messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hel"}]}"#;
    const USER_LAST: &str = r#"{"model":"m","messages":[{"role":"user","content":"Hi"}]}"#;

    let res = post(&client, &server, "/v1/chat/completions", PREFILL)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = body_json(res).await;
    assert_eq!(body["error"]["code"], "invalid_prefill");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["param"], "messages");

    let res = post(&client, &server, "/v1/messages", PREFILL)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = body_json(res).await;
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("does not support assistant message prefill"));

    // A conversation that ends with the user is answered as the script says.
    for path in ["/v1/chat/completions", "/v1/messages"] {
        let res = post(&client, &server, path, USER_LAST).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{path}");
        let _ = body_bytes(res).await;
    }
    assert_eq!(server.request_count(), 4);
}
