use std::collections::VecDeque;
use std::fmt;
use std::future::{self, Future};
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use super::script::{success_body, End, Payload, Reply, Rule, Script, SseFrame, TokenBucket};
use super::tls::Tls;

/// A fake LLM provider: a real HTTP server on `127.0.0.1` that answers
/// according to a [`Script`].
///
/// [`MockServer::start`] serves plain TCP, HTTP/1.1 or HTTP/2 with prior
/// knowledge (h2c), told apart by the first bytes of each connection.
/// [`MockServer::builder`] adds HTTPS and pins the protocol.
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
    tls: Option<Arc<Tls>>,
}

/// The HTTP versions a [`MockServer`] speaks.
///
/// Over TLS the choice is made by ALPN: the server offers `http/1.1`, `h2`
/// or both. On plain TCP, [`Http2`](Protocol::Http2) means HTTP/2 with prior
/// knowledge (h2c), and [`Auto`](Protocol::Auto) reads the first bytes of a
/// connection to tell the HTTP/2 connection preface from an HTTP/1.1
/// request, as it also does over TLS when the client offered no ALPN.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Protocol {
    /// HTTP/1.1 only.
    Http1,
    /// HTTP/2 only.
    Http2,
    /// Either, as the client chooses.
    #[default]
    Auto,
}

/// Configures and starts a [`MockServer`]; made by [`MockServer::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until started"]
pub struct MockServerBuilder {
    script: Script,
    tls: bool,
    protocol: Protocol,
}

impl MockServerBuilder {
    /// Serves HTTPS with a certificate made at start, for `localhost` and
    /// `127.0.0.1`, signed by a certificate authority made with it.
    ///
    /// Clients trust the server through [`MockServer::ca_cert_der`],
    /// [`MockServer::ca_cert_pem`], [`MockServer::root_cert_store`] or a
    /// ready [`MockServer::tls_client_config`].
    ///
    /// Defaults to `false`: plain TCP.
    pub fn tls(mut self, enabled: bool) -> Self {
        self.tls = enabled;
        self
    }

    /// The HTTP versions the server speaks.
    ///
    /// Defaults to [`Protocol::Auto`].
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// Binds `127.0.0.1` on an ephemeral port and starts serving.
    ///
    /// # Errors
    ///
    /// Fails if the port cannot be bound or the certificate cannot be made.
    ///
    /// # Panics
    ///
    /// Panics if called outside a Tokio runtime.
    pub async fn start(self) -> io::Result<MockServer> {
        let tls = match self.tls {
            true => Some(Arc::new(Tls::generate(self.protocol)?)),
            false => None,
        };
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let script = self.script;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rules: script.rules,
                steps: script.steps,
                otherwise: script.otherwise,
                bucket: script.capacity.as_ref().map(|c| c.bucket()),
                requests: Vec::new(),
            }),
            accepted: AtomicUsize::new(0),
        });
        let shutdown = CancellationToken::new();
        let settings = Arc::new(Settings {
            tls: tls.clone(),
            protocol: self.protocol,
        });
        let accept = tokio::spawn(accept_loop(
            listener,
            shared.clone(),
            settings,
            shutdown.clone(),
        ));

        Ok(MockServer {
            addr,
            shared,
            shutdown,
            accept: accept.abort_handle(),
            tls,
        })
    }
}

