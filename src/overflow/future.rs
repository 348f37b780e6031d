use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use serde::Deserialize;
use tower_service::Service;

use super::layer::Config;
use super::{ContextWindowExceeded, OverflowRepaired};
use crate::body::ReplayBody;
use crate::json_edit;
use crate::pipeline::{AttemptContext, Companion, Judged, Link, Question};
use crate::provider::error_body::Overflow;

pin_project! {
    /// The response future of [`ContextOverflow`](super::ContextOverflow).
    pub struct ResponseFuture<F> {
        #[pin]
        future: F,
        // Inside a retry loop: what the loop is asked about a `400` or `413`.
        ctx: Option<LoopCtx>,
    }
}

struct LoopCtx {
    config: Arc<Config>,
    link: Link,
    /// The body sent, for the repair.
    sent: Option<Bytes>,
    /// The repair this send carries (boxed: rare, and the future stays small).
    repaired: Option<Box<OverflowRepaired>>,
}

impl<F> ResponseFuture<F> {
    #[inline]
    pub(crate) fn new<S>(service: &mut S, config: Arc<Config>, req: Request<ReplayBody>) -> Self
    where
        S: Service<Request<ReplayBody>, Future = F>,
    {
        let Some(link) = AttemptContext::link_of(req.extensions()).cloned() else {
            // No loop around it: nothing to repair with, the request goes as it is.
            return ResponseFuture {
                future: service.call(req),
                ctx: None,
            };
        };
        let (parts, body) = req.into_parts();
        // Every send after a repair carries it.
        let repair = link.carried().repair.clone();
        let body = repair
            .as_ref()
            .and_then(|r| apply(&body, r))
            .unwrap_or(body);
        let sent = body.as_bytes().cloned();
        // The service was polled ready before `call`.
        let future = service.call(crate::body::request(parts, body));
        ResponseFuture {
            future,
            ctx: Some(LoopCtx {
                config,
                link,
                sent,
                repaired: repair.map(Box::new),
            }),
        }
    }
}

impl<F, ResBody, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
{
    type Output = Result<Response<ResBody>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut res = ready!(this.future.poll(cx))?;
        let Some(ctx) = this.ctx.take() else {
            return Poll::Ready(Ok(res));
        };
        if let Some(repaired) = ctx.repaired {
            res.extensions_mut().insert(*repaired);
        }
        if matches!(
            res.status(),
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE
        ) {
            ctx.link.ask(OverflowJudge {
                config: ctx.config,
                sent: ctx.sent,
            });
        }
        Poll::Ready(Ok(res))
    }
}

impl<F> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let repaired = self.ctx.as_ref().is_some_and(|c| c.repaired.is_some());
        f.debug_struct("ResponseFuture")
            .field("repaired", &repaired)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Thinking {
    budget_tokens: Option<u64>,
}

/// The repair for an overflow of a request with body `bytes`, if there is one: a smaller
/// `max_tokens` that fits, or else the context-window fallback model.
fn plan_repair(config: &Config, bytes: &[u8], overflow: Overflow) -> Option<OverflowRepaired> {
    if let Overflow::MaxTokens { input, limit, .. } = overflow {
        if let Some((from, to)) = smaller_max_tokens(config, bytes, input, limit) {
            tracing::info!(
                input_tokens = input,
                context_limit = limit,
                from,
                to,
                "max_tokens exceeds the context window; re-sending with less"
            );
            return Some(OverflowRepaired::MaxTokens { from, to });
        }
    }
    let to = config.context_window_fallback.as_deref()?;
    let from = json_edit::read_value::<String>(bytes, "model")?;
    if from == to {
        return None;
    }
    tracing::info!(
        from = from.as_str(),
        to,
        "the request does not fit the context window; re-sending to a larger one"
    );
    Some(OverflowRepaired::Model {
        from,
        to: to.to_owned(),
    })
}

/// `body` with `repair` made: one top-level value replaced, every other byte as it was.
fn apply(body: &ReplayBody, repair: &OverflowRepaired) -> Option<ReplayBody> {
    let bytes = body.as_bytes()?;
    let data = match repair {
        OverflowRepaired::MaxTokens { to, .. } => json_edit::replace_value(bytes, "max_tokens", to),
        OverflowRepaired::Model { to, .. } => json_edit::replace_value(bytes, "model", to),
    }?;
    body.with_data(data)
}

/// Inside a retry loop: a `400` or `413` that may be a context overflow, judged once the loop
/// has read its body and classified it.
struct OverflowJudge {
    config: Arc<Config>,
    sent: Option<Bytes>,
}

impl Companion for OverflowJudge {
    fn wants_body(&self, _: &http::response::Parts) -> bool {
        true
    }

    fn judge(&self, q: &mut Question<'_>) -> Judged {
        let Some(overflow) = q.class.overflow() else {
            return Judged::Pass;
        };
        // One repair a request: a second overflow goes back with its numbers.
        if q.carried.repair.is_none() {
            let repair = (self.sent.as_ref()).and_then(|b| plan_repair(&self.config, b, overflow));
            if let Some(repair) = repair {
                q.carried.repair = Some(repair);
                return Judged::Resend;
            }
        }
        let overflow = ContextWindowExceeded::from(overflow);
        tracing::debug!(
            input_tokens = overflow.input_tokens,
            context_limit = overflow.limit,
            "the request does not fit the context window"
        );
        q.head.extensions.insert(overflow);
        Judged::Pass
    }
}

/// `max_tokens` as sent and as it should be, when lowering it makes the request fit.
fn smaller_max_tokens(config: &Config, bytes: &[u8], input: u64, limit: u64) -> Option<(u64, u64)> {
    let from: u64 = json_edit::read_value(bytes, "max_tokens")?;
    // At least one token whatever the floor: the APIs refuse `max_tokens: 0`.
    let mut to = limit
        .saturating_sub(input)
        .saturating_sub(config.margin)
        .max(config.floor)
        .max(1);
    let budget = json_edit::read_value::<Thinking>(bytes, "thinking").and_then(|t| t.budget_tokens);
    if let Some(budget) = budget {
        to = to.max(budget.saturating_add(1));
    }
    // Only a smaller value that fits is worth a request.
    (to < from && input.saturating_add(to) <= limit).then_some((from, to))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(floor: u64, margin: u64) -> Config {
        Config {
            floor,
            margin,
            context_window_fallback: None,
        }
    }

    #[test]
    fn a_repair_never_sends_zero_tokens() {
        let body = br#"{"model":"m","max_tokens":4096,"messages":[]}"#;
        // No room left after the margin, and a floor of 0: one token, not zero.
        assert_eq!(
            smaller_max_tokens(&config(0, 1_000), body, 199_000, 200_000),
            Some((4096, 1))
        );
        // The usual case: what is left below the limit, less the margin.
        assert_eq!(
            smaller_max_tokens(&config(3_000, 1_000), body, 190_000, 200_000),
            None,
            "9,000 left is more than was asked for: nothing to repair"
        );
        assert_eq!(
            smaller_max_tokens(&config(1_000, 1_000), body, 197_000, 200_000),
            Some((4096, 2_000))
        );
        // Not even the floor fits: no repair.
        assert_eq!(
            smaller_max_tokens(&config(3_000, 1_000), body, 198_000, 200_000),
            None
        );
    }
}
