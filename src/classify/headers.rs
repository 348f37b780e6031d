//! Parsing of the headers that steer retries.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// `retry-after-ms`: milliseconds, as sent by the Anthropic and OpenAI APIs.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";
/// `x-amz-retry-after`: milliseconds, as sent by Amazon Bedrock.
pub const X_AMZ_RETRY_AFTER: &str = "x-amz-retry-after";
/// `x-should-retry`: the server's explicit retry advice.
pub const X_SHOULD_RETRY: &str = "x-should-retry";

/// Reads the wait a response asks for, first found wins: `retry-after-ms`,
/// `x-amz-retry-after` (milliseconds, Amazon Bedrock), `retry-after` as (possibly fractional)
/// seconds, then `retry-after` as an HTTP-date relative to `now`.
///
/// NaN, infinite, negative or unparseable values count as absent, and so do an HTTP-date in
/// the past and a value longer than 32 characters. A plain number too large for a `Duration`
/// is `Duration::MAX`: a wait above any ceiling, as the server asked for, not no wait at all. When a header appears more than once,
/// its first value is used.
pub fn parse_retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    parse_retry_after_with(headers, || now)
}

/// [`parse_retry_after`], with "now" asked for only when the value is an HTTP-date.
pub(crate) fn parse_retry_after_with(
    headers: &HeaderMap,
    now: impl FnOnce() -> SystemTime,
) -> Option<Duration> {
    if let Some(ms) = headers.get(RETRY_AFTER_MS).and_then(|v| v.to_str().ok()) {
        if let Some(d) = parse_seconds(ms).and_then(|ms| duration_from_secs(ms / 1000.0)) {
            return Some(d);
        }
    }
    if let Some(ms) = headers.get(X_AMZ_RETRY_AFTER).and_then(|v| v.to_str().ok()) {
        if let Some(d) = parse_seconds(ms).and_then(|ms| duration_from_secs(ms / 1000.0)) {
            return Some(d);
        }
    }
    let value = headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())?;
    if let Some(secs) = parse_seconds(value) {
        return duration_from_secs(secs);
    }
    let when = httpdate::parse_http_date(value.trim()).ok()?;
    when.duration_since(now()).ok()
}

/// "Now" for an HTTP-date `Retry-After` of a response: the response's own `Date`, so that the
/// wait is the one the server meant (the host's clock skew neither stretches nor cuts it);
/// the system clock when it sent none that parses.
pub(crate) fn server_now(headers: &HeaderMap) -> SystemTime {
    server_date(headers).unwrap_or_else(SystemTime::now)
}

/// A response's `Date`, when it sent one that parses.
pub(crate) fn server_date(headers: &HeaderMap) -> Option<SystemTime> {
    headers
        .get(http::header::DATE)
        .and_then(|d| d.to_str().ok())
        .and_then(|d| httpdate::parse_http_date(d.trim()).ok())
}

