//! `GET /v1/models`, `GET /health`, `GET /metrics`, and the JSON 404.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};

use super::client_of;
use crate::error::ApiError;
use crate::protocol::{ModelCard, ModelList};
use crate::state::AppState;

pub async fn models(State(state): State<Arc<AppState>>, parts: Parts) -> Response {
    if let Err(error) = state.authorize_client(&parts.headers, client_of(&parts.extensions)) {
        return error.into_response();
    }
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: state.served_model_name.clone(),
            object: "model".into(),
            created: state.created,
            owned_by: "kiln".into(),
            max_model_len: state.limits.max_model_len,
        }],
    })
    .into_response()
}

/// 200 while serving; 503 once shutting down or when the engine thread has ended (a panic, a
/// stop), so a load balancer stops sending and a supervisor restarts the server.
pub async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.shutting_down.load(Ordering::SeqCst) || !state.engine.is_alive() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::bad_request(format!("{method} is not allowed on {}", uri.path()))
    }
    .into_response()
}

pub async fn not_found(uri: Uri) -> Response {
    ApiError::not_found(format!("no route for {}", uri.path())).into_response()
}
