//! The integration tests, as one binary: each module is one area of behaviour, against real
//! servers on 127.0.0.1 (the `mock` module) and, where the components allow, paused time.
//! The tests that capture tracing output live in the `tracing` binary instead.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "async-openai")]
mod async_openai;
mod auth;
mod axum_proxy;
mod backoff;
mod cancellation;
mod classification;
mod cloud;
mod continuation;
mod deadline;
mod extremes;
mod failover;
mod fallback;
mod faults;
mod first_output;
mod fleet;
#[cfg(feature = "fleet-redis")]
mod fleet_redis;
#[cfg(feature = "fleet-redis-cluster")]
mod fleet_redis_cluster;
#[cfg(feature = "google-auth")]
mod google_auth;
mod http2;
mod incomplete_stream;
mod mcp;
mod mock_server;
mod mock_tls_h2;
mod overflow;
mod pipeline;
mod replay;
mod reqwest;
mod reqwest_tls;
mod soak;
mod streaming;
mod tokens;
mod unsendable;
