//! The listener and the request handler: ops endpoints, routing, the client-token check, the
//! concurrency cap, the body cap, the call through the tenant's stack, and the response
//! headers that tell an SDK what happened.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_llm_retry::continuation::{ResumeBody, ResumeOutcome, ResumeWith};
use tower_llm_retry::fallback::ModelUsed;
use tower_llm_retry::retry::{GiveUpReason, NoRetry, Override};
use tower_llm_retry::{BoxError, ErrorKind, RetryTrail};

use crate::body::{Ended, ProxyBody};
use crate::budget::{BodyBudget, Reservation};
use crate::config::{Config, ConfigError, Kind, Preset, ResumeMode, Secret};
use crate::conn;
use crate::deadline;
use crate::envelope::{self, Reject, StreamStyle};
use crate::forward::{
    self, API_KEY, RETRY_POLICY, RETRY_POLICY_NAME, RETRY_SWITCH, RETRY_SWITCH_NAME,
    SDK_RETRY_COUNT_NAME, X_API_KEY,
};
use crate::metrics::{reason_name, Metrics};
use crate::routes::Routes;
use crate::stack::{Peer, StackFactory, TenantId, TenantKeys, Tenants, UpstreamHead};
use crate::workers::Workers;

/// Response header: how many attempts the proxy made upstream.
pub const ATTEMPTS: &str = "x-llm-retry-attempts";
/// Response header: the model that served the response (when a fallback chain is set).
pub const MODEL: &str = "x-llm-retry-model";
/// Response header: `true` when a fallback model served the response.
pub const FALLBACK: &str = "x-llm-retry-fallback";
/// Response header: why the proxy stopped retrying, when it gave up.
pub const GAVE_UP: &str = "x-llm-retry-gave-up";
/// Response header: the name of the upstream that served the response.
pub const UPSTREAM: &str = "x-llm-retry-upstream";
/// Response header: every target a request went to, in order of first use, with its
/// attempts (`upstream/model=attempts`, comma separated), when it took more than one attempt.
pub const TARGETS: &str = "x-llm-retry-targets";

/// The response headers above, and `x-should-retry`, as names parsed once: an insert by
/// `&str` parses the name on every response.
const ATTEMPTS_NAME: HeaderName = HeaderName::from_static(ATTEMPTS);
const MODEL_NAME: HeaderName = HeaderName::from_static(MODEL);
const FALLBACK_NAME: HeaderName = HeaderName::from_static(FALLBACK);
const GAVE_UP_NAME: HeaderName = HeaderName::from_static(GAVE_UP);
const UPSTREAM_NAME: HeaderName = HeaderName::from_static(UPSTREAM);
const TARGETS_NAME: HeaderName = HeaderName::from_static(TARGETS);
const SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

/// How long a client may take to send a request's headers, and how long a new connection
/// may stay silent before its first request.
const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a request body may go without a byte while the proxy reads it (the whole body
/// has `body_timeout_secs`).
const BODY_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The methods the proxy forwards; any other is refused with 405.
const FORWARDED_METHODS: [Method; 7] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::PATCH,
    Method::DELETE,
    Method::HEAD,
    Method::OPTIONS,
];

/// The `Allow` header of a 405: [`FORWARDED_METHODS`].
const ALLOW: &str = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS";

/// A configured proxy, ready to serve.
#[derive(Clone, Debug)]
pub struct Proxy {
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    config: Config,
    routes: Routes,
    factories: Vec<StackFactory>,
    tenants: Tenants,
    metrics: Arc<Metrics>,
    limit: Arc<Semaphore>,
    body_budget: Arc<BodyBudget>,
    client_token: Option<[u8; 32]>,
    tenant_keys: TenantKeys,
    draining: AtomicBool,
}

/// What the client asked of the retry loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The upstream's loop, or the preset the request named.
    Retry,
    /// `x-llm-retry: off`: sent once, the upstream's answer as it is.
    Off,
    /// The SDK is retrying the proxy (`x-stainless-retry-count` > 0): sent once.
    ClientRetry,
}

impl Proxy {
    /// Builds the proxy: loads the keys it holds and an HTTP client per upstream.
    pub fn new(config: Config) -> Result<Proxy, ConfigError> {
        config.validate()?;
        let metrics = Arc::new(Metrics::new());
        let mut factories = Vec::new();
        let redis = config.redis_store()?;
        // One client and key pool per upstream, shared by its own stack and by every stack
        // whose fallback chain sends to it.
        let peers = config
            .upstream
            .iter()
            .map(|up| Peer::new(Arc::new(up.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        for index in 0..peers.len() {
            factories.push(StackFactory::new(
                &peers,
                index,
                metrics.clone(),
                config.max_body_bytes,
                redis.clone(),
                config.max_tenants,
            )?);
        }
        let client_token = config
            .resolved_client_token()?
            .map(|t: Secret| Sha256::digest(t.expose().as_bytes()).into());
        Ok(Proxy {
            state: Arc::new(State {
                routes: Routes::new(&config.upstream),
                // The fleets' bound, over every upstream: no tenant a fleet keeps loses its
                // client budget.
                tenants: Tenants::new(
                    config
                        .max_tenants
                        .saturating_mul(config.upstream.len().max(1)),
                ),
                limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
                body_budget: BodyBudget::new(
                    config.buffered_body_budget(),
                    metrics.buffered_body_bytes().clone(),
                ),
                factories,
                metrics,
                client_token,
                tenant_keys: TenantKeys::new(),
                draining: AtomicBool::new(false),
                config,
            }),
        })
    }

    /// The proxy's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.state.metrics
    }

    /// How many tenants (upstream, credential) the upstreams' fleets keep apart.
    pub fn tenant_count(&self) -> usize {
        self.state
            .factories
            .iter()
            .map(|f| f.fleet().scopes().len())
            .sum()
    }

    /// Handles one request.
    pub async fn handle<B>(&self, req: Request<B>) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        self.state.clone().handle(req).await
    }

    /// Serves on `listener` until `shutdown` completes, then stops accepting, lets requests
    /// and streams in flight finish for up to the drain deadline, and cuts what is left.
    /// Connections are served on the runtime this runs on, as `tokio::spawn` places them.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> io::Result<()> {
        self.serve_with(listener, shutdown, None).await
    }

