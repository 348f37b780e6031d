//! The fleet across processes: several fleets built separately (as separate processes build
//! theirs) sharing one real `redis-server`, in front of the mock on 127.0.0.1. Redis keeps
//! real time, so these tests run in real time, each for a few seconds at most.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_llm_retry::fleet::{BudgetConfig, Fleet, GateConfig, PacingWake, RedisFleet, RedisState};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{GiveUpReason, Jitter, Retry};
use tower_llm_retry::{RetryLayer, RetryPolicy, RetryTrail};

#[path = "../common/redis.rs"]
#[allow(dead_code)]
pub(crate) mod redis_server;
use redis_server::RedisServer;

/// The tests below need a `redis-server` and are ignored by default; under CI (`CI` set),
/// where they must run, this one fails when it is not installed.
#[test]
fn redis_server_is_installed_under_ci() {
    redis_server::assert_installed_under_ci();
}

fn store(redis: &RedisServer) -> RedisFleet {
    RedisFleet::from_url(&redis.url())
        .unwrap()
        .scope("127.0.0.1", b"test-key")
}

/// A store whose calls may take 250 ms: for the tests of the shared pacing, which are about
/// the schedule, not the fallback a slow call takes (a loaded machine misses 50 ms).
fn patient(store: RedisFleet) -> RedisFleet {
    store.call_timeout(Duration::from_millis(250)).unwrap()
}

pub(super) fn gate() -> GateConfig {
    GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(0.25, Duration::from_secs(30))
        .unwrap()
}

pub(super) fn policy() -> RetryPolicy {
    RetryPolicy::default().jitter(Jitter::none())
}

pub(super) fn stack(fleet: &Fleet, policy: RetryPolicy) -> Retry<HttpClient> {
    RetryLayer::new()
        .policy(policy)
        .fleet(fleet.clone())
        .layer(http_client())
}

