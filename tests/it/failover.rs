//! Failover through ModelFallbackLayer inside RetryLayer, against mock servers on 127.0.0.1
//! under paused time: the trigger classes, the circuit per target, a target on another
//! upstream, and the interactive bound.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::ApiKeyPool;
use tower_llm_retry::fallback::{Circuit, CircuitState, ModelUsed, Target};
use tower_llm_retry::mock::{sse, MockServer, RecordedRequest, Reply, Script};
use tower_llm_retry::retry::GiveUpReason;
use tower_llm_retry::stream::StreamCommitted;
use tower_llm_retry::{
    ApiKey, AuthLayer, ErrorKind, ModelFallbackLayer, RetryLayer, RetryPolicy, RetryTrail,
};

const PRIMARY: &str = "claude-opus-4-1";
const FALLBACK: &str = "claude-sonnet-4-5";
const REQUEST: &str = r#"{"model":"claude-opus-4-1","max_tokens":1024,"system":"Be terse.","messages":[{"role":"user","content":"Name a \"model\" of car."}],"metadata":{"model":"not this one"}}"#;

fn model_of(r: &RecordedRequest) -> String {
    r.json().unwrap()["model"].as_str().unwrap().to_owned()
}

/// Requests for the primary get `primary(request)`; the fallback always succeeds.
fn by_model(primary: impl Fn(&RecordedRequest) -> Reply + Send + Sync + 'static) -> Script {
    Script::new().when(move |req| (model_of(req) == PRIMARY).then(|| primary(req)))
}

/// The models the server saw, each with its arrival after `start`.
fn seen(server: &MockServer, start: Instant) -> Vec<(String, Duration)> {
    server
        .requests()
        .iter()
        .map(|r| (model_of(r), r.received_at - start))
        .collect()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn policy() -> RetryPolicy {
    exact_policy()
        .head_timeout(Some(Duration::from_secs(5)))
        .idle_timeout(Some(Duration::from_secs(20)))
}

async fn send(
    server: &MockServer,
    policy: RetryPolicy,
    layer: ModelFallbackLayer,
) -> Result<http::Response<tower_llm_retry::RetryBody<hyper::body::Incoming>>, tower_llm_retry::Error>
{
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy))
        .layer(layer)
        .service(http_client());
    svc.oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
        .await
}

fn chain() -> ModelFallbackLayer {
    ModelFallbackLayer::new([PRIMARY, FALLBACK]).unwrap()
}

#[tokio::test(start_paused = true)]
async fn each_trigger_class_moves_to_the_next_target_after_its_threshold() {
    let no_output = || vec![sse::anthropic_message(&[])[0].clone()];
    let cases: Vec<(&str, ModelFallbackLayer, Reply, Vec<Duration>)> = vec![
        (
            "two overloads",
            chain().threshold(2).unwrap(),
            Reply::overloaded(),
            vec![ms(0), ms(500), ms(1_500)],
        ),
        (
            "two 503s",
            chain().after_failures(2).unwrap(),
            Reply::status(503),
            vec![ms(0), ms(500), ms(1_500)],
        ),
        (
            "one reset connection",
            chain().after_failures(1).unwrap(),
            Reply::reset(),
            vec![ms(0), ms(500)],
        ),
        (
            "one head timeout (5 s)",
            chain().after_timeouts(1).unwrap(),
            Reply::stall(),
            vec![ms(0), ms(5_500)],
        ),
        (
            "two idle stalls before the commit point (20 s each)",
            chain().after_timeouts(2).unwrap(),
            Reply::sse_then_stall(no_output()),
            vec![ms(0), ms(20_500), ms(41_500)],
        ),
        (
            "a Retry-After above the policy's ceiling",
            chain().on_unwaitable_rate_limit(true),
            Reply::rate_limited("3600"),
            vec![ms(0), ms(500)],
        ),
        (
            "a 429 with no Retry-After",
            chain().on_unwaitable_rate_limit(true),
            Reply::status(429),
            vec![ms(0), ms(500)],
        ),
    ];
    for (name, layer, reply, times) in cases {
        let server = MockServer::start(by_model(move |_| reply.clone()))
            .await
            .unwrap();
        let start = Instant::now();
        let res = send(&server, policy(), layer).await.expect(name);
        assert_eq!(res.status(), StatusCode::OK, "{name}");
        let got = seen(&server, start);
        let mut want: Vec<(String, Duration)> =
            times.iter().map(|t| (PRIMARY.to_owned(), *t)).collect();
        want.last_mut().unwrap().0 = FALLBACK.to_owned();
        assert_eq!(got, want, "{name}");
        let used = res.extensions().get::<ModelUsed>().unwrap();
        assert_eq!(used.model, FALLBACK, "{name}");
        assert_eq!(used.attempts.len(), 2, "{name}");
        assert_eq!(used.attempts[0].model, PRIMARY, "{name}");
        assert_eq!(
            used.attempts[0].attempts as usize,
            times.len() - 1,
            "{name}"
        );
        assert_eq!(used.attempts[1].model, FALLBACK, "{name}");
        assert_eq!(used.attempts[1].attempts, 1, "{name}");
    }
}

