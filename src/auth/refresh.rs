use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use futures_util::future::{self, FutureExt};
use tokio::time::Instant;

use super::credential::{capped_add, MAX_REST};
use super::{Credential, CredentialFuture, CredentialHeader, TokenSource};
use crate::error::ConfigError;
use crate::error::{BoxError, Error, ErrorKind};

/// Token lifetimes beyond this count as this. A year is far enough ahead for any token, and far
/// inside the clock's range, which an `expires_in` from a server need not be.
const MAX_LIFETIME: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// A token as a refresh function returns it: the secret, and when it expires.
///
/// Its `Debug` output never shows the secret.
pub struct Token {
    secret: String,
    expires_at: Option<Instant>,
}

impl Token {
    /// A token that does not expire (until the server rejects it).
    pub fn new(secret: impl Into<String>) -> Self {
        Token {
            secret: secret.into(),
            expires_at: None,
        }
    }

    /// This token, expiring `lifetime` from now, as an OAuth `expires_in` says.
    ///
    /// A lifetime over a year (up to [`Duration::MAX`]) counts as a year: such a token is
    /// refreshed ahead of expiry a year on. (Parse `expires_in` as an integer, or with
    /// [`Duration::try_from_secs_f64`]: `Duration::from_secs_f64` panics on a huge or negative
    /// number.)
    pub fn expires_in(mut self, lifetime: Duration) -> Self {
        self.expires_at = Some(capped_add(Instant::now(), lifetime, MAX_LIFETIME));
        self
    }

    /// This token, expiring at `at` (on the [`tokio::time`] clock).
    pub fn expires_at(mut self, at: Instant) -> Self {
        self.expires_at = Some(at);
        self
    }

    fn into_credential(
        self,
        header: &CredentialHeader,
    ) -> Result<Credential, super::InvalidCredential> {
        let credential = Credential::new(header, &self.secret)?;
        Ok(match self.expires_at {
            Some(at) => credential.expires_at(at),
            None => credential,
        })
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token")
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

type Fetch =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Token, BoxError>> + Send>> + Send + Sync>;

/// A token fetched by an async function, cached, and refreshed when it nears expiry or the
/// server rejects it.
///
/// - **Single flight**: however many requests need a new token at once (1,000 concurrent
///   `401`s, say), the function runs once and they all get its result.
/// - **A refresh outlives its requests**: the refresh belongs to the source, not to the request
///   that started it. When that request is dropped (its own timeout fired, say), the refresh
///   carries on where it was, driven by whichever request waits for it next, and its result
///   goes to that request and the ones after it. Nothing runs in the background: while no
///   request waits, the refresh waits too.
/// - **Bounded**: a refresh that takes longer than its [timeout](Self::refresh_timeout)
///   (30 s by default) fails like any other.
/// - **Ahead of expiry**: inside the *advisory* window (120 s before expiry by default) one
///   request refreshes while the others keep using the current token, which is kept if the
///   refresh fails; inside the *mandatory* window (30 s) requests wait for the new token.
/// - **On `401`**: the rejected token is dropped only if it is still the current one, so a
///   token that another request already refreshed is not thrown away.
/// - **On failure** (an error, the timeout, or a panic): every waiting request
///   ends with [`ErrorKind::TokenRefresh`](crate::ErrorKind::TokenRefresh), and until a
///   backoff (1 s, doubling to 30 s) has passed, requests that need a token fail at once with
///   the same cause instead of calling the function again.
///
/// Clones share the cache.
///
/// ```
/// use std::time::Duration;
/// use tower_llm_retry::auth::{RefreshingToken, Token};
///
/// # async fn fetch_from_identity_provider() -> Result<(String, u64), std::io::Error> { Ok(("t".into(), 3600)) }
/// # fn main() -> Result<(), tower_llm_retry::ConfigError> {
/// let source = RefreshingToken::new(|| async {
///     let (access_token, expires_in) = fetch_from_identity_provider().await?;
///     Ok::<_, std::io::Error>(Token::new(access_token).expires_in(Duration::from_secs(expires_in)))
/// })
/// .refresh_timeout(Duration::from_secs(10))?;
/// # let _ = source;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RefreshingToken {
    fetch: Fetch,
    header: CredentialHeader,
    advisory: Duration,
    mandatory: Duration,
    backoff_initial: Duration,
    backoff_max: Duration,
    timeout: Duration,
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    current: Option<Credential>,
    failure: Option<Failure>,
    // The refresh under way. Kept here rather than in the request that started it, so that
    // dropping that request does not drop the refresh: the next request to need a token polls
    // the same future on. The future records its own result here, once, and clears this.
    flight: Option<Flight>,
}

struct Flight {
    outcome: Outcome,
    started_at: Instant,
}

/// What one refresh ends with, for every request that waits for it.
type Outcome = future::Shared<Pin<Box<dyn Future<Output = Refreshed> + Send>>>;
type Refreshed = Result<Credential, Cause>;
type Cause = Arc<dyn std::error::Error + Send + Sync>;

struct Failure {
    cause: Cause,
    retry_at: Instant,
    count: u32,
}

fn refresh_error(cause: Cause) -> BoxError {
    Error::new(ErrorKind::TokenRefresh)
        .with_source(SharedCause(cause))
        .into()
}

/// One refresh failure, handed to every request that waited for it.
#[derive(Debug)]
struct SharedCause(Cause);

impl fmt::Display for SharedCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// The cause of a refresh that ran out of time.
#[derive(Debug)]
struct RefreshTimedOut(Duration);

impl fmt::Display for RefreshTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the credential refresh did not finish within {:?}",
            self.0
        )
    }
}

