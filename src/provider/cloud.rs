//! The cloud dialects of the same APIs: Amazon Bedrock's AWS error codes (the
//! `x-amzn-ErrorType` header, or `__type` in the body beside a top-level `message`) and
//! Google's error envelope (Vertex AI and the Gemini API: `error.status`, `error.message` and
//! `error.details[]`, as an object or a one-element array).
//!
//! Every reader here is bounded by its input (a body the loop already capped at its peek
//! limit, a header value) and never panics: what does not parse is "nothing said".

use std::borrow::Cow;
use std::time::Duration;

use serde::Deserialize;

use super::signal::BodySignal;

/// Bedrock's error-type header: `ThrottlingException:http://internal.amazon.com/coral/...`.
pub(crate) const X_AMZN_ERROR_TYPE: &str = "x-amzn-errortype";

/// What an AWS error code says, as far as retries care; `None` for a code that leaves the
/// decision to the status and the message (`ValidationException`, `AccessDeniedException`:
/// their `400` and `403` are not retried, and a validation message may still name a context
/// overflow).
pub(crate) fn aws_signal(code: &str) -> Option<BodySignal> {
    // `ThrottlingException:http://...` in the header, `com.amazon.coral...#ThrottlingException`
    // in a body's `__type`.
    let code = code.split(':').next().unwrap_or("");
    let code = code.rsplit('#').next().unwrap_or("").trim();
    match code {
        // "Too many requests" and "Too many tokens" alike: a throttle, never an overflow.
        "ThrottlingException" => Some(BodySignal::Throttled),
        "ServiceUnavailableException" | "ModelNotReadyException" => Some(BodySignal::Overloaded),
        _ => None,
    }
}

/// The AWS error code of a response's `x-amzn-ErrorType` header, read as [`aws_signal`].
pub(crate) fn aws_header_signal(headers: &http::HeaderMap) -> Option<BodySignal> {
    let value = headers.get(X_AMZN_ERROR_TYPE)?.to_str().ok()?;
    // A code is short; a long value is not one.
    if value.len() > 256 {
        return None;
    }
    aws_signal(value)
}

/// A Bedrock error body: `{"message": "..."}`, sometimes with `__type`.
#[derive(Deserialize)]
struct AwsBody<'a> {
    #[serde(borrow, default, rename = "__type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default, alias = "Message")]
    message: Option<Cow<'a, str>>,
}

/// What a Bedrock error body says: its code's signal, and its message.
pub(crate) fn aws_body(body: &[u8]) -> Option<(Option<BodySignal>, Option<Cow<'_, str>>)> {
    let parsed = serde_json::from_slice::<AwsBody<'_>>(body).ok()?;
    if parsed.kind.is_none() && parsed.message.is_none() {
        return None;
    }
    let signal = parsed.kind.as_deref().and_then(aws_signal);
    Some((signal, parsed.message))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum GoogleBody<'a> {
    #[serde(borrow)]
    One(GoogleEnvelope<'a>),
    #[serde(borrow)]
    Many(Vec<GoogleEnvelope<'a>>),
}

#[derive(Deserialize)]
struct GoogleEnvelope<'a> {
    #[serde(borrow)]
    error: GoogleError<'a>,
}

#[derive(Deserialize)]
struct GoogleError<'a> {
    #[serde(borrow)]
    status: Cow<'a, str>,
    #[serde(borrow, default)]
    message: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    details: Vec<Detail<'a>>,
}

#[derive(Deserialize)]
struct Detail<'a> {
    #[serde(borrow, default, rename = "@type")]
    kind: Option<Cow<'a, str>>,
    /// `google.rpc.RetryInfo`.
    #[serde(borrow, default, rename = "retryDelay")]
    retry_delay: Option<Cow<'a, str>>,
    /// `google.rpc.QuotaFailure`.
    #[serde(borrow, default)]
    violations: Vec<Violation<'a>>,
    /// `google.rpc.ErrorInfo`.
    #[serde(borrow, default)]
    reason: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    metadata: Option<Metadata<'a>>,
}

#[derive(Deserialize)]
struct Violation<'a> {
    #[serde(borrow, default, rename = "quotaId")]
    quota_id: Option<Cow<'a, str>>,
    #[serde(borrow, default, rename = "quotaMetric")]
    quota_metric: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    description: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    quota_metric: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    quota_limit: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    quota_id: Option<Cow<'a, str>>,
}

const RETRY_INFO: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// What Google's error envelope says: the signal, the `RetryInfo` delay, and the message.
pub(crate) struct Google<'a> {
    pub(crate) signal: BodySignal,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) message: Option<Cow<'a, str>>,
}

