//! Tenants: fleet state per (upstream, credential), and the client token of a proxy that
//! holds the keys.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use http_body_util::Full;
use tower_llm_retry::mock::{Reply, Script};
use tower_llm_retry_proxy::config::Secret;

use crate::common::*;

fn from(key: &'static str, h: &Harness) -> Request<Full<bytes::Bytes>> {
    Request::post(h.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", key)
        .body(Full::from(MESSAGES))
        .unwrap()
}

async fn until_requests(h: &Harness, n: usize) {
    while h.mock.request_count() < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn one_tenants_rate_limit_and_gate_do_not_delay_another() {
    let limited = Arc::new(AtomicBool::new(false));
    let script = Script::new().when(move |req| {
        let a = req.headers.get("x-api-key").is_some_and(|k| k == "sk-A");
        (a && !limited.swap(true, Ordering::SeqCst)).then(|| Reply::rate_limited("30"))
    });
    let h = Arc::new(start(script).await);
    let a1 = tokio::spawn({
        let h = h.clone();
        async move { h.send(from("sk-A", &h)).await.status() }
    });
    until_requests(&h, 1).await;
    // A's gate is closed for 30 s: B goes through at once.
    let res = h.send(from("sk-B", &h)).await;
    assert_eq!(res.status(), 200);
    let seen = h.mock.requests();
    assert_eq!(seen[1].headers["x-api-key"], "sk-B");
    assert!(seen[1].received_at - seen[0].received_at < Duration::from_millis(50));
    // A's second request waits at A's gate.
    let res = h.send(from("sk-A", &h)).await;
    assert_eq!(res.status(), 200);
    assert_eq!(a1.await.unwrap(), 200);
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 4);
    let a_times: Vec<_> = seen
        .iter()
        .filter(|r| r.headers["x-api-key"] == "sk-A")
        .map(|r| r.received_at - seen[0].received_at)
        .collect();
    assert_eq!(a_times.len(), 3);
    assert!(
        a_times[1..].iter().all(|t| *t >= Duration::from_secs(30)),
        "{a_times:?}"
    );
    assert_eq!(h.proxy.tenant_count(), 2);
    let m = h.proxy.metrics().render();
    assert!(
        m.contains("llm_retry_proxy_gate_closures_total{upstream=\"anthropic\"} 1"),
        "{m}"
    );
}

#[tokio::test(start_paused = true)]
async fn tenants_are_kept_in_a_bounded_map() {
    let h = start_with(Script::always(Reply::success()), |c| c.max_tenants = 2).await;
    for key in ["sk-1", "sk-2", "sk-3", "sk-1"] {
        assert_eq!(h.send(from(key, &h)).await.status(), 200);
    }
    assert_eq!(h.proxy.tenant_count(), 2);
}

fn keys_file(name: &str, keys: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("llm-retry-proxy-{name}-{}", std::process::id()));
    std::fs::write(&p, keys).unwrap();
    p
}

