//! Attention sinks ([`attn_host::Sinks`], `finish_row` in `kernels/src/attention/softmax.rs`) on
//! the GPU, forward and backward with dSinks, against the float64 reference: the `f32` flash
//! kernels in both dQ modes, and the 16-bit kernels that the context's kernel path runs with the
//! built-in tiles (`mma.sync` on the sm_80 path, `wgmma` on sm_90a), `f16` and `bf16`, both dQ
//! modes; GPT-OSS's layout (64 query heads over 8, head_dim 64, alternating a 128-token sliding
//! window with full causal attention), rows that see no key, sinks with softcapping and ALiBi,
//! head dims between the compiled ones, and grids deep enough for the Hopper forward's three
//! consumers.

mod common;

use attn_host::check::random_normal;
use attn_host::{
    Alibi, AttentionOptions, AttentionShape, Causal, DType, DqAccumulation, SlidingWindow, TileConfig, bf16, f16,
};
use common::attention::{Kernel, check_with_sinks};
use common::gpu;
use common::tensor_cores::{Inputs, check16_with_sinks};

/// Sinks of `heads` heads, around 2 (comparable to the rows' own LSE), the last one large enough
/// to take most of its rows' mass.
fn sinks(heads: usize, seed: u64) -> Vec<f32> {
    let mut sinks: Vec<f32> = random_normal(heads, seed).iter().map(|x| 2.0 + x).collect();
    sinks[heads - 1] = 9.0;
    sinks
}

fn shape(batch: usize, heads_q: usize, heads_kv: usize, seqlen_q: usize, seqlen_k: usize, d: usize) -> AttentionShape {
    AttentionShape { batch, num_heads_q: heads_q, num_heads_kv: heads_kv, seqlen_q, seqlen_k, head_dim: d }
}

#[test]
fn f32_kernels_take_sinks() {
    let Some(ctx) = gpu("f32_kernels_take_sinks") else { return };
    let cases = [
        (shape(2, 6, 2, 130, 257, 64), AttentionOptions::causal(Causal::BottomRight)),
        (shape(1, 12, 4, 200, 77, 32), AttentionOptions::causal(Causal::BottomRight).with_alibi(Alibi::standard())),
        (shape(1, 4, 4, 150, 150, 128), AttentionOptions::with_scale(0.25).with_softcap(2.0)),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        let sinks = sinks(shape.num_heads_q, 900 + i as u64);
        for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
            let tile = TileConfig::default_for_dtype(DType::F32, shape.head_dim);
            check_with_sinks(ctx, shape, Kernel::Flash(tile, mode), options, Some(&sinks), 910 + i as u64, true);
        }
    }
}

#[test]
fn tensor_core_kernels_take_sinks() {
    let Some(ctx) = gpu("tensor_core_kernels_take_sinks") else { return };
    let window = SlidingWindow::new(Some(127), Some(0));
    let cases = [
        // GPT-OSS: 64 query heads over 8, head_dim 64, sliding-window and full layers.
        (shape(1, 64, 8, 700, 700, 64), AttentionOptions::causal(Causal::BottomRight).with_window(window)),
        (shape(1, 64, 8, 700, 700, 64), AttentionOptions::causal(Causal::BottomRight)),
        (shape(2, 4, 2, 333, 333, 128), AttentionOptions::default()),
        // More queries than keys, bottom-right: the first 200 rows see no key (LSE = sink).
        (shape(1, 6, 2, 500, 300, 128), AttentionOptions::causal(Causal::BottomRight)),
        (shape(1, 6, 6, 200, 260, 96), AttentionOptions::causal(Causal::TopLeft).with_alibi(Alibi::standard())),
        (shape(1, 5, 5, 129, 77, 80), AttentionOptions::with_scale(0.25).with_softcap(2.0)),
        (shape(1, 4, 2, 300, 300, 256), AttentionOptions::causal(Causal::TopLeft)),
        // Deep enough for the Hopper forward's three consumers at head_dim 64, with short blocks.
        (shape(3, 16, 4, 1100, 1100, 64), AttentionOptions::causal(Causal::BottomRight)),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        let fwd = TileConfig::default_for_dtype(DType::F16, shape.head_dim);
        let bwd = TileConfig::default_backward_for_dtype(DType::F16, shape.head_dim);
        let seed = 930 + 2 * i as u64;
        let sinks = sinks(shape.num_heads_q, seed);
        let atomic = Some((bwd, DqAccumulation::Atomic));
        let deterministic = Some((bwd, DqAccumulation::Deterministic));
        check16_with_sinks::<f16>(ctx, shape, fwd, atomic, options, Some(&sinks), seed, Inputs::Normal);
        check16_with_sinks::<bf16>(ctx, shape, fwd, deterministic, options, Some(&sinks), seed + 1, Inputs::Normal);
    }
}
