use serde_json::json;

use super::*;

fn anthropic_event(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn message_start(id: &str) -> String {
    anthropic_event(
        "message_start",
        json!({"type":"message_start","message":{"id":id,"type":"message","role":"assistant",
            "model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,
            "usage":{"input_tokens":10,"output_tokens":1}}}),
    )
}

fn block_start(index: u64, kind: &str) -> String {
    let block = match kind {
        "text" => json!({"type":"text","text":""}),
        "tool_use" => json!({"type":"tool_use","id":"toolu_1","name":"rm","input":{}}),
        other => json!({"type": other}),
    };
    anthropic_event(
        "content_block_start",
        json!({"type":"content_block_start","index":index,"content_block":block}),
    )
}

fn text_delta(index: u64, text: &str) -> String {
    anthropic_event(
        "content_block_delta",
        json!({"type":"content_block_delta","index":index,"delta":{"type":"text_delta","text":text}}),
    )
}

fn block_stop(index: u64) -> String {
    anthropic_event(
        "content_block_stop",
        json!({"type":"content_block_stop","index":index}),
    )
}

fn message_end(output_tokens: u64) -> String {
    anthropic_event(
        "message_delta",
        json!({"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},
            "usage":{"output_tokens":output_tokens}}),
    ) + &anthropic_event("message_stop", json!({"type":"message_stop"}))
}

/// Every event of `stream`: (name, data).
fn events(stream: &[u8]) -> Vec<(Option<String>, Value)> {
    let text = std::str::from_utf8(stream).unwrap();
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text:?}");
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = None;
            let mut data = String::new();
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                }
            }
            let data = if data == "[DONE]" {
                Value::from("[DONE]")
            } else {
                serde_json::from_str(&data).unwrap()
            };
            (name, data)
        })
        .collect()
}

/// The text of an Anthropic stream, checking it is one well-formed message: one
/// `message_start`, each block started once before its deltas and stopped once, in order.
fn anthropic_text(stream: &[u8]) -> (String, Value) {
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut open: Option<u64> = None;
    let mut next = 0;
    let mut starts = 0;
    for (name, data) in events(stream) {
        assert_eq!(name.as_deref(), data["type"].as_str());
        match data["type"].as_str().unwrap() {
            "message_start" => starts += 1,
            "content_block_start" => {
                assert_eq!(open, None, "a block started inside another");
                assert_eq!(data["index"], next, "indices in order");
                open = Some(next);
                next += 1;
            }
            "content_block_delta" => {
                assert_eq!(Some(data["index"].as_u64().unwrap()), open);
                text.push_str(data["delta"]["text"].as_str().unwrap());
            }
            "content_block_stop" => {
                assert_eq!(Some(data["index"].as_u64().unwrap()), open);
                open = None;
            }
            "message_delta" => usage = data["usage"].clone(),
            "message_stop" | "ping" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(starts, 1, "one message");
    assert_eq!(open, None, "every block closed");
    (text, usage)
}

const REQUEST: &[u8] =
    br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"Hi"}]}"#;

/// Feeds `original` in chunks of `chunk` bytes, then the continuation likewise; returns what
/// the caller received.
fn splice(original: &str, continuation: &str, chunk: usize) -> (Splice, Vec<u8>) {
    let mut s = Splice::new();
    let mut out = Vec::new();
    for c in original.as_bytes().chunks(chunk) {
        out.extend_from_slice(&s.original(c));
    }
    assert!(s.resumable());
    for c in continuation.as_bytes().chunks(chunk) {
        out.extend_from_slice(&s.continuation(c));
    }
    (s, out)
}

#[test]
fn anthropic_cut_mid_text_block_goes_on_in_the_same_block() {
    let original = message_start("msg_1")
        + &block_start(0, "text")
        + &text_delta(0, "Hello")
        + &text_delta(0, ", wor");
    let continuation = message_start("msg_2")
        + &anthropic_event("ping", json!({"type":"ping"}))
        + &block_start(0, "text")
        + &text_delta(0, "ld")
        + &text_delta(0, "!")
        + &block_stop(0)
        + &message_end(7);
    for chunk in [1, 7, 4096] {
        let mut s = Splice::new();
        let mut out = Vec::new();
        for c in original.as_bytes().chunks(chunk) {
            out.extend_from_slice(&s.original(c));
        }
        assert_eq!(s.partial(), "Hello, wor");
        let (body, with) = s.follow_up(REQUEST, ResumeWith::Prefill, "go on").unwrap();
        assert_eq!(with, ResumeWith::Prefill);
        assert_eq!(
            &body[..],
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello, wor"}]}"#
        );
        for c in continuation.as_bytes().chunks(chunk) {
            out.extend_from_slice(&s.continuation(c));
        }
        assert!(s.continuation_complete());
        let (text, usage) = anthropic_text(&out);
        assert_eq!(text, "Hello, world!");
        // message_start's usage of both, overlaid by the continuation's message_delta.
        assert_eq!(usage, json!({"input_tokens":20,"output_tokens":8}));
        // The original's bytes went out as they came.
        assert!(out.starts_with(original.as_bytes()));
    }
}

