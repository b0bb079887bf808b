//! Writing a model directory all at once: the files go into a sibling staging directory,
//! which takes the directory's place only once every file is written. A failure (a full disk,
//! a tensor the format cannot hold) leaves nothing behind, and the directory holds either a
//! whole checkpoint or nothing.

use std::path::{Path, PathBuf};

/// The staging directory of `out`: a hidden sibling, named for this process.
fn staging_for(out: &Path) -> PathBuf {
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("model");
    out.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

/// Creates the directory `out` (missing, or empty: the caller checked) with what `write` puts
/// into the directory it is given. `io` turns a filesystem error at a path into the caller's
/// error.
pub fn write_new_dir<E>(
    out: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
    io: impl Fn(&Path, std::io::Error) -> E,
) -> Result<(), E> {
    let staging = staging_for(out);
    let _ = std::fs::remove_dir_all(&staging); // a leftover of an earlier run of this process id
    let written = std::fs::create_dir_all(&staging)
        .map_err(|e| io(&staging, e))
        .and_then(|()| write(&staging))
        .and_then(|()| {
            if out.exists() {
                std::fs::remove_dir(out).map_err(|e| io(out, e))?;
            }
            std::fs::rename(&staging, out).map_err(|e| io(out, e))
        });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_nothing_and_a_good_one_the_whole_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model");
        let io = |path: &Path, e: std::io::Error| format!("{}: {e}", path.display());
        let failed = write_new_dir(
            &out,
            |dir| {
                std::fs::write(dir.join("config.json"), "{}").unwrap();
                Err("the disk is full".to_string())
            },
            io,
        );
        assert!(failed.is_err());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        std::fs::create_dir(&out).unwrap(); // an empty directory is replaced
        write_new_dir(
            &out,
            |dir| std::fs::write(dir.join("config.json"), "{}").map_err(|e| e.to_string()),
            io,
        )
        .unwrap();
        assert!(out.join("config.json").exists());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }
}
