//! Failover to another upstream: each a listener of its own (a second mock), reached with its
//! own key and client; the triggers, the circuit and its gauge, the headers that say who
//! served.

use std::path::PathBuf;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry_proxy::config::Secret;
use tower_llm_retry_proxy::{CircuitConfig, Config, FallbackTarget};

use crate::common::*;

const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hello"}]}"#;

/// `model` on the upstream named `upstream`.
fn on(upstream: &str, model: &str) -> FallbackTarget {
    FallbackTarget {
        model: model.into(),
        upstream: Some(upstream.into()),
        resume: None,
    }
}

fn upstream<'a>(c: &'a mut Config, name: &str) -> &'a mut tower_llm_retry_proxy::Upstream {
    c.upstream.iter_mut().find(|u| u.name == name).unwrap()
}

/// A file holding `key`, named by `tag`, for `keys_file`.
fn key_file(tag: &str, key: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "llm-retry-proxy-failover-{tag}-{}",
        std::process::id()
    ));
    std::fs::write(&path, key).unwrap();
    path
}

async fn metrics(h: &Harness) -> String {
    let res = h
        .send(
            http::Request::get(h.url("/metrics"))
                .body(Full::default())
                .unwrap(),
        )
        .await;
    let body = res.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

/// The value of the circuit gauge of `target` in the chain of `upstream`, from `/metrics`.
async fn circuit(h: &Harness, upstream: &str, target: &str) -> u32 {
    let text = metrics(h).await;
    let line =
        format!("llm_retry_proxy_circuit_state{{upstream=\"{upstream}\",target=\"{target}\"}} ");
    let value = text
        .lines()
        .find_map(|l| l.strip_prefix(line.as_str()))
        .unwrap_or_else(|| panic!("no {line:?} in {text}"));
    value.trim().parse().unwrap()
}

fn key_hashes(mock: &MockServer) -> Vec<[u8; 32]> {
    mock.requests()
        .iter()
        .map(|r| sha256(r.headers["x-api-key"].as_bytes()))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn an_overload_falls_over_to_the_second_upstream_with_its_own_key() {
    let (a_keys, b_keys) = (key_file("a", "sk-first-a"), key_file("b", "sk-second-b"));
    let (a, b) = (a_keys.clone(), b_keys.clone());
    let (h, second) = start_two(
        Script::always(Reply::overloaded()),
        Script::new(),
        move |c| {
            c.client_token = Some(Secret::new("proxy-token"));
            let up = upstream(c, "anthropic");
            up.keys_file = Some(a);
            up.fallback_threshold = 1;
            up.fallback = vec![
                "claude-sonnet-4-5".into(),
                on("anthropic-b", "claude-sonnet-4-5"),
            ];
            upstream(c, "anthropic-b").keys_file = Some(b);
        },
    )
    .await;
    let req = http::Request::post(h.url("/v1/messages"))
        .header("x-api-key", "proxy-token")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("anthropic-b"));
    assert_eq!(
        header(&res, "x-llm-retry-targets"),
        Some("anthropic/claude-sonnet-4-5=1,anthropic-b/claude-sonnet-4-5=1")
    );
    assert_eq!(json(res).await["model"], "claude-sonnet-4-5");
    // One attempt at the primary, with its key; one at the second upstream, with the second
    // upstream's key; the same body bytes at both.
    assert_eq!(key_hashes(&h.mock), [sha256(b"sk-first-a")]);
    assert_eq!(key_hashes(&second), [sha256(b"sk-second-b")]);
    for r in h.mock.requests().iter().chain(second.requests().iter()) {
        assert_eq!(sha256(&r.body), sha256(MESSAGES.as_bytes()));
        assert_eq!(r.uri.path(), "/v1/messages");
    }
    let m = h.proxy.metrics().render();
    for up in ["anthropic", "anthropic-b"] {
        assert!(
            m.contains(&format!(
                "llm_retry_proxy_attempts_total{{upstream=\"{up}\"}} 1\n"
            )),
            "{m}"
        );
    }
    let _ = std::fs::remove_file(&a_keys);
    let _ = std::fs::remove_file(&b_keys);
}

/// The failover benchmark's fault S04 in OpenAI's dialect: a 503 whose body says the server
/// is overloaded, on every attempt.
#[tokio::test(start_paused = true)]
async fn an_openai_503_overloaded_falls_over_to_the_second_upstream() {
    let (h, second) = start_two(
        Script::always(Reply::openai_error(
            503,
            "server_is_overloaded",
            "The server is overloaded or not ready yet.",
        )),
        Script::new(),
        |c| {
            let up = upstream(c, "openai");
            up.fallback_threshold = 1;
            up.fallback = vec!["gpt-4o".into(), on("openai-b", "gpt-4o")];
        },
    )
    .await;
    let req = h
        .post("/v1/chat/completions", CHAT)
        .body(Full::from(CHAT))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("openai-b"));
    assert_eq!(h.mock.request_count(), 1);
    assert_eq!(second.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn persistent_server_errors_fall_over_after_two_failures() {
    let (h, second) = start_two(
        Script::always(Reply::openai_error(500, "server_error", "boom")),
        Script::new(),
        |c| {
            let up = upstream(c, "openai");
            up.fallback_after_failures = Some(2);
            up.fallback = vec!["gpt-4o".into(), on("openai-b", "gpt-4o-mini")];
        },
    )
    .await;
    let req = h
        .post("/v1/chat/completions", CHAT)
        .body(Full::from(CHAT))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("3"));
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("openai-b"));
    assert_eq!(header(&res, "x-llm-retry-model"), Some("gpt-4o-mini"));
    assert_eq!(header(&res, "x-llm-retry-fallback"), Some("true"));
    assert_eq!(
        header(&res, "x-llm-retry-targets"),
        Some("openai/gpt-4o=2,openai-b/gpt-4o-mini=1")
    );
    // The body's model is the one that served, as the upstream wrote it.
    assert_eq!(json(res).await["model"], "gpt-4o-mini");
    assert_eq!(h.mock.request_count(), 2);
    for r in h.mock.requests() {
        assert_eq!(sha256(&r.body), sha256(CHAT.as_bytes()));
    }
    let moved = CHAT.replace("\"gpt-4o\"", "\"gpt-4o-mini\"");
    let seen = second.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(sha256(&seen[0].body), sha256(moved.as_bytes()));
    assert_eq!(seen[0].uri.path(), "/v1/chat/completions");
    // Neither upstream holds keys: the client's credential goes to both.
    assert_eq!(seen[0].headers["x-api-key"], "sk-client");
    let m = h.proxy.metrics().render();
    assert!(
        m.contains("llm_retry_proxy_attempts_total{upstream=\"openai\"} 2\n"),
        "{m}"
    );
    assert!(
        m.contains("llm_retry_proxy_attempts_total{upstream=\"openai-b\"} 1\n"),
        "{m}"
    );
}

