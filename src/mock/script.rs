use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::StatusCode;
use serde_json::Value;
use tokio::time::Instant;

use super::json::{array, object, Null};
use super::server::RecordedRequest;

/// What the server does with each request it receives.
///
/// A script is a queue of [`Reply`] steps, consumed one per request in
/// arrival order, followed by a fallback reply used once the steps run out.
/// An optional [`Capacity`] limiter runs in front of the steps: a request it
/// rejects is answered with `429` and does not consume a step. Rules added with
/// [`Script::when`] run in front of both: they answer a request by what it
/// carries (a credential, a model) rather than by when it arrives.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_llm_retry::mock::{Capacity, Reply, Script};
///
/// // Two failures, then success for every request after that.
/// let script = Script::new()
///     .then(Reply::overloaded())
///     .then(Reply::rate_limited("1").delay(Duration::from_millis(50)))
///     .otherwise(Reply::success());
///
/// // At most 5 requests per second, with bursts of up to 2.
/// let limited = Script::new().capacity(Capacity::token_bucket(5.0, 2));
/// # drop((script, limited));
/// ```
#[derive(Clone, Debug)]
pub struct Script {
    pub(super) rules: Vec<Rule>,
    pub(super) steps: VecDeque<Reply>,
    pub(super) otherwise: Reply,
    pub(super) capacity: Option<Capacity>,
}

type RuleFn = dyn Fn(&RecordedRequest) -> Option<Reply> + Send + Sync;

/// A reply chosen by the content of the request.
#[derive(Clone)]
pub(super) struct Rule(Arc<RuleFn>);

impl Rule {
    pub(super) fn reply(&self, request: &RecordedRequest) -> Option<Reply> {
        (self.0)(request)
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Rule")
    }
}

impl Script {
    /// Creates an empty script: every request gets [`Reply::success`].
    pub fn new() -> Self {
        Self {
            rules: Vec::new(),
            steps: VecDeque::new(),
            otherwise: Reply::success(),
            capacity: None,
        }
    }

    /// Adds a rule that looks at each request first: when `rule` returns a
    /// reply, the request gets it, ahead of the capacity limiter and the
    /// steps, and consumes no step. Rules run in the order they were added.
    ///
    /// ```
    /// use tower_llm_retry::mock::{Reply, Script};
    ///
    /// // Requests for one model are overloaded; everything else follows the steps.
    /// let script = Script::new().when(|req| {
    ///     let model = req.json().ok()?.get("model")?.as_str()?.to_owned();
    ///     (model == "claude-opus-4-1").then(Reply::overloaded)
    /// });
    /// # drop(script);
    /// ```
    pub fn when(
        mut self,
        rule: impl Fn(&RecordedRequest) -> Option<Reply> + Send + Sync + 'static,
    ) -> Self {
        self.rules.push(Rule(Arc::new(rule)));
        self
    }

    /// Answers [`Reply::unauthorized`] to every request whose `header` is
    /// missing or holds none of the `accepted` values, as a provider does for
    /// an unknown or expired credential. A rule, as [`Script::when`] adds.
    ///
    /// ```
    /// use tower_llm_retry::mock::Script;
    ///
    /// let script = Script::new().require_header("x-api-key", ["sk-new"]);
    /// # drop(script);
    /// ```
    ///
    /// # Panics
    ///
    /// Panics if `header` is not a valid header name.
    pub fn require_header<I, V>(self, header: &str, accepted: I) -> Self
    where
        I: IntoIterator<Item = V>,
        V: Into<String>,
    {
        let name = HeaderName::from_bytes(header.as_bytes())
            .unwrap_or_else(|e| panic!("invalid header name {header:?}: {e}"));
        let accepted: Vec<String> = accepted.into_iter().map(Into::into).collect();
        self.when(move |req| {
            let ok = req
                .headers
                .get(&name)
                .is_some_and(|v| accepted.iter().any(|a| v.as_bytes() == a.as_bytes()));
            (!ok).then(Reply::unauthorized)
        })
    }

