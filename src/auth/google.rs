//! Google OAuth access tokens (feature `google-auth`), for Vertex AI.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use tower::ServiceExt;
use tower_service::Service;

use super::refresh::{RefreshingToken, Token};
use crate::body::ReplayBody;
use crate::error::{BoxError, ConfigError};

/// The metadata server's token for the default service account (Compute Engine, Cloud Run,
/// GKE, Cloud Functions).
pub const METADATA_TOKEN_URL: &str =
    "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token";

/// Google's OAuth 2.0 token endpoint, where a refresh token is exchanged.
pub const OAUTH_TOKEN_URL: &str = "https://oauth2.googleapis.com/token";

/// The most of a token answer read: a real one is well under 4 KiB.
const ANSWER_LIMIT: usize = 64 * 1024;

/// Google OAuth access tokens for Vertex AI, as a [`RefreshingToken`]: fetched through your
/// HTTP client, sent as `authorization: Bearer …`, refreshed ahead of expiry (Google's tokens
/// last an hour) and once after a `401`, single-flight.
///
/// Two sources, no new dependency: the metadata server of the machine the code runs on
/// ([`metadata_server`](Self::metadata_server)), and the user credentials that
/// `gcloud auth application-default login` writes ([`authorized_user`](Self::authorized_user)).
/// A service-account key file needs an RS256 signature, which this crate does not make: put
/// a crate that does (such as `gcp_auth`) in a [`RefreshingToken::new`] closure, and build a
/// new provider of it after a `401`, as its cache would hand back the rejected token.
///
/// ```no_run
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use hyper_util::client::legacy::Client;
/// use hyper_util::rt::TokioExecutor;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_llm_retry::auth::GoogleToken;
/// use tower_llm_retry::{AuthLayer, ReplayBody, RetryLayer};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
/// // `client`: any `Service<http::Request<ReplayBody>>` that speaks HTTPS (the quick start's).
/// let adc = std::fs::read_to_string(
///     std::env::var("HOME")? + "/.config/gcloud/application_default_credentials.json",
/// )?;
/// let vertex = ServiceBuilder::new()
///     .layer(RetryLayer::new())
///     .layer(AuthLayer::new(GoogleToken::authorized_user(client.clone(), &adc)?.build()))
///     .service(client);
/// let url = "https://us-east5-aiplatform.googleapis.com/v1/projects/my-project/locations/us-east5/\
///            publishers/anthropic/models/claude-sonnet-4-5:rawPredict";
/// let request = http::Request::post(url)
///     .header("content-type", "application/json")
///     .body(Full::new(Bytes::from_static(
///         br#"{"anthropic_version":"vertex-2023-10-16","max_tokens":64,"messages":[{"role":"user","content":"Hello"}]}"#,
///     )))?;
/// let response = vertex.oneshot(request).await?;
/// # let _ = response; Ok(()) }
/// ```
pub struct GoogleToken<S> {
    client: S,
    url: Uri,
    grant: Grant,
}

#[derive(Clone)]
enum Grant {
    Metadata,
    RefreshToken {
        client_id: String,
        client_secret: String,
        refresh_token: String,
    },
}

impl<S> fmt::Debug for GoogleToken<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The client secret and refresh token are never shown.
        let grant = match self.grant {
            Grant::Metadata => "metadata_server",
            Grant::RefreshToken { .. } => "authorized_user",
        };
        f.debug_struct("GoogleToken")
            .field("grant", &grant)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// The fields of an application-default credentials file this reads.
#[derive(Deserialize)]
struct CredentialsFile {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    client_id: String,
    #[serde(default)]
    client_secret: String,
    #[serde(default)]
    refresh_token: String,
}

/// A token endpoint's answer (the metadata server's and the OAuth endpoint's alike).
#[derive(Deserialize)]
struct Answer {
    access_token: String,
    expires_in: u64,
}

/// An OAuth error answer: its code (`invalid_grant`, …) says what went wrong and holds no
/// secret, unlike the request.
#[derive(Deserialize)]
struct ErrorAnswer {
    error: String,
}

impl<S> GoogleToken<S> {
    /// Tokens of the machine's default service account, from the metadata server
    /// (`GET`, `Metadata-Flavor: Google`), through `client`: plain HTTP, so any client will do.
    pub fn metadata_server(client: S) -> Self {
        GoogleToken {
            client,
            url: Uri::from_static(METADATA_TOKEN_URL),
            grant: Grant::Metadata,
        }
    }

