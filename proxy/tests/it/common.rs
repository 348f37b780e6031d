//! The harness: the mock, the proxy in front of it, and a plain hyper-util client.
#![allow(dead_code)]

#[path = "../../../tests/common/listener.rs"]
mod listener;

pub use listener::refuses;

use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_llm_retry::mock::{MockServer, Script, SseFrame};
use tower_llm_retry_proxy::{Config, Kind, Proxy, Upstream};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub const MESSAGES: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":"Hello, world"}]}"#;
pub const MESSAGES_STREAM: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":1024,"stream":true,"messages":[{"role":"user","content":"Hello, world"}]}"#;
pub const CHAT_STREAM: &str =
    r#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"Hello"}]}"#;

pub fn client() -> HttpClient {
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(tcp)
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

pub fn concat(events: &[SseFrame]) -> Bytes {
    let mut out = Vec::new();
    for e in events {
        out.extend_from_slice(&e.bytes());
    }
    Bytes::from(out)
}

/// The mock, a proxy in front of it, and a client.
pub struct Harness {
    pub mock: MockServer,
    pub proxy: Proxy,
    pub addr: SocketAddr,
    pub client: HttpClient,
    stop: Option<oneshot::Sender<()>>,
    pub server: Option<JoinHandle<std::io::Result<()>>>,
}

/// A configuration with an Anthropic and an OpenAI upstream, both at `mock`.
pub fn config_for(mock: &MockServer) -> Config {
    let url = mock.url("");
    let url = url.trim_end_matches('/');
    Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        upstream: vec![
            Upstream::new("anthropic", Kind::Anthropic, url),
            Upstream::new("openai", Kind::OpenAi, url),
        ],
        ..Config::default()
    }
}

/// Two mocks, each an upstream listener of its own: the proxy's `anthropic` and `openai`
/// upstreams at `first` (as [`config_for`]), and `anthropic-b` and `openai-b` (prefixes
/// `/anthropic-b`, `/openai-b`) at `second`. Returns the harness (its `mock` is `first`)
/// and `second`.
pub async fn start_two(
    first: Script,
    second: Script,
    tweak: impl FnOnce(&mut Config),
) -> (Harness, MockServer) {
    let first = MockServer::start(first).await.unwrap();
    let second = MockServer::start(second).await.unwrap();
    let mut config = config_for(&first);
    let url = second.url("");
    let url = url.trim_end_matches('/');
    config
        .upstream
        .push(Upstream::new("anthropic-b", Kind::Anthropic, url));
    config
        .upstream
        .push(Upstream::new("openai-b", Kind::OpenAi, url));
    tweak(&mut config);
    (serve(first, config).await, second)
}

pub async fn start(script: Script) -> Harness {
    start_with(script, |_| {}).await
}

pub async fn start_with(script: Script, tweak: impl FnOnce(&mut Config)) -> Harness {
    let mock = MockServer::start(script).await.unwrap();
    let mut config = config_for(&mock);
    tweak(&mut config);
    serve(mock, config).await
}

pub async fn serve(mock: MockServer, config: Config) -> Harness {
    let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(config).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(proxy.clone().serve(listener, async move {
        let _ = stopped.await;
    }));
    Harness {
        mock,
        proxy,
        addr,
        client: client(),
        stop: Some(stop),
        server: Some(server),
    }
}

/// The proxy in front of a mock that speaks HTTPS and HTTP/2 only, trusted through a
/// `ca_file` in a directory of the test's own (`tag` names it), which the caller removes.
pub async fn behind_https_h2(script: Script, tag: &str) -> (Harness, std::path::PathBuf) {
    let mock = MockServer::builder(script)
        .tls(true)
        .protocol(tower_llm_retry::mock::Protocol::Http2)
        .start()
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!("llm-retry-proxy-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, mock.ca_cert_pem().unwrap()).unwrap();
    let mut config = config_for(&mock);
    // The certificate names `localhost`.
    let url = mock
        .url("")
        .trim_end_matches('/')
        .replace("127.0.0.1", "localhost");
    for up in &mut config.upstream {
        up.url = url.clone();
        up.ca_file = Some(ca.clone());
    }
    (serve(mock, config).await, dir)
}

impl Harness {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn post(&self, path: &str, body: &'static str) -> http::request::Builder {
        let _ = body;
        Request::post(self.url(path))
            .header("content-type", "application/json")
            .header("anthropic-version", "2023-06-01")
            .header("x-api-key", "sk-client")
    }

    pub async fn send(&self, req: Request<Full<Bytes>>) -> Response<Incoming> {
        self.client.request(req).await.unwrap()
    }

    pub async fn messages(&self, body: &'static str) -> Response<Incoming> {
        let req = self
            .post("/v1/messages", body)
            .body(Full::from(body))
            .unwrap();
        self.send(req).await
    }

    /// Stops accepting and starts the drain.
    pub fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Every frame of a body with the instant it arrived, and how the body ended.
pub async fn frames(res: Response<Incoming>) -> (Vec<(Instant, Bytes)>, Result<(), hyper::Error>) {
    let mut body = res.into_body();
    let mut out = Vec::new();
    loop {
        match body.frame().await {
            None => return (out, Ok(())),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    out.push((Instant::now(), d));
                }
            }
            Some(Err(e)) => return (out, Err(e)),
        }
    }
}

pub fn joined(frames: &[(Instant, Bytes)]) -> Bytes {
    let mut out = Vec::new();
    for (_, b) in frames {
        out.extend_from_slice(b);
    }
    Bytes::from(out)
}

pub async fn json(res: Response<Incoming>) -> serde_json::Value {
    let b = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&b).unwrap_or_else(|e| panic!("not JSON ({e}): {b:?}"))
}

pub fn header<'a, B>(res: &'a Response<B>, name: &str) -> Option<&'a str> {
    res.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Two upstream listeners, a primary and a fallback, and the proxy in front of both: the
/// harness's `mock` is the primary; the fallback is returned beside it.
pub async fn start_pair(
    primary: Script,
    fallback: Script,
    config: impl FnOnce(&MockServer, &MockServer) -> Config,
) -> (Harness, MockServer) {
    let primary = MockServer::start(primary).await.unwrap();
    let fallback = MockServer::start(fallback).await.unwrap();
    let config = config(&primary, &fallback);
    (serve(primary, config).await, fallback)
}

/// A mock's base URL, without the trailing slash, as a config's `url` takes it.
pub fn base_url(mock: &MockServer) -> String {
    mock.url("").trim_end_matches('/').to_owned()
}