/// Waits (in real time) until `cond` holds, for at most `limit`; returns how long it took.
pub(super) async fn within(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() <= limit {
        if cond() {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

pub(super) fn connected(fleet: &Fleet) -> bool {
    matches!(fleet.redis_state(), Some(RedisState::Connected { .. }))
}

async fn all_connected(fleets: &[Fleet]) {
    let ok = within(Duration::from_secs(2), || fleets.iter().all(connected)).await;
    assert!(
        ok.is_some(),
        "{:?}",
        fleets.iter().map(|f| f.redis_state()).collect::<Vec<_>>()
    );
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn one_429_seen_by_one_fleet_holds_the_first_attempts_of_all_and_releases_them_spread() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new().then(Reply::rate_limited("2")))
        .await
        .unwrap();
    // The third fleet is given a connection manager, which cannot subscribe: it learns of
    // the closing from its poll.
    let manager = redis::aio::ConnectionManager::new(redis::Client::open(redis.url()).unwrap())
        .await
        .unwrap();
    let fleets: Vec<Fleet> = (0..3)
        .map(|i| {
            let store = if i == 2 {
                RedisFleet::from_manager(manager.clone()).scope("127.0.0.1", b"test-key")
            } else {
                store(&redis)
            };
            Fleet::builder()
                .cooldown_gate(Some(gate()))
                .redis(store)
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();

    let first = tokio::spawn(
        stacks[0]
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    );
    within(Duration::from_secs(1), || {
        fleets[0].gate_closed_until().is_some()
    })
    .await
    .expect("the fleet that got the 429 closes its gate");
    let refused_at = server.requests()[0].received_at;
    let by_message = within(Duration::from_millis(500), || {
        fleets[1].gate_closed_until().is_some()
    })
    .await
    .expect("a subscribed fleet learns of the closing from the message");
    let by_poll = within(Duration::from_millis(1_500), || {
        fleets[2].gate_closed_until().is_some()
    })
    .await
    .expect("a fleet that does not subscribe learns of it from the poll");
    assert!(by_message < Duration::from_millis(100), "{by_message:?}");
    assert!(by_poll <= Duration::from_millis(1_100), "{by_poll:?}");
    // Each holds its gate until the deadline Redis keeps, converted on arrival: within a few
    // milliseconds of the local one.
    let deadline = fleets[0].gate_closed_until().unwrap();
    for f in &fleets[1..] {
        let d = f.gate_closed_until().unwrap();
        let skew = if d > deadline {
            d - deadline
        } else {
            deadline - d
        };
        assert!(skew < Duration::from_millis(20), "{skew:?}");
    }

    // First attempts of the other fleets, made while the gate is closed.
    let mut tasks = tokio::task::JoinSet::new();
    for svc in &stacks[1..] {
        for _ in 0..10 {
            let svc = svc.clone();
            let req = anthropic_request(&server.url("/v1/messages"), BODY);
            tasks.spawn(async move { svc.oneshot(req).await.unwrap() });
        }
    }
    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.extensions().get::<RetryTrail>().is_none());
    }
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(server.request_count(), 22);
    let mut after: Vec<Duration> = server.requests()[1..]
        .iter()
        .map(|r| r.received_at - refused_at)
        .collect();
    after.sort();
    // None before the deadline (the 429's Retry-After of 2 s, less the Redis round trip that
    // converted it), then spread over up to 25 % of it.
    assert!(after[0] >= Duration::from_millis(1_990), "{after:?}");
    assert!(
        *after.last().unwrap() <= Duration::from_millis(2_600),
        "{after:?}"
    );
    let span = *after.last().unwrap() - after[0];
    assert!(
        span >= Duration::from_millis(150),
        "released at once: {after:?}"
    );
    // Each counted the three of them.
    for f in &fleets {
        assert_eq!(
            f.redis_state(),
            Some(RedisState::Connected { processes: 3 })
        );
    }
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn the_budget_holds_fleet_wide_in_a_full_outage() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let budget = BudgetConfig::new(Duration::from_secs(10), 1, 0.1).unwrap();
    let fleets: Vec<Fleet> = (0..4)
        .map(|_| {
            Fleet::builder()
                .budget(Some(budget))
                .redis(store(&redis))
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    // 3 retries 20, 40 and 80 ms apart: everything happens within one window.
    let policy = policy()
        .max_retries(3)
        .initial_backoff(Duration::from_millis(20));
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy.clone())).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for round in 0..25 {
        for svc in &stacks {
            let svc = svc.clone();
            let req = anthropic_request(&server.url("/v1/messages"), BODY);
            tasks.spawn(async move { svc.oneshot(req).await.unwrap() });
        }
        if round % 5 == 4 {
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
    }
    let (mut retries, mut denied) = (0, 0);
    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        let trail = res.extensions().get::<RetryTrail>().unwrap();
        retries += trail.retries();
        denied += u32::from(trail.gave_up() == Some(GiveUpReason::Budget));
    }
    // Fleet-wide: 1 retry a second for 10 s, plus one per 10 of the 100 first attempts. Four
    // budgets of their own would have allowed 4 × (10 + 2.5) = 50.
    assert_eq!(budget.max_retries(100), 20);
    assert!(retries <= 20, "{retries} retries");
    assert!(
        retries >= 10,
        "only {retries} retries of the 20 the budget allows"
    );
    assert_eq!(server.request_count(), 100 + retries as usize);
    assert!(denied >= 80, "{denied}");
    let stats: u64 = fleets
        .iter()
        .map(|f| f.budget_stats().unwrap().retries)
        .sum();
    assert_eq!(stats, u64::from(retries));
}

/// Sends a request through each stack every 10 ms for `run`, and returns the slowest.
async fn steady(stacks: &[Retry<HttpClient>], server: &MockServer, run: Duration) -> Duration {
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    while start.elapsed() < run {
        for svc in stacks {
            let t = Instant::now();
            let res = svc
                .clone()
                .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            assert!(res.extensions().get::<RetryTrail>().is_none());
            slowest = slowest.max(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    slowest
}

/// One 429 with Retry-After 1 s through `a`; returns how long `b` took to learn of it.
async fn coordination(a: &Fleet, b: &Fleet) -> Option<Duration> {
    close_through(a, b, "1").await
}

/// One 429 with Retry-After `secs` through `a`; returns how long `b` took to learn of it.
async fn close_through(a: &Fleet, b: &Fleet, secs: &str) -> Option<Duration> {
    let server = MockServer::start(Script::new().then(Reply::rate_limited(secs)))
        .await
        .unwrap();
    let svc = stack(a, policy().max_retries(0));
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    within(Duration::from_millis(1_200), || {
        b.gate_closed_until().is_some()
    })
    .await
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn redis_killed_mid_run_loses_fails_and_delays_nothing_and_coordination_comes_back() {
    let mut redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    // The bounds come from the store's settings, not from how fast this machine is: a
    // request that waited on the dead Redis would wait a whole call timeout (a second, far
    // above what a loaded machine adds to a local request); the reconnection is tried at
    // least once a second (the backoff's cap) and the gate polled every 200 ms.
    let call = Duration::from_secs(1);
    let poll = Duration::from_millis(200);
    let reconnect = Duration::from_secs(1);
    let patience = Duration::from_secs(10);
    let fleets: Vec<Fleet> = (0..2)
        .map(|_| {
            Fleet::builder()
                .cooldown_gate(Some(gate()))
                .redis(
                    store(&redis)
                        .call_timeout(call)
                        .unwrap()
                        .poll_interval(poll)
                        .unwrap(),
                )
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();
    // Once each has counted both (its poll after the other's first).
    let counted = within(patience, || {
        fleets
            .iter()
            .all(|f| f.redis_state() == Some(RedisState::Connected { processes: 2 }))
    });
    assert!(counted.await.is_some());
    let slowest = steady(&stacks, &server, poll).await;
    assert!(slowest < call, "{slowest:?}");

    redis.kill();
    let before = server.request_count();
    // Requests go on while the fleets notice: none waits for Redis, none fails.
    let slowest = steady(&stacks, &server, 3 * poll).await;
    assert!(slowest < call, "{slowest:?}");
    assert!(server.request_count() > before);
    let local = within(patience, || {
        fleets
            .iter()
            .all(|f| matches!(f.redis_state(), Some(RedisState::Local { processes: 2 })))
    });
    assert!(
        local.await.is_some(),
        "{:?}",
        fleets.iter().map(|f| f.redis_state()).collect::<Vec<_>>()
    );
    // Out of touch, each fleet still has its own gate: a closing stays in the one that saw
    // it. Closed for 5 s: long enough to be still in force when Redis is back (a restart and
    // one reconnection take well under that, however loaded the machine), short enough to
    // wait out.
    assert!(close_through(&fleets[0], &fleets[0], "5").await.is_some());
    let closed_until = fleets[0].gate_closed_until().unwrap();
    assert_eq!(fleets[1].gate_closed_until(), None);

    redis.restart();
    let back = within(reconnect + patience, || fleets.iter().all(connected)).await;
    assert!(back.is_some(), "{:?}", fleets[0].redis_state());
    // The closing made while out of touch is merged back into the new Redis, and reaches the
    // other fleet from there.
    let key = store(&redis).key_names()[0].clone();
    let stored = within(patience, || {
        redis.command(&["EXISTS", &key]) == redis::Value::Int(1)
    });
    assert!(
        stored.await.is_some(),
        "the closing was not merged back into Redis"
    );
    let merged = within(poll + patience, || fleets[1].gate_closed_until().is_some());
    assert!(merged.await.is_some());
    assert!(
        Instant::now() < closed_until,
        "the closing lapsed before it was merged back: the check above proves nothing"
    );
    let open = within(closed_until - Instant::now() + patience, || {
        fleets.iter().all(|f| f.gate_closed_until().is_none())
    });
    assert!(open.await.is_some());
    let slowest = steady(&stacks, &server, poll).await;
    assert!(slowest < call, "{slowest:?}");
    // And the gate is shared again.
    let learnt = coordination(&fleets[0], &fleets[1]).await;
    assert!(
        learnt.is_some(),
        "the other fleet never learnt of the closing"
    );
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn redis_frozen_delays_no_request_and_the_fleet_falls_back_then_returns() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    let fleets: Vec<Fleet> = (0..2)
        .map(|_| {
            Fleet::builder()
                .cooldown_gate(Some(gate()))
                .redis(store(&redis))
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();
    // Redis answers nobody for 2 s.
    redis.command(&["CLIENT", "PAUSE", "2000", "ALL"]);
    let slowest = steady(&stacks, &server, Duration::from_millis(800)).await;
    // No request waits for the frozen Redis: a request that did would take up to the rest of
    // the 2 s. The bound leaves room for what a loaded machine adds to a local round trip
    // (50 ms was missed under load), and is still far below the freeze.
    assert!(slowest < Duration::from_millis(500), "{slowest:?}");
    for f in &fleets {
        assert!(
            matches!(f.redis_state(), Some(RedisState::Local { .. })),
            "{:?}",
            f.redis_state()
        );
    }
    let back = within(Duration::from_secs(5), || fleets.iter().all(connected)).await;
    assert!(back.is_some(), "{:?}", fleets[0].redis_state());
    assert!(coordination(&fleets[0], &fleets[1]).await.is_some());
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn flushed_scripts_and_keys_heal_by_themselves() {
    let redis = RedisServer::start();
    let fleets: Vec<Fleet> = (0..2)
        .map(|_| {
            Fleet::builder()
                .cooldown_gate(Some(gate()))
                .redis(store(&redis))
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    assert!(coordination(&fleets[0], &fleets[1]).await.is_some());
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(fleets[1].gate_closed_until(), None);
    redis.command(&["SCRIPT", "FLUSH"]);
    redis.command(&["FLUSHALL"]);
    assert!(
        coordination(&fleets[1], &fleets[0]).await.is_some(),
        "no coordination after the scripts and keys were flushed"
    );
    assert!(fleets.iter().all(connected));
    // And a retry is still paid for by the fleet-wide budget.
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let res = stack(
        &fleets[0],
        policy().initial_backoff(Duration::from_millis(10)),
    )
    .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
    .await
    .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "{:?}",
        res.extensions().get::<RetryTrail>()
    );
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn the_background_task_ends_when_the_fleet_is_dropped() {
    let redis = RedisServer::start();
    let fleet = Fleet::builder()
        .cooldown_gate(Some(gate()))
        .redis(store(&redis))
        .build();
    all_connected(std::slice::from_ref(&fleet)).await;
    let clients = || -> usize {
        match redis.command(&["CLIENT", "LIST"]) {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).lines().count(),
            redis::Value::VerbatimString { text, .. } => text.lines().count(),
            other => panic!("{other:?}"),
        }
    };
    // Its script connection and its subscription, and the one asking.
    assert_eq!(clients(), 3);
    drop(fleet);
    let gone = within(Duration::from_secs(1), || clients() == 1).await;
    assert!(gone.is_some(), "{} clients left", clients());
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn the_shared_pace_keeps_the_sum_of_the_fleets_under_the_stated_limit() {
    let redis = RedisServer::start();
    // 1,200 a minute: 20 a second for the fleet, however many processes it has.
    let server = MockServer::start(Script::always(
        Reply::success().header("anthropic-ratelimit-requests-limit", "1200"),
    ))
    .await
    .unwrap();
    let fleets: Vec<Fleet> = (0..3)
        .map(|_| {
            Fleet::builder()
                .pacing(Some(
                    tower_llm_retry::fleet::PacingConfig::new()
                        .dormant(false)
                        .burst(Duration::ZERO)
                        .unwrap(),
                ))
                .redis(patient(store(&redis)))
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();
    // One answer states the limit; then 3 × 12 requests at once.
    let res = stacks[0]
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The cap reaches the fleet's schedule, and every fleet reads it there (by its poll).
    let cap = within(Duration::from_millis(1_500), || {
        fleets.iter().all(|f| f.pace() == Some(20.0))
    });
    assert!(
        cap.await.is_some(),
        "{:?}",
        fleets.iter().map(|f| f.pace()).collect::<Vec<_>>()
    );
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for svc in &stacks {
        for _ in 0..12 {
            let svc = svc.clone();
            let req = anthropic_request(&server.url("/v1/messages"), BODY);
            tasks.spawn(async move { svc.oneshot(req).await.unwrap().status() });
        }
    }
    while let Some(status) = tasks.join_next().await {
        assert_eq!(status.unwrap(), StatusCode::OK);
    }
    let mut at: Vec<Duration> = server.requests()[1..]
        .iter()
        .map(|r| r.received_at - start)
        .collect();
    at.sort();
    assert_eq!(at.len(), 36);
    // 50 ms apart, whichever fleet sent them: 36 take 1.75 s (three fleets pacing on their
    // own would have sent them in 0.55 s, 60 a second); no second holds more than the
    // limit, give or take what a stalled scheduler bunches.
    let span = *at.last().unwrap() - at[0];
    assert!(span >= Duration::from_millis(1_650), "{span:?}");
    assert_within_limit(&at);
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_refusal_seen_by_every_fleet_in_one_round_slows_the_fleet_once() {
    let redis = RedisServer::start();
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("0"))
            .then(Reply::rate_limited("0"))
            .then(Reply::rate_limited("0")),
    )
    .await
    .unwrap();
    let pacing = tower_llm_retry::fleet::PacingConfig::new()
        .dormant(false)
        .burst(Duration::ZERO)
        .unwrap()
        .rates(10.0, 1.0, 10.0)
        .unwrap()
        .decrease(0.5)
        .unwrap();
    let fleets: Vec<Fleet> = (0..3)
        .map(|_| {
            Fleet::builder()
                .pacing(Some(pacing))
                .redis(store(&redis))
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    let mut tasks = tokio::task::JoinSet::new();
    for f in &fleets {
        let svc = stack(f, policy());
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap() });
    }
    let mut retries = 0;
    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        retries += res
            .extensions()
            .get::<RetryTrail>()
            .map_or(0, |t| t.retries());
    }
    assert_eq!(retries, 3);
    assert_eq!(server.request_count(), 6);
    // Three refusals of attempts sent in one round: one decrease, 10 → 5 a second (one per
    // process would have left 1.25), plus what the successes added since.
    let learnt = within(Duration::from_millis(1_500), || {
        fleets.iter().all(|f| f.pace().is_some_and(|p| p < 6.0))
    });
    assert!(
        learnt.await.is_some(),
        "{:?}",
        fleets.iter().map(|f| f.pace()).collect::<Vec<_>>()
    );
    for f in &fleets {
        let pace = f.pace().unwrap();
        assert!((5.0..5.5).contains(&pace), "{pace}");
    }
}

/// Run by the multi-process test, in a child process of its own: sends `FLEET_CHILD_N`
/// requests at once to the mock at `FLEET_CHILD_MOCK`, its fleet sharing the Redis at
/// `FLEET_CHILD_REDIS`, and checks that each succeeded.
#[tokio::test]
#[ignore = "a child process of the multi-process test"]
async fn pacing_child() {
    let redis = std::env::var("FLEET_CHILD_REDIS").expect("run by the multi-process test");
    let mock = std::env::var("FLEET_CHILD_MOCK").unwrap();
    let n: usize = std::env::var("FLEET_CHILD_N").unwrap().parse().unwrap();
    let fleet = Fleet::builder()
        .pacing(Some(
            tower_llm_retry::fleet::PacingConfig::new()
                .dormant(false)
                .burst(Duration::ZERO)
                .unwrap(),
        ))
        .redis(patient(
            RedisFleet::from_url(&redis)
                .unwrap()
                .scope("127.0.0.1", b"test-key"),
        ))
        .build();
    all_connected(std::slice::from_ref(&fleet)).await;
    let svc = stack(&fleet, policy());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let svc = svc.clone();
        let req = anthropic_request(&mock, BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap().status() });
    }
    while let Some(status) = tasks.join_next().await {
        assert_eq!(status.unwrap(), StatusCode::OK);
    }
}

/// One request through a stack on `fleet` to a server that answers it.
async fn one_success(fleet: &Fleet) {
    let server = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let res = stack(fleet, policy())
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// A server that states 1,200 requests a minute on every answer, and a paced fleet on
/// `redis`, in touch.
async fn paced_under_a_stated_limit(redis: &RedisServer) -> (MockServer, Fleet) {
    let server = MockServer::start(Script::always(
        Reply::success().header("anthropic-ratelimit-requests-limit", "1200"),
    ))
    .await
    .unwrap();
    let fleet = Fleet::builder()
        .pacing(Some(
            tower_llm_retry::fleet::PacingConfig::new()
                .dormant(false)
                .burst(Duration::ZERO)
                .unwrap(),
        ))
        .redis(patient(store(redis)))
        .build();
    all_connected(std::slice::from_ref(&fleet)).await;
    (server, fleet)
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn separate_processes_sharing_one_redis_keep_together_under_the_stated_limit() {
    let redis = RedisServer::start();
    // This process states the limit to the fleet's schedule first.
    let (server, fleet) = paced_under_a_stated_limit(&redis).await;
    stack(&fleet, policy())
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert!(
        within(Duration::from_millis(500), || fleet.pace() == Some(20.0))
            .await
            .is_some()
    );
    let start = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|_| {
            tokio::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "fleet_redis::pacing_child",
                    "--exact",
                    "--include-ignored",
                    "--test-threads=1",
                ])
                .env("FLEET_CHILD_REDIS", redis.url())
                .env("FLEET_CHILD_MOCK", server.url("/v1/messages"))
                .env("FLEET_CHILD_N", "12")
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true)
                .status()
        })
        .collect();
    for status in futures_util::future::join_all(children).await {
        assert!(status.unwrap().success());
    }
    let mut at: Vec<Duration> = server.requests()[1..]
        .iter()
        .map(|r| r.received_at - start)
        .collect();
    at.sort();
    assert_eq!(at.len(), 36);
    // The mock's count of requests in any second stays within the limit across the three
    // processes (pacing on their own they would send 60 a second; sharing it, 36 take 1.75 s).
    let span = *at.last().unwrap() - at[0];
    assert!(span >= Duration::from_millis(1_650), "{span:?}");
    assert_within_limit(&at);
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn fleets_kept_per_scope_share_each_scope_across_processes_and_only_it() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new().then(Reply::rate_limited("2")))
        .await
        .unwrap();
    let url = server.url("/v1/messages");
    let keyed = |key: &'static str| {
        let mut req = anthropic_request(&url, BODY);
        req.headers_mut()
            .insert("x-api-key", http::HeaderValue::from_static(key));
        req
    };
    // No scope set on the store: each scope of the requests names its own in Redis.
    let fleets: Vec<Fleet> = (0..2)
        .map(|_| {
            Fleet::builder()
                .cooldown_gate(Some(gate()))
                .per_scope(true)
                .redis(RedisFleet::from_url(&redis.url()).unwrap())
                .build()
        })
        .collect();
    let a: Vec<Fleet> = fleets
        .iter()
        .map(|f| f.scope_for(&keyed("key-a")))
        .collect();
    let b = fleets[1].scope_for(&keyed("key-b"));
    assert_eq!(a[0].scope_id(), a[1].scope_id());
    assert_ne!(a[1].scope_id(), b.scope_id());
    all_connected(&[a[0].clone(), a[1].clone(), b.clone()]).await;
    let res = stack(&fleets[0], policy().max_retries(0))
        .oneshot(keyed("key-a"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let learnt = within(Duration::from_millis(500), || {
        a[1].gate_closed_until().is_some()
    });
    assert!(learnt.await.is_some());
    assert_eq!(b.gate_closed_until(), None);
    // The scopes of a fleet share one connection for their scripts and one for pub/sub:
    // 2 + 2, and the one asking.
    let clients = match redis.command(&["CLIENT", "LIST"]) {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).lines().count(),
        redis::Value::VerbatimString { text, .. } => text.lines().count(),
        other => panic!("{other:?}"),
    };
    assert_eq!(clients, 5);
    // Only hashes reach Redis.
    let keys = match redis.command(&["KEYS", "*"]) {
        redis::Value::Array(keys) => keys,
        other => panic!("{other:?}"),
    };
    for k in keys {
        let redis::Value::BulkString(k) = k else {
            panic!("{k:?}")
        };
        let k = String::from_utf8(k).unwrap();
        assert!(!k.contains("key-a") && !k.contains("127.0.0.1"), "{k}");
    }
}

/// No second of `at` (sorted arrival times) holds more than the stated 20 requests plus 4:
/// the schedule's slots are 50 ms apart, but on a loaded machine a process the scheduler
/// stalls sends the requests whose slots passed meanwhile together when it runs again.
fn assert_within_limit(at: &[Duration]) {
    for (i, t) in at.iter().enumerate() {
        let in_window = at[i..]
            .iter()
            .take_while(|u| **u < *t + Duration::from_secs(1))
            .count();
        assert!(in_window <= 24, "{in_window} within 1 s from {t:?}: {at:?}");
    }
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_pacing_turn_waits_no_longer_than_one_redis_deadline_when_redis_freezes() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    // A rate no request reaches: a turn is its admission alone.
    let pacing = tower_llm_retry::fleet::PacingConfig::new()
        .dormant(false)
        .burst(Duration::ZERO)
        .unwrap()
        .rates(1_000.0, 1.0, 1_000.0)
        .unwrap();
    let fleet = Fleet::builder()
        .pacing(Some(pacing))
        .redis(store(&redis))
        .build();
    all_connected(std::slice::from_ref(&fleet)).await;
    let stacks = [stack(&fleet, policy())];
    assert!(steady(&stacks, &server, Duration::from_millis(100)).await < Duration::from_millis(20));
    let before = server.request_count();
    redis.command(&["CLIENT", "PAUSE", "800", "ALL"]);
    // Each reservation Redis does not answer within its 50 ms falls back to the local line,
    // until the fleet stops asking Redis.
    let slowest = steady(&stacks, &server, Duration::from_millis(600)).await;
    assert!(slowest < Duration::from_millis(90), "{slowest:?}");
    let sent = server.request_count() - before;
    assert!(
        sent > 10,
        "{sent} sent, slowest {slowest:?}, {:?}",
        fleet.redis_state()
    );
    assert!(matches!(
        fleet.redis_state(),
        Some(RedisState::Local { .. })
    ));
    let back = within(Duration::from_secs(3), || connected(&fleet)).await;
    assert!(back.is_some(), "{:?}", fleet.redis_state());
}

/// A fleet with the shared pacing alone (no gate, no budget: the only scripts are the
/// reservations and the poll), at a fixed `rate`.
fn paced_only(redis: &RedisServer, rate: f64) -> Fleet {
    let pacing = tower_llm_retry::fleet::PacingConfig::new()
        .dormant(false)
        .burst(Duration::ZERO)
        .unwrap()
        .rates(rate, 1.0, rate)
        .unwrap();
    Fleet::builder()
        .budget(None)
        .pacing(Some(pacing))
        .redis(patient(store(redis)))
        .build()
}

/// Sends `n` requests at once through each of `stacks`, each marked with its stack's
/// index; all must succeed.
async fn at_once(stacks: &[Retry<HttpClient>], server: &MockServer, n: usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for (i, svc) in stacks.iter().enumerate() {
        for _ in 0..n {
            let svc = svc.clone();
            let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
            req.headers_mut().insert("x-fleet", i.into());
            tasks.spawn(async move { svc.oneshot(req).await.unwrap().status() });
        }
    }
    while let Some(status) = tasks.join_next().await {
        assert_eq!(status.unwrap(), StatusCode::OK);
    }
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn attempts_waiting_together_reserve_their_slots_in_one_script() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    // A rate no request reaches: every slot is due at once, and what is counted is how the
    // attempts ask for them.
    let fleet = paced_only(&redis, 100_000.0);
    all_connected(std::slice::from_ref(&fleet)).await;
    let stacks = [stack(&fleet, policy())];
    at_once(&stacks, &server, 8).await;
    let before = redis.round_trips();
    for _ in 0..4 {
        at_once(&stacks, &server, 64).await;
    }
    let trips = redis.round_trips() - before;
    assert_eq!(server.request_count(), 8 + 256);
    // One script per attempt would be 256; while one is in flight the others queue, and the
    // next reserves for all of them.
    assert!(trips <= 64, "{trips} round trips for 256 attempts");
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn coalesced_slots_keep_the_shared_spacing_and_every_process_its_turn() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    // 20 a second for the fleet: 50 ms apart, whichever of the two sends.
    let fleets = [paced_only(&redis, 20.0), paced_only(&redis, 20.0)];
    all_connected(&fleets).await;
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();
    let before = redis.round_trips();
    let start = Instant::now();
    at_once(&stacks, &server, 12).await;
    let trips = redis.round_trips() - before;
    let mut sent: Vec<(Duration, String)> = server
        .requests()
        .iter()
        .map(|r| {
            let fleet = r.headers["x-fleet"].to_str().unwrap().to_owned();
            (r.received_at - start, fleet)
        })
        .collect();
    sent.sort();
    assert_eq!(sent.len(), 24);
    let at: Vec<Duration> = sent.iter().map(|(t, _)| *t).collect();
    // 24 slots 50 ms apart take 1.15 s, as one schedule; two fleets booking on their own
    // would have sent them in 0.55 s.
    let span = *at.last().unwrap() - at[0];
    assert!(span >= Duration::from_millis(1_050), "{span:?}");
    assert_within_limit(&at);
    // Each fleet books its share of what lies ahead, not the whole of it: in the first
    // half, both sent.
    let first_half: Vec<&str> = sent[..12].iter().map(|(_, f)| f.as_str()).collect();
    for fleet in ["0", "1"] {
        let n = first_half.iter().filter(|f| **f == fleet).count();
        assert!(
            n >= 3,
            "fleet {fleet} sent {n} of the first 12: {first_half:?}"
        );
    }
    // Far fewer scripts than attempts: a slot a script, 24 and more.
    assert!(trips < 20, "{trips} round trips for 24 attempts");
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn attempts_queued_for_a_slot_go_to_the_local_line_when_redis_freezes() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    let fleet = Fleet::builder()
        .budget(None)
        .pacing(Some(
            tower_llm_retry::fleet::PacingConfig::new()
                .dormant(false)
                .burst(Duration::ZERO)
                .unwrap()
                .rates(20.0, 1.0, 20.0)
                .unwrap(),
        ))
        .redis(store(&redis))
        .build();
    all_connected(std::slice::from_ref(&fleet)).await;
    let stacks = [stack(&fleet, policy())];
    let start = Instant::now();
    let run = at_once(&stacks, &server, 30);
    // 30 slots at 20 a second: 1.5 s. Redis stops answering while most of them wait in the
    // process's line for the next reservation.
    let freeze = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        redis.command(&["CLIENT", "PAUSE", "3000", "ALL"]);
    };
    tokio::join!(run, freeze);
    let took = start.elapsed();
    assert_eq!(server.request_count(), 30);
    // Every one was sent: those Redis booked in its slot, the rest from the local line at
    // this process's share of the rate (the whole of it: one process), without waiting for
    // Redis to come back.
    assert!(took < Duration::from_millis(2_600), "{took:?}");
    let at: Vec<Duration> = server
        .requests()
        .iter()
        .map(|r| r.received_at - start)
        .collect();
    assert_within_limit(&at);
    assert!(
        !connected(&fleet),
        "{:?} after a 3 s pause",
        fleet.redis_state()
    );
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn every_script_runs_on_a_single_node_cluster_without_crossslot_and_coordinates() {
    // A cluster node that owns every hash slot answers every command itself, so the plain
    // connection manager talks to it; what a cluster adds is that a script's keys must share
    // one slot, which the scope's hash tag gives them.
    let redis = RedisServer::start_cluster();
    let url = redis.tcp_url().unwrap();
    let server = MockServer::start(
        Script::new()
            .then(Reply::success().header("anthropic-ratelimit-requests-limit", "1200"))
            .then(Reply::status(529))
            .then(Reply::success())
            .then(Reply::rate_limited("1")),
    )
    .await
    .unwrap();
    let fleets: Vec<Fleet> = (0..2)
        .map(|_| {
            let store = RedisFleet::from_url(&url)
                .unwrap()
                .scope("127.0.0.1", b"test-key");
            Fleet::builder()
                .cooldown_gate(Some(gate()))
                .pacing(Some(
                    tower_llm_retry::fleet::PacingConfig::new()
                        .dormant(false)
                        .burst(Duration::ZERO)
                        .unwrap(),
                ))
                .redis(patient(store))
                .build()
        })
        .collect();
    // Connected: each has run the poll.
    all_connected(&fleets).await;
    let policy = policy().initial_backoff(Duration::from_millis(20));
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy.clone())).collect();
    let send = |i: usize| {
        stacks[i]
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
    };
    // A stated limit (the limit script) on a reserved slot (the reservation).
    assert_eq!(send(0).await.unwrap().status(), StatusCode::OK);
    // An overload refused (the refusal script), retried on a grant (the budget's flush).
    let res = send(0).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.extensions().get::<RetryTrail>().unwrap().retries(), 1);
    // A 429 with Retry-After through the second fleet closes the gate of the first (the
    // closing script, and its message).
    let limited = tokio::spawn(send(1));
    within(Duration::from_millis(800), || {
        fleets[0].gate_closed_until().is_some()
    })
    .await
    .expect("the closing reaches the other fleet");
    assert_eq!(limited.await.unwrap().unwrap().status(), StatusCode::OK);
    // The stated limit is the fleet's: both read it from the shared schedule.
    let capped = within(Duration::from_millis(1_500), || {
        fleets.iter().all(|f| f.pace().is_some_and(|p| p <= 20.0))
    });
    assert!(
        capped.await.is_some(),
        "{:?}",
        fleets.iter().map(|f| f.pace()).collect::<Vec<_>>()
    );
    assert!(
        fleets.iter().all(connected),
        "{:?}",
        fleets[0].redis_state()
    );
    // No script failed but at its first call (answered NOSCRIPT, then loaded): none was
    // refused for keys in other slots. (Redis 7.0 also counts an error for each connection's
    // `CLIENT SETINFO`, which it does not know.)
    let errors = redis.errors();
    let count = |kind: &str| {
        errors
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0, |(_, n)| *n)
    };
    assert_eq!(count("CROSSSLOT"), 0, "{errors:?}");
    let stats = match redis.command(&["INFO", "commandstats"]) {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        redis::Value::VerbatimString { text, .. } => text,
        other => panic!("{other:?}"),
    };
    let field = |cmd: &str, name: &str| -> u64 {
        stats
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
            .and_then(|l| l.split(&format!("{name}=")).nth(1))
            .and_then(|v| v.split(',').next())
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    assert!(field("evalsha", "calls") >= 10, "{stats}");
    let failed = field("evalsha", "failed_calls") + field("evalsha", "rejected_calls");
    assert_eq!(failed, count("NOSCRIPT"), "{errors:?} {stats}");
    assert_eq!(
        field("eval", "failed_calls") + field("eval", "rejected_calls"),
        0
    );
    let keys: Vec<String> = match redis.command(&["KEYS", "*"]) {
        redis::Value::Array(keys) => keys
            .into_iter()
            .map(|k| match k {
                redis::Value::BulkString(b) => String::from_utf8(b).unwrap(),
                other => panic!("{other:?}"),
            })
            .collect(),
        other => panic!("{other:?}"),
    };
    // The gate, the budget, the processes and the schedule; and each process's last budget
    // flush, which expires with the budget's window.
    let (flushes, shared): (Vec<_>, Vec<_>) = keys.iter().partition(|k| k.contains(":flush:"));
    assert_eq!(shared.len(), 4, "{keys:?}");
    assert!(!flushes.is_empty(), "{keys:?}");
    for key in flushes {
        match redis.command(&["PTTL", key]) {
            redis::Value::Int(ms) => assert!(ms > 0, "{key} has no expiry"),
            other => panic!("{other:?}"),
        }
    }
}

/// A fleet started on one runtime that has since shut down (a fleet in a `static`, built in a
/// set-up `block_on`): its background tasks are gone with it, so it keeps to its local state,
/// and a paced attempt takes the local line instead of waiting for a slot nobody reserves.
#[test]
#[ignore = "needs redis-server; run as the README's Tests say"]
fn a_fleet_whose_runtime_shut_down_paces_locally_and_hangs_nothing() {
    let redis = RedisServer::start();
    let fleet = Fleet::builder()
        .pacing(Some(
            tower_llm_retry::fleet::PacingConfig::new()
                .dormant(false)
                .burst(Duration::ZERO)
                .unwrap(),
        ))
        .redis(patient(store(&redis)))
        .build();
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    first.block_on(async {
        one_success(&fleet).await;
        all_connected(std::slice::from_ref(&fleet)).await;
    });
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let server = MockServer::start(Script::always(Reply::success()))
            .await
            .unwrap();
        let svc = stack(&fleet, policy());
        for _ in 0..3 {
            let res = tokio::time::timeout(
                Duration::from_secs(5),
                svc.clone()
                    .oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
            )
            .await
            .expect("a paced attempt waited for a slot nobody reserves")
            .unwrap();
            assert_eq!(res.status(), StatusCode::OK);
        }
        assert_eq!(server.request_count(), 3);
        assert!(
            matches!(fleet.redis_state(), Some(RedisState::Local { .. })),
            "{:?}",
            fleet.redis_state()
        );
    });
}

/// A budget flush that misses its 50 ms deadline may still run in Redis: sent again under its
/// number, it is counted once.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_flush_that_times_out_but_runs_is_counted_once() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    let store = store(&redis);
    let budget_key = store.key_names()[1].clone();
    let fleet = Fleet::builder().redis(store).build();
    all_connected(std::slice::from_ref(&fleet)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let svc = stack(&fleet, policy());
    // Redis stalls (a slow command, a fork, a failover) for 120 ms...
    redis.command(&["CLIENT", "PAUSE", "120", "ALL"]);
    // ...while 10 first attempts are made (they never touch Redis).
    let calls = (0..10).map(|_| {
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
    });
    for res in futures_util::future::join_all(calls).await {
        assert_eq!(res.unwrap().status(), StatusCode::OK);
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let deposits: i64 = match redis.command(&["HGETALL", &budget_key]) {
        redis::Value::Array(v) => v
            .chunks(2)
            .filter_map(|c| match (&c[0], &c[1]) {
                (redis::Value::BulkString(f), redis::Value::BulkString(n)) if f[0] == b'd' => {
                    std::str::from_utf8(n).ok()?.parse::<i64>().ok()
                }
                _ => None,
            })
            .sum(),
        redis::Value::Map(v) => v
            .iter()
            .filter_map(|(f, n)| match (f, n) {
                (redis::Value::BulkString(f), redis::Value::BulkString(n)) if f[0] == b'd' => {
                    std::str::from_utf8(n).ok()?.parse::<i64>().ok()
                }
                _ => None,
            })
            .sum(),
        other => panic!("{other:?}"),
    };
    assert_eq!(fleet.budget_stats().unwrap().first_attempts, 10);
    assert_eq!(
        deposits, 10,
        "the fleet's window counts {deposits} first attempts"
    );
}

/// A refusal whose script misses its deadline is sent again: the fleet's shared rate still
/// decreases for it.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_refusal_reported_during_a_redis_stall_still_slows_the_fleet() {
    let redis = RedisServer::start();
    let server = MockServer::start(
        Script::new().then(Reply::rate_limited("0").delay(Duration::from_millis(150))),
    )
    .await
    .unwrap();
    let pacing = tower_llm_retry::fleet::PacingConfig::new()
        .dormant(false)
        .burst(Duration::ZERO)
        .unwrap()
        .rates(10.0, 1.0, 10.0)
        .unwrap()
        .decrease(0.5)
        .unwrap();
    let fleet = Fleet::builder()
        .budget(None)
        .pacing(Some(pacing))
        .redis(store(&redis))
        .build();
    all_connected(std::slice::from_ref(&fleet)).await;
    let svc = stack(&fleet, policy().max_retries(0));
    let req = anthropic_request(&server.url("/v1/messages"), BODY);
    let call = tokio::spawn(async move { svc.oneshot(req).await.unwrap() });
    // The slot is reserved at once; Redis stalls while the 429 is on its way.
    tokio::time::sleep(Duration::from_millis(60)).await;
    redis.command(&["CLIENT", "PAUSE", "200", "ALL"]);
    assert_eq!(call.await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
    let slowed = within(Duration::from_millis(2_500), || {
        fleet.pace().is_some_and(|p| p < 6.0)
    })
    .await;
    assert!(
        slowed.is_some(),
        "pace {:?}, {:?}",
        fleet.pace(),
        fleet.redis_state()
    );
}

/// A fleet with no budget, built outside a runtime, starts its link on the first request's
/// runtime, and learns the other processes' closings.
#[test]
#[ignore = "needs redis-server; run as the README's Tests say"]
fn a_gate_only_fleet_built_outside_a_runtime_starts_on_its_first_request() {
    let redis = RedisServer::start();
    let fleet = Fleet::builder()
        .budget(None)
        .cooldown_gate(Some(gate()))
        .redis(store(&redis))
        .build();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        one_success(&fleet).await;
        // Another process closes the gate.
        let other = Fleet::builder()
            .budget(None)
            .cooldown_gate(Some(gate()))
            .redis(store(&redis))
            .build();
        all_connected(std::slice::from_ref(&other)).await;
        let learnt = close_through(&other, &fleet, "5").await;
        assert!(learnt.is_some(), "never learnt: {:?}", fleet.redis_state());
    });
}

/// A stated limit caps the shared schedule again after its key was lost (Redis restarted,
/// flushed, or the key expired after an idle hour), though the limit itself did not change.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn the_stated_limit_caps_the_shared_schedule_again_after_its_key_was_lost() {
    let redis = RedisServer::start();
    let (server, fleet) = paced_under_a_stated_limit(&redis).await;
    let svc = stack(&fleet, policy());
    let one = || {
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
    };
    assert_eq!(one().await.unwrap().status(), StatusCode::OK);
    let cap = within(Duration::from_millis(1_500), || fleet.pace() == Some(20.0));
    assert!(cap.await.is_some(), "{:?}", fleet.pace());
    // The keys are lost; every answer still states 1,200 a minute.
    redis.command(&["FLUSHALL"]);
    assert_eq!(one().await.unwrap().status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let before = server.request_count();
    let start = Instant::now();
    let calls = (0..24).map(|_| one());
    for res in futures_util::future::join_all(calls).await {
        assert_eq!(res.unwrap().status(), StatusCode::OK);
    }
    let mut at: Vec<Duration> = server.requests()[before..]
        .iter()
        .map(|r| r.received_at - start)
        .collect();
    at.sort();
    let span = *at.last().unwrap() - at[0];
    // 24 at 20 a second take 1.15 s.
    assert!(
        span >= Duration::from_millis(1_050),
        "24 requests in {span:?}; the fleet's pace is {:?}",
        fleet.pace()
    );
}

/// A process new to a scope reads its gate in Redis before its first request goes out:
/// another process's 429 (Retry-After 10 s) holds it. With Redis gone, its first request goes
/// out once the call deadline has passed.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_fleet_new_to_a_scope_holds_its_first_request_at_the_gate_closed_in_redis() {
    let mut redis = RedisServer::start();
    let a = Fleet::builder()
        .cooldown_gate(Some(gate()))
        .redis(store(&redis))
        .build();
    all_connected(std::slice::from_ref(&a)).await;
    let server = MockServer::start(Script::new().then(Reply::rate_limited("10")))
        .await
        .unwrap();
    let res = stack(&a, policy().max_retries(0))
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let gate_key = store(&redis).key_names()[0].clone();
    within(Duration::from_secs(1), || {
        redis.command(&["EXISTS", &gate_key]) == redis::Value::Int(1)
    })
    .await
    .expect("the closing reaches Redis");

    // Another process, which has never seen the scope: its first request waits. (Its calls
    // may take 250 ms: a loaded machine misses 50 ms, and the request would go out.)
    let b = Fleet::builder()
        .cooldown_gate(Some(gate()))
        .redis(patient(store(&redis)))
        .build();
    let sent = Instant::now();
    let held = tokio::spawn(
        stack(&b, policy()).oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        server.requests().len(),
        1,
        "the first request of b went out"
    );
    let until = b.gate_closed_until().expect("b holds the gate");
    assert!(
        until >= sent + Duration::from_secs(9),
        "closed for {:?}",
        until - sent
    );
    held.abort();

    // Redis gone: a third process's first request waits one call deadline (50 ms) at most.
    redis.kill();
    let c = Fleet::builder()
        .cooldown_gate(Some(gate()))
        .redis(store(&redis))
        .build();
    let server = MockServer::start(Script::new()).await.unwrap();
    let sent = Instant::now();
    let res = stack(&c, policy())
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let waited = server.requests()[0].received_at - sent;
    assert!(waited < Duration::from_millis(300), "waited {waited:?}");
}

/// The pub/sub clients connected to `redis`.
fn subscribers(redis: &RedisServer) -> usize {
    let list = match redis.command(&["CLIENT", "LIST"]) {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        redis::Value::VerbatimString { text, .. } => text,
        other => panic!("{other:?}"),
    };
    list.lines()
        .filter(|l| {
            l.split(' ')
                .any(|f| f.starts_with("flags=") && f.contains('P'))
        })
        .count()
}

/// Every scope of the fleets built from one store shares one subscription, and a closing
/// reaches them through it long before their poll (a minute here) would.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn one_subscription_per_store_brings_a_closing_to_every_scope_well_before_the_poll() {
    let redis = RedisServer::start();
    let a = Fleet::builder()
        .cooldown_gate(Some(gate()))
        .redis(store(&redis))
        .build();
    // Another process: one store, two scopes (as the tenants of a per-scope fleet), each
    // polled once a minute.
    let b_store = store(&redis)
        .poll_interval(Duration::from_secs(60))
        .unwrap();
    let b: Vec<Fleet> = [&b"test-key"[..], b"other-key"]
        .into_iter()
        .map(|key| {
            Fleet::builder()
                .cooldown_gate(Some(gate()))
                .redis(b_store.clone().scope("127.0.0.1", key))
                .build()
        })
        .collect();
    all_connected(&[a.clone(), b[0].clone(), b[1].clone()]).await;
    // One subscription for a, one for both scopes of b.
    let subscribed = within(Duration::from_secs(2), || subscribers(&redis) == 2).await;
    assert!(subscribed.is_some(), "{} subscribers", subscribers(&redis));
    // Past the first polls: only a message can tell b now.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(b[0].gate_closed_until().is_none());

    let server = MockServer::start(Script::new().then(Reply::rate_limited("10")))
        .await
        .unwrap();
    let res = stack(&a, policy().max_retries(0))
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let seen = within(Duration::from_millis(1_000), || {
        b[0].gate_closed_until().is_some()
    })
    .await
    .expect("the closing reaches the other process before its poll");
    assert!(seen < Duration::from_millis(100), "took {seen:?}");
    // The other scope is left alone.
    assert!(b[1].gate_closed_until().is_none());
    // The last fleet of a store gone, its subscription goes.
    drop(b);
    let gone = within(Duration::from_secs(1), || subscribers(&redis) == 1).await;
    assert!(gone.is_some(), "{} subscribers", subscribers(&redis));
}

