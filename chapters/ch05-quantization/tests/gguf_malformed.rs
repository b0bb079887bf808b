//! Malformed GGUF files: each way a header can be wrong gives its own typed error naming the
//! file and what is wrong; random byte flips and truncations of a small valid file never panic,
//! and parsing never allocates more than a small multiple of the file's size.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ch01::WeightSource;
use ch01::testing::seeded_config;
use ch05_quantization::GgmlType;
use ch05_quantization::gguf::tokenizer::load_tokenizer;
use ch05_quantization::gguf::{
    GgufArray, GgufError, GgufFile, GgufHostSide, GgufSource, GgufValue, GgufValueType, GgufWriter,
    llama_config,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Counting this thread's allocations, to bound what a hostile header can make the reader reserve
// ---------------------------------------------------------------------------------------------

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the counters are thread-local cells that do not
// allocate (const-initialised), and are skipped once the thread's locals are gone.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|live| {
            let now = live.get() + layout.size();
            live.set(now);
            let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
        });
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(layout.size())));
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result and the most bytes it had allocated at once (this thread).
fn peak_bytes<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get) - base)
}

// ---------------------------------------------------------------------------------------------
// Hand-built headers
// ---------------------------------------------------------------------------------------------

/// Little-endian header bytes, built field by field.
#[derive(Clone)]
struct Bytes(Vec<u8>);

