//! McpGateLayer in front of RetryLayer, against the mock server as an MCP streamable-HTTP
//! server: side-effecting tool calls are never run twice, idempotent ones are re-sent at most
//! once, annotations are learned from `tools/list` (JSON and SSE), and the session id goes
//! with every attempt.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_llm_retry::mcp::{McpGate, ToolAnnotations};
use tower_llm_retry::mock::{MockServer, Reply, Script, SseFrame};
use tower_llm_retry::retry::{GiveUpReason, Retry};
use tower_llm_retry::{BoxError, Error, McpGateLayer, ReplayBody, RetryLayer, RetryTrail};

fn gate() -> McpGateLayer {
    McpGateLayer::new().policy(exact_policy())
}

/// The gate, then the retry layer, then `client`.
fn stack<K>(
    layer: McpGateLayer,
    client: Client<K, ReplayBody>,
) -> McpGate<Retry<Client<K, ReplayBody>>> {
    ServiceBuilder::new()
        .layer(layer)
        .layer(RetryLayer::new().policy(exact_policy()))
        .service(client)
}

fn rpc(server: &MockServer, body: serde_json::Value) -> Request<Full<Bytes>> {
    Request::post(server.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

fn call(id: u64, tool: &str) -> serde_json::Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
           "params": {"name": tool, "arguments": {"path": "/tmp/x"}}})
}

fn result(id: u64) -> Reply {
    Reply::status(200).json(json!({"jsonrpc": "2.0", "id": id,
        "result": {"content": [{"type": "text", "text": "done"}], "isError": false}}))
}

fn tools_list_result() -> serde_json::Value {
    json!({"jsonrpc": "2.0", "id": 2, "result": {"tools": [
        {"name": "get_weather", "inputSchema": {"type": "object"},
         "annotations": {"title": "Weather", "readOnlyHint": true, "openWorldHint": true}},
        {"name": "send_email", "inputSchema": {"type": "object"},
         "annotations": {"destructiveHint": true, "idempotentHint": false}}]}})
}

fn gave_up(err: &BoxError) -> Option<GiveUpReason> {
    err.downcast_ref::<Error>()?.trail()?.gave_up()
}

#[tokio::test(start_paused = true)]
async fn a_destructive_or_unannotated_call_reset_after_the_server_read_it_is_not_resent() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let svc = stack(
        gate().tool("delete_file", ToolAnnotations::destructive()),
        http_client(),
    );
    for (n, tool) in ["delete_file", "never_listed"].into_iter().enumerate() {
        let err = svc
            .clone()
            .oneshot(rpc(&server, call(1, tool)))
            .await
            .unwrap_err();
        assert_eq!(gave_up(&err), Some(GiveUpReason::NotReplaySafe), "{tool}");
        assert_eq!(server.request_count(), n + 1, "{tool} was sent once");
    }
}

/// A body the gate cannot read may hold any call: a destructive one hidden in a batch beside
/// positional params, arguments nested past the parser's depth. Neither is re-sent after the
/// server may have read it.
#[tokio::test(start_paused = true)]
async fn a_call_the_gate_cannot_read_plainly_is_not_resent() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let svc = stack(
        gate().tool("charge_card", ToolAnnotations::destructive()),
        http_client(),
    );
    let batch = json!([call(1, "charge_card"),
        {"jsonrpc": "2.0", "id": 2, "method": "x/custom", "params": [1, 2]}]);
    let deep = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"charge_card","arguments":{{"x":{}1{}}}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let bodies = [Bytes::from(batch.to_string()), Bytes::from(deep)];
    for (n, body) in bodies.into_iter().enumerate() {
        let req = Request::post(server.url("/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(Full::new(body))
            .unwrap();
        let err = svc.clone().oneshot(req).await.unwrap_err();
        assert_eq!(gave_up(&err), Some(GiveUpReason::NotReplaySafe), "body {n}");
        assert_eq!(server.request_count(), n + 1, "body {n} was sent once");
    }
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_call_is_resent_once_and_no_more() {
    let server = MockServer::start(Script::new().then(Reply::reset()).then(result(1)))
        .await
        .unwrap();
    let layer = gate()
        .tool("upsert_record", ToolAnnotations::idempotent())
        .tool("search", ToolAnnotations::read_only());
    let svc = stack(layer.clone(), http_client());
    let res = svc
        .clone()
        .oneshot(rpc(&server, call(1, "upsert_record")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.extensions().get::<RetryTrail>().unwrap().retries(), 1);
    let seen = server.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].body, seen[1].body, "the same bytes both times");

    // A server that keeps failing gets the call twice, never a third time.
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let err = stack(layer, http_client())
        .oneshot(rpc(&server, call(2, "search")))
        .await
        .unwrap_err();
    assert_eq!(gave_up(&err), Some(GiveUpReason::MaxRetries));
    assert_eq!(server.request_count(), 2);
}

/// A connector that sends its first `refusals` connections to a closed port: the kernel
/// refuses them, so the request provably never left.
#[derive(Clone)]
struct Refusing {
    inner: HttpConnector,
    refusals: Arc<AtomicUsize>,
    closed: Uri,
}

impl Service<Uri> for Refusing {
    type Response = <HttpConnector as Service<Uri>>::Response;
    type Error = <HttpConnector as Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let refuse = self
            .refusals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let target = if refuse { self.closed.clone() } else { uri };
        Box::pin(self.inner.call(target))
    }
}