#[tokio::test(start_paused = true)]
async fn below_its_threshold_a_trigger_keeps_the_request_on_the_primary() {
    // Two 503s, then success, with a threshold of three: the primary every time.
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::status(503))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let res = send(&server, policy(), chain().after_failures(3).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen(&server, start),
        [
            (PRIMARY.to_owned(), ms(0)),
            (PRIMARY.to_owned(), ms(500)),
            (PRIMARY.to_owned(), ms(1_500)),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_rate_limit_with_every_pool_key_resting_moves_to_the_fallback() {
    let server = MockServer::start(by_model(|_| Reply::rate_limited("10")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()))
        .layer(chain().on_unwaitable_rate_limit(true))
        .layer(AuthLayer::new(
            ApiKeyPool::new(["sk-one", "sk-two"]).unwrap(),
        ))
        .service(http_client());
    let start = Instant::now();
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let reqs = server.requests();
    // Both keys rate-limited at once (a rotation is a re-send, not a retry), then the
    // fallback after the policy's first backoff, not after the 10 s the keys rest.
    assert_eq!(
        seen(&server, start),
        [
            (PRIMARY.to_owned(), ms(0)),
            (PRIMARY.to_owned(), ms(0)),
            (FALLBACK.to_owned(), ms(500)),
        ]
    );
    assert_eq!(reqs[0].headers["x-api-key"], "sk-one");
    assert_eq!(reqs[1].headers["x-api-key"], "sk-two");
}

#[tokio::test(start_paused = true)]
async fn a_waitable_rate_limit_is_waited_for_on_the_primary() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("3"))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let res = send(&server, policy(), chain().on_unwaitable_rate_limit(true))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen(&server, start),
        [(PRIMARY.to_owned(), ms(0)), (PRIMARY.to_owned(), ms(3_000))]
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_has_nowhere_to_wait() {
    // 30 s is under the policy's ceiling, but past the 10 s deadline: waiting cannot help.
    let server = MockServer::start(by_model(|_| Reply::rate_limited("30")))
        .await
        .unwrap();
    let start = Instant::now();
    let policy = policy().deadline(Some(Duration::from_secs(10)));
    let res = send(&server, policy, chain().on_unwaitable_rate_limit(true))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen(&server, start),
        [(PRIMARY.to_owned(), ms(0)), (FALLBACK.to_owned(), ms(500))]
    );
}

#[tokio::test(start_paused = true)]
async fn without_the_rate_limit_trigger_an_unwaitable_retry_after_gives_up() {
    let server = MockServer::start(by_model(|_| Reply::rate_limited("3600")))
        .await
        .unwrap();
    let res = send(&server, policy(), chain()).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(server.request_count(), 1);
    assert_eq!(
        res.extensions().get::<RetryTrail>().unwrap().gave_up(),
        Some(GiveUpReason::RetryAfterTooLong)
    );
}

