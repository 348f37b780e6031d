//! Rate-limit headers: "nothing left until T", and the request limit itself.
//!
//! | provider | limit | remaining | reset |
//! |---|---|---|---|
//! | Anthropic | `anthropic-ratelimit-requests-limit` | `anthropic-ratelimit-requests-remaining` | `anthropic-ratelimit-requests-reset`: an RFC 3339 instant, `2026-01-01T00:00:10Z` |
//! | OpenAI | `x-ratelimit-limit-requests` | `x-ratelimit-remaining-requests` | `x-ratelimit-reset-requests`: a duration, `1s`, `6m0s`, `547ms`, `2m52.8s` |
//!
//! Every parser here is a pure function that reads at most [`MAX_VALUE_LEN`] bytes and never
//! panics: a malformed, negative, overflowing or absurdly large value counts as absent.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};

/// Anthropic's count of requests left in the current window.
pub(crate) const ANTHROPIC_REQUESTS_REMAINING: &str = "anthropic-ratelimit-requests-remaining";
/// Anthropic's instant (RFC 3339) at which the request limit is replenished.
pub(crate) const ANTHROPIC_REQUESTS_RESET: &str = "anthropic-ratelimit-requests-reset";
/// OpenAI's count of requests left in the current window.
pub(crate) const OPENAI_REQUESTS_REMAINING: &str = "x-ratelimit-remaining-requests";
/// OpenAI's time (a duration such as `6m0s`) until the request limit is replenished.
pub(crate) const OPENAI_REQUESTS_RESET: &str = "x-ratelimit-reset-requests";

/// Anthropic's request limit (requests per minute).
pub(crate) const ANTHROPIC_REQUESTS_LIMIT: &str = "anthropic-ratelimit-requests-limit";
/// OpenAI's request limit (requests per minute).
pub(crate) const OPENAI_REQUESTS_LIMIT: &str = "x-ratelimit-limit-requests";

// The names as `HeaderName`s, so that a lookup on every response hashes them without parsing
// them first.
static ANTHROPIC_REQUESTS_REMAINING_NAME: HeaderName =
    HeaderName::from_static(ANTHROPIC_REQUESTS_REMAINING);
static ANTHROPIC_REQUESTS_RESET_NAME: HeaderName =
    HeaderName::from_static(ANTHROPIC_REQUESTS_RESET);
static OPENAI_REQUESTS_REMAINING_NAME: HeaderName =
    HeaderName::from_static(OPENAI_REQUESTS_REMAINING);
static OPENAI_REQUESTS_RESET_NAME: HeaderName = HeaderName::from_static(OPENAI_REQUESTS_RESET);

/// The longest header value the parsers look at; longer values count as absent.
pub(crate) const MAX_VALUE_LEN: usize = 64;

/// The longest reset the parsers accept: a value further away counts as absent.
pub(crate) const MAX_RESET: Duration = Duration::from_secs(24 * 60 * 60);

/// How long until the request limit is replenished, when a response says none are left.
///
/// Reads Anthropic's pair first, then OpenAI's. Returns `None` when the remaining count is
/// absent, unparseable or above zero, when the reset is absent, malformed or already past,
/// or when it is further away than [`MAX_RESET`].
pub(crate) fn requests_exhausted_for(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let anthropic = || {
        if header(headers, &ANTHROPIC_REQUESTS_REMAINING_NAME).and_then(parse_count)? != 0 {
            return None;
        }
        let at = header(headers, &ANTHROPIC_REQUESTS_RESET_NAME).and_then(parse_rfc3339)?;
        at.duration_since(now).ok().filter(|d| *d <= MAX_RESET)
    };
    let openai = || {
        if header(headers, &OPENAI_REQUESTS_REMAINING_NAME).and_then(parse_count)? != 0 {
            return None;
        }
        header(headers, &OPENAI_REQUESTS_RESET_NAME).and_then(parse_duration)
    };
    anthropic().or_else(openai).filter(|d| !d.is_zero())
}