#[tokio::test(start_paused = true)]
async fn a_refused_connection_is_resent_for_any_call() {
    let server = MockServer::start(Script::always(result(1))).await.unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for (n, tool) in ["charge_card", "never_listed"].into_iter().enumerate() {
        // A fresh client each time, so the connection is not taken from the pool.
        let refusing = Refusing {
            inner: HttpConnector::new(),
            refusals: Arc::new(AtomicUsize::new(1)),
            closed: format!("http://127.0.0.1:{port}/").parse().unwrap(),
        };
        let client: Client<Refusing, ReplayBody> =
            Client::builder(TokioExecutor::new()).build(refusing.clone());
        let svc = stack(
            gate().tool("charge_card", ToolAnnotations::destructive()),
            client,
        );
        let res = svc.oneshot(rpc(&server, call(1, tool))).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let trail = res.extensions().get::<RetryTrail>().unwrap();
        assert_eq!(trail.total_attempts(), 2, "{tool}: refused, then sent");
        assert_eq!(refusing.refusals.load(Ordering::SeqCst), 0);
        assert_eq!(
            server.request_count(),
            n + 1,
            "{tool} reached the server once"
        );
    }
}

async fn learns_from(list_reply: Reply) {
    let server = MockServer::start(
        Script::new()
            .then(Reply::reset()) // get_weather, before anything is known
            .then(list_reply)
            .then(Reply::reset()) // get_weather, now known read-only
            .then(result(4))
            .then(Reply::reset()) // send_email, known destructive
            .otherwise(result(9)),
    )
    .await
    .unwrap();
    let svc = stack(gate(), http_client());

    let err = svc
        .clone()
        .oneshot(rpc(&server, call(1, "get_weather")))
        .await
        .unwrap_err();
    assert_eq!(gave_up(&err), Some(GiveUpReason::NotReplaySafe));
    assert_eq!(server.request_count(), 1);

    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}});
    let res = svc.clone().oneshot(rpc(&server, list)).await.unwrap();
    let body = body_bytes(res).await;
    assert!(std::str::from_utf8(&body).unwrap().contains("get_weather"));
    assert_eq!(server.request_count(), 2);

    let res = svc
        .clone()
        .oneshot(rpc(&server, call(3, "get_weather")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 4, "re-sent once");

    let err = svc
        .clone()
        .oneshot(rpc(&server, call(5, "send_email")))
        .await
        .unwrap_err();
    assert_eq!(gave_up(&err), Some(GiveUpReason::NotReplaySafe));
    assert_eq!(server.request_count(), 5, "not re-sent");
}

#[tokio::test(start_paused = true)]
async fn annotations_are_learned_from_a_json_tools_list_response() {
    learns_from(Reply::status(200).json(tools_list_result())).await;
}

