//! The main job, `cargo run --release`: naive attention against FlashAttention on the GPU,
//! forward and backward, each checked against the CPU reference, in one table: the `f32` kernels
//! (CUDA cores) and the `f16`/`bf16` kernels (tensor cores).
//!
//! With no shape flags it runs four cases: the attention of a ViT-B/16 (a 224×224 image in 16×16
//! patches: 196 patches and a class token, so 197 tokens; 12 heads of head_dim 64; a batch of 8
//! images), the same at a training batch of 256 images (thousands of short query blocks: the
//! grid, not the tile, sets the speed), a long sequence (1 × 12 heads × 4096 tokens × 64), where the naive kernels' N×N
//! matrix costs 805 MB and most of the time, and the same long sequence with a causal mask. Any
//! shape flag switches to one case of that shape.
//!
//! Every row is judged against the test suite's tolerances (`check::Tolerance`): a row beyond them
//! is marked FAIL and the job exits non-zero, its last line saying how many rows failed.

use std::time::Instant;

use clap::ValueEnum;
use comfy_table::{Table, presets::ASCII_MARKDOWN};

use super::{CausalArg, DeviceArg, Verdicts};
use crate::check::{
    CPU_TILED_TOLERANCE, Checked, Measured, Output, Tolerance, gradient_error, lse_error, random_normal,
    relative_l2_error,
};
use crate::dtype::{DType, Element, from_f32_slice, to_f32_vec};
use crate::timing::{tflops, time_gpu};
use crate::tune::{Pass, TunedTiles};
use crate::{
    AttentionOptions, AttentionShape, Causal, Context, Device, DeviceTensor, DqAccumulation, Error, KernelPath, Result,
    TileConfig, cpu,
};

/// The main job's flags: naive attention vs FlashAttention on the GPU, forward and backward,
/// checked against a CPU reference.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Batch size. Any shape flag (or --causal) runs one custom case instead of the three default
    /// ones; unset dimensions then default to a ViT-B/16 batch, 8 × 12 heads × 197 × 64 (on the
    /// emulator to its small case, 1 × 2 heads × 100 × 64).
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
    /// Head dimension: 1 to 256, each run on the next compiled one.
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Query rows per flash block (Br), given together with --block-n; default: tuned per head_dim,
    /// element type and pass. The tile flags name one tile for every --dtype and for both passes,
    /// so it must be compiled for each (see `TileConfig::compiled_for`); pick one type with --dtype.
    #[arg(long, requires = "block_n")]
    pub block_m: Option<usize>,
    /// Key/value rows per flash tile (Bc), given together with --block-m.
    #[arg(long, requires = "block_m")]
    pub block_n: Option<usize>,
    /// Pipeline stages of the f16/bf16 kernels' tile given by --block-m/--block-n (the f32
    /// kernels have 1).
    #[arg(long, default_value_t = 2, requires = "block_m")]
    pub stages: usize,
    /// Element types of the flash rows: f32 (CUDA cores), f16 and bf16 (tensor cores); a comma
    /// list. The naive rows are f32.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,bf16")]
    pub dtype: Vec<DType>,
    /// Softmax scale; default 1/sqrt(head_dim).
    #[arg(long, allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Causal mask of the custom case.
    #[arg(long, value_enum, default_value_t = CausalArg::None)]
    pub causal: CausalArg,
    /// Timed repeats per kernel (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
    /// Untimed warm-up runs per kernel.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Where to run: a CUDA device ordinal (0, 1, …), or `cpu-emulated` for the CPU emulator,
    /// which runs the kernels' own code with one OS thread per GPU thread and checks shared-memory
    /// races and barriers (slow by design: it runs a small case unless shape flags are given,
    /// and its times say nothing about a GPU).
    /// `cpu` runs the CPU reference only (what happens anyway when there is no GPU).
    #[arg(long, default_value = "0")]
    pub device: DeviceArg,
    /// Kernel path for the f16/bf16 passes with the built-in tiles: `sm90a` (Hopper's wgmma and
    /// TMA for the forward and backward passes; compute capability 9.0 only) or
    /// `sm80` (mma.sync, every GPU). Default: sm90a where it runs (or what
    /// $RUST_ATTENTION_KERNELS says).
    #[arg(long)]
    pub kernels: Option<KernelPath>,
    /// Heads checked against the CPU when checking all of them would take long.
    #[arg(long, default_value_t = 2)]
    pub check_heads: usize,
    /// Autotune instead of running the main job: time every compiled tile on this GPU, forward
    /// and backward (both dQ modes), for each --dtype and head_dim (--head-dim, or every compiled
    /// one), with and without a causal mask, at --batch × --heads × --seqlen (default
    /// 4 × 16 × 4096); save the fastest per case in the tuned-tiles file (see `--tiles`).
    #[arg(long, conflicts_with_all = ["block_m", "heads_kv", "seqlen_k", "scale", "causal"])]
    pub tune: bool,
    /// Where the flash tiles come from when --block-m/--block-n are not given: `tuned` uses the
    /// file `--tune` wrote for this device (`$RUST_ATTENTION_CACHE_DIR/tuned-tiles.json`, else
    /// `~/.cache/rust-attention/tuned-tiles.json`), falling back to the built-in tiles for what it
    /// does not cover or when it was tuned on another device; `builtin` ignores it.
    #[arg(long, value_enum, default_value_t = TileSource::Tuned)]
    pub tiles: TileSource,
    /// The tuned tiles in use (read after the device is opened).
    #[arg(skip)]
    pub tuned: Option<TunedTiles>,
}

