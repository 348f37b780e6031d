//! The retry stack of one upstream: `RetryLayer` → `ModelFallbackLayer` →
//! `ContextOverflowLayer` → `AuthLayer` (when the proxy holds the keys) → a hyper-util client
//! over rustls with HTTP/2. Its fleet keeps a budget, cooldown gate and pacing per tenant (the
//! upstream and the credential the requests go out with), in the library's bounded scope map:
//! one tenant's `429` never holds another's requests.
//!
//! A fallback target on another upstream is a library [`Target`] with that upstream's URL
//! and key pool; its attempts go out on that upstream's own client (its TLS roots, its
//! pool), picked by the attempt's scheme, authority and path from a table made at start-up
//! (with no such target, the table has one entry and no lookup is made).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::Uri;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;
use thread_local::ThreadLocal;
use tokio::time::Instant;
use tower::retry::budget::TpsBudget;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};
use tower_llm_retry::auth::{ApiKeyPool, CredentialHeader};
use tower_llm_retry::fallback::Target;
use tower_llm_retry::fleet::{BudgetConfig, Fleet, RedisFleet, ScopeKey};
use tower_llm_retry::{
    AuthLayer, BoxError, ContextOverflowLayer, ModelFallbackLayer, ReplayBody, RetryLayer,
};

use crate::config::{load_keys, ConfigError, Kind, Roots, Upstream};
use crate::metrics::{Metrics, Observer, UpstreamSeries};

/// The body of an upstream response, boxed once the stack's layers have wrapped it.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// One upstream's full stack.
pub type Stack = BoxCloneSyncService<Request<Full<Bytes>>, Response<UpstreamBody>, BoxError>;

/// The hyper-util client for upstreams.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, ReplayBody>;

/// Response extension: how long the upstream took to the head of the attempt that answered.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamHead(pub Duration);

/// Builds the HTTPS (and plain HTTP) client for `up`: TCP_NODELAY, ALPN h2 and http/1.1, a
/// connection pool per thread.
pub fn client(up: &Upstream) -> Result<ThreadClients, ConfigError> {
    let mut roots = RootCertStore::empty();
    match up.roots {
        Roots::Webpki => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Roots::Native => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    if let Some(path) = &up.ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| {
                crate::config::ConfigError::from_message(format!(
                    "[[upstream]] {:?}: cannot read ca_file {}: {e}",
                    up.name,
                    path.display()
                ))
            })?;
        for cert in certs {
            roots.add(cert).map_err(|e| {
                ConfigError::from_message(format!(
                    "[[upstream]] {:?}: bad certificate in ca_file {}: {e}",
                    up.name,
                    path.display()
                ))
            })?;
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| ConfigError::from_message(format!("TLS set-up failed: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    tcp.enforce_http(false);
    tcp.set_connect_timeout(Some(Duration::from_secs(10)));
    let https = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(tcp);
    Ok(ThreadClients {
        builder: Client::builder(TokioExecutor::new()),
        connector: https,
        clients: Arc::new(ThreadLocal::new()),
    })
}

/// One upstream's client as each thread has it: the same connector (TLS roots, timeouts)
/// and settings, and a connection pool of the thread's own, made the first time the thread
/// sends. On the proxy's workers (a current-thread runtime each, see [`crate::workers`]) an
/// upstream connection is then opened, driven and reused on the thread of the requests it
/// carries, and no answer wakes another thread; each worker keeps its own idle connections,
/// as each nginx worker does.
#[derive(Clone)]
pub struct ThreadClients {
    builder: hyper_util::client::legacy::Builder,
    connector: HttpsConnector<HttpConnector>,
    clients: Arc<ThreadLocal<HttpClient>>,
}

impl std::fmt::Debug for ThreadClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadClients").finish_non_exhaustive()
    }
}

impl ThreadClients {
    /// This thread's client.
    pub fn get(&self) -> &HttpClient {
        self.clients
            .get_or(|| self.builder.build(self.connector.clone()))
    }
}

/// The client headers, forwarded as they are, that can make the upstream answer `401` to a
/// held key that is good: an organization or project the key does not belong to, a beta the
/// account is not enrolled in, and Azure's `api-key` (a credential of the client's own,
/// forwarded). A `401` to a request carrying one sets no held key aside.
const REQUEST_SCOPED: [&str; 4] = [
    "openai-organization",
    "openai-project",
    "anthropic-beta",
    "api-key",
];

/// What one upstream lends every stack that sends to it, its own and those whose fallback
/// chain names it: its HTTP client (its TLS roots, its connection pool) and the keys the
/// proxy holds for it.
#[derive(Clone)]
pub struct Peer {
    upstream: Arc<Upstream>,
    client: ThreadClients,
    pool: Option<Arc<ApiKeyPool>>,
    /// What names the proxy's own keys in a Redis scope: every replica holding the same
    /// keys shares one fleet for them (only a hash of it reaches Redis).
    keys_scope: Option<Vec<u8>>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("upstream", &self.upstream.name)
            .field("holds_keys", &self.pool.is_some())
            .finish_non_exhaustive()
    }
}

