//! Whether an event stream reached its protocol's terminal event.
//!
//! A stream cut by a hop that ends the HTTP body cleanly (a gateway, a load balancer's idle
//! cut) looks like a normal end to an SSE client: the official SDKs return the partial text as
//! a success. The protocols say when a stream is finished, so a clean end before that is an
//! error, not an end.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;

use super::sse::{ScanError, SseEvent, SseScanner};

/// The streaming protocols whose end is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StreamProtocol {
    /// Anthropic Messages: ends with `message_stop` (or an `error` event); a body that ends
    /// cleanly after a `message_delta` carrying a `stop_reason` is complete too (the answer
    /// and its usage came; only `message_stop`, which carries nothing, is missing).
    AnthropicMessages,
    /// OpenAI Chat Completions: ends with a chunk whose choice has a `finish_reason` (the
    /// `data: [DONE]` sentinel is not required: some compatible servers never send it), or an
    /// in-band error.
    OpenAiChat,
    /// OpenAI Responses: ends with `response.completed`, `response.failed`,
    /// `response.incomplete` (or an `error` event).
    OpenAiResponses,
}

impl StreamProtocol {
    /// A short, stable name.
    pub fn as_str(&self) -> &'static str {
        match self {
            StreamProtocol::AnthropicMessages => "anthropic_messages",
            StreamProtocol::OpenAiChat => "openai_chat",
            StreamProtocol::OpenAiResponses => "openai_responses",
        }
    }
}

/// The source of an [`ErrorKind::IncompleteStream`](crate::ErrorKind::IncompleteStream) error:
/// the event stream ended cleanly before its protocol's terminal event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncompleteStream {
    protocol: StreamProtocol,
    delivered: u64,
    last_event: Option<&'static str>,
}

impl IncompleteStream {
    /// The protocol the stream spoke.
    pub fn protocol(&self) -> StreamProtocol {
        self.protocol
    }

    /// How many bytes of the body reached the caller before the cut: every byte the server
    /// sent.
    pub fn delivered_bytes(&self) -> u64 {
        self.delivered
    }

    /// The type of the last complete event, when it is one of the protocol's known events.
    pub fn last_event(&self) -> Option<&'static str> {
        self.last_event
    }
}

impl fmt::Display for IncompleteStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} stream ended after {} bytes without its terminal event",
            self.protocol.as_str(),
            self.delivered
        )?;
        if let Some(last) = self.last_event {
            write!(f, " (last event: {last})")?;
        }
        Ok(())
    }
}

impl std::error::Error for IncompleteStream {}

/// The longest event the tracker follows after the commit point. A longer one (no protocol
/// sends such an event) switches the check off for that stream rather than hold it.
const MAX_EVENT: usize = 1 << 20;

/// Follows an event stream to its end: which protocol it speaks (from its events), and
/// whether the terminal event came.
#[derive(Debug, Clone)]
pub(crate) struct StreamScan {
    scanner: SseScanner,
    protocol: Option<StreamProtocol>,
    finished: bool,
    // The stream could not be followed (an event past `MAX_EVENT`): no verdict.
    lost: bool,
    last_event: Option<&'static str>,
}

impl StreamScan {
    pub(crate) fn new() -> Self {
        Self::with_limit(MAX_EVENT)
    }

    /// A scan whose scanner holds at most `limit` bytes of one event (the peek's limit, while
    /// the retry loop reads the start of the stream).
    pub(crate) fn with_limit(limit: usize) -> Self {
        StreamScan {
            scanner: SseScanner::new(limit),
            protocol: None,
            finished: false,
            lost: false,
            last_event: None,
        }
    }

    /// After the peek: the scanner may now hold events as long as any protocol sends.
    pub(crate) fn widen(&mut self) {
        self.scanner.set_limit(MAX_EVENT);
    }