    /// [`serve`](Proxy::serve), each connection on one of `workers` (the one serving the
    /// fewest), where it stays with what its requests start, its socket's readiness and the
    /// upstream connections included: the binary's way, see [`crate::workers`]. Accepting,
    /// and the work the proxy's state does apart from requests (Redis, for one), stay on the
    /// runtime this runs on.
    pub async fn serve_on(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
        workers: &Workers,
    ) -> io::Result<()> {
        self.serve_with(listener, shutdown, Some(workers)).await
    }

    async fn serve_with(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
        workers: Option<&Workers>,
    ) -> io::Result<()> {
        let config = &self.state.config;
        let mut builder = auto::Builder::new(TokioExecutor::new());
        // A client that does not finish sending its headers in time is dropped, so idle
        // connections cannot pile up.
        builder
            .http1()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT);
        // Pings find a client gone without a word; the idle timeout below closes one that
        // is there but has nothing in flight.
        builder
            .http2()
            .timer(hyper_util::rt::TokioTimer::new())
            .keep_alive_interval(config.http2_keep_alive());
        if let Some(every) = config.http2_keep_alive() {
            builder.http2().keep_alive_timeout(every);
        }
        let idle_after = config.connection_idle_timeout();
        let write_timeout = config.write_timeout();
        let cap = conn::connection_cap(config.max_connections, conn::fd_soft_limit());
        if cap < config.max_connections {
            tracing::warn!(
                max_connections = config.max_connections,
                cap,
                fd_limit = conn::fd_soft_limit(),
                "max_connections lowered to half the file-descriptor limit"
            );
        }
        let slots = Arc::new(Semaphore::new(cap));
        // Every connection in accept order, for the cap to find the oldest that has sent
        // nothing (a task that ended has dropped its clone).
        let mut accepted: VecDeque<Arc<conn::Activity>> = VecDeque::new();
        // Tells every connection to finish what it has in flight and close; the drain is
        // over when every connection has dropped its receiver.
        let (stop_tx, _) = watch::channel(());
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            let (tcp, _) = tokio::select! {
                res = listener.accept() => match res {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of descriptors and the like: back off a moment, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            if accepted.len() >= cap.saturating_mul(2) {
                accepted.retain(|a| Arc::strong_count(a) > 1);
            }
            let Some(slot) = admit(&slots, &mut accepted).await else {
                tracing::debug!(
                    cap,
                    "connection cap reached: a new connection closed at once"
                );
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let state = self.state.clone();
            let activity = Arc::new(conn::Activity::default());
            accepted.push_back(activity.clone());
            let seen = activity.clone();
            let svc = hyper::service::service_fn(move |req| {
                let open = seen.begin();
                let state = state.clone();
                async move {
                    let res = state.handle(req).await;
                    Ok::<_, Infallible>(res.map(|inner| conn::Tracked::new(inner, open)))
                }
            });
            // On a worker, the socket goes to that worker's reactor: left with this runtime's,
            // its every readiness would wake the worker from this thread.
            let socket = match workers {
                None => Socket::Here(tcp),
                Some(_) => match tcp.into_std() {
                    Ok(std) => Socket::Moving(std),
                    Err(e) => {
                        tracing::debug!(error = %e, "a new connection could not be handed on");
                        continue;
                    }
                },
            };
            let builder = builder.clone();
            let mut stop = stop_tx.subscribe();
            let task = async move {
                let _slot = slot;
                let tcp = match socket.arrive() {
                    Ok(tcp) => tcp,
                    Err(e) => {
                        tracing::debug!(error = %e, "a new connection could not be served");
                        return;
                    }
                };
                let io = conn::WriteTimeout::new(tcp, write_timeout);
                let conn = builder.serve_connection(TokioIo::new(io), svc);
                let mut conn = std::pin::pin!(conn);
                // Until the first request no timeout of hyper's runs: HTTP/1's header
                // timeout starts once the protocol is known, and a connection that sends
                // nothing, or half of HTTP/2's preface, never gets that far.
                let silent = async {
                    tokio::time::sleep(HEADER_READ_TIMEOUT).await;
                    if activity.served() {
                        std::future::pending::<()>().await;
                    }
                };
                let mut silent = std::pin::pin!(silent);
                let mut idle = std::pin::pin!(activity.idle(idle_after));
                let mut stalled = std::pin::pin!(activity.stalled(write_timeout));
                let mut closing = false;
                loop {
                    tokio::select! {
                        // In order, with the connection first: no random start to draw on
                        // every wake-up.
                        biased;
                        res = conn.as_mut() => {
                            if let Err(e) = res {
                                tracing::debug!(error = %e, "connection ended with an error");
                            }
                            break;
                        }
                        () = &mut silent => {
                            tracing::debug!("connection closed: no request in time");
                            break;
                        }
                        () = &mut stalled => {
                            tracing::debug!("connection cut: a response waited too long for the client to read");
                            break;
                        }
                        () = activity.evict.notified(), if !closing => {
                            tracing::debug!("connection closed: its place went to a new one");
                            if !activity.served() {
                                break;
                            }
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                        }
                        _ = stop.changed(), if !closing => {
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                        }
                        () = &mut idle, if !closing => {
                            tracing::debug!("connection closed: idle");
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                        }
                    }
                }
            };
            match workers {
                Some(workers) => workers.spawn(&mut conns, task),
                None => drop(conns.spawn(task)),
            }
            // Reap finished connections so the set does not grow.
            while conns.try_join_next().is_some() {}
        }
        drop(listener);
        self.state.draining.store(true, Ordering::SeqCst);
        let deadline = self.state.config.drain_timeout();
        tracing::info!(?deadline, "shutting down: draining requests in flight");
        let _ = stop_tx.send(());
        tokio::select! {
            () = stop_tx.closed() => tracing::info!("drained"),
            () = tokio::time::sleep(deadline) => {
                tracing::warn!(open = conns.len(), "drain deadline reached: cutting what is left");
            }
        }
        conns.shutdown().await;
        Ok(())
    }
}

/// A client socket on its way to the task that serves it.
enum Socket {
    /// Registered with the reactor of the runtime the task runs on.
    Here(tokio::net::TcpStream),
    /// Taken off the accepting runtime's reactor, to be registered with the worker's.
    Moving(std::net::TcpStream),
}

impl Socket {
    /// The socket, registered with the reactor of the runtime this is called on.
    fn arrive(self) -> io::Result<tokio::net::TcpStream> {
        match self {
            Socket::Here(tcp) => Ok(tcp),
            Socket::Moving(std) => tokio::net::TcpStream::from_std(std),
        }
    }
}

/// A place under the connection cap for a new connection: a free one, else the place of
/// the oldest connection that has not sent a request yet, else that of the connection idle
/// longest (between requests, nothing in flight), else none. The one chosen is told to close:
/// at once for one that sent nothing (the cheapest to lose and the likeliest to be hostile),
/// gracefully for an idle one, which an HTTP/1 client's pool reopens when it needs it. The
/// connections serving requests, and new clients such as health checks, keep being served;
/// the cap bounds memory (hyper keeps about 20 KiB of buffers per connection for its life)
/// without refusing a client while idle connections hold the places.
async fn admit(
    slots: &Arc<Semaphore>,
    accepted: &mut VecDeque<Arc<conn::Activity>>,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(slot) = slots.clone().try_acquire_owned() {
        return Some(slot);
    }
    accepted.retain(|a| Arc::strong_count(a) > 1);
    let at = accepted.iter().position(|a| !a.served()).or_else(|| {
        let idle = accepted.iter().enumerate();
        let idle = idle.filter_map(|(i, a)| Some((a.idle_since()?, i)));
        idle.min().map(|(_, i)| i)
    })?;
    let victim = accepted.remove(at)?;
    victim.evict.notify_one();
    drop(victim);
    // Its task ends (an idle HTTP/1 connection at once) and gives the place back.
    tokio::time::timeout(Duration::from_secs(1), slots.clone().acquire_owned())
        .await
        .ok()?
        .ok()
}

/// Whether an answer is an event stream: `text/event-stream` in any case (media types are
/// case-insensitive), with or without parameters, as the library's loop reads it.
fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
        })
}