#[test]
fn anthropic_cut_between_blocks_starts_the_next_index() {
    let original = message_start("msg_1")
        + &block_start(0, "text")
        + &text_delta(0, "First.")
        + &block_stop(0);
    let continuation = message_start("msg_2")
        + &block_start(0, "text")
        + &text_delta(0, " Second.")
        + &block_stop(0)
        + &message_end(3);
    let (s, out) = splice(&original, &continuation, 5);
    assert!(s.continuation_complete());
    let (text, _) = anthropic_text(&out);
    assert_eq!(text, "First. Second.");
    // A continuation whose stop reason comes without `message_stop` is whole too.
    let end = message_end(3);
    let delta_only = &end[..end.find("event: message_stop").unwrap()];
    let continuation = message_start("msg_2")
        + &block_start(0, "text")
        + &text_delta(0, " Second.")
        + &block_stop(0)
        + delta_only;
    let (s, _) = splice(&original, &continuation, 4096);
    assert!(s.continuation_complete());
    let indices: Vec<_> = events(&out)
        .into_iter()
        .filter_map(|(_, d)| d["index"].as_u64())
        .collect();
    assert_eq!(indices, [0, 0, 0, 1, 1, 1]);
}

#[test]
fn anthropic_open_block_closed_when_the_continuation_starts_another_kind() {
    let original = message_start("m") + &block_start(0, "text") + &text_delta(0, "Let me");
    let continuation =
        message_start("m2") + &block_start(0, "tool_use") + &block_stop(0) + &message_end(3);
    let (_, out) = splice(&original, &continuation, 4096);
    let ev = events(&out);
    let kinds: Vec<_> = ev
        .iter()
        .map(|(_, d)| (d["type"].as_str().unwrap().to_owned(), d["index"].as_u64()))
        .collect();
    assert_eq!(
        kinds[3..],
        [
            ("content_block_stop".to_owned(), Some(0)),
            ("content_block_start".to_owned(), Some(1)),
            ("content_block_stop".to_owned(), Some(1)),
            ("message_delta".to_owned(), None),
            ("message_stop".to_owned(), None),
        ]
    );
}

#[test]
fn a_tool_block_open_or_seen_is_not_resumable() {
    let mut s = Splice::new();
    s.original(
        (message_start("m")
            + &block_start(0, "text")
            + &text_delta(0, "Running")
            + &block_start(1, "tool_use"))
            .as_bytes(),
    );
    assert!(!s.resumable());
    // A whole tool call, then text: still not resumed.
    let mut s = Splice::new();
    s.original(
        (message_start("m")
            + &block_start(0, "tool_use")
            + &block_stop(0)
            + &block_start(1, "text")
            + &text_delta(1, "Done"))
            .as_bytes(),
    );
    assert!(!s.resumable());
    let mut s = Splice::new();
    s.original((message_start("m") + &block_start(0, "server_tool_use")).as_bytes());
    assert!(!s.resumable());
    // Nothing to resume yet, or already whole.
    let mut s = Splice::new();
    s.original((message_start("m") + &block_start(0, "text")).as_bytes());
    assert!(!s.resumable());
    let mut s = Splice::new();
    s.original(
        (message_start("m")
            + &block_start(0, "text")
            + &text_delta(0, "Hi")
            + &block_stop(0)
            + &message_end(2))
            .as_bytes(),
    );
    assert!(!s.resumable() && s.complete());
    // A stop reason without message_stop is the end of the answer.
    let mut s = Splice::new();
    let end = message_end(2);
    let delta_only = &end[..end.find("event: message_stop").unwrap()];
    s.original(
        (message_start("m") + &block_start(0, "text") + &text_delta(0, "Hi") + delta_only)
            .as_bytes(),
    );
    assert!(!s.resumable());
}