/// The request limit and the requests left that a response states, found in one pass over
/// its headers: on every response, that is cheaper than looking up each of the four names
/// (each lookup hashes a name of 26 to 38 bytes, present or not).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RequestCounts<'a> {
    anthropic_limit: Option<&'a HeaderValue>,
    openai_limit: Option<&'a HeaderValue>,
    anthropic_remaining: Option<&'a HeaderValue>,
    openai_remaining: Option<&'a HeaderValue>,
    /// The token headers, found in the same pass: [provider (Anthropic, OpenAI)][kind][part
    /// (limit, remaining, reset)], read by [`TokenHeaders::of`].
    tokens: [[[Option<&'a HeaderValue>; 3]; 3]; 2],
}

impl<'a> RequestCounts<'a> {
    pub(crate) fn read(headers: &'a HeaderMap) -> Self {
        let mut counts = RequestCounts::default();
        for (name, value) in headers {
            let t = &mut counts.tokens;
            let slot = match name.as_str() {
                ANTHROPIC_REQUESTS_LIMIT => &mut counts.anthropic_limit,
                OPENAI_REQUESTS_LIMIT => &mut counts.openai_limit,
                ANTHROPIC_REQUESTS_REMAINING => &mut counts.anthropic_remaining,
                OPENAI_REQUESTS_REMAINING => &mut counts.openai_remaining,
                "anthropic-ratelimit-input-tokens-limit" => &mut t[0][0][0],
                "anthropic-ratelimit-input-tokens-remaining" => &mut t[0][0][1],
                "anthropic-ratelimit-input-tokens-reset" => &mut t[0][0][2],
                "anthropic-ratelimit-output-tokens-limit" => &mut t[0][1][0],
                "anthropic-ratelimit-output-tokens-remaining" => &mut t[0][1][1],
                "anthropic-ratelimit-output-tokens-reset" => &mut t[0][1][2],
                "anthropic-ratelimit-tokens-limit" => &mut t[0][2][0],
                "anthropic-ratelimit-tokens-remaining" => &mut t[0][2][1],
                "anthropic-ratelimit-tokens-reset" => &mut t[0][2][2],
                "x-ratelimit-limit-tokens" => &mut t[1][2][0],
                "x-ratelimit-remaining-tokens" => &mut t[1][2][1],
                "x-ratelimit-reset-tokens" => &mut t[1][2][2],
                _ => continue,
            };
            // The first value, as `HeaderMap::get` would give.
            slot.get_or_insert(value);
        }
        counts
    }

    /// The request limit, Anthropic's header first, then OpenAI's. `None` when neither is
    /// present and well formed, or the limit is zero.
    pub(crate) fn limit(&self) -> Option<u64> {
        [self.anthropic_limit, self.openai_limit]
            .into_iter()
            .find_map(|v| v.and_then(value_str).and_then(parse_count))
            .filter(|&n| n > 0)
    }

    /// The requests left in the window, Anthropic's header first, then OpenAI's. `None` when
    /// neither is present and well formed.
    pub(crate) fn remaining(&self) -> Option<u64> {
        [self.anthropic_remaining, self.openai_remaining]
            .into_iter()
            .find_map(|v| v.and_then(value_str).and_then(parse_count))
    }

    /// Whether any token header is present, well formed or not.
    pub(crate) fn states_tokens(&self) -> bool {
        self.tokens.iter().flatten().flatten().any(Option::is_some)
    }

    /// Whether either provider's remaining-count header is present, well formed or not.
    pub(crate) fn states_remaining(&self) -> bool {
        self.anthropic_remaining.is_some() || self.openai_remaining.is_some()
    }
}

/// Which of a provider's token limits: Anthropic states input tokens per minute (ITPM) and
/// output tokens per minute (OTPM), and in `anthropic-ratelimit-tokens-*` the most
/// restrictive of its token limits in effect (read only where it states neither of the
/// other two, as both together: the safe side); OpenAI states one token limit, which counts
/// the prompt and the `max_tokens` asked for, read as [`Combined`](TokenKind::Combined).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// Input tokens: `anthropic-ratelimit-input-tokens-*`.
    Input,
    /// Output tokens: `anthropic-ratelimit-output-tokens-*`.
    Output,
    /// Input and output together: `x-ratelimit-*-tokens`, and
    /// `anthropic-ratelimit-tokens-*` where no input or output window is stated.
    Combined,
}

impl TokenKind {
    /// Every kind, in the order of [`TokenKind::index`].
    pub const ALL: [TokenKind; 3] = [TokenKind::Input, TokenKind::Output, TokenKind::Combined];

    /// A short name: `input`, `output`, `combined`.
    pub fn as_str(&self) -> &'static str {
        match self {
            TokenKind::Input => "input",
            TokenKind::Output => "output",
            TokenKind::Combined => "combined",
        }
    }

    /// Its place in [`TokenKind::ALL`].
    pub fn index(&self) -> usize {
        match self {
            TokenKind::Input => 0,
            TokenKind::Output => 1,
            TokenKind::Combined => 2,
        }
    }
}

/// One token window as a response states it: the limit, what is left, and how long until it
/// is full again. Each part is `None` when absent or malformed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TokenWindow {
    pub(crate) limit: Option<u64>,
    pub(crate) remaining: Option<u64>,
    pub(crate) reset: Option<Duration>,
}

impl TokenWindow {
    /// Whether at most `1 / fraction` of the limit is left.
    pub(crate) fn nearly_spent(&self, fraction: u64) -> bool {
        match (self.limit, self.remaining) {
            (Some(limit), Some(left)) => left.saturating_mul(fraction) <= limit,
            _ => false,
        }
    }
}

/// The token windows a response states, read in one pass over its headers, Anthropic's
/// names before OpenAI's (OpenAI's one token limit is the combined window).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TokenHeaders {
    pub(crate) windows: [TokenWindow; 3],
}

impl TokenHeaders {
    /// Reads the token headers; `now` gives the instant an Anthropic reset (RFC 3339) is
    /// read against (the server's `Date` where it sent one), asked only when one is present.
    #[cfg(test)]
    pub(crate) fn read(headers: &HeaderMap, now: impl Fn() -> SystemTime) -> Self {
        Self::of(&RequestCounts::read(headers), now)
    }

