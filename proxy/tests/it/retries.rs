//! The retry behaviour through the proxy, and the header contract with SDKs that retry too.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use tower_llm_retry::mock::{sse, Reply, Script, SseFrame};

use crate::common::*;

fn gaps(h: &Harness) -> Vec<Duration> {
    let r = h.mock.requests();
    r.windows(2)
        .map(|w| w[1].received_at - w[0].received_at)
        .collect()
}

fn assert_same_bodies(h: &Harness, body: &str) {
    for r in h.mock.requests() {
        assert_eq!(sha256(&r.body), sha256(body.as_bytes()));
    }
}

#[tokio::test(start_paused = true)]
async fn rate_limit_waits_the_retry_after() {
    let h = start(
        Script::new()
            .then(Reply::rate_limited("7"))
            .then(Reply::success()),
    )
    .await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    assert_eq!(header(&res, "x-should-retry"), None);
    let _ = json(res).await;
    assert_eq!(gaps(&h), [Duration::from_secs(7)]);
    assert_same_bodies(&h, MESSAGES);
}

#[tokio::test(start_paused = true)]
async fn overloaded_three_times_falls_back_to_the_next_model() {
    let script = Script::new().when(|req| {
        let model = req.json().ok()?.get("model")?.as_str()?.to_owned();
        (model == "claude-sonnet-4-5").then(Reply::overloaded)
    });
    let h = start_with(script, |c| {
        c.upstream[0].fallback = vec!["claude-sonnet-4-5".into(), "claude-haiku-4-5".into()];
    })
    .await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("4"));
    assert_eq!(header(&res, "x-llm-retry-model"), Some("claude-haiku-4-5"));
    assert_eq!(header(&res, "x-llm-retry-fallback"), Some("true"));
    assert_eq!(json(res).await["model"], "claude-haiku-4-5");
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 4);
    for r in &seen[..3] {
        assert_eq!(sha256(&r.body), sha256(MESSAGES.as_bytes()));
    }
    // Only the model's value changed, every other byte as sent.
    let expected = MESSAGES.replace("claude-sonnet-4-5", "claude-haiku-4-5");
    assert_eq!(sha256(&seen[3].body), sha256(expected.as_bytes()));
    let metrics = h.proxy.metrics().render();
    assert!(
        metrics.contains("llm_retry_proxy_fallbacks_total{upstream=\"anthropic\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "llm_retry_proxy_retries_total{upstream=\"anthropic\",class=\"overloaded\"} 3"
        ),
        "{metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_in_band_error_before_output_is_retried_unseen() {
    let first = vec![
        sse::anthropic_message(&[])[0].clone(),
        SseFrame::new("ping", "{\"type\":\"ping\"}"),
        sse::anthropic_error("overloaded_error"),
    ];
    let good = sse::anthropic_message(&["Hello", " again"]);
    let h = start(
        Script::new()
            .then(Reply::sse(first))
            .then(Reply::sse(good.clone())),
    )
    .await;
    let res = h.messages(MESSAGES_STREAM).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    let (frames, end) = frames(res).await;
    end.unwrap();
    assert_eq!(sha256(&joined(&frames)), sha256(&concat(&good)));
    assert_eq!(h.mock.request_count(), 2);
    assert_same_bodies(&h, MESSAGES_STREAM);
}

#[tokio::test(start_paused = true)]
async fn a_reset_before_the_head_is_retried() {
    let h = start(Script::new().then(Reply::reset()).then(Reply::success())).await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    assert_eq!(h.mock.request_count(), 2);
    assert_same_bodies(&h, MESSAGES);
}

#[tokio::test(start_paused = true)]
async fn a_max_tokens_overflow_is_repaired() {
    let h = start(
        Script::new()
            .then(Reply::context_overflow(190_000, 20_000, 200_000))
            .then(Reply::success()),
    )
    .await;
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":20000,"messages":[{"role":"user","content":"long"}]}"#;
    let res = h.messages(body).await;
    assert_eq!(res.status(), 200);
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(sha256(&seen[0].body), sha256(body.as_bytes()));
    let repaired = body.replace("\"max_tokens\":20000", "\"max_tokens\":9000");
    assert_eq!(String::from_utf8_lossy(&seen[1].body), repaired);
    // Re-sent at once.
    assert_eq!(gaps(&h), [Duration::ZERO]);
}

#[tokio::test(start_paused = true)]
async fn after_giving_up_the_proxy_tells_the_sdk_not_to_retry() {
    let h = start_with(
        Script::always(Reply::overloaded().header("x-should-retry", "true")),
        |c| {
            c.upstream[0].max_retries = Some(2);
            c.upstream[0].initial_backoff_ms = Some(100);
        },
    )
    .await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 529);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("3"));
    assert_eq!(header(&res, "x-llm-retry-gave-up"), Some("max_retries"));
    assert_eq!(json(res).await["error"]["type"], "overloaded_error");
    assert_eq!(h.mock.request_count(), 3);
    let m = h.proxy.metrics().render();
    for line in [
        "llm_retry_proxy_give_ups_total{upstream=\"anthropic\",reason=\"max_retries\"} 1",
        "llm_retry_proxy_retries_total{upstream=\"anthropic\",class=\"overloaded\"} 2",
        "llm_retry_proxy_requests_total{upstream=\"anthropic\",status=\"529\"} 1",
    ] {
        assert!(m.contains(line), "missing {line}:\n{m}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_response_the_proxy_chose_not_to_retry_keeps_the_upstreams_hint() {
    // A Retry-After above the ceiling: returned as is, without a hint of the proxy's.
    let h = start(Script::always(Reply::rate_limited("3600"))).await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 429);
    assert_eq!(header(&res, "x-should-retry"), None);
    assert_eq!(
        header(&res, "x-llm-retry-gave-up"),
        Some("retry_after_too_long")
    );
    assert_eq!(h.mock.request_count(), 1);

    // Retries off by header: sent once, the upstream's own `x-should-retry` as it was.
    let h = start(Script::always(
        Reply::overloaded().header("x-should-retry", "true"),
    ))
    .await;
    let req = h
        .post("/v1/messages", MESSAGES)
        .header("x-llm-retry", "off")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 529);
    assert_eq!(header(&res, "x-should-retry"), Some("true"));
    assert_eq!(h.mock.request_count(), 1);
    assert!(!h.mock.requests()[0].headers.contains_key("x-llm-retry"));
}

