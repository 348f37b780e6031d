use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response, Uri};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use super::circuit::Admit;
use super::layer::{Config, Counted};
use super::{FallbackMode, ModelUsed, TargetAttempts};
#[cfg(feature = "auth")]
use crate::auth::TargetCredential;
use crate::body::ReplayBody;
use crate::error::{Error, ErrorKind, FallbackTriggered};
use crate::json_edit;
#[cfg(feature = "overflow")]
use crate::overflow::OverflowRepaired;
use crate::pipeline::{AttemptContext, Companion, Judged, Link, Question};

pin_project! {
    /// The response future of [`ModelFallback`](super::ModelFallback).
    pub struct ResponseFuture<F> {
        #[pin]
        future: F,
        planner: Planner,
    }
}

impl<F> ResponseFuture<F> {
    #[inline]
    pub(crate) fn new<S>(service: &mut S, config: Arc<Config>, req: Request<ReplayBody>) -> Self
    where
        S: Service<Request<ReplayBody>, Future = F>,
    {
        let (mut parts, body) = req.into_parts();
        let ctx = parts.extensions.get::<AttemptContext>();
        if ctx.is_none() {
            config.state.warn_outside_once();
        }
        let mut planner = Planner {
            config,
            overloads: ctx.map_or(0, |c| c.consecutive_overloads),
            link: ctx.and_then(|c| c.link.clone()),
            head_timeout: ctx.and_then(|c| c.head_timeout),
            plan: None,
            span: Span::none(),
        };
        let body = planner.plan(&mut parts, body);
        let future = {
            let _enter = planner.span.enter();
            // The service was polled ready before `call`.
            service.call(crate::body::request(parts, body))
        };
        ResponseFuture { future, planner }
    }
}

impl<F, ResBody, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
{
    type Output = Result<Response<ResBody>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let planner = this.planner;
        let result = {
            let _enter = planner.span.enter();
            ready!(this.future.poll(cx))
        };
        let res = match result {
            Ok(res) => res,
            Err(e) => {
                planner.failed_without_response();
                return Poll::Ready(Err(e));
            }
        };
        if let (Some(judge), Some(link)) = (planner.judge_for(res.status()), &planner.link) {
            link.ask(judge);
        }
        Poll::Ready(Ok(planner.finish(res)))
    }
}

impl<F> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("model", &self.planner.plan.as_ref().map(|p| &p.sent))
            .finish_non_exhaustive()
    }
}

/// The target of an attempt, and what the answer means for the next.
struct Planner {
    config: Arc<Config>,
    /// Overloads in a row just before this attempt, from the retry loop.
    overloads: u32,
    /// Inside a retry loop: the loop's handle for this send.
    link: Option<Link>,
    /// This attempt's head timeout, as the loop armed it.
    head_timeout: Option<Duration>,
    plan: Option<Plan>,
    span: Span,
}

/// Which target this attempt goes to.
struct Plan {
    requested: String,
    sent: String,
    /// How far down the chain `sent` is: 0 for the requested model.
    level: usize,
    /// Where the requested model is in the chain, if it is.
    own: Option<usize>,
    /// How many fallbacks the request has.
    last: usize,
    /// The upstream the request was moved to, if it was.
    upstream: Option<Uri>,
    /// What the target's circuit is still to be told.
    verdict: Verdict,
    /// When the attempt was sent, while a circuit watches the target.
    sent_at: Option<Instant>,
}

/// Inside a retry loop: at a trigger, the next attempt goes one target down the chain (the
/// loop carries the failures it is replayed from), the caller is told to switch (signal
/// mode), or, at the end of the chain after overloads, the response goes back without a
/// retry. It also tells the target's circuit how the attempt went.
struct FallbackJudge {
    config: Arc<Config>,
    requested: String,
    sent: String,
    level: usize,
    /// How many fallbacks the request has.
    last: usize,
    next: Option<String>,
    verdict: Verdict,
    span: Span,
}

