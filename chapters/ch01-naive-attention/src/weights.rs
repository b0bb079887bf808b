//! Safetensors checkpoints → f32 tensors.
//!
//! A checkpoint is either one `model.safetensors` or several shards listed in
//! `model.safetensors.index.json` (`weight_map`: tensor name → file). Every file is memory-mapped
//! and its header validated once, at [`Weights::open`]; a tensor is converted to f32 (from F32,
//! F16 or BF16) only when the model asks for it, and its shape is checked against what the
//! config implies.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use ndarray::{Array1, Array2};
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};

/// The tensors of one checkpoint directory. Invariant: every name in `location` maps to a file
/// in `files` whose header lists that name.
pub struct Weights {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    /// tensor name → index into `files`
    location: HashMap<String, usize>,
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl Weights {
    /// Opens `dir/model.safetensors`, or the shards named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let file_names: Vec<String> = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let index: ShardIndex =
                serde_json::from_str(&text).map_err(|e| Error::Safetensors {
                    path: index_path.clone(),
                    message: e.to_string(),
                })?;
            let mut names: Vec<String> = index.weight_map.into_values().collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec!["model.safetensors".to_string()]
        };

        let mut weights = Weights {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            location: HashMap::new(),
        };
        for name in file_names {
            weights.add_file(dir.join(name))?;
        }
        Ok(weights)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<()> {
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
        if len < 8 {
            return Err(Error::Safetensors {
                path,
                message: format!("file is {len} bytes, too short for a safetensors header"),
            });
        }
        // SAFETY: the map is read-only; kiln never writes a checkpoint while it is loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let tensors = SafeTensors::deserialize(&mmap).map_err(|e| Error::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let index = self.files.len();
        for name in tensors.names() {
            self.location.insert(name.to_string(), index);
        }
        drop(tensors);
        self.files.push((path, mmap));
        Ok(())
    }

    /// The directory the checkpoint came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the checkpoint holds a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// Tensor `name` as f32 values in row-major order, after checking that its shape is `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let &index = self
            .location
            .get(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                location: self.dir.clone(),
            })?;
        let (path, mmap) = &self.files[index];
        let tensors = SafeTensors::deserialize(mmap).map_err(|e| Error::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let view = tensors.tensor(name).map_err(|e| Error::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        if view.shape() != shape {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: view.shape().to_vec(),
            });
        }
        to_f32(name, view.dtype(), view.data())
    }

    /// A 1-D tensor of length `n`.
    pub fn vector(&self, name: &str, n: usize) -> Result<Array1<f32>> {
        Ok(Array1::from_vec(self.get(name, &[n])?))
    }

    /// A 2-D tensor `[rows, cols]` (Hugging Face linear weights are `[out_features, in_features]`).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Array2<f32>> {
        let data = self.get(name, &[rows, cols])?;
        Ok(Array2::from_shape_vec((rows, cols), data).expect("shape checked against the header"))
    }
}

/// Decodes little-endian F32/F16/BF16 bytes to f32 (the conversions are exact).
// ANCHOR: to_f32
fn to_f32(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let values = match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    };
    Ok(values)
}
// ANCHOR_END: to_f32
