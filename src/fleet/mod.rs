//! Fleet behaviour: the requests sent on one API key share a retry budget, a cooldown gate and
//! an adaptive pacing, so that they behave as a well-mannered fleet rather than a retry storm.
//! That state is a [`Fleet`]: built once, cloned into every layer that sends on the key, and
//! readable while requests run. By default a fleet keeps it per scope (the upstream and a hash
//! of the credential), so one layer may front several keys and upstreams without one key's
//! `429` holding the others.
//!
//! Per-request retry alone turns an overload into a storm: each failed request retries, the
//! retries add load, and an exact `Retry-After` sends everyone back in the same instant.
//!
//! - **Retry budget** ([`BudgetConfig`], on by default): every first attempt deposits, every
//!   retry withdraws; retries the budget cannot pay for are not made. With the defaults,
//!   retries add at most 20 % to the load, plus 10 a second. The accounting is
//!   [`tower::retry::budget::TpsBudget`].
//! - **Cooldown gate** ([`GateConfig`], on by default for a `Retry-After` of 2 s or more): a
//!   `429` or `529` with `Retry-After`,
//!   or rate-limit headers saying no request is left ([below](#rate-limit-headers)), close the gate until
//!   then; attempts about to be sent wait at the gate instead of hammering, and leave spread
//!   over a window once it reopens. An open gate costs a request one atomic load.
//! - **Adaptive pacing** ([`PacingConfig`], on by default and [dormant](PacingConfig::dormant)
//!   until the server signals a rate limit): attempts leave evenly spaced, in
//!   arrival order, at a rate learned from the answers: slow start until the first refusal,
//!   then a small increase per success and a multiplicative decrease per `429`;
//!   a long `Retry-After` is read as a quota and sets the rate that spreads it over its
//!   cycle. It wakes only on evidence of a limit the scope's own rate meets
//!   ([below](#noise-or-a-limit)). A fleet whose requests start together otherwise comes back together, and a
//!   server's limiter refuses the part of every burst above its capacity even when the
//!   average fits. An attempt waits in line no longer than its policy's Retry-After
//!   ceiling or its deadline
//!   ([`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong)), and a head of
//!   the line that is not polled does not hold up the others.
//!
//! # Noise or a limit
//!
//! A dormant pacing slows a scope only on evidence that the scope's own rate meets a limit,
//! one of ([`PacingWake`], read back with [`Fleet::pacing_state`], [`Fleet::paced_scopes`]
//! and [`Fleet::pacing_wakes`]):
//!
//! - rate-limit headers saying at most a tenth of the stated request limit is left;
//! - a `429` whose `Retry-After` is longer than the backoff its retry would take on its own
//!   (the server asks for more than a retry would give it) and than 1 s (what any server
//!   rounding up to whole seconds says for a token bucket's next token, and random
//!   refusals say too);
//! - a `429` whose `Retry-After` is 10 s or more: a quota spent, renewed at its reset;
//! - a burst of `429`s: at least 16 within 10 s that are at least a quarter of the attempts
//!   sent since the first of them came back.
//!
//! Anything else is noise, absorbed by the retries: a `429` without `Retry-After` (or with
//! one no longer than the backoff) among attempts mostly answered, and every overload
//! (`529`, OpenAI's `503` overloaded), which is the server's state, not this client's limit
//! (the budget and the gate shed load already). An overload neither wakes the pacing nor,
//! once awake, slows it. Random refusals at a steady few percent, even 15 %, stay well below
//! a quarter of the attempts; a server refusing the part of the demand above its limit
//! refuses far more. A pacing once woken stays awake, slowed by each round of `429`s and
//! growing back with the successes.
//!
//! Evidence comes back with answers, and a scope's first attempts go out before any: when
//! many clients start together, a dormant pacing lets them all go, and against a limit all
//! but the limit's worth are refused whatever it learns after. A
//! [warm-up](PacingConfig::warm_up) (off in the library's defaults, on in the proxy's) paces
//! a new scope from its first attempt at the initial rate, in slow start, unslowed by noise,
//! until evidence wakes the pacing for good or the warm-up is over with no one in line.
//!
//! # Pacing by tokens
//!
//! Providers limit tokens per minute as well as requests, and say so on every answer
//! (Anthropic: input and output, and the most restrictive of its token limits, read only
//! where neither of the others is stated; OpenAI: one token limit, read as both together;
//! see [the headers](#rate-limit-headers)). For requests with large prompts the
//! token limit is the one met first, well inside the request limit. The token pacing
//! ([`TokenPacingConfig`], on by default and dormant) keeps a scope under it:
//!
//! - **Dormant** until a token limit is met: a response stating that at most a tenth of a
//!   token limit is left ([`TokenWake::NearlySpent`]), or a `429` for a token limit
//!   ([`TokenWake::TokenRefusal`]): its token headers read 0, or its message names input or
//!   output tokens ("… 40,000 input tokens per minute", "… on tokens per min (TPM)"). A
//!   `429` for the request limit does not wake it, nor does a stated limit with room left.
//!   Dormant, it costs a pass over the response's headers.
//! - **Awake**, a bucket per kind of limit woken, sized from the stated limit and refilled
//!   continuously at `limit / 60 s`, as the providers describe theirs; it starts from what
//!   the server said is left. Each attempt takes its cost from every awake bucket before it
//!   is sent: its input tokens from the input bucket, the output it may produce from the
//!   output bucket, both from the combined one. A request waits for its tokens, then for its
//!   request-pacing turn: a turn is not spent waiting for tokens. What the server says is
//!   left lowers a bucket (it counts every client of the limit), never raises it; it is taken
//!   as a count made when the attempt it answers was sent, refilled since, less the tokens
//!   taken since (the server had not seen those requests).
//! - **Settled by the answer**: a success's usage, read from its body as it goes to the
//!   caller (`usage.input_tokens` plus `cache_creation_input_tokens`, or `prompt_tokens`;
//!   `output_tokens` or `completion_tokens`; in a JSON answer, or in a stream's first and
//!   last events), gives back what the estimate took beyond it, or takes what it fell short.
//!   The output is settled only when the body was read to its end. An answer the server
//!   refused (any status but a success) gives the whole charge back: the providers do not
//!   count it. A transport failure keeps it.
//! - **No starvation: head-of-line order.** The requests of a scope take their tokens in
//!   arrival order: a large request at the head of the line is not passed by the small ones
//!   behind it, though the bucket holds enough for each of them long before it holds enough
//!   for it. The cost: while a large request waits, the small ones wait behind it, at most
//!   the large one's refill time. Across processes the order is that of the bookings in
//!   Redis, the same rule. A head that does not take its tokens (a future kept alive but no
//!   longer polled) does not hold the line: 100 ms after they are in hand, the one right
//!   behind it passes it over, and it comes back right behind that one.
//! - **A request larger than the whole limit** (its estimate above the bucket) is not held
//!   forever and not refused on an estimate: it waits for a full bucket, takes all of it,
//!   and goes alone. The server then serves it (the estimate was high: the usage settles the
//!   difference) or refuses it (its `429` and `Retry-After` come back to the caller as any
//!   other, and the tokens are given back).
//! - **Bounded**: an attempt waits for its tokens no longer than it may wait in the request
//!   pacing's line (its policy's `retry_after_max`, 60 s by default, or its deadline). When it
//!   is known that its tokens come later (on joining, from the tokens of those ahead of it),
//!   it ends with [`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong) (or
//!   [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded)), nothing sent.
//! - **Visible**: [`Fleet::token_pacing`] reads the tokens per minute believed, each
//!   bucket's level, the requests in line and those that waited; [`Fleet::token_pacing_state`]
//!   what woke a scope's; a request that waited for tokens says how long in its
//!   [`RetryTrail::token_wait`](crate::RetryTrail::token_wait).
//!
//! ## The estimate
//!
//! A request's input tokens are estimated before it is sent from its buffered body: a
//! quarter of its bytes, each base64 `"data"` string of 1 KiB or more (an image, a document)
//! counted as 1,600 tokens instead. Four bytes a token is the providers' own rule of thumb
//! for English; the JSON around the messages (keys, quotes, the model's name, tool schemas)
//! makes it an over-estimate, which is the safe side (the usage gives the excess back), and
//! one pass over the bytes costs far less than a tokenizer. Code and languages that take
//! more tokens a byte are under-estimated until their usage comes back.
//! [`TokenPacingConfig::input_counter`] puts the caller's own count in its place. The output
//! reserved is the request's `max_tokens` (or `max_completion_tokens`, `max_output_tokens`),
//! as Anthropic reserves it against its output limit, 0 when it sets none.
//!
//! Across processes (`fleet-redis`), the buckets of a scope are one in Redis: an attempt
//! books its tokens with one script on Redis's clock (a GCRA weighted by the tokens, so the
//! bookings keep their arrival order) and sleeps locally until they are in hand; the usage
//! gives back in the background. Redis counts only the fleet's bookings, the server every
//! client of the limit: a booking carries what the server last said is left (refilled to
//! now) and when, and the shared bucket is lowered to it less what the fleet booked since
//! then (those the server had not counted), as each process lowers its own. So a process
//! whose first requests went before it knew the limit, unbooked, is caught up with by its
//! first booking, whichever process made the bucket. A booking Redis does not answer within
//! its deadline takes this process's bucket instead. Each process wakes on its own
//! answers. Keys: `…:tokens` (a hash: each kind's theoretical arrival time on Redis's
//! clock, and its running total of bookings) and `…:tokens-log` (a sorted set: the last
//! 2 s of bookings, by the time their tokens were in hand).
//!
//! # Sharing
//!
//! A [`Fleet`] is a handle on one state: its clones share it. Every layer given the same
//! fleet ([`RetryLayer::fleet`](crate::RetryLayer::fleet)), the services they make, and their
//! clones, share one budget, one gate and one pace per scope, whichever client they sit in
//! front of. A layer given none builds its own [`Fleet::default`]; its clones keep sharing
//! it, however they are re-configured. Two layers built separately without a fleet share
//! nothing.
//!
//! # The defaults
//!
//! A fleet built by default ([`Fleet::default`], [`Fleet::builder`], and the one a
//! [`RetryLayer::new`](crate::RetryLayer::new) builds for itself) has the budget, the gate
//! (for a `Retry-After` of 2 s or more), a dormant pacing with a burst of 1 s, and a state
//! per scope. Where no limit is met that costs nothing but the bookkeeping: the gate is
//! open, the pacing limits nothing until the server shows a limit the scope's rate meets
//! ([evidence](#noise-or-a-limit), not a random `429` or an overload), and then starts from the rate it
//! measured over the last second. On the success path, in memory, the defaults cost about
//! 400 instructions a request more than the budget alone (the scope's hash and lookup, the
//! rate-limit headers read on the answer when the pacing or the gate uses them); an open gate
//! is one atomic load, a dormant pacing a load and an atomic add. In the storm bench they turn S1 (1,000 clients against a token
//! bucket) from 5.4 % success at 22 attempts per success into 100 % at 1.01, lose nothing in
//! S4 (an outage) and S5 (random `503`s, no limit), and at the knee (S6, demand at the
//! limit) keep goodput (0.979 C against 0.977 C) and succeed for every request where the
//! budget alone fails 0.6 % (its p99 is 5.0 s, against 2.0 s for the requests the budget
//! alone gets through); with random `429`s and overloads at 3 % and 8 % and no limit, they
//! keep all the goodput of the same run with pacing off. The earlier defaults, the budget alone and one state:
//!
//! ```
//! use tower_llm_retry::fleet::Fleet;
//! use tower_llm_retry::RetryLayer;
//!
//! let old = Fleet::builder()
//!     .cooldown_gate(None)
//!     .pacing(None)
//!     .per_scope(false)
//!     .build();
//! let layer = RetryLayer::new().fleet(old);
//! # let _ = layer;
//! ```
//!
//! # Configuration
//!
//! | setting | default | change with |
//! |---|---|---|
//! | retry budget | on: deposits count for 10 s, 10 retries a second whatever the traffic, plus 20 % of first attempts; in any 10 s, at most `10 × 10 + 0.2 × first attempts` retries ([`BudgetConfig::max_retries`]) | [`FleetBuilder::budget`] with [`BudgetConfig::new(ttl, min_per_sec, ratio)`](BudgetConfig::new), or `None` to turn it off |
//! | cooldown gate | on, for a `Retry-After` of 2 s or more (a shorter one, a token bucket's next token, is left to the pacing) | [`FleetBuilder::cooldown_gate`] with a [`GateConfig`] (`GateConfig::new().min_close(Duration::ZERO)`: every `Retry-After` closes it), or `None` to turn it off |
//! | gate: what closes it | a `429` or `529` with a `Retry-After`, for that wait (at most the request's `retry_after_max`; not one above it that the policy ignores, [`AboveCeiling::UseBackoff`](crate::retry::AboveCeiling::UseBackoff)); rate-limit headers saying no request is left, until their reset | [`GateConfig::min_close`] (2 s by default; zero: every `Retry-After` closes it), [`GateConfig::rate_limit_headers`] (default on) |
//! | gate: spread on reopening | each waiter adds a random extra in `[0, min(50 % × announced wait, 30 s)]`, from the policy's [`Random`] | [`GateConfig::spread`] |
//! | adaptive pacing | on, dormant: it limits nothing until the server shows a limit the scope's rate meets ([evidence](#noise-or-a-limit): a burst of `429`s, a `Retry-After` longer than the backoff, a quota, headers saying little is left; an overload or a `5xx` neither wakes nor slows it, and a stated request limit, which the providers send on every answer, only caps it for when it wakes); woken by a refusal, it starts from the rate measured over the last second, halved as at the end of slow start but not below 50/s and not above a stated limit; a response saying at most a tenth of the stated limit is left wakes it at the limit | [`FleetBuilder::pacing`] with a [`PacingConfig`] ([`PacingConfig::dormant`]`(false)` paces from the first attempt), or `None` to turn it off |
//! | pacing: rate | starts at 50 requests/s (when not dormant), kept within 1 and 10,000 (a stated limit may cap it lower); slow start doubles it every second until the first refusal | [`PacingConfig::rates`] |
//! | pacing: burst | 1 s (after a quiet spell, up to `rate × 1 s` attempts leave at once) | [`PacingConfig::burst`] |
//! | pacing: on a `429` or overload | ×0.95, once per round; the first refusal, which ends slow start, at least halves it | [`PacingConfig::decrease`] |
//! | pacing: on a success | +0.05 requests/s, only while someone waits in line | [`PacingConfig::growth`] |
//! | pacing: a `Retry-After` of 10 s or more | read as a quota spent: the rate that spreads it over its cycle, held for a cycle, then at most +25 % a cycle | — |
//! | pacing: a stated request limit | caps the rate at the limit per 60 s | [`PacingConfig::limit_period`] |
//! | state per scope | on: a budget, gate and pace per upstream and credential hash, at most 4,096 scopes (a new one past the bound replaces one no request holds whose gate is open; with all in use or closed, it shares the fleet's own state); off for a fleet given a Redis store, whose store names the scope; the fleet's read-outs sum or report over its scopes | [`FleetBuilder::per_scope`], [`FleetBuilder::scope_key`] (what names a scope), [`FleetBuilder::max_scopes`] |
//! | token pacing | on, dormant: it limits nothing until a token limit is stated as nearly spent (a tenth or less left) or a `429` names one; then admission against a bucket per stated limit, in arrival order ([Pacing by tokens](#pacing-by-tokens)) | [`FleetBuilder::token_pacing`] with a [`TokenPacingConfig`], or `None` to turn it off |
//! | pacing: longest wait in line | the request's `retry_after_max` (60 s by default) or its deadline, whichever is nearer; then [`ErrorKind::PacingWaitTooLong`](crate::ErrorKind::PacingWaitTooLong), or [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded) for the deadline | [`RetryPolicy::retry_after_max`](crate::RetryPolicy::retry_after_max) |
//!
//! The headers read are listed [below](#rate-limit-headers). A retry the budget refuses is not made: the
//! last response comes back as it is, its [`RetryTrail`](crate::RetryTrail) saying
//! [`GiveUpReason::Budget`](crate::retry::GiveUpReason::Budget); a transport error becomes
//! [`ErrorKind::BudgetExhausted`](crate::ErrorKind::BudgetExhausted). What these settings do
//! to a fleet of 1,000 clients is measured by the storm bench (`cargo bench --bench storm`).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_llm_retry::fleet::{BudgetConfig, Fleet, GateConfig, PacingConfig};
//! use tower_llm_retry::RetryLayer;
//!
//! # fn main() -> Result<(), tower_llm_retry::ConfigError> {
//! // One fleet per API key, built once.
//! let fleet = Fleet::builder()
//!     .budget(Some(BudgetConfig::new(Duration::from_secs(10), 5, 0.1)?))
//!     .cooldown_gate(Some(GateConfig::new().spread(0.5, Duration::from_secs(10))?))
//!     .pacing(Some(PacingConfig::new().dormant(false)))
//!     .build();
//! // Every stack that sends on the key gets a clone of it.
//! let for_hyper = RetryLayer::new().fleet(fleet.clone());
//! let for_reqwest = RetryLayer::new().fleet(fleet.clone());
//! // Its state, for metrics.
//! assert_eq!(fleet.gate_closed_until(), None);
//! assert_eq!(fleet.pace(), Some(PacingConfig::new().get_initial()));
//! # let _ = (for_hyper, for_reqwest);
//! # Ok(()) }
//! ```
//!
//! # Across processes
//!
//! With the `fleet-redis` feature, a fleet given a [`RedisFleet`]
//! ([`FleetBuilder::redis`]) shares its cooldown gate and its retry budget with every
//! process whose fleet names the same scope (an upstream and a hash of a credential) in the
//! same Redis. Nothing on a request's path waits for Redis:
//!
//! - **Gate**: a closing is one script on Redis's own clock that only ever extends the
//!   deadline, and publishes it. Each process holds the gate locally and learns of closings
//!   from its own answers, from the message, and from a poll every second (the backstop).
//!   The scopes of a process built from one [`RedisFleet`] (and its clones: the tenants of a
//!   per-scope fleet) share one subscription, on one connection, each message routed by its
//!   channel, which names the scope's hash. A scope new to the process reads its gate (and
//!   the pacing rate) before its first request goes out, waiting at most one call deadline:
//!   a gate another process closed holds it too. The spread of the release stays local.
//!   Idle, the background task of a scope wakes for its poll and the renewal of its grant
//!   only.
//! - **Budget**: the window of `TpsBudget`, fleet-wide: retries in it stay within
//!   `min_per_sec × ttl + retry_ratio × first attempts` summed over every process. First
//!   attempts are counted locally and flushed every 100 ms; each process holds a small
//!   grant of retries from the fleet's balance (renewed with the flush), so a retry spends
//!   one without a round trip, and a retry the grant cannot pay for is refused.
//! - **When Redis fails**: every call has a deadline (50 ms); after three failures in a row
//!   the fleet keeps to its local state, the budget's reserve divided by the number of
//!   processes last known, reconnects in the background, logs once per change of state,
//!   and on return hands Redis the gate deadline it learnt meanwhile (Redis keeps the later).
//!   Keys or scripts that were lost come back with the next call.
//!
//! - **Pacing**: one shared GCRA schedule per scope: an attempt reserves the next slot, then
//!   sleeps locally for it; the attempts of a process that wait together reserve theirs in
//!   one script, booked at most 400 ms ahead, each process its share. The rate is learnt as in one
//!   process (slow start while attempts queue, `growth` per success, `decrease` per
//!   refusal) but in Redis, so a refusal decreases it once per fleet, not once per process;
//!   successes are reported with the next reservation, at no round trip of their own; a
//!   stated limit caps it. A reservation Redis does not answer within its deadline takes a
//!   turn of the local line instead; out of touch, the local line keeps to this process's
//!   share of the fleet's rate. (The quota reading of a long `Retry-After` stays local.)
//!
//! [`Fleet::redis_state`] says whether the fleet is in touch. A fleet that must never
//! exceed a paid limit can fail closed instead (`RedisFleet::fail_closed`): while out of
//! touch, it admits no attempt (each ends with `ErrorKind::FleetUnreachable`).
//!
//! **On a Redis Cluster** (or Valkey in cluster mode; feature `fleet-redis-cluster`,
//! `RedisFleet::from_cluster_nodes`, or a `redis+cluster://host1:port1,host2:port2` URL),
//! the same scripts run through a cluster client: every key of a scope shares the scope's
//! hash tag, so each script goes to the one node that owns the scope's slot, and follows it
//! when it moves (`MOVED`, `ASK`). A node that is lost takes only the coordination of the
//! scopes on its slots: those fall back to local state after their failed calls (each within
//! the call deadline), the others go on in touch, and when the slots answer again (the node
//! back, or a replica promoted) the scopes come back and merge their gate as on one node.
//! Without replicas, the nodes must be set with `cluster-require-full-coverage no` for the
//! others to keep serving while one is lost. While a scope's slot is half moved, a script
//! whose keys are split between the two nodes is answered `TRYAGAIN`, which the client
//! retries within the call deadline; a move that keeps them split for longer (keys moved one
//! at a time, slowly) may cost the scope its coordination until it is over, never a request. Closings are published with `PUBLISH`, which
//! the cluster carries to every node, and received on the store's one subscription, made on
//! a seed node (the next one when it is lost).
//!
//! Keys (one hash tag per scope, so the scripts stay legal on Redis Cluster):
//! `{prefix}:{{scope}}:gate` (a hash: deadline and announced wait, on Redis's clock),
//! `…:budget` (a hash of deposit and withdrawal counts per slot of the window),
//! `…:budget:flush:<process>` (the number and answer of a process's last budget flush: a
//! flush whose answer was lost to the deadline is sent again under its number and counted
//! once; it expires with the window), `…:procs` (a sorted set of live processes), `…:pace`
//! (a hash: the schedule's next slot, rate, epoch, and the stated cap, which every
//! reservation carries again so a lost schedule comes back capped); closings are published
//! on `…:gate-closed`.
//!
#![cfg_attr(
    feature = "fleet-redis",
    doc = r#"```no_run