/// Why a request body could not be read.
enum BodyError {
    TooLarge,
    Stalled,
    /// Not whole by the body deadline.
    TooSlow,
    /// Over what is left of the body budget.
    OverBudget,
    Read,
}

/// Reads a request body whole, up to `cap` bytes, each frame within [`BODY_IDLE_TIMEOUT`] of
/// the one before and all of it by `deadline` (none: a timeout past what time can count),
/// taking each frame's bytes from `reservation`.
async fn read_body<B>(
    body: B,
    cap: usize,
    deadline: Option<Instant>,
    reservation: &mut Reservation,
) -> Result<Bytes, BodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, cap));
    // The usual body is one chunk that came with the head: no list, and no timer for a frame
    // (or the end) already here.
    let mut first: Option<Bytes> = None;
    let mut chunks: Vec<Bytes> = Vec::new();
    loop {
        let here = std::future::poll_fn(|cx| Poll::Ready(body.as_mut().poll_frame(cx))).await;
        let next = match here {
            Poll::Ready(next) => next,
            Poll::Pending => {
                let idle = Instant::now() + BODY_IDLE_TIMEOUT;
                let until = deadline.map_or(idle, |d| idle.min(d));
                match tokio::time::timeout_at(until, body.frame()).await {
                    Ok(next) => next,
                    Err(_) if until == idle => return Err(BodyError::Stalled),
                    Err(_) => return Err(BodyError::TooSlow),
                }
            }
        };
        let frame = match next {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(e)) => {
                return Err(
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some()
                    {
                        BodyError::TooLarge
                    } else {
                        BodyError::Read
                    },
                )
            }
        };
        // Trailers of a request are not forwarded (as before): only the data is kept.
        if let Ok(data) = frame.into_data() {
            if !data.is_empty() {
                if !reservation.grow(data.len()) {
                    return Err(BodyError::OverBudget);
                }
                if first.is_none() && chunks.is_empty() {
                    first = Some(data);
                } else {
                    chunks.extend(first.take());
                    chunks.push(data);
                }
            }
        }
    }
    Ok(match first {
        Some(only) => only,
        None if chunks.is_empty() => Bytes::new(),
        None => Bytes::from(chunks.concat()),
    })
}