impl Peer {
    /// `upstream`'s client and, when it names a key source, its key pool.
    pub fn new(upstream: Arc<Upstream>) -> Result<Self, ConfigError> {
        let client = client(&upstream)?;
        let keys = load_keys(&upstream)?;
        let keys_scope = keys.as_ref().map(|keys| {
            let mut sorted: Vec<&str> = keys.iter().map(String::as_str).collect();
            sorted.sort_unstable();
            sorted.join("\n").into_bytes()
        });
        let pool = match keys {
            None => None,
            Some(keys) => {
                let header = match upstream.kind {
                    Kind::Anthropic => CredentialHeader::x_api_key(),
                    Kind::OpenAi => CredentialHeader::Bearer,
                };
                let pool = ApiKeyPool::with_header(keys, header)
                    .map_err(|e| {
                        ConfigError::from_message(format!(
                            "[[upstream]] {:?}: a key is not usable: {e}",
                            upstream.name
                        ))
                    })?
                    .request_scoped_headers(
                        REQUEST_SCOPED.iter().map(|h| HeaderName::from_static(h)),
                    );
                Some(Arc::new(pool))
            }
        };
        Ok(Peer {
            upstream,
            client,
            pool,
            keys_scope,
        })
    }
}

/// One upstream's stack, shared by every tenant of the upstream: its fleet keeps their state
/// apart.
#[derive(Clone)]
pub struct StackFactory {
    upstream: Arc<Upstream>,
    holds_keys: bool,
    stack: Stack,
    fleet: Fleet,
    /// The base URL each fallback target on another upstream was given, and that
    /// upstream's name: what [`ModelUsed`](tower_llm_retry::fallback::ModelUsed) reports
    /// is mapped back through it.
    names: Arc<[(Uri, Arc<str>, HeaderValue)]>,
    /// This upstream's name as a header value, made once.
    header: HeaderValue,
    /// This upstream's request series, looked up once.
    series: Arc<UpstreamSeries>,
    /// The upstream URL's scheme, authority and path (no trailing slash), parsed once.
    base: Option<(Scheme, Authority, String)>,
}

impl std::fmt::Debug for StackFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StackFactory")
            .field("upstream", &self.upstream.name)
            .field("holds_keys", &self.holds_keys)
            .field("fleet", &self.fleet)
            .finish_non_exhaustive()
    }
}