#[tokio::test(start_paused = true)]
async fn non_trigger_classes_never_move_to_the_next_target() {
    let cases = [
        (
            "400 validation",
            Reply::anthropic_error(400, "invalid_request_error", "messages: field required"),
        ),
        ("401", Reply::unauthorized()),
        (
            "403",
            Reply::anthropic_error(403, "permission_error", "not allowed"),
        ),
        (
            "404",
            Reply::anthropic_error(404, "not_found_error", "no such model"),
        ),
        (
            "quota exhausted",
            Reply::openai_error(429, "insufficient_quota", "You exceeded your current quota"),
        ),
        ("context overflow", Reply::prompt_too_long(210_000, 200_000)),
    ];
    for (name, reply) in cases {
        let status = reply.clone();
        let server = MockServer::start(by_model(move |_| reply.clone()))
            .await
            .unwrap();
        // Every trigger at its most eager, and a circuit that opens on one failure.
        let layer = chain()
            .threshold(1)
            .unwrap()
            .after_failures(1)
            .unwrap()
            .after_timeouts(1)
            .unwrap()
            .on_unwaitable_rate_limit(true)
            .circuit(Circuit::new().failures(1))
            .unwrap();
        let res = send(&server, policy(), layer.clone()).await.unwrap();
        assert!(
            res.status().is_client_error(),
            "{name}: {} ({status:?})",
            res.status()
        );
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(server.request_count(), 1, "{name}");
        assert_eq!(model_of(&server.requests()[0]), PRIMARY, "{name}");
        assert!(
            layer.circuit_states().iter().all(|t| t.state.is_closed()),
            "{name}: the circuit learnt nothing"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_circuit_opens_after_f_failures_in_w_and_the_cooldown_goes_straight_to_the_fallback() {
    let server = MockServer::start(by_model(|_| Reply::status(503)))
        .await
        .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .circuit(
            Circuit::new()
                .failures(3)
                .window(Duration::from_secs(10))
                .cooldown(Duration::from_secs(30)),
        )
        .unwrap();
    let svc = retried(&layer);
    let call = || {
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
    };
    let start = Instant::now();
    // Two failures 11 s apart: the first has left the window when the second comes.
    for at in [0, 11] {
        tokio::time::sleep_until(start + Duration::from_secs(at)).await;
        assert_eq!(call().await.unwrap().status(), StatusCode::OK);
    }
    assert!(layer.circuit_states()[0].state.is_closed());
    // Three within 10 s (11, 12, 13): open.
    for at in [12, 13] {
        tokio::time::sleep_until(start + Duration::from_secs(at)).await;
        assert_eq!(call().await.unwrap().status(), StatusCode::OK);
    }
    let states = layer.circuit_states();
    assert_eq!(states[0].model, PRIMARY);
    assert_eq!(
        states[0].state,
        CircuitState::Open {
            remaining: ms(29_500)
        }
    );
    assert_eq!(states[0].cooldown, Some(Duration::from_secs(30)));
    assert!(states[1].state.is_closed());
    // During the cooldown: the fallback at once, the primary sees nothing.
    for at in [14, 20, 42] {
        let sent = start + Duration::from_secs(at);
        tokio::time::sleep_until(sent).await;
        let res = call().await.unwrap();
        assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, FALLBACK);
        let last = server.requests().pop().unwrap();
        assert_eq!(
            (model_of(&last), last.received_at),
            (FALLBACK.to_owned(), sent)
        );
        assert!(
            res.extensions().get::<RetryTrail>().is_none(),
            "one attempt"
        );
    }
    let primary: Vec<Duration> = seen(&server, start)
        .into_iter()
        .filter(|(m, _)| m == PRIMARY)
        .map(|(_, t)| t)
        .collect();
    assert_eq!(
        primary,
        [0, 11, 12, 13].map(Duration::from_secs),
        "nothing reached the primary while it was open"
    );
}

#[tokio::test(start_paused = true)]
async fn half_open_lets_one_probe_through_under_50_concurrent_requests_and_a_good_probe_closes() {
    let healthy = Arc::new(AtomicBool::new(false));
    let flag = healthy.clone();
    let server = MockServer::start(by_model(move |_| match flag.load(Ordering::SeqCst) {
        true => Reply::success().delay(Duration::from_secs(2)),
        false => Reply::status(503),
    }))
    .await
    .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .circuit(Circuit::new().failures(1).cooldown(Duration::from_secs(10)))
        .unwrap();
    let svc = retried(&layer);
    let call = || {
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
    };
    let start = Instant::now();
    assert_eq!(call().await.unwrap().status(), StatusCode::OK);
    assert!(!layer.circuit_states()[0].state.is_closed());

    tokio::time::sleep_until(start + Duration::from_secs(10)).await;
    healthy.store(true, Ordering::SeqCst);
    let before = server.request_count();
    let results = futures_util::future::join_all((0..50).map(|_| call())).await;
    let mut by: Vec<String> = Vec::new();
    for res in results {
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        by.push(res.extensions().get::<ModelUsed>().unwrap().model.clone());
    }
    assert_eq!(by.iter().filter(|m| *m == PRIMARY).count(), 1, "one probe");
    assert_eq!(by.iter().filter(|m| *m == FALLBACK).count(), 49);
    let during = &server.requests()[before..];
    assert_eq!(during.len(), 50, "no request was sent twice");
    let probes: Vec<&RecordedRequest> = during.iter().filter(|r| model_of(r) == PRIMARY).collect();
    assert_eq!(probes.len(), 1);
    // The others did not wait for the probe.
    assert!(during
        .iter()
        .all(|r| r.received_at == start + Duration::from_secs(10)));
    assert!(
        layer.circuit_states()[0].state.is_closed(),
        "the probe closed it"
    );
    assert_eq!(layer.circuit_states()[0].cooldown, None);

    // Closed again: requests go to the primary.
    let res = call().await.unwrap();
    assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, PRIMARY);
}

#[tokio::test(start_paused = true)]
async fn a_failed_probe_reopens_the_circuit_with_the_cooldown_doubled_up_to_its_bound() {
    let server = MockServer::start(by_model(|_| Reply::status(503)))
        .await
        .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .circuit(
            Circuit::new()
                .failures(1)
                .cooldown(Duration::from_secs(10))
                .max_cooldown(Duration::from_secs(25)),
        )
        .unwrap();
    let svc = retried(&layer);
    let start = Instant::now();
    // Opens at 0 (10 s); probes at 10 (reopens for 20 s), at 30 (25 s, the bound), at 55.
    for at in [0, 9, 10, 29, 30, 54, 55] {
        tokio::time::sleep_until(start + Duration::from_secs(at)).await;
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "at {at} s");
        let cooldown = layer.circuit_states()[0].cooldown;
        let want = match at {
            0 | 9 => 10,
            10 | 29 => 20,
            _ => 25,
        };
        assert_eq!(cooldown, Some(Duration::from_secs(want)), "at {at} s");
    }
    let primary: Vec<Duration> = seen(&server, start)
        .into_iter()
        .filter(|(m, _)| m == PRIMARY)
        .map(|(_, t)| t)
        .collect();
    assert_eq!(primary, [0, 10, 30, 55].map(Duration::from_secs));
}

