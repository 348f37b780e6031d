//! What an error says, as far as retries care, in the words both the first-party shapes
//! ([`error_body`](super::error_body)) and the cloud dialects ([`cloud`](super::cloud)) read
//! into: one vocabulary, so neither reader depends on the other's.

/// What a provider's JSON error body says, as far as retries care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodySignal {
    /// `overloaded_error`.
    Overloaded,
    /// OpenAI's overload: a `code` or `type` of `overloaded` or `server_is_overloaded`, or the
    /// message "The server is overloaded or not ready yet.". An overload only on a `5xx`
    /// (where OpenAI sends it); on other statuses it is nothing this crate acts on.
    ServerOverloaded,
    /// `insufficient_quota`, `enforced_spend_limit_reached` and similar: waiting will not help.
    QuotaExhausted,
    /// A context-window overflow (`max_tokens` too large, or the prompt itself too long).
    ContextOverflow,
    /// A throttle whatever the status: Bedrock's `ThrottlingException` (also "Too many
    /// tokens", which is a rate, not a context overflow), Google's `RESOURCE_EXHAUSTED` on a
    /// quota that is not daily or billing. A rate limit, retried.
    Throttled,
    /// Nothing this crate acts on.
    Other,
}

const OVERFLOW_PATTERNS: &[&str] = &[
    "exceed context limit",
    "prompt is too long",
    "context_length_exceeded",
    "maximum context length",
    // Google (Gemini API, Vertex AI): "The input token count (1200000) exceeds the maximum
    // number of tokens allowed (1048576)."
    "exceeds the maximum number of tokens allowed",
    // Bedrock's `ValidationException`.
    "Input is too long for requested model",
];

/// Whether an error message names a context overflow.
pub(crate) fn says_overflow(message: &str) -> bool {
    OVERFLOW_PATTERNS.iter().any(|p| message.contains(p))
}
