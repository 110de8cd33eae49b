//! `cargo bench --bench hopper`: the FlashAttention forward on both kernel paths (sm_80
//! `mma.sync`, built-in tile; sm_90a `wgmma` + TMA, `kernels/src/flash_forward_wgmma.rs`) and the
//! backward pass (sm_80 on both paths) on the same inputs, for the shapes of issue #9:
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
    AttentionOptions, AttentionShape, Causal, Context, DType, DqAccumulation, Element, KernelPath, Result, TileConfig,
    bf16, f16,
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
        "| shape (B, H, N, D) | dtype | causal | fwd sm_80 | fwd sm_90a | bwd (sm_80) |\n|---|---|---|---:|---:|---:|\n",
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

/// One table row: the forward on each path and the backward, TFLOP/s.
fn compare<T: Element>(sm80: &Context, sm90a: &Context, shape: &AttentionShape, causal: Causal) -> Result<String> {
    let options = AttentionOptions::causal(causal);
    let flops = options.forward_flops(shape);
    let tile = TileConfig::default_for_dtype(T::DTYPE, shape.head_dim);
    let n: usize = shape.q_shape().iter().product();
    let host: Vec<Vec<T>> = (1..=4).map(|seed| from_f32_slice::<T>(&random_normal(n, seed))).collect();
    let forward = |ctx: &Context| -> Result<f64> {
        let [q, k, v] = [0, 1, 2].map(|i| ctx.upload(&host[i], &shape.q_shape()));
        let (q, k, v) = (q?, k?, v?);
        let mut out = ctx.flash_attention_forward(&q, &k, &v, &options, tile)?;
        let timing =
            time_gpu(ctx, WARMUP, REPEATS, || ctx.flash_attention_forward_into(&q, &k, &v, &mut out, &options, tile))?;
        Ok(tflops(flops, timing.median_ms))
    };
    let (fwd80, fwd90) = (forward(sm80)?, forward(sm90a)?);

    let [q, k, v, d_o] = [0, 1, 2, 3].map(|i| sm80.upload(&host[i], &shape.q_shape()));
    let (q, k, v, d_o) = (q?, k?, v?, d_o?);
    let out = sm80.flash_attention_forward(&q, &k, &v, &options, tile)?;
    let (bwd_tile, dq) =
        (TileConfig::default_backward_for_dtype(T::DTYPE, shape.head_dim), DqAccumulation::fastest_for(T::DTYPE));
    let mut grads = sm80.flash_attention_backward(&q, &k, &v, &out.o, &out.lse, &d_o, &options, bwd_tile, dq)?;
    let backward = time_gpu(sm80, WARMUP, REPEATS, || {
        sm80.flash_attention_backward_into(&q, &k, &v, &out.o, &out.lse, &d_o, &mut grads, &options, bwd_tile, dq)
    })?;
    let bwd = tflops(2.5 * flops, backward.median_ms);

    let s = shape;
    let mask = if causal == Causal::None { "–" } else { "top-left" };
    let dtype: DType = T::DTYPE;
    Ok(format!(
        "| {}, {}, {}, {} | {dtype} | {mask} | {fwd80:.1} | {fwd90:.1} | {bwd:.1} |",
        s.batch, s.num_heads_q, s.seqlen_q, s.head_dim
    ))
}