use tower_llm_retry::fleet::{Fleet, GateConfig, RedisFleet};
use tower_llm_retry::RetryLayer;

# fn main() -> Result<(), tower_llm_retry::ConfigError> {
let store = RedisFleet::from_url("redis://127.0.0.1:6379/")?
    .scope("api.anthropic.com", b"the API key");
let fleet = Fleet::builder()
    .cooldown_gate(Some(GateConfig::new()))
    .redis(store)
    .build();
let layer = RetryLayer::new().fleet(fleet);
# let _ = layer;
# Ok(()) }
```"#
)]
//!
//! # One gate per scope
//!
//! One gate, and one pace, hold every request of their state. That is right when the state's
//! requests share a rate limit (one key, one upstream), and wrong when one state fronts
//! several providers or keys: a `429` from one would hold the others. So a fleet keeps a
//! state per scope by default: the upstream (the request URI's authority) and a hash of the
//! credential header (`authorization`, `x-api-key`, `api-key`, `x-goog-api-key`). A
//! credential set by an inner [`AuthLayer`] is not seen: such requests are
//! scoped by upstream. A [`scope_key`](FleetBuilder::scope_key) hook names scopes otherwise
//! (a gateway scopes by its own name for the upstream and the tenant's credential, say).
//!
//! The fleet's read-outs ([`Fleet::budget_stats`], [`Fleet::gate_closings`],
//! [`Fleet::gate_closed_until`], [`Fleet::pace`], [`Fleet::pacing_refused`]) sum or report
//! over its scopes, so a dashboard reads the handle it built; each scope's handle
//! ([`Fleet::scopes`], [`Fleet::scope_for`]) reads its own:
//!
//! ```
//! use tower_llm_retry::fleet::Fleet;
//!
//! let fleet = Fleet::default();
//! for scope in fleet.scopes() {
//!     println!("{:?}: {:?}", scope.scope_upstream(), scope.budget_stats());
//! }
//! println!("all: {:?}, gate closed until {:?}", fleet.budget_stats(), fleet.gate_closed_until());
//! ```
//!
//! # Differences from `tower::retry` with a budget
//!
//! - The budget is wired in: deposits on first attempts, a withdrawal before each retry, and
//!   a refusal that is visible in the [`RetryTrail`](crate::RetryTrail)
//!   ([`GiveUpReason::Budget`](crate::retry::GiveUpReason::Budget)).
//! - The gate has no counterpart in `tower::retry`, which knows no HTTP.
//!
//! # Rate-limit headers
//!
//! | provider | limit | remaining | reset |
//! |---|---|---|---|
//! | Anthropic | `anthropic-ratelimit-requests-limit` | `anthropic-ratelimit-requests-remaining` | `anthropic-ratelimit-requests-reset`: an RFC 3339 instant, `2026-01-01T00:00:10Z` |
//! | OpenAI | `x-ratelimit-limit-requests` | `x-ratelimit-remaining-requests` | `x-ratelimit-reset-requests`: a duration, `1s`, `6m0s`, `547ms`, `2m52.8s` |
//!
//! Token limits, read by the [token pacing](#pacing-by-tokens):
//!
//! | provider | limit | remaining | reset |
//! |---|---|---|---|
//! | Anthropic | `anthropic-ratelimit-{input-tokens,output-tokens,tokens}-limit` | `…-remaining` | `…-reset`: an RFC 3339 instant |
//! | OpenAI | `x-ratelimit-limit-tokens` | `x-ratelimit-remaining-tokens` | `x-ratelimit-reset-tokens`: a duration, `6m0s`, `1.5s`, `120ms` |
//!
//! A value longer than 64 bytes, malformed, negative, overflowing, or a reset more than a day
//! away counts as absent.
//!
#![cfg_attr(feature = "auth", doc = "[`AuthLayer`]: crate::AuthLayer")]
#![cfg_attr(not(feature = "auth"), doc = "[`AuthLayer`]: crate#features")]
#![cfg_attr(not(feature = "fleet-redis"), doc = "[`RedisFleet`]: crate#features")]
#![cfg_attr(
    not(feature = "fleet-redis"),
    doc = "[`FleetBuilder::redis`]: crate#features"
)]
#![cfg_attr(
    not(feature = "fleet-redis"),
    doc = "[`Fleet::redis_state`]: crate#features"
)]

