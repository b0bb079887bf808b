//! Writing a model directory, or one file, all at once: it is written under another name, which
//! takes its place only once everything is written. A failure (a full disk, a tensor the format
//! cannot hold) leaves nothing behind, and the directory holds either a whole checkpoint or
//! nothing; a reader of the file never sees half of it.

use std::path::Path;

/// Creates the directory `out` (missing, or empty; a directory with anything in it is an error
/// of kind `DirectoryNotEmpty`, anything else at `out` one of kind `AlreadyExists`) with what
/// `write` puts into the directory it is given. `io` turns a filesystem error at a path into
/// the caller's error.
///
/// A missing `out` is staged beside it (a hidden sibling named for this process) and renamed
/// into place. An existing one (a mount point, a directory with its own owner and mode) is
/// kept: the staging directory is a hidden one inside it, whose files move up at the end.
pub fn write_new_dir<E>(
    out: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
    io: impl Fn(&Path, std::io::Error) -> E,
) -> Result<(), E> {
    let existing = out.is_dir();
    if !existing && std::fs::symlink_metadata(out).is_ok() {
        let not_a_dir = std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "exists and is not a directory: a model directory is written into a new or empty one",
        );
        return Err(io(out, not_a_dir));
    }
    if existing
        && std::fs::read_dir(out)
            .map_err(|e| io(out, e))?
            .next()
            .is_some()
    {
        let not_empty = std::io::Error::new(
            std::io::ErrorKind::DirectoryNotEmpty,
            "is not empty: a model directory is written into a new or empty directory",
        );
        return Err(io(out, not_empty));
    }
    let partial = format!(".partial-{}", std::process::id());
    let staging = match existing {
        true => out.join(&partial),
        false => {
            let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("model");
            out.with_file_name(format!(".{name}{partial}"))
        }
    };
    let _ = std::fs::remove_dir_all(&staging); // a leftover of an earlier run of this process id
    let written = std::fs::create_dir_all(&staging)
        .map_err(|e| io(&staging, e))
        .and_then(|()| write(&staging))
        .and_then(|()| match existing {
            false => std::fs::rename(&staging, out).map_err(|e| io(out, e)),
            true => move_up(&staging, out).map_err(|e| io(out, e)),
        });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    written
}

/// Writes the file `path` with `bytes`: under a hidden name beside it (named for this
/// process), then renamed over it. What is, or links to, neither a file nor a directory (a
/// device such as `/dev/null`, `/dev/stdout`, a pipe) is written into and never replaced; a
/// directory, or a link to one, is an error of kind `IsADirectory`, left as it was.
pub fn write_new_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // `metadata` follows links: `/dev/stdout` is a link to the process's output.
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::IsADirectory,
                "is a directory, not a file",
            ));
        }
        Ok(meta) if !meta.is_file() => {
            let mut special = std::fs::OpenOptions::new().write(true).open(path)?;
            return std::io::Write::write_all(&mut special, bytes);
        }
        _ => {}
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let partial = path.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let written = std::fs::write(&partial, bytes).and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

/// Moves every entry of `staging` into `out` (its parent), then removes `staging`.
fn move_up(staging: &Path, out: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(staging)? {
        let entry = entry?;
        std::fs::rename(entry.path(), out.join(entry.file_name()))?;
    }
    std::fs::remove_dir(staging)
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
        let write_config =
            |dir: &Path| std::fs::write(dir.join("config.json"), "{}").map_err(|e| e.to_string());
        write_new_dir(&out, write_config, io).unwrap();
        assert!(out.join("config.json").exists());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        // An existing empty directory is kept (a mount point, say) and filled; a failure
        // leaves it empty.
        let kept = tmp.path().join("kept");
        std::fs::create_dir(&kept).unwrap();
        assert!(write_new_dir(&kept, |_| Err("no".to_string()), io).is_err());
        assert_eq!(std::fs::read_dir(&kept).unwrap().count(), 0);
        write_new_dir(&kept, write_config, io).unwrap();
        let names: Vec<_> = (std::fs::read_dir(&kept).unwrap())
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["config.json"]);
        // A directory with anything in it is refused, untouched.
        let refused = write_new_dir(&kept, write_config, io).unwrap_err();
        assert!(refused.contains("is not empty"), "{refused}");
        assert_eq!(std::fs::read(kept.join("config.json")).unwrap(), b"{}");
        // A file (or a device) is not written over, nor is anything written before saying so.
        let file = tmp.path().join("file");
        std::fs::write(&file, "mine").unwrap();
        let refused = write_new_dir(&file, |_| panic!("nothing is written"), io).unwrap_err();
        assert!(refused.contains("is not a directory"), "{refused}");
        assert_eq!(std::fs::read(&file).unwrap(), b"mine");
    }

    #[test]
    fn a_file_is_replaced_whole_a_directory_refused_and_a_device_written_into() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("logits.safetensors");
        write_new_file(&file, b"first").unwrap();
        write_new_file(&file, b"second").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"second");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        let refused = write_new_file(tmp.path(), b"x").unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::IsADirectory);
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        #[cfg(unix)]
        {
            let to_dir = tmp.path().join("to-dir");
            std::os::unix::fs::symlink(tmp.path(), &to_dir).unwrap();
            let refused = write_new_file(&to_dir, b"x").unwrap_err();
            assert_eq!(refused.kind(), std::io::ErrorKind::IsADirectory);
            assert!(std::fs::symlink_metadata(&to_dir).unwrap().is_symlink());
            std::fs::remove_file(&to_dir).unwrap();
        }
        // A pipe stands for `/dev/null` here, and a link to one for `/dev/stdout`: renamed
        // over, `/dev/null` would become a file of these bytes, read back by every later
        // reader of `/dev/null`.
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::FileTypeExt;
            let pipe = tmp.path().join("pipe");
            let made = std::process::Command::new("mkfifo")
                .arg(&pipe)
                .status()
                .unwrap();
            assert!(made.success());
            let link = tmp.path().join("link");
            std::os::unix::fs::symlink(&pipe, &link).unwrap();
            for path in [&pipe, &link] {
                // The reader reports through a channel: were the pipe replaced, its `open`
                // would wait for a writer forever, and the test fails on the timeout instead.
                let (sent, received) = std::sync::mpsc::channel();
                let pipe = pipe.clone();
                std::thread::spawn(move || sent.send(std::fs::read(pipe).unwrap()));
                write_new_file(path, b"logits").unwrap();
                let kind = std::fs::metadata(path).unwrap().file_type();
                assert!(kind.is_fifo(), "{} now leads to {kind:?}", path.display());
                let read = received.recv_timeout(std::time::Duration::from_secs(30));
                assert_eq!(read.unwrap(), b"logits");
            }
            assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        }
    }
}
