use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use tokio::time::Instant;

use super::credential::{capped_add, MAX_REST};
use super::{Credential, CredentialFuture, CredentialHeader, InvalidCredential, TokenSource};

/// One static API key.
///
/// A `401` is returned as it is: re-sending the same key would not help. Its `Debug` output
/// never shows the key.
///
/// ```
/// use tower_llm_retry::ApiKey;
/// use tower_llm_retry::auth::CredentialHeader;
///
/// # fn main() -> Result<(), tower_llm_retry::auth::InvalidCredential> {
/// let anthropic = ApiKey::new("sk-ant-api03-...")?; // x-api-key: sk-ant-api03-...
/// let openai = ApiKey::with_header("sk-proj-...", CredentialHeader::Bearer)?; // authorization: Bearer sk-proj-...
/// # let _ = (anthropic, openai);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ApiKey {
    credential: Credential,
}

impl ApiKey {
    /// The key, sent as `x-api-key`.
    pub fn new(key: &str) -> Result<Self, InvalidCredential> {
        Self::with_header(key, CredentialHeader::x_api_key())
    }

    /// The key, sent as `header` says.
    pub fn with_header(key: &str, header: CredentialHeader) -> Result<Self, InvalidCredential> {
        Ok(ApiKey {
            credential: Credential::new(&header, key)?,
        })
    }
}

impl TokenSource for ApiKey {
    fn credential(&self) -> CredentialFuture {
        CredentialFuture::ready(Ok(self.credential.clone()))
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKey")
            .field("header", self.credential.header_name())
            .finish_non_exhaustive()
    }
}

/// Several API keys for one provider, used in turn.
///
/// Each request takes the next key that is not resting. When a key is rate-limited (a `429`
/// that is not an exhausted quota) it rests for the `Retry-After` the server sent (at most a
/// day), and the request is re-sent at once with the next usable key; when every key is resting, the `429`
/// goes back up, to `RetryLayer`'s ordinary backoff.
///
/// A key answered with `401` is set aside for a while (a quarantine of 1 min, doubled each
/// time the key is answered `401` again on its return, up to 1 h; see
/// [`quarantine`](Self::quarantine)), and the request is re-sent once with another key. After
/// its quarantine the key is tried again: a key revoked by mistake and restored comes back into
/// rotation, one that stays revoked costs one re-send per quarantine. A `401` to a request that
/// carries a header which can itself cause it (an `OpenAI-Organization` the key does not
/// belong to, say; see [`request_scoped_headers`](Self::request_scoped_headers)) sets no key
/// aside: it goes back as it is, and the key is judged on a later request without such a
/// header.
///
/// ```
/// use tower_llm_retry::auth::ApiKeyPool;
///
/// # fn main() -> Result<(), tower_llm_retry::auth::InvalidCredential> {
/// let pool = ApiKeyPool::new(["sk-ant-api03-first", "sk-ant-api03-second"])?;
/// assert_eq!(pool.len(), 2);
/// # Ok(()) }
/// ```
pub struct ApiKeyPool {
    keys: Vec<Credential>,
    default_rest: Duration,
    quarantine: Duration,
    quarantine_cap: Duration,
    request_scoped: Vec<HeaderName>,
    state: Mutex<PoolState>,
}

struct PoolState {
    resting_until: Vec<Option<Instant>>,
    /// Until when a key answered `401` stays out of rotation.
    aside_until: Vec<Option<Instant>>,
    /// How many quarantines in a row a key has served: each doubles the next.
    strikes: Vec<u32>,
    next: usize,
}

/// The request headers that can cause a `401` whatever the key: the organization and project
/// an OpenAI key is used for, and the betas an Anthropic account must be enrolled in.
const REQUEST_SCOPED: [&str; 3] = ["openai-organization", "openai-project", "anthropic-beta"];

