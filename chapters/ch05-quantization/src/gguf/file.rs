//! The GGUF reader: a memory-mapped file, its metadata and its tensor directory.
//!
//! ```text
//! "GGUF" | version u32 (2 or 3) | tensor count u64 | metadata count u64
//! metadata × count:  key (u64 length + UTF-8) | value type u32 | value      (see value.rs)
//! tensor info × count: name (u64 length + UTF-8) | n_dims u32 (1..=4) | dims u64 × n_dims,
//!                      fastest-varying first | type id u32 | offset u64 into the data section
//! padding to `general.alignment` (default 32, a power of two)
//! data section: each tensor's bytes at its offset, a multiple of the alignment
//! ```
//!
//! Invariants once [`GgufFile::open`] has returned:
//! - every tensor's type is a known [`GgmlType`], its rows are whole blocks, its element and
//!   byte counts fit in `usize`, and its bytes lie inside the data section at an aligned offset;
//! - metadata keys and tensor names are unique;
//! - nothing was allocated for a count or length before checking that the bytes left in the
//!   file could hold it, so a hostile header costs memory proportional to the file's size (at
//!   most a few dozen bytes per byte of header), and no input makes the reader panic.
//!
//! Tensors are not copied: [`GgufFile::tensor_bytes`] borrows from the map. The bytes carry no
//! alignment guarantee beyond the file's (decode them with `from_le_bytes`).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::{GgufError, GgufResult};
use super::value::{GgufArray, GgufValue, GgufValueType};
use crate::format::GgmlType;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The data section's alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Tensors have at most this many dimensions (ggml's limit).
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays nest at most this deep (a bound on the reader's recursion).
pub const MAX_NESTING: usize = 8;

/// The fewest bytes one tensor info takes: name length, n_dims, one dim, type id, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// The fewest bytes one metadata entry takes: key length, value type, a one-byte value.
const MIN_METADATA_BYTES: u64 = 8 + 4 + 1;

/// One tensor of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Dimensions as stored: fastest-varying first (`[in_features, out_features]` for a linear
    /// weight). Use [`GgufTensorInfo::shape`] for the Hugging Face order.
    pub dims: Vec<u64>,
    /// Byte offset of the tensor's data inside the data section.
    pub offset: u64,
    /// Bytes of data: `rows × row_bytes(dims[0])`.
    pub size: usize,
}

impl GgufTensorInfo {
    /// Dimensions outermost first, as Hugging Face and ndarray list them (`dims` reversed):
    /// `[rows, cols]` for a matrix. Every dimension fits in `usize` (checked when reading).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Elements in one row (the fastest-varying dimension).
    pub fn row_len(&self) -> usize {
        self.dims.first().map_or(1, |&d| d as usize)
    }

    /// Rows: the product of every dimension but the first.
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).map(|&d| d as usize).product()
    }

    /// Elements in the whole tensor.
    pub fn n_elements(&self) -> usize {
        self.row_len() * self.n_rows()
    }

    /// Bytes of one row.
    /// Bytes of one row (checked when reading; 0 if the info did not come from the reader and
    /// the count overflows).
    pub fn row_bytes(&self) -> usize {
        (self.row_len() / self.ty.block_elems())
            .checked_mul(self.ty.block_bytes())
            .unwrap_or(0)
    }
}

