//! Prometheus metrics, one registry per proxy (so several proxies in one process, as in the
//! tests, never share counters), rendered at `/metrics`.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tower_llm_retry::fallback::CircuitState;
use tower_llm_retry::fleet::{Fleet, TokenKind};
use tower_llm_retry::retry::{GiveUpReason, RetryEvent, RetryObserver};
use tower_llm_retry::{ModelFallbackLayer, RetryTrail};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Up {
    upstream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Req {
    upstream: String,
    status: Outcome,
}

/// How a request ended, as the `status` label says it: the status answered, or
/// `client_gone` when the client hung up first.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Outcome {
    Status(u16),
    ClientGone,
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        match self {
            Outcome::Status(code) => EncodeLabelValue::encode(code, encoder),
            Outcome::ClientGone => EncodeLabelValue::encode(&"client_gone", encoder),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Class {
    upstream: String,
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    upstream: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabel {
    upstream: String,
    target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResumeOutcome {
    upstream: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Wake {
    upstream: String,
    cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabel {
    upstream: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Rejected {
    reason: String,
}

fn latency() -> Histogram {
    // 0.5 ms to ~65 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.0005, 2.0, 18,
    ))
}

/// Every metric the proxy exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<Req, Counter>,
    attempts: Family<Up, Counter>,
    retries: Family<Class, Counter>,
    give_ups: Family<Reason, Counter>,
    fallbacks: Family<Up, Counter>,
    gate_closures: Family<Up, Counter>,
    budget_refusals: Family<Up, Counter>,
    client_retries: Family<Up, Counter>,
    stream_aborts: Family<Reason, Counter>,
    resumes: Family<ResumeOutcome, Counter>,
    rejected: Family<Rejected, Counter>,
    upstream_latency: Family<Up, Histogram, fn() -> Histogram>,
    overhead: Histogram,
    in_flight: Gauge,
    buffered_body_bytes: Gauge,
    circuit_state: Family<TargetLabel, Gauge>,
    paced_scopes: Family<Up, Gauge>,
    pacing_rate: Family<Up, Gauge<f64, AtomicU64>>,
    pacing_wakes: Family<Wake, Counter>,
    token_paced_scopes: Family<Up, Gauge>,
    token_rate: Family<TokenLabel, Gauge<f64, AtomicU64>>,
    token_level: Family<TokenLabel, Gauge<f64, AtomicU64>>,
    token_waiting: Family<Up, Gauge>,
    token_waits: Family<Up, Counter>,
    /// The upstreams' fleets, whose own counters some metrics read when rendered.
    fleets: Mutex<Vec<(Up, Fleet)>>,
    /// The fallback layers with circuits, read when rendered: each with the label of every
    /// target of its chain, in chain order.
    circuits: Mutex<Vec<(String, ModelFallbackLayer, Vec<String>)>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("llm_retry_proxy"),
            requests: Family::default(),
            attempts: Family::default(),
            retries: Family::default(),
            give_ups: Family::default(),
            fallbacks: Family::default(),
            gate_closures: Family::default(),
            budget_refusals: Family::default(),
            client_retries: Family::default(),
            stream_aborts: Family::default(),
            resumes: Family::default(),
            rejected: Family::default(),
            upstream_latency: Family::new_with_constructor(latency),
            overhead: latency(),
            in_flight: Gauge::default(),
            buffered_body_bytes: Gauge::default(),
            circuit_state: Family::default(),
            paced_scopes: Family::default(),
            pacing_rate: Family::default(),
            pacing_wakes: Family::default(),
            token_paced_scopes: Family::default(),
            token_rate: Family::default(),
            token_level: Family::default(),
            token_waiting: Family::default(),
            token_waits: Family::default(),
            fleets: Mutex::new(Vec::new()),
            circuits: Mutex::new(Vec::new()),
        };
        let r = &mut m.registry;
        r.register(
            "requests",
            "Requests answered, by upstream and final status (client_gone: the client hung up before the end)",
            m.requests.clone(),
        );
        r.register("attempts", "Attempts sent upstream", m.attempts.clone());
        r.register(
            "retries",
            "Retries, by the class of the failure retried",
            m.retries.clone(),
        );
        r.register(
            "give_ups",
            "Requests the retry loop gave up on, by reason",
            m.give_ups.clone(),
        );
        r.register(
            "fallbacks",
            "Responses served by a fallback model",
            m.fallbacks.clone(),
        );
        r.register(
            "gate_closures",
            "Times an upstream's cooldown gate closed, or its closing was extended, over its tenants (the fleet's own count)",
            m.gate_closures.clone(),
        );
        r.register(
            "budget_refusals",
            "Retries the retry budget refused",
            m.budget_refusals.clone(),
        );
        r.register(
            "client_retries",
            "Requests that were a client's own retry (x-stainless-retry-count > 0)",
            m.client_retries.clone(),
        );
        r.register(
            "stream_aborts",
            "Responses cut after their head, by error kind",
            m.stream_aborts.clone(),
        );
        r.register(
            "resumes",
            "Continuations sent for streams cut after output, by outcome (resumed, failed)",
            m.resumes.clone(),
        );
        r.register(
            "rejected",
            "Requests the proxy refused itself, by reason",
            m.rejected.clone(),
        );
        r.register(
            "upstream_latency_seconds",
            "Time from sending an attempt to its response head",
            m.upstream_latency.clone(),
        );
        r.register(
            "overhead_seconds",
            "Proxy time to the response head minus the upstream's, single-attempt requests",
            m.overhead.clone(),
        );
        r.register("in_flight", "Requests being handled", m.in_flight.clone());
        r.register(
            "buffered_body_bytes",
            "Request-body bytes held, over every request being read or served",
            m.buffered_body_bytes.clone(),
        );
        r.register(
            "circuit_state",
            "The circuit of each fallback target (upstream/model): 0 closed, 1 half-open, 2 open",
            m.circuit_state.clone(),
        );
        r.register(
            "paced_scopes",
            "Tenants of an upstream whose pacing paces: it saw evidence of a rate limit their own rate meets, or it warms a new tenant up",
            m.paced_scopes.clone(),
        );
        r.register(
            "pacing_rate",
            "The pacing rates of an upstream's awake tenants, summed, in requests per second",
            m.pacing_rate.clone(),
        );
        r.register(
            "pacing_wakes",
            "Times a tenant's dormant pacing woke, by cause (rate_limit_headers, long_retry_after, quota_reset, refusal_share)",
            m.pacing_wakes.clone(),
        );
        r.register(
            "token_paced_scopes",
            "Tenants of an upstream whose token pacing is awake: a token limit was stated as nearly spent, or a 429 named one",
            m.token_paced_scopes.clone(),
        );
        r.register(
            "token_rate_per_minute",
            "The token limits an upstream's awake tenants believe, summed, by kind (input, output, combined), in tokens per minute",
            m.token_rate.clone(),
        );
        r.register(
            "token_bucket_level",
            "The tokens in hand in the awake tenants' buckets, summed, by kind (below zero: owed for answers that used more than their estimate)",
            m.token_level.clone(),
        );
        r.register(
            "token_waiting",
            "Requests of an upstream in line for tokens now",
            m.token_waiting.clone(),
        );
        r.register(
            "token_waits",
            "Requests of an upstream that waited for tokens",
            m.token_waits.clone(),
        );
        m
    }

    /// Reads the circuits of `layer`, the fallback layer of `upstream`, when rendering;
    /// `targets` labels its chain's targets in order.
    pub(crate) fn watch_circuits(
        &self,
        upstream: &str,
        layer: ModelFallbackLayer,
        targets: Vec<String>,
    ) {
        self.circuits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((upstream.into(), layer, targets));
    }

    /// Reads `fleet`'s own counters for `upstream` when rendering.
    pub(crate) fn watch_fleet(&self, upstream: &str, fleet: Fleet) {
        let up = Up {
            upstream: upstream.into(),
        };
        self.fleets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((up, fleet));
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        {
            // Under the lock, so that two renders do not both add what the fleet counted.
            let fleets = self.fleets.lock().unwrap_or_else(PoisonError::into_inner);
            for (up, fleet) in fleets.iter() {
                // A fleet's sums only grow (a scope dropped to make room keeps its counts).
                if let Some(closings) = fleet.gate_closings() {
                    let counter = self.gate_closures.get_or_create(up);
                    let seen = counter.get();
                    if closings > seen {
                        counter.inc_by(closings - seen);
                    }
                }
                if let Some(t) = fleet.token_pacing() {
                    self.token_paced_scopes
                        .get_or_create(up)
                        .set(i64::try_from(t.awake).unwrap_or(i64::MAX));
                    self.token_waiting
                        .get_or_create(up)
                        .set(i64::try_from(t.waiting).unwrap_or(i64::MAX));
                    let counter = self.token_waits.get_or_create(up);
                    let seen = counter.get();
                    if t.waited > seen {
                        counter.inc_by(t.waited - seen);
                    }
                    for kind in TokenKind::ALL {
                        let label = TokenLabel {
                            upstream: up.upstream.clone(),
                            kind: kind.as_str().into(),
                        };
                        let bucket = t.bucket(kind).unwrap_or_default();
                        self.token_rate.get_or_create(&label).set(bucket.per_minute);
                        self.token_level.get_or_create(&label).set(bucket.level);
                    }
                }
                if let Some(wakes) = fleet.pacing_wakes() {
                    self.paced_scopes
                        .get_or_create(up)
                        .set(i64::try_from(fleet.paced_scopes()).unwrap_or(i64::MAX));
                    self.pacing_rate
                        .get_or_create(up)
                        .set(fleet.pace().unwrap_or(0.0));
                    for (cause, n) in wakes {
                        let counter = self.pacing_wakes.get_or_create(&Wake {
                            upstream: up.upstream.clone(),
                            cause: cause.as_str().into(),
                        });
                        let seen = counter.get();
                        if n > seen {
                            counter.inc_by(n - seen);
                        }
                    }
                }
            }
        }
        {
            let circuits = self.circuits.lock().unwrap_or_else(PoisonError::into_inner);
            for (upstream, layer, targets) in circuits.iter() {
                for (status, target) in layer.circuit_states().iter().zip(targets) {
                    let state = match status.state {
                        CircuitState::Closed => 0,
                        CircuitState::HalfOpen { .. } => 1,
                        _ => 2,
                    };
                    self.circuit_state
                        .get_or_create(&TargetLabel {
                            upstream: upstream.clone(),
                            target: target.clone(),
                        })
                        .set(state);
                }
            }
        }
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The per-request series of `upstream`, looked up once: each is made on its first use,
    /// as [`request`](Self::request) makes its own, so the
    /// exposition is the same.
    pub(crate) fn series(&self, upstream: &str) -> Arc<UpstreamSeries> {
        Arc::new(UpstreamSeries {
            label: Up {
                upstream: upstream.into(),
            },
            requests: self.requests.clone(),
            attempts: self.attempts.clone(),
            upstream_latency: self.upstream_latency.clone(),
            ok: OnceLock::new(),
            attempt: OnceLock::new(),
            latency: OnceLock::new(),
        })
    }

    pub(crate) fn request(&self, upstream: &str, status: u16) {
        self.requests
            .get_or_create(&Req {
                upstream: upstream.into(),
                status: Outcome::Status(status),
            })
            .inc();
    }

    /// A request whose client hung up before its response head, or before its body's end.
    pub(crate) fn client_gone(&self, upstream: &str) {
        self.requests
            .get_or_create(&Req {
                upstream: upstream.into(),
                status: Outcome::ClientGone,
            })
            .inc();
    }

    pub(crate) fn fallback(&self, upstream: &str) {
        self.fallbacks
            .get_or_create(&Up {
                upstream: upstream.into(),
            })
            .inc();
    }

    pub(crate) fn client_retry(&self, upstream: &str) {
        self.client_retries
            .get_or_create(&Up {
                upstream: upstream.into(),
            })
            .inc();
    }

    pub(crate) fn client_retry_refused(&self, upstream: &str) {
        self.budget_refusals
            .get_or_create(&Up {
                upstream: upstream.into(),
            })
            .inc();
    }

    pub(crate) fn stream_abort(&self, upstream: &str, kind: &str) {
        self.stream_aborts
            .get_or_create(&Reason {
                upstream: upstream.into(),
                reason: kind.into(),
            })
            .inc();
    }

    pub(crate) fn resume(&self, upstream: &str, outcome: &str) {
        self.resumes
            .get_or_create(&ResumeOutcome {
                upstream: upstream.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    pub(crate) fn rejected(&self, reason: &str) {
        self.rejected
            .get_or_create(&Rejected {
                reason: reason.into(),
            })
            .inc();
    }

    pub(crate) fn overhead(&self, d: Duration) {
        self.overhead.observe(d.as_secs_f64());
    }

    pub(crate) fn in_flight(&self) -> &Gauge {
        &self.in_flight
    }

    pub(crate) fn buffered_body_bytes(&self) -> &Gauge {
        &self.buffered_body_bytes
    }
}

/// One upstream's per-request series, held by the handler and the stack: the label is not
/// made, hashed and looked up again on every request. Only `200`, the status nearly every
/// request ends with, has its own handle; any other goes through the family.
pub(crate) struct UpstreamSeries {
    label: Up,
    requests: Family<Req, Counter>,
    attempts: Family<Up, Counter>,
    upstream_latency: Family<Up, Histogram, fn() -> Histogram>,
    ok: OnceLock<Counter>,
    attempt: OnceLock<Counter>,
    latency: OnceLock<Histogram>,
}

impl std::fmt::Debug for UpstreamSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamSeries")
            .field("upstream", &self.label.upstream)
            .finish_non_exhaustive()
    }
}

impl UpstreamSeries {
    /// [`Metrics::request`] for this upstream.
    pub(crate) fn request(&self, status: u16) {
        let req = |status| Req {
            upstream: self.label.upstream.clone(),
            status: Outcome::Status(status),
        };
        if status == 200 {
            self.ok
                .get_or_init(|| self.requests.get_or_create(&req(200)).clone())
                .inc();
        } else {
            self.requests.get_or_create(&req(status)).inc();
        }
    }

    /// An attempt sent to this upstream, and how long it took to its response head.
    pub(crate) fn attempt(&self, latency: Duration) {
        self.attempt
            .get_or_init(|| self.attempts.get_or_create(&self.label).clone())
            .inc();
        self.latency
            .get_or_init(|| self.upstream_latency.get_or_create(&self.label).clone())
            .observe(latency.as_secs_f64());
    }
}

/// The library's retry events, counted for one upstream.
#[derive(Debug, Clone)]
pub struct Observer {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) upstream: String,
}

/// A stable name for a give-up reason.
pub fn reason_name(r: GiveUpReason) -> &'static str {
    match r {
        GiveUpReason::NotRetryable => "not_retryable",
        GiveUpReason::MaxRetries => "max_retries",
        GiveUpReason::RetryAfterTooLong => "retry_after_too_long",
        GiveUpReason::NotReplaySafe => "not_replay_safe",
        GiveUpReason::MaxConsecutiveOverloads => "max_consecutive_overloads",
        GiveUpReason::Budget => "budget",
        GiveUpReason::Cancelled => "cancelled",
        GiveUpReason::Deadline => "deadline",
        GiveUpReason::PacingWaitTooLong => "pacing_wait_too_long",
        _ => "other",
    }
}

impl RetryObserver for Observer {
    fn on_retry(&self, event: &RetryEvent<'_>) {
        self.metrics
            .retries
            .get_or_create(&Class {
                upstream: self.upstream.clone(),
                class: event.class.as_str().into(),
            })
            .inc();
    }

    fn on_give_up(&self, trail: &RetryTrail) {
        let reason = trail.gave_up().map_or("other", reason_name);
        if trail.gave_up() == Some(GiveUpReason::Budget) {
            self.metrics
                .budget_refusals
                .get_or_create(&Up {
                    upstream: self.upstream.clone(),
                })
                .inc();
        }
        self.metrics
            .give_ups
            .get_or_create(&Reason {
                upstream: self.upstream.clone(),
                reason: reason.into(),
            })
            .inc();
    }
}
