//! Recognising provider error bodies (Anthropic and OpenAI shapes, and the cloud dialects
//! [`cloud`](super::cloud) reads).

use std::time::Duration;

use serde::Deserialize;

pub(crate) use super::signal::{says_overflow, BodySignal};

const QUOTA_CODES: &[&str] = &[
    "insufficient_quota",
    "enforced_spend_limit_reached",
    "billing_hard_limit_reached",
    "billing_not_active",
];

/// OpenAI's codes for an overloaded server (in the `code` or the `type` of the error).
const SERVER_OVERLOADED_CODES: &[&str] = &["overloaded", "server_is_overloaded"];

/// OpenAI's message for an overloaded server ("The server is overloaded or not ready yet."),
/// but its full stop: a message that starts with it, in any ASCII case, says so. A shorter
/// "The server is overloaded" is not read as it: other servers say that of any 503.
const SERVER_OVERLOADED_MESSAGE: &str = "the server is overloaded or not ready yet";

/// Whether an error's `type`, `code` and `message` say OpenAI's server is overloaded. The
/// message is compared on its start only, so a long message costs nothing.
pub(crate) fn says_server_overloaded(kind: &str, code: &str, message: Option<&str>) -> bool {
    SERVER_OVERLOADED_CODES
        .iter()
        .any(|c| kind == *c || code == *c)
        || message.is_some_and(|m| {
            m.trim_start()
                .as_bytes()
                .get(..SERVER_OVERLOADED_MESSAGE.len())
                .is_some_and(|start| {
                    start.eq_ignore_ascii_case(SERVER_OVERLOADED_MESSAGE.as_bytes())
                })
        })
}

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

/// What an error body says, parsed once: by the default classifier, which hands the numbers
/// of a context overflow on to the companion layers in its [`Classification`].
///
/// [`Classification`]: crate::classify::Classification
#[derive(Debug, Clone, Copy)]
pub(crate) struct ErrorBody {
    pub(crate) signal: BodySignal,
    pub(crate) overflow: Option<Overflow>,
    /// The wait the body asks for: Google's `RetryInfo.retryDelay`.
    pub(crate) retry_after: Option<Duration>,
}

impl ErrorBody {
    /// Reads a (possibly truncated) JSON error body.
    ///
    /// A body that parses is judged by its `error.type`, `error.code` and `error.message`;
    /// one that does not (cut short at the peek limit, or not JSON) falls back to looking for
    /// the quoted error codes, which no prose message contains by accident.
    ///
    /// Google's envelope (`error.status`, a number as `error.code`) and Bedrock's
    /// (`__type` and a top-level `message`) are read by [`cloud`](super::cloud) first and
    /// last.
    pub(crate) fn parse(bytes: &[u8]) -> Self {
        let (signal, message, retry_after) = match super::cloud::google(bytes) {
            Some(g) => (g.signal, g.message, g.retry_after),
            None => {
                let (signal, message) = read(bytes);
                match (signal, &message) {
                    (BodySignal::Other, None) => match super::cloud::aws_body(bytes) {
                        Some((aws, message)) => {
                            let signal = match aws {
                                Some(signal) => signal,
                                None if message.as_deref().is_some_and(says_overflow) => {
                                    BodySignal::ContextOverflow
                                }
                                None => BodySignal::Other,
                            };
                            (signal, message, None)
                        }
                        None => (signal, message, None),
                    },
                    _ => (signal, message, None),
                }
            }
        };
        let overflow = match signal {
            BodySignal::ContextOverflow => Some(overflow_of(message.as_deref().unwrap_or(""))),
            _ => None,
        };
        ErrorBody {
            signal,
            overflow,
            retry_after,
        }
    }
}

/// The token limit a `429`'s error body names in its message, if any (see
/// [`token_limit_named`](super::ratelimit::token_limit_named)); a body that does not parse is
/// read as text.
pub(crate) fn token_limit_of(body: &[u8]) -> Option<super::ratelimit::TokenKind> {
    match read(body) {
        (_, Some(message)) => super::ratelimit::token_limit_named(&message),
        (_, None) => super::ratelimit::token_limit_named(&String::from_utf8_lossy(
            &body[..body.len().min(4096)],
        )),
    }
}