mod budget;
mod gate;
mod limit;
mod pacing;
#[cfg(feature = "fleet-redis")]
mod redis;
mod scope;
mod store;
mod ticket;
mod token_cost;
mod token_ticket;
mod tokens;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use tokio::time::Instant;

pub use self::budget::BudgetConfig;
pub use self::gate::GateConfig;
pub(crate) use self::gate::{GateWait, PastDeadline};
pub use self::pacing::{PacingConfig, PacingWake};
#[cfg(feature = "fleet-redis")]
pub use self::redis::{RedisFleet, RedisState};
pub use self::scope::ScopeKey;
pub(crate) use self::ticket::Ticket;
pub use self::token_cost::InputCounter;
pub(crate) use self::token_cost::{read_usage, Cost, Usage};
pub(crate) use self::token_ticket::{TokenTicket, UsageTap};
pub(crate) use self::tokens::TokenPacer;
pub use self::tokens::{TokenBucketStats, TokenPacingConfig, TokenPacingStats, TokenWake};
pub use crate::provider::ratelimit::TokenKind;

use self::budget::SharedBudget;
use self::gate::Gate;
use self::limit::Pacer;
use self::scope::{KeyFn, ScopeName, Scopes, MAX_SCOPES};
use self::store::{Store, StoreConfig};
use self::ticket::MAX_PACING_WAIT;
use crate::random::Random;

