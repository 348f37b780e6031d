//! The retry loop's state machine, one transition at a time: each test polls the future by
//! hand under paused time against an in-memory service, and reads the state it is in from its
//! `Debug` output. (What the loop does over real HTTP is in the integration tests.)

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::Layer;
use tower_service::Service;

use crate::fleet::{Fleet, GateConfig};
use crate::pipeline::{AttemptContext, Companion, Judged, Question};
use crate::{ReplayBody, RetryLayer, RetryPolicy};

/// Answers from a script, in order, and records every request's retry count.
#[derive(Clone)]
struct Scripted {
    replies: Arc<Mutex<VecDeque<Response<Full<Bytes>>>>>,
    seen: Arc<Mutex<Vec<u32>>>,
}

impl Scripted {
    fn new(replies: impl IntoIterator<Item = Response<Full<Bytes>>>) -> Self {
        Scripted {
            replies: Arc::new(Mutex::new(replies.into_iter().collect())),
            seen: Arc::default(),
        }
    }

    fn sends(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

impl Service<Request<ReplayBody>> for Scripted {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReplayBody>) -> Self::Future {
        let attempt = req
            .extensions()
            .get::<crate::retry::AttemptContext>()
            .map_or(0, |c| c.attempt);
        self.seen.lock().unwrap().push(attempt);
        let reply = self
            .replies
            .lock()
            .unwrap()
            .pop_front()
            .expect("a scripted reply");
        ready(Ok(reply))
    }
}

fn status(code: u16) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

fn request() -> Request<Full<Bytes>> {
    Request::post("http://127.0.0.1/v1/messages")
        .body(Full::new(Bytes::from_static(b"{\"model\":\"m\"}")))
        .unwrap()
}

/// Polls once; returns whether it finished and the state it is in (or ended in).
fn step<F: Future + std::fmt::Debug>(f: Pin<&mut F>) -> (bool, String) {
    let mut cx = Context::from_waker(Waker::noop());
    let mut f = f;
    let done = f.as_mut().poll(&mut cx).is_ready();
    (done, state_of(&*f))
}

fn state_of(f: &impl std::fmt::Debug) -> String {
    let text = format!("{f:?}");
    let start = text.find("state: \"").expect("the state is shown") + 8;
    text[start..].split('"').next().unwrap().to_owned()
}

fn policy() -> RetryPolicy {
    RetryPolicy::default().jitter(crate::retry::Jitter::none())
}

#[tokio::test(start_paused = true)]
async fn a_success_goes_from_buffering_to_done_in_one_poll() {
    let inner = Scripted::new([status(200)]);
    let mut svc = RetryLayer::new().policy(policy()).layer(inner.clone());
    let f = svc.call(request());
    tokio::pin!(f);
    assert_eq!(state_of(&*f), "buffering");
    assert_eq!(step(f.as_mut()), (true, "done".to_owned()));
    assert_eq!(*inner.seen.lock().unwrap(), [1]);
}

#[tokio::test(start_paused = true)]
async fn a_503_reads_the_body_sleeps_the_backoff_then_sends_attempt_two() {
    let inner = Scripted::new([status(503), status(200)]);
    let mut svc = RetryLayer::new().policy(policy()).layer(inner.clone());
    let f = svc.call(request());
    tokio::pin!(f);
    // The error body is read (it is there at once), judged, and the backoff begins.
    assert_eq!(step(f.as_mut()), (false, "sleeping".to_owned()));
    tokio::time::advance(Duration::from_millis(499)).await;
    assert_eq!(step(f.as_mut()), (false, "sleeping".to_owned()));
    assert_eq!(inner.sends(), 1);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(step(f.as_mut()), (true, "done".to_owned()));
    assert_eq!(*inner.seen.lock().unwrap(), [1, 2]);
}

#[tokio::test(start_paused = true)]
async fn a_closed_gate_holds_the_first_attempt_then_sends_it() {
    // One state for every request: the gate read is the fleet's own.
    let fleet = Fleet::builder()
        .cooldown_gate(Some(
            GateConfig::new()
                .min_close(Duration::ZERO)
                .spread(0.0, Duration::ZERO)
                .unwrap(),
        ))
        .per_scope(false)
        .build();
    // A 429 with Retry-After: 10 from one request closes the gate for the next.
    let limited = Response::builder()
        .status(429)
        .header("retry-after", "10")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let inner = Scripted::new([limited, status(200)]);
    let layer = RetryLayer::new()
        .policy(policy().max_retries(0))
        .fleet(fleet.clone());
    let mut first = layer.layer(inner.clone());
    let res = first.call(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(fleet.gate_closed_until().is_some());

    let mut second = layer.layer(inner.clone());
    let f = second.call(request());
    tokio::pin!(f);
    assert_eq!(step(f.as_mut()), (false, "gated".to_owned()));
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(step(f.as_mut()), (true, "done".to_owned()));
    assert_eq!(inner.sends(), 2);
}

/// A companion that asks for one re-send of the first answer.
struct ResendOnce;

impl Companion for ResendOnce {
    fn judge(&self, q: &mut Question<'_>) -> Judged {
        if q.carried.refreshed {
            return Judged::Pass;
        }
        q.carried.refreshed = true;
        Judged::Resend
    }
}

/// Puts a [`ResendOnce`] question on every `401`.
#[derive(Clone)]
struct Asking(Scripted);

impl Service<Request<ReplayBody>> for Asking {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReplayBody>) -> Self::Future {
        let link = AttemptContext::link_of(req.extensions()).cloned();
        let refreshed = link.as_ref().is_some_and(|l| l.carried().refreshed);
        let res = self.0.call(req).into_inner().unwrap();
        if let (StatusCode::UNAUTHORIZED, false, Some(link)) = (res.status(), refreshed, link) {
            link.ask(ResendOnce);
        }
        ready(Ok(res))
    }
}

#[tokio::test(start_paused = true)]
async fn a_companion_resend_is_the_same_attempt_with_no_sleep() {
    let inner = Scripted::new([status(401), status(200)]);
    let mut svc = RetryLayer::new()
        .policy(policy())
        .layer(Asking(inner.clone()));
    let f = svc.call(request());
    tokio::pin!(f);
    // No sleep between: the re-send goes out in the same poll, as attempt 1 again.
    let mut cx = Context::from_waker(Waker::noop());
    let Poll::Ready(res) = f.as_mut().poll(&mut cx) else {
        panic!("the re-send went out at once and was answered");
    };
    assert_eq!(state_of(&*f), "done");
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.extensions().get::<crate::RetryTrail>().is_none());
    assert_eq!(*inner.seen.lock().unwrap(), [1, 1]);
}

/// Records, at each send, how many failed attempts the loop carries for the companions.
#[derive(Clone)]
struct Counting(Scripted, Arc<Mutex<Vec<usize>>>);

impl Service<Request<ReplayBody>> for Counting {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReplayBody>) -> Self::Future {
        let link = AttemptContext::link_of(req.extensions()).expect("a link on every send");
        self.1.lock().unwrap().push(link.carried().failures.len());
        self.0.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn a_handle_used_again_by_the_next_request_carries_nothing_of_the_last() {
    let inner = Scripted::new([status(503), status(200), status(200), status(200)]);
    let carried = Arc::new(Mutex::new(Vec::new()));
    let mut svc = RetryLayer::new()
        .policy(policy())
        .layer(Counting(inner, carried.clone()));
    // One failure, carried to the retry; then two requests on the same service and on a
    // clone of it, each starting with nothing carried.
    assert_eq!(svc.call(request()).await.unwrap().status(), StatusCode::OK);
    assert_eq!(svc.call(request()).await.unwrap().status(), StatusCode::OK);
    let mut clone = svc.clone();
    assert_eq!(
        clone.call(request()).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(*carried.lock().unwrap(), [0, 1, 0, 0]);
}
