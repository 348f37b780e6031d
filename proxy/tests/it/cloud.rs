//! Cloud endpoints as upstreams of the existing kinds (see `docs/clients.md`): Bedrock's
//! Anthropic-compatible endpoint (a base path, the client's bearer key passed through) and
//! Vertex AI's Anthropic endpoint (the model in the path), each throttling in its own dialect:
//! the proxy waits exactly what the dialect says and re-sends the same bytes to the same path.

use std::time::Duration;

use http_body_util::Full;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry_proxy::{Kind, Upstream};

use crate::common::*;

/// The proxy with one more upstream, `name`, of the Anthropic kind at `{mock}{base}`.
async fn with_cloud_upstream(script: Script, name: &str, base: &str) -> Harness {
    let mock = MockServer::start(script).await.unwrap();
    let mut config = config_for(&mock);
    let url = format!("{}{base}", mock.url("").trim_end_matches('/'));
    config
        .upstream
        .push(Upstream::new(name, Kind::Anthropic, &url));
    serve(mock, config).await
}

/// Asserts what the upstream received: `n` requests at `path`, each with the client's bearer
/// token and its exact body, `gap` apart.
fn assert_seen(h: &Harness, n: usize, path: &str, gap: Duration) {
    let seen = h.mock.requests();
    assert_eq!(seen.len(), n);
    for r in &seen {
        assert_eq!(r.uri.path_and_query().unwrap().as_str(), path);
        assert_eq!(
            r.headers.get("authorization").unwrap(),
            "Bearer cloud-credential"
        );
        assert_eq!(sha256(&r.body), sha256(MESSAGES.as_bytes()));
    }
    for pair in seen.windows(2) {
        assert_eq!(pair[1].received_at - pair[0].received_at, gap);
    }
}

#[tokio::test(start_paused = true)]
async fn bedrock_anthropic_endpoint_through_a_base_path_waits_x_amz_retry_after() {
    let h = with_cloud_upstream(
        Script::new()
            .then(Reply::bedrock_throttled(1500))
            .then(Reply::success()),
        "bedrock",
        "/anthropic",
    )
    .await;
    let req = http::Request::post(h.url("/bedrock/v1/messages"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("authorization", "Bearer cloud-credential")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    assert_seen(&h, 2, "/anthropic/v1/messages", Duration::from_millis(1500));
}

#[tokio::test(start_paused = true)]
async fn vertex_anthropic_endpoint_keeps_its_path_and_waits_retry_delay() {
    let h = with_cloud_upstream(
        Script::new()
            .then(Reply::google_resource_exhausted("30s"))
            .then(Reply::success()),
        "vertex",
        "",
    )
    .await;
    let path = "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-sonnet-4-5:rawPredict";
    let req = http::Request::post(h.url(&format!("/vertex{path}")))
        .header("content-type", "application/json")
        .header("authorization", "Bearer cloud-credential")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "x-llm-retry-attempts"), Some("2"));
    assert_seen(&h, 2, path, Duration::from_secs(30));
}

/// A daily quota is returned at once, not waited out.
#[tokio::test(start_paused = true)]
async fn vertex_daily_quota_is_returned_at_once() {
    let h = with_cloud_upstream(
        Script::new()
            .then(Reply::google_daily_quota_exhausted())
            .then(Reply::success()),
        "vertex",
        "",
    )
    .await;
    let path = "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-sonnet-4-5:rawPredict";
    let req = http::Request::post(h.url(&format!("/vertex{path}")))
        .header("content-type", "application/json")
        .header("authorization", "Bearer cloud-credential")
        .body(Full::from(MESSAGES))
        .unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 429);
    assert_seen(&h, 1, path, Duration::ZERO);
}
