//! `GoogleToken` in `AuthLayer`: a token server (the mock, as the metadata server or Google's
//! OAuth endpoint) and an API server (the mock, as Vertex), both on 127.0.0.1 under paused
//! time.

use std::time::Duration;

use http::StatusCode;
use serde_json::json;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::{AuthOutcome, GoogleToken};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{AuthLayer, ErrorKind, RetryLayer};

use crate::common::*;

const VERTEX_PATH: &str =
    "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-sonnet-4-5:rawPredict";
const TOKEN_PATH: &str = "/computeMetadata/v1/instance/service-accounts/default/token";

fn token(access_token: &str, expires_in: u64) -> Reply {
    Reply::status(200).json(json!({
        "access_token": access_token,
        "expires_in": expires_in,
        "token_type": "Bearer",
    }))
}

fn bearer(r: &tower_llm_retry::mock::RecordedRequest) -> &str {
    r.headers["authorization"].to_str().unwrap()
}

async fn send(
    api: &MockServer,
    source: tower_llm_retry::auth::RefreshingToken,
) -> http::Response<impl http_body::Body> {
    ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(AuthLayer::new(source))
        .service(http_client())
        .oneshot(anthropic_request(&api.url(VERTEX_PATH), BODY))
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn metadata_token_is_sent_and_refreshed_before_it_expires() {
    let tokens = MockServer::start(
        Script::new()
            .then(token("ya29.first", 200))
            .then(token("ya29.second", 3600)),
    )
    .await
    .unwrap();
    let api = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let source = GoogleToken::metadata_server(http_client())
        .token_url(&tokens.url(TOKEN_PATH))
        .unwrap()
        .build();
    let stack = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(AuthLayer::new(source))
        .service(http_client());

    let start = tokio::time::Instant::now();
    let res = stack
        .clone()
        .oneshot(anthropic_request(&api.url(VERTEX_PATH), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // 29 s left of the 200 s, inside the 30 s mandatory window: the next request waits for
    // a new token.
    tokio::time::sleep(Duration::from_secs(171)).await;
    let res = stack
        .oneshot(anthropic_request(&api.url(VERTEX_PATH), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    let sent: Vec<_> = api
        .requests()
        .iter()
        .map(|r| bearer(r).to_owned())
        .collect();
    assert_eq!(sent, ["Bearer ya29.first", "Bearer ya29.second"]);
    let asked = tokens.requests();
    assert_eq!(asked.len(), 2);
    assert_eq!(asked[0].received_at - start, Duration::ZERO);
    assert_eq!(asked[1].received_at - start, Duration::from_secs(171));
    for r in &asked {
        assert_eq!(r.method, http::Method::GET);
        assert_eq!(r.uri.path(), TOKEN_PATH);
        assert_eq!(r.headers["metadata-flavor"], "Google");
    }
}

#[tokio::test(start_paused = true)]
async fn a_401_fetches_a_new_token_and_resends_the_same_bytes() {
    let tokens = MockServer::start(
        Script::new()
            .then(token("ya29.revoked", 3600))
            .then(token("ya29.fresh", 3600)),
    )
    .await
    .unwrap();
    let api = MockServer::start(
        Script::new()
            .then(Reply::unauthorized())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let source = GoogleToken::metadata_server(http_client())
        .token_url(&tokens.url(TOKEN_PATH))
        .unwrap()
        .build();
    let res = send(&api, source).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.extensions().get::<AuthOutcome>().unwrap().refreshed);
    let reqs = api.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(bearer(&reqs[0]), "Bearer ya29.revoked");
    assert_eq!(bearer(&reqs[1]), "Bearer ya29.fresh");
    for r in &reqs {
        assert_eq!(r.uri.path(), VERTEX_PATH);
        assert_eq!(sha256(&r.body), sha256(BODY.as_bytes()));
    }
    assert_eq!(tokens.request_count(), 2);
}

const ADC: &str = r#"{
  "client_id": "764086051850-6qr4p6gpi6hn506pt8ejuq83di341hur.apps.googleusercontent.com",
  "client_secret": "d-FL95Q19q7MQmFpd7hHD0Ty",
  "refresh_token": "1//0gSecret+Refresh/Token=",
  "type": "authorized_user"
}"#;

#[tokio::test(start_paused = true)]
async fn authorized_user_exchanges_its_refresh_token() {
    let tokens = MockServer::start(Script::new().then(token("ya29.user", 3599)))
        .await
        .unwrap();
    let api = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let source = GoogleToken::authorized_user(http_client(), ADC)
        .unwrap()
        .token_url(&tokens.url("/token"))
        .unwrap()
        .build();
    let res = send(&api, source).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(bearer(&api.requests()[0]), "Bearer ya29.user");
    let asked = tokens.requests();
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].method, http::Method::POST);
    assert_eq!(
        asked[0].headers["content-type"],
        "application/x-www-form-urlencoded"
    );
    let form = "grant_type=refresh_token\
        &client_id=764086051850-6qr4p6gpi6hn506pt8ejuq83di341hur.apps.googleusercontent.com\
        &client_secret=d-FL95Q19q7MQmFpd7hHD0Ty\
        &refresh_token=1%2F%2F0gSecret%2BRefresh%2FToken%3D";
    assert_eq!(sha256(&asked[0].body), sha256(form.as_bytes()));
}

#[tokio::test(start_paused = true)]
async fn a_refused_exchange_ends_the_request_without_quoting_secrets() {
    let tokens = MockServer::start(Script::always(Reply::status(400).json(json!({
        "error": "invalid_grant",
        "error_description": "Token has been expired or revoked.",
    }))))
    .await
    .unwrap();
    let api = MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap();
    let source = GoogleToken::authorized_user(http_client(), ADC)
        .unwrap()
        .token_url(&tokens.url("/token"))
        .unwrap()
        .build();
    let err = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(AuthLayer::new(source))
        .service(http_client())
        .oneshot(anthropic_request(&api.url(VERTEX_PATH), BODY))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TokenRefresh);
    let mut chain = format!("{err} {err:?}");
    let mut next = std::error::Error::source(&err);
    while let Some(e) = next {
        chain.push_str(&format!(" {e}"));
        next = e.source();
    }
    assert!(chain.contains("400 Bad Request: invalid_grant"), "{chain}");
    for secret in ["d-FL95Q19q7MQmFpd7hHD0Ty", "1//0gSecret", "1%2F%2F0gSecret"] {
        assert!(!chain.contains(secret), "{chain}");
    }
    assert_eq!(api.request_count(), 0);
    assert_eq!(tokens.request_count(), 1);
}

#[test]
fn credentials_that_are_not_an_authorized_user_are_refused() {
    // Nothing is sent: `()` stands for the client.
    let sa = r#"{"type":"service_account","private_key":"-----BEGIN PRIVATE KEY-----\nMIIE"}"#;
    let err = GoogleToken::authorized_user((), sa).unwrap_err();
    assert!(err.to_string().contains("service_account"), "{err}");
    assert!(!err.to_string().contains("PRIVATE"), "{err}");
    let err = GoogleToken::authorized_user((), "{\"type\": \"auth").unwrap_err();
    assert!(err.to_string().contains("not JSON"), "{err}");
    assert!(!err.to_string().contains("auth"), "{err}");
    let debug = format!("{:?}", GoogleToken::authorized_user((), ADC).unwrap());
    assert!(
        !debug.contains("d-FL95Q19q7MQmFpd7hHD0Ty") && !debug.contains("1//0g"),
        "{debug}"
    );
}