/// Reads Google's error envelope (an object, or the first of an array); `None` for a body
/// of another shape. `RESOURCE_EXHAUSTED` is a rate limit ([`BodySignal::Throttled`]) unless
/// a quota it names, or its message, is per day or a billing limit: then an exhausted quota
/// that waiting will not fix. `UNAVAILABLE` whose message says "overloaded" is an overload.
/// A message that names a context overflow is one, whatever the status.
pub(crate) fn google(body: &[u8]) -> Option<Google<'_>> {
    let error = match serde_json::from_slice::<GoogleBody<'_>>(body).ok()? {
        GoogleBody::One(e) => e.error,
        GoogleBody::Many(v) => v.into_iter().next()?.error,
    };
    let retry_after = error
        .details
        .iter()
        .filter(|d| d.kind.as_deref() == Some(RETRY_INFO))
        .find_map(|d| d.retry_delay.as_deref().and_then(parse_google_duration));
    let message = error.message.as_deref().unwrap_or("");
    let signal = match &*error.status {
        "RESOURCE_EXHAUSTED" => {
            if names_daily_or_billing(&error) {
                BodySignal::QuotaExhausted
            } else {
                BodySignal::Throttled
            }
        }
        "UNAVAILABLE" if contains_ignore_case(message, "overloaded") => {
            BodySignal::ServerOverloaded
        }
        _ if super::signal::says_overflow(message) => BodySignal::ContextOverflow,
        _ => BodySignal::Other,
    };
    Some(Google {
        signal,
        retry_after,
        message: error.message,
    })
}

/// Whether a `RESOURCE_EXHAUSTED` names a quota that resets daily, or billing: in a
/// `QuotaFailure` violation's `quotaId`, `quotaMetric` or description, an `ErrorInfo`'s
/// reason or metadata, or the message.
fn names_daily_or_billing(error: &GoogleError<'_>) -> bool {
    let says = |text: &str| {
        [
            "perday", "per_day", "per day", "per-day", "daily", "billing",
        ]
        .iter()
        .any(|w| contains_ignore_case(text, w))
    };
    if says(error.message.as_deref().unwrap_or("")) {
        return true;
    }
    error.details.iter().any(|d| {
        d.violations.iter().any(|v| {
            [&v.quota_id, &v.quota_metric, &v.description]
                .into_iter()
                .any(|s| s.as_deref().is_some_and(says))
        }) || d.reason.as_deref().is_some_and(says)
            || d.metadata.as_ref().is_some_and(|m| {
                [&m.quota_metric, &m.quota_limit, &m.quota_id]
                    .into_iter()
                    .any(|s| s.as_deref().is_some_and(says))
            })
    })
}

/// `needle` (ASCII, lower case) in `haystack`, in any ASCII case.
fn contains_ignore_case(haystack: &str, needle: &str) -> bool {
    let needle = needle.as_bytes();
    !needle.is_empty()
        && haystack
            .as_bytes()
            .windows(needle.len())
            .any(|w| w.eq_ignore_ascii_case(needle))
}