    /// Feeds `chunk`; each complete event is observed, then offered to `on_event`, which may
    /// stop the scan early (the rest stays pending for the next push).
    pub(crate) fn push<T>(
        &mut self,
        chunk: &[u8],
        on_event: impl FnMut(&SseEvent<'_>) -> Option<T>,
    ) -> Result<Option<T>, ScanError> {
        self.observing(on_event, |scanner, f| scanner.push(chunk, f))
    }

    /// Runs `scan` on the scanner, each event it completes observed, then offered to
    /// `on_event`.
    fn observing<T>(
        &mut self,
        mut on_event: impl FnMut(&SseEvent<'_>) -> Option<T>,
        scan: impl FnOnce(
            &mut SseScanner,
            &mut dyn FnMut(&SseEvent<'_>) -> Option<T>,
        ) -> Result<Option<T>, ScanError>,
    ) -> Result<Option<T>, ScanError> {
        let Self {
            scanner,
            protocol,
            finished,
            last_event,
            ..
        } = self;
        scan(scanner, &mut |event| {
            observe(event, protocol, finished, last_event);
            on_event(event)
        })
    }

    /// At the end of the body: [`SseScanner::finish`], each event observed, then offered to
    /// `on_event`.
    pub(crate) fn finish<T>(
        &mut self,
        on_event: impl FnMut(&SseEvent<'_>) -> Option<T>,
    ) -> Result<Option<T>, ScanError> {
        self.observing(on_event, |scanner, f| scanner.finish(f))
    }

    /// Feeds a chunk that went to the caller, only to follow the stream.
    pub(crate) fn follow(&mut self, chunk: &[u8]) {
        if self.lost || self.finished {
            return;
        }
        if self.push::<()>(chunk, |_| None).is_err() {
            self.lost = true;
        }
    }

    /// Whether the verdict is in: the terminal event came, or the stream could not be
    /// followed. Until then a clean end may still be a cut.
    pub(crate) fn settled(&self) -> bool {
        self.lost || self.finished
    }

    /// At a clean end of the body: the error to raise, when the stream spoke a known protocol
    /// and its terminal event never came.
    pub(crate) fn end(&mut self, delivered: u64) -> Option<IncompleteStream> {
        // Events left pending (by an early stop, or a last event ended by a lone `\r`) are
        // complete; read them before judging.
        if !self.lost && !self.finished && self.finish::<()>(|_| None).is_err() {
            self.lost = true;
        }
        if self.lost || self.finished {
            return None;
        }
        Some(IncompleteStream {
            protocol: self.protocol?,
            delivered,
            last_event: self.last_event,
        })
    }
}

fn observe(
    event: &SseEvent<'_>,
    protocol: &mut Option<StreamProtocol>,
    finished: &mut bool,
    last_event: &mut Option<&'static str>,
) {
    if let Some(name) = event.event.as_deref() {
        if let Some((p, known, terminal)) = named(name) {
            protocol.get_or_insert(p);
            *last_event = Some(known);
            *finished |= terminal || (known == "message_delta" && stops(&event.data));
            return;
        }
        // `error` belongs to Anthropic and Responses alike: it ends either.
        if name == "error" {
            *last_event = Some("error");
            *finished = true;
            return;
        }
    }
    let data = event.data.trim();
    if data == "[DONE]" {
        *last_event = Some("[DONE]");
        *finished = true;
        return;
    }
    if !data.starts_with('{') {
        return;
    }
    let Ok(chunk) = serde_json::from_str::<Chunk<'_>>(data) else {
        return;
    };
    if chunk.error.is_some() {
        *last_event = Some("error");
        *finished = true;
        return;
    }
    // Servers that put the type only in the data.
    if let Some((p, known, terminal)) = chunk.kind.as_deref().and_then(named) {
        protocol.get_or_insert(p);
        *last_event = Some(known);
        *finished |= terminal
            || (known == "message_delta" && chunk.delta.is_some_and(|d| d.stop_reason.is_some()));
        return;
    }
    if chunk.kind.as_deref() == Some("error") {
        *last_event = Some("error");
        *finished = true;
        return;
    }
    if chunk.object.as_deref() == Some("chat.completion.chunk") || !chunk.choices.is_empty() {
        protocol.get_or_insert(StreamProtocol::OpenAiChat);
        *last_event = Some("chat.completion.chunk");
        *finished |= chunk.choices.iter().any(|c| c.finish_reason.is_some());
    }
}

/// Whether an Anthropic `message_delta`'s data carries a `stop_reason`: the message is
/// complete by its content (its usage came with it), and a body that ends cleanly after it
/// has lost only `message_stop`, which carries nothing.
fn stops(data: &str) -> bool {
    serde_json::from_str::<Chunk<'_>>(data.trim())
        .is_ok_and(|c| c.delta.is_some_and(|d| d.stop_reason.is_some()))
}

/// A known event type: its protocol, its name as a static string, and whether it ends the
/// stream.
fn named(name: &str) -> Option<(StreamProtocol, &'static str, bool)> {
    use StreamProtocol::{AnthropicMessages as A, OpenAiResponses as R};
    Some(match name {
        "message_start" => (A, "message_start", false),
        "content_block_start" => (A, "content_block_start", false),
        "content_block_delta" => (A, "content_block_delta", false),
        "content_block_stop" => (A, "content_block_stop", false),
        "message_delta" => (A, "message_delta", false),
        "message_stop" => (A, "message_stop", true),
        "ping" => (A, "ping", false),
        "response.completed" => (R, "response.completed", true),
        "response.failed" => (R, "response.failed", true),
        "response.incomplete" => (R, "response.incomplete", true),
        "response.created" => (R, "response.created", false),
        "response.in_progress" => (R, "response.in_progress", false),
        n if n.starts_with("response.") => (R, "response.*", false),
        _ => return None,
    })
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    object: Option<Cow<'a, str>>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    choices: Vec<Choice>,
    // Anthropic's `message_delta`; `null` (as in `message_start`) reads as none.
    #[serde(default)]
    delta: Option<MessageDelta>,
}

#[derive(Deserialize)]
struct MessageDelta {
    #[serde(default)]
    stop_reason: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    finish_reason: Option<serde::de::IgnoredAny>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(stream: &str) -> Option<IncompleteStream> {
        let mut s = StreamScan::new();
        // One byte at a time: the verdict must not depend on chunking.
        for b in stream.as_bytes().chunks(1) {
            s.follow(b);
        }
        s.end(stream.len() as u64)
    }

    const ANTHROPIC: &str = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n\
        event: content_block_delta\ndata: {\"type\":\"content_block_delta\"}\n\n";

    #[test]
    fn a_last_event_ended_by_a_lone_cr_is_an_event() {
        // SSE counts a lone `\r` as a line end: the last event of a stream that ends with
        // `\r\r` is complete, though no byte follows to say the `\r` was not half of `\r\n`.
        let cr = "event: message_start\rdata: {\"type\":\"message_start\"}\r\r\
                  event: content_block_delta\rdata: {\"type\":\"content_block_delta\"}\r\r\
                  event: message_stop\rdata: {\"type\":\"message_stop\"}\r\r";
        assert_eq!(scan(cr), None);
        let cut = scan(&cr[..cr.find("event: message_stop").unwrap()]).unwrap();
        assert_eq!(cut.last_event(), Some("content_block_delta"));
    }

    #[test]
    fn anthropic_needs_message_stop() {
        let cut = scan(ANTHROPIC).unwrap();
        assert_eq!(cut.protocol(), StreamProtocol::AnthropicMessages);
        assert_eq!(cut.last_event(), Some("content_block_delta"));
        assert_eq!(cut.delivered_bytes(), ANTHROPIC.len() as u64);
        let whole =
            format!("{ANTHROPIC}event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n");
        assert_eq!(scan(&whole), None);
        let errored = format!("{ANTHROPIC}event: error\ndata: {{\"type\":\"error\"}}\n\n");
        assert_eq!(scan(&errored), None);
        // A terminal event with no blank line after it is no event (the SSE rules).
        let unterminated = format!("{ANTHROPIC}event: message_stop\ndata: {{}}");
        assert!(scan(&unterminated).is_some());
    }

    #[test]
    fn an_anthropic_message_delta_with_a_stop_reason_completes_the_stream() {
        let delta = "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":3}}\n\n";
        let stop_block =
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n";
        // The delta came, `message_stop` did not: complete by content.
        assert_eq!(scan(&format!("{ANTHROPIC}{stop_block}{delta}")), None);
        // So with the type only in the data.
        let typed =
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"}}\n\n";
        assert_eq!(scan(&format!("{ANTHROPIC}{typed}")), None);
        // Cut before the delta: incomplete, as before.
        let cut = scan(&format!("{ANTHROPIC}{stop_block}")).unwrap();
        assert_eq!(cut.last_event(), Some("content_block_stop"));
        // A delta without a stop reason (or with a null one) says nothing of the end.
        for no_stop in [
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":3}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":3}}\n\n",
            "event: message_delta\ndata: not json\n\n",
        ] {
            let cut = scan(&format!("{ANTHROPIC}{no_stop}")).unwrap();
            assert_eq!(cut.last_event(), Some("message_delta"), "{no_stop}");
        }
        // A delta cut before its blank line is no event.
        let half = &delta[..delta.len() - 1];
        assert!(scan(&format!("{ANTHROPIC}{half}")).is_some());
    }