#[tokio::test(start_paused = true)]
async fn an_sdk_retry_is_sent_once_and_not_looped_again() {
    let h = start(Script::always(Reply::overloaded())).await;
    let req = h
        .post("/v1/messages", MESSAGES)
        .header("x-stainless-retry-count", "1")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 529);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("1"));
    assert_eq!(h.mock.request_count(), 1);
    // The SDK's header is forwarded as sent.
    assert_eq!(h.mock.requests()[0].headers["x-stainless-retry-count"], "1");
    let metrics = h.proxy.metrics().render();
    assert!(
        metrics.contains("llm_retry_proxy_client_retries_total{upstream=\"anthropic\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_preset_is_chosen_by_header() {
    for (preset, attempts) in [("never", 1), ("interactive", 4)] {
        let h = start(Script::always(Reply::overloaded())).await;
        let req = h
            .post("/v1/messages", MESSAGES)
            .header("x-llm-retry-policy", preset)
            .body(Full::from(MESSAGES))
            .unwrap();
        let res = h.send(req).await;
        assert_eq!(res.status(), 529, "{preset}");
        let _ = res.into_body().collect().await;
        assert_eq!(h.mock.request_count(), attempts, "{preset}");
        assert!(!h.mock.requests()[0]
            .headers
            .contains_key("x-llm-retry-policy"));
    }
}

#[tokio::test(start_paused = true)]
async fn a_proxy_held_key_is_swapped_on_401() {
    let keys = std::env::temp_dir().join(format!("llm-retry-proxy-keys-{}", std::process::id()));
    std::fs::write(&keys, "sk-revoked\nsk-good\n").unwrap();
    let keys2 = keys.clone();
    let h = start_with(
        Script::new().require_header("x-api-key", ["sk-good"]),
        move |c| {
            c.client_token = Some(tower_llm_retry_proxy::config::Secret::new("proxy-token"));
            c.upstream[0].keys_file = Some(keys2);
        },
    )
    .await;
    let req = http::Request::post(h.url("/v1/messages"))
        .header("x-api-key", "proxy-token")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    let seen = h.mock.requests();
    let used: Vec<_> = seen
        .iter()
        .map(|r| r.headers["x-api-key"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(used, ["sk-revoked", "sk-good"]);
    assert!(seen
        .iter()
        .all(|r| r.headers.get_all("x-api-key").iter().count() == 1));
    assert_same_bodies(&h, MESSAGES);
    // The next request goes straight to the good key.
    let req = http::Request::post(h.url("/v1/messages"))
        .header("authorization", "Bearer proxy-token")
        .body(Full::from(MESSAGES))
        .unwrap();
    assert_eq!(h.send(req).await.status(), 200);
    assert_eq!(h.mock.requests()[2].headers["x-api-key"], "sk-good");
    assert!(!h.mock.requests()[2].headers.contains_key("authorization"));
    let _ = std::fs::remove_file(&keys);
}

#[tokio::test(start_paused = true)]
async fn a_rate_limited_held_key_rotates_to_the_next_at_once() {
    let keys = std::env::temp_dir().join(format!("llm-retry-proxy-rotate-{}", std::process::id()));
    std::fs::write(&keys, "sk-first,sk-second").unwrap();
    let k = keys.clone();
    let script = Script::new().when(|req| {
        (req.headers
            .get("x-api-key")
            .is_some_and(|v| v == "sk-first"))
        .then(|| Reply::rate_limited("30"))
    });
    let h = start_with(script, move |c| {
        c.client_token = Some(tower_llm_retry_proxy::config::Secret::new("proxy-token"));
        c.upstream[0].keys_file = Some(k);
    })
    .await;
    let req = http::Request::post(h.url("/v1/messages"))
        .header("x-api-key", "proxy-token")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    let used: Vec<_> = h
        .mock
        .requests()
        .iter()
        .map(|r| r.headers["x-api-key"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(used, ["sk-first", "sk-second"]);
    assert_eq!(gaps(&h), [Duration::ZERO]);
    let _ = std::fs::remove_file(&keys);
}

#[tokio::test(start_paused = true)]
async fn sdk_retries_draw_on_the_tenants_budget() {
    // The pacing is off: woken by the 529s it would space the requests out, and the budget's
    // reserve refills while they wait (this test is about the budget alone).
    let h = start_with(Script::always(Reply::overloaded()), |c| {
        for up in &mut c.upstream {
            up.pacing = false;
        }
    })
    .await;
    // No first attempt has paid in: only the budget's reserve is there.
    let allowed = tower_llm_retry::fleet::BudgetConfig::default().max_retries(0) as usize;
    assert!(allowed > 0);
    let retry = || {
        h.post("/v1/messages", MESSAGES)
            .header("x-stainless-retry-count", "2")
            .body(Full::from(MESSAGES))
            .unwrap()
    };
    for _ in 0..allowed {
        let res = h.send(retry()).await;
        assert_eq!(res.status(), 529);
        let _ = res.into_body().collect().await;
    }
    assert_eq!(h.mock.request_count(), allowed);
    let res = h.send(retry()).await;
    assert_eq!(res.status(), 503);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    assert_eq!(header(&res, "x-llm-retry-error"), Some("budget"));
    assert_eq!(
        h.mock.request_count(),
        allowed,
        "a refused client retry was sent"
    );
    // Another tenant's budget is its own.
    let mut other = retry();
    other
        .headers_mut()
        .insert("x-api-key", "sk-other".parse().unwrap());
    assert_eq!(h.send(other).await.status(), 529);
}

/// A client's `OpenAI-Organization` the held keys do not belong to: the upstream answers
/// `401`, the client gets it, and no held key leaves the rotation.
#[tokio::test(start_paused = true)]
async fn a_401_caused_by_a_client_header_takes_no_held_key_out_of_rotation() {
    // Not named LLM_RETRY_PROXY_*: the proxies other tests start refuse unknown settings.
    const VAR: &str = "HELD_KEYS_FOR_A_CLIENT_401_TEST";
    std::env::set_var(VAR, "sk-a\nsk-b\nsk-c\n");
    let script = Script::new().when(|req| {
        req.headers
            .contains_key("openai-organization")
            .then(Reply::unauthorized)
    });
    let h = start_with(script, |c| {
        c.client_token = Some(tower_llm_retry_proxy::config::Secret::new("proxy-token"));
        c.upstream[0].keys_env = Some(VAR.into());
    })
    .await;
    let send = |org: Option<&str>| {
        let mut req = http::Request::post(h.url("/v1/messages")).header("x-api-key", "proxy-token");
        if let Some(org) = org {
            req = req.header("openai-organization", org);
        }
        h.send(req.body(Full::from(MESSAGES)).unwrap())
    };
    for _ in 0..2 {
        assert_eq!(send(Some("org-not-mine")).await.status(), 401);
    }
    for _ in 0..4 {
        assert_eq!(send(None).await.status(), 200);
    }
    let used: Vec<_> = h
        .mock
        .requests()
        .iter()
        .map(|r| r.headers["x-api-key"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(used, ["sk-a", "sk-b", "sk-c", "sk-a", "sk-b", "sk-c"]);
    assert_same_bodies(&h, MESSAGES);
}

/// A held key the upstream refuses on every request is set aside, and tried again when its
/// quarantine (1 min at first) is over.
#[tokio::test(start_paused = true)]
async fn a_revoked_held_key_is_set_aside_and_tried_again_after_its_quarantine() {
    const VAR: &str = "HELD_KEYS_FOR_A_REVOKED_KEY_TEST";
    std::env::set_var(VAR, "sk-revoked\nsk-good\n");
    let h = start_with(
        Script::new().require_header("x-api-key", ["sk-good"]),
        |c| {
            c.client_token = Some(tower_llm_retry_proxy::config::Secret::new("proxy-token"));
            c.upstream[0].keys_env = Some(VAR.into());
        },
    )
    .await;
    let send = || {
        let req = http::Request::post(h.url("/v1/messages"))
            .header("x-api-key", "proxy-token")
            .body(Full::from(MESSAGES))
            .unwrap();
        h.send(req)
    };
    assert_eq!(send().await.status(), 200);
    tokio::time::sleep(Duration::from_secs(59)).await;
    assert_eq!(send().await.status(), 200);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(send().await.status(), 200);
    let used: Vec<_> = h
        .mock
        .requests()
        .iter()
        .map(|r| r.headers["x-api-key"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        used,
        ["sk-revoked", "sk-good", "sk-good", "sk-revoked", "sk-good"]
    );
}
