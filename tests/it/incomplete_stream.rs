//! A stream that ends cleanly without its protocol's terminal event is an error, not an end:
//! after the commit point the caller reads every byte the server sent, then
//! `ErrorKind::IncompleteStream`; before it, the cut is retried like a reset. For Anthropic
//! Messages, OpenAI Chat Completions and OpenAI Responses, over real HTTP on 127.0.0.1.

use crate::common::*;
use bytes::Bytes;
use http::StatusCode;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, Reply, Script, SseFrame};
use tower_llm_retry::stream::{IncompleteStream, StreamProtocol};
use tower_llm_retry::{ErrorKind, RetryLayer, RetryTrail};

struct Case {
    protocol: StreamProtocol,
    /// Events up to and including some output.
    started: Vec<SseFrame>,
    /// The events that end the stream properly.
    ending: Vec<SseFrame>,
    /// The preamble alone: no output yet.
    preamble: Vec<SseFrame>,
    last_event: &'static str,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            protocol: StreamProtocol::AnthropicMessages,
            started: vec![
                SseFrame::new("message_start", r#"{"type":"message_start","message":{}}"#),
                SseFrame::new(
                    "content_block_start",
                    r#"{"type":"content_block_start","index":0}"#,
                ),
                SseFrame::new(
                    "content_block_delta",
                    r#"{"type":"content_block_delta","delta":{"text":"part"}}"#,
                ),
                SseFrame::new(
                    "content_block_delta",
                    r#"{"type":"content_block_delta","delta":{"text":"ial"}}"#,
                ),
            ],
            ending: vec![
                SseFrame::new("content_block_stop", r#"{"type":"content_block_stop"}"#),
                SseFrame::new("message_delta", r#"{"type":"message_delta"}"#),
                SseFrame::new("message_stop", r#"{"type":"message_stop"}"#),
            ],
            preamble: vec![
                SseFrame::new("message_start", r#"{"type":"message_start","message":{}}"#),
                SseFrame::new("ping", r#"{"type":"ping"}"#),
            ],
            last_event: "content_block_delta",
        },
        Case {
            protocol: StreamProtocol::OpenAiChat,
            started: vec![
                SseFrame::data(
                    r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                ),
                SseFrame::data(
                    r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"part"},"finish_reason":null}]}"#,
                ),
                SseFrame::data(
                    r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ial"},"finish_reason":null}]}"#,
                ),
            ],
            // A finish_reason and no `[DONE]`: some compatible servers never send it.
            ending: vec![SseFrame::data(
                r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            )],
            preamble: vec![SseFrame::data(
                r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            )],
            last_event: "chat.completion.chunk",
        },
        Case {
            protocol: StreamProtocol::OpenAiResponses,
            started: vec![
                SseFrame::new("response.created", r#"{"type":"response.created"}"#),
                SseFrame::new(
                    "response.output_text.delta",
                    r#"{"type":"response.output_text.delta","delta":"part"}"#,
                ),
                SseFrame::new(
                    "response.output_text.delta",
                    r#"{"type":"response.output_text.delta","delta":"ial"}"#,
                ),
            ],
            ending: vec![SseFrame::new(
                "response.completed",
                r#"{"type":"response.completed"}"#,
            )],
            preamble: vec![
                SseFrame::new("response.created", r#"{"type":"response.created"}"#),
                SseFrame::new("response.in_progress", r#"{"type":"response.in_progress"}"#),
            ],
            last_event: "response.*",
        },
    ]
}

fn svc() -> tower_llm_retry::retry::Retry<HttpClient> {
    ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .service(http_client())
}

#[tokio::test(start_paused = true)]
async fn a_clean_cut_after_output_is_an_incomplete_stream_error_with_every_byte_delivered() {
    for case in cases() {
        let server = MockServer::start(Script::new().then(Reply::sse(case.started.clone())))
            .await
            .unwrap();
        let res = svc()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let (bytes, err) = drain(res.into_body()).await;
        let sent = concat(&case.started);
        assert_eq!(sha256(&bytes), sha256(&sent), "{:?}", case.protocol);
        let err = err.unwrap_or_else(|| panic!("{:?}: the cut ended cleanly", case.protocol));
        assert_eq!(err.kind(), ErrorKind::IncompleteStream);
        let cut = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<IncompleteStream>())
            .unwrap();
        assert_eq!(cut.protocol(), case.protocol);
        assert_eq!(cut.delivered_bytes(), sent.len() as u64);
        assert_eq!(cut.last_event(), Some(case.last_event));
        // Never re-sent after output.
        assert_eq!(server.request_count(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_ends_properly_is_no_error() {
    for case in cases() {
        let events: Vec<_> = case.started.iter().chain(&case.ending).cloned().collect();
        let server = MockServer::start(Script::new().then(Reply::sse(events.clone())))
            .await
            .unwrap();
        let res = svc()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        let (bytes, err) = drain(res.into_body()).await;
        assert!(err.is_none(), "{:?}: {err:?}", case.protocol);
        assert_eq!(sha256(&bytes), sha256(&concat(&events)));
    }
}

#[tokio::test(start_paused = true)]
async fn openai_done_alone_also_ends_a_chat_stream() {
    let mut events = cases().swap_remove(1).started;
    events.push(SseFrame::data("[DONE]"));
    let server = MockServer::start(Script::new().then(Reply::sse(events.clone())))
        .await
        .unwrap();
    let res = svc()
        .oneshot(anthropic_request(&server.url("/v1/chat/completions"), BODY))
        .await
        .unwrap();
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&events));
}

#[tokio::test(start_paused = true)]
async fn a_clean_cut_before_output_is_retried_and_the_caller_sees_only_the_good_attempt() {
    for case in cases() {
        let good: Vec<_> = case.started.iter().chain(&case.ending).cloned().collect();
        let server = MockServer::start(
            Script::new()
                .then(Reply::sse(case.preamble.clone()))
                .then(Reply::sse(good.clone())),
        )
        .await
        .unwrap();
        let res = svc()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        let trail = res.extensions().get::<RetryTrail>().cloned().unwrap();
        assert_eq!(trail.total_attempts(), 2, "{:?}", case.protocol);
        assert!(trail.attempts()[0]
            .error
            .as_deref()
            .unwrap()
            .contains("without its terminal event"));
        let (bytes, err) = drain(res.into_body()).await;
        assert!(err.is_none(), "{:?}: {err:?}", case.protocol);
        assert_eq!(sha256(&bytes), sha256(&concat(&good)));
        assert_eq!(server.request_count(), 2);
    }
}

#[tokio::test(start_paused = true)]
async fn the_check_can_be_switched_off_and_unknown_streams_pass() {
    let cut = cases().swap_remove(0).started;
    let server = MockServer::start(Script::new().then(Reply::sse(cut.clone())))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(exact_policy())
                .stream_end_check(false),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&cut));

    // A stream of no known protocol ends when its body ends.
    let other = vec![SseFrame::new("tick", "1"), SseFrame::data("hello")];
    let server = MockServer::start(Script::new().then(Reply::sse(other.clone())))
        .await
        .unwrap();
    let res = svc_gate_off()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&other));
}

