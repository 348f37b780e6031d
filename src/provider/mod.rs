//! What this crate knows of the providers' wire formats, in one place: the shapes of their
//! JSON error bodies ([`error_body`]), the cloud dialects of the same APIs (Bedrock's AWS error
//! codes, Google's error envelope: [`cloud`]) and their rate-limit headers ([`ratelimit`]). The
//! modules that act on them (`classify`, the companion layers, `fleet`) read them from here.
//!
//! Two pieces live beside the code they drive, each in one file: the meaning of each SSE event
//! before the commit point (`classify::sse`) and each protocol's terminal events
//! (`stream::terminal`); and the credential headers (`auth::CredentialHeader`).

pub(crate) mod cloud;
pub(crate) mod error_body;
pub(crate) mod ratelimit;
pub(crate) mod signal;
