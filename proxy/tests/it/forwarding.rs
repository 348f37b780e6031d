//! Faithful forwarding: every route, byte-identical bodies both ways (hashed at the mock),
//! headers as sent less hop-by-hop ones, SSE frames relayed as they come.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Version};
use http_body_util::{BodyExt, Full};
use tower_llm_retry::mock::{sse, MockServer, Reply, Script, SseFrame};

use crate::common::*;

const UPSTREAM_BODY: &[u8] = b"{ \"id\" : \"x\",\n  \"unusual\":  [1,2 ,3] }";

#[tokio::test(start_paused = true)]
async fn every_route_is_forwarded_byte_for_byte() {
    let h = start(Script::always(
        Reply::status(200)
            .header("content-type", "application/json")
            .header("x-upstream-header", "kept")
            .header("request-id", "req_1")
            .body(Bytes::from_static(UPSTREAM_BODY)),
    ))
    .await;
    // (method, path the client uses, path the upstream must see, body, Anthropic SDK?)
    let cases: &[(Method, &str, &str, &str, bool)] = &[
        (Method::POST, "/v1/messages", "/v1/messages", MESSAGES, true),
        (
            Method::POST,
            "/v1/messages/count_tokens",
            "/v1/messages/count_tokens",
            MESSAGES,
            true,
        ),
        (
            Method::POST,
            "/v1/chat/completions",
            "/v1/chat/completions",
            CHAT_STREAM,
            false,
        ),
        (
            Method::POST,
            "/v1/responses",
            "/v1/responses",
            "{\"model\":\"gpt-4o\",\"input\":\"hi\"}",
            false,
        ),
        (
            Method::POST,
            "/v1/embeddings",
            "/v1/embeddings",
            "{\"model\":\"e\",\"input\":[\"a\"]}",
            false,
        ),
        (
            Method::GET,
            "/v1/models?limit=2&after_id=x",
            "/v1/models?limit=2&after_id=x",
            "",
            true,
        ),
        (Method::GET, "/v1/models", "/v1/models", "", false),
        (
            Method::GET,
            "/openai/v1/models/gpt-4o",
            "/v1/models/gpt-4o",
            "",
            false,
        ),
        (
            Method::POST,
            "/anthropic/v1/messages?beta=true",
            "/v1/messages?beta=true",
            MESSAGES,
            true,
        ),
    ];
    for (i, (method, path, upstream_path, body, anthropic)) in cases.iter().enumerate() {
        let mut req = Request::builder()
            .method(method.clone())
            .uri(h.url(path))
            .header("content-type", "application/json")
            .header("x-custom", "Value With  Spaces")
            .header("x-custom", "second")
            .header("connection", "x-hop")
            .header("x-hop", "must not pass")
            .header("x-llm-retry", "on");
        if *anthropic {
            req = req
                .header("anthropic-version", "2023-06-01")
                .header("x-api-key", "sk-ant-1");
        } else {
            req = req.header("authorization", "Bearer sk-proj-1");
        }
        let res = h.send(req.body(Full::from(*body)).unwrap()).await;
        assert_eq!(res.status(), 200, "{path}");
        assert_eq!(header(&res, "x-upstream-header"), Some("kept"));
        assert_eq!(header(&res, "request-id"), Some("req_1"));
        assert_eq!(header(&res, "x-llm-retry-attempts"), Some("1"));
        let got = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(sha256(&got), sha256(UPSTREAM_BODY), "{path}: response body");

        let seen = &h.mock.requests()[i];
        assert_eq!(seen.method, *method);
        assert_eq!(seen.uri.path_and_query().unwrap().as_str(), *upstream_path);
        assert_eq!(
            sha256(&seen.body),
            sha256(body.as_bytes()),
            "{path}: request body"
        );
        let custom: Vec<_> = seen.headers.get_all("x-custom").iter().collect();
        assert_eq!(custom, ["Value With  Spaces", "second"]);
        assert!(
            !seen.headers.contains_key("x-hop"),
            "a header named by Connection crossed"
        );
        assert!(!seen.headers.contains_key("x-llm-retry"));
        assert_eq!(seen.headers["host"], h.mock.addr().to_string());
        if !body.is_empty() {
            assert_eq!(
                seen.headers["content-length"],
                body.len().to_string().as_str()
            );
        }
        if *anthropic {
            assert_eq!(seen.headers["x-api-key"], "sk-ant-1");
            assert_eq!(seen.headers["anthropic-version"], "2023-06-01");
        } else {
            assert_eq!(seen.headers["authorization"], "Bearer sk-proj-1");
        }
    }
    assert_eq!(h.mock.request_count(), cases.len());
}

#[tokio::test(start_paused = true)]
async fn sse_is_relayed_frame_by_frame_as_it_comes() {
    let events: Vec<SseFrame> = sse::anthropic_message(&["one ", "two ", "three"])
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            if i > 1 {
                e.after(Duration::from_secs(1))
            } else {
                e
            }
        })
        .collect();
    let h = start(Script::always(Reply::sse(events.clone()))).await;
    let t0 = tokio::time::Instant::now();
    let res = h.messages(MESSAGES_STREAM).await;
    assert_eq!(header(&res, "content-type"), Some("text/event-stream"));
    let (frames, end) = frames(res).await;
    end.unwrap();
    assert_eq!(sha256(&joined(&frames)), sha256(&concat(&events)));
    // Each delayed event reached the client a second after the one before: nothing was held.
    let mut at = Vec::new();
    let mut acc = Vec::new();
    let mut next = 0;
    for (when, bytes) in &frames {
        acc.extend_from_slice(bytes);
        while next < events.len() && acc.len() >= concat(&events[..=next]).len() {
            at.push(when.duration_since(t0));
            next += 1;
        }
    }
    assert_eq!(at.len(), events.len());
    for (i, w) in at.iter().enumerate().skip(2) {
        assert_eq!(
            w.as_secs(),
            (i - 1) as u64,
            "event {i} arrived at {w:?}: {at:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn https_and_http2_upstream() {
    let (h, dir) = behind_https_h2(Script::always(Reply::success()), "ca").await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    let _ = json(res).await;
    let seen = &h.mock.requests()[0];
    assert_eq!(seen.version, Version::HTTP_2);
    assert_eq!(sha256(&seen.body), sha256(MESSAGES.as_bytes()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(start_paused = true)]
async fn several_upstreams_of_one_kind_by_prefix_and_a_base_path() {
    let primary = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let gateway = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let mut config = config_for(&primary);
    let mut eu = tower_llm_retry_proxy::Upstream::new(
        "eu",
        tower_llm_retry_proxy::Kind::Anthropic,
        &format!("{}/corp/llm", gateway.url("").trim_end_matches('/')),
    );
    eu.prefix = Some("/eu".into());
    config.upstream.push(eu);
    let h = serve(primary, config).await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    let req = h
        .post("/eu/v1/messages?x=1", MESSAGES)
        .body(Full::from(MESSAGES))
        .unwrap();
    assert_eq!(h.send(req).await.status(), 200);
    assert_eq!(h.mock.request_count(), 1);
    let seen = gateway.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].uri.path_and_query().unwrap().as_str(),
        "/corp/llm/v1/messages?x=1"
    );
    assert_eq!(sha256(&seen[0].body), sha256(MESSAGES.as_bytes()));
}
