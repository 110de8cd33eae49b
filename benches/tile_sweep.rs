//! `cargo bench --bench tile_sweep`: every compiled FlashAttention tile, forward and backward
//! (both dQ modes), for every element type, head_dim and mask (none, causal), at sizes that fill
//! the GPU. For each tile: time, TFLOP/s, and what decides its occupancy (registers per thread,
//! dynamic shared memory per block, resident blocks per SM). Writes to `bench-results/`:
//!
//! * `tile_sweep.csv`, `tile_sweep.json`: every measurement;
//! * `tile_sweep.svg`: one heat map per (dtype, head_dim, pass, mask) over (block_m, block_n),
//!   the best of the stages and dQ modes in each cell;
//! * `ours.csv`: the fastest tile per row in the columns of `benches/peers/sdpa_bench.py`, which
//!   puts it beside PyTorch's FlashAttention-2 and cuDNN backends.
//!
//! Timing: CUDA events, warm-up, median of repeats (see `attn_host::tune::sweep_tiles`); inputs
//! are seeded normal draws. Needs a GPU; without one it says so and exits successfully.

#[path = "common/mod.rs"]
mod common;

use attn_host::tune::{Pass, SweepTiming, TileMeasurement, sweep_len, sweep_tiles};
use attn_host::{AttentionShape, Causal, DType, DqAccumulation, TileConfig};
use common::HeatPanel;
use serde_json::json;

/// The problem for `dtype` and `head_dim`, `[batch, heads, seqlen]`: FlashAttention-2's benchmark
/// shapes (4 × 16 × 4096, and 2 × 16 × 8192 at head_dim 128 for the 16-bit types, as in the
/// comparison with PyTorch's backends). Every tile launches thousands of blocks on them.
fn problem(dtype: DType, head_dim: usize) -> AttentionShape {
    let (batch, seqlen) = if dtype != DType::F32 && head_dim == 128 { (2, 8192) } else { (4, 4096) };
    AttentionShape { batch, num_heads_q: 16, num_heads_kv: 16, seqlen_q: seqlen, seqlen_k: seqlen, head_dim }
}

/// Fewer repeats for the slower `f32` kernels, whose times vary less.
fn timing(dtype: DType) -> SweepTiming {
    if dtype == DType::F32 { SweepTiming { warmup: 2, repeats: 5 } } else { SweepTiming { warmup: 3, repeats: 10 } }
}

const MASKS: [Causal; 2] = [Causal::None, Causal::TopLeft];

fn main() -> attn_host::Result<()> {
    let Some(ctx) = common::open_gpu("tile_sweep") else { return Ok(()) };
    let mut groups = Vec::new(); // (dtype, head_dim, causal, pass)
    for dtype in DType::ALL {
        for d in TileConfig::compiled_head_dims_for(dtype) {
            for causal in MASKS {
                groups.extend([Pass::Forward, Pass::Backward].map(|pass| (dtype, d, causal, pass)));
            }
        }
    }
    let bar = common::progress(groups.iter().map(|&(dtype, d, _, pass)| sweep_len(pass, dtype, d)).sum());
    let mut all = Vec::new();
    for &(dtype, d, causal, pass) in &groups {
        bar.set_message(format!("{} {dtype} d{d}{}", pass.name(), mask_suffix(causal)));
        let shape = problem(dtype, d);
        let mut group = sweep_tiles(&ctx, &shape, dtype, causal, pass, timing(dtype), &mut |_| bar.inc(1))?;
        group.sort_by(|a, b| a.ms.total_cmp(&b.ms));
        bar.suspend(|| print_ranking(&shape, &group));
        all.extend(group);
    }
    bar.finish_and_clear();
    write_files(&ctx.device().name, &all);
    Ok(())
}

fn mask_suffix(causal: Causal) -> &'static str {
    if causal == Causal::None { "" } else { ", causal" }
}

fn dq_name(dq: Option<DqAccumulation>) -> &'static str {
    match dq {
        None => "",
        Some(DqAccumulation::Atomic) => "atomic",
        Some(DqAccumulation::Deterministic) => "deterministic",
    }
}

/// One ranked markdown table: fastest first.
fn print_ranking(shape: &AttentionShape, group: &[TileMeasurement]) {
    let Some(first) = group.first() else { return };
    let s = shape;
    println!(
        "\n### {} {} [{}, {}, {}, {}]{}\n",
        first.pass.name(),
        first.dtype,
        s.batch,
        s.num_heads_q,
        s.seqlen_q,
        s.head_dim,
        mask_suffix(if first.causal { Causal::TopLeft } else { Causal::None })
    );
    println!(
        "| rank | tile (m, n, stages) | dQ | threads | regs/thread | smem/block (KiB) | blocks/SM | time (ms) | TFLOP/s |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|");
    for (rank, m) in group.iter().enumerate() {
        println!(
            "| {} | ({}, {}, {}) | {} | {} | {} | {:.1} | {} | {:.3} | {:.1} |",
            rank + 1,
            m.tile.block_m,
            m.tile.block_n,
            m.tile.stages,
            dq_name(m.dq),
            m.threads,
            m.registers,
            m.shared_memory_bytes as f64 / 1024.0,
            m.blocks_per_sm,
            m.ms,
            m.tflops
        );
    }
}