/// `--tiles`: where the default flash tiles come from.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileSource {
    /// The tuned-tiles file of this device, if any; the built-in tiles otherwise.
    Tuned,
    /// The built-in tiles (`TileConfig::default_for_dtype`, measured on an H200).
    Builtin,
}

/// One shape (and mask) to run.
struct Case {
    name: String,
    shape: AttentionShape,
    causal: Causal,
}

impl Args {
    /// The flash tile the flags or the tuned file (`--tune`) give for `dtype`, `head_dim`, the
    /// mask and the pass, if any.
    fn chosen_tile(&self, dtype: DType, head_dim: usize, causal: Causal, pass: Pass) -> Option<TileConfig> {
        if let (Some(m), Some(n)) = (self.block_m, self.block_n) {
            return Some(TileConfig::new(m, n).with_stages(if dtype == DType::F32 { 1 } else { self.stages }));
        }
        Some(self.tuned.as_ref()?.tile(pass, dtype, head_dim, causal)?.tile)
    }

    /// [`Args::chosen_tile`], else the built-in default (for the checks that run before a
    /// device is open, and the CPU-only job).
    fn tile(&self, dtype: DType, head_dim: usize, causal: Causal, pass: Pass) -> TileConfig {
        self.chosen_tile(dtype, head_dim, causal, pass).unwrap_or(match pass {
            Pass::Forward => TileConfig::default_for_dtype(dtype, head_dim),
            Pass::Backward => TileConfig::default_backward_for_dtype(dtype, head_dim),
        })
    }

    /// [`Args::chosen_tile`], else `ctx`'s default, which fits the device's shared memory
    /// (`Context::default_tile`, `default_backward_tile` for dQ mode `dq`; the built-in tile on
    /// an H200).
    fn tile_on(
        &self,
        ctx: &Context,
        dtype: DType,
        head_dim: usize,
        causal: Causal,
        pass: Pass,
        dq: DqAccumulation,
    ) -> TileConfig {
        self.chosen_tile(dtype, head_dim, causal, pass).unwrap_or_else(|| match pass {
            Pass::Forward => ctx.default_tile(dtype, head_dim),
            Pass::Backward => ctx.default_backward_tile(dtype, head_dim, dq),
        })
    }

    /// The dQ mode of the 16-bit backward rows: the tuned one for the tuned tile, else the
    /// measured faster mode for the type.
    fn dq_mode(&self, ctx: &Context, dtype: DType, head_dim: usize, causal: Causal) -> DqAccumulation {
        let tuned = self.tuned.as_ref().filter(|_| self.block_m.is_none());
        tuned
            .and_then(|t| t.tile(Pass::Backward, dtype, head_dim, causal)?.dq)
            .unwrap_or(ctx.dq_accumulation_for(dtype, head_dim))
    }

    /// Whether no shape flag was given (the default cases run).
    fn uses_default_cases(&self) -> bool {
        let custom = [self.batch, self.heads, self.heads_kv, self.seqlen, self.seqlen_k, self.head_dim];
        custom.iter().all(Option::is_none) && self.causal == CausalArg::None
    }

