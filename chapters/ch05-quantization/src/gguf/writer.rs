//! The GGUF writer (version 3): metadata and already-encoded tensors, laid out as the reader
//! expects them (see `file.rs` for the layout).
//!
//! Invariants of what [`GgufWriter`] writes: keys and tensor names are unique; every tensor's
//! bytes hold exactly its shape in its type (rows of whole blocks); the data section and every
//! tensor in it start at a multiple of the alignment (32, or `general.alignment` when the
//! metadata sets it), tensors in the order they were added, zero bytes between them.
//! [`GgufWriter::write`] writes a temporary file beside the target and links it into place,
//! so a reader never sees a half-written file under the target's name; it never replaces a
//! file (not even one created while it wrote): `kiln quantize --out` naming its own input, or
//! any other file, is refused (the rule of `ch01::new_dir` for model directories).

use std::borrow::Cow;
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

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
        // Every check before any change: a refused call leaves the writer as it was.
        if self.keys.contains(&key) {
            return Err(GgufError::Write(format!(
                "metadata key `{key}` added twice"
            )));
        }
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
        self.keys.insert(key.clone());
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

    /// Writes the new file `path`: first to a temporary name in the same directory, then
    /// linked to `path`. An existing `path` is an error of kind `AlreadyExists`, left as it was.
    pub fn write(&self, path: &Path) -> GgufResult<()> {
        let file_name = path
            .file_name()
            .ok_or_else(|| GgufError::Write(format!("{} is not a file name", path.display())))?;
        refuse_existing(path).map_err(|e| GgufError::io(path, e))?;
        let (file, tmp) = create_temporary(path, file_name).map_err(|e| GgufError::io(path, e))?;
        let result = (|| {
            let mut out = std::io::BufWriter::new(file);
            self.write_to(&mut out)?;
            out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            link_new(&tmp, path)
        })();
        result.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            GgufError::io(path, e)
        })
    }
}

/// Tries at the temporary file's name before giving up (see [`create_temporary`]).
const TEMPORARY_NAMES: u32 = 16;

