//! A request's cost in tokens, before it is sent and as its answer reports it: the input
//! estimated from the buffered body (or a caller's own count), the output reserved from the
//! tokens it asks for, and the usage read from a JSON answer or a stream's events. What the
//! token pacing (`tokens.rs`) books and settles; no state of its own.

use std::sync::Arc;

use crate::provider::ratelimit::TokenKind;

/// A caller's own count of a request's input tokens: given the request's buffered body, the
/// tokens, or `None` to fall back to the built-in estimate.
pub type InputCounter = Arc<dyn Fn(&[u8]) -> Option<u64> + Send + Sync>;

/// Bytes of prompt per token in the built-in estimate.
const BYTES_PER_TOKEN: u64 = 4;

/// What an embedded file or image (a base64 `"data"` string) is counted as, whatever its
/// length: base64 bytes are not text, and a picture costs the providers about this much
/// (Anthropic: `width × height / 750`, at most about 1,600 tokens).
const TOKENS_PER_ATTACHMENT: u64 = 1_600;

/// What one request costs in tokens: the input, estimated from its body before it is sent
/// (then what the answer reports), and the output it may produce.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cost {
    pub(crate) input: u64,
    pub(crate) output: u64,
    /// Taken from the buckets shared through the store, not this process's.
    pub(crate) shared: bool,
}

impl Cost {
    /// What it takes from the bucket of `kind`.
    pub(crate) fn of(&self, kind: TokenKind) -> u64 {
        match kind {
            TokenKind::Input => self.input,
            TokenKind::Output => self.output,
            TokenKind::Combined => self.input.saturating_add(self.output),
        }
    }

    /// The cost of a request with buffered body `body`: its input counted by `counter`, or
    /// estimated; its output, the `max_tokens` (or `max_completion_tokens`,
    /// `max_output_tokens`) it asks for.
    pub(crate) fn of_request(body: &[u8], counter: Option<&InputCounter>) -> Cost {
        let input = counter
            .and_then(|c| c(body))
            .unwrap_or_else(|| estimate_input(body));
        let output = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
            .iter()
            .find_map(|k| crate::json_edit::read_value::<u64>(body, k))
            .unwrap_or(0);
        Cost {
            input,
            output,
            shared: false,
        }
    }
}

/// The built-in estimate of a request's input tokens: a quarter of its body's bytes, the
/// base64 `"data"` strings (images, documents) counted as [`TOKENS_PER_ATTACHMENT`] each
/// instead. Four bytes a token is the providers' own rule of thumb for English text; the
/// JSON around the messages (keys, quotes, escapes) makes it an over-estimate, the safe
/// side, which the usage the answer reports gives back. One pass over the bytes, no parse.
pub(crate) fn estimate_input(body: &[u8]) -> u64 {
    const KEY: &[u8] = b"\"data\":\"";
    let mut text = body.len() as u64;
    let mut attachments = 0u64;
    let mut i = 0;
    while let Some(at) = find(&body[i..], KEY) {
        let start = i + at + KEY.len();
        // The string ends at the next quote that is not escaped; base64 has none inside.
        let len = body[start..]
            .iter()
            .position(|&b| b == b'"')
            .unwrap_or(body.len() - start);
        // A short string is text, not an attachment.
        if len >= 1024 {
            text -= len as u64;
            attachments += 1;
        }
        i = start + len;
    }
    (text / BYTES_PER_TOKEN).saturating_add(attachments.saturating_mul(TOKENS_PER_ATTACHMENT))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The usage an answer reports, as far as it was read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub(crate) input: Option<u64>,
    pub(crate) output: Option<u64>,
}

impl Usage {
    /// What was used of `charged`: the usage reported, the charge where it reported none.
    pub(crate) fn cost(&self, charged: Cost) -> Cost {
        Cost {
            input: self.input.unwrap_or(charged.input),
            output: self.output.unwrap_or(charged.output),
            shared: charged.shared,
        }
    }
}

/// The longest `usage` object read.
const MAX_USAGE_OBJECT: usize = 1024;