#[tokio::test(start_paused = true)]
async fn a_proxy_holding_keys_requires_its_client_token() {
    let file = keys_file("token", "sk-held-1\n");
    let f = file.clone();
    let h = start_with(Script::always(Reply::success()), move |c| {
        c.client_token = Some(Secret::new("the-token"));
        c.upstream[0].keys_file = Some(f.clone());
        c.upstream[1].keys_file = Some(f);
    })
    .await;
    // Nothing, a wrong token, an upstream key: 401 in the route's envelope, nothing sent.
    let none = Request::post(h.url("/v1/messages"))
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(none).await;
    assert_eq!(res.status(), 401);
    assert_eq!(header(&res, "x-should-retry"), Some("false"));
    let body = json(res).await;
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "authentication_error");
    for key in ["wrong", "the-toke", "the-token-", "sk-held-1"] {
        assert_eq!(h.send(from(key, &h)).await.status(), 401, "{key}");
    }
    let chat = Request::post(h.url("/v1/chat/completions"))
        .header("authorization", "Bearer nope")
        .body(Full::from(CHAT_STREAM))
        .unwrap();
    let res = h.send(chat).await;
    assert_eq!(res.status(), 401);
    assert_eq!(json(res).await["error"]["type"], "authentication_error");
    assert_eq!(h.mock.request_count(), 0);

    // The token: forwarded with the held key, the token itself never sent.
    assert_eq!(h.send(from("the-token", &h)).await.status(), 200);
    let chat = Request::post(h.url("/v1/chat/completions"))
        .header("authorization", "Bearer the-token")
        .body(Full::from(r#"{"model":"gpt-4o","messages":[]}"#))
        .unwrap();
    assert_eq!(h.send(chat).await.status(), 200);
    let seen = h.mock.requests();
    assert_eq!(seen[0].headers["x-api-key"], "sk-held-1");
    assert_eq!(seen[1].headers["authorization"], "Bearer sk-held-1");
    for r in &seen {
        for (_, v) in r.headers.iter() {
            assert!(!v.as_bytes().windows(9).any(|w| w == b"the-token"));
        }
    }
    // Metrics and the masked config never show a key or the token.
    let m = h.proxy.metrics().render();
    assert!(!m.contains("sk-held") && !m.contains("the-token"));
    let _ = std::fs::remove_file(&file);
}

#[tokio::test(start_paused = true)]
async fn an_azure_api_key_names_its_own_tenant() {
    let h = start(Script::always(Reply::success())).await;
    for key in ["az-1", "az-2", "az-1"] {
        let req = Request::post(h.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("api-key", key)
            .body(Full::from(
                r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hi"}]}"#,
            ))
            .unwrap();
        assert_eq!(h.send(req).await.status(), 200);
    }
    // Two keys, two stacks: neither's budget or gate is the other's.
    assert_eq!(h.proxy.tenant_count(), 2);
    let seen = h.mock.requests();
    let keys: Vec<_> = seen.iter().map(|r| r.headers["api-key"].clone()).collect();
    assert_eq!(keys, ["az-1", "az-2", "az-1"]);
}

/// The gate metric is the fleet's own count of closings: a `429` with `Retry-After: 1` (a
/// token bucket's next token, under the default gate's 2 s) closes nothing; one with
/// `Retry-After: 3` closes the tenant's gate once.
#[tokio::test(start_paused = true)]
async fn the_gate_metric_counts_only_the_closings_the_fleet_made() {
    let closings = |h: &Harness| {
        let m = h.proxy.metrics().render();
        m.lines()
            .find_map(|l| {
                l.strip_prefix("llm_retry_proxy_gate_closures_total{upstream=\"anthropic\"} ")
            })
            .map(|v| v.parse::<u64>().unwrap())
    };
    let h = start(
        Script::new()
            .then(Reply::rate_limited("1"))
            .then(Reply::success())
            .then(Reply::rate_limited("3"))
            .then(Reply::success()),
    )
    .await;
    let started = tokio::time::Instant::now();
    assert_eq!(h.send(from("sk-A", &h)).await.status(), 200);
    assert_eq!(h.mock.request_count(), 2);
    assert_eq!(closings(&h), Some(0));
    assert_eq!(h.send(from("sk-A", &h)).await.status(), 200);
    assert_eq!(h.mock.request_count(), 4);
    assert_eq!(closings(&h), Some(1));
    // The retries waited what they were told: 1 s, then 3 s.
    let seen = h.mock.requests();
    assert_eq!(
        seen[1].received_at - seen[0].received_at,
        Duration::from_secs(1)
    );
    assert_eq!(
        seen[3].received_at - seen[2].received_at,
        Duration::from_secs(3)
    );
    assert!(started.elapsed() >= Duration::from_secs(4));
}

/// A proxy whose `client_token_env` holds only spaces does not start; one with a real token
/// refuses a credential of only spaces in every header it reads, over HTTP/1.1 and h2c, and
/// sends nothing upstream.
#[tokio::test(start_paused = true)]
async fn a_blank_token_is_never_a_token_over_h1_or_h2c() {
    let file = keys_file("blank-keys", "sk-held-1\n");
    let var = format!("LLM_RETRY_PROXY_TEST_BLANK_{}", std::process::id());
    std::env::set_var(&var, "    ");
    let mock = tower_llm_retry::mock::MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let mut config = config_for(&mock);
    config.client_token_env = Some(var.clone());
    config.upstream[0].keys_file = Some(file.clone());
    let e = tower_llm_retry_proxy::Proxy::new(config)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&var) && e.contains("whitespace"), "{e}");
    std::env::remove_var(&var);

    let f = file.clone();
    let h = start_with(Script::always(Reply::success()), move |c| {
        c.client_token = Some(Secret::new("the-token"));
        c.upstream[0].keys_file = Some(f.clone());
        c.upstream[1].keys_file = Some(f);
    })
    .await;
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.set_nodelay(true);
    let h2c: HttpClient =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build(tcp);
    for (name, client) in [("h1", &h.client), ("h2c", &h2c)] {
        for (header, value) in [
            ("x-api-key", "   "),
            ("x-api-key", ""),
            ("authorization", "Bearer    "),
            ("authorization", "Bearer"),
            ("x-llm-retry-token", " \t "),
        ] {
            let req = Request::post(h.url("/v1/messages"))
                .header("content-type", "application/json")
                .header(header, value)
                .body(Full::from(MESSAGES))
                .unwrap();
            let res = client.request(req).await.unwrap();
            assert_eq!(res.status(), 401, "{name} {header}: {value:?}");
            if name == "h2c" {
                assert_eq!(res.version(), http::Version::HTTP_2);
            }
        }
    }
    assert_eq!(h.mock.request_count(), 0);
    // The token itself, over both.
    for client in [&h.client, &h2c] {
        let req = Request::post(h.url("/v1/messages"))
            .header("x-llm-retry-token", "the-token")
            .body(Full::from(MESSAGES))
            .unwrap();
        assert_eq!(client.request(req).await.unwrap().status(), 200);
    }
    let _ = std::fs::remove_file(&file);
}

