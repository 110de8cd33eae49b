//! The `f16`/`bf16` tensor-core FlashAttention kernels (forward, backward with atomic and
//! deterministic dQ) against the float64 CPU reference on the rounded inputs: random shapes
//! (ragged lengths, cross-attention, GQA, both causal alignments), every compiled instance,
//! logits in the hundreds, bitwise-deterministic dQ, and a long sequence.
//!
//! Tolerances (relative L2, issue 4): O ≤ 3e-3 (f16) / 1e-2 (bf16); dQ, dK, dV ≤ 1e-2 / 2e-2;
//! LSE ≤ 1e-4. Outputs are poisoned with NaN before every launch.

mod common;

use attn_host::{
    AttentionOptions, AttentionShape, Causal, Context, DType, DqAccumulation, Element, FlashKernel, TileConfig, bf16,
    f16,
};
use common::tensor_cores::{Inputs, Problem16, check16};
use common::{gpu, gpu_proptest_config, head_dims, runs, windows};
use proptest::prelude::*;

fn masks() -> impl Strategy<Value = Causal> {
    prop::sample::select(vec![Causal::None, Causal::TopLeft, Causal::BottomRight])
}

/// A shape with seqlen_q and seqlen_k drawn independently, a GQA ratio from {1, 2, 4} and a
/// head_dim from [`common::head_dims`].
fn shapes() -> impl Strategy<Value = AttentionShape> {
    (1usize..=2, 1usize..=3, prop::sample::select(vec![1usize, 2, 4]), 1usize..=400, 1usize..=400, head_dims())
        .prop_map(|(batch, heads_kv, group, seqlen_q, seqlen_k, head_dim)| AttentionShape {
            batch,
            num_heads_q: heads_kv * group,
            num_heads_kv: heads_kv,
            seqlen_q,
            seqlen_k,
            head_dim,
        })
}

/// The `index`-th compiled tile of `kernel` (modulo their number).
fn pick(kernel: FlashKernel, dtype: DType, head_dim: usize, index: usize) -> TileConfig {
    let tiles = TileConfig::compiled_for(kernel, dtype, head_dim);
    tiles[index % tiles.len()]
}

/// The softmax scale: the default 1/√d mostly, and the corner cases a kernel must not assume
/// away (negative, zero, large).
fn scales() -> impl Strategy<Value = Option<f32>> {
    prop::sample::select(vec![None, None, None, Some(-0.2), Some(0.0), Some(1.0)])
}

fn random_case<T: Element>(
    ctx: &Context,
    shape: AttentionShape,
    options: AttentionOptions,
    picks: (usize, usize),
    deterministic: bool,
    seed: u64,
) {
    let d = shape.head_dim;
    let tile = pick(FlashKernel::Forward, T::DTYPE, d, picks.0);
    let bwd = pick(FlashKernel::Backward, T::DTYPE, d, picks.1);
    let mode = if deterministic { DqAccumulation::Deterministic } else { DqAccumulation::Atomic };
    check16::<T>(ctx, shape, tile, Some((bwd, mode)), options, seed, Inputs::Normal);
}

#[test]
fn tensor_core_forward_and_backward_match_cpu_on_random_problems() {
    let Some(ctx) = gpu("tensor_core_forward_and_backward_match_cpu_on_random_problems") else { return };
    proptest!(gpu_proptest_config(48), |(shape in shapes(), causal in masks(), window in windows(), scale in scales(), bf in any::<bool>(), picks in (0usize..64, 0usize..64), deterministic in any::<bool>(), seed in any::<u32>())| {
        let (seed, options) = (seed as u64 * 4, AttentionOptions { scale, causal, window, ..Default::default() });
        if bf {
            random_case::<bf16>(ctx, shape, options, picks, deterministic, seed);
        } else {
            random_case::<f16>(ctx, shape, options, picks, deterministic, seed);
        }
    });
}

/// Every compiled forward and backward instance, both types, both dQ modes, on a shape with
/// ragged tails, a GQA group and a bottom-right causal mask (seqlen_q < seqlen_k).
#[test]
fn every_tensor_core_instance_on_a_ragged_causal_shape() {
    let Some(ctx) = gpu("every_tensor_core_instance_on_a_ragged_causal_shape") else { return };
    fn all<T: Element>(ctx: &Context) -> usize {
        let mut ran = 0;
        for head_dim in TileConfig::compiled_head_dims_for(T::DTYPE) {
            let shape =
                AttentionShape { batch: 2, num_heads_q: 4, num_heads_kv: 2, seqlen_q: 201, seqlen_k: 333, head_dim };
            let options = AttentionOptions::causal(Causal::BottomRight);
            // (`ran` counts the checks that ran: a GPU without the type or the room leaves some out.)
            let mut seed = 0;
            for tile in TileConfig::compiled_for(FlashKernel::Forward, T::DTYPE, head_dim) {
                ran += usize::from(check16::<T>(ctx, shape, tile, None, options, seed, Inputs::Normal));
                seed += 1;
            }
            let forward = TileConfig::default_for_dtype(T::DTYPE, head_dim);
            for tile in TileConfig::compiled_for(FlashKernel::Backward, T::DTYPE, head_dim) {
                for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
                    let checked = check16::<T>(ctx, shape, forward, Some((tile, mode)), options, seed, Inputs::Normal);
                    ran += usize::from(checked);
                    seed += 1;
                }
            }
        }
        ran
    }
    let ran = all::<f16>(ctx) + all::<bf16>(ctx);
    assert!(ran > 20, "only {ran} instances checked");
}

