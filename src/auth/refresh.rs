use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::credential::{capped_add, MAX_REST};
use super::{Credential, CredentialFuture, CredentialHeader, TokenSource};
use crate::error::{BoxError, Error, ErrorKind};
use crate::retry::ConfigError;

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
///   `401`s, say), the function runs once and they all get its result. If the request driving
///   the refresh is dropped, the next waiter takes over; nothing runs in the background.
/// - **Ahead of expiry**: inside the *advisory* window (120 s before expiry by default) one
///   request refreshes while the others keep using the current token, which is kept if the
///   refresh fails; inside the *mandatory* window (30 s) requests wait for the new token.
/// - **On `401`**: the rejected token is dropped only if it is still the current one, so a
///   token that another request already refreshed is not thrown away.
/// - **On failure**: every waiting request ends with
///   [`ErrorKind::TokenRefresh`](crate::ErrorKind::TokenRefresh), and until a backoff (1 s,
///   doubling to 30 s) has passed, requests that need a token fail at once with the same cause
///   instead of calling the function again.
///
/// Clones share the cache.
///
/// ```
/// use std::time::Duration;
/// use tower_llm_retry::auth::{RefreshingToken, Token};
///
/// # async fn fetch_from_identity_provider() -> Result<(String, u64), std::io::Error> { Ok(("t".into(), 3600)) }
/// let source = RefreshingToken::new(|| async {
///     let (access_token, expires_in) = fetch_from_identity_provider().await?;
///     Ok::<_, std::io::Error>(Token::new(access_token).expires_in(Duration::from_secs(expires_in)))
/// });
/// # let _ = source;
/// ```
#[derive(Clone)]
pub struct RefreshingToken {
    fetch: Fetch,
    header: CredentialHeader,
    advisory: Duration,
    mandatory: Duration,
    backoff_initial: Duration,
    backoff_max: Duration,
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    // Held while a refresh runs: whoever holds it refreshes, the others queue behind it and
    // find the new token (or the failure) when their turn comes.
    refreshing: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct State {
    current: Option<Credential>,
    failure: Option<Failure>,
}

struct Failure {
    cause: Arc<dyn std::error::Error + Send + Sync>,
    retry_at: Instant,
    count: u32,
}

impl Failure {
    fn error(&self) -> BoxError {
        Error::new(ErrorKind::TokenRefresh)
            .with_source(SharedCause(self.cause.clone()))
            .into()
    }
}

/// One refresh failure, handed to every request that waited for it.
#[derive(Debug)]
struct SharedCause(Arc<dyn std::error::Error + Send + Sync>);

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
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                refreshing: tokio::sync::Mutex::new(()),
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

    /// Waits for whoever is refreshing, then refreshes unless they left a usable token or a
    /// fresh failure behind.
    async fn wait_and_refresh(self) -> Result<Credential, BoxError> {
        let _turn = self.shared.refreshing.lock().await;
        {
            let st = self.shared.state();
            let now = Instant::now();
            if let Some(c) = st.current.as_ref().filter(|c| self.usable(c, now)) {
                return Ok(c.clone());
            }
            if let Some(f) = st.failure.as_ref().filter(|f| f.retry_at > now) {
                return Err(f.error());
            }
        }
        self.refresh().await
    }

    /// Refreshes inside the advisory window, unless someone else is already at it; on failure
    /// the current token, still valid, is kept.
    async fn refresh_ahead(self, current: Credential) -> Result<Credential, BoxError> {
        let Ok(_turn) = self.shared.refreshing.try_lock() else {
            return Ok(current);
        };
        {
            let st = self.shared.state();
            if let Some(c) = st.current.as_ref().filter(|c| **c != current) {
                return Ok(c.clone());
            }
        }
        Ok(self.refresh().await.unwrap_or(current))
    }

    /// Calls `fetch` and records the result. The caller holds `refreshing`.
    async fn refresh(&self) -> Result<Credential, BoxError> {
        tracing::debug!("refreshing the credential");
        let result = (self.fetch)()
            .await
            .and_then(|token| token.into_credential(&self.header).map_err(Into::into));
        let now = Instant::now();
        let mut st = self.shared.state();
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
                let backoff = self
                    .backoff_initial
                    .saturating_mul(1 << (count - 1).min(20))
                    .min(self.backoff_max);
                // The cause is the caller's to read; it is not logged, in case it quotes a
                // secret.
                tracing::warn!(
                    failures = count,
                    retry_in_ms = backoff.as_millis() as u64,
                    "credential refresh failed"
                );
                let failure = Failure {
                    cause: Arc::from(cause),
                    retry_at: capped_add(now, backoff, MAX_REST),
                    count,
                };
                let err = failure.error();
                st.failure = Some(failure);
                Err(err)
            }
        }
    }

    /// Whether `c` may be sent without waiting for a refresh.
    fn usable(&self, c: &Credential, now: Instant) -> bool {
        c.remaining(now).is_none_or(|left| left > self.mandatory)
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl TokenSource for RefreshingToken {
    fn credential(&self) -> CredentialFuture {
        let now = Instant::now();
        let st = self.shared.state();
        if let Some(c) = &st.current {
            match c.remaining(now) {
                None => return CredentialFuture::ready(Ok(c.clone())),
                Some(left) if left > self.advisory => {
                    return CredentialFuture::ready(Ok(c.clone()))
                }
                Some(left) if left > self.mandatory => {
                    let resting = st.failure.as_ref().is_some_and(|f| f.retry_at > now);
                    // Taken by another request: it is refreshing, this one need not wait.
                    let busy = self.shared.refreshing.try_lock().is_err();
                    if resting || busy {
                        return CredentialFuture::ready(Ok(c.clone()));
                    }
                    return CredentialFuture::new(self.clone().refresh_ahead(c.clone()));
                }
                Some(_) => {}
            }
        }
        if let Some(f) = st.failure.as_ref().filter(|f| f.retry_at > now) {
            return CredentialFuture::ready(Err(f.error()));
        }
        drop(st);
        CredentialFuture::new(self.clone().wait_and_refresh())
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
            .field("failures", &st.failure.as_ref().map_or(0, |f| f.count))
            .field("advisory", &self.advisory)
            .field("mandatory", &self.mandatory)
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
    async fn a_dropped_refresh_is_taken_over() {
        let (source, calls) = counting(Duration::from_secs(3600), false);
        let mut first = source.credential();
        let second = source.credential();
        // Start the first refresh, then drop it half-way.
        assert!(futures_poll_once(&mut first).await.is_none());
        drop(first);
        assert!(second.await.is_ok());
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