/// Reads every `"usage"` object in `bytes` (a JSON answer, or events of a stream): the input
/// is the largest `input_tokens` (plus `cache_creation_input_tokens`, which Anthropic counts
/// against the limit) or `prompt_tokens` seen; the output, the last `output_tokens` or
/// `completion_tokens` seen (a stream reports it growing, its last event the total). A
/// usage cut off, or malformed, is skipped.
pub(crate) fn read_usage(bytes: &[u8], into: &mut Usage) {
    #[derive(serde::Deserialize)]
    struct Raw {
        input_tokens: Option<u64>,
        cache_creation_input_tokens: Option<u64>,
        prompt_tokens: Option<u64>,
        output_tokens: Option<u64>,
        completion_tokens: Option<u64>,
    }
    const KEY: &[u8] = b"\"usage\"";
    let mut i = 0;
    while let Some(at) = find(&bytes[i..], KEY) {
        let after = i + at + KEY.len();
        i = after;
        let rest = &bytes[after..];
        let Some(open) = rest.iter().position(|b| !matches!(b, b' ' | b':' | b'\n')) else {
            break;
        };
        if rest[open] != b'{' {
            continue;
        }
        let Some(len) = object_len(&rest[open..]) else {
            continue;
        };
        let Ok(raw) = serde_json::from_slice::<Raw>(&rest[open..open + len]) else {
            continue;
        };
        let input = match (raw.input_tokens, raw.prompt_tokens) {
            (Some(n), _) => Some(n.saturating_add(raw.cache_creation_input_tokens.unwrap_or(0))),
            (None, p) => p,
        };
        if let Some(n) = input {
            into.input = Some(into.input.map_or(n, |m| m.max(n)));
        }
        if let Some(n) = raw.output_tokens.or(raw.completion_tokens) {
            into.output = Some(n);
        }
        i = after + open + len;
    }
}

/// The length of the JSON object at the start of `bytes`, when it closes within
/// [`MAX_USAGE_OBJECT`] bytes.
fn object_len(bytes: &[u8]) -> Option<usize> {
    let mut depth = 0u32;
    let mut in_string = false;
    let mut escaped = false;
    for (i, &b) in bytes.iter().take(MAX_USAGE_OBJECT).enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' => depth += 1,
            b'}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_counts_text_and_not_base64() {
        let text = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "a".repeat(4000)
        );
        let n = estimate_input(text.as_bytes());
        assert_eq!(n, text.len() as u64 / 4);
        let image = format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","data":"{}"}}}},{{"type":"text","text":"hi"}}]}}]}}"#,
            "QUJD".repeat(50_000)
        );
        let n = estimate_input(image.as_bytes());
        let rest = image.len() as u64 - 200_000;
        assert_eq!(n, rest / 4 + TOKENS_PER_ATTACHMENT);
        // A short "data" string is text; an unterminated one ends the body.
        assert_eq!(estimate_input(br#"{"data":"abc"}"#), 3);
        let cut = format!(r#"{{"data":"{}"#, "A".repeat(2000));
        assert_eq!(
            estimate_input(cut.as_bytes()),
            9 / 4 + TOKENS_PER_ATTACHMENT
        );
        assert_eq!(estimate_input(b""), 0);
    }

    #[test]
    fn the_output_reserved_is_max_tokens() {
        let body = br#"{"model":"m","max_tokens":1024,"messages":[]}"#;
        let c = Cost::of_request(body, None);
        assert_eq!(c.output, 1024);
        let body = br#"{"model":"m","max_completion_tokens":300,"messages":[]}"#;
        assert_eq!(Cost::of_request(body, None).output, 300);
        let body = br#"{"model":"m","max_tokens":-3}"#;
        assert_eq!(Cost::of_request(body, None).output, 0);
        let counter: InputCounter = Arc::new(|b: &[u8]| Some(b.len() as u64 * 10));
        let c = Cost::of_request(b"{}", Some(&counter));
        assert_eq!(
            c,
            Cost {
                input: 20,
                output: 0,
                shared: false
            }
        );
    }

    #[test]
    fn usage_is_read_from_json_and_streams() {
        let mut u = Usage::default();
        read_usage(
            br#"{"id":"msg","content":[{"type":"text","text":"\"usage\": {"}],"usage":{"input_tokens":12,"cache_creation_input_tokens":3,"cache_read_input_tokens":100,"output_tokens":7}}"#,
            &mut u,
        );
        assert_eq!(
            u,
            Usage {
                input: Some(15),
                output: Some(7)
            }
        );
        let mut u = Usage::default();
        read_usage(
            br#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":9,"total_tokens":49,"prompt_tokens_details":{"cached_tokens":0}}}"#,
            &mut u,
        );
        assert_eq!(
            u,
            Usage {
                input: Some(40),
                output: Some(9)
            }
        );
        // A stream: the first event's input, the last event's output.
        let mut u = Usage::default();
        read_usage(
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n",
            &mut u,
        );
        read_usage(
            b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n",
            &mut u,
        );
        assert_eq!(
            u,
            Usage {
                input: Some(25),
                output: Some(15)
            }
        );
        // Cut off, malformed, or hostile: skipped.
        let mut u = Usage::default();
        read_usage(br#"{"usage":{"input_tokens":5"#, &mut u);
        read_usage(br#"{"usage":{"input_tokens":-5}}"#, &mut u);
        read_usage(br#"{"usage":"none","usage":[1]}"#, &mut u);
        read_usage(
            format!(r#"{{"usage":{}"#, "{".repeat(5000)).as_bytes(),
            &mut u,
        );
        read_usage(br#"{"usage":{"input_tokens":1e400}}"#, &mut u);
        assert_eq!(u, Usage::default());
    }
}
