//! Path → upstream.
//!
//! In order: a configured prefix (`/eu/v1/messages` → the `eu` upstream, prefix removed); the
//! well-known paths of each API (`/v1/messages…` → the first Anthropic upstream;
//! `/v1/chat/…`, `/v1/responses…`, `/v1/embeddings…` → the first OpenAI upstream); any other
//! `/v1/…` path (`GET /v1/models`) → the first Anthropic upstream when the request carries
//! `anthropic-version` (the Anthropic SDKs always send it), else the first OpenAI upstream.

use http::{HeaderMap, Uri};

use crate::config::{Kind, Upstream};

/// Anthropic's version header, which tells its requests apart on a shared path.
const ANTHROPIC_VERSION: http::HeaderName = http::HeaderName::from_static("anthropic-version");

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Index of the upstream in the configuration.
    pub upstream: usize,
    /// The path (and query) to send upstream, after the upstream's base path.
    pub path_and_query: String,
}

/// The routing table built from the configured upstreams.
#[derive(Debug, Clone)]
pub struct Routes {
    /// (prefix, upstream index), longest prefix first.
    prefixes: Vec<(String, usize)>,
    first: [Option<usize>; 2],
    kinds: Vec<Kind>,
}

impl Routes {
    /// Builds the table.
    pub fn new(upstreams: &[Upstream]) -> Self {
        let mut prefixes: Vec<(String, usize)> = upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| (u.route_prefix(), i))
            .collect();
        prefixes.sort_by_key(|p| std::cmp::Reverse(p.0.len()));
        let first = |k: Kind| upstreams.iter().position(|u| u.kind == k);
        Routes {
            prefixes,
            first: [first(Kind::Anthropic), first(Kind::OpenAi)],
            kinds: upstreams.iter().map(|u| u.kind).collect(),
        }
    }

    /// The route for a request, or `None` when no upstream takes it.
    pub fn resolve(&self, uri: &Uri, headers: &HeaderMap) -> Option<Route> {
        let path = uri.path();
        let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
        for (prefix, i) in &self.prefixes {
            if let Some(rest) = path.strip_prefix(prefix.as_str()) {
                if rest.is_empty() || rest.starts_with('/') {
                    let rest = if rest.is_empty() { "/" } else { rest };
                    return Some(Route {
                        upstream: *i,
                        path_and_query: format!("{rest}{query}"),
                    });
                }
            }
        }
        let kind = well_known(path).or_else(|| {
            path.starts_with("/v1/").then(|| {
                if headers.contains_key(ANTHROPIC_VERSION) {
                    Kind::Anthropic
                } else {
                    Kind::OpenAi
                }
            })
        })?;
        let upstream = self.first[kind as usize]?;
        Some(Route {
            upstream,
            path_and_query: format!("{path}{query}"),
        })
    }

    /// The kind of API a request most likely speaks, for the envelope of an error about a
    /// request no upstream takes.
    pub fn guess_kind(&self, uri: &Uri, headers: &HeaderMap) -> Kind {
        if let Some(r) = self.resolve(uri, headers) {
            return self.kinds[r.upstream];
        }
        well_known(uri.path()).unwrap_or(if headers.contains_key(ANTHROPIC_VERSION) {
            Kind::Anthropic
        } else {
            Kind::OpenAi
        })
    }
}

fn well_known(path: &str) -> Option<Kind> {
    let under = |p: &str| {
        path.strip_prefix(p)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    };
    if under("/v1/messages") || under("/v1/complete") {
        Some(Kind::Anthropic)
    } else if under("/v1/chat/completions") || under("/v1/responses") || under("/v1/embeddings") {
        Some(Kind::OpenAi)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes() -> Routes {
        let mut eu = Upstream::new("eu", Kind::Anthropic, "https://eu.example");
        eu.prefix = Some("/eu".into());
        Routes::new(&[
            Upstream::new("anthropic", Kind::Anthropic, "https://a.example"),
            Upstream::new("openai", Kind::OpenAi, "https://o.example"),
            eu,
        ])
    }

    fn at(path: &str, anthropic: bool) -> Option<Route> {
        let mut h = HeaderMap::new();
        if anthropic {
            h.insert("anthropic-version", "2023-06-01".parse().unwrap());
        }
        routes().resolve(&path.parse().unwrap(), &h)
    }

    #[test]
    fn table() {
        let r = |u: usize, p: &str| {
            Some(Route {
                upstream: u,
                path_and_query: p.into(),
            })
        };
        assert_eq!(at("/v1/messages", false), r(0, "/v1/messages"));
        assert_eq!(
            at("/v1/messages/count_tokens", false),
            r(0, "/v1/messages/count_tokens")
        );
        assert_eq!(
            at("/v1/chat/completions", true),
            r(1, "/v1/chat/completions")
        );
        assert_eq!(at("/v1/responses", false), r(1, "/v1/responses"));
        assert_eq!(at("/v1/embeddings", false), r(1, "/v1/embeddings"));
        assert_eq!(at("/v1/models?limit=2", true), r(0, "/v1/models?limit=2"));
        assert_eq!(at("/v1/models", false), r(1, "/v1/models"));
        assert_eq!(at("/eu/v1/messages", false), r(2, "/v1/messages"));
        assert_eq!(at("/openai/v1/models", false), r(1, "/v1/models"));
        assert_eq!(at("/europe/v1/messages", false), None);
        assert_eq!(at("/v2/messages", false), None);
        assert_eq!(at("/", false), None);
    }
}
