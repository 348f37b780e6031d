//! The retry stack of one upstream, built per (upstream, credential): `RetryLayer` →
//! `ModelFallbackLayer` → `ContextOverflowLayer` → `AuthLayer` (when the proxy holds the keys)
//! → a hyper-util client over rustls with HTTP/2. Each stack has its own `RetryLayer`, so its
//! own budget, cooldown gate and pacing: one tenant's `429` never holds another's requests.

use std::collections::HashMap;
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
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt};
use tower_llm_retry::auth::{ApiKeyPool, CredentialHeader};
use tower_llm_retry::fleet::RedisFleet;
use tower_llm_retry::{
    AuthLayer, BoxError, ContextOverflowLayer, ModelFallbackLayer, ReplayBody, RetryLayer,
};

use crate::config::{ConfigError, Kind, Roots, Upstream};
use crate::metrics::{Metrics, Observer};

/// The body of an upstream response, boxed once the stack's layers have wrapped it.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// One upstream's full stack.
pub type Stack = BoxCloneService<Request<Full<Bytes>>, Response<UpstreamBody>, BoxError>;

type Inner = BoxCloneService<Request<ReplayBody>, Response<UpstreamBody>, BoxError>;

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

/// What a stack is built from, shared by every tenant of one upstream.
#[derive(Clone)]
pub struct StackFactory {
    upstream: Arc<Upstream>,
    client: HttpClient,
    keys: Option<Arc<ApiKeyPool>>,
    /// What names the proxy's own keys in a Redis scope: every replica holding the same
    /// keys shares one fleet for them (only a hash of it reaches Redis).
    keys_scope: Vec<u8>,
    metrics: Arc<Metrics>,
    body_limit: usize,
    redis: Option<RedisFleet>,
}

impl std::fmt::Debug for StackFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StackFactory")
            .field("upstream", &self.upstream.name)
            .field("holds_keys", &self.keys.is_some())
            .field("shared_through_redis", &self.redis.is_some())
            .finish_non_exhaustive()
    }
}

