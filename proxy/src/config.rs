//! The proxy's configuration: a TOML file, then environment overrides, validated once at
//! start-up into the typed structs the rest of the proxy reads.
//!
//! Every field has a default, so an empty file (or none) gives a proxy on `127.0.0.1:8787` in
//! front of `https://api.anthropic.com` and `https://api.openai.com`, passing the client's own
//! credentials through.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tower_llm_retry::fallback::Circuit;
use tower_llm_retry::fleet::{BudgetConfig, Fleet, FleetBuilder, PacingConfig, RedisFleet};
use tower_llm_retry::RetryPolicy;

/// The prefix of every environment variable the proxy reads.
pub const ENV_PREFIX: &str = "LLM_RETRY_PROXY_";

/// The most `worker_threads` can be: a thread and a runtime each.
pub const MAX_WORKER_THREADS: usize = 1024;

/// The whole configuration.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where to listen. Defaults to `127.0.0.1:8787`.
    pub listen: SocketAddr,
    /// The largest request body accepted, in bytes; a larger one is refused with `413` before
    /// anything is sent. Defaults to 32 MiB (Anthropic's own request limit).
    pub max_body_bytes: usize,
    /// Requests handled at once, from the end of their body to the end of their response; one
    /// more is refused at once with `503` and `Retry-After: 1` (never queued; on HTTP/1 with
    /// `connection: close`, the connection closed with the answer). A request whose
    /// body is still arriving holds no slot (`body_timeout_secs` and
    /// `max_buffered_body_bytes` bound it instead). Defaults to 512.
    pub max_concurrent_requests: usize,
    /// How long a request body may take to arrive whole, from the request's head; a body not
    /// complete by then is refused with `408` (`body_timeout`), nothing sent upstream. Apart
    /// from it, a body may go at most 30 s without a byte. Defaults to 60 s.
    pub body_timeout_secs: u64,
    /// The request-body bytes the proxy holds at once, over every request being read or
    /// served (a body is held until its response ends: the retry loop may send it again). A
    /// request whose declared `content-length` is over what is left, or a body that grows past
    /// it while read, is refused with `503` and `Retry-After: 1` (on HTTP/1 with
    /// `connection: close`), nothing sent upstream.
    /// Must be at least `max_body_bytes`. Defaults to 8 × `max_body_bytes` (256 MiB).
    pub max_buffered_body_bytes: Option<usize>,
    /// Client connections open at once. At the cap, a new connection takes the place of the
    /// oldest one that has not sent a request yet, else of the one idle longest (nothing in
    /// flight; closed gracefully); with none such, it is closed at once. The cap bounds the
    /// proxy's memory (about 20 KiB a connection); at twice `max_concurrent_requests` a new
    /// client is not refused while a connection is idle. It is kept at half the soft
    /// file-descriptor limit at most (the other half is for upstream connections), lowered
    /// with a warning if set higher. Defaults to 1,024.
    pub max_connections: usize,
    /// How long a client connection may stay open with no request in flight, after its first
    /// request (HTTP/2: `GOAWAY`, then closed). Defaults to 30 s.
    pub connection_idle_timeout_secs: u64,
    /// The interval of the HTTP/2 keep-alive pings sent to clients; a ping unanswered for as
    /// long closes the connection. `0` sends none. Defaults to 20 s.
    pub http2_keep_alive_secs: u64,
    /// How long a write to a client may wait for the client to read (its receive window
    /// full), or a response for the client to take its next piece (HTTP/2 flow control),
    /// before the connection is cut and its request's slot freed. Defaults to 30 s.
    pub write_timeout_secs: u64,
    /// How long a shutdown waits for in-flight requests and streams before it cuts them.
    /// Defaults to 30 s.
    pub drain_timeout_secs: u64,
    /// The threads that serve client connections, each a runtime of its own with its own
    /// upstream connection pools: a connection, and the upstream connections its requests
    /// use, stay on one thread, and a request wakes no other. A new connection goes to the
    /// thread serving the fewest. `0` is one per core. Defaults to 0.
    pub worker_threads: usize,
    /// How many tenants (upstream, credential), each with its own budget, gate and pacing,
    /// each upstream's fleet keeps apart; beyond it, a new tenant takes the place of one with
    /// no request in flight (with every one in flight, it shares the upstream's own state).
    /// Defaults to 1,024.
    pub max_tenants: usize,
    /// `text` or `json` log lines on standard error. Defaults to `text`.
    pub log_format: LogFormat,
    /// The token clients must present (as `x-api-key`, `authorization: Bearer …` or
    /// `x-llm-retry-token`) when the proxy holds the upstream keys. Prefer `client_token_env`.
    /// Defaults to none.
    pub client_token: Option<Secret>,
    /// The name of an environment variable holding the client token. Defaults to none.
    pub client_token_env: Option<String>,
    /// A Redis (or Valkey) URL, `redis://host:port/db`, `rediss://…` or
    /// `redis+unix:///path`, or a Redis Cluster's seed nodes,
    /// `redis+cluster://[user:password@]host1:port1,host2:port2` (`rediss+cluster://…` for
    /// TLS; the credentials apply to every node): every replica given the same URL shares the
    /// budget, the cooldown gate and the pacing of each (upstream, credential) with the
    /// others. On a cluster each (upstream, credential) lives on the node of its hash slot, and
    /// a lost node costs only the coordination of those on its slots. Only hashes of the
    /// upstream and the credential reach Redis. The URL may carry a password: it is shown as
    /// `"***"` and never logged. Defaults to none (each replica on its own).
    pub redis_url: Option<Secret>,
    /// The start of every key and channel name in Redis, so that several deployments can share
    /// one Redis apart. Defaults to `llm-retry-proxy`.
    pub redis_prefix: String,
    /// With `redis_url`: whether a tenant's requests are refused while its shared state is out
    /// of reach (Redis down, or the cluster node of the tenant's slot), rather than sent with
    /// each replica's own state. Refused, a request is answered `503` with `x-should-retry:
    /// true` and nothing reaches the upstream: for keys whose paid limit must never be
    /// exceeded, at the price of availability while Redis is out. Defaults to false (each
    /// replica goes on alone).
    pub redis_fail_closed: bool,
    /// The upstream APIs. Defaults to one Anthropic and one OpenAI upstream.
    pub upstream: Vec<Upstream>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            max_body_bytes: 32 * 1024 * 1024,
            max_concurrent_requests: 512,
            body_timeout_secs: 60,
            max_buffered_body_bytes: None,
            max_connections: 1024,
            connection_idle_timeout_secs: 30,
            http2_keep_alive_secs: 20,
            write_timeout_secs: 30,
            drain_timeout_secs: 30,
            worker_threads: 0,
            max_tenants: 1024,
            log_format: LogFormat::Text,
            client_token: None,
            client_token_env: None,
            redis_url: None,
            redis_prefix: "llm-retry-proxy".to_owned(),
            redis_fail_closed: false,
            upstream: vec![
                Upstream::new("anthropic", Kind::Anthropic, "https://api.anthropic.com"),
                Upstream::new("openai", Kind::OpenAi, "https://api.openai.com"),
            ],
        }
    }
}

/// Log line format.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Which API an upstream speaks: it picks the well-known paths routed to it and the envelope
/// of the proxy's own errors.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The Anthropic Messages API.
    Anthropic,
    /// The OpenAI API (Chat Completions, Responses, Embeddings) and compatible gateways.
    #[serde(rename = "openai")]
    OpenAi,
}

impl Kind {
    /// `anthropic` or `openai`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Anthropic => "anthropic",
            Kind::OpenAi => "openai",
        }
    }
}

/// A named retry policy preset.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    /// 10 retries, 0.5 s doubling to 32 s.
    Default,
    /// The official SDKs' own loop: 2 retries, 0.5 s doubling to 8 s.
    SdkCompatible,
    /// 12 retries, 5 s doubling to 60 s, for unattended jobs.
    Patient,
    /// 3 retries, for a person waiting.
    Interactive,
    /// No retries.
    Never,
}

impl Preset {
    /// The preset of that name, as the `x-llm-retry-policy` header names it.
    pub fn from_name(name: &str) -> Option<Preset> {
        Some(match name.trim() {
            "default" => Preset::Default,
            "sdk_compatible" | "sdk-compatible" => Preset::SdkCompatible,
            "patient" => Preset::Patient,
            "interactive" => Preset::Interactive,
            "never" => Preset::Never,
            _ => return None,
        })
    }

    /// The library's policy for this preset.
    pub fn policy(self) -> RetryPolicy {
        match self {
            Preset::Default => RetryPolicy::default(),
            Preset::SdkCompatible => RetryPolicy::sdk_compatible(),
            Preset::Patient => RetryPolicy::patient(),
            Preset::Interactive => RetryPolicy::interactive(),
            Preset::Never => RetryPolicy::never(),
        }
    }
}

/// Whether and how a stream cut after output is resumed (see [`Upstream::resume`]).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Not resumed: the client gets the protocol's error event.
    #[default]
    Off,
    /// The partial text as an assistant prefill (Anthropic); an instruction where the API has
    /// no prefill or answers it with `400`.
    Prefill,
    /// The partial text as an assistant turn, then a user turn asking for the rest.
    Instruction,
}

/// Where upstream TLS trust comes from.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Roots {
    /// Mozilla's roots, built in (`webpki-roots`).
    Webpki,
    /// The operating system's store.
    Native,
}

