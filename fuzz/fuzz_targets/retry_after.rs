//! `Retry-After`, `retry-after-ms` and `x-amz-retry-after` parsing: never panics, never
//! overflows.
#![no_main]

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_llm_retry::classify::headers::{parse_retry_after, parse_should_retry};

fuzz_target!(|data: &[u8]| {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let (first, second) = data.split_at(data.len() / 2);
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_bytes(first) {
        headers.append("retry-after", v.clone());
        headers.append("x-should-retry", v);
    }
    if let Ok(v) = HeaderValue::from_bytes(second) {
        headers.append("x-amz-retry-after", v.clone());
        headers.append("retry-after-ms", v);
    }
    if let Some(d) = parse_retry_after(&headers, now) {
        assert!(d.as_secs_f64().is_finite());
    }
    let _ = parse_should_retry(&headers);
});
