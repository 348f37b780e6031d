//! The retry stack of one upstream: `RetryLayer` → `ModelFallbackLayer` →
//! `ContextOverflowLayer` → `AuthLayer` (when the proxy holds the keys) → a hyper-util client
//! over rustls with HTTP/2. Its fleet keeps a budget, cooldown gate and pacing per tenant (the
//! upstream and the credential the requests go out with), in the library's bounded scope map:
//! one tenant's `429` never holds another's requests.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower::retry::budget::TpsBudget;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};
use tower_llm_retry::auth::{ApiKeyPool, CredentialHeader};
use tower_llm_retry::fleet::{BudgetConfig, Fleet, RedisFleet, ScopeKey};
use tower_llm_retry::{
    AuthLayer, BoxError, ContextOverflowLayer, ModelFallbackLayer, ReplayBody, RetryLayer,
};

use crate::config::{ConfigError, Kind, Roots, Upstream};
use crate::metrics::{Metrics, Observer};

/// The body of an upstream response, boxed once the stack's layers have wrapped it.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// One upstream's full stack.
pub type Stack = BoxCloneSyncService<Request<Full<Bytes>>, Response<UpstreamBody>, BoxError>;

type Inner = BoxCloneSyncService<Request<ReplayBody>, Response<UpstreamBody>, BoxError>;

/// The hyper-util client for upstreams.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, ReplayBody>;

/// Response extension: how long the upstream took to the head of the attempt that answered.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamHead(pub Duration);

/// Builds the HTTPS (and plain HTTP) client for `up`: TCP_NODELAY, ALPN h2 and http/1.1.
pub fn client(up: &Upstream) -> Result<HttpClient, ConfigError> {
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
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// One upstream's stack, shared by every tenant of the upstream: its fleet keeps their state
/// apart.
#[derive(Clone)]
pub struct StackFactory {
    upstream: Arc<Upstream>,
    holds_keys: bool,
    stack: Stack,
    fleet: Fleet,
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
    /// The stack of `upstream`; `keys` when the proxy holds them; `redis` when the fleets
    /// are shared with the other replicas; at most `max_tenants` tenants kept apart.
    pub fn new(
        upstream: Arc<Upstream>,
        keys: Option<Vec<String>>,
        metrics: Arc<Metrics>,
        body_limit: usize,
        redis: Option<RedisFleet>,
        max_tenants: usize,
    ) -> Result<Self, ConfigError> {
        let client = client(&upstream)?;
        // What names the proxy's own keys in a Redis scope: every replica holding the same
        // keys shares one fleet for them (only a hash of it reaches Redis).
        let keys_scope = keys.as_ref().map(|keys| {
            let mut sorted: Vec<&str> = keys.iter().map(String::as_str).collect();
            sorted.sort_unstable();
            sorted.join("\n").into_bytes()
        });
        let keys = match keys {
            None => None,
            Some(keys) => {
                let header = match upstream.kind {
                    Kind::Anthropic => CredentialHeader::x_api_key(),
                    Kind::OpenAi => CredentialHeader::Bearer,
                };
                let pool = ApiKeyPool::with_header(keys, header).map_err(|e| {
                    ConfigError::from_message(format!(
                        "[[upstream]] {:?}: a key is not usable: {e}",
                        upstream.name
                    ))
                })?;
                Some(Arc::new(pool))
            }
        };
        let mut fleet = upstream
            .fleet()
            .scope_key(tenant_key(upstream.url.clone(), keys_scope))
            .max_scopes(max_tenants);
        if let Some(store) = redis {
            // Each tenant's scope is named in Redis by the upstream's URL and the credential
            // the hook writes, as `RedisFleet::scope` would name it.
            fleet = fleet.redis(store);
        }
        let fleet = fleet.build();
        metrics.watch_fleet(&upstream.name, fleet.clone());
        let stack = build(
            &upstream,
            client,
            keys.as_ref(),
            &metrics,
            body_limit,
            &fleet,
        )?;
        Ok(StackFactory {
            holds_keys: keys.is_some(),
            upstream,
            stack,
            fleet,
        })
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
        let get = |n: &str| h.get(n).map_or(&b""[..], http::HeaderValue::as_bytes);
        key.credential(get("x-api-key"))
            .credential(b"\n")
            .credential(get("authorization"));
        // Azure OpenAI's header; written only when sent, so the other tenants' names (and
        // their Redis keys) are as they were.
        let azure = get("api-key");
        if !azure.is_empty() {
            key.credential(b"\napi-key: ").credential(azure);
        }
    }
}

/// The stack of `up` over `client`, with `fleet`.
fn build(
    up: &Upstream,
    client: HttpClient,
    keys: Option<&Arc<ApiKeyPool>>,
    metrics: &Arc<Metrics>,
    body_limit: usize,
    fleet: &Fleet,
) -> Result<Stack, ConfigError> {
    let name: Arc<str> = Arc::from(up.name.as_str());
    let timed = {
        let metrics = metrics.clone();
        tower::service_fn(move |req: Request<ReplayBody>| {
            // `request` borrows the client only to start: no clone per attempt.
            let start = Instant::now();
            let sent = client.request(req);
            let metrics = metrics.clone();
            let name = name.clone();
            async move {
                let res = sent.await;
                let took = start.elapsed();
                metrics.attempt(&name, took);
                let mut res = res.map_err(BoxError::from)?;
                res.extensions_mut().insert(UpstreamHead(took));
                Ok::<_, BoxError>(res.map(|b| b.map_err(BoxError::from).boxed_unsync()))
            }
        })
    };
    let mut inner: Inner = BoxCloneSyncService::new(timed);
    if let Some(pool) = keys {
        inner = boxed(AuthLayer::new(pool.clone()).layer(inner));
    }
    if up.overflow_repair {
        inner = boxed(ContextOverflowLayer::new().layer(inner));
    }
    if !up.fallback.is_empty() {
        let layer = ModelFallbackLayer::new(up.fallback.iter().map(String::as_str))
            .and_then(|l| l.threshold(up.fallback_threshold))
            .map_err(|e| {
                ConfigError::from_message(format!("[[upstream]] {:?}: fallback: {e}", up.name))
            })?;
        inner = boxed(layer.layer(inner));
    }
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
    Ok(BoxCloneSyncService::new(svc))
}

fn boxed<S, B>(svc: S) -> Inner
where
    S: tower::Service<Request<ReplayBody>, Response = Response<B>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxCloneSyncService::new(
        svc.map_err(Into::into)
            .map_response(|r: Response<B>| r.map(|b| b.map_err(Into::into).boxed_unsync())),
    )
}

/// Which tenant a request belongs to: a salted SHA-256 of its credential headers. The key
/// itself is never kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TenantId([u8; 32]);

impl TenantId {
    /// The tenant of the proxy's own keys (every client of a key-holding upstream).
    pub const PROXY: TenantId = TenantId([0; 32]);

    /// The tenant of a request carrying these credential header values.
    pub fn of(salt: &[u8; 16], credentials: &[&[u8]]) -> TenantId {
        let mut h = Sha256::new();
        h.update(salt);
        for c in credentials {
            h.update((c.len() as u64).to_be_bytes());
            h.update(c);
        }
        TenantId(h.finalize().into())
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