/// One upstream API.
#[derive(Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Upstream {
    /// A name for logs, metrics and env overrides. Defaults to `anthropic`.
    pub name: String,
    /// `anthropic` or `openai`. Defaults to `anthropic`.
    pub kind: Kind,
    /// The base URL; a path in it is kept in front of every forwarded path. Defaults to
    /// `https://api.anthropic.com`. A `user:password@` in it is shown as `***@` by
    /// `--check-config`, and no error quotes the URL.
    #[serde(serialize_with = "serialize_url")]
    pub url: String,
    /// Requests under this path prefix go to this upstream, the prefix removed (`/eu/v1/models`
    /// → `{url}/v1/models`). The first upstream of each kind also takes that kind's well-known
    /// paths without a prefix. Defaults to `/{name}`.
    pub prefix: Option<String>,
    /// The retry preset. Defaults to `default`.
    pub policy: Preset,
    /// Overrides the preset's retry count. Defaults to the preset's.
    pub max_retries: Option<u32>,
    /// Overrides the preset's first backoff, in milliseconds. Defaults to the preset's.
    pub initial_backoff_ms: Option<u64>,
    /// Overrides the preset's longest backoff, in milliseconds. Defaults to the preset's.
    pub max_backoff_ms: Option<u64>,
    /// Overrides the preset's `Retry-After` ceiling, in seconds. Defaults to the preset's.
    pub retry_after_max_secs: Option<u64>,
    /// Time to the response head per attempt, in seconds. Defaults to 600.
    pub head_timeout_secs: Option<u64>,
    /// Longest silence between body frames, in seconds (before a stream's commit point a
    /// stall is retried; after it, the client gets the protocol's error). Defaults to 600.
    pub idle_timeout_secs: Option<u64>,
    /// Time from an event stream's response head to its first output event, per attempt, in
    /// seconds: none in time is a timeout of its own class before the commit point, retried
    /// or failed over (`fallback_after_timeouts`) like a head timeout; never applied after
    /// output. Defaults to none (off).
    pub first_output_timeout_secs: Option<u64>,
    /// The longest a client of this upstream waits, in seconds: the retry loop of every
    /// request ends that long, less a margin for the answer to travel back (5 %, at least
    /// 1 s, at most half), after the request arrived. For clients that do not advertise their
    /// own timeout (the Node SDKs); a shorter one a request advertises wins (see
    /// `client_deadline`). Defaults to none.
    pub deadline_secs: Option<u64>,
    /// Honour the timeout the official Python SDKs advertise with each request
    /// (`x-stainless-read-timeout`, `x-stainless-timeout`): the retry loop ends before the
    /// client would stop waiting, less the same margin as `deadline_secs`. A value that is not
    /// a sensible number of seconds is ignored. The proxy's own `x-llm-retry-deadline` applies
    /// either way. Defaults to `true`.
    pub client_deadline: bool,
    /// A model with a larger context window on this upstream, tried once for a prompt that
    /// no lower `max_tokens` can fit (needs `overflow_repair`). Defaults to none.
    pub context_window_fallback: Option<String>,
    /// Resume after a cut for streams served by this upstream's own models: `off`,
    /// `prefill` or `instruction`. Defaults to `off`.
    pub resume: ResumeMode,
    /// The fallback chain, in order: model names on this upstream, or tables
    /// `{ model, upstream, resume }` for a model on another `[[upstream]]` of the same kind.
    /// A request for a model of the chain falls back to the entries after it; list the model
    /// clients ask for first (it then has a circuit too). Defaults to none.
    pub fallback: Vec<FallbackTarget>,
    /// Consecutive overloads (Anthropic's `529` / `overloaded_error`) before the next target
    /// is tried. Defaults to 3.
    pub fallback_threshold: u32,
    /// Consecutive retryable failures of any class before the next target is tried.
    /// Defaults to none (off).
    pub fallback_after_failures: Option<u32>,
    /// Consecutive timeouts (no response head in time, a stall before the first output)
    /// before the next target is tried. Defaults to none (off).
    pub fallback_after_timeouts: Option<u32>,
    /// Consecutive connect failures before the next target is tried. Defaults to none (off).
    pub fallback_after_connect_failures: Option<u32>,
    /// Fall over at once on a rate limit with nowhere to wait (a `Retry-After` above the
    /// ceiling, or every held key resting). Defaults to `false`.
    pub fallback_on_unwaitable_rate_limit: bool,
    /// Lower a `max_tokens` that does not fit the context window and re-send once.
    /// Defaults to `true`.
    pub overflow_repair: bool,
    /// The retry budget (retries at most 20 % of first attempts plus 10 a second).
    /// Defaults to `true`.
    pub budget: bool,
    /// The cooldown gate: a `Retry-After` of 2 s or more holds the tenant's other requests
    /// too (the library's default gate). Defaults to `true`.
    pub gate: bool,
    /// Adaptive pacing of the tenant's attempts: dormant until the upstream first signals a
    /// rate limit, then from the rate measured (the library's default pacing). Defaults to
    /// `true`.
    pub pacing: bool,
    /// How long the pacing warms a new tenant up, in seconds: its first attempts leave at
    /// 50 a second, the rate doubling every second while some wait, until evidence of a
    /// limit wakes the pacing for good or the span is over with no one waiting (the
    /// library's `PacingConfig::warm_up`). Many clients starting together (a deploy, a
    /// restart, replicas scaled out on one key) then do not all go at once into a limit; a
    /// burst of 1,000 requests at a new tenant takes about 4 s to leave. 0 turns it off.
    /// Defaults to 3.
    pub pacing_warm_up_secs: f64,
    /// Pacing by tokens: dormant until the upstream states a token limit nearly spent or
    /// answers a `429` for one, then each attempt waits for its estimated tokens (the
    /// library's default token pacing). Defaults to `true`.
    pub token_pacing: bool,
    /// An environment variable with the upstream keys the proxy holds (separated by commas
    /// or new lines); a client token is then required. Defaults to none: clients' own
    /// credentials pass through.
    pub keys_env: Option<String>,
    /// A file with one upstream key per line, as `keys_env`. Defaults to none.
    pub keys_file: Option<PathBuf>,
    /// `webpki` or `native` trust roots for HTTPS upstreams. Defaults to `webpki`.
    pub roots: Roots,
    /// A PEM file of extra certificate authorities to trust (a corporate gateway).
    /// Defaults to none.
    pub ca_file: Option<PathBuf>,
    /// `[upstream.circuit]`: a circuit per target of the fallback chain, shared by every
    /// tenant of the upstream. Defaults to none (no circuits).
    pub circuit: Option<CircuitConfig>,
}

/// One entry of an upstream's fallback chain: a model name (`"gpt-4o-mini"`) or a table
/// (`{ model = "gpt-4o", upstream = "openai-backup", resume = "instruction" }`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FallbackTarget {
    /// The model.
    pub model: String,
    /// The name of the `[[upstream]]` that serves it, of the same kind. Defaults to the
    /// upstream whose chain this is.
    pub upstream: Option<String>,
    /// Resume after a cut for streams this target serves. Defaults to the upstream's own
    /// `resume` for a model on it, `off` for one on another upstream.
    pub resume: Option<ResumeMode>,
}

impl FallbackTarget {
    /// The name of the upstream serving this target, when `own` is the chain's.
    pub fn upstream_or<'a>(&'a self, own: &'a str) -> &'a str {
        self.upstream.as_deref().unwrap_or(own)
    }
}

impl From<&str> for FallbackTarget {
    fn from(model: &str) -> Self {
        FallbackTarget {
            model: model.to_owned(),
            upstream: None,
            resume: None,
        }
    }
}

impl From<String> for FallbackTarget {
    fn from(model: String) -> Self {
        FallbackTarget {
            model,
            upstream: None,
            resume: None,
        }
    }
}

/// The table form of a fallback entry, as written.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FallbackTable {
    model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    upstream: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    resume: Option<ResumeMode>,
}

impl Serialize for FallbackTarget {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.upstream.is_none() && self.resume.is_none() {
            return s.serialize_str(&self.model);
        }
        FallbackTable {
            model: self.model.clone(),
            upstream: self.upstream.clone(),
            resume: self.resume,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for FallbackTarget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entry;
        impl<'de> serde::de::Visitor<'de> for Entry {
            type Value = FallbackTarget;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a model name or a table { model, upstream, resume }")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<FallbackTarget, E> {
                Ok(FallbackTarget::from(v))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<FallbackTarget, A::Error> {
                let t =
                    FallbackTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(FallbackTarget {
                    model: t.model,
                    upstream: t.upstream,
                    resume: t.resume,
                })
            }
        }
        d.deserialize_any(Entry)
    }
}

/// `[upstream.circuit]`: the settings of the circuit each target of the fallback chain gets.
/// After `failures` failures of a trigger class within `window_secs`, a target is skipped
/// for `cooldown_secs`; then one request probes it, and a failed probe doubles the cooldown
/// up to `max_cooldown_secs`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct CircuitConfig {
    /// Failures within the window that open a target's circuit; at least 1. Defaults to 5.
    pub failures: u32,
    /// How far back failures count, in seconds; at least 1. Defaults to 30.
    pub window_secs: u64,
    /// How long an opened circuit stays open before its first probe, in seconds; at least 1.
    /// Defaults to 30.
    pub cooldown_secs: u64,
    /// The longest cooldown failed probes double up to, in seconds. Defaults to 300.
    pub max_cooldown_secs: u64,
}

impl Default for CircuitConfig {
    /// The library's [`Circuit::new`] (a unit test holds the two together).
    fn default() -> Self {
        CircuitConfig {
            failures: 5,
            window_secs: 30,
            cooldown_secs: 30,
            max_cooldown_secs: 300,
        }
    }
}