fn svc_gate_off() -> tower_llm_retry::retry::Retry<HttpClient> {
    ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()).sse_gate(false))
        .service(http_client())
}

#[tokio::test(start_paused = true)]
async fn with_the_gate_off_a_cut_stream_is_still_an_error() {
    let cut = cases().swap_remove(2).started;
    let server = MockServer::start(Script::new().then(Reply::sse(cut.clone())))
        .await
        .unwrap();
    let res = svc_gate_off()
        .oneshot(anthropic_request(&server.url("/v1/responses"), BODY))
        .await
        .unwrap();
    let (bytes, err): (Bytes, _) = drain(res.into_body()).await;
    assert_eq!(bytes, concat(&cut));
    assert_eq!(err.unwrap().kind(), ErrorKind::IncompleteStream);
}

/// One request through `layer` to a server that always answers the event stream `raw`.
async fn one_raw_stream(
    raw: &'static str,
    layer: RetryLayer,
) -> (
    MockServer,
    http::Response<tower_llm_retry::RetryBody<hyper::body::Incoming>>,
) {
    let server = MockServer::start(Script::always(Reply::sse(vec![SseFrame::raw(raw)])))
        .await
        .unwrap();
    let res = ServiceBuilder::new()
        .layer(layer)
        .service(http_client())
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    (server, res)
}

