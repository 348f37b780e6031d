//! The proxy end to end: a client, the proxy's `serve` on 127.0.0.1, and the crate's mock as
//! the upstream, all on one current-thread runtime with paused time (real time for the
//! replicas sharing a real Redis).

mod common;

mod bad_input;
mod body_limits;
mod cloud;
mod connections;
mod deadline;
mod failover;
mod failover_faults;
mod forwarding;
mod ops;
mod protocol;
mod replicas;
mod resume;
mod retries;
mod secrets;
mod streams;
mod tenants;
