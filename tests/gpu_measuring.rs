//! On the GPU: what the benchmarks and `--tune` read from the device. A tile sweep reports the
//! resources of every compiled tile (registers from the loaded function, shared memory, blocks
//! per SM that fit), the peak-memory measurement sees the naive kernels' N×N matrix and
//! FlashAttention's absence of one, and an allocation too large for the device is reported as
//! out of memory without harming the context.

mod common;

use std::sync::Mutex;

use attn_host::check::random_normal;
use attn_host::tune::{Pass, SweepTiming, sweep_len, sweep_tiles};
use attn_host::{AttentionOptions, Causal, DType, DqAccumulation, FlashKernel, TileConfig};
use common::{gpu, mha};

/// The tests here share one context and its memory pool; `Context::peak_memory` reads the pool's
/// high-water mark, which counts every thread's allocations, so they run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn a_sweep_reports_every_tile_with_its_resources() {
    let Some(ctx) = gpu("a_sweep_reports_every_tile_with_its_resources") else { return };
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let shape = mha(1, 4, 300, 64);
    let timing = SweepTiming { warmup: 1, repeats: 2 };
    for dtype in [DType::F32, DType::F16] {
        for pass in [Pass::Forward, Pass::Backward] {
            let mut seen = 0;
            let sweep =
                sweep_tiles(ctx, &shape, dtype, Causal::TopLeft, pass, timing, &mut |_| seen += 1).expect("sweep runs");
            // Every compiled tile that fits the device (every one on an H200; fewer under a
            // smaller GPU's profile).
            let kernel = if pass == Pass::Forward { FlashKernel::Forward } else { FlashKernel::Backward };
            let fits = |tile: &TileConfig, dq| match (pass, dq) {
                (Pass::Forward, _) => tile.validate_kernel(kernel, dtype, 64, ctx.device()).is_ok(),
                (Pass::Backward, DqAccumulation::Atomic) => {
                    tile.validate_kernel(FlashKernel::Backward, dtype, 64, ctx.device()).is_ok()
                }
                (Pass::Backward, DqAccumulation::Deterministic) => [FlashKernel::BackwardDkDv, FlashKernel::BackwardDq]
                    .iter()
                    .all(|&k| tile.validate_kernel(k, dtype, 64, ctx.device()).is_ok()),
            };
            let modes: &[DqAccumulation] = if pass == Pass::Forward {
                &[DqAccumulation::Atomic]
            } else {
                &[DqAccumulation::Atomic, DqAccumulation::Deterministic]
            };
            let fitting = TileConfig::compiled_for(kernel, dtype, 64)
                .iter()
                .map(|tile| modes.iter().filter(|&&dq| fits(tile, dq)).count())
                .sum::<usize>();
            assert!(fitting <= sweep_len(pass, dtype, 64));
            assert_eq!(sweep.len(), fitting, "{dtype} {pass:?}: every compiled tile that fits {}", ctx.device().name);
            assert_eq!(seen, sweep.len(), "the callback runs once per measurement");
            for m in &sweep {
                let kernel = match m.dq {
                    None => FlashKernel::Forward,
                    Some(DqAccumulation::Atomic) => FlashKernel::Backward,
                    Some(DqAccumulation::Deterministic) => FlashKernel::BackwardDkDv,
                };
                assert!(m.ms > 0.0 && m.tflops > 0.0, "{m:?}");
                assert!((1..=255).contains(&m.registers), "{m:?}");
                assert!(m.blocks_per_sm >= 1, "a tile that cannot be resident could not launch: {m:?}");
                assert!(m.blocks_per_sm * m.threads <= 2048, "{m:?}");
                assert_eq!(m.shared_memory_bytes, m.tile.shared_memory_bytes_for(kernel, dtype, 64), "{m:?}");
                assert!(m.causal);
            }
        }
    }
}

#[test]
fn peak_memory_sees_the_score_matrix_and_only_it() {
    let Some(ctx) = gpu("peak_memory_sees_the_score_matrix_and_only_it") else { return };
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let shape = mha(2, 4, 1000, 64);
    let n: usize = shape.q_shape().iter().product();
    let [q, k, v] = [1, 2, 3].map(|seed| ctx.upload(&random_normal(n, seed), &shape.q_shape()).expect("upload"));
    let options = AttentionOptions::default();
    let (_, naive) = ctx.peak_memory(|| ctx.attention_naive(&q, &k, &v, &options)).expect("naive runs");
    let outputs = (n + shape.query_rows()) * 4;
    let scores = shape.naive_workspace_bytes();
    // The pool rounds allocations up (2 MiB granularity): allow that much per buffer.
    let slack = 3 * (2 << 20);
    assert!(
        naive >= scores + outputs && naive <= scores + outputs + slack,
        "naive peak {naive} vs {scores} + {outputs}"
    );
    let tile = common::on_device(ctx, TileConfig::default_for(64), DType::F32, 64, None);
    let (_, flash) = ctx.peak_memory(|| ctx.flash_attention_forward(&q, &k, &v, &options, tile)).expect("flash runs");
    assert!(flash >= outputs && flash <= outputs + slack, "flash peak {flash} vs outputs {outputs}");
}

#[test]
fn an_allocation_larger_than_the_device_is_out_of_memory_and_harmless() {
    let Some(ctx) = gpu("an_allocation_larger_than_the_device_is_out_of_memory_and_harmless") else { return };
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // A score matrix of 64 heads × 65536² floats: 1 TiB, more than any GPU has.
    let shape = mha(1, 64, 65536, 16);
    let n: usize = shape.q_shape().iter().product();
    let x = ctx.upload(&random_normal(n, 1), &shape.q_shape()).expect("upload");
    let error = ctx.attention_naive(&x, &x, &x, &AttentionOptions::default()).expect_err("cannot fit");
    assert!(error.is_out_of_memory(), "{error}");
    // The context still works.
    let small = ctx.upload(&random_normal(1000, 2), &[1000]).expect("upload");
    let sum = ctx.vector_add(&small, &small).expect("runs").to_host().expect("download");
    assert_eq!(sum[7], 2.0 * random_normal(1000, 2)[7]);
}
