//! FP8 conversion against PyTorch 2.15's casts to `float8_e4m3fn` and `float8_e5m2`, bit for
//! bit, on every f16 and every bf16 input and on 4,096 random f32 bit patterns
//! (`fixtures/golden/fp8/`, written by `fixtures/scripts/make_fp8_golden.py`).

use ch01::fixtures_dir;
use ch05_quantization::fp8::Fp8Format;
use half::{bf16, f16};

fn read(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join("golden/fp8").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Compares kiln's code for every input with torch's; reports the first few that differ.
fn check(what: &str, expected: &[u8], inputs: impl Iterator<Item = (u32, f32)>, format: Fp8Format) {
    let mut wrong = Vec::new();
    let mut count = 0;
    for ((bits, x), &want) in inputs.zip(expected) {
        count += 1;
        let got = format.encode(x);
        if got != want {
            wrong.push(format!(
                "{bits:#010x} ({x:e}): kiln {got:#04x}, torch {want:#04x}"
            ));
        }
    }
    assert_eq!(count, expected.len(), "{what}: one code per input");
    assert!(
        wrong.is_empty(),
        "{what}: {} of {count} differ, first: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(8)]
    );
}

#[test]
fn every_f16_and_bf16_converts_as_torch_does() {
    for (format, name) in [(Fp8Format::E4M3, "e4m3fn"), (Fp8Format::E5M2, "e5m2")] {
        let from_f16 = read(&format!("{name}_from_f16.bin"));
        let from_bf16 = read(&format!("{name}_from_bf16.bin"));
        assert_eq!((from_f16.len(), from_bf16.len()), (1 << 16, 1 << 16));
        let f16s = (0..=u16::MAX).map(|b| (b as u32, f16::from_bits(b).to_f32()));
        check(&format!("{name} from f16"), &from_f16, f16s, format);
        let bf16s = (0..=u16::MAX).map(|b| (b as u32, bf16::from_bits(b).to_f32()));
        check(&format!("{name} from bf16"), &from_bf16, bf16s, format);
        // The typed entry points agree with the f32 path they document.
        for b in (0..=u16::MAX).step_by(97) {
            assert_eq!(format.encode_f16(f16::from_bits(b)), from_f16[b as usize]);
            assert_eq!(
                format.encode_bf16(bf16::from_bits(b)),
                from_bf16[b as usize]
            );
        }
    }
}

#[test]
fn random_f32_convert_as_torch_does() {
    let inputs: Vec<u32> = read("f32_inputs.bin")
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(inputs.len(), 4096);
    for (format, name) in [(Fp8Format::E4M3, "e4m3fn"), (Fp8Format::E5M2, "e5m2")] {
        let expected = read(&format!("{name}_from_f32.bin"));
        let xs = inputs.iter().map(|&b| (b, f32::from_bits(b)));
        check(&format!("{name} from f32"), &expected, xs, format);
    }
}