    /// Answers `400` to every request whose last message is an assistant
    /// message (a prefill), as models that accept no prefill do; a rule, as
    /// [`Script::when`] adds. The body is OpenAI's error shape (code
    /// `invalid_prefill`) on paths ending in `/chat/completions`, Anthropic's
    /// (`invalid_request_error`) on every other path.
    ///
    /// ```
    /// use tower_llm_retry::mock::Script;
    ///
    /// // Continuations must come as an instruction, never as a prefill.
    /// let script = Script::new().reject_prefill();
    /// # drop(script);
    /// ```
    pub fn reject_prefill(self) -> Self {
        self.when(|req| {
            let body = req.json().ok()?;
            let last = body.get("messages")?.as_array()?.last()?;
            (last.get("role")?.as_str()? == "assistant").then(|| {
                let message = "This model does not support assistant message prefill. \
                               The conversation must end with a user message.";
                if req.uri.path().ends_with("/chat/completions") {
                    let body = object! {
                        "error": object! {
                            "message": message,
                            "type": "invalid_request_error",
                            "param": "messages",
                            "code": "invalid_prefill",
                        },
                    };
                    Reply::status(400).json_text(body.into_string())
                } else {
                    Reply::anthropic_error(400, "invalid_request_error", message)
                }
            })
        })
    }

    /// Creates a script that answers every request with `reply`.
    pub fn always(reply: Reply) -> Self {
        Self::new().otherwise(reply)
    }

    /// Appends a step; steps are consumed one per request, in order.
    pub fn then(mut self, reply: Reply) -> Self {
        self.steps.push_back(reply);
        self
    }

    /// Sets the reply used once all steps have been consumed.
    ///
    /// Defaults to [`Reply::success`].
    pub fn otherwise(mut self, reply: Reply) -> Self {
        self.otherwise = reply;
        self
    }

    /// Puts a capacity limiter in front of the steps.
    ///
    /// Requests the limiter rejects are answered with `429` and do not
    /// consume a step.
    pub fn capacity(mut self, limiter: Capacity) -> Self {
        self.capacity = Some(limiter);
        self
    }
}

impl Default for Script {
    fn default() -> Self {
        Self::new()
    }
}

/// A capacity limiter that models a provider's rate limit.
///
/// Requests it rejects get `429 Too Many Requests` with a `retry-after`
/// header and an Anthropic `rate_limit_error` body.
#[derive(Clone, Debug)]
pub struct Capacity {
    rate_per_sec: f64,
    burst: u32,
    unit: Unit,
}

/// What a [`Capacity`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unit {
    Requests,
    InputTokens,
}

impl Capacity {
    /// A token bucket holding up to `burst` tokens, refilled at
    /// `rate_per_sec` tokens per second; each request takes one token.
    ///
    /// The bucket starts full. When it is empty the request is rejected with
    /// `retry-after` set to the whole number of seconds until the next token,
    /// rounded up and at least `1`. Refill follows [`tokio::time::Instant`],
    /// so it respects paused and advanced time in tests.
    ///
    /// # Panics
    ///
    /// Panics if `rate_per_sec` is not a finite positive number or `burst`
    /// is zero.
    pub fn token_bucket(rate_per_sec: f64, burst: u32) -> Capacity {
        assert!(
            rate_per_sec.is_finite() && rate_per_sec > 0.0,
            "token bucket rate must be a finite positive number, got {rate_per_sec}"
        );
        assert!(burst > 0, "token bucket burst must be at least 1");
        Capacity {
            rate_per_sec,
            burst,
            unit: Unit::Requests,
        }
    }

    /// An input-token limit as Anthropic describes it: a bucket of `per_minute` tokens,
    /// refilled continuously at `per_minute / 60` a second, starting full. Each request takes
    /// its input tokens, counted as the characters of its `system` and message contents
    /// (strings and `text` blocks) divided by 4, rounded up, at least 1 (a stand-in for a
    /// tokenizer). Every answer states the limit
    /// (`anthropic-ratelimit-input-tokens-limit`, `-remaining`, `-reset` as an RFC 3339
    /// instant on the system clock), and a default success reports the count as
    /// `usage.input_tokens`. A request over what is left is answered `429` with
    /// `retry-after` (whole seconds until its tokens are in, at least 1) and Anthropic's
    /// message naming input tokens; one larger than the whole limit, always.
    ///
    /// # Panics
    ///
    /// Panics if `per_minute` is zero or above `u32::MAX`.
    pub fn input_tokens_per_minute(per_minute: u64) -> Capacity {
        let burst = u32::try_from(per_minute)
            .ok()
            .filter(|b| *b > 0)
            .expect("an input-token limit within 1..=u32::MAX");
        Capacity {
            rate_per_sec: per_minute as f64 / 60.0,
            burst,
            unit: Unit::InputTokens,
        }
    }

