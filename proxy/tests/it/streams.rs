//! After the commit point: a stream that dies, stalls or ends cleanly without its terminal
//! event reaches the client as the protocol's own error event, then an aborted connection.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use tower_llm_retry::mock::{sse, Reply, Script, SseFrame};

use crate::common::*;

fn anthropic_partial() -> Vec<SseFrame> {
    let mut e = sse::anthropic_message(&["Partial ", "answer"]);
    e.truncate(4); // message_start, content_block_start, two deltas
    e
}

fn chat_partial() -> Vec<SseFrame> {
    let mut e = sse::openai_chat(&["Partial ", "answer"]);
    e.truncate(3); // role chunk and two content chunks
    e
}

/// The bytes after `prefix`, as one SSE event `(event name, data JSON)`.
fn tail_event(all: &Bytes, prefix: &Bytes) -> (Option<String>, serde_json::Value) {
    assert!(
        all.starts_with(prefix),
        "the client did not get the upstream's bytes first"
    );
    let tail = std::str::from_utf8(&all[prefix.len()..]).unwrap();
    assert!(tail.ends_with("\n\n"), "{tail:?}");
    let mut event = None;
    let mut data = None;
    for line in tail.trim().lines() {
        if let Some(v) = line.strip_prefix("event: ") {
            event = Some(v.to_owned());
        } else if let Some(v) = line.strip_prefix("data: ") {
            data = Some(serde_json::from_str(v).unwrap());
        }
    }
    (event, data.expect("a data line"))
}

async fn cut(h: &Harness, path: &str, body: &'static str) -> (Bytes, Result<(), hyper::Error>) {
    let req = h.post(path, body).body(Full::from(body)).unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    let (frames, end) = frames(res).await;
    (joined(&frames), end)
}

#[tokio::test(start_paused = true)]
async fn a_reset_after_output_is_an_anthropic_error_event_then_an_abort() {
    let events = anthropic_partial();
    let h = start(Script::always(Reply::sse_then_reset(events.clone()))).await;
    let (got, end) = cut(&h, "/v1/messages", MESSAGES_STREAM).await;
    let (event, data) = tail_event(&got, &concat(&events));
    assert_eq!(event.as_deref(), Some("error"));
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["type"], "api_error");
    assert!(end.is_err(), "the connection was not aborted");
    // Never replayed after output.
    assert_eq!(h.mock.request_count(), 1);
    let m = h.proxy.metrics().render();
    assert!(
        m.contains("stream_aborts_total{upstream=\"anthropic\",reason=\"response_body\"} 1"),
        "{m}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_reset_after_output_is_an_openai_error_chunk_without_done() {
    let events = chat_partial();
    let h = start(Script::always(Reply::sse_then_reset(events.clone()))).await;
    let (got, end) = cut(&h, "/v1/chat/completions", CHAT_STREAM).await;
    let (event, data) = tail_event(&got, &concat(&events));
    assert_eq!(event, None);
    assert_eq!(data["error"]["type"], "server_error");
    assert!(!String::from_utf8_lossy(&got).contains("[DONE]"));
    assert!(end.is_err());
}

#[tokio::test(start_paused = true)]
async fn a_clean_cut_after_output_reaches_an_sse_client_as_the_protocols_error_frame_followed_by_a_connection_abort(
) {
    // Anthropic: no message_stop; OpenAI chat: no finish_reason and no [DONE].
    for (path, body, events) in [
        ("/v1/messages", MESSAGES_STREAM, anthropic_partial()),
        ("/v1/chat/completions", CHAT_STREAM, chat_partial()),
    ] {
        let h = start(Script::always(Reply::sse(events.clone()))).await;
        let (got, end) = cut(&h, path, body).await;
        let (_, data) = tail_event(&got, &concat(&events));
        assert!(data.get("error").is_some(), "{data}");
        let message = data["error"]["message"].as_str().unwrap();
        assert!(message.contains("incomplete_stream"), "{message}");
        assert!(
            end.is_err(),
            "{path}: a clean end would look like a whole answer"
        );
        assert_eq!(h.mock.request_count(), 1);
    }
}