/// Reads `x-should-retry`: `Some(true)` for `true`, `Some(false)` for `false`, `None` for
/// anything else (including absence).
pub fn parse_should_retry(headers: &HeaderMap) -> Option<bool> {
    match headers.get(X_SHOULD_RETRY)?.to_str().ok()?.trim() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

// Only plain decimal numbers: `f64::from_str` would also take "inf", "NaN" and "1e308",
// which no server means as a wait.
fn parse_seconds(s: &str) -> Option<f64> {
    let s = s.trim();
    if s.is_empty() || s.len() > 32 {
        return None;
    }
    let digits = s.strip_prefix('+').unwrap_or(s);
    let mut seen_dot = false;
    let mut seen_digit = false;
    for c in digits.chars() {
        match c {
            '0'..='9' => seen_digit = true,
            '.' if !seen_dot => seen_dot = true,
            _ => return None,
        }
    }
    if !seen_digit {
        return None;
    }
    digits.parse::<f64>().ok()
}

fn duration_from_secs(secs: f64) -> Option<Duration> {
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    // Finite and not negative: only too large can fail, and that is the longest wait.
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn now() -> SystemTime {
        // 2026-01-01T00:00:00Z
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600)
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn retry_after_table() {
        type Case<'a> = (&'a [(&'a str, &'a str)], Option<Duration>);
        let cases: &[Case<'_>] = &[
            (&[("retry-after", "3")], Some(Duration::from_secs(3))),
            (&[("retry-after", " 3 ")], Some(Duration::from_secs(3))),
            (&[("retry-after", "1.5")], Some(Duration::from_millis(1500))),
            (&[("retry-after", "0")], Some(Duration::ZERO)),
            (
                &[("retry-after-ms", "250")],
                Some(Duration::from_millis(250)),
            ),
            (
                &[("retry-after-ms", "12.5")],
                Some(Duration::from_micros(12_500)),
            ),
            (
                &[("retry-after-ms", "100"), ("retry-after", "9")],
                Some(Duration::from_millis(100)),
            ),
            (
                &[("x-amz-retry-after", "1500")],
                Some(Duration::from_millis(1500)),
            ),
            (
                &[("x-amz-retry-after", "1500"), ("retry-after", "9")],
                Some(Duration::from_millis(1500)),
            ),
            (
                &[("retry-after-ms", "100"), ("x-amz-retry-after", "1500")],
                Some(Duration::from_millis(100)),
            ),
            (
                &[("x-amz-retry-after", "soon"), ("retry-after", "9")],
                Some(Duration::from_secs(9)),
            ),
            (&[("x-amz-retry-after", "-5")], None),
            (
                &[("retry-after-ms", "junk"), ("retry-after", "9")],
                Some(Duration::from_secs(9)),
            ),
            (&[("retry-after", "-5")], None),
            (&[("retry-after", "nan")], None),
            (&[("retry-after", "NaN")], None),
            (&[("retry-after", "inf")], None),
            (&[("retry-after", "infinity")], None),
            (&[("retry-after", "1e3")], None),
            (&[("retry-after-ms", "1e308")], None),
            (
                &[("retry-after", "99999999999999999999")],
                Some(Duration::MAX),
            ),
            (
                &[("retry-after-ms", "99999999999999999999999")],
                Some(Duration::MAX),
            ),
            (&[("retry-after", "garbage")], None),
            (&[("retry-after", "")], None),
            (&[("retry-after", ".")], None),
            (&[("retry-after", "1.2.3")], None),
            (
                &[("retry-after", "Thu, 01 Jan 2026 00:00:30 GMT")],
                Some(Duration::from_secs(30)),
            ),
            (&[("retry-after", "Wed, 31 Dec 2025 23:59:00 GMT")], None),
            (
                &[("retry-after", "Fri, 01 Jan 2100 00:00:00 GMT")],
                Some(Duration::from_secs(2_335_219_200)),
            ),
            (
                &[("retry-after", "2"), ("retry-after", "40")],
                Some(Duration::from_secs(2)),
            ),
            (&[], None),
        ];
        for (pairs, want) in cases {
            assert_eq!(
                parse_retry_after(&headers(pairs), now()),
                *want,
                "headers {pairs:?}"
            );
        }
    }

    #[test]
    fn non_utf8_retry_after_is_absent() {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from_bytes(&[0xff, 0x31]).unwrap(),
        );
        assert_eq!(parse_retry_after(&h, now()), None);
    }

    #[test]
    fn should_retry_values() {
        assert_eq!(
            parse_should_retry(&headers(&[("x-should-retry", "true")])),
            Some(true)
        );
        assert_eq!(
            parse_should_retry(&headers(&[("x-should-retry", "false")])),
            Some(false)
        );
        assert_eq!(
            parse_should_retry(&headers(&[("x-should-retry", "yes")])),
            None
        );
        assert_eq!(parse_should_retry(&headers(&[])), None);
    }
}
