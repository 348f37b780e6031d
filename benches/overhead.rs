//! What the retry layer costs on the success path.
//!
//! Run with `cargo bench --bench overhead`. In memory (criterion): one request through the
//! bare service, through `RetryLayer::new()` (budget on), and through `tower::retry` with a
//! policy that clones the request, for `Full<Bytes>` bodies of 1 KiB and 1 MiB and a 1 MiB
//! body streamed in 16 KiB chunks; for 1 KiB also through the whole stack (retry, model
//! fallback, context-overflow repair, credentials). The futures are polled by hand with a no-op waker, so no
//! executor cost dilutes the comparison. A counting global allocator reports allocations and
//! bytes allocated per request. Over loopback HTTP (a hyper server and hyper-util's client on
//! 127.0.0.1): requests per second, bare client against the client behind the layer, over
//! HTTP/1.1 (`loopback`) and over one HTTP/2 connection with prior knowledge (`loopback_h2`).
//!
//! Writes `target/bench/overhead.json`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::hint::black_box;
use std::path::Path;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use criterion::{Criterion, Throughput};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tower::{Layer, Service};
use tower_llm_retry::{ReplayBody, RetryLayer};

// ---------------------------------------------------------------------------------------------
// Counting allocations.

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

fn count(size: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(size as u64, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; counting has no effect
// on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

// ---------------------------------------------------------------------------------------------
// The in-memory upstream, and the bodies.

/// Reads the whole request body (without copying it) and answers a small JSON reply.
#[derive(Debug, Clone, Copy)]
struct Upstream;

const REPLY: &[u8] =
    br#"{"id":"msg_1","type":"message","content":[{"type":"text","text":"Hello!"}]}"#;

impl<B> Service<Request<B>> for Upstream
where
    B: Body + Unpin,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Full<Bytes>>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let mut body = req.into_body();
        let mut cx = Context::from_waker(Waker::noop());
        let mut len = 0;
        while let Poll::Ready(Some(frame)) = Pin::new(&mut body).poll_frame(&mut cx) {
            if let Some(data) = frame.ok().and_then(|f| f.into_data().ok()) {
                len += data.remaining();
            }
        }
        black_box(len);
        ready(Ok(Response::new(Full::new(Bytes::from_static(REPLY)))))
    }
}

/// A body streamed in chunks, with no length known up front.
struct Chunks(VecDeque<Bytes>);