impl StackFactory {
    /// The stack of `peers[index]`, sending to the other peers its fallback chain names;
    /// `redis` when the fleets are shared with the other replicas; at most `max_tenants`
    /// tenants kept apart.
    pub fn new(
        peers: &[Peer],
        index: usize,
        metrics: Arc<Metrics>,
        body_limit: usize,
        redis: Option<RedisFleet>,
        max_tenants: usize,
    ) -> Result<Self, ConfigError> {
        let own = &peers[index];
        let upstream = own.upstream.clone();
        let mut fleet = upstream
            .fleet()
            .scope_key(tenant_key(upstream.url.clone(), own.keys_scope.clone()))
            .max_scopes(max_tenants);
        if let Some(store) = redis {
            // Each tenant's scope is named in Redis by the upstream's URL and the credential
            // the hook writes, as `RedisFleet::scope` would name it.
            fleet = fleet.redis(store);
        }
        let fleet = fleet.build();
        metrics.watch_fleet(&upstream.name, fleet.clone());
        let (stack, names) = build(peers, index, &metrics, body_limit, &fleet)?;
        // Names are ASCII letters, digits, '-' and '_' (`Config::validate`).
        let header = |name: &str| HeaderValue::from_str(name).ok();
        let names = names
            .into_iter()
            .filter_map(|(uri, name)| Some((uri, name.clone(), header(&name)?)))
            .collect();
        let base = upstream.url.parse::<Uri>().ok().and_then(|uri| {
            if uri.query().is_some() {
                return None;
            }
            let path = uri.path().trim_end_matches('/').to_owned();
            let parts = uri.into_parts();
            Some((parts.scheme?, parts.authority?, path))
        });
        Ok(StackFactory {
            base,
            series: metrics.series(&upstream.name),
            holds_keys: own.pool.is_some(),
            header: header(&upstream.name)
                .ok_or_else(|| ConfigError::from_message("an upstream name is not ASCII"))?,
            upstream,
            stack,
            fleet,
            names,
        })
    }

    /// The name of the upstream that served a response whose
    /// [`ModelUsed::upstream`](tower_llm_retry::fallback::ModelUsed::upstream) is `uri`:
    /// this one for `None`.
    pub fn upstream_name(&self, uri: Option<&Uri>) -> &str {
        uri.and_then(|uri| self.names.iter().find(|(u, ..)| u == uri))
            .map_or(self.upstream.name.as_str(), |(_, name, _)| name)
    }

    /// [`upstream_name`](Self::upstream_name) as a header value, made at start-up.
    pub fn upstream_header(&self, uri: Option<&Uri>) -> HeaderValue {
        uri.and_then(|uri| self.names.iter().find(|(u, ..)| u == uri))
            .map_or(&self.header, |(.., header)| header)
            .clone()
    }

    /// The upstream's settings.
    pub fn upstream(&self) -> &Arc<Upstream> {
        &self.upstream
    }

    /// Whether the proxy holds this upstream's keys.
    pub fn holds_keys(&self) -> bool {
        self.holds_keys
    }

    /// The upstream's stack.
    pub fn stack(&self) -> Stack {
        self.stack.clone()
    }

    /// The upstream URL with `path_and_query` after its path; `None` when that is not a URI.
    pub(crate) fn upstream_uri(&self, path_and_query: String) -> Option<Uri> {
        match &self.base {
            // The usual case, an upstream URL without a path: the parts are put together,
            // and only the request's own path and query are parsed.
            Some((scheme, authority, path))
                if path.is_empty() && path_and_query.starts_with('/') =>
            {
                let mut parts = http::uri::Parts::default();
                parts.scheme = Some(scheme.clone());
                parts.authority = Some(authority.clone());
                parts.path_and_query = Some(path_and_query.try_into().ok()?);
                Uri::from_parts(parts).ok()
            }
            _ => {
                let base = self.upstream.url.trim_end_matches('/');
                format!("{base}{path_and_query}").parse().ok()
            }
        }
    }

    /// The upstream's request series.
    pub(crate) fn series(&self) -> &UpstreamSeries {
        &self.series
    }

    /// The upstream's fleet: a scope per tenant.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }
}

