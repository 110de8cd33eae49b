//! Softcapping and ALiBi ([`attn_host::ScoreMod`], `kernels/src/attention/score.rs`) on the GPU,
//! forward and backward, against the float64 reference: the `f32` flash kernels in both dQ
//! modes and the naive kernels; and the 16-bit kernels that the context's kernel path runs with
//! the built-in tiles (`mma.sync` on the sm_80 path, `wgmma` on sm_90a), `f16` and `bf16`, both
//! dQ modes, causal or not, GQA, head counts off ALiBi's power-of-two sequence, a head_dim between
//! the compiled ones, and grids deep enough for the Hopper forward's three consumers.

mod common;

use attn_host::{Alibi, AttentionOptions, AttentionShape, Causal, DType, DqAccumulation, TileConfig, bf16, f16};
use common::attention::{Kernel, check};
use common::gpu;
use common::tensor_cores::{Inputs, check16};

/// A softcap that bends: logits of spread about 1.4 (scale 0.25 at head_dim 32, 1/√d elsewhere
/// times 2) against a cap of 2.
fn softcap(head_dim: usize) -> AttentionOptions<'static> {
    AttentionOptions::with_scale(2.0 / (head_dim as f32).sqrt()).with_softcap(2.0)
}

fn alibi() -> AttentionOptions<'static> {
    AttentionOptions::default().with_alibi(Alibi::standard())
}

#[test]
fn f32_kernels_take_softcap_and_alibi() {
    let Some(ctx) = gpu("f32_kernels_take_softcap_and_alibi") else { return };
    let cases = [
        (
            AttentionShape { batch: 2, num_heads_q: 6, num_heads_kv: 2, seqlen_q: 130, seqlen_k: 257, head_dim: 64 },
            softcap(64),
        ),
        (
            AttentionShape { batch: 1, num_heads_q: 12, num_heads_kv: 4, seqlen_q: 200, seqlen_k: 77, head_dim: 32 },
            alibi(),
        ),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        for causal in [Causal::None, Causal::BottomRight] {
            let options = AttentionOptions { causal, ..options };
            for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
                let tile = TileConfig::default_for_dtype(DType::F32, shape.head_dim);
                check(ctx, shape, Kernel::Flash(tile, mode), options, 700 + i as u64, true);
            }
        }
    }
    let shape = AttentionShape { batch: 1, num_heads_q: 5, num_heads_kv: 5, seqlen_q: 90, seqlen_k: 110, head_dim: 40 };
    check(ctx, shape, Kernel::Naive, alibi(), 720, true);
    check(ctx, shape, Kernel::Naive, softcap(40), 721, false);
}

#[test]
fn tensor_core_kernels_take_softcap_and_alibi() {
    let Some(ctx) = gpu("tensor_core_kernels_take_softcap_and_alibi") else { return };
    let gqa = |batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim| AttentionShape {
        batch,
        num_heads_q: heads_q,
        num_heads_kv: heads_kv,
        seqlen_q,
        seqlen_k,
        head_dim,
    };
    let cases = [
        (gqa(2, 4, 2, 333, 333, 64), softcap(64)),
        (gqa(2, 4, 2, 333, 333, 128), AttentionOptions { causal: Causal::TopLeft, ..softcap(128) }),
        (gqa(1, 12, 4, 300, 500, 64), alibi()),
        (gqa(1, 12, 4, 500, 300, 128), AttentionOptions { causal: Causal::BottomRight, ..alibi() }),
        (gqa(1, 6, 6, 200, 260, 96), AttentionOptions { causal: Causal::BottomRight, ..softcap(96) }),
        (gqa(1, 5, 5, 129, 77, 80), alibi()),
        // Deep enough for the Hopper forward's three consumers at head_dim 64, with short blocks.
        (gqa(6, 16, 4, 400, 300, 64), AttentionOptions { causal: Causal::BottomRight, ..alibi() }),
        (gqa(3, 16, 4, 1100, 1100, 64), AttentionOptions { causal: Causal::BottomRight, ..softcap(64) }),
        // Wide heads: on the sm_90a path the Hopper backward's 64-key blocks (atomic dQ), 160 on
        // 192's with padding columns.
        (gqa(1, 4, 2, 300, 333, 256), AttentionOptions { causal: Causal::TopLeft, ..softcap(256) }),
        (gqa(1, 6, 2, 257, 200, 192), alibi()),
        (gqa(1, 4, 4, 130, 190, 160), AttentionOptions { causal: Causal::BottomRight, ..softcap(160) }),
        // Gemma 2's cap on large logits (LargeLogits inputs below).
        (gqa(1, 8, 4, 512, 512, 128), AttentionOptions::causal(Causal::BottomRight).with_softcap(50.0)),
    ];
    for (i, (shape, options)) in cases.into_iter().enumerate() {
        let fwd = TileConfig::default_for_dtype(DType::F16, shape.head_dim);
        let bwd = TileConfig::default_backward_for_dtype(DType::F16, shape.head_dim);
        let inputs = if i == cases.len() - 1 { Inputs::LargeLogits } else { Inputs::Normal };
        let seed = 800 + 2 * i as u64;
        check16::<f16>(ctx, shape, fwd, Some((bwd, DqAccumulation::Atomic)), options, seed, inputs);
        check16::<bf16>(ctx, shape, fwd, Some((bwd, DqAccumulation::Deterministic)), options, seed + 1, inputs);
    }
}