#[tokio::test(start_paused = true)]
async fn annotations_are_learned_from_an_sse_tools_list_response() {
    learns_from(Reply::sse(vec![
        SseFrame::raw(": keep-alive\n\n"),
        SseFrame::new(
            "message",
            &json!({"jsonrpc": "2.0", "method": "notifications/message",
                    "params": {"level": "info", "data": "listing"}})
            .to_string(),
        ),
        SseFrame::new("message", &tools_list_result().to_string()),
    ]))
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_callers_annotations_win_over_the_servers() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(200).json(tools_list_result()))
            .otherwise(Reply::reset()),
    )
    .await
    .unwrap();
    let svc = stack(
        gate().tool("get_weather", ToolAnnotations::destructive()),
        http_client(),
    );
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    body_bytes(svc.clone().oneshot(rpc(&server, list)).await.unwrap()).await;
    let err = svc
        .oneshot(rpc(&server, call(3, "get_weather")))
        .await
        .unwrap_err();
    assert_eq!(gave_up(&err), Some(GiveUpReason::NotReplaySafe));
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_session_id_goes_with_every_attempt() {
    let init_result = json!({"jsonrpc": "2.0", "id": 1, "result": {
        "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
        "serverInfo": {"name": "mock", "version": "1"}}});
    let server = MockServer::start(
        Script::new()
            .then(
                Reply::status(200)
                    .json(init_result)
                    .header("mcp-session-id", "sess-42"),
            )
            .then(Reply::status(202))
            .then(Reply::reset())
            .then(result(2))
            .then(Reply::anthropic_error(404, "not_found", "session expired"))
            .otherwise(result(3)),
    )
    .await
    .unwrap();
    let svc = stack(
        gate().tool("upsert_record", ToolAnnotations::idempotent()),
        http_client(),
    );
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "test", "version": "1"}}});
    svc.clone()
        .oneshot(rpc(&server, init.clone()))
        .await
        .unwrap();
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let res = svc
        .clone()
        .oneshot(rpc(&server, initialized))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let res = svc
        .clone()
        .oneshot(rpc(&server, call(2, "upsert_record")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    let seen = server.requests();
    let session = |i: usize| {
        seen[i]
            .headers
            .get("mcp-session-id")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(session(0), None, "initialize starts a session");
    assert_eq!(session(1).as_deref(), Some("sess-42"));
    // Both attempts of the call carry it.
    assert_eq!(session(2).as_deref(), Some("sess-42"));
    assert_eq!(session(3).as_deref(), Some("sess-42"));
    assert_eq!(seen[2].body, seen[3].body);

    // The server ends the session: the id is forgotten, the next initialize goes without it.
    let res = svc
        .clone()
        .oneshot(rpc(&server, call(4, "upsert_record")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    svc.oneshot(rpc(&server, init)).await.unwrap();
    let seen = server.requests();
    assert_eq!(seen.len(), 6);
    assert_eq!(seen[4].headers["mcp-session-id"], "sess-42");
    assert!(seen[5].headers.get("mcp-session-id").is_none());
}

#[tokio::test(start_paused = true)]
async fn other_methods_follow_the_ordinary_policy() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::reset())
            .then(Reply::reset())
            .then(result(1)),
    )
    .await
    .unwrap();
    let read = json!({"jsonrpc": "2.0", "id": 1, "method": "resources/read",
                      "params": {"uri": "file:///notes.txt"}});
    let res = stack(gate(), http_client())
        .oneshot(rpc(&server, read))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 3);
}

#[tokio::test(start_paused = true)]
async fn the_session_reconnect_cap_bounds_resends_within_its_window() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let svc = stack(gate().reconnect(2, Duration::from_secs(60)), http_client());
    let read = || {
        json!({"jsonrpc": "2.0", "id": 1, "method": "resources/read",
               "params": {"uri": "file:///notes.txt"}})
    };
    let first = svc.clone().oneshot(rpc(&server, read())).await.unwrap_err();
    assert_eq!(gave_up(&first), Some(GiveUpReason::MaxRetries));
    assert_eq!(server.request_count(), 3, "two re-sends, the cap");
    svc.clone().oneshot(rpc(&server, read())).await.unwrap_err();
    assert_eq!(server.request_count(), 4, "the cap is spent: sent once");

    tokio::time::advance(Duration::from_secs(61)).await;
    svc.oneshot(rpc(&server, read())).await.unwrap_err();
    assert_eq!(server.request_count(), 7, "the window moved on");
}
