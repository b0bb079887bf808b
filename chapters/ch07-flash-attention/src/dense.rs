//! Attention over contiguous Q, K, V, the two paths side by side with one signature: chapter
//! 1's naive attention, which materialises the `[T_q, T_k]` score matrix of every head, and
//! flash attention, which never holds more than one tile of it.
//!
//! ```text
//! q [T_q, num_heads · d], k, v [T_k, num_kv_heads · d]  →  out [T_q, num_heads · d]
//! queries are the last T_q of the T_k positions (a prompt: T_q = T_k; a chunk: T_q < T_k)
//! ```
//! Contiguous K/V are a paged pool of one block of `T_k` positions, so both paths of this file
//! and the engine's backend share one kernel ([`flash_attention_paged`]).

use ch01::attention::{AttentionShape, causal_attention};
use ch02::kernels::Isa;
use ch03::KvScales;
use ch04::attention::QueryRow;
use ndarray::{Array2, ArrayView2};

use crate::attention::{FlashParams, Scratch, flash_attention_paged};
use crate::tile::LayerKv;

/// Inputs whose shapes do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")]
    Heads {
        num_heads: usize,
        num_kv_heads: usize,
    },
    #[error("head_dim must be at least 1")]
    ZeroHeadDim,
    #[error("{what} has {got} columns, the shape says {expected}")]
    Columns {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("k has {k} rows and v {v}: one per position each")]
    KvRows { k: usize, v: usize },
    #[error("{t_q} queries cannot be the last positions of {t_k} keys")]
    MoreQueriesThanKeys { t_q: usize, t_k: usize },
}

/// Checks the shapes of one attention call.
pub fn check_shapes(
    q: &ArrayView2<f32>,
    k: &ArrayView2<f32>,
    v: &ArrayView2<f32>,
    shape: AttentionShape,
) -> Result<(), ShapeError> {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
    } = shape;
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 || num_heads == 0 {
        return Err(ShapeError::Heads {
            num_heads,
            num_kv_heads,
        });
    }
    if head_dim == 0 {
        return Err(ShapeError::ZeroHeadDim);
    }
    for (what, got, expected) in [
        ("q", q.ncols(), num_heads * head_dim),
        ("k", k.ncols(), num_kv_heads * head_dim),
        ("v", v.ncols(), num_kv_heads * head_dim),
    ] {
        if got != expected {
            return Err(ShapeError::Columns {
                what,
                got,
                expected,
            });
        }
    }
    if k.nrows() != v.nrows() {
        return Err(ShapeError::KvRows {
            k: k.nrows(),
            v: v.nrows(),
        });
    }
    if q.nrows() > k.nrows() {
        return Err(ShapeError::MoreQueriesThanKeys {
            t_q: q.nrows(),
            t_k: k.nrows(),
        });
    }
    Ok(())
}

// ANCHOR: side_by_side
/// Causal attention the naive way: chapter 1's oracle, `[T_q, T_k]` scores per head.
pub fn naive_attention(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    shape: AttentionShape,
) -> Result<Array2<f32>, ShapeError> {
    check_shapes(&q, &k, &v, shape)?;
    Ok(causal_attention(q, k, v, shape))
}

/// Causal attention tile by tile: the same inputs, the same result (within rounding), O(T)
/// memory.
pub fn flash_attention(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    shape: AttentionShape,
) -> Result<Array2<f32>, ShapeError> {
    flash_attention_with(Isa::detect(), &FlashParams::default(), q, k, v, shape)
}
// ANCHOR_END: side_by_side

/// [`flash_attention`] with a chosen instruction set and tile sizes.
pub fn flash_attention_with(
    isa: Isa,
    params: &FlashParams,
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    shape: AttentionShape,
) -> Result<Array2<f32>, ShapeError> {
    check_shapes(&q, &k, &v, shape)?;
    let (t_q, t_k) = (q.nrows(), k.nrows());
    let mut out = Array2::<f32>::zeros((t_q, shape.num_heads * shape.head_dim));
    if t_q == 0 {
        return Ok(out);
    }
    let (q, k, v) = (
        q.as_standard_layout(),
        k.as_standard_layout(),
        v.as_standard_layout(),
    );
    let kv = LayerKv {
        keys: k.as_slice().expect("standard layout"),
        values: v.as_slice().expect("standard layout"),
        scales: KvScales::NONE,
        block_size: t_k, // one block holds every position: slot = position
        shape,
    };
    let blocks = [0];
    let rows: Vec<QueryRow> = (t_k - t_q..t_k)
        .map(|pos| QueryRow {
            blocks: &blocks,
            pos,
        })
        .collect();
    flash_attention_paged(
        isa,
        &kv,
        &rows,
        q.as_slice().expect("standard layout"),
        params,
        &mut Scratch::new(),
        out.as_slice_mut().expect("a fresh array is contiguous"),
    );
    Ok(out)
}