/// What names a request's tenant in the fleet: the upstream's URL and the credential the
/// request goes out with (the proxy's own keys, when it holds them; the client's
/// `x-api-key`, `authorization` and, when sent, Azure's `api-key` otherwise). Written as the
/// Redis scopes of earlier versions were named, so the keys in Redis stay the same.
fn tenant_key(
    url: String,
    keys_scope: Option<Vec<u8>>,
) -> impl Fn(&http::request::Parts, &mut ScopeKey<'_>) + Send + Sync + 'static {
    move |parts, key| {
        key.upstream(&url);
        if let Some(keys) = &keys_scope {
            key.credential(keys);
            return;
        }
        let h = &parts.headers;
        let get = |n: &HeaderName| h.get(n).map_or(&b""[..], http::HeaderValue::as_bytes);
        key.credential(get(&crate::forward::X_API_KEY))
            .credential(b"\n")
            .credential(get(&http::header::AUTHORIZATION));
        // Azure OpenAI's header; written only when sent, so the other tenants' names (and
        // their Redis keys) are as they were.
        let azure = get(&crate::forward::API_KEY);
        if !azure.is_empty() {
            key.credential(b"\napi-key: ").credential(azure);
        }
    }
}

/// Where an attempt goes: the client of the upstream whose URL its URI is under.
struct Route {
    scheme: Scheme,
    authority: Authority,
    /// The upstream URL's path, without a trailing slash.
    prefix: String,
    client: ThreadClients,
    name: Arc<str>,
    /// The upstream's attempt series, looked up once.
    series: Arc<UpstreamSeries>,
}

impl Route {
    fn new(peer: &Peer, metrics: &Metrics) -> Result<Self, ConfigError> {
        let bad = || {
            ConfigError::from_message(format!(
                "[[upstream]] {:?}: url is not a URL with a scheme and host",
                peer.upstream.name
            ))
        };
        let uri: Uri = peer.upstream.url.parse().map_err(|_| bad())?;
        let parts = uri.clone().into_parts();
        Ok(Route {
            scheme: parts.scheme.ok_or_else(bad)?,
            authority: parts.authority.ok_or_else(bad)?,
            prefix: uri.path().trim_end_matches('/').to_owned(),
            client: peer.client.clone(),
            name: Arc::from(peer.upstream.name.as_str()),
            series: metrics.series(&peer.upstream.name),
        })
    }

    /// How well `uri` fits this route: the length of the matching path prefix.
    fn fit(&self, uri: &Uri) -> Option<usize> {
        let path = uri.path();
        let under = path.starts_with(&self.prefix)
            && matches!(path.as_bytes().get(self.prefix.len()), None | Some(b'/'));
        (uri.scheme() == Some(&self.scheme) && uri.authority() == Some(&self.authority) && under)
            .then_some(self.prefix.len())
    }
}

/// The routes of one stack, its own upstream first. With no fallback target on another
/// upstream there is one, and an attempt is sent without a look at its URI.
#[derive(Clone)]
struct Routes(Arc<[Route]>);

impl Routes {
    fn pick(&self, uri: &Uri) -> &Route {
        let routes = &self.0;
        if routes.len() == 1 {
            return &routes[0];
        }
        let mut best: Option<(&Route, usize)> = None;
        for route in routes.iter() {
            if let Some(fit) = route.fit(uri) {
                if best.is_none_or(|(_, b)| fit > b) {
                    best = Some((route, fit));
                }
            }
        }
        best.map_or(&routes[0], |(r, _)| r)
    }
}

/// The stack of `peers[index]`, with `fleet`, and the base URL → name of each upstream its
/// fallback targets send to.
#[allow(clippy::type_complexity)]
fn build(
    peers: &[Peer],
    index: usize,
    metrics: &Arc<Metrics>,
    body_limit: usize,
    fleet: &Fleet,
) -> Result<(Stack, Vec<(Uri, Arc<str>)>), ConfigError> {
    let own = &peers[index];
    let up = &*own.upstream;
    let at = |e: &dyn std::fmt::Display| {
        ConfigError::from_message(format!("[[upstream]] {:?}: fallback: {e}", up.name))
    };
    // The chain: a model on this upstream, or one on a peer, sent to that peer's URL with
    // that peer's keys (when the proxy holds them: then it holds this upstream's too).
    let mut routes = vec![Route::new(own, metrics)?];
    let mut names: Vec<(Uri, Arc<str>)> = Vec::new();
    let mut chain = Vec::with_capacity(up.fallback.len());
    for t in &up.fallback {
        let name = t.upstream_or(&up.name);
        let mut target = Target::new(t.model.as_str());
        if name != up.name {
            let peer = peers
                .iter()
                .find(|p| p.upstream.name == name)
                .ok_or_else(|| at(&format!("no upstream named {name:?}")))?;
            // The library puts the target's URL in front of the request's path, which
            // carries this upstream's own path already: a target on an upstream with the
            // same path gets its scheme and host only.
            let own_path = routes[0].prefix.clone();
            let route = Route::new(peer, metrics)?;
            let base = if own_path.is_empty() {
                peer.upstream.url.trim_end_matches('/').to_owned()
            } else if route.prefix == own_path {
                format!("{}://{}", route.scheme, route.authority)
            } else {
                return Err(at(&format!(
                    "upstream {name:?} has the path {:?} and this upstream {own_path:?}: a \
                     target on another upstream needs the same path, or this upstream none",
                    route.prefix
                )));
            };
            // The library's error quotes the URL, which may carry a password: not passed on.
            target = target
                .upstream(&base)
                .map_err(|_| at(&format!("upstream {name:?}'s url is not a base URL")))?;
            if let Some(pool) = &peer.pool {
                target = target.credential(pool.clone());
            }
            let uri: Uri = base.parse().map_err(|_| at(&"a bad url"))?;
            if !names.iter().any(|(u, _)| *u == uri) {
                names.push((uri, route.name.clone()));
                routes.push(route);
            }
        }
        chain.push(target);
    }
    let routes = Routes(routes.into());
    let timed = {
        tower::service_fn(move |req: Request<ReplayBody>| {
            // `request` borrows this thread's client only to start: no clone per attempt.
            let route = routes.pick(req.uri());
            let start = Instant::now();
            let sent = route.client.get().request(req);
            let series = route.series.clone();
            async move {
                let res = sent.await;
                let took = start.elapsed();
                // Counted under the upstream that received the attempt.
                series.attempt(took);
                let mut res = res.map_err(BoxError::from)?;
                res.extensions_mut().insert(UpstreamHead(took));
                Ok::<_, BoxError>(res.map(|b| b.map_err(BoxError::from).boxed_unsync()))
            }
        })
    };
    let auth = own.pool.as_ref().map(|pool| AuthLayer::new(pool.clone()));
    let overflow = up.overflow_repair.then(|| {
        let overflow = ContextOverflowLayer::new();
        match &up.context_window_fallback {
            // Inside the fallback layer, so that `ModelUsed` names the model that served.
            Some(model) => overflow.context_window_fallback(model.clone()),
            None => overflow,
        }
    });
    let fallback = if chain.is_empty() {
        None
    } else {
        let mut layer = ModelFallbackLayer::new(chain)
            .and_then(|l| l.threshold(up.fallback_threshold))
            .map_err(|e| at(&e))?;
        if let Some(n) = up.fallback_after_failures {
            layer = layer.after_failures(n).map_err(|e| at(&e))?;
        }
        if let Some(n) = up.fallback_after_timeouts {
            layer = layer.after_timeouts(n).map_err(|e| at(&e))?;
        }
        if let Some(n) = up.fallback_after_connect_failures {
            layer = layer.after_connect_failures(n).map_err(|e| at(&e))?;
        }
        layer = layer.on_unwaitable_rate_limit(up.fallback_on_unwaitable_rate_limit);
        if let Some(circuit) = &up.circuit {
            layer = layer.circuit(circuit.circuit()).map_err(|e| at(&e))?;
            let labels = up
                .fallback
                .iter()
                .map(|t| format!("{}/{}", t.upstream_or(&up.name), t.model))
                .collect();
            metrics.watch_circuits(&up.name, layer.clone(), labels);
        }
        Some(layer)
    };
    // The layers a configuration leaves out are `Either`'s other side, not a box: the stack
    // under the retry loop is one concrete type, cloned per request without an allocation,
    // its futures and response bodies unboxed (every layer passes the body through).
    let inner = tower::ServiceBuilder::new()
        .option_layer(fallback)
        .option_layer(overflow)
        .option_layer(auth)
        .service(timed);
    let retry = RetryLayer::new()
        .policy(up.retry_policy())
        .body_limit(body_limit)
        .fleet(fleet.clone())
        .observer(Observer {
            metrics: metrics.clone(),
            upstream: up.name.clone(),
        });
    type Req = Request<Full<Bytes>>;
    let svc = ServiceExt::<Req>::map_err(retry.layer(inner), BoxError::from);
    let svc = ServiceExt::<Req>::map_response(
        svc,
        |r: Response<tower_llm_retry::RetryBody<UpstreamBody>>| {
            r.map(|b| b.map_err(BoxError::from).boxed_unsync())
        },
    );
    Ok((BoxCloneSyncService::new(svc), names))
}

/// Which tenant a request belongs to: a keyed hash of its credential headers, 128 bits from
/// two SipHash keys drawn at random when the process starts. The key itself is never kept,
/// and without the hash keys no one can make two credentials share a tenant. (A SHA-256 of
/// the credential cost more than the rest of the handler's own work, on every request.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TenantId([u8; 16]);

/// The secret keys a [`TenantId`] is made with: random, different in every process.
#[derive(Clone, Debug, Default)]
pub struct TenantKeys([std::collections::hash_map::RandomState; 2]);

impl TenantKeys {
    /// Two fresh random keys.
    pub fn new() -> Self {
        Self::default()
    }
}

impl TenantId {
    /// The tenant of the proxy's own keys (every client of a key-holding upstream).
    pub const PROXY: TenantId = TenantId([0; 16]);

    /// The tenant of a request carrying these credential header values.
    pub fn of(keys: &TenantKeys, credentials: &[&[u8]]) -> TenantId {
        use std::hash::{BuildHasher, Hasher};
        let mut out = [0u8; 16];
        for (key, half) in keys.0.iter().zip(out.chunks_mut(8)) {
            let mut h = key.build_hasher();
            for c in credentials {
                // Length-prefixed, so that the values' boundaries are part of the name.
                h.write_u64(c.len() as u64);
                h.write(c);
            }
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
        TenantId(out)
    }
}

/// The budgets an SDK's retries of the proxy (`x-stainless-retry-count` > 0) are charged
/// to, one per (upstream, tenant): the same parameters as the stack's budget, fed by the
/// requests that are not such retries. A thin cache beside the fleet's own scopes, with the
/// same bound: past it, the oldest budget is dropped (O(1)), and its tenant starts a new one.
pub struct Tenants {
    map: Mutex<Budgets>,
    max: usize,
}

#[derive(Default)]
struct Budgets {
    by_tenant: HashMap<(usize, TenantId), Arc<TpsBudget>>,
    /// The keys in the order they were made: the front is dropped first.
    order: VecDeque<(usize, TenantId)>,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl Tenants {
    /// An empty cache holding at most `max` budgets.
    pub fn new(max: usize) -> Self {
        Tenants {
            map: Mutex::new(Budgets::default()),
            max: max.max(1),
        }
    }

    /// The client budget of (`upstream`, `tenant`), made with `config` when there is none.
    pub fn client_budget(
        &self,
        upstream: usize,
        tenant: TenantId,
        config: BudgetConfig,
    ) -> Arc<TpsBudget> {
        let mut guard = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        let b = &mut *guard;
        if let Some(budget) = b.by_tenant.get(&(upstream, tenant)) {
            return budget.clone();
        }
        if b.by_tenant.len() >= self.max {
            if let Some(oldest) = b.order.pop_front() {
                b.by_tenant.remove(&oldest);
            }
        }
        let budget = Arc::new(TpsBudget::new(
            config.get_ttl(),
            config.get_min_per_sec(),
            config.get_retry_ratio(),
        ));
        b.by_tenant.insert((upstream, tenant), budget.clone());
        b.order.push_back((upstream, tenant));
        budget
    }
}

/// Whether a status means the upstream is failing (for logs).
pub fn is_failure(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}
