//! Extreme durations in every setter, against hostile `Retry-After` values from a real server
//! on 127.0.0.1: nothing panics (no `Instant + Duration` or `Duration × f64` overflow), every
//! request ends, no sleep exceeds the documented ceilings, and nothing reaches the server after
//! the request's deadline. Paused time, so a wait of "forever" costs nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use proptest::prelude::*;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::fleet::{Fleet, GateConfig, PacingConfig};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{AboveCeiling, Jitter, Random, RetryEvent, RetryObserver};
use tower_llm_retry::{ContextOverflowLayer, ModelFallbackLayer, RetryLayer, RetryPolicy};

fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_nanos(1)),
        Just(Duration::from_millis(1)),
        Just(Duration::from_secs(1)),
        Just(Duration::from_secs(60)),
        Just(Duration::from_secs(86_400)),
        Just(Duration::from_secs(u64::from(u32::MAX))),
        Just(Duration::from_secs(u64::MAX)),
        Just(Duration::MAX),
        (0u64..u64::MAX).prop_map(Duration::from_secs),
    ]
}

fn hostile_retry_after() -> impl Strategy<Value = (&'static str, String)> {
    let value = prop_oneof![
        Just("0".to_owned()),
        Just("-1".to_owned()),
        Just("NaN".to_owned()),
        Just("inf".to_owned()),
        Just("1e300".to_owned()),
        Just("18446744073709551615".to_owned()),
        Just("99999999999999999999999".to_owned()),
        Just("0.000000001".to_owned()),
        Just("Fri, 31 Dec 9999 23:59:59 GMT".to_owned()),
        Just("Thu, 01 Jan 1970 00:00:00 GMT".to_owned()),
        (0u64..u64::MAX).prop_map(|n| n.to_string()),
        "[ -~]{0,24}",
    ];
    (
        prop_oneof![Just("retry-after"), Just("retry-after-ms")],
        value,
    )
}

fn jitter() -> impl Strategy<Value = Jitter> {
    prop_oneof![
        Just(Jitter::none()),
        (0.0f64..=1.0).prop_map(|f| Jitter::add(f).unwrap()),
        (0.0f64..=1.0).prop_map(|f| Jitter::subtract(f).unwrap()),
        (0.0f64..=1.0).prop_map(|f| Jitter::symmetric(f).unwrap()),
    ]
}

/// The delays the loop announced.
#[derive(Clone, Default)]
struct Delays(Arc<Mutex<Vec<Duration>>>);

impl RetryObserver for Delays {
    fn on_retry(&self, e: &RetryEvent<'_>) {
        self.0.lock().unwrap().push(e.delay);
    }
}

#[derive(Debug, Clone)]
struct Setup {
    initial: Duration,
    max_backoff: Duration,
    jitter: Jitter,
    sample: f64,
    ra_min: Duration,
    ra_max: Duration,
    above: u8,
    floor: bool,
    head: Duration,
    idle: Duration,
    deadline: Option<Duration>,
    spread: f64,
    max_spread: Duration,
    sticky: Duration,
    pacing: bool,
    replies: Vec<(&'static str, String)>,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        (
            duration(),
            duration(),
            jitter(),
            0.0f64..1.0,
            duration(),
            duration(),
        ),
        (0u8..3, any::<bool>()),
        // A head or idle timeout of `None` waits forever by design, and the script stalls a
        // body: both are set here, to values as extreme as the rest.
        (duration(), duration(), proptest::option::of(duration())),
        (0.0f64..=10.0, duration(), duration(), any::<bool>()),
        proptest::collection::vec(hostile_retry_after(), 1..4),
    )
        .prop_map(
            |(
                (initial, max_backoff, jitter, sample, ra_min, ra_max),
                (above, floor),
                (head, idle, deadline),
                (spread, max_spread, sticky, pacing),
                replies,
            )| Setup {
                initial,
                max_backoff,
                jitter,
                sample,
                ra_min,
                ra_max,
                above,
                floor,
                head,
                idle,
                deadline,
                spread,
                max_spread,
                sticky,
                pacing,
                replies,
            },
        )
}

/// The documented ceiling of one sleep: the backoff at its maximum with jitter, or the
/// `Retry-After` as the policy clamps it, whichever is larger.
fn ceiling(s: &Setup, jitter_max: f64) -> Duration {
    let backoff = Duration::try_from_secs_f64(s.max_backoff.as_secs_f64() * jitter_max)
        .unwrap_or(Duration::MAX);
    backoff.max(s.ra_max.max(s.ra_min))
}

/// The test client without its pool's idle sweep: that timer ticks every few seconds of
/// virtual time, and a sleep of "forever" (about 30 years) would tick it millions of times.
fn client() -> HttpClient {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(None)
        .build_http()
}