/// Two fleets on `redis`, no budget, their dormant pacing warming a new scope up for 3 s;
/// once both are in touch.
async fn warming_fleets(redis: &RedisServer) -> Vec<Fleet> {
    let fleets: Vec<Fleet> = (0..2)
        .map(|_| {
            Fleet::builder()
                .budget(None)
                .pacing(Some(
                    tower_llm_retry::fleet::PacingConfig::new().warm_up(Duration::from_secs(3)),
                ))
                .redis(patient(store(redis)))
                .build()
        })
        .collect();
    all_connected(&fleets).await;
    fleets
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_warm_up_paces_the_first_burst_of_every_process_on_the_fleets_one_schedule() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new()).await.unwrap();
    let fleets = warming_fleets(&redis).await;
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();
    let origin = tokio::time::Instant::now();
    at_once(&stacks, &server, 30).await;
    let mut at: Vec<Duration> = server
        .requests()
        .iter()
        .map(|r| r.received_at - origin)
        .collect();
    at.sort();
    assert_eq!(at.len(), 60);
    // One schedule for both, from 50/s doubling every second: about 23 attempts in the
    // first 400 ms, the 60th after 0.86 s. A schedule per process would send twice as many
    // as soon, the last after 0.48 s.
    let early = at
        .iter()
        .filter(|t| **t < Duration::from_millis(400))
        .count();
    assert!(early <= 30, "{early} attempts in the first 400 ms: {at:?}");
    assert!(at[59] >= Duration::from_millis(700), "{at:?}");
    for f in &fleets {
        assert_eq!(f.pacing_state(), Some(None));
    }
}