/// What a request's retry policy tells the fleet, so that the fleet does not depend on the
/// retry module: the longest server wait it honours, whether it ignores a longer one, and the
/// source of the gate's spread.
#[derive(Clone, Copy)]
pub(crate) struct Limits<'a> {
    /// The policy's `Retry-After` ceiling.
    pub(crate) retry_after_max: Duration,
    /// A `Retry-After` above the ceiling is ignored (the policy backs off instead, as the
    /// official SDKs do), so the fleet does not take it as a wait either.
    pub(crate) ignores_above_ceiling: bool,
    pub(crate) random: &'a Random,
    /// The backoff (un-jittered) the retry of the attempt answered would take on its own: a
    /// `Retry-After` longer than that is a limit's, not noise's.
    pub(crate) backoff: Duration,
}

/// The fleet state that requests on one key share: the retry budget, the cooldown gate and
/// the adaptive pacing, built once and handed to every layer (or middleware) whose requests
/// go out under that key.
///
/// A `Fleet` is a handle: its clones share one state. Hand one to
/// [`RetryLayer::fleet`](crate::RetryLayer::fleet) of every stack that sends on the key (a
/// hyper client and a reqwest-middleware client of one process, say), and they keep one
/// budget, close one gate and keep one pace. A layer given none builds its own
/// ([`Fleet::default`]), shared by the services it makes and by its clones, however they are
/// re-configured.
///
/// The state can be read while requests run, summed or reported over the fleet's scopes:
/// [`gate_closed_until`](Fleet::gate_closed_until), [`gate_closings`](Fleet::gate_closings),
/// [`pace`](Fleet::pace), [`pacing_refused`](Fleet::pacing_refused),
/// [`budget_stats`](Fleet::budget_stats); a scope's handle ([`Fleet::scopes`]) reads its own.
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<FleetState>,
}

/// What the handles of one fleet share.
struct FleetState {
    budget: Option<(BudgetConfig, SharedBudget)>,
    gate: Option<Arc<Gate>>,
    pacer: Option<Arc<Pacer>>,
    tokens: Option<Arc<TokenPacer>>,
    /// Where the state lives: in this process, or shared with others.
    store: Store,
    /// Per scope: the states of each upstream and credential, made on first use.
    scopes: Option<Scopes>,
    /// The scope this state is of, when it is one.
    scope: Option<ScopeName>,
}

