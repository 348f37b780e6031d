//! A fleet kept per scope: a state (budget, gate, pacing, store) for each upstream and
//! credential, made on a scope's first request and kept in a bounded map.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{BudgetStats, Fleet, FleetBuilder};

/// The most scopes a fleet keeps apart by default; requests of scopes beyond share the
/// fleet's own state.
pub(crate) const MAX_SCOPES: usize = 4096;

/// The request headers that carry an API credential, in the order they are preferred.
const CREDENTIAL_HEADERS: [&str; 4] = ["authorization", "x-api-key", "api-key", "x-goog-api-key"];

/// A hook that names the scope of a request ([`FleetBuilder::scope_key`]).
pub(crate) type KeyFn = Arc<dyn Fn(&http::request::Parts, &mut ScopeKey<'_>) + Send + Sync>;

/// The states of a fleet kept per scope.
pub(crate) struct Scopes {
    /// What a scope's state is built from.
    pub(super) template: FleetBuilder,
    /// What names a request's scope, when not its upstream and credential headers.
    key: Option<KeyFn>,
    hasher: foldhash::fast::RandomState,
    kept: RwLock<Kept>,
    max: usize,
    /// What the scopes dropped to make room had counted: the fleet's sums only grow.
    retired: Retired,
}

/// The scopes kept.
#[derive(Default)]
struct Kept {
    map: ScopeMap,
    /// The keys in the order they were made or passed over: where the search for a scope
    /// to drop starts. Only touched when a scope is made.
    order: VecDeque<u64>,
}

/// The scopes by the foldhash of their upstream and credential: the key is a hash already (of
/// a seeded hasher), so the map does not hash it again.
type ScopeMap = std::collections::HashMap<u64, Fleet, std::hash::BuildHasherDefault<KeyIsHash>>;

/// The hasher of a key that is already a hash: it keeps it.
#[derive(Default)]
struct KeyIsHash(u64);

impl Hasher for KeyIsHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed; anything else is folded in, never dropped.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// What names a scope: its upstream, and a hash of the credential (never the credential).
#[derive(Debug, Clone)]
pub(crate) struct ScopeName {
    pub(super) upstream: String,
    pub(super) id: String,
}

/// The counts of the scopes a fleet dropped.
#[derive(Debug, Default)]
struct Retired {
    first_attempts: AtomicU64,
    retries: AtomicU64,
    refused: AtomicU64,
    closings: AtomicU64,
    pacing_refused: AtomicU64,
    pacing_wakes: [AtomicU64; 4],
}

/// What names the scope of a request, written by a [`FleetBuilder::scope_key`] hook: an
/// upstream, and the credential (or anything else that tells tenants apart) the requests
/// go out with. Requests named alike share a state. Neither is kept: a scope is found by a
/// hash of the two, and, with a Redis store, named there by another hash of the two.
///
/// A hook that names no upstream leaves the request to the fleet's own state.
pub struct ScopeKey<'a> {
    sink: Sink<'a>,
}

enum Sink<'a> {
    /// Hashed as written, to find the scope: nothing allocated.
    Hash {
        hasher: &'a mut dyn Hasher,
        named: bool,
    },
    /// Kept, to name a new scope.
    Name {
        upstream: Option<String>,
        credential: Vec<u8>,
    },
}

impl ScopeKey<'_> {
    /// The upstream of the request: shown by [`Fleet::scope_upstream`], and part of the
    /// scope's name in Redis. A second call replaces the first.
    pub fn upstream(&mut self, upstream: &str) -> &mut Self {
        match &mut self.sink {
            Sink::Hash { hasher, named } => {
                hasher.write(upstream.as_bytes());
                // Ends the upstream, as `str` hashing does: it cannot run into what follows.
                hasher.write_u8(0xff);
                *named = true;
            }
            Sink::Name { upstream: u, .. } => *u = Some(upstream.to_owned()),
        }
        self
    }

    /// Bytes of the credential, appended to those written before. Write them the same way
    /// for the same scope: the pieces are hashed as written.
    pub fn credential(&mut self, bytes: &[u8]) -> &mut Self {
        match &mut self.sink {
            Sink::Hash { hasher, .. } => hasher.write(bytes),
            Sink::Name { credential, .. } => credential.extend_from_slice(bytes),
        }
        self
    }
}

