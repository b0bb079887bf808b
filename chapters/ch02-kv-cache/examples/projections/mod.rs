//! What the projection examples share: one pass over every projection of every layer of a
//! model (q, k, v, o, gate, up, down), each into its own output, and its weights' count.

use std::time::Instant;

use ch01::{Llama, LlamaConfig};
use ndarray::Array2;

/// One pass: every projection of every layer on `x` [T, hidden], each into its own output.
pub fn pass(model: &Llama, x: &Array2<f32>) -> f64 {
    let c = &model.config;
    let n = x.nrows();
    let head_dim = c.hidden_size / c.num_attention_heads;
    let kv_dim = c.num_key_value_heads * head_dim;
    let mut q = Array2::zeros((n, c.num_attention_heads * head_dim));
    let mut kv = Array2::zeros((n, kv_dim));
    let mut wide = Array2::zeros((n, c.intermediate_size));
    let mut narrow = Array2::zeros((n, c.hidden_size));
    let h = Array2::from_shape_fn((n, c.intermediate_size), |(i, j)| {
        ((i * 17 + j * 5) % 11) as f32 / 11.0 - 0.5
    }); // down_proj's input [T, intermediate]
    let start = Instant::now();
    for layer in &model.layers {
        let (a, m) = (&layer.self_attn, &layer.mlp);
        a.q_proj.forward_into(x.view(), q.view_mut());
        a.k_proj.forward_into(x.view(), kv.view_mut());
        a.v_proj.forward_into(x.view(), kv.view_mut());
        a.o_proj.forward_into(q.view(), narrow.view_mut());
        m.gate_proj.forward_into(x.view(), wide.view_mut());
        m.up_proj.forward_into(x.view(), wide.view_mut());
        m.down_proj.forward_into(h.view(), narrow.view_mut());
    }
    start.elapsed().as_secs_f64() * 1e3
}

/// Weights of one pass ([`pass`]): every projection of every layer.
pub fn weights(c: &LlamaConfig) -> usize {
    c.num_hidden_layers
        * (c.hidden_size
            * (2 * c.hidden_size
                + 2 * (c.num_key_value_heads * c.hidden_size) / c.num_attention_heads)
            + 3 * c.hidden_size * c.intermediate_size)
}