    fn cases(&self) -> Vec<Case> {
        if self.uses_default_cases() {
            return vec![
                Case { name: "ViT-B/16".into(), shape: mha(8, 12, 197, 64), causal: Causal::None },
                Case { name: "ViT-B/16, batch 256".into(), shape: mha(256, 12, 197, 64), causal: Causal::None },
                Case { name: "long".into(), shape: mha(1, 12, 4096, 64), causal: Causal::None },
                Case { name: "long, causal".into(), shape: mha(1, 12, 4096, 64), causal: Causal::TopLeft },
            ];
        }
        // Unset dimensions: a ViT-B/16 batch on a GPU, the emulator's small case on the emulator
        // (a full batch would take it minutes).
        let emulated = self.device == DeviceArg::Kernels(Device::CpuEmulated);
        let heads = self.heads.unwrap_or(if emulated { 2 } else { 12 });
        let seqlen = self.seqlen.unwrap_or(if emulated { 100 } else { 197 });
        let shape = AttentionShape {
            batch: self.batch.unwrap_or(if emulated { 1 } else { 8 }),
            num_heads_q: heads,
            num_heads_kv: self.heads_kv.unwrap_or(heads),
            seqlen_q: seqlen,
            seqlen_k: self.seqlen_k.unwrap_or(seqlen),
            head_dim: self.head_dim.unwrap_or(64),
        };
        let name = match self.causal.to_possible_value() {
            Some(value) if self.causal != CausalArg::None => format!("custom, causal {}", value.get_name()),
            _ => "custom".to_string(),
        };
        vec![Case { name, shape, causal: self.causal.into() }]
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

/// Runs the main job.
pub(super) fn run(mut args: Args) -> Result<()> {
    // Check every flag before looking for a GPU, so a typo is reported the same way everywhere.
    let cases = args.cases();
    for case in &cases {
        let shape = case.shape;
        AttentionShape::from_qkv(&shape.q_shape(), &shape.kv_shape(), &shape.kv_shape())?;
        AttentionOptions { scale: args.scale, causal: case.causal, ..Default::default() }
            .checked_scale(shape.head_dim)?;
        for &dtype in &args.dtype {
            let d = shape.head_dim;
            for (kernel, pass) in
                [(crate::FlashKernel::Forward, Pass::Forward), (crate::FlashKernel::Backward, Pass::Backward)]
            {
                // Without tile flags a missing head_dim only costs that type its rows.
                let checked = args.tile(dtype, d, case.causal, pass).compiled_entry_for(kernel, dtype, d);
                if args.block_m.is_some() || matches!(checked, Err(Error::TileNotCompiled { .. })) {
                    checked?;
                }
            }
        }
    }
    let device = match args.device {
        DeviceArg::Kernels(device) => device,
        DeviceArg::Cpu if args.tune => {
            return Err(Error::Argument("--tune measures a GPU; --device cpu has none".into()));
        }
        DeviceArg::Cpu => {
            println!("device: CPU (--device cpu): the CPU reference only, no kernels; {EMULATOR_HINT}");
            return run_cpu_only(&args, &cases);
        }
    };
    let ctx = match Context::open(device) {
        Ok(ctx) => ctx,
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) if args.tune => {
            return Err(Error::Argument(format!("--tune measures a GPU, and there is none: {e}")));
        }
        Err(e) if args.tune => return Err(e),
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => {
            println!("no CUDA device ({e}): running the CPU reference only, none of the kernels; {EMULATOR_HINT}");
            return run_cpu_only(&args, &cases);
        }
        Err(e) => return Err(e),
    };
    if ctx.is_emulated() {
        println!("device: CPU emulator");
    } else {
        println!("device: {}", ctx.device());
    }
    let ctx = super::with_kernels(ctx, args.kernels)?;
    // A type the GPU has no kernels for (bf16 on Turing) leaves the list with a line, rather than
    // failing its rows.
    let (kept, lacking): (Vec<DType>, Vec<DType>) = args.dtype.iter().partition(|&&dtype| ctx.device().supports(dtype));
    for dtype in lacking {
        println!("{dtype}: skipped, {} has no {dtype} kernels (compute capability 8.0 and newer)", ctx.device().name);
    }
    args.dtype = kept;
    if args.tune {
        return super::tune::run(&ctx, &args);
    }
    if args.tiles == TileSource::Tuned && args.block_m.is_none() && !ctx.is_emulated() {
        args.tuned = load_tuned_tiles(&ctx);
    }
    let args = &args;
    let (cases, warmup, repeats) = if ctx.is_emulated() {
        println!(
            "the CPU emulator runs the kernels' own code, one OS thread per GPU thread, checking \
             shared-memory races and barriers: slow by design, and its times say nothing about a GPU"
        );
        let small = args.uses_default_cases();
        let cases = if small {
            vec![Case { name: "small, causal (emulated)".into(), shape: mha(1, 2, 100, 64), causal: Causal::TopLeft }]
        } else {
            cases
        };
        (cases, 0, 1)
    } else {
        (cases, args.warmup, args.repeats)
    };
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header([
        "case [B, Hq, Hkv, Sq, Sk, D]",
        "kernel",
        "time (ms)",
        "TFLOP/s",
        "extra memory",
        "heads checked",
        "rel L2 error vs CPU (f64)",
        "check",
    ]);
    let mut verdicts = Verdicts::default();
    for case in &cases {
        run_case(&ctx, args, case, (warmup, repeats), &mut table, &mut verdicts)?;
    }
    println!("{table}");
    let timing = if ctx.is_emulated() {
        "time: one run, host clock (the emulator's time says nothing about a GPU)".to_string()
    } else {
        format!("time: median of {repeats} runs after {warmup} warm-up runs (CUDA events)")
    };
    println!(
        "{timing}; TFLOP/s counts the forward as 4·B·Hq·Sq·Sk·D (half with a causal mask) and the \
         backward as 2.5× that; extra memory: device memory beyond the inputs and outputs"
    );
    verdicts.finish()
}

/// What the lines of a run without kernels add.
const EMULATOR_HINT: &str =
    "to run the kernels' own code on the CPU emulator: cargo run --release -- --device cpu-emulated";

/// The inputs of a case on the host and on the device (`f32`).
struct Inputs {
    host: [Vec<f32>; 4], // q, k, v, dO
    device: [DeviceTensor; 4],
}

impl Inputs {
    fn new(ctx: &Context, shape: &AttentionShape) -> Result<Self> {
        let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()];
        let host: [Vec<f32>; 4] = std::array::from_fn(|i| random_normal(shapes[i].iter().product(), i as u64 + 1));
        let device = [
            ctx.upload(&host[0], &shapes[0])?,
            ctx.upload(&host[1], &shapes[1])?,
            ctx.upload(&host[2], &shapes[2])?,
            ctx.upload(&host[3], &shapes[3])?,
        ];
        Ok(Self { host, device })
    }
}

