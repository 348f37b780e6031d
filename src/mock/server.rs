use std::collections::VecDeque;
use std::fmt;
use std::future::{self, Future};
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use super::script::{success_body, End, Payload, Reply, Rule, Script, SseEvent, TokenBucket};

/// A fake LLM provider: a real HTTP/1 server on `127.0.0.1` that answers
/// according to a [`Script`].
///
/// The server runs as tasks on the runtime that called
/// [`start`](MockServer::start); all scripted delays use [`tokio::time`], so
/// they are virtual when that runtime's time is paused. Dropping the server
/// (or calling [`shutdown`](MockServer::shutdown)) stops it and ends every
/// connection, including stalled ones.
pub struct MockServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    accept: AbortHandle,
}

/// A request the server received.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// The request method.
    pub method: Method,
    /// The request target, as sent (usually just a path and query).
    pub uri: Uri,
    /// The request headers.
    pub headers: HeaderMap,
    /// The complete request body.
    pub body: Bytes,
    /// When the full request had been read, on the [`tokio::time`] clock.
    pub received_at: Instant,
}

impl RecordedRequest {
    /// Parses the body as JSON.
    pub fn json(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
    }
}

impl MockServer {
    /// Binds `127.0.0.1` on an ephemeral port and starts serving `script`.
    ///
    /// # Panics
    ///
    /// Panics if called outside a Tokio runtime.
    pub async fn start(script: Script) -> io::Result<MockServer> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rules: script.rules,
                steps: script.steps,
                otherwise: script.otherwise,
                bucket: script.capacity.as_ref().map(|c| c.bucket()),
                requests: Vec::new(),
            }),
        });
        let shutdown = CancellationToken::new();
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), shutdown.clone()));

        Ok(MockServer {
            addr,
            shared,
            shutdown,
            accept: accept.abort_handle(),
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL of `path` on this server, such as
    /// `http://127.0.0.1:49152/v1/messages`.
    pub fn url(&self, path: &str) -> String {
        let slash = if path.starts_with('/') { "" } else { "/" };
        format!("http://{}{slash}{path}", self.addr)
    }

    /// Like [`url`](MockServer::url), as a [`Uri`].
    ///
    /// # Panics
    ///
    /// Panics if `path` does not make a valid URI.
    pub fn uri(&self, path: &str) -> Uri {
        let url = self.url(path);
        url.parse()
            .unwrap_or_else(|e| panic!("invalid URI {url:?}: {e}"))
    }

    /// Every request received so far, in arrival order.
    ///
    /// A request is recorded as soon as its body has been read, before its
    /// scripted reply runs, so requests answered with a reset or a stall are
    /// included.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.lock().requests.clone()
    }

    /// The number of requests received so far.
    pub fn request_count(&self) -> usize {
        self.shared.lock().requests.len()
    }

    /// Appends a step to the script.
    pub fn push(&self, reply: Reply) {
        self.shared.lock().steps.push_back(reply);
    }

    /// Stops accepting connections and ends every open connection.
    ///
    /// Calling it more than once is harmless; dropping the server does the
    /// same.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
        // Aborting the accept loop drops the set that owns the connection
        // tasks, which aborts them too.
        self.accept.abort();
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl fmt::Debug for MockServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("MockServer")
            .field("addr", &self.addr)
            .field("requests", &state.requests.len())
            .field("pending_steps", &state.steps.len())
            .field("shut_down", &self.shutdown.is_cancelled())
            .finish()
    }
}

struct Shared {
    state: Mutex<State>,
}

