//! The faithful copy: which headers cross the proxy, and what it adds to a response.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Headers that describe one connection, never forwarded (RFC 9110 §7.6.1), `keep-alive`
/// and `proxy-connection`, plus `host`, which the client sets from the upstream URL.
static HOP_BY_HOP: [HeaderName; 10] = [
    // First: `CONNECTION_AT`.
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::HOST,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// Where `connection` is in [`HOP_BY_HOP`].
const CONNECTION_AT: usize = 0;

/// Request headers that are the proxy's own and are stripped before forwarding.
pub const RETRY_SWITCH: &str = "x-llm-retry";
/// Picks a preset for one request.
pub const RETRY_POLICY: &str = "x-llm-retry-policy";
/// Bounds one request's retry loop, in seconds (see [`crate::deadline`]).
pub const CLIENT_DEADLINE: &str = "x-llm-retry-deadline";
/// Where a client may present the proxy's token (besides `x-api-key` and `authorization`).
pub const CLIENT_TOKEN: &str = "x-llm-retry-token";
/// The official SDKs' attempt counter: above 0, the client is retrying the proxy.
pub const SDK_RETRY_COUNT: &str = "x-stainless-retry-count";

/// The header names below, parsed once: a lookup by `&str` parses the name on every call.
pub(crate) const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
/// Azure OpenAI's credential header.
pub(crate) const API_KEY: HeaderName = HeaderName::from_static("api-key");
/// [`RETRY_SWITCH`] as a header name.
pub(crate) const RETRY_SWITCH_NAME: HeaderName = HeaderName::from_static(RETRY_SWITCH);
/// [`RETRY_POLICY`] as a header name.
pub(crate) const RETRY_POLICY_NAME: HeaderName = HeaderName::from_static(RETRY_POLICY);
/// [`CLIENT_DEADLINE`] as a header name.
pub(crate) const CLIENT_DEADLINE_NAME: HeaderName = HeaderName::from_static(CLIENT_DEADLINE);
/// [`CLIENT_TOKEN`] as a header name.
pub(crate) const CLIENT_TOKEN_NAME: HeaderName = HeaderName::from_static(CLIENT_TOKEN);
/// [`SDK_RETRY_COUNT`] as a header name.
pub(crate) const SDK_RETRY_COUNT_NAME: HeaderName = HeaderName::from_static(SDK_RETRY_COUNT);

/// Removes hop-by-hop headers, those the `Connection` header names, and `keep-alive` /
/// `proxy-connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the handful of names the map holds finds the few to drop, with no list
    // made and no hashed removal of a name that is absent: this runs on every request and
    // every response.
    let mut present = [false; HOP_BY_HOP.len()];
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            present[i] = true;
        }
    }
    if !present.contains(&true) {
        return;
    }
    // The names `Connection` lists, less the usual `keep-alive` and `close`, which are no
    // header to remove here (`keep-alive` is one of ours already).
    let named: Vec<HeaderName> = if present[CONNECTION_AT] {
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|n| !n.eq_ignore_ascii_case("keep-alive") && !n.eq_ignore_ascii_case("close"))
            .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
            .collect()
    } else {
        Vec::new()
    };
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        headers.remove(name);
    }
    for name in &named {
        headers.remove(name);
    }
}

/// The request headers to send upstream: the client's, less hop-by-hop headers and the
/// proxy's own, and less the client's credentials when the proxy holds the keys.
pub fn request_headers(mut headers: HeaderMap, holds_keys: bool) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    // Framing, like `transfer-encoding`: the client sets it from the body it sends, which is
    // the caller's bytes unless a layer changed one JSON value (`model`, `max_tokens`).
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(RETRY_SWITCH_NAME);
    headers.remove(RETRY_POLICY_NAME);
    headers.remove(CLIENT_DEADLINE_NAME);
    headers.remove(CLIENT_TOKEN_NAME);
    if holds_keys {
        headers.remove(header::AUTHORIZATION);
        headers.remove(X_API_KEY);
    }
    headers
}

