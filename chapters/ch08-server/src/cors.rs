//! CORS for browser clients (`--allowed-origins`, off by default).
//!
//! A browser sends a page's requests to another origin only if the server says it may: a
//! preflight `OPTIONS` (with `Access-Control-Request-Method`) is answered here, before the API
//! key is checked (the browser sends no key with it), and every answer to an allowed origin
//! carries `Access-Control-Allow-Origin`. Without `--allowed-origins`, nothing changes: no
//! header is added, and a preflight is the 405 any `OPTIONS` is.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD, ORIGIN,
    VARY,
};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

/// The origins allowed (`https://example.com`), or any (`*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedOrigins(pub Arc<Vec<String>>);

impl AllowedOrigins {
    /// The `Access-Control-Allow-Origin` value for a request from `origin`, if it is allowed.
    fn allow(&self, origin: &str) -> Option<HeaderValue> {
        if self.0.iter().any(|o| o == "*") {
            return Some(HeaderValue::from_static("*"));
        }
        self.0
            .iter()
            .any(|o| o == origin)
            .then(|| HeaderValue::from_str(origin).ok())
            .flatten()
    }
}

// ANCHOR: cors
/// Answers preflights from allowed origins, and marks every response to one.
pub async fn cors(State(origins): State<AllowedOrigins>, request: Request, next: Next) -> Response {
    let allowed = request
        .headers()
        .get(ORIGIN)
        .and_then(|o| o.to_str().ok())
        .and_then(|o| origins.allow(o));
    let Some(allowed) = allowed else {
        return next.run(request).await;
    };
    let preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let asked = request
            .headers()
            .get(ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned();
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::NO_CONTENT;
        let headers = response.headers_mut();
        headers.insert(
            ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        headers.insert(
            ACCESS_CONTROL_ALLOW_HEADERS,
            asked.unwrap_or_else(|| HeaderValue::from_static("authorization, content-type")),
        );
        headers.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        response
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
    headers.append(VARY, HeaderValue::from_static("Origin"));
    response
}
// ANCHOR_END: cors
