//! The Hopper building blocks (`kernels/src/hopper.rs`, PTX for `sm_90a`) on a GPU of compute
//! capability 9.0: `wgmma` reading both operands from shared memory through matrix descriptors
//! (f16 and bf16, one to eight k-steps) against the product in f64, and a TMA load of a 2-D box
//! completing on an `mbarrier`, inside and across the tensor's edges, against the tensor itself.
//! Other GPUs skip these tests with a visible line (they do not load the `sm_90a` module).

mod common;

use attn_host::check::{random_normal, relative_l2_error};
use attn_host::dtype::{from_f32_slice, to_f32_vec};
use attn_host::{Context, DescriptorOffsets, Element, bf16, f16};
use common::gpu;

/// The context, if it runs the `sm_90a` kernels; otherwise a skip line.
fn hopper(test: &str) -> Option<&'static Context> {
    let ctx = gpu(test)?;
    if ctx.has_hopper_kernels() {
        return Some(ctx);
    }
    eprintln!("{test}: skipped: {} is not compute capability 9.0 (no sm_90a kernels)", ctx.device().name);
    None
}

/// C = A · Bᵀ by the probe (with `offsets`) against f64 on the same rounded inputs: relative L2.
fn wgmma_error<T: Element>(ctx: &Context, k: usize, offsets: DescriptorOffsets, seed: u64) -> f64 {
    let (a, b) =
        (from_f32_slice::<T>(&random_normal(64 * k, seed)), from_f32_slice::<T>(&random_normal(64 * k, seed + 1)));
    let (a32, b32) = (to_f32_vec(&a), to_f32_vec(&b));
    let want: Vec<f64> = (0..64 * 64)
        .map(|i| {
            let (row, col) = (i / 64, i % 64);
            (0..k).map(|j| a32[row * k + j] as f64 * b32[col * k + j] as f64).sum()
        })
        .collect();
    let (a, b) = (ctx.upload(&a, &[64, k]).unwrap(), ctx.upload(&b, &[64, k]).unwrap());
    let c = ctx.hopper_probe_wgmma(&a, &b, offsets).unwrap().to_host().unwrap();
    relative_l2_error(&c, &want)
}

#[test]
fn wgmma_from_shared_memory_descriptors_matches_f64() {
    let Some(ctx) = hopper("wgmma_from_shared_memory_descriptors_matches_f64") else { return };
    for k in [16, 32, 64, 128] {
        let offsets = DescriptorOffsets::for_depth(k);
        for (name, err) in
            [("f16", wgmma_error::<f16>(ctx, k, offsets, 1)), ("bf16", wgmma_error::<bf16>(ctx, k, offsets, 3))]
        {
            // Products of 16-bit values are exact in f32; only the f32 sums round.
            if err > 1e-6 {
                // Say whether the two descriptor offsets were read the other way round.
                let swapped = DescriptorOffsets { leading: offsets.stride, stride: offsets.leading };
                let other = wgmma_error::<f16>(ctx, k, swapped, 1);
                panic!("{name} k={k}: relative L2 error {err:.3e} with {offsets:?}; {other:.3e} with {swapped:?}");
            }
        }
    }
}

/// C = A · B by the register-A probe (B MN-major, with `offsets`) against f64: relative L2.
fn register_a_error<T: Element>(ctx: &Context, k: usize, offsets: DescriptorOffsets, seed: u64) -> f64 {
    let (a, b) =
        (from_f32_slice::<T>(&random_normal(64 * k, seed)), from_f32_slice::<T>(&random_normal(k * 64, seed + 1)));
    let (a32, b32) = (to_f32_vec(&a), to_f32_vec(&b));
    let want: Vec<f64> = (0..64 * 64)
        .map(|i| {
            let (row, col) = (i / 64, i % 64);
            (0..k).map(|j| a32[row * k + j] as f64 * b32[j * 64 + col] as f64).sum()
        })
        .collect();
    let (a, b) = (ctx.upload(&a, &[64, k]).unwrap(), ctx.upload(&b, &[k, 64]).unwrap());
    let c = ctx.hopper_probe_wgmma_register_a(&a, &b, offsets).unwrap().to_host().unwrap();
    relative_l2_error(&c, &want)
}

#[test]
fn wgmma_with_a_in_registers_and_mn_major_b_matches_f64() {
    let Some(ctx) = hopper("wgmma_with_a_in_registers_and_mn_major_b_matches_f64") else { return };
    let offsets = DescriptorOffsets::mn_major_n64();
    for k in [16, 64, 128] {
        for (name, err) in [
            ("f16", register_a_error::<f16>(ctx, k, offsets, 11)),
            ("bf16", register_a_error::<bf16>(ctx, k, offsets, 13)),
        ] {
            assert!(err <= 1e-6, "{name} k={k}: relative L2 error {err:.3e} with {offsets:?}");
        }
    }
}

#[test]
fn tma_box_loads_match_the_tensor_and_fill_zeros_outside() {
    let Some(ctx) = hopper("tma_box_loads_match_the_tensor_and_fill_zeros_outside") else { return };
    let (rows, cols) = (100, 72);
    let host: Vec<f16> = from_f32_slice(&random_normal(rows * cols, 7));
    let tensor = ctx.upload(&host, &[rows, cols]).unwrap();
    // Inside, across the right edge, across the bottom edge, across both.
    for (x, y) in [(0, 0), (8, 30), (32, 0), (0, 60), (40, 50)] {
        let got = ctx.hopper_probe_tma(&tensor, x, y).unwrap().to_host().unwrap();
        for r in 0..64 {
            for c in 0..64 {
                let (row, col) = (y + r, x + c);
                let want = if row < rows && col < cols { host[row * cols + col] } else { f16::ZERO };
                let value = got[r * 64 + c];
                assert_eq!(value.to_bits(), want.to_bits(), "box ({x}, {y}) element ({r}, {c}): {value} != {want}");
            }
        }
    }
}

#[test]
fn probes_refuse_bad_shapes() {
    let Some(ctx) = hopper("probes_refuse_bad_shapes") else { return };
    let a = ctx.upload(&from_f32_slice::<f16>(&random_normal(64 * 24, 1)), &[64, 24]).unwrap();
    let err = ctx.hopper_probe_wgmma(&a, &a, DescriptorOffsets::for_depth(24)).unwrap_err();
    assert!(err.to_string().contains("multiple of 16"), "{err}");
    let odd = ctx.upload(&from_f32_slice::<f16>(&random_normal(10 * 7, 1)), &[10, 7]).unwrap();
    let err = ctx.hopper_probe_tma(&odd, 0, 0).unwrap_err();
    assert!(err.to_string().contains("16 bytes"), "{err}");
}