/// The part of a problem the CPU checks: batch 0, key/value head 0 and the query heads of its
/// group, unless the whole problem is cheap enough.
struct CheckedPart {
    shape: AttentionShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
}

/// Forward flops below which the CPU checks the whole problem.
const FULL_CHECK_FLOPS: f64 = 2e9;

impl CheckedPart {
    fn new(host: &[Vec<f32>; 4], shape: &AttentionShape) -> Self {
        let [q, k, v, d_o] = host;
        if shape.forward_flops() <= FULL_CHECK_FLOPS {
            return Self { shape: *shape, q: q.clone(), k: k.clone(), v: v.clone(), d_o: d_o.clone() };
        }
        let part = AttentionShape { batch: 1, num_heads_q: shape.group_size(), num_heads_kv: 1, ..*shape };
        let (q_len, kv_len) = (part.query_rows() * shape.head_dim, shape.seqlen_k * shape.head_dim);
        // Batch 0 and kv head 0 are the first rows of every tensor.
        Self {
            shape: part,
            q: q[..q_len].to_vec(),
            k: k[..kv_len].to_vec(),
            v: v[..kv_len].to_vec(),
            d_o: d_o[..q_len].to_vec(),
        }
    }

    /// O's and the LSE's relative L2 errors of a forward pass's outputs (whole tensors, in
    /// `f32`) on the checked part, against `reference`, judged by `tolerance`.
    fn forward_errors(&self, o: &[f32], lse: &[f32], reference: &cpu::Reference, tolerance: Tolerance) -> Checked {
        let o_err = relative_l2_error(self.slice(o, true), &reference.o);
        let lse_err = lse_error(lse.get(..self.shape.query_rows()).unwrap_or(lse), &reference.lse);
        Checked(vec![Measured::new(Output::O, o_err, tolerance), Measured::new(Output::Lse, lse_err, tolerance)])
    }

    /// dQ's, dK's and dV's errors ([`gradient_error`]) of a backward pass's gradients (whole
    /// tensors, in `f32`) on the checked part, against `reference`, judged by `tolerance`.
    fn backward_errors(
        &self,
        [dq, dk, dv]: [&[f32]; 3],
        reference: &cpu::GradientReference,
        tolerance: Tolerance,
    ) -> Checked {
        Checked(vec![
            Measured::new(Output::Dq, gradient_error(self.slice(dq, true), &reference.dq), tolerance),
            Measured::new(Output::Dk, gradient_error(self.slice(dk, false), &reference.dk), tolerance),
            Measured::new(Output::Dv, gradient_error(self.slice(dv, false), &reference.dv), tolerance),
        ])
    }

