//! Peak memory of many concurrent requests with 1 MiB bodies, measured with a counting
//! allocator: `Full` bodies must not be copied at all, and a streamed body is held exactly
//! once (the one buffered copy every retry layer needs).
//!
//! ```text
//! cargo bench --bench memory
//! ```
//!
//! Writes `target/bench/memory.json`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use tokio::sync::Barrier;
use tower::{service_fn, Layer, ServiceExt};
use tower_llm_retry::{ReplayBody, RetryLayer};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const N: usize = 1_000;
const MIB: usize = 1024 * 1024;

/// A request body that arrives in 16 KiB chunks, each a slice of one shared buffer, so the
/// chunks themselves allocate nothing.
struct Chunked(VecDeque<Bytes>);

impl Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|c| Ok(Frame::data(c))))
    }
    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Runs `N` concurrent requests whose bodies `make` builds; the upstream holds every request
/// until all `N` have arrived, so all are in flight at once. Returns the peak extra bytes.
fn peak_extra<B, F>(make: F) -> usize
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<tower_llm_retry::BoxError>,
    F: Fn() -> B,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let barrier = Arc::new(Barrier::new(N));
        let upstream = service_fn(move |req: Request<ReplayBody>| {
            let barrier = barrier.clone();
            async move {
                barrier.wait().await;
                drop(req);
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        });
        let svc = RetryLayer::new().layer(upstream);
        let requests: Vec<_> = (0..N)
            .map(|_| {
                Request::post("http://llm.test/v1/messages")
                    .body(make())
                    .unwrap()
            })
            .collect();
        let base = CURRENT.load(Ordering::SeqCst);
        PEAK.store(base, Ordering::SeqCst);
        let mut set = tokio::task::JoinSet::new();
        for req in requests {
            let svc = svc.clone();
            set.spawn(async move { svc.oneshot(req).await.map(|_| ()) });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap().unwrap();
        }
        PEAK.load(Ordering::SeqCst).saturating_sub(base)
    })
}

fn main() {
    let shared = Bytes::from(vec![7u8; MIB]);

    let full = {
        let shared = shared.clone();
        peak_extra(move || Full::new(shared.clone()))
    };
    let streamed = {
        let shared = shared.clone();
        peak_extra(move || {
            Chunked(
                (0..MIB)
                    .step_by(16 * 1024)
                    .map(|i| shared.slice(i..i + 16 * 1024))
                    .collect(),
            )
        })
    };

    let body_bytes = (N * MIB) as f64;
    let full_copies = full as f64 / body_bytes;
    let streamed_copies = streamed as f64 / body_bytes;
    println!("{N} concurrent requests, 1 MiB bodies, peak extra heap:");
    println!(
        "  Full<Bytes>   {:>10} bytes  = {:>6.3} body copies ({:.0} bytes per request)",
        full,
        full_copies,
        full as f64 / N as f64
    );
    println!(
        "  streamed      {:>10} bytes  = {:>6.3} body copies ({:.0} bytes per request)",
        streamed,
        streamed_copies,
        streamed as f64 / N as f64
    );
    let json = format!(
        "[{{\"case\":\"full_1m\",\"requests\":{N},\"peak_extra_bytes\":{full},\"body_copies\":{full_copies:.4}}},\
         {{\"case\":\"streamed_1m\",\"requests\":{N},\"peak_extra_bytes\":{streamed},\"body_copies\":{streamed_copies:.4}}}]\n"
    );
    std::fs::create_dir_all("target/bench").unwrap();
    std::fs::write("target/bench/memory.json", json).unwrap();
}