impl std::error::Error for RefreshTimedOut {}

/// The cause of a refresh that panicked. The panic's message is not kept, in case it quotes a
/// secret; the panic hook has reported it.
#[derive(Debug)]
struct RefreshPanicked;

impl fmt::Display for RefreshPanicked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the credential refresh panicked")
    }
}

impl std::error::Error for RefreshPanicked {}

/// What a request that needs a new token does next.
enum Step {
    Ready(Result<Credential, BoxError>),
    /// Wait for this refresh; `late` when it was started longer ago than its timeout, so that
    /// its result may be old news by now.
    Wait {
        outcome: Outcome,
        late: bool,
    },
}

impl RefreshingToken {
    /// A source that calls `fetch` for each new token. The token is sent as
    /// `authorization: Bearer …` unless [`header`](Self::header) says otherwise.
    pub fn new<F, Fut, E>(fetch: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Token, E>> + Send + 'static,
        E: Into<BoxError>,
    {
        let fetch: Fetch = Arc::new(move || {
            let future = fetch();
            Box::pin(async move { future.await.map_err(Into::into) })
        });
        RefreshingToken {
            fetch,
            header: CredentialHeader::Bearer,
            advisory: Duration::from_secs(120),
            mandatory: Duration::from_secs(30),
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            timeout: Duration::from_secs(30),
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Where the token goes. Defaults to [`CredentialHeader::Bearer`].
    pub fn header(mut self, header: CredentialHeader) -> Self {
        self.header = header;
        self
    }

    /// A token to start with (one saved from an earlier run, say), so the first request need
    /// not wait for `fetch`. Defaults to none.
    pub fn initial(self, token: Token) -> Result<Self, super::InvalidCredential> {
        self.shared.state().current = Some(token.into_credential(&self.header)?);
        Ok(self)
    }

    /// How long before expiry a token is refreshed: from `advisory` on, one request refreshes
    /// while the others keep the current token; from `mandatory` on, requests wait for the new
    /// one. `mandatory` must not exceed `advisory`. Defaults to 120 s and 30 s.
    pub fn refresh_windows(
        mut self,
        advisory: Duration,
        mandatory: Duration,
    ) -> Result<Self, ConfigError> {
        if mandatory > advisory {
            return Err(ConfigError::new(format!(
                "the mandatory refresh window ({mandatory:?}) exceeds the advisory one ({advisory:?})"
            )));
        }
        self.advisory = advisory;
        self.mandatory = mandatory;
        Ok(self)
    }

    /// How long refreshing rests after a failure: `initial`, doubling with each failure in a
    /// row up to `max`, and never more than a day. `initial` must be above zero and not exceed
    /// `max`. Defaults to 1 s and 30 s.
    pub fn failure_backoff(
        mut self,
        initial: Duration,
        max: Duration,
    ) -> Result<Self, ConfigError> {
        if initial.is_zero() || initial > max {
            return Err(ConfigError::new(format!(
                "the refresh failure backoff must start above zero and at most at its maximum, got {initial:?} and {max:?}"
            )));
        }
        self.backoff_initial = initial;
        self.backoff_max = max;
        Ok(self)
    }

    /// How long one call of the refresh function may take, counted from its start, whoever
    /// waits for it: requests that give up sooner leave it running for the next. One that takes
    /// longer is a failed refresh: the requests waiting for it end with
    /// [`ErrorKind::TokenRefresh`](crate::ErrorKind::TokenRefresh), and the
    /// [failure backoff](Self::failure_backoff) follows. Must be above zero. Defaults to 30 s.
    pub fn refresh_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        if timeout.is_zero() {
            return Err(ConfigError::new(
                "the credential refresh timeout must be above zero",
            ));
        }
        self.timeout = timeout;
        Ok(self)
    }

    /// With the state locked: the usable token, the failure that still rests refreshing, or
    /// the refresh to wait for, started if none is under way.
    fn next_step(&self, st: &mut State, now: Instant) -> Step {
        if let Some(c) = st.current.as_ref().filter(|c| self.usable(c, now)) {
            return Step::Ready(Ok(c.clone()));
        }
        if let Some(f) = st.failure.as_ref().filter(|f| f.retry_at > now) {
            return Step::Ready(Err(refresh_error(f.cause.clone())));
        }
        match &st.flight {
            Some(flight) => Step::Wait {
                outcome: flight.outcome.clone(),
                late: flight
                    .started_at
                    .checked_add(self.timeout)
                    .is_some_and(|deadline| deadline <= now),
            },
            None => Step::Wait {
                outcome: self.start(st, now),
                late: false,
            },
        }
    }

    /// Waits for a refresh (started by this request or an earlier one) and returns its result.
    async fn wait(self, outcome: Outcome, late: bool) -> Result<Credential, BoxError> {
        let refreshed = outcome.await;
        if !late {
            return refreshed.map_err(refresh_error);
        }
        // Nobody waited for this refresh when it ended, perhaps long ago. Its result is in the
        // state now: if the token has expired since, or the failure's backoff is over, a
        // report of it would be old news, so look again (and refresh afresh if need be).
        let step = self.next_step(&mut self.shared.state(), Instant::now());
        match step {
            Step::Ready(result) => result,
            Step::Wait { outcome, .. } => outcome.await.map_err(refresh_error),
        }
    }

    /// Starts a refresh and keeps it in the state for the requests that need it. The function
    /// is called when the refresh is first polled, not here, under the lock.
    fn start(&self, st: &mut State, now: Instant) -> Outcome {
        tracing::debug!("refreshing the credential");
        let outcome = Refresh {
            fetch: self.fetch.clone(),
            header: self.header.clone(),
            timeout: self.timeout,
            backoff_initial: self.backoff_initial,
            backoff_max: self.backoff_max,
            // Weak: the state holds the refresh, which must not keep the state alive.
            shared: Arc::downgrade(&self.shared),
        }
        .run()
        .boxed()
        .shared();
        st.flight = Some(Flight {
            outcome: outcome.clone(),
            started_at: now,
        });
        outcome
    }

    /// Whether `c` may be sent without waiting for a refresh.
    fn usable(&self, c: &Credential, now: Instant) -> bool {
        c.remaining(now).is_none_or(|left| left > self.mandatory)
    }
}

/// One call of the refresh function, as the shared future runs it.
struct Refresh {
    fetch: Fetch,
    header: CredentialHeader,
    timeout: Duration,
    backoff_initial: Duration,
    backoff_max: Duration,
    shared: Weak<Shared>,
}

impl Refresh {
    async fn run(self) -> Refreshed {
        let deadline = Instant::now().checked_add(self.timeout);
        let (fetch, timeout) = (self.fetch.clone(), self.timeout);
        let call = async move {
            match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, fetch())
                    .await
                    .unwrap_or_else(|_| Err(Box::new(RefreshTimedOut(timeout)))),
                // A timeout past the end of the clock: none.
                None => fetch().await,
            }
        };
        // A panic must not poison the shared future: it stays in the state, and every later
        // request would panic on it. That covers the function, and a refresh left behind by a
        // runtime that has shut down (its timers panic when polled from another).
        let result = match AssertUnwindSafe(call).catch_unwind().await {
            Ok(Ok(token)) => token.into_credential(&self.header).map_err(Into::into),
            Ok(Err(cause)) => Err(cause),
            Err(_panic) => Err(Box::new(RefreshPanicked) as BoxError),
        };
        match self.shared.upgrade() {
            Some(shared) => shared.record(&self, result, deadline),
            // Every handle on the source is gone: nobody to tell but the waiters.
            None => result.map_err(Cause::from),
        }
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records what a refresh ended with, and ends the flight.
    fn record(
        &self,
        refresh: &Refresh,
        result: Result<Credential, BoxError>,
        deadline: Option<Instant>,
    ) -> Refreshed {
        let now = Instant::now();
        let mut st = self.state();
        st.flight = None;
        match result {
            Ok(credential) => {
                st.current = Some(credential.clone());
                st.failure = None;
                tracing::info!(
                    expires_in_s = credential.remaining(now).map(|d| d.as_secs()),
                    "credential refreshed"
                );
                Ok(credential)
            }
            Err(cause) => {
                let count = st.failure.as_ref().map_or(0, |f| f.count) + 1;
                let backoff = refresh
                    .backoff_initial
                    .saturating_mul(1 << (count - 1).min(20))
                    .min(refresh.backoff_max);
                // Seen after the deadline by a request that came late, the failure happened
                // by the deadline at the latest: the backoff counts from there.
                let failed_at = deadline.map_or(now, |deadline| deadline.min(now));
                let timed_out = cause.is::<RefreshTimedOut>();
                // The cause is the caller's to read; it is not logged, in case it quotes a
                // secret.
                tracing::warn!(
                    failures = count,
                    timed_out,
                    retry_in_ms = backoff.as_millis() as u64,
                    "credential refresh failed"
                );
                let cause = Cause::from(cause);
                st.failure = Some(Failure {
                    cause: cause.clone(),
                    retry_at: capped_add(failed_at, backoff, MAX_REST),
                    count,
                });
                Err(cause)
            }
        }
    }
}

impl TokenSource for RefreshingToken {
    fn credential(&self) -> CredentialFuture {
        let now = Instant::now();
        let mut st = self.shared.state();
        if let Some(c) = st.current.clone() {
            match c.remaining(now) {
                None => return CredentialFuture::ready(Ok(c)),
                Some(left) if left > self.advisory => return CredentialFuture::ready(Ok(c)),
                Some(left) if left > self.mandatory => {
                    if st.failure.as_ref().is_some_and(|f| f.retry_at > now) {
                        return CredentialFuture::ready(Ok(c));
                    }
                    if let Some(flight) = &st.flight {
                        // Another request refreshes (or did, until it was dropped). This one
                        // need not wait, but gives the refresh a poll on its way: its answer
                        // may be in.
                        let outcome = flight.outcome.clone();
                        drop(st);
                        let fresh = outcome.now_or_never().and_then(Result::ok);
                        return CredentialFuture::ready(Ok(fresh.unwrap_or(c)));
                    }
                    // This one refreshes, once, and keeps the current token if that fails.
                    let outcome = self.start(&mut st, now);
                    drop(st);
                    return CredentialFuture::new(async move { Ok(outcome.await.unwrap_or(c)) });
                }
                Some(_) => {}
            }
        }
        match self.next_step(&mut st, now) {
            Step::Ready(result) => CredentialFuture::ready(result),
            Step::Wait { outcome, late } => {
                drop(st);
                CredentialFuture::new(self.clone().wait(outcome, late))
            }
        }
    }

    fn invalidate(&self, rejected: &Credential) -> bool {
        let mut st = self.shared.state();
        if st.current.as_ref() == Some(rejected) {
            tracing::debug!("credential rejected by the server; it will be refreshed");
            st.current = None;
        }
        true
    }
}

impl fmt::Debug for RefreshingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.state();
        f.debug_struct("RefreshingToken")
            .field("header", &self.header)
            .field("cached", &st.current.is_some())
            .field("refreshing", &st.flight.is_some())
            .field("failures", &st.failure.as_ref().map_or(0, |f| f.count))
            .field("advisory", &self.advisory)
            .field("mandatory", &self.mandatory)
            .field("refresh_timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
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
            let gave_up =
                tokio::time::timeout(Duration::from_millis(100), source.credential()).await;
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
}