fn write_files(device: &str, all: &[TileMeasurement]) {
    let header = "dtype,head_dim,causal,pass,batch,heads,seqlen,block_m,block_n,stages,dq,threads,registers,\
                  shared_memory_bytes,blocks_per_sm,ms,tflops";
    let rows: Vec<String> = all
        .iter()
        .map(|m| {
            let s = problem(m.dtype, m.head_dim);
            format!(
                "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.4},{:.2}",
                m.dtype,
                m.head_dim,
                m.causal,
                m.pass.name(),
                s.batch,
                s.num_heads_q,
                s.seqlen_q,
                m.tile.block_m,
                m.tile.block_n,
                m.tile.stages,
                dq_name(m.dq),
                m.threads,
                m.registers,
                m.shared_memory_bytes,
                m.blocks_per_sm,
                m.ms,
                m.tflops
            )
        })
        .collect();
    common::write_csv("tile_sweep.csv", header, &rows);
    common::write_json(
        "tile_sweep.json",
        &json!({ "device": device, "unix_time": common::unix_time(), "measurements": all }),
    );
    write_peer_rows(all);
    let panels = heat_panels(all);
    let title = format!("FlashAttention tiles on {device}: TFLOP/s (outlined: fastest)");
    common::heat_maps("tile_sweep.svg", &title, "block_m", "block_n", 4, &panels);
}

/// The fastest tile of each (dtype, head_dim, mask, pass), in the peers' CSV columns.
fn write_peer_rows(all: &[TileMeasurement]) {
    let header = "impl,backend,dtype,batch,heads,seqlen_q,seqlen_k,head_dim,causal,pass,ms,tflops,status,note";
    let mut rows = Vec::new();
    for (i, m) in all.iter().enumerate() {
        let key = |o: &TileMeasurement| (o.dtype, o.head_dim, o.causal, o.pass);
        let fastest = all.iter().enumerate().filter(|(_, o)| key(o) == key(m)).min_by(|a, b| a.1.ms.total_cmp(&b.1.ms));
        if fastest.map(|(j, _)| j) != Some(i) {
            continue;
        }
        let s = problem(m.dtype, m.head_dim);
        let implementation = if m.dtype == DType::F32 { "rust-f32" } else { "rust-mma" };
        let backend = format!("{}{}{}", m.tile, if m.dq.is_some() { " " } else { "" }, dq_name(m.dq));
        rows.push(format!(
            "{implementation},{backend},{},{},{},{},{},{},{},{},{:.4},{:.2},ok,{} regs {} B smem {} blocks/SM",
            m.dtype,
            s.batch,
            s.num_heads_q,
            s.seqlen_q,
            s.seqlen_k,
            s.head_dim,
            if m.causal { "top-left" } else { "none" },
            m.pass.name(),
            m.ms,
            m.tflops,
            m.registers,
            m.shared_memory_bytes,
            m.blocks_per_sm
        ));
    }
    common::write_csv("ours.csv", header, &rows);
}

/// One panel per (dtype, head_dim) row and (pass, mask) column; a cell holds the best TFLOP/s of
/// its (block_m, block_n) over stages and dQ modes.
fn heat_panels(all: &[TileMeasurement]) -> Vec<HeatPanel> {
    let mut panels = Vec::new();
    for dtype in DType::ALL {
        for d in TileConfig::compiled_head_dims_for(dtype) {
            for pass in [Pass::Forward, Pass::Backward] {
                for causal in [false, true] {
                    let group: Vec<&TileMeasurement> = all
                        .iter()
                        .filter(|m| (m.dtype, m.head_dim, m.pass, m.causal) == (dtype, d, pass, causal))
                        .collect();
                    let values_of = |f: fn(&TileMeasurement) -> usize| {
                        let mut v: Vec<usize> = group.iter().map(|m| f(m)).collect();
                        v.sort_unstable();
                        v.dedup();
                        v
                    };
                    let (rows, columns) = (values_of(|m| m.tile.block_m), values_of(|m| m.tile.block_n));
                    let values = rows
                        .iter()
                        .map(|&bm| {
                            columns
                                .iter()
                                .map(|&bn| {
                                    group
                                        .iter()
                                        .filter(|m| (m.tile.block_m, m.tile.block_n) == (bm, bn))
                                        .map(|m| m.tflops)
                                        .reduce(f64::max)
                                })
                                .collect()
                        })
                        .collect();
                    let mask = if causal { ", causal" } else { "" };
                    let title = format!("{dtype} d{d} {}{mask}", pass.name());
                    panels.push(HeatPanel { title, rows, columns, values });
                }
            }
        }
    }
    panels
}
pub fn write_files_demo(all: &[TileMeasurement]) {
    write_files("NVIDIA Demo", all)
}
