//! `llm-retry-proxy`: the `tower-llm-retry` stack behind an HTTP listener, so that an SDK in
//! any language gets its retry behaviour by pointing its base URL at it.
//!
//! ```no_run
//! use tower_llm_retry_proxy::{Config, Proxy};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::load(None)?; // the defaults, with LLM_RETRY_PROXY_* overrides
//! let listener = tokio::net::TcpListener::bind(config.listen).await?;
//! Proxy::new(config)?.serve(listener, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```
//!
//! The modules, in the order a request meets them: [`server`] (listener, ops endpoints,
//! token check, caps, headers), [`conn`] (connection limits: the cap, the descriptor limit,
//! idle and write timeouts), [`deadline`] (the client's deadline), [`routes`] (path → upstream), [`forward`] (which headers
//! cross), [`stack`] (the retry stack per upstream, its fleet scoped per credential),
//! [`body`] (the response copy, and the protocol's error when a stream fails after its commit
//! point), [`envelope`]
//! (the proxy's own errors in each API's format), [`metrics`]; [`config`] reads the TOML file
//! and the environment; [`demo`] puts the proxy in front of the crate's mock; [`workers`]
//! are the threads the binary serves connections on.

#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub, missing_debug_implementations, rust_2018_idioms)]

pub mod body;
mod budget;
pub mod config;
pub mod conn;
pub mod deadline;
pub mod demo;
pub mod envelope;
pub mod forward;
pub mod metrics;
pub mod routes;
pub mod server;
pub mod stack;
pub mod workers;

pub use crate::config::{
    CircuitConfig, Config, ConfigError, FallbackTarget, Kind, Preset, ResumeMode, Upstream,
};
pub use crate::server::Proxy;
pub use crate::workers::Workers;
