//! GPU attention (naive and FlashAttention, forward and backward) against the float64 CPU
//! reference.
//!
//! Every output is poisoned with NaN before the launch, so an element a kernel fails to write
//! fails the error check. Inputs are seeded standard-normal draws, fresh for every case.

mod common;

use attn_host::check::relative_l2_error;
use attn_host::{AttentionOptions, AttentionShape, Causal, Context, DeviceTensor, DqAccumulation, TileConfig};
use common::attention::{GRAD_TOLERANCE, Kernel, O_TOLERANCE, Problem, check};
use common::{gpu, gpu_proptest_config, head_dims, mha, windows};
use proptest::prelude::*;

/// A shape in the test's range with any head_dim up to 256 ([`common::head_dims`]), seqlen_q and
/// seqlen_k drawn independently (cross-attention), and a GQA ratio from {1, 2, 4}.
fn shapes() -> impl Strategy<Value = AttentionShape> {
    (1usize..=3, 1usize..=4, prop::sample::select(vec![1usize, 2, 4]), 1usize..=300, 1usize..=300, head_dims())
        .prop_map(|(batch, heads_kv, group, seqlen_q, seqlen_k, head_dim)| AttentionShape {
            batch,
            num_heads_q: heads_kv * group,
            num_heads_kv: heads_kv,
            seqlen_q,
            seqlen_k,
            head_dim,
        })
}

fn masks() -> impl Strategy<Value = Causal> {
    prop::sample::select(vec![Causal::None, Causal::TopLeft, Causal::BottomRight])
}

/// Any tile compiled at head_dim 64, replaced by (16, 16) where it is not compiled for the
/// problem's head_dim or the backward kernels' shared memory does not fit the device.
fn tiles() -> impl Strategy<Value = TileConfig> {
    prop::sample::select(TileConfig::compiled(64))
}

fn fitting(ctx: &Context, tile: TileConfig, head_dim: usize) -> TileConfig {
    let fits = [attn_host::FlashKernel::Backward, attn_host::FlashKernel::BackwardDq]
        .iter()
        .all(|&kernel| tile.validate_for(kernel, head_dim, ctx.device()).is_ok());
    if fits { tile } else { TileConfig::new(16, 16) }
}

// The GPU is looked up once per test, before proptest starts: without a GPU (and with
// REQUIRE_GPU=1) the test fails once instead of once per shrinking step.

#[test]
fn flash_forward_and_backward_match_cpu_on_random_problems() {
    let Some(ctx) = gpu("flash_forward_and_backward_match_cpu_on_random_problems") else { return };
    let modes = prop::sample::select(vec![DqAccumulation::Atomic, DqAccumulation::Deterministic]);
    proptest!(gpu_proptest_config(48), |(shape in shapes(), tile in tiles(), causal in masks(), window in windows(), mode in modes, seed in any::<u32>())| {
        let tile = fitting(ctx, tile, shape.head_dim);
        let options = AttentionOptions { causal, window, ..Default::default() };
        check(ctx, shape, Kernel::Flash(tile, mode), options, seed as u64 * 4, true);
    });
}

#[test]
fn naive_forward_and_backward_match_cpu_on_random_problems() {
    let Some(ctx) = gpu("naive_forward_and_backward_match_cpu_on_random_problems") else { return };
    proptest!(gpu_proptest_config(32), |(shape in shapes(), causal in masks(), seed in any::<u32>())| {
        check(ctx, shape, Kernel::Naive, AttentionOptions::causal(causal), seed as u64 * 4, true);
    });
}

/// Every compiled (block_m, block_n, head_dim) instance of every kernel family, on a shape with
/// a ragged tail in both sequence dimensions, a GQA group and a causal mask.
#[test]
fn every_flash_instance_on_a_ragged_causal_shape() {
    let Some(ctx) = gpu("every_flash_instance_on_a_ragged_causal_shape") else { return };
    let mut ran = 0;
    for head_dim in TileConfig::compiled_head_dims() {
        for tile in TileConfig::compiled(head_dim) {
            if fitting(ctx, tile, head_dim) != tile {
                println!("tile {tile:?} at head_dim {head_dim} does not fit {}: skipped", ctx.device().name);
                continue;
            }
            let shape =
                AttentionShape { batch: 2, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 77, seqlen_k: 93, head_dim };
            for mode in [DqAccumulation::Atomic, DqAccumulation::Deterministic] {
                let options = AttentionOptions::causal(Causal::BottomRight);
                check(ctx, shape, Kernel::Flash(tile, mode), options, ran, true);
                ran += 1;
            }
        }
    }
    println!("checked {ran} flash instance/mode pairs");
}

