//! `cargo bench --bench flash_tiles`: every compiled FlashAttention tile at a size that fills the
//! GPU, naive attention at the same size, and vector-add bandwidth. Needs a GPU; without one it
//! says so and exits successfully.

use attn_host::check::random_normal;
use attn_host::timing::{tflops, time_gpu};
use attn_host::{AttentionOptions, AttentionShape, Context, Result, TileConfig};

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
    let options = AttentionOptions::default();
    println!("\n| head_dim | kernel | block_m | block_n | smem (KiB) | regs | time (ms) | TFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for head_dim in TileConfig::compiled_head_dims() {
        let shape =
            AttentionShape { batch: 4, num_heads_q: 16, num_heads_kv: 16, seqlen_q: 4096, seqlen_k: 4096, head_dim };
        let n: usize = shape.q_shape().iter().product();
        let q = ctx.upload(&random_normal(n, 1), &shape.q_shape())?;
        let k = ctx.upload(&random_normal(n, 2), &shape.kv_shape())?;
        let v = ctx.upload(&random_normal(n, 3), &shape.kv_shape())?;
        let mut rows = Vec::new();
        for tile in TileConfig::compiled(head_dim) {
            let Ok(entry) = tile.validate(head_dim, ctx.device()) else { continue };
            let t =
                time_gpu(&ctx, WARMUP, REPEATS, || ctx.flash_attention_forward(&q, &k, &v, &options, tile).map(drop))?;
            let (regs, _) = ctx.kernel_resources(entry)?;
            rows.push((t.median_ms, tile, regs));
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (ms, tile, regs) in rows {
            let smem = tile.shared_memory_bytes(head_dim) as f64 / 1024.0;
            let tf = tflops(shape.forward_flops(), ms);
            println!(
                "| {head_dim} | flash | {} | {} | {smem:.1} | {regs} | {ms:.3} | {tf:.2} |",
                tile.block_m, tile.block_n
            );
        }
        let t = time_gpu(&ctx, 1, 5, || ctx.attention_naive(&q, &k, &v, &options).map(drop))?;
        println!(
            "| {head_dim} | naive | - | - | - | - | {:.3} | {:.2} |",
            t.median_ms,
            tflops(shape.forward_flops(), t.median_ms)
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