fn run(s: Setup) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        // 429s and 529s with hostile Retry-After values, a body that stalls after its first
        // byte (the idle timeout), then a success.
        let mut script = Script::new();
        for (i, (name, value)) in s.replies.iter().enumerate() {
            let reply = if i % 2 == 0 {
                Reply::rate_limited("1")
            } else {
                Reply::overloaded()
            };
            let reply = match http::HeaderValue::from_str(value) {
                Ok(_) => reply.header(name, value),
                Err(_) => reply,
            };
            script = script.then(reply);
        }
        let script = script
            .then(Reply::stall_mid_body(200, "{"))
            .then(Reply::success());
        let server = MockServer::start(script).await.unwrap();

        let sample = s.sample;
        let above = match s.above {
            0 => AboveCeiling::GiveUp,
            1 => AboveCeiling::UseBackoff,
            _ => AboveCeiling::Clamp,
        };
        let policy = RetryPolicy::default()
            .max_retries(6)
            .initial_backoff(s.initial)
            .max_backoff(s.max_backoff)
            .jitter(s.jitter)
            .random(Random::from_fn(move || sample))
            .retry_after_min(s.ra_min)
            .retry_after_max(s.ra_max)
            .above_ceiling(above)
            .backoff_is_floor(s.floor)
            .head_timeout(Some(s.head))
            .idle_timeout(Some(s.idle))
            .deadline(s.deadline);
        let jitter_max = 1.0 + 1.0; // every jitter mode stays within ×[0, 2]
        let delays = Delays::default();
        let gate = GateConfig::new()
            .min_close(Duration::ZERO)
            .spread(s.spread, s.max_spread)
            .unwrap();
        let pacing = s.pacing.then(PacingConfig::new);
        let svc = ServiceBuilder::new()
            .layer(
                RetryLayer::new()
                    .policy(policy)
                    .observer(delays.clone())
                    .fleet(
                        Fleet::builder()
                            .cooldown_gate(Some(gate))
                            .pacing(pacing)
                            // tower's TpsBudget, on its first use after a gap, clears its slots
                            // one window at a time: after a virtual sleep of "forever" (~30
                            // years) that is ~10⁹ steps. Real gaps cost microseconds; the
                            // budget's own durations are validated to 1–60 s, so it has no
                            // extreme setter to test here.
                            .budget(None)
                            .build(),
                    ),
            )
            .layer(
                ModelFallbackLayer::new(["claude-haiku-4-5"])
                    .unwrap()
                    .threshold(1)
                    .unwrap()
                    .sticky(s.sticky),
            )
            .layer(ContextOverflowLayer::new())
            .service(client());
        // Each request's start, and how many attempts the server had seen when it began.
        let mut starts = Vec::new();
        for _ in 0..2 {
            starts.push((tokio::time::Instant::now(), server.request_count()));
            let req = anthropic_request(&server.url("/v1/messages"), BODY);
            // Every request ends: with a response (whose body is read to its end or its
            // error) or a typed error.
            if let Ok(res) = svc.clone().oneshot(req).await {
                let _ = drain(res.into_body()).await;
            }
        }
        let bound = ceiling(&s, jitter_max);
        for d in delays.0.lock().unwrap().iter() {
            prop_assert!(
                *d <= bound,
                "slept {d:?}, above the ceiling {bound:?} for {s:?}"
            );
        }
        if let Some(deadline) = s.deadline {
            // Every attempt of each request reached the server by that request's deadline:
            // all of them, retries included, not only the first (which leaves at once).
            let requests = server.requests();
            let ends = starts.iter().map(|s| s.1).skip(1).chain([requests.len()]);
            for (&(start, from), to) in starts.iter().zip(ends) {
                let Some(end) = start.checked_add(deadline) else {
                    continue;
                };
                for r in &requests[from..to] {
                    prop_assert!(
                        r.received_at <= end,
                        "an attempt at {:?} after the deadline {deadline:?} for {s:?}",
                        r.received_at - start
                    );
                }
            }
        }
        Ok(())
    })
}

proptest! {
    // A random seed each run; a failing case is kept in `extremes.proptest-regressions`
    // and replayed first.
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn extreme_durations_never_panic_or_overwait(s in setup()) {
        run(s)?;
    }
}

/// Sends one request and reads its body, bounded by a virtual 31 years so a hang fails
/// instead of blocking.
async fn ends<F, B, E>(call: F)
where
    F: std::future::Future<Output = Result<http::Response<tower_llm_retry::RetryBody<B>>, E>>,
    B: http_body::Body + Unpin,
    B::Error: Into<tower_llm_retry::BoxError>,
{
    let outcome = tokio::time::timeout(Duration::from_secs(86_400 * 366 * 31), async {
        if let Ok(res) = call.await {
            let _ = drain(res.into_body()).await;
        }
    })
    .await;
    assert!(outcome.is_ok(), "the request did not end");
}