#[test]
fn an_event_cut_in_half_is_held_back_and_not_part_of_the_text() {
    let whole = message_start("m") + &block_start(0, "text") + &text_delta(0, "Hel");
    let half = &text_delta(0, "lo")[..30];
    let mut s = Splice::new();
    let out = s.original((whole.clone() + half).as_bytes());
    assert_eq!(&out[..], whole.as_bytes());
    assert_eq!(s.partial(), "Hel");
    assert_eq!(&s.original_rest()[..], half.as_bytes());
}

#[test]
fn crlf_and_cr_line_ends_split_events() {
    let a = "event: ping\r\ndata: {\"type\":\"ping\"}\r\n\r\n";
    let b = "data: {}\r\rdata: {}\n\n";
    let all = a.to_owned() + b;
    for size in [1, 2, all.len()] {
        let mut e = Events::new();
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for c in all.as_bytes().chunks(size) {
            out.extend_from_slice(&e.push(c, |ev| seen.push(ev.len())));
        }
        assert_eq!(seen.len(), 3, "{size}");
        assert_eq!(out, all.as_bytes());
        assert!(e.rest().is_empty());
    }
    // Whole, each event ends with its own blank line.
    let mut e = Events::new();
    let mut seen = Vec::new();
    e.push(all.as_bytes(), |ev| {
        seen.push(String::from_utf8(ev.to_vec()).unwrap())
    });
    assert_eq!(seen, [a, "data: {}\r\r", "data: {}\n\n"]);
}

#[test]
fn a_prefill_leaves_trailing_whitespace_out_and_drops_it_from_the_continuation() {
    let original = message_start("m") + &block_start(0, "text") + &text_delta(0, "One two ");
    let mut s = Splice::new();
    let mut out = s.original(original.as_bytes()).to_vec();
    let (body, _) = s.follow_up(REQUEST, ResumeWith::Prefill, "go on").unwrap();
    assert!(body.ends_with(br#"{"role":"assistant","content":"One two"}]}"#));
    let continuation = message_start("m2")
        + &block_start(0, "text")
        + &text_delta(0, " ")
        + &text_delta(0, "three ")
        + &text_delta(0, "four")
        + &block_stop(0)
        + &message_end(3);
    out.extend_from_slice(&s.continuation(continuation.as_bytes()));
    assert_eq!(anthropic_text(&out).0, "One two three four");
    // A continuation that does not repeat the space loses nothing.
    let mut s = Splice::new();
    let mut out = s.original(original.as_bytes()).to_vec();
    s.follow_up(REQUEST, ResumeWith::Prefill, "go on").unwrap();
    let continuation = message_start("m2")
        + &block_start(0, "text")
        + &text_delta(0, "three")
        + &block_stop(0)
        + &message_end(3);
    out.extend_from_slice(&s.continuation(continuation.as_bytes()));
    assert_eq!(anthropic_text(&out).0, "One two three");
}

#[test]
fn an_instruction_carries_the_exact_text() {
    let original = message_start("m") + &block_start(0, "text") + &text_delta(0, "a \"q\" ");
    let mut s = Splice::new();
    s.original(original.as_bytes());
    let (body, with) = s
        .follow_up(REQUEST, ResumeWith::Instruction, "go on")
        .unwrap();
    assert_eq!(with, ResumeWith::Instruction);
    assert_eq!(
        &body[..],
        br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"a \"q\" "},{"role":"user","content":"go on"}]}"#
    );
    assert_eq!(s.follow_up(b"{}", ResumeWith::Instruction, "go on"), None);
}

fn chunk(id: &str, delta: Value, finish: Option<&str>) -> String {
    format!(
        "data: {}\n\n",
        json!({"id":id,"object":"chat.completion.chunk","created":1,"model":"gpt-4o",
            "choices":[{"index":0,"delta":delta,"logprobs":null,"finish_reason":finish}]})
    )
}

/// The text of an OpenAI chat stream, checking every chunk carries `id` and the role comes
/// once.
fn chat_text(stream: &[u8], id: &str) -> (String, Value) {
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut roles = 0;
    for (_, data) in events(stream) {
        if data == "[DONE]" {
            continue;
        }
        assert_eq!(data["id"], id);
        if !data["usage"].is_null() {
            usage = data["usage"].clone();
        }
        for choice in data["choices"].as_array().unwrap() {
            if choice["delta"].get("role").is_some() {
                roles += 1;
            }
            if let Some(t) = choice["delta"]["content"].as_str() {
                text.push_str(t);
            }
        }
    }
    assert_eq!(roles, 1);
    (text, usage)
}

