//! An incremental Server-Sent Events scanner: finds event boundaries in a byte stream that
//! arrives in arbitrary chunks, without copying the stream itself.
//!
//! The work is linear in the bytes fed, however they are chunked: the search for the blank
//! line that ends an event resumes where the previous chunk left it, and the bytes of finished
//! events are dropped, so a stream of any length is scanned once.

use std::borrow::Cow;
#[cfg(test)]
use std::cell::Cell;
use std::ops::Range;

/// One parsed event: its `event:` name, if any, and its `data:` lines joined with `\n`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent<'a> {
    /// The `event:` field; `None` when absent (the SSE default type, "message").
    pub event: Option<Cow<'a, str>>,
    /// The `data:` fields, joined with `\n`.
    pub data: Cow<'a, str>,
}

impl SseEvent<'_> {
    /// Whether the event carried neither a name nor data (a comment-only block, or a
    /// keep-alive).
    pub fn is_empty(&self) -> bool {
        self.event.is_none() && self.data.is_empty()
    }
}

/// Splits a byte stream into SSE event blocks.
///
/// Feed chunks with [`SseScanner::push`]; each complete block (ended by a blank line) is
/// returned parsed. The bytes of finished events are dropped; the event still in progress may
/// hold at most `limit` bytes: a longer event makes `push` report [`ScanError::TooLong`].
#[derive(Debug, Clone)]
#[cfg_attr(not(fuzzing), allow(unreachable_pub))]
pub struct SseScanner {
    /// `pending[start..]` is the unfinished event; what comes before it are finished events
    /// not dropped yet (see [`SseScanner::compact`]).
    pending: Vec<u8>,
    start: usize,
    /// How many bytes of the unfinished event the blank-line search has read, and what it
    /// found there.
    scanned: usize,
    state: Scan,
    limit: usize,
    /// Whether the start of the stream has been looked at for a byte order mark, which the
    /// SSE rules strip (else the first line's field name would begin with it).
    bom_checked: bool,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Where the blank-line search stopped. A line ends with `\n`, `\r\n` or `\r`; an event
/// ends with an empty line, so with two line ends in a row. `at` is where the first of the
/// two began (counted from the start of the unfinished event): where the event's bytes end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// Inside a line, or at the start of the event.
    Text,
    /// A line ended with `\r`, which may be the first half of `\r\n`.
    Cr { at: usize },
    /// A line ended: one more line end finishes the event.
    LineEnd { at: usize },
    /// A line ended and a `\r` followed: the event is finished, but the next byte says
    /// whether that `\r` is half of `\r\n`, and so where the next event starts.
    BlankCr { at: usize },
}

/// The scanner gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(fuzzing), allow(unreachable_pub))]
pub enum ScanError {
    /// One event grew past the scanner's limit.
    TooLong,
}

#[cfg_attr(not(fuzzing), allow(unreachable_pub))]
impl SseScanner {
    /// A scanner holding at most `limit` bytes of one unfinished event.
    pub fn new(limit: usize) -> Self {
        SseScanner {
            pending: Vec::new(),
            start: 0,
            scanned: 0,
            state: Scan::Text,
            limit,
            bom_checked: false,
        }
    }

