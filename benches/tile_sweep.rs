//! `cargo bench --bench tensor_cores`: the `f16`/`bf16` tensor-core FlashAttention kernels on the
//! shapes of the FlashAttention-2 comparison (issue 4), every compiled tile, forward and
//! backward. Prints one ranked table per shape and writes
//!
//! * `bench-results/tensor_core_tiles.csv`: every (shape, pass, tile) measured;
//! * `bench-results/ours.csv`: the fastest tile per (shape, pass), in the columns of
//!   `benches/peers/sdpa_bench.py`, which merges it with PyTorch's FA2 and cuDNN backends:
//!   `python3 benches/peers/sdpa_bench.py --merge bench-results/ours.csv`.
//!
//! Timing: CUDA events, warm-up, median of repeats; inputs are seeded normal draws. TFLOP/s in the
//! field's convention (forward 4·B·H·N²·D, backward 2.5× that). Needs a GPU; without one it says
//! so and exits successfully.

use std::fmt::Write as _;

use attn_host::check::random_normal;
use attn_host::dtype::from_f32_slice;
use attn_host::timing::{tflops, time_gpu};
use attn_host::{
    AttentionOptions, AttentionShape, Context, DType, DqAccumulation, Element, FlashKernel, Result, TileConfig, bf16,
    f16,
};

const WARMUP: usize = 5;
const REPEATS: usize = 20;
const COLUMNS: &str = "impl,backend,dtype,batch,heads,seqlen_q,seqlen_k,head_dim,causal,pass,ms,tflops,status,note";

/// (batch, heads, seqlen, head_dim, dtype): the shapes of issue 4's table.
const SHAPES: &[(usize, usize, usize, usize, DType)] = &[
    (4, 16, 4096, 64, DType::F16),
    (2, 16, 8192, 128, DType::Bf16),
    (256, 12, 197, 64, DType::F16),
    (4, 16, 4096, 64, DType::Bf16),
    (2, 16, 8192, 128, DType::F16),
    (256, 12, 197, 64, DType::Bf16),
];