impl Chunks {
    fn of(data: &Bytes, chunk: usize) -> Self {
        Chunks(
            (0..data.len())
                .step_by(chunk)
                .map(|i| data.slice(i..(i + chunk).min(data.len())))
                .collect(),
        )
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

fn request<B>(body: B) -> Request<B> {
    Request::post("https://api.anthropic.com/v1/messages")
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-ant-bench")
        .body(body)
        .expect("valid request")
}

/// Polls a future that completes without waiting (everything here is in memory).
fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

fn call<S, Req>(svc: &mut S, req: Req) -> S::Response
where
    S: Service<Req>,
    S::Error: std::fmt::Debug,
{
    now(std::future::poll_fn(|cx| svc.poll_ready(cx))).expect("ready");
    now(svc.call(req)).expect("success")
}

/// `tower::retry` needs a request it can clone: this policy clones head and `Full` body.
#[derive(Debug, Clone, Copy)]
struct ClonePolicy;

impl<E> tower::retry::Policy<Request<Full<Bytes>>, Response<Full<Bytes>>, E> for ClonePolicy {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<Full<Bytes>>, E>,
    ) -> Option<Ready<()>> {
        match result {
            Ok(res) if res.status().is_server_error() => Some(ready(())),
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut clone = Request::builder()
            .method(req.method().clone())
            .uri(req.uri().clone())
            .version(req.version());
        *clone.headers_mut()? = req.headers().clone();
        clone.body(req.body().clone()).ok()
    }
}

// ---------------------------------------------------------------------------------------------
// In-memory benchmarks.

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

fn payload(len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>())
}

fn in_memory(c: &mut Criterion) {
    for (case, len) in [("full_1k", KIB), ("full_1m", MIB)] {
        let data = payload(len);
        let mut group = c.benchmark_group(case);
        group.throughput(Throughput::Bytes(len as u64));
        let mut bare = Upstream;
        group.bench_function("bare", |b| {
            b.iter(|| call(&mut bare, request(Full::new(data.clone()))))
        });
        let mut ours = RetryLayer::new().layer(Upstream);
        group.bench_function("ours", |b| {
            b.iter(|| call(&mut ours, request(Full::new(data.clone()))))
        });
        if case == "full_1k" {
            // What the retry budget's bookkeeping adds (a lock and a clock read per request).
            let mut no_budget = RetryLayer::new()
                .fleet(
                    tower_llm_retry::fleet::Fleet::builder()
                        .budget(None)
                        .build(),
                )
                .layer(Upstream);
            group.bench_function("ours_without_budget", |b| {
                b.iter(|| call(&mut no_budget, request(Full::new(data.clone()))))
            });
            // The whole stack: retry, model fallback, context-overflow repair, credentials.
            let mut stack = full_stack();
            group.bench_function("full_stack", |b| {
                b.iter(|| call(&mut stack, request(Full::new(data.clone()))))
            });
        }
        let mut tower = tower::retry::Retry::new(ClonePolicy, Upstream);
        group.bench_function("tower_retry", |b| {
            b.iter(|| call(&mut tower, request(Full::new(data.clone()))))
        });
        group.finish();
    }
    let data = payload(MIB);
    let mut group = c.benchmark_group("streamed_1m");
    group.throughput(Throughput::Bytes(MIB as u64));
    let mut bare = Upstream;
    group.bench_function("bare", |b| {
        b.iter(|| call(&mut bare, request(Chunks::of(&data, 16 * KIB))))
    });
    let mut ours = RetryLayer::new().layer(Upstream);
    group.bench_function("ours", |b| {
        b.iter(|| call(&mut ours, request(Chunks::of(&data, 16 * KIB))))
    });
    group.finish();
}

/// `RetryLayer` with every companion layer, as the `full_stack` example builds it, over the
/// in-memory upstream.
fn full_stack(
) -> impl Service<Request<Full<Bytes>>, Response = Response<impl Body>, Error = tower_llm_retry::Error>
{
    use tower_llm_retry::{ApiKey, AuthLayer, ContextOverflowLayer, ModelFallbackLayer};
    tower::ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(
            ModelFallbackLayer::new(["claude-sonnet-4-5", "claude-haiku-4-5"])
                .expect("valid chain"),
        )
        .layer(ContextOverflowLayer::new())
        .layer(AuthLayer::new(
            ApiKey::new("sk-ant-bench").expect("valid key"),
        ))
        .service(Upstream)
}

/// Allocations and bytes allocated per request, over `n` requests.
fn allocations(n: u64, mut one: impl FnMut()) -> (f64, f64) {
    one();
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for _ in 0..n {
        one();
    }
    COUNTING.store(false, Ordering::SeqCst);
    let allocs = ALLOCS.load(Ordering::SeqCst) as f64 / n as f64;
    let bytes = BYTES.load(Ordering::SeqCst) as f64 / n as f64;
    (allocs, bytes)
}

// ---------------------------------------------------------------------------------------------
// Loopback HTTP.

const LOOPBACK_TASKS: usize = 16;
const LOOPBACK_REQUESTS: usize = 4_000;
const LOOPBACK_ROUNDS: usize = 15;

/// The protocol of a loopback case, on both sides of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    /// h2c with prior knowledge: every request of a client shares one connection.
    Http2,
}

/// Serves `REPLY` over `protocol`, counting the connections accepted.
async fn serve(listener: tokio::net::TcpListener, protocol: Protocol, accepted: Arc<AtomicUsize>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        accepted.fetch_add(1, Ordering::Relaxed);
        if protocol == Protocol::Http2 {
            // Every reply goes out as small frames on the one shared connection, and with Nagle
            // on they can wait for the client's delayed ACK: without this, bare throughput
            // varied up to fourfold between rounds and the ratios from 0.2 to 2.5.
            let _ = stream.set_nodelay(true);
        }
        tokio::spawn(async move {
            let service = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async {
                let body = req.into_body().collect().await?.to_bytes();
                black_box(body.len());
                Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::from_static(REPLY))))
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = match protocol {
                Protocol::Http1 => {
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await
                }
                Protocol::Http2 => {
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(io, service)
                        .await
                }
            };
        });
    }
}

