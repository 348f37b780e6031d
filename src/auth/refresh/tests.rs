//! Unit tests of `auth::refresh`.

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

fn counting(lifetime: Duration, fail: bool) -> (RefreshingToken, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if fail {
                Err(std::io::Error::other("identity provider down"))
            } else {
                Ok(Token::new(format!("token-{n}")).expires_in(lifetime))
            }
        }
    });
    (source, calls)
}

#[tokio::test(start_paused = true)]
async fn concurrent_callers_share_one_refresh() {
    let (source, calls) = counting(Duration::from_secs(3600), false);
    let all: Vec<_> = (0..100).map(|_| source.credential()).collect();
    let creds: Vec<_> = futures_join(all).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(creds
        .windows(2)
        .all(|w| w[0].as_ref().unwrap() == w[1].as_ref().unwrap()));
}

#[tokio::test(start_paused = true)]
async fn refreshes_ahead_of_expiry() {
    let (source, calls) = counting(Duration::from_secs(600), false);
    let first = source.credential().await.unwrap();
    // Well before the advisory window: cached.
    tokio::time::advance(Duration::from_secs(400)).await;
    assert_eq!(source.credential().await.unwrap(), first);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Inside the advisory window (100 s left): one caller refreshes.
    tokio::time::advance(Duration::from_secs(100)).await;
    let second = source.credential().await.unwrap();
    assert_ne!(second, first);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // Inside the mandatory window (20 s left): callers wait for a new one.
    tokio::time::advance(Duration::from_secs(580)).await;
    let third = source.credential().await.unwrap();
    assert_ne!(third, second);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn failures_back_off() {
    let (source, calls) = counting(Duration::from_secs(600), true);
    let err = source.credential().await.unwrap_err();
    let err = err.downcast::<Error>().unwrap();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(
        std::error::Error::source(&*err).unwrap().to_string(),
        "identity provider down"
    );
    // Within the backoff: the same failure, no new call.
    assert!(source.credential().await.is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(source.credential().await.is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // Now the backoff is 2 s.
    tokio::time::advance(Duration::from_millis(1500)).await;
    assert!(source.credential().await.is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn invalidate_only_drops_the_current_token() {
    let (source, calls) = counting(Duration::from_secs(3600), false);
    let old = source.credential().await.unwrap();
    assert!(source.invalidate(&old));
    let new = source.credential().await.unwrap();
    assert_ne!(new, old);
    // A late 401 for the old token leaves the new one alone.
    assert!(source.invalidate(&old));
    assert_eq!(source.credential().await.unwrap(), new);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_refresh_is_resumed_not_restarted() {
    let (source, calls) = counting(Duration::from_secs(3600), false);
    let mut first = source.credential();
    let second = source.credential();
    // Start the first refresh, then drop it half-way.
    assert!(futures_poll_once(&mut first).await.is_none());
    drop(first);
    assert_eq!(second.await.unwrap(), source.credential().await.unwrap());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A source whose every call takes `latency` (forever when `None`) and hands out
/// `token-1`, `token-2`, … valid for an hour, counting its calls.
fn slow(latency: Option<Duration>) -> (RefreshingToken, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            match latency {
                Some(latency) => tokio::time::sleep(latency).await,
                None => std::future::pending().await,
            }
            Ok::<_, std::io::Error>(
                Token::new(format!("token-{n}")).expires_in(Duration::from_secs(3600)),
            )
        }
    });
    (source, calls)
}

#[tokio::test(start_paused = true)]
async fn a_refresh_outlives_the_callers_that_give_up_on_it() {
    // Each caller waits 100 ms; the identity provider takes 300 ms.
    let (source, calls) = slow(Some(Duration::from_millis(300)));
    let patience = Duration::from_millis(100);
    let start = Instant::now();
    for _ in 0..2 {
        assert!(tokio::time::timeout(patience, source.credential())
            .await
            .is_err());
    }
    // Nobody waits while the provider answers; the next caller finds the answer.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let asked_at = Instant::now();
    let credential = tokio::time::timeout(patience, source.credential())
        .await
        .expect("a caller after the provider answered gets the token")
        .unwrap();
    assert_eq!(asked_at - start, Duration::from_millis(350));
    assert_eq!(Instant::now(), asked_at);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // It is the cached token from now on.
    assert_eq!(source.credential().await.unwrap(), credential);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn impatient_callers_in_a_row_share_one_refresh() {
    // Callers keep coming, each giving up after 100 ms, until one gets a token.
    let (source, calls) = slow(Some(Duration::from_millis(300)));
    let start = Instant::now();
    let mut gave_up = 0;
    let credential = loop {
        match tokio::time::timeout(Duration::from_millis(100), source.credential()).await {
            Ok(credential) => break credential.unwrap(),
            Err(_) => gave_up += 1,
        }
        assert!(
            gave_up < 20,
            "no caller got a token in 2 s; the provider was called {} times",
            calls.load(Ordering::SeqCst)
        );
    };
    assert!(gave_up >= 2, "{gave_up}");
    assert!(Instant::now() - start <= Duration::from_millis(300));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(source.credential().await.unwrap(), credential);
}

#[tokio::test(start_paused = true)]
async fn a_hung_refresh_times_out_and_backs_off() {
    let (source, calls) = slow(None);
    let start = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(120), source.credential())
        .await
        .expect("the refresh gave up by itself")
        .unwrap_err()
        .downcast::<Error>()
        .unwrap();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(Instant::now() - start, Duration::from_secs(30));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Within the backoff (1 s): the same failure at once, no new call.
    let err = source.credential().await.unwrap_err();
    assert_eq!(
        err.downcast::<Error>().unwrap().kind(),
        ErrorKind::TokenRefresh
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // After it: one new call.
    tokio::time::advance(Duration::from_secs(1)).await;
    let mut next = source.credential();
    assert!(futures_poll_once(&mut next).await.is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn huge_lifetimes_do_not_overflow() {
    const DAY: Duration = Duration::from_secs(24 * 60 * 60);
    for lifetime in [Duration::from_secs(u64::MAX), Duration::MAX] {
        let (source, calls) = counting(lifetime, false);
        let source = source
            .initial(Token::new("initial").expires_in(lifetime))
            .unwrap();
        let first = source.credential().await.unwrap();
        let expiry = first.expiry().expect("a token that expires");
        assert!(expiry >= Instant::now() + 364 * DAY, "{lifetime:?}");
        // Far from expiry: the cached token, no refresh.
        tokio::time::advance(300 * DAY).await;
        assert_eq!(source.credential().await.unwrap(), first);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        // In the advisory window (100 s left): one refresh, whose huge lifetime is capped too.
        let left = expiry - Instant::now();
        tokio::time::advance(left - Duration::from_secs(100)).await;
        let second = source.credential().await.unwrap();
        assert_ne!(second, first);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(second.expiry().unwrap() >= Instant::now() + 364 * DAY);
        assert_eq!(source.credential().await.unwrap(), second);
    }
}

#[tokio::test(start_paused = true)]
async fn a_token_with_no_lifetime_left_is_still_handed_out() {
    let (source, calls) = counting(Duration::ZERO, false);
    let source = source
        .initial(Token::new("initial").expires_in(Duration::ZERO))
        .unwrap();
    // Expired from the start: each caller waits for a new one, and gets it.
    for n in 1..=2 {
        let c = source.credential().await.unwrap();
        assert_eq!(c.expiry(), Some(Instant::now()));
        assert_eq!(calls.load(Ordering::SeqCst), n);
    }
}

#[tokio::test(start_paused = true)]
async fn a_huge_failure_backoff_does_not_overflow() {
    let (source, calls) = counting(Duration::from_secs(600), true);
    let source = source
        .failure_backoff(Duration::MAX, Duration::MAX)
        .unwrap();
    let err = source.credential().await.unwrap_err();
    assert_eq!(
        err.downcast::<Error>().unwrap().kind(),
        ErrorKind::TokenRefresh
    );
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert!(source.credential().await.is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn the_refresh_timeout_is_configurable() {
    let (source, calls) = slow(Some(Duration::from_secs(6)));
    let source = source.refresh_timeout(Duration::from_secs(5)).unwrap();
    let start = Instant::now();
    let err = source.credential().await.unwrap_err();
    assert_eq!(Instant::now() - start, Duration::from_secs(5));
    let err = err.downcast::<Error>().unwrap();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(
        std::error::Error::source(&*err).unwrap().to_string(),
        "the credential refresh did not finish within 5s"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn an_abandoned_refresh_that_failed_long_ago_is_not_reported() {
    // The first call fails after 300 ms, later ones succeed at once.
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if n == 1 {
                tokio::time::sleep(Duration::from_millis(300)).await;
                return Err(std::io::Error::other("identity provider down"));
            }
            Ok(Token::new(format!("token-{n}")).expires_in(Duration::from_secs(3600)))
        }
    });
    let gave_up = tokio::time::timeout(Duration::from_millis(100), source.credential()).await;
    assert!(gave_up.is_err());
    // An hour on, that failure is old news: the next caller gets a fresh refresh.
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert!(source.credential().await.is_ok());
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Within the backoff of its deadline, though, it still counts.
    let (source, calls) = slow(None);
    let gave_up = tokio::time::timeout(Duration::from_millis(100), source.credential()).await;
    assert!(gave_up.is_err());
    tokio::time::advance(Duration::from_millis(30_500)).await;
    let err = source.credential().await.unwrap_err();
    assert_eq!(
        err.downcast::<Error>().unwrap().kind(),
        ErrorKind::TokenRefresh
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_refresh_ahead_outlives_its_caller_and_is_tried_once() {
    let (source, calls) = slow(Some(Duration::from_millis(300)));
    let source = source
        .initial(Token::new("aging").expires_in(Duration::from_secs(100)))
        .unwrap();
    // In the advisory window: the first caller refreshes, and gives up on it.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), source.credential())
            .await
            .is_err()
    );
    // Others keep the current token meanwhile, without waiting.
    let current = source.credential().await.unwrap();
    assert_eq!(
        current.expiry(),
        Some(Instant::now() + Duration::from_millis(99_900))
    );
    // Once the provider has answered, the next caller takes the new token on its way.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let new = source.credential().await.unwrap();
    assert_ne!(new, current);
    assert!(new.expiry().unwrap() > Instant::now() + Duration::from_secs(3000));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // A refresh ahead that fails: tried once, the current token kept.
    let (source, calls) = slow(None);
    let source = source
        .initial(Token::new("aging").expires_in(Duration::from_secs(100)))
        .unwrap();
    let first = source.credential();
    let kept = source.credential().await.unwrap();
    assert_eq!(first.await.unwrap(), kept);
    assert_eq!(source.credential().await.unwrap(), kept);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_refresh_is_a_failed_refresh() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            assert!(n > 1, "the identity provider's client panicked");
            Ok::<_, std::io::Error>(Token::new("token"))
        }
    });
    let err = source.credential().await.unwrap_err();
    let err = err.downcast::<Error>().unwrap();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    assert_eq!(
        std::error::Error::source(&*err).unwrap().to_string(),
        "the credential refresh panicked"
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(source.credential().await.is_ok());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn a_refresh_left_by_a_runtime_that_shut_down_does_not_poison_the_source() {
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    };
    // The first call never answers (and sets no timer of its own); later ones answer at once.
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let source = RefreshingToken::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if n == 1 {
                std::future::pending::<()>().await;
            }
            Ok::<_, std::io::Error>(Token::new(format!("token-{n}")))
        }
    });
    runtime().block_on(async {
        let gave_up = tokio::time::timeout(Duration::from_millis(100), source.credential()).await;
        assert!(gave_up.is_err());
    });
    // That runtime is gone, and the refresh timeout's timer with it. The refresh it left
    // cannot go on; it fails, and the next one after the backoff works.
    runtime().block_on(async {
        let err = source.credential().await.unwrap_err();
        assert_eq!(
            err.downcast::<Error>().unwrap().kind(),
            ErrorKind::TokenRefresh
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(source.credential().await.is_ok());
    });
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn validation_and_debug() {
    let (source, _) = counting(Duration::from_secs(1), false);
    assert!(source
        .clone()
        .refresh_windows(Duration::from_secs(10), Duration::from_secs(20))
        .is_err());
    assert!(source
        .clone()
        .failure_backoff(Duration::ZERO, Duration::from_secs(1))
        .is_err());
    assert!(source.clone().refresh_timeout(Duration::ZERO).is_err());
    let source = source.initial(Token::new("tok-SECRET")).unwrap();
    assert!(!format!("{source:?} {:?}", Token::new("tok-SECRET")).contains("SECRET"));
}

async fn futures_join(all: Vec<CredentialFuture>) -> Vec<Result<Credential, BoxError>> {
    let handles: Vec<_> = all.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

async fn futures_poll_once(f: &mut CredentialFuture) -> Option<Result<Credential, BoxError>> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match Pin::new(&mut *f).poll(cx) {
            std::task::Poll::Ready(r) => Some(r),
            std::task::Poll::Pending => None,
        })
    })
    .await
}