impl StackFactory {
    /// A factory for `upstream`'s stacks; `keys` when the proxy holds them; `redis` when the
    /// fleets are shared with the other replicas.
    pub fn new(
        upstream: Arc<Upstream>,
        keys: Option<Vec<String>>,
        metrics: Arc<Metrics>,
        body_limit: usize,
        redis: Option<RedisFleet>,
    ) -> Result<Self, ConfigError> {
        let client = client(&upstream)?;
        let keys_scope = keys.as_ref().map_or_else(Vec::new, |keys| {
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
        Ok(StackFactory {
            upstream,
            client,
            keys,
            keys_scope,
            metrics,
            body_limit,
            redis,
        })
    }

    /// The upstream's settings.
    pub fn upstream(&self) -> &Arc<Upstream> {
        &self.upstream
    }

    /// Whether the fleets are shared with other replicas through Redis.
    pub fn shares_fleets(&self) -> bool {
        self.redis.is_some()
    }

    /// Whether the proxy holds this upstream's keys.
    pub fn holds_keys(&self) -> bool {
        self.keys.is_some()
    }

    /// A new stack, with its own fleet state: for the requests that go out with `credential`
    /// (the client's credential headers, or none when the proxy holds the keys). With Redis,
    /// that state is the one every replica keeps for this upstream and credential.
    pub fn build(&self, credential: &[u8]) -> Result<Stack, ConfigError> {
        let up = &self.upstream;
        let metrics = self.metrics.clone();
        let name: Arc<str> = Arc::from(up.name.as_str());
        let gate = up.gate;
        let client = self.client.clone();
        let timed = tower::service_fn(move |req: Request<ReplayBody>| {
            // `request` borrows the client only to start: no clone per attempt.
            let start = Instant::now();
            let sent = client.request(req);
            let metrics = metrics.clone();
            let name = name.clone();
            async move {
                let res = sent.await;
                let took = start.elapsed();
                let closes_gate = gate
                    && res.as_ref().is_ok_and(|r| {
                        matches!(r.status().as_u16(), 429 | 529)
                            && (r.headers().contains_key("retry-after")
                                || r.headers().contains_key("retry-after-ms"))
                    });
                metrics.attempt(&name, took, closes_gate);
                let mut res = res.map_err(BoxError::from)?;
                res.extensions_mut().insert(UpstreamHead(took));
                Ok::<_, BoxError>(res.map(|b| b.map_err(BoxError::from).boxed_unsync()))
            }
        });
        let mut inner: Inner = BoxCloneService::new(timed);
        if let Some(pool) = &self.keys {
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
        let mut fleet = up.fleet();
        if let Some(store) = &self.redis {
            let credential = if self.keys.is_some() {
                &self.keys_scope[..]
            } else {
                credential
            };
            fleet = fleet.redis(store.clone().scope(&up.url, credential));
        }
        let fleet = fleet.build();
        let retry = RetryLayer::new()
            .policy(up.retry_policy())
            .body_limit(self.body_limit)
            .fleet(fleet)
            .observer(Observer {
                metrics: self.metrics.clone(),
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
        Ok(BoxCloneService::new(svc))
    }
}

fn boxed<S, B>(svc: S) -> Inner
where
    S: tower::Service<Request<ReplayBody>, Response = Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxCloneService::new(
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

struct Entry {
    tenant: Tenant,
    used: u64,
}

/// One tenant of one upstream: its stack, and the budget its clients' own retries draw on.
#[derive(Clone)]
pub struct Tenant {
    /// The retry stack, with its own budget, gate and pacing.
    pub stack: Stack,
    /// What an SDK's retry of the proxy (`x-stainless-retry-count` > 0) is charged to: the
    /// same parameters as the stack's budget, fed by the requests that are not such retries.
    /// `None` when the upstream's budget is off.
    pub client_budget: Option<Arc<TpsBudget>>,
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant").finish_non_exhaustive()
    }
}

/// A use counter (for least-recently-used eviction) and the stacks.
type Map = (u64, HashMap<(usize, TenantId), Entry>);

/// The stacks, one per (upstream, tenant), made when first needed and kept in a bounded map:
/// beyond `max` the least recently used is dropped (its in-flight requests keep their clone).
pub struct Tenants {
    map: Mutex<Map>,
    max: usize,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl Tenants {
    /// An empty map holding at most `max` stacks.
    pub fn new(max: usize) -> Self {
        Tenants {
            map: Mutex::new((0, HashMap::new())),
            max: max.max(1),
        }
    }

    /// The stack of (`upstream`, `tenant`), built with `factory` when there is none;
    /// `credential` is what the tenant's requests go out with (see [`StackFactory::build`]).
    pub fn get(
        &self,
        upstream: usize,
        tenant: TenantId,
        credential: &[u8],
        factory: &StackFactory,
    ) -> Result<Tenant, ConfigError> {
        let mut guard = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        let (clock, map) = &mut *guard;
        *clock += 1;
        let now = *clock;
        if let Some(e) = map.get_mut(&(upstream, tenant)) {
            e.used = now;
            return Ok(e.tenant.clone());
        }
        if map.len() >= self.max {
            if let Some(oldest) = map.iter().min_by_key(|(_, e)| e.used).map(|(k, _)| *k) {
                map.remove(&oldest);
            }
        }
        let built = Tenant {
            stack: factory.build(credential)?,
            client_budget: factory.upstream.budget_config().map(|b| {
                Arc::new(TpsBudget::new(
                    b.get_ttl(),
                    b.get_min_per_sec(),
                    b.get_retry_ratio(),
                ))
            }),
        };
        map.insert(
            (upstream, tenant),
            Entry {
                tenant: built.clone(),
                used: now,
            },
        );
        Ok(built)
    }

    /// How many stacks are kept.
    pub fn len(&self) -> usize {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .len()
    }

    /// Whether no stack is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether a status means the upstream is failing (for logs).
pub fn is_failure(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}