#[test]
fn one_tile() {
    let Some(ctx) = gpu("one_tile") else { return };
    let flash = Kernel::Flash(TileConfig::new(64, 64), DqAccumulation::Atomic);
    check(ctx, mha(1, 1, 64, 64), flash, AttentionOptions::default(), 10, true);
}

#[test]
fn smaller_than_one_tile() {
    let Some(ctx) = gpu("smaller_than_one_tile") else { return };
    for seqlen in [1, 2, 3, 17] {
        let flash = Kernel::Flash(TileConfig::new(64, 64), DqAccumulation::Deterministic);
        check(ctx, mha(1, 2, seqlen, 32), flash, AttentionOptions::default(), 20, true);
        check(ctx, mha(1, 2, seqlen, 32), Kernel::Naive, AttentionOptions::default(), 20, true);
    }
}

#[test]
fn ragged_tail_lengths() {
    let Some(ctx) = gpu("ragged_tail_lengths") else { return };
    for seqlen in [113, 239, 799, 1023] {
        for causal in [Causal::None, Causal::TopLeft] {
            let flash = Kernel::Flash(TileConfig::default_for(64), DqAccumulation::Atomic);
            check(ctx, mha(1, 2, seqlen, 64), flash, AttentionOptions::causal(causal), 30, true);
        }
    }
}

#[test]
fn cross_attention_lengths_with_every_mask() {
    let Some(ctx) = gpu("cross_attention_lengths_with_every_mask") else { return };
    for (seqlen_q, seqlen_k) in [(1, 300), (300, 1), (17, 239), (239, 17), (100, 37), (37, 100)] {
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            let shape = AttentionShape { batch: 2, num_heads_q: 3, num_heads_kv: 3, seqlen_q, seqlen_k, head_dim: 128 };
            let options = AttentionOptions::causal(causal);
            let flash = Kernel::Flash(TileConfig::default_for(128), DqAccumulation::Deterministic);
            check(ctx, shape, flash, options, 40, true);
            check(ctx, shape, Kernel::Naive, options, 40, true);
        }
    }
}

/// Bottom-right alignment with seqlen_q > seqlen_k: the first seqlen_q − seqlen_k queries see no
/// key at all. They must get O = 0, LSE = −∞ and zero dQ, and no NaN may appear anywhere.
#[test]
fn rows_that_see_no_key() {
    let Some(ctx) = gpu("rows_that_see_no_key") else { return };
    let shape = AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 2, seqlen_q: 50, seqlen_k: 20, head_dim: 64 };
    let options = AttentionOptions::causal(Causal::BottomRight);
    let empty_rows = shape.seqlen_q - shape.seqlen_k;
    for kernel in [
        Kernel::Naive,
        Kernel::Flash(TileConfig::new(16, 16), DqAccumulation::Atomic),
        Kernel::Flash(TileConfig::new(64, 32), DqAccumulation::Deterministic),
    ] {
        check(ctx, shape, kernel, options, 90, true);
        let problem = Problem::new(ctx, shape, 91);
        let fwd = problem.forward(ctx, kernel, &options);
        let grads = problem.backward(ctx, kernel, &options, &fwd);
        let (o, lse, dq) = (fwd.o.to_host().unwrap(), fwd.lse.to_host().unwrap(), grads.dq.to_host().unwrap());
        for head in 0..shape.num_heads_q {
            for row in head * shape.seqlen_q..head * shape.seqlen_q + empty_rows {
                assert_eq!(lse[row], f32::NEG_INFINITY, "{kernel:?}: LSE of empty row {row}");
                let d = shape.head_dim;
                assert!(o[row * d..(row + 1) * d].iter().all(|&x| x == 0.0), "{kernel:?}: O of empty row {row}");
                assert!(dq[row * d..(row + 1) * d].iter().all(|&x| x == 0.0), "{kernel:?}: dQ of empty row {row}");
            }
        }
        for (name, t) in [("dk", &grads.dk), ("dv", &grads.dv)] {
            assert!(t.to_host().unwrap().iter().all(|x| x.is_finite()), "{kernel:?}: {name} has a non-finite value");
        }
    }
}

#[test]
fn gqa_8_to_1_and_mqa() {
    let Some(ctx) = gpu("gqa_8_to_1_and_mqa") else { return };
    for heads_kv in [1, 2] {
        let shape = AttentionShape {
            batch: 2,
            num_heads_q: 8 * heads_kv,
            num_heads_kv: heads_kv,
            seqlen_q: 129,
            seqlen_k: 129,
            head_dim: 64,
        };
        for causal in [Causal::None, Causal::TopLeft] {
            let options = AttentionOptions::causal(causal);
            check(ctx, shape, Kernel::Flash(TileConfig::new(32, 64), DqAccumulation::Atomic), options, 50, true);
            check(ctx, shape, Kernel::Naive, options, 50, true);
        }
    }
}

