//! The kernels that compute the same thing in different ways, and which one runs: a new
//! variant runs only when an environment variable asks for it, until a GPU has timed it beside
//! the old one. kiln prints the choice when a device opens.

use super::CudaError;
use super::ops::{DeviceScalar, HeadShape};

/// The value of `variable` among `choices` (name, value), the first when it is not set.
fn from_env<T: Copy>(variable: &str, choices: &[(&str, T)]) -> Result<T, CudaError> {
    let asked = match std::env::var(variable) {
        Ok(asked) => asked,
        Err(std::env::VarError::NotPresent) => return Ok(choices[0].1),
        Err(std::env::VarError::NotUnicode(value)) => {
            return Err(CudaError::Config(format!(
                "{variable}={value:?} is not UTF-8"
            )));
        }
    };
    choices
        .iter()
        .find(|(name, _)| *name == asked)
        .map(|&(_, value)| value)
        .ok_or_else(|| {
            let names: Vec<String> = choices.iter().map(|(n, _)| format!("`{n}`")).collect();
            CudaError::Config(format!(
                "{variable}={asked}: expected {}",
                names.join(" or ")
            ))
        })
}

/// Which split-K decode kernel reads K and V (both leave the same partial results, which
/// `paged_decode_merge` finishes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// `paged_decode.cu`: each thread scores whole keys, a K row 16 bytes at a time. Any shape
    /// [`HeadShape::check`] accepts.
    KeyPerThread,
    /// `paged_decode_lanes.cu`: a group of lanes reads each K and V row together, so one load
    /// instruction reads whole rows. Head sizes 64 and 128, 1, 2, 4 or 8 query heads per KV head.
    LaneGroups,
}

impl DecodeKernel {
    /// The head sizes and groups the lane-group kernels are compiled for.
    const LANE_GROUP_HEAD_DIMS: [usize; 2] = [64, 128];
    const LANE_GROUP_GROUPS: [usize; 4] = [1, 2, 4, 8];

    /// The kernel `KILN_DECODE_KERNEL` names (`key-per-thread`, the default, or
    /// `lane-groups`): the lane-group kernel is new and not yet timed on a GPU, so it runs only
    /// when asked for.
    pub fn from_env() -> Result<DecodeKernel, CudaError> {
        from_env(
            "KILN_DECODE_KERNEL",
            &[
                ("key-per-thread", DecodeKernel::KeyPerThread),
                ("lane-groups", DecodeKernel::LaneGroups),
            ],
        )
    }

    /// Whether this kernel has an instance for `heads` (valid by [`HeadShape::check`]).
    pub fn takes(self, heads: HeadShape) -> bool {
        match self {
            DecodeKernel::KeyPerThread => true,
            DecodeKernel::LaneGroups => {
                Self::LANE_GROUP_HEAD_DIMS.contains(&heads.head_dim)
                    && heads
                        .group()
                        .is_some_and(|g| Self::LANE_GROUP_GROUPS.contains(&g))
            }
        }
    }

    /// The kernel function for K/V of type `T` and `heads` (which [`takes`](Self::takes) holds).
    pub(super) fn function<T: DeviceScalar>(self, heads: HeadShape) -> String {
        match self {
            DecodeKernel::KeyPerThread => format!("paged_decode_{}", T::SUFFIX),
            DecodeKernel::LaneGroups => format!(
                "paged_decode_lanes_{}_d{}_g{}",
                T::SUFFIX,
                heads.head_dim,
                heads.num_heads / heads.num_kv_heads
            ),
        }
    }
}

/// Which tensor-core prefill kernel runs (`kernels/flash_prefill_tc.cu`; both compute the same
/// attention, with the same roundings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// 64 query rows a thread block, 16 a warp, Q's fragments in registers.
    Rows64,
    /// 128 query rows a thread block, 32 a warp: each K/V fragment read from shared memory
    /// serves twice the rows, and Q's fragments come from a shared Q tile.
    Rows128,
}

impl PrefillKernel {
    pub const ALL: [PrefillKernel; 2] = [PrefillKernel::Rows64, PrefillKernel::Rows128];
    /// The head sizes the tensor-core prefill kernels are compiled for.
    pub const HEAD_DIMS: [usize; 2] = [64, 128];

    /// The kernel `KILN_PREFILL_KERNEL` names (`rows64`, the default, or `rows128`): the
    /// 128-row kernel is new and not yet timed on a GPU, so it runs only when asked for.
    pub fn from_env() -> Result<PrefillKernel, CudaError> {
        from_env(
            "KILN_PREFILL_KERNEL",
            &[
                ("rows64", PrefillKernel::Rows64),
                ("rows128", PrefillKernel::Rows128),
            ],
        )
    }

    /// Query rows per thread block (4 warps of 16 or 32).
    pub fn query_rows(self) -> usize {
        match self {
            PrefillKernel::Rows64 => 64,
            PrefillKernel::Rows128 => 128,
        }
    }

    /// The kernel function for head size `d` (one of [`HEAD_DIMS`](Self::HEAD_DIMS)).
    pub(super) fn function(self, d: usize) -> String {
        match self {
            PrefillKernel::Rows64 => format!("flash_prefill_tc_bf16_d{d}"),
            PrefillKernel::Rows128 => format!("flash_prefill_tc_rows128_bf16_d{d}"),
        }
    }

    /// The dynamic shared memory for head size `d` (`tc_smem` in the kernel): two buffers of a
    /// K and a V tile of 64 keys, and for 128 rows the Q tile, each row `d + 8` bf16.
    pub(super) fn shared_bytes(self, d: usize) -> u32 {
        let tiles = 2 * 2 * 64;
        let q_rows = match self {
            PrefillKernel::Rows64 => 0,
            PrefillKernel::Rows128 => 128,
        };
        ((tiles + q_rows) * (d + 8) * 2) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_memory_of_each_prefill_kernel() {
        // d = 128: 4 tiles of 64 rows of 136 bf16 (69,632 bytes), and 128 rows of Q (34,816).
        assert_eq!(PrefillKernel::Rows64.shared_bytes(128), 69_632);
        assert_eq!(PrefillKernel::Rows128.shared_bytes(128), 104_448);
        // At most 227 KiB a block on sm_90, 99 KiB on sm_86/89: the 128-row kernel at d = 128
        // needs a GPU with more than 99 KiB (sm_80, sm_90, sm_100).
        assert!(PrefillKernel::Rows128.shared_bytes(64) <= 99 << 10);
    }

    #[test]
    fn a_variable_names_one_of_its_choices() {
        let choices = [("a", 1), ("b", 2)];
        // Unset: the first choice (a variable no test sets).
        assert_eq!(from_env("KILN_TEST_UNSET_CHOICE", &choices).unwrap(), 1);
        let err = from_env("PATH", &choices).unwrap_err().to_string();
        assert!(err.contains("expected `a` or `b`"), "{err}");
    }
}