    /// "checked/all" query heads, for the table.
    fn heads_checked(&self, shape: &AttentionShape) -> String {
        format!("{}/{}", self.shape.batch * self.shape.num_heads_q, shape.batch * shape.num_heads_q)
    }

    /// The checked part of a Q-shaped (`q_like`) or K-shaped tensor: its first elements.
    fn slice<'a>(&self, values: &'a [f32], q_like: bool) -> &'a [f32] {
        let rows = if q_like {
            self.shape.query_rows()
        } else {
            self.shape.batch * self.shape.num_heads_kv * self.shape.seqlen_k
        };
        values.get(..rows * self.shape.head_dim).unwrap_or(values)
    }
}

fn run_case(
    ctx: &Context,
    args: &Args,
    case: &Case,
    (warmup, repeats): (usize, usize),
    table: &mut Table,
    verdicts: &mut Verdicts,
) -> Result<()> {
    let shape = case.shape;
    let options = AttentionOptions { scale: args.scale, causal: case.causal, ..Default::default() };
    // The f32 rows run both dQ modes on one backward tile: one that fits the deterministic
    // mode's kernels fits the atomic one's too.
    let d = shape.head_dim;
    let tile_for = |pass, dq| args.tile_on(ctx, DType::F32, d, case.causal, pass, dq);
    let (tile, backward_tile) =
        (tile_for(Pass::Forward, DqAccumulation::Atomic), tile_for(Pass::Backward, DqAccumulation::Deterministic));
    let inputs = Inputs::new(ctx, &shape)?;
    let [q, k, v, d_o] = &inputs.device;
    let part = CheckedPart::new(&inputs.host, &shape);
    let params = cpu::Params::of(&options, shape.head_dim);
    let forward_ref = cpu::attention(&part.q, &part.k, &part.v, &part.shape, params)?;
    let backward_ref = cpu::attention_backward(&part.q, &part.k, &part.v, &part.d_o, &part.shape, params)?;

    let label = format!("{} {}", case.name, dims(&shape));
    let checked = part.heads_checked(&shape);
    let flops = options.forward_flops(&shape);
    let score_bytes = shape.naive_workspace_bytes();
    let row_bytes = shape.lse_bytes(); // one f32 per query row (LSE, or D in the backward)
    let mut add_row = |kernel: &str, backward: bool, extra: usize, result: Result<(f64, Checked)>| {
        let row = match result {
            Ok((ms, errors)) => {
                let tf = tflops(if backward { 2.5 * flops } else { flops }, ms);
                [
                    kernel.to_string(),
                    format!("{ms:.3}"),
                    format!("{tf:.2}"),
                    format_bytes(extra),
                    checked.clone(),
                    errors.to_string(),
                    verdicts.judge(DType::F32, &errors),
                ]
            }
            // A kernel that cannot run (e.g. naive out of memory at long sequences) gets a row
            // saying why; the other kernels still run.
            Err(e) => [
                kernel.to_string(),
                format!("failed: {e}"),
                String::new(),
                format_bytes(extra),
                String::new(),
                String::new(),
                verdicts.error(&e),
            ],
        };
        table.add_row(std::iter::once(label.clone()).chain(row));
    };
    let tolerance = Tolerance::F32;
    let forward_errors = |o: &DeviceTensor, lse: &DeviceTensor| -> Result<Checked> {
        Ok(part.forward_errors(&o.to_host()?, &lse.to_host()?, &forward_ref, tolerance))
    };
    let backward_errors = |g: &crate::Gradients| -> Result<Checked> {
        let (dq, dk, dv) = (g.dq.to_host()?, g.dk.to_host()?, g.dv.to_host()?);
        Ok(part.backward_errors([&dq, &dk, &dv], &backward_ref, tolerance))
    };
    let time = |work: &mut dyn FnMut() -> Result<()>| median_ms(ctx, (warmup, repeats), work);

    // Each operation runs once for the error check; then it is timed writing into those same
    // outputs (the `_into` calls), so that the times are the kernels', not the allocator's.
    // Backward passes start from their own method's forward outputs.
    let mut naive = ctx.attention_naive(q, k, v, &options);
    add_row(
        "naive forward",
        false,
        score_bytes + row_bytes,
        naive.as_mut().map_err(|e| clone_error(e)).and_then(|out| {
            let errors = forward_errors(&out.o, &out.lse)?;
            Ok((time(&mut || ctx.attention_naive_into(q, k, v, out, &options))?, errors))
        }),
    );
    // The f32 flash rows only when f32 is among the types asked for; the naive rows always.
    let mut flash = None;
    if args.dtype.contains(&DType::F32) {
        let out = flash.insert(ctx.flash_attention_forward(q, k, v, &options, tile)?);
        let errors = forward_errors(&out.o, &out.lse);
        add_row(
            &format!("flash forward (m{}, n{})", tile.block_m, tile.block_n),
            false,
            row_bytes,
            errors.and_then(|errors| {
                Ok((time(&mut || ctx.flash_attention_forward_into(q, k, v, out, &options, tile))?, errors))
            }),
        );
    }
    add_row(
        "naive backward",
        true,
        score_bytes + 2 * row_bytes,
        naive.as_ref().map_err(clone_error).and_then(|out| {
            let mut grads = ctx.attention_naive_backward(q, k, v, &out.o, d_o, &options)?;
            let errors = backward_errors(&grads)?;
            Ok((time(&mut || ctx.attention_naive_backward_into(q, k, v, &out.o, d_o, &mut grads, &options))?, errors))
        }),
    );
    if let Some(flash) = &flash {
        for (mode, name) in [(DqAccumulation::Atomic, "atomic dQ"), (DqAccumulation::Deterministic, "deterministic")] {
            let (o, lse, tile) = (&flash.o, &flash.lse, backward_tile);
            let result =
                ctx.flash_attention_backward(q, k, v, o, lse, d_o, &options, tile, mode).and_then(|mut grads| {
                    let errors = backward_errors(&grads)?;
                    let mut run =
                        || ctx.flash_attention_backward_into(q, k, v, o, lse, d_o, &mut grads, &options, tile, mode);
                    Ok((time(&mut run)?, errors))
                });
            add_row(&format!("flash backward, {name} (m{}, n{})", tile.block_m, tile.block_n), true, row_bytes, result);
        }
    }
    for &dtype in &args.dtype {
        let rows = match dtype {
            DType::F32 => continue,
            DType::F16 => tensor_core_rows::<crate::f16>(ctx, args, case, &inputs, (warmup, repeats), verdicts),
            DType::Bf16 => tensor_core_rows::<crate::bf16>(ctx, args, case, &inputs, (warmup, repeats), verdicts),
        };
        for row in rows {
            table.add_row(std::iter::once(label.clone()).chain(row));
        }
    }
    Ok(())
}