    pub(super) fn bucket(&self) -> TokenBucket {
        TokenBucket {
            rate_per_sec: self.rate_per_sec,
            burst: f64::from(self.burst),
            tokens: f64::from(self.burst),
            unit: self.unit,
            // Set on first use so the bucket follows the clock of the runtime
            // that serves requests, not of whoever built the script.
            refilled_at: None,
        }
    }
}

/// Headers an answer carries.
pub(super) type Headers = Vec<(HeaderName, HeaderValue)>;

#[derive(Debug)]
pub(super) struct TokenBucket {
    rate_per_sec: f64,
    burst: f64,
    tokens: f64,
    unit: Unit,
    refilled_at: Option<Instant>,
}

impl TokenBucket {
    /// Takes what `request` costs, or returns the reply rejecting it. Of an input-token
    /// bucket, what it took and the headers every answer carries.
    pub(super) fn admit(
        &mut self,
        request: &RecordedRequest,
        now: Instant,
    ) -> Result<Option<(u64, Headers)>, Reply> {
        match self.unit {
            Unit::Requests => self.acquire(now).map(|()| None),
            Unit::InputTokens => {
                self.refill(now);
                let cost = count_input_tokens(&request.body);
                let ok = cost as f64 <= self.tokens;
                if ok {
                    self.tokens -= cost as f64;
                }
                let headers = self.token_headers();
                if ok {
                    return Ok(Some((cost, headers)));
                }
                let wait = (cost as f64 - self.tokens) / self.rate_per_sec;
                let retry_after = if cost as f64 > self.burst {
                    // It can never fit: a wait as long as a whole refill.
                    (self.burst / self.rate_per_sec).ceil()
                } else {
                    wait.ceil().max(1.0)
                };
                let message = format!(
                    "This request would exceed the rate limit for your organization of {} \
                     input tokens per minute. For details, refer to: \
                     https://docs.anthropic.com/en/api/rate-limits.",
                    self.burst
                );
                let mut reply = Reply::anthropic_error(429, "rate_limit_error", &message)
                    .header(RETRY_AFTER.as_str(), &format!("{retry_after:.0}"));
                reply.headers.extend(headers);
                Err(reply)
            }
        }
    }

    /// The input-token headers of an answer, as they stand.
    fn token_headers(&self) -> Headers {
        let full_in = (self.burst - self.tokens).max(0.0) / self.rate_per_sec;
        let reset = std::time::SystemTime::now() + Duration::from_secs_f64(full_in.ceil());
        let h = |name: &'static str, value: String| {
            (
                HeaderName::from_static(name),
                HeaderValue::from_str(&value).expect("digits and RFC 3339"),
            )
        };
        vec![
            h(
                "anthropic-ratelimit-input-tokens-limit",
                format!("{:.0}", self.burst),
            ),
            h(
                "anthropic-ratelimit-input-tokens-remaining",
                format!("{:.0}", self.tokens.max(0.0).floor()),
            ),
            h("anthropic-ratelimit-input-tokens-reset", rfc3339(reset)),
        ]
    }

    fn refill(&mut self, now: Instant) {
        if let Some(last) = self.refilled_at {
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.rate_per_sec).min(self.burst);
        }
        self.refilled_at = Some(now);
    }

    /// Takes a token, or returns the reply rejecting the request.
    fn acquire(&mut self, now: Instant) -> Result<(), Reply> {
        self.refill(now);

        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        let wait = (1.0 - self.tokens) / self.rate_per_sec;
        let retry_after = wait.ceil().max(1.0);
        Err(Reply::anthropic_error(
            429,
            "rate_limit_error",
            "Number of requests has exceeded your rate limit. Please try again later.",
        )
        .header(RETRY_AFTER.as_str(), &format!("{retry_after:.0}")))
    }
}

/// The input tokens of a request, as the mock counts them: the characters of its `system`
/// and of its messages' contents (strings, and the `text` of blocks), divided by 4, rounded
/// up, at least 1.
pub(super) fn count_input_tokens(body: &[u8]) -> u64 {
    fn text_len(v: &Value) -> usize {
        match v {
            Value::String(s) => s.chars().count(),
            Value::Array(blocks) => blocks
                .iter()
                .map(|b| match b {
                    Value::String(s) => s.chars().count(),
                    _ => b.get("text").map_or(0, text_len),
                })
                .sum(),
            _ => 0,
        }
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return 1;
    };
    let mut chars = v.get("system").map_or(0, text_len);
    if let Some(messages) = v.get("messages").and_then(Value::as_array) {
        chars += messages
            .iter()
            .map(|m| m.get("content").map_or(0, text_len))
            .sum::<usize>();
    }
    (chars as u64).div_ceil(4).max(1)
}

