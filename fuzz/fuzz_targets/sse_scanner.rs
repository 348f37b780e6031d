//! The SSE scanner and the default event verdict: never panic, stay within their bound, and
//! find the same events however the input is split, the ones its end completes included.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_llm_retry::classify::{Classify, DefaultClassifier};
use tower_llm_retry::stream::SseScanner;

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
        .is_ok()
        && s.finish::<()>(|e| {
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
    // The end of the stream: the event a lone `\r` as the last byte completes, held by `push`.
    split_ok = split_ok
        && s.finish::<()>(|e| {
            split.push((e.event.clone().map(|c| c.into_owned()), e.data.to_string()));
            None
        })
        .is_ok();
    if whole_ok && split_ok {
        assert_eq!(whole, split);
    }
    // A stream ending in a lone `\r` ends its line there: `finish` hands on what a `\n` after
    // it would have completed. Checked on the input followed by an event whose blank line is
    // that lone `\r`, so that every input reaches that end.
    let ended = [stream, b"\ndata: end\n\r"].concat();
    let events = |input: &[u8], finish: bool| {
        let mut found = Vec::new();
        let mut s = SseScanner::new(1 << 16);
        let mut record = |e: &tower_llm_retry::stream::SseEvent<'_>| {
            found.push((e.event.clone().map(|c| c.into_owned()), e.data.to_string()));
            None::<()>
        };
        let ok = s.push(input, &mut record).is_ok() && (!finish || s.finish(&mut record).is_ok());
        ok.then_some(found)
    };
    if let (Some(finished), Some(closed)) = (
        events(&ended, true),
        events(&[&ended[..], b"\n"].concat(), false),
    ) {
        assert_eq!(finished, closed);
    }
});
