//! The CUDA sources, embedded in the binary so that it needs no file at run time. A source may
//! `#include "common.cuh"`: [`KernelSource::resolved`] pastes the header in (NVRTC then needs no
//! include path, and no CUDA header is used).

/// One `kernels/*.cu` file.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub file: &'static str,
    pub source: &'static str,
    /// The `extern "C" __global__` functions it defines, which the executor launches.
    pub functions: &'static [&'static str],
}

const COMMON: &str = include_str!("../../../../kernels/common.cuh");

macro_rules! kernel {
    ($file:literal, [$($function:literal),* $(,)?]) => {
        KernelSource {
            file: $file,
            source: include_str!(concat!("../../../../kernels/", $file)),
            functions: &[$($function),*],
        }
    };
}

/// Every kernel file, in the order a decoder layer uses them.
pub const KERNELS: &[KernelSource] = &[
    kernel!("embedding.cu", ["embedding_f32", "embedding_bf16"]),
    kernel!("rmsnorm.cu", ["add_rmsnorm", "add_in_place", "add_bias"]),
    kernel!("rope.cu", ["rope"]),
    kernel!(
        "kv_write.cu",
        ["kv_write_f32", "kv_write_bf16", "copy_block"]
    ),
    kernel!(
        "flash_prefill.cu",
        ["flash_prefill_f32", "flash_prefill_bf16"]
    ),
    kernel!(
        "flash_prefill_tc.cu",
        [
            "flash_prefill_tc_bf16_d64",
            "flash_prefill_tc_bf16_d128",
            "flash_prefill_tc_rows128_bf16_d64",
            "flash_prefill_tc_rows128_bf16_d128"
        ]
    ),
    kernel!(
        "paged_decode.cu",
        [
            "paged_decode_f32",
            "paged_decode_bf16",
            "paged_decode_merge"
        ]
    ),
    kernel!(
        "paged_decode_lanes.cu",
        [
            "paged_decode_lanes_f32_d64_g1",
            "paged_decode_lanes_f32_d64_g2",
            "paged_decode_lanes_f32_d64_g4",
            "paged_decode_lanes_f32_d64_g8",
            "paged_decode_lanes_f32_d128_g1",
            "paged_decode_lanes_f32_d128_g2",
            "paged_decode_lanes_f32_d128_g4",
            "paged_decode_lanes_f32_d128_g8",
            "paged_decode_lanes_bf16_d64_g1",
            "paged_decode_lanes_bf16_d64_g2",
            "paged_decode_lanes_bf16_d64_g4",
            "paged_decode_lanes_bf16_d64_g8",
            "paged_decode_lanes_bf16_d128_g1",
            "paged_decode_lanes_bf16_d128_g2",
            "paged_decode_lanes_bf16_d128_g4",
            "paged_decode_lanes_bf16_d128_g8",
        ]
    ),
    kernel!("silu_mul.cu", ["silu_mul", "cast_f32_bf16"]),
    kernel!("argmax.cu", ["argmax_rows"]),
];

impl KernelSource {
    /// The source with `#include "common.cuh"` replaced by the header itself.
    pub fn resolved(&self) -> String {
        self.source
            .lines()
            .map(|line| {
                if line.trim() == "#include \"common.cuh\"" {
                    COMMON
                } else {
                    line
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_is_listed_once() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|name| name.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut listed: Vec<&str> = KERNELS.iter().map(|k| k.file).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
    }

    #[test]
    fn every_listed_function_is_defined_extern_c() {
        for kernel in KERNELS {
            for function in kernel.functions {
                // Written out, or through a macro that writes it (`DECODE_LANES(name, ...)`).
                let defined = kernel.source.lines().any(|line| {
                    (line.starts_with("extern \"C\" __global__ void")
                        && line.contains(&format!(" {function}(")))
                        || line.starts_with(&format!("DECODE_LANES({function},"))
                });
                assert!(defined, "{} does not define {function}", kernel.file);
            }
        }
    }

    #[test]
    fn resolved_sources_paste_the_header_in() {
        for kernel in KERNELS {
            let resolved = kernel.resolved();
            assert!(
                !resolved.contains("#include \"common.cuh\""),
                "{}",
                kernel.file
            );
            assert!(resolved.contains("__device__ __forceinline__ float bf16_to_f32"));
            // No CUDA header: NVRTC compiles the sources with nothing but itself.
            assert!(!resolved.contains("#include <"), "{}", kernel.file);
        }
    }
}