/// A request the server received.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// The request method.
    pub method: Method,
    /// The request target: on HTTP/1.1 as sent (usually just a path and
    /// query); on HTTP/2 the full URI the pseudo-headers make, with scheme
    /// and authority.
    pub uri: Uri,
    /// The request headers (on HTTP/2, without the pseudo-headers).
    pub headers: HeaderMap,
    /// The HTTP version the request came on: [`Version::HTTP_11`] or
    /// [`Version::HTTP_2`].
    pub version: Version,
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
    /// Binds `127.0.0.1` on an ephemeral port and starts serving `script`
    /// over plain TCP, HTTP/1.1 or h2c, as each connection starts.
    ///
    /// The same as `MockServer::builder(script).start()`.
    ///
    /// # Panics
    ///
    /// Panics if called outside a Tokio runtime.
    pub async fn start(script: Script) -> io::Result<MockServer> {
        MockServer::builder(script).start().await
    }

    /// A builder for a server answering with `script`, to serve HTTPS or
    /// pin the HTTP version.
    ///
    /// ```
    /// use tower_llm_retry::mock::{MockServer, Protocol, Script};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> std::io::Result<()> {
    /// let server = MockServer::builder(Script::new())
    ///     .tls(true)
    ///     .protocol(Protocol::Http2)
    ///     .start()
    ///     .await?;
    /// assert!(server.url("/v1/messages").starts_with("https://127.0.0.1:"));
    /// let roots = server.root_cert_store().expect("a TLS server has a CA");
    /// assert_eq!(roots.len(), 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(script: Script) -> MockServerBuilder {
        MockServerBuilder {
            script,
            tls: false,
            protocol: Protocol::Auto,
        }
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL of `path` on this server, such as
    /// `http://127.0.0.1:49152/v1/messages` (`https://` when serving TLS).
    pub fn url(&self, path: &str) -> String {
        let slash = if path.starts_with('/') { "" } else { "/" };
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}{slash}{path}", self.addr)
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

    /// The certificate authority that signed the server's certificate, in
    /// DER; `None` unless the server serves TLS.
    pub fn ca_cert_der(&self) -> Option<&CertificateDer<'static>> {
        self.tls.as_ref().map(|tls| &tls.ca_der)
    }

    /// The certificate authority that signed the server's certificate, in
    /// PEM; `None` unless the server serves TLS.
    pub fn ca_cert_pem(&self) -> Option<&str> {
        self.tls.as_ref().map(|tls| tls.ca_pem.as_str())
    }

    /// A root store trusting only this server's certificate authority;
    /// `None` unless the server serves TLS.
    pub fn root_cert_store(&self) -> Option<RootCertStore> {
        self.tls.as_ref().map(|tls| tls.root_store())
    }

    /// A client configuration trusting only this server's certificate
    /// authority, with the `ring` crypto provider and no ALPN protocols (a
    /// connector such as `hyper-rustls` sets those); `None` unless the
    /// server serves TLS.
    pub fn tls_client_config(&self) -> Option<ClientConfig> {
        self.tls.as_ref().map(|tls| tls.client_config())
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

    /// The number of connections accepted so far, over TCP (before any TLS handshake): how
    /// many connections a client opened, which tells a client's pooling.
    pub fn connection_count(&self) -> usize {
        self.shared.accepted.load(Ordering::Relaxed)
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
            .field("tls", &self.tls.is_some())
            .field("requests", &state.requests.len())
            .field("pending_steps", &state.steps.len())
            .field("shut_down", &self.shutdown.is_cancelled())
            .finish()
    }
}

pub(super) struct Shared {
    state: Mutex<State>,
    /// Connections accepted so far.
    accepted: AtomicUsize,
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
    pub(super) fn record(&self, request: RecordedRequest) -> (usize, Reply) {
        let mut state = self.lock();
        let now = request.received_at;
        let index = state.requests.len();
        state.requests.push(request);

        let request = &state.requests[index];
        if let Some(reply) = state.rules.iter().find_map(|rule| rule.reply(request)) {
            return (index, reply);
        }
        let mut took = None;
        let State {
            requests, bucket, ..
        } = &mut *state;
        if let Some(bucket) = bucket {
            match bucket.admit(&requests[index], now) {
                Ok(t) => took = t,
                Err(rejected) => return (index, rejected),
            }
        }
        let mut reply = match state.steps.pop_front() {
            Some(reply) => reply,
            None => state.otherwise.clone(),
        };
        // An input-token bucket states itself, and the success reports what it counted.
        if let Some((tokens, headers)) = took {
            let request = &state.requests[index];
            if let Payload::Success = reply.payload {
                reply.payload = Payload::Full(super::script::success_body_with(
                    request.uri.path(),
                    &request.body,
                    index,
                    tokens,
                ));
            }
            reply.headers.extend(headers);
        }
        (index, reply)
    }
}

/// How every connection is served.
struct Settings {
    tls: Option<Arc<Tls>>,
    protocol: Protocol,
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    settings: Arc<Settings>,
    shutdown: CancellationToken,
) {
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
                    shared.accepted.fetch_add(1, Ordering::Relaxed);
                    // Each scripted frame goes out when written: Nagle's
                    // algorithm would hold a small write behind the client's
                    // delayed ACK, tens of milliseconds that paused time
                    // never waits for.
                    let _ = stream.set_nodelay(true);
                    connections.spawn(serve_connection(
                        stream,
                        shared.clone(),
                        settings.clone(),
                        shutdown.clone(),
                    ));
                }
                // Typically running out of file descriptors; back off instead
                // of spinning on an error that will repeat immediately.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

async fn serve_connection(
    stream: TcpStream,
    shared: Arc<Shared>,
    settings: Arc<Settings>,
    shutdown: CancellationToken,
) {
    tokio::select! {
        // Connection errors are mostly the scripted faults themselves, or the
        // client giving up; neither is worth reporting.
        _ = serve(stream, shared, &settings) => {}
        () = shutdown.cancelled() => {}
    }
}

async fn serve(stream: TcpStream, shared: Arc<Shared>, settings: &Settings) -> io::Result<()> {
    let (io, alpn): (Box<dyn Io>, _) = match &settings.tls {
        Some(tls) => {
            let stream = tls.acceptor.accept(stream).await?;
            let alpn = stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
            (Box::new(stream), alpn)
        }
        None => (Box::new(stream), None),
    };
    let mut io = Rewind::new(io);
    let http2 = match (alpn.as_deref(), settings.protocol) {
        (Some(alpn), _) => alpn == b"h2",
        (None, Protocol::Http1) => false,
        (None, Protocol::Http2) => true,
        (None, Protocol::Auto) => io.sniff_preface().await?,
    };

    if http2 {
        super::http2::serve(io, shared).await;
    } else {
        let raw = io.raw.clone();
        let service = service_fn(move |req| handle(shared.clone(), req, raw.clone()));
        http1::Builder::new()
            .serve_connection(TokioIo::new(io), service)
            .await
            .map_err(io::Error::other)?;
    }
    Ok(())
}

