//! Claude on Vertex AI: a Google OAuth access token on every request (`GoogleToken`, feature
//! `google-auth`), refreshed before it expires and once after a `401`, and Vertex's
//! `RESOURCE_EXHAUSTED` waited out for its `retryDelay`.
//!
//! ```text
//! cargo run --example vertex --features mock,google-auth
//! ```
//!
//! Two mocks stand in for Google: one as the metadata server (the token), one as Vertex (a
//! per-minute quota exhausted, with `retryDelay: 1s`, then the answer). Against the real
//! service: an HTTPS client (the quick start's hyper-rustls one), no `token_url`, and
//! `GoogleToken::metadata_server` on Google Cloud or `GoogleToken::authorized_user` with the
//! file `gcloud auth application-default login` writes.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::GoogleToken;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{AuthLayer, ReplayBody, RetryLayer, RetryTrail};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let metadata = MockServer::start(Script::always(Reply::status(200).json(json!({
        "access_token": "ya29.mock-token",
        "expires_in": 3599,
        "token_type": "Bearer",
    }))))
    .await?;
    let vertex = MockServer::start(
        Script::new()
            .then(Reply::google_resource_exhausted("1s"))
            .then(Reply::success()),
    )
    .await?;

    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let token = GoogleToken::metadata_server(client.clone())
        .token_url(&metadata.url("/computeMetadata/v1/instance/service-accounts/default/token"))?
        .build();
    let llm = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(AuthLayer::new(token))
        .service(client);

    // Vertex names the model in the path and the API version in the body.
    let url = vertex.url(
        "/v1/projects/my-project/locations/us-east5/publishers/anthropic/models/\
         claude-sonnet-4-5:rawPredict",
    );
    let request = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"anthropic_version":"vertex-2023-10-16","max_tokens":64,"messages":[{"role":"user","content":"Hello"}]}"#,
        )))?;
    let response = llm.oneshot(request).await?;
    let trail = response.extensions().get::<RetryTrail>().cloned();
    println!(
        "{} after {} attempts (slept {:?}), tokens fetched: {}",
        response.status(),
        trail.as_ref().map_or(1, RetryTrail::total_attempts),
        trail
            .as_ref()
            .map(RetryTrail::total_delay)
            .unwrap_or_default(),
        metadata.request_count(),
    );
    let body = response.into_body().collect().await?.to_bytes();
    println!("{}", String::from_utf8_lossy(&body));
    Ok(())
}