/// SSE counts a lone `\r` as a line end. A stream whose last event ends `\r\r` is whole at
/// its end (no byte follows to say the `\r` was half of `\r\n`), and that last event is
/// judged: a whole answer is no error, an in-band client error before output is not retried.
#[tokio::test(start_paused = true)]
async fn a_stream_with_lone_cr_line_ends_is_judged_to_its_last_event() {
    let whole = "event: message_start\rdata: {\"type\":\"message_start\",\"message\":{}}\r\r\
                 event: content_block_delta\rdata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\r\r\
                 event: message_stop\rdata: {\"type\":\"message_stop\"}\r\r";
    for gate in [true, false] {
        let layer = RetryLayer::new().policy(exact_policy()).sse_gate(gate);
        let (server, res) = one_raw_stream(whole, layer).await;
        let (bytes, err) = drain(res.into_body()).await;
        assert!(err.is_none(), "gate {gate}: {err:?}");
        assert_eq!(bytes, Bytes::from_static(whole.as_bytes()));
        assert_eq!(server.request_count(), 1);
    }
    let client_error = "event: message_start\rdata: {\"type\":\"message_start\",\"message\":{}}\r\r\
                        event: error\rdata: {\"type\":\"error\",\"error\":{\"type\":\"invalid_request_error\"}}\r\r";
    let (server, res) =
        one_raw_stream(client_error, RetryLayer::new().policy(exact_policy())).await;
    let trail = res.extensions().get::<RetryTrail>().cloned().unwrap();
    assert_eq!(
        trail.attempts()[0].class,
        tower_llm_retry::classify::FailureClass::Client
    );
    assert_eq!(server.request_count(), 1, "a client error is not retried");
}

/// The failover benchmark's fault S11 in the Anthropic dialect: the answer and its final
/// `message_delta` (stop reason and usage) came, then the body ended cleanly without
/// `message_stop`. Complete by its content: a clean end for the caller.
#[tokio::test(start_paused = true)]
async fn an_anthropic_stream_that_ends_after_its_stop_reason_is_complete() {
    use tower_llm_retry::mock::sse;
    let mut events = sse::anthropic_message(&["Complete ", "answer."]);
    let stop = events.pop().unwrap();
    assert!(stop.bytes().starts_with(b"event: message_stop\n"));
    assert!(concat(&events).ends_with(b"\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":2}}\n\n"));
    let server = MockServer::start(Script::new().then(Reply::sse(events.clone())))
        .await
        .unwrap();
    let res = svc()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(sha256(&bytes), sha256(&concat(&events)));
    assert_eq!(server.request_count(), 1);
}

/// Cut before the `message_delta` that carries the stop reason: incomplete, as ever.
#[tokio::test(start_paused = true)]
async fn an_anthropic_stream_cut_before_its_stop_reason_is_incomplete() {
    use tower_llm_retry::mock::sse;
    let mut events = sse::anthropic_message(&["Partial ", "answer"]);
    // message_start, content_block_start, two deltas, content_block_stop.
    events.truncate(5);
    let server = MockServer::start(Script::new().then(Reply::sse(events.clone())))
        .await
        .unwrap();
    let res = svc()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(sha256(&bytes), sha256(&concat(&events)));
    let err = err.expect("the cut before the stop reason");
    assert_eq!(err.kind(), ErrorKind::IncompleteStream);
    let cut = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<IncompleteStream>())
        .unwrap();
    assert_eq!(cut.protocol(), StreamProtocol::AnthropicMessages);
    assert_eq!(cut.last_event(), Some("content_block_stop"));
    assert_eq!(server.request_count(), 1);
}