// ---------------------------------------------------------------------------------------------
// Pacing by tokens across processes.

/// A fleet that paces only by tokens, from the first stated limit, on `redis`.
/// Waits for every answer in `tasks`, each a success sent once (no retry), and returns the
/// longest a request waited for its tokens.
async fn longest_token_wait<B>(mut tasks: tokio::task::JoinSet<http::Response<B>>) -> Duration
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::fmt::Debug,
{
    let mut longest = Duration::ZERO;
    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let trail = res.extensions().get::<RetryTrail>().cloned();
        assert_eq!(trail.as_ref().map_or(0, |t| t.retries()), 0, "{trail:?}");
        longest = longest.max(trail.and_then(|t| t.token_wait()).unwrap_or_default());
        drop(body_bytes(res).await);
    }
    longest
}

fn token_fleet(redis: &RedisServer) -> Fleet {
    Fleet::builder()
        .pacing(None)
        .cooldown_gate(None)
        .token_pacing(Some(
            tower_llm_retry::fleet::TokenPacingConfig::new().dormant(false),
        ))
        // A slow call under a loaded machine falls back to this process's bucket, which is
        // what this test is not about.
        .redis(store(redis).call_timeout(Duration::from_secs(1)).unwrap())
        .build()
}

/// A Messages body whose content the mock counts as `chars / 4` input tokens.
fn token_body(chars: usize) -> String {
    format!(
        r#"{{"model":"claude-test","max_tokens":16,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "a".repeat(chars)
    )
}