/// The signal, and the message when the body parsed.
fn read(body: &[u8]) -> (BodySignal, Option<std::borrow::Cow<'_, str>>) {
    if body.is_empty() {
        return (BodySignal::Other, None);
    }
    if let Ok(Envelope { error: Some(e) }) = serde_json::from_slice::<Envelope<'_>>(body) {
        let kind = e.kind.as_deref().unwrap_or("");
        let code = e.code.as_deref().unwrap_or("");
        let signal = if kind == "overloaded_error" || code == "overloaded_error" {
            BodySignal::Overloaded
        } else if QUOTA_CODES.iter().any(|q| kind == *q || code == *q) {
            BodySignal::QuotaExhausted
        } else if says_server_overloaded(kind, code, e.message.as_deref()) {
            BodySignal::ServerOverloaded
        } else if code == "context_length_exceeded"
            || e.message.as_deref().is_some_and(says_overflow)
        {
            BodySignal::ContextOverflow
        } else {
            BodySignal::Other
        };
        return (signal, e.message);
    }
    let contains = |needle: &str| {
        body.windows(needle.len() + 2).any(|w| {
            w[0] == b'"' && w[w.len() - 1] == b'"' && &w[1..w.len() - 1] == needle.as_bytes()
        })
    };
    let signal = if contains("overloaded_error") {
        BodySignal::Overloaded
    } else if QUOTA_CODES.iter().any(|q| contains(q)) {
        BodySignal::QuotaExhausted
    } else if SERVER_OVERLOADED_CODES.iter().any(|c| contains(c)) {
        BodySignal::ServerOverloaded
    } else if contains("context_length_exceeded") {
        BodySignal::ContextOverflow
    } else {
        BodySignal::Other
    };
    (signal, None)
}

/// What a context-overflow error message says, with its numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overflow {
    /// Anthropic's `input length and `max_tokens` exceed context limit: A + B > C`: the prompt
    /// fits, the room asked for the answer does not, so a smaller `max_tokens` repairs it.
    MaxTokens {
        input: u64,
        max_tokens: u64,
        limit: u64,
    },
    /// The prompt alone does not fit (Anthropic's `prompt is too long: X tokens > Y maximum`,
    /// OpenAI's `context_length_exceeded`): only a shorter prompt or a larger window helps.
    Prompt {
        input: Option<u64>,
        limit: Option<u64>,
    },
}

/// Reads a context-overflow error body, Anthropic's or OpenAI's; `None` for anything else.
pub(crate) fn context_overflow(body: &[u8]) -> Option<Overflow> {
    ErrorBody::parse(body).overflow
}

/// The numbers of a context-overflow message.
fn overflow_of(message: &str) -> Overflow {
    if let Some(rest) = after(message, "exceed context limit:") {
        let mut p = Numbers(rest);
        if let (Some(input), Some(()), Some(max_tokens), Some(()), Some(limit)) = (
            p.number(),
            p.symbol('+'),
            p.number(),
            p.symbol('>'),
            p.number(),
        ) {
            return Overflow::MaxTokens {
                input,
                max_tokens,
                limit,
            };
        }
    }
    if let Some(rest) = after(message, "prompt is too long:") {
        let mut p = Numbers(rest);
        let input = p.number();
        let limit = p
            .word("tokens")
            .and_then(|()| p.symbol('>'))
            .and_then(|()| p.number());
        return Overflow::Prompt { input, limit };
    }
    // Google: "The input token count (1200000) exceeds the maximum number of tokens allowed
    // (1048576)."
    if let Some(rest) = after(message, "input token count (") {
        let input = Numbers(rest).number();
        let limit = after(message, "tokens allowed (").and_then(|r| Numbers(r).number());
        return Overflow::Prompt { input, limit };
    }
    // OpenAI: "This model's maximum context length is 8192 tokens. However, your messages
    // resulted in 9000 tokens." or "... you requested 9000 tokens (8000 in the messages, ...".
    let limit = after(message, "maximum context length is").and_then(|r| Numbers(r).number());
    let input = after(message, "resulted in")
        .or_else(|| after(message, "tokens ("))
        .and_then(|r| Numbers(r).number());
    Overflow::Prompt { input, limit }
}

fn after<'a>(haystack: &'a str, marker: &str) -> Option<&'a str> {
    haystack.find(marker).map(|i| &haystack[i + marker.len()..])
}

/// A tiny scanner for the numbers in an error message.
struct Numbers<'a>(&'a str);

