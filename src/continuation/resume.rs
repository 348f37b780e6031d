//! Splicing a continuation into a cut event stream: what the original stream said so far, the
//! follow-up request, and the continuation's events rewritten to carry on the caller's one
//! stream. Pure functions over bytes, so they are tested on their own; the body in
//! `resume_body.rs` drives them.

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use super::stitch::{add_usage, append_prefill, append_turns};
use super::ResumeWith;
use crate::json_edit;
use crate::stream::parse_block;

/// The streaming dialects a cut can be resumed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialect {
    /// Anthropic Messages: named events, blocks with indices.
    Anthropic,
    /// OpenAI Chat Completions: unnamed `data:` chunks, `choices[].delta`.
    OpenAiChat,
}

const TOOL_BLOCKS: [&str; 3] = ["tool_use", "server_tool_use", "mcp_tool_use"];

/// Splits a byte stream into whole SSE events (each with the blank line that ends it), holding
/// back an event until its end has come, so the caller never forwards half an event.
#[derive(Debug, Default)]
struct Events {
    buf: BytesMut,
    /// How far the search for the end of the first event has read `buf`.
    scanned: usize,
    /// The line being read is still empty (the event so far ends with a line end, or nothing).
    line_empty: bool,
    /// The last byte read was a `\r`: a `\n` right after it is the same line end.
    after_cr: bool,
    /// Where the last whole event found ends.
    whole: usize,
}

impl Events {
    fn new() -> Self {
        Events {
            line_empty: true,
            ..Events::default()
        }
    }

    /// Feeds `chunk`; calls `each` with the bytes of every event it completes, and returns
    /// the bytes of those events, in one piece.
    fn push(&mut self, chunk: &[u8], mut each: impl FnMut(&[u8])) -> Bytes {
        self.buf.extend_from_slice(chunk);
        let mut start = self.whole;
        let mut i = self.scanned;
        while i < self.buf.len() {
            let b = self.buf[i];
            i += 1;
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                continue;
            }
            match b {
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    if self.line_empty {
                        // A `\r\n` blank line: its `\n`, when already here, belongs to this
                        // event; one still to come is skipped by `after_cr`.
                        if self.after_cr && self.buf.get(i) == Some(&b'\n') {
                            i += 1;
                            self.after_cr = false;
                        }
                        each(&self.buf[start..i]);
                        start = i;
                        self.whole = i;
                    }
                    self.line_empty = true;
                }
                _ => self.line_empty = false,
            }
        }
        self.scanned = i;
        let out = self.buf.split_to(self.whole).freeze();
        self.scanned -= self.whole;
        self.whole = 0;
        out
    }

    /// The bytes of an event not finished yet.
    fn rest(&mut self) -> Bytes {
        self.scanned = 0;
        self.line_empty = true;
        self.buf.split().freeze()
    }
}

/// The Anthropic block open when the original stream was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Open {
    index: u64,
    text: bool,
}

/// How the continuation's blocks land in the caller's stream (Anthropic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocks {
    /// No block of the continuation seen yet.
    Waiting,
    /// The continuation's block `i` is the caller's block `i + base`.
    Mapped { base: u64 },
}

/// What the original stream said, and how the continuation is spliced after it.
#[derive(Debug)]
pub(crate) struct Splice {
    dialect: Option<Dialect>,
    original: Events,
    /// The answer's text so far, every text delta of whole events.
    text: String,
    /// Anthropic: the block open at the cut, and the index after the last block started.
    open: Option<Open>,
    next_index: u64,
    /// Only text was seen: no tool call, thinking, refusal, or second choice.
    only_text: bool,
    /// The stream reached its end (a terminal event, a stop reason, an error).
    complete: bool,
    /// The original's message or completion id.
    id: Option<String>,
    /// The original's usage as far as it was reported.
    usage: Value,

    continuation: Events,
    cont_usage: Value,
    blocks: Blocks,
    /// Anthropic: the original's open text block goes on with the continuation's first.
    merged: bool,
    /// Anthropic: the original's open block, not merged, was closed by the splice.
    closed: bool,
    /// OpenAI: the continuation's first chunk was looked at for a role-only delta.
    role_seen: bool,
    /// Whitespace the prefill left out, which the continuation's text may repeat.
    skip: String,
    cont_complete: bool,
    cont_failed: bool,
}

