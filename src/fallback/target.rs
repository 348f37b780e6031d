//! Fallback targets: a model, optionally on another upstream with its own credential.

use std::fmt;
#[cfg(feature = "auth")]
use std::sync::Arc;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::Uri;

#[cfg(feature = "auth")]
use crate::auth::TokenSource;
use crate::error::ConfigError;

/// One target of a fallback chain: a model, and optionally another upstream (another region,
/// a second gateway, a cloud provider's endpoint of the same API shape) with a credential
/// source of its own.
///
/// A request moved to a target is the same request: the body's top-level `"model"` is
/// rewritten (every other byte untouched), and for a target with an
/// [`upstream`](Target::upstream) the URI's scheme, authority and path prefix are replaced
/// (`https://api.anthropic.com/v1/messages?beta=true` to
/// `https://gateway.example.com/anthropic/v1/messages?beta=true` for the upstream
/// `https://gateway.example.com/anthropic`); a `host` header the caller set is replaced by
/// the new authority. Every other header is sent as it was.
///
/// ```
/// # #[cfg(not(feature = "auth"))] fn main() {}
/// # #[cfg(feature = "auth")]
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_llm_retry::ApiKey;
/// use tower_llm_retry::fallback::Target;
///
/// // The same model, served by a second gateway with its own key.
/// let target = Target::new("claude-sonnet-4-5")
///     .upstream("https://gateway.example.com/anthropic")?
///     .credential(ApiKey::new("sk-gateway-key")?);
/// # let _ = target;
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct Target {
    pub(crate) model: String,
    pub(crate) upstream: Option<Upstream>,
    #[cfg(feature = "auth")]
    pub(crate) credential: Option<Arc<dyn TokenSource>>,
}

/// Where a target's requests go instead of the request's own URI.
#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    pub(crate) base: Uri,
    scheme: Scheme,
    authority: Authority,
    // Without a trailing slash; empty for none.
    prefix: String,
}

impl Target {
    /// A target for `model`, on the request's own upstream.
    pub fn new(model: impl Into<String>) -> Self {
        Target {
            model: model.into(),
            upstream: None,
            #[cfg(feature = "auth")]
            credential: None,
        }
    }

    /// Sends this target's requests to `base_url` (scheme, authority and an optional path
    /// prefix, such as `https://gateway.example.com/anthropic`); the request's path and query
    /// follow the prefix. Fails on a URL without a scheme and authority, or with a query.
    /// Defaults to the request's own upstream.
    pub fn upstream(mut self, base_url: &str) -> Result<Self, ConfigError> {
        self.upstream = Some(Upstream::parse(base_url)?);
        Ok(self)
    }

    /// The credential source for this target's requests, used by the
    /// [`AuthLayer`](crate::AuthLayer) inside the fallback layer instead of its own
    /// (refresh on `401` and pool rotation included). Without one, a target on another
    /// upstream is sent the credential of the `AuthLayer` inside (or the caller's own
    /// headers). Defaults to none.
    #[cfg(feature = "auth")]
    #[cfg_attr(docsrs, doc(cfg(feature = "auth")))]
    pub fn credential(mut self, source: impl TokenSource) -> Self {
        self.credential = Some(Arc::new(source));
        self
    }

    /// The model.
    pub fn get_model(&self) -> &str {
        &self.model
    }

    /// The upstream base URL, when the target has its own.
    pub fn get_upstream(&self) -> Option<&Uri> {
        self.upstream.as_ref().map(|u| &u.base)
    }

    /// Whether the target sends the request anywhere but its own URI, or with another
    /// credential.
    pub(crate) fn moves_request(&self) -> bool {
        #[cfg(feature = "auth")]
        if self.credential.is_some() {
            return true;
        }
        self.upstream.is_some()
    }
}

impl From<&str> for Target {
    fn from(model: &str) -> Self {
        Target::new(model)
    }
}

impl From<String> for Target {
    fn from(model: String) -> Self {
        Target::new(model)
    }
}

impl From<&String> for Target {
    fn from(model: &String) -> Self {
        Target::new(model.as_str())
    }
}

impl fmt::Debug for Target {
    // The credential source holds secrets: only whether there is one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Target");
        d.field("model", &self.model)
            .field("upstream", &self.upstream.as_ref().map(|u| &u.base));
        #[cfg(feature = "auth")]
        d.field("credential", &self.credential.is_some());
        d.finish()
    }
}

impl Upstream {
    fn parse(base_url: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| ConfigError::new(format!("fallback upstream {base_url:?}: {why}"));
        let base: Uri = base_url
            .parse()
            .map_err(|e| bad(&format!("not a URL ({e})")))?;
        let parts = base.clone().into_parts();
        let scheme = parts.scheme.ok_or_else(|| bad("no scheme"))?;
        let authority = parts.authority.ok_or_else(|| bad("no host"))?;
        if base.query().is_some() {
            return Err(bad("a base URL takes no query"));
        }
        let prefix = base.path().trim_end_matches('/').to_owned();
        Ok(Upstream {
            base,
            scheme,
            authority,
            prefix,
        })
    }

    /// `uri` moved to this upstream: its path and query after the prefix.
    pub(crate) fn rewrite(&self, uri: &Uri) -> Option<Uri> {
        let rest = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let rest = if rest.starts_with('/') {
            rest.to_owned()
        } else {
            format!("/{rest}")
        };
        let path: PathAndQuery = format!("{}{rest}", self.prefix).parse().ok()?;
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .ok()
    }

    /// The `host` header value for this upstream.
    pub(crate) fn host(&self) -> Option<http::HeaderValue> {
        http::HeaderValue::from_str(self.authority.as_str()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_scheme_authority_and_prefix_keeping_path_and_query() {
        let up = Upstream::parse("https://gw.example.com/anthropic/").unwrap();
        let uri: Uri = "http://api.example.com:8080/v1/messages?beta=true"
            .parse()
            .unwrap();
        assert_eq!(
            up.rewrite(&uri).unwrap().to_string(),
            "https://gw.example.com/anthropic/v1/messages?beta=true"
        );
        let up = Upstream::parse("http://127.0.0.1:9000").unwrap();
        assert_eq!(
            up.rewrite(&"/v1/messages".parse().unwrap())
                .unwrap()
                .to_string(),
            "http://127.0.0.1:9000/v1/messages"
        );
    }

    #[test]
    fn bad_base_urls_are_config_errors() {
        for bad in [
            "",
            "not a url",
            "/just/a/path",
            "https://h.example.com/p?x=1",
        ] {
            assert!(Target::new("m").upstream(bad).is_err(), "{bad:?}");
        }
    }
}
