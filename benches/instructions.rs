//! Instructions per request on the success path, counted by `valgrind --tool=cachegrind`
//! (a count, which the machine's load does not move, unlike a time).
//!
//! `cargo bench --bench instructions` runs this binary under cachegrind for 2,000 and 22,000
//! requests of each case and prints the difference divided by 20,000, so that set-up and
//! start-up cancel out: the bare in-memory service, `tower::retry` with a policy that clones
//! the request, `RetryLayer::new()`, and the whole stack (retry, model fallback,
//! context-overflow repair, an API key) with a 1 KiB body and with a small JSON body. Needs
//! `valgrind` on the `PATH`. `instructions CASE N` sends N requests of one case.
use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::hint::black_box;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower::{Layer, Service};
use tower_llm_retry::RetryLayer;

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

fn request<B>(body: B) -> Request<B> {
    Request::post("https://api.anthropic.com/v1/messages")
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-ant-bench")
        .body(body)
        .expect("valid request")
}

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

const CASES: [&str; 5] = ["bare", "tower", "layer", "stack", "stack_json"];

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    match args.as_slice() {
        [case, n] => run(case, n.parse().expect("a number of requests")),
        _ => count_all(),
    }
}

/// Runs every case under cachegrind twice and prints instructions per request.
fn count_all() {
    let exe = std::env::current_exe().expect("own path");
    let total = |case: &str, n: u64| -> Option<u64> {
        let out = std::process::Command::new("valgrind")
            .args([
                "--tool=cachegrind",
                "--cache-sim=no",
                "--cachegrind-out-file=/dev/null",
            ])
            .arg(&exe)
            .args([case, &n.to_string()])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stderr);
        let line = text
            .lines()
            .find(|l| l.contains("I") && l.contains("refs:"))?;
        line.rsplit(':')
            .next()?
            .trim()
            .replace(',', "")
            .parse()
            .ok()
    };
    let mut per = Vec::new();
    for case in CASES {
        let (Some(short), Some(long)) = (total(case, 2_000), total(case, 22_000)) else {
            println!("valgrind did not run: install it to count instructions");
            return;
        };
        let n = long.saturating_sub(short) as f64 / 20_000.0;
        per.push(n);
        println!("{case}: {n:.0} instructions per request");
    }
    println!(
        "layer / tower::retry: {:.3}; stack / bare: {:.3}",
        per[2] / per[1],
        per[3] / per[0]
    );
}

fn run(case: &str, n: usize) {
    let data = Bytes::from(vec![b'x'; 1024]);
    let json = Bytes::from_static(br#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":"Hello there, how are you today? Tell me about retries."}]}"#);
    match case {
        "bare" => {
            let mut s = Upstream;
            for _ in 0..n {
                black_box(call(&mut s, request(Full::new(data.clone()))));
            }
        }
        "tower" => {
            let mut s = tower::retry::Retry::new(ClonePolicy, Upstream);
            for _ in 0..n {
                black_box(call(&mut s, request(Full::new(data.clone()))));
            }
        }
        "layer" => {
            let mut s = RetryLayer::new().layer(Upstream);
            for _ in 0..n {
                black_box(call(&mut s, request(Full::new(data.clone()))));
            }
        }
        "stack" => {
            let mut s = full_stack();
            for _ in 0..n {
                black_box(call(&mut s, request(Full::new(data.clone()))));
            }
        }
        "stack_json" => {
            let mut s = full_stack();
            for _ in 0..n {
                black_box(call(&mut s, request(Full::new(json.clone()))));
            }
        }
        other => panic!("unknown case {other}: one of {CASES:?}"),
    }
}
