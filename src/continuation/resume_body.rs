use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::resume::Splice;
use super::{ResumeOutcome, ResumeWith, RESUME_PROMPT};
use crate::error::{BoxError, Error, ErrorKind};
use crate::json_edit;
use crate::stream::is_event_stream;

type OnOutcome = Box<dyn FnOnce(ResumeOutcome) + Send>;

pin_project! {
    /// A streamed answer (Anthropic Messages or OpenAI Chat Completions) that, when cut after
    /// output, is continued through `S` and spliced into one stream. See the
    /// [module docs](super#resuming-a-cut-stream).
    ///
    /// It forwards the answer's events whole (an event still arriving is held back until its
    /// blank line comes). When the answer's body fails, or ends without its protocol's
    /// terminal event, after text output and with no tool call in it, it sends a follow-up
    /// through `S` and yields the follow-up's events rewritten to carry on the same message.
    /// When that cannot be done, or the follow-up fails, the body ends with the answer's own
    /// error, as it would have without this wrapper.
    pub struct ResumeBody<B, S>
    where
        S: Service<Request<Full<Bytes>>>,
    {
        #[pin]
        inner: B,
        state: State<S::Future>,
        splice: Splice,
        service: S,
        request: Request<Bytes>,
        with: ResumeWith,
        prompt: Arc<str>,
        model: Option<String>,
        on_outcome: Option<OnOutcome>,
    }
}

enum State<F> {
    /// The answer's own body.
    Original,
    /// The follow-up waits for the service to be ready; `error` is the cut's.
    Ready {
        body: Bytes,
        with: ResumeWith,
        error: BoxError,
    },
    /// The follow-up is on its way.
    Calling {
        future: Pin<Box<F>>,
        with: ResumeWith,
        error: BoxError,
    },
    /// The follow-up's events, rewritten.
    Continuing {
        body: UnsyncBoxBody<Bytes, BoxError>,
        error: BoxError,
    },
    /// The held-back bytes went out; the error follows.
    Failing(Option<BoxError>),
    Done,
}

impl<B, S> ResumeBody<B, S>
where
    S: Service<Request<Full<Bytes>>>,
{
    /// Wraps `body`, the streamed answer to `request` (its body whole), so that a cut is
    /// continued through `service` with the same method, URI, headers and extensions, the
    /// partial text sent back as `with` says.
    pub fn new(body: B, service: S, request: Request<Bytes>, with: ResumeWith) -> Self {
        ResumeBody {
            inner: body,
            state: State::Original,
            splice: Splice::new(),
            service,
            request,
            with,
            prompt: Arc::from(RESUME_PROMPT),
            model: None,
            on_outcome: None,
        }
    }

    /// The `model` the follow-up asks for: the one that served the answer, when a fallback
    /// chain may have changed it. Defaults to the request's own.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// The user turn of an instruction follow-up. Defaults to [`RESUME_PROMPT`].
    pub fn prompt(mut self, text: impl Into<String>) -> Self {
        self.prompt = Arc::from(text.into());
        self
    }

    /// Told once whether a continuation that was sent made the answer whole. Not called when
    /// none was sent (the answer ended well, or could not be resumed). Defaults to none.
    pub fn on_outcome(mut self, f: impl FnOnce(ResumeOutcome) + Send + 'static) -> Self {
        self.on_outcome = Some(Box::new(f));
        self
    }
}

/// The follow-up request: `request`'s head and extensions with `body`.
fn follow_up(request: &Request<Bytes>, body: Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = request.method().clone();
    *req.uri_mut() = request.uri().clone();
    *req.version_mut() = request.version();
    *req.headers_mut() = request.headers().clone();
    // The body grew: its length is the body's own.
    req.headers_mut().remove(CONTENT_LENGTH);
    *req.extensions_mut() = request.extensions().clone();
    req
}