/// `at` as an RFC 3339 instant in UTC, to the second.
fn rfc3339(at: std::time::SystemTime) -> String {
    let secs = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A scripted response, or a scripted failure to respond.
///
/// Builders such as [`Reply::success`] and [`Reply::anthropic_error`] produce
/// realistic provider responses; [`Reply::reset`], [`Reply::stall`] and the
/// `*_mid_body` variants produce transport failures; [`Reply::refused_stream`],
/// [`Reply::goaway`] and [`Reply::reset_stream_after_head`] produce HTTP/2
/// stream and connection errors, and degrade to closing the connection on
/// HTTP/1.1.
#[derive(Clone, Debug)]
pub struct Reply {
    pub(super) status: StatusCode,
    pub(super) headers: Vec<(HeaderName, HeaderValue)>,
    pub(super) payload: Payload,
    pub(super) delay: Duration,
}

#[derive(Clone, Debug)]
pub(super) enum Payload {
    Full(Bytes),
    /// Resolved per request, since the right shape depends on the path.
    Success,
    Stream {
        events: Vec<SseFrame>,
        end: End,
    },
    Reset,
    Stall,
    /// HTTP/2: `RST_STREAM` with `REFUSED_STREAM` before any response.
    RefusedStream,
    /// HTTP/2: `GOAWAY` whose last-stream-id is just below this stream.
    GoAway,
    /// HTTP/1.1: these bytes as the whole response, then the connection closes.
    Raw(Bytes),
}

impl Payload {
    /// Whether the reply never sends a response head.
    pub(super) fn sends_no_head(&self) -> bool {
        matches!(
            self,
            Payload::Reset | Payload::Stall | Payload::RefusedStream | Payload::GoAway
        )
    }
}

/// How a streamed body ends once its events have been written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
    Finish,
    /// Abort the connection (on HTTP/2, every stream on it).
    Reset,
    /// HTTP/2: `RST_STREAM` with `INTERNAL_ERROR` on this stream only; on
    /// HTTP/1.1 the same as `Reset`.
    ResetStream,
    Stall,
}

impl Reply {
    /// A response with the given status and an empty body.
    ///
    /// # Panics
    ///
    /// Panics if `code` is not a valid HTTP status code.
    pub fn status(code: u16) -> Self {
        Self {
            status: status(code),
            headers: Vec::new(),
            payload: Payload::Full(Bytes::new()),
            delay: Duration::ZERO,
        }
    }