impl ApiKeyPool {
    /// The keys, each sent as `x-api-key`. At least one is needed.
    pub fn new<I, K>(keys: I) -> Result<Self, InvalidCredential>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        Self::with_header(keys, CredentialHeader::x_api_key())
    }

    /// The keys, each sent as `header` says. At least one is needed.
    pub fn with_header<I, K>(keys: I, header: CredentialHeader) -> Result<Self, InvalidCredential>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let keys = keys
            .into_iter()
            .enumerate()
            .map(|(i, k)| Credential::new(&header, k.as_ref()).map(|c| c.with_key_index(i)))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(InvalidCredential::new("the key pool holds no key"));
        }
        let n = keys.len();
        Ok(ApiKeyPool {
            keys,
            default_rest: Duration::from_secs(5),
            quarantine: Duration::from_secs(60),
            quarantine_cap: Duration::from_secs(60 * 60),
            request_scoped: REQUEST_SCOPED
                .iter()
                .map(|h| HeaderName::from_static(h))
                .collect(),
            state: Mutex::new(PoolState {
                resting_until: vec![None; n],
                aside_until: vec![None; n],
                strikes: vec![0; n],
                next: 0,
            }),
        })
    }

    /// How long a rate-limited key rests when the `429` says no `Retry-After`. A rest, this one
    /// or a server's, lasts at most a day. Defaults to 5 s.
    pub fn default_rest(mut self, rest: Duration) -> Self {
        self.default_rest = rest;
        self
    }

    /// How long a key answered `401` stays out of rotation: `first` the first time, doubled
    /// each time it is answered `401` again when it comes back, at most `cap`. A key that went
    /// a whole `cap` without a `401` starts again from `first`. A `cap` below `first` is taken
    /// as `first`; a quarantine lasts at most a day. Defaults to 1 min doubling to 1 h.
    pub fn quarantine(mut self, first: Duration, cap: Duration) -> Self {
        self.quarantine = first.min(MAX_REST);
        self.quarantine_cap = cap.max(first).min(MAX_REST);
        self
    }

    /// The request headers that can cause a `401` whatever the key, because they name
    /// something the key must belong to. A `401` to a request carrying any of them sets no
    /// key aside and is not re-sent with another key: it goes back as it is. An empty list
    /// judges every `401` as the key's. Defaults to `openai-organization`, `openai-project`
    /// and `anthropic-beta`.
    pub fn request_scoped_headers<I>(mut self, headers: I) -> Self
    where
        I: IntoIterator<Item = HeaderName>,
    {
        self.request_scoped = headers.into_iter().collect();
        self
    }

    /// How many keys the pool holds.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the pool is empty; never true, since a pool needs a key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl PoolState {
    fn set_aside(&self, i: usize, now: Instant) -> bool {
        self.aside_until[i].is_some_and(|until| until > now)
    }

    fn usable(&self, i: usize, now: Instant) -> bool {
        !self.set_aside(i, now) && self.resting_until[i].is_none_or(|until| until <= now)
    }

    fn any_usable(&self, now: Instant) -> bool {
        (0..self.aside_until.len()).any(|i| self.usable(i, now))
    }
}

impl TokenSource for ApiKeyPool {
    fn credential(&self) -> CredentialFuture {
        let now = Instant::now();
        let mut st = self.state();
        let n = self.keys.len();
        let start = st.next;
        let pick = (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| st.usable(i, now))
            // Every key rests: the one that is back soonest. (The caller's retry loop waited
            // for the Retry-After, so that one is usually back already.)
            .or_else(|| {
                (0..n)
                    .filter(|&i| !st.set_aside(i, now))
                    .min_by_key(|&i| st.resting_until[i])
            })
            // Every key is set aside: keep sending them, so the server's answer reaches the
            // caller rather than one made up here.
            .unwrap_or(start % n);
        st.next = pick + 1;
        CredentialFuture::ready(Ok(self.keys[pick].clone()))
    }

    fn invalidate(&self, rejected: &Credential) -> bool {
        let Some(i) = rejected.key_index().filter(|&i| i < self.keys.len()) else {
            return false;
        };
        let now = Instant::now();
        let mut st = self.state();
        // Concurrent requests with the key answered `401` together: one quarantine.
        if !st.set_aside(i, now) {
            // A key that went a whole cap since its last quarantine without a `401` is
            // judged afresh.
            if st.aside_until[i]
                .is_some_and(|u| now.saturating_duration_since(u) >= self.quarantine_cap)
            {
                st.strikes[i] = 0;
            }
            let period = self
                .quarantine
                .saturating_mul(1u32 << st.strikes[i].min(20))
                .min(self.quarantine_cap);
            st.strikes[i] = st.strikes[i].saturating_add(1);
            st.aside_until[i] = Some(capped_add(now, period, MAX_REST));
            tracing::warn!(
                key_index = i,
                quarantine_s = period.as_secs(),
                "API key rejected by the server (401); setting it aside"
            );
        }
        st.any_usable(now)
    }

    fn blames_request(&self, request: &HeaderMap) -> bool {
        self.request_scoped.iter().any(|h| request.contains_key(h))
    }

    fn rotates(&self) -> bool {
        self.keys.len() > 1
    }

    fn rate_limited(&self, limited: &Credential, retry_after: Option<Duration>) -> bool {
        let Some(i) = limited.key_index().filter(|&i| i < self.keys.len()) else {
            return false;
        };
        let now = Instant::now();
        let mut st = self.state();
        let until = capped_add(now, retry_after.unwrap_or(self.default_rest), MAX_REST);
        st.resting_until[i] = Some(st.resting_until[i].map_or(until, |u| u.max(until)));
        st.any_usable(now)
    }
}

