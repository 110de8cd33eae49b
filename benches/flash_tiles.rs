//! `cargo bench --bench flash_tiles`: every compiled FlashAttention tile, forward and backward, at
//! a size that fills the GPU, naive attention at the same size, and vector-add bandwidth. Needs a
//! GPU; without one it says so and exits successfully.

use attn_host::check::random_normal;
use attn_host::timing::{tflops, time_gpu};
use attn_host::{
    AttentionOptions, AttentionOutput, AttentionShape, Context, DType, DqAccumulation, FlashKernel, Result, TileConfig,
};

const WARMUP: usize = 3;
const REPEATS: usize = 15;

fn main() -> Result<()> {
    let ctx = match Context::new(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("flash_tiles: skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    println!("device: {}", ctx.device());
    vector_add_bandwidth(&ctx)?;
    small_problem_overhead(&ctx)?;
    let options = AttentionOptions::default();
    println!("\n| head_dim | pass | block_m | block_n | smem (KiB) | regs | time (ms) | TFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for head_dim in TileConfig::compiled_head_dims_for(DType::F32) {
        let shape =
            AttentionShape { batch: 4, num_heads_q: 16, num_heads_kv: 16, seqlen_q: 4096, seqlen_k: 4096, head_dim };
        let n: usize = shape.q_shape().iter().product();
        let q = ctx.upload(&random_normal(n, 1), &shape.q_shape())?;
        let k = ctx.upload(&random_normal(n, 2), &shape.kv_shape())?;
        let v = ctx.upload(&random_normal(n, 3), &shape.kv_shape())?;
        let d_o = ctx.upload(&random_normal(n, 4), &shape.q_shape())?;
        let forward_flops = shape.forward_flops();
        let mut rows = Vec::new();
        for tile in TileConfig::compiled(head_dim) {
            if let Ok(entry) = tile.validate(head_dim, ctx.device()) {
                let t = time_gpu(&ctx, WARMUP, REPEATS, || {
                    ctx.flash_attention_forward(&q, &k, &v, &options, tile).map(drop)
                })?;
                rows.push((
                    "forward",
                    t.median_ms,
                    tile,
                    ctx.kernel_resources(entry)?.0,
                    tile.shared_memory_bytes(head_dim),
                    forward_flops,
                ));
            }
            if let Ok(entry) = tile.validate_for(FlashKernel::Backward, head_dim, ctx.device()) {
                let out = ctx.flash_attention_forward(&q, &k, &v, &options, tile)?;
                let backward = || {
                    ctx.flash_attention_backward(
                        &q,
                        &k,
                        &v,
                        &out.o,
                        &out.lse,
                        &d_o,
                        &options,
                        tile,
                        DqAccumulation::Atomic,
                    )
                };
                let t = time_gpu(&ctx, 1, 5, || backward().map(drop))?;
                let smem = tile.shared_memory_bytes_for(FlashKernel::Backward, DType::F32, head_dim);
                rows.push(("backward", t.median_ms, tile, ctx.kernel_resources(entry)?.0, smem, 2.5 * forward_flops));
            }
        }
        rows.sort_by(|a, b| a.0.cmp(b.0).then(a.1.total_cmp(&b.1)));
        for (pass, ms, tile, regs, smem, flops) in rows {
            let (m, n, kib, tf) = (tile.block_m, tile.block_n, smem as f64 / 1024.0, tflops(flops, ms));
            println!("| {head_dim} | flash {pass} | {m} | {n} | {kib:.1} | {regs} | {ms:.3} | {tf:.2} |");
        }
        let t = time_gpu(&ctx, 1, 5, || ctx.attention_naive(&q, &k, &v, &options).map(drop))?;
        println!(
            "| {head_dim} | naive forward | - | - | - | - | {:.3} | {:.2} |",
            t.median_ms,
            tflops(forward_flops, t.median_ms)
        );
    }
    Ok(())
}

fn vector_add_bandwidth(ctx: &Context) -> Result<()> {
    println!("\n| n | vector_add (ms) | GB/s (12 bytes per element) |");
    println!("|---|---|---|");
    for log2 in [20, 24, 26, 28] {
        let n = 1usize << log2;
        let a = ctx.upload(&random_normal(n, 4), &[n])?;
        let b = ctx.upload(&random_normal(n, 5), &[n])?;
        let mut c = ctx.full(&[n], 0.0)?;
        let t = time_gpu(ctx, WARMUP, REPEATS, || ctx.vector_add_into(&a, &b, &mut c))?;
        println!("| 2^{log2} | {:.4} | {:.0} |", t.median_ms, 12.0 * n as f64 / (t.median_ms * 1e-3) / 1e9);
    }
    Ok(())
}

/// A ViT-B/16-sized forward (8 × 12 × 197 × 64, one wave of blocks, tens of microseconds): the
/// allocating call against the `_into` call that reuses its outputs, to show how much of a small
/// problem's time is host-side work (allocation, argument checks, launch).
fn small_problem_overhead(ctx: &Context) -> Result<()> {
    let shape =
        AttentionShape { batch: 8, num_heads_q: 12, num_heads_kv: 12, seqlen_q: 197, seqlen_k: 197, head_dim: 64 };
    let n: usize = shape.q_shape().iter().product();
    let q = ctx.upload(&random_normal(n, 1), &shape.q_shape())?;
    let k = ctx.upload(&random_normal(n, 2), &shape.kv_shape())?;
    let v = ctx.upload(&random_normal(n, 3), &shape.kv_shape())?;
    let (options, tile) = (AttentionOptions::default(), TileConfig::default_for(64));
    let mut out = AttentionOutput { o: ctx.full(&shape.q_shape(), 0.0)?, lse: ctx.full(&shape.lse_shape(), 0.0)? };
    let allocating = time_gpu(ctx, 10, 50, || ctx.flash_attention_forward(&q, &k, &v, &options, tile).map(drop))?;
    let into = time_gpu(ctx, 10, 50, || ctx.flash_attention_forward_into(&q, &k, &v, &mut out, &options, tile))?;
    println!("\n| ViT-B/16 forward [8, 12, 197, 64] | median (ms) | min (ms) |");
    println!("|---|---|---|");
    println!("| flash_attention_forward (allocates O, LSE) | {:.4} | {:.4} |", allocating.median_ms, allocating.min_ms);
    println!("| flash_attention_forward_into | {:.4} | {:.4} |", into.median_ms, into.min_ms);
    Ok(())
}
