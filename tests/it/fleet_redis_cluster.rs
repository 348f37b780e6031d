//! The fleet across processes on a real Redis Cluster: three primaries on 127.0.0.1, started
//! by each test (a test that kills nodes or moves slots needs a cluster of its own) and torn
//! down after it. Fleets built separately, as separate processes build theirs, in front of the
//! mock. Redis keeps real time, so these tests run in real time, a few seconds each.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_llm_retry::fleet::{Fleet, RedisFleet, RedisState};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::Retry;
use tower_llm_retry::{ErrorKind, RetryTrail};

use super::fleet_redis::redis_server::{RedisCluster, RedisServer};
use super::fleet_redis::{connected, gate, policy, stack, within};

fn fleet(store: RedisFleet) -> Fleet {
    Fleet::builder()
        .cooldown_gate(Some(gate()))
        .redis(store)
        .build()
}

fn local(fleet: &Fleet) -> bool {
    matches!(fleet.redis_state(), Some(RedisState::Local { .. }))
}

async fn all_connected(fleets: &[&Fleet]) {
    let ok = within(Duration::from_secs(5), || {
        fleets.iter().all(|f| connected(f))
    })
    .await;
    assert!(
        ok.is_some(),
        "{:?}",
        fleets.iter().map(|f| f.redis_state()).collect::<Vec<_>>()
    );
}

/// A scope (its credential) whose keys live on node `node` of `cluster`.
fn credential_on(cluster: &RedisCluster, url: &str, node: usize) -> Vec<u8> {
    (0..1_000)
        .map(|i| format!("key-{i}").into_bytes())
        .find(|key| {
            let store = RedisFleet::from_url(url).unwrap().scope("127.0.0.1", key);
            cluster.owner(&store.key_names()[0]) == node
        })
        .expect("a scope on that node")
}

/// One 429 with Retry-After `secs` through `a`; returns how long `b` took to learn of it.
async fn close_through(a: &Fleet, b: &Fleet, secs: &str) -> Option<Duration> {
    let server = MockServer::start(Script::new().then(Reply::rate_limited(secs)))
        .await
        .unwrap();
    let res = stack(a, policy().max_retries(0))
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    within(Duration::from_millis(1_500), || {
        b.gate_closed_until().is_some()
    })
    .await
}