/// The bytes of the file: a read-only memory map, or a buffer (tests, and empty files, which
/// cannot be mapped).
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. See the module docs for the invariants.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    version: u32,
    /// In file order.
    metadata: Vec<(String, GgufValue)>,
    /// key → index into `metadata`
    keys: HashMap<String, usize>,
    /// In file order.
    tensors: Vec<GgufTensorInfo>,
    /// name → index into `tensors`
    names: HashMap<String, usize>,
    alignment: u64,
    /// Byte offset of the data section in the file.
    data_offset: usize,
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> GgufResult<GgufFile> {
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        let len = file.metadata().map_err(|e| GgufError::io(path, e))?.len();
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and kiln never writes a GGUF file while it is mapped
            // (the writer writes a new file and renames it into place). Another process
            // truncating the file under us is outside what any mmap-based reader can defend.
            Storage::Mapped(unsafe { Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?)
        };
        GgufFile::parse(path.to_path_buf(), storage)
    }

    /// Parses a file held in memory; `path` only labels errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> GgufResult<GgufFile> {
        GgufFile::parse(path.into(), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> GgufResult<GgufFile> {
        let header = parse_header(&path, storage.bytes())?;
        Ok(GgufFile {
            path,
            storage,
            version: header.version,
            keys: index_of(&header.metadata, |(k, _)| k),
            metadata: header.metadata,
            names: index_of(&header.tensors, |t| &t.name),
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// 2 or 3: the same layout. (A big-endian file's version reads as a huge number and is
    /// refused as unsupported.)
    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    // ---------------------------------------------------------------------------------------
    // Metadata
    // ---------------------------------------------------------------------------------------

    /// Every key and value, in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.keys.contains_key(key)
    }

    /// `Ok(None)` when `key` is absent, an error naming it when its value is not what `convert`
    /// accepts.
    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        convert: impl FnOnce(&'s GgufValue) -> Option<T>,
    ) -> GgufResult<Option<T>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        convert(value)
            .map(Some)
            .ok_or_else(|| GgufError::WrongType {
                path: self.path.clone(),
                key: key.to_string(),
                expected: expected.to_string(),
                found: value.describe(),
            })
    }

    fn required<T>(&self, key: &str, value: GgufResult<Option<T>>) -> GgufResult<T> {
        value?.ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    /// Any integer type whose value fits u32.
    pub fn opt_u32(&self, key: &str) -> GgufResult<Option<u32>> {
        self.typed(key, "an integer that fits u32", |v| {
            v.as_u64().and_then(|v| u32::try_from(v).ok())
        })
    }

    pub fn get_u32(&self, key: &str) -> GgufResult<u32> {
        self.required(key, self.opt_u32(key))
    }

    /// Any integer type whose value is not negative.
    pub fn opt_u64(&self, key: &str) -> GgufResult<Option<u64>> {
        self.typed(key, "a non-negative integer", GgufValue::as_u64)
    }

    pub fn get_u64(&self, key: &str) -> GgufResult<u64> {
        self.required(key, self.opt_u64(key))
    }

    /// Any integer type whose value fits usize.
    pub fn opt_usize(&self, key: &str) -> GgufResult<Option<usize>> {
        self.typed(key, "an integer that fits usize", |v| {
            v.as_u64().and_then(|v| usize::try_from(v).ok())
        })
    }

    pub fn get_usize(&self, key: &str) -> GgufResult<usize> {
        self.required(key, self.opt_usize(key))
    }

    /// Any integer type whose value fits i64.
    pub fn opt_i64(&self, key: &str) -> GgufResult<Option<i64>> {
        self.typed(key, "an integer that fits i64", GgufValue::as_i64)
    }

    pub fn get_i64(&self, key: &str) -> GgufResult<i64> {
        self.required(key, self.opt_i64(key))
    }

    /// An f32 (or an f64, rounded to f32).
    pub fn opt_f32(&self, key: &str) -> GgufResult<Option<f32>> {
        self.typed(key, "a float", |v| v.as_f64().map(|v| v as f32))
    }

    pub fn get_f32(&self, key: &str) -> GgufResult<f32> {
        self.required(key, self.opt_f32(key))
    }

    /// An f64 or an f32 (widened exactly).
    pub fn opt_f64(&self, key: &str) -> GgufResult<Option<f64>> {
        self.typed(key, "a float", GgufValue::as_f64)
    }

    pub fn get_f64(&self, key: &str) -> GgufResult<f64> {
        self.required(key, self.opt_f64(key))
    }

    pub fn opt_bool(&self, key: &str) -> GgufResult<Option<bool>> {
        self.typed(key, "a bool", GgufValue::as_bool)
    }

    pub fn get_bool(&self, key: &str) -> GgufResult<bool> {
        self.required(key, self.opt_bool(key))
    }

    pub fn opt_str(&self, key: &str) -> GgufResult<Option<&str>> {
        self.typed(key, "a string", GgufValue::as_str)
    }

    pub fn get_str(&self, key: &str) -> GgufResult<&str> {
        self.required(key, self.opt_str(key))
    }

    pub fn opt_array(&self, key: &str) -> GgufResult<Option<&GgufArray>> {
        self.typed(key, "an array", GgufValue::as_array)
    }

    pub fn get_array(&self, key: &str) -> GgufResult<&GgufArray> {
        self.required(key, self.opt_array(key))
    }

    /// An array of strings.
    pub fn opt_str_array(&self, key: &str) -> GgufResult<Option<Vec<&str>>> {
        self.typed(key, "an array of strings", |v| {
            v.as_array()?
                .values()
                .iter()
                .map(GgufValue::as_str)
                .collect()
        })
    }

    pub fn get_str_array(&self, key: &str) -> GgufResult<Vec<&str>> {
        self.required(key, self.opt_str_array(key))
    }

    /// An array of f32 (or f64, rounded).
    pub fn opt_f32_array(&self, key: &str) -> GgufResult<Option<Vec<f32>>> {
        self.typed(key, "an array of floats", |v| {
            v.as_array()?
                .values()
                .iter()
                .map(|v| v.as_f64().map(|v| v as f32))
                .collect()
        })
    }

    pub fn get_f32_array(&self, key: &str) -> GgufResult<Vec<f32>> {
        self.required(key, self.opt_f32_array(key))
    }

    /// An array of integers that each fit i32.
    pub fn opt_i32_array(&self, key: &str) -> GgufResult<Option<Vec<i32>>> {
        self.typed(key, "an array of integers that fit i32", |v| {
            v.as_array()?
                .values()
                .iter()
                .map(|v| v.as_i64().and_then(|v| i32::try_from(v).ok()))
                .collect()
        })
    }

    pub fn get_i32_array(&self, key: &str) -> GgufResult<Vec<i32>> {
        self.required(key, self.opt_i32_array(key))
    }

    // ---------------------------------------------------------------------------------------
    // Tensors
    // ---------------------------------------------------------------------------------------

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The tensor named `name` (GGUF's own name: `blk.0.attn_q.weight`).
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor of this file's directory (`info.size` of them). An info from
    /// another file gets an empty slice if its range falls outside this one.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        let start = self.data_offset.saturating_add(info.offset as usize);
        let end = start.saturating_add(info.size);
        self.storage.bytes().get(start..end).unwrap_or_default()
    }

    /// The tensor named `name` and its bytes; a missing name is [`GgufError::MissingTensor`].
    pub fn tensor(&self, name: &str) -> GgufResult<(&GgufTensorInfo, &[u8])> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        Ok((info, self.tensor_bytes(info)))
    }
}

fn index_of<T>(items: &[T], key: impl Fn(&T) -> &String) -> HashMap<String, usize> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| (key(item).clone(), i))
        .collect()
}