impl Bytes {
    /// Magic, `version`, and the two counts.
    fn header(version: u32, n_tensors: u64, n_metadata: u64) -> Bytes {
        Bytes(b"GGUF".to_vec())
            .u32(version)
            .u64(n_tensors)
            .u64(n_metadata)
    }
    fn u32(mut self, v: u32) -> Bytes {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Bytes {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn raw(mut self, b: &[u8]) -> Bytes {
        self.0.extend(b);
        self
    }
    fn str(self, s: &str) -> Bytes {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    fn kv_u32(self, key: &str, v: u32) -> Bytes {
        self.str(key).u32(GgufValueType::U32.id()).u32(v)
    }
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Bytes {
        let mut b = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            b = b.u64(d);
        }
        b.u32(ty).u64(offset)
    }
    /// Zero padding to `align`, then `n` data bytes.
    fn data(mut self, align: usize, n: usize) -> Bytes {
        let len = self.0.len().next_multiple_of(align) + n;
        self.0.resize(len, 0);
        self
    }
    fn parse(&self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes("bad.gguf", self.0.clone())
    }
    fn err(&self) -> GgufError {
        match self.parse() {
            Ok(_) => panic!("a malformed file parsed"),
            Err(e) => {
                assert!(e.to_string().starts_with("bad.gguf: "), "{e}");
                e
            }
        }
    }
}

fn f32_tensor(name: &str, dims: &[u64], offset: u64) -> Bytes {
    Bytes::header(3, 1, 0).tensor(name, dims, GgmlType::F32.id(), offset)
}

#[test]
fn a_valid_hand_built_file_parses() {
    let file = f32_tensor("t", &[4, 2], 0).data(32, 32).parse().unwrap();
    assert_eq!(file.tensors()[0].shape(), [2, 4]);
    let v2 = Bytes::header(2, 0, 1).kv_u32("k", 5).parse().unwrap();
    assert_eq!((v2.version(), v2.get_u32("k").unwrap()), (2, 5));
}

#[test]
fn truncated_files() {
    for len in [0, 3, 7, 15, 23] {
        let b = Bytes(Bytes::header(3, 0, 0).0[..len].to_vec());
        assert!(
            matches!(b.err(), GgufError::Truncated { .. }),
            "length {len}"
        );
    }
    let full = Bytes::header(3, 1, 1)
        .kv_u32("key", 1)
        .tensor("t", &[8], 0, 0);
    for len in 24..full.0.len() {
        let e = Bytes(full.0[..len].to_vec()).err();
        assert!(
            matches!(
                e,
                GgufError::Truncated { .. } | GgufError::CountTooLarge { .. }
            ),
            "length {len}: {e}"
        );
    }
}

#[test]
fn bad_magic_and_versions() {
    let mut b = Bytes::header(3, 0, 0);
    b.0[..4].copy_from_slice(b"GGML");
    assert!(matches!(b.err(), GgufError::BadMagic { found, .. } if found == b"GGML"));
    for version in [0, 1, 4, u32::MAX] {
        let e = Bytes::header(version, 0, 0).err();
        assert!(matches!(e, GgufError::UnsupportedVersion { version: v, .. } if v == version));
    }
}

#[test]
fn absurd_counts_are_refused_before_allocating() {
    for (n_tensors, n_metadata) in [(u64::MAX, 0), (0, u64::MAX), (1 << 40, 0), (0, 1 << 40)] {
        let b = Bytes::header(3, n_tensors, n_metadata);
        let (e, peak) = peak_bytes(|| b.err());
        assert!(matches!(e, GgufError::CountTooLarge { .. }), "{e}");
        assert!(peak < 4096, "{peak} bytes allocated for a refused count");
    }
    // A string length, an array length, and an array length whose byte count overflows u64.
    let key = Bytes::header(3, 0, 1).u64(u64::MAX - 3);
    let string = Bytes::header(3, 0, 1)
        .str("k")
        .u32(GgufValueType::String.id())
        .u64(1 << 50);
    let array = |elem: GgufValueType, n: u64| {
        Bytes::header(3, 0, 1)
            .str("k")
            .u32(GgufValueType::Array.id())
            .u32(elem.id())
            .u64(n)
    };
    let name = Bytes::header(3, 1, 0).u64(1 << 62);
    for b in [
        key,
        string,
        array(GgufValueType::U8, 1 << 40),
        array(GgufValueType::U64, u64::MAX / 4),
        array(GgufValueType::Array, u64::MAX),
        name,
    ] {
        let (e, peak) = peak_bytes(|| b.err());
        assert!(matches!(e, GgufError::CountTooLarge { .. }), "{e}");
        assert!(peak < 4096, "{peak} bytes allocated for a refused length");
    }
}

/// Metadata arrays whose elements the file holds (one byte each) but whose decoded values would
/// take 32 times the file's bytes: refused past `MAX_METADATA_ELEMENTS` in all, before a large
/// allocation; one element fewer parses.
#[test]
fn too_many_metadata_elements_are_refused_before_allocating() {
    let max = ch05_quantization::gguf::file::MAX_METADATA_ELEMENTS;
    let arrays = |counts: &[u64]| {
        let mut b = Bytes::header(3, 0, counts.len() as u64);
        for (i, &n) in counts.iter().enumerate() {
            b = b
                .str(&format!("k{i}"))
                .u32(GgufValueType::Array.id())
                .u32(GgufValueType::U8.id())
                .u64(n)
                .raw(&vec![7u8; n as usize]);
        }
        b
    };
    for counts in [&[max + 1][..], &[max / 2, max / 2 + 1]] {
        let b = arrays(counts);
        let (e, peak) = peak_bytes(|| b.err());
        assert!(matches!(e, GgufError::TooManyElements { .. }), "{e}");
        // The copy of the file `err` parses, and the decoded elements of a first array that
        // stays within the bound.
        let first = if counts.len() > 1 { counts[0] * 32 } else { 0 } as usize;
        assert!(
            peak <= b.0.len() + first + (1 << 20),
            "{peak} bytes allocated"
        );
    }
    assert!(arrays(&[max / 2, max / 2]).parse().is_ok());
}

#[test]
fn bad_metadata() {
    let b = Bytes::header(3, 0, 1).str("k").u32(13).u32(0);
    assert!(matches!(
        b.err(),
        GgufError::UnknownValueType { id: 13, .. }
    ));
    let b = Bytes::header(3, 0, 1)
        .str("k")
        .u32(GgufValueType::Array.id())
        .u32(99)
        .u64(0);
    assert!(matches!(
        b.err(),
        GgufError::UnknownValueType { id: 99, .. }
    ));

    // An array of one array of one array ...: each level is an element type and a count.
    let mut deep = Bytes::header(3, 0, 1)
        .str("deep")
        .u32(GgufValueType::Array.id());
    for _ in 0..20 {
        deep = deep.u32(GgufValueType::Array.id()).u64(1);
    }
    assert!(matches!(deep.err(), GgufError::NestingTooDeep { key, .. } if key == "deep"));

    let b = Bytes::header(3, 0, 1)
        .u64(2)
        .raw(&[0xff, 0xfe])
        .u32(0)
        .raw(&[0]);
    assert!(matches!(b.err(), GgufError::InvalidUtf8 { .. }));
    let b = Bytes::header(3, 0, 1)
        .str("k")
        .u32(GgufValueType::String.id())
        .u64(1)
        .raw(&[0x80]);
    assert!(matches!(b.err(), GgufError::InvalidUtf8 { .. }));

    let b = Bytes::header(3, 0, 2).kv_u32("k", 1).kv_u32("k", 2);
    assert!(matches!(b.err(), GgufError::DuplicateKey { key, .. } if key == "k"));

    for alignment in [0, 3, 48] {
        let b = Bytes::header(3, 0, 1).kv_u32("general.alignment", alignment);
        assert!(
            matches!(b.err(), GgufError::BadAlignment { alignment: a, .. } if a == u64::from(alignment))
        );
    }
    let b = Bytes::header(3, 0, 1)
        .str("general.alignment")
        .u32(GgufValueType::String.id())
        .str("32");
    assert!(matches!(b.err(), GgufError::WrongType { key, .. } if key == "general.alignment"));
    let ok = Bytes::header(3, 0, 1)
        .kv_u32("general.alignment", 64)
        .parse()
        .unwrap();
    assert_eq!(ok.alignment(), 64);
}

#[test]
fn bad_tensor_infos() {
    for n_dims in [0u32, 5, u32::MAX] {
        let b = Bytes::header(3, 1, 0)
            .str("t")
            .u32(n_dims)
            .u64(1)
            .u64(1)
            .u64(1)
            .u64(1)
            .u64(1);
        assert!(matches!(b.err(), GgufError::BadDimensionCount { n_dims: n, .. } if n == n_dims));
    }
    for id in [4u32, 5, 16, 31, 1000] {
        let b = Bytes::header(3, 1, 0)
            .tensor("w", &[32], id, 0)
            .data(32, 128);
        let e = b.err();
        assert!(
            matches!(&e, GgufError::UnknownTensorType { tensor, id: i, .. } if tensor == "w" && *i == id),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains(&format!("`w` has unknown type id {id}")),
            "{e}"
        );
    }
    for dims in [
        &[u64::MAX, 2][..],
        &[1 << 32, 1 << 32],
        &[1 << 62, 4],
        &[1 << 63],
    ] {
        let e = f32_tensor("t", dims, 0).err();
        assert!(
            matches!(e, GgufError::ShapeOverflow { .. }),
            "{dims:?}: {e}"
        );
    }
    let b = Bytes::header(3, 1, 0)
        .tensor("q", &[33, 2], GgmlType::Q8_0.id(), 0)
        .data(32, 68);
    assert!(
        matches!(b.err(), GgufError::PartialBlock { tensor, row_len: 33, .. } if tensor == "q")
    );

    let e = f32_tensor("t", &[8], 32).data(32, 32).err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    let e = f32_tensor("t", &[9], 0).data(32, 32).err();
    assert!(
        matches!(e, GgufError::TensorOutOfBounds { .. }),
        "one element short: {e}"
    );
    let e = f32_tensor("t", &[1 << 40, 1 << 20], 0).data(32, 32).err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    let e = f32_tensor("t", &[1], u64::MAX - 31).data(32, 32).err();
    assert!(
        matches!(e, GgufError::TensorOutOfBounds { .. }),
        "offset + size overflows: {e}"
    );
    let e = f32_tensor("t", &[1], 16).data(32, 64).err();
    assert!(
        matches!(
            e,
            GgufError::MisalignedTensor {
                offset: 16,
                alignment: 32,
                ..
            }
        ),
        "{e}"
    );

    let b = Bytes::header(3, 2, 0)
        .tensor("t", &[8], 0, 0)
        .tensor("t", &[8], 0, 32)
        .data(32, 64);
    assert!(matches!(b.err(), GgufError::DuplicateTensor { tensor, .. } if tensor == "t"));

    // Two tensors' data may not overlap, wholly or in part; side by side they parse.
    let f32 = GgmlType::F32.id();
    for (a, b_at) in [((8, 0), 0), ((16, 0), 32)] {
        let b = Bytes::header(3, 2, 0)
            .tensor("a", &[a.0], f32, a.1)
            .tensor("b", &[8], f32, b_at)
            .data(32, 96);
        assert!(
            matches!(b.err(), GgufError::OverlappingTensors { first, second, .. }
                if first == "a" && second == "b"),
            "a {a:?}, b at {b_at}"
        );
    }
    let b = Bytes::header(3, 2, 0)
        .tensor("a", &[8], f32, 0)
        .tensor("b", &[8], f32, 32)
        .data(32, 64);
    assert!(b.parse().is_ok());
}

// ---------------------------------------------------------------------------------------------
// Random corruption of a valid file
// ---------------------------------------------------------------------------------------------

/// The config keys of a one-layer llama of width 32, and a GPT-2-style tokenizer's model key.
fn tiny_llama(w: &mut GgufWriter) {
    w.add_metadata("general.architecture", "llama").unwrap();
    for (k, v) in [
        ("block_count", 1u32),
        ("context_length", 16),
        ("embedding_length", 32),
        ("feed_forward_length", 32),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 1),
    ] {
        w.add_metadata(format!("llama.{k}"), v).unwrap();
    }
    w.add_metadata("llama.attention.layer_norm_rms_epsilon", 1e-5f32)
        .unwrap();
    w.add_metadata("tokenizer.ggml.model", "gpt2").unwrap();
}

/// `tiny_llama`'s config keys and a tokenizer of three tokens ("a", "b", "ab").
fn tiny_llama_with_tokens(w: &mut GgufWriter) {
    tiny_llama(w);
    w.add_metadata(
        "tokenizer.ggml.tokens",
        GgufValue::strings(["a", "b", "ab"]),
    )
    .unwrap();
}

/// A small valid model file: config keys, a two-token tokenizer, nested arrays, three tensors.
fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    tiny_llama_with_tokens(&mut w);
    w.add_metadata("tokenizer.ggml.token_type", GgufValue::array([1i32, 1, 1]))
        .unwrap();
    w.add_metadata("tokenizer.ggml.merges", GgufValue::strings(["a b"]))
        .unwrap();
    w.add_metadata("tokenizer.ggml.eos_token_id", 2u32).unwrap();
    let nested = GgufArray::new(GgufValueType::Array, vec![GgufValue::array([1u16, 2])]).unwrap();
    w.add_metadata("nested", nested).unwrap();
    w.add_tensor(
        "token_embd.weight",
        GgmlType::Q8_0,
        &[3, 32],
        vec![1u8; 3 * 34],
    )
    .unwrap();
    w.add_tensor(
        "blk.0.attn_k.weight",
        GgmlType::F16,
        &[16, 32],
        vec![0u8; 16 * 64],
    )
    .unwrap();
    w.add_tensor("output_norm.weight", GgmlType::F32, &[32], vec![0u8; 128])
        .unwrap();
    w.to_bytes()
}

