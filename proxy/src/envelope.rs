//! The proxy's own error responses, in the envelope of the API the request was meant for, so
//! SDKs parse them as they parse the upstream's.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};
use serde_json::json;

use crate::body::ProxyBody;
use crate::config::Kind;

/// A typed failure of the proxy itself, before or instead of an upstream response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// No upstream takes this path.
    NotFound,
    /// The request body is over the cap.
    BodyTooLarge,
    /// The request body could not be read.
    BodyRead,
    /// The request body stalled: no byte for the proxy's body timeout.
    BodyTimeout,
    /// A header the proxy reads is not valid.
    BadHeader,
    /// The proxy holds the keys and the client token is missing or wrong.
    Unauthorized,
    /// Too many requests in flight.
    Busy,
    /// The request bodies held already leave no room for this one's.
    BodyMemory,
    /// The upstream could not be reached or failed on every attempt.
    Upstream,
    /// The retry budget refused a retry.
    Budget,
    /// The request's deadline passed.
    Deadline,
    /// The proxy could not get a credential for the upstream.
    Credential,
    /// The request to the upstream cannot be sent as the proxy is configured (the upstream's
    /// host is not a name the TLS connector can use, say): the proxy's configuration is at
    /// fault, nothing was sent, and no retry can fix it.
    Unsendable,
    /// A method the proxy does not forward (`TRACE`, `CONNECT`, anything outside the
    /// methods the APIs use).
    MethodNotAllowed,
    /// A path with a dot segment (`..`, `.`, plain or percent-encoded) or an encoded slash:
    /// an upstream that normalises it would leave the configured base path.
    BadPath,
}

impl Reject {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Reject::NotFound => StatusCode::NOT_FOUND,
            Reject::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Reject::BodyRead | Reject::BadHeader | Reject::BadPath => StatusCode::BAD_REQUEST,
            Reject::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Reject::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Reject::Unauthorized => StatusCode::UNAUTHORIZED,
            Reject::Busy | Reject::BodyMemory | Reject::Budget => StatusCode::SERVICE_UNAVAILABLE,
            Reject::Upstream | Reject::Credential => StatusCode::BAD_GATEWAY,
            Reject::Deadline => StatusCode::GATEWAY_TIMEOUT,
            Reject::Unsendable => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A short stable name, for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Reject::NotFound => "not_found",
            Reject::BodyTooLarge => "body_too_large",
            Reject::BodyRead => "body_read",
            Reject::BodyTimeout => "body_timeout",
            Reject::BadHeader => "bad_header",
            Reject::Unauthorized => "unauthorized",
            Reject::Busy => "busy",
            Reject::BodyMemory => "body_memory",
            Reject::Upstream => "upstream",
            Reject::Budget => "budget",
            Reject::Deadline => "deadline",
            Reject::Credential => "credential",
            Reject::Unsendable => "upstream_unsendable",
            Reject::MethodNotAllowed => "method_not_allowed",
            Reject::BadPath => "bad_path",
        }
    }

    fn error_type(self, kind: Kind) -> &'static str {
        match (self, kind) {
            (Reject::NotFound, _) => "not_found_error",
            (Reject::BodyTooLarge, Kind::Anthropic) => "request_too_large",
            (
                Reject::BodyTooLarge
                | Reject::BodyRead
                | Reject::BodyTimeout
                | Reject::BadHeader
                | Reject::MethodNotAllowed
                | Reject::BadPath,
                _,
            ) => "invalid_request_error",
            (Reject::Unauthorized, _) => "authentication_error",
            (Reject::Busy | Reject::BodyMemory, Kind::Anthropic) => "overloaded_error",
            (_, Kind::Anthropic) => "api_error",
            (_, Kind::OpenAi) => "server_error",
        }
    }

    /// What `x-should-retry` says: `true` for a busy proxy, `false` for everything a retry
    /// cannot fix or the proxy already retried.
    fn should_retry(self) -> Option<bool> {
        match self {
            Reject::Busy | Reject::BodyMemory => Some(true),
            // The client's own upload stalled: sending it again may well go through.
            Reject::BodyTimeout => Some(true),
            // Whether the proxy retried is the caller's to say (see `server`).
            Reject::Upstream | Reject::Deadline | Reject::Budget | Reject::Credential => None,
            _ => Some(false),
        }
    }
}

/// The error body of `kind`'s API.
pub fn body(kind: Kind, error_type: &str, message: &str) -> Bytes {
    let v = match kind {
        Kind::Anthropic => {
            json!({"type": "error", "error": {"type": error_type, "message": message}})
        }
        Kind::OpenAi => {
            json!({"error": {"message": message, "type": error_type, "param": null, "code": error_type}})
        }
    };
    Bytes::from(v.to_string())
}

/// The response for `reject`, in `kind`'s envelope.
pub fn response(kind: Kind, reject: Reject, message: &str) -> Response<ProxyBody> {
    let mut res = Response::new(ProxyBody::full(body(
        kind,
        reject.error_type(kind),
        message,
    )));
    *res.status_mut() = reject.status();
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(
        "x-llm-retry-error",
        HeaderValue::from_static(reject.as_str()),
    );
    if matches!(reject, Reject::Busy | Reject::BodyMemory) {
        h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
    }
    if let Some(yes) = reject.should_retry() {
        h.insert(
            "x-should-retry",
            HeaderValue::from_static(if yes { "true" } else { "false" }),
        );
    }
    res
}

/// Which protocol's terminal error ends a stream cut after its commit point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamStyle {
    /// `event: error` with Anthropic's error object.
    Anthropic,
    /// A `data: {"error": …}` chunk, with no `[DONE]` after it (Chat Completions).
    OpenAiChat,
    /// `event: error` with the Responses API's error event.
    OpenAiResponses,
}

impl StreamStyle {
    /// The style for a stream from `kind` on `path`.
    pub fn for_route(kind: Kind, path: &str) -> Self {
        match kind {
            Kind::Anthropic => StreamStyle::Anthropic,
            Kind::OpenAi if path.starts_with("/v1/responses") => StreamStyle::OpenAiResponses,
            Kind::OpenAi => StreamStyle::OpenAiChat,
        }
    }

    /// The terminal error event carrying `message`.
    pub fn error_event(self, message: &str) -> Bytes {
        let frame = match self {
            StreamStyle::Anthropic => format!(
                "event: error\ndata: {}\n\n",
                json!({"type": "error", "error": {"type": "api_error", "message": message}})
            ),
            StreamStyle::OpenAiChat => format!(
                "data: {}\n\n",
                json!({"error": {"message": message, "type": "server_error", "param": null, "code": "stream_interrupted"}})
            ),
            StreamStyle::OpenAiResponses => format!(
                "event: error\ndata: {}\n\n",
                json!({"type": "error", "code": "stream_interrupted", "message": message, "param": null})
            ),
        };
        Bytes::from(frame)
    }
}
