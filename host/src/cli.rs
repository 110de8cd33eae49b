//! The main job, `cargo run --release`: naive attention against FlashAttention on the GPU, each
//! checked against the CPU reference, in one table.
//!
//! With no shape flags it runs two cases: the attention of a ViT-B/16 (a 224×224 image in 16×16
//! patches: 196 patches and a class token, so 197 tokens; 12 heads of head_dim 64; a batch of 8
//! images) and a long sequence (1 × 12 heads × 4096 tokens × 64), where the naive kernels' N×N
//! matrix costs 805 MB and most of the time. Any shape flag switches to one case of that shape.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use comfy_table::{Table, presets::ASCII_MARKDOWN};

use crate::check::{max_abs_error, random_normal, relative_l2_error};
use crate::timing::{tflops, time_gpu};
use crate::{AttentionOptions, AttentionOutput, AttentionShape, Context, Error, Result, TileConfig, cpu};

/// Naive attention vs FlashAttention on the GPU, checked against a CPU reference.
#[derive(Parser, Debug)]
#[command(name = "rust-attention", version)]
pub struct Args {
    /// Batch size (one custom case instead of the two default ones).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads (grouped-query attention); defaults to --heads.
    #[arg(long)]
    pub heads_kv: Option<usize>,
    /// Query sequence length.
    #[arg(long)]
    pub seqlen: Option<usize>,
    /// Key/value sequence length; defaults to --seqlen.
    #[arg(long)]
    pub seqlen_k: Option<usize>,
    /// Head dimension (flash kernels exist for 32, 64 and 128).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Query rows per flash block (Br), given together with --block-n; default: tuned per head_dim.
    #[arg(long, requires = "block_n")]
    pub block_m: Option<usize>,
    /// Key/value rows per flash tile (Bc), given together with --block-m.
    #[arg(long, requires = "block_m")]
    pub block_n: Option<usize>,
    /// Softmax scale; default 1/sqrt(head_dim).
    #[arg(long)]
    pub scale: Option<f32>,
    /// Timed repeats per kernel (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
    /// Untimed warm-up runs per kernel.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Heads checked against the CPU when checking all of them would take long.
    #[arg(long, default_value_t = 2)]
    pub check_heads: usize,
}

/// Runs one kernel on the case's inputs and returns its outputs.
type Launch<'a> = Box<dyn Fn() -> Result<AttentionOutput> + 'a>;

/// One shape to run.
struct Case {
    name: String,
    shape: AttentionShape,
}

impl Args {
    /// The flash tile: the flags', or the tuned default for `head_dim`.
    fn tile(&self, head_dim: usize) -> TileConfig {
        match (self.block_m, self.block_n) {
            (Some(m), Some(n)) => TileConfig::new(m, n),
            _ => TileConfig::default_for(head_dim),
        }
    }

    fn cases(&self) -> Vec<Case> {
        let custom = [self.batch, self.heads, self.heads_kv, self.seqlen, self.seqlen_k, self.head_dim];
        if custom.iter().all(Option::is_none) {
            return vec![
                Case { name: "ViT-B/16".into(), shape: mha(8, 12, 197, 64) },
                Case { name: "long".into(), shape: mha(1, 12, 4096, 64) },
            ];
        }
        let heads = self.heads.unwrap_or(12);
        let seqlen = self.seqlen.unwrap_or(197);
        let shape = AttentionShape {
            batch: self.batch.unwrap_or(8),
            num_heads_q: heads,
            num_heads_kv: self.heads_kv.unwrap_or(heads),
            seqlen_q: seqlen,
            seqlen_k: self.seqlen_k.unwrap_or(seqlen),
            head_dim: self.head_dim.unwrap_or(64),
        };
        vec![Case { name: "custom".into(), shape }]
    }
}