/// A request whose message the mock counts as `chars / 4` input tokens.
fn token_request(
    server: &MockServer,
    chars: usize,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    http::Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(token_body(
            chars,
        ))))
        .unwrap()
}

/// Each fleet alone believes it may send 30,000 of the 59,500 input tokens left at once, and
/// so it may; both together may not. Sharing one bucket in Redis, the last request waits for
/// its tokens, and the server refuses none.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn two_fleets_on_one_redis_take_their_tokens_from_one_bucket() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new().capacity(
        tower_llm_retry::mock::Capacity::input_tokens_per_minute(60_000),
    ))
    .await
    .unwrap();
    let fleets = [token_fleet(&redis), token_fleet(&redis)];
    all_connected(&fleets).await;
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();
    // Each learns the limit from an answer of its own: 250 tokens each.
    for svc in &stacks {
        let res = svc
            .clone()
            .oneshot(token_request(&server, 1_000))
            .await
            .unwrap();
        drop(body_bytes(res).await);
    }
    // 12 requests of 5,000 tokens, six through each fleet, at once: 500 more than is left.
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..12 {
        let svc = stacks[i % 2].clone();
        let req = token_request(&server, 20_000);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap() });
    }
    let longest = longest_token_wait(tasks).await;
    // Nothing refused: 2 + 12 requests, each answered once.
    assert_eq!(server.request_count(), 14);
    // The last waited for the 500 tokens (and its estimate's excess), at 1,000 a second.
    assert!(longest >= Duration::from_millis(400), "{longest:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    // The read-out of the fleet that booked last mirrors the shared bucket: nearly spent.
    let lowest = fleets
        .iter()
        .filter_map(|f| {
            f.token_pacing()?
                .bucket(tower_llm_retry::fleet::TokenKind::Input)
        })
        .map(|b| b.level)
        .fold(f64::INFINITY, f64::min);
    assert!(lowest < 10_000.0, "{lowest}");
}