/// A flood of made-up credentials, twice as many as the tenants kept, does not push out a
/// tenant whose gate a 429 closed: its next request still waits for the gate.
#[tokio::test(start_paused = true)]
async fn a_flood_of_made_up_credentials_does_not_open_a_tenants_gate() {
    let limited = Arc::new(AtomicBool::new(false));
    let script = Script::new().when(move |req| {
        let a = req.headers.get("x-api-key").is_some_and(|k| k == "sk-A");
        (a && !limited.swap(true, Ordering::SeqCst)).then(|| Reply::rate_limited("30"))
    });
    let max_tenants = 4;
    let h = start_with(script, |c| c.max_tenants = max_tenants).await;
    // A's 429 closes A's gate for 30 s; A's client, retries off, gets it at once.
    let req = Request::post(h.url("/v1/messages"))
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-A")
        .header("x-llm-retry", "off")
        .body(Full::from(MESSAGES))
        .unwrap();
    assert_eq!(h.send(req).await.status(), 429);
    let flood: Vec<&'static str> = (0..2 * max_tenants)
        .map(|i| &*Box::leak(format!("sk-made-up-{i}").into_boxed_str()))
        .collect();
    for key in &flood {
        assert_eq!(h.send(from(key, &h)).await.status(), 200, "{key}");
    }
    assert!(h.proxy.tenant_count() <= max_tenants);
    // A's next request waits at A's gate, as it would have without the flood.
    assert_eq!(h.send(from("sk-A", &h)).await.status(), 200);
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 2 + flood.len());
    let last = seen.last().unwrap();
    assert_eq!(last.headers["x-api-key"], "sk-A");
    let waited = last.received_at - seen[0].received_at;
    assert!(waited >= Duration::from_secs(30), "{waited:?}");
}