impl Companion for FallbackJudge {
    fn judge(&self, q: &mut Question<'_>) -> Judged {
        let triggers = &self.config.triggers;
        // The loop's classification, as the loop will record this failure.
        let failed = q.failure(Some(self.level as u32));
        let (_, mut streak) = triggers.replay(&q.carried.failures, self.last);
        let counted = match failed {
            Some(f) => triggers.count(&mut streak, &f),
            None => Counted {
                fires: false,
                by_overload: false,
                of_trigger_class: false,
            },
        };
        self.verdict.resolve(counted.of_trigger_class);
        if !counted.fires {
            return Judged::Pass;
        }
        match (self.config.mode, &self.next) {
            (FallbackMode::Signal, Some(next)) => {
                tracing::info!(
                    parent: &self.span,
                    from = self.sent.as_str(),
                    to = next.as_str(),
                    "model overloaded; signalling the caller to fall back"
                );
                let signal = FallbackTriggered::new(self.sent.clone(), next.as_str());
                Judged::Final(Error::new(ErrorKind::FallbackTriggered).with_source(signal))
            }
            (FallbackMode::Rewrite, Some(next)) => {
                if let Some(cooldown) = self.config.sticky {
                    let until = crate::time::after(Instant::now(), cooldown);
                    self.config
                        .state
                        .raise(&self.requested, self.level + 1, until);
                }
                tracing::debug!(
                    parent: &self.span,
                    from = self.sent.as_str(),
                    to = next.as_str(),
                    "error.type" = failed.map_or("", |f| f.class.as_str()),
                    "the next attempt falls back"
                );
                Judged::Step
            }
            (_, None) if counted.by_overload => {
                tracing::warn!(
                    parent: &self.span,
                    model = self.sent.as_str(),
                    requested = self.requested.as_str(),
                    "every model of the fallback chain is overloaded"
                );
                if let Some(used) = q.head.extensions.get_mut::<ModelUsed>() {
                    used.chain_exhausted = true;
                }
                Judged::Keep
            }
            // Other triggers at the last target: the policy goes on there.
            (_, None) => Judged::Pass,
        }
    }
}

/// An attempt that failed before a response head, for its target's circuit.
struct NoResponse {
    verdict: Verdict,
    /// A transport failure counts against the circuit (the failure trigger is on).
    counts: bool,
    /// A failure to connect counts against the circuit (the connect-failure trigger is on).
    connects: bool,
}

impl Companion for NoResponse {
    fn judge(&self, _: &mut Question<'_>) -> Judged {
        Judged::Pass
    }

