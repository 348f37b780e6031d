use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

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
/// goes back up, to `RetryLayer`'s ordinary backoff. A key answered with `401` is set aside
/// for good (while another key is left); the request is then re-sent once with another key.
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
    state: Mutex<PoolState>,
}

struct PoolState {
    resting_until: Vec<Option<Instant>>,
    rejected: Vec<bool>,
    next: usize,
}

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
            state: Mutex::new(PoolState {
                resting_until: vec![None; n],
                rejected: vec![false; n],
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
    fn usable(&self, i: usize, now: Instant) -> bool {
        !self.rejected[i] && self.resting_until[i].is_none_or(|until| until <= now)
    }

    fn any_usable(&self, now: Instant) -> bool {
        (0..self.rejected.len()).any(|i| self.usable(i, now))
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
                    .filter(|&i| !st.rejected[i])
                    .min_by_key(|&i| st.resting_until[i])
            })
            // Every key was rejected: keep sending them, so the server's answer reaches the
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
        if !st.rejected[i] {
            tracing::warn!(
                key_index = i,
                "API key rejected by the server; setting it aside"
            );
            st.rejected[i] = true;
        }
        st.any_usable(now)
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
        let rejected = st.rejected.iter().filter(|r| **r).count();
        f.debug_struct("ApiKeyPool")
            .field("keys", &self.keys.len())
            .field("resting", &resting)
            .field("rejected", &rejected)
            .field("default_rest", &self.default_rest)
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