#[tokio::test(start_paused = true)]
async fn one_attempt_names_its_upstream_and_no_targets() {
    let h = start(Script::new()).await;
    let req = h
        .post("/v1/chat/completions", CHAT)
        .body(Full::from(CHAT))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("openai"));
    assert_eq!(header(&res, "x-llm-retry-targets"), None);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("1"));
}

/// The failover benchmark's fault S15 in small: the primary fails, its circuit opens,
/// requests go straight to the fallback, a probe after the cooldown fails and doubles it, the
/// next probe succeeds and closes the circuit.
#[tokio::test(start_paused = true)]
async fn a_circuit_opens_skips_the_primary_and_probes_after_its_cooldown() {
    let (h, second) = start_two(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded()),
        Script::new(),
        |c| {
            let up = upstream(c, "anthropic");
            up.fallback_threshold = 1;
            up.fallback = vec![
                "claude-sonnet-4-5".into(),
                on("anthropic-b", "claude-sonnet-4-5"),
            ];
            up.circuit = Some(CircuitConfig {
                failures: 2,
                window_secs: 30,
                cooldown_secs: 10,
                max_cooldown_secs: 40,
            });
        },
    )
    .await;
    let primary = "anthropic/claude-sonnet-4-5";
    let backup = "anthropic-b/claude-sonnet-4-5";
    let send = || async {
        let res = h.messages(MESSAGES).await;
        assert_eq!(res.status(), 200);
        let served = header(&res, "x-llm-retry-upstream").unwrap().to_owned();
        let attempts = header(&res, "x-llm-retry-attempts").unwrap().to_owned();
        let _ = json(res).await;
        (served, attempts)
    };
    assert_eq!(circuit(&h, "anthropic", primary).await, 0, "closed");
    // Two failures at the primary, each request served by the second upstream.
    for n in 1..=2 {
        assert_eq!(send().await, ("anthropic-b".into(), "2".into()));
        assert_eq!(h.mock.request_count(), n);
    }
    assert_eq!(circuit(&h, "anthropic", primary).await, 2, "open");
    assert_eq!(circuit(&h, "anthropic", backup).await, 0);
    // Open: straight to the second upstream, no attempt at the primary.
    assert_eq!(send().await, ("anthropic-b".into(), "1".into()));
    assert_eq!(h.mock.request_count(), 2);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(circuit(&h, "anthropic", primary).await, 1, "half-open");
    // The probe fails: open again, for twice the cooldown.
    assert_eq!(send().await, ("anthropic-b".into(), "2".into()));
    assert_eq!(h.mock.request_count(), 3);
    assert_eq!(circuit(&h, "anthropic", primary).await, 2, "reopened");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(circuit(&h, "anthropic", primary).await, 2, "20 s this time");
    assert_eq!(send().await, ("anthropic-b".into(), "1".into()));
    assert_eq!(h.mock.request_count(), 3);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        circuit(&h, "anthropic", primary).await,
        1,
        "half-open again"
    );
    // The primary is back: the probe succeeds and closes the circuit.
    assert_eq!(send().await, ("anthropic".into(), "1".into()));
    assert_eq!(h.mock.request_count(), 4);
    assert_eq!(circuit(&h, "anthropic", primary).await, 0, "closed again");
    assert_eq!(second.request_count(), 5);
}