impl CircuitConfig {
    /// The library's circuit with these settings.
    pub fn circuit(&self) -> Circuit {
        Circuit::new()
            .failures(self.failures)
            .window(Duration::from_secs(self.window_secs))
            .cooldown(Duration::from_secs(self.cooldown_secs))
            .max_cooldown(Duration::from_secs(self.max_cooldown_secs))
    }
}

// By hand, so that a password in `url` is masked here as in `--check-config`: a panic or a
// log line that prints an upstream never shows it.
impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("url", &mask_userinfo(&self.url))
            .field("prefix", &self.prefix)
            .field("policy", &self.policy)
            .field("fallback", &self.fallback)
            .field("keys_env", &self.keys_env)
            .field("keys_file", &self.keys_file)
            .finish_non_exhaustive()
    }
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream::new("anthropic", Kind::Anthropic, "https://api.anthropic.com")
    }
}

impl Upstream {
    /// An upstream with every other setting at its default.
    pub fn new(name: &str, kind: Kind, url: &str) -> Self {
        Upstream {
            name: name.to_owned(),
            kind,
            url: url.to_owned(),
            prefix: None,
            policy: Preset::Default,
            max_retries: None,
            initial_backoff_ms: None,
            max_backoff_ms: None,
            retry_after_max_secs: None,
            head_timeout_secs: None,
            idle_timeout_secs: None,
            first_output_timeout_secs: None,
            deadline_secs: None,
            context_window_fallback: None,
            resume: ResumeMode::Off,
            client_deadline: true,
            fallback: Vec::new(),
            fallback_threshold: 3,
            fallback_after_failures: None,
            fallback_after_timeouts: None,
            fallback_after_connect_failures: None,
            fallback_on_unwaitable_rate_limit: false,
            overflow_repair: true,
            budget: true,
            gate: true,
            pacing: true,
            pacing_warm_up_secs: 3.0,
            token_pacing: true,
            keys_env: None,
            keys_file: None,
            roots: Roots::Webpki,
            ca_file: None,
            circuit: None,
        }
    }

    /// The path prefix routed here: `prefix`, or `/{name}`.
    pub fn route_prefix(&self) -> String {
        let p = self
            .prefix
            .clone()
            .unwrap_or_else(|| format!("/{}", self.name));
        let p = p.trim_end_matches('/');
        if p.starts_with('/') {
            p.to_owned()
        } else {
            format!("/{p}")
        }
    }

    /// Whether the proxy holds this upstream's keys.
    pub fn holds_keys(&self) -> bool {
        self.keys_env.is_some() || self.keys_file.is_some()
    }

    /// Whether a stream this upstream's stack serves may be resumed: its own `resume`, or a
    /// target of its chain, is on.
    pub fn resumes(&self) -> bool {
        self.resume != ResumeMode::Off
            || self
                .fallback
                .iter()
                .any(|t| t.resume.is_some_and(|m| m != ResumeMode::Off))
    }

    /// The resume mode for a stream that upstream `upstream` served with `model`, in a
    /// request routed to this upstream: the matching fallback entry's `resume` when it sets
    /// one, else this upstream's `resume` for a model on this upstream, else `off`.
    pub fn resume_for(&self, upstream: &str, model: &str) -> ResumeMode {
        let entry = self
            .fallback
            .iter()
            .find(|t| t.model == model && t.upstream_or(&self.name) == upstream);
        match entry.and_then(|t| t.resume) {
            Some(mode) => mode,
            None if upstream == self.name => self.resume,
            None => ResumeMode::Off,
        }
    }

    /// The fallback triggers that are on, with the failures in a row each needs to move a
    /// request one target on: a failure of a trigger's class also counts towards
    /// `fallback_after_failures`, so that one fires no later. Checked in this order.
    fn trigger_counts(&self) -> Vec<(&'static str, u32)> {
        let any = self.fallback_after_failures.unwrap_or(u32::MAX);
        let mut out = Vec::new();
        if let Some(n) = self.fallback_after_failures {
            out.push(("fallback_after_failures", n));
        }
        out.push(("fallback_threshold", self.fallback_threshold.min(any)));
        if let Some(n) = self.fallback_after_timeouts {
            out.push(("fallback_after_timeouts", n.min(any)));
        }
        if let Some(n) = self.fallback_after_connect_failures {
            out.push(("fallback_after_connect_failures", n.min(any)));
        }
        if self.fallback_on_unwaitable_rate_limit {
            out.push(("fallback_on_unwaitable_rate_limit", 1));
        }
        out
    }

    /// Checks the fallback chain, its triggers and circuit against `all` the upstreams.
    fn validate_failover(&self, all: &[Upstream]) -> Result<(), ConfigError> {
        let at = format!("[[upstream]] {:?}", self.name);
        if !(self.pacing_warm_up_secs.is_finite()
            && (0.0..=3600.0).contains(&self.pacing_warm_up_secs))
        {
            return Err(ConfigError::new(format!(
                "{at}: pacing_warm_up_secs must be within 0 and 3600, got {}",
                self.pacing_warm_up_secs
            )));
        }
        for (key, n) in [
            ("fallback_after_failures", self.fallback_after_failures),
            ("fallback_after_timeouts", self.fallback_after_timeouts),
            (
                "fallback_after_connect_failures",
                self.fallback_after_connect_failures,
            ),
        ] {
            if n == Some(0) {
                return Err(ConfigError::new(format!(
                    "{at}: {key} must be at least 1 (leave it out to turn it off)"
                )));
            }
        }
        if let Some(model) = &self.context_window_fallback {
            if model.is_empty() {
                return Err(ConfigError::new(format!(
                    "{at}: context_window_fallback is empty: name a model, or leave it out"
                )));
            }
            if !self.overflow_repair {
                return Err(ConfigError::new(format!(
                    "{at}: context_window_fallback needs overflow_repair = true (the repair \
                     sends the request to it)"
                )));
            }
        }
        if let Some(c) = &self.circuit {
            for (key, v) in [
                ("failures", u64::from(c.failures)),
                ("window_secs", c.window_secs),
                ("cooldown_secs", c.cooldown_secs),
            ] {
                if v == 0 {
                    return Err(ConfigError::new(format!(
                        "{at}: circuit.{key} must be at least 1"
                    )));
                }
            }
        }
        if self.fallback.is_empty() {
            // A trigger or a circuit with nowhere to go would be a key that does nothing.
            let set = [
                (
                    "fallback_after_failures",
                    self.fallback_after_failures.is_some(),
                ),
                (
                    "fallback_after_timeouts",
                    self.fallback_after_timeouts.is_some(),
                ),
                (
                    "fallback_after_connect_failures",
                    self.fallback_after_connect_failures.is_some(),
                ),
                (
                    "fallback_on_unwaitable_rate_limit",
                    self.fallback_on_unwaitable_rate_limit,
                ),
                ("[upstream.circuit]", self.circuit.is_some()),
            ];
            if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
                return Err(ConfigError::new(format!(
                    "{at}: {key} is set but fallback is empty: add a fallback target, or \
                     leave {key} out"
                )));
            }
            return Ok(());
        }
        let mut seen: Vec<(&str, &str)> = Vec::new();
        let mut urls: Vec<(&str, String)> = vec![(&self.name, base_url(&self.url))];
        for (i, t) in self.fallback.iter().enumerate() {
            let entry = format!("{at}: fallback entry {} ({:?})", i + 1, t.model);
            let name = t.upstream_or(&self.name);
            if name != self.name {
                let Some(other) = all.iter().find(|u| u.name == name) else {
                    let names: Vec<&str> = all.iter().map(|u| u.name.as_str()).collect();
                    return Err(ConfigError::new(format!(
                        "{entry} names upstream {name:?}, which is not configured: use one \
                         of {names:?}"
                    )));
                };
                if other.kind != self.kind {
                    return Err(ConfigError::new(format!(
                        "{entry} is on upstream {name:?} of kind {}, but this upstream is of \
                         kind {}: a fallback target must speak the same API",
                        other.kind.as_str(),
                        self.kind.as_str()
                    )));
                }
                if other.holds_keys() != self.holds_keys() {
                    let (with, without) = if self.holds_keys() {
                        (self.name.as_str(), name)
                    } else {
                        (name, self.name.as_str())
                    };
                    return Err(ConfigError::new(format!(
                        "{entry} is on upstream {name:?}: upstream {with:?} holds keys \
                         (keys_env or keys_file) and {without:?} passes the client's \
                         credentials through; set keys_env or keys_file on both, or on neither"
                    )));
                }
                if i == 0 {
                    // A request starts at the first entry of its model's name, wherever that
                    // entry's upstream is: requests for this one would all go there.
                    return Err(ConfigError::new(format!(
                        "{entry} is on upstream {name:?}: the first entry is the model clients \
                         ask for, and a request for {:?} here would be sent straight to \
                         {name:?}; list the model clients ask for first (a model of this \
                         upstream)",
                        t.model
                    )));
                }
                // The target's URL goes in front of the request's path, which carries this
                // upstream's own path already.
                let path = |url: &str| {
                    url.parse::<http::Uri>()
                        .map(|u| u.path().trim_end_matches('/').to_owned())
                        .unwrap_or_default()
                };
                let (own_path, other_path) = (path(&self.url), path(&other.url));
                if !own_path.is_empty() && own_path != other_path {
                    return Err(ConfigError::new(format!(
                        "{entry} is on upstream {name:?}, whose url has the path \
                         {other_path:?}, and this upstream's url has {own_path:?}: with a \
                         path in this upstream's url, a target on another upstream needs the \
                         same path"
                    )));
                }
                let url = base_url(&other.url);
                if let Some((same, _)) = urls.iter().find(|(n, u)| *u == url && *n != name) {
                    return Err(ConfigError::new(format!(
                        "{entry} is on upstream {name:?}, whose url is {same:?}'s: the \
                         upstreams of one chain are told apart by their url"
                    )));
                }
                urls.push((name, url));
            }
            if seen.contains(&(name, t.model.as_str())) {
                return Err(ConfigError::new(format!(
                    "{entry} lists {:?} on upstream {name:?} a second time: each target \
                     once",
                    t.model
                )));
            }
            seen.push((name, &t.model));
        }
        // Fallback steps are attempts of the retry loop: the last target is reached only
        // when the policy allows that many retries. A request for the first model walks the
        // rest of the chain (at least one step).
        let max_retries = self.retry_policy().get_max_retries();
        let steps = (self.fallback.len() as u32).saturating_sub(1).max(1);
        for (key, n) in self.trigger_counts() {
            let needed = n.saturating_mul(steps);
            if needed > max_retries {
                let policy = match self.max_retries {
                    Some(m) => format!("max_retries = {m}"),
                    None => format!("policy {:?} ({max_retries} retries)", self.policy_name()),
                };
                return Err(ConfigError::new(format!(
                    "{at}: {key} needs {n} failed attempt(s) per fallback step, so {steps} \
                     step(s) down the chain take {needed} retries, but {policy} allows \
                     {max_retries}: the last fallback target can never be reached (fallback \
                     steps count against max_retries); lower {key}, raise max_retries to \
                     {needed}, or shorten fallback"
                )));
            }
        }
        Ok(())
    }

    fn policy_name(&self) -> &'static str {
        match self.policy {
            Preset::Default => "default",
            Preset::SdkCompatible => "sdk_compatible",
            Preset::Patient => "patient",
            Preset::Interactive => "interactive",
            Preset::Never => "never",
        }
    }

    /// The preset with this upstream's overrides applied.
    pub fn retry_policy(&self) -> RetryPolicy {
        self.apply_overrides(self.policy.policy())
    }

    /// Applies the timeouts and overrides of this upstream to `policy` (used for a preset a
    /// request picks by header too, so its timeouts stay the upstream's).
    pub fn apply_overrides(&self, mut policy: RetryPolicy) -> RetryPolicy {
        if let Some(n) = self.max_retries {
            policy = policy.max_retries(n);
        }
        if let Some(ms) = self.initial_backoff_ms {
            policy = policy.initial_backoff(Duration::from_millis(ms));
        }
        if let Some(ms) = self.max_backoff_ms {
            policy = policy.max_backoff(Duration::from_millis(ms));
        }
        if let Some(s) = self.retry_after_max_secs {
            policy = policy.retry_after_max(Duration::from_secs(s));
        }
        self.apply_timeouts(policy)
    }

    /// Applies only this upstream's timeouts to `policy`.
    pub fn apply_timeouts(&self, mut policy: RetryPolicy) -> RetryPolicy {
        if let Some(s) = self.head_timeout_secs {
            policy = policy.head_timeout(Some(Duration::from_secs(s)));
        }
        if let Some(s) = self.idle_timeout_secs {
            policy = policy.idle_timeout(Some(Duration::from_secs(s)));
        }
        if let Some(s) = self.first_output_timeout_secs {
            policy = policy.first_output_timeout(Some(Duration::from_secs(s)));
        }
        if let Some(s) = self.deadline_secs {
            policy = policy.deadline(Some(crate::deadline::bound(Duration::from_secs(s))));
        }
        policy
    }

    /// The retry budget, `None` when off.
    pub fn budget_config(&self) -> Option<BudgetConfig> {
        self.budget.then(BudgetConfig::default)
    }

    /// The fleet of the upstream's stack: the library's defaults (budget, gate, dormant
    /// pacing, a state per scope), less what is turned off. The stack names each tenant's
    /// scope.
    pub fn fleet(&self) -> FleetBuilder {
        let mut fleet = Fleet::builder().budget(self.budget_config());
        if !self.gate {
            fleet = fleet.cooldown_gate(None);
        }
        if !self.token_pacing {
            fleet = fleet.token_pacing(None);
        }
        if !self.pacing {
            fleet = fleet.pacing(None);
        } else if self.pacing_warm_up_secs > 0.0 {
            let warm_up =
                Duration::try_from_secs_f64(self.pacing_warm_up_secs).unwrap_or(Duration::MAX);
            fleet = fleet.pacing(Some(PacingConfig::new().warm_up(warm_up)));
        }
        fleet
    }
}

