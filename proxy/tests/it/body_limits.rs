//! Request-body limits: the whole-body deadline (a trickled body holds no concurrency slot and
//! ends at the deadline) and the memory budget over every body held.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower_llm_retry::mock::{sse, Reply, Script, SseFrame};
use tower_llm_retry_proxy::Config;

use crate::common::*;

const MIB: usize = 1024 * 1024;

/// The value of the body-memory gauge, read from `/metrics`.
async fn buffered_body_bytes(h: &Harness) -> u64 {
    let res = h
        .send(
            Request::get(h.url("/metrics"))
                .body(Full::default())
                .unwrap(),
        )
        .await;
    let text = res.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(text.to_vec()).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("llm_retry_proxy_buffered_body_bytes "))
        .unwrap_or_else(|| panic!("no body-memory gauge in {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Sends `head` (and `body`) on a fresh connection and reads the whole answer.
async fn raw(h: &Harness, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(3600), s.read_to_end(&mut out))
        .await
        .expect("the proxy answers")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(start_paused = true)]
async fn trickled_bodies_hold_no_slot_and_end_at_the_body_deadline() {
    assert_eq!(Config::default().body_timeout_secs, 60);
    let h = start_with(Script::always(Reply::success()), |c| {
        c.max_concurrent_requests = 2;
    })
    .await;
    let started = Instant::now();
    let mut trickles = Vec::new();
    for _ in 0..2 {
        let (mut rd, mut wr) = TcpStream::connect(h.addr).await.unwrap().into_split();
        wr.write_all(
            b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\n\
              content-length: 100\r\n\r\n",
        )
        .await
        .unwrap();
        // One byte every 29 s: never the 30 s without a byte that the idle limit refuses.
        let writer = tokio::spawn(async move {
            while wr.write_all(b" ").await.is_ok() {
                tokio::time::sleep(Duration::from_secs(29)).await;
            }
        });
        let reader = tokio::spawn(async move {
            let mut out = Vec::new();
            let _ = rd.read_to_end(&mut out).await;
            (
                started.elapsed(),
                String::from_utf8_lossy(&out).into_owned(),
            )
        });
        trickles.push((writer, reader));
    }
    // While both trickle, the two slots are free: legitimate requests are served, before and
    // after the trickles' second byte.
    for at in [10, 45] {
        tokio::time::sleep_until(started + Duration::from_secs(at)).await;
        for _ in 0..2 {
            assert_eq!(h.messages(MESSAGES).await.status(), 200, "at {at} s");
        }
    }
    for (writer, reader) in trickles {
        let (elapsed, answer) = reader.await.unwrap();
        writer.abort();
        assert_eq!(elapsed, Duration::from_secs(60), "{answer}");
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(
            answer.contains("x-llm-retry-error: body_timeout"),
            "{answer}"
        );
        assert!(answer.contains("within 60 s"), "{answer}");
    }
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
    // Nothing of the trickled requests went upstream.
    assert_eq!(h.mock.request_count(), 5);
    assert_eq!(buffered_body_bytes(&h).await, 0);
}

/// A Messages request body of exactly `len` bytes, its text made of `fill`.
fn body_of(len: usize, fill: char) -> Bytes {
    let head =
        r#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":""#;
    let tail = r#""}]}"#;
    let mut s = String::with_capacity(len);
    s.push_str(head);
    s.extend(std::iter::repeat_n(fill, len - head.len() - tail.len()));
    s.push_str(tail);
    assert_eq!(s.len(), len);
    Bytes::from(s)
}

#[tokio::test(start_paused = true)]
async fn the_body_budget_refuses_what_would_not_fit_and_comes_back_to_zero() {
    assert_eq!(
        Config::default().buffered_body_budget(),
        8 * Config::default().max_body_bytes
    );
    // The upstream holds the first three requests (and so their bodies): 10 s, 20 s, 20 s.
    let script = Script::new()
        .then(Reply::success().delay(Duration::from_secs(10)))
        .then(Reply::success().delay(Duration::from_secs(20)))
        .then(Reply::success().delay(Duration::from_secs(20)));
    let h = start_with(script, |c| {
        c.max_body_bytes = MIB;
        c.max_buffered_body_bytes = Some(3 * MIB);
        // The bodies held, not the pacing: the new tenant's requests go at once, not 20 ms
        // apart as its warm-up would send them.
        c.upstream[0].pacing_warm_up_secs = 0.0;
    })
    .await;
    let started = Instant::now();
    let bodies: Vec<Bytes> = ['a', 'b', 'c', 'd'].map(|c| body_of(MIB, c)).into();
    let mut held = Vec::new();
    for (i, body) in bodies[..3].iter().enumerate() {
        let req = h
            .post("/v1/messages", "")
            .body(Full::new(body.clone()))
            .unwrap();
        let client = h.client.clone();
        held.push(tokio::spawn(async move {
            let res = client.request(req).await.unwrap();
            let status = res.status();
            res.into_body().collect().await.unwrap();
            (status, started.elapsed())
        }));
        // In order, so that each gets its step of the script.
        while h.mock.request_count() < i + 1 {
            tokio::task::yield_now().await;
        }
    }
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(buffered_body_bytes(&h).await, 3 * MIB as u64);

    // A fourth declared body is refused at once: the head alone, no body byte sent.
    let answer = raw(
        &h,
        format!(
            "POST /v1/messages HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\n\
             content-length: {MIB}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1\r\n"), "{answer}");
    assert!(
        answer.contains("x-llm-retry-error: body_memory"),
        "{answer}"
    );
    assert!(answer.contains("overloaded_error"), "{answer}");
    // A chunked body, which declares nothing, is refused as it grows past what is left.
    let answer = raw(
        &h,
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\n\
          transfer-encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1\r\n"), "{answer}");
    assert!(
        answer.contains("x-llm-retry-error: body_memory"),
        "{answer}"
    );
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(h.mock.request_count(), 3);
    assert_eq!(buffered_body_bytes(&h).await, 3 * MIB as u64);

    // Once the first is answered its megabyte is free, and a new body is taken.
    let mut held = held.into_iter();
    let first = held.next().unwrap().await.unwrap();
    assert_eq!(first, (http::StatusCode::OK, Duration::from_secs(10)));
    assert_eq!(buffered_body_bytes(&h).await, 2 * MIB as u64);
    let res = h
        .send(
            h.post("/v1/messages", "")
                .body(Full::new(bodies[3].clone()))
                .unwrap(),
        )
        .await;
    assert_eq!(res.status(), 200);
    res.into_body().collect().await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_secs(10));
    for rest in held {
        let (status, at) = rest.await.unwrap();
        assert_eq!(
            (status, at),
            (http::StatusCode::OK, Duration::from_secs(20))
        );
    }
    // The upstream got the four bodies taken, byte for byte, and nothing of the two refused.
    let got: Vec<[u8; 32]> = h.mock.requests().iter().map(|r| sha256(&r.body)).collect();
    let sent: Vec<[u8; 32]> = bodies.iter().map(|b| sha256(b)).collect();
    assert_eq!(got, sent);
    assert_eq!(buffered_body_bytes(&h).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_stream_holds_its_request_body_to_its_last_byte() {
    // Four events a second apart: the retry loop keeps the request (to send it again) until
    // the response body is dropped, and the budget counts it so long.
    let events: Vec<SseFrame> = sse::anthropic_message(&["a", "b", "c", "d"])
        .into_iter()
        .map(|e| e.after(Duration::from_secs(1)))
        .collect();
    let h = start(Script::always(Reply::sse(events.clone()))).await;
    let held = MESSAGES_STREAM.len() as u64;

    // Read to its end.
    let res = h.messages(MESSAGES_STREAM).await;
    assert_eq!(res.status(), 200);
    assert_eq!(buffered_body_bytes(&h).await, held);
    let (frames, end) = frames(res).await;
    end.unwrap();
    assert_eq!(sha256(&joined(&frames)), sha256(&concat(&events)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(buffered_body_bytes(&h).await, 0);

    // Dropped by its client after the first frame: given back when the proxy drops the body.
    let res = h.messages(MESSAGES_STREAM).await;
    let mut body = res.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(buffered_body_bytes(&h).await, held);
    drop(body);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(buffered_body_bytes(&h).await, 0);
    assert_eq!(h.mock.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_body_timeout_past_what_time_can_count_leaves_the_idle_limit() {
    let h = start_with(Script::always(Reply::success()), |c| {
        c.body_timeout_secs = u64::MAX;
    })
    .await;
    assert_eq!(h.messages(MESSAGES).await.status(), 200);
    // The 30 s between two bytes still holds.
    let started = Instant::now();
    let answer = raw(
        &h,
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\n\
          content-length: 100\r\n\r\n{",
    )
    .await;
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("no byte for 30 s"), "{answer}");
}