/// A process spends before it knows the limit (its first answer states it): those tokens
/// were never booked. The server counts at arrival and answers 300 ms later, as a model
/// does after its output. A's first booking makes the shared bucket from what A was told,
/// 12,000 tokens too many (B's spend). B's first booking, while A's is on its way, carries
/// what B was told less what the fleet booked since (A's 5,000): the bucket comes down to the
/// server's count, and ten requests of 5,000 into the 48,000 or so left all go without a
/// `429`, the last after about two seconds. Without taking off what was booked since, B's
/// floor lowers the bucket only to 5,000 above the server's count: the last is refused.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_process_that_spent_before_it_knew_the_limit_is_caught_up_with_by_its_first_booking() {
    let redis = RedisServer::start();
    let server = MockServer::start(
        Script::always(Reply::success().delay(Duration::from_millis(300))).capacity(
            tower_llm_retry::mock::Capacity::input_tokens_per_minute(60_000),
        ),
    )
    .await
    .unwrap();
    let fleets = [token_fleet(&redis), token_fleet(&redis)];
    all_connected(&fleets).await;
    let [a, b] = [stack(&fleets[0], policy()), stack(&fleets[1], policy())];
    let send = |svc: &Retry<HttpClient>, chars| svc.clone().oneshot(token_request(&server, chars));
    // A learns the limit (250 tokens), then B (12,000, unbooked): 47,750 left.
    drop(body_bytes(send(&a, 1_000).await.unwrap()).await);
    drop(body_bytes(send(&b, 48_000).await.unwrap()).await);
    // Ten of 5,000: A's first alone, the rest once it has reached the server.
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let first = send(&a, 20_000);
    tasks.spawn(async move { first.await.unwrap() });
    let arrived = within(Duration::from_secs(2), || server.request_count() == 3).await;
    assert!(arrived.is_some());
    for i in 1..10 {
        let next = send([&a, &b][i % 2], 20_000);
        tasks.spawn(async move { next.await.unwrap() });
    }
    let longest = longest_token_wait(tasks).await;
    assert_eq!(server.request_count(), 12);
    // The last waited for the 2,000 or so tokens short (less what came in meanwhile).
    assert!(longest >= Duration::from_secs(1), "{longest:?}");
    assert!(start.elapsed() < Duration::from_secs(8));
}

