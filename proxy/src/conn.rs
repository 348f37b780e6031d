//! Connection-level limits: the file-descriptor limit and the connection cap it bounds, the
//! write timeout around a client's socket, and the per-connection count of requests in
//! flight that the idle timeout reads.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

/// The process's file-descriptor limits, as [`raise_fd_limit`] found and left them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit before.
    pub before: u64,
    /// The soft limit now.
    pub soft: u64,
    /// The hard limit (the most the soft one can be raised to).
    pub hard: u64,
}

/// Raises the soft file-descriptor limit to the hard one (on macOS, to the kernel's
/// per-process ceiling when lower): every client connection and every upstream connection is
/// a descriptor, and the common soft default of 1,024 is far below what the proxy serves.
pub fn raise_fd_limit() -> io::Result<FdLimit> {
    let before = fd_soft_limit().unwrap_or(0);
    let soft = rlimit::increase_nofile_limit(u64::MAX)?;
    let hard = rlimit::Resource::NOFILE.get().map_or(soft, |(_, h)| h);
    Ok(FdLimit { before, soft, hard })
}

/// The soft file-descriptor limit, when the platform has one.
pub fn fd_soft_limit() -> Option<u64> {
    if !rlimit::Resource::NOFILE.is_supported() {
        return None;
    }
    rlimit::Resource::NOFILE.get().ok().map(|(soft, _)| soft)
}

/// The connection cap in force: `configured`, at most half of the soft descriptor limit (the
/// other half is for upstream connections, files and the listener), at least 1.
pub fn connection_cap(configured: usize, soft_limit: Option<u64>) -> usize {
    match soft_limit {
        Some(soft) => {
            let half = usize::try_from(soft / 2).unwrap_or(usize::MAX);
            configured.min(half).max(1)
        }
        None => configured,
    }
}

/// A client socket whose writes fail with [`io::ErrorKind::TimedOut`] once one has waited
/// longer than the timeout for the client to make room: a client that does not read its
/// response would otherwise hold its connection, and its request's slot, for ever.
pub struct WriteTimeout<T> {
    io: T,
    after: Duration,
    // Armed when a write first waits; disarmed by any write that goes through.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<T> std::fmt::Debug for WriteTimeout<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteTimeout")
            .field("after", &self.after)
            .field("waiting", &self.timer.is_some())
            .finish()
    }
}

impl<T> WriteTimeout<T> {
    /// Wraps `io`; a write waiting longer than `after` fails.
    pub fn new(io: T, after: Duration) -> Self {
        WriteTimeout {
            io,
            after,
            timer: None,
        }
    }

    fn watch<R>(&mut self, cx: &mut Context<'_>, res: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match res {
            Poll::Ready(r) => {
                self.timer = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let after = self.after;
                let timer = self
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(after)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client did not read its response within the write timeout",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteTimeout<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let res = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, res)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let res = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, res)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let res = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, res)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let res = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, res)
    }
}

/// What the serve loop knows of one client connection: the requests it made and has in
/// flight, and the signal that asks it to close.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    started: AtomicU64,
    open: AtomicUsize,
    /// When its last request in flight ended, in the order of [`IDLE_ORDER`].
    idle_since: AtomicU64,
    changed: Notify,
    /// Told when the connection cap needs this connection's place.
    pub(crate) evict: Notify,
    /// The responses in flight, each with the instant since which it has waited for the
    /// client to take its next piece.
    responses: Mutex<Vec<Weak<Waiting>>>,
}

/// Since when a response body has had a piece taken by hyper and not been asked for the next:
/// hyper is then waiting on the client (a full socket, or HTTP/2 flow control).
#[derive(Debug, Default)]
struct Waiting(Mutex<Option<Instant>>);

impl Waiting {
    fn set(&self, since: Option<Instant>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = since;
    }

    fn get(&self) -> Option<Instant> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The order in which connections fell idle, across every connection of the process: a
/// count, so the one idle longest is exact whatever the clock.
static IDLE_ORDER: AtomicU64 = AtomicU64::new(0);

impl Activity {
    /// Since when the connection has had nothing in flight, in the order connections fell
    /// idle (lower: longer); `None` while a request is in flight or before its first.
    pub(crate) fn idle_since(&self) -> Option<u64> {
        (self.served() && self.open.load(Ordering::SeqCst) == 0)
            .then(|| self.idle_since.load(Ordering::Relaxed))
    }

    /// Whether the connection has made a request yet.
    pub(crate) fn served(&self) -> bool {
        self.started.load(Ordering::SeqCst) > 0
    }