/// The credential a client presented: `x-llm-retry-token`, `x-api-key`, or the token of
/// `authorization: Bearer …`, in that order.
pub fn presented_tokens(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    let direct = [CLIENT_TOKEN_NAME, X_API_KEY]
        .into_iter()
        .flat_map(|n| headers.get_all(n))
        .map(HeaderValue::as_bytes);
    let bearer = headers
        .get_all(header::AUTHORIZATION)
        .into_iter()
        .filter_map(|v| {
            let v = v.as_bytes();
            let (scheme, rest) = v.split_at(v.iter().position(|b| *b == b' ')?);
            scheme
                .eq_ignore_ascii_case(b"bearer")
                .then(|| rest.trim_ascii())
        });
    // A blank credential is never a token, whatever the configured one: a check that
    // compared it could only ever be fooled by a blank token.
    direct
        .chain(bearer)
        .filter(|t| !t.iter().all(u8::is_ascii_whitespace))
}

/// Refuses a request path an upstream could read as leaving the configured base path: a
/// `.` or `..` segment, written plainly or percent-encoded in any case (`%2e%2E`), an encoded
/// slash or backslash (`%2f`, `%5c`), or a backslash. Forwarded raw, an upstream that
/// normalises paths would resolve them.
pub fn check_path(path: &str) -> Result<(), &'static str> {
    // Most paths have no percent sign, backslash or dot: nothing to look at closer, nothing to copy.
    if !path.bytes().any(|b| matches!(b, b'%' | b'\\' | b'.')) {
        return Ok(());
    }
    let lower = path.to_ascii_lowercase();
    if lower.contains("%2f") || lower.contains("%5c") || path.contains('\\') {
        return Err("the path has an encoded slash or a backslash");
    }
    for segment in lower.split('/') {
        let decoded = segment.replace("%2e", ".");
        if decoded == "." || decoded == ".." {
            return Err("the path has a dot segment (. or ..)");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_own_headers_are_removed() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("host", "127.0.0.1:8787"),
            ("transfer-encoding", "chunked"),
            ("x-llm-retry", "off"),
            ("x-llm-retry-policy", "patient"),
            ("x-llm-retry-deadline", "30"),
            ("x-api-key", "sk-1"),
            ("anthropic-version", "2023-06-01"),
            ("content-length", "12"),
        ] {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = request_headers(h.clone(), false);
        let names: Vec<&str> = out.keys().map(HeaderName::as_str).collect();
        let mut names = names;
        names.sort_unstable();
        assert_eq!(names, ["anthropic-version", "x-api-key"]);
        let out = request_headers(h, true);
        assert!(!out.contains_key("x-api-key"));
    }

    #[test]
    fn connection_is_where_the_removal_looks_for_it() {
        assert_eq!(HOP_BY_HOP[CONNECTION_AT], header::CONNECTION);
    }

    #[test]
    fn dot_segments_and_encoded_slashes() {
        for ok in ["/v1/messages", "/v1/models/a.b", "/v1/x..y", "/v1/...", "/"] {
            assert_eq!(check_path(ok), Ok(()), "{ok}");
        }
        for bad in [
            "/v1/../admin",
            "/v1/..",
            "/v1/./messages",
            "/v1/%2e%2e/admin",
            "/v1/%2E%2e/admin",
            "/v1/.%2E/admin",
            "/v1/%2e/messages",
            "/v1/a%2fb",
            "/v1/a%2Fb",
            "/v1/a%5cb",
            "/v1/a\\b",
        ] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tokens() {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer  tok-1 "));
        assert_eq!(
            presented_tokens(&h).collect::<Vec<_>>(),
            [b"tok-1".as_slice()]
        );
        h.insert("x-api-key", HeaderValue::from_static("tok-2"));
        assert_eq!(presented_tokens(&h).count(), 2);
        // Blank credentials are never presented, from any header.
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("   "));
        h.append("x-api-key", HeaderValue::from_static(""));
        h.insert("x-llm-retry-token", HeaderValue::from_static(" \t "));
        h.insert("authorization", HeaderValue::from_static("Bearer    "));
        h.append("authorization", HeaderValue::from_static("Bearer \t"));
        assert_eq!(presented_tokens(&h).count(), 0);
    }
}