/// The flash rows of one 16-bit type: the inputs rounded to `T`, the forward and the backward
/// (in the faster dQ mode for the type) on the tensor cores, checked against the float64
/// reference computed on the rounded inputs, and judged by the type's tolerances. A type without
/// kernels for the case's head_dim gets a row that says so.
fn tensor_core_rows<T: Element>(
    ctx: &Context,
    args: &Args,
    case: &Case,
    inputs: &Inputs,
    (warmup, repeats): (usize, usize),
    verdicts: &mut Verdicts,
) -> Vec<[String; 7]> {
    let (shape, dtype) = (case.shape, T::DTYPE);
    let options = AttentionOptions { scale: args.scale, causal: case.causal, ..Default::default() };
    let mut mode = args.dq_mode(ctx, dtype, shape.head_dim, case.causal);
    let tile_for = |pass| args.tile_on(ctx, dtype, shape.head_dim, case.causal, pass, mode);
    let (mut tile, mut backward_tile) = (tile_for(Pass::Forward), tile_for(Pass::Backward));
    // `--tune` measures the sm_80 tiles only; where this context runs a Hopper kernel (which the
    // built-in tile selects), that kernel is the faster, so a tuned tile does not replace it.
    if args.block_m.is_none() {
        let d = shape.head_dim;
        let (forward_default, backward_default) =
            (TileConfig::default_for_dtype(dtype, d), TileConfig::default_backward_for_dtype(dtype, d));
        if ctx.target().hopper_forward_for(dtype, &shape, forward_default, &options).is_some() {
            tile = forward_default;
        }
        if ctx.target().hopper_backward(dtype, d, backward_default, DqAccumulation::Atomic).is_some() {
            (backward_tile, mode) = (backward_default, DqAccumulation::Atomic);
        }
    }
    let mode_name = super::dq_mode_name(ctx, dtype, shape.head_dim, backward_tile, mode);
    let forward_kernel = ctx.forward_kernel_label(dtype, &shape, tile, &options);
    let names = [
        format!("flash forward {dtype} ({forward_kernel})"),
        format!(
            "flash backward {dtype}, {mode_name} ({})",
            ctx.backward_kernel_label(dtype, shape.head_dim, backward_tile, mode, &options)
        ),
    ];
    let flops = options.forward_flops(&shape);
    // The inputs rounded to T and widened back (exactly): what the kernels see, and so what the
    // reference must see.
    let rounded: [Vec<f32>; 4] = inputs.host.each_ref().map(|x| to_f32_vec(&from_f32_slice::<T>(x)));
    let part = CheckedPart::new(&rounded, &shape);
    let tolerance = Tolerance::of(dtype);
    // The forward's result, and the backward's (a backward that cannot run, on a GPU whose shared
    // memory its tile does not fit, costs only the backward row).
    type Measured = (f64, Checked);
    let result = (|| -> Result<(Measured, Result<Measured>)> {
        let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()];
        let device: Vec<DeviceTensor<T>> =
            (0..4).map(|i| ctx.upload(&from_f32_slice::<T>(&rounded[i]), &shapes[i])).collect::<Result<_>>()?;
        let (q, k, v, d_o) = (&device[0], &device[1], &device[2], &device[3]);
        let params = cpu::Params::of(&options, shape.head_dim);
        let forward_ref = cpu::attention(&part.q, &part.k, &part.v, &part.shape, params)?;
        let backward_ref = cpu::attention_backward(&part.q, &part.k, &part.v, &part.d_o, &part.shape, params)?;
        let time = |work: &mut dyn FnMut() -> Result<()>| median_ms(ctx, (warmup, repeats), work);
        let widened = |t: &DeviceTensor<T>| t.to_host().map(|x| to_f32_vec(&x));

        let mut out = ctx.flash_attention_forward(q, k, v, &options, tile)?;
        let forward_errors = part.forward_errors(&widened(&out.o)?, &out.lse.to_host()?, &forward_ref, tolerance);
        let forward_ms = time(&mut || ctx.flash_attention_forward_into(q, k, v, &mut out, &options, tile))?;

        let (o, lse) = (&out.o, &out.lse);
        let backward = (|| -> Result<Measured> {
            let mut grads = ctx.flash_attention_backward(q, k, v, o, lse, d_o, &options, backward_tile, mode)?;
            let (dq, dk, dv) = (widened(&grads.dq)?, widened(&grads.dk)?, widened(&grads.dv)?);
            let backward_errors = part.backward_errors([&dq, &dk, &dv], &backward_ref, tolerance);
            let backward_ms = time(&mut || {
                ctx.flash_attention_backward_into(q, k, v, o, lse, d_o, &mut grads, &options, backward_tile, mode)
            })?;
            Ok((backward_ms, backward_errors))
        })();
        Ok(((forward_ms, forward_errors), backward))
    })();
    let checked = part.heads_checked(&shape);
    // One `f32` per query row (LSE, or D in the backward); a 16-bit backward with atomic dQ, or
    // the Hopper one, also accumulates dQ in an `f32` copy.
    let row_bytes = shape.lse_bytes();
    let hopper = ctx.target().hopper_backward(dtype, shape.head_dim, backward_tile, mode).is_some();
    let f32_copy = mode == DqAccumulation::Atomic || hopper;
    let dq_copy_bytes = if f32_copy { shape.q_shape().iter().product::<usize>() * 4 } else { 0 };
    let empty = String::new;
    let mut row = |i: usize, result: Result<Measured>| match result {
        Ok((ms, errors)) => {
            let tf = tflops(if i == 1 { 2.5 * flops } else { flops }, ms);
            let extra = if i == 1 { row_bytes + dq_copy_bytes } else { row_bytes };
            let verdict = verdicts.judge(dtype, &errors);
            [
                names[i].clone(),
                format!("{ms:.3}"),
                format!("{tf:.2}"),
                format_bytes(extra),
                checked.clone(),
                errors.to_string(),
                verdict,
            ]
        }
        Err(e) => {
            let verdict = verdicts.error(&e);
            [names[i].clone(), format!("failed: {e}"), empty(), empty(), empty(), empty(), verdict]
        }
    };
    match result {
        Ok((forward, backward)) => vec![row(0, Ok(forward)), row(1, backward)],
        Err(e) => vec![row(0, Err(e))],
    }
}