fn text(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<ProxyBody> {
    let mut res = Response::new(ProxyBody::full(body));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    res
}

/// An overload answer that also closes its HTTP/1 connection: under overload every client
/// connection kept open holds its buffers (some 20 KiB), so the ones refused give them back
/// at once, and the memory stays bounded by the requests in flight rather than by every
/// client that tried. (HTTP/2 has no such header; its streams share one connection.)
fn closing(mut res: Response<ProxyBody>, version: http::Version) -> Response<ProxyBody> {
    if version <= http::Version::HTTP_11 {
        res.headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
    res
}

impl State {
    fn busy(&self, kind: Kind, version: http::Version) -> Response<ProxyBody> {
        closing(
            self.reject(
                kind,
                Reject::Busy,
                "the proxy is handling as many requests as it is allowed to; retry shortly",
            ),
            version,
        )
    }

    fn body_memory(&self, kind: Kind, version: http::Version) -> Response<ProxyBody> {
        closing(
            self.reject(
                kind,
                Reject::BodyMemory,
                "the request bodies this proxy holds leave no room for this one; retry shortly",
            ),
            version,
        )
    }

    fn reject(&self, kind: Kind, reject: Reject, message: &str) -> Response<ProxyBody> {
        self.metrics.rejected(reject.as_str());
        envelope::response(kind, reject, message)
    }

    /// An upstream answer the proxy cannot pass on (logged by the caller, with what it knows):
    /// counted as the request's `502`, and answered in the route's envelope.
    fn broken_answer(
        &self,
        kind: Kind,
        upstream: &str,
        what: std::fmt::Arguments<'_>,
    ) -> Response<ProxyBody> {
        self.metrics
            .request(upstream, Reject::Upstream.status().as_u16());
        self.reject(
            kind,
            Reject::Upstream,
            &format!("upstream {upstream:?} {what}"),
        )
    }

    async fn handle<B>(self: Arc<Self>, req: Request<B>) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let start = Instant::now();
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/livez") => return text(StatusCode::OK, "text/plain", "ok\n"),
            (&Method::GET, "/readyz") => {
                return if self.draining.load(Ordering::SeqCst) {
                    text(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "draining\n")
                } else {
                    text(StatusCode::OK, "text/plain", "ready\n")
                }
            }
            (&Method::GET, "/metrics") => {
                return text(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    self.metrics.render(),
                )
            }
            _ => {}
        }
        // TRACE would echo the request, held key included, back to the client; CONNECT would
        // make the proxy a tunnel. Only the methods the APIs use are forwarded.
        if !FORWARDED_METHODS.contains(req.method()) {
            let kind = self.routes.guess_kind(req.uri(), req.headers());
            let mut res = self.reject(
                kind,
                Reject::MethodNotAllowed,
                "this proxy forwards GET, POST, PUT, PATCH, DELETE, HEAD and OPTIONS only",
            );
            res.headers_mut()
                .insert(http::header::ALLOW, HeaderValue::from_static(ALLOW));
            return res;
        }
        if let Err(why) = forward::check_path(req.uri().path()) {
            let kind = self.routes.guess_kind(req.uri(), req.headers());
            return self.reject(kind, Reject::BadPath, why);
        }
        let Some(route) = self.routes.resolve(req.uri(), req.headers()) else {
            let kind = self.routes.guess_kind(req.uri(), req.headers());
            let path: String = req.uri().path().chars().take(200).collect();
            return self.reject(
                kind,
                Reject::NotFound,
                &format!("no upstream serves {} {path}", req.method()),
            );
        };
        // Armed until the handler returns: hyper drops this future when the client hangs up
        // before the response head, and the guard then logs and counts the request.
        let mut gone = ClientGone {
            metrics: &self.metrics,
            upstream: &self.factories[route.upstream].upstream().name,
            method: req.method().clone(),
            path: route
                .path_and_query
                .split('?')
                .next()
                .unwrap_or("")
                .to_owned(),
            start,
            armed: true,
        };
        let res = self.forward(req, route, &gone).await;
        gone.armed = false;
        res
    }

    async fn forward<B>(
        self: &Arc<Self>,
        req: Request<B>,
        route: crate::routes::Route,
        gone: &ClientGone<'_>,
    ) -> Response<ProxyBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let factory = &self.factories[route.upstream];
        let up = factory.upstream().clone();
        let kind = up.kind;
        let version = req.version();

        // The slot is taken once the body is read (a body still arriving holds only its
        // bytes, which the body budget bounds); a proxy already full says so at once.
        if self.limit.available_permits() == 0 {
            return self.busy(kind, version);
        }
        self.metrics.in_flight().inc();
        let _in_flight = InFlight(&self.metrics);

        let (mode, preset) = match retry_headers(req.headers()) {
            Ok(x) => x,
            Err(msg) => return self.reject(kind, Reject::BadHeader, &msg),
        };
        let client_deadline = match deadline::requested(req.headers(), up.client_deadline) {
            Ok(d) => d,
            Err(msg) => return self.reject(kind, Reject::BadHeader, &msg),
        };

        // Which tenant's client budget an SDK's retry is charged to. (The fleet names the
        // tenant's scope itself, from the request the stack sends.)
        let tenant = if factory.holds_keys() {
            if !self.token_ok(req.headers()) {
                return self.reject(
                    kind,
                    Reject::Unauthorized,
                    "this proxy holds the upstream keys and requires its client token \
                     (as x-api-key, authorization: Bearer, or x-llm-retry-token)",
                );
            }
            TenantId::PROXY
        } else {
            let h = req.headers();
            let get = |n: &HeaderName| h.get(n).map_or(&b""[..], HeaderValue::as_bytes);
            let (key, auth, azure) = (
                get(&X_API_KEY),
                get(&http::header::AUTHORIZATION),
                get(&API_KEY),
            );
            if azure.is_empty() {
                TenantId::of(&self.tenant_keys, &[key, auth])
            } else {
                TenantId::of(&self.tenant_keys, &[key, auth, b"api-key", azure])
            }
        };

        let cap = self.config.max_body_bytes;
        let declared = req
            .headers()
            .get(CONTENT_LENGTH)
            .map(|v| v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()));
        match declared {
            Some(None) => {
                return self.reject(kind, Reject::BadHeader, "content-length is not a number")
            }
            Some(Some(n)) if n > cap as u64 => {
                return self.reject(
                    kind,
                    Reject::BodyTooLarge,
                    &format!("request body of {n} bytes is over this proxy's limit of {cap}"),
                )
            }
            Some(Some(n)) if n > self.body_budget.left() as u64 => {
                return self.body_memory(kind, version)
            }
            _ => {}
        }
        let (parts, body) = req.into_parts();
        let mut reservation = self.body_budget.reserve();
        let body_deadline = gone.start.checked_add(self.config.body_timeout());
        let body = match read_body(body, cap, body_deadline, &mut reservation).await {
            Ok(b) => b,
            Err(BodyError::OverBudget) => return self.body_memory(kind, version),
            Err(BodyError::TooSlow) => {
                return self.reject(
                    kind,
                    Reject::BodyTimeout,
                    &format!(
                        "the request body did not arrive whole within {} s",
                        self.config.body_timeout_secs
                    ),
                )
            }
            Err(BodyError::TooLarge) => {
                return self.reject(
                    kind,
                    Reject::BodyTooLarge,
                    &format!("request body is over this proxy's limit of {cap} bytes"),
                )
            }
            Err(BodyError::Stalled) => {
                return self.reject(
                    kind,
                    Reject::BodyTimeout,
                    &format!(
                        "the request body stalled: no byte for {} s",
                        BODY_IDLE_TIMEOUT.as_secs()
                    ),
                )
            }
            Err(BodyError::Read) => {
                return self.reject(kind, Reject::BodyRead, "the request body could not be read")
            }
        };
        let Ok(permit) = self.limit.clone().try_acquire_owned() else {
            return self.busy(kind, version);
        };

        let Some(uri) = factory.upstream_uri(route.path_and_query) else {
            return self.reject(kind, Reject::BadHeader, "the request target is not valid");
        };
        // Kept for a continuation only when this upstream resumes cut streams.
        let resume_body = up.resumes().then(|| body.clone());
        let mut upstream_req = Request::new(Full::new(body));
        *upstream_req.method_mut() = parts.method;
        *upstream_req.uri_mut() = uri;
        *upstream_req.headers_mut() = forward::request_headers(parts.headers, factory.holds_keys());
        match mode {
            Mode::Retry => {}
            Mode::Off => {
                upstream_req.extensions_mut().insert(NoRetry);
            }
            Mode::ClientRetry => {
                self.metrics.client_retry(&up.name);
                upstream_req.extensions_mut().insert(NoRetry);
            }
        }
        if let Some(p) = preset {
            upstream_req
                .extensions_mut()
                .insert(up.apply_timeouts(p.policy()));
        }
        // The upstream's `deadline_secs` already bounds the policy, less the same margin: a
        // shorter deadline of the client's replaces it, and only it. The library's deadline
        // runs from the call, once the body is read: where an SDK's read timeout starts too.
        if let Some(t) = client_deadline {
            if up.deadline_secs.is_none_or(|s| t < Duration::from_secs(s)) {
                upstream_req
                    .extensions_mut()
                    .insert(Override::new().deadline(Some(deadline::bound(t))));
            }
        }

        // An SDK's retry of the proxy is a retry: it draws on the tenant's client budget,
        // which the other requests pay into, instead of starting a loop of its own.
        if let Some(config) = up.budget_config() {
            use tower::retry::budget::Budget;
            let budget = self.tenants.client_budget(route.upstream, tenant, config);
            if mode == Mode::ClientRetry {
                if !budget.withdraw() {
                    self.metrics.client_retry_refused(&up.name);
                    let mut res = self.reject(
                        kind,
                        Reject::Budget,
                        "the retry budget is spent: this client retry is not sent",
                    );
                    res.headers_mut()
                        .insert(SHOULD_RETRY, HeaderValue::from_static("false"));
                    res.headers_mut()
                        .insert(ATTEMPTS_NAME, HeaderValue::from(0u32));
                    return res;
                }
            } else {
                budget.deposit();
            }
        }
        let stack = factory.stack();
        let (path, method, start) = (&gone.path, &gone.method, gone.start);
        let resume = resume_body.and_then(|body| {
            // A client that turned retries off gets the upstream's answer as it is.
            let text_route = path.ends_with("/chat/completions") || path.ends_with("/messages");
            if mode == Mode::Off || method != Method::POST || !text_route {
                return None;
            }
            let mut req = Request::new(body);
            *req.method_mut() = method.clone();
            *req.uri_mut() = upstream_req.uri().clone();
            *req.headers_mut() = upstream_req.headers().clone();
            *req.extensions_mut() = upstream_req.extensions().clone();
            Some(req)
        });
        match stack.oneshot(upstream_req).await {
            Ok(res) => {
                let (mut head, body) = res.into_parts();
                // A 1xx as the final answer: hyper consumes the interim ones (100, 103), and
                // the request asked for no upgrade (`upgrade` is not forwarded), so a 101 or
                // any other is a protocol the client did not ask for. Passed on, it would end
                // the client's connection.
                if head.status.is_informational() {
                    tracing::warn!(
                        method = %method,
                        upstream = %up.name,
                        path = %path,
                        status = head.status.as_u16(),
                        "upstream answered with an informational status as its final answer"
                    );
                    return self.broken_answer(
                        kind,
                        &up.name,
                        format_args!(
                            "answered {} to a request that asked for no upgrade",
                            head.status.as_u16()
                        ),
                    );
                }
                // An answer that is not a stream waits for its first frame before its head
                // goes out: a body that fails before any byte (broken chunked framing, a cut)
                // is then the proxy's 502, which the client can read, not a 200 that ends in
                // a bare close. A stream's head goes out at once; its failure is the
                // protocol's error event.
                let sse = is_event_stream(&head.headers);
                let body = if sse {
                    body
                } else {
                    let mut body = body;
                    match body.frame().await {
                        Some(Err(e)) => {
                            tracing::warn!(
                                method = %method,
                                upstream = %up.name,
                                path = %path,
                                status = head.status.as_u16(),
                                error = %e,
                                "upstream answer failed before its first body byte"
                            );
                            return self.broken_answer(
                                kind,
                                &up.name,
                                format_args!(
                                    "answered {} and its body failed before its first byte",
                                    head.status.as_u16()
                                ),
                            );
                        }
                        first => Peeked {
                            first: first.and_then(Result::ok),
                            rest: body,
                        }
                        .boxed_unsync(),
                    }
                };
                // Chunked framing wins over a Content-Length (RFC 9112 §6.3): the length the
                // upstream stated is not the body's, and passed on it would cut the body
                // short and mark it complete.
                if head.headers.contains_key(http::header::TRANSFER_ENCODING) {
                    head.headers.remove(CONTENT_LENGTH);
                }
                let trail = head.extensions.get::<RetryTrail>();
                let attempts = trail.map_or(1, |t| t.total_attempts().max(1));
                let gave_up = trail.and_then(RetryTrail::gave_up);
                forward::strip_hop_by_hop(&mut head.headers);
                decorate(&mut head.headers, attempts, gave_up, mode);
                let used = head.extensions.get::<ModelUsed>();
                head.headers.insert(
                    UPSTREAM_NAME,
                    factory.upstream_header(used.and_then(|u| u.upstream.as_ref())),
                );
                if let Some(used) = used {
                    if let Some(v) = targets_header(factory, used) {
                        head.headers.insert(TARGETS_NAME, v);
                    }
                    if let Ok(v) = HeaderValue::from_str(&used.model) {
                        head.headers.insert(MODEL_NAME, v);
                    }
                    head.headers.insert(
                        FALLBACK_NAME,
                        HeaderValue::from_static(if used.is_fallback() { "true" } else { "false" }),
                    );
                    if used.is_fallback() {
                        self.metrics.fallback(&up.name);
                    }
                }
                if attempts == 1 {
                    if let Some(UpstreamHead(d)) = head.extensions.get::<UpstreamHead>() {
                        self.metrics.overhead(start.elapsed().saturating_sub(*d));
                    }
                }
                let status = head.status.as_u16();
                // A stream is counted when it ends: by its status, or as `client_gone` when the
                // client hangs up first.
                if !sse {
                    factory.series().request(status);
                }
                tracing::info!(
                    method = %method,
                    upstream = %up.name,
                    path = %path,
                    status = head.status.as_u16(),
                    attempts,
                    ms = start.elapsed().as_millis() as u64,
                    "request"
                );
                let style = sse.then(|| StreamStyle::for_route(kind, path));
                if sse {
                    // The stream may end with an error event of the proxy's: its length is
                    // not the upstream's to state.
                    head.headers.remove(CONTENT_LENGTH);
                }
                // The mode of the target that served: its own `resume`, else its upstream's.
                let with = resume.and_then(|req| {
                    let served = head
                        .headers
                        .get(UPSTREAM_NAME)
                        .and_then(|v| v.to_str().ok());
                    let model = head.extensions.get::<ModelUsed>().map(|u| u.model.as_str());
                    let with = match up.resume_for(served.unwrap_or(&up.name), model.unwrap_or(""))
                    {
                        ResumeMode::Off => return None,
                        ResumeMode::Prefill => ResumeWith::Prefill,
                        ResumeMode::Instruction => ResumeWith::Instruction,
                    };
                    Some((with, req))
                });
                let body = match with {
                    Some((with, req))
                        if matches!(
                            style,
                            Some(StreamStyle::Anthropic | StreamStyle::OpenAiChat)
                        ) =>
                    {
                        let metrics = self.metrics.clone();
                        let name = up.name.clone();
                        // The continuation goes through the same stack (its retries and
                        // fallbacks apply), for the model that served the answer.
                        let mut resumed = ResumeBody::new(body, factory.stack(), req, with)
                            .on_outcome(move |outcome| {
                                let outcome = match outcome {
                                    ResumeOutcome::Resumed => "resumed",
                                    _ => "failed",
                                };
                                metrics.resume(&name, outcome);
                            });
                        if let Some(used) = head.extensions.get::<ModelUsed>() {
                            resumed = resumed.model(used.model.clone());
                        }
                        resumed.boxed_unsync()
                    }
                    _ => body,
                };
                let metrics = self.metrics.clone();
                let name = up.name.clone();
                let on_abort: crate::body::OnAbort =
                    Box::new(move |k| metrics.stream_abort(&name, k));
                let mut body = ProxyBody::upstream(body, style, Some(permit), Some(on_abort))
                    .holding(reservation);
                if sse {
                    let state = self.clone();
                    let (name, method, path) = (up.name.clone(), method.clone(), path.clone());
                    body = body.on_end(Box::new(move |how| {
                        state.stream_ended(how, &name, status, &method, &path, start)
                    }));
                }
                Response::from_parts(head, body)
            }
            Err(e) => {
                let lib = e.downcast_ref::<tower_llm_retry::Error>();
                let err_kind = lib.map(|e| e.kind());
                let attempts = lib
                    .and_then(|e| e.trail())
                    .map_or(1, |t| t.total_attempts().max(1));
                let (reject, retried) = match err_kind {
                    Some(ErrorKind::BodyTooLarge) => (Reject::BodyTooLarge, false),
                    Some(ErrorKind::BodyRead) => (Reject::BodyRead, false),
                    Some(ErrorKind::BudgetExhausted) => (Reject::Budget, true),
                    Some(ErrorKind::DeadlineExceeded | ErrorKind::PacingWaitTooLong) => {
                        (Reject::Deadline, true)
                    }
                    Some(ErrorKind::TokenRefresh) => (Reject::Credential, false),
                    // `redis_fail_closed`: nothing was sent; the client may come back.
                    Some(ErrorKind::FleetUnreachable) => (Reject::Busy, false),
                    Some(ErrorKind::Exhausted) => (Reject::Upstream, true),
                    Some(ErrorKind::Unsendable) => (Reject::Unsendable, false),
                    _ => (Reject::Upstream, false),
                };
                let what = err_kind.map_or("upstream_error", |k| k.as_str());
                // What to change, when the proxy's configuration is what failed.
                let cause = lib
                    .and_then(|e| std::error::Error::source(e))
                    .and_then(|s| s.downcast_ref::<tower_llm_retry::classify::Unsendable>())
                    .map(|u| u.cause());
                tracing::warn!(
                    method = %method,
                    upstream = %up.name,
                    path = %path,
                    error.type = what,
                    error = %e,
                    attempts,
                    "request failed"
                );
                self.metrics.request(&up.name, reject.status().as_u16());
                let message = match cause {
                    Some(cause) => format!(
                        "upstream {:?} cannot be sent to as the proxy is configured (nothing \
                         was sent): {cause}",
                        up.name
                    ),
                    None => format!(
                        "upstream {:?} failed after {attempts} attempt(s): {what}",
                        up.name
                    ),
                };
                let mut res = self.reject(kind, reject, &message);
                let h = res.headers_mut();
                h.insert(ATTEMPTS_NAME, HeaderValue::from(attempts));
                if mode != Mode::Off && (retried || mode == Mode::ClientRetry) {
                    h.insert(SHOULD_RETRY, HeaderValue::from_static("false"));
                }
                res
            }
        }
    }

    /// Counts a stream when its body ends: by its status, or as `client_gone` when the client
    /// dropped it first. A stream the drain cuts was not the client's doing: its status.
    fn stream_ended(
        &self,
        how: Ended,
        upstream: &str,
        status: u16,
        method: &Method,
        path: &str,
        start: Instant,
    ) {
        if how == Ended::Dropped && !self.draining.load(Ordering::SeqCst) {
            tracing::info!(
                method = %method,
                upstream = %upstream,
                path = %path,
                status,
                ms = start.elapsed().as_millis() as u64,
                "client gone before the end of the response"
            );
            self.metrics.client_gone(upstream);
        } else {
            self.metrics.request(upstream, status);
        }
    }

    fn token_ok(&self, headers: &HeaderMap) -> bool {
        let Some(expected) = &self.client_token else {
            return false;
        };
        let mut ok = subtle::Choice::from(0);
        for presented in forward::presented_tokens(headers) {
            let digest: [u8; 32] = Sha256::digest(presented).into();
            ok |= digest.ct_eq(expected);
        }
        ok.into()
    }
}

