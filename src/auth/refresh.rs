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
mod tests;