impl Default for Splice {
    fn default() -> Self {
        Splice::new()
    }
}

impl Splice {
    pub(crate) fn new() -> Self {
        Splice {
            dialect: None,
            original: Events::new(),
            text: String::new(),
            open: None,
            next_index: 0,
            only_text: true,
            complete: false,
            id: None,
            usage: Value::Null,
            continuation: Events::new(),
            cont_usage: Value::Null,
            blocks: Blocks::Waiting,
            merged: false,
            closed: false,
            role_seen: false,
            skip: String::new(),
            cont_complete: false,
            cont_failed: false,
        }
    }

    /// Feeds bytes of the original stream; returns those to forward: its whole events.
    pub(crate) fn original(&mut self, chunk: &[u8]) -> Bytes {
        let mut original = std::mem::take(&mut self.original);
        let out = original.push(chunk, |event| self.observe(event));
        self.original = original;
        out
    }

    /// The original's bytes of an event it did not finish (forwarded when not resuming, so
    /// the caller gets every byte as before).
    pub(crate) fn original_rest(&mut self) -> Bytes {
        self.original.rest()
    }

    /// The text the caller has received.
    #[cfg(test)]
    pub(crate) fn partial(&self) -> &str {
        &self.text
    }

    /// Whether the stream can be resumed: a known dialect, text output and only text, not
    /// finished.
    pub(crate) fn resumable(&self) -> bool {
        self.dialect.is_some() && self.only_text && !self.complete && !self.text.is_empty()
    }

    /// Whether the original stream reached its end.
    #[cfg(test)]
    pub(crate) fn complete(&self) -> bool {
        self.complete
    }

    fn observe(&mut self, raw: &[u8]) {
        let event = parse_block(raw);
        if event.data.is_empty() {
            return;
        }
        let name = event.event.as_deref();
        if name.is_none() && event.data.trim() == "[DONE]" {
            self.complete = true;
            return;
        }
        let Ok(Value::Object(data)) = serde_json::from_str::<Value>(&event.data) else {
            return;
        };
        let kind = data.get("type").and_then(Value::as_str);
        if self.dialect.is_none() {
            self.dialect = if data.contains_key("choices") {
                Some(Dialect::OpenAiChat)
            } else if kind.is_some_and(|k| k.starts_with("message_") || k == "ping") {
                Some(Dialect::Anthropic)
            } else {
                None
            };
        }
        if kind == Some("error") || data.contains_key("error") {
            self.complete = true;
            return;
        }
        match self.dialect {
            Some(Dialect::Anthropic) => self.observe_anthropic(kind, &data),
            Some(Dialect::OpenAiChat) => self.observe_chat(&data),
            None => {}
        }
    }

    fn observe_anthropic(&mut self, kind: Option<&str>, data: &Map<String, Value>) {
        let index = data.get("index").and_then(Value::as_u64);
        match kind {
            Some("message_start") => {
                let message = data.get("message");
                self.id = message
                    .and_then(|m| m.get("id"))
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                if let Some(u) = message.and_then(|m| m.get("usage")) {
                    overlay(&mut self.usage, u);
                }
            }
            Some("content_block_start") => {
                let block = data
                    .get("content_block")
                    .and_then(|b| b.get("type"))
                    .and_then(Value::as_str);
                let text = block == Some("text");
                if !text || block.is_some_and(|b| TOOL_BLOCKS.contains(&b)) {
                    self.only_text = false;
                }
                if let Some(index) = index {
                    self.open = Some(Open { index, text });
                    self.next_index = self.next_index.max(index + 1);
                }
                if let Some(t) = data
                    .get("content_block")
                    .and_then(|b| b.get("text"))
                    .and_then(Value::as_str)
                {
                    self.text.push_str(t);
                }
            }
            Some("content_block_delta") => {
                let delta = data.get("delta");
                match delta.and_then(|d| d.get("type")).and_then(Value::as_str) {
                    Some("text_delta") => {
                        if let Some(t) = delta.and_then(|d| d.get("text")).and_then(Value::as_str) {
                            self.text.push_str(t);
                        }
                    }
                    _ => self.only_text = false,
                }
            }
            Some("content_block_stop") => self.open = None,
            Some("message_delta") => {
                if let Some(u) = data.get("usage") {
                    overlay(&mut self.usage, u);
                }
                let stop = data.get("delta").and_then(|d| d.get("stop_reason"));
                if stop.is_some_and(|s| !s.is_null()) {
                    self.complete = true;
                }
            }
            Some("message_stop") => self.complete = true,
            _ => {}
        }
    }