    /// Tokens for the user whose credentials `gcloud auth application-default login` wrote
    /// (`application_default_credentials.json`, given as its text), exchanged at Google's
    /// token endpoint through `client`, which must speak HTTPS. Fails unless the file is of
    /// type `authorized_user` with a client id, client secret and refresh token (a
    /// service-account key needs signing: see the type's docs).
    pub fn authorized_user(client: S, credentials_json: &str) -> Result<Self, ConfigError> {
        let file: CredentialsFile = serde_json::from_str(credentials_json).map_err(|e| {
            // The position only: serde's message may quote the text, secrets included.
            ConfigError::new(format!(
                "the Google credentials are not JSON (line {}, column {})",
                e.line(),
                e.column()
            ))
        })?;
        if file.kind != "authorized_user" {
            return Err(ConfigError::new(format!(
                "Google credentials of type {:?}: only \"authorized_user\" is read here; a \
                 service-account key needs a signing crate in a RefreshingToken",
                file.kind
            )));
        }
        if file.client_id.is_empty()
            || file.client_secret.is_empty()
            || file.refresh_token.is_empty()
        {
            return Err(ConfigError::new(
                "the Google credentials need client_id, client_secret and refresh_token",
            ));
        }
        Ok(GoogleToken {
            client,
            url: Uri::from_static(OAUTH_TOKEN_URL),
            grant: Grant::RefreshToken {
                client_id: file.client_id,
                client_secret: file.client_secret,
                refresh_token: file.refresh_token,
            },
        })
    }

    /// Where tokens are fetched from (a private endpoint, a test server). Defaults to
    /// [`METADATA_TOKEN_URL`] for [`metadata_server`](Self::metadata_server) and
    /// [`OAUTH_TOKEN_URL`] for [`authorized_user`](Self::authorized_user).
    pub fn token_url(mut self, url: &str) -> Result<Self, ConfigError> {
        let uri: Uri = url
            .parse()
            .map_err(|_| ConfigError::new("the Google token URL is not a valid URI"))?;
        if uri.scheme().is_none() || uri.host().is_none() {
            return Err(ConfigError::new(
                "the Google token URL needs a scheme and a host",
            ));
        }
        self.url = uri;
        Ok(self)
    }
}

impl<S, B> GoogleToken<S>
where
    S: Service<Request<ReplayBody>, Response = Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    /// The token source, for [`AuthLayer::new`](crate::AuthLayer::new). Its refresh windows,
    /// failure backoff and timeout are [`RefreshingToken`]'s, set on what this returns.
    pub fn build(self) -> RefreshingToken {
        let GoogleToken { client, url, grant } = self;
        RefreshingToken::new(move || fetch(client.clone(), url.clone(), grant.clone()))
    }
}

async fn fetch<S, B>(client: S, url: Uri, grant: Grant) -> Result<Token, BoxError>
where
    S: Service<Request<ReplayBody>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    let request = match &grant {
        Grant::Metadata => Request::builder()
            .method(Method::GET)
            .uri(url)
            .header("metadata-flavor", "Google")
            .body(ReplayBody::empty())?,
        Grant::RefreshToken {
            client_id,
            client_secret,
            refresh_token,
        } => {
            let mut form = String::from("grant_type=refresh_token");
            for (name, value) in [
                ("client_id", client_id),
                ("client_secret", client_secret),
                ("refresh_token", refresh_token),
            ] {
                form.push('&');
                form.push_str(name);
                form.push('=');
                form_encode(value, &mut form);
            }
            let mut request = Request::builder()
                .method(Method::POST)
                .uri(url)
                .header(
                    CONTENT_TYPE,
                    HeaderValue::from_static("application/x-www-form-urlencoded"),
                )
                .body(ReplayBody::new(Bytes::from(form)))?;
            request.headers_mut().insert(
                http::header::ACCEPT,
                HeaderValue::from_static("application/json"),
            );
            request
        }
    };
    let response = client.oneshot(request).await.map_err(Into::into)?;
    let status = response.status();
    let body = Limited::new(response.into_body(), ANSWER_LIMIT)
        .collect()
        .await?
        .to_bytes();
    if !status.is_success() {
        let code = serde_json::from_slice::<ErrorAnswer>(&body)
            .map(|e| e.error.chars().take(64).collect());
        return Err(TokenEndpointError {
            status,
            code: code.ok(),
        }
        .into());
    }
    let answer: Answer = serde_json::from_slice(&body).map_err(|_| TokenEndpointError {
        status,
        code: Some("an answer without access_token and expires_in".into()),
    })?;
    Ok(Token::new(answer.access_token).expires_in(Duration::from_secs(answer.expires_in)))
}

/// `value` as `application/x-www-form-urlencoded`: unreserved bytes as they are, every other
/// byte percent-encoded.
fn form_encode(value: &str, out: &mut String) {
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b >> 4)]));
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b & 0xF)]));
        }
    }
}

/// A token endpoint that did not give a token: its status and OAuth error code.
#[derive(Debug)]
struct TokenEndpointError {
    status: http::StatusCode,
    code: Option<String>,
}

impl fmt::Display for TokenEndpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the Google token endpoint answered {}", self.status)?;
        if let Some(code) = &self.code {
            write!(f, ": {code}")?;
        }
        Ok(())
    }
}

impl std::error::Error for TokenEndpointError {}

#[cfg(test)]
mod tests {
    use super::form_encode;

    #[test]
    fn form_encoding_keeps_unreserved_bytes_only() {
        let mut out = String::new();
        form_encode("1//0a-B_c.d~e+f/g=h&i j\u{e9}", &mut out);
        assert_eq!(out, "1%2F%2F0a-B_c.d~e%2Bf%2Fg%3Dh%26i%20j%C3%A9");
    }
}