/// The tuned tiles for this device, if `--tune` saved some; says which tiles the run uses.
fn load_tuned_tiles(ctx: &Context) -> Option<TunedTiles> {
    let path = TunedTiles::default_path()?;
    match TunedTiles::load(&path, ctx.device()) {
        Ok(Some(tuned)) => {
            println!("tiles: tuned on this device ({}); built-in where it has none", path.display());
            Some(tuned)
        }
        Ok(None) => {
            if ctx.has_hopper_kernels() && ctx.kernel_path() == KernelPath::Sm90a {
                println!("tiles: built-in (the Hopper kernels' own; `--tune` measures the sm_80 tiles only)");
            } else {
                println!("tiles: built-in (`--tune` measures this device's fastest)");
            }
            None
        }
        Err(e) => {
            println!("tiles: built-in ({e})");
            None
        }
    }
}

/// The median time of `work`, in ms, after `warmup` untimed runs (see `timing::time_gpu`).
fn median_ms(ctx: &Context, (warmup, repeats): (usize, usize), work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    time_gpu(ctx, warmup, repeats, work).map(|t| t.median_ms)
}

/// Errors are not `Clone`; a failed naive forward is reported in its backward row by message,
/// a driver error keeping its code (so that running out of memory still reads as such).
fn clone_error(e: &Error) -> Error {
    match e {
        Error::Driver { during, source } => {
            Error::Driver { during: format!("{during} (the naive forward)"), source: *source }
        }
        _ => Error::Shape(format!("the naive forward failed: {e}")),
    }
}