/// A new, empty file beside `path` to write into, and its name: `.{file_name}.tmp{pid}`, or
/// that with `-1`, `-2`, ... when something is there already. The file is created only where
/// nothing is (`create_new`): a link planted at the name is not followed, as `File::create`
/// would (truncating its target and writing the model into it), and a file left there by an
/// earlier process with this id is neither written over nor removed.
fn create_temporary(
    path: &Path,
    file_name: &std::ffi::OsStr,
) -> std::io::Result<(std::fs::File, PathBuf)> {
    let pid = std::process::id();
    for n in 0..TEMPORARY_NAMES {
        let mut name = std::ffi::OsString::from(".");
        name.push(file_name);
        name.push(format!(".tmp{pid}"));
        if n > 0 {
            name.push(format!("-{n}"));
        }
        let tmp = path.with_file_name(name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(file) => return Ok((file, tmp)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        format!(
            "the temporary names .{}.tmp{pid} to -{} beside it are all taken: remove the ones \
             no process is writing",
            file_name.to_string_lossy(),
            TEMPORARY_NAMES - 1
        ),
    ))
}

/// An `AlreadyExists` error when anything (a file, a directory, a dangling link) is at `path`.
pub fn refuse_existing(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Err(already_exists()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn already_exists() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        "already exists: a GGUF file is written as a new file, never over another",
    )
}

/// Puts the finished `tmp` at `path` unless something is there: a hard link fails rather than
/// replace, atomically. Where links are not supported, a check then a rename (a file created
/// between the two would be replaced).
fn link_new(tmp: &Path, path: &Path) -> std::io::Result<()> {
    match std::fs::hard_link(tmp, path) {
        Ok(()) => {
            let _ = std::fs::remove_file(tmp); // the file is whole at `path` already
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(already_exists()),
        Err(_) => {
            refuse_existing(path)?;
            std::fs::rename(tmp, path)
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::file::GgufFile;
    use crate::gguf::value::{GgufArray, GgufValueType};

    /// One key of every value type, including empty and nested arrays.
    fn every_value() -> Vec<(String, GgufValue)> {
        let nested = GgufValue::Array(
            GgufArray::new(
                GgufValueType::Array,
                vec![
                    GgufValue::array([1u32, 2, 3]),
                    GgufValue::strings(["a", "bc"]),
                    GgufValue::array(Vec::<f64>::new()),
                ],
            )
            .unwrap(),
        );
        vec![
            ("u8".into(), GgufValue::U8(200)),
            ("i8".into(), GgufValue::I8(-100)),
            ("u16".into(), GgufValue::U16(60_000)),
            ("i16".into(), GgufValue::I16(-30_000)),
            ("u32".into(), GgufValue::U32(4_000_000_000)),
            ("i32".into(), GgufValue::I32(-2_000_000_000)),
            ("u64".into(), GgufValue::U64(u64::MAX)),
            ("i64".into(), GgufValue::I64(i64::MIN)),
            ("f32".into(), GgufValue::F32(-1.5e-7)),
            ("f64".into(), GgufValue::F64(std::f64::consts::PI)),
            ("bool.true".into(), GgufValue::Bool(true)),
            ("bool.false".into(), GgufValue::Bool(false)),
            ("string".into(), GgufValue::from("héllo ▁ 🦀")),
            ("string.empty".into(), GgufValue::from("")),
            ("array.i32".into(), GgufValue::array([-1i32, 0, 7])),
            ("array.bool".into(), GgufValue::array([true, false])),
            (
                "array.empty".into(),
                GgufValue::strings(Vec::<String>::new()),
            ),
            ("array.nested".into(), nested),
        ]
    }

    #[test]
    fn every_metadata_type_round_trips() {
        let mut w = GgufWriter::new();
        for (k, v) in every_value() {
            w.add_metadata(k, v).unwrap();
        }
        let file = GgufFile::from_bytes("mem.gguf", w.to_bytes()).unwrap();
        assert_eq!(file.version(), 3);
        assert_eq!(file.metadata(), &every_value()[..]);
        assert!(file.tensors().is_empty());
    }

    #[test]
    fn tensors_round_trip_aligned_with_their_bytes() {
        for alignment in [None, Some(64u32), Some(1)] {
            let mut w = GgufWriter::new();
            if let Some(a) = alignment {
                w.add_metadata(ALIGNMENT_KEY, a).unwrap();
            }
            w.add_metadata("general.architecture", "llama").unwrap();
            let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
            let q8: Vec<u8> = (0..2 * 34).map(|i| i as u8).collect();
            let one = vec![7u8; 2];
            w.add_tensor("a", GgmlType::F32, &[2, 3], f32s.clone())
                .unwrap();
            w.add_tensor("b", GgmlType::Q8_0, &[2, 32], q8.clone())
                .unwrap();
            w.add_tensor("c", GgmlType::F16, &[1, 1, 1, 1], one.clone())
                .unwrap();
            let file = GgufFile::from_bytes("mem.gguf", w.to_bytes()).unwrap();
            let align = u64::from(alignment.unwrap_or(32));
            assert_eq!(file.alignment(), align);
            assert_eq!(file.data_offset() as u64 % align, 0);
            let t: Vec<_> = file
                .tensors()
                .iter()
                .map(|t| (t.name.as_str(), t.ty, t.shape()))
                .collect();
            assert_eq!(
                t,
                [
                    ("a", GgmlType::F32, vec![2, 3]),
                    ("b", GgmlType::Q8_0, vec![2, 32]),
                    ("c", GgmlType::F16, vec![1, 1, 1, 1]),
                ]
            );
            assert_eq!(
                file.tensor_info("a").unwrap().dims,
                [3, 2],
                "stored fastest first"
            );
            for (name, bytes) in [("a", &f32s), ("b", &q8), ("c", &one)] {
                let (info, data) = file.tensor(name).unwrap();
                assert_eq!(data, &bytes[..], "{name}");
                assert_eq!(info.offset % align, 0);
            }
        }
    }

    #[test]
    fn write_puts_a_new_file_in_place_and_never_replaces_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let mut w = GgufWriter::new();
        w.add_metadata("k", 1u8).unwrap();
        w.write(&path).unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["m.gguf"], "no temporary file left behind");
        assert_eq!(GgufFile::open(&path).unwrap().get_u32("k").unwrap(), 1);
        let mut other = GgufWriter::new();
        other.add_metadata("k", 2u8).unwrap();
        let refused = other.write(&path).unwrap_err().to_string();
        assert!(refused.contains("already exists"), "{refused}");
        assert_eq!(GgufFile::open(&path).unwrap().get_u32("k").unwrap(), 1);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// Whatever is already at the temporary file's name (`.m.gguf.tmp<pid>`) is left as it is:
    /// a link there is not followed (`File::create` once truncated the link's target and wrote
    /// the model into it), a stale file is not overwritten; the writer takes another name.
    #[cfg(unix)]
    #[test]
    fn write_never_writes_through_what_is_at_its_temporary_name() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let pid = std::process::id();
        let link = dir.path().join(format!(".m.gguf.tmp{pid}"));
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let stale = dir.path().join(format!(".n.gguf.tmp{pid}"));
        std::fs::write(&stale, "stale").unwrap();
        let mut w = GgufWriter::new();
        w.add_metadata("k", 1u8).unwrap();
        for name in ["m.gguf", "n.gguf"] {
            let path = dir.path().join(name);
            w.write(&path).unwrap();
            assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
            assert_eq!(GgufFile::open(&path).unwrap().get_u32("k").unwrap(), 1);
        }
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(std::fs::read_to_string(&stale).unwrap(), "stale");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            5,
            "no temporary file of the writer's left behind"
        );
    }

    #[test]
    fn the_writer_refuses_what_it_cannot_write() {
        let mut w = GgufWriter::new();
        w.add_metadata("k", 1u8).unwrap();
        assert!(w.add_metadata("k", 2u8).is_err(), "duplicate key");
        assert!(
            w.add_metadata(ALIGNMENT_KEY, 48u32).is_err(),
            "alignment not a power of two"
        );
        assert!(
            w.add_tensor("t", GgmlType::F32, &[2], vec![0; 4]).is_err(),
            "too few bytes"
        );
        assert!(
            w.add_tensor("t", GgmlType::Q8_0, &[1, 33], vec![0; 34])
                .is_err(),
            "partial block"
        );
        assert!(
            w.add_tensor("t", GgmlType::F32, &[1; 5], vec![0; 4])
                .is_err(),
            "5 dims"
        );
        w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4]).unwrap();
        assert!(
            w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4]).is_err(),
            "duplicate tensor"
        );
        // A refused second alignment leaves the first in force, in the header and the offsets.
        let mut w = GgufWriter::new();
        w.add_metadata(ALIGNMENT_KEY, 32u32).unwrap();
        assert!(w.add_metadata(ALIGNMENT_KEY, 64u32).is_err());
        w.add_tensor("t", GgmlType::F32, &[3], vec![7; 12]).unwrap();
        let f = GgufFile::from_bytes("mem.gguf", w.to_bytes()).unwrap();
        assert_eq!(f.alignment(), 32);
        assert_eq!(f.tensor_bytes(&f.tensors()[0]), &[7; 12][..]);
    }

    #[test]
    fn typed_getters_accept_any_integer_that_fits_and_name_the_key() {
        let mut w = GgufWriter::new();
        w.add_metadata("small", 7u8).unwrap();
        w.add_metadata("negative", -1i32).unwrap();
        w.add_metadata("name", "x").unwrap();
        w.add_metadata("eps", 1e-5f32).unwrap();
        w.add_metadata("tokens", GgufValue::strings(["a", "b"]))
            .unwrap();
        let f = GgufFile::from_bytes("mem.gguf", w.to_bytes()).unwrap();
        assert_eq!(f.get_u32("small").unwrap(), 7);
        assert_eq!(f.get_u64("small").unwrap(), 7);
        assert_eq!(f.get_i64("negative").unwrap(), -1);
        assert_eq!(f.get_f32("eps").unwrap(), 1e-5);
        assert_eq!(f.get_f64("eps").unwrap(), f64::from(1e-5f32));
        assert_eq!(f.get_str_array("tokens").unwrap(), ["a", "b"]);
        assert_eq!(f.opt_u32("absent").unwrap(), None);
        let e = f.get_u32("negative").unwrap_err().to_string();
        assert!(e.contains("`negative`") && e.contains("I32"), "{e}");
        let e = f.get_str("absent").unwrap_err();
        assert!(
            matches!(e, GgufError::MissingKey { ref key, .. } if key == "absent"),
            "{e}"
        );
        assert!(matches!(
            f.get_str("small"),
            Err(GgufError::WrongType { .. })
        ));
    }
}