struct State {
    rules: Vec<Rule>,
    steps: VecDeque<Reply>,
    otherwise: Reply,
    bucket: Option<TokenBucket>,
    requests: Vec<RecordedRequest>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide what the server recorded.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `request` and picks its reply; returns the request's index too.
    fn record(&self, request: RecordedRequest) -> (usize, Reply) {
        let mut state = self.lock();
        let now = request.received_at;
        let index = state.requests.len();
        state.requests.push(request);

        let request = &state.requests[index];
        if let Some(reply) = state.rules.iter().find_map(|rule| rule.reply(request)) {
            return (index, reply);
        }
        if let Some(bucket) = &mut state.bucket {
            if let Err(rejected) = bucket.acquire(now) {
                return (index, rejected);
            }
        }
        let reply = match state.steps.pop_front() {
            Some(reply) => reply,
            None => state.otherwise.clone(),
        };
        (index, reply)
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, shutdown: CancellationToken) {
    // Connection tasks live in this set so that ending this task, by
    // cancellation or abort, also ends every connection.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, shared.clone(), shutdown.clone()));
                }
                // Typically running out of file descriptors; back off instead
                // of spinning on an error that will repeat immediately.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>, shutdown: CancellationToken) {
    let service = service_fn(move |req| handle(shared.clone(), req));
    let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        // Connection errors are mostly the scripted faults themselves, or the
        // client giving up; neither is worth reporting.
        _ = conn => {}
        () = shutdown.cancelled() => {}
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> io::Result<Response<MockBody>> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(io::Error::other)?.to_bytes();
    let path = parts.uri.path().to_owned();
    let (index, reply) = shared.record(RecordedRequest {
        method: parts.method,
        uri: parts.uri,
        headers: parts.headers,
        body: body.clone(),
        received_at: Instant::now(),
    });

    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }

    let body = match reply.payload {
        // An error from the service makes the connection close without a
        // response, which is exactly what a reset looks like to the client.
        Payload::Reset => {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "scripted reset",
            ))
        }
        Payload::Stall => return future::pending().await,
        Payload::Full(bytes) => MockBody::full(bytes),
        Payload::Success => MockBody::full(success_body(&path, &body, index)),
        Payload::Stream { events, end } => MockBody::stream(events, end),
    };

    let mut response = Response::new(body);
    *response.status_mut() = reply.status;
    let headers = response.headers_mut();
    for (name, value) in reply.headers {
        headers.append(name, value);
    }
    Ok(response)
}

/// Response body: either complete up front, or a timed sequence of frames.
#[derive(Debug)]
pub(super) struct MockBody {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Full(Option<Bytes>),
    Stream {
        events: VecDeque<SseEvent>,
        end: End,
        sleep: Option<Pin<Box<Sleep>>>,
        yielded: bool,
    },
}

impl MockBody {
    fn full(bytes: Bytes) -> Self {
        let bytes = if bytes.is_empty() { None } else { Some(bytes) };
        Self {
            kind: Kind::Full(bytes),
        }
    }

    fn stream(events: Vec<SseEvent>, end: End) -> Self {
        Self {
            kind: Kind::Stream {
                events: events.into(),
                end,
                sleep: None,
                yielded: false,
            },
        }
    }
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut self.get_mut().kind {
            Kind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Kind::Stream {
                events,
                end,
                sleep,
                yielded,
            } => {
                if let Some(event) = events.front() {
                    if !event.delay.is_zero() {
                        let delay = event.delay;
                        let timer =
                            sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
                        ready!(timer.as_mut().poll(cx));
                        *sleep = None;
                    }
                    let event = events.pop_front().expect("front exists");
                    return Poll::Ready(Some(Ok(Frame::data(event.bytes()))));
                }
                match end {
                    End::Finish => Poll::Ready(None),
                    // Nothing will ever wake this; the connection ends only
                    // when the server shuts down.
                    End::Stall => Poll::Pending,
                    End::Reset if !*yielded => {
                        // The connection writes buffered frames only when the
                        // body is pending, and drops them if the body fails
                        // first; yield once so the last frame goes out.
                        *yielded = true;
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    // An error from the body makes the connection abort
                    // without finishing the message.
                    End::Reset => Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        "scripted reset mid-body",
                    )))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, Kind::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Stream { .. } => SizeHint::default(),
        }
    }
}