    fn failed(&self, error: &(dyn std::error::Error + 'static)) {
        let final_error = error.downcast_ref::<Error>().is_some_and(Error::is_final);
        if !final_error {
            self.verdict
                .resolve(self.counts || (self.connects && failed_to_connect(error)));
        }
    }
}

/// Whether `error` proves the attempt never got a connection to send on: the default test
/// of [`Classify::request_not_sent`](crate::classify::Classify::request_not_sent), less the
/// HTTP/2 proofs, which come on a connection that was up.
fn failed_to_connect(error: &(dyn std::error::Error + 'static)) -> bool {
    crate::classify::request_not_sent(error) && !crate::classify::never_processed(error)
}

/// What an attempt tells its target's circuit, once: a probe that ends with no answer frees
/// the probe slot.
struct Verdict {
    config: Arc<Config>,
    /// The target's index in the chain, when a circuit watches it.
    index: Option<usize>,
    probe: bool,
    told: AtomicBool,
}

impl Verdict {
    fn none(config: Arc<Config>) -> Self {
        Verdict {
            config,
            index: None,
            probe: false,
            told: AtomicBool::new(true),
        }
    }

    /// Tells the circuit: a failure of a trigger class, or an answer.
    fn resolve(&self, failure: bool) {
        let Some(i) = self.index else { return };
        if self.told.swap(true, Ordering::AcqRel) {
            return;
        }
        let (Some(circuit), Some(target)) = (&self.config.circuit, self.config.chain.get(i)) else {
            return;
        };
        let state = &self.config.circuits[i];
        if failure {
            state.failed(self.probe, Instant::now(), circuit, &target.model);
        } else {
            state.succeeded(self.probe, &target.model);
        }
    }

    /// Hands the duty on (to the judge that will see the error body).
    fn take(&mut self) -> Verdict {
        let config = self.config.clone();
        std::mem::replace(self, Verdict::none(config))
    }
}

impl Drop for Verdict {
    fn drop(&mut self) {
        if self.probe && !*self.told.get_mut() {
            if let Some(i) = self.index {
                self.config.circuits[i].release_probe();
            }
        }
    }
}

impl Planner {
    /// The target after the one `plan` sends to, if the chain goes on.
    fn next(&self, plan: &Plan) -> Option<&str> {
        let fallbacks = self.config.fallbacks(plan.own);
        fallbacks.get(plan.level).map(|t| t.model.as_str())
    }

    /// The first level at or after `level` whose circuit takes the request now, and whether
    /// as its probe; `level` itself when every circuit is open.
    fn admit(&self, own: Option<usize>, level: usize, last: usize) -> (usize, Verdict) {
        let config = &self.config;
        if config.circuit.is_none() || config.mode == FallbackMode::Signal {
            return (level, Verdict::none(config.clone()));
        }
        let now = Instant::now();
        for l in level..=last {
            let Some(i) = config.index(own, l) else {
                return (l, Verdict::none(config.clone()));
            };
            let probe = match config.circuits[i].admit(now, &config.chain[i].model) {
                Admit::Go => false,
                Admit::Probe => true,
                Admit::Skip => continue,
            };
            let verdict = Verdict {
                config: config.clone(),
                index: Some(i),
                probe,
                told: AtomicBool::new(false),
            };
            return (l, verdict);
        }
        (level, Verdict::none(config.clone()))
    }

    /// Picks the target for this attempt and moves the request to it.
    fn plan(&mut self, parts: &mut http::request::Parts, body: ReplayBody) -> ReplayBody {
        let Some(bytes) = body.as_bytes() else {
            return body;
        };
        let Some(requested) = json_edit::read_value::<String>(bytes, "model") else {
            return body;
        };
        let config = self.config.clone();
        let own = config.own(&requested);
        let fallbacks = config.fallbacks(own);
        let last = fallbacks.len();
        let mut wanted = 0;
        if config.mode == FallbackMode::Rewrite {
            if let Some(link) = &self.link {
                wanted = config.triggers.replay(&link.carried().failures, last).0;
            }
            if config.sticky.is_some() {
                wanted = wanted.max(config.state.level(&requested, Instant::now()));
            }
            wanted = wanted.min(last);
        }
        let (mut level, mut verdict) = self.admit(own, wanted, last);
        let body = match level {
            0 => body,
            l if fallbacks[l - 1].model == requested => body,
            l => match json_edit::replace_value(bytes, "model", &fallbacks[l - 1].model)
                .and_then(|data| body.with_data(data))
            {
                Some(rewritten) => rewritten,
                None => {
                    level = 0;
                    verdict = Verdict::none(config.clone());
                    body
                }
            },
        };
        let sent = match level {
            0 => requested.clone(),
            l => fallbacks[l - 1].model.clone(),
        };
        let target = config.index(own, level).map(|i| &config.chain[i]);
        let mut upstream = None;
        if let Some(target) = target.filter(|t| t.moves_request()) {
            if let Some(up) = &target.upstream {
                if let Some(uri) = up.rewrite(&parts.uri) {
                    parts.uri = uri;
                    if parts.headers.contains_key(http::header::HOST) {
                        if let Some(host) = up.host() {
                            parts.headers.insert(http::header::HOST, host);
                        }
                    }
                    upstream = Some(up.base.clone());
                }
            }
            #[cfg(feature = "auth")]
            if let Some(source) = &target.credential {
                parts.extensions.insert(TargetCredential(source.clone()));
            }
        }
        self.span = tracing::debug_span!(
            "llm_fallback",
            "gen_ai.request.model" = sent.as_str(),
            "gen_ai.response.model" = tracing::field::Empty,
        );
        if level > wanted {
            tracing::info!(
                parent: &self.span,
                requested = requested.as_str(),
                to = sent.as_str(),
                skipped = level - wanted,
                "skipping targets whose circuits are open"
            );
        } else if level > 0 {
            tracing::info!(
                parent: &self.span,
                from = requested.as_str(),
                to = sent.as_str(),
                consecutive_overloads = self.overloads,
                "falling back to another model"
            );
        }
        let sent_at = verdict.index.map(|_| Instant::now());
        // Where this send goes, for the loop's record of it, whatever its answer or error.
        if let Some(link) = &self.link {
            link.record_level(level as u32);
        }
        self.plan = Some(Plan {
            requested,
            sent,
            level,
            own,
            last,
            upstream,
            verdict,
            sent_at,
        });
        body
    }

    /// Inside a retry loop: the question about an error response.
    fn judge_for(&mut self, status: http::StatusCode) -> Option<FallbackJudge> {
        if !(status.is_client_error() || status.is_server_error()) {
            return None;
        }
        self.link.as_ref()?;
        let next = self.next(self.plan.as_ref()?).map(str::to_owned);
        let plan = self.plan.as_mut()?;
        Some(FallbackJudge {
            config: self.config.clone(),
            requested: plan.requested.clone(),
            sent: plan.sent.clone(),
            level: plan.level,
            last: plan.last,
            next,
            verdict: plan.verdict.take(),
            span: self.span.clone(),
        })
    }

    /// The attempt failed before a response head: a transport failure of the target, for the
    /// failure trigger's circuit. The loop is told, which tells the circuit once it has read
    /// the error: an inner layer's own final error tells it nothing.
    fn failed_without_response(&mut self) {
        let Some(plan) = self.plan.take() else {
            return;
        };
        let failure = NoResponse {
            verdict: plan.verdict,
            counts: self.config.triggers.failures.is_some(),
            connects: self.config.triggers.connects.is_some(),
        };
        match &self.link {
            Some(link) => link.ask(failure),
            // Outside a loop, no one reads the error.
            None => failure.verdict.resolve(failure.counts),
        }
    }

    /// The response handed back, with the model that served it. A response the loop is
    /// asked about (an error) leaves the circuit's verdict to the question; anything else is
    /// an answer.
    fn finish<R>(&mut self, mut res: Response<R>) -> Response<R> {
        let Some(plan) = self.plan.take() else {
            return res;
        };
        plan.verdict.resolve(false);
        self.span
            .record("gen_ai.response.model", plan.sent.as_str());
        let attempts = self.attempts(&plan);
        // A layer inside (ContextOverflowLayer's context-window fallback) may have re-sent
        // the request to another model: the response came from that one.
        #[cfg(feature = "overflow")]
        let model = match res.extensions().get::<OverflowRepaired>() {
            Some(OverflowRepaired::Model { to, .. }) => to.clone(),
            _ => plan.sent.clone(),
        };
        #[cfg(not(feature = "overflow"))]
        let model = plan.sent.clone();
        res.extensions_mut().insert(ModelUsed {
            model,
            requested: plan.requested,
            chain_exhausted: false,
            upstream: plan.upstream,
            attempts,
        });
        res
    }

    /// Every target the request went to, with its number of attempts, when it took more than
    /// one attempt; none (no allocation) for a request answered by its first.
    fn attempts(&self, plan: &Plan) -> Vec<TargetAttempts> {
        let Some(link) = self
            .link
            .as_ref()
            .filter(|l| !l.carried().failures.is_empty())
        else {
            return Vec::new();
        };
        let mut out: Vec<TargetAttempts> = Vec::new();
        let fallbacks = self.config.fallbacks(plan.own);
        let mut count = |level: usize| {
            let (model, upstream) = match level {
                0 => {
                    let own = plan.own.map(|i| &self.config.chain[i]);
                    (
                        plan.requested.clone(),
                        own.and_then(|t| t.get_upstream().cloned()),
                    )
                }
                l => {
                    let t = &fallbacks[l - 1];
                    (t.model.clone(), t.get_upstream().cloned())
                }
            };
            match out
                .iter_mut()
                .find(|t| t.model == model && t.upstream == upstream)
            {
                Some(t) => t.attempts += 1,
                None => out.push(TargetAttempts {
                    model,
                    upstream,
                    attempts: 1,
                }),
            }
        };
        self.config
            .triggers
            .replay_each(&link.carried().failures, plan.last, &mut count);
        count(plan.level);
        out
    }
}

impl Drop for Planner {
    // The loop dropped the attempt in flight: at its head timeout, the target timed out.
    fn drop(&mut self) {
        let (Some(plan), Some(_)) = (self.plan.take(), self.link.as_ref()) else {
            return;
        };
        let triggers = &self.config.triggers;
        let (Some(sent_at), Some(timeout)) = (plan.sent_at, self.head_timeout) else {
            return;
        };
        if (triggers.timeouts.is_some() || triggers.failures.is_some())
            && Instant::now().saturating_duration_since(sent_at) >= timeout
        {
            plan.verdict.resolve(true);
        }
    }
}