/// A body whose first frame was read ahead: that frame, then the rest.
struct Peeked<B> {
    first: Option<http_body::Frame<Bytes>>,
    rest: B,
}

impl<B> Body for Peeked<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        if let Some(f) = self.first.take() {
            return Poll::Ready(Some(Ok(f)));
        }
        std::pin::Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut hint = self.rest.size_hint();
        if let Some(n) = self
            .first
            .as_ref()
            .and_then(|f| f.data_ref())
            .map(|d| d.len() as u64)
        {
            // The upper bound first: a lower bound above the old upper one would panic.
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper.saturating_add(n));
            }
            hint.set_lower(hint.lower().saturating_add(n));
        }
        hint
    }
}

/// Logs and counts a request whose client hung up before its response head: the handler's
/// future, which holds this, is dropped by hyper then, and the loop with it (its attempts are
/// counted as they are made).
struct ClientGone<'a> {
    metrics: &'a Metrics,
    upstream: &'a str,
    method: Method,
    path: String,
    start: Instant,
    armed: bool,
}

impl Drop for ClientGone<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(
                method = %self.method,
                upstream = %self.upstream,
                path = %self.path,
                ms = self.start.elapsed().as_millis() as u64,
                "client gone before the response head"
            );
            self.metrics.client_gone(self.upstream);
        }
    }
}

