//! An incremental Server-Sent Events scanner: finds event boundaries in a byte stream that
//! arrives in arbitrary chunks, without copying the stream itself.

use std::borrow::Cow;

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
/// returned parsed. Only the bytes of the event still in progress are held, never more than
/// `limit` of them: a longer event makes `push` report [`ScanError::TooLong`].
#[derive(Debug, Clone)]
pub struct SseScanner {
    pending: Vec<u8>,
    limit: usize,
}

/// The scanner gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanError {
    /// One event grew past the scanner's limit.
    TooLong,
}

impl SseScanner {
    /// A scanner holding at most `limit` bytes of one unfinished event.
    pub fn new(limit: usize) -> Self {
        SseScanner {
            pending: Vec::new(),
            limit,
        }
    }

    /// Feeds `chunk`, calling `on_event` with each event it completes, in order. Stops early
    /// and returns `Ok(Some(v))` as soon as `on_event` returns `Some(v)`.
    pub fn push<T>(
        &mut self,
        chunk: &[u8],
        mut on_event: impl FnMut(&SseEvent<'_>) -> Option<T>,
    ) -> Result<Option<T>, ScanError> {
        self.pending.extend_from_slice(chunk);
        let mut start = 0;
        let mut result = None;
        while let Some((end, next)) = find_block_end(&self.pending[start..]) {
            let block = &self.pending[start..start + end];
            let event = parse_block(block);
            start += next;
            if !event.is_empty() {
                if let Some(v) = on_event(&event) {
                    result = Some(v);
                    break;
                }
            }
        }
        self.pending.drain(..start);
        if result.is_none() && self.pending.len() > self.limit {
            return Err(ScanError::TooLong);
        }
        Ok(result)
    }
}

/// Finds the first blank line: returns (end of the block, start of what follows).
fn find_block_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        // A line ends with \n, \r\n or \r; a block ends with an empty line.
        let after = match buf[i] {
            b'\n' => i + 1,
            b'\r' if buf.get(i + 1) == Some(&b'\n') => i + 2,
            b'\r' if i + 1 < buf.len() => i + 1,
            // A lone \r at the very end: wait, it may be the first half of \r\n.
            b'\r' => return None,
            _ => {
                i += 1;
                continue;
            }
        };
        match buf.get(after) {
            Some(b'\n') => return Some((i, after + 1)),
            Some(b'\r') if buf.get(after + 1) == Some(&b'\n') => return Some((i, after + 2)),
            Some(b'\r') if after + 1 < buf.len() => return Some((i, after + 1)),
            Some(b'\r') | None => return None,
            Some(_) => i = after,
        }
    }
    None
}

fn parse_block(block: &[u8]) -> SseEvent<'_> {
    let mut event = None;
    let mut data: Option<Cow<'_, str>> = None;
    for line in block.split(|b| *b == b'\n' || *b == b'\r') {
        if line.is_empty() || line[0] == b':' {
            continue;
        }
        let (field, value) = match line.iter().position(|b| *b == b':') {
            Some(p) => {
                let v = &line[p + 1..];
                (&line[..p], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        let value = String::from_utf8_lossy(value);
        match field {
            b"event" => event = Some(value),
            b"data" => {
                data = Some(match data {
                    None => value,
                    Some(prev) => Cow::Owned(format!("{prev}\n{value}")),
                })
            }
            _ => {}
        }
    }
    SseEvent {
        event,
        data: data.unwrap_or(Cow::Borrowed("")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn bounded() {
        let mut s = SseScanner::new(10);
        assert_eq!(
            s.push::<()>(b"data: 0123456789abcdef", |_| None),
            Err(ScanError::TooLong)
        );
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
    }
}
