//! Reading JSON-RPC requests and `tools/list` results.

use std::borrow::Cow;

use serde::Deserialize;

use super::ToolAnnotations;

/// What a request body asks for, as far as the gate is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    /// `tools/call` of these tools (more than one in a batch).
    Tools(Vec<String>),
    /// Some other method; `initialize` and `tools/list` are told apart.
    Other { initialize: bool, tools_list: bool },
    /// Not a JSON-RPC request (a `GET` for the server's stream, a `DELETE`, an empty body, or
    /// only responses to the server's own requests).
    NotRpc,
    /// A body that does not read as JSON-RPC (malformed, or nested past what the parser
    /// follows): it may hold any call, so it is sent as if it mattered.
    Unreadable,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    params: Option<AnyParams<'a>>,
}

/// JSON-RPC's `params` is an object or an array; only a `tools/call`'s object names a tool.
#[derive(Deserialize)]
#[serde(untagged)]
enum AnyParams<'a> {
    #[serde(borrow)]
    Named(Params<'a>),
    Positional(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
struct Params<'a> {
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrBatch<'a> {
    #[serde(borrow)]
    One(Message<'a>),
    Batch(Vec<Message<'a>>),
}

pub(crate) fn read_call(body: &[u8]) -> Call {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Call::NotRpc;
    }
    let messages = match serde_json::from_slice::<OneOrBatch<'_>>(body) {
        Ok(OneOrBatch::One(m)) => vec![m],
        Ok(OneOrBatch::Batch(b)) => b,
        Err(_) => return Call::Unreadable,
    };
    let method = |m: &Message<'_>| m.method.as_deref().map(str::to_owned);
    if messages.iter().all(|m| m.method.is_none()) {
        return Call::NotRpc;
    }
    let calls: Vec<&Message<'_>> = messages
        .iter()
        .filter(|m| method(m).as_deref() == Some("tools/call"))
        .collect();
    if !calls.is_empty() {
        // A call without a name is a tool nobody knows: not replay-safe.
        let names = calls
            .iter()
            .map(|m| {
                match &m.params {
                    Some(AnyParams::Named(p)) => p.name.as_deref().unwrap_or_default(),
                    _ => "",
                }
                .to_owned()
            })
            .collect();
        return Call::Tools(names);
    }
    Call::Other {
        initialize: messages
            .iter()
            .any(|m| method(m).as_deref() == Some("initialize")),
        tools_list: messages
            .iter()
            .any(|m| method(m).as_deref() == Some("tools/list")),
    }
}

#[derive(Deserialize)]
struct Response {
    #[serde(default)]
    result: Option<ToolsResult>,
}

#[derive(Deserialize)]
struct ToolsResult {
    tools: Vec<Tool>,
}

#[derive(Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    annotations: Option<ToolAnnotations>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrBatchResponse {
    One(Response),
    Batch(Vec<Response>),
}

/// The tools of a `tools/list` result (a JSON-RPC response, or a batch holding one), each with
/// its annotations (none given: the defaults, not replay-safe).
pub(crate) fn read_tools(json: &[u8]) -> Vec<(String, ToolAnnotations)> {
    let responses = match serde_json::from_slice::<OneOrBatchResponse>(json) {
        Ok(OneOrBatchResponse::One(r)) => vec![r],
        Ok(OneOrBatchResponse::Batch(b)) => b,
        Err(_) => return Vec::new(),
    };
    responses
        .into_iter()
        .filter_map(|r| r.result)
        .flat_map(|r| r.tools)
        .map(|t| (t.name, t.annotations.unwrap_or_default()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positional_params_elsewhere_in_a_batch_do_not_hide_a_call() {
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge_card","arguments":{}}},{"jsonrpc":"2.0","id":2,"method":"x/custom","params":[1,2]}]"#;
        assert_eq!(read_call(batch), Call::Tools(vec!["charge_card".into()]));
        let positional = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":[1]}"#;
        assert_eq!(read_call(positional), Call::Tools(vec![String::new()]));
    }

    #[test]
    fn a_body_that_does_not_read_is_unreadable_not_rpc_free() {
        // Arguments nested past the parser's depth, garbage, a cut body: any of them may be a
        // call, so none is taken for "not JSON-RPC".
        let deep = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"charge_card","arguments":{{"x":{}1{}}}}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(read_call(deep.as_bytes()), Call::Unreadable);
        assert_eq!(read_call(b"not json"), Call::Unreadable);
        assert_eq!(
            read_call(br#"{"jsonrpc":"2.0","id":1,"method":"tools/ca"#),
            Call::Unreadable
        );
    }

    #[test]
    fn reads_methods_and_tool_names() {
        let call = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"get_weather","arguments":{"city":"Oslo"}}}"#;
        assert_eq!(read_call(call), Call::Tools(vec!["get_weather".into()]));
        let init = br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18"}}"#;
        assert_eq!(
            read_call(init),
            Call::Other {
                initialize: true,
                tools_list: false
            }
        );
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"rm"}}]"#;
        assert_eq!(read_call(batch), Call::Tools(vec!["rm".into()]));
        let unnamed = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}"#;
        assert_eq!(read_call(unnamed), Call::Tools(vec![String::new()]));
        assert_eq!(read_call(b""), Call::NotRpc);
        assert_eq!(read_call(b" \r\n"), Call::NotRpc);
        assert_eq!(
            read_call(br#"{"jsonrpc":"2.0","id":1,"result":{}}"#),
            Call::NotRpc
        );
    }

    #[test]
    fn reads_tools_list_results() {
        let list = br#"{"jsonrpc":"2.0","id":2,"result":{"tools":[
            {"name":"get_weather","inputSchema":{},"annotations":{"title":"Weather","readOnlyHint":true,"openWorldHint":true}},
            {"name":"delete_file","annotations":{"destructiveHint":true,"idempotentHint":false}},
            {"name":"plain"}],"nextCursor":"x"}}"#;
        let tools = read_tools(list);
        assert_eq!(tools.len(), 3);
        assert!(tools[0].1.is_replay_safe());
        assert_eq!(tools[1].1.destructive_hint, Some(true));
        assert!(!tools[1].1.is_replay_safe());
        assert_eq!(tools[2].1, ToolAnnotations::default());
        assert!(read_tools(br#"{"jsonrpc":"2.0","id":2,"error":{"code":-1}}"#).is_empty());
    }
}