/// Redis counts only the fleet's bookings; the server counts every client of the limit. A
/// client outside the fleet spends most of the bucket: the next booking carries what the
/// server last said was left, the shared bucket is lowered to it, and the fleet's two
/// requests of 3,000 tokens go one after the other, the second when its tokens are in,
/// instead of both at once into a `429`.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn the_shared_bucket_is_lowered_to_what_the_server_says_is_left() {
    let redis = RedisServer::start();
    let server = MockServer::start(Script::new().capacity(
        tower_llm_retry::mock::Capacity::input_tokens_per_minute(60_000),
    ))
    .await
    .unwrap();
    let fleet = token_fleet(&redis);
    all_connected(std::slice::from_ref(&fleet)).await;
    let svc = stack(&fleet, policy());
    let small = |svc: &Retry<HttpClient>| svc.clone().oneshot(token_request(&server, 1_000));
    // Awake from the first answer; the second books in Redis.
    for _ in 0..2 {
        drop(body_bytes(small(&svc).await.unwrap()).await);
    }
    // Another client of the same limit spends 56,000 tokens: about 3,500 are left.
    let outside = http::Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(tower_llm_retry::ReplayBody::new(token_body(224_000)))
        .unwrap();
    let outside = http_client().request(outside).await.unwrap();
    assert_eq!(outside.status(), StatusCode::OK);
    // The fleet's next answer says so.
    drop(body_bytes(small(&svc).await.unwrap()).await);
    let start = Instant::now();
    let (a, b) = tokio::join!(
        svc.clone().oneshot(token_request(&server, 12_000)),
        svc.clone().oneshot(token_request(&server, 12_000)),
    );
    let mut waited = Vec::new();
    for res in [a.unwrap(), b.unwrap()] {
        assert_eq!(res.status(), StatusCode::OK);
        let trail = res.extensions().get::<RetryTrail>().cloned();
        assert_eq!(trail.as_ref().map_or(0, |t| t.retries()), 0, "{trail:?}");
        waited.extend(trail.and_then(|t| t.token_wait()));
    }
    assert_eq!(server.request_count(), 6);
    let longest = waited.iter().max().copied().unwrap_or_default();
    assert!(longest >= Duration::from_secs(2), "{waited:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

/// Two processes warming a new scope up on one schedule meet a limit: the first to see the
/// evidence brings the fleet's schedule down to the share of it the server admitted (not by
/// half, then 5 % a round), so the seconds after the wake hold about the capacity's worth
/// of attempts.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_warm_up_woken_by_a_limit_brings_the_fleets_schedule_down_at_once() {
    let redis = RedisServer::start();
    let server = MockServer::start(
        Script::new().capacity(tower_llm_retry::mock::Capacity::token_bucket(20.0, 20)),
    )
    .await
    .unwrap();
    let fleets = warming_fleets(&redis).await;
    let stacks: Vec<_> = fleets
        .iter()
        .map(|f| stack(f, policy().max_retries(30)))
        .collect();
    let origin = tokio::time::Instant::now();
    at_once(&stacks, &server, 60).await;
    let per_second: Vec<usize> = (0..5)
        .map(|i| {
            server
                .requests()
                .iter()
                .filter(|r| (r.received_at - origin).as_secs() == i)
                .count()
        })
        .collect();
    // Evidence comes in the second second (a bucket of 20 that starts full admits most of
    // the first); the two after it hold 52–54 attempts for 40 admitted. Falling by half
    // and 5 % a round, 76.
    let after = per_second[2] + per_second[3];
    assert!(after <= 60, "{per_second:?}");
    for f in &fleets {
        assert_eq!(f.pacing_state(), Some(Some(PacingWake::RefusalShare)));
    }
}