/// Over HTTP/2 the upstream's body says it has ended as soon as its last `DATA` frame came:
/// the cut must still be found before the proxy ends its own response.
#[tokio::test(start_paused = true)]
async fn a_clean_cut_from_an_http2_upstream_is_also_the_error_frame_then_an_abort() {
    let events = anthropic_partial();
    let (h, dir) = behind_https_h2(Script::always(Reply::sse(events.clone())), "cut").await;
    let (got, end) = cut(&h, "/v1/messages", MESSAGES_STREAM).await;
    assert_eq!(h.mock.requests()[0].version, http::Version::HTTP_2);
    let (event, data) = tail_event(&got, &concat(&events));
    assert_eq!(event.as_deref(), Some("error"));
    let message = data["error"]["message"].as_str().unwrap();
    assert!(message.contains("incomplete_stream"), "{message}");
    assert!(end.is_err(), "a clean end would look like a whole answer");
    assert_eq!(h.mock.request_count(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(start_paused = true)]
async fn a_stall_after_output_ends_at_the_idle_timeout_with_the_error_event() {
    let events = anthropic_partial();
    let h = start_with(Script::always(Reply::sse_then_stall(events.clone())), |c| {
        c.upstream[0].idle_timeout_secs = Some(30);
    })
    .await;
    let t0 = tokio::time::Instant::now();
    let req = h
        .post("/v1/messages", MESSAGES_STREAM)
        .body(Full::from(MESSAGES_STREAM))
        .unwrap();
    let res = h.send(req).await;
    let (frames, end) = frames(res).await;
    let got = joined(&frames);
    let (event, data) = tail_event(&got, &concat(&events));
    assert_eq!(event.as_deref(), Some("error"));
    assert!(data["error"]["message"]
        .as_str()
        .unwrap()
        .contains("idle_timeout"));
    assert!(end.is_err());
    // The error frame left when the idle timeout fired, 30 s after the last event.
    let error_at = frames.last().unwrap().0 - t0;
    assert_eq!(error_at.as_secs(), 30, "{error_at:?}");
    assert!(error_at < Duration::from_millis(30_100));
}

#[tokio::test(start_paused = true)]
async fn a_cut_mid_event_is_closed_before_the_error_event() {
    let mut events = anthropic_partial();
    events.push(SseFrame::raw(Bytes::from_static(
        b"event: content_block_delta\ndata: {\"type\":\"content_blo",
    )));
    let h = start(Script::always(Reply::sse_then_reset(events.clone()))).await;
    let (got, end) = cut(&h, "/v1/messages", MESSAGES_STREAM).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.ends_with("\n\n"));
    assert!(
        text.contains("content_blo\n\nevent: error\ndata: "),
        "{text}"
    );
    assert!(end.is_err());
}

#[tokio::test(start_paused = true)]
async fn over_http2_a_cut_after_output_is_the_error_event_then_a_reset_stream() {
    let events = anthropic_partial();
    let h = start(Script::always(Reply::sse_then_reset(events.clone()))).await;
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.set_nodelay(true);
    let h2: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build(tcp);
    let req = h
        .post("/v1/messages", MESSAGES_STREAM)
        .body(Full::from(MESSAGES_STREAM))
        .unwrap();
    let res = h2.request(req).await.unwrap();
    assert_eq!(res.version(), http::Version::HTTP_2);
    let (frames, end) = frames(res).await;
    let (event, _) = tail_event(&joined(&frames), &concat(&events));
    assert_eq!(event.as_deref(), Some("error"));
    assert!(end.is_err(), "the stream was not reset");
    // The connection itself lives on for other streams.
    let req = h
        .post("/v1/messages", MESSAGES)
        .body(Full::from(MESSAGES))
        .unwrap();
    let _ = h2.request(req).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_json_body_cut_after_the_head_is_an_aborted_response_not_a_short_one() {
    let h = start(Script::always(Reply::reset_mid_body(
        200,
        &br#"{"id":"msg_1","content":[{"#[..],
    )))
    .await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    let (frames, end) = frames(res).await;
    assert!(end.is_err(), "a cut JSON body must not end cleanly");
    // Nothing was added to a JSON body: only the upstream's bytes.
    assert!(joined(&frames).starts_with(b"{\"id\":\"msg_1\""));
    assert!(!String::from_utf8_lossy(&joined(&frames)).contains("event: error"));
}
