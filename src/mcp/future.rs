use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::header::CONTENT_TYPE;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::{McpBody, Tap};
use super::layer::Config;
use super::rpc::{self, Call};
use crate::body::{PrepareBody, ReplayBody};
use crate::error::{BoxError, Error, RetryTrail};
use crate::retry::policy::per_request;
use crate::retry::{NotReplaySafe, Override};

/// The MCP session header.
pub(crate) const SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");

pin_project! {
    /// The response future of [`McpGate`](super::McpGate).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<ReplayBody>>,
        B: Body,
        B::Error: Into<BoxError>,
    {
        #[pin]
        state: State<S::Future, B>,
        ctx: Ctx<S>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Preparing { #[pin] prepare: PrepareBody<B> },
        Calling { #[pin] future: F },
        Done,
    }
}

struct Ctx<S> {
    service: S,
    config: Arc<Config>,
    parts: Option<http::request::Parts>,
    /// The request is a `tools/list` whose answer is worth reading.
    tools_list: bool,
    /// The session id the request went out with.
    sent_session: Option<HeaderValue>,
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>>,
    B: Body,
    B::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("tools_list", &self.ctx.tools_list)
            .finish_non_exhaustive()
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    pub(crate) fn new(service: S, config: Arc<Config>, req: Request<B>) -> Self {
        let (parts, body) = req.into_parts();
        let prepare = PrepareBody::new(body, config.body_limit);
        ResponseFuture {
            state: State::Preparing { prepare },
            ctx: Ctx {
                service,
                config,
                parts: Some(parts),
                tools_list: false,
                sent_session: None,
            },
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body,
{
    type Output = Result<Response<McpBody<ResBody>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let ctx = this.ctx;
        loop {
            match this.state.as_mut().project() {
                StateProj::Preparing { prepare } => {
                    let body = match ready!(prepare.poll(cx)) {
                        Ok(body) => body,
                        Err(e) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e.into()));
                        }
                    };
                    let mut parts = ctx.parts.take().expect("the head is kept until sent");
                    let call = body.as_bytes().map(|b| rpc::read_call(b));
                    ctx.mark(&mut parts, call);
                    // The service was polled ready before `call`.
                    let future = ctx.service.call(Request::from_parts(parts, body));
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let result = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(match result {
                        Ok(res) => Ok(ctx.respond(res)),
                        Err(e) => {
                            let e: BoxError = e.into();
                            let trail = e.downcast_ref::<Error>().and_then(Error::trail);
                            ctx.record(trail);
                            Err(e)
                        }
                    });
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S> Ctx<S> {
    /// Marks the request for `RetryLayer` and gives it the session id.
    fn mark(&mut self, parts: &mut http::request::Parts, call: Option<Call>) {
        let config = &self.config;
        let session = &config.session;
        let left = session.resends_left(config.reconnect_attempts, config.reconnect_window);
        // The retries the request would have: its own policy, override and `NoRetry` on the
        // gate's copy of `RetryLayer`'s policy.
        let base_max = per_request(&parts.extensions, &config.policy)
            .as_ref()
            .unwrap_or(&config.policy)
            .get_max_retries();
        let (max, replay_safe, tool_call) = match &call {
            // Too large to read, or not readable: it may be anything, so it is sent as if it
            // mattered.
            None | Some(Call::Unreadable) => (base_max, false, false),
            Some(Call::Tools(names)) => {
                let safe = names.iter().all(|n| self.annotations(n).is_replay_safe());
                tracing::debug!(tools = ?names, replay_safe = safe, "MCP tools/call");
                if safe {
                    (base_max.min(1), true, true)
                } else {
                    (base_max, false, true)
                }
            }
            Some(Call::Other { .. } | Call::NotRpc) => (base_max, true, false),
        };
        let max = max.min(left);
        if !replay_safe {
            parts.extensions.insert(NotReplaySafe);
        }
        if max != base_max || (tool_call && replay_safe) {
            // Only the count changes: everything else of `RetryLayer`'s policy still applies.
            let changes = parts.extensions.get::<Override>().copied();
            parts
                .extensions
                .insert(changes.unwrap_or_default().max_retries(max));
        }

        let initialize = matches!(
            call,
            Some(Call::Other {
                initialize: true,
                ..
            })
        );
        // An `initialize` starts a session: it never carries the old one.
        if !initialize && !parts.headers.contains_key(&SESSION_ID) {
            if let Some(id) = session.id() {
                parts.headers.insert(SESSION_ID, id);
            }
        }
        self.sent_session = parts.headers.get(&SESSION_ID).cloned();
        self.tools_list = config.learn
            && matches!(
                call,
                Some(Call::Other {
                    tools_list: true,
                    ..
                })
            );
    }

    /// The annotations of a tool: the caller's, else what a `tools/list` said, else none.
    fn annotations(&self, name: &str) -> super::ToolAnnotations {
        let config = &self.config;
        config
            .tools
            .get(name)
            .copied()
            .or_else(|| {
                config
                    .learn
                    .then(|| config.session.annotations(name))
                    .flatten()
            })
            .unwrap_or_default()
    }

    fn record(&self, trail: Option<&RetryTrail>) {
        if let Some(trail) = trail {
            let config = &self.config;
            config
                .session
                .record_resends(trail.retries(), config.reconnect_window);
        }
    }

    fn respond<R>(&mut self, res: Response<R>) -> Response<McpBody<R>> {
        let (head, body) = res.into_parts();
        self.record(head.extensions.get::<RetryTrail>());
        let session = &self.config.session;
        if let Some(id) = head.headers.get(&SESSION_ID) {
            session.set_id(Some(id.clone()));
        } else if head.status == http::StatusCode::NOT_FOUND {
            // The server no longer knows the session: the next request must `initialize`.
            if let Some(sent) = &self.sent_session {
                session.expire(sent);
            }
        }
        let tap = if self.tools_list && head.status.is_success() {
            let content_type = head
                .headers
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .trim_start()
                .to_ascii_lowercase();
            if content_type.starts_with("text/event-stream") {
                Some(Tap::sse(self.config.clone()))
            } else if content_type.starts_with("application/json") {
                Some(Tap::json(self.config.clone()))
            } else {
                None
            }
        } else {
            None
        };
        Response::from_parts(head, McpBody::new(body, tap))
    }
}
