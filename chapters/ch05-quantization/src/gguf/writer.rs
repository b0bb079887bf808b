//! The GGUF writer (version 3): metadata and already-encoded tensors, laid out as the reader
//! expects them (see `file.rs` for the layout).
//!
//! Invariants of what [`GgufWriter`] writes: keys and tensor names are unique; every tensor's
//! bytes hold exactly its shape in its type (rows of whole blocks); the data section and every
//! tensor in it start at a multiple of the alignment (32, or `general.alignment` when the
//! metadata sets it), tensors in the order they were added, zero bytes between them.
//! [`GgufWriter::write`] writes a temporary file beside the target and renames it into place,
//! so a reader never sees a half-written file under the target's name.

use std::borrow::Cow;
use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use super::error::{GgufError, GgufResult};
use super::file::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use super::value::GgufValue;
use crate::format::GgmlType;

/// The version this writer writes.
pub const GGUF_VERSION: u32 = 3;

struct PendingTensor<'a> {
    name: String,
    ty: GgmlType,
    /// Fastest-varying first, as the file stores them.
    dims: Vec<u64>,
    bytes: Cow<'a, [u8]>,
}

/// Collects metadata and tensors, then writes them as one GGUF file. Tensor bytes may be
/// borrowed (from another file's map) for as long as the writer lives.
#[derive(Default)]
pub struct GgufWriter<'a> {
    metadata: Vec<(String, GgufValue)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor<'a>>,
    names: HashSet<String>,
    alignment: Option<u64>,
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        GgufWriter::default()
    }

    /// Adds `key`. A key added twice, or a `general.alignment` that is not a power-of-two
    /// integer, is an error. Arrays are written with their element type; nested arrays are
    /// allowed.
    pub fn add_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<GgufValue>,
    ) -> GgufResult<&mut Self> {
        let (key, value) = (key.into(), value.into());
        if key == ALIGNMENT_KEY {
            match value.as_u64() {
                Some(a) if a.is_power_of_two() => self.alignment = Some(a),
                _ => {
                    return Err(GgufError::Write(format!(
                        "{ALIGNMENT_KEY} must be a power-of-two integer, got {value:?}"
                    )));
                }
            }
        }
        if !self.keys.insert(key.clone()) {
            return Err(GgufError::Write(format!(
                "metadata key `{key}` added twice"
            )));
        }
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Adds tensor `name` of `shape` (outermost first, as Hugging Face lists it: `[out, in]`
    /// for a linear weight) whose `bytes` are already encoded in `ty`, row after row.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        shape: &[usize],
        bytes: impl Into<Cow<'a, [u8]>>,
    ) -> GgufResult<&mut Self> {
        let (name, bytes) = (name.into(), bytes.into());
        if shape.is_empty() || shape.len() > MAX_DIMS {
            return Err(GgufError::Write(format!(
                "tensor `{name}` has {} dimensions (1 to {MAX_DIMS} are allowed)",
                shape.len()
            )));
        }
        if ty.tensor_dtype().storage_bytes(shape) != Some(bytes.len()) {
            return Err(GgufError::Write(format!(
                "tensor `{name}`: {} bytes do not hold shape {shape:?} of {ty}",
                bytes.len()
            )));
        }
        if !self.names.insert(name.clone()) {
            return Err(GgufError::Write(format!("tensor `{name}` added twice")));
        }
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            bytes,
        });
        Ok(self)
    }

    /// The alignment of the data section and of every tensor in it.
    pub fn alignment(&self) -> u64 {
        self.alignment.unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Writes the whole file to `out`.
    pub fn write_to(&self, out: &mut impl Write) -> std::io::Result<()> {
        let align = self.alignment();
        let mut w = CountingWriter { out, written: 0 };
        w.put(&GGUF_MAGIC)?;
        w.put(&GGUF_VERSION.to_le_bytes())?;
        w.put(&(self.tensors.len() as u64).to_le_bytes())?;
        w.put(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in &self.metadata {
            w.string(key)?;
            w.put(&value.value_type().id().to_le_bytes())?;
            w.value(value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            w.string(&t.name)?;
            w.put(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                w.put(&d.to_le_bytes())?;
            }
            w.put(&t.ty.id().to_le_bytes())?;
            w.put(&offset.to_le_bytes())?;
            offset = (offset + t.bytes.len() as u64).next_multiple_of(align);
        }
        w.pad_to(align)?;
        let data_start = w.written;
        for t in &self.tensors {
            w.put(&t.bytes)?;
            // Pad to the next tensor's offset (the relative offsets were rounded the same way).
            let relative = w.written - data_start;
            w.zeros(relative.next_multiple_of(align) - relative)?;
        }
        w.out.flush()
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = self.write_to(&mut bytes);
        bytes
    }

    /// Writes the file to `path`: first to a temporary name in the same directory, then
    /// renamed over `path`.
    pub fn write(&self, path: &Path) -> GgufResult<()> {
        let file_name = path
            .file_name()
            .ok_or_else(|| GgufError::Write(format!("{} is not a file name", path.display())))?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(file_name);
        tmp_name.push(format!(".tmp{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let result = (|| {
            let file = std::fs::File::create(&tmp)?;
            let mut out = std::io::BufWriter::new(file);
            self.write_to(&mut out)?;
            out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        result.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            GgufError::io(path, e)
        })
    }
}

struct CountingWriter<'w, W: Write> {
    out: &'w mut W,
    written: u64,
}

impl<W: Write> CountingWriter<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn zeros(&mut self, n: u64) -> std::io::Result<()> {
        const ZEROS: [u8; 64] = [0; 64];
        let mut left = n;
        while left > 0 {
            let k = left.min(ZEROS.len() as u64);
            self.put(&ZEROS[..k as usize])?;
            left -= k;
        }
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> std::io::Result<()> {
        self.zeros(self.written.next_multiple_of(align) - self.written)
    }

    fn string(&mut self, s: &str) -> std::io::Result<()> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    fn value(&mut self, value: &GgufValue) -> std::io::Result<()> {
        use GgufValue as V;
        match value {
            V::U8(v) => self.put(&v.to_le_bytes()),
            V::I8(v) => self.put(&v.to_le_bytes()),
            V::U16(v) => self.put(&v.to_le_bytes()),
            V::I16(v) => self.put(&v.to_le_bytes()),
            V::U32(v) => self.put(&v.to_le_bytes()),
            V::I32(v) => self.put(&v.to_le_bytes()),
            V::U64(v) => self.put(&v.to_le_bytes()),
            V::I64(v) => self.put(&v.to_le_bytes()),
            V::F32(v) => self.put(&v.to_le_bytes()),
            V::F64(v) => self.put(&v.to_le_bytes()),
            V::Bool(v) => self.put(&[u8::from(*v)]),
            V::String(s) => self.string(s),
            V::Array(a) => {
                self.put(&a.elem().id().to_le_bytes())?;
                self.put(&(a.len() as u64).to_le_bytes())?;
                a.values().iter().try_for_each(|v| self.value(v))
            }
        }
    }
}