/// "[B, Hq, Hkv, Sq, Sk, D]" of a shape, as the tables show it.
fn dims(shape: &AttentionShape) -> String {
    let s = shape;
    format!("[{}, {}, {}, {}, {}, {}]", s.batch, s.num_heads_q, s.num_heads_kv, s.seqlen_q, s.seqlen_k, s.head_dim)
}

fn mha(batch: usize, heads: usize, seqlen: usize, head_dim: usize) -> AttentionShape {
    AttentionShape { batch, num_heads_q: heads, num_heads_kv: heads, seqlen_q: seqlen, seqlen_k: seqlen, head_dim }
}

/// Entry point of the `rust-attention` binary.
pub fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    // Check every flag before looking for a GPU, so a typo is reported the same way everywhere.
    let cases = args.cases();
    for case in &cases {
        let shape = case.shape;
        AttentionShape::from_qkv(&shape.q_shape(), &shape.kv_shape(), &shape.kv_shape())?;
        args.tile(shape.head_dim).compiled_entry(shape.head_dim)?;
    }
    let ctx = match Context::new(args.device) {
        Ok(ctx) => ctx,
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => {
            println!("no CUDA device ({e}); running the CPU reference instead");
            return run_cpu_only(args, &cases);
        }
        Err(e) => return Err(e),
    };
    println!("device: {}", ctx.device());
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header([
        "case [B, Hq, Hkv, Sq, Sk, D]",
        "kernel",
        "time (ms)",
        "TFLOP/s",
        "extra memory",
        "heads checked",
        "max |ΔO|",
        "max |ΔLSE|",
        "rel L2 (O)",
    ]);
    for case in &cases {
        run_case(&ctx, args, case, &mut table)?;
    }
    println!("{table}");
    println!(
        "time: median of {} runs after {} warm-up runs (CUDA events); TFLOP/s counts 4·B·Hq·Sq·Sk·D; \
         extra memory: device memory beyond Q, K, V and O; errors against a float64 CPU reference",
        args.repeats, args.warmup
    );
    Ok(())
}

fn run_case(ctx: &Context, args: &Args, case: &Case, table: &mut Table) -> Result<()> {
    let shape = case.shape;
    let options = AttentionOptions { scale: args.scale };
    let tile = args.tile(shape.head_dim);
    let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
    let (q_len, kv_len) = (q_shape.iter().product(), kv_shape.iter().product());
    let (q_host, k_host, v_host) = (random_normal(q_len, 1), random_normal(kv_len, 2), random_normal(kv_len, 3));
    let q = ctx.upload(&q_host, &q_shape)?;
    let k = ctx.upload(&k_host, &kv_shape)?;
    let v = ctx.upload(&v_host, &kv_shape)?;

    // Which heads to check on the CPU: all of them if that is quick, otherwise the first few.
    let cpu_cost = shape.forward_flops();
    let heads: Vec<(usize, usize)> = (0..shape.batch)
        .flat_map(|b| (0..shape.num_heads_q).map(move |h| (b, h)))
        .take(if cpu_cost < 2e9 { usize::MAX } else { args.check_heads.max(1) })
        .collect();
    let scale = options.scale_for(shape.head_dim) as f64;
    let references: Vec<cpu::Reference> =
        heads.iter().map(|&(b, h)| cpu::attention_head(&q_host, &k_host, &v_host, &shape, scale, b, h)).collect();

    let label = format!("{} {}", case.name, dims(&shape));
    let naive_extra = shape.naive_workspace_bytes() + shape.lse_bytes();
    let kernels: [(String, usize, Launch); 2] = [
        ("naive".into(), naive_extra, Box::new(|| ctx.attention_naive(&q, &k, &v, &options))),
        (
            format!("flash (m{}, n{})", tile.block_m, tile.block_n),
            shape.lse_bytes(),
            Box::new(|| ctx.flash_attention_forward(&q, &k, &v, &options, tile)),
        ),
    ];
    for (name, extra, kernel) in kernels {
        let row = kernel().and_then(|out| {
            let timing = time_gpu(ctx, args.warmup, args.repeats, || kernel().map(drop))?;
            let (o, lse) = (out.o.to_host()?, out.lse.to_host()?);
            Ok((timing, o, lse))
        });
        match row {
            Ok((timing, o, lse)) => {
                let (mut err_o, mut err_lse, mut rel) = (0.0f64, 0.0f64, 0.0f64);
                for (&(b, h), reference) in heads.iter().zip(&references) {
                    let o_head = &o[shape.q_head_offset(b, h)..][..shape.seqlen_q * shape.head_dim];
                    let lse_head = &lse[shape.q_head_offset(b, h) / shape.head_dim..][..shape.seqlen_q];
                    err_o = err_o.max(max_abs_error(o_head, &reference.o));
                    err_lse = err_lse.max(max_abs_error(lse_head, &reference.lse));
                    rel = rel.max(relative_l2_error(o_head, &reference.o));
                }
                table.add_row([
                    label.clone(),
                    name,
                    format!("{:.3}", timing.median_ms),
                    format!("{:.2}", tflops(shape.forward_flops(), timing.median_ms)),
                    format_bytes(extra),
                    format!("{}/{}", heads.len(), shape.batch * shape.num_heads_q),
                    format!("{err_o:.2e}"),
                    format!("{err_lse:.2e}"),
                    format!("{rel:.2e}"),
                ]);
            }
            // A kernel that cannot run (e.g. naive out of memory at long sequences) gets a row
            // saying why; the other kernels still run.
            Err(e) => {
                table.add_row([label.clone(), name, format!("failed: {e}"), String::new(), format_bytes(extra)]);
            }
        }
    }
    Ok(())
}