/// Parses `bytes` and, when that succeeds, uses everything built on it; any error is fine.
fn exercise(bytes: Vec<u8>) {
    let len = bytes.len();
    let (_, peak) = peak_bytes(|| {
        let Ok(file) = GgufFile::from_bytes("fuzz.gguf", bytes) else {
            return;
        };
        for t in file.tensors() {
            assert_eq!(file.tensor_bytes(t).len(), t.size);
        }
        let _ = llama_config(&file);
        let _ = load_tokenizer(&file);
        if let Ok(source) = GgufSource::new(file) {
            for name in [
                "model.embed_tokens.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.norm.weight",
            ] {
                if let Ok(raw) = source.tensor(name) {
                    let _ = source.get(name, raw.shape());
                }
            }
        }
    });
    // The tokenizer and the decoded tensors are small here; what is bounded is the reader's
    // reservations for counts and lengths.
    assert!(
        peak < 64 * len + (1 << 20),
        "{peak} bytes for a {len}-byte file"
    );
}

#[test]
fn the_valid_fuzz_seed_loads() {
    let file = GgufFile::from_bytes("seed.gguf", valid_file()).unwrap();
    llama_config(&file).unwrap();
    let t = load_tokenizer(&file).unwrap();
    assert_eq!(t.encode("ab", false).unwrap(), [2]);
    let source = GgufSource::new(file).unwrap();
    source.get("model.embed_tokens.weight", &[3, 32]).unwrap();
}