impl Numbers<'_> {
    fn number(&mut self) -> Option<u64> {
        let s = self.0.trim_start();
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let n = s[..end].parse().ok()?;
        self.0 = &s[end..];
        Some(n)
    }

    fn symbol(&mut self, c: char) -> Option<()> {
        self.0 = self.0.trim_start().strip_prefix(c)?;
        Some(())
    }

    fn word(&mut self, w: &str) -> Option<()> {
        self.0 = self.0.trim_start().strip_prefix(w)?;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_signal(body: &[u8]) -> BodySignal {
        ErrorBody::parse(body).signal
    }

    #[test]
    fn overflow_numbers() {
        let b = br#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 197000 + 21333 > 200000, decrease input length or `max_tokens` and try again"}}"#;
        assert_eq!(
            context_overflow(b),
            Some(Overflow::MaxTokens {
                input: 197_000,
                max_tokens: 21_333,
                limit: 200_000
            })
        );
        let b = br#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#;
        assert_eq!(
            context_overflow(b),
            Some(Overflow::Prompt {
                input: Some(210_000),
                limit: Some(200_000)
            })
        );
        let b = br#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        assert_eq!(
            context_overflow(b),
            Some(Overflow::Prompt {
                input: Some(9000),
                limit: Some(8192)
            })
        );
        let b = br#"{"error":{"message":"This model's maximum context length is 128000 tokens. However, you requested 130000 tokens (129000 in the messages, 1000 in the completion).","type":"invalid_request_error","code":"context_length_exceeded"}}"#;
        assert_eq!(
            context_overflow(b),
            Some(Overflow::Prompt {
                input: Some(129_000),
                limit: Some(128_000)
            })
        );
        // Recognised, but the numbers are not where they should be.
        let b = br#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit"}}"#;
        assert_eq!(
            context_overflow(b),
            Some(Overflow::Prompt {
                input: None,
                limit: None
            })
        );
        let b = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        assert_eq!(context_overflow(b), None);
        assert_eq!(context_overflow(b"garbage"), None);
    }

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
    fn openai_overload() {
        let server = BodySignal::ServerOverloaded;
        // The message OpenAI sends with its 503, in any case, and with nothing else to go by.
        let b = br#"{"error":{"message":"The server is overloaded or not ready yet.","type":"server_error","param":null,"code":null}}"#;
        assert_eq!(body_signal(b), server);
        let b = br#"{"error":{"message":"  THE SERVER IS OVERLOADED or not ready yet.","type":"server_error"}}"#;
        assert_eq!(body_signal(b), server);
        // Its codes, in `code` or in `type`.
        let b =
            br#"{"error":{"message":"Busy","type":"server_error","code":"server_is_overloaded"}}"#;
        assert_eq!(body_signal(b), server);
        let b = br#"{"error":{"message":"Busy","type":"overloaded","code":null}}"#;
        assert_eq!(body_signal(b), server);
        // Cut at the peek limit: the quoted code still says it.
        let b = br#"{"error":{"code":"server_is_overloaded","message":"The serv"#;
        assert_eq!(body_signal(b), server);
        // Not an overload: another message, the words elsewhere than at the start, a prefix
        // of the message, a code that merely contains the word.
        for b in [
            &br#"{"error":{"message":"The server had an error while processing your request.","type":"server_error"}}"#[..],
            br#"{"error":{"message":"Sorry: the server is overloaded","type":"server_error"}}"#,
            br#"{"error":{"message":"The server is over","type":"server_error"}}"#,
            br#"{"error":{"message":"The server is overloaded","type":"server_error"}}"#,
            br#"{"error":{"message":"x","type":"server_error","code":"not_overloaded"}}"#,
            b"the server is overloaded or not ready yet",
        ] {
            assert_eq!(body_signal(b), BodySignal::Other, "{}", String::from_utf8_lossy(b));
        }
        // Anthropic's overload is still its own signal.
        let b = br#"{"type":"error","error":{"type":"overloaded_error","message":"The server is overloaded"}}"#;
        assert_eq!(body_signal(b), BodySignal::Overloaded);
    }

    #[test]
    fn cloud_shapes() {
        // Bedrock: a throttle named in the body, "Too many tokens" included: never an overflow.
        let b = br#"{"__type":"ThrottlingException","message":"Too many tokens, please wait before trying again."}"#;
        assert_eq!(body_signal(b), BodySignal::Throttled);
        assert_eq!(context_overflow(b), None);
        // Bedrock's message alone says nothing of a throttle (the header does).
        let b = br#"{"message":"Too many tokens, please wait before trying again."}"#;
        assert_eq!(body_signal(b), BodySignal::Other);
        let b = br#"{"message":"Model is not ready for inference.","__type":"com.amazon.coral.service#ModelNotReadyException"}"#;
        assert_eq!(body_signal(b), BodySignal::Overloaded);
        let b = br#"{"message":"Input is too long for requested model."}"#;
        assert_eq!(body_signal(b), BodySignal::ContextOverflow);
        assert_eq!(
            context_overflow(b),
            Some(Overflow::Prompt {
                input: None,
                limit: None
            })
        );
        let b = br#"{"message":"Malformed input request","__type":"ValidationException"}"#;
        assert_eq!(body_signal(b), BodySignal::Other);
        // Google: a prompt too long (as on a 413), with its numbers; a RetryInfo wait.
        let b = br#"{"error":{"code":413,"message":"The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}"#;
        assert_eq!(body_signal(b), BodySignal::ContextOverflow);
        assert_eq!(
            context_overflow(b),
            Some(Overflow::Prompt {
                input: Some(1_200_000),
                limit: Some(1_048_576)
            })
        );
        let b = br#"[{"error":{"code":429,"message":"Resource exhausted.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"17s"}]}}]"#;
        let parsed = ErrorBody::parse(b);
        assert_eq!(parsed.signal, BodySignal::Throttled);
        assert_eq!(parsed.retry_after, Some(Duration::from_secs(17)));
        // The Anthropic and OpenAI shapes carry no body wait.
        let b = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        assert_eq!(ErrorBody::parse(b).retry_after, None);
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
