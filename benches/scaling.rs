//! `cargo bench --bench scaling`: why FlashAttention exists, in numbers. Naive attention (the
//! N×N score matrix in device memory) against FlashAttention (`f32` on the CUDA cores, `f16` on
//! the tensor cores), forward and backward, over sequence lengths 256 … 32768 at batch 4,
//! 16 heads, head_dim 64. For each: time, TFLOP/s and the peak device memory the call allocates
//! beyond its inputs (outputs and workspace, read from the memory pool's high-water mark). Where
//! the naive kernels run out of device memory the table says so and the run goes on.
//!
//! Writes `bench-results/scaling.csv`, `scaling.json`, and two log-log pictures:
//! `scaling_time.svg` (time vs N: both grow as N², flash with a far smaller constant) and
//! `scaling_memory.svg` (memory vs N: N² against N).
//!
//! Timing: CUDA events; calls that take more than a quarter second are timed once (their
//! variation is far below the differences shown), the others after 2 warm-up runs as the median
//! of 7. Needs a GPU; without one it says so and exits successfully.

#[path = "common/mod.rs"]
mod common;

use attn_host::check::random_normal;
use attn_host::dtype::from_f32_slice;
use attn_host::timing::{tflops, time_gpu};
use attn_host::{
    AttentionOptions, AttentionShape, Context, DType, DeviceTensor, DqAccumulation, Element, Result, TileConfig, f16,
};
use common::{Chart, Series};
use serde_json::json;

const SEQLENS: [usize; 8] = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768];
const BATCH: usize = 4;
const HEADS: usize = 16;
const HEAD_DIM: usize = 64;

/// The implementations compared.
const KERNELS: [&str; 3] = ["naive f32", "flash f32", "flash f16"];
const PASSES: [&str; 2] = ["forward", "backward"];

/// One (kernel, pass, seqlen) result: `None` time where it ran out of device memory.
struct Point {
    kernel: &'static str,
    pass: &'static str,
    seqlen: usize,
    ms: Option<f64>,
    tflops: Option<f64>,
    /// Peak device memory beyond the inputs (outputs and workspace), in bytes; for an
    /// out-of-memory point, what the call would have needed at least (its N×N matrix).
    peak_bytes: usize,
    note: String,
}

fn main() -> Result<()> {
    let Some(ctx) = common::open_gpu("scaling") else { return Ok(()) };
    let bar = common::progress(SEQLENS.len() * KERNELS.len() * PASSES.len());
    let mut points = Vec::new();
    for seqlen in SEQLENS {
        let shape = AttentionShape {
            batch: BATCH,
            num_heads_q: HEADS,
            num_heads_kv: HEADS,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            head_dim: HEAD_DIM,
        };
        bar.set_message(format!("N = {seqlen}"));
        measure_seqlen(&ctx, &shape, &mut points, &mut || bar.inc(1))?;
    }
    bar.finish_and_clear();
    print_table(&points);
    write_files(&ctx, &points);
    Ok(())
}