/// A dormant pacing wakes when a response says at most `1 / LOW_REMAINING` of the stated
/// request limit is left.
const LOW_REMAINING: u64 = 10;

/// Builds a [`Fleet`]; see [`Fleet::builder`].
#[derive(Clone)]
#[must_use]
pub struct FleetBuilder {
    budget: Option<BudgetConfig>,
    gate: Option<GateConfig>,
    pacing: Option<PacingConfig>,
    token_pacing: Option<TokenPacingConfig>,
    /// `None`: the default, per scope unless the fleet has a Redis store.
    per_scope: Option<bool>,
    scope_key: Option<KeyFn>,
    max_scopes: usize,
    store: StoreConfig,
}

impl FleetBuilder {
    /// The retry budget: retries beyond it are not made, and the trail says so. `None` turns
    /// it off. Defaults to [`BudgetConfig::default`]: a 10 s window, 10 retries a second plus
    /// 20 % of first attempts.
    pub fn budget(mut self, budget: Option<BudgetConfig>) -> Self {
        self.budget = budget;
        self
    }

    /// The cooldown gate: a `429` / `529` with `Retry-After`, or rate-limit headers saying
    /// nothing is left, hold every attempt until then, and release them spread out. See
    /// [`GateConfig`]. An open gate costs a request one atomic load. Defaults to
    /// [`GateConfig::new`]: on, for a `Retry-After` of 2 s or more (a shorter one, a token
    /// bucket's next token, is left to the pacing). `None` turns it off.
    pub fn cooldown_gate(mut self, gate: Option<GateConfig>) -> Self {
        self.gate = gate;
        self
    }

    /// Adaptive pacing: attempts leave evenly spaced at a rate that grows with successes and
    /// shrinks on `429` / overload, the rest waiting their turn in arrival order. See
    /// [`PacingConfig`]. Defaults to [`PacingConfig::new`]: [dormant](PacingConfig::dormant)
    /// until the server first signals a rate limit, then from the rate measured over the
    /// last second, with a burst of 1 s; `None` turns it off.
    pub fn pacing(mut self, pacing: Option<PacingConfig>) -> Self {
        self.pacing = pacing;
        self
    }

    /// Pacing by tokens: once a provider says a token limit is nearly spent, or answers a
    /// `429` for one, requests are admitted against a token bucket sized from the stated
    /// limit, in arrival order, beside the request pacing. See
    /// [Pacing by tokens](crate::fleet#pacing-by-tokens) and [`TokenPacingConfig`].
    /// Defaults to [`TokenPacingConfig::new`]: dormant until that evidence; `None` turns it
    /// off.
    pub fn token_pacing(mut self, tokens: Option<TokenPacingConfig>) -> Self {
        self.token_pacing = tokens;
        self
    }

    /// Shares the budget and the gate with every process whose fleet has the same Redis
    /// store and scope; see [Across processes](crate::fleet#across-processes). The
    /// in-process state stays the fallback. Defaults to none: the state is this process's.
    #[cfg(feature = "fleet-redis")]
    pub fn redis(mut self, store: RedisFleet) -> Self {
        self.store = StoreConfig::Redis(Box::new(store));
        self
    }

    /// Keeps a state of its own (budget, gate, pacing, and, with a Redis store, its Redis
    /// scope) for each scope of the requests: their upstream (the authority of the request's
    /// URI) and credential (the value of `authorization`, `x-api-key`, `api-key` or
    /// `x-goog-api-key`, hashed, never kept), or what a [`scope_key`](Self::scope_key) hook
    /// names. One fleet may then front several keys and
    /// upstreams without one key's `429` holding the others. A credential set by an inner
    /// layer ([`AuthLayer`]) is not seen: such requests are scoped by
    /// upstream. The read-outs of the fleet ([`Fleet::budget_stats`] and the others) sum or
    /// report over its scopes and its own state (that of requests with no upstream, or past
    /// the bound with every scope in use, which stays in the process); [`Fleet::scopes`] and
    /// [`Fleet::scope_for`] reach each scope, whose read-outs are its own. A scope set on the
    /// Redis store with [`RedisFleet::scope`] applies to every scope.
    ///
    /// On a request's path the scope costs a hash of the authority and the credential
    /// (foldhash, not a cryptographic hash: the credential is never stored) and one map
    /// lookup under a read lock; only the first request of a scope allocates. The map holds
    /// at most [`max_scopes`](Self::max_scopes) scopes. A new scope past the bound takes
    /// the place of the oldest that no request holds at that moment and whose gate is open
    /// (what it learnt is forgotten, what it counted stays in the fleet's sums; a closed gate
    /// is never forgotten this way), so credentials that
    /// rotate do not fill it for good; when all are in use or closed, its requests share the fleet's
    /// own state (one budget, gate and pace for all of them, as with `per_scope(false)`).
    /// A flood of distinct credentials costs a bounded amount of memory (about 4,096 small
    /// states by default).
    /// Defaults to true, but for a fleet given a Redis store ([`FleetBuilder::redis`]),
    /// whose store names its scope already (call `per_scope(true)` to key its state by
    /// request as well); false keeps one state for every request.
    ///
    #[cfg_attr(feature = "auth", doc = "[`AuthLayer`]: crate::AuthLayer")]
    #[cfg_attr(not(feature = "auth"), doc = "[`AuthLayer`]: crate#features")]
    #[cfg_attr(
        not(feature = "fleet-redis"),
        doc = "[`RedisFleet::scope`]: crate#features"
    )]
    #[cfg_attr(
        not(feature = "fleet-redis"),
        doc = "[`FleetBuilder::redis`]: crate#features"
    )]
    pub fn per_scope(mut self, yes: bool) -> Self {
        self.per_scope = Some(yes);
        self
    }

    /// What names the scope of a request, instead of its upstream and credential headers:
    /// `key` is called with the request's head and writes an upstream and a credential (or
    /// whatever tells its tenants apart) into the [`ScopeKey`]; a request for which it
    /// writes no upstream uses the fleet's own state. It is called on every request, so it
    /// should be cheap: what it writes is hashed as written, nothing is allocated but on a
    /// scope's first request (when it is called a second time, to name the scope). With a
    /// Redis store, the scope's name in Redis is a hash of what it wrote, as with
    /// [`RedisFleet::scope`]. Only for a fleet kept [per scope](Self::per_scope) (a hook
    /// turns it on, as if `per_scope(true)`, unless `per_scope(false)` is called after).
    /// Defaults to none: the request URI's authority and its credential header.
    ///
    #[cfg_attr(
        not(feature = "fleet-redis"),
        doc = "[`RedisFleet::scope`]: crate#features"
    )]
    pub fn scope_key<F>(mut self, key: F) -> Self
    where
        F: Fn(&http::request::Parts, &mut ScopeKey<'_>) + Send + Sync + 'static,
    {
        self.scope_key = Some(Arc::new(key));
        self.per_scope = Some(true);
        self
    }

    /// The most scopes the fleet keeps apart (at least 1); past it, a new scope takes the
    /// place of one no request holds and whose gate is open (see
    /// [`per_scope`](Self::per_scope)). Defaults to 4,096.
    pub fn max_scopes(mut self, max: usize) -> Self {
        self.max_scopes = max.max(1);
        self
    }

    /// The fleet, its state new. With a Redis store, its background task starts on the
    /// Tokio runtime this is called on, or, without one, on the first request's.
    pub fn build(self) -> Fleet {
        let per_scope = self.per_scope.unwrap_or(self.store.is_local());
        let scopes = per_scope.then(|| {
            let template = FleetBuilder {
                per_scope: Some(false),
                scope_key: None,
                ..self.clone()
            };
            Scopes::new(template, self.scope_key.clone(), self.max_scopes)
        });
        let mut root = self;
        // The fleet's own state, of the requests that have no scope, stays in the process.
        if scopes.is_some() {
            root.store = StoreConfig::Local;
        }
        root.build_state(scopes, None)
    }

    /// The builder of the scope of `upstream` and `credential`.
    fn store_for_scope(mut self, upstream: &str, credential: &[u8]) -> Self {
        self.store = self.store.for_scope(upstream, credential);
        self
    }

    fn build_state(self, scopes: Option<Scopes>, scope: Option<ScopeName>) -> Fleet {
        let gate = self.gate.map(|g| Arc::new(Gate::new(g)));
        let pacer = self.pacing.map(|p| Arc::new(Pacer::new(p)));
        let tokens = self.token_pacing.map(|t| Arc::new(TokenPacer::new(t)));
        Fleet {
            inner: Arc::new(FleetState {
                budget: self.budget.map(|c| (c, c.build())),
                store: self.store.build(gate.as_ref(), self.budget, pacer.as_ref()),
                gate,
                pacer,
                tokens,
                scopes,
                scope,
            }),
        }
    }
}