/// hyper-util's client as each loopback case uses it: its defaults over HTTP/1.1; over
/// HTTP/2 only HTTP/2, and no Nagle delay on the one connection every request shares.
fn client<B>(
    protocol: Protocol,
) -> hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, B>
where
    B: Body + Send,
    B::Data: Send,
{
    use hyper_util::client::legacy::{connect::HttpConnector, Client};
    use hyper_util::rt::TokioExecutor;
    match protocol {
        Protocol::Http1 => Client::builder(TokioExecutor::new()).build_http(),
        Protocol::Http2 => {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(connector)
        }
    }
}

/// Requests per second of `LOOPBACK_TASKS` tasks sending `LOOPBACK_REQUESTS` in all.
async fn rps<S, B, RB>(svc: S, url: &str, body: Bytes, wrap: fn(Bytes) -> B) -> f64
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug,
    S::Future: Send,
    B: Send + 'static,
    RB: Body + Send,
    RB::Data: Send,
    RB::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..LOOPBACK_TASKS {
        let svc = svc.clone();
        let url = url.to_owned();
        let body = body.clone();
        tasks.spawn(async move {
            for _ in 0..LOOPBACK_REQUESTS / LOOPBACK_TASKS {
                let mut req = request(wrap(body.clone()));
                *req.uri_mut() = url.parse().expect("url");
                let res = svc.clone().oneshot(req).await.expect("loopback request");
                assert_eq!(res.status(), StatusCode::OK);
                let body = res.into_body().collect().await.expect("reply body");
                black_box(body);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    LOOPBACK_REQUESTS as f64 / start.elapsed().as_secs_f64()
}

/// One loopback case's figures.
#[derive(Debug)]
struct Loopback {
    /// Requests per second bare, median over the rounds.
    bare: f64,
    /// Requests per second through the layer, median over the rounds.
    ours: f64,
    /// The median of the rounds' ratios (each round runs both, one after the other, so drift
    /// hits both).
    ratio: f64,
    /// The lowest and highest ratio of a round.
    range: (f64, f64),
    /// Connections the server accepted over the case, warm-up included.
    connections: usize,
}

fn loopback(protocol: Protocol) -> Loopback {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind 127.0.0.1");
        let url = format!(
            "http://{}/v1/messages",
            listener.local_addr().expect("addr")
        );
        let accepted = Arc::new(AtomicUsize::new(0));
        let server = tokio::spawn(serve(listener, protocol, accepted.clone()));
        let body = payload(KIB);
        let bare = client::<Full<Bytes>>(protocol);
        let ours = RetryLayer::new().layer(client::<ReplayBody>(protocol));
        // Warm the connection pools, then alternate so that drift hits both alike.
        rps(bare.clone(), &url, body.clone(), Full::new).await;
        rps(ours.clone(), &url, body.clone(), Full::new).await;
        let (mut b, mut o, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..LOOPBACK_ROUNDS {
            let bare_rps = rps(bare.clone(), &url, body.clone(), Full::new).await;
            let our_rps = rps(ours.clone(), &url, body.clone(), Full::new).await;
            b.push(bare_rps);
            o.push(our_rps);
            ratios.push(our_rps / bare_rps);
        }
        server.abort();
        let range = ratios
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &r| {
                (lo.min(r), hi.max(r))
            });
        Loopback {
            bare: median(b),
            ours: median(o),
            ratio: median(ratios),
            range,
            connections: accepted.load(Ordering::Relaxed),
        }
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

// ---------------------------------------------------------------------------------------------
// Results.

/// Criterion's median estimate for one benchmark, in nanoseconds (the median, because other
/// processes on a small machine add outliers).
fn median_ns(dir: &Path, group: &str, id: &str) -> Option<f64> {
    let path = dir.join(group).join(id).join("new").join("estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v["median"]["point_estimate"].as_f64()
}

fn round(x: f64, places: i32) -> f64 {
    let f = 10f64.powi(places);
    (x * f).round() / f
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let criterion_dir = root.join("target").join("criterion");
    let mut c = Criterion::default()
        .output_directory(&criterion_dir)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50)
        .configure_from_args();
    in_memory(&mut c);
    c.final_summary();

    let mut rows = Vec::new();
    let mut print = Vec::new();
    for (case, len, chunked) in [
        ("full_1k", KIB, false),
        ("full_1m", MIB, false),
        ("streamed_1m", MIB, true),
    ] {
        let data = payload(len);
        let mut ours = RetryLayer::new().layer(Upstream);
        let (allocs, bytes) = if chunked {
            allocations(200, || {
                black_box(call(&mut ours, request(Chunks::of(&data, 16 * KIB))));
            })
        } else {
            allocations(1_000, || {
                black_box(call(&mut ours, request(Full::new(data.clone()))));
            })
        };
        let mut bare = Upstream;
        let (bare_allocs, bare_bytes) = if chunked {
            allocations(200, || {
                black_box(call(&mut bare, request(Chunks::of(&data, 16 * KIB))));
            })
        } else {
            allocations(1_000, || {
                black_box(call(&mut bare, request(Full::new(data.clone()))));
            })
        };
        print.push(format!(
            "{case}: through the layer {allocs:.1} allocations and {bytes:.0} bytes per request \
             (bare: {bare_allocs:.1} and {bare_bytes:.0}); the body is {len} bytes"
        ));
        let Some(our_ns) = median_ns(&criterion_dir, case, "ours") else {
            continue;
        };
        let baselines: &[&str] = if chunked {
            &["bare"]
        } else {
            &["bare", "tower_retry"]
        };
        for baseline in baselines {
            if let Some(base_ns) = median_ns(&criterion_dir, case, baseline) {
                rows.push(json!({
                    "case": case,
                    "baseline": baseline,
                    "ratio": round(our_ns / base_ns, 3),
                    "better": "lower",
                    "allocs_per_request": round(allocs, 2),
                }));
                print.push(format!(
                    "{case}: {our_ns:.0} ns through the layer, {base_ns:.0} ns {baseline}: ratio {:.3}",
                    our_ns / base_ns
                ));
            }
        }
        if let Some(nb) = median_ns(&criterion_dir, case, "ours_without_budget") {
            print.push(format!(
                "{case}: {nb:.0} ns through the layer without the budget"
            ));
        }
        if let Some(fs) = median_ns(&criterion_dir, case, "full_stack") {
            let mut stack = full_stack();
            let (allocs, bytes) = allocations(1_000, || {
                black_box(call(&mut stack, request(Full::new(data.clone()))));
            });
            let bare = median_ns(&criterion_dir, case, "bare").unwrap_or(f64::NAN);
            print.push(format!(
                "{case}: {fs:.0} ns through the full stack (retry, fallback, overflow, auth): \
                 ratio to bare {:.3}; {allocs:.1} allocations and {bytes:.0} bytes per request",
                fs / bare
            ));
        }
        print.push(format!(
            "{case}: {:.2} GB/s through the layer",
            len as f64 / our_ns
        ));
    }

    for (case, protocol) in [
        ("loopback", Protocol::Http1),
        ("loopback_h2", Protocol::Http2),
    ] {
        let Loopback {
            bare,
            ours,
            ratio,
            range: (lo, hi),
            connections,
        } = loopback(protocol);
        rows.push(json!({
            "case": case,
            "baseline": "bare",
            "ratio": round(ratio, 3),
            "better": "higher",
        }));
        print.push(format!(
            "{case}: {bare:.0} requests/s bare, {ours:.0} through the layer (medians of \
             {LOOPBACK_ROUNDS} rounds); median ratio of the rounds {ratio:.3} (rounds \
             {lo:.3}-{hi:.3}); {connections} connections accepted"
        ));
    }

    for line in print {
        println!("{line}");
    }
    let dir = root.join("target").join("bench");
    std::fs::create_dir_all(&dir).expect("create target/bench");
    let path = dir.join("overhead.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&Value::Array(rows)).expect("json") + "\n",
    )
    .expect("write overhead.json");
    println!("wrote {}", path.display());
}
