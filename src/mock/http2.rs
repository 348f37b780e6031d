//! HTTP/2 connections, served with the `h2` crate directly so that scripted
//! replies can send the frames a fault needs (`RST_STREAM`, `GOAWAY`) when it
//! needs them; hyper sends those only on its own terms.

use std::collections::BTreeSet;
use std::future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use h2::server::SendResponse;
use h2::{Reason, RecvStream};
use http::header::CONTENT_LENGTH;
use http::{HeaderValue, Request, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::script::{success_body, End, Payload};
use super::server::{RecordedRequest, Rewind, Shared};

/// Serves one HTTP/2 connection until it closes, is aborted by a scripted
/// fault, or has sent `GOAWAY` and finished the streams it kept.
pub(super) async fn serve(io: Rewind, shared: Arc<Shared>) {
    let control = Arc::new(Control::new());
    let io = Injecting {
        inner: io,
        control: control.clone(),
        writing: Bytes::new(),
        wrote_injected: false,
    };
    let Ok(mut connection) = h2::server::handshake(io).await else {
        return;
    };
    // Streams are tasks of this task, so ending the connection ends them.
    let mut streams = JoinSet::new();
    loop {
        let changed = control.changed.notified();
        if control.should_close() {
            break;
        }
        tokio::select! {
            // Accepting first drives the connection, which writes what the
            // streams queued before a close is acted on.
            biased;
            accepted = connection.accept() => match accepted {
                Some(Ok((request, respond))) => {
                    let id = u32::from(respond.stream_id());
                    control.lock().open.insert(id);
                    streams.spawn(serve_stream(
                        shared.clone(),
                        control.clone(),
                        id,
                        request,
                        respond,
                    ));
                }
                Some(Err(_)) | None => break,
            },
            () = changed => {}
            Some(_) = streams.join_next(), if !streams.is_empty() => {}
        }
    }
    // Dropping the connection without a last poll sends nothing more: no
    // `RST_STREAM` for the streams cut off by a `GOAWAY`, no closing
    // `GOAWAY` of h2's own after an abort.
}

/// What the streams of one connection tell the connection task.
struct Control {
    state: Mutex<ControlState>,
    /// Wakes the connection task to act on a change.
    changed: Notify,
    /// Counts completed flushes, so a stream can wait until what it queued
    /// has been written.
    flushed: watch::Sender<u64>,
    /// The last-stream-id of the lowest `GOAWAY` sent.
    goaway: watch::Sender<Option<u32>>,
}

#[derive(Default)]
struct ControlState {
    /// Streams whose replies have not finished.
    open: BTreeSet<u32>,
    /// Frames to write at the next frame boundary.
    inject: Option<Bytes>,
    /// Whether injected frames are still to be written and flushed.
    injecting: bool,
    /// Drop the connection now.
    abort: bool,
}

impl Control {
    fn new() -> Self {
        Self {
            state: Mutex::default(),
            changed: Notify::new(),
            flushed: watch::Sender::new(0),
            goaway: watch::Sender::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn should_close(&self) -> bool {
        let state = self.lock();
        if state.abort {
            return true;
        }
        match *self.goaway.borrow() {
            Some(last) => !state.injecting && state.open.range(..=last).next().is_none(),
            None => false,
        }
    }

    fn abort(&self) {
        self.lock().abort = true;
        self.changed.notify_one();
    }

    /// Sends `GOAWAY` with `last` as its last-stream-id, unless one as low
    /// has been sent already (a later `GOAWAY` may lower it, never raise it).
    fn goaway(&self, last: u32) {
        let lowered = self.goaway.send_if_modified(|sent| match *sent {
            Some(sent) if sent <= last => false,
            _ => {
                *sent = Some(last);
                true
            }
        });
        if lowered {
            let mut state = self.lock();
            let mut frames = BytesMut::from(&state.inject.take().unwrap_or_default()[..]);
            frames.put_slice(&goaway_frame(last, Reason::NO_ERROR));
            state.inject = Some(frames.freeze());
            state.injecting = true;
            drop(state);
            self.changed.notify_one();
        }
    }

    /// Resolves once a `GOAWAY` has refused stream `id`.
    async fn refused(&self, id: u32) {
        let mut goaway = self.goaway.subscribe();
        // Only fails when the sender is dropped, and `self` holds it.
        let _ = goaway
            .wait_for(|sent| sent.is_some_and(|last| id > last))
            .await;
    }

    /// Resolves once the connection has written and flushed what the
    /// streams had queued.
    ///
    /// On a current-thread runtime the connection cannot be part-way
    /// through a write when this is called, so the next completed flush
    /// includes everything queued before.
    async fn written(&self) {
        let mut flushed = self.flushed.subscribe();
        self.changed.notify_one();
        let _ = flushed.changed().await;
    }
}

/// A `GOAWAY` frame (RFC 9113, section 6.8), without debug data.
fn goaway_frame(last_stream_id: u32, reason: Reason) -> [u8; 17] {
    let mut frame = [0; 17];
    // Length 8, type GOAWAY (0x7), no flags, stream 0.
    frame[..9].copy_from_slice(&[0, 0, 8, 0x7, 0, 0, 0, 0, 0]);
    frame[9..13].copy_from_slice(&(last_stream_id & 0x7fff_ffff).to_be_bytes());
    frame[13..].copy_from_slice(&u32::from(reason).to_be_bytes());
    frame
}

/// The connection's transport, able to write frames h2 did not make.
///
/// h2 sends `GOAWAY` only with the highest stream id it has seen, while a
/// scripted `GOAWAY` names a lower one; this writes the frame itself. h2
/// flushes only after writing out every frame it encoded, so a flush is a
/// frame boundary: injected frames are written there.
struct Injecting {
    inner: Rewind,
    control: Arc<Control>,
    /// Injected bytes taken but not yet all written.
    writing: Bytes,
    /// Whether injected bytes were written since the last flush.
    wrote_injected: bool,
}

impl Injecting {
    fn poll_write_injected(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.writing.is_empty() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.writing))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let _ = self.writing.split_to(n);
            self.wrote_injected = true;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Injecting {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Injecting {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // A frame begun must be finished before h2's next bytes.
        ready!(self.poll_write_injected(cx))?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.writing.is_empty() {
            if let Some(frames) = this.control.lock().inject.take() {
                this.writing = frames;
            }
        }
        ready!(this.poll_write_injected(cx))?;
        ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        if std::mem::take(&mut this.wrote_injected) {
            let mut state = this.control.lock();
            state.injecting = state.inject.is_some();
            drop(state);
            this.control.changed.notify_one();
        }
        this.control.flushed.send_modify(|n| *n = n.wrapping_add(1));
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

async fn serve_stream(
    shared: Arc<Shared>,
    control: Arc<Control>,
    id: u32,
    request: Request<RecvStream>,
    respond: SendResponse<Bytes>,
) {
    let reply = respond_to(&shared, &control, id, request, respond);
    tokio::pin!(reply);
    tokio::select! {
        () = &mut reply => {}
        () = control.refused(id) => {
            // A refused stream gets nothing more. Its reply is kept, not
            // dropped: dropping it would make h2 reset the stream.
            future::pending::<()>().await;
        }
    }
    control.written().await;
    control.lock().open.remove(&id);
    control.changed.notify_one();
}

async fn respond_to(
    shared: &Shared,
    control: &Control,
    id: u32,
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let (parts, mut body) = request.into_parts();
    let mut received = BytesMut::new();
    while let Some(chunk) = body.data().await {
        // The client reset the stream; there is no request to answer.
        let Ok(chunk) = chunk else { return };
        let _ = body.flow_control().release_capacity(chunk.len());
        received.put_slice(&chunk);
    }
    let received = received.freeze();
    let path = parts.uri.path().to_owned();
    let (index, reply) = shared.record(RecordedRequest {
        method: parts.method,
        uri: parts.uri,
        headers: parts.headers,
        version: parts.version,
        body: received.clone(),
        received_at: Instant::now(),
    });

    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }

    let (full, events, end) = match reply.payload {
        Payload::Reset | Payload::Raw(_) => {
            // `respond` is kept: dropping it would have h2 reset the stream
            // before the connection goes.
            control.abort();
            return future::pending().await;
        }
        Payload::Stall => return future::pending().await,
        Payload::RefusedStream => return respond.send_reset(Reason::REFUSED_STREAM),
        Payload::GoAway => {
            // Client streams have odd ids: the one below this is `id - 2`.
            control.goaway(id.saturating_sub(2));
            return future::pending().await;
        }
        Payload::Full(bytes) => (Some(bytes), Vec::new(), End::Finish),
        Payload::Success => (
            Some(success_body(&path, &received, index)),
            Vec::new(),
            End::Finish,
        ),
        Payload::Stream { events, end } => (None, events, end),
    };

    let mut head = Response::new(());
    *head.status_mut() = reply.status;
    let headers = head.headers_mut();
    for (name, value) in reply.headers {
        headers.append(name, value);
    }
    if let Some(full) = &full {
        // As a server that knows the length says it, on either version, in
        // the responses that may carry one.
        let status = reply.status;
        let bodiless = status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        if !bodiless && !headers.contains_key(CONTENT_LENGTH) {
            headers.insert(CONTENT_LENGTH, HeaderValue::from(full.len()));
        }
    }
    let empty = full.as_ref().is_some_and(Bytes::is_empty);
    // Fails for headers HTTP/2 forbids, such as `connection`; dropping
    // `respond` then resets the stream.
    let Ok(mut send) = respond.send_response(head, empty) else {
        return;
    };

    if let Some(full) = full {
        if !full.is_empty() {
            let _ = send.send_data(full, true);
        }
        return;
    }
    for event in events {
        if !event.delay.is_zero() {
            tokio::time::sleep(event.delay).await;
        }
        if event.bytes().is_empty() {
            // A silence: nothing to write.
            continue;
        }
        if send.send_data(event.bytes(), false).is_err() {
            return;
        }
    }
    match end {
        End::Finish => {
            let _ = send.send_data(Bytes::new(), true);
        }
        End::Stall => future::pending().await,
        End::Reset => {
            // The events must be on the wire before the connection goes.
            control.written().await;
            control.abort();
            future::pending().await
        }
        End::ResetStream => {
            // h2 discards a stream's unwritten frames when it is reset.
            control.written().await;
            send.send_reset(Reason::INTERNAL_ERROR);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goaway_frame_layout() {
        assert_eq!(
            goaway_frame(3, Reason::NO_ERROR),
            [0, 0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0]
        );
        assert_eq!(
            goaway_frame(u32::MAX, Reason::PROTOCOL_ERROR)[9..],
            [0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 1]
        );
    }
}