/// The scripts run by node `i` so far.
fn scripts_run(node: &RedisServer) -> u64 {
    let stats = match node.command(&["INFO", "commandstats"]) {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        redis::Value::VerbatimString { text, .. } => text,
        other => panic!("{other:?}"),
    };
    stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// The errors node `node` answered, of `kind` (`MOVED`, `ASK`).
fn errors(node: &RedisServer, kind: &str) -> u64 {
    node.errors()
        .into_iter()
        .find(|(k, _)| k == kind)
        .map_or(0, |(_, n)| n)
}

/// Sends requests through `stacks` until `stop`, each one checked to succeed at once; returns
/// the number sent and the slowest.
fn flow(
    stacks: Vec<Retry<HttpClient>>,
    server: Arc<MockServer>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u64, Duration)> {
    tokio::spawn(async move {
        let mut sent = 0;
        let mut slowest = Duration::ZERO;
        while !stop.load(Ordering::Relaxed) {
            for svc in &stacks {
                let t = Instant::now();
                let res = svc
                    .clone()
                    .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
                    .await
                    .expect("no error reaches a request");
                assert_eq!(res.status(), StatusCode::OK);
                assert!(res.extensions().get::<RetryTrail>().is_none());
                slowest = slowest.max(t.elapsed());
                sent += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (sent, slowest)
    })
}

/// A closing made through a scope on one node reaches another process, subscribed on another
/// node, at once (the cluster carries `PUBLISH` to every node); when the node of that
/// subscription is lost, the subscription moves to another seed node and the next closing
/// arrives as fast. Each script runs on the node that owns the scope's slot.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn closings_cross_the_cluster_at_once_and_survive_the_loss_of_the_subscribed_node() {
    let mut cluster = RedisCluster::start(3);
    let url = cluster.url();
    // The scope lives on node 1; every process subscribes on node 0 first (the first seed).
    let key = credential_on(&cluster, &url, 1);
    let store = || RedisFleet::from_url(&url).unwrap().scope("127.0.0.1", &key);
    let a = fleet(store());
    // The other process polls once a minute: only a message can tell it in time.
    let b = fleet(store().poll_interval(Duration::from_secs(60)).unwrap());
    all_connected(&[&a, &b]).await;
    let before = scripts_run(&cluster.nodes[1]);
    // Past the first polls.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let seen = close_through(&a, &b, "1")
        .await
        .expect("the closing reaches the other process");
    assert!(seen < Duration::from_millis(100), "took {seen:?}");
    // The closing ran on the slot's node, and every script since the start did: the other
    // nodes ran none.
    assert!(scripts_run(&cluster.nodes[1]) > before);
    assert_eq!(scripts_run(&cluster.nodes[0]), 0);
    assert_eq!(scripts_run(&cluster.nodes[2]), 0);
    // Reopened.
    let open = within(Duration::from_secs(3), || {
        a.gate_closed_until().is_none() && b.gate_closed_until().is_none()
    });
    assert!(open.await.is_some());

    // The node both processes subscribed on is lost (it owns other slots, not this scope's).
    cluster.nodes[0].kill();
    // Time for the subscription to move (a connection refused at once, then the next seed).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(connected(&a) && connected(&b));
    let seen = close_through(&a, &b, "1")
        .await
        .expect("the closing reaches the other process after its node was lost");
    assert!(seen < Duration::from_millis(100), "took {seen:?}");
}

/// A primary killed mid-run: the scope on its slots falls back to local state (no request
/// waits for it, none fails), the scope on another node keeps coordinating throughout; when
/// the node is back, the scope comes back in touch and the closing it made meanwhile is merged
/// into the node and reaches the other process.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_primary_killed_costs_only_its_scopes_coordination_and_they_merge_back() {
    let mut cluster = RedisCluster::start(3);
    let url = cluster.url();
    let server = Arc::new(MockServer::start(Script::new()).await.unwrap());
    // The bounds come from the store's settings: a request that waited on the dead node would
    // wait a whole call deadline (a second, far above what a loaded machine adds to a local
    // request).
    let call = Duration::from_secs(1);
    let poll = Duration::from_millis(200);
    let patience = Duration::from_secs(10);
    let lost_key = credential_on(&cluster, &url, 1);
    let kept_key = credential_on(&cluster, &url, 2);
    // Two processes, each with one store for two scopes (as the tenants of a per-scope fleet).
    let processes: Vec<[Fleet; 2]> = (0..2)
        .map(|_| {
            let store = RedisFleet::from_url(&url)
                .unwrap()
                .call_timeout(call)
                .unwrap()
                .poll_interval(poll)
                .unwrap();
            [
                fleet(store.clone().scope("127.0.0.1", &lost_key)),
                fleet(store.scope("127.0.0.1", &kept_key)),
            ]
        })
        .collect();
    let [lost, kept]: [Vec<Fleet>; 2] =
        [0, 1].map(|s| processes.iter().map(|p| p[s].clone()).collect());
    all_connected(&lost.iter().chain(&kept).collect::<Vec<_>>()).await;
    let stacks: Vec<_> = lost
        .iter()
        .chain(&kept)
        .map(|f| stack(f, policy()))
        .collect();
    // The other scope never notices: in touch all along (sampled until the end).
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let kept_out = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (kept, out, stop) = (kept.clone(), kept_out.clone(), stop_sampling.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if !kept.iter().all(connected) {
                    out.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let requests = flow(stacks, server.clone(), stop.clone());
    tokio::time::sleep(poll).await;

    cluster.nodes[1].kill();
    let fell = within(patience, || lost.iter().all(local)).await;
    assert!(
        fell.is_some(),
        "{:?}",
        lost.iter().map(|f| f.redis_state()).collect::<Vec<_>>()
    );
    // Requests go on while the scope finds out, and after: none waits for the dead node,
    // none fails.
    tokio::time::sleep(poll * 3).await;
    stop.store(true, Ordering::Relaxed);
    let (sent, slowest) = requests.await.unwrap();
    assert!(sent > 20, "{sent} requests");
    assert!(slowest < call, "{slowest:?}");
    // The other scope's gate is still shared.
    assert!(close_through(&kept[0], &kept[1], "1").await.is_some());
    // Out of touch, the lost scope's processes each keep their own gate: a closing stays in
    // the one that saw it. Closed for 5 s: still in force when the node is back.
    assert!(close_through(&lost[0], &lost[0], "5").await.is_some());
    let closed_until = lost[0].gate_closed_until().unwrap();
    assert_eq!(lost[1].gate_closed_until(), None);

    cluster.nodes[1].restart();
    let back = within(patience, || lost.iter().all(connected)).await;
    assert!(
        back.is_some(),
        "{:?}",
        lost.iter().map(|f| f.redis_state()).collect::<Vec<_>>()
    );
    // The closing made while out of touch is merged into the node that came back, and
    // reaches the other process from there.
    let gate_key = RedisFleet::from_url(&url)
        .unwrap()
        .scope("127.0.0.1", &lost_key)
        .key_names()[0]
        .clone();
    let stored = within(patience, || {
        cluster.nodes[1].command(&["EXISTS", &gate_key]) == redis::Value::Int(1)
    });
    assert!(stored.await.is_some(), "the closing was not merged back");
    let merged = within(patience, || lost[1].gate_closed_until().is_some()).await;
    assert!(merged.is_some());
    assert!(
        Instant::now() < closed_until,
        "the closing lapsed before it was merged back: the check above proves nothing"
    );
    stop_sampling.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    assert_eq!(
        kept_out.load(Ordering::Relaxed),
        0,
        "the scope on a live node went out of touch"
    );
}

/// A scope's slot moved to another node while requests flow (as `redis-cli --cluster
/// reshard` moves it): no request fails or waits, the clients follow the redirections
/// (`ASK` while the slot is half moved, `MOVED` after), and the scope still coordinates from
/// the new node.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn a_slot_moved_while_requests_flow_fails_nothing_and_coordination_follows_it() {
    let cluster = RedisCluster::start(3);
    let url = cluster.url();
    let server = Arc::new(MockServer::start(Script::new()).await.unwrap());
    let key = credential_on(&cluster, &url, 1);
    let call = Duration::from_millis(250);
    let fleets: Vec<Fleet> = (0..2)
        .map(|_| {
            fleet(
                RedisFleet::from_url(&url)
                    .unwrap()
                    .scope("127.0.0.1", &key)
                    .call_timeout(call)
                    .unwrap()
                    .poll_interval(Duration::from_millis(100))
                    .unwrap(),
            )
        })
        .collect();
    all_connected(&fleets.iter().collect::<Vec<_>>()).await;
    // A closing, so that the scope's gate is among the keys that move; the requests below
    // are sent once it has reopened.
    assert!(close_through(&fleets[0], &fleets[1], "1").await.is_some());
    let open = within(Duration::from_secs(3), || {
        fleets.iter().all(|f| f.gate_closed_until().is_none())
    });
    assert!(open.await.is_some());
    let stacks: Vec<_> = fleets.iter().map(|f| stack(f, policy())).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let requests = flow(stacks, server.clone(), stop.clone());
    let gate_key = RedisFleet::from_url(&url)
        .unwrap()
        .scope("127.0.0.1", &key)
        .key_names()[0]
        .clone();
    let slot = cluster.slot(&gate_key);
    let cluster = tokio::task::spawn_blocking(move || {
        // A key at a time, with the requests' flushes and polls in between.
        cluster.migrate_slot(slot, 1, 2, || {
            std::thread::sleep(Duration::from_millis(30));
        });
        cluster
    })
    .await
    .unwrap();
    assert_eq!(cluster.owner(&gate_key), 2);
    // The clients were redirected: the old node answered MOVED or ASK.
    let redirected = errors(&cluster.nodes[1], "MOVED") + errors(&cluster.nodes[1], "ASK");
    // Requests go on past the move.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (sent, slowest) = requests.await.unwrap();
    assert!(sent > 20, "{sent} requests");
    assert!(slowest < call, "{slowest:?}");
    // The scope coordinates from the new node: a closing through one reaches the other.
    all_connected(&fleets.iter().collect::<Vec<_>>()).await;
    let before = scripts_run(&cluster.nodes[2]);
    let seen = close_through(&fleets[0], &fleets[1], "1").await;
    assert!(
        seen.is_some(),
        "the closing did not reach the other process"
    );
    assert!(
        scripts_run(&cluster.nodes[2]) > before,
        "the new node runs the scripts"
    );
    assert!(
        redirected + errors(&cluster.nodes[1], "MOVED") > 0,
        "{:?}",
        cluster.nodes[1].errors()
    );
}

/// The whole cluster down: a fleet that fails open goes on with its local state; one that
/// fails closed admits nothing (a typed error, nothing sent) until the cluster is back, and
/// neither does one that starts while it is down.
#[tokio::test]
#[ignore = "needs redis-server; run as the README's Tests say"]
async fn the_whole_cluster_down_fails_open_by_default_and_closed_when_asked() {
    let mut cluster = RedisCluster::start(3);
    let url = cluster.url();
    let server = MockServer::start(Script::new()).await.unwrap();
    let store = || {
        RedisFleet::from_url(&url)
            .unwrap()
            .scope("127.0.0.1", b"test-key")
            .poll_interval(Duration::from_millis(100))
            .unwrap()
    };
    let open = fleet(store());
    let closed = fleet(store().fail_closed(true));
    all_connected(&[&open, &closed]).await;
    let send = |f: &Fleet| {
        stack(f, policy()).oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
    };
    assert_eq!(send(&closed).await.unwrap().status(), StatusCode::OK);
    // A request whose first attempt went out in touch, answered 503: its retry, 2 s later,
    // comes when the cluster is down.
    let failing = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let retried = tokio::spawn(
        stack(&closed, policy().initial_backoff(Duration::from_secs(2)))
            .oneshot(anthropic_request(&failing.url("/v1/messages"), BODY)),
    );
    let first = within(Duration::from_secs(1), || failing.request_count() == 1);
    assert!(first.await.is_some());

    for node in &mut cluster.nodes {
        node.kill();
    }
    let down = within(Duration::from_secs(5), || local(&open) && local(&closed)).await;
    assert!(down.is_some(), "{:?}", closed.redis_state());
    // The retry is not admitted either: the error, with the trail of the one attempt made.
    let err = retried.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FleetUnreachable);
    assert_eq!(err.trail().unwrap().total_attempts(), 1);
    assert_eq!(failing.request_count(), 1, "the retry was not sent");
    let before = server.request_count();
    assert_eq!(send(&open).await.unwrap().status(), StatusCode::OK);
    assert_eq!(server.request_count(), before + 1);
    let err = send(&closed).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FleetUnreachable);
    assert_eq!(server.request_count(), before + 1, "nothing was sent");
    // A process that starts while the cluster is down refuses from its first request.
    let new = fleet(store().fail_closed(true));
    let err = send(&new).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FleetUnreachable);
    assert_eq!(server.request_count(), before + 1);

    for node in &mut cluster.nodes {
        node.restart();
    }
    cluster.wait_ok(Duration::from_secs(10));
    all_connected(&[&open, &closed, &new]).await;
    assert_eq!(send(&closed).await.unwrap().status(), StatusCode::OK);
    assert_eq!(send(&new).await.unwrap().status(), StatusCode::OK);
    assert_eq!(server.request_count(), before + 3);
}