impl std::fmt::Debug for ScopeKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The credential is never shown.
        f.debug_struct("ScopeKey").finish_non_exhaustive()
    }
}

/// The credential a request carries: the first value of the first of [`CREDENTIAL_HEADERS`]
/// it has. One pass over the (few) request headers, cheaper than a lookup of each name.
fn credential(headers: &http::HeaderMap) -> &[u8] {
    let mut best: Option<(usize, &http::HeaderValue)> = None;
    for (name, value) in headers {
        let Some(rank) = CREDENTIAL_HEADERS.iter().position(|h| *h == name.as_str()) else {
            continue;
        };
        if best.is_none_or(|(r, _)| rank < r) {
            best = Some((rank, value));
        }
    }
    best.map_or(&b""[..], |(_, v)| v.as_bytes())
}

impl Scopes {
    pub(super) fn new(template: FleetBuilder, key: Option<KeyFn>, max: usize) -> Self {
        Scopes {
            template,
            key,
            hasher: foldhash::fast::RandomState::default(),
            kept: RwLock::new(Kept::default()),
            max,
            retired: Retired::default(),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, Kept> {
        self.kept.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Kept> {
        self.kept.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many scopes are kept.
    pub(super) fn len(&self) -> usize {
        self.read().map.len()
    }

    /// Calls `f` with each scope kept.
    pub(super) fn for_each(&self, mut f: impl FnMut(&Fleet)) {
        for scope in self.read().map.values() {
            f(scope);
        }
    }

    /// What the dropped scopes' budgets had counted.
    pub(super) fn retired_budget(&self) -> BudgetStats {
        let r = &self.retired;
        BudgetStats {
            first_attempts: r.first_attempts.load(Ordering::Relaxed),
            retries: r.retries.load(Ordering::Relaxed),
            refused: r.refused.load(Ordering::Relaxed),
        }
    }

    /// How often the dropped scopes' gates had closed.
    pub(super) fn retired_closings(&self) -> u64 {
        self.retired.closings.load(Ordering::Relaxed)
    }

    /// How many attempts the dropped scopes' pacing had refused.
    pub(super) fn retired_pacing_refused(&self) -> u64 {
        self.retired.pacing_refused.load(Ordering::Relaxed)
    }

    /// The wakes of the dropped scopes' pacing, by cause (in the order of
    /// [`PacingWake::ALL`](super::PacingWake::ALL)).
    pub(super) fn retired_pacing_wakes(&self) -> [u64; 4] {
        let w = &self.retired.pacing_wakes;
        std::array::from_fn(|i| w[i].load(Ordering::Relaxed))
    }

    /// The state of scope `key`, made with the name `name()` gives when there is none.
    fn get<'n>(
        &self,
        key: u64,
        name: impl FnOnce() -> (Cow<'n, str>, Cow<'n, [u8]>),
    ) -> Option<Fleet> {
        if let Some(f) = self.read().map.get(&key) {
            return Some(f.clone());
        }
        let mut kept = self.write();
        let Kept { map, order } = &mut *kept;
        if let Some(f) = map.get(&key) {
            return Some(f.clone());
        }
        if map.len() >= self.max {
            // Full: a scope no request holds makes room (its state is what a new scope would
            // start from anyway, less what it learnt), so rotating credentials (hourly bearer
            // tokens) do not fill the map for good. The oldest first; one in use goes to the
            // back (a second chance), so the scopes of long requests are not looked at again
            // and again. A scope whose gate is closed is kept as one in use is: dropping it
            // would forget the cooldown, and made-up credentials could then open a tenant's
            // gate at will. With every scope in use or closed, the request shares the fleet's
            // own state.
            let mut dropped = None;
            for _ in 0..order.len() {
                let Some(k) = order.pop_front() else { break };
                match map.get(&k) {
                    Some(f) if Arc::strong_count(&f.inner) > 1 || f.closed_until().is_some() => {
                        order.push_back(k)
                    }
                    Some(_) => {
                        dropped = map.remove(&k);
                        break;
                    }
                    None => {}
                }
            }
            self.retire(&dropped?);
        }
        let (upstream, credential) = name();
        let fleet = self
            .template
            .clone()
            .store_for_scope(&upstream, &credential)
            .build_state(
                None,
                Some(ScopeName {
                    id: super::store::scope_id(&upstream, &credential),
                    upstream: upstream.into_owned(),
                }),
            );
        map.insert(key, fleet.clone());
        order.push_back(key);
        Some(fleet)
    }

    /// Keeps what a dropped scope had counted.
    fn retire(&self, scope: &Fleet) {
        let r = &self.retired;
        if let Some(b) = scope.own_budget_stats() {
            r.first_attempts
                .fetch_add(b.first_attempts, Ordering::Relaxed);
            r.retries.fetch_add(b.retries, Ordering::Relaxed);
            r.refused.fetch_add(b.refused, Ordering::Relaxed);
        }
        if let Some(n) = scope.gate().map(|g| g.closings()) {
            r.closings.fetch_add(n, Ordering::Relaxed);
        }
        if let Some(n) = scope.pacer().map(|p| p.refused()) {
            r.pacing_refused.fetch_add(n, Ordering::Relaxed);
        }
        if let Some(cause) = scope.pacer().and_then(|p| p.woken_by()) {
            r.pacing_wakes[cause.index()].fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Fleet {
    /// The handle on the state that a request like `req` uses: its scope's, when the fleet
    /// keeps one per scope ([`FleetBuilder::per_scope`]), made now if it was not yet; the
    /// fleet itself otherwise. Its read-outs are that scope's alone.
    pub fn scope_for<B>(&self, req: &http::Request<B>) -> Fleet {
        let mut head = http::Request::new(());
        *head.method_mut() = req.method().clone();
        *head.uri_mut() = req.uri().clone();
        *head.version_mut() = req.version();
        *head.headers_mut() = req.headers().clone();
        let (parts, ()) = head.into_parts();
        self.for_request(&parts).unwrap_or_else(|| self.clone())
    }

    /// The scopes made so far (and not dropped to make room), when the fleet keeps one per
    /// scope: the read-outs of each are its own.
    pub fn scopes(&self) -> Vec<Fleet> {
        let mut all = Vec::new();
        if let Some(s) = &self.inner.scopes {
            s.for_each(|f| all.push(f.clone()));
        }
        all
    }

    /// The upstream of the scope this handle is of, when it is one.
    pub fn scope_upstream(&self) -> Option<&str> {
        self.inner.scope.as_ref().map(|s| s.upstream.as_str())
    }

    /// The id of the scope this handle is of, when it is one: a hash of its upstream and
    /// credential (the name of its state in Redis, with a store).
    pub fn scope_id(&self) -> Option<&str> {
        self.inner.scope.as_ref().map(|s| s.id.as_str())
    }

    /// The state of a request with head `parts`: its scope's when the fleet keeps one per
    /// scope, `None` when the fleet's own.
    pub(crate) fn for_request(&self, parts: &http::request::Parts) -> Option<Fleet> {
        let scopes = self.inner.scopes.as_ref()?;
        if let Some(hook) = &scopes.key {
            let mut hasher = scopes.hasher.build_hasher();
            let mut key = ScopeKey {
                sink: Sink::Hash {
                    hasher: &mut hasher,
                    named: false,
                },
            };
            hook(parts, &mut key);
            let Sink::Hash { named: true, .. } = key.sink else {
                return None;
            };
            return scopes.get(hasher.finish(), || {
                let mut key = ScopeKey {
                    sink: Sink::Name {
                        upstream: None,
                        credential: Vec::new(),
                    },
                };
                hook(parts, &mut key);
                match key.sink {
                    Sink::Name {
                        upstream,
                        credential,
                    } => (
                        Cow::Owned(upstream.unwrap_or_default()),
                        Cow::Owned(credential),
                    ),
                    Sink::Hash { .. } => (Cow::Borrowed(""), Cow::Borrowed(&[][..])),
                }
            });
        }
        // Without any `user:password@`: the upstream is shown in read-outs and logs, and names
        // the scope in Redis, so the key leaves it out too.
        let authority = parts.uri.authority()?.as_str();
        let upstream = authority
            .rsplit_once('@')
            .map_or(authority, |(_, host)| host);
        let credential = credential(&parts.headers);
        let key = scopes.hasher.hash_one((upstream, credential));
        scopes.get(key, || (Cow::Borrowed(upstream), Cow::Borrowed(credential)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scope's credential: `authorization` first, then the API-key headers in order,
    /// the first value of each, whatever order the request has them in.
    #[test]
    fn credential_prefers_in_order() {
        let mut h = http::HeaderMap::new();
        assert_eq!(credential(&h), b"");
        h.insert("content-type", "application/json".parse().unwrap());
        h.insert("x-goog-api-key", "g".parse().unwrap());
        assert_eq!(credential(&h), b"g");
        h.insert("api-key", "azure".parse().unwrap());
        assert_eq!(credential(&h), b"azure");
        h.append("x-api-key", "first".parse().unwrap());
        h.append("x-api-key", "second".parse().unwrap());
        assert_eq!(credential(&h), b"first");
        h.insert("authorization", "Bearer t".parse().unwrap());
        assert_eq!(credential(&h), b"Bearer t");
        // The rank decides, not the order in the map.
        let mut h = http::HeaderMap::new();
        h.insert("authorization", "Bearer first".parse().unwrap());
        h.insert("x-api-key", "k".parse().unwrap());
        h.insert("x-goog-api-key", "g".parse().unwrap());
        assert_eq!(credential(&h), b"Bearer first");
        h.remove("authorization");
        assert_eq!(credential(&h), b"k");
    }

    fn req(uri: &str, key: &str) -> http::Request<()> {
        http::Request::get(uri)
            .header("x-api-key", key)
            .body(())
            .unwrap()
    }

    /// A scope is the upstream without its userinfo plus the credential: the same key through
    /// `user:password@` shares one scope, named without it; another key gets its own.
    #[test]
    fn scopes_leave_userinfo_out() {
        let fleet = Fleet::builder().build();
        let plain = fleet.scope_for(&req("https://api.example.com/v1/messages", "k1"));
        let alice = fleet.scope_for(&req("https://alice:pw@api.example.com/v1/messages", "k1"));
        let bob = fleet.scope_for(&req("https://bob:pw@api.example.com/v1/messages", "k1"));
        let other = fleet.scope_for(&req("https://alice:pw@api.example.com/v1/messages", "k2"));
        assert!(Arc::ptr_eq(&plain.inner, &alice.inner));
        assert!(Arc::ptr_eq(&plain.inner, &bob.inner));
        assert!(!Arc::ptr_eq(&plain.inner, &other.inner));
        assert_eq!(alice.scope_upstream(), Some("api.example.com"));
        assert_eq!(other.scope_upstream(), Some("api.example.com"));
        assert_ne!(plain.scope_id(), other.scope_id());
        assert_eq!(fleet.scopes().len(), 2);
    }

    /// A hook names the scope: here a tenant header, on an upstream the hook names; the
    /// scope's id is the hash of what the hook wrote, as one written by hand would be.
    #[test]
    fn a_scope_key_hook_names_the_scope() {
        let fleet = Fleet::builder()
            .scope_key(|parts, key| {
                if let Some(t) = parts.headers.get("x-tenant") {
                    key.upstream("the-upstream")
                        .credential(b"tenant:")
                        .credential(t.as_bytes());
                }
            })
            .build();
        let with = |tenant: &str, uri: &str| {
            http::Request::get(uri)
                .header("x-tenant", tenant)
                .header("x-api-key", "ignored")
                .body(())
                .unwrap()
        };
        let a = fleet.scope_for(&with("a", "https://one.example.com/"));
        let a_elsewhere = fleet.scope_for(&with("a", "https://two.example.com/"));
        let b = fleet.scope_for(&with("b", "https://one.example.com/"));
        assert!(a.ptr_eq(&a_elsewhere));
        assert!(!a.ptr_eq(&b));
        assert_eq!(a.scope_upstream(), Some("the-upstream"));
        assert_eq!(
            a.scope_id(),
            Some(super::super::store::scope_id("the-upstream", b"tenant:a").as_str())
        );
        // No tenant: the hook names nothing, the fleet's own state.
        let none = fleet.scope_for(&req("https://one.example.com/", "k"));
        assert!(none.ptr_eq(&fleet));
        assert_eq!(fleet.scopes().len(), 2);
    }

    /// Past the bound, the oldest scope no request holds makes room; one in use is passed
    /// over, and with all in use a new scope shares the fleet's own state.
    #[test]
    fn the_oldest_idle_scope_makes_room() {
        let fleet = Fleet::builder().max_scopes(2).build();
        let key = |k: &str| req("https://api.example.com/", k);
        let a = fleet.scope_for(&key("a"));
        drop(fleet.scope_for(&key("b")));
        // a is held, b is not: c takes b's place.
        let c = fleet.scope_for(&key("c"));
        assert_eq!(fleet.scopes().len(), 2);
        assert!(fleet.scope_for(&key("a")).ptr_eq(&a));
        // Both held: d shares the fleet's own state, and nothing is dropped.
        let d = fleet.scope_for(&key("d"));
        assert!(d.ptr_eq(&fleet));
        assert!(fleet.scope_for(&key("c")).ptr_eq(&c));
        // a let go (it was passed over, so it is now behind c): e takes its place.
        drop(a);
        let e = fleet.scope_for(&key("e"));
        assert!(!e.ptr_eq(&fleet));
        assert!(fleet.scope_for(&key("c")).ptr_eq(&c));
        assert_eq!(fleet.scopes().len(), 2);
    }

    /// A scope whose gate is closed is not dropped to make room, however many new scopes
    /// come: its cooldown holds until the gate opens, and then it may go.
    #[tokio::test(start_paused = true)]
    async fn a_scope_with_a_closed_gate_is_kept() {
        let fleet = Fleet::builder().max_scopes(2).build();
        let a = fleet.scope_for(&req("https://api.example.com/", "a"));
        let until = a.gate().unwrap().close(
            tokio::time::Instant::now(),
            std::time::Duration::from_secs(30),
        );
        assert!(until.is_some());
        drop(a);
        for i in 0..8 {
            drop(fleet.scope_for(&req("https://api.example.com/", &format!("made-up-{i}"))));
        }
        assert_eq!(fleet.scopes().len(), 2);
        let a = fleet.scope_for(&req("https://api.example.com/", "a"));
        assert!(a.closed_until().is_some());
        drop(a);
        // Open again: the next new scope may take its place.
        tokio::time::advance(std::time::Duration::from_secs(31)).await;
        drop(fleet.scope_for(&req("https://api.example.com/", "made-up-x")));
        drop(fleet.scope_for(&req("https://api.example.com/", "made-up-y")));
        let a = fleet.scope_for(&req("https://api.example.com/", "a"));
        assert_eq!(a.closed_until(), None);
    }

    /// Past the bound, a scope no request holds makes room, and what it counted stays in the
    /// fleet's sums.
    #[test]
    fn a_dropped_scope_keeps_its_counts_in_the_sums() {
        let fleet = Fleet::builder().max_scopes(1).build();
        let a = fleet.scope_for(&req("https://api.example.com/", "a"));
        a.deposit();
        a.deposit();
        drop(a);
        let b = fleet.scope_for(&req("https://api.example.com/", "b"));
        b.deposit();
        assert_eq!(fleet.scopes().len(), 1);
        assert_eq!(fleet.budget_stats().unwrap().first_attempts, 3);
        // With the one scope held, a new one shares the fleet's own state.
        let c = fleet.scope_for(&req("https://api.example.com/", "c"));
        assert!(c.ptr_eq(&fleet));
    }
}