/// The six (kernel, pass) points of one sequence length.
fn measure_seqlen(
    ctx: &Context,
    shape: &AttentionShape,
    points: &mut Vec<Point>,
    step: &mut dyn FnMut(),
) -> Result<()> {
    let n: usize = shape.q_shape().iter().product();
    let host: Vec<Vec<f32>> = (1..=4).map(|seed| random_normal(n, seed)).collect();
    let upload = |i: usize| ctx.upload(&host[i], &shape.q_shape());
    let (q, k, v, d_o) = (upload(0)?, upload(1)?, upload(2)?, upload(3)?);
    let options = AttentionOptions::default();
    let flops = options.forward_flops(shape);
    let mut add = |kernel, pass, result: Result<(f64, usize)>, needs: usize| {
        let flops = if pass == "forward" { flops } else { 2.5 * flops };
        points.push(match result {
            Ok((ms, peak_bytes)) => Point {
                kernel,
                pass,
                seqlen: shape.seqlen_q,
                ms: Some(ms),
                tflops: Some(tflops(flops, ms)),
                peak_bytes,
                note: String::new(),
            },
            Err(e) if e.is_out_of_memory() => Point {
                kernel,
                pass,
                seqlen: shape.seqlen_q,
                ms: None,
                tflops: None,
                peak_bytes: needs,
                note: "out of memory".into(),
            },
            Err(e) => panic!("{kernel} {pass} at N = {} failed: {e}", shape.seqlen_q),
        });
        step();
    };
    let score_bytes = shape.naive_workspace_bytes();

    // Naive: each call allocates its N×N matrix, so the first call measures memory, and an
    // allocation that does not fit is reported, not fatal.
    let naive = measure(
        ctx,
        || ctx.attention_naive(&q, &k, &v, &options),
        |out| ctx.attention_naive_into(&q, &k, &v, out, &options),
    );
    add("naive f32", "forward", naive, score_bytes);

    let tile = TileConfig::default_for(HEAD_DIM);
    let flash = ctx.flash_attention_forward(&q, &k, &v, &options, tile)?;
    let flash_forward = measure(
        ctx,
        || ctx.flash_attention_forward(&q, &k, &v, &options, tile),
        |out| ctx.flash_attention_forward_into(&q, &k, &v, out, &options, tile),
    );
    add("flash f32", "forward", flash_forward, 0);

    // Both backward passes start from the flash forward's O and LSE (the naive backward
    // recomputes P itself and reads O only for rowsum(dO ∘ O)).
    let (o, lse) = (&flash.o, &flash.lse);
    let naive_backward = measure(
        ctx,
        || ctx.attention_naive_backward(&q, &k, &v, o, &d_o, &options),
        |g| ctx.attention_naive_backward_into(&q, &k, &v, o, &d_o, g, &options),
    );
    add("naive f32", "backward", naive_backward, score_bytes);
    let (backward_tile, dq) = (TileConfig::default_backward_for(HEAD_DIM), DqAccumulation::fastest_for(DType::F32));
    let flash_backward = measure(
        ctx,
        || ctx.flash_attention_backward(&q, &k, &v, o, lse, &d_o, &options, backward_tile, dq),
        |g| ctx.flash_attention_backward_into(&q, &k, &v, o, lse, &d_o, g, &options, backward_tile, dq),
    );
    add("flash f32", "backward", flash_backward, 0);
    drop(flash);

    let [forward, backward] = tensor_cores::<f16>(ctx, shape, &host, &options)?;
    add("flash f16", "forward", forward, 0);
    add("flash f16", "backward", backward, 0);
    Ok(())
}

/// The tensor-core forward and backward of `T` on the same inputs rounded to `T`.
fn tensor_cores<T: Element>(
    ctx: &Context,
    shape: &AttentionShape,
    host: &[Vec<f32>],
    options: &AttentionOptions,
) -> Result<[Result<(f64, usize)>; 2]> {
    let upload = |i: usize| -> Result<DeviceTensor<T>> { ctx.upload(&from_f32_slice::<T>(&host[i]), &shape.q_shape()) };
    let (q, k, v, d_o) = (upload(0)?, upload(1)?, upload(2)?, upload(3)?);
    let (dtype, d) = (T::DTYPE, shape.head_dim);
    let tile = TileConfig::default_for_dtype(dtype, d);
    let forward = measure(
        ctx,
        || ctx.flash_attention_forward(&q, &k, &v, options, tile),
        |out| ctx.flash_attention_forward_into(&q, &k, &v, out, options, tile),
    );
    let out = ctx.flash_attention_forward(&q, &k, &v, options, tile)?;
    let (backward_tile, dq) = (TileConfig::default_backward_for_dtype(dtype, d), DqAccumulation::fastest_for(dtype));
    let (o, lse) = (&out.o, &out.lse);
    let backward = measure(
        ctx,
        || ctx.flash_attention_backward(&q, &k, &v, o, lse, &d_o, options, backward_tile, dq),
        |g| ctx.flash_attention_backward_into(&q, &k, &v, o, lse, &d_o, g, options, backward_tile, dq),
    );
    Ok([forward, backward])
}