    fn observe_chat(&mut self, data: &Map<String, Value>) {
        if self.id.is_none() {
            self.id = data.get("id").and_then(Value::as_str).map(str::to_owned);
        }
        if let Some(u) = data.get("usage").filter(|u| !u.is_null()) {
            self.usage = u.clone();
        }
        let Some(choices) = data.get("choices").and_then(Value::as_array) else {
            return;
        };
        for choice in choices {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                self.only_text = false;
            }
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
                self.complete = true;
            }
            let Some(delta) = choice.get("delta") else {
                continue;
            };
            let present = |k: &str| delta.get(k).is_some_and(|v| !v.is_null());
            if present("tool_calls") || present("function_call") || present("refusal") {
                self.only_text = false;
            }
            if let Some(t) = delta.get("content").and_then(Value::as_str) {
                self.text.push_str(t);
            }
        }
    }

    /// The follow-up request: `request` asking for the rest of the text. `with` is what the
    /// caller asked; a prefill is sent only in the Anthropic dialect (elsewhere, and when the
    /// text is all whitespace, it is an instruction). Returns the body and what it is; `None`
    /// when `request` is not a JSON object with a `messages` array.
    pub(crate) fn follow_up(
        &mut self,
        request: &[u8],
        with: ResumeWith,
        prompt: &str,
    ) -> Option<(Bytes, ResumeWith)> {
        self.skip.clear();
        if with == ResumeWith::Prefill && self.dialect == Some(Dialect::Anthropic) {
            // Anthropic refuses a final assistant turn that ends in whitespace: it is left out
            // of the prefill, and dropped from the start of the continuation if it comes back.
            let prefill = self.text.trim_end();
            if !prefill.is_empty() {
                let body = append_prefill(request, prefill)?;
                self.skip = self.text[prefill.len()..].to_owned();
                return Some((body, ResumeWith::Prefill));
            }
        }
        let body = append_turns(request, &self.text, prompt)?;
        Some((body, ResumeWith::Instruction))
    }

    /// Feeds bytes of the continuation's stream; returns the events to forward, rewritten.
    pub(crate) fn continuation(&mut self, chunk: &[u8]) -> Bytes {
        let mut events = std::mem::take(&mut self.continuation);
        let mut out = Vec::new();
        events.push(chunk, |raw| {
            if !self.cont_failed {
                self.rewrite(raw, &mut out);
            }
        });
        self.continuation = events;
        Bytes::from(out)
    }

    /// Whether the continuation reached its protocol's end.
    pub(crate) fn continuation_complete(&self) -> bool {
        self.cont_complete
    }

    /// Whether the continuation sent an error event (not forwarded: the caller gets the
    /// original's error instead).
    pub(crate) fn continuation_failed(&self) -> bool {
        self.cont_failed
    }

    fn rewrite(&mut self, raw: &[u8], out: &mut Vec<u8>) {
        let event = parse_block(raw);
        if event.data.is_empty() {
            // Comments and keep-alives carry nothing of the answer.
            return;
        }
        let name = event.event.as_deref().map(str::to_owned);
        if name.is_none() && event.data.trim() == "[DONE]" {
            self.cont_complete = true;
            out.extend_from_slice(raw);
            return;
        }
        let data = event.data.into_owned();
        let Ok(Value::Object(parsed)) = serde_json::from_str::<Value>(&data) else {
            out.extend_from_slice(raw);
            return;
        };
        if parsed.get("type").and_then(Value::as_str) == Some("error")
            || parsed.contains_key("error")
        {
            self.cont_failed = true;
            return;
        }
        match self.dialect {
            Some(Dialect::Anthropic) => self.rewrite_anthropic(name, data, &parsed, raw, out),
            Some(Dialect::OpenAiChat) => self.rewrite_chat(data, &parsed, raw, out),
            None => out.extend_from_slice(raw),
        }
    }

    fn rewrite_anthropic(
        &mut self,
        name: Option<String>,
        data: String,
        parsed: &Map<String, Value>,
        raw: &[u8],
        out: &mut Vec<u8>,
    ) {
        let kind = parsed.get("type").and_then(Value::as_str).unwrap_or("");
        let name = name.unwrap_or_else(|| kind.to_owned());
        let index = parsed.get("index").and_then(Value::as_u64);
        match kind {
            "message_start" => {
                if let Some(u) = parsed.get("message").and_then(|m| m.get("usage")) {
                    overlay(&mut self.cont_usage, u);
                }
            }
            "ping" => {}
            "content_block_start" => {
                let block = parsed.get("content_block");
                let is_text =
                    block.and_then(|b| b.get("type")).and_then(Value::as_str) == Some("text");
                if self.blocks == Blocks::Waiting {
                    let open_text = self.open.filter(|o| o.text);
                    match open_text {
                        Some(open) if is_text => {
                            // The cut block goes on: its deltas carry on at its index.
                            self.merged = true;
                            self.blocks = Blocks::Mapped {
                                base: open.index.saturating_sub(index.unwrap_or(0)),
                            };
                            let text = block
                                .and_then(|b| b.get("text"))
                                .and_then(Value::as_str)
                                .unwrap_or("");
                            let text = self.skip_whitespace(text);
                            if !text.is_empty() {
                                let delta = serde_json::json!({
                                    "type": "content_block_delta",
                                    "index": open.index,
                                    "delta": {"type": "text_delta", "text": text},
                                });
                                write_event(out, Some("content_block_delta"), &delta.to_string());
                            }
                            return;
                        }
                        _ => {
                            self.close_open(out);
                            self.blocks = Blocks::Mapped {
                                base: self.next_index.saturating_sub(index.unwrap_or(0)),
                            };
                        }
                    }
                }
                if !is_text {
                    // Whitespace left out of a prefill comes back, if at all, as text.
                    self.skip.clear();
                }
                self.write_mapped(out, &name, &data, index);
            }
            "content_block_delta" => {
                let delta = parsed.get("delta");
                let text_delta =
                    delta.and_then(|d| d.get("type")).and_then(Value::as_str) == Some("text_delta");
                if text_delta && !self.skip.is_empty() {
                    let text = delta
                        .and_then(|d| d.get("text"))
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    let kept = self.skip_whitespace(text);
                    if kept.is_empty() {
                        return;
                    }
                    if kept.len() != text.len() {
                        let mut d = delta.cloned().unwrap_or(Value::Null);
                        d["text"] = Value::from(kept);
                        let Some(edited) = json_edit::replace_value(data.as_bytes(), "delta", &d)
                        else {
                            return;
                        };
                        let edited = String::from_utf8_lossy(&edited).into_owned();
                        self.write_mapped(out, &name, &edited, index);
                        return;
                    }
                }
                self.write_mapped(out, &name, &data, index);
            }
            "content_block_stop" => self.write_mapped(out, &name, &data, index),
            "message_delta" => {
                self.close_open(out);
                if let Some(u) = parsed.get("usage") {
                    overlay(&mut self.cont_usage, u);
                }
                // A stop reason ends the answer, `message_stop` or not.
                let stop = parsed.get("delta").and_then(|d| d.get("stop_reason"));
                if stop.is_some_and(|s| !s.is_null()) {
                    self.cont_complete = true;
                }
                let mut total = self.usage.clone();
                add_usage(&mut total, &self.cont_usage);
                let data = if total.is_object() {
                    json_edit::replace_value(data.as_bytes(), "usage", &total)
                        .map_or(data, |b| String::from_utf8_lossy(&b).into_owned())
                } else {
                    data
                };
                write_event(out, Some(&name), &data);
            }
            "message_stop" => {
                self.close_open(out);
                self.cont_complete = true;
                out.extend_from_slice(raw);
            }
            _ => out.extend_from_slice(raw),
        }
    }

    /// The caller's index of the continuation's block `index`.
    fn map(&self, index: Option<u64>) -> Option<u64> {
        match self.blocks {
            Blocks::Mapped { base } => index.map(|i| i + base),
            Blocks::Waiting => index,
        }
    }

    fn write_mapped(&self, out: &mut Vec<u8>, name: &str, data: &str, index: Option<u64>) {
        let mapped = self.map(index);
        let data = match mapped {
            Some(m) if Some(m) != index => json_edit::replace_value(data.as_bytes(), "index", &m)
                .map_or_else(
                    || data.to_owned(),
                    |b| String::from_utf8_lossy(&b).into_owned(),
                ),
            _ => data.to_owned(),
        };
        write_event(out, Some(name), &data);
    }

    /// Closes the original's open block when the continuation does not go on with it.
    fn close_open(&mut self, out: &mut Vec<u8>) {
        if self.merged || self.closed {
            return;
        }
        self.closed = true;
        if let Some(open) = self.open {
            let stop = serde_json::json!({"type": "content_block_stop", "index": open.index});
            write_event(out, Some("content_block_stop"), &stop.to_string());
        }
    }

    /// `text` less the whitespace the prefill left out, as far as it repeats it.
    fn skip_whitespace<'t>(&mut self, text: &'t str) -> &'t str {
        let mut kept = text;
        while let Some(c) = kept.chars().next() {
            if self.skip.starts_with(c) {
                self.skip.drain(..c.len_utf8());
                kept = &kept[c.len_utf8()..];
            } else {
                // Something else came: no more of the continuation is dropped.
                self.skip.clear();
                break;
            }
        }
        kept
    }

    fn rewrite_chat(
        &mut self,
        data: String,
        parsed: &Map<String, Value>,
        raw: &[u8],
        out: &mut Vec<u8>,
    ) {
        let choices = parsed.get("choices").and_then(Value::as_array);
        if choices.is_some_and(|c| {
            c.iter()
                .any(|ch| ch.get("finish_reason").is_some_and(|f| !f.is_null()))
        }) {
            self.cont_complete = true;
        }
        if !std::mem::replace(&mut self.role_seen, true) {
            // The continuation's opening chunk says the role again: the caller has had it.
            let role_only = choices.is_some_and(|c| {
                !c.is_empty()
                    && c.iter().all(|ch| {
                        let Some(d) = ch.get("delta").and_then(Value::as_object) else {
                            return false;
                        };
                        d.contains_key("role")
                            && d.iter()
                                .all(|(k, v)| k == "role" || v.is_null() || v.as_str() == Some(""))
                            && ch.get("finish_reason").is_none_or(Value::is_null)
                    })
            });
            if role_only && parsed.get("usage").is_none_or(Value::is_null) {
                return;
            }
        }
        let mut edited = Bytes::from(data.into_bytes());
        let mut changed = false;
        if let Some(id) = &self.id {
            if parsed.get("id").and_then(Value::as_str) != Some(id) {
                if let Some(b) = json_edit::replace_value(&edited, "id", id) {
                    (edited, changed) = (b, true);
                }
            }
        }
        if let Some(u) = parsed.get("usage").filter(|u| !u.is_null()) {
            if !self.usage.is_null() {
                let mut total = self.usage.clone();
                add_usage(&mut total, u);
                if let Some(b) = json_edit::replace_value(&edited, "usage", &total) {
                    (edited, changed) = (b, true);
                }
            }
        }
        if changed {
            write_event(out, None, &String::from_utf8_lossy(&edited));
        } else {
            out.extend_from_slice(raw);
        }
    }
}

/// `next`'s fields over `acc`'s (a later report of the same message's usage, whose counts are
/// running totals); a null does not erase a count.
fn overlay(acc: &mut Value, next: &Value) {
    let Value::Object(next) = next else {
        return;
    };
    if !acc.is_object() {
        *acc = Value::Object(Map::new());
    }
    if let Value::Object(acc) = acc {
        for (k, v) in next {
            if !v.is_null() {
                acc.insert(k.clone(), v.clone());
            }
        }
    }
}

fn write_event(out: &mut Vec<u8>, name: Option<&str>, data: &str) {
    if let Some(name) = name {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    for line in data.split('\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
}

#[cfg(test)]
mod tests;
