//! `cargo bench --bench hopper`: the FlashAttention forward and backward passes on both kernel
//! paths (sm_80: `mma.sync`, built-in tiles, the faster dQ mode; sm_90a: `wgmma` + TMA,
//! `kernels/src/sm90/{forward,backward}.rs`) on the same inputs, for the shapes of issue #9:
//! 4 × 16 × 4096 × 64 and 2 × 16 × 8192 × 128, non-causal and causal (top-left), f16 and bf16.
//! TFLOP/s in the field's convention (forward 4·B·H·N²·D, backward 2.5 times that, causal half),
//! median of 20 repeats after 5 warm-ups, timed with CUDA events. Writes the table to
//! `bench-results/hopper.md`. Needs a GPU of compute capability 9.0; elsewhere it says so and
//! exits successfully.

#[path = "common/mod.rs"]
mod common;

use std::fmt::Write as _;

use attn_host::check::random_normal;
use attn_host::dtype::from_f32_slice;
use attn_host::timing::{tflops, time_gpu};
use attn_host::{
    AttentionOptions, AttentionShape, Causal, Context, DType, Element, KernelPath, Result, TileConfig, bf16, f16,
};

const WARMUP: usize = 5;
const REPEATS: usize = 20;

fn main() -> Result<()> {
    let Some(ctx) = common::open_gpu("hopper") else { return Ok(()) };
    if !ctx.has_hopper_kernels() {
        println!("hopper: skipped: {} is not compute capability 9.0", ctx.device().name);
        return Ok(());
    }
    let sm90a = ctx.with_kernel_path(KernelPath::Sm90a)?;
    let sm80 = Context::new(sm90a.device().ordinal)?.with_kernel_path(KernelPath::Sm80)?;
    let shape = |batch, seqlen, head_dim| AttentionShape {
        batch,
        num_heads_q: 16,
        num_heads_kv: 16,
        seqlen_q: seqlen,
        seqlen_k: seqlen,
        head_dim,
    };
    let mut table = String::from(
        "| shape (B, H, N, D) | dtype | causal | fwd sm_80 | fwd sm_90a | bwd sm_80 | bwd sm_90a |\n|---|---|---|---:|---:|---:|---:|\n",
    );
    print!("\n{table}");
    for shape in [shape(4, 4096, 64), shape(2, 8192, 128)] {
        for causal in [Causal::None, Causal::TopLeft] {
            for row in [compare::<f16>(&sm80, &sm90a, &shape, causal)?, compare::<bf16>(&sm80, &sm90a, &shape, causal)?]
            {
                println!("{row}");
                writeln!(table, "{row}").unwrap();
            }
        }
    }
    let path = common::result_path("hopper.md");
    std::fs::write(&path, table).expect("bench-results/ is writable");
    println!("wrote {}", path.display());
    Ok(())
}

/// One table row: the forward and backward passes on each path, TFLOP/s.
fn compare<T: Element>(sm80: &Context, sm90a: &Context, shape: &AttentionShape, causal: Causal) -> Result<String> {
    let options = AttentionOptions::causal(causal);
    let flops = options.forward_flops(shape);
    let d = shape.head_dim;
    let (tile, backward_tile) =
        (TileConfig::default_for_dtype(T::DTYPE, d), TileConfig::default_backward_for_dtype(T::DTYPE, d));
    let n: usize = shape.q_shape().iter().product();
    let host: Vec<Vec<T>> = (1..=4).map(|seed| from_f32_slice::<T>(&random_normal(n, seed))).collect();
    // Forward and backward on one context, each with the kernels and dQ mode that context picks.
    let measure = |ctx: &Context| -> Result<(f64, f64)> {
        let [q, k, v, d_o] = [0, 1, 2, 3].map(|i| ctx.upload(&host[i], &shape.q_shape()));
        let (q, k, v, d_o) = (q?, k?, v?, d_o?);
        let mut out = ctx.flash_attention_forward(&q, &k, &v, &options, tile)?;
        let forward =
            time_gpu(ctx, WARMUP, REPEATS, || ctx.flash_attention_forward_into(&q, &k, &v, &mut out, &options, tile))?;
        let dq = ctx.dq_accumulation_for(T::DTYPE, d);
        let (o, lse) = (&out.o, &out.lse);
        let mut grads = ctx.flash_attention_backward(&q, &k, &v, o, lse, &d_o, &options, backward_tile, dq)?;
        let backward = time_gpu(ctx, WARMUP, REPEATS, || {
            ctx.flash_attention_backward_into(&q, &k, &v, o, lse, &d_o, &mut grads, &options, backward_tile, dq)
        })?;
        Ok((tflops(flops, forward.median_ms), tflops(2.5 * flops, backward.median_ms)))
    };
    let ((fwd80, bwd80), (fwd90, bwd90)) = (measure(sm80)?, measure(sm90a)?);
    let s = shape;
    let mask = if causal == Causal::None { "–" } else { "top-left" };
    let dtype: DType = T::DTYPE;
    Ok(format!(
        "| {}, {}, {}, {} | {dtype} | {mask} | {fwd80:.1} | {fwd90:.1} | {bwd80:.1} | {bwd90:.1} |",
        s.batch, s.num_heads_q, s.seqlen_q, s.head_dim
    ))
}
