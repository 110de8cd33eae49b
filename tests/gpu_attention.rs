//! GPU attention (naive and FlashAttention forward) against the float64 CPU reference.
//!
//! Every output is poisoned with NaN before the launch, so an element a kernel fails to write
//! fails the error check. Inputs are seeded standard-normal draws, fresh for every case.

mod common;

use attn_host::check::{random_normal, relative_l2_error};
use attn_host::{AttentionOptions, AttentionOutput, AttentionShape, Context, TileConfig, cpu};
use common::{gpu, gpu_proptest_config, mha};
use proptest::prelude::*;

/// Tolerances of this issue: relative L2 error against the float64 reference.
const O_TOLERANCE: f64 = 1e-5;
const LSE_TOLERANCE: f64 = 1e-5;

#[derive(Clone, Copy, Debug)]
enum Kernel {
    Naive,
    Flash(TileConfig),
}

/// Runs `kernel` on fresh random inputs of `shape` and checks O and LSE against the CPU.
fn check(ctx: &Context, shape: AttentionShape, kernel: Kernel, options: AttentionOptions, seed: u64) {
    let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
    let q_host = random_normal(q_shape.iter().product(), seed);
    let k_host = random_normal(kv_shape.iter().product(), seed + 1);
    let v_host = random_normal(kv_shape.iter().product(), seed + 2);
    let q = ctx.upload(&q_host, &q_shape).unwrap();
    let k = ctx.upload(&k_host, &kv_shape).unwrap();
    let v = ctx.upload(&v_host, &kv_shape).unwrap();
    let mut out = AttentionOutput {
        o: ctx.full(&q_shape, f32::NAN).unwrap(),
        lse: ctx.full(&shape.lse_shape(), f32::NAN).unwrap(),
    };
    match kernel {
        Kernel::Naive => ctx.attention_naive_into(&q, &k, &v, &mut out, &options).unwrap(),
        Kernel::Flash(tile) => ctx.flash_attention_forward_into(&q, &k, &v, &mut out, &options, tile).unwrap(),
    }
    let (o, lse) = (out.o.to_host().unwrap(), out.lse.to_host().unwrap());
    let reference = cpu::attention(&q_host, &k_host, &v_host, &shape, options.scale_for(shape.head_dim) as f64);
    let (err_o, err_lse) = (relative_l2_error(&o, &reference.o), relative_l2_error(&lse, &reference.lse));
    assert!(
        err_o <= O_TOLERANCE && err_lse <= LSE_TOLERANCE,
        "{kernel:?} on {shape:?}: relative L2 error O {err_o:.3e}, LSE {err_lse:.3e} (tolerance {O_TOLERANCE:.0e})"
    );
}

/// A shape in the test's range with a compiled head_dim, seqlen_q and seqlen_k drawn
/// independently (cross-attention), and a GQA ratio from {1, 2, 4}.
fn shapes() -> impl Strategy<Value = AttentionShape> {
    (
        1usize..=3,
        1usize..=4,
        prop::sample::select(vec![1usize, 2, 4]),
        1usize..=300,
        1usize..=300,
        prop::sample::select(TileConfig::compiled_head_dims()),
    )
        .prop_map(|(batch, heads_kv, group, seqlen_q, seqlen_k, head_dim)| AttentionShape {
            batch,
            num_heads_q: heads_kv * group,
            num_heads_kv: heads_kv,
            seqlen_q,
            seqlen_k,
            head_dim,
        })
}

/// Any compiled tile (all fit an H200; the test picks again if one does not fit the device).
fn tiles() -> impl Strategy<Value = TileConfig> {
    prop::sample::select(TileConfig::compiled(64))
}

// The GPU is looked up once per test, before proptest starts: without a GPU (and with
// REQUIRE_GPU=1) the test fails once instead of once per shrinking step.

#[test]
fn flash_matches_cpu_on_random_shapes_and_tiles() {
    let Some(ctx) = gpu("flash_matches_cpu_on_random_shapes_and_tiles") else { return };
    proptest!(gpu_proptest_config(48), |(shape in shapes(), tile in tiles(), seed in any::<u32>())| {
        let tile = if tile.validate(shape.head_dim, ctx.device()).is_ok() { tile } else { TileConfig::new(16, 16) };
        check(ctx, shape, Kernel::Flash(tile), AttentionOptions::default(), seed as u64 * 3);
    });
}

#[test]
fn naive_matches_cpu_on_random_shapes() {
    let Some(ctx) = gpu("naive_matches_cpu_on_random_shapes") else { return };
    proptest!(gpu_proptest_config(48), |(shape in shapes(), seed in any::<u32>())| {
        check(ctx, shape, Kernel::Naive, AttentionOptions::default(), seed as u64 * 3);
    });
}

