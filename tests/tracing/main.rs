//! The tests that read what the stack writes to tracing, in a binary of their own.
//!
//! tracing decides once per callsite, process-wide, whether it is enabled, by the subscriber
//! of the first thread that reaches it. A test thread with no subscriber would cache "never"
//! and hide events from a sibling's capture, so every test in this binary installs a
//! TRACE-level subscriber, and no other test shares the process.

#[path = "../common/mod.rs"]
mod common;

mod companions;
mod observability;
mod secrets;