/// A protobuf `Duration` in JSON: decimal seconds with an `s` suffix, such as `"17s"`,
/// `"1.5s"` or `"0.250s"`. Anything else (no `s`, a sign, an exponent, more than 32
/// characters, more than nine fractional digits) counts as absent.
pub(crate) fn parse_google_duration(value: &str) -> Option<Duration> {
    let value = value.trim();
    if value.len() > 32 {
        return None;
    }
    let number = value.strip_suffix('s')?;
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    if fraction.len() > 9
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let secs = if whole.is_empty() {
        0
    } else {
        // Digits only: only too large can fail, and that is the longest wait.
        whole.parse::<u64>().unwrap_or(u64::MAX)
    };
    let nanos = if fraction.is_empty() {
        0
    } else {
        let digits: u32 = fraction.parse().ok()?;
        // At most nine digits: scale to nanoseconds.
        let scale = 10u32.pow(9 - u32::try_from(fraction.len()).ok()?);
        digits.checked_mul(scale)?
    };
    Some(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn google_durations() {
        let cases: &[(&str, Option<Duration>)] = &[
            ("17s", Some(Duration::from_secs(17))),
            ("1.5s", Some(Duration::from_millis(1500))),
            ("0.250s", Some(Duration::from_millis(250))),
            (" 30s ", Some(Duration::from_secs(30))),
            (".5s", Some(Duration::from_millis(500))),
            ("5.s", Some(Duration::from_secs(5))),
            ("0s", Some(Duration::ZERO)),
            ("0.000000001s", Some(Duration::from_nanos(1))),
            ("18446744073709551615s", Some(Duration::from_secs(u64::MAX))),
            (
                "99999999999999999999999s",
                Some(Duration::from_secs(u64::MAX)),
            ),
            ("0.0000000001s", None),
            ("17", None),
            ("s", None),
            (".s", None),
            ("-1s", None),
            ("+1s", None),
            ("1e3s", None),
            ("1.2.3s", None),
            ("NaNs", None),
            ("infs", None),
            ("17ms", None),
            ("", None),
            ("١٧s", None),
        ];
        for &(value, want) in cases {
            assert_eq!(parse_google_duration(value), want, "{value:?}");
        }
        let long = format!("{}s", "1".repeat(40));
        assert_eq!(parse_google_duration(&long), None);
    }

    #[test]
    fn aws_codes() {
        use BodySignal::*;
        let cases: &[(&str, Option<BodySignal>)] = &[
            ("ThrottlingException", Some(Throttled)),
            (
                "ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/",
                Some(Throttled),
            ),
            (
                "com.amazon.coral.service#ThrottlingException",
                Some(Throttled),
            ),
            ("ServiceUnavailableException", Some(Overloaded)),
            ("ModelNotReadyException", Some(Overloaded)),
            ("ValidationException", None),
            ("AccessDeniedException", None),
            ("InternalServerException", None),
            ("throttlingexception", None),
            ("", None),
            (":", None),
            ("#", None),
        ];
        for &(code, want) in cases {
            assert_eq!(aws_signal(code), want, "{code:?}");
        }
    }

    fn signal(body: &str) -> Option<(BodySignal, Option<Duration>)> {
        google(body.as_bytes()).map(|g| (g.signal, g.retry_after))
    }

    #[test]
    fn google_envelopes() {
        use BodySignal::*;
        // Vertex: a per-minute quota, with a RetryInfo.
        let per_minute = r#"{"error":{"code":429,"message":"Quota exceeded for aiplatform.googleapis.com/generate_content_requests_per_minute_per_project_per_base_model with base model: gemini-2.5-pro.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"30s"}]}}"#;
        assert_eq!(
            signal(per_minute),
            Some((Throttled, Some(Duration::from_secs(30))))
        );
        // The same as a one-element array, with no RetryInfo.
        let array = r#"[{"error":{"code":429,"message":"Resource has been exhausted (e.g. check quota).","status":"RESOURCE_EXHAUSTED"}}]"#;
        assert_eq!(signal(array), Some((Throttled, None)));
        // Gemini API: a daily free-tier quota, named by its quotaId; a RetryInfo too.
        let daily = r#"{"error":{"code":429,"message":"You exceeded your current quota, please check your plan and billing details.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier","quotaDimensions":{"location":"global","model":"gemini-2.5-pro"},"quotaValue":"50"}]},{"@type":"type.googleapis.com/google.rpc.Help","links":[{"description":"Learn more","url":"https://ai.google.dev/gemini-api/docs/rate-limits"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"17s"}]}}"#;
        assert_eq!(
            signal(daily),
            Some((QuotaExhausted, Some(Duration::from_secs(17))))
        );
        // A per-minute quotaId, and a message that says nothing of days: a rate limit.
        let minute_id = r#"{"error":{"code":429,"message":"Resource exhausted.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"1.5s"}]}}"#;
        assert_eq!(
            signal(minute_id),
            Some((Throttled, Some(Duration::from_millis(1500))))
        );
        // ErrorInfo metadata naming a daily limit.
        let info = r#"{"error":{"code":429,"message":"Quota exceeded.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"RATE_LIMIT_EXCEEDED","metadata":{"quota_metric":"aiplatform.googleapis.com/online_prediction_requests","quota_limit":"OnlinePredictionRequestsPerDayPerProject"}}]}}"#;
        assert_eq!(signal(info), Some((QuotaExhausted, None)));
        // UNAVAILABLE: an overload when it says so, else nothing more than its 503.
        let overloaded = r#"{"error":{"code":503,"message":"The model is overloaded. Please try again later.","status":"UNAVAILABLE"}}"#;
        assert_eq!(signal(overloaded), Some((ServerOverloaded, None)));
        let unavailable = r#"{"error":{"code":503,"message":"The service is currently unavailable.","status":"UNAVAILABLE"}}"#;
        assert_eq!(signal(unavailable), Some((Other, None)));
        // A prompt too long, on 400 or 413.
        let long = r#"{"error":{"code":400,"message":"The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}"#;
        assert_eq!(signal(long), Some((ContextOverflow, None)));
        // A RetryInfo of another type, or a bad delay, gives no wait.
        let bad = r#"{"error":{"status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.Help","retryDelay":"5s"},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"soon"}]}}"#;
        assert_eq!(signal(bad), Some((Throttled, None)));
    }

    #[test]
    fn google_envelope_rejects_other_shapes() {
        for body in [
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            r#"{"error":{"message":"x","type":"insufficient_quota","code":"insufficient_quota"}}"#,
            r#"[]"#,
            r#"[1]"#,
            r#"{"error":{"status":7}}"#,
            r#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED""#,
            "",
            "null",
            "not json",
        ] {
            assert!(google(body.as_bytes()).is_none(), "{body}");
        }
    }

    #[test]
    fn readers_never_panic_on_cut_or_odd_bodies() {
        let body = r#"[{"error":{"code":429,"message":"Quota exceeded per day","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"17s"}]}}]"#;
        // Every prefix, and every byte flipped: whatever it reads, it does not panic.
        for end in 0..=body.len() {
            let _ = google(&body.as_bytes()[..end]);
            let _ = aws_body(&body.as_bytes()[..end]);
        }
        let mut bytes = body.as_bytes().to_vec();
        for i in 0..bytes.len() {
            let old = bytes[i];
            bytes[i] = 0xff;
            let _ = google(&bytes);
            let _ = aws_body(&bytes);
            bytes[i] = old;
        }
        // Deep nesting is refused by the JSON reader's recursion limit, not a stack overflow.
        let deep = "[".repeat(100_000);
        assert!(google(deep.as_bytes()).is_none());
    }
}
