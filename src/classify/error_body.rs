//! Recognising provider error bodies (Anthropic and OpenAI shapes).

use serde::Deserialize;

/// What a provider's JSON error body says, as far as retries care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodySignal {
    /// `overloaded_error`.
    Overloaded,
    /// `insufficient_quota`, `enforced_spend_limit_reached` and similar: waiting will not help.
    QuotaExhausted,
    /// A context-window overflow (`max_tokens` too large, or the prompt itself too long).
    ContextOverflow,
    /// Nothing this crate acts on.
    Other,
}

const QUOTA_CODES: &[&str] = &[
    "insufficient_quota",
    "enforced_spend_limit_reached",
    "billing_hard_limit_reached",
    "billing_not_active",
];

const OVERFLOW_PATTERNS: &[&str] = &[
    "exceed context limit",
    "prompt is too long",
    "context_length_exceeded",
    "maximum context length",
];

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    error: Option<ErrorObject<'a>>,
}

#[derive(Deserialize)]
struct ErrorObject<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    code: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    message: Option<std::borrow::Cow<'a, str>>,
}

/// Reads the error signal out of a (possibly truncated) JSON error body.
///
/// A body that parses is judged by its `error.type`, `error.code` and `error.message`; one that
/// does not (cut short at the peek limit, or not JSON) falls back to looking for the quoted
/// error codes, which no prose message contains by accident.
pub(crate) fn body_signal(body: &[u8]) -> BodySignal {
    if body.is_empty() {
        return BodySignal::Other;
    }
    if let Ok(Envelope { error: Some(e) }) = serde_json::from_slice::<Envelope<'_>>(body) {
        let kind = e.kind.as_deref().unwrap_or("");
        let code = e.code.as_deref().unwrap_or("");
        if kind == "overloaded_error" || code == "overloaded_error" {
            return BodySignal::Overloaded;
        }
        if QUOTA_CODES.iter().any(|q| kind == *q || code == *q) {
            return BodySignal::QuotaExhausted;
        }
        if code == "context_length_exceeded" {
            return BodySignal::ContextOverflow;
        }
        if let Some(msg) = e.message.as_deref() {
            if OVERFLOW_PATTERNS.iter().any(|p| msg.contains(p)) {
                return BodySignal::ContextOverflow;
            }
        }
        return BodySignal::Other;
    }
    let contains = |needle: &str| {
        body.windows(needle.len() + 2).any(|w| {
            w[0] == b'"' && w[w.len() - 1] == b'"' && &w[1..w.len() - 1] == needle.as_bytes()
        })
    };
    if contains("overloaded_error") {
        BodySignal::Overloaded
    } else if QUOTA_CODES.iter().any(|q| contains(q)) {
        BodySignal::QuotaExhausted
    } else if contains("context_length_exceeded") {
        BodySignal::ContextOverflow
    } else {
        BodySignal::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_shapes() {
        let b = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        assert_eq!(body_signal(b), BodySignal::Overloaded);
        let b = br#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 197000 + 21333 > 200000, decrease input length or `max_tokens` and try again"}}"#;
        assert_eq!(body_signal(b), BodySignal::ContextOverflow);
        let b = br#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#;
        assert_eq!(body_signal(b), BodySignal::ContextOverflow);
        let b = br#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#;
        assert_eq!(body_signal(b), BodySignal::Other);
    }

    #[test]
    fn openai_shapes() {
        let b = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        assert_eq!(body_signal(b), BodySignal::QuotaExhausted);
        let b = br#"{"error":{"message":"limit","type":"invalid_request_error","code":"enforced_spend_limit_reached"}}"#;
        assert_eq!(body_signal(b), BodySignal::QuotaExhausted);
        let b = br#"{"error":{"message":"This model's maximum context length is 8192 tokens","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        assert_eq!(body_signal(b), BodySignal::ContextOverflow);
        let b = br#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;
        assert_eq!(body_signal(b), BodySignal::Other);
    }

    #[test]
    fn truncated_and_garbage() {
        let b = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overl"#;
        assert_eq!(body_signal(b), BodySignal::Overloaded);
        assert_eq!(
            body_signal(b"<html>502 Bad Gateway</html>"),
            BodySignal::Other
        );
        assert_eq!(body_signal(b""), BodySignal::Other);
        // Mentioned in prose, not as a code: no signal.
        assert_eq!(
            body_signal(b"not json: overloaded_error happened"),
            BodySignal::Other
        );
    }
}