/// The attempt at the second upstream goes out on that upstream's client: over HTTPS and
/// HTTP/2, trusting only the CA of its `ca_file`, while the primary is plain HTTP.
#[tokio::test(start_paused = true)]
async fn the_second_upstream_is_reached_with_its_own_tls_roots() {
    let second = MockServer::builder(Script::new())
        .tls(true)
        .protocol(tower_llm_retry::mock::Protocol::Http2)
        .start()
        .await
        .unwrap();
    let ca = std::env::temp_dir().join(format!(
        "llm-retry-proxy-failover-ca-{}.pem",
        std::process::id()
    ));
    std::fs::write(&ca, second.ca_cert_pem().unwrap()).unwrap();
    let first = MockServer::start(Script::always(Reply::overloaded()))
        .await
        .unwrap();
    let mut config = config_for(&first);
    // The certificate names `localhost`.
    let mut b = tower_llm_retry_proxy::Upstream::new(
        "anthropic-b",
        tower_llm_retry_proxy::Kind::Anthropic,
        &second
            .url("")
            .trim_end_matches('/')
            .replace("127.0.0.1", "localhost"),
    );
    b.ca_file = Some(ca.clone());
    config.upstream.push(b);
    let up = upstream(&mut config, "anthropic");
    up.fallback_threshold = 1;
    up.fallback = vec![
        "claude-sonnet-4-5".into(),
        on("anthropic-b", "claude-sonnet-4-5"),
    ];
    let h = serve(first, config).await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("anthropic-b"));
    let _ = json(res).await;
    assert_eq!(h.mock.request_count(), 1);
    let seen = second.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].version, http::Version::HTTP_2);
    assert_eq!(sha256(&seen[0].body), sha256(MESSAGES.as_bytes()));
    let _ = std::fs::remove_file(&ca);
}