#[test]
fn openai_chat_continuation_keeps_the_id_drops_the_role_and_sums_usage() {
    let original = chunk("chatcmpl-1", json!({"role":"assistant","content":""}), None)
        + &chunk("chatcmpl-1", json!({"content":"Hello"}), None)
        + &chunk("chatcmpl-1", json!({"content":", wor"}), None);
    let usage =
        |p: u64, c: u64| json!({"prompt_tokens":p,"completion_tokens":c,"total_tokens":p+c});
    let continuation = chunk("chatcmpl-2", json!({"role":"assistant","content":""}), None)
        + &chunk("chatcmpl-2", json!({"content":"ld!"}), None)
        + &chunk("chatcmpl-2", json!({}), Some("stop"))
        + &format!(
            "data: {}\n\n",
            json!({"id":"chatcmpl-2","object":"chat.completion.chunk","choices":[],"usage":usage(30,2)})
        )
        + "data: [DONE]\n\n";
    let mut s = Splice::new();
    let mut out = s.original(original.as_bytes()).to_vec();
    assert!(s.resumable());
    // OpenAI has no prefill: it is an instruction.
    let (body, with) = s.follow_up(REQUEST, ResumeWith::Prefill, "go on").unwrap();
    assert_eq!(with, ResumeWith::Instruction);
    assert!(body.ends_with(
        br#"{"role":"assistant","content":"Hello, wor"},{"role":"user","content":"go on"}]}"#
    ));
    for c in continuation.as_bytes().chunks(9) {
        out.extend_from_slice(&s.continuation(c));
    }
    assert!(s.continuation_complete());
    let (text, u) = chat_text(&out, "chatcmpl-1");
    assert_eq!(text, "Hello, world!");
    // The original reported no usage before the cut: the continuation's is the total.
    assert_eq!(u, usage(30, 2));
    assert!(String::from_utf8_lossy(&out).ends_with("data: [DONE]\n\n"));
}

#[test]
fn openai_usage_reported_before_the_cut_is_summed() {
    let mut s = Splice::new();
    s.original(
        (chunk("c1", json!({"role":"assistant","content":"Hi"}), None)
            + "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6}}\n\n")
            .as_bytes(),
    );
    s.follow_up(REQUEST, ResumeWith::Instruction, "go on")
        .unwrap();
    let out = s.continuation(
        (chunk("c2", json!({"content":" there"}), Some("stop"))
            + "data: {\"id\":\"c2\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n")
            .as_bytes(),
    );
    let ev = events(&out);
    assert_eq!(ev[0].1["choices"][0]["delta"]["content"], " there");
    assert_eq!(
        ev[1].1["usage"],
        json!({"prompt_tokens":14,"completion_tokens":3,"total_tokens":17})
    );
    assert_eq!(ev[1].1["id"], "c1");
}

#[test]
fn openai_tool_calls_refusals_and_many_choices_are_not_resumable() {
    for delta in [
        json!({"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"pay","arguments":""}}]}),
        json!({"function_call":{"name":"pay","arguments":""}}),
        json!({"refusal":"I can't"}),
    ] {
        let mut s = Splice::new();
        s.original(
            (chunk("c", json!({"role":"assistant","content":"Sure"}), None)
                + &chunk("c", delta.clone(), None))
                .as_bytes(),
        );
        assert!(!s.resumable(), "{delta}");
    }
    let mut s = Splice::new();
    s.original(
        format!(
            "data: {}\n\n",
            json!({"id":"c","choices":[{"index":1,"delta":{"content":"b"},"finish_reason":null}]})
        )
        .as_bytes(),
    );
    assert!(!s.resumable());
    let mut s = Splice::new();
    s.original((chunk("c", json!({"content":"Hi"}), Some("stop"))).as_bytes());
    assert!(!s.resumable());
}

#[test]
fn an_error_event_in_the_continuation_is_not_forwarded() {
    let mut s = Splice::new();
    s.original((message_start("m") + &block_start(0, "text") + &text_delta(0, "Hi")).as_bytes());
    s.follow_up(REQUEST, ResumeWith::Prefill, "go on").unwrap();
    let out = s.continuation(
        (message_start("m2")
            + &anthropic_event(
                "error",
                json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}),
            ))
            .as_bytes(),
    );
    assert!(out.is_empty());
    assert!(s.continuation_failed() && !s.continuation_complete());
}

#[test]
fn a_stream_of_another_protocol_is_not_resumable() {
    let mut s = Splice::new();
    s.original(b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n");
    assert!(!s.resumable());
}