/// A secret read from the configuration: shown as `"***"` everywhere.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }

    /// The secret itself, for the one place that compares it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"***\"")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("***")
    }
}

/// A configuration that cannot be used, naming the file or variable, the key and the fix.
#[derive(Debug)]
pub struct ConfigError(String);

impl ConfigError {
    fn new(msg: impl Into<String>) -> Self {
        ConfigError(msg.into())
    }

    /// An error with this message.
    pub fn from_message(msg: impl Into<String>) -> Self {
        ConfigError(msg.into())
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads `path` (or the defaults when `None`), then applies the environment overrides
    /// and validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let mut config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    ConfigError::new(format!("cannot read config file {}: {e}", path.display()))
                })?;
                Config::from_toml(&text).map_err(|e| {
                    ConfigError::new(format!("in config file {}: {e}", path.display()))
                })?
            }
            None => Config::default(),
        };
        config.apply_env(std::env::vars())?;
        config.validate()?;
        Ok(config)
    }

    /// Parses TOML, without env overrides or validation.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        // The parser's own message quotes the offending line, which may hold a secret (a
        // `redis_url` with its password, a `client_token`): say where, not what.
        toml::from_str(text).map_err(|e: toml::de::Error| {
            let at = e.span().map(|span| {
                let before = &text.as_bytes()[..span.start.min(text.len())];
                let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
                let column = before.iter().rev().take_while(|&&b| b != b'\n').count() + 1;
                format!(" at line {line}, column {column}")
            });
            ConfigError::new(format!(
                "{}{}",
                e.message().trim_end(),
                at.unwrap_or_default()
            ))
        })
    }

    /// Applies `LLM_RETRY_PROXY_*` overrides from `vars`: `LISTEN`, `MAX_BODY_BYTES`,
    /// `MAX_CONCURRENT_REQUESTS`, `DRAIN_TIMEOUT_SECS`, `MAX_TENANTS`, `WORKER_THREADS`,
    /// `LOG_FORMAT`, `CLIENT_TOKEN`, `REDIS_URL`, `REDIS_PREFIX`, and per upstream
    /// `UPSTREAM_{NAME}_URL`, `UPSTREAM_{NAME}_POLICY`,
    /// `UPSTREAM_{NAME}_MAX_RETRIES`, `UPSTREAM_{NAME}_FALLBACK_AFTER_FAILURES`,
    /// `UPSTREAM_{NAME}_FALLBACK_AFTER_TIMEOUTS` (`NAME` upper-cased, `-` as `_`).
    ///
    /// A variable that `client_token_env` or an upstream's `keys_env` names is the secret
    /// itself, not a setting, and is left alone even when it has the prefix. No error quotes
    /// a variable's value: a misspelt name may hold a key.
    pub fn apply_env(
        &mut self,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(), ConfigError> {
        let secrets: Vec<String> = self
            .client_token_env
            .iter()
            .chain(self.upstream.iter().filter_map(|u| u.keys_env.as_ref()))
            .cloned()
            .collect();
        for (name, value) in vars {
            if secrets.contains(&name) {
                continue;
            }
            let Some(key) = name.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let bad = |what: &str| ConfigError::new(format!("environment variable {name}: {what}"));
            match key {
                "LISTEN" => self.listen = value.parse().map_err(|_| bad("expected ip:port"))?,
                "MAX_BODY_BYTES" => {
                    self.max_body_bytes = value.parse().map_err(|_| bad("expected a number"))?
                }
                "MAX_CONCURRENT_REQUESTS" => {
                    self.max_concurrent_requests =
                        value.parse().map_err(|_| bad("expected a number"))?
                }
                "BODY_TIMEOUT_SECS" => {
                    self.body_timeout_secs = value.parse().map_err(|_| bad("expected a number"))?
                }
                "MAX_BUFFERED_BODY_BYTES" => {
                    self.max_buffered_body_bytes =
                        Some(value.parse().map_err(|_| bad("expected a number"))?)
                }
                "DRAIN_TIMEOUT_SECS" => {
                    self.drain_timeout_secs = value.parse().map_err(|_| bad("expected a number"))?
                }
                "MAX_TENANTS" => {
                    self.max_tenants = value.parse().map_err(|_| bad("expected a number"))?
                }
                "WORKER_THREADS" => {
                    self.worker_threads = value.parse().map_err(|_| bad("expected a number"))?
                }
                "LOG_FORMAT" => {
                    self.log_format = match value.as_str() {
                        "text" => LogFormat::Text,
                        "json" => LogFormat::Json,
                        _ => return Err(bad("expected text or json")),
                    }
                }
                "CLIENT_TOKEN" => self.client_token = Some(Secret::new(value.clone())),
                "REDIS_URL" => self.redis_url = Some(Secret::new(value.clone())),
                "REDIS_PREFIX" => self.redis_prefix = value.clone(),
                "REDIS_FAIL_CLOSED" => {
                    self.redis_fail_closed =
                        value.parse().map_err(|_| bad("expected true or false"))?
                }
                // The log filter, read by the binary.
                "LOG" => {}
                _ => {
                    let Some(rest) = key.strip_prefix("UPSTREAM_") else {
                        return Err(bad("unknown setting"));
                    };
                    // The longest name that fits: with upstreams `eu` and `eu_west`,
                    // `UPSTREAM_EU_WEST_URL` is `eu_west`'s (names that read the same here
                    // are refused by `validate`).
                    let up = self
                        .upstream
                        .iter_mut()
                        .filter(|u| {
                            rest.strip_prefix(&env_name(&u.name))
                                .and_then(|r| r.strip_prefix('_'))
                                .is_some_and(|setting| {
                                    matches!(
                                        setting,
                                        "URL"
                                            | "POLICY"
                                            | "MAX_RETRIES"
                                            | "FALLBACK_AFTER_FAILURES"
                                            | "FALLBACK_AFTER_TIMEOUTS"
                                    )
                                })
                        })
                        .max_by_key(|u| u.name.len())
                        .ok_or_else(|| bad("no upstream of that name, or no such setting"))?;
                    match &rest[env_name(&up.name).len() + 1..] {
                        "URL" => up.url = value.clone(),
                        "POLICY" => up.policy = Preset::from_name(&value).ok_or_else(|| {
                            bad("expected default, sdk_compatible, patient, interactive or never")
                        })?,
                        "MAX_RETRIES" => {
                            up.max_retries =
                                Some(value.parse().map_err(|_| bad("expected a number"))?)
                        }
                        "FALLBACK_AFTER_FAILURES" => {
                            up.fallback_after_failures =
                                Some(value.parse().map_err(|_| bad("expected a number"))?)
                        }
                        "FALLBACK_AFTER_TIMEOUTS" => {
                            up.fallback_after_timeouts =
                                Some(value.parse().map_err(|_| bad("expected a number"))?)
                        }
                        _ => return Err(bad("unknown upstream setting")),
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks what serde cannot: URLs, prefixes, names, fallback chains, key sources.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.upstream.is_empty() {
            return Err(ConfigError::new(
                "no [[upstream]] configured: add at least one",
            ));
        }
        if self.max_concurrent_requests == 0 {
            return Err(ConfigError::new(
                "max_concurrent_requests = 0 would refuse every request: use at least 1",
            ));
        }
        if self.max_concurrent_requests > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(ConfigError::new(format!(
                "max_concurrent_requests must be at most {}",
                tokio::sync::Semaphore::MAX_PERMITS
            )));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::new(
                "max_connections = 0 would refuse every connection: use at least 1",
            ));
        }
        if self.connection_idle_timeout_secs == 0 {
            return Err(ConfigError::new(
                "connection_idle_timeout_secs must be at least 1",
            ));
        }
        if self.write_timeout_secs == 0 {
            return Err(ConfigError::new("write_timeout_secs must be at least 1"));
        }
        if self.max_tenants == 0 {
            return Err(ConfigError::new("max_tenants must be at least 1"));
        }
        if self.worker_threads > MAX_WORKER_THREADS {
            return Err(ConfigError::new(format!(
                "worker_threads must be at most {MAX_WORKER_THREADS} (0: one per core)"
            )));
        }
        if self.body_timeout_secs == 0 {
            return Err(ConfigError::new(
                "body_timeout_secs = 0 would refuse every request body: use at least 1",
            ));
        }
        if let Some(n) = self.max_buffered_body_bytes {
            if n < self.max_body_bytes {
                return Err(ConfigError::new(format!(
                    "max_buffered_body_bytes ({n}) is under max_body_bytes ({}): a body the \
                     cap accepts could never be held; raise it or leave it out",
                    self.max_body_bytes
                )));
            }
        }
        if self
            .client_token
            .as_ref()
            .is_some_and(|t| t.expose().trim().is_empty())
        {
            // An empty token matches an empty `x-api-key`: the proxy's keys for anyone.
            return Err(ConfigError::new(
                "client_token is empty: set a token, or leave it out",
            ));
        }
        if self.client_token.is_none() {
            if let Some(name) = &self.client_token_env {
                if std::env::var(name).is_ok_and(|v| !v.is_empty() && v.trim().is_empty()) {
                    return Err(ConfigError::new(format!(
                        "client_token_env names {name}, which holds only whitespace: set a token"
                    )));
                }
            }
        }
        let mut env_names: Vec<String> = Vec::new();
        self.redis_store()?;
        let mut prefixes = Vec::new();
        for up in &self.upstream {
            let at = format!("[[upstream]] {:?}", up.name);
            if up.name.is_empty()
                || !up
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(ConfigError::new(format!(
                    "{at}: name must be non-empty ASCII letters, digits, '-' or '_'"
                )));
            }
            let env = env_name(&up.name);
            if env_names.contains(&env) {
                return Err(ConfigError::new(format!(
                    "{at}: name reads as {env} in environment variables, as another upstream's \
                     does: rename one"
                )));
            }
            env_names.push(env);
            // The URL is not quoted: it may carry a password, and may come from an
            // environment variable whose value no error shows.
            let uri: http::Uri = up
                .url
                .parse()
                .map_err(|e| ConfigError::new(format!("{at}: url is not a URL: {e}")))?;
            if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                return Err(ConfigError::new(format!(
                    "{at}: url needs http:// or https:// and a host"
                )));
            }
            if uri.query().is_some() {
                return Err(ConfigError::new(format!("{at}: url must not have a query")));
            }
            let prefix = up.route_prefix();
            if prefix == "/v1" || prefix.is_empty() || prefix == "/" || prefix.starts_with("/v1/") {
                return Err(ConfigError::new(format!(
                    "{at}: prefix {prefix:?} would shadow the API's own paths: pick e.g. \"/{}\"",
                    up.name
                )));
            }
            if prefix.starts_with("/livez")
                || prefix.starts_with("/readyz")
                || prefix.starts_with("/metrics")
            {
                return Err(ConfigError::new(format!(
                    "{at}: prefix {prefix:?} is taken by the proxy's own endpoints"
                )));
            }
            if prefixes.contains(&prefix) {
                return Err(ConfigError::new(format!(
                    "{at}: prefix {prefix:?} is used twice"
                )));
            }
            prefixes.push(prefix);
            if up.fallback_threshold == 0 {
                return Err(ConfigError::new(format!(
                    "{at}: fallback_threshold must be at least 1"
                )));
            }
            if up.fallback.iter().any(|t| t.model.is_empty()) {
                return Err(ConfigError::new(format!(
                    "{at}: fallback has an empty model name"
                )));
            }
            up.validate_failover(&self.upstream)?;
            if up.keys_env.is_some() && up.keys_file.is_some() {
                return Err(ConfigError::new(format!(
                    "{at}: set keys_env or keys_file, not both"
                )));
            }
        }
        if self.upstream.iter().any(Upstream::holds_keys) && self.client_token_source().is_none() {
            return Err(ConfigError::new(
                "the proxy holds upstream keys but no client token is set: set client_token_env \
                 (or LLM_RETRY_PROXY_CLIENT_TOKEN), so that the proxy is not an open relay",
            ));
        }
        Ok(())
    }

    fn client_token_source(&self) -> Option<Secret> {
        if let Some(t) = &self.client_token {
            return Some(t.clone());
        }
        let name = self.client_token_env.as_ref()?;
        // A token of only whitespace would match a header of spaces: never a token.
        std::env::var(name)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(Secret::new)
    }

    /// The client token, from `client_token` or the variable `client_token_env` names.
    pub fn resolved_client_token(&self) -> Result<Option<Secret>, ConfigError> {
        if self.client_token.is_none() {
            if let Some(name) = &self.client_token_env {
                match std::env::var(name) {
                    Ok(v) if v.is_empty() => {}
                    Ok(v) if v.trim().is_empty() => {
                        return Err(ConfigError::new(format!(
                            "client_token_env names {name}, which holds only whitespace: \
                             set a token"
                        )))
                    }
                    Ok(_) => return Ok(self.client_token_source()),
                    Err(_) => {}
                }
                return Err(ConfigError::new(format!(
                    "client_token_env names {name}, which is not set"
                )));
            }
        }
        Ok(self.client_token_source())
    }

    /// The Redis store every stack's fleet shares, when `redis_url` is set. Nothing connects
    /// yet: the fleets connect in the background once used, and keep to their own state
    /// until then (or whenever Redis is out of reach).
    pub fn redis_store(&self) -> Result<Option<RedisFleet>, ConfigError> {
        let Some(url) = &self.redis_url else {
            return Ok(None);
        };
        if self.redis_prefix.is_empty() || self.redis_prefix.contains(['{', '}']) {
            return Err(ConfigError::new(
                "redis_prefix must be non-empty and without braces (they would move the keys' hash slot)",
            ));
        }
        // The library's error never quotes the URL (it may carry a password).
        let store = RedisFleet::from_url(url.expose())
            .map_err(|e| ConfigError::new(format!("redis_url is not a valid Redis URL ({e})")))?;
        // Every tenant's fleet is built from this one store: its scripts share one connection,
        // and its closings arrive on one pub/sub connection, whatever the number of tenants
        // (a client may make tenants at will with made-up keys).
        Ok(Some(
            store
                .prefix(self.redis_prefix.clone())
                .fail_closed(self.redis_fail_closed),
        ))
    }

    /// The resolved configuration as TOML, with every secret shown as `"***"`.
    pub fn masked(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }

    /// How long a request body may take to arrive whole.
    pub fn body_timeout(&self) -> Duration {
        Duration::from_secs(self.body_timeout_secs)
    }

    /// The request-body bytes held at once: `max_buffered_body_bytes`, else 8 ×
    /// `max_body_bytes`.
    pub fn buffered_body_budget(&self) -> usize {
        self.max_buffered_body_bytes
            .unwrap_or_else(|| self.max_body_bytes.saturating_mul(8))
    }

    /// The drain deadline.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_secs)
    }

    /// `connection_idle_timeout_secs` as a duration.
    pub fn connection_idle_timeout(&self) -> Duration {
        Duration::from_secs(self.connection_idle_timeout_secs)
    }

    /// `write_timeout_secs` as a duration.
    pub fn write_timeout(&self) -> Duration {
        Duration::from_secs(self.write_timeout_secs)
    }

    /// `http2_keep_alive_secs` as a duration, `None` when `0`.
    pub fn http2_keep_alive(&self) -> Option<Duration> {
        (self.http2_keep_alive_secs > 0).then(|| Duration::from_secs(self.http2_keep_alive_secs))
    }
}

