//! Operations: health, metrics, the concurrency cap, and the graceful drain.

use std::sync::Arc;
use std::time::Duration;

use http::Request;
use http_body_util::{BodyExt, Full};
use tower_llm_retry::mock::{sse, Reply, Script, SseFrame};

use crate::common::*;

fn get(h: &Harness, path: &str) -> Request<Full<bytes::Bytes>> {
    Request::get(h.url(path)).body(Full::default()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn health_and_metrics() {
    let h = start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await;
    assert_eq!(h.send(get(&h, "/livez")).await.status(), 200);
    assert_eq!(h.send(get(&h, "/readyz")).await.status(), 200);
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
    let res = h.send(get(&h, "/metrics")).await;
    assert_eq!(res.status(), 200);
    let text =
        String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    for line in [
        "llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"200\"} 1",
        "llm_retry_proxy_attempts_total{upstream=\"anthropic\"} 2",
        "llm_retry_proxy_retries_total{upstream=\"anthropic\",class=\"overloaded\"} 1",
        "llm_retry_proxy_upstream_latency_seconds_count{upstream=\"anthropic\"} 2",
        "llm_retry_proxy_in_flight 0",
    ] {
        assert!(text.contains(line), "missing {line}:\n{text}");
    }
}

#[tokio::test(start_paused = true)]
async fn over_the_concurrency_cap_is_a_503_at_once_never_a_queue() {
    let h = Arc::new(
        start_with(
            Script::always(Reply::success().delay(Duration::from_secs(10))),
            |c| {
                c.max_concurrent_requests = 2;
            },
        )
        .await,
    );
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move { h.messages(MESSAGES).await.status() })
        })
        .collect();
    while h.mock.request_count() < 2 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let t0 = tokio::time::Instant::now();
    let res = h.messages(MESSAGES).await;
    assert!(t0.elapsed() < Duration::from_millis(10));
    assert_eq!(res.status(), 503);
    assert_eq!(header(&res, "retry-after"), Some("1"));
    assert_eq!(header(&res, "x-should-retry"), Some("true"));
    assert_eq!(json(res).await["error"]["type"], "overloaded_error");
    // Health stays answerable at the cap.
    assert_eq!(h.send(get(&h, "/livez")).await.status(), 200);
    for s in slow {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
    assert_eq!(h.mock.request_count(), 3);
}

#[tokio::test(start_paused = true)]
async fn shutdown_drains_a_stream_in_flight() {
    let events: Vec<SseFrame> = sse::anthropic_message(&["a", "b", "c", "d"])
        .into_iter()
        .map(|e| e.after(Duration::from_secs(1)))
        .collect();
    let mut h = start(Script::always(Reply::sse(events.clone()))).await;
    let res = h.messages(MESSAGES_STREAM).await;
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    h.shutdown();
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Draining: not ready, not accepting.
    let ready = h
        .proxy
        .handle(
            Request::get("/readyz")
                .body(Full::<bytes::Bytes>::default())
                .unwrap(),
        )
        .await;
    assert_eq!(ready.status(), 503);
    assert!(refuses(h.addr));
    // The stream in flight finishes whole.
    let rest = body
        .collect()
        .await
        .expect("the stream finished cleanly")
        .to_bytes();
    let mut all = first.to_vec();
    all.extend_from_slice(&rest);
    assert_eq!(sha256(&all), sha256(&concat(&events)));
    h.server.take().unwrap().await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_drain_deadline_cuts_what_is_left() {
    let mut events = sse::anthropic_message(&["a"]);
    events.truncate(3);
    let mut h = start_with(Script::always(Reply::sse_then_stall(events)), |c| {
        c.drain_timeout_secs = 5;
    })
    .await;
    let res = h.messages(MESSAGES_STREAM).await;
    let t0 = tokio::time::Instant::now();
    h.shutdown();
    let (_, end) = frames(res).await;
    assert!(end.is_err(), "a cut stream must not end cleanly");
    h.server.take().unwrap().await.unwrap().unwrap();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_millis(5_100),
        "{took:?}"
    );
}

/// The binary itself: `--demo` starts and prints how to use it; SIGTERM drains and exits 0.
#[cfg(unix)]
#[test]
fn the_binary_stops_cleanly_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let mut child = Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"))
        .args(["--demo", "--listen", "127.0.0.1:0"])
        .env("LLM_RETRY_PROXY_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let printed: Vec<String> = lines.by_ref().take(9).map(Result::unwrap).collect();
    let text = printed.join("\n");
    assert!(
        text.contains("export ANTHROPIC_BASE_URL=http://127.0.0.1:"),
        "{text}"
    );
    assert!(
        text.contains("export OPENAI_BASE_URL=http://127.0.0.1:"),
        "{text}"
    );
    assert!(text.contains("curl"), "{text}");
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = child.wait().unwrap();
    assert!(exited.success(), "{exited:?}");
}