    /// Changes how many bytes of one unfinished event may be held.
    pub(crate) fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Feeds `chunk`, calling `on_event` with each event it completes, in order. Stops early
    /// and returns `Ok(Some(v))` as soon as `on_event` returns `Some(v)`.
    pub fn push<T>(
        &mut self,
        chunk: &[u8],
        mut on_event: impl FnMut(&SseEvent<'_>) -> Option<T>,
    ) -> Result<Option<T>, ScanError> {
        self.pending.extend_from_slice(chunk);
        if !self.bom_checked {
            let have = self.pending.len().min(BOM.len());
            if self.pending[..have] != BOM[..have] {
                self.bom_checked = true;
            } else if have == BOM.len() {
                self.pending.drain(..BOM.len());
                self.bom_checked = true;
            } else {
                // Perhaps the start of one: nothing to scan until it is known.
                return Ok(None);
            }
        }
        let mut result = None;
        while let Some(block) = self.next_block() {
            let event = parse_block(&self.pending[block]);
            if !event.is_empty() {
                if let Some(v) = on_event(&event) {
                    result = Some(v);
                    break;
                }
            }
        }
        self.compact();
        if result.is_none() && self.pending.len() - self.start > self.limit {
            return Err(ScanError::TooLong);
        }
        Ok(result)
    }

    /// At the end of the stream: the events [`push`](Self::push) left pending, then an event
    /// whose blank line ended in a lone `\r` as the stream's last byte (a complete line end
    /// in SSE, which `push` holds until the next byte says whether it was half of `\r\n`).
    /// An unfinished event without its blank line is dropped, as the SSE rules say.
    pub fn finish<T>(
        &mut self,
        mut on_event: impl FnMut(&SseEvent<'_>) -> Option<T>,
    ) -> Result<Option<T>, ScanError> {
        if let Some(v) = self.push(&[], &mut on_event)? {
            return Ok(Some(v));
        }
        let Scan::BlankCr { at } = self.state else {
            return Ok(None);
        };
        if self.scanned != self.pending.len() - self.start {
            return Ok(None);
        }
        let block = self.start..self.start + at;
        self.start = self.pending.len();
        (self.scanned, self.state) = (0, Scan::Text);
        let event = parse_block(&self.pending[block]);
        Ok(if event.is_empty() {
            None
        } else {
            on_event(&event)
        })
    }

    /// Searches on for the blank line that ends the unfinished event, from where the last
    /// search stopped. When found, moves past it and returns the event's bytes.
    fn next_block(&mut self) -> Option<Range<usize>> {
        let rest = &self.pending[self.start..];
        let (mut i, mut state) = (self.scanned, self.state);
        let found = loop {
            let Some(&b) = rest.get(i) else { break None };
            state = match (state, b) {
                (Scan::Text, b'\n') => Scan::LineEnd { at: i },
                (Scan::Text, b'\r') => Scan::Cr { at: i },
                (Scan::Cr { at }, b'\n') => Scan::LineEnd { at },
                (Scan::Cr { at } | Scan::LineEnd { at }, b'\r') => Scan::BlankCr { at },
                (Scan::LineEnd { at } | Scan::BlankCr { at }, b'\n') => break Some((at, i + 1)),
                // A `\r` alone ended the blank line; `b` starts the next event.
                (Scan::BlankCr { at }, _) => break Some((at, i)),
                _ => Scan::Text,
            };
            i += 1;
        };
        let Some((end, next)) = found else {
            work(rest.len() - self.scanned);
            (self.scanned, self.state) = (rest.len(), state);
            return None;
        };
        work(i + 1 - self.scanned);
        let block = self.start..self.start + end;
        self.start += next;
        (self.scanned, self.state) = (0, Scan::Text);
        Some(block)
    }

    /// Drops the finished events' bytes once they are at least as many as the unfinished
    /// event's: the bytes moved are then never more than the bytes dropped, so compacting
    /// stays linear even when `on_event` stops early and leaves finished events behind.
    fn compact(&mut self) {
        let unfinished = self.pending.len() - self.start;
        if self.start > 0 && self.start >= unfinished {
            work(unfinished);
            self.pending.drain(..self.start);
            self.start = 0;
        }
    }
}

pub(crate) fn parse_block(block: &[u8]) -> SseEvent<'_> {
    let mut event = None;
    // The data lines, joined once at the end: one line is borrowed, more are copied once.
    let mut first_data = None;
    let mut more_data = Vec::new();
    work(block.len());
    for line in block.split(|b| *b == b'\n' || *b == b'\r') {
        if line.is_empty() || line[0] == b':' {
            continue;
        }
        let colon = line.iter().position(|b| *b == b':');
        work(colon.map_or(line.len(), |p| p + 1));
        let (field, value) = match colon {
            Some(p) => {
                let v = &line[p + 1..];
                (&line[..p], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"event" => {
                work(value.len());
                event = Some(String::from_utf8_lossy(value));
            }
            b"data" if first_data.is_none() => first_data = Some(value),
            b"data" => more_data.push(value),
            _ => {}
        }
    }
    let data = match first_data {
        None => Cow::Borrowed(""),
        Some(line) if more_data.is_empty() => {
            work(line.len());
            String::from_utf8_lossy(line)
        }
        Some(line) => {
            let len = more_data.iter().map(|l| 1 + l.len()).sum::<usize>() + line.len();
            work(2 * len);
            let mut data = String::with_capacity(len);
            data.push_str(&String::from_utf8_lossy(line));
            for line in more_data {
                data.push('\n');
                data.push_str(&String::from_utf8_lossy(line));
            }
            Cow::Owned(data)
        }
    };
    SseEvent { event, data }
}

// Bytes the scanner read or moved, counted in tests so they can assert the work is linear.
#[cfg(test)]
thread_local! {
    static WORK: Cell<usize> = const { Cell::new(0) };
}

fn work(bytes: usize) {
    #[cfg(test)]
    WORK.with(|w| w.set(w.get() + bytes));
    let _ = bytes;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn events(chunks: &[&[u8]]) -> Vec<(Option<String>, String)> {
        let mut s = SseScanner::new(1 << 16);
        let mut out = Vec::new();
        for c in chunks {
            s.push::<()>(c, |e| {
                out.push((e.event.as_deref().map(str::to_owned), e.data.to_string()));
                None
            })
            .unwrap();
        }
        out
    }

    /// The scanner's work while `f` runs, in bytes read or moved (see [`work`]).
    fn work_done(f: impl FnOnce()) -> usize {
        WORK.with(|w| w.set(0));
        f();
        WORK.with(Cell::get)
    }

    #[test]
    fn a_byte_order_mark_at_the_start_is_stripped_however_it_is_split() {
        let stream =
            b"\xEF\xBB\xBFevent: message_start\ndata: {}\n\nevent: ping\ndata: \xEF\xBB\xBF\n\n";
        for split in 0..=stream.len() {
            let got = events(&[&stream[..split], &stream[split..]]);
            assert_eq!(
                got,
                [
                    (Some("message_start".to_owned()), "{}".to_owned()),
                    // Only the stream's first bytes: a mark inside is data.
                    (Some("ping".to_owned()), "\u{feff}".to_owned()),
                ],
                "split at {split}"
            );
        }
        // Bytes that only begin like one are kept.
        assert_eq!(
            events(&[b"\xEF", b"x: 1\ndata: a\n\n"]),
            [(None, "a".to_owned())]
        );
    }

    #[test]
    fn finish_hands_on_a_last_event_ended_by_a_lone_cr() {
        let mut s = SseScanner::new(1 << 16);
        let mut got = Vec::new();
        s.push::<()>(b"data: a\r\rdata: b\r\r", |e| {
            got.push(e.data.to_string());
            None
        })
        .unwrap();
        // `a` is out (`d` followed its `\r`); `b` waits for a byte that never comes.
        assert_eq!(got, ["a"]);
        s.finish::<()>(|e| {
            got.push(e.data.to_string());
            None
        })
        .unwrap();
        assert_eq!(got, ["a", "b"]);
        // Once only, and an unfinished event (no blank line) is not one.
        assert_eq!(s.finish(|e| Some(e.data.to_string())).unwrap(), None);
        let mut s = SseScanner::new(1 << 16);
        s.push::<()>(b"data: c\r", |_| None).unwrap();
        assert_eq!(s.finish(|e| Some(e.data.to_string())).unwrap(), None);
    }

    #[test]
    fn splits_on_blank_lines_across_chunks() {
        let got = events(&[
            b"event: ping\nda",
            b"ta: {}\n",
            b"\n: comment\n\ndata: a\ndata: b\n\n",
            b"event: x\r\ndata: 1\r\n\r\n",
            b"data: cr\r\rdata:nospace\n\n",
        ]);
        assert_eq!(
            got,
            [
                (Some("ping".into()), "{}".into()),
                (None, "a\nb".into()),
                (Some("x".into()), "1".into()),
                (None, "cr".into()),
                (None, "nospace".into()),
            ]
        );
    }

    #[test]
    fn crlf_split_between_chunks() {
        let got = events(&[b"data: 1\r", b"\n\r", b"\n"]);
        assert_eq!(got, [(None, "1".into())]);
    }

    #[test]
    fn lone_cr_at_the_end_waits_for_the_next_chunk() {
        // `\r` then `\r`: two line ends, so the event is finished, but only the next byte says
        // whether the second `\r` is half of `\r\n`.
        let got = events(&[b"data: 1\r", b"\r"]);
        assert_eq!(got, []);
        let got = events(&[b"data: 1\r", b"\r", b"\n", b"data: 2\r", b"\r", b"x"]);
        assert_eq!(got, [(None, "1".into()), (None, "2".into())]);
    }

    #[test]
    fn bounded() {
        let mut s = SseScanner::new(10);
        assert_eq!(
            s.push::<()>(b"data: 0123456789abcdef", |_| None),
            Err(ScanError::TooLong)
        );
    }

    #[test]
    fn bounded_by_the_unfinished_event_only() {
        let mut s = SseScanner::new(10);
        // Finished events do not count, however many arrive in one chunk.
        assert_eq!(
            s.push::<()>(&b"data: 12\n\n".repeat(100), |_| None),
            Ok(None)
        );
        // One byte at a time, the limit is passed by the eleventh byte of the unfinished event.
        for (i, b) in b"data: 0123456789abcdef".iter().enumerate() {
            let r = s.push::<()>(&[*b], |_| None);
            assert_eq!(r.is_err(), i >= 10, "byte {i}");
        }
    }

    #[test]
    fn stops_at_the_first_match() {
        let mut s = SseScanner::new(100);
        let r = s
            .push(b"data: 1\n\ndata: 2\n\ndata: 3\n\n", |e| {
                (e.data == "2").then_some(2)
            })
            .unwrap();
        assert_eq!(r, Some(2));
        // What followed the match is kept, and found by the next push.
        let r = s.push(b"", |e| Some(e.data.to_string())).unwrap();
        assert_eq!(r.as_deref(), Some("3"));
    }

    #[test]
    fn one_byte_chunks_cost_linear_work() {
        // The peek's worst case: a 64 KiB event that arrives one byte at a time.
        let mut input = b"data: ".to_vec();
        input.resize(6 + (64 << 10), b'x');
        input.extend_from_slice(b"\n\n");
        let mut s = SseScanner::new(1 << 17);
        let mut got = Vec::new();
        let work = work_done(|| {
            for b in &input {
                s.push::<()>(&[*b], |e| {
                    got.push(e.data.len());
                    None
                })
                .unwrap();
            }
        });
        assert_eq!(got, [64 << 10]);
        eprintln!(
            "64 KiB event in 1-byte chunks: {work} bytes of work for {}",
            input.len()
        );
        assert!(work <= 4 * input.len(), "{work} for {} bytes", input.len());
    }

    #[test]
    fn many_data_lines_are_joined_in_linear_work() {
        let lines = 8 << 10;
        let mut input = b"data: x\n".repeat(lines);
        input.push(b'\n');
        let mut s = SseScanner::new(1 << 17);
        let mut got = None;
        let work = work_done(|| {
            s.push::<()>(&input, |e| {
                got = Some(e.data.to_string());
                None
            })
            .unwrap();
        });
        assert_eq!(got, Some(vec!["x"; lines].join("\n")));
        eprintln!(
            "{lines} data lines: {work} bytes of work for {}",
            input.len()
        );
        assert!(work <= 4 * input.len(), "{work} for {} bytes", input.len());
    }

    #[test]
    fn a_long_stream_costs_linear_work_and_holds_one_event() {
        // Far longer than the limit in all, each event within it: only the unfinished event
        // is held and counted against the limit.
        let input = b"event: delta\ndata: {\"text\":\"x\"}\n\n".repeat(20_000);
        let mut s = SseScanner::new(64);
        let mut n = 0;
        let work = work_done(|| {
            for b in &input {
                s.push::<()>(&[*b], |_| {
                    n += 1;
                    None
                })
                .unwrap();
                // The finished events' bytes are dropped as the stream goes on.
                assert!(s.pending.len() <= 2 * 64);
            }
        });
        assert_eq!(n, 20_000);
        eprintln!(
            "20000 events in 1-byte chunks: {work} bytes of work for {}",
            input.len()
        );
        assert!(work <= 4 * input.len(), "{work} for {} bytes", input.len());
    }

    #[test]
    fn finished_events_are_dropped_when_chunks_end_mid_event() {
        // Every chunk finishes one event and starts the next, so something is always left
        // unfinished when the chunk has been scanned.
        let mut s = SseScanner::new(64);
        s.push::<()>(b"data: ", |_| None).unwrap();
        let mut n = 0;
        for _ in 0..10_000 {
            s.push::<()>(b"{\"text\":\"x\"}\n\ndata: ", |_| {
                n += 1;
                None
            })
            .unwrap();
            assert!(s.pending.len() <= 2 * 64);
        }
        assert_eq!(n, 10_000);
    }

    /// A plain line-at-a-time reading of the same rules, over the whole input: the events
    /// and how many bytes they took up. A line ends with `\n`, `\r\n` or `\r` (a `\r` at the
    /// very end is not yet a line end); an empty line ends an event unless it is the event's
    /// first line.
    fn reference(input: &[u8]) -> (Vec<(Option<String>, String)>, usize) {
        let mut lines = Vec::new();
        let mut start = 0;
        let mut i = 0;
        while i < input.len() {
            match input[i] {
                b'\r' if i + 1 == input.len() => break,
                b'\r' if input[i + 1] == b'\n' => {
                    lines.push((start, i, i + 2));
                    i += 2;
                }
                b'\r' | b'\n' => {
                    lines.push((start, i, i + 1));
                    i += 1;
                }
                _ => {
                    i += 1;
                    continue;
                }
            }
            start = i;
        }
        let (mut out, mut consumed) = (Vec::new(), 0);
        let (mut event, mut data, mut first) = (None, None::<String>, true);
        for (from, to, next) in lines {
            let line = &input[from..to];
            if line.is_empty() && !first {
                if event.is_some() || data.as_ref().is_some_and(|d| !d.is_empty()) {
                    out.push((event.take(), data.take().unwrap_or_default()));
                }
                (event, data, first, consumed) = (None, None, true, next);
                continue;
            }
            first = false;
            if line.first().is_none_or(|b| *b == b':') {
                continue;
            }
            let (field, value) = match line.iter().position(|b| *b == b':') {
                Some(p) => (
                    &line[..p],
                    line[p + 1..].strip_prefix(b" ").unwrap_or(&line[p + 1..]),
                ),
                None => (line, &b""[..]),
            };
            let value = String::from_utf8_lossy(value).into_owned();
            match field {
                b"event" => event = Some(value),
                b"data" => match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(&value);
                    }
                    None => data = Some(value),
                },
                _ => {}
            }
        }
        (out, consumed)
    }

    fn sse_bytes() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            4 => Just(&b"\n"[..]),
            4 => Just(&b"\r"[..]),
            4 => Just(&b"\r\n"[..]),
            3 => Just(&b"data:"[..]),
            3 => Just(&b"data: "[..]),
            2 => Just(&b"event: "[..]),
            1 => Just(&b"data"[..]),
            1 => Just(&b": comment"[..]),
            1 => Just(&b"id: 7"[..]),
            1 => Just(&b":"[..]),
            1 => Just(&b" "[..]),
            3 => Just(&b"x"[..]),
            2 => Just(&b"{\"a\":1}"[..]),
            1 => Just("é".as_bytes()),
            1 => Just(&b"\xff"[..]),
        ];
        proptest::collection::vec(piece, 0..80).prop_map(|p| p.concat())
    }

    fn chunks(input: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        points.push(input.len());
        points.sort_unstable();
        let mut last = 0;
        points
            .into_iter()
            .map(|p| {
                let c = input[last..p].to_vec();
                last = p;
                c
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn any_chunking_finds_the_same_events(
            input in sse_bytes(),
            cuts in proptest::collection::vec(any::<usize>(), 0..24),
        ) {
            let whole = events(&[&input]);
            let split = chunks(&input, &cuts);
            let split: Vec<&[u8]> = split.iter().map(Vec::as_slice).collect();
            prop_assert_eq!(&events(&split), &whole);
            let bytes: Vec<&[u8]> = input.chunks(1).collect();
            prop_assert_eq!(&events(&bytes), &whole);
            prop_assert_eq!(whole, reference(&input).0);
        }

        #[test]
        fn early_stops_lose_nothing(
            input in sse_bytes(),
            cuts in proptest::collection::vec(any::<usize>(), 0..24),
            stops in proptest::collection::vec(any::<bool>(), 0..32),
        ) {
            let mut s = SseScanner::new(1 << 16);
            let mut seen = Vec::new();
            let mut stop = stops.into_iter().chain(std::iter::repeat(false));
            let mut on_event = |e: &SseEvent<'_>| {
                seen.push((e.event.as_deref().map(str::to_owned), e.data.to_string()));
                stop.next().unwrap().then_some(())
            };
            for chunk in chunks(&input, &cuts) {
                s.push(&chunk, &mut on_event).unwrap();
            }
            // What followed a stop waits for the next push.
            while s.push(b"", &mut on_event).unwrap().is_some() {}
            prop_assert_eq!(seen, reference(&input).0);
        }

        #[test]
        fn too_long_means_the_unfinished_event_passed_the_limit(
            input in sse_bytes(),
            cuts in proptest::collection::vec(any::<usize>(), 0..24),
            limit in 0usize..40,
        ) {
            let mut s = SseScanner::new(limit);
            let mut fed = 0;
            for chunk in chunks(&input, &cuts) {
                fed += chunk.len();
                let unfinished = fed - reference(&input[..fed]).1;
                let r = s.push::<()>(&chunk, |_| None);
                prop_assert_eq!(r, if unfinished > limit { Err(ScanError::TooLong) } else { Ok(None) });
            }
        }
    }
}