impl Default for FleetBuilder {
    fn default() -> Self {
        FleetBuilder {
            budget: Some(BudgetConfig::default()),
            gate: Some(GateConfig::new()),
            pacing: Some(PacingConfig::new()),
            token_pacing: Some(TokenPacingConfig::new()),
            per_scope: None,
            scope_key: None,
            max_scopes: MAX_SCOPES,
            store: StoreConfig::Local,
        }
    }
}

impl std::fmt::Debug for FleetBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetBuilder")
            .field("budget", &self.budget)
            .field("gate", &self.gate)
            .field("pacing", &self.pacing)
            .field("token_pacing", &self.token_pacing)
            .field("per_scope", &self.per_scope)
            .field("scope_key", &self.scope_key.is_some())
            .field("max_scopes", &self.max_scopes)
            .field("store", &self.store)
            .finish()
    }
}

impl Default for Fleet {
    /// The defaults of [`Fleet::builder`]: what a layer given no fleet builds.
    fn default() -> Self {
        Fleet::builder().build()
    }
}

/// What the retry budget of a fleet has counted since the fleet was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct BudgetStats {
    /// First attempts, each a deposit.
    pub first_attempts: u64,
    /// Retries the budget paid for.
    pub retries: u64,
    /// Retries the budget refused (each a request that gave up with
    /// [`GiveUpReason::Budget`](crate::retry::GiveUpReason::Budget)).
    pub refused: u64,
}

impl Fleet {
    /// A builder with the defaults: the default budget, the default cooldown gate, a
    /// [dormant](PacingConfig::dormant) pacing, a state per scope
    /// ([`FleetBuilder::per_scope`]). `Fleet::builder().cooldown_gate(None).pacing(None)
    /// .per_scope(false)` is the fleet of earlier versions: the budget alone, one state.
    pub fn builder() -> FleetBuilder {
        FleetBuilder::default()
    }

    /// Whether `self` and `other` are handles of one fleet.
    pub fn ptr_eq(&self, other: &Fleet) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The budget's settings, when it is on.
    pub fn budget_config(&self) -> Option<BudgetConfig> {
        self.inner.budget.as_ref().map(|(c, _)| *c)
    }

    /// What the budget has counted, when it is on: over every scope of a fleet kept per
    /// scope (those dropped to make room included) and its own state. A scope's handle
    /// ([`Fleet::scopes`], [`Fleet::scope_for`]) reads its own.
    pub fn budget_stats(&self) -> Option<BudgetStats> {
        let mut sum = self.own_budget_stats()?;
        if let Some(scopes) = &self.inner.scopes {
            let add = |sum: &mut BudgetStats, b: BudgetStats| {
                sum.first_attempts += b.first_attempts;
                sum.retries += b.retries;
                sum.refused += b.refused;
            };
            add(&mut sum, scopes.retired_budget());
            scopes.for_each(|f| {
                if let Some(b) = f.own_budget_stats() {
                    add(&mut sum, b);
                }
            });
        }
        Some(sum)
    }

    fn own_budget_stats(&self) -> Option<BudgetStats> {
        self.inner.budget.as_ref().map(|(_, b)| b.stats())
    }

    /// The gate's settings, when it is on.
    pub fn gate_config(&self) -> Option<GateConfig> {
        self.inner.gate.as_ref().map(|g| g.config.clone())
    }

    /// When the cooldown gate reopens, while it is closed; `None` when it is open (or off).
    /// Waiters leave from then on, spread out. Of a fleet kept per scope: the latest instant
    /// any of its gates reopens (a scope's handle reads its own).
    pub fn gate_closed_until(&self) -> Option<Instant> {
        let mut latest = self.closed_until();
        if let Some(scopes) = &self.inner.scopes {
            scopes.for_each(|f| latest = latest.max(f.closed_until()));
        }
        latest
    }

    /// This state's gate: closed until when.
    pub(crate) fn closed_until(&self) -> Option<Instant> {
        self.inner.gate.as_ref()?.closed_until()
    }

    /// How many times the gate was closed, or its closing extended, when it is on: over every
    /// scope of a fleet kept per scope (a scope's handle reads its own). An extension counts
    /// when it moves the reopening by more than 100 ms: a closing that comes back through
    /// Redis, dated on another clock, is the same closing.
    pub fn gate_closings(&self) -> Option<u64> {
        let mut sum = self.gate()?.closings();
        if let Some(scopes) = &self.inner.scopes {
            sum += scopes.retired_closings();
            scopes.for_each(|f| sum += f.gate().map_or(0, |g| g.closings()));
        }
        Some(sum)
    }

    /// The pacing's settings, when it is on.
    pub fn pacing_config(&self) -> Option<PacingConfig> {
        self.inner.pacer.as_ref().map(|p| p.config())
    }

    /// The current pacing rate, in requests per second, when pacing is on and awake (not
    /// [dormant](PacingConfig::dormant)): the fleet's, across processes, while a Redis store
    /// is in touch. Of a fleet kept per scope: the sum of the rates of the scopes whose
    /// pacing is awake, `None` when none is (a scope's handle reads its own).
    pub fn pace(&self) -> Option<f64> {
        let mut sum = self.pacing_rate();
        if let Some(scopes) = &self.inner.scopes {
            scopes.for_each(|f| {
                if let Some(rate) = f.pacing_rate() {
                    sum = Some(sum.unwrap_or(0.0) + rate);
                }
            });
        }
        sum
    }

    /// How many attempts gave up because their pacing turn would come later than they may
    /// wait, when pacing is on: over every scope of a fleet kept per scope (a scope's handle
    /// reads its own).
    pub fn pacing_refused(&self) -> Option<u64> {
        let mut sum = self.pacer()?.refused();
        if let Some(scopes) = &self.inner.scopes {
            sum += scopes.retired_pacing_refused();
            scopes.for_each(|f| sum += f.pacer().map_or(0, |p| p.refused()));
        }
        Some(sum)
    }