// -------------------------------------------------------------------------------------------
// Parsing
// -------------------------------------------------------------------------------------------

struct Header {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_offset: usize,
}

fn parse_header(path: &Path, bytes: &[u8]) -> GgufResult<Header> {
    let mut r = Reader {
        path,
        bytes,
        pos: 0,
        elements: 0,
    };
    let magic = r.take(4, "the magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
            found: magic.to_vec(),
        });
    }
    let version = r.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let n_tensors = r.u64("the tensor count")?;
    let n_metadata = r.u64("the metadata count")?;
    // Every metadata entry and every tensor info takes at least a few bytes: refuse counts the
    // file cannot hold before reserving room for them.
    r.check_count("metadata count", n_metadata, MIN_METADATA_BYTES)?;
    r.check_count("tensor count", n_tensors, MIN_TENSOR_INFO_BYTES)?;

    let mut metadata = Vec::with_capacity(n_metadata as usize);
    let mut seen = HashMap::with_capacity(n_metadata as usize);
    for i in 0..n_metadata {
        let key = r.string(&format!("metadata key {i}"))?;
        let ty = r.value_type(&format!("metadata `{key}`"))?;
        let value = r.value(ty, &key, 0)?;
        if seen.insert(key.clone(), ()).is_some() {
            return Err(GgufError::DuplicateKey {
                path: path.to_path_buf(),
                key,
            });
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some((_, value)) => {
            let alignment = value.as_u64().ok_or_else(|| GgufError::WrongType {
                path: path.to_path_buf(),
                key: ALIGNMENT_KEY.to_string(),
                expected: "an unsigned integer".to_string(),
                found: value.describe(),
            })?;
            if !alignment.is_power_of_two() {
                return Err(GgufError::BadAlignment {
                    path: path.to_path_buf(),
                    alignment,
                });
            }
            alignment
        }
    };

    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(n_tensors as usize);
    let mut names = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let info = r.tensor_info(i)?;
        if names.insert(info.name.clone(), ()).is_some() {
            return Err(GgufError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: info.name,
            });
        }
        tensors.push(info);
    }

    // The data section starts at the header's end rounded up to the alignment.
    let data_offset = (r.pos as u64)
        .checked_next_multiple_of(alignment)
        .and_then(|o| usize::try_from(o).ok())
        .unwrap_or(usize::MAX);
    let data_len = bytes.len().saturating_sub(data_offset) as u64;
    for t in &tensors {
        if t.offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let size = t.size as u64;
        if t.offset.checked_add(size).is_none_or(|end| end > data_len) {
            return Err(GgufError::TensorOutOfBounds {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                offset: t.offset,
                size,
                data_len,
            });
        }
    }
    // Each tensor's bytes are its own: two whose data overlap would make one tensor's bytes
    // another's (llama.cpp refuses such files too).
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .filter(|t| t.size > 0)
        .map(|t| (t.offset, t.offset + t.size as u64, t.name.as_str()))
        .collect();
    spans.sort_unstable();
    if let Some(pair) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(GgufError::OverlappingTensors {
            path: path.to_path_buf(),
            first: pair[0].2.to_string(),
            second: pair[1].2.to_string(),
        });
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// Metadata array elements a file may hold in all: each is a [`GgufValue`] of 32 bytes in
/// memory, however few bytes it takes in the file (a `u8` takes one), so the file's size alone
/// does not bound them. A 256k-token vocabulary's tokens, scores and types are under 1M.
pub const MAX_METADATA_ELEMENTS: u64 = 1 << 24;