#[tokio::test(start_paused = true)]
async fn a_flapping_primary_is_covered_by_the_fallback_and_serves_again_within_one_cooldown() {
    let start = Instant::now();
    let server = MockServer::start(by_model(move |req| {
        if req.received_at - start < Duration::from_secs(60) {
            Reply::status(503)
        } else {
            Reply::success()
        }
    }))
    .await
    .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .circuit(
            Circuit::new()
                .failures(2)
                .window(Duration::from_secs(30))
                .cooldown(Duration::from_secs(10))
                .max_cooldown(Duration::from_secs(30)),
        )
        .unwrap();
    let svc = retried(&layer);
    let mut served = Vec::new();
    let mut cooldown_at_recovery = None;
    for i in 0..20u64 {
        tokio::time::sleep_until(start + Duration::from_secs(4 * i)).await;
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "request {i}");
        served.push(res.extensions().get::<ModelUsed>().unwrap().model.clone());
        if 4 * i == 60 {
            cooldown_at_recovery = layer.circuit_states()[0].cooldown;
        }
    }
    let primary: Vec<Duration> = seen(&server, start)
        .into_iter()
        .filter(|(m, _)| m == PRIMARY)
        .map(|(_, t)| t)
        .collect();
    // Failures at 0 and 4 open it (10 s); probes at 16 (reopens for 20 s) and 36 (30 s,
    // the bound) fail; the probe at 68 finds it healthy, and it serves from there.
    assert_eq!(primary, [0, 4, 16, 36, 68, 72, 76].map(Duration::from_secs));
    let first_primary = served.iter().position(|m| m == PRIMARY).unwrap();
    assert_eq!(first_primary, 17, "the request at 68 s");
    assert!(served[..17].iter().all(|m| m == FALLBACK));
    assert!(served[17..].iter().all(|m| m == PRIMARY));
    // Recovered at 60 s, served again at 68 s: within the cooldown in force then (30 s).
    let cooldown = cooldown_at_recovery.expect("open when the primary recovered");
    assert_eq!(cooldown, Duration::from_secs(30));
    let back = primary
        .iter()
        .find(|t| **t >= Duration::from_secs(60))
        .unwrap();
    assert!(*back - Duration::from_secs(60) <= cooldown, "{back:?}");
    assert!(layer.circuit_states()[0].state.is_closed());
}

#[tokio::test(start_paused = true)]
async fn a_fallback_on_another_upstream_gets_the_same_bytes_but_the_model_and_its_own_credential() {
    let primary = MockServer::start(
        Script::always(Reply::overloaded()).require_header("x-api-key", ["sk-primary"]),
    )
    .await
    .unwrap();
    let second = MockServer::start(Script::new().require_header("x-api-key", ["sk-second"]))
        .await
        .unwrap();
    let base = second.url("/gateway");
    let layer = ModelFallbackLayer::new([
        Target::new(PRIMARY),
        Target::new(FALLBACK)
            .upstream(&base)
            .unwrap()
            .credential(ApiKey::new("sk-second").unwrap()),
    ])
    .unwrap()
    .threshold(1)
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()))
        .layer(layer)
        .layer(AuthLayer::new(ApiKey::new("sk-primary").unwrap()))
        .service(http_client());
    let mut req = anthropic_request(&primary.url("/v1/messages?beta=true"), REQUEST);
    let own_host = primary.addr().to_string();
    req.headers_mut().insert("host", own_host.parse().unwrap());
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    let first = primary.requests();
    assert_eq!(first[0].headers["host"], own_host.as_str());
    assert_eq!(first.len(), 1);
    assert_eq!(sha256(&first[0].body), sha256(REQUEST.as_bytes()));
    assert_eq!(first[0].headers["x-api-key"], "sk-primary");
    let moved = second.requests();
    assert_eq!(moved.len(), 1);
    assert_eq!(moved[0].uri.path(), "/gateway/v1/messages");
    assert_eq!(moved[0].uri.query(), Some("beta=true"));
    assert_only_value_changed(
        REQUEST.as_bytes(),
        &moved[0].body,
        "model",
        "\"claude-sonnet-4-5\"",
    );
    assert_eq!(moved[0].headers["x-api-key"], "sk-second");
    assert_eq!(
        moved[0].headers["host"],
        second.addr().to_string().as_str(),
        "the caller's host header follows the new authority"
    );
    for name in ["anthropic-version", "content-type"] {
        assert_eq!(moved[0].headers[name], first[0].headers[name], "{name}");
    }

    let used = res.extensions().get::<ModelUsed>().unwrap().clone();
    assert_eq!(used.model, FALLBACK);
    assert_eq!(used.upstream.as_ref().map(|u| u.to_string()), Some(base));
    assert_eq!(used.attempts.len(), 2);
    assert_eq!(
        (
            used.attempts[0].model.as_str(),
            used.attempts[0].upstream.as_ref(),
            used.attempts[0].attempts
        ),
        (PRIMARY, None, 1)
    );
    assert_eq!(used.attempts[1].model, FALLBACK);
    assert_eq!(used.attempts[1].upstream, used.upstream);
    assert_eq!(used.attempts[1].attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_after_the_commit_point_never_falls_back() {
    let mut events = sse::anthropic_message(&["partial"]);
    events.truncate(3); // message_start, content_block_start, one delta of output
    let server = MockServer::start(by_model({
        let events = events.clone();
        move |_| Reply::sse_then_reset(events.clone())
    }))
    .await
    .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .after_timeouts(1)
        .unwrap()
        .circuit(Circuit::new().failures(1))
        .unwrap();
    let res = send(&server, policy(), layer.clone()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.extensions().get::<StreamCommitted>().is_some());
    assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, PRIMARY);
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(bytes, concat(&events));
    assert!(err.is_some(), "the cut reaches the caller as an error");
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(
        server.request_count(),
        1,
        "nothing was re-sent after output"
    );
    assert!(layer.circuit_states()[0].state.is_closed());
}