/// Every compiled (block_m, block_n, head_dim) instance, on a shape with a ragged tail in both
/// sequence dimensions.
#[test]
fn every_flash_instance_on_a_ragged_shape() {
    let Some(ctx) = gpu("every_flash_instance_on_a_ragged_shape") else { return };
    let mut ran = 0;
    for head_dim in TileConfig::compiled_head_dims() {
        for tile in TileConfig::compiled(head_dim) {
            if tile.validate(head_dim, ctx.device()).is_err() {
                println!("tile {tile:?} at head_dim {head_dim} does not fit {}: skipped", ctx.device().name);
                continue;
            }
            let shape =
                AttentionShape { batch: 2, num_heads_q: 2, num_heads_kv: 1, seqlen_q: 77, seqlen_k: 93, head_dim };
            check(ctx, shape, Kernel::Flash(tile), AttentionOptions::default(), ran);
            ran += 1;
        }
    }
    println!("checked {ran} flash instances");
}

#[test]
fn one_tile() {
    let Some(ctx) = gpu("one_tile") else { return };
    check(ctx, mha(1, 1, 64, 64), Kernel::Flash(TileConfig::new(64, 64)), AttentionOptions::default(), 10);
}

#[test]
fn smaller_than_one_tile() {
    let Some(ctx) = gpu("smaller_than_one_tile") else { return };
    for seqlen in [1, 2, 3, 17] {
        check(ctx, mha(1, 2, seqlen, 32), Kernel::Flash(TileConfig::new(64, 64)), AttentionOptions::default(), 20);
        check(ctx, mha(1, 2, seqlen, 32), Kernel::Naive, AttentionOptions::default(), 20);
    }
}

#[test]
fn ragged_tail_lengths() {
    let Some(ctx) = gpu("ragged_tail_lengths") else { return };
    for seqlen in [113, 239, 799, 1023] {
        check(ctx, mha(1, 2, seqlen, 64), Kernel::Flash(TileConfig::default_for(64)), AttentionOptions::default(), 30);
    }
}

#[test]
fn cross_attention_lengths() {
    let Some(ctx) = gpu("cross_attention_lengths") else { return };
    for (seqlen_q, seqlen_k) in [(1, 300), (300, 1), (17, 239), (239, 17)] {
        let shape = AttentionShape { batch: 2, num_heads_q: 3, num_heads_kv: 3, seqlen_q, seqlen_k, head_dim: 128 };
        check(ctx, shape, Kernel::Flash(TileConfig::default_for(128)), AttentionOptions::default(), 40);
        check(ctx, shape, Kernel::Naive, AttentionOptions::default(), 40);
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
        check(ctx, shape, Kernel::Flash(TileConfig::new(32, 64)), AttentionOptions::default(), 50);
        check(ctx, shape, Kernel::Naive, AttentionOptions::default(), 50);
    }
}

#[test]
fn explicit_scale_and_large_logits() {
    let Some(ctx) = gpu("explicit_scale_and_large_logits") else { return };
    // scale 2.0 on standard-normal inputs with head_dim 128 gives logits in the hundreds: the
    // running max must keep exp from overflowing.
    for scale in [0.0, 0.01, 2.0] {
        let options = AttentionOptions::with_scale(scale);
        check(ctx, mha(1, 2, 200, 128), Kernel::Flash(TileConfig::new(32, 32)), options, 60);
        check(ctx, mha(1, 2, 200, 128), Kernel::Naive, options, 60);
    }
}

#[test]
fn vit_b16_shape() {
    let Some(ctx) = gpu("vit_b16_shape") else { return };
    check(ctx, mha(2, 12, 197, 64), Kernel::Flash(TileConfig::default_for(64)), AttentionOptions::default(), 70);
    check(ctx, mha(2, 12, 197, 64), Kernel::Naive, AttentionOptions::default(), 70);
}

#[test]
fn flash_and_naive_agree_on_a_long_sequence() {
    let Some(ctx) = gpu("flash_and_naive_agree_on_a_long_sequence") else { return };
    // Too large for the full CPU reference in a test; check one head on the CPU and the rest
    // flash against naive.
    let shape = mha(1, 4, 4096, 64);
    let n: usize = shape.q_shape().iter().product();
    let (qh, kh, vh) = (random_normal(n, 80), random_normal(n, 81), random_normal(n, 82));
    let q = ctx.upload(&qh, &shape.q_shape()).unwrap();
    let k = ctx.upload(&kh, &shape.kv_shape()).unwrap();
    let v = ctx.upload(&vh, &shape.kv_shape()).unwrap();
    let options = AttentionOptions::default();
    let flash = ctx.flash_attention_forward(&q, &k, &v, &options, TileConfig::default_for(64)).unwrap();
    let naive = ctx.attention_naive(&q, &k, &v, &options).unwrap();
    let (flash_o, naive_o) = (flash.o.to_host().unwrap(), naive.o.to_host().unwrap());
    let reference = cpu::attention_head(&qh, &kh, &vh, &shape, options.scale_for(64) as f64, 0, 3);
    let head = shape.q_head_offset(0, 3)..shape.q_head_offset(0, 4);
    let err = relative_l2_error(&flash_o[head.clone()], &reference.o);
    assert!(err <= O_TOLERANCE, "flash head 3 vs CPU: {err:.3e}");
    let naive_f64: Vec<f64> = naive_o.iter().map(|&x| x as f64).collect();
    let err = relative_l2_error(&flash_o, &naive_f64);
    assert!(err <= 2.0 * O_TOLERANCE, "flash vs naive: {err:.3e}");
}
