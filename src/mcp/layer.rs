use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use http::HeaderValue;
use tokio::time::Instant;
use tower_layer::Layer;

use super::{McpGate, ToolAnnotations};
use crate::body::DEFAULT_BODY_LIMIT;
use crate::retry::RetryPolicy;

/// Applies [`McpGate`] to an MCP streamable-HTTP client: each JSON-RPC request is marked
/// for [`RetryLayer`](crate::RetryLayer) by what it calls, and the session id is kept. See the
/// [module docs](crate::mcp).
///
/// Every service made from one layer (and their clones) shares one session: the session id,
/// the learned tool annotations and the reconnect budget. Use one layer per MCP server.
#[derive(Clone)]
#[must_use]
pub struct McpGateLayer {
    pub(crate) config: Arc<Config>,
}

pub(crate) struct Config {
    pub(crate) policy: RetryPolicy,
    pub(crate) tools: HashMap<String, ToolAnnotations>,
    pub(crate) learn: bool,
    pub(crate) reconnect_attempts: u32,
    pub(crate) reconnect_window: Duration,
    pub(crate) body_limit: usize,
    pub(crate) session: Session,
}

/// What the services of one layer share.
#[derive(Default)]
pub(crate) struct Session {
    pub(crate) id: Mutex<Option<HeaderValue>>,
    pub(crate) learned: RwLock<HashMap<String, ToolAnnotations>>,
    /// When each re-send of the session happened, oldest first, within the window.
    pub(crate) resends: Mutex<VecDeque<Instant>>,
}

impl Clone for Config {
    fn clone(&self) -> Self {
        // A changed setting starts a new session: nothing learned about one server is
        // carried to a layer that may talk to another.
        Config {
            policy: self.policy.clone(),
            tools: self.tools.clone(),
            learn: self.learn,
            reconnect_attempts: self.reconnect_attempts,
            reconnect_window: self.reconnect_window,
            body_limit: self.body_limit,
            session: Session::default(),
        }
    }
}

impl McpGateLayer {
    /// A gate with the [default policy](RetryPolicy::default), annotations learned from
    /// `tools/list`, and at most 5 re-sends per session within 60 s.
    pub fn new() -> Self {
        McpGateLayer {
            config: Arc::new(Config {
                policy: RetryPolicy::default(),
                tools: HashMap::new(),
                learn: true,
                reconnect_attempts: 5,
                reconnect_window: Duration::from_secs(60),
                body_limit: DEFAULT_BODY_LIMIT,
                session: Session::default(),
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        let mut config = Config::clone(&self.config);
        f(&mut config);
        self.config = Arc::new(config);
        self
    }

    /// The policy of the `RetryLayer` inside, for its retry count: an idempotent tool call is
    /// allowed at most one of them, and the session cap lowers it, through an
    /// [`Override`](crate::retry::Override) of `max_retries` that leaves the rest of
    /// `RetryLayer`'s policy as it is. Give the gate the same policy as the `RetryLayer`
    /// inside it. A request that already carries a `RetryPolicy` or an `Override` extension
    /// is counted from those. Defaults to [`RetryPolicy::default`].
    pub fn policy(self, policy: RetryPolicy) -> Self {
        self.edit(|c| c.policy = policy)
    }

    /// The annotations of a tool, as the caller knows them. They take precedence over what a
    /// server says in `tools/list`. Defaults to none.
    pub fn tool(self, name: impl Into<String>, annotations: ToolAnnotations) -> Self {
        let name = name.into();
        self.edit(|c| {
            c.tools.insert(name, annotations);
        })
    }

    /// Whether tool annotations are learned from the `tools/list` responses that pass
    /// through. Annotations are hints from the server: turn this off for a server you do not
    /// trust and give them with [`tool`](Self::tool). Defaults to true.
    pub fn learn_annotations(self, on: bool) -> Self {
        self.edit(|c| c.learn = on)
    }

    /// The session's reconnect cap: at most `attempts` re-sends (retries of any request,
    /// counted from the `RetryTrail`s that come back) within any `window`. Once spent,
    /// requests are sent once ([`NoRetry`](crate::retry::NoRetry)) until older re-sends leave the
    /// window. Defaults to 5 within 60 s.
    pub fn reconnect(self, attempts: u32, window: Duration) -> Self {
        self.edit(|c| {
            c.reconnect_attempts = attempts;
            c.reconnect_window = window;
        })
    }

    /// The most request-body bytes read to find the JSON-RPC method; a larger body is sent
    /// once, marked [`NotReplaySafe`](crate::retry::NotReplaySafe). Defaults to 32 MiB.
    pub fn body_limit(self, bytes: usize) -> Self {
        self.edit(|c| c.body_limit = bytes)
    }
}

impl Default for McpGateLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for McpGateLayer {
    type Service = McpGate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        McpGate::from_config(inner, self.config.clone())
    }
}

impl Session {
    pub(crate) fn id(&self) -> Option<HeaderValue> {
        self.id
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Keeps the session id, marked sensitive: it names the session to the server as a
    /// credential would, so a request's `Debug` and hyper's HPACK leave it out.
    pub(crate) fn set_id(&self, id: Option<HeaderValue>) {
        let id = id.map(|mut id| {
            id.set_sensitive(true);
            id
        });
        *self.id.lock().unwrap_or_else(PoisonError::into_inner) = id;
    }

    /// Forgets the session id when it is still `expired`.
    pub(crate) fn expire(&self, expired: &HeaderValue) {
        let mut id = self.id.lock().unwrap_or_else(PoisonError::into_inner);
        if id.as_ref() == Some(expired) {
            *id = None;
        }
    }

    pub(crate) fn annotations(&self, name: &str) -> Option<ToolAnnotations> {
        let learned = self.learned.read().unwrap_or_else(PoisonError::into_inner);
        learned.get(name).copied()
    }

    pub(crate) fn learn(&self, tools: impl IntoIterator<Item = (String, ToolAnnotations)>) {
        let mut learned = self.learned.write().unwrap_or_else(PoisonError::into_inner);
        learned.extend(tools);
    }

    /// Re-sends left in the window.
    pub(crate) fn resends_left(&self, attempts: u32, window: Duration) -> u32 {
        let mut log = self.resends.lock().unwrap_or_else(PoisonError::into_inner);
        prune(&mut log, window);
        attempts.saturating_sub(u32::try_from(log.len()).unwrap_or(u32::MAX))
    }

    pub(crate) fn record_resends(&self, n: u32, window: Duration) {
        if n == 0 {
            return;
        }
        let mut log = self.resends.lock().unwrap_or_else(PoisonError::into_inner);
        prune(&mut log, window);
        let now = Instant::now();
        log.extend(std::iter::repeat_n(now, n as usize));
    }
}

fn prune(log: &mut VecDeque<Instant>, window: Duration) {
    let now = Instant::now();
    while log
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) >= window)
    {
        log.pop_front();
    }
}

impl fmt::Debug for McpGateLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    // The session id is a bearer of the session: never shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpGateLayer")
            .field("policy", &self.policy)
            .field("tools", &self.tools)
            .field("learn", &self.learn)
            .field("reconnect_attempts", &self.reconnect_attempts)
            .field("reconnect_window", &self.reconnect_window)
            .field("body_limit", &self.body_limit)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_id_is_kept_sensitive() {
        let session = Session::default();
        session.set_id(Some(HeaderValue::from_static("sess-42")));
        let id = session.id().expect("kept");
        assert!(id.is_sensitive());
        let mut headers = http::HeaderMap::new();
        headers.insert("mcp-session-id", id);
        assert!(!format!("{headers:?}").contains("sess-42"));
    }
}