#[tokio::test(start_paused = true)]
async fn an_idle_timeout_of_duration_max_does_not_overflow() {
    // The body stalls after its first byte: the idle timer is armed with `Duration::MAX`.
    let server = MockServer::start(Script::new().then(Reply::stall_mid_body(200, "{")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().idle_timeout(Some(Duration::MAX)))
                .fleet(Fleet::builder().budget(None).build()),
        )
        .service(client());
    ends(svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))).await;
}

#[tokio::test(start_paused = true)]
async fn jitter_on_a_backoff_of_duration_max_does_not_overflow() {
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let delays = Delays::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(
                    RetryPolicy::default()
                        .max_retries(1)
                        .initial_backoff(Duration::MAX)
                        .max_backoff(Duration::MAX)
                        .jitter(Jitter::add(0.25).unwrap())
                        .random(Random::from_fn(|| 0.5)),
                )
                .observer(delays.clone())
                .fleet(Fleet::builder().budget(None).build()),
        )
        .service(client());
    ends(svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))).await;
    assert_eq!(*delays.0.lock().unwrap(), [Duration::MAX]);
}

#[tokio::test(start_paused = true)]
async fn a_sticky_cooldown_of_duration_max_does_not_overflow() {
    let server = MockServer::start(Script::new().then(Reply::overloaded()))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::default().jitter(Jitter::none())))
        .layer(
            ModelFallbackLayer::new(["claude-haiku-4-5"])
                .unwrap()
                .threshold(1)
                .unwrap()
                .sticky(Duration::MAX),
        )
        .service(client());
    ends(svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))).await;
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_huge_retry_after_closes_the_gate_for_its_longest_hold() {
    // A Retry-After of 10¹⁹ seconds (past what an `Instant` can hold), no ceiling, the largest spread fraction: the gate
    // closes for the longest hold (a day) without overflowing, where before the sum overflowed
    // and the gate did not close at all.
    let server = MockServer::start(Script::new().then(Reply::rate_limited("10000000000000000000")))
        .await
        .unwrap();
    let delays = Delays::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(
                    RetryPolicy::default()
                        .max_retries(1)
                        .retry_after_max(Duration::MAX)
                        .random(Random::from_fn(|| 0.0)),
                )
                .observer(delays.clone())
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(
                            GateConfig::new()
                                .min_close(Duration::ZERO)
                                .spread(10.0, Duration::MAX)
                                .unwrap(),
                        ))
                        .budget(None)
                        .build(),
                ),
        )
        .service(client());
    let first = tokio::spawn(ends(
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    ));
    // Once its retry is planned, the gate has seen the answer.
    while delays.0.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let origin = server.requests()[0].received_at;
    ends(svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))).await;
    let second = server.requests()[1].received_at - origin;
    assert!(
        second >= Duration::from_secs(86_400) && second < Duration::from_secs(86_401),
        "{second:?}"
    );
    first.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_spread_of_duration_max_holds_a_waiter_at_most_a_day_past_the_reopening() {
    // The combination that held the extreme-settings property for ages of virtual time: a
    // `Retry-After` past what a `Duration` holds, the spread fraction at 4.3 with no maximum,
    // a waiter drawing 0.437 of it. The spread was taken of the announced wait before its
    // cap, so the waiter slept about 2.5 × 10¹¹ years after the gate reopened.
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("1").header("retry-after-ms", "99999999999999999999999")),
    )
    .await
    .unwrap();
    let delays = Delays::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(
                    RetryPolicy::default()
                        .max_retries(1)
                        .retry_after_max(Duration::MAX)
                        .random(Random::from_fn(|| 0.437)),
                )
                .observer(delays.clone())
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(
                            GateConfig::new()
                                .min_close(Duration::ZERO)
                                .spread(4.3, Duration::MAX)
                                .unwrap(),
                        ))
                        .budget(None)
                        .build(),
                ),
        )
        .service(client());
    let first = tokio::spawn(ends(
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    ));
    while delays.0.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let origin = server.requests()[0].received_at;
    ends(svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))).await;
    // Held for the longest hold (a day), plus at most a day of spread: 0.437 of it.
    let second = server.requests()[1].received_at - origin;
    let day = Duration::from_secs(86_400);
    let expected = day + day.mul_f64(0.437);
    assert!(
        second >= expected && second < expected + Duration::from_secs(1),
        "{second:?}"
    );
    first.await.unwrap();
}