struct InFlight<'a>(&'a Metrics);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight().dec();
    }
}

/// `upstream/model=attempts,…` for every target `used` went to, when it went to more than
/// one attempt's worth; `None` for a single attempt.
fn targets_header(factory: &StackFactory, used: &ModelUsed) -> Option<HeaderValue> {
    if used.attempts.is_empty() {
        return None;
    }
    let mut out = String::new();
    for (i, t) in used.attempts.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let name = factory.upstream_name(t.upstream.as_ref());
        out.push_str(&format!("{name}/{}={}", t.model, t.attempts));
    }
    HeaderValue::from_str(&out).ok()
}

/// The retry switch and preset a request asks for.
fn retry_headers(headers: &HeaderMap) -> Result<(Mode, Option<Preset>), String> {
    let mut mode = match headers.get(RETRY_SWITCH_NAME).map(|v| v.to_str()) {
        None => Mode::Retry,
        Some(Ok(v)) if v.trim().eq_ignore_ascii_case("off") => Mode::Off,
        Some(Ok(v)) if v.trim().eq_ignore_ascii_case("on") => Mode::Retry,
        Some(_) => return Err(format!("{RETRY_SWITCH} must be \"on\" or \"off\"")),
    };
    let preset = match headers.get(RETRY_POLICY_NAME).map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => Some(Preset::from_name(v).ok_or_else(|| {
            format!(
                "{RETRY_POLICY} must be one of default, sdk_compatible, patient, interactive, never"
            )
        })?),
        Some(Err(_)) => return Err(format!("{RETRY_POLICY} is not valid text")),
    };
    let client_retrying = headers
        .get(SDK_RETRY_COUNT_NAME)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u32>().ok())
        .is_some_and(|n| n > 0);
    if mode == Mode::Retry && client_retrying {
        mode = Mode::ClientRetry;
    }
    Ok((mode, preset))
}