/// The failover benchmark's fault S06: the primary accepts and never answers. With a 5 s
/// head timeout and `fallback_after_timeouts = 1`, the second attempt goes to the second
/// upstream after the first timeout and one backoff.
#[tokio::test(start_paused = true)]
async fn a_timeout_falls_over_after_the_first_one() {
    let (h, second) = start_two(Script::always(Reply::stall()), Script::new(), |c| {
        let up = upstream(c, "openai");
        up.head_timeout_secs = Some(5);
        up.fallback_after_timeouts = Some(1);
        up.fallback = vec!["gpt-4o".into(), on("openai-b", "gpt-4o")];
    })
    .await;
    let req = h
        .post("/v1/chat/completions", CHAT)
        .body(Full::from(CHAT))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("openai-b"));
    assert_eq!(
        header(&res, "x-llm-retry-targets"),
        Some("openai/gpt-4o=1,openai-b/gpt-4o=1")
    );
    let _ = json(res).await;
    let (first, seen) = (h.mock.requests(), second.requests());
    assert_eq!((first.len(), seen.len()), (1, 1));
    // The head timeout, then the first backoff (0.5 s, up to 25 % more).
    let took = seen[0].received_at - first[0].received_at;
    assert!(
        took >= Duration::from_millis(5500) && took <= Duration::from_millis(5625),
        "{took:?}"
    );
}

/// A `429` whose `Retry-After` is above the policy's ceiling would end the request; with
/// `fallback_on_unwaitable_rate_limit` the retry goes to the second upstream instead.
#[tokio::test(start_paused = true)]
async fn a_rate_limit_with_nowhere_to_wait_falls_over_at_once() {
    let (h, second) = start_two(
        Script::always(Reply::rate_limited("3600")),
        Script::new(),
        |c| {
            let up = upstream(c, "anthropic");
            up.fallback_on_unwaitable_rate_limit = true;
            up.fallback = vec![
                "claude-sonnet-4-5".into(),
                on("anthropic-b", "claude-sonnet-4-5"),
            ];
        },
    )
    .await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("anthropic-b"));
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    let _ = json(res).await;
    let (first, seen) = (h.mock.requests(), second.requests());
    assert_eq!((first.len(), seen.len()), (1, 1));
    let took = seen[0].received_at - first[0].received_at;
    assert!(took <= Duration::from_millis(625), "{took:?}");
}

/// A prompt too long for the requested model goes once to the upstream's
/// `context_window_fallback`, within the same attempt, and the headers name that model.
#[tokio::test(start_paused = true)]
async fn a_prompt_too_long_goes_to_the_context_window_fallback() {
    let script = Script::new().when(|req| {
        let model = req.json().ok()?.get("model")?.as_str()?.to_owned();
        (model == "claude-sonnet-4-5").then(|| Reply::prompt_too_long(250_000, 200_000))
    });
    let h = start_with(script, |c| {
        c.upstream[0].context_window_fallback = Some("claude-sonnet-4-5-1m".into());
        c.upstream[0].fallback = vec!["claude-sonnet-4-5".into(), "claude-haiku-4-5".into()];
    })
    .await;
    let res = h.messages(MESSAGES).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("1"));
    assert_eq!(
        header(&res, "x-llm-retry-model"),
        Some("claude-sonnet-4-5-1m")
    );
    assert_eq!(header(&res, "x-llm-retry-upstream"), Some("anthropic"));
    assert_eq!(json(res).await["model"], "claude-sonnet-4-5-1m");
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(sha256(&seen[0].body), sha256(MESSAGES.as_bytes()));
    let moved = MESSAGES.replace("claude-sonnet-4-5", "claude-sonnet-4-5-1m");
    assert_eq!(sha256(&seen[1].body), sha256(moved.as_bytes()));
}