proptest! {
    #![proptest_config(seeded_config(2048, 0x6767_7566))]

    #[test]
    fn flipped_bytes_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..12)) {
        let mut bytes = valid_file();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        exercise(bytes);
    }

    #[test]
    fn extreme_words_never_panic(at in any::<prop::sample::Index>(), word in prop::sample::select(vec![
        u64::MAX, u64::MAX / 2, 1 << 32, 1 << 40, u32::MAX as u64, 0, 1, 4, 9, 13,
    ])) {
        let mut bytes = valid_file();
        let i = at.index(bytes.len() - 8);
        bytes[i..i + 8].copy_from_slice(&word.to_le_bytes());
        exercise(bytes);
    }

    #[test]
    fn truncations_never_panic(at in any::<prop::sample::Index>()) {
        let mut bytes = valid_file();
        bytes.truncate(at.index(bytes.len()));
        exercise(bytes);
    }
}

/// A zero dimension is a valid, empty tensor (found by `extreme_words_never_panic`).
#[test]
fn zero_sized_tensors_decode_to_nothing() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.attention.head_count", 1u32).unwrap();
    w.add_tensor("output_norm.weight", GgmlType::F32, &[0], Vec::new())
        .unwrap();
    w.add_tensor("token_embd.weight", GgmlType::Q8_0, &[0, 32], Vec::new())
        .unwrap();
    let source = GgufSource::new(GgufFile::from_bytes("zero.gguf", w.to_bytes()).unwrap()).unwrap();
    assert_eq!(
        source.get("model.norm.weight", &[0]).unwrap(),
        Vec::<f32>::new()
    );
    assert_eq!(
        source
            .matrix("model.embed_tokens.weight", 0, 32)
            .unwrap()
            .len(),
        0
    );
    // A row too long to count in bytes overflows even when there are no rows (found by
    // `flipped_bytes_never_panic`: the byte count used to overflow unchecked).
    let e = f32_tensor("t", &[1 << 62, 0], 0).err();
    assert!(matches!(e, GgufError::ShapeOverflow { .. }), "{e}");
    let e = f32_tensor("t", &[1 << 62, 1], 0).err();
    assert!(matches!(e, GgufError::ShapeOverflow { .. }), "{e}");
    // Nor may an empty tensor's rows overflow their count.
    let e = f32_tensor("t", &[0, 1 << 32, 1 << 32], 0).err();
    assert!(matches!(e, GgufError::ShapeOverflow { .. }), "{e}");
    // An empty q projection of 2^40 rows (a llama file's rows are reordered per head) costs no
    // memory for its rows: there is nothing to reorder.
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.attention.head_count", 1u32).unwrap();
    w.add_metadata("llama.attention.head_count_kv", 1u32)
        .unwrap();
    w.add_tensor(
        "blk.0.attn_k.weight",
        GgmlType::F32,
        &[1 << 40, 0],
        Vec::new(),
    )
    .unwrap();
    let source =
        GgufSource::new(GgufFile::from_bytes("empty.gguf", w.to_bytes()).unwrap()).unwrap();
    let (tensor, peak) = peak_bytes(|| {
        source
            .tensor("model.layers.0.self_attn.k_proj.weight")
            .map(|t| t.bytes().len())
    });
    assert_eq!(tensor.unwrap(), 0);
    assert!(peak < 1 << 20, "{peak} bytes");
}

