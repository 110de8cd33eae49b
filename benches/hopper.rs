//! `cargo bench --bench hopper`: the `wgmma` FlashAttention forward (sm_90a, first version: one
//! warpgroup per 64 query rows, head_dim 64; `kernels/src/flash_forward_wgmma.rs`) next to the `mma.sync`
//! forward (sm_80 PTX, its built-in tile) on the same inputs, FlashAttention-2's benchmark shape
//! 4 × 16 × 4096 × 64, non-causal and causal, f16 and bf16. TFLOP/s in the field's convention.
//! Needs a GPU of compute capability 9.0; elsewhere it says so and exits successfully.

#[path = "common/mod.rs"]
mod common;

use attn_host::check::random_normal;
use attn_host::dtype::from_f32_slice;
use attn_host::timing::{tflops, time_gpu};
use attn_host::{AttentionOptions, AttentionShape, Causal, Context, DType, Element, Result, TileConfig, bf16, f16};

fn main() -> Result<()> {
    let Some(ctx) = common::open_gpu("hopper") else { return Ok(()) };
    if !ctx.has_hopper_kernels() {
        println!("hopper: skipped: {} is not compute capability 9.0", ctx.device().name);
        return Ok(());
    }
    let shape =
        AttentionShape { batch: 4, num_heads_q: 16, num_heads_kv: 16, seqlen_q: 4096, seqlen_k: 4096, head_dim: 64 };
    println!("\n| dtype | causal | mma.sync forward (TFLOP/s) | wgmma forward (TFLOP/s) |");
    println!("|---|---|---:|---:|");
    for causal in [Causal::None, Causal::TopLeft] {
        compare::<f16>(&ctx, &shape, causal)?;
        compare::<bf16>(&ctx, &shape, causal)?;
    }
    Ok(())
}

fn compare<T: Element>(ctx: &Context, shape: &AttentionShape, causal: Causal) -> Result<()> {
    let n: usize = shape.q_shape().iter().product();
    let upload = |seed| ctx.upload(&from_f32_slice::<T>(&random_normal(n, seed)), &shape.q_shape());
    let (q, k, v) = (upload(1)?, upload(2)?, upload(3)?);
    let options = AttentionOptions::causal(causal);
    let flops = options.forward_flops(shape);
    let tile = TileConfig::default_for_dtype(T::DTYPE, shape.head_dim);
    let mut out = ctx.flash_attention_forward(&q, &k, &v, &options, tile)?;
    let mma = time_gpu(ctx, 5, 20, || ctx.flash_attention_forward_into(&q, &k, &v, &mut out, &options, tile))?;
    let wgmma = time_gpu(ctx, 5, 20, || ctx.flash_attention_forward_hopper_into(&q, &k, &v, &mut out, &options))?;
    let mask = if causal == Causal::None { "–" } else { "top-left" };
    let dtype: DType = T::DTYPE;
    println!("| {dtype} | {mask} | {:.1} | {:.1} |", tflops(flops, mma.median_ms), tflops(flops, wgmma.median_ms));
    Ok(())
}
