//! Reading a text file whose size nobody promised: a file given on the command line or in a
//! server's configuration may as well be `/dev/zero` or a pipe that never ends, so it is read up
//! to a limit, and one byte more tells whether it was longer.

use std::io::Read;
use std::path::Path;

/// Why a text file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TextFileError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// It holds more than the limit; the rest was never read.
    #[error("it holds more than {most} bytes, the most a text file given here may")]
    TooLarge { most: u64 },
    #[error("it is not UTF-8 text")]
    NotUtf8(#[from] std::string::FromUtf8Error),
}

/// The UTF-8 text of `path` (a file, or a pipe such as `<(command)`), if it holds at most
/// `most` bytes; at most `most + 1` bytes are read whatever it holds.
pub fn read_text_up_to(path: &Path, most: u64) -> Result<String, TextFileError> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(most.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > most {
        return Err(TextFileError::TooLarge { most });
    }
    Ok(String::from_utf8(bytes)?)
}