/// A stop token (EOS, EOT, or a token whose text ends generation) or a BOS that the model has
/// no embedding row for is refused at load, naming the file and the id: the tokenizer's list
/// may be longer than the embedding (llama.cpp refuses such a file too), and the server's
/// grammar engine once panicked on a stop id past the vocabulary.
#[test]
fn special_tokens_outside_the_embedding_are_refused() {
    let file = |rows: usize, bos: Option<u32>| {
        let mut w = GgufWriter::new();
        tiny_llama(&mut w);
        let tokens = GgufValue::strings(["a", "b", "ab", "<|im_end|>", "<s>"]);
        w.add_metadata("tokenizer.ggml.tokens", tokens).unwrap();
        let types = GgufValue::array([1i32, 1, 1, 3, 3]);
        w.add_metadata("tokenizer.ggml.token_type", types).unwrap();
        w.add_metadata("tokenizer.ggml.merges", GgufValue::strings(["a b"]))
            .unwrap();
        w.add_metadata("tokenizer.ggml.eos_token_id", 2u32).unwrap();
        if let Some(bos) = bos {
            w.add_metadata("tokenizer.ggml.bos_token_id", bos).unwrap();
        }
        let embedding = vec![0u8; rows * 32 * 4];
        w.add_tensor("token_embd.weight", GgmlType::F32, &[rows, 32], embedding)
            .unwrap();
        GgufFile::from_bytes("stops.gguf", w.to_bytes()).unwrap()
    };
    let whole = GgufHostSide::read(&file(5, Some(4))).unwrap();
    assert_eq!(whole.eos_token_ids, [2, 3]);
    assert_eq!(whole.config.vocab_size, 5);
    for (rows, bos, needles) in [
        (
            3,
            None,
            ["stops.gguf", "stop token 3 is outside", "vocabulary of 3"],
        ),
        (
            4,
            Some(4),
            ["stops.gguf", "bos_token_id 4 is outside", "vocabulary of 4"],
        ),
    ] {
        let error = GgufHostSide::read(&file(rows, bos))
            .err()
            .unwrap()
            .to_string();
        for needle in needles {
            assert!(
                error.contains(needle),
                "{error:?} should mention {needle:?}"
            );
        }
    }
}