/// What a connection runs over: a TCP stream, or TLS over one.
pub(super) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A connection whose first bytes, once read to tell the protocol, are read
/// again by whoever serves it.
pub(super) struct Rewind {
    prefix: Bytes,
    inner: Box<dyn Io>,
    /// A [`Reply::raw`] the service chose: written in place of hyper's response.
    raw: RawSlot,
    /// What is left to write of the raw reply; once it is set, every write of hyper's is
    /// dropped and reads see the end, so the connection closes after the raw bytes.
    raw_out: Option<Bytes>,
}

/// Where the service leaves a raw reply for its connection to write.
type RawSlot = Arc<Mutex<Option<Bytes>>>;

/// What an HTTP/2 client sends first (RFC 9113, section 3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl Rewind {
    fn new(inner: Box<dyn Io>) -> Self {
        Self {
            prefix: Bytes::new(),
            inner,
            raw: RawSlot::default(),
            raw_out: None,
        }
    }

    /// Reads until the bytes either are the HTTP/2 preface or cannot be.
    async fn sniff_preface(&mut self) -> io::Result<bool> {
        let mut buf = BytesMut::with_capacity(PREFACE.len());
        let http2 = loop {
            let seen = buf.len().min(PREFACE.len());
            if !PREFACE.starts_with(&buf[..seen]) {
                break false;
            }
            if seen == PREFACE.len() {
                break true;
            }
            if self.inner.read_buf(&mut buf).await? == 0 {
                break false;
            }
        };
        self.prefix = buf.freeze();
        Ok(http2)
    }
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.raw_out.is_some() {
            // After a raw reply: the end, so hyper closes the connection.
            return Poll::Ready(Ok(()));
        }
        if self.prefix.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining());
        buf.put_slice(&self.prefix.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.raw_out.is_none() {
            let pending = this
                .raw
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            this.raw_out = pending;
        }
        let Some(out) = &mut this.raw_out else {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        };
        // The raw reply goes out in place of hyper's response, which is dropped.
        while !out.is_empty() {
            let n = ready!(Pin::new(&mut this.inner).poll_write(cx, out))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let _ = out.split_to(n);
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    raw: RawSlot,
) -> io::Result<Response<MockBody>> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(io::Error::other)?.to_bytes();
    let path = parts.uri.path().to_owned();
    let (index, reply) = shared.record(RecordedRequest {
        method: parts.method,
        uri: parts.uri,
        headers: parts.headers,
        version: parts.version,
        body: body.clone(),
        received_at: Instant::now(),
    });

    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }

    let body = match reply.payload {
        // An error from the service makes the connection close without a
        // response, which is exactly what a reset looks like to the client.
        // HTTP/1.1 cannot tell the client a request went unprocessed; the
        // nearest it has is closing the connection without a response.
        Payload::Reset | Payload::RefusedStream | Payload::GoAway => {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "scripted reset",
            ))
        }
        Payload::Stall => return future::pending().await,
        // Written by the connection in place of the empty response hyper sends.
        Payload::Raw(bytes) => {
            *raw.lock().unwrap_or_else(PoisonError::into_inner) = Some(bytes);
            return Ok(Response::new(MockBody::full(Bytes::new())));
        }
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

/// HTTP/1.1 response body: either complete up front, or a timed sequence of
/// frames.
#[derive(Debug)]
pub(super) struct MockBody {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Full(Option<Bytes>),
    Stream {
        events: VecDeque<SseFrame>,
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

    fn stream(events: Vec<SseFrame>, end: End) -> Self {
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
                while let Some(event) = events.front() {
                    if !event.delay.is_zero() {
                        let delay = event.delay;
                        let timer =
                            sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
                        ready!(timer.as_mut().poll(cx));
                        *sleep = None;
                    }
                    let event = events.pop_front().expect("front exists");
                    // A silence writes nothing: an empty frame would be no frame at all.
                    if !event.bytes().is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(event.bytes()))));
                    }
                }
                match end {
                    End::Finish => Poll::Ready(None),
                    // Nothing will ever wake this; the connection ends only
                    // when the server shuts down.
                    End::Stall => Poll::Pending,
                    End::Reset | End::ResetStream if !*yielded => {
                        // The connection writes buffered frames only when the
                        // body is pending, and drops them if the body fails
                        // first; yield once so the last frame goes out.
                        *yielded = true;
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    // An error from the body makes the connection abort
                    // without finishing the message.
                    End::Reset | End::ResetStream => Poll::Ready(Some(Err(io::Error::new(
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