impl<B, S, R> Body for ResumeBody<B, S>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    S: Service<Request<Full<Bytes>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        loop {
            match this.state {
                State::Original => {
                    let error: BoxError = match ready!(this.inner.as_mut().poll_frame(cx)) {
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(data) => {
                                let out = this.splice.original(&data);
                                if out.is_empty() {
                                    continue;
                                }
                                return Poll::Ready(Some(Ok(Frame::data(out))));
                            }
                            Err(frame) => return Poll::Ready(Some(Ok(frame))),
                        },
                        Some(Err(e)) => e.into(),
                        None if this.splice.resumable() => {
                            // A clean end without the terminal event is a cut too.
                            Error::new(ErrorKind::IncompleteStream).into()
                        }
                        None => {
                            *this.state = State::Done;
                            let rest = this.splice.original_rest();
                            if rest.is_empty() {
                                return Poll::Ready(None);
                            }
                            return Poll::Ready(Some(Ok(Frame::data(rest))));
                        }
                    };
                    let next = if this.splice.resumable() {
                        let body = this.request.body();
                        let body = match this.model.as_deref() {
                            Some(m) => json_edit::replace_value(body, "model", m)
                                .unwrap_or_else(|| body.clone()),
                            None => body.clone(),
                        };
                        this.splice.follow_up(&body, *this.with, this.prompt)
                    } else {
                        None
                    };
                    match next {
                        Some((body, with)) => {
                            tracing::debug!(?with, "resuming a cut stream");
                            *this.state = State::Ready { body, with, error };
                        }
                        None => {
                            let rest = this.splice.original_rest();
                            *this.state = State::Failing(Some(error));
                            if !rest.is_empty() {
                                return Poll::Ready(Some(Ok(Frame::data(rest))));
                            }
                        }
                    }
                }
                State::Ready { .. } => {
                    let ready = ready!(this.service.poll_ready(cx));
                    let State::Ready { body, with, error } =
                        std::mem::replace(this.state, State::Done)
                    else {
                        unreachable!("matched above")
                    };
                    if let Err(e) = ready {
                        let e: BoxError = e.into();
                        tracing::warn!(error = %e, "the continuation of a cut stream failed");
                        fail(this.on_outcome, this.state, error);
                        continue;
                    }
                    let future = Box::pin(this.service.call(follow_up(this.request, body)));
                    *this.state = State::Calling {
                        future,
                        with,
                        error,
                    };
                }
                State::Calling { future, .. } => {
                    let result = ready!(future.as_mut().poll(cx));
                    let State::Calling { with, error, .. } =
                        std::mem::replace(this.state, State::Done)
                    else {
                        unreachable!("matched above")
                    };
                    let res = match result {
                        Ok(res) => res,
                        Err(e) => {
                            let e: BoxError = e.into();
                            tracing::warn!(error = %e, "the continuation of a cut stream failed");
                            fail(this.on_outcome, this.state, error);
                            continue;
                        }
                    };
                    let (head, body) = res.into_parts();
                    if head.status.is_success() && is_event_stream(&head) {
                        *this.state = State::Continuing {
                            body: body.map_err(Into::into).boxed_unsync(),
                            error,
                        };
                        continue;
                    }
                    if head.status == StatusCode::BAD_REQUEST && with == ResumeWith::Prefill {
                        // A model that takes no prefill: the same text as an instruction, to
                        // the model that refused it (a fallback chain may have moved the
                        // prefill on), not back to the start of the chain.
                        #[cfg(feature = "fallback")]
                        let refused_by = head
                            .extensions
                            .get::<crate::fallback::ModelUsed>()
                            .map(|used| used.model.clone());
                        #[cfg(not(feature = "fallback"))]
                        let refused_by: Option<String> = None;
                        let request = this.request.body();
                        let request = match refused_by.as_deref().or(this.model.as_deref()) {
                            Some(m) => json_edit::replace_value(request, "model", m)
                                .unwrap_or_else(|| request.clone()),
                            None => request.clone(),
                        };
                        if let Some((body, with)) =
                            this.splice
                                .follow_up(&request, ResumeWith::Instruction, this.prompt)
                        {
                            tracing::debug!(
                                "the prefill was refused: resuming with an instruction"
                            );
                            *this.state = State::Ready { body, with, error };
                            continue;
                        }
                    }
                    tracing::warn!(status = %head.status, "the continuation of a cut stream failed");
                    fail(this.on_outcome, this.state, error);
                }
                State::Continuing { body, .. } => {
                    let polled = ready!(Pin::new(body).poll_frame(cx));
                    match polled {
                        Some(Ok(frame)) => {
                            let Ok(data) = frame.into_data() else {
                                // The caller's stream has its own end: no trailers of the
                                // continuation's.
                                continue;
                            };
                            let out = this.splice.continuation(&data);
                            if this.splice.continuation_failed() {
                                let State::Continuing { error, .. } =
                                    std::mem::replace(this.state, State::Done)
                                else {
                                    unreachable!("matched above")
                                };
                                tracing::warn!("the continuation of a cut stream sent an error");
                                fail(this.on_outcome, this.state, error);
                            }
                            if out.is_empty() {
                                continue;
                            }
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "the continuation of a cut stream was cut");
                            *this.state = State::Done;
                            if let Some(f) = this.on_outcome.take() {
                                f(ResumeOutcome::Failed);
                            }
                            return Poll::Ready(Some(Err(e)));
                        }
                        None => {
                            let State::Continuing { error, .. } =
                                std::mem::replace(this.state, State::Done)
                            else {
                                unreachable!("matched above")
                            };
                            if this.splice.continuation_complete() {
                                if let Some(f) = this.on_outcome.take() {
                                    f(ResumeOutcome::Resumed);
                                }
                                return Poll::Ready(None);
                            }
                            tracing::warn!("the continuation of a cut stream ended early");
                            fail(this.on_outcome, this.state, error);
                        }
                    }
                }
                State::Failing(error) => {
                    let error = error.take();
                    *this.state = State::Done;
                    return Poll::Ready(error.map(Err));
                }
                State::Done => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, State::Done)
    }

    fn size_hint(&self) -> SizeHint {
        // The length changes when a continuation is spliced in.
        SizeHint::default()
    }
}

/// Ends the resume: the cut's own error goes to the caller.
fn fail<F>(on_outcome: &mut Option<OnOutcome>, state: &mut State<F>, error: BoxError) {
    if let Some(f) = on_outcome.take() {
        f(ResumeOutcome::Failed);
    }
    *state = State::Failing(Some(error));
}

impl<B, S> fmt::Debug for ResumeBody<B, S>
where
    S: Service<Request<Full<Bytes>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Original => "original",
            State::Ready { .. } | State::Calling { .. } => "sending",
            State::Continuing { .. } => "continuing",
            State::Failing(_) | State::Done => "done",
        };
        f.debug_struct("ResumeBody")
            .field("with", &self.with)
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