    #[test]
    fn openai_chat_needs_a_finish_reason_not_done() {
        let delta = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n";
        let cut = scan(delta).unwrap();
        assert_eq!(cut.protocol(), StreamProtocol::OpenAiChat);
        let finished = format!(
            "{delta}data: {{\"choices\":[{{\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n"
        );
        assert_eq!(scan(&finished), None);
        assert_eq!(scan(&format!("{finished}data: [DONE]\n\n")), None);
        assert_eq!(scan(&format!("{delta}data: [DONE]\n\n")), None);
    }

    #[test]
    fn openai_responses_needs_a_final_event() {
        let started =
            "event: response.created\ndata: {}\n\nevent: response.output_text.delta\ndata: {}\n\n";
        let cut = scan(started).unwrap();
        assert_eq!(cut.protocol(), StreamProtocol::OpenAiResponses);
        assert_eq!(cut.last_event(), Some("response.*"));
        for end in [
            "response.completed",
            "response.failed",
            "response.incomplete",
        ] {
            assert_eq!(
                scan(&format!("{started}event: {end}\ndata: {{}}\n\n")),
                None
            );
        }
    }

    #[test]
    fn unknown_streams_pass() {
        assert_eq!(scan("data: hello\n\ndata: world\n\n"), None);
        assert_eq!(scan("event: tick\ndata: 1\n\n"), None);
        assert_eq!(scan(""), None);
    }

    #[test]
    fn an_event_too_long_to_follow_switches_the_check_off() {
        let mut s = StreamScan::with_limit(40);
        s.follow(b"event: message_start\ndata: {}\n\n");
        s.follow(&[b'x'; 64]);
        assert_eq!(s.end(0), None);
    }
}
