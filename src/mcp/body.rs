use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::layer::Config;
use super::rpc;
use crate::stream::SseScanner;

pin_project! {
    /// The response body of [`McpGate`](super::McpGate): the inner body, frame for frame.
    /// For a `tools/list` response the gate reads along as the caller does (a JSON body up to
    /// the layer's limit, or each event of an SSE stream) and learns the tools' annotations;
    /// nothing is held back or changed.
    pub struct McpBody<B> {
        #[pin]
        inner: B,
        tap: Option<Tap>,
    }
}

/// Reading a `tools/list` response along with the caller.
pub(crate) struct Tap {
    config: Arc<Config>,
    kind: TapKind,
}

enum TapKind {
    Json { held: Vec<Bytes>, len: usize },
    Sse { scanner: SseScanner },
}

impl Tap {
    pub(crate) fn json(config: Arc<Config>) -> Self {
        Tap {
            config,
            kind: TapKind::Json {
                held: Vec::new(),
                len: 0,
            },
        }
    }

    pub(crate) fn sse(config: Arc<Config>) -> Self {
        let limit = config.body_limit;
        Tap {
            config,
            kind: TapKind::Sse {
                scanner: SseScanner::new(limit),
            },
        }
    }

    /// Reads one frame's bytes; `false` once there is nothing more worth reading.
    fn feed(&mut self, data: &Bytes) -> bool {
        let session = &self.config.session;
        match &mut self.kind {
            TapKind::Json { held, len } => {
                *len += data.len();
                held.push(data.clone());
                *len <= self.config.body_limit
            }
            TapKind::Sse { scanner } => {
                let result = scanner.push(data, |event| {
                    let tools = rpc::read_tools(event.data.as_bytes());
                    if tools.is_empty() {
                        return None;
                    }
                    session.learn(tools);
                    Some(())
                });
                // One result answers the request; after it, or an event too long, stop.
                matches!(result, Ok(None))
            }
        }
    }

    /// The body ended.
    fn finish(self) {
        if let TapKind::Json { held, .. } = self.kind {
            let json: Vec<u8> = held.iter().flat_map(|b| b.iter().copied()).collect();
            let tools = rpc::read_tools(&json);
            if !tools.is_empty() {
                tracing::debug!(tools = tools.len(), "learned MCP tool annotations");
                self.config.session.learn(tools);
            }
        }
    }
}

impl<B> McpBody<B> {
    pub(crate) fn new(inner: B, tap: Option<Tap>) -> Self {
        McpBody { inner, tap }
    }
}

impl<B> Body for McpBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        let polled = std::task::ready!(this.inner.as_mut().poll_frame(cx))
            .map(|r| r.map(|frame| frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))));
        let ended = match &polled {
            None => true,
            Some(Ok(frame)) => match (frame.data_ref(), this.tap.as_mut()) {
                (Some(data), Some(tap)) => {
                    if !tap.feed(data) {
                        *this.tap = None;
                    }
                    false
                }
                _ => frame.is_trailers(),
            },
            Some(Err(_)) => {
                // A body that failed teaches nothing.
                *this.tap = None;
                false
            }
        };
        if ended || this.inner.is_end_stream() {
            if let Some(tap) = this.tap.take() {
                tap.finish();
            }
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> std::fmt::Debug for McpBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpBody")
            .field("reading_tools", &self.tap.is_some())
            .finish_non_exhaustive()
    }
}