/// Runs `allocate` once under the memory pool's high-water mark (its outputs and workspace),
/// then times `into`, which writes into those outputs: (ms, peak bytes).
fn measure<O>(
    ctx: &Context,
    allocate: impl FnOnce() -> Result<O>,
    mut into: impl FnMut(&mut O) -> Result<()>,
) -> Result<(f64, usize)> {
    let (mut outputs, peak_bytes) = ctx.peak_memory(allocate)?;
    let once = time_gpu(ctx, 0, 1, || into(&mut outputs))?.median_ms;
    let ms = if once > 250.0 { once } else { time_gpu(ctx, 2, 7, || into(&mut outputs))?.median_ms };
    Ok((ms, peak_bytes))
}

fn print_table(points: &[Point]) {
    println!("\n### Naive vs flash, [batch, heads, head_dim] = [{BATCH}, {HEADS}, {HEAD_DIM}], non-causal\n");
    println!("| seqlen | kernel | pass | time (ms) | TFLOP/s | peak memory beyond inputs |");
    println!("|---:|---|---|---:|---:|---:|");
    for p in points {
        let (time, tf, memory) = match (p.ms, p.tflops) {
            (Some(ms), Some(tf)) => (format!("{ms:.3}"), format!("{tf:.1}"), mib(p.peak_bytes)),
            _ => (p.note.clone(), String::new(), format!("needs > {}", mib(p.peak_bytes))),
        };
        println!("| {} | {} | {} | {time} | {tf} | {memory} |", p.seqlen, p.kernel, p.pass);
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn write_files(ctx: &Context, points: &[Point]) {
    let header = "kernel,pass,batch,heads,head_dim,seqlen,ms,tflops,peak_bytes,status";
    let rows: Vec<String> = points
        .iter()
        .map(|p| {
            let number = |x: Option<f64>| x.map_or(String::new(), |x| format!("{x:.4}"));
            let status = if p.ms.is_some() { "ok" } else { p.note.as_str() };
            let (kernel, pass, seqlen, peak) = (p.kernel, p.pass, p.seqlen, p.peak_bytes);
            format!(
                "{kernel},{pass},{BATCH},{HEADS},{HEAD_DIM},{seqlen},{},{},{peak},{status}",
                number(p.ms),
                number(p.tflops)
            )
        })
        .collect();
    common::write_csv("scaling.csv", header, &rows);
    let records: Vec<_> = points
        .iter()
        .map(|p| {
            json!({ "kernel": p.kernel, "pass": p.pass, "seqlen": p.seqlen, "ms": p.ms,
                    "tflops": p.tflops, "peak_bytes": p.peak_bytes, "status": if p.ms.is_some() { "ok" } else { &p.note } })
        })
        .collect();
    let device = &ctx.device().name;
    common::write_json(
        "scaling.json",
        &json!({ "device": device, "unix_time": common::unix_time(), "batch": BATCH, "heads": HEADS,
                 "head_dim": HEAD_DIM, "points": records }),
    );
    let series = |pass: &str, y: fn(&Point) -> Option<f64>| -> Vec<Series> {
        KERNELS
            .iter()
            .map(|&kernel| Series {
                label: kernel.to_string(),
                points: points
                    .iter()
                    .filter(|p| p.kernel == kernel && p.pass == pass)
                    .filter_map(|p| Some((p.seqlen as f64, y(p)?)))
                    .collect(),
            })
            .collect()
    };
    let oom = oom_note(points);
    let charts = |y_label, log_y, y: fn(&Point) -> Option<f64>| {
        PASSES.map(|pass| Chart { title: pass, x_label: "seqlen N", y_label, log_y, series: series(pass, y) })
    };
    let title = format!("Time vs N on {device}, [B, H, D] = [{BATCH}, {HEADS}, {HEAD_DIM}]{oom}");
    common::line_charts("scaling_time.svg", &title, &charts("time (ms)", true, |p| p.ms));
    let title = format!("Peak device memory beyond the inputs vs N on {device}{oom}");
    common::line_charts(
        "scaling_memory.svg",
        &title,
        &charts("MiB", true, |p| p.ms.map(|_| p.peak_bytes as f64 / (1u64 << 20) as f64)),
    );
}

/// "; naive out of memory from N = …" when it happened.
fn oom_note(points: &[Point]) -> String {
    points
        .iter()
        .filter(|p| p.ms.is_none())
        .map(|p| p.seqlen)
        .min()
        .map_or(String::new(), |n| format!("; naive: out of memory from N = {n}"))
}
