//! Replicas sharing one Redis: two proxies in front of one upstream, as two processes would
//! be, learn each other's `429`s per tenant. Against a real `redis-server` (started here, on a
//! Unix socket), so in real time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use http_body_util::Full;
use tokio::time::Instant;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry_proxy::config::Secret;
use tower_llm_retry_proxy::{Config, Proxy};

use crate::common::*;

#[path = "../../../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis_server;

/// A proxy with `config`, serving on a port of its own until the test ends.
async fn replica(config: Config) -> (std::net::SocketAddr, Proxy) {
    let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(config).unwrap();
    tokio::spawn(proxy.clone().serve(listener, std::future::pending::<()>()));
    (addr, proxy)
}

fn from(addr: std::net::SocketAddr, key: &str) -> Request<Full<bytes::Bytes>> {
    Request::post(format!("http://{addr}/v1/messages"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", key)
        .body(Full::from(MESSAGES))
        .unwrap()
}

async fn until_requests(mock: &MockServer, n: usize) {
    let start = Instant::now();
    while mock.request_count() < n {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the upstream saw too few requests"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The test below needs a `redis-server` and is ignored by default; under CI (`CI` set),
/// where it must run, this one fails when it is not installed.
#[test]
fn redis_server_is_installed_under_ci() {
    redis_server::assert_installed_under_ci();
}

#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn replicas_sharing_one_redis_hold_a_tenant_at_the_gate_another_replica_closed() {
    let redis = redis_server::RedisServer::start();
    held_at_the_gate_another_replica_closed(redis.url()).await;
}

/// The same with `redis_url` naming a Redis Cluster of three primaries by its seed nodes.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn replicas_sharing_a_redis_cluster_hold_a_tenant_at_the_gate_another_replica_closed() {
    let cluster = redis_server::RedisCluster::start(3);
    held_at_the_gate_another_replica_closed(cluster.url()).await;
}

async fn held_at_the_gate_another_replica_closed(redis_url: String) {
    // The second request of tenant A (the first goes through replica B) is refused for 3 s.
    let seen_a = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let limited = Arc::new(AtomicBool::new(false));
    let script = Script::new().when({
        let seen_a = seen_a.clone();
        move |req| {
            let a = req.headers.get("x-api-key").is_some_and(|k| k == "sk-A");
            (a && seen_a.fetch_add(1, Ordering::SeqCst) == 1
                && !limited.swap(true, Ordering::SeqCst))
            .then(|| Reply::rate_limited("3"))
        }
    });
    let mock = MockServer::start(script).await.unwrap();
    let mut config = config_for(&mock);
    config.redis_url = Some(Secret::new(redis_url));
    config.redis_prefix = format!("proxy-replicas-{}", std::process::id());
    let (a, proxy_a) = replica(config.clone()).await;
    let (b, _) = replica(config).await;
    let client = client();

    // B's stack for tenant A exists (and is in touch with Redis) before A's 429.
    assert_eq!(client.request(from(b, "sk-A")).await.unwrap().status(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let through_a = tokio::spawn({
        let client = client.clone();
        async move { client.request(from(a, "sk-A")).await.unwrap().status() }
    });
    until_requests(&mock, 2).await;
    let closed_at = mock.requests()[1].received_at;
    // Once A has the 429 (and closes the gate in Redis), B learns of it from the message,
    // or at the latest from its poll, within a second.
    let start = Instant::now();
    while !proxy_a
        .metrics()
        .render()
        .contains("llm_retry_proxy_gate_closures_total{upstream=\"anthropic\"} 1")
    {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "A never saw its 429"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let through_b = tokio::spawn({
        let client = client.clone();
        async move { client.request(from(b, "sk-A")).await.unwrap().status() }
    });
    // Another tenant on B is not held by A's gate.
    let sent_b = Instant::now();
    assert_eq!(client.request(from(b, "sk-B")).await.unwrap().status(), 200);
    assert_eq!(through_b.await.unwrap(), 200);
    assert_eq!(through_a.await.unwrap(), 200);

    let seen = mock.requests();
    assert_eq!(
        seen.len(),
        5,
        "B's first, A's 429, B's tenant B, then A and B after the gate"
    );
    let after = |key: &str| -> Vec<Duration> {
        seen.iter()
            .filter(|r| r.headers["x-api-key"] == key && r.received_at > closed_at)
            .map(|r| r.received_at - closed_at)
            .collect()
    };
    let b_tenant: Vec<Duration> = seen
        .iter()
        .filter(|r| r.headers["x-api-key"] == "sk-B")
        .map(|r| r.received_at - sent_b)
        .collect();
    assert_eq!(b_tenant.len(), 1);
    assert!(b_tenant[0] < Duration::from_millis(500), "{b_tenant:?}");
    // Both replicas' requests of tenant A left only once the 3 s were over.
    let a_tenant = after("sk-A");
    assert_eq!(a_tenant.len(), 2);
    assert!(
        a_tenant.iter().all(|t| *t >= Duration::from_millis(2900)),
        "{a_tenant:?}"
    );
}

/// A closing on one replica reaches the other on the subscription its tenants share, long
/// before the other's poll: a request there 100 ms after the `429` waits for the gate.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_closing_on_one_replica_holds_the_tenant_on_another_100_ms_later() {
    let redis = redis_server::RedisServer::start();
    // The second request of tenant A is refused for 3 s.
    let seen_a = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let script = Script::new().when({
        let seen_a = seen_a.clone();
        move |req| {
            let a = req.headers.get("x-api-key").is_some_and(|k| k == "sk-A");
            (a && seen_a.fetch_add(1, Ordering::SeqCst) == 1).then(|| Reply::rate_limited("3"))
        }
    });
    let mock = MockServer::start(script).await.unwrap();
    let mut config = config_for(&mock);
    config.redis_url = Some(Secret::new(redis.url()));
    config.redis_prefix = format!("proxy-propagation-{}", std::process::id());
    let (a, proxy_a) = replica(config.clone()).await;
    let (b, _) = replica(config).await;
    let client = client();

    // B's tenant A has read the gate (its first poll) before A's 429; its next poll is a
    // second after.
    assert_eq!(client.request(from(b, "sk-A")).await.unwrap().status(), 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let through_a = tokio::spawn({
        let client = client.clone();
        async move { client.request(from(a, "sk-A")).await.unwrap().status() }
    });
    until_requests(&mock, 2).await;
    let closed_at = mock.requests()[1].received_at;
    let start = Instant::now();
    while !proxy_a
        .metrics()
        .render()
        .contains("llm_retry_proxy_gate_closures_total{upstream=\"anthropic\"} 1")
    {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "A never saw its 429"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep_until(closed_at + Duration::from_millis(100)).await;
    assert_eq!(client.request(from(b, "sk-A")).await.unwrap().status(), 200);
    assert_eq!(through_a.await.unwrap(), 200);
    let seen = mock.requests();
    assert_eq!(seen.len(), 4);
    let b_after = seen[2].received_at.min(seen[3].received_at) - closed_at;
    assert!(
        b_after >= Duration::from_millis(2_500),
        "a request went out {b_after:?} after the 429"
    );
}

/// With `redis_fail_closed`, a tenant whose Redis is out of reach is refused: `503` with
/// `x-should-retry: true`, nothing sent upstream. Failing open (the default), the same
/// request goes through on the replica's own state. (Redis here is a port nobody listens on.)
#[tokio::test]
async fn failing_closed_refuses_a_tenant_whose_redis_is_out_of_reach_and_sends_nothing() {
    let mock = MockServer::start(Script::new()).await.unwrap();
    let client = client();
    for closed in [true, false] {
        let mut config = config_for(&mock);
        config.redis_url = Some(Secret::new("redis://127.0.0.1:1/".to_owned()));
        config.redis_fail_closed = closed;
        let (addr, _proxy) = replica(config).await;
        let before = mock.request_count();
        let res = client.request(from(addr, "sk-A")).await.unwrap();
        if closed {
            assert_eq!(res.status(), 503);
            assert_eq!(res.headers()["x-should-retry"], "true");
            assert_eq!(mock.request_count(), before, "nothing reached the upstream");
        } else {
            assert_eq!(res.status(), 200);
            assert_eq!(mock.request_count(), before + 1);
        }
    }
}