    /// Whether this state's pacing paces, and why, when pacing is on: `None` while it is
    /// dormant, `Some(None)` when it paces from the start
    /// ([`dormant(false)`](PacingConfig::dormant), or a [warm-up](PacingConfig::warm_up)
    /// within its span or with someone in line), `Some(Some(cause))` once the evidence of a
    /// limit woke it. A scope's handle reads its own; a fleet kept per scope, its own state's
    /// (see [`paced_scopes`](Fleet::paced_scopes) for its scopes). The rate is
    /// [`pace`](Fleet::pace).
    pub fn pacing_state(&self) -> Option<Option<PacingWake>> {
        let pacer = self.pacer()?;
        pacer.paces().then(|| pacer.woken_by())
    }

    /// How many states pace now (their pacing is on and awake): the fleet's own and, of a
    /// fleet kept per scope, its scopes'. 0 when pacing is off.
    pub fn paced_scopes(&self) -> usize {
        let mut n = usize::from(self.pacer().is_some_and(Pacer::paces));
        if let Some(scopes) = &self.inner.scopes {
            scopes.for_each(|f| n += usize::from(f.pacer().is_some_and(Pacer::paces)));
        }
        n
    }

    /// How many times a dormant pacing woke, by cause, in the order of [`PacingWake::ALL`],
    /// when pacing is on: over every scope of a fleet kept per scope, those dropped to make
    /// room included (a scope's handle reads its own). A pacing wakes once.
    pub fn pacing_wakes(&self) -> Option<[(PacingWake, u64); 4]> {
        self.pacer()?;
        let mut sum = self
            .inner
            .scopes
            .as_ref()
            .map_or([0; 4], |s| s.retired_pacing_wakes());
        let mut add = |f: &Fleet| {
            if let Some(cause) = f.pacer().and_then(|p| p.woken_by()) {
                sum[cause.index()] += 1;
            }
        };
        add(self);
        if let Some(scopes) = &self.inner.scopes {
            scopes.for_each(&mut add);
        }
        Some(std::array::from_fn(|i| (PacingWake::ALL[i], sum[i])))
    }

    /// The state of the link to Redis, when the fleet has a Redis store.
    #[cfg(feature = "fleet-redis")]
    pub fn redis_state(&self) -> Option<RedisState> {
        self.inner.store.redis_state()
    }

    fn gate(&self) -> Option<&Gate> {
        self.inner.gate.as_deref()
    }

    /// Whether an attempt may start: false only for a fleet that fails closed while its
    /// shared state is out of reach.
    #[cfg(feature = "fleet-redis")]
    pub(crate) fn admits(&self) -> bool {
        self.inner.store.admits()
    }

    /// The wait for the first read of the gate shared across processes, while it is to come.
    fn first_read(&self) -> Option<store::FirstRead> {
        self.inner.store.first_read()
    }

    fn pacer(&self) -> Option<&Pacer> {
        self.inner.pacer.as_deref()
    }

    fn tokens(&self) -> Option<&TokenPacer> {
        self.inner.tokens.as_deref()
    }

    /// The token pacing's state, when it is on: the tokens per minute believed, the level
    /// of each awake bucket, the requests in line for tokens, those that waited and those
    /// that gave up. Of a fleet kept per scope: summed over its scopes and its own state
    /// (a scope's handle reads its own). See [Pacing by tokens](crate::fleet#pacing-by-tokens).
    pub fn token_pacing(&self) -> Option<TokenPacingStats> {
        let mut sum = self.tokens()?.stats();
        if let Some(scopes) = &self.inner.scopes {
            scopes.for_each(|f| {
                if let Some(t) = f.tokens() {
                    sum.add(&t.stats());
                }
            });
        }
        Some(sum)
    }

    /// Whether this state's token pacing is awake, and what woke it, when it is on: `None`
    /// while it sleeps. A scope's handle reads its own.
    pub fn token_pacing_state(&self) -> Option<TokenWake> {
        let t = self.tokens()?;
        t.is_awake().then(|| t.woken_by()).flatten()
    }

    /// Whether this state's token pacing is awake: one atomic load.
    #[inline]
    pub(crate) fn tokens_awake(&self) -> bool {
        self.tokens().is_some_and(TokenPacer::is_awake)
    }

    /// A place in the line for tokens, when the token pacing is awake: `cost` gives the
    /// request's cost (called only then). Bounded like a pacing ticket.
    pub(crate) fn token_ticket(
        &self,
        cost: impl FnOnce(Option<&InputCounter>) -> Cost,
        limits: Limits<'_>,
        deadline: Option<Instant>,
    ) -> Option<TokenTicket> {
        let tokens = self.tokens()?;
        if !tokens.is_awake() {
            return None;
        }
        let cost = cost(tokens.config().counter());
        let now = Instant::now();
        let ceiling = now + limits.retry_after_max.min(MAX_PACING_WAIT);
        let give_up_at = deadline.map_or(ceiling, |d| d.min(ceiling));
        // Tokens from the buckets the store shares; this process's otherwise.
        let remote = self.inner.store.is_shared().then(|| {
            let args = tokens.args(cost, None);
            let wait = give_up_at.saturating_duration_since(now);
            self.inner.store.reserve_tokens(&args, wait)
        });
        Some(TokenTicket {
            fleet: self.clone(),
            n: None,
            remote: remote.flatten(),
            cost,
            since: now,
            give_up_at,
            by_deadline: deadline.is_some_and(|d| d <= ceiling),
            joined: false,
            done: false,
            sleep: None,
        })
    }

    /// Settles the tokens an attempt took: `usage` is what its answer reported (nothing,
    /// for an answer the server did not count: the whole charge comes back).
    pub(crate) fn settle_tokens(&self, charged: Cost, usage: Usage) {
        if let Some(t) = self.tokens() {
            if charged.shared {
                self.inner.store.give_tokens(&t.args(charged, Some(usage)));
            }
            t.settle(charged, usage);
        }
    }

    /// A place in the pacing line for the next attempt, when pacing is on. It waits for its
    /// turn no longer than the policy's Retry-After ceiling, nor past `deadline`. Dropping it
    /// before its turn leaves the line.
    pub(crate) fn ticket(&self, limits: Limits<'_>, deadline: Option<Instant>) -> Option<Ticket> {
        let pacer = self.pacer()?;
        // Dormant, the pacing only counts what goes out, until the server signals a limit.
        // Warming a new scope up, it counts each attempt as its turn comes (the ticket does),
        // and sleeps once the warm-up is over with no one in line.
        if !pacer.is_awake()
            || (pacer.is_warming() && pacer.end_warm_up(|| self.inner.store.line_is_empty()))
        {
            pacer.dormant_send();
            return None;
        }
        let now = Instant::now();
        // A ceiling set to "forever" must not overflow the instant.
        let ceiling = now + limits.retry_after_max.min(MAX_PACING_WAIT);
        let give_up_at = deadline.map_or(ceiling, |d| d.min(ceiling));
        // A turn of the schedule the store shares; the local line otherwise.
        let remote = self
            .inner
            .store
            .reserve(give_up_at.saturating_duration_since(now));
        let n = remote.is_none().then(|| pacer.ticket());
        Some(Ticket {
            fleet: self.clone(),
            n,
            remote,
            done: false,
            joined: false,
            since: now,
            give_up_at,
            by_deadline: deadline.is_some_and(|d| d <= ceiling),
            sleep: None,
        })
    }

    /// This state's pacing rate, when awake: the fleet's across processes while the store
    /// knows it. For the retry loop's trace events.
    pub(crate) fn pacing_rate(&self) -> Option<f64> {
        let pacer = self.pacer()?;
        if !pacer.paces() {
            return None;
        }
        self.inner.store.pace().or_else(|| Some(pacer.rate()))
    }

    /// An attempt that had a pacing turn succeeded.
    pub(crate) fn paced_success(&self) {
        if self.inner.store.paced_success() {
            return;
        }
        if let Some(p) = self.pacer() {
            p.on_success();
        }
    }

