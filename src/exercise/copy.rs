//! The learner's copy of the repository: the sources, with the fixtures linked, not copied.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// What a copy holds: the workspace's manifests and sources (the book, CI and fixtures stay
/// in the reference; `fixtures/` is a link to it).
const COPIED: &[&str] = &[
    "Cargo.toml",
    "Cargo.lock",
    "chapters",
    "src",
    "tests",
    "kernels",
];

/// Files of the reference (relative paths) that a copy holds.
pub fn source_files(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for top in COPIED {
        collect(root, Path::new(top), &mut files)?;
    }
    Ok(files)
}

fn collect(root: &Path, rel: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    let path = root.join(rel);
    if path.is_file() {
        files.push(rel.to_path_buf());
    } else if path.is_dir() {
        for entry in std::fs::read_dir(&path).with_context(|| format!("{}", path.display()))? {
            let name = entry?.file_name();
            if name == "target" {
                continue;
            }
            collect(root, &rel.join(name), files)?;
        }
    }
    Ok(())
}

/// Writes `text` to `path` unless it already holds exactly that (an unchanged file keeps its
/// modification time, so cargo does not rebuild it).
pub fn write_if_changed(path: &Path, text: &str) -> Result<bool> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(true)
}

/// Makes `dest` a copy of the reference at `root`: the files it lacks are added (those in
/// `replaced` with that text instead of the reference's); with `refresh`, files that differ
/// are rewritten too. Returns the files added.
///
/// The copy shares the reference's build directory, and cargo names a workspace crate's
/// artifacts by its name, version and path relative to the workspace: the same for the copy's
/// crates as for the reference's. So the copy's workspace version gets the suffix `-tag`
/// ([`tag_version`]), and its crates build apart from the reference's, while the registry
/// dependencies, which are the same, are shared.
pub fn sync(
    root: &Path,
    dest: &Path,
    tag: &str,
    refresh: bool,
    replaced: &HashMap<PathBuf, String>,
) -> Result<Vec<PathBuf>> {
    let mut added = Vec::new();
    for rel in source_files(root)? {
        let target = dest.join(&rel);
        let exists = target.exists();
        if exists && !refresh {
            continue;
        }
        let bytes = match replaced.get(&rel) {
            Some(text) => text.as_bytes().to_vec(),
            None if rel == Path::new("Cargo.toml") => {
                tag_version(&std::fs::read_to_string(root.join(&rel))?, tag)?.into_bytes()
            }
            None => std::fs::read(root.join(&rel))?,
        };
        if !exists || std::fs::read(&target)? != bytes {
            std::fs::create_dir_all(target.parent().expect("a file has a parent"))?;
            std::fs::write(&target, bytes)?;
        }
        if !exists {
            added.push(rel);
        }
    }
    let fixtures = dest.join("fixtures");
    if std::fs::symlink_metadata(&fixtures).is_err() {
        let reference = std::fs::canonicalize(root.join("fixtures"))?;
        link_dir(&reference, &fixtures)?;
    }
    Ok(added)
}

/// What kiln itself wrote into a copy: `.kiln-copied` in the copy, a line `hash path` per file
/// as kiln last wrote it (FNV-1a of its bytes), and a line `todo N.k` per task whose body kiln
/// has made a `todo!` (handed to the learner). A file whose bytes still hash the same is
/// untouched since, even when the reference has moved on; a task handed out holds the
/// learner's body from then on, whatever it is.
pub struct Copied {
    path: PathBuf,
    hashes: HashMap<PathBuf, u64>,
    handed_out: BTreeSet<String>,
}

impl Copied {
    pub fn load(dest: &Path) -> Copied {
        let path = dest.join(".kiln-copied");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let mut hashes = HashMap::new();
        let mut handed_out = BTreeSet::new();
        for line in text.lines() {
            let Some((first, rest)) = line.split_once(' ') else {
                continue;
            };
            if first == TODO {
                handed_out.insert(rest.to_string());
            } else if let Ok(hash) = u64::from_str_radix(first, 16) {
                hashes.insert(PathBuf::from(rest), hash);
            }
        }
        Copied {
            path,
            hashes,
            handed_out,
        }
    }

    /// Records the files of `dest` named in `added` as they are now.
    pub fn record(&mut self, dest: &Path, added: &[PathBuf]) -> Result<()> {
        for rel in added {
            self.hashes
                .insert(rel.clone(), hash(&std::fs::read(dest.join(rel))?));
        }
        self.save()
    }