/// One measurement.
struct Row {
    shape: AttentionShape,
    dtype: DType,
    pass: &'static str,
    /// dQ accumulation of a backward row ("atomic" or "deterministic"); empty for the forward.
    mode: &'static str,
    tile: TileConfig,
    regs: usize,
    smem: usize,
    ms: f64,
    tflops: f64,
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let ctx = match Context::new(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("tensor_cores: skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    println!("device: {}", ctx.device());
    let mut rows = Vec::new();
    for &(batch, heads, seqlen, head_dim, dtype) in SHAPES {
        let shape = AttentionShape {
            batch,
            num_heads_q: heads,
            num_heads_kv: heads,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            head_dim,
        };
        match dtype {
            DType::Bf16 => sweep::<bf16>(&ctx, shape, &mut rows)?,
            _ => sweep::<f16>(&ctx, shape, &mut rows)?,
        }
    }
    write_results(&ctx, &rows)?;
    Ok(())
}

/// Times every compiled tile of `T` at `shape`, forward, and backward in both dQ modes.
fn sweep<T: Element>(ctx: &Context, shape: AttentionShape, rows: &mut Vec<Row>) -> Result<()> {
    let n: usize = shape.q_shape().iter().product();
    let upload = |seed| ctx.upload(&from_f32_slice::<T>(&random_normal(n, seed)), &shape.q_shape());
    let (q, k, v, d_o) = (upload(1)?, upload(2)?, upload(3)?, upload(4)?);
    let options = AttentionOptions::default();
    let flops = options.forward_flops(&shape);
    let (dtype, d) = (T::DTYPE, shape.head_dim);
    let first = rows.len();
    for tile in TileConfig::compiled_for(FlashKernel::Forward, dtype, d) {
        let Ok(entry) = tile.validate_kernel(FlashKernel::Forward, dtype, d, ctx.device()) else { continue };
        let mut out = ctx.flash_attention_forward(&q, &k, &v, &options, tile)?;
        let t =
            time_gpu(ctx, WARMUP, REPEATS, || ctx.flash_attention_forward_into(&q, &k, &v, &mut out, &options, tile))?;
        let (regs, smem) =
            (ctx.kernel_resources(entry)?.0, tile.shared_memory_bytes_for(FlashKernel::Forward, dtype, d));
        rows.push(Row {
            shape,
            dtype,
            pass: "forward",
            mode: "",
            tile,
            regs,
            smem,
            ms: t.median_ms,
            tflops: tflops(flops, t.median_ms),
        });
    }
    let out = ctx.flash_attention_forward(&q, &k, &v, &options, TileConfig::default_for_dtype(dtype, d))?;
    for tile in TileConfig::compiled_for(FlashKernel::Backward, dtype, d) {
        let Ok(entry) = tile.validate_kernel(FlashKernel::Backward, dtype, d, ctx.device()) else { continue };
        let mut grads =
            ctx.flash_attention_backward(&q, &k, &v, &out.o, &out.lse, &d_o, &options, tile, DqAccumulation::Atomic)?;
        for (mode, dq) in [("atomic", DqAccumulation::Atomic), ("deterministic", DqAccumulation::Deterministic)] {
            let t = time_gpu(ctx, 2, REPEATS / 2, || {
                ctx.flash_attention_backward_into(&q, &k, &v, &out.o, &out.lse, &d_o, &mut grads, &options, tile, dq)
            })?;
            let (regs, smem) =
                (ctx.kernel_resources(entry)?.0, tile.shared_memory_bytes_for(FlashKernel::Backward, dtype, d));
            rows.push(Row {
                shape,
                dtype,
                pass: "backward",
                mode,
                tile,
                regs,
                smem,
                ms: t.median_ms,
                tflops: tflops(2.5 * flops, t.median_ms),
            });
        }
    }
    rows[first..].sort_by(|a, b| a.pass.cmp(b.pass).then(a.ms.total_cmp(&b.ms)));
    let s = shape;
    println!(
        "\n### [{}, {}, {}, {}] {dtype}, non-causal\n\n| pass | dQ | tile (m, n, stages) | warps | regs | smem (KiB) | time (ms) | TFLOP/s |\n|---|---|---|---|---|---|---|---|",
        s.batch, s.num_heads_q, s.seqlen_q, s.head_dim
    );
    for r in &rows[first..] {
        let kernel = if r.pass == "forward" { FlashKernel::Forward } else { FlashKernel::Backward };
        println!(
            "| {} | {} | ({}, {}, {}) | {} | {} | {:.1} | {:.3} | {:.1} |",
            r.pass,
            r.mode,
            r.tile.block_m,
            r.tile.block_n,
            r.tile.stages,
            r.tile.warps(kernel, dtype),
            r.regs,
            r.smem as f64 / 1024.0,
            r.ms,
            r.tflops
        );
    }
    Ok(())
}

/// Writes every row, and the fastest per (shape, dtype, pass) in the peers' columns.
fn write_results(ctx: &Context, rows: &[Row]) -> std::io::Result<()> {
    let line = |r: &Row, implementation: &str| {
        let s = r.shape;
        format!(
            "{implementation},{}{}{},{},{},{},{},{},{},none,{},{:.4},{:.2},ok,{} regs {} B smem\n",
            r.tile,
            if r.mode.is_empty() { "" } else { " " },
            r.mode,
            r.dtype,
            s.batch,
            s.num_heads_q,
            s.seqlen_q,
            s.seqlen_k,
            s.head_dim,
            r.pass,
            r.ms,
            r.tflops,
            r.regs,
            r.smem
        )
    };
    let (mut all, mut best) = (format!("{COLUMNS}\n"), format!("{COLUMNS}\n"));
    for r in rows {
        all.push_str(&line(r, "rust-mma"));
        let fastest = rows
            .iter()
            .filter(|o| o.shape == r.shape && o.dtype == r.dtype && o.pass == r.pass)
            .min_by(|a, b| a.ms.total_cmp(&b.ms));
        if fastest.is_some_and(|f| std::ptr::eq(f, r)) {
            best.push_str(&line(r, "rust-mma"));
        }
    }
    let _ = writeln!(all, "# device: {}", ctx.device().name);
    std::fs::create_dir_all("bench-results")?;
    for (file, text) in [("bench-results/tensor_core_tiles.csv", all), ("bench-results/ours.csv", best)] {
        std::fs::write(file, text)?;
        println!("wrote {file}");
    }
    Ok(())
}