#[test]
fn explicit_scale_and_large_logits() {
    let Some(ctx) = gpu("explicit_scale_and_large_logits") else { return };
    // scale 2.0 on standard-normal inputs with head_dim 128 gives logits in the hundreds: the
    // running max must keep exp from overflowing.
    for scale in [0.0, 0.01, 2.0] {
        let options = AttentionOptions::with_scale(scale);
        let flash = Kernel::Flash(TileConfig::new(32, 32), DqAccumulation::Deterministic);
        check(ctx, mha(1, 2, 200, 128), flash, options, 60, true);
        check(ctx, mha(1, 2, 200, 128), Kernel::Naive, options, 60, true);
    }
}

#[test]
fn vit_b16_shape() {
    let Some(ctx) = gpu("vit_b16_shape") else { return };
    let flash = Kernel::Flash(TileConfig::default_for(64), DqAccumulation::Atomic);
    check(ctx, mha(2, 12, 197, 64), flash, AttentionOptions::default(), 70, true);
    check(ctx, mha(2, 12, 197, 64), Kernel::Naive, AttentionOptions::default(), 70, true);
}

/// The deterministic backward gives the same bits on every run; the atomic one the same dK and
/// dV (only dQ is summed by atomics).
#[test]
fn deterministic_backward_is_bit_identical_across_runs() {
    let Some(ctx) = gpu("deterministic_backward_is_bit_identical_across_runs") else { return };
    let shape =
        AttentionShape { batch: 2, num_heads_q: 8, num_heads_kv: 2, seqlen_q: 1000, seqlen_k: 1000, head_dim: 64 };
    let problem = Problem::new(ctx, shape, 100);
    let options = AttentionOptions::causal(Causal::TopLeft);
    let bits = |t: &DeviceTensor| t.to_host().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for mode in [DqAccumulation::Deterministic, DqAccumulation::Atomic] {
        let kernel = Kernel::Flash(TileConfig::new(64, 64), mode);
        let fwd = problem.forward(ctx, kernel, &options);
        let runs: Vec<[Vec<u32>; 3]> = (0..3)
            .map(|_| {
                let g = problem.backward(ctx, kernel, &options, &fwd);
                [bits(&g.dq), bits(&g.dk), bits(&g.dv)]
            })
            .collect();
        for run in &runs[1..] {
            if mode == DqAccumulation::Deterministic {
                assert!(run[0] == runs[0][0], "deterministic dQ differs between runs");
            }
            assert!(run[1] == runs[0][1] && run[2] == runs[0][2], "{mode:?}: dK or dV differs between runs");
        }
    }
}

#[test]
fn flash_and_naive_agree_on_a_long_causal_sequence() {
    let Some(ctx) = gpu("flash_and_naive_agree_on_a_long_causal_sequence") else { return };
    // Too large for the full CPU reference in a test: flash against naive on the whole problem.
    let shape = mha(1, 4, 4096, 64);
    let problem = Problem::new(ctx, shape, 80);
    let options = AttentionOptions::causal(Causal::TopLeft);
    let flash_kernel = Kernel::Flash(TileConfig::default_for(64), DqAccumulation::Atomic);
    let (flash, naive) = (problem.forward(ctx, flash_kernel, &options), problem.forward(ctx, Kernel::Naive, &options));
    let (flash_grads, naive_grads) =
        (problem.backward(ctx, flash_kernel, &options, &flash), problem.backward(ctx, Kernel::Naive, &options, &naive));
    let as_f64 = |t: &DeviceTensor| t.to_host().unwrap().iter().map(|&x| x as f64).collect::<Vec<_>>();
    for (name, got, want, tolerance) in [
        ("O", &flash.o, &naive.o, 2.0 * O_TOLERANCE),
        ("dQ", &flash_grads.dq, &naive_grads.dq, 2.0 * GRAD_TOLERANCE),
        ("dK", &flash_grads.dk, &naive_grads.dk, 2.0 * GRAD_TOLERANCE),
        ("dV", &flash_grads.dv, &naive_grads.dv, 2.0 * GRAD_TOLERANCE),
    ] {
        let err = relative_l2_error(&got.to_host().unwrap(), &as_f64(want));
        assert!(err <= tolerance, "flash vs naive {name}: {err:.3e}");
    }
}