    /// Records that task `id`'s body was made a `todo!` by kiln: the learner's from now on.
    pub fn hand_out(&mut self, id: &str) -> Result<()> {
        if self.handed_out.insert(id.to_string()) {
            self.save()?;
        }
        Ok(())
    }

    /// Whether task `id`'s body was ever made a `todo!` by kiln in this copy.
    pub fn handed_out(&self, id: &str) -> bool {
        self.handed_out.contains(id)
    }

    fn save(&self) -> Result<()> {
        let mut lines: Vec<String> = self
            .hashes
            .iter()
            .map(|(rel, h)| format!("{h:016x} {}", rel.display()))
            .collect();
        lines.sort();
        lines.extend(self.handed_out.iter().map(|id| format!("{TODO} {id}")));
        write_if_changed(&self.path, &(lines.join("\n") + "\n"))?;
        Ok(())
    }

    /// Whether `text` is what file `rel` held when it was copied.
    pub fn untouched(&self, rel: &Path, text: &str) -> bool {
        self.hashes.get(rel) == Some(&hash(text.as_bytes()))
    }
}

/// The first word of a `.kiln-copied` line that names a task handed out (never a hash: not
/// hexadecimal).
const TODO: &str = "todo";

fn hash(bytes: &[u8]) -> u64 {
    ch03::block_manager::fnv1a_extend(ch03::block_manager::FNV_OFFSET, bytes)
}

#[cfg(unix)]
fn link_dir(from: &Path, to: &Path) -> Result<()> {
    std::os::unix::fs::symlink(from, to).with_context(|| format!("linking {}", to.display()))
}

#[cfg(not(unix))]
fn link_dir(from: &Path, to: &Path) -> Result<()> {
    anyhow::bail!(
        "linking {} to {} needs a Unix system",
        to.display(),
        from.display()
    )
}

/// The workspace manifest with `[workspace.package] version = "X"` as `"X-tag"`.
pub fn tag_version(manifest: &str, tag: &str) -> Result<String> {
    let section = manifest
        .find("[workspace.package]")
        .context("Cargo.toml has no [workspace.package]")?;
    let at = section
        + manifest[section..]
            .find("version = \"")
            .context("[workspace.package] has no version")?
        + "version = \"".len();
    let end = at + manifest[at..].find('"').context("unterminated version")?;
    Ok(format!("{}-{tag}{}", &manifest[..end], &manifest[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file is untouched while it holds what was recorded, whatever the reference holds
    /// now; the record survives a reload, and a later record of the same file replaces it.
    #[test]
    fn copied_files_are_untouched_until_their_bytes_change() {
        let dir = tempfile::tempdir().unwrap();
        let rel = PathBuf::from("src/a.rs");
        std::fs::create_dir_all(dir.path().join("src")).unwrap();
        std::fs::write(dir.path().join(&rel), "fn a() { 1 }").unwrap();
        let mut copied = Copied::load(dir.path());
        assert!(
            !copied.untouched(&rel, "fn a() { 1 }"),
            "nothing recorded yet"
        );
        copied
            .record(dir.path(), std::slice::from_ref(&rel))
            .unwrap();
        let copied = Copied::load(dir.path());
        assert!(copied.untouched(&rel, "fn a() { 1 }"));
        assert!(!copied.untouched(&rel, "fn a() { 2 }"));
        assert!(!copied.untouched(Path::new("src/b.rs"), "fn a() { 1 }"));
        std::fs::write(dir.path().join(&rel), "fn a() { todo!() }").unwrap();
        let mut copied = Copied::load(dir.path());
        copied
            .record(dir.path(), std::slice::from_ref(&rel))
            .unwrap();
        assert!(Copied::load(dir.path()).untouched(&rel, "fn a() { todo!() }"));
    }

    #[test]
    fn the_workspace_version_gets_the_tag_and_nothing_else_changes() {
        let manifest = "[package]\nversion = \"9.9.9\"\n[workspace.package]\nedition = \"2024\"\nversion = \"0.1.0\"\n[dependencies]\nx = { version = \"1.0\" }\n";
        assert_eq!(
            tag_version(manifest, "learner").unwrap(),
            manifest.replace("\"0.1.0\"", "\"0.1.0-learner\"")
        );
        assert!(tag_version("[package]\nversion = \"1\"\n", "t").is_err());
    }
}
