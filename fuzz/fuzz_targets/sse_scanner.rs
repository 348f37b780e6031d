//! The SSE scanner and the default event verdict: never panic, stay within their bound, and
//! find the same events however the input is split.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_llm_retry::stream::SseScanner;
use tower_llm_retry::classify::{Classify, DefaultClassifier};

fuzz_target!(|data: &[u8]| {
    let Some((&cut, stream)) = data.split_first() else {
        return;
    };
    let classifier = DefaultClassifier::new();
    let mut whole = Vec::new();
    let mut s = SseScanner::new(1 << 16);
    let whole_ok = s
        .push::<()>(stream, |e| {
            let _ = classifier.classify_sse_event(e);
            whole.push((e.event.clone().map(|c| c.into_owned()), e.data.to_string()));
            None
        })
        .is_ok();
    let at = (cut as usize).min(stream.len());
    let mut split = Vec::new();
    let mut s = SseScanner::new(1 << 16);
    let mut split_ok = true;
    for part in [&stream[..at], &stream[at..]] {
        split_ok &= s
            .push::<()>(part, |e| {
                split.push((e.event.clone().map(|c| c.into_owned()), e.data.to_string()));
                None
            })
            .is_ok();
    }
    if whole_ok && split_ok {
        assert_eq!(whole, split);
    }
});