/// A tenant that sees a few random refusals (4 % `429`s without `Retry-After`, 4 %
/// overloads) is not paced: its healthy requests go upstream the instant they arrive, and
/// `/metrics` shows no paced tenant. A burst of `429`s, a limit its rate meets, wakes its
/// pacing, and `/metrics` says so and why.
#[tokio::test(start_paused = true)]
async fn random_429s_do_not_hold_a_tenants_healthy_requests() {
    let noisy = Arc::new(AtomicBool::new(true));
    let script = Script::new().when({
        let n = std::sync::atomic::AtomicU64::new(0);
        let noisy = noisy.clone();
        move |_| {
            if !noisy.load(Ordering::SeqCst) {
                return None;
            }
            match n.fetch_add(1, Ordering::SeqCst) % 25 {
                7 => Some(Reply::status(429)),
                19 => Some(Reply::overloaded()),
                _ => None,
            }
        }
    });
    let h = Arc::new(start(script).await);
    let metric = |h: &Harness, line: &str| {
        let m = h.proxy.metrics().render();
        m.lines()
            .find_map(|l| l.strip_prefix(line).map(|v| v.trim().to_owned()))
    };
    // The tenant past its warm-up (its first seconds are paced: see the test below), with
    // no one in line: its pacing sleeps.
    assert_eq!(h.send(from("sk-A", &h)).await.status(), 200);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // One request every 5 ms (200/s) for 1 s.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..200 {
        let h = h.clone();
        tasks.spawn(async move {
            let start = tokio::time::Instant::now();
            let res = h.send(from("sk-A", &h)).await;
            let attempts = header(&res, "x-llm-retry-attempts").map(str::to_owned);
            (res.status(), attempts, start.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (mut healthy, mut retried, mut sent) = (0, 0, 0);
    while let Some(res) = tasks.join_next().await {
        let (status, attempts, held) = res.unwrap();
        assert_eq!(status, 200);
        sent += attempts.as_deref().unwrap().parse::<usize>().unwrap();
        if attempts.as_deref() == Some("1") {
            // Sent upstream and answered the instant it came: held for nothing.
            assert_eq!(held, Duration::ZERO);
            healthy += 1;
        } else {
            retried += 1;
        }
    }
    // Two of each 25 answers were refusals (which ones met a retry depends on the
    // retries' jitter): each refused attempt was retried, and the upstream saw every one.
    assert_eq!(healthy + retried, 200);
    assert!(retried >= 12, "{retried}");
    assert_eq!(sent + 1, h.mock.request_count());
    assert_eq!(
        metric(&h, "llm_retry_proxy_paced_scopes{upstream=\"anthropic\"}").as_deref(),
        Some("0")
    );
    assert_eq!(
        metric(
            &h,
            "llm_retry_proxy_pacing_wakes_total{upstream=\"anthropic\",cause=\"refusal_share\"}"
        )
        .as_deref(),
        Some("0")
    );

    // Twenty refused in a row, all the tenant sends: a limit its rate meets.
    noisy.store(false, Ordering::SeqCst);
    for _ in 0..20 {
        h.mock.push(Reply::status(429));
    }
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let h = h.clone();
        tasks.spawn(async move { h.send(from("sk-A", &h)).await.status() });
    }
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap(), 200);
    }
    assert_eq!(
        metric(&h, "llm_retry_proxy_paced_scopes{upstream=\"anthropic\"}").as_deref(),
        Some("1")
    );
    assert_eq!(
        metric(
            &h,
            "llm_retry_proxy_pacing_wakes_total{upstream=\"anthropic\",cause=\"refusal_share\"}"
        )
        .as_deref(),
        Some("1")
    );
}