/// Forward flops above which a case is too slow for the CPU-only fallback (a few seconds).
const CPU_ONLY_MAX_FLOPS: f64 = 2e9;

/// Without a GPU: the plain CPU formula against the tiled CPU FlashAttention, on the requested
/// cases where they are small enough, otherwise on a small case.
fn run_cpu_only(args: &Args, cases: &[Case]) -> Result<()> {
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header([
        "case [B, Hq, Hkv, Sq, Sk, D]",
        "kernel (CPU, f64)",
        "time (ms)",
        "max |ΔO| vs plain",
    ]);
    for case in cases {
        let shape = if case.shape.forward_flops() <= CPU_ONLY_MAX_FLOPS {
            case.shape
        } else {
            let small = mha(1, 4, 256, case.shape.head_dim);
            println!("{} {}: too large for the CPU; running {} instead", case.name, dims(&case.shape), dims(&small));
            small
        };
        let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
        let q = random_normal(q_shape.iter().product(), 1);
        let k = random_normal(kv_shape.iter().product(), 2);
        let v = random_normal(kv_shape.iter().product(), 3);
        let scale = AttentionOptions { scale: args.scale }.scale_for(shape.head_dim) as f64;
        let tile = args.tile(shape.head_dim);
        let start = Instant::now();
        let plain = cpu::attention(&q, &k, &v, &shape, scale);
        let plain_ms = start.elapsed().as_secs_f64() * 1e3;
        let start = Instant::now();
        let tiled = cpu::flash_attention(&q, &k, &v, &shape, scale, tile);
        let tiled_ms = start.elapsed().as_secs_f64() * 1e3;
        let diff = plain.o.iter().zip(&tiled.o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let label = format!(
            "{} [{}, {}, {}, {}, {}, {}]",
            case.name,
            shape.batch,
            shape.num_heads_q,
            shape.num_heads_kv,
            shape.seqlen_q,
            shape.seqlen_k,
            shape.head_dim
        );
        table.add_row([label.clone(), "plain formula".into(), format!("{plain_ms:.1}"), "-".into()]);
        table.add_row([
            label,
            format!("tiled flash (m{}, n{})", tile.block_m, tile.block_n),
            format!("{tiled_ms:.1}"),
            format!("{diff:.2e}"),
        ]);
    }
    println!("{table}");
    Ok(())
}

fn format_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}
