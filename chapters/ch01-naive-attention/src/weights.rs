//! Safetensors checkpoints: the [`WeightSource`] of Hugging Face models.
//!
//! A checkpoint is either one `model.safetensors` or several shards listed in
//! `model.safetensors.index.json` (`weight_map`: tensor name → file). Every file is memory-mapped
//! and its header parsed and validated once, at [`Weights::open`], into each tensor's dtype,
//! shape and byte range: asking for a tensor is a lookup and a slice of the map, whatever the
//! size of the header. A tensor's bytes are only read when the model asks for it (borrowed
//! from the map, never copied), and the source's provided methods check its shape against what
//! the config implies before converting it to f32.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::source::{RawTensor, TensorDtype, WeightSource};

/// The tensors of one checkpoint directory. Invariant: every entry of `location` names a file
/// in `files` whose header lists that tensor with that dtype and shape, and its `bytes` lie
/// inside that file's map and hold exactly the shape in the dtype (safetensors validated the
/// header's offsets against the file's length).
pub struct Weights {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    /// tensor name → where it is
    location: HashMap<String, Entry>,
}

/// One tensor of the header, as parsed at open.
struct Entry {
    /// Index into `Weights::files`.
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the whole file (header included).
    bytes: std::ops::Range<usize>,
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
            // A shard is a file of the model's directory: not `/dev/zero`, nor `../elsewhere`.
            if let Some(name) = names.iter().find(|name| !is_inside(name)) {
                return Err(Error::Safetensors {
                    path: index_path,
                    message: format!(
                        "shard {name:?} is not a file name inside the model directory"
                    ),
                });
            }
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
        // Opening a named pipe would wait for a writer forever; a directory cannot be mapped.
        if !std::fs::metadata(&path)
            .map_err(|e| Error::io(&path, e))?
            .is_file()
        {
            return Err(Error::Safetensors {
                path,
                message: "not a regular file".into(),
            });
        }
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
        // What `SafeTensors::deserialize` checks, without keeping a borrow of the map.
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| Error::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let data_start = 8 + header_len;
        let file = self.files.len();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            let entry = Entry {
                file,
                dtype: info.dtype,
                shape: info.shape.clone(),
                bytes: data_start + start..data_start + end,
            };
            if let Some(earlier) = self.location.insert(name.clone(), entry) {
                return Err(Error::Safetensors {
                    path,
                    message: format!(
                        "tensor `{name}` is also in {}: which one is meant is unclear",
                        self.files[earlier.file].0.display()
                    ),
                });
            }
        }
        self.files.push((path, mmap));
        Ok(())
    }

    /// The directory the checkpoint came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Whether `name` names a path below the directory it is joined to: only plain components,
/// none of them `..`, and not absolute.
fn is_inside(name: &str) -> bool {
    let mut components = Path::new(name).components().peekable();
    components.peek().is_some() && components.all(|c| matches!(c, std::path::Component::Normal(_)))
}

impl WeightSource for Weights {
    fn location(&self) -> &Path {
        &self.dir
    }

    fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    fn tensor(&self, name: &str) -> Result<RawTensor<'_>> {
        let entry = self
            .location
            .get(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                location: self.dir.clone(),
            })?;
        let (path, mmap) = &self.files[entry.file];
        let dtype = tensor_dtype(entry.dtype).ok_or_else(|| Error::Safetensors {
            path: path.clone(),
            message: format!(
                "tensor `{name}` has dtype {:?}, whose elements are smaller than a byte",
                entry.dtype
            ),
        })?;
        let bytes = &mmap[entry.bytes.clone()];
        RawTensor::new(name, path, dtype, entry.shape.clone(), bytes)
    }
}

/// safetensors' dtype → ours; `None` for the sub-byte floats (F4, F6), which kiln cannot read.
fn tensor_dtype(dtype: Dtype) -> Option<TensorDtype> {
    Some(match dtype {
        Dtype::BOOL => TensorDtype::Bool,
        Dtype::U8 => TensorDtype::U8,
        Dtype::I8 => TensorDtype::I8,
        Dtype::F8_E4M3 => TensorDtype::F8E4M3,
        Dtype::F8_E5M2 => TensorDtype::F8E5M2,
        Dtype::F8_E8M0 => TensorDtype::F8E8M0,
        Dtype::I16 => TensorDtype::I16,
        Dtype::U16 => TensorDtype::U16,
        Dtype::F16 => TensorDtype::F16,
        Dtype::BF16 => TensorDtype::BF16,
        Dtype::I32 => TensorDtype::I32,
        Dtype::U32 => TensorDtype::U32,
        Dtype::F32 => TensorDtype::F32,
        Dtype::I64 => TensorDtype::I64,
        Dtype::U64 => TensorDtype::U64,
        Dtype::F64 => TensorDtype::F64,
        _ => return None,
    })
}
