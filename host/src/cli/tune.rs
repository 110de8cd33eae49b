//! `rust-attention --tune`: sweeps every compiled tile on this GPU and saves the fastest per
//! (pass, dtype, head_dim, mask) in the tuned-tiles file ([`crate::tune::TunedTiles`]), which the
//! main job then uses in place of the built-in tiles.

use comfy_table::{Table, presets::ASCII_MARKDOWN};
use indicatif::{ProgressBar, ProgressStyle};

use super::main_job::Args;
use crate::tune::{Pass, SweepTiming, TileMeasurement, TunedTiles, sweep_len, sweep_tiles};
use crate::{AttentionShape, Causal, Context, DType, DqAccumulation, Error, Result, TileConfig};

/// The problem size tuned at when no shape flag is given: large enough to fill an H200 with
/// blocks at every tile, small enough that the whole sweep takes about a minute.
const DEFAULT_CLASS: [usize; 3] = [4, 16, 4096];

/// Runs the sweep, prints the winners next to the built-in tiles and saves them.
pub(super) fn run(ctx: &Context, args: &Args) -> Result<()> {
    if ctx.is_emulated() {
        return Err(Error::NotOnEmulator("--tune (it measures a GPU)"));
    }
    let class = [
        args.batch.unwrap_or(DEFAULT_CLASS[0]),
        args.heads.unwrap_or(DEFAULT_CLASS[1]),
        args.seqlen.unwrap_or(DEFAULT_CLASS[2]),
    ];
    let mut cases = Vec::new(); // (dtype, head_dim, causal, pass)
    for &dtype in &args.dtype {
        let head_dims = match args.head_dim {
            Some(d) => vec![d],
            None => TileConfig::compiled_head_dims_for(dtype),
        };
        for d in head_dims {
            for causal in [Causal::None, Causal::TopLeft] {
                cases.extend([Pass::Forward, Pass::Backward].map(|pass| (dtype, d, causal, pass)));
            }
        }
    }
    let total = cases.iter().map(|&(dtype, d, _, pass)| sweep_len(pass, dtype, d)).sum::<usize>();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{msg:32} [{bar:40}] {pos}/{len} tiles, {elapsed} (eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    println!("tuning at [batch, heads, seqlen] = {class:?} on {}", ctx.device().name);
    let mut measurements = Vec::new();
    for &(dtype, head_dim, causal, pass) in &cases {
        let [batch, heads, seqlen] = class;
        let shape = AttentionShape {
            batch,
            num_heads_q: heads,
            num_heads_kv: heads,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            head_dim,
        };
        let mask = if causal == Causal::None { "" } else { ", causal" };
        bar.set_message(format!("{} {dtype} d{head_dim}{mask}", pass.name()));
        let timing = SweepTiming::default();
        measurements.extend(sweep_tiles(ctx, &shape, dtype, causal, pass, timing, &mut |_| bar.inc(1))?);
    }
    bar.finish_and_clear();
    let tuned = TunedTiles::from_measurements(ctx.device(), class, &measurements);
    print_winners(&tuned, &measurements);
    let path = TunedTiles::default_path()
        .ok_or_else(|| Error::TunedTiles { path: "tuned-tiles.json".into(), reason: "no cache directory".into() })?;
    tuned.save(&path)?;
    println!("saved {} tuned tiles to {}; later runs on this device use them", tuned.tiles.len(), path.display());
    Ok(())
}

/// One row per tuned case: the winner, and the built-in tile's speed for comparison.
fn print_winners(tuned: &TunedTiles, measurements: &[TileMeasurement]) {
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header([
        "pass",
        "dtype",
        "head_dim",
        "causal",
        "fastest tile",
        "TFLOP/s",
        "built-in tile",
        "TFLOP/s",
        "gain",
    ]);
    for t in &tuned.tiles {
        let (builtin, builtin_dq) = builtin_choice(t.pass, t.dtype, t.head_dim);
        let builtin_tflops = measurements
            .iter()
            .find(|m| {
                (m.pass, m.dtype, m.head_dim, m.causal, m.tile, m.dq)
                    == (t.pass, t.dtype, t.head_dim, t.causal, builtin, builtin_dq)
            })
            .map(|m| m.tflops);
        let with_dq = |tile: TileConfig, dq: Option<DqAccumulation>| match dq {
            Some(DqAccumulation::Atomic) => format!("{tile}, atomic dQ"),
            Some(DqAccumulation::Deterministic) => format!("{tile}, deterministic"),
            None => tile.to_string(),
        };
        table.add_row([
            t.pass.name().to_string(),
            t.dtype.to_string(),
            t.head_dim.to_string(),
            if t.causal { "top-left" } else { "none" }.to_string(),
            with_dq(t.tile, t.dq),
            format!("{:.1}", t.tflops),
            with_dq(builtin, builtin_dq),
            builtin_tflops.map_or("-".into(), |tf| format!("{tf:.1}")),
            builtin_tflops.map_or("-".into(), |tf| format!("{:.2}×", t.tflops / tf)),
        ]);
    }
    println!("{table}");
}

/// The built-in tile and dQ mode of a case (what runs without a tuned-tiles file).
fn builtin_choice(pass: Pass, dtype: DType, head_dim: usize) -> (TileConfig, Option<DqAccumulation>) {
    match pass {
        Pass::Forward => (TileConfig::default_for_dtype(dtype, head_dim), None),
        Pass::Backward => {
            (TileConfig::default_backward_for_dtype(dtype, head_dim), Some(DqAccumulation::fastest_for(dtype)))
        }
    }
}