/// Q and K uniform in [−8, 8] with scale 1: logits in the hundreds. Everything stays finite and
/// within tolerance (the online softmax subtracts the running max before exponentiating).
#[test]
fn tensor_cores_with_logits_in_the_hundreds() {
    let Some(ctx) = gpu("tensor_cores_with_logits_in_the_hundreds") else { return };
    for head_dim in [64, 128] {
        for causal in [Causal::None, Causal::BottomRight] {
            let shape =
                AttentionShape { batch: 1, num_heads_q: 4, num_heads_kv: 2, seqlen_q: 300, seqlen_k: 517, head_dim };
            let options = AttentionOptions { scale: Some(1.0), causal, ..Default::default() };
            for (i, mode) in [DqAccumulation::Atomic, DqAccumulation::Deterministic].into_iter().enumerate() {
                let bwd = (TileConfig::default_backward_for_dtype(DType::F16, head_dim), mode);
                let fwd = TileConfig::default_for_dtype(DType::F16, head_dim);
                check16::<f16>(ctx, shape, fwd, Some(bwd), options, 70 + i as u64, Inputs::LargeLogits);
                check16::<bf16>(ctx, shape, fwd, Some(bwd), options, 80 + i as u64, Inputs::LargeLogits);
            }
        }
    }
}

/// The deterministic backward gives bit-identical dQ, dK and dV from run to run (in `bf16`, or
/// `f16` on a GPU without `bf16`).
#[test]
fn deterministic_tensor_core_backward_is_bitwise_reproducible() {
    let Some(ctx) = gpu("deterministic_tensor_core_backward_is_bitwise_reproducible") else { return };
    fn reproducible<T: Element>(ctx: &Context) {
        let shape =
            AttentionShape { batch: 2, num_heads_q: 8, num_heads_kv: 2, seqlen_q: 777, seqlen_k: 1029, head_dim: 128 };
        let problem = Problem16::<T>::new(ctx, shape, 5, Inputs::Normal);
        let options = AttentionOptions::causal(Causal::TopLeft);
        let fwd = problem.forward(ctx, TileConfig::default_for_dtype(T::DTYPE, 128), &options);
        let tile = TileConfig::default_backward_for_dtype(T::DTYPE, 128);
        let bits = |g: &attn_host::Gradients<T>| {
            // Widening to f32 is exact, so equal f32 bits are equal 16-bit values.
            [&g.dq, &g.dk, &g.dv]
                .map(|t| t.to_host().unwrap().iter().map(|x| x.to_f32().to_bits()).collect::<Vec<u32>>())
        };
        let first = bits(&problem.backward(ctx, tile, DqAccumulation::Deterministic, &options, &fwd));
        for _ in 0..3 {
            assert!(bits(&problem.backward(ctx, tile, DqAccumulation::Deterministic, &options, &fwd)) == first);
        }
    }
    if runs(ctx, DType::Bf16) { reproducible::<bf16>(ctx) } else { reproducible::<f16>(ctx) }
}

/// A long sequence: many K/V tiles through the pipeline, many query tiles per key block.
#[test]
fn tensor_cores_on_a_long_causal_sequence() {
    let Some(ctx) = gpu("tensor_cores_on_a_long_causal_sequence") else { return };
    let shape =
        AttentionShape { batch: 1, num_heads_q: 4, num_heads_kv: 4, seqlen_q: 3000, seqlen_k: 3000, head_dim: 128 };
    let options = AttentionOptions::causal(Causal::TopLeft);
    let (fwd, bwd) =
        (TileConfig::default_for_dtype(DType::F16, 128), TileConfig::default_backward_for_dtype(DType::F16, 128));
    check16::<f16>(ctx, shape, fwd, Some((bwd, DqAccumulation::Atomic)), options, 11, Inputs::Normal);
    let shape = AttentionShape { head_dim: 64, seqlen_q: 4100, seqlen_k: 2500, ..shape };
    let (fwd, bwd) =
        (TileConfig::default_for_dtype(DType::Bf16, 64), TileConfig::default_backward_for_dtype(DType::Bf16, 64));
    check16::<bf16>(
        ctx,
        shape,
        fwd,
        Some((bwd, DqAccumulation::Deterministic)),
        AttentionOptions::causal(Causal::BottomRight),
        12,
        Inputs::Normal,
    );
}