    /// An attempt sent in `epoch` was refused for load.
    pub(crate) fn paced_refusal(&self, epoch: u64, retry_after: Option<Duration>) {
        // A warm-up is not slowed by refusals that are no evidence of a limit (evidence wakes
        // it, before this, from the same answer), unless the turn came from a shared
        // schedule another process's evidence already slowed (its epoch is past the first):
        // the fleet is limited, and this process's refusals count as the others' do.
        let slowed_elsewhere = epoch & store::REMOTE_EPOCH != 0 && epoch & !store::REMOTE_EPOCH > 0;
        if self.pacer().is_some_and(Pacer::is_warming) && !slowed_elsewhere {
            return;
        }
        if self.inner.store.paced_refusal(epoch, None) {
            return;
        }
        if let Some(p) = self.pacer() {
            p.on_refusal(epoch, retry_after);
        }
    }

    /// A first attempt is about to be sent.
    pub(crate) fn deposit(&self) {
        if let Some((_, budget)) = &self.inner.budget {
            budget.deposit();
        }
        self.inner.store.deposit(self.inner.budget.is_some());
    }

    /// A retry is planned: may it be made?
    pub(crate) fn withdraw(&self) -> bool {
        match &self.inner.budget {
            Some((_, budget)) => self.inner.store.withdraw(budget),
            None => true,
        }
    }

    /// Closes the gate for `wait` from now, and tells the other processes.
    fn close_gate(&self, gate: &Gate, wait: Duration) {
        if let Some(until) = gate.close(Instant::now(), wait) {
            self.inner.store.closed(until, wait);
        }
    }

    /// Tells the fleet what a response said. The gate: a `429` / `529` with `Retry-After`, or
    /// rate-limit headers saying no request is left (the wait is capped at `policy`'s
    /// Retry-After ceiling). The pacing: a stated request limit.
    pub(crate) fn observe(
        &self,
        head: &http::response::Parts,
        retry_after: Option<Duration>,
        limits: Limits<'_>,
        named: Option<TokenKind>,
        sent_at: Instant,
    ) {
        let ceiling = limits.retry_after_max;
        // A Retry-After above the ceiling of a policy that ignores it (as the official SDKs
        // do) is not taken as a wait by the fleet either.
        let honoured = |w: &Duration| *w <= ceiling || !limits.ignores_above_ceiling;
        let retry_after = retry_after.filter(honoured);
        // Read only for what uses them: the pacing, and a gate that reads rate-limit headers.
        let counts = match self.pacer().is_some()
            || self.tokens().is_some()
            || self
                .gate()
                .is_some_and(|g| g.config.reads_rate_limit_headers())
        {
            true => crate::provider::ratelimit::RequestCounts::read(&head.headers),
            false => crate::provider::ratelimit::RequestCounts::default(),
        };
        // The token pacing: the token windows found in the same pass (an answer that states
        // none and refuses nothing tells it nothing).
        let refusal = head.status == StatusCode::TOO_MANY_REQUESTS;
        if let Some(tokens) = self.tokens().filter(|_| refusal || counts.states_tokens()) {
            let now = || crate::classify::headers::server_now(&head.headers);
            let headers = crate::provider::ratelimit::TokenHeaders::of(&counts, now);
            tokens.observe(&headers, refusal, named, sent_at);
        }
        // Pacing: a 429 that shows a limit the scope's rate meets wakes a dormant pacing
        // (random 429s and overloads do not: see the module docs); a stated request limit
        // caps the rate. The limit alone does not wake it (the providers
        // state theirs on every answer, and a client well within it is not to be slowed), but
        // a window nearly spent does: at most a tenth of the limit left.
        if let Some(pacer) = self.pacer() {
            if !pacer.is_woken() && head.status == StatusCode::TOO_MANY_REQUESTS {
                let wait = retry_after.map(|w| w.min(ceiling));
                let cause = if wait.is_some_and(|w| w >= limit::MIN_INFORMED_WAIT) {
                    Some((PacingWake::QuotaReset, None))
                } else if wait.is_some_and(|w| w > limits.backoff.max(WHOLE_SECOND)) {
                    Some((PacingWake::LongRetryAfter, None))
                } else {
                    pacer
                        .refusal_burst()
                        .map(|admitted| (PacingWake::RefusalShare, Some(admitted)))
                };
                if let Some((cause, admitted)) = cause {
                    pacer.wake_on_refusal(wait, cause, admitted);
                    // The fleet's schedule falls as this process's pacing did.
                    if let Some(factor) = pacer.take_wake_factor() {
                        self.inner.store.woke(factor);
                    }
                }
            }
            if let Some(limit) = counts.limit() {
                pacer.on_limit(limit);
                if !pacer.is_woken()
                    && counts
                        .remaining()
                        .is_some_and(|left| left.saturating_mul(LOW_REMAINING) <= limit)
                {
                    pacer.wake_on_limit();
                }
                if self.inner.store.is_shared() {
                    if let Some(cap) = pacer.config().cap_for(limit) {
                        self.inner.store.stated_limit(cap);
                    }
                }
            }
        }
        let Some(gate) = self.gate() else {
            return;
        };
        let status = head.status.as_u16();
        let h = &head.headers;
        // Absolute times from the server are read against the server's own clock, its
        // `Date`, where it sent one: the host's clock skew then does not move the deadline.
        // (A wall clock set on the gate config, for tests, is used instead.)
        // Parsed only when an absolute time is read: not on the success path.
        let server_now = || {
            if gate.config.has_wall_clock() {
                None
            } else {
                crate::classify::headers::server_date(h)
            }
        };
        if status == StatusCode::TOO_MANY_REQUESTS.as_u16()
            || status == crate::classify::STATUS_OVERLOADED
        {
            let server_now = retry_after_is_a_date(h).then(server_now).flatten();
            let retry_after = match server_now {
                Some(now) => crate::classify::headers::parse_retry_after(h, now),
                _ => retry_after,
            }
            .filter(honoured);
            if let Some(wait) = retry_after.filter(|w| *w >= gate.config.get_min_close()) {
                self.close_gate(gate, wait.min(ceiling));
            }
        }
        if gate.config.reads_rate_limit_headers() && counts.states_remaining() {
            let now = server_now().unwrap_or_else(|| gate.config.now());
            if let Some(wait) = crate::provider::ratelimit::requests_exhausted_for(h, now) {
                self.close_gate(gate, wait.min(ceiling));
            }
        }
    }
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.inner;
        let mut d = f.debug_struct("Fleet");
        d.field("budget", &s.budget.as_ref().map(|(c, b)| (c, b.stats())))
            .field("gate", &s.gate)
            .field("pacer", &s.pacer)
            .field("store", &s.store);
        if let Some(scope) = &s.scope {
            d.field("scope", scope);
        }
        if let Some(scopes) = &s.scopes {
            d.field("scopes", &scopes.len());
        }
        d.finish()
    }
}

/// The `Retry-After` any server that rounds up to whole seconds sends for a token bucket's
/// next token, and random refusals send too: no evidence of a limit on its own.
const WHOLE_SECOND: Duration = Duration::from_secs(1);

/// Whether the wait a response asks for is an HTTP-date (`retry-after` with no
/// `retry-after-ms` before it, and not a number of seconds).
fn retry_after_is_a_date(h: &http::HeaderMap) -> bool {
    if h.contains_key(crate::classify::headers::RETRY_AFTER_MS) {
        return false;
    }
    h.get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| httpdate::parse_http_date(v.trim()).is_ok())
}