/// `url` with whatever comes before the last `@` of its authority shown as `***`: a
/// `user:password@` is never shown. Anything after the scheme up to the last `@` is taken for
/// userinfo (a password may hold a `/`), so an `@` further on is masked too, never leaked.
pub fn mask_userinfo(url: &str) -> std::borrow::Cow<'_, str> {
    let start = url.find("://").map_or(0, |i| i + 3);
    match url[start..].rfind('@') {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]).into(),
        None => url.into(),
    }
}

fn serialize_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&mask_userinfo(url))
}

/// A URL without its trailing slashes, to compare upstreams by.
fn base_url(url: &str) -> String {
    url.trim_end_matches('/').to_ascii_lowercase()
}

fn env_name(name: &str) -> String {
    name.to_ascii_uppercase().replace('-', "_")
}

/// Reads the keys an upstream holds, from its `keys_env` or `keys_file`.
pub fn load_keys(up: &Upstream) -> Result<Option<Vec<String>>, ConfigError> {
    let text = if let Some(var) = &up.keys_env {
        std::env::var(var).map_err(|_| {
            ConfigError::new(format!(
                "[[upstream]] {:?}: keys_env names {var}, which is not set",
                up.name
            ))
        })?
    } else if let Some(path) = &up.keys_file {
        std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new(format!(
                "[[upstream]] {:?}: cannot read keys_file {}: {e}",
                up.name,
                path.display()
            ))
        })?
    } else {
        return Ok(None);
    };
    let keys: Vec<String> = text
        .split([',', '\n'])
        .map(str::trim)
        .filter(|k| !k.is_empty() && !k.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if keys.is_empty() {
        return Err(ConfigError::new(format!(
            "[[upstream]] {:?}: its key source holds no key",
            up.name
        )));
    }
    Ok(Some(keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_mask() {
        let mut c = Config::from_toml("").unwrap();
        assert_eq!(c, Config::default());
        c.client_token = Some(Secret::new("tok-SECRET"));
        c.validate().unwrap();
        let shown = c.masked();
        assert!(shown.contains("\"***\""), "{shown}");
        assert!(!shown.contains("SECRET"));
        assert!(!format!("{c:?}").contains("SECRET"));
    }

    #[test]
    fn the_pacing_keys_reach_the_fleet_and_a_warm_up_out_of_range_is_refused() {
        let c = Config::from_toml("").unwrap();
        let up = &c.upstream[0];
        let fleet = up.fleet().build();
        assert!(fleet.token_pacing().is_some());
        assert_eq!(
            fleet.pacing_config().map(|p| p.get_warm_up()),
            Some(Duration::from_secs(3))
        );
        let mut c = c.clone();
        c.upstream[0].token_pacing = false;
        c.upstream[0].pacing_warm_up_secs = 0.0;
        c.validate().unwrap();
        let fleet = c.upstream[0].fleet().build();
        assert!(fleet.token_pacing().is_none());
        assert_eq!(
            fleet.pacing_config().map(|p| p.get_warm_up()),
            Some(Duration::ZERO)
        );
        for bad in [-1.0, f64::NAN, 1e9] {
            c.upstream[0].pacing_warm_up_secs = bad;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("pacing_warm_up_secs"), "{e}");
        }
    }

    #[test]
    fn a_redis_url_is_checked_masked_and_overridable() {
        let mut c = Config::from_toml(
            "redis_url = \"redis://:pa55-SECRET@10.0.0.5:6379/2\"\nredis_prefix = \"team-a\"\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert!(c.redis_store().unwrap().is_some());
        let shown = c.masked();
        assert!(shown.contains("redis_url = \"***\""), "{shown}");
        assert!(shown.contains("redis_prefix = \"team-a\""), "{shown}");
        assert!(!shown.contains("SECRET") && !format!("{c:?}").contains("SECRET"));

        c.apply_env([(
            "LLM_RETRY_PROXY_REDIS_URL".into(),
            "not a url, SECRET".into(),
        )])
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("redis_url") && !e.contains("SECRET"), "{e}");

        c.apply_env([
            (
                "LLM_RETRY_PROXY_REDIS_URL".into(),
                "redis://127.0.0.1:1/".into(),
            ),
            ("LLM_RETRY_PROXY_REDIS_PREFIX".into(), "a{b}".into()),
        ])
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("redis_prefix"), "{e}");
        assert_eq!(Config::default().redis_store().unwrap().map(|_| ()), None);
    }

    #[test]
    fn failing_closed_is_read_from_the_file_and_the_environment() {
        let mut c = Config::from_toml("redis_fail_closed = true\n").unwrap();
        assert!(c.redis_fail_closed);
        assert!(!Config::default().redis_fail_closed);
        c.apply_env([("LLM_RETRY_PROXY_REDIS_FAIL_CLOSED".into(), "false".into())])
            .unwrap();
        assert!(!c.redis_fail_closed);
        assert!(c
            .apply_env([("LLM_RETRY_PROXY_REDIS_FAIL_CLOSED".into(), "yes".into())])
            .is_err());
        assert!(c.masked().contains("redis_fail_closed = false"));
    }

    #[test]
    fn a_redis_cluster_url_is_checked_masked_and_overridable() {
        let mut c = Config::from_toml(
            "redis_url = \"redis+cluster://:pa55-SECRET@10.0.0.5:7000,10.0.0.6:7001\"\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert!(c.redis_store().unwrap().is_some());
        let shown = c.masked();
        assert!(shown.contains("redis_url = \"***\""), "{shown}");
        assert!(!shown.contains("SECRET") && !format!("{c:?}").contains("SECRET"));
        // A cluster has one database: a path naming another is refused, without the URL.
        c.apply_env([(
            "LLM_RETRY_PROXY_REDIS_URL".into(),
            "redis+cluster://:pa55-SECRET@10.0.0.5:7000,10.0.0.6:7001/3".into(),
        )])
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("redis_url") && e.contains("database 0"), "{e}");
        assert!(!e.contains("SECRET"), "{e}");
        c.apply_env([(
            "LLM_RETRY_PROXY_REDIS_URL".into(),
            "redis+cluster://10.0.0.5:7000".into(),
        )])
        .unwrap();
        c.validate().unwrap();
        let e = Config::from_toml("redis_url = \"redis+cluster://:pw-SECRET@/\"\n")
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("redis_url") && !e.contains("SECRET"), "{e}");
    }

    #[test]
    fn resume_is_off_by_default_and_read_per_upstream() {
        let c = Config::default();
        assert!(c.upstream.iter().all(|u| u.resume == ResumeMode::Off));
        let c = Config::from_toml(
            "[[upstream]]\nname = \"a\"\nresume = \"prefill\"\n\n\
             [[upstream]]\nname = \"b\"\nkind = \"openai\"\nresume = \"instruction\"\n\n\
             [[upstream]]\nname = \"c\"\n",
        )
        .unwrap();
        let modes: Vec<_> = c.upstream.iter().map(|u| u.resume).collect();
        assert_eq!(
            modes,
            [
                ResumeMode::Prefill,
                ResumeMode::Instruction,
                ResumeMode::Off
            ]
        );
        let e = Config::from_toml("[[upstream]]\nresume = \"always\"\n").unwrap_err();
        assert!(e.to_string().contains("unknown variant `always`"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let e = Config::from_toml("listen = \"127.0.0.1:1\"\nlisten_port = 3\n").unwrap_err();
        assert!(e.to_string().contains("listen_port"), "{e}");
        let e = Config::from_toml("[[upstream]]\nname = \"a\"\nurls = \"x\"\n").unwrap_err();
        assert!(e.to_string().contains("urls"), "{e}");
    }

    #[test]
    fn env_overrides() {
        let mut c = Config::default();
        c.apply_env([
            ("LLM_RETRY_PROXY_LISTEN".into(), "127.0.0.1:9999".into()),
            (
                "LLM_RETRY_PROXY_UPSTREAM_OPENAI_URL".into(),
                "http://127.0.0.1:1".into(),
            ),
            (
                "LLM_RETRY_PROXY_UPSTREAM_ANTHROPIC_POLICY".into(),
                "patient".into(),
            ),
            ("OTHER".into(), "ignored".into()),
        ])
        .unwrap();
        assert_eq!(c.listen.port(), 9999);
        assert_eq!(c.upstream[1].url, "http://127.0.0.1:1");
        assert_eq!(c.upstream[0].policy, Preset::Patient);
        let e = c
            .apply_env([("LLM_RETRY_PROXY_UPSTREAM_NOPE_URL".into(), "x".into())])
            .unwrap_err();
        assert!(e.to_string().contains("UPSTREAM_NOPE_URL"), "{e}");
    }

    #[test]
    fn an_upstream_printed_for_debugging_masks_its_password() {
        let up = Upstream::new(
            "eu",
            Kind::Anthropic,
            "https://user:hunter2@gw.example.com/v1",
        );
        let shown = format!("{up:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("gw.example.com"), "{shown}");
    }

    #[test]
    fn userinfo_is_masked() {
        for (url, shown) in [
            (
                "https://user:pw@host.example/b",
                "https://***@host.example/b",
            ),
            ("https://user@host.example", "https://***@host.example"),
            ("https://u:p/w@host.example/b", "https://***@host.example/b"),
            ("u:pw@host.example", "***@host.example"),
            ("https://host.example/v1", "https://host.example/v1"),
        ] {
            assert_eq!(mask_userinfo(url), shown, "{url}");
        }
    }

    #[test]
    fn validation_names_the_problem() {
        let mut c = Config::default();
        c.upstream[0].keys_env = Some("SOME_KEYS".into());
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("open relay"), "{e}");
        let mut c = Config::default();
        c.upstream[1].prefix = Some("/v1".into());
        assert!(c.validate().unwrap_err().to_string().contains("shadow"));
        let mut c = Config::default();
        c.upstream[0].url = "ftp://x".into();
        assert!(c.validate().unwrap_err().to_string().contains("http://"));
    }

    #[test]
    fn no_env_error_quotes_a_value_and_named_secrets_are_left_alone() {
        // The variable the README names for the token has the prefix: it is the token, not a
        // setting, and so are the keys a `keys_env` names.
        let mut c = Config::from_toml(
            "client_token_env = \"LLM_RETRY_PROXY_TOKEN\"\n[[upstream]]\nname = \"a\"\n\
             keys_env = \"LLM_RETRY_PROXY_KEYS\"\n",
        )
        .unwrap();
        c.apply_env([
            ("LLM_RETRY_PROXY_TOKEN".into(), "tok-SECRET".into()),
            ("LLM_RETRY_PROXY_KEYS".into(), "sk-SECRET".into()),
        ])
        .unwrap();
        // A misspelt setting, a bad value, an unknown upstream setting: named, never quoted.
        for (name, value) in [
            ("LLM_RETRY_PROXY_TOKN", "tok-SECRET"),
            ("LLM_RETRY_PROXY_MAX_BODY_BYTES", "sk-SECRET"),
            ("LLM_RETRY_PROXY_UPSTREAM_A_KEYS", "sk-SECRET"),
        ] {
            let e = c
                .apply_env([(name.into(), value.into())])
                .unwrap_err()
                .to_string();
            assert!(e.contains(name), "{e}");
            assert!(!e.contains("SECRET"), "{e}");
        }
    }

    #[test]
    fn a_syntax_error_says_where_not_what() {
        let e = Config::from_toml("redis_url = 'redis://:pw-SECRET@h\nlisten = 3\n")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("SECRET"), "{e}");
        assert!(e.contains("line 1"), "{e}");
        let e = Config::from_toml("listen = \"127.0.0.1:1\"\nlisten_port = 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("listen_port") && e.contains("line 2"), "{e}");
    }

    #[test]
    fn an_empty_client_token_is_refused() {
        for token in ["", "  "] {
            let mut c = Config {
                client_token: Some(Secret::new(token)),
                ..Config::default()
            };
            c.upstream[0].keys_env = Some("SOME_KEYS".into());
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("client_token is empty"), "{e}");
        }
    }

    #[test]
    fn an_upstream_override_goes_to_the_longest_name_and_names_must_differ() {
        let mut c = Config::from_toml(
            "[[upstream]]\nname = \"eu\"\n[[upstream]]\nname = \"eu_west\"\nprefix = \"/w\"\n",
        )
        .unwrap();
        c.apply_env([
            (
                "LLM_RETRY_PROXY_UPSTREAM_EU_WEST_URL".into(),
                "http://west.example".into(),
            ),
            (
                "LLM_RETRY_PROXY_UPSTREAM_EU_URL".into(),
                "http://eu.example".into(),
            ),
        ])
        .unwrap();
        assert_eq!(c.upstream[0].url, "http://eu.example");
        assert_eq!(c.upstream[1].url, "http://west.example");
        c.validate().unwrap();
        // `a-b` and `a_b` both read as `A_B`: one would take the other's overrides.
        let c = Config::from_toml(
            "[[upstream]]\nname = \"a-b\"\n[[upstream]]\nname = \"a_b\"\nprefix = \"/x\"\n",
        )
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("A_B"), "{e}");
    }

    #[test]
    fn body_limits_default_validate_and_take_env_overrides() {
        let c = Config::default();
        assert_eq!(c.body_timeout(), Duration::from_secs(60));
        assert_eq!(c.buffered_body_budget(), 256 * 1024 * 1024);
        let c = Config::from_toml("max_body_bytes = 1000\n").unwrap();
        assert_eq!(c.buffered_body_budget(), 8000);
        let c = Config::from_toml(
            "max_body_bytes = 1000\nmax_buffered_body_bytes = 999\n[[upstream]]\nname = \"a\"\n",
        )
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_buffered_body_bytes (999)"), "{e}");
        let c = Config::from_toml("body_timeout_secs = 0\n[[upstream]]\nname = \"a\"\n").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("body_timeout_secs = 0"), "{e}");
        let mut c = Config::default();
        c.apply_env([
            ("LLM_RETRY_PROXY_BODY_TIMEOUT_SECS".into(), "5".into()),
            (
                "LLM_RETRY_PROXY_MAX_BUFFERED_BODY_BYTES".into(),
                "33554432".into(),
            ),
        ])
        .unwrap();
        assert_eq!(c.body_timeout(), Duration::from_secs(5));
        assert_eq!(c.buffered_body_budget(), 32 * 1024 * 1024);
        c.validate().unwrap();
    }

    #[test]
    fn the_client_deadline_is_honoured_unless_turned_off() {
        assert!(Upstream::default().client_deadline);
        let c = Config::from_toml(
            "[[upstream]]\nname = \"a\"\ndeadline_secs = 30\nclient_deadline = false\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert!(!c.upstream[0].client_deadline);
        assert_eq!(c.upstream[0].deadline_secs, Some(30));
        assert!(c.masked().contains("client_deadline = false"));
    }

    #[test]
    fn a_concurrency_cap_above_what_a_semaphore_holds_is_refused() {
        let c = Config {
            max_concurrent_requests: usize::MAX,
            ..Config::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_concurrent_requests"), "{e}");
    }

    #[test]
    fn connection_limits_of_zero_are_refused() {
        for (tweak, key) in [
            (
                (|c: &mut Config| c.max_connections = 0) as fn(&mut Config),
                "max_connections",
            ),
            (
                |c| c.connection_idle_timeout_secs = 0,
                "connection_idle_timeout_secs",
            ),
            (|c| c.write_timeout_secs = 0, "write_timeout_secs"),
        ] {
            let mut c = Config::default();
            tweak(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
        // No pings is a choice, not a mistake.
        let c = Config {
            http2_keep_alive_secs: 0,
            ..Config::default()
        };
        c.validate().unwrap();
        assert_eq!(c.http2_keep_alive(), None);
    }

    #[test]
    fn worker_threads_from_the_file_or_the_environment_and_bounded() {
        assert_eq!(Config::default().worker_threads, 0);
        let c = Config::from_toml("worker_threads = 3\n[[upstream]]\nname = \"a\"\n").unwrap();
        c.validate().unwrap();
        assert_eq!(c.worker_threads, 3);
        let mut c = Config::default();
        c.apply_env([("LLM_RETRY_PROXY_WORKER_THREADS".into(), "1".into())])
            .unwrap();
        assert_eq!(c.worker_threads, 1);
        let e = c
            .apply_env([("LLM_RETRY_PROXY_WORKER_THREADS".into(), "many".into())])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("WORKER_THREADS") && e.contains("a number"),
            "{e}"
        );
        let c = Config {
            worker_threads: MAX_WORKER_THREADS + 1,
            ..Config::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("worker_threads must be at most 1024"), "{e}");
    }

    /// Two OpenAI upstreams and one Anthropic upstream, for the failover checks.
    fn failover(extra: &str) -> Result<Config, ConfigError> {
        let c = Config::from_toml(&format!(
            "[[upstream]]\nname = \"openai\"\nkind = \"openai\"\nurl = \"https://api.openai.com\"\n\
             {extra}\n\
             [[upstream]]\nname = \"backup\"\nkind = \"openai\"\nurl = \"https://backup.example.com\"\n\
             [[upstream]]\nname = \"claude\"\nkind = \"anthropic\"\n"
        ))?;
        c.validate()?;
        Ok(c)
    }

    fn refused(extra: &str) -> String {
        failover(extra).unwrap_err().to_string()
    }

    #[test]
    fn fallback_entries_are_names_or_tables_and_round_trip_masked() {
        let c = failover(
            "policy = \"sdk_compatible\"\nfallback_threshold = 1\n\
             context_window_fallback = \"gpt-4.1\"\nresume = \"prefill\"\n\
             fallback = [\"gpt-4o\", { model = \"gpt-4o\", upstream = \"backup\", resume = \"instruction\" }]\n\
             fallback_after_failures = 2\nfallback_after_timeouts = 1\n\
             fallback_after_connect_failures = 1\nfallback_on_unwaitable_rate_limit = true\n\
             [upstream.circuit]\nfailures = 3\n",
        )
        .unwrap();
        let up = &c.upstream[0];
        assert_eq!(up.fallback[0], FallbackTarget::from("gpt-4o"));
        assert_eq!(
            up.fallback[1],
            FallbackTarget {
                model: "gpt-4o".into(),
                upstream: Some("backup".into()),
                resume: Some(ResumeMode::Instruction),
            }
        );
        assert_eq!(
            up.circuit,
            Some(CircuitConfig {
                failures: 3,
                ..CircuitConfig::default()
            })
        );
        assert_eq!(up.fallback_after_connect_failures, Some(1));
        // The resume mode of each (upstream, model) that can serve.
        assert_eq!(up.resume_for("backup", "gpt-4o"), ResumeMode::Instruction);
        assert_eq!(up.resume_for("openai", "gpt-4o"), ResumeMode::Prefill);
        assert_eq!(up.resume_for("openai", "gpt-4.1"), ResumeMode::Prefill);
        assert_eq!(up.resume_for("backup", "other"), ResumeMode::Off);
        assert_eq!(c.upstream[1].resume, ResumeMode::Off, "off by default");
        // `--check-config` prints what parses back to the same configuration.
        let again = Config::from_toml(&c.masked()).unwrap();
        assert_eq!(again, c, "{}", c.masked());
        // A table with a key of no meaning is refused with its name.
        let e = refused("fallback = [{ model = \"m\", upstreams = \"backup\" }]");
        assert!(e.contains("upstreams"), "{e}");
        let e = refused("resume = \"sometimes\"");
        assert!(e.contains("sometimes") || e.contains("resume"), "{e}");
    }

    #[test]
    fn the_circuit_defaults_are_the_librarys() {
        assert_eq!(CircuitConfig::default().circuit(), Circuit::new());
        let c = failover("fallback = [\"a\", \"b\"]\n[upstream.circuit]\n").unwrap();
        assert_eq!(c.upstream[0].circuit, Some(CircuitConfig::default()));
        assert_eq!(
            Config::default().upstream[0].circuit,
            None,
            "no circuits by default"
        );
    }

    #[test]
    fn a_fallback_target_on_another_upstream_must_exist_match_and_differ() {
        let e = refused("fallback = [\"gpt-4o\", { model = \"gpt-4o\", upstream = \"nope\" }]");
        assert_eq!(
            e,
            "[[upstream]] \"openai\": fallback entry 2 (\"gpt-4o\") names upstream \"nope\", \
             which is not configured: use one of [\"openai\", \"backup\", \"claude\"]"
        );
        let e = refused("fallback = [\"gpt-4o\", { model = \"claude-x\", upstream = \"claude\" }]");
        assert_eq!(
            e,
            "[[upstream]] \"openai\": fallback entry 2 (\"claude-x\") is on upstream \"claude\" \
             of kind anthropic, but this upstream is of kind openai: a fallback target must \
             speak the same API"
        );
        // The same target twice, also when the entry names its own upstream.
        for chain in [
            "[\"gpt-4o\", \"gpt-4o\"]",
            "[\"gpt-4o\", { model = \"gpt-4o\", upstream = \"openai\" }]",
        ] {
            let e = refused(&format!("fallback = {chain}"));
            assert_eq!(
                e,
                "[[upstream]] \"openai\": fallback entry 2 (\"gpt-4o\") lists \"gpt-4o\" on \
                 upstream \"openai\" a second time: each target once",
                "{chain}"
            );
        }
        let e = refused("fallback = [{ model = \"gpt-4o\", upstream = \"backup\" }]");
        assert!(
            e.starts_with(
                "[[upstream]] \"openai\": fallback entry 1 (\"gpt-4o\") is on upstream \
                 \"backup\": the first entry is the model clients ask for"
            ),
            "{e}"
        );
        // The same model elsewhere, after this upstream's: accepted.
        failover("fallback = [\"gpt-4o\", { model = \"gpt-4o\", upstream = \"backup\" }]").unwrap();
        // Upstreams of one chain are told apart by their url, and paths must line up.
        let mut c =
            failover("fallback = [\"gpt-4o\", { model = \"gpt-4o\", upstream = \"backup\" }]")
                .unwrap();
        c.upstream[1].url = "https://api.openai.com/".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.ends_with(
                "whose url is \"openai\"'s: the upstreams of one chain are told apart by their url"
            ),
            "{e}"
        );
        c.upstream[0].url = "https://gw.example.com/openai".into();
        c.upstream[1].url = "https://gw.example.com/backup".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains(
                "whose url has the path \"/backup\", and this upstream's url has \"/openai\""
            ),
            "{e}"
        );
        c.upstream[1].url = "https://backup.example.com/openai/".into();
        c.validate().unwrap();
    }

    #[test]
    fn both_upstreams_hold_keys_or_neither() {
        let mut c = failover("").unwrap();
        c.client_token = Some(Secret::new("tok"));
        c.upstream[0].fallback = vec![
            "gpt-4o".into(),
            FallbackTarget {
                model: "gpt-4o".into(),
                upstream: Some("backup".into()),
                resume: None,
            },
        ];
        c.upstream[1].keys_env = Some("BACKUP_KEYS".into());
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(
            e,
            "[[upstream]] \"openai\": fallback entry 2 (\"gpt-4o\") is on upstream \"backup\": \
             upstream \"backup\" holds keys (keys_env or keys_file) and \"openai\" passes the \
             client's credentials through; set keys_env or keys_file on both, or on neither"
        );
        c.upstream[0].keys_file = Some("openai-keys".into());
        c.validate().unwrap();
        c.upstream[1].keys_env = None;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains(
                "upstream \"openai\" holds keys (keys_env or keys_file) and \"backup\" passes"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_trigger_the_retry_budget_cannot_reach_is_refused() {
        // The case: two retries, three overloads before the one fallback.
        let e = refused("policy = \"sdk_compatible\"\nfallback = [\"gpt-4o\", \"gpt-4o-mini\"]");
        assert_eq!(
            e,
            "[[upstream]] \"openai\": fallback_threshold needs 3 failed attempt(s) per fallback \
             step, so 1 step(s) down the chain take 3 retries, but policy \"sdk_compatible\" (2 \
             retries) allows 2: the last fallback target can never be reached (fallback steps \
             count against max_retries); lower fallback_threshold, raise max_retries to 3, or \
             shorten fallback"
        );
        // A failure trigger below the threshold fires first for overloads too.
        failover(
            "policy = \"sdk_compatible\"\nfallback = [\"gpt-4o\", \"gpt-4o-mini\"]\n\
             fallback_after_failures = 2",
        )
        .unwrap();
        // Each configured trigger over a longer chain, against an override.
        for (key, line) in [
            ("fallback_after_failures", "fallback_after_failures = 2"),
            ("fallback_after_timeouts", "fallback_after_timeouts = 2"),
            (
                "fallback_after_connect_failures",
                "fallback_after_connect_failures = 2",
            ),
        ] {
            let e = refused(&format!(
                "max_retries = 3\nfallback_threshold = 1\nfallback = [\"a\", \"b\", \"c\"]\n{line}"
            ));
            assert_eq!(
                e,
                format!(
                    "[[upstream]] \"openai\": {key} needs 2 failed attempt(s) per fallback \
                     step, so 2 step(s) down the chain take 4 retries, but max_retries = 3 \
                     allows 3: the last fallback target can never be reached (fallback steps \
                     count against max_retries); lower {key}, raise max_retries to 4, or \
                     shorten fallback"
                )
            );
        }
        let e = refused(
            "policy = \"never\"\nfallback_threshold = 1\nfallback = [\"a\", \"b\"]\n\
             fallback_on_unwaitable_rate_limit = true",
        );
        assert!(
            e.starts_with("[[upstream]] \"openai\": fallback_threshold needs 1 failed attempt(s)"),
            "{e}"
        );
        assert!(e.contains("policy \"never\" (0 retries) allows 0"), "{e}");
        // Exactly enough is enough.
        failover("max_retries = 4\nfallback_after_failures = 2\nfallback = [\"a\", \"b\", \"c\"]")
            .unwrap();
    }

    #[test]
    fn keys_that_would_do_nothing_are_refused() {
        assert_eq!(
            refused("fallback_after_failures = 0\nfallback = [\"a\", \"b\"]"),
            "[[upstream]] \"openai\": fallback_after_failures must be at least 1 (leave it out \
             to turn it off)"
        );
        assert_eq!(
            refused("fallback_after_timeouts = 1"),
            "[[upstream]] \"openai\": fallback_after_timeouts is set but fallback is empty: add \
             a fallback target, or leave fallback_after_timeouts out"
        );
        assert_eq!(
            refused("[upstream.circuit]\nfailures = 2"),
            "[[upstream]] \"openai\": [upstream.circuit] is set but fallback is empty: add a \
             fallback target, or leave [upstream.circuit] out"
        );
        assert_eq!(
            refused("fallback = [\"a\", \"b\"]\n[upstream.circuit]\ncooldown_secs = 0"),
            "[[upstream]] \"openai\": circuit.cooldown_secs must be at least 1"
        );
        assert_eq!(
            refused("context_window_fallback = \"big\"\noverflow_repair = false"),
            "[[upstream]] \"openai\": context_window_fallback needs overflow_repair = true (the \
             repair sends the request to it)"
        );
    }

    #[test]
    fn fallback_triggers_take_env_overrides() {
        let mut c = failover("fallback = [\"a\", \"b\"]").unwrap();
        c.apply_env([
            (
                "LLM_RETRY_PROXY_UPSTREAM_OPENAI_FALLBACK_AFTER_FAILURES".into(),
                "2".into(),
            ),
            (
                "LLM_RETRY_PROXY_UPSTREAM_OPENAI_FALLBACK_AFTER_TIMEOUTS".into(),
                "1".into(),
            ),
        ])
        .unwrap();
        assert_eq!(c.upstream[0].fallback_after_failures, Some(2));
        assert_eq!(c.upstream[0].fallback_after_timeouts, Some(1));
        let e = c
            .apply_env([(
                "LLM_RETRY_PROXY_UPSTREAM_OPENAI_FALLBACK_AFTER_TIMEOUTS".into(),
                "x".into(),
            )])
            .unwrap_err();
        assert!(e.to_string().contains("expected a number"), "{e}");
    }
}
