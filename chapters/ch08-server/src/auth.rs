//! API keys and the `Authorization: Bearer <key>` header.
//!
//! The server is either open (no keys configured: every request is served as `anonymous`) or
//! closed (a request must carry one of the keys). Keys come from `--api-key` flags and from a
//! file with one key per line. Invariants:
//!
//! - a key is never empty and never has surrounding whitespace (both are trimmed on load);
//! - a key never appears in an error message, in `Debug` output, or in the identity that
//!   [`ApiKeys::check`] returns (that identity is `key-<n>`, the key's 1-based position), so
//!   logs and rate-limit state cannot leak it;
//! - checking a header compares it against every key, in time that does not depend on where
//!   the first differing byte is (no early exit), so response times do not reveal key prefixes.

use std::fmt;
use std::path::{Path, PathBuf};

/// The identity of every request on an open server.
pub const ANONYMOUS: &str = "anonymous";

/// Why a request was not authenticated, or why keys could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The request had no usable `Authorization: Bearer <key>` header.
    #[error(
        "You didn't provide an API key. You need to provide your API key in an Authorization \
         header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
    )]
    Missing,
    /// The request had a bearer key, but not one of ours.
    #[error("Incorrect API key provided.")]
    Invalid,
    /// Keys were asked for (`--api-key`, `--api-key-file`) and none is usable: the server
    /// would be open to everyone.
    #[error(
        "no API key is usable (every one given is empty, or the key file holds none): the \
         server would accept any request; give a key, or none of these options"
    )]
    NoneUsable,
    /// The key file could not be read.
    #[error("cannot read API key file {}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The most bytes a key file may hold: ample for thousands of keys, and `/dev/zero` or a log
/// given by mistake is refused instead of read until memory runs out.
pub const MAX_KEY_FILE_BYTES: u64 = 1 << 20;

/// The text of the key file `path`, if it holds at most [`MAX_KEY_FILE_BYTES`] of UTF-8.
fn read_key_file(path: &Path) -> std::io::Result<String> {
    use ch01::text_file::{TextFileError, read_text_up_to};
    read_text_up_to(path, MAX_KEY_FILE_BYTES).map_err(|e| match e {
        TextFileError::Io(e) => e,
        TextFileError::TooLarge { most } => std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {most} bytes: not a file of API keys"),
        ),
        e @ TextFileError::NotUtf8(_) => std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}

/// The accepted API keys. Empty: the server is open (no Authorization needed).
#[derive(Clone, Default)]
pub struct ApiKeys {
    /// Trimmed, non-empty, without duplicates, in the order given.
    keys: Vec<String>,
}

impl fmt::Debug for ApiKeys {
    /// Shows how many keys there are, never the keys.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKeys")
            .field("len", &self.keys.len())
            .finish()
    }
}

impl ApiKeys {
    /// The given keys, trimmed; empty strings and duplicates are dropped.
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        let mut out: Vec<String> = Vec::new();
        for key in keys {
            let key = key.trim();
            if !key.is_empty() && !out.iter().any(|k| k == key) {
                out.push(key.to_string());
            }
        }
        ApiKeys { keys: out }
    }

    /// `--api-key` values plus, if given, a file with one key per line (blank lines and lines
    /// starting with '#' ignored). Errors: keys asked for, and none usable.
    pub fn load(keys: &[String], file: Option<&Path>) -> Result<Self, AuthError> {
        let asked = !keys.is_empty() || file.is_some();
        let mut all = keys.to_vec();
        if let Some(path) = file {
            let text = read_key_file(path).map_err(|source| AuthError::File {
                path: path.to_path_buf(),
                source,
            })?;
            all.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|line| !line.is_empty() && !line.starts_with('#'))
                    .map(str::to_string),
            );
        }
        let keys = ApiKeys::new(all);
        if asked && keys.is_open() {
            return Err(AuthError::NoneUsable);
        }
        Ok(keys)
    }

    /// True when no key is configured: every request is accepted as [`ANONYMOUS`].
    pub fn is_open(&self) -> bool {
        self.keys.is_empty()
    }

    /// The number of distinct keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Same as [`ApiKeys::is_open`]: no keys.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Checks an `Authorization` header value (`Bearer <key>`, scheme case-insensitive).
    ///
    /// Returns the identity used for rate limiting: [`ANONYMOUS`] on an open server (whatever
    /// the header says), otherwise `key-<n>` for the n-th configured key (1-based).
    pub fn check(&self, authorization: Option<&str>) -> Result<String, AuthError> {
        if self.is_open() {
            return Ok(ANONYMOUS.to_string());
        }
        let presented = authorization
            .and_then(bearer_token)
            .ok_or(AuthError::Missing)?;
        // Compare against every key, without stopping at the first match.
        let mut found = None;
        for (i, key) in self.keys.iter().enumerate() {
            let equal = constant_time_eq(key.as_bytes(), presented.as_bytes());
            if equal && found.is_none() {
                found = Some(i);
            }
        }
        found
            .map(|i| format!("key-{}", i + 1))
            .ok_or(AuthError::Invalid)
    }
}