/// A new tenant's first burst is paced (the warm-up, 3 s by default): 50 requests arriving
/// together leave from 50/s, doubling every second, instead of all at once, and `/metrics`
/// counts the tenant as paced meanwhile. Once the warm-up is over with no one waiting, the
/// tenant's pacing sleeps and a burst goes at once.
#[tokio::test(start_paused = true)]
async fn a_new_tenants_first_burst_is_paced_by_the_warm_up_then_goes_at_once() {
    let h = Arc::new(start(Script::new()).await);
    let metric = |h: &Harness, line: &str| {
        let m = h.proxy.metrics().render();
        m.lines()
            .find_map(|l| l.strip_prefix(line).map(|v| v.trim().to_owned()))
    };
    let burst = |n: usize| {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..n {
            let h = h.clone();
            tasks.spawn(async move { h.send(from("sk-A", &h)).await.status() });
        }
        tasks
    };
    let origin = tokio::time::Instant::now();
    let mut tasks = burst(50);
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap(), 200);
    }
    let mut at: Vec<Duration> = h
        .mock
        .requests()
        .iter()
        .map(|r| r.received_at - origin)
        .collect();
    at.sort();
    // The first at once, the next a gap (20 ms) after, the 50th some 0.75 s in.
    assert_eq!(at[0], Duration::ZERO);
    assert_eq!(at[1], Duration::from_millis(20));
    assert!(
        at[49] >= Duration::from_millis(700) && at[49] <= Duration::from_millis(800),
        "{:?}",
        at[49]
    );
    assert_eq!(
        metric(&h, "llm_retry_proxy_paced_scopes{upstream=\"anthropic\"}").as_deref(),
        Some("1")
    );
    tokio::time::sleep_until(origin + Duration::from_secs(3)).await;
    let later = tokio::time::Instant::now();
    let mut tasks = burst(50);
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap(), 200);
    }
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 100);
    assert!(seen[50..].iter().all(|r| r.received_at == later));
    assert_eq!(
        metric(&h, "llm_retry_proxy_paced_scopes{upstream=\"anthropic\"}").as_deref(),
        Some("0")
    );
}

/// A tenant whose upstream states its input-token limit and answers a 429 naming input
/// tokens: its token pacing wakes, `/metrics` shows the limit believed, the bucket's level,
/// and the request that waited for its tokens.
#[tokio::test(start_paused = true)]
async fn a_token_429_shows_the_token_pacing_on_metrics() {
    let h =
        start(Script::new().capacity(tower_llm_retry::mock::Capacity::input_tokens_per_minute(60)))
            .await;
    let metric = |line: &str| {
        let m = h.proxy.metrics().render();
        m.lines()
            .find_map(|l| l.strip_prefix(line).map(|v| v.trim().to_owned()))
    };
    // MESSAGES is a few tokens: asleep, nothing believed.
    assert_eq!(h.send(from("sk-A", &h)).await.status(), 200);
    assert_eq!(
        metric("llm_retry_proxy_token_paced_scopes{upstream=\"anthropic\"}").as_deref(),
        Some("0")
    );
    // 60 tokens a minute: a request of about 30 tokens spends what is left; the mock's
    // 429 names input tokens, its retry waits for the tokens.
    let big = format!(
        r#"{{"model":"claude-test","max_tokens":16,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "a".repeat(200)
    );
    let req = |body: String| {
        Request::post(h.url("/v1/messages"))
            .header("content-type", "application/json")
            .header("anthropic-version", "2023-06-01")
            .header("x-api-key", "sk-A")
            .body(Full::from(body))
            .unwrap()
    };
    assert_eq!(h.send(req(big.clone())).await.status(), 200);
    assert_eq!(h.send(req(big)).await.status(), 200);
    assert_eq!(
        metric("llm_retry_proxy_token_paced_scopes{upstream=\"anthropic\"}").as_deref(),
        Some("1")
    );
    assert_eq!(
        metric("llm_retry_proxy_token_rate_per_minute{upstream=\"anthropic\",kind=\"input\"}")
            .as_deref(),
        Some("60.0")
    );
    assert!(
        metric("llm_retry_proxy_token_bucket_level{upstream=\"anthropic\",kind=\"input\"}")
            .is_some()
    );
    assert_eq!(
        metric("llm_retry_proxy_token_waiting{upstream=\"anthropic\"}").as_deref(),
        Some("0")
    );
    assert_eq!(
        metric("llm_retry_proxy_token_waits_total{upstream=\"anthropic\"}").as_deref(),
        Some("1")
    );
}
