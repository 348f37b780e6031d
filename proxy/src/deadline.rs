//! The client's deadline: the timeout an SDK advertises with each request (or the one the
//! request names in `x-llm-retry-deadline`, or the upstream's `deadline_secs`), less a margin
//! for the answer to travel back, bounds the proxy's retry loop for that request, so the
//! proxy gives up and answers before the client stops waiting.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::forward::{CLIENT_DEADLINE, CLIENT_DEADLINE_NAME};

/// The official Python SDKs' read timeout, in seconds (OpenAI's and Anthropic's).
pub const SDK_READ_TIMEOUT: &str = "x-stainless-read-timeout";
/// Anthropic's Python SDK's timeout, in seconds.
pub const SDK_TIMEOUT: &str = "x-stainless-timeout";
/// The two SDK headers as names, parsed once.
const SDK_TIMEOUT_NAMES: [HeaderName; 2] = [
    HeaderName::from_static(SDK_READ_TIMEOUT),
    HeaderName::from_static(SDK_TIMEOUT),
];

/// The longest deadline a header may state: anything above a day is a mistake, not a wish.
const LONGEST: f64 = 86_400.0;

/// What is kept back from a deadline for the answer to reach the client: 5 % of it, at least
/// 1 s, and never more than half of it.
///
/// Why these figures: an error answer is small, but it still has to cross the network back,
/// be parsed by the SDK and, for a long timeout, may sit behind a slow client link or a
/// proxy in between: 1 s covers a round trip and the SDK's own work with room to spare, and
/// 5 % scales it for long timeouts, where the clocks of a loaded client and the proxy (and a
/// final attempt's own head) drift further apart. The half cap keeps a short timeout useful:
/// a client that waits 1 s still gets an attempt of 0.5 s rather than none.
pub fn margin(timeout: Duration) -> Duration {
    (timeout / 20).max(Duration::from_secs(1)).min(timeout / 2)
}

/// `timeout` less its [`margin`]: how long the retry loop may run for a client that waits
/// `timeout`.
pub fn bound(timeout: Duration) -> Duration {
    timeout.saturating_sub(margin(timeout))
}

/// A header's seconds, when they make sense as a deadline: a finite number above 0 and at
/// most a day.
fn seconds(value: &HeaderValue) -> Option<Duration> {
    let secs: f64 = value.to_str().ok()?.trim().parse().ok()?;
    if !(secs > 0.0 && secs <= LONGEST) {
        // Also refuses NaN, which compares false with everything.
        return None;
    }
    Duration::try_from_secs_f64(secs).ok()
}

/// The timeout the request's client stated: the smallest of `x-llm-retry-deadline` (ours:
/// a value that is not a deadline is an error, the message to send back) and, when
/// `honour_sdk`, the SDKs' `x-stainless-read-timeout` and `x-stainless-timeout` (theirs:
/// a value that is not a deadline is ignored; a request is never refused for them).
pub fn requested(headers: &HeaderMap, honour_sdk: bool) -> Result<Option<Duration>, String> {
    let ours = match headers.get(CLIENT_DEADLINE_NAME) {
        None => None,
        Some(v) => Some(seconds(v).ok_or_else(|| {
            format!("{CLIENT_DEADLINE} must be a number of seconds above 0 and at most 86400")
        })?),
    };
    let sdk = honour_sdk.then(|| {
        SDK_TIMEOUT_NAMES
            .iter()
            .filter_map(|name| headers.get(name).and_then(seconds))
            .min()
    });
    Ok([ours, sdk.flatten()].into_iter().flatten().min())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn the_margin_is_five_percent_at_least_a_second_at_most_half() {
        let s = Duration::from_secs_f64;
        for (timeout, bounded) in [
            (600.0, 570.0),
            (60.0, 57.0),
            (20.0, 19.0),
            (6.0, 5.0),
            (2.0, 1.0),
            (1.0, 0.5),
            (0.2, 0.1),
        ] {
            assert_eq!(bound(s(timeout)), s(bounded), "{timeout}");
        }
    }

    #[test]
    fn the_smallest_sensible_value_wins() {
        let h = headers(&[
            (SDK_READ_TIMEOUT, "60"),
            (SDK_TIMEOUT, "30.5"),
            (CLIENT_DEADLINE, "45"),
        ]);
        assert_eq!(requested(&h, true), Ok(Some(Duration::from_secs_f64(30.5))));
        // The SDKs' headers not honoured: ours alone.
        assert_eq!(requested(&h, false), Ok(Some(Duration::from_secs(45))));
        assert_eq!(requested(&HeaderMap::new(), true), Ok(None));
    }

    #[test]
    fn a_senseless_sdk_value_is_ignored_and_ours_refused() {
        for bad in [
            "",
            "abc",
            "0",
            "-5",
            "NaN",
            "inf",
            "86401",
            "1e9",
            "NOT_GIVEN",
            "None",
        ] {
            let value = HeaderValue::from_str(bad).unwrap();
            let mut h = HeaderMap::new();
            h.insert(SDK_READ_TIMEOUT, value.clone());
            h.insert(SDK_TIMEOUT, value.clone());
            assert_eq!(requested(&h, true), Ok(None), "{bad:?}");
            h.insert(SDK_TIMEOUT, HeaderValue::from_static("7"));
            assert_eq!(
                requested(&h, true),
                Ok(Some(Duration::from_secs(7))),
                "{bad:?}"
            );
            let mut h = HeaderMap::new();
            h.insert(CLIENT_DEADLINE, value);
            let e = requested(&h, true).unwrap_err();
            assert!(e.contains(CLIENT_DEADLINE), "{bad:?}: {e}");
        }
        assert_eq!(
            requested(&headers(&[(CLIENT_DEADLINE, " 86400 ")]), true),
            Ok(Some(Duration::from_secs(86_400)))
        );
    }
}