/// A cursor over the header bytes that never reads past the end.
struct Reader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
    /// Metadata array elements read so far (at most [`MAX_METADATA_ELEMENTS`]).
    elements: u64,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> GgufResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> GgufResult<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> GgufResult<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> GgufResult<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Errors unless `count` items of at least `min_bytes` each fit in what remains.
    fn check_count(&self, what: &str, count: u64, min_bytes: u64) -> GgufResult<()> {
        if count
            .checked_mul(min_bytes)
            .is_none_or(|n| n > self.remaining())
        {
            return Err(GgufError::CountTooLarge {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                count,
                offset: self.pos as u64,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> GgufResult<String> {
        let len = self.u64(&format!("the length of {what}"))?;
        self.check_count(&format!("length of {what}"), len, 1)?;
        let offset = self.pos as u64;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            path: self.path.to_path_buf(),
            what: what.to_string(),
            offset,
        })
    }

    fn value_type(&mut self, what: &str) -> GgufResult<GgufValueType> {
        let id = self.u32(&format!("the value type of {what}"))?;
        GgufValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            path: self.path.to_path_buf(),
            what: what.to_string(),
            id,
        })
    }

    /// One value of type `ty` for metadata `key`, inside `depth` enclosing arrays.
    fn value(&mut self, ty: GgufValueType, key: &str, depth: usize) -> GgufResult<GgufValue> {
        use GgufValueType as T;
        let what = || format!("metadata `{key}`");
        Ok(match ty {
            T::U8 => GgufValue::U8(u8::from_le_bytes(self.array(&what())?)),
            T::I8 => GgufValue::I8(i8::from_le_bytes(self.array(&what())?)),
            T::U16 => GgufValue::U16(u16::from_le_bytes(self.array(&what())?)),
            T::I16 => GgufValue::I16(i16::from_le_bytes(self.array(&what())?)),
            T::U32 => GgufValue::U32(u32::from_le_bytes(self.array(&what())?)),
            T::I32 => GgufValue::I32(i32::from_le_bytes(self.array(&what())?)),
            T::U64 => GgufValue::U64(u64::from_le_bytes(self.array(&what())?)),
            T::I64 => GgufValue::I64(i64::from_le_bytes(self.array(&what())?)),
            T::F32 => GgufValue::F32(f32::from_le_bytes(self.array(&what())?)),
            T::F64 => GgufValue::F64(f64::from_le_bytes(self.array(&what())?)),
            // Any non-zero byte reads as true, as llama.cpp's reader does.
            T::Bool => GgufValue::Bool(u8::from_le_bytes(self.array(&what())?) != 0),
            T::String => GgufValue::String(self.string(&what())?),
            T::Array => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::NestingTooDeep {
                        path: self.path.to_path_buf(),
                        key: key.to_string(),
                        max: MAX_NESTING,
                    });
                }
                let elem = self.value_type(&format!("the elements of {}", what()))?;
                let count = self.u64(&format!("the length of {}", what()))?;
                self.check_count(&format!("array `{key}`"), count, elem.min_bytes())?;
                self.elements = self.elements.saturating_add(count);
                if self.elements > MAX_METADATA_ELEMENTS {
                    return Err(GgufError::TooManyElements {
                        path: self.path.to_path_buf(),
                        key: key.to_string(),
                        max: MAX_METADATA_ELEMENTS,
                    });
                }
                let mut values = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    values.push(self.value(elem, key, depth + 1)?);
                }
                // Every element was read as `elem`: the array's invariant holds.
                GgufValue::Array(GgufArray::of_type(elem, values))
            }
        })
    }

    fn tensor_info(&mut self, index: u64) -> GgufResult<GgufTensorInfo> {
        let name = self.string(&format!("the name of tensor {index}"))?;
        let what = format!("tensor `{name}`");
        let n_dims = self.u32(&what)?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::BadDimensionCount {
                path: self.path.to_path_buf(),
                tensor: name,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&what)?);
        }
        let id = self.u32(&what)?;
        let offset = self.u64(&what)?;
        let Some(ty) = GgmlType::from_id(id) else {
            return Err(GgufError::UnknownTensorType {
                path: self.path.to_path_buf(),
                tensor: name,
                id,
            });
        };
        let overflow = || GgufError::ShapeOverflow {
            path: self.path.to_path_buf(),
            tensor: name.clone(),
            dims: dims.clone(),
        };
        // ggml stores dimensions as i64, and kiln indexes them with usize.
        let limit = usize::try_from(i64::MAX).unwrap_or(usize::MAX) as u64;
        // The product skips zero dimensions: an empty tensor's other dimensions still count
        // its rows, which must not overflow either.
        let elements = dims
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .filter(|&n| n <= limit)
            .map(|n| if dims.contains(&0) { 0 } else { n })
            .ok_or_else(overflow)?;
        let row_len = dims[0];
        let (block_elems, block_bytes) = (ty.block_elems() as u64, ty.block_bytes() as u64);
        if row_len % block_elems != 0 {
            return Err(GgufError::PartialBlock {
                path: self.path.to_path_buf(),
                tensor: name,
                ty,
                row_len,
            });
        }
        // Bytes: blocks per row × block bytes × rows, each product checked.
        let rows = elements.checked_div(row_len).unwrap_or(0);
        let size = (row_len / block_elems)
            .checked_mul(block_bytes)
            .and_then(|row_bytes| row_bytes.checked_mul(rows))
            .filter(|&s| s <= limit)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(overflow)?;
        Ok(GgufTensorInfo {
            name,
            ty,
            dims,
            offset,
            size,
        })
    }
}