/// The interactive recipe of the `fallback` module docs, jitter aside.
fn interactive() -> (RetryPolicy, ModelFallbackLayer) {
    let policy = RetryPolicy::interactive()
        .jitter(tower_llm_retry::retry::Jitter::none())
        .head_timeout(Some(Duration::from_secs(10)))
        .deadline(Some(Duration::from_secs(30)));
    let layer = chain()
        .after_timeouts(1)
        .unwrap()
        .after_failures(2)
        .unwrap()
        .circuit(Circuit::new())
        .unwrap();
    (policy, layer)
}

#[tokio::test(start_paused = true)]
async fn the_interactive_recipe_falls_over_after_one_timeout_and_ends_at_its_deadline() {
    // Both stall: the primary times out at 10 s, the fallback at 20.5 s; its retry at 21.5 s
    // has its head timeout cut to the deadline, and the call ends at exactly 30 s.
    let server = MockServer::start(Script::always(Reply::stall()))
        .await
        .unwrap();
    let (policy, layer) = interactive();
    let start = Instant::now();
    let err = send(&server, policy.clone(), layer).await.unwrap_err();
    // The last attempt's head timeout was cut to the deadline; no retry fits after it.
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    assert_eq!(err.trail().unwrap().gave_up(), Some(GiveUpReason::Deadline));
    assert_eq!(start.elapsed(), Duration::from_secs(30));
    assert_eq!(
        seen(&server, start),
        [
            (PRIMARY.to_owned(), ms(0)),
            (FALLBACK.to_owned(), ms(10_500)),
            (FALLBACK.to_owned(), ms(21_500)),
        ]
    );

    // A stalled primary and a healthy fallback: answered 10.5 s in.
    let server = MockServer::start(by_model(|_| Reply::stall()))
        .await
        .unwrap();
    let (policy, layer) = interactive();
    let start = Instant::now();
    let res = send(&server, policy, layer).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), ms(10_500));
    assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, FALLBACK);
}

#[tokio::test(start_paused = true)]
async fn head_timeouts_count_against_the_circuit() {
    let server = MockServer::start(by_model(|_| Reply::stall()))
        .await
        .unwrap();
    let layer = chain()
        .after_timeouts(1)
        .unwrap()
        .circuit(Circuit::new().failures(2).cooldown(Duration::from_secs(60)))
        .unwrap();
    let svc = retried(&layer);
    let start = Instant::now();
    for _ in 0..3 {
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
            .await
            .unwrap();
        assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, FALLBACK);
    }
    // Two head timeouts of 5 s (each then served by the fallback 0.5 s later) opened the
    // circuit; the third request went straight to the fallback at 11 s.
    assert_eq!(
        seen(&server, start),
        [
            (PRIMARY.to_owned(), ms(0)),
            (FALLBACK.to_owned(), ms(5_500)),
            (PRIMARY.to_owned(), ms(5_500)),
            (FALLBACK.to_owned(), ms(11_000)),
            (FALLBACK.to_owned(), ms(11_000)),
        ]
    );
    assert!(matches!(
        layer.circuit_states()[0].state,
        CircuitState::Open { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn a_step_to_the_next_target_does_not_wait_at_the_gate_the_failing_target_closed() {
    use tower_llm_retry::fleet::{Fleet, GateConfig};
    let server = MockServer::start(by_model(|_| {
        Reply::overloaded().header("retry-after", "20")
    }))
    .await
    .unwrap();
    // One state for every request: the gate read is the fleet's own.
    let fleet = Fleet::builder()
        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
        .per_scope(false)
        .build();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).fleet(fleet.clone()))
        .layer(chain().threshold(1).unwrap())
        .service(http_client());
    let start = Instant::now();
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        fleet.gate_closed_until().is_some(),
        "the primary's Retry-After closed the gate"
    );
    assert_eq!(
        seen(&server, start),
        [(PRIMARY.to_owned(), ms(0)), (FALLBACK.to_owned(), ms(500))]
    );
}