/// Forward flops above which a case is too slow for the CPU-only fallback (a few seconds).
const CPU_ONLY_MAX_FLOPS: f64 = 2e9;

/// Without a GPU: the plain CPU formula against the tiled CPU FlashAttention, on the requested
/// cases where they are small enough, otherwise on a small case; the tiled rows judged as
/// `tests/cpu_reference.rs` judges them (every element of O and LSE within
/// [`CPU_TILED_TOLERANCE`] · (1 + |plain|)).
fn run_cpu_only(args: &Args, cases: &[Case]) -> Result<()> {
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header([
        "case [B, Hq, Hkv, Sq, Sk, D]",
        "kernel (CPU, f64)",
        "time (ms)",
        "max |Δ|/(1 + |plain|) vs plain",
        "check",
    ]);
    let (mut rows, mut failed) = (0, 0);
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
        let params = cpu::Params::of(
            &AttentionOptions { scale: args.scale, causal: case.causal, ..Default::default() },
            shape.head_dim,
        );
        let tile = args.tile(DType::F32, shape.head_dim, case.causal, Pass::Forward);
        let start = Instant::now();
        let plain = cpu::attention(&q, &k, &v, &shape, params)?;
        let plain_ms = start.elapsed().as_secs_f64() * 1e3;
        let start = Instant::now();
        let tiled = cpu::flash_attention(&q, &k, &v, &shape, params, tile)?;
        let tiled_ms = start.elapsed().as_secs_f64() * 1e3;
        // Relative to 1 + |plain|, NaN-propagating (a NaN fails); equal values (−∞ LSEs) differ by 0.
        let worst = |plain: &[f64], tiled: &[f64]| {
            plain.iter().zip(tiled).fold(0.0f64, |m, (&a, &b)| {
                let d = if a == b { 0.0 } else { (a - b).abs() / (1.0 + a.abs()) };
                if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) }
            })
        };
        let (o_diff, lse_diff) = (worst(&plain.o, &tiled.o), worst(&plain.lse, &tiled.lse));
        let passes = o_diff <= CPU_TILED_TOLERANCE && lse_diff <= CPU_TILED_TOLERANCE;
        rows += 1;
        failed += usize::from(!passes);
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
        table.add_row([label.clone(), "plain formula".into(), format!("{plain_ms:.1}"), "-".into(), "-".into()]);
        table.add_row([
            label,
            format!("tiled flash (m{}, n{})", tile.block_m, tile.block_n),
            format!("{tiled_ms:.1}"),
            format!("O {o_diff:.1e}, LSE {lse_diff:.1e}"),
            (if passes { "PASS" } else { "**FAIL**" }).into(),
        ]);
    }
    println!("{table}");
    println!(
        "check: the tiled rows within {CPU_TILED_TOLERANCE:.0e} · (1 + |plain|) per element, as tests/cpu_reference.rs"
    );
    if failed > 0 {
        return Err(Error::CheckFailed {
            failed,
            rows,
            what: "the tiled CPU FlashAttention differs from the plain formula",
        });
    }
    println!("check: all {rows} tiled rows PASS; {EMULATOR_HINT}");
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