    /// The token windows among the headers `counts` found (the first value of each name).
    pub(crate) fn of(counts: &RequestCounts<'_>, now: impl Fn() -> SystemTime) -> Self {
        let raw = counts
            .tokens
            .map(|kinds| kinds.map(|parts| parts.map(|v| v.map(|v| value_str(v).unwrap_or("")))));
        // Anthropic's `anthropic-ratelimit-tokens-*` state the most restrictive of its token
        // limits in effect, not a window of their own: beside its input and output windows
        // they are not read (as a window of input and output together, a prompt would be
        // charged against the output limit when that is the tighter one).
        let anthropic_split = raw[0][0][0].is_some() || raw[0][1][0].is_some();
        let mut found = TokenHeaders::default();
        for (k, w) in found.windows.iter_mut().enumerate() {
            let first = usize::from(k == TokenKind::Combined.index() && anthropic_split);
            let pick = |part: usize, parse: &dyn Fn(usize, &str) -> Option<u64>| {
                (first..2).find_map(|p| raw[p][k][part].and_then(|v| parse(p, v)))
            };
            w.limit = pick(0, &|_, v| parse_count(v).filter(|&n| n > 0));
            w.remaining = pick(1, &|_, v| parse_count(v));
            w.reset = (first..2).find_map(|p| {
                let v = raw[p][k][2]?;
                match p {
                    0 => parse_rfc3339(v)
                        .and_then(|at| at.duration_since(now()).ok())
                        .filter(|d| *d <= MAX_RESET),
                    _ => parse_duration(v),
                }
            });
        }
        found
    }

    /// The window of `kind`.
    pub(crate) fn window(&self, kind: TokenKind) -> &TokenWindow {
        &self.windows[kind.index()]
    }

    /// Whether any token limit is stated.
    pub(crate) fn states_a_limit(&self) -> bool {
        self.windows.iter().any(|w| w.limit.is_some())
    }

    /// The token limit a `429` with these headers was for: the first window (input, output,
    /// combined) whose remaining count reads 0.
    pub(crate) fn exhausted(&self) -> Option<TokenKind> {
        TokenKind::ALL
            .into_iter()
            .find(|k| self.window(*k).remaining == Some(0))
    }
}

/// The longest part of an error message read for the limit it names.
const MAX_MESSAGE_SCAN: usize = 2048;

/// The token limit an error message names, when it names one: Anthropic's "… 40,000 input
/// tokens per minute" and "… output tokens per minute", OpenAI's "… on tokens per min (TPM):
/// Limit 30000 …". A message about requests ("requests per min (RPM)") names none. Only the
/// first 2 KiB are read; matching ignores ASCII case.
pub(crate) fn token_limit_named(message: &str) -> Option<TokenKind> {
    let bytes = message.as_bytes();
    let bytes = &bytes[..bytes.len().min(MAX_MESSAGE_SCAN)];
    let has = |needle: &[u8]| {
        bytes
            .windows(needle.len())
            .any(|w| w.eq_ignore_ascii_case(needle))
    };
    if has(b"input tokens") || has(b"input_tokens") {
        Some(TokenKind::Input)
    } else if has(b"output tokens") || has(b"output_tokens") {
        Some(TokenKind::Output)
    } else if has(b"tokens per min") || has(b"(tpm)") || has(b"tokens per day") {
        Some(TokenKind::Combined)
    } else {
        None
    }
}

fn value_str(value: &HeaderValue) -> Option<&str> {
    value.to_str().ok().filter(|v| v.len() <= MAX_VALUE_LEN)
}

fn header<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a str> {
    headers
        .get(name)?
        .to_str()
        .ok()
        .filter(|v| v.len() <= MAX_VALUE_LEN)
}

/// A remaining-count header: a whole number, surrounding whitespace allowed.
pub(crate) fn parse_count(value: &str) -> Option<u64> {
    let v = value.trim();
    if v.is_empty() || v.len() > 20 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// A duration as OpenAI writes it (Go's `time.Duration` format): one or more
/// `<number><unit>` parts, units `h`, `m`, `s`, `ms`, `us` / `µs`, `ns`, numbers possibly
/// fractional: `1s`, `6m0s`, `547ms`, `2m52.8s`, `1h30m`. A bare `0` is zero.
///
/// Negative, malformed, overflowing values and values above [`MAX_RESET`] are `None`.
pub(crate) fn parse_duration(value: &str) -> Option<Duration> {
    let s = value.trim();
    if s.is_empty() || s.len() > MAX_VALUE_LEN {
        return None;
    }
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let mut rest = s;
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(digits);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "h" => 3_600_000_000_000,
            "m" => 60_000_000_000,
            "s" => 1_000_000_000,
            "ms" => 1_000_000,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ns" => 1,
            _ => return None,
        };
        total = total.checked_add(scaled(number, unit_nanos)?)?;
        rest = tail;
    }
    let d = Duration::from_nanos(u64::try_from(total).ok()?);
    (d <= MAX_RESET).then_some(d)
}