    /// Counts a request in; it is in flight until the guard is dropped (with its response
    /// body, or with the handler when the client hangs up first).
    pub(crate) fn begin(self: &Arc<Self>) -> Open {
        self.started.fetch_add(1, Ordering::SeqCst);
        self.open.fetch_add(1, Ordering::SeqCst);
        // No notification: a request in flight never ends the idle wait, only its end does
        // (`Open::drop`). One here woke the connection's task for nothing on every request.
        let waiting = Arc::new(Waiting::default());
        let mut responses = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        responses.retain(|w| w.strong_count() > 0);
        responses.push(Arc::downgrade(&waiting));
        Open {
            activity: self.clone(),
            waiting,
        }
    }

    /// Resolves once a response has waited `after` for the client to take its next piece.
    /// Over HTTP/2 a stream whose flow-control window the client never opens waits so while
    /// the socket stays writable: the write timeout of the socket does not see it.
    pub(crate) async fn stalled(&self, after: Duration) {
        loop {
            let earliest = {
                let mut responses = self.responses.lock().unwrap_or_else(|e| e.into_inner());
                responses.retain(|w| w.strong_count() > 0);
                responses
                    .iter()
                    .filter_map(|w| w.upgrade().and_then(|w| w.get()))
                    .min()
            };
            match earliest {
                Some(since) if since.elapsed() >= after => return,
                Some(since) => tokio::time::sleep_until(since + after).await,
                None => tokio::time::sleep(after).await,
            }
        }
    }

    /// Resolves once the connection has made a request and then gone `after` with none in
    /// flight.
    pub(crate) async fn idle(&self, after: Duration) {
        loop {
            // `notify_one` keeps a wake-up for a waiter not yet waiting: none is lost between
            // the check and the wait.
            while !self.served() || self.open.load(Ordering::SeqCst) > 0 {
                self.changed.notified().await;
            }
            let seen = self.started.load(Ordering::SeqCst);
            tokio::time::sleep(after).await;
            if self.open.load(Ordering::SeqCst) == 0 && self.started.load(Ordering::SeqCst) == seen
            {
                return;
            }
        }
    }
}

/// A request in flight on a connection.
#[derive(Debug)]
pub(crate) struct Open {
    activity: Arc<Activity>,
    waiting: Arc<Waiting>,
}

impl Drop for Open {
    fn drop(&mut self) {
        if self.activity.open.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.activity.idle_since.store(
                IDLE_ORDER.fetch_add(1, Ordering::Relaxed),
                Ordering::Relaxed,
            );
            self.activity.changed.notify_one();
        }
    }
}

/// A response body that keeps its request counted in flight until hyper drops it, and tells
/// the connection how long hyper has waited on the client since its last piece.
pub(crate) struct Tracked<B> {
    inner: B,
    open: Open,
}

impl<B> Tracked<B> {
    /// The response is handed to hyper: from now on, until hyper asks for a piece, it waits
    /// on the client.
    pub(crate) fn new(inner: B, open: Open) -> Self {
        open.waiting.set(Some(Instant::now()));
        Tracked { inner, open }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Tracked<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let res = Pin::new(&mut self.inner).poll_frame(cx);
        let since = matches!(res, Poll::Ready(Some(Ok(_)))).then(Instant::now);
        self.open.waiting.set(since);
        res
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_descriptor_limit_is_raised_to_the_hard_one() {
        let (_, hard) = rlimit::Resource::NOFILE.get().unwrap();
        // From a low soft limit, as many systems start a process with.
        let low = hard.min(256);
        rlimit::Resource::NOFILE.set(low, hard).unwrap();
        let raised = raise_fd_limit().unwrap();
        let (soft_after, hard_after) = rlimit::Resource::NOFILE.get().unwrap();
        assert_eq!(raised.before, low);
        assert_eq!(hard_after, hard);
        assert_eq!(raised.soft, soft_after);
        if cfg!(target_os = "macos") {
            assert!(soft_after > low || low == hard, "{soft_after}");
        } else {
            assert_eq!(soft_after, hard);
        }
    }

    #[test]
    fn the_connection_cap_stays_under_half_the_descriptor_limit() {
        assert_eq!(connection_cap(4096, Some(1024)), 512);
        assert_eq!(connection_cap(4096, Some(1_048_576)), 4096);
        assert_eq!(connection_cap(100, Some(1)), 1);
        assert_eq!(connection_cap(100, None), 100);
    }
}
