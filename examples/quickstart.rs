//! The README's quick start: one message to the Anthropic Messages API over HTTPS, through
//! `RetryLayer`, `ModelFallbackLayer` and `AuthLayer` on hyper-util's client with hyper-rustls.
//!
//! ```text
//! ANTHROPIC_API_KEY=sk-ant-... cargo run --example quickstart --features mock   # the real API
//! cargo run --example quickstart --features mock                                # no key: a local mock
//! ```
//!
//! With `ANTHROPIC_API_KEY` set it talks to `https://api.anthropic.com` and trusts the
//! webpki roots. Without it the same stack talks HTTPS to the crate's mock server on
//! 127.0.0.1 (feature `mock`), trusting only the certificate authority the mock made at
//! start, and the mock fails the way the real API does: a rate limit with `Retry-After`, then
//! three overloads in a row. Either way the example prints every attempt the stack made.
//!
//! The client speaks HTTPS (hyper-rustls, webpki roots, HTTP/2 offered by ALPN). hyper-util's
//! `build_http()` would not do: it speaks plain `http://` only, and the request would end at
//! once with `ErrorKind::Unsendable` ("the client's connector speaks only http://"). The
//! same client with reqwest (default features: rustls, the platform's roots, HTTP/2):
//!
//! ```text
//! let client = reqwest::Client::builder().retry(reqwest::retry::never()).build()?;
//! let llm = ServiceBuilder::new()
//!     .layer(RetryLayer::new())
//!     .layer(fallback)
//!     .layer(AuthLayer::new(key))
//!     .service(tower_llm_retry::reqwest::ReqwestService::new(client)); // feature `reqwest`
//! ```
//!
//! (reqwest's own retry off, or attempts multiply; `examples/reqwest_client.rs` runs it.)

use std::time::Instant;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::fallback::ModelUsed;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{
    ApiKey, AuthLayer, BoxError, ModelFallbackLayer, ReplayBody, RetryLayer, RetryTrail,
};

const ANTHROPIC: &str = "https://api.anthropic.com";
const BODY: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"Say hello in five words."}]}"#;
/// The key the mock accepts; any other gets the `401` the real API sends.
const MOCK_KEY: &str = "sk-ant-mock-key";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (api_key, mock) = match std::env::var("ANTHROPIC_API_KEY") {
        Ok(key) if !key.is_empty() => (key, None),
        _ => (MOCK_KEY.to_owned(), Some(start_mock().await?)),
    };

    // The README's code, with the two differences a mock needs: whom the TLS client trusts
    // and where the request goes. HTTPS, HTTP/1.1 and HTTP/2 (by ALPN), webpki roots.
    let tls = HttpsConnectorBuilder::new();
    let tls = match &mock {
        None => tls.with_webpki_roots(),
        Some(server) => tls.with_tls_config(server.tls_client_config().ok_or("no TLS")?),
    };
    let https = tls.https_only().enable_http1().enable_http2().build();
    let client = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(https);

    let key = ApiKey::new(&api_key)?;
    let fallback = ModelFallbackLayer::new(["claude-sonnet-4-5", "claude-haiku-4-5"])?;
    let llm = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(fallback)
        .layer(AuthLayer::new(key))
        .service(client);

    let url = match &mock {
        None => format!("{ANTHROPIC}/v1/messages"),
        Some(server) => server.url("/v1/messages"),
    };
    let requests = if mock.is_some() { 2 } else { 1 };
    println!("POST {url}");

    for n in 1..=requests {
        let sent = Instant::now();
        let request = Request::post(&url)
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))?;

        println!("request {n}");
        let response = match llm.clone().oneshot(request).await {
            Ok(response) => response,
            Err(e) => {
                print_attempts(e.trail());
                println!("  -> {:?} after {:.1?}: {e}", e.kind(), sent.elapsed());
                return Err(e.into());
            }
        };

        let status = response.status();
        let trail = response.extensions().get::<RetryTrail>().cloned();
        let used = response.extensions().get::<ModelUsed>().cloned();
        let body = response.into_body().collect().await?.to_bytes();

        print_attempts(trail.as_ref());
        let attempts = trail.as_ref().map_or(1, |t| t.total_attempts());
        let model = used.as_ref().map_or("?", |u| u.model.as_str());
        let asked_for = used.as_ref().map_or("?", |u| u.requested.as_str());
        println!(
            "  -> {status} from {model} (asked for {asked_for}) after {attempts} attempt(s) in {:.1?}",
            sent.elapsed(),
        );
        println!("  {}", answer_text(&body));
    }

    if let Some(server) = mock {
        let received = server.requests();
        let keyed = received
            .iter()
            .filter(|r| r.headers.get("x-api-key").is_some_and(|v| v == MOCK_KEY))
            .count();
        let models: Vec<String> = received
            .iter()
            .map(|r| {
                r.json()
                    .ok()
                    .and_then(|v| v.get("model")?.as_str().map(str::to_owned))
                    .unwrap_or_default()
            })
            .collect();
        let version = received
            .first()
            .map_or(http::Version::HTTP_11, |r| r.version);
        println!(
            "the mock received {} requests over TLS and {version:?}, {keyed} of them with the key; models sent: {}",
            received.len(),
            models.join(", ")
        );
        println!("set ANTHROPIC_API_KEY to send the same request to {ANTHROPIC}");
    }
    Ok(())
}

/// One line per failed attempt: its status (or the error when it got none), its class, the
/// wait the server asked for and the sleep the loop took.
fn print_attempts(trail: Option<&RetryTrail>) {
    for a in trail.map_or(&[][..], |t| t.attempts()) {
        let what = match (a.status, &a.error) {
            (Some(s), _) => format!("{} {}", s.as_u16(), a.class.as_str()),
            (None, Some(error)) => format!("{}: {error}", a.class.as_str()),
            (None, None) => a.class.as_str().to_owned(),
        };
        let asked = a
            .retry_after
            .map(|d| format!(", server asked for {d:?}"))
            .unwrap_or_default();
        let slept = a
            .delay
            .map(|d| format!(", slept {d:.2?}"))
            .unwrap_or_default();
        println!("  attempt {}: {what}{asked}{slept}", a.attempt);
    }
}

/// A local HTTPS server that answers like the Anthropic API: the first request is rate
/// limited once, the second is overloaded three times in a row (so the third retry goes to the
/// fallback model), and any other key than [`MOCK_KEY`] gets a `401`.
async fn start_mock() -> Result<MockServer, BoxError> {
    let script = Script::new()
        .require_header("x-api-key", [MOCK_KEY])
        .then(Reply::rate_limited("1"))
        .then(Reply::success())
        .then(Reply::overloaded())
        .then(Reply::overloaded())
        .then(Reply::overloaded());
    Ok(MockServer::builder(script).tls(true).start().await?)
}

/// The text of a Messages API answer, or the body as it came when it is not one.
fn answer_text(body: &Bytes) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.pointer("/content/0/text")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}