/// Adds the attempt count and, when the proxy retried and gave up, `x-should-retry: false`,
/// so an SDK that retries by itself does not multiply the attempts. A response the proxy
/// chose not to retry keeps the upstream's own hint.
fn decorate(headers: &mut HeaderMap, attempts: u32, gave_up: Option<GiveUpReason>, mode: Mode) {
    headers.insert(ATTEMPTS_NAME, HeaderValue::from(attempts));
    let Some(reason) = gave_up else {
        return;
    };
    headers.insert(GAVE_UP_NAME, HeaderValue::from_static(reason_name(reason)));
    let exhausted = matches!(
        reason,
        GiveUpReason::MaxRetries
            | GiveUpReason::MaxConsecutiveOverloads
            | GiveUpReason::Budget
            | GiveUpReason::Deadline
            | GiveUpReason::PacingWaitTooLong
    );
    if exhausted && mode != Mode::Off {
        headers.insert(SHOULD_RETRY, HeaderValue::from_static("false"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_stream_in_any_case_with_parameters() {
        let headers = |ct: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            h
        };
        for yes in [
            "text/event-stream",
            "Text/Event-Stream",
            " TEXT/EVENT-STREAM; charset=utf-8",
        ] {
            assert!(is_event_stream(&headers(yes)), "{yes}");
        }
        for no in ["text/event-streams", "application/json"] {
            assert!(!is_event_stream(&headers(no)), "{no}");
        }
        assert!(!is_event_stream(&http::HeaderMap::new()));
    }
}