// `number` (digits with at most one dot, at least one digit; no sign, exponent, NaN or
// infinity) times `unit_nanos`, exactly, in nanoseconds. Fraction digits past nine are dropped.
fn scaled(number: &str, unit_nanos: u128) -> Option<u128> {
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() || int.len() > 20 || frac.contains('.') {
        return None;
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac = &frac[..frac.len().min(9)];
    let mut frac_value: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    for _ in frac.len()..9 {
        frac_value *= 10;
    }
    int.checked_mul(unit_nanos)?
        .checked_add(frac_value * unit_nanos / 1_000_000_000)
}

/// An RFC 3339 instant: `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`, as in
/// `2026-01-01T00:00:10Z` or `2026-01-01T01:00:10.5+01:00`. `t`, `z` and a space in place of
/// `T` are accepted; fields out of range (month 13, February 30, hour 24) are not. A leap
/// second (`:60`) is read as the last second of its minute.
pub(crate) fn parse_rfc3339(value: &str) -> Option<SystemTime> {
    let s = value.trim().as_bytes();
    if s.len() < 20 || s.len() > MAX_VALUE_LEN {
        return None;
    }
    let num = |range: std::ops::Range<usize>| -> Option<u32> {
        let part = s.get(range)?;
        if !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        Some(part.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')))
    };
    let year = num(0..4)?;
    let month = num(5..7)?;
    let day = num(8..10)?;
    let hour = num(11..13)?;
    let minute = num(14..16)?;
    let second = num(17..19)?;
    if s[4] != b'-' || s[7] != b'-' || !matches!(s[10], b'T' | b't' | b' ') {
        return None;
    }
    if s[13] != b':' || s[16] != b':' {
        return None;
    }
    if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut i = 19;
    let mut nanos = 0u32;
    if s[i] == b'.' {
        i += 1;
        let start = i;
        while i < s.len() && s[i].is_ascii_digit() {
            if i - start < 9 {
                nanos = nanos * 10 + u32::from(s[i] - b'0');
            }
            i += 1;
        }
        let digits = i - start;
        if digits == 0 {
            return None;
        }
        for _ in digits..9 {
            nanos *= 10;
        }
    }
    let offset_secs: i64 = match s.get(i..)? {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let digits = [*h1, *h2, *m1, *m2];
            if !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let h = i64::from((h1 - b'0') * 10 + (h2 - b'0'));
            let m = i64::from((m1 - b'0') * 10 + (m2 - b'0'));
            if h > 23 || m > 59 {
                return None;
            }
            let off = h * 3600 + m * 60;
            if *sign == b'+' {
                off
            } else {
                -off
            }
        }
        _ => return None,
    };
    let days = days_from_civil(i64::from(year), month, day);
    let secs =
        days * 86_400 + i64::from(hour) * 3600 + i64::from(minute) * 60 + i64::from(second.min(59))
            - offset_secs;
    let secs = u64::try_from(secs).ok()?;
    UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

fn is_leap(year: u32) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exhausted_openai_window_and_a_stated_limit() {
        let mut headers = HeaderMap::new();
        headers.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
        headers.insert("x-ratelimit-reset-requests", "2m52.8s".parse().unwrap());
        assert_eq!(
            requests_exhausted_for(&headers, SystemTime::now()),
            Some(Duration::from_millis(172_800)),
        );
        let mut headers = HeaderMap::new();
        headers.insert(
            "anthropic-ratelimit-requests-limit",
            "4000".parse().unwrap(),
        );
        assert_eq!(RequestCounts::read(&headers).limit(), Some(4000));
        headers.insert("anthropic-ratelimit-requests-limit", "-1".parse().unwrap());
        assert_eq!(RequestCounts::read(&headers).limit(), None);
    }
    use http::HeaderValue;

    // 2026-01-01T00:00:00Z
    const NOW: u64 = 1_767_225_600;

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(NOW)
    }

    fn ms(n: u64) -> Option<Duration> {
        Some(Duration::from_millis(n))
    }

    #[test]
    fn duration_table() {
        let cases: &[(&str, Option<Duration>)] = &[
            ("1s", ms(1000)),
            ("6m0s", ms(360_000)),
            ("547ms", ms(547)),
            ("2m52.8s", ms(172_800)),
            ("1h30m", ms(5_400_000)),
            ("0.5s", ms(500)),
            ("20us", Some(Duration::from_micros(20))),
            ("20µs", Some(Duration::from_micros(20))),
            ("15ns", Some(Duration::from_nanos(15))),
            (" 7s ", ms(7000)),
            ("0", Some(Duration::ZERO)),
            ("0s", Some(Duration::ZERO)),
            ("24h", ms(86_400_000)),
            // Malformed.
            ("", None),
            ("s", None),
            ("1", None),
            ("10", None),
            ("1x", None),
            ("1 s", None),
            ("1.2.3s", None),
            (".s", None),
            ("1e3s", None),
            ("NaNs", None),
            ("infs", None),
            ("1s2", None),
            ("abc", None),
            // Negative.
            ("-1s", None),
            ("-0.5s", None),
            // Huge, or past the bound.
            ("24h0m0.001s", None),
            ("25h", None),
            ("99999999999999999999h", None),
            ("9999999999999999999999999999s", None),
            (&"1s".repeat(40), None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_duration(input), *want, "{input:?}");
        }
    }

    #[test]
    fn rfc3339_table() {
        let at = |secs: u64, nanos: u32| Some(UNIX_EPOCH + Duration::new(secs, nanos));
        let cases: &[(&str, Option<SystemTime>)] = &[
            ("2026-01-01T00:00:10Z", at(NOW + 10, 0)),
            ("2026-01-01t00:00:10z", at(NOW + 10, 0)),
            ("2026-01-01 00:00:10Z", at(NOW + 10, 0)),
            ("2026-01-01T00:00:10.25Z", at(NOW + 10, 250_000_000)),
            (
                "2026-01-01T00:00:10.123456789123Z",
                at(NOW + 10, 123_456_789),
            ),
            ("2026-01-01T01:00:10+01:00", at(NOW + 10, 0)),
            ("2025-12-31T23:00:10-01:00", at(NOW + 10, 0)),
            ("1970-01-01T00:00:00Z", at(0, 0)),
            ("2024-02-29T00:00:00Z", at(1_709_164_800, 0)),
            ("2016-12-31T23:59:60Z", at(1_483_228_799, 0)),
            ("9999-12-31T23:59:59Z", at(253_402_300_799, 0)),
            // Malformed.
            ("", None),
            ("2026-01-01", None),
            ("2026-01-01T00:00:10", None),
            ("2026-01-01T00:00:10.Z", None),
            ("2026-01-01T00:00:10+0100", None),
            ("2026-01-01T00:00:10 Z", None),
            ("2026/01/01T00:00:10Z", None),
            ("2026-1-01T00:00:10Z", None),
            ("Thu, 01 Jan 2026 00:00:10 GMT", None),
            ("+026-01-01T00:00:10Z", None),
            ("2026-01-01T00:00:10ZZ", None),
            // Out of range.
            ("2026-13-01T00:00:00Z", None),
            ("2026-00-01T00:00:00Z", None),
            ("2025-02-29T00:00:00Z", None),
            ("2026-04-31T00:00:00Z", None),
            ("2026-01-01T24:00:00Z", None),
            ("2026-01-01T00:60:00Z", None),
            ("2026-01-01T00:00:61Z", None),
            ("2026-01-01T00:00:00+24:00", None),
            // Before the epoch.
            ("1969-12-31T23:59:59Z", None),
            // Too long.
            (&format!("2026-01-01T00:00:10.{}Z", "1".repeat(80)), None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_rfc3339(input), *want, "{input:?}");
        }
    }

    #[test]
    fn count_table() {
        assert_eq!(parse_count("0"), Some(0));
        assert_eq!(parse_count(" 12 "), Some(12));
        assert_eq!(parse_count("-1"), None);
        assert_eq!(parse_count("1.0"), None);
        assert_eq!(parse_count(""), None);
        assert_eq!(parse_count("99999999999999999999999"), None);
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
    fn exhausted_table() {
        type Case<'a> = (&'a [(&'a str, &'a str)], Option<Duration>);
        let cases: &[Case<'_>] = &[
            (
                &[
                    (ANTHROPIC_REQUESTS_REMAINING, "0"),
                    (ANTHROPIC_REQUESTS_RESET, "2026-01-01T00:00:10Z"),
                ],
                ms(10_000),
            ),
            (
                &[
                    (OPENAI_REQUESTS_REMAINING, "0"),
                    (OPENAI_REQUESTS_RESET, "6m0s"),
                ],
                ms(360_000),
            ),
            // Requests left: nothing to do.
            (
                &[
                    (ANTHROPIC_REQUESTS_REMAINING, "3"),
                    (ANTHROPIC_REQUESTS_RESET, "2026-01-01T00:00:10Z"),
                ],
                None,
            ),
            (
                &[
                    (OPENAI_REQUESTS_REMAINING, "1"),
                    (OPENAI_REQUESTS_RESET, "1s"),
                ],
                None,
            ),
            // A reset in the past, or now.
            (
                &[
                    (ANTHROPIC_REQUESTS_REMAINING, "0"),
                    (ANTHROPIC_REQUESTS_RESET, "2025-12-31T23:59:59Z"),
                ],
                None,
            ),
            (
                &[
                    (OPENAI_REQUESTS_REMAINING, "0"),
                    (OPENAI_REQUESTS_RESET, "0s"),
                ],
                None,
            ),
            // A reset too far away.
            (
                &[
                    (ANTHROPIC_REQUESTS_REMAINING, "0"),
                    (ANTHROPIC_REQUESTS_RESET, "2026-01-03T00:00:00Z"),
                ],
                None,
            ),
            // Half a pair, or garbage.
            (&[(ANTHROPIC_REQUESTS_REMAINING, "0")], None),
            (&[(OPENAI_REQUESTS_RESET, "1s")], None),
            (
                &[
                    (OPENAI_REQUESTS_REMAINING, "none"),
                    (OPENAI_REQUESTS_RESET, "1s"),
                ],
                None,
            ),
            (
                &[
                    (OPENAI_REQUESTS_REMAINING, "0"),
                    (OPENAI_REQUESTS_RESET, "soon"),
                ],
                None,
            ),
            // Anthropic's pair is malformed, OpenAI's is fine.
            (
                &[
                    (ANTHROPIC_REQUESTS_REMAINING, "0"),
                    (ANTHROPIC_REQUESTS_RESET, "tomorrow"),
                    (OPENAI_REQUESTS_REMAINING, "0"),
                    (OPENAI_REQUESTS_RESET, "547ms"),
                ],
                ms(547),
            ),
            (&[], None),
        ];
        for (pairs, want) in cases {
            assert_eq!(
                requests_exhausted_for(&headers(pairs), now()),
                *want,
                "{pairs:?}"
            );
        }
    }

    #[test]
    fn long_values_are_ignored() {
        let long = format!("{}1s", "0".repeat(MAX_VALUE_LEN));
        let h = headers(&[
            (OPENAI_REQUESTS_REMAINING, "0"),
            (OPENAI_REQUESTS_RESET, &long),
        ]);
        assert_eq!(requests_exhausted_for(&h, now()), None);
    }

    #[test]
    fn limit_table() {
        let cases: &[(&str, &str, Option<u64>)] = &[
            (ANTHROPIC_REQUESTS_LIMIT, "4000", Some(4000)),
            (OPENAI_REQUESTS_LIMIT, " 10000 ", Some(10_000)),
            (OPENAI_REQUESTS_LIMIT, "0", None),
            (OPENAI_REQUESTS_LIMIT, "-5", None),
            (OPENAI_REQUESTS_LIMIT, "12.5", None),
            (OPENAI_REQUESTS_LIMIT, "many", None),
            (OPENAI_REQUESTS_LIMIT, "", None),
            (OPENAI_REQUESTS_LIMIT, "99999999999999999999999", None),
            ("x-ratelimit-limit-tokens", "4000", None),
        ];
        for (name, value, want) in cases {
            let mut h = HeaderMap::new();
            h.insert(*name, HeaderValue::from_str(value).unwrap());
            assert_eq!(RequestCounts::read(&h).limit(), *want, "{name}: {value:?}");
        }
        // Anthropic's is read first; a malformed one falls back to OpenAI's.
        let mut h = HeaderMap::new();
        h.insert(ANTHROPIC_REQUESTS_LIMIT, HeaderValue::from_static("50"));
        h.insert(OPENAI_REQUESTS_LIMIT, HeaderValue::from_static("60"));
        assert_eq!(RequestCounts::read(&h).limit(), Some(50));
        h.insert(ANTHROPIC_REQUESTS_LIMIT, HeaderValue::from_static("fifty"));
        assert_eq!(RequestCounts::read(&h).limit(), Some(60));
        // Too long to read.
        let mut h = HeaderMap::new();
        let long = "1".repeat(MAX_VALUE_LEN + 1);
        h.insert(OPENAI_REQUESTS_LIMIT, HeaderValue::from_str(&long).unwrap());
        assert_eq!(RequestCounts::read(&h).limit(), None);
    }

    /// The one pass reads what a lookup of each name would: the first value of a repeated
    /// header, Anthropic's before OpenAI's, whatever their order in the map.
    #[test]
    fn counts_in_one_pass_match_lookups() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.append(OPENAI_REQUESTS_REMAINING, HeaderValue::from_static("7"));
        h.append(ANTHROPIC_REQUESTS_REMAINING, HeaderValue::from_static("3"));
        h.append(ANTHROPIC_REQUESTS_REMAINING, HeaderValue::from_static("9"));
        h.append(ANTHROPIC_REQUESTS_LIMIT, HeaderValue::from_static("50"));
        let counts = RequestCounts::read(&h);
        assert_eq!(counts.remaining(), Some(3));
        assert_eq!(counts.limit(), Some(50));
        assert!(counts.states_remaining());
        // A malformed Anthropic count falls back to OpenAI's, and still counts as stated.
        h.insert(
            ANTHROPIC_REQUESTS_REMAINING,
            HeaderValue::from_static("n/a"),
        );
        let counts = RequestCounts::read(&h);
        assert_eq!(counts.remaining(), Some(7));
        let mut h = HeaderMap::new();
        h.insert(
            ANTHROPIC_REQUESTS_REMAINING,
            HeaderValue::from_static("n/a"),
        );
        let counts = RequestCounts::read(&h);
        assert_eq!(
            (counts.remaining(), counts.states_remaining()),
            (None, true)
        );
        // Anthropic's first whatever the order in the map.
        let mut h = HeaderMap::new();
        h.insert(ANTHROPIC_REQUESTS_LIMIT, HeaderValue::from_static("50"));
        h.insert(OPENAI_REQUESTS_LIMIT, HeaderValue::from_static("60"));
        h.insert(ANTHROPIC_REQUESTS_REMAINING, HeaderValue::from_static("3"));
        h.insert(OPENAI_REQUESTS_REMAINING, HeaderValue::from_static("7"));
        let counts = RequestCounts::read(&h);
        assert_eq!((counts.limit(), counts.remaining()), (Some(50), Some(3)));
        let mut h = HeaderMap::new();
        h.insert(OPENAI_REQUESTS_LIMIT, HeaderValue::from_static("60"));
        h.insert(ANTHROPIC_REQUESTS_LIMIT, HeaderValue::from_static("50"));
        assert_eq!(RequestCounts::read(&h).limit(), Some(50));
        let empty = HeaderMap::new();
        let counts = RequestCounts::read(&empty);
        assert_eq!((counts.limit(), counts.remaining()), (None, None));
        assert!(!counts.states_remaining());
    }

    /// Real header sets of both providers: Anthropic's three windows with RFC 3339 resets,
    /// OpenAI's one token window with Go durations.
    #[test]
    fn token_headers_of_both_providers() {
        let h = headers(&[
            ("anthropic-ratelimit-requests-limit", "4000"),
            ("anthropic-ratelimit-input-tokens-limit", "2000000"),
            ("anthropic-ratelimit-input-tokens-remaining", "1999000"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2026-01-01T00:00:01Z",
            ),
            ("anthropic-ratelimit-output-tokens-limit", "400000"),
            ("anthropic-ratelimit-output-tokens-remaining", "400000"),
            (
                "anthropic-ratelimit-output-tokens-reset",
                "2026-01-01T00:00:00Z",
            ),
            ("anthropic-ratelimit-tokens-limit", "2400000"),
            ("anthropic-ratelimit-tokens-remaining", "2399000"),
            ("anthropic-ratelimit-tokens-reset", "2026-01-01T00:00:01.5Z"),
        ]);
        let t = TokenHeaders::read(&h, now);
        assert_eq!(
            *t.window(TokenKind::Input),
            TokenWindow {
                limit: Some(2_000_000),
                remaining: Some(1_999_000),
                reset: ms(1000),
            }
        );
        assert_eq!(t.window(TokenKind::Output).reset, Some(Duration::ZERO));
        // Beside the input and output windows, `tokens-*` (the most restrictive of them) is
        // no window of its own.
        assert_eq!(*t.window(TokenKind::Combined), TokenWindow::default());
        assert!(t.states_a_limit());
        assert_eq!(t.exhausted(), None);
        // Alone, it is read as input and output together (the safe side).
        let h = headers(&[
            ("anthropic-ratelimit-tokens-limit", "2400000"),
            ("anthropic-ratelimit-tokens-remaining", "2399000"),
            ("anthropic-ratelimit-tokens-reset", "2026-01-01T00:00:01.5Z"),
        ]);
        let t = TokenHeaders::read(&h, now);
        assert_eq!(t.window(TokenKind::Combined).limit, Some(2_400_000));
        assert_eq!(t.window(TokenKind::Combined).reset, ms(1500));
        let h = headers(&[
            ("x-ratelimit-limit-requests", "10000"),
            ("x-ratelimit-limit-tokens", "30000000"),
            ("x-ratelimit-remaining-requests", "9999"),
            ("x-ratelimit-remaining-tokens", "29999000"),
            ("x-ratelimit-reset-requests", "6ms"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let t = TokenHeaders::read(&h, now);
        assert_eq!(
            *t.window(TokenKind::Combined),
            TokenWindow {
                limit: Some(30_000_000),
                remaining: Some(29_999_000),
                reset: ms(360_000),
            }
        );
        assert_eq!(*t.window(TokenKind::Input), TokenWindow::default());
        for (v, want) in [("1.5s", ms(1500)), ("120ms", ms(120)), ("0s", ms(0))] {
            let h = headers(&[("x-ratelimit-reset-tokens", v)]);
            assert_eq!(TokenHeaders::read(&h, now).windows[2].reset, want, "{v}");
        }
        // A token 429 says which window is spent; a request 429 names none.
        let h = headers(&[
            ("anthropic-ratelimit-input-tokens-limit", "30000"),
            ("anthropic-ratelimit-input-tokens-remaining", "0"),
            ("anthropic-ratelimit-output-tokens-remaining", "8000"),
        ]);
        assert_eq!(
            TokenHeaders::read(&h, now).exhausted(),
            Some(TokenKind::Input)
        );
        let h = headers(&[
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-input-tokens-remaining", "29000"),
            ("anthropic-ratelimit-output-tokens-remaining", "8000"),
        ]);
        assert_eq!(TokenHeaders::read(&h, now).exhausted(), None);
        let h = headers(&[("x-ratelimit-remaining-tokens", "0")]);
        assert_eq!(
            TokenHeaders::read(&h, now).exhausted(),
            Some(TokenKind::Combined)
        );
    }

    /// Hostile values count as absent, one part at a time; Anthropic's value wins over
    /// OpenAI's whatever their order, and a malformed one falls back to it.
    #[test]
    fn token_headers_hostile() {
        let long = "9".repeat(MAX_VALUE_LEN + 1);
        let cases: &[(&str, &str)] = &[
            ("anthropic-ratelimit-input-tokens-limit", "-1"),
            ("anthropic-ratelimit-input-tokens-limit", "0"),
            ("anthropic-ratelimit-input-tokens-limit", "1e6"),
            (
                "anthropic-ratelimit-input-tokens-limit",
                "99999999999999999999999",
            ),
            ("anthropic-ratelimit-input-tokens-limit", &long),
            ("anthropic-ratelimit-input-tokens-remaining", "NaN"),
            ("anthropic-ratelimit-input-tokens-remaining", "1.5"),
            ("anthropic-ratelimit-input-tokens-reset", "soon"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2025-12-31T23:59:59Z",
            ),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2026-01-05T00:00:00Z",
            ),
            ("anthropic-ratelimit-input-tokens-reset", "6m0s"),
            ("anthropic-ratelimit-input-tokens-sometime", "5"),
            ("anthropic-ratelimit-inputtokens-limit", "5"),
            ("x-ratelimit-reset-tokens", "-1s"),
            ("x-ratelimit-reset-tokens", "25h"),
            ("x-ratelimit-reset-tokens", "1"),
            ("x-ratelimit-reset-tokens", "2026-01-01T00:00:01Z"),
            ("x-ratelimit-limit-tokens_usage_based", "5"),
            ("x-ratelimit-remaining-tokens", "-3"),
        ];
        for (name, value) in cases {
            let t = TokenHeaders::read(&headers(&[(name, value)]), now);
            assert_eq!(t, TokenHeaders::default(), "{name}: {value:?}");
        }
        // Non-UTF-8 bytes.
        let mut h = HeaderMap::new();
        h.insert(
            "x-ratelimit-limit-tokens",
            HeaderValue::from_bytes(b"\xff\xfe12").unwrap(),
        );
        assert_eq!(TokenHeaders::read(&h, now), TokenHeaders::default());
        // Anthropic's combined window first, whatever the order; a malformed one falls back.
        let h = headers(&[
            ("x-ratelimit-limit-tokens", "60"),
            ("anthropic-ratelimit-tokens-limit", "50"),
        ]);
        assert_eq!(TokenHeaders::read(&h, now).windows[2].limit, Some(50));
        let h = headers(&[
            ("anthropic-ratelimit-tokens-limit", "fifty"),
            ("x-ratelimit-limit-tokens", "60"),
        ]);
        assert_eq!(TokenHeaders::read(&h, now).windows[2].limit, Some(60));
        // The first value of a repeated name.
        let h = headers(&[
            ("anthropic-ratelimit-input-tokens-remaining", "3"),
            ("anthropic-ratelimit-input-tokens-remaining", "0"),
        ]);
        assert_eq!(TokenHeaders::read(&h, now).exhausted(), None);
        // Nearly spent: a tenth or less of the limit left.
        let w = |limit, remaining| TokenWindow {
            limit: Some(limit),
            remaining: Some(remaining),
            reset: None,
        };
        assert!(w(1000, 100).nearly_spent(10));
        assert!(!w(1000, 101).nearly_spent(10));
        assert!(w(u64::MAX, u64::MAX / 10).nearly_spent(10));
        assert!(!TokenWindow::default().nearly_spent(10));
    }

    /// The messages of a token 429 name their limit; a request 429's names none.
    #[test]
    fn token_limit_named_in_messages() {
        let cases: &[(&str, Option<TokenKind>)] = &[
            (
                "This request would exceed the rate limit for your organization \
                 (8f7e) of 40,000 input tokens per minute. For details, refer to: \
                 https://docs.anthropic.com/en/api/rate-limits.",
                Some(TokenKind::Input),
            ),
            (
                "This request would exceed the rate limit for your organization \
                 (8f7e) of 8,000 output tokens per minute.",
                Some(TokenKind::Output),
            ),
            (
                "Rate limit reached for gpt-4o in organization org-abc on tokens per min \
                 (TPM): Limit 30000, Used 29000, Requested 2000. Please try again in 2s.",
                Some(TokenKind::Combined),
            ),
            (
                "Rate limit reached for gpt-4o in organization org-abc on requests per min \
                 (RPM): Limit 500, Used 500, Requested 1.",
                None,
            ),
            (
                "Number of request tokens has exceeded your per-minute rate limit",
                None,
            ),
            ("", None),
            ("INPUT TOKENS", Some(TokenKind::Input)),
            ("ünïcödé ✓ output tokens", Some(TokenKind::Output)),
        ];
        for (message, want) in cases {
            assert_eq!(token_limit_named(message), *want, "{message}");
        }
        // Only the start of a long message is read.
        let long = format!("{}input tokens", "x".repeat(MAX_MESSAGE_SCAN));
        assert_eq!(token_limit_named(&long), None);
    }
}