#[tokio::test(start_paused = true)]
async fn with_the_never_policy_the_layer_still_routes_around_an_open_circuit() {
    let server = MockServer::start(by_model(|_| Reply::status(503)))
        .await
        .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .circuit(Circuit::new().failures(2).cooldown(Duration::from_secs(30)))
        .unwrap();
    // No retries: each request is one attempt, which a circuit still moves.
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::never()))
        .layer(layer.clone())
        .service(http_client());
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
            .await
            .unwrap();
        statuses.push(res.status().as_u16());
    }
    assert_eq!(statuses, [503, 503, 200, 200]);
    let models: Vec<String> = server.requests().iter().map(model_of).collect();
    assert_eq!(models, [PRIMARY, PRIMARY, FALLBACK, FALLBACK]);
    assert_only_value_changed(
        REQUEST.as_bytes(),
        &server.requests()[2].body,
        "model",
        "\"claude-sonnet-4-5\"",
    );
}

#[tokio::test(start_paused = true)]
async fn with_the_never_policy_an_exhausted_quota_never_counts_against_the_circuit() {
    let server = MockServer::start(by_model(|_| {
        Reply::openai_error(429, "insufficient_quota", "You exceeded your current quota")
    }))
    .await
    .unwrap();
    let layer = chain()
        .after_failures(1)
        .unwrap()
        .circuit(Circuit::new().failures(1))
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::never()))
        .layer(layer.clone())
        .service(http_client());
    send_twice(&svc, &server, StatusCode::TOO_MANY_REQUESTS).await;
    assert!(layer.circuit_states()[0].state.is_closed());
    let models: Vec<String> = server.requests().iter().map(model_of).collect();
    assert_eq!(models, [PRIMARY, PRIMARY]);
}

/// A failure with no response (a reset) at a target a circuit skipped to counts where it
/// happened: the next attempt moves on from there, not from the target it was planned for.
#[tokio::test(start_paused = true)]
async fn a_reset_at_a_target_skipped_to_moves_one_target_on_from_it() {
    const THIRD: &str = "claude-haiku-4-5";
    let resets = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r = resets.clone();
    let server = MockServer::start(Script::new().when(move |req| match model_of(req).as_str() {
        PRIMARY => Some(Reply::status(503)),
        // The first two requests' fallbacks answer; from the third request on it resets.
        FALLBACK if r.fetch_add(1, Ordering::SeqCst) > 1 => Some(Reply::reset()),
        _ => None,
    }))
    .await
    .unwrap();
    let layer = ModelFallbackLayer::new([PRIMARY, FALLBACK, THIRD])
        .unwrap()
        .after_failures(1)
        .unwrap()
        .circuit(Circuit::new().failures(2).cooldown(Duration::from_secs(60)))
        .unwrap();
    let svc = retried(&layer);
    // Two requests open the primary's circuit (each: a 503 there, then the fallback answers).
    send_twice(&svc, &server, StatusCode::OK).await;
    assert!(!layer.circuit_states()[0].state.is_closed());
    let before = server.requests().len();
    let res = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // Started on the fallback (the primary's circuit is open), reset there, then the third.
    let models: Vec<String> = server.requests()[before..].iter().map(model_of).collect();
    assert_eq!(models, [FALLBACK, THIRD]);
    let used = res.extensions().get::<ModelUsed>().unwrap();
    assert_eq!(used.model, THIRD);
}

/// Sends `REQUEST` through `svc` twice, and checks each is answered `status`.
async fn send_twice<S, B>(svc: &S, server: &MockServer, status: StatusCode)
where
    S: tower::Service<
            http::Request<http_body_util::Full<bytes::Bytes>>,
            Response = http::Response<B>,
        > + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..2 {
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
            .await
            .unwrap();
        assert_eq!(res.status(), status);
    }
}

/// The retry loop with `layer` inside it, over a plain client.
fn retried(
    layer: &ModelFallbackLayer,
) -> tower_llm_retry::retry::Retry<tower_llm_retry::fallback::ModelFallback<HttpClient>> {
    ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()))
        .layer(layer.clone())
        .service(http_client())
}

const GPT: &str = "gpt-4o";
const GPT_MINI: &str = "gpt-4o-mini";
const OPENAI_REQUEST: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Name a \"model\" of car."}],"metadata":{"model":"not this one"}}"#;
/// OpenAI's answer when the model's servers are overloaded: a 503 with no code of its own.
const OPENAI_OVERLOADED: &str = r#"{"error":{"message":"The server is overloaded or not ready yet.","type":"server_error","param":null,"code":null}}"#;

fn openai_503(body: &'static str) -> Reply {
    Reply::status(503)
        .header("content-type", "application/json")
        .body(body)
}