    /// Adds a response header.
    ///
    /// Calling it again with the same name adds another value rather than
    /// replacing the first, so duplicate headers can be scripted.
    ///
    /// # Panics
    ///
    /// Panics if `name` or `value` is not a valid header name or value.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        let name = HeaderName::from_bytes(name.as_bytes())
            .unwrap_or_else(|e| panic!("invalid header name {name:?}: {e}"));
        let value = HeaderValue::from_str(value)
            .unwrap_or_else(|e| panic!("invalid header value {value:?}: {e}"));
        self.headers.push((name, value));
        self
    }

    /// Replaces the response body.
    ///
    /// Has no effect on the replies that never send a response:
    /// [`Reply::reset`], [`Reply::stall`], [`Reply::refused_stream`] and
    /// [`Reply::goaway`].
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        if !self.payload.sends_no_head() {
            self.payload = Payload::Full(body.into());
        }
        self
    }

    /// Replaces the response body with `value` and sets
    /// `content-type: application/json`.
    ///
    /// Has no effect on the replies that never send a response, as with
    /// [`Reply::body`].
    pub fn json(self, value: Value) -> Self {
        self.json_text(value.to_string())
    }

    fn json_text(self, text: String) -> Self {
        self.body(text).content_type("application/json")
    }

    /// Waits `d` before sending the response head (or before resetting or
    /// stalling the connection).
    ///
    /// The wait uses [`tokio::time::sleep`], so it is virtual under paused
    /// time.
    pub fn delay(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }

    /// A `200` with a realistic JSON body for the request's path.
    ///
    /// Paths ending in `/chat/completions` get an OpenAI `chat.completion`;
    /// every other path gets an Anthropic `message`. Both echo the `model`
    /// field of a JSON request body when there is one.
    pub fn success() -> Self {
        Self {
            payload: Payload::Success,
            ..Self::status(200)
        }
        .content_type("application/json")
    }

    /// An Anthropic error response:
    /// `{"type":"error","error":{"type":error_type,"message":message}}`.
    ///
    /// # Panics
    ///
    /// Panics if `status` is not a valid HTTP status code.
    pub fn anthropic_error(status: u16, error_type: &str, message: &str) -> Self {
        Self::status(status).json_text(anthropic_error_body(error_type, message))
    }

    /// An OpenAI error response:
    /// `{"error":{"message":message,"type":code,"param":null,"code":code}}`.
    ///
    /// # Panics
    ///
    /// Panics if `status` is not a valid HTTP status code.
    pub fn openai_error(status: u16, code: &str, message: &str) -> Self {
        let body = object! {
            "error": object! {
                "message": message,
                "type": code,
                "param": Null,
                "code": code,
            },
        };
        Self::status(status).json_text(body.into_string())
    }

    /// `401` with an Anthropic `authentication_error` body, as sent for a
    /// missing, unknown or expired credential.
    pub fn unauthorized() -> Self {
        Self::anthropic_error(401, "authentication_error", "invalid x-api-key")
    }

    /// `400` with Anthropic's message for a request whose prompt fits but
    /// whose `max_tokens` does not:
    /// `input length and `max_tokens` exceed context limit: input + max_tokens > limit`.
    pub fn context_overflow(input: u64, max_tokens: u64, limit: u64) -> Self {
        Self::anthropic_error(
            400,
            "invalid_request_error",
            &format!(
                "input length and `max_tokens` exceed context limit: {input} + {max_tokens} > {limit}, \
                 decrease input length or `max_tokens` and try again"
            ),
        )
    }

    /// `400` with Anthropic's message for a prompt that alone exceeds the
    /// context window: `prompt is too long: tokens tokens > maximum maximum`.
    pub fn prompt_too_long(tokens: u64, maximum: u64) -> Self {
        Self::anthropic_error(
            400,
            "invalid_request_error",
            &format!("prompt is too long: {tokens} tokens > {maximum} maximum"),
        )
    }

    /// `529` with an Anthropic `overloaded_error` body.
    pub fn overloaded() -> Self {
        Self::anthropic_error(529, "overloaded_error", "Overloaded")
    }

    /// `429` with an Anthropic `rate_limit_error` body and `retry-after` set
    /// to `retry_after` verbatim (delta-seconds, an HTTP date, or anything
    /// else worth testing a parser against).
    ///
    /// # Panics
    ///
    /// Panics if `retry_after` is not a valid header value.
    pub fn rate_limited(retry_after: &str) -> Self {
        Self::anthropic_error(
            429,
            "rate_limit_error",
            "Number of requests has exceeded your rate limit. Please try again later.",
        )
        .header(RETRY_AFTER.as_str(), retry_after)
    }

    /// An Amazon Bedrock error: `status`, the header
    /// `x-amzn-ErrorType: {error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/`
    /// and the body `{"message":message}`, as Bedrock's runtime sends them (its codes:
    /// `ThrottlingException`, `ServiceUnavailableException`, `ModelNotReadyException`,
    /// `ValidationException`, `AccessDeniedException`, ...).
    ///
    /// # Panics
    ///
    /// Panics if `status` is not a valid HTTP status code, or `error_type` not a valid header
    /// value.
    pub fn bedrock_error(status: u16, error_type: &str, message: &str) -> Self {
        let body = object! { "message": message };
        Self::status(status)
            .header(
                "x-amzn-errortype",
                &format!("{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/"),
            )
            .json_text(body.into_string())
    }

    /// `429` as Amazon Bedrock throttles: a `ThrottlingException` whose message is "Too many
    /// tokens, please wait before trying again.", with `x-amz-retry-after` set to
    /// `retry_after_ms` milliseconds.
    pub fn bedrock_throttled(retry_after_ms: u64) -> Self {
        Self::bedrock_error(
            429,
            "ThrottlingException",
            "Too many tokens, please wait before trying again.",
        )
        .header("x-amz-retry-after", &retry_after_ms.to_string())
    }

    /// A Google error (Vertex AI, the Gemini API): `status` with the envelope
    /// `{"error":{"code":status,"message":message,"status":google_status,"details":[...]}}`,
    /// whose `details` hold a `google.rpc.RetryInfo` with `retryDelay` set to `retry_delay`
    /// verbatim (such as `"17s"` or `"1.5s"`) when there is one, after a
    /// `google.rpc.QuotaFailure` naming `quota_id` when there is one. `array`: the envelope
    /// as a one-element JSON array, as some Google endpoints send it.
    ///
    /// # Panics
    ///
    /// Panics if `status` is not a valid HTTP status code.
    pub fn google_error(
        status: u16,
        google_status: &str,
        message: &str,
        quota_id: Option<&str>,
        retry_delay: Option<&str>,
        array: bool,
    ) -> Self {
        let mut details = String::from("[");
        if let Some(quota_id) = quota_id {
            let failure = object! {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": array![object! {
                    "quotaMetric": "aiplatform.googleapis.com/generate_content_requests",
                    "quotaId": quota_id,
                }],
            };
            details.push_str(&failure.into_string());
        }
        if let Some(delay) = retry_delay {
            if details.len() > 1 {
                details.push(',');
            }
            let info = object! {
                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                "retryDelay": delay,
            };
            details.push_str(&info.into_string());
        }
        details.push(']');
        let envelope = object! {
            "error": object! {
                "code": u32::from(status),
                "message": message,
                "status": google_status,
                "details": super::json::Raw(details),
            },
        };
        let body = if array {
            array![envelope].into_string()
        } else {
            envelope.into_string()
        };
        Self::status(status).json_text(body)
    }

    /// `429` with Google's `RESOURCE_EXHAUSTED` on a per-minute quota, and a
    /// `google.rpc.RetryInfo` whose `retryDelay` is `retry_delay` verbatim (`"30s"`): what
    /// Vertex AI sends when a per-minute quota runs out. A rate limit, to wait out.
    pub fn google_resource_exhausted(retry_delay: &str) -> Self {
        Self::google_error(
            429,
            "RESOURCE_EXHAUSTED",
            "Quota exceeded for aiplatform.googleapis.com/generate_content_requests_per_minute_per_project_per_base_model with base model: gemini-2.5-pro. Please submit a quota increase request.",
            Some("GenerateContentRequestsPerMinutePerProjectPerBaseModel"),
            Some(retry_delay),
            false,
        )
    }

    /// `429` with Google's `RESOURCE_EXHAUSTED` on a daily quota (the Gemini API's free tier,
    /// `GenerateRequestsPerDayPerProjectPerModel-FreeTier`), with a `retryDelay` of `"17s"`
    /// that waiting would not honour: the quota comes back tomorrow.
    pub fn google_daily_quota_exhausted() -> Self {
        Self::google_error(
            429,
            "RESOURCE_EXHAUSTED",
            "You exceeded your current quota, please check your plan and billing details.",
            Some("GenerateRequestsPerDayPerProjectPerModel-FreeTier"),
            Some("17s"),
            true,
        )
    }

    /// Reads the request, then closes the connection without responding.
    ///
    /// Clients see the connection closed before the response began. On
    /// HTTP/2 the whole connection closes, failing every stream on it.
    pub fn reset() -> Self {
        Self {
            payload: Payload::Reset,
            ..Self::status(200)
        }
    }

    /// Reads the request, writes `bytes` as the whole response (head, framing
    /// and body, exactly as given, however malformed), then closes the
    /// connection: for what no well-behaved server sends, such as a head with
    /// both `Transfer-Encoding: chunked` and `Content-Length`, a `101` nobody
    /// asked for, or broken chunked framing. The status and headers of the
    /// reply are not used. On HTTP/2 the same as [`Reply::reset`].
    pub fn raw(bytes: impl Into<Bytes>) -> Self {
        Self {
            payload: Payload::Raw(bytes.into()),
            ..Self::status(200)
        }
    }

    /// Reads the request and never responds; the connection stays open
    /// until the server shuts down.
    pub fn stall() -> Self {
        Self {
            payload: Payload::Stall,
            ..Self::status(200)
        }
    }

    /// Sends the head and `first`, then aborts the connection.
    ///
    /// The body is sent chunked, so clients see the body fail part-way. On
    /// HTTP/2 the whole connection is dropped mid-stream, failing every
    /// stream on it; [`Reply::reset_stream_after_head`] fails one stream
    /// only.
    ///
    /// # Panics
    ///
    /// Panics if `status` is not a valid HTTP status code.
    pub fn reset_mid_body(status: u16, first: impl Into<Bytes>) -> Self {
        Self::streamed(status, vec![SseFrame::raw(first)], End::Reset)
    }

    /// Sends the head and `first`, then never sends anything more; the
    /// connection stays open until the server shuts down.
    ///
    /// # Panics
    ///
    /// Panics if `status` is not a valid HTTP status code.
    pub fn stall_mid_body(status: u16, first: impl Into<Bytes>) -> Self {
        Self::streamed(status, vec![SseFrame::raw(first)], End::Stall)
    }

    /// A `200` `text/event-stream` response writing each event as its own
    /// frame, after that event's [delay](SseFrame::after).
    pub fn sse(events: Vec<SseFrame>) -> Self {
        Self::event_stream(events, End::Finish)
    }

    /// Like [`Reply::sse`], but aborts the connection after the last event
    /// instead of ending the body.
    ///
    /// On HTTP/2 the whole connection is dropped mid-stream, failing every
    /// stream on it.
    pub fn sse_then_reset(events: Vec<SseFrame>) -> Self {
        Self::event_stream(events, End::Reset)
    }

    /// Like [`Reply::sse`], but resets the stream after the last event
    /// instead of ending the body.
    ///
    /// On HTTP/2 the server sends `RST_STREAM` with `INTERNAL_ERROR` on this
    /// stream only; other streams on the connection carry on. On HTTP/1.1,
    /// which has no streams, it aborts the connection, as
    /// [`Reply::sse_then_reset`] does.
    pub fn sse_then_reset_stream(events: Vec<SseFrame>) -> Self {
        Self::event_stream(events, End::ResetStream)
    }

    /// Sends the response head, then resets the stream before any body.
    ///
    /// On HTTP/2 the server sends `HEADERS` and then `RST_STREAM` with
    /// `INTERNAL_ERROR`: the client has a response whose body fails. Other
    /// streams on the connection carry on. On HTTP/1.1 the head goes out
    /// with a chunked body, then the connection is aborted.
    ///
    /// # Panics
    ///
    /// Panics if `status` is not a valid HTTP status code.
    pub fn reset_stream_after_head(status: u16) -> Self {
        Self::streamed(status, Vec::new(), End::ResetStream)
    }

    /// Reads the request, then refuses it: on HTTP/2, `RST_STREAM` with
    /// `REFUSED_STREAM` before any response.
    ///
    /// `REFUSED_STREAM` tells the client the server did no processing of
    /// the request, so even a request that is not safe to repeat may be sent
    /// again. Other streams on the connection carry on.
    ///
    /// On HTTP/1.1, which cannot say so, the connection closes without a
    /// response, as with [`Reply::reset`].
    pub fn refused_stream() -> Self {
        Self {
            payload: Payload::RefusedStream,
            ..Self::status(200)
        }
    }

    /// Reads the request, then sends `GOAWAY` refusing this stream and every
    /// stream after it.
    ///
    /// On HTTP/2 the `GOAWAY` (`NO_ERROR`) carries a last-stream-id just
    /// below this request's stream id (the id minus two, the client's
    /// previous stream). Streams at or below it, already in flight, are
    /// still answered by their own replies; streams above it, this one
    /// included, get nothing more, which tells the client none of them was
    /// processed. The connection closes once the streams at or below the
    /// last-stream-id have finished.
    ///
    /// On HTTP/1.1 the connection closes without a response, as with
    /// [`Reply::reset`].
    pub fn goaway() -> Self {
        Self {
            payload: Payload::GoAway,
            ..Self::status(200)
        }
    }

    /// Like [`Reply::sse`], but never ends the body after the last event;
    /// the connection stays open until the server shuts down.
    pub fn sse_then_stall(events: Vec<SseFrame>) -> Self {
        Self::event_stream(events, End::Stall)
    }

    fn event_stream(events: Vec<SseFrame>, end: End) -> Self {
        Self::streamed(200, events, end)
            .content_type("text/event-stream")
            .header("cache-control", "no-cache")
    }

    fn streamed(status: u16, events: Vec<SseFrame>, end: End) -> Self {
        Self {
            payload: Payload::Stream { events, end },
            ..Self::status(status)
        }
    }

    fn content_type(mut self, value: &'static str) -> Self {
        self.headers.retain(|(name, _)| name != CONTENT_TYPE);
        self.headers
            .push((CONTENT_TYPE, HeaderValue::from_static(value)));
        self
    }
}

