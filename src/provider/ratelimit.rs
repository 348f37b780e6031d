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
}

impl<'a> RequestCounts<'a> {
    pub(crate) fn read(headers: &'a HeaderMap) -> Self {
        let mut counts = RequestCounts::default();
        for (name, value) in headers {
            let slot = match name.as_str() {
                ANTHROPIC_REQUESTS_LIMIT => &mut counts.anthropic_limit,
                OPENAI_REQUESTS_LIMIT => &mut counts.openai_limit,
                ANTHROPIC_REQUESTS_REMAINING => &mut counts.anthropic_remaining,
                OPENAI_REQUESTS_REMAINING => &mut counts.openai_remaining,
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

    /// Whether either provider's remaining-count header is present, well formed or not.
    pub(crate) fn states_remaining(&self) -> bool {
        self.anthropic_remaining.is_some() || self.openai_remaining.is_some()
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
}