async fn send_openai(
    server: &MockServer,
    path: &str,
    policy: RetryPolicy,
    layer: ModelFallbackLayer,
) -> Result<http::Response<tower_llm_retry::RetryBody<hyper::body::Incoming>>, tower_llm_retry::Error>
{
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy))
        .layer(layer)
        .service(http_client());
    svc.oneshot(anthropic_request(&server.url(path), OPENAI_REQUEST))
        .await
}

fn classes(trail: &RetryTrail) -> Vec<tower_llm_retry::classify::FailureClass> {
    trail.attempts().iter().map(|a| a.class).collect()
}

/// The failover benchmark's faults S04 and S16: every attempt at the primary is OpenAI's 503
/// overloaded; the overload trigger moves the request on after `threshold` of them.
#[tokio::test(start_paused = true)]
async fn a_persistent_openai_503_overloaded_falls_back_after_the_threshold() {
    use tower_llm_retry::classify::FailureClass::Overloaded;
    let server = MockServer::start(
        Script::new().when(|req| (model_of(req) == GPT).then(|| openai_503(OPENAI_OVERLOADED))),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let layer = ModelFallbackLayer::new([GPT, GPT_MINI])
        .unwrap()
        .threshold(2)
        .unwrap();
    let res = send_openai(&server, "/v1/chat/completions", policy(), layer)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen(&server, start),
        [
            (GPT.to_owned(), ms(0)),
            (GPT.to_owned(), ms(500)),
            (GPT_MINI.to_owned(), ms(1_500)),
        ]
    );
    let requests = server.requests();
    for r in &requests[..2] {
        assert_eq!(sha256(&r.body), sha256(OPENAI_REQUEST.as_bytes()));
    }
    assert_only_value_changed(
        OPENAI_REQUEST.as_bytes(),
        &requests[2].body,
        "model",
        "\"gpt-4o-mini\"",
    );
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(classes(&trail), [Overloaded, Overloaded]);
    assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, GPT_MINI);
    let body: serde_json::Value = serde_json::from_slice(&body_bytes(res).await).unwrap();
    assert_eq!(body["model"], GPT_MINI);

    // The same answers count toward the policy's limit of consecutive overloads.
    let server = MockServer::start(Script::always(openai_503(OPENAI_OVERLOADED)))
        .await
        .unwrap();
    let res = send_openai(
        &server,
        "/v1/chat/completions",
        policy().max_consecutive_overloads(Some(2)),
        ModelFallbackLayer::new([GPT]).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.request_count(), 2);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxConsecutiveOverloads));
    assert_eq!(classes(trail), [Overloaded, Overloaded]);
}

#[tokio::test(start_paused = true)]
async fn a_plain_503_never_counts_as_an_overload() {
    use tower_llm_retry::classify::FailureClass::Server;
    const UNAVAILABLE: &str = r#"{"error":{"message":"Service Unavailable","type":"server_error","param":null,"code":null}}"#;
    let server = MockServer::start(Script::always(openai_503(UNAVAILABLE)))
        .await
        .unwrap();
    let start = Instant::now();
    let layer = ModelFallbackLayer::new([GPT, GPT_MINI])
        .unwrap()
        .threshold(1)
        .unwrap();
    let res = send_openai(
        &server,
        "/v1/chat/completions",
        policy().max_retries(3),
        layer,
    )
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        seen(&server, start),
        [
            (GPT.to_owned(), ms(0)),
            (GPT.to_owned(), ms(500)),
            (GPT.to_owned(), ms(1_500)),
            (GPT.to_owned(), ms(3_500)),
        ]
    );
    assert!(server
        .requests()
        .iter()
        .all(|r| sha256(&r.body) == sha256(OPENAI_REQUEST.as_bytes())));
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    assert_eq!(classes(trail), [Server; 4]);
    assert_eq!(body_bytes(res).await, UNAVAILABLE.as_bytes());
}

/// The Responses API says it in-band: a `200` stream whose first event after
/// `response.created` is an `error` or a `response.failed` naming `server_is_overloaded`.
#[tokio::test(start_paused = true)]
async fn the_in_band_server_is_overloaded_of_the_responses_api_falls_back() {
    use tower_llm_retry::classify::FailureClass::Overloaded;
    use tower_llm_retry::mock::SseFrame;
    let created = || {
        SseFrame::new(
            "response.created",
            r#"{"type":"response.created","response":{"id":"resp_1","status":"in_progress"}}"#,
        )
    };
    let error_event = vec![
        created(),
        SseFrame::new(
            "error",
            r#"{"type":"error","code":"server_is_overloaded","message":"The server is overloaded or not ready yet.","param":null}"#,
        ),
    ];
    let failed_event = vec![
        created(),
        SseFrame::new(
            "response.failed",
            r#"{"type":"response.failed","response":{"id":"resp_1","status":"failed","error":{"code":"server_is_overloaded","message":"Try again later."}}}"#,
        ),
    ];
    let good = vec![
        created(),
        SseFrame::new(
            "response.output_text.delta",
            r#"{"type":"response.output_text.delta","delta":"A Saab."}"#,
        ),
        SseFrame::new(
            "response.completed",
            r#"{"type":"response.completed","response":{"id":"resp_2","status":"completed","usage":{"input_tokens":9,"output_tokens":3}}}"#,
        ),
    ];
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse(error_event))
            .then(Reply::sse(failed_event))
            .otherwise(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let layer = ModelFallbackLayer::new([GPT, GPT_MINI])
        .unwrap()
        .threshold(2)
        .unwrap();
    let res = send_openai(&server, "/v1/responses", policy(), layer)
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen(&server, start),
        [
            (GPT.to_owned(), ms(0)),
            (GPT.to_owned(), ms(500)),
            (GPT_MINI.to_owned(), ms(1_500)),
        ]
    );
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(classes(&trail), [Overloaded, Overloaded]);
    assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, GPT_MINI);
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&good));
}