/// The key of a `Bearer <key>` header value; `None` for another scheme or an empty key.
fn bearer_token(header: &str) -> Option<&str> {
    let header = header.trim();
    let (scheme, rest) = header.split_once(char::is_whitespace)?;
    let token = rest.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Byte-string equality that looks at every byte of the longer input whatever the data, so
/// the time taken reveals at most the lengths, not where the inputs first differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= std::hint::black_box(x ^ y);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> ApiKeys {
        ApiKeys::new(list.iter().map(|k| k.to_string()))
    }

    #[test]
    fn open_server_accepts_anything_as_anonymous() {
        let open = keys(&["", "  "]);
        assert!(open.is_open());
        assert_eq!(open.len(), 0);
        assert_eq!(open.check(None).unwrap(), "anonymous");
        assert_eq!(open.check(Some("Bearer whatever")).unwrap(), "anonymous");
    }

    #[test]
    fn bearer_key_is_accepted_with_any_scheme_case() {
        let k = keys(&["sk-one", "sk-two"]);
        assert!(!k.is_open());
        assert_eq!(k.check(Some("Bearer sk-one")).unwrap(), "key-1");
        assert_eq!(k.check(Some("bearer sk-two")).unwrap(), "key-2");
        assert_eq!(k.check(Some("  BEARER   sk-two  ")).unwrap(), "key-2");
    }

    #[test]
    fn missing_or_malformed_header_is_missing() {
        let k = keys(&["sk-one"]);
        for header in [
            None,
            Some(""),
            Some("Bearer"),
            Some("Bearer   "),
            Some("Basic sk-one"),
        ] {
            assert!(
                matches!(k.check(header), Err(AuthError::Missing)),
                "{header:?}"
            );
        }
    }

    #[test]
    fn wrong_key_is_invalid_and_never_echoed() {
        let k = keys(&["sk-secret"]);
        for wrong in ["sk-secreT", "sk-secret2", "sk-secre", "x"] {
            let err = k.check(Some(&format!("Bearer {wrong}"))).unwrap_err();
            assert!(matches!(err, AuthError::Invalid));
            let message = err.to_string();
            assert!(message.starts_with("Incorrect API key provided"));
            assert!(!message.contains(wrong) && !message.contains("sk-secret"));
        }
        assert!(!format!("{k:?}").contains("sk-secret"));
    }

    #[test]
    fn new_trims_and_deduplicates() {
        let k = keys(&[" a ", "a", "", "b"]);
        assert_eq!(k.len(), 2);
        assert_eq!(k.check(Some("Bearer a")).unwrap(), "key-1");
        assert_eq!(k.check(Some("Bearer b")).unwrap(), "key-2");
    }

    #[test]
    fn keys_asked_for_and_none_usable_are_an_error_not_an_open_server() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.txt");
        std::fs::write(
            &path,
            "# only a comment

",
        )
        .unwrap();
        assert!(matches!(
            ApiKeys::load(&[" ".to_string()], None),
            Err(AuthError::NoneUsable)
        ));
        assert!(matches!(
            ApiKeys::load(&[], Some(&path)),
            Err(AuthError::NoneUsable)
        ));
        assert!(ApiKeys::load(&[], None).unwrap().is_open());
    }

    #[test]
    fn a_key_file_past_its_limit_is_refused_unread() {
        let err = ApiKeys::load(&[], Some(Path::new("/dev/zero"))).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.txt");
        let mut text = "sk-one\n".to_string();
        text.push_str(&"#".repeat(MAX_KEY_FILE_BYTES as usize - text.len()));
        std::fs::write(&path, &text).unwrap();
        assert_eq!(ApiKeys::load(&[], Some(&path)).unwrap().len(), 1);
        text.push('#');
        std::fs::write(&path, &text).unwrap();
        let err = ApiKeys::load(&[], Some(&path)).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
        // Cut in the middle of a character by the limit: still too large, not "invalid UTF-8".
        text.pop();
        text.push('é');
        std::fs::write(&path, &text).unwrap();
        let err = ApiKeys::load(&[], Some(&path)).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }

    #[test]
    fn load_merges_flags_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.txt");
        std::fs::write(
            &path,
            "# team keys\n\nsk-file-1\n  sk-file-2  \n#sk-commented\n",
        )
        .unwrap();
        let k = ApiKeys::load(&["sk-flag".to_string()], Some(&path)).unwrap();
        assert_eq!(k.len(), 3);
        assert_eq!(k.check(Some("Bearer sk-flag")).unwrap(), "key-1");
        assert_eq!(k.check(Some("Bearer sk-file-2")).unwrap(), "key-3");
        assert!(matches!(
            k.check(Some("Bearer #sk-commented")),
            Err(AuthError::Invalid)
        ));
    }

    #[test]
    fn load_reports_unreadable_file_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.txt");
        let err = ApiKeys::load(&[], Some(&path)).unwrap_err();
        assert!(matches!(&err, AuthError::File { path: p, .. } if p == &path));
        assert!(err.to_string().contains("absent.txt"));
    }

    #[test]
    fn constant_time_eq_is_plain_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab\0", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