/// An embedding table that is not a matrix `[vocab, hidden]` is refused, naming its shape: its
/// first dimension was taken for the vocabulary, so a `[1, 3, 32]` table made a vocabulary of
/// one token and the error blamed the EOS id, and a `[96]` one loaded as 96 tokens.
#[test]
fn an_embedding_that_is_not_a_matrix_is_refused() {
    for shape in [&[1usize, 3, 32][..], &[96]] {
        let mut w = GgufWriter::new();
        tiny_llama_with_tokens(&mut w);
        w.add_metadata("tokenizer.ggml.eos_token_id", 2u32).unwrap();
        let elements: usize = shape.iter().product();
        let bytes = vec![0u8; elements * 4];
        w.add_tensor("token_embd.weight", GgmlType::F32, shape, bytes)
            .unwrap();
        let file = GgufFile::from_bytes("embd.gguf", w.to_bytes()).unwrap();
        let error = llama_config(&file).err().unwrap();
        assert!(
            matches!(error, GgufError::Unsupported { .. }),
            "{shape:?}: {error}"
        );
        assert_eq!(
            error.to_string(),
            format!(
                "embd.gguf: tensor token_embd.weight has shape {shape:?} (outermost first): the \
                 embedding table must be a matrix [vocab, hidden]"
            )
        );
    }
}
