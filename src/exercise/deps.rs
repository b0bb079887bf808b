//! Which chapter crates a crate's tests can run code from: itself, its dependencies (its
//! dev-dependencies too) and theirs, read from the manifests. A task box tells the learner to
//! write an earlier task first only when the earlier task's code is among them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result};

/// The workspace's path dependencies, by crate directory (relative to the repository root).
pub struct Graph {
    /// Per crate: the crates it depends on directly, (`dev`) the ones its tests add.
    edges: BTreeMap<PathBuf, (BTreeSet<PathBuf>, BTreeSet<PathBuf>)>,
}

impl Graph {
    /// Reads the manifests of the crates in `dirs` (and of every path dependency they reach)
    /// under `root`; a workspace dependency's path comes from the root manifest.
    pub fn load(root: &Path, dirs: impl IntoIterator<Item = PathBuf>) -> Result<Graph> {
        let workspace = manifest(&root.join("Cargo.toml"))?;
        let shared = workspace
            .get("workspace")
            .and_then(|w| w.get("dependencies"))
            .and_then(toml::Value::as_table);
        let mut graph = Graph {
            edges: BTreeMap::new(),
        };
        let mut todo: Vec<PathBuf> = dirs.into_iter().collect();
        while let Some(dir) = todo.pop() {
            if graph.edges.contains_key(&dir) {
                continue;
            }
            let own = manifest(&root.join(&dir).join("Cargo.toml"))?;
            // The section at the top and in every `[target.'cfg(..)'.*]`.
            let targets = own.get("target").and_then(toml::Value::as_table);
            let mut tops = vec![&own];
            tops.extend(targets.into_iter().flat_map(|t| t.values()));
            let paths = |section: &str| -> BTreeSet<PathBuf> {
                tops.iter()
                    .filter_map(|top| top.get(section).and_then(toml::Value::as_table))
                    .flatten()
                    .filter_map(|(name, spec)| {
                        if let Some(path) = spec.get("path").and_then(toml::Value::as_str) {
                            return Some(normalise(&dir.join(path)));
                        }
                        let inherited = spec.get("workspace")?.as_bool()?;
                        let path = shared?.get(name)?.get("path")?.as_str()?;
                        inherited.then(|| normalise(Path::new(path)))
                    })
                    .collect()
            };
            let (normal, dev) = (paths("dependencies"), paths("dev-dependencies"));
            todo.extend(normal.iter().chain(&dev).cloned());
            graph.edges.insert(dir, (normal, dev));
        }
        Ok(graph)
    }

    /// The crates whose code the tests of crate `dir` can run: itself, its dependencies and
    /// dev-dependencies, and their dependencies in turn.
    pub fn reach(&self, dir: &Path) -> BTreeSet<PathBuf> {
        let mut seen = BTreeSet::from([dir.to_path_buf()]);
        let mut todo: Vec<&PathBuf> = match self.edges.get(dir) {
            Some((normal, dev)) => normal.iter().chain(dev).collect(),
            None => Vec::new(),
        };
        while let Some(next) = todo.pop() {
            if seen.insert(next.clone())
                && let Some((normal, _)) = self.edges.get(next)
            {
                todo.extend(normal);
            }
        }
        seen
    }

    /// The crate whose directory holds `file` (relative to the root), among those read: the
    /// deepest such directory, or `None` for a file outside them all (`kernels/`).
    pub fn owner(&self, file: &Path) -> Option<&Path> {
        self.edges
            .keys()
            .filter(|dir| file.starts_with(dir))
            .max_by_key(|dir| dir.components().count())
            .map(PathBuf::as_path)
    }
}

fn manifest(path: &Path) -> Result<toml::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("{}", path.display()))
}

/// `path` with `.` and `..` resolved textually (`chapters/ch08-x/../ch01-y` is `chapters/ch01-y`).
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}
