//! Across the whole stack (retry, model fallback, context overflow, auth), credentials never
//! appear in tracing output captured at TRACE level, nor in the `Debug` output of any public
//! type, while the server does receive them.
//!
//! It lives in the `tracing` binary, where every test installs a TRACE-level subscriber (see
//! `main.rs`), so no sibling running without one can hide events from the capture.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use http::{Request, StatusCode};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::{
    ApiKeyPool, AuthOutcome, Credential, CredentialHeader, RefreshingToken, Token, TokenSource,
};
use tower_llm_retry::fallback::ModelUsed;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::overflow::OverflowRepaired;
use tower_llm_retry::{
    ApiKey, AuthLayer, ContextOverflowLayer, ModelFallbackLayer, ReplayBody, RetryLayer, RetryTrail,
};

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const OPUS: &str =
    r#"{"model":"claude-opus-4-1","max_tokens":64000,"messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test(start_paused = true)]
async fn credentials_never_reach_tracing_or_debug() {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let mut text = String::new();

    // Stack 1: an expired OAuth token refreshed on 401, three overloads, then an overflow.
    let server = MockServer::start(
        Script::new()
            .require_header("authorization", ["Bearer tok-SECRET-new"])
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::context_overflow(150_000, 64_000, 200_000)),
    )
    .await
    .unwrap();
    let source = Arc::new(
        RefreshingToken::new(|| async {
            Ok::<_, std::io::Error>(
                Token::new("tok-SECRET-new").expires_in(Duration::from_secs(3600)),
            )
        })
        .initial(Token::new("tok-SECRET-old"))
        .unwrap(),
    );
    let headers_seen = Arc::new(Mutex::new(String::new()));
    let log = headers_seen.clone();
    let layers = (
        RetryLayer::new().policy(exact_policy()),
        ModelFallbackLayer::new(["claude-sonnet-4-5"]).unwrap(),
        ContextOverflowLayer::new(),
        AuthLayer::new(source.clone()),
    );
    let svc = ServiceBuilder::new()
        .layer(layers.0.clone())
        .layer(layers.1.clone())
        .layer(layers.2.clone())
        .layer(layers.3.clone())
        .map_request(move |req: Request<ReplayBody>| {
            // What a request log would print: the header map, as `Debug` shows it.
            log.lock()
                .unwrap()
                .push_str(&format!("{:?} {:?}\n", req.headers(), req));
            req
        })
        .service(http_client());
    let url = server.url("/v1/messages");
    let res = svc
        .clone()
        .oneshot(anthropic_request(&url, OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let used = res.extensions().get::<ModelUsed>().unwrap();
    assert_eq!(used.model, "claude-sonnet-4-5");
    assert!(matches!(
        res.extensions().get::<OverflowRepaired>(),
        Some(OverflowRepaired::MaxTokens {
            from: 64_000,
            to: 49_000
        })
    ));
    let sent: Vec<_> = server
        .requests()
        .iter()
        .map(|r| r.headers["authorization"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        sent,
        [
            "Bearer tok-SECRET-old",
            "Bearer tok-SECRET-new",
            "Bearer tok-SECRET-new",
            "Bearer tok-SECRET-new",
            "Bearer tok-SECRET-new",
            "Bearer tok-SECRET-new",
        ],
        "the credentials were sent, just never shown"
    );
    text.push_str(&format!(
        "{:?} {:?} {:?} {:?} {:?}\n",
        res.extensions().get::<RetryTrail>(),
        res.extensions().get::<ModelUsed>(),
        res.extensions().get::<OverflowRepaired>(),
        res.extensions().get::<AuthOutcome>(),
        res,
    ));
    text.push_str(&format!("{layers:?} {svc:?}\n"));
    let mut ready = svc.clone();
    let pending = ServiceExt::<Request<http_body_util::Full<bytes::Bytes>>>::ready(&mut ready)
        .await
        .unwrap()
        .call(anthropic_request(&url, OPUS));
    text.push_str(&format!("{pending:?}\n"));
    drop(pending);

    // Stack 2: a key pool, one key rate-limited.
    let pool_server = MockServer::start(Script::new().when(|req| {
        (req.headers["x-api-key"] == "sk-ant-SECRET-a").then(|| Reply::rate_limited("5"))
    }))
    .await
    .unwrap();
    let pool = Arc::new(ApiKeyPool::new(["sk-ant-SECRET-a", "sk-ant-SECRET-b"]).unwrap());
    let pool_svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(AuthLayer::new(pool.clone()))
        .service(http_client());
    let res = pool_svc
        .clone()
        .oneshot(anthropic_request(&pool_server.url("/v1/messages"), OPUS))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.extensions().get::<AuthOutcome>().unwrap().rotations, 1);

    // Every public type that holds or touches a secret.
    let credential: Credential = source.credential().await.unwrap();
    let key = ApiKey::new("sk-ant-SECRET-static").unwrap();
    let bearer = ApiKey::with_header("sk-SECRET-openai", CredentialHeader::Bearer).unwrap();
    let invalid = ApiKey::new("sk-ant-SECRET\nbroken").unwrap_err();
    let failing = RefreshingToken::new(|| async {
        Err::<Token, _>(std::io::Error::other("token endpoint said 503"))
    });
    let refresh_error = failing.credential().await.unwrap_err();
    text.push_str(&format!(
        "{credential:?} {key:?} {bearer:?} {invalid:?} {invalid} {source:?} {pool:?} {pool_svc:?} \
         {refresh_error:?} {refresh_error} {:?} {:?} {:?}\n",
        Token::new("tok-SECRET-x"),
        source.credential(),
        key.credential(),
    ));
    text.push_str(&headers_seen.lock().unwrap());
    let captured = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    text.push_str(&captured);

    // The events that tell what each layer did are there…
    for expected in [
        "credential rejected (401); re-sending once with a fresh one",
        "credential refreshed",
        "falling back to another model",
        "llm_fallback",
        "gen_ai.request.model=\"claude-sonnet-4-5\"",
        "gen_ai.response.model=\"claude-sonnet-4-5\"",
        "max_tokens exceeds the context window; re-sending with less",
        "API key rate-limited (429); re-sending at once with the next key",
        "Sensitive",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    // …and no secret anywhere.
    assert!(!text.contains("SECRET"), "a credential leaked:\n{text}");
}