fn status(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or_else(|e| panic!("invalid status code {code}: {e}"))
}

pub(super) fn anthropic_error_body(error_type: &str, message: &str) -> String {
    object! {
        "type": "error",
        "error": object! {
            "type": error_type,
            "message": message,
        },
    }
    .into_string()
}

/// One server-sent event, written to the body as a single frame.
#[derive(Clone)]
pub struct SseFrame {
    bytes: Bytes,
    pub(super) delay: Duration,
}

impl SseFrame {
    /// An event with an `event:` name: `"event: {event}\ndata: {data}\n\n"`.
    ///
    /// Multi-line `data` is split into one `data:` line per line, as the
    /// event-stream format requires.
    pub fn new(event: &str, data: &str) -> Self {
        let mut buf = BytesMut::new();
        buf.put_slice(b"event: ");
        buf.put_slice(event.as_bytes());
        buf.put_u8(b'\n');
        put_data(&mut buf, data);
        Self::raw(buf.freeze())
    }

    /// An unnamed event: `"data: {data}\n\n"`.
    ///
    /// Multi-line `data` is split into one `data:` line per line.
    pub fn data(data: &str) -> Self {
        let mut buf = BytesMut::new();
        put_data(&mut buf, data);
        Self::raw(buf.freeze())
    }

