//! The access log: one record per HTTP request, written when its response has been sent (a
//! stream's, when the stream ends), with what an operator needs and nothing a client sent as a
//! secret: the key's identity (`key-2`), never the key; the path, never the query. What the
//! client chose is escaped and cut short (see `Escaped`): one request, one line.

use std::fmt::{self, Write as _};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::connections::hold_until_sent;
use crate::protocol::Usage;

/// The most bytes of a path (or method) a record holds: a longer one is cut, and says so.
pub const MAX_LOGGED_BYTES: usize = 1024;

/// Text the client chose (the method, the path), as a record holds it: `"` and `\` escaped as
/// `\"` and `\\`, control characters as `\xNN` (a newline would start a forged record, an
/// escape sequence would drive the operator's terminal), and cut after [`MAX_LOGGED_BYTES`]
/// with `...(N bytes)`, N the whole length. The quotes around it then end only where the
/// server put them.
struct Escaped<'a>(&'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0;
        let mut end = text.len().min(MAX_LOGGED_BYTES);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        for c in text[..end].chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                c if c.is_control() => write!(f, "\\x{:02x}", u32::from(c))?,
                c => f.write_char(c)?,
            }
        }
        if end < text.len() {
            write!(f, "...({} bytes)", text.len())?;
        }
        Ok(())
    }
}

/// One request, as logged.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessRecord {
    pub method: String,
    /// The path only: a query string could carry anything.
    pub path: String,
    pub status: u16,
    pub client: Option<IpAddr>,
    /// The API key's identity (`key-<n>`, or `anonymous` on an open server), once checked.
    pub key_id: Option<String>,
    /// The generation's tokens, for a generation that finished.
    pub usage: Option<Usage>,
    /// From the request's arrival to its response's last byte.
    pub latency: Duration,
}

impl fmt::Display for AccessRecord {
    /// `127.0.0.1 key-1 "POST /v1/completions" 200 prompt=12 completion=16 0.412s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let client = self.client.map_or("-".to_string(), |ip| ip.to_string());
        let key = self.key_id.as_deref().unwrap_or("-");
        write!(
            f,
            "{client} {key} \"{} {}\" {}",
            Escaped(&self.method),
            Escaped(&self.path),
            self.status
        )?;
        if let Some(usage) = self.usage {
            write!(
                f,
                " prompt={} completion={}",
                usage.prompt_tokens, usage.completion_tokens
            )?;
        }
        write!(f, " {:.3}s", self.latency.as_secs_f64())
    }
}

/// Where records go (the binary writes them to stderr; tests keep them).
#[derive(Clone)]
pub struct AccessLog(pub Arc<dyn Fn(&AccessRecord) + Send + Sync>);

impl fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AccessLog")
    }
}

/// What a handler learns about its request for the log: filled in as it goes.
#[derive(Debug, Clone, Default)]
pub struct AccessNote(Arc<Mutex<Note>>);

#[derive(Debug, Default)]
struct Note {
    key_id: Option<String>,
    usage: Option<Usage>,
}

impl AccessNote {
    fn note(&self) -> std::sync::MutexGuard<'_, Note> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn key_id(&self, key_id: &str) {
        self.note().key_id = Some(key_id.to_string());
    }

    pub fn usage(&self, usage: Usage) {
        self.note().usage = Some(usage);
    }
}

/// Writes the record when dropped: when the response body has been sent, or abandoned.
struct Pending {
    log: AccessLog,
    note: AccessNote,
    record: AccessRecord,
    started: Instant,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let note = self.note.note();
        self.record.key_id = note.key_id.clone();
        self.record.usage = note.usage;
        self.record.latency = self.started.elapsed();
        (self.log.0)(&self.record);
    }
}

// ANCHOR: middleware
/// The middleware: gives the handler an [`AccessNote`], and logs once the response is sent.
pub async fn log_access(
    State(log): State<AccessLog>,
    mut request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let note = AccessNote::default();
    request.extensions_mut().insert(note.clone());
    let client = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip());
    let method = request.method().to_string();
    let path = request.uri().path().to_string();
    let response = next.run(request).await;
    let pending = Pending {
        log,
        note,
        record: AccessRecord {
            method,
            path,
            status: response.status().as_u16(),
            client,
            key_id: None,
            usage: None,
            latency: Duration::ZERO,
        },
        started,
    };
    response.map(|body| hold_until_sent(body, pending))
}
// ANCHOR_END: middleware

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_as_one_line_without_secrets() {
        let record = AccessRecord {
            method: "POST".into(),
            path: "/v1/completions".into(),
            status: 200,
            client: Some("10.0.0.7".parse().unwrap()),
            key_id: Some("key-2".into()),
            usage: Some(Usage::new(12, 16)),
            latency: Duration::from_millis(412),
        };
        assert_eq!(
            record.to_string(),
            "10.0.0.7 key-2 \"POST /v1/completions\" 200 prompt=12 completion=16 0.412s"
        );
        let bare = AccessRecord {
            client: None,
            key_id: None,
            usage: None,
            status: 401,
            ..record
        };
        assert_eq!(bare.to_string(), "- - \"POST /v1/completions\" 401 0.412s");
    }

    /// A path is the client's text: its quotes, backslashes and control characters are escaped,
    /// so it cannot end its field and forge the rest of the line (or start another), and a long
    /// one is cut. `GET /x"%20200%200.001s\` used to read `"GET /x" 200 0.001s\" 404 0.000s`.
    #[test]
    fn a_path_cannot_forge_a_record_or_flood_the_log() {
        let record = |path: &str| {
            AccessRecord {
                method: "GET".into(),
                path: path.into(),
                status: 404,
                client: None,
                key_id: None,
                usage: None,
                latency: Duration::ZERO,
            }
            .to_string()
        };
        assert_eq!(
            record("/x\" 200 0.001s\\"),
            r#"- - "GET /x\" 200 0.001s\\" 404 0.000s"#
        );
        assert_eq!(
            record("/a\nb\x1b[2J\u{85}é"),
            r#"- - "GET /a\x0ab\x1b[2J\x85é" 404 0.000s"#
        );
        let long = format!("/{}", "é".repeat(40_000)); // 80,001 bytes
        let line = record(&long);
        assert!(line.len() < MAX_LOGGED_BYTES + 100, "{} bytes", line.len());
        assert!(line.ends_with("...(80001 bytes)\" 404 0.000s"), "{line}");
    }
}
