//! GPU vector add against the CPU.

mod common;

use attn_host::check::{random_normal, relative_l2_error};
use attn_host::{Context, cpu};
use common::{gpu, gpu_proptest_config};
use proptest::prelude::*;

fn check_vector_add(ctx: &Context, len: usize, seed: u64) {
    let (a, b) = (random_normal(len, seed), random_normal(len, seed + 1));
    let (da, db) = (ctx.upload(&a, &[len]).unwrap(), ctx.upload(&b, &[len]).unwrap());
    let mut dc = ctx.full(&[len], f32::NAN).unwrap();
    ctx.vector_add_into(&da, &db, &mut dc).unwrap();
    let c = dc.to_host().unwrap();
    let want = cpu::vector_add(&a, &b).unwrap();
    // f32 addition of two f32 values is correctly rounded: the only error is that rounding.
    let err = relative_l2_error(&c, &want);
    assert!(err <= 1e-7, "vector_add of {len}: relative L2 error {err:.3e}");
}

#[test]
fn vector_add_matches_cpu_on_random_lengths() {
    let Some(ctx) = gpu("vector_add_matches_cpu_on_random_lengths") else { return };
    proptest!(gpu_proptest_config(64), |(len in 1usize..200_000, seed in any::<u32>())| {
        check_vector_add(ctx, len, seed as u64);
    });
}

#[test]
fn vector_add_tails_and_tiny_lengths() {
    let Some(ctx) = gpu("vector_add_tails_and_tiny_lengths") else { return };
    for len in [1, 2, 3, 4, 5, 7, 255, 256, 257, 1023, 1025] {
        check_vector_add(ctx, len, len as u64);
    }
}

#[test]
fn vector_add_large() {
    let Some(ctx) = gpu("vector_add_large") else { return };
    // More elements than threads in the grid (32 blocks per SM cap): the grid-stride loop must
    // cover the rest.
    check_vector_add(ctx, (1 << 26) + 3, 7);
}

#[test]
fn vector_add_rejects_mismatched_shapes() {
    let Some(ctx) = gpu("vector_add_rejects_mismatched_shapes") else { return };
    let a = ctx.full(&[10], 1.0).unwrap();
    let b = ctx.full(&[11], 1.0).unwrap();
    let err = ctx.vector_add(&a, &b).unwrap_err();
    assert!(err.to_string().contains("equal shapes"), "{err}");
}