impl fmt::Debug for ApiKeyPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let now = Instant::now();
        let st = self.state();
        let resting = (0..self.keys.len())
            .filter(|&i| st.resting_until[i].is_some_and(|u| u > now))
            .count();
        let rejected = (0..self.keys.len())
            .filter(|&i| st.set_aside(i, now))
            .count();
        f.debug_struct("ApiKeyPool")
            .field("keys", &self.keys.len())
            .field("resting", &resting)
            .field("rejected", &rejected)
            .field("default_rest", &self.default_rest)
            .field("quarantine", &self.quarantine)
            .field("quarantine_cap", &self.quarantine_cap)
            .field("request_scoped_headers", &self.request_scoped)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl ApiKeyPool {
        fn any_usable_now(&self) -> bool {
            self.state().any_usable(Instant::now())
        }
    }

    async fn key(pool: &ApiKeyPool) -> usize {
        pool.credential().await.unwrap().key_index().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn keys_are_used_in_turn_and_rest_when_limited() {
        let pool = ApiKeyPool::new(["a", "b", "c"]).unwrap();
        assert!(pool.rotates());
        assert_eq!(
            [
                key(&pool).await,
                key(&pool).await,
                key(&pool).await,
                key(&pool).await
            ],
            [0, 1, 2, 0]
        );
        let b = pool.credential().await.unwrap();
        assert_eq!(b.key_index(), Some(1));
        assert!(pool.rate_limited(&b, Some(Duration::from_secs(2))));
        assert_eq!(
            [key(&pool).await, key(&pool).await, key(&pool).await],
            [2, 0, 2]
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!([key(&pool).await, key(&pool).await], [0, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn all_resting_picks_the_first_back() {
        let pool = ApiKeyPool::new(["a", "b"]).unwrap();
        let a = pool.credential().await.unwrap();
        let b = pool.credential().await.unwrap();
        assert!(pool.rate_limited(&a, Some(Duration::from_secs(9))));
        assert!(!pool.rate_limited(&b, Some(Duration::from_secs(3))));
        assert_eq!(key(&pool).await, 1);
        assert_eq!(key(&pool).await, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn huge_rests_do_not_overflow() {
        const DAY: Duration = Duration::from_secs(24 * 60 * 60);
        let pool = ApiKeyPool::new(["a", "b"])
            .unwrap()
            .default_rest(Duration::MAX);
        let a = pool.credential().await.unwrap();
        let b = pool.credential().await.unwrap();
        // A server's Retry-After as large as the parser takes, and no Retry-After at all.
        assert!(pool.rate_limited(&a, Some(Duration::from_secs(u64::MAX))));
        assert!(!pool.rate_limited(&b, None));
        assert!(!pool.rate_limited(&a, Some(Duration::MAX)));
        // Both rest for at most a day, then are used again.
        tokio::time::advance(DAY - Duration::from_secs(1)).await;
        assert!(!pool.any_usable_now());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(pool.any_usable_now());
        assert_eq!([key(&pool).await, key(&pool).await], [0, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn rejected_keys_are_set_aside() {
        let pool = ApiKeyPool::new(["a", "b"]).unwrap();
        let a = pool.credential().await.unwrap();
        assert!(pool.invalidate(&a));
        assert_eq!([key(&pool).await, key(&pool).await], [1, 1]);
        let b = pool.credential().await.unwrap();
        assert!(!pool.invalidate(&b));
        // Nothing left: keys are still handed out, and the server says no.
        assert!(pool.credential().await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_quarantine_doubles_to_its_cap_and_starts_over_after_a_clean_cap() {
        let pool = ApiKeyPool::new(["a", "b"])
            .unwrap()
            .quarantine(Duration::from_secs(10), Duration::from_secs(30));
        let a = pool.credential().await.unwrap();
        let mut served = Vec::new();
        for _ in 0..4 {
            assert!(pool.invalidate(&a));
            // A second 401 while it is aside (a concurrent request) adds nothing.
            assert!(pool.invalidate(&a));
            let start = Instant::now();
            while key(&pool).await != 0 {
                tokio::time::advance(Duration::from_secs(1)).await;
            }
            served.push(start.elapsed().as_secs());
        }
        assert_eq!(served, [10, 20, 30, 30]);
        // A whole cap without a 401: the next quarantine is the first one again.
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(pool.invalidate(&a));
        let start = Instant::now();
        while key(&pool).await != 0 {
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert_eq!(start.elapsed().as_secs(), 10);
    }

    #[test]
    fn request_scoped_headers_are_named_by_the_pool() {
        let pool = ApiKeyPool::new(["a", "b"]).unwrap();
        let mut h = HeaderMap::new();
        assert!(!pool.blames_request(&h));
        h.insert("anthropic-version", "2023-06-01".parse().unwrap());
        assert!(!pool.blames_request(&h));
        for name in ["openai-organization", "openai-project", "anthropic-beta"] {
            let mut h = h.clone();
            h.insert(name, "x".parse().unwrap());
            assert!(pool.blames_request(&h), "{name}");
        }
        h.insert("openai-organization", "org".parse().unwrap());
        let none = ApiKeyPool::new(["a"])
            .unwrap()
            .request_scoped_headers(std::iter::empty());
        assert!(!none.blames_request(&h));
    }

    #[test]
    fn single_key_and_empty_pools() {
        assert!(!ApiKeyPool::new(["a"]).unwrap().rotates());
        assert!(ApiKeyPool::new(Vec::<String>::new()).is_err());
        let pool = ApiKeyPool::new(["sk-SECRET-1", "sk-SECRET-2"]).unwrap();
        assert!(!format!("{pool:?}").contains("SECRET"));
        let key = ApiKey::new("sk-SECRET").unwrap();
        assert!(!format!("{key:?}").contains("SECRET"));
    }
}