    /// A frame of arbitrary bytes, for malformed or partial events.
    pub fn raw(bytes: impl Into<Bytes>) -> Self {
        Self {
            bytes: bytes.into(),
            delay: Duration::ZERO,
        }
    }

    /// A frame of no bytes that waits `d`: the stream goes silent for `d`
    /// before whatever comes next, its next event or its end (a clean end, a
    /// reset or a stall). Nothing is written for it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_llm_retry::mock::{sse, Reply, SseFrame};
    ///
    /// // Two events, 30 s of silence, then the connection is cut.
    /// let mut events = sse::openai_chat(&["Hello", " there"]);
    /// events.truncate(2);
    /// events.push(SseFrame::silence(Duration::from_secs(30)));
    /// let reply = Reply::sse_then_reset(events);
    /// # drop(reply);
    /// ```
    pub fn silence(d: Duration) -> Self {
        Self::raw(Bytes::new()).after(d)
    }

    /// Waits `d` before writing this event.
    ///
    /// The wait starts once the previous frame (or the response head) has
    /// been handed to the connection, and uses [`tokio::time::sleep`].
    pub fn after(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }

    /// The bytes written for this event.
    pub fn bytes(&self) -> Bytes {
        self.bytes.clone()
    }
}

impl fmt::Debug for SseFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SseFrame")
            .field("bytes", &String::from_utf8_lossy(&self.bytes))
            .field("delay", &self.delay)
            .finish()
    }
}