/// A port nothing listens on: connecting to it is refused at once.
fn closed_port() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

#[tokio::test(start_paused = true)]
async fn connect_failures_move_the_request_to_the_next_upstream_after_n_in_a_row() {
    use tower_llm_retry::classify::FailureClass::Transport;
    let server = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let dead = closed_port();
    let next = server.url("/next");
    let layer = ModelFallbackLayer::new([
        Target::new(PRIMARY).upstream(&dead).unwrap(),
        Target::new(FALLBACK).upstream(&next).unwrap(),
    ])
    .unwrap()
    .after_connect_failures(2)
    .unwrap();
    let start = Instant::now();
    // The request's own URI is the mock's: only the primary target's upstream is dead.
    let res = send(&server, policy(), layer).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let requests = server.requests();
    assert_eq!(requests.len(), 1, "the primary never reached the mock");
    assert_eq!(requests[0].received_at - start, ms(1_500));
    assert_eq!(requests[0].uri.path(), "/next/v1/messages");
    assert_only_value_changed(
        REQUEST.as_bytes(),
        &requests[0].body,
        "model",
        "\"claude-sonnet-4-5\"",
    );
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(classes(&trail), [Transport, Transport]);
    let used = res.extensions().get::<ModelUsed>().unwrap().clone();
    assert_eq!(used.model, FALLBACK);
    let per_target: Vec<_> = used
        .attempts
        .iter()
        .map(|t| {
            (
                t.model.as_str(),
                t.upstream.as_ref().map(|u| u.to_string()),
                t.attempts,
            )
        })
        .collect();
    assert_eq!(
        per_target,
        [
            (PRIMARY, Some(format!("{dead}/")), 2),
            (FALLBACK, Some(next), 1),
        ]
    );

    // Without the trigger, refused connections are retried at the primary until the policy
    // gives up; the mock sees nothing.
    let layer = ModelFallbackLayer::new([
        Target::new(PRIMARY).upstream(&dead).unwrap(),
        Target::new(FALLBACK)
            .upstream(&server.url("/next"))
            .unwrap(),
    ])
    .unwrap()
    .after_timeouts(1)
    .unwrap();
    let err = send(&server, policy().max_retries(2), layer)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    assert_eq!(classes(err.trail().unwrap()), [Transport; 3]);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_reset_after_the_request_was_sent_is_no_connect_failure() {
    let server = MockServer::start(by_model(|_| Reply::reset()))
        .await
        .unwrap();
    let layer = chain().after_connect_failures(1).unwrap();
    let err = send(&server, policy().max_retries(2), layer)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    let models: Vec<String> = server.requests().iter().map(model_of).collect();
    assert_eq!(models, [PRIMARY; 3]);
}

#[tokio::test(start_paused = true)]
async fn connect_failures_count_against_the_circuit_when_their_trigger_is_on() {
    let server = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let dead = closed_port();
    let layer = |connects: bool| {
        let layer = ModelFallbackLayer::new([
            Target::new(PRIMARY).upstream(&dead).unwrap(),
            Target::new(FALLBACK).upstream(&server.url("")).unwrap(),
        ])
        .unwrap()
        .after_timeouts(1)
        .unwrap()
        .circuit(Circuit::new().failures(1).cooldown(Duration::from_secs(60)))
        .unwrap();
        match connects {
            true => layer.after_connect_failures(1).unwrap(),
            false => layer,
        }
    };
    // The trigger on: the refused attempt opens the primary's circuit, and the next request
    // goes straight to the fallback.
    let on = layer(true);
    let svc = retried(&on);
    let start = Instant::now();
    for _ in 0..2 {
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
            .await
            .unwrap();
        assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, FALLBACK);
    }
    assert_eq!(
        seen(&server, start),
        [
            (FALLBACK.to_owned(), ms(500)),
            (FALLBACK.to_owned(), ms(500))
        ]
    );
    assert!(matches!(
        on.circuit_states()[0].state,
        CircuitState::Open { .. }
    ));

    // Off: a refused connection is no failure of the layer's trigger classes.
    let off = layer(false);
    let err = retried(&off)
        .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    assert!(off.circuit_states()[0].state.is_closed());
}