fn put_data(buf: &mut BytesMut, data: &str) {
    for line in data.split('\n') {
        buf.put_slice(b"data: ");
        buf.put_slice(line.as_bytes());
        buf.put_u8(b'\n');
    }
    buf.put_u8(b'\n');
}

/// The default `200` body for a request to `path`.
pub(super) fn success_body(path: &str, request_body: &[u8], index: usize) -> Bytes {
    success_body_with(path, request_body, index, 10)
}

/// The default `200` body, reporting `input_tokens` of usage.
pub(super) fn success_body_with(
    path: &str,
    request_body: &[u8],
    index: usize,
    input_tokens: u64,
) -> Bytes {
    let model = serde_json::from_slice::<Value>(request_body)
        .ok()
        .and_then(|v| v.get("model")?.as_str().map(str::to_owned));

    let body = if path.ends_with("/chat/completions") {
        object! {
            "id": format!("chatcmpl-mock{index}"),
            "object": "chat.completion",
            "created": CREATED,
            "model": model.as_deref().unwrap_or(OPENAI_MODEL),
            "choices": array![object! {
                "index": 0,
                "message": object! {
                    "role": "assistant",
                    "content": "Hello!",
                    "refusal": Null,
                },
                "logprobs": Null,
                "finish_reason": "stop",
            }],
            "usage": object! {
                "prompt_tokens": input_tokens,
                "completion_tokens": 2,
                "total_tokens": input_tokens + 2,
            },
        }
    } else {
        object! {
            "id": format!("msg_mock{index}"),
            "type": "message",
            "role": "assistant",
            "model": model.as_deref().unwrap_or(ANTHROPIC_MODEL),
            "content": array![object! {"type": "text", "text": "Hello!"}],
            "stop_reason": "end_turn",
            "stop_sequence": Null,
            "usage": object! {
                "input_tokens": input_tokens,
                "output_tokens": 2,
            },
        }
    };
    Bytes::from(body.into_string())
}

// Fixed so that responses are reproducible byte for byte.
pub(super) const CREATED: u64 = 1_700_000_000;
pub(super) const ANTHROPIC_MODEL: &str = "claude-mock";
pub(super) const OPENAI_MODEL: &str = "gpt-mock";
