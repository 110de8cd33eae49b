//! `rust-attention attn`: attention forward (and, given dO, backward) on tensors read from files,
//! with the outputs written to a file, the time of each kernel printed and, with `--check`, each
//! output's error against the CPU reference.
//!
//! ```text
//! rust-attention attn --q q.npy --k k.npy --v v.npy [--do do.npy] [--causal top-left|bottom-right]
//!     [--scale X] [--kernel flash|naive] [--dtype f32|f16|bf16] [--out DIR|FILE.safetensors] [--check]
//! rust-attention attn --input qkv.safetensors ...   # tensors q, k, v (and do) from one file
//! rust-attention attn --random 2x8x128x64 [--seed N] [--forward-only] ...   # seeded random inputs
//! ```
//!
//! * Inputs: Q `[batch, num_heads_q, seqlen_q, head_dim]`, K and V `[batch, num_heads_kv,
//!   seqlen_k, head_dim]` (grouped-query attention when `num_heads_kv` divides `num_heads_q`),
//!   dO Q's shape; `.npy` or `.safetensors` files as [`crate::io`] reads them (bf16 in `.npy` as
//!   `NAME.bf16.npy`). Or `--random SHAPE`: Q, K, V and dO drawn from the standard normal
//!   distribution (seeded: `--seed`), so that one kernel runs at one shape without any file.
//! * `--dtype`: the element type the kernels run in; default: the inputs' own (they must then
//!   agree). Inputs of another type are rounded to it first (f32 files run in f16, say), and
//!   `--check` compares against the reference on those rounded inputs. `f32` runs the CUDA-core
//!   kernels (flash: head_dim 1 to 256; naive: any head_dim), `f16`/`bf16` the tensor-core
//!   flash kernels (head_dim 1 to 256, forward and backward);
//!   the naive kernels are `f32` only.
//! * Outputs: O and dQ, dK, dV in the run's element type; LSE always `f32`, the natural-log
//!   logsumexp of each score row, ln Σ_j exp(scale · q·k_j) (−∞ for a row that sees no key),
//!   `[batch, num_heads_q, seqlen_q]`. Written under the names `o`, `lse`, `dq`, `dk`, `dv` to one
//!   `.safetensors` file, or to a directory of `.npy` files (`o.npy`, …; `o.bf16.npy` for bf16).
//! * Tiles: the tuned defaults ([`TileConfig::default_for_dtype`],
//!   [`TileConfig::default_backward_for_dtype`]); dQ mode: `--dq`, by default
//!   [`Context::dq_accumulation_for`].
//! * `--device`: a CUDA ordinal, `cpu-emulated` (the kernels' own code on the CPU emulator: slow,
//!   for small inputs), or `cpu` (the CPU reference, the plain formula in `f64`, its results
//!   rounded to the run's type). With a CUDA ordinal and no GPU on the machine, the job says so
//!   and runs the CPU reference, as the main job does.
//! * `--check`: each row's errors against the test suite's tolerances ([`crate::check::Tolerance`]
//!   of the run's type); a row beyond them is marked FAIL and the job fails (after writing the
//!   outputs), its last line saying how many rows failed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::ValueEnum;
use comfy_table::{Table, presets::ASCII_MARKDOWN};

use super::{CausalArg, DeviceArg, Verdicts};
use crate::check::{Checked, Measured, Output, Tolerance, gradient_error, lse_error, random_normal, relative_l2_error};
use crate::dtype::{DType, Element};
use crate::io::{self, HostTensor};
use crate::timing::{tflops, time_gpu};
use crate::{
    AttentionOptions, AttentionShape, Context, DqAccumulation, Error, FlashKernel, KernelPath, Result, TileConfig, cpu,
};

/// The `attn` subcommand's flags.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Q, [batch, num_heads_q, seqlen_q, head_dim]: a .npy file, or a .safetensors file holding a
    /// tensor named `q` (or give all inputs in one file with --input, or --random).
    #[arg(long, value_name = "FILE", required_unless_present_any = ["input", "random"], conflicts_with_all = ["input", "random"])]
    pub q: Option<PathBuf>,
    /// K, [batch, num_heads_kv, seqlen_k, head_dim] (num_heads_kv dividing num_heads_q: GQA); a .npy
    /// file, or a .safetensors file holding `k`.
    #[arg(long, value_name = "FILE", required_unless_present_any = ["input", "random"], conflicts_with_all = ["input", "random"])]
    pub k: Option<PathBuf>,
    /// V, K's shape; a .npy file, or a .safetensors file holding `v`.
    #[arg(long, value_name = "FILE", required_unless_present_any = ["input", "random"], conflicts_with_all = ["input", "random"])]
    pub v: Option<PathBuf>,
    /// dO = ∂loss/∂O, Q's shape; a .npy file, or a .safetensors file holding `do`. Given, the
    /// backward pass runs too.
    #[arg(long = "do", value_name = "FILE", conflicts_with_all = ["input", "random"])]
    pub d_o: Option<PathBuf>,
    /// One .safetensors file holding tensors q, k, v and, for the backward pass, do (in place of
    /// --q, --k, --v, --do).
    #[arg(long, value_name = "FILE", conflicts_with = "random")]
    pub input: Option<PathBuf>,
    /// Random inputs instead of files: Q, K, V and dO drawn from the standard normal distribution
    /// (rounded to --dtype, default f32), of shape BxHxSxD (batch, heads, seqlen, head_dim; e.g.
    /// 2x8x128x64) or BxHqxHkvxSqxSkxD (grouped-query or cross attention, e.g. 1x8x2x100x300x64).
    /// The backward pass runs too, unless --forward-only.
    #[arg(long, value_name = "SHAPE")]
    pub random: Option<RandomShape>,
    /// The seed of --random's inputs: Q is drawn with SEED, K with SEED+1, V with SEED+2, dO with
    /// SEED+3 (`check::random_normal`); default 0.
    #[arg(long)]
    pub seed: Option<u64>,
    /// With --random: no dO, the forward pass only.
    #[arg(long)]
    pub forward_only: bool,
    /// Causal mask.
    #[arg(long, value_enum, default_value_t = CausalArg::None)]
    pub causal: CausalArg,
    /// The window, score modification and sinks (`super::ModelArgs`).
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// A document mask (packed sequences): every batch entry's row is cut into documents of
    /// LEN,LEN,... tokens (the tokens after them form one more document), and each token sees
    /// only the tokens of its own document; with --causal top-left each document is causal on
    /// its own. Needs seqlen_q = seqlen_k, unless --documents-k gives the documents' key lengths.
    #[arg(long, value_name = "LEN,LEN,...", value_delimiter = ',', conflicts_with = "prefix_lm")]
    pub documents: Option<Vec<usize>>,
    /// With --documents: the documents' key lengths, one per --documents length (the keys after
    /// them belong to the one more document), for documents whose queries and keys differ in
    /// length (chunked prefill against cached keys, ragged cross-attention; seqlen_q may then
    /// differ from seqlen_k). Each document's queries see only its keys, and --causal and
    /// --window apply inside each document on its own lengths (`Context::varlen_mask`). A
    /// document may have 0 queries or 0 keys.
    #[arg(long, value_name = "LEN,LEN,...", value_delimiter = ',', requires = "documents")]
    pub documents_k: Option<Vec<usize>>,
    /// Prefix-LM: the first PREFIX tokens of every row see each other in both directions, every
    /// later token the prefix and the tokens before it. A causal mask of its own (no --causal).
    /// Needs seqlen_q = seqlen_k.
    #[arg(long, value_name = "PREFIX")]
    pub prefix_lm: Option<usize>,
    /// An additive bias on the logits, with its gradient dBias in the backward pass
    /// (`AttentionOptions::with_bias`): an `f32` tensor drawn from the standard normal
    /// distribution (seed SEED+4), of shape [1, Hq, Sq, Sk] (`per-head`: Swin's or T5's learned
    /// position bias), [B, 1, Sq, Sk] (`per-batch`), [1, 1, Sq, Sk] (`shared`) or [B, Hq, Sq, Sk]
    /// (`full`). Flash kernels only; not with --softcap.
    #[arg(long, value_enum, value_name = "BROADCAST")]
    pub bias: Option<BiasArg>,
    /// Softmax scale; default 1/sqrt(head_dim).
    #[arg(long, allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Which kernels: FlashAttention-2 (f32, f16, bf16) or the naive ones (f32 only).
    #[arg(long, value_enum, default_value_t = KernelChoice::Flash)]
    pub kernel: KernelChoice,
    /// Element type to run in; default: the inputs' type. Inputs of another type are rounded to it.
    #[arg(long)]
    pub dtype: Option<DType>,
    /// Where to write O and LSE (and dQ, dK, dV): FILE.safetensors, or a directory for one .npy
    /// file per tensor. Nothing is written without it.
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
    /// Also run the CPU reference (f64, every head: slow for long sequences), print each
    /// output's relative L2 error against it and judge each row PASS or FAIL by the test suite's
    /// tolerances for the type (`check::Tolerance`); a FAIL makes the job fail.
    #[arg(long)]
    pub check: bool,
    /// A CUDA device ordinal (0, 1, …), `cpu-emulated` (the kernels on the CPU emulator: slow,
    /// small inputs only) or `cpu` (the CPU reference instead of the kernels).
    #[arg(long, default_value = "0")]
    pub device: DeviceArg,
    /// Kernel path for the f16/bf16 passes with the built-in tiles: `sm90a` (Hopper's wgmma and
    /// TMA for the forward and backward passes; compute capability 9.0 only) or
    /// `sm80` (mma.sync, every GPU). Default: sm90a where it runs (or what
    /// $RUST_ATTENTION_KERNELS says).
    #[arg(long)]
    pub kernels: Option<KernelPath>,
    /// How the 16-bit flash backward sums dQ: `atomic` or `deterministic` (bit-identical on
    /// every run); default: the faster on this GPU (`Context::dq_accumulation_for`).
    #[arg(long)]
    pub dq: Option<DqAccumulation>,
    /// Timed repeats per kernel (the median is printed).
    #[arg(long, default_value_t = 10)]
    pub repeats: usize,
    /// Untimed warm-up runs per kernel.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
}

/// `--bias`: which dimensions of `[batch, num_heads_q, seqlen_q, seqlen_k]` the bias has (the
/// others are 1, broadcast).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BiasArg {
    /// `[1, num_heads_q, seqlen_q, seqlen_k]`: one plane per head, shared by the batch entries.
    PerHead,
    /// `[batch, 1, seqlen_q, seqlen_k]`: one plane per batch entry, shared by the heads.
    PerBatch,
    /// `[1, 1, seqlen_q, seqlen_k]`: one plane for the whole problem.
    Shared,
    /// `[batch, num_heads_q, seqlen_q, seqlen_k]`: a plane per batch entry and head.
    Full,
}

impl BiasArg {
    /// The bias's shape for `shape`.
    fn dims(self, shape: &AttentionShape) -> [usize; 4] {
        let (b, h) = match self {
            Self::PerHead => (1, shape.num_heads_q),
            Self::PerBatch => (shape.batch, 1),
            Self::Shared => (1, 1),
            Self::Full => (shape.batch, shape.num_heads_q),
        };
        [b, h, shape.seqlen_q, shape.seqlen_k]
    }
}

/// `--bias`'s values on the host: random normal of [`BiasArg::dims`], seed SEED+4.
struct HostBias {
    values: Vec<f32>,
    dims: [usize; 4],
}

impl HostBias {
    /// The bias `arg` asks for, drawn for `shape`.
    ///
    /// # Errors
    /// [`Error::Bias`] when the bias would have more than 2^32 entries.
    fn draw(arg: BiasArg, shape: &AttentionShape, seed: u64) -> Result<Self> {
        let dims = arg.dims(shape);
        let n = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).filter(|&n| n <= RANDOM_MAX_ELEMENTS);
        let n =
            n.ok_or_else(|| Error::Bias(format!("a bias {dims:?} has more than 2^32 entries, too many to draw")))?;
        Ok(Self { values: random_normal(n, seed.wrapping_add(4)), dims })
    }

    /// The values as the CPU references read them.
    fn values(&self) -> cpu::BiasValues<'_> {
        cpu::BiasValues { values: &self.values, shape: self.dims }
    }
}

/// `--kernel`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelChoice {
    /// FlashAttention-2: CUDA cores in f32, tensor cores in f16/bf16.
    Flash,
    /// Standard attention with the score matrix in device memory (f32 only).
    Naive,
}

/// `--random`'s shape: `BxHxSxD` or `BxHqxHkvxSqxSkxD`, checked as a problem shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomShape(pub AttentionShape);

/// The most elements `--random` draws for one tensor (2^32: 16 GiB in `f32`).
const RANDOM_MAX_ELEMENTS: usize = 1 << 32;

impl std::str::FromStr for RandomShape {
    type Err = String;

    /// `2x8x128x64` = [batch 2, 8 heads, 128 tokens, head_dim 64]; `1x8x2x100x300x64` = batch 1,
    /// 8 query heads, 2 key/value heads, 100 queries, 300 keys, head_dim 64.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let expected = "expected BxHxSxD (batch, heads, seqlen, head_dim; e.g. 2x8x128x64) or BxHqxHkvxSqxSkxD";
        let dims = s
            .split(['x', 'X', '×'])
            .map(|d| d.trim().parse::<usize>().map_err(|_| format!("`{s}`: `{d}` is not a whole number; {expected}")))
            .collect::<std::result::Result<Vec<usize>, String>>()?;
        let (q, kv) = match dims[..] {
            [b, h, n, d] => ([b, h, n, d], [b, h, n, d]),
            [b, hq, hkv, nq, nk, d] => ([b, hq, nq, d], [b, hkv, nk, d]),
            _ => return Err(format!("`{s}` has {} dimensions; {expected}", dims.len())),
        };
        let shape = AttentionShape::from_qkv(&q, &kv, &kv).map_err(|e| format!("`{s}`: {e}"))?;
        for (name, dims) in [("q", q), ("k", kv)] {
            let n = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            if n.is_none_or(|n| n > RANDOM_MAX_ELEMENTS) {
                return Err(format!("`{s}`: {name} {dims:?} has more than 2^32 elements, too many to draw"));
            }
        }
        Ok(Self(shape))
    }
}

/// An input tensor and where it came from (a file, or `--random`).
struct Input {
    tensor: HostTensor,
    source: String,
}

impl Input {
    fn error(&self, reason: String) -> Error {
        Error::TensorFile { path: self.source.clone(), tensor: Some(self.tensor.name().to_string()), reason }
    }
}

/// Q, K, V and dO as read.
struct Inputs {
    q: Input,
    k: Input,
    v: Input,
    d_o: Option<Input>,
}

impl Inputs {
    fn read(args: &Args) -> Result<Self> {
        // (Checked here, not by clap's `requires`, which does not fire when the flag it requires
        // conflicts with one that is present, as --random does with the file flags.)
        if args.random.is_none() && (args.seed.is_some() || args.forward_only) {
            let flag = if args.seed.is_some() { "--seed" } else { "--forward-only" };
            return Err(Error::Argument(format!("{flag} goes with --random (the inputs of files are what they are)")));
        }
        if let Some(RandomShape(shape)) = args.random {
            let seed = args.seed.unwrap_or(0);
            let draw = |i: u64, name: &str, dims: [usize; 4]| -> Result<Input> {
                let values = random_normal(dims.iter().product(), seed.wrapping_add(i));
                let source = format!("--random, seed {}", seed.wrapping_add(i));
                Ok(Input { tensor: HostTensor::new(name, &dims, values)?, source })
            };
            let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
            return Ok(Self {
                q: draw(0, "q", q_shape)?,
                k: draw(1, "k", kv_shape)?,
                v: draw(2, "v", kv_shape)?,
                d_o: if args.forward_only { None } else { Some(draw(3, "do", q_shape)?) },
            });
        }
        if let Some(path) = &args.input {
            let mut tensors = io::read_safetensors(path)?;
            let mut take = |name: &str| {
                tensors
                    .iter()
                    .position(|t| t.name() == name)
                    .map(|i| Input { tensor: tensors.remove(i), source: path.display().to_string() })
            };
            let (q, k, v, d_o) = (take("q"), take("k"), take("v"), take("do"));
            let missing = |name: &str| Error::TensorFile {
                path: path.display().to_string(),
                tensor: Some(name.into()),
                reason: "no such tensor; --input needs tensors q, k, v (and do for the backward pass)".into(),
            };
            return Ok(Self {
                q: q.ok_or_else(|| missing("q"))?,
                k: k.ok_or_else(|| missing("k"))?,
                v: v.ok_or_else(|| missing("v"))?,
                d_o,
            });
        }
        let read = |path: &Option<PathBuf>, name: &str| -> Result<Option<Input>> {
            path.as_ref()
                .map(|p| Ok(Input { tensor: io::read_tensor(p, name)?, source: p.display().to_string() }))
                .transpose()
        };
        let required = |name: &str| Error::Argument(format!("--{name} is required (or --input, or --random)"));
        Ok(Self {
            q: read(&args.q, "q")?.ok_or_else(|| required("q"))?,
            k: read(&args.k, "k")?.ok_or_else(|| required("k"))?,
            v: read(&args.v, "v")?.ok_or_else(|| required("v"))?,
            d_o: read(&args.d_o, "do")?,
        })
    }

    fn all(&self) -> impl Iterator<Item = &Input> {
        [&self.q, &self.k, &self.v].into_iter().chain(self.d_o.as_ref())
    }

    /// The problem shape; every tensor's rank, and dO's shape, checked with the file named.
    fn shape(&self) -> Result<AttentionShape> {
        for input in self.all() {
            let shape = input.tensor.shape();
            if shape.len() != 4 {
                return Err(input.error(format!(
                    "shape {shape:?} has {} dimensions; expected 4: [batch, heads, seqlen, head_dim]",
                    shape.len()
                )));
            }
        }
        if let Some(d_o) = &self.d_o
            && d_o.tensor.shape() != self.q.tensor.shape()
        {
            return Err(d_o.error(format!(
                "shape {:?} differs from q's {:?}; dO has the shape of Q (and O)",
                d_o.tensor.shape(),
                self.q.tensor.shape()
            )));
        }
        Ok(AttentionShape::from_qkv(self.q.tensor.shape(), self.k.tensor.shape(), self.v.tensor.shape())?)
    }

    /// The inputs' common type, for a run without --dtype.
    fn common_dtype(&self) -> Result<DType> {
        let dtype = self.q.tensor.dtype();
        if self.all().all(|input| input.tensor.dtype() == dtype) {
            return Ok(dtype);
        }
        let each: Vec<String> = self.all().map(|i| format!("{} {}", i.tensor.name(), i.tensor.dtype())).collect();
        Err(Error::Argument(format!("the inputs have different types ({}); choose one with --dtype", each.join(", "))))
    }

    /// The tensors rounded to `dtype` (unchanged when they are of it).
    fn converted(&self, dtype: DType) -> Vec<HostTensor> {
        self.all().map(|input| input.tensor.converted(dtype)).collect()
    }
}

/// One line of the table: a kernel (or the CPU reference), its time and the outputs it made.
struct Row {
    label: String,
    ms: f64,
    /// Flops in the field's convention (forward 4·B·Hq·Sq·Sk·D, half with a mask; backward 2.5×).
    flops: f64,
    outputs: Vec<HostTensor>,
}

/// Runs the `attn` job.
///
/// # Errors
/// [`Error::TensorFile`] for an input file that cannot be read or a tensor of the wrong rank or
/// type; [`Error::Shape`] for inputs whose shapes disagree; [`Error::Argument`] for a 16-bit type
/// with the naive kernels, or inputs of different types without --dtype;
/// [`Error::HeadDimNotCompiled`] for a head_dim without flash kernels for the type; what the
/// kernels and the device return; [`Error::TensorFile`] when the output cannot be written.
pub fn run(args: &Args) -> Result<()> {
    // Every check that needs no device comes first, so that a mistake is reported the same way
    // on every machine.
    let inputs = Inputs::read(args)?;
    let shape = inputs.shape()?;
    let dtype = match args.dtype {
        Some(dtype) => dtype,
        None => inputs.common_dtype()?,
    };
    if args.kernel == KernelChoice::Naive && args.model.sinks.is_some() {
        return Err(Error::Sinks("the naive kernels do not take attention sinks; use --kernel flash".into()));
    }
    if args.kernel == KernelChoice::Naive && args.bias.is_some() {
        return Err(Error::Bias("the naive kernels do not take a bias; use --kernel flash".into()));
    }
    if args.bias.is_some() && args.model.softcap.is_some() {
        return Err(Error::Bias("softcapping and a bias together are not supported".into()));
    }
    if args.kernel == KernelChoice::Naive && dtype != DType::F32 {
        return Err(Error::Argument(format!(
            "the naive kernels take f32 only; for {dtype} use --kernel flash (the tensor-core kernels), or --dtype f32"
        )));
    }
    let options = AttentionOptions {
        scale: args.scale,
        causal: args.causal.into(),
        window: args.model.window(),
        score: args.model.score(),
        ..Default::default()
    };
    options.checked_scale(shape.head_dim)?;
    check_mask_table_args(args, &shape)?;
    let sinks = args.model.sinks.map(|sink| vec![sink; shape.num_heads_q]);
    let sinks = sinks.as_deref();
    let bias = args.bias.map(|arg| HostBias::draw(arg, &shape, args.seed.unwrap_or(0))).transpose()?;
    let extras = Extras { sinks, bias: bias.as_ref() };
    if let Some(out) = &args.out {
        io::check_output_path(out)?;
    }
    let backward = inputs.d_o.is_some();
    if args.kernel == KernelChoice::Flash && matches!(args.device, DeviceArg::Kernels(_)) {
        let d = shape.head_dim;
        TileConfig::default_for_dtype(dtype, d).compiled_entry_for(FlashKernel::Forward, dtype, d)?;
        if backward {
            crate::ops::check_backward_head_dim(dtype, d)?;
        }
    }

    let ctx = match args.device {
        DeviceArg::Cpu => None,
        DeviceArg::Kernels(device) => match Context::open(device) {
            Ok(ctx) => Some(ctx),
            Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => {
                println!("no CUDA device ({e}); computing with the CPU reference (f64, plain formula) instead");
                None
            }
            Err(e) => return Err(e),
        },
    };
    match &ctx {
        Some(ctx) if ctx.is_emulated() => println!("device: CPU emulator (the kernels' own code; slow by design)"),
        Some(ctx) => println!("device: {}", ctx.device()),
        None => println!("device: CPU reference (f64, plain formula; results rounded to {dtype})"),
    }
    let ctx = ctx.map(|ctx| super::with_kernels(ctx, args.kernels)).transpose()?;
    print_problem(&inputs, &shape, dtype, args);
    // A mask table lives on the context that runs the kernels; the CPU reference alone reads
    // its host copy, made on an emulator context.
    let table = match &ctx {
        Some(ctx) => mask_table(args, &shape, ctx)?,
        None => mask_table(args, &shape, &Context::cpu_emulated())?,
    };
    let options = with_table(options, table.as_ref());

    let rounded = inputs.converted(dtype);
    let (warmup, repeats) = match &ctx {
        Some(ctx) if !ctx.is_emulated() => (args.warmup, args.repeats),
        _ => (0, 1),
    };
    let flops = options.forward_flops(&shape);
    let rows = match (&ctx, args.kernel, dtype) {
        (None, _, _) => cpu_rows(&rounded, &shape, &options, extras, dtype, flops)?,
        (Some(ctx), KernelChoice::Naive, _) => naive_rows(ctx, &rounded, &options, (warmup, repeats), flops)?,
        (Some(ctx), KernelChoice::Flash, DType::F32) => {
            flash_rows::<f32>(ctx, &rounded, &options, extras, args.dq, (warmup, repeats), flops)?
        }
        (Some(ctx), KernelChoice::Flash, DType::F16) => {
            flash_rows::<crate::f16>(ctx, &rounded, &options, extras, args.dq, (warmup, repeats), flops)?
        }
        (Some(ctx), KernelChoice::Flash, DType::Bf16) => {
            flash_rows::<crate::bf16>(ctx, &rounded, &options, extras, args.dq, (warmup, repeats), flops)?
        }
    };

    let errors = if args.check { Some(check(&rounded, &shape, &options, extras, dtype, &rows)?) } else { None };
    let mut verdicts = Verdicts::default();
    print_table(&rows, errors.as_deref(), dtype, &mut verdicts);
    match &ctx {
        Some(ctx) if !ctx.is_emulated() => println!(
            "time: median of {repeats} runs after {warmup} warm-up runs (CUDA events); TFLOP/s counts the forward as \
             4·B·Hq·Sq·Sk·D (half with a causal mask; with a window, on the visible pairs) and the backward as 2.5× that"
        ),
        _ => println!("time: one run, host clock"),
    }

    let outputs: Vec<HostTensor> = rows.into_iter().flat_map(|row| row.outputs).collect();
    match &args.out {
        Some(out) => {
            let written = io::write_tensors(out, &outputs)?;
            let described: Vec<String> =
                outputs.iter().map(|t| format!("{} {:?} {}", t.name(), t.shape(), t.dtype())).collect();
            println!("wrote {} to {}", described.join(", "), describe_paths(out, &written));
        }
        None => println!("no --out: the outputs were not written"),
    }
    if args.check { verdicts.finish() } else { Ok(()) }
}

/// Refuses `--documents` and `--prefix-lm` where they cannot apply, before any device work.
///
/// # Errors
/// [`Error::Argument`] for a table on unequal sequence lengths, documents longer than the row,
/// a document of 0 tokens, a prefix longer than the row, or a prefix with --causal.
fn check_mask_table_args(args: &Args, shape: &AttentionShape) -> Result<()> {
    if args.documents.is_none() && args.prefix_lm.is_none() {
        return Ok(());
    }
    let flag = if args.documents.is_some() { "--documents" } else { "--prefix-lm" };
    if let Some(lengths_k) = &args.documents_k {
        return check_varlen_args(args, shape, lengths_k);
    }
    if shape.seqlen_q != shape.seqlen_k {
        let remedy = if args.documents.is_some() { "; give --documents-k for the documents' key lengths" } else { "" };
        return Err(Error::Argument(format!(
            "{flag} needs seqlen_q = seqlen_k (one token axis); got {} and {}{remedy}",
            shape.seqlen_q, shape.seqlen_k
        )));
    }
    if let Some(lengths) = &args.documents {
        if lengths.contains(&0) {
            return Err(Error::Argument("--documents: a document has at least 1 token".into()));
        }
        let total = lengths.iter().try_fold(0usize, |sum, &n| sum.checked_add(n)).unwrap_or(usize::MAX);
        if total > shape.seqlen_q {
            return Err(Error::Argument(format!(
                "--documents: the documents hold {total} tokens, more than seqlen = {}",
                shape.seqlen_q
            )));
        }
    }
    if let Some(prefix) = args.prefix_lm {
        if prefix > shape.seqlen_q {
            return Err(Error::Argument(format!("--prefix-lm {prefix} is longer than seqlen = {}", shape.seqlen_q)));
        }
        if args.causal != CausalArg::None {
            return Err(Error::Argument(
                "--prefix-lm is a causal mask of its own; leave out --causal (it would hide the prefix's later keys)"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// Refuses `--documents` with `--documents-k` (key lengths `lengths_k`) where they cannot
/// apply, before any device work.
///
/// # Errors
/// [`Error::Argument`] for lists of different lengths, documents longer than seqlen_q or
/// seqlen_k, and ALiBi (whose distances would run along the packed row). A document may have no
/// queries or no keys (FlashAttention's varlen takes empty sequences too).
fn check_varlen_args(args: &Args, shape: &AttentionShape, lengths_k: &[usize]) -> Result<()> {
    let lengths_q = args.documents.as_deref().unwrap_or_default();
    if lengths_q.len() != lengths_k.len() {
        return Err(Error::Argument(format!(
            "--documents-k lists {} key length(s) for {} document(s) in --documents; give one per document",
            lengths_k.len(),
            lengths_q.len()
        )));
    }
    for (flag, lengths, seqlen, axis) in [
        ("--documents", lengths_q, shape.seqlen_q, "seqlen_q"),
        ("--documents-k", lengths_k, shape.seqlen_k, "seqlen_k"),
    ] {
        let total = lengths.iter().try_fold(0usize, |sum, &n| sum.checked_add(n)).unwrap_or(usize::MAX);
        if total > seqlen {
            return Err(Error::Argument(format!(
                "{flag}: the documents hold {total} tokens, more than {axis} = {seqlen}"
            )));
        }
    }
    if args.model.score().alibi.is_some() {
        return Err(Error::Argument(
            "--alibi with --documents-k: ALiBi's distances would run along the packed row, across documents; \
             leave out --alibi, or use --documents alone (seqlen_q = seqlen_k, each document's keys its queries)"
                .into(),
        ));
    }
    Ok(())
}

/// The prefix sums of `lengths` and of the rest of a row of `seqlen` tokens, as `i32`
/// (`cu_seqlens`; [`check_varlen_args`] bounds them by the row).
fn prefix_sums(lengths: &[usize], seqlen: usize) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &n in lengths.iter().chain([&seqlen]) {
        let end = cu[cu.len() - 1] as usize + n;
        cu.push(end.min(seqlen) as i32);
    }
    cu
}

/// The options the kernels get with `table`: with `--documents-k` the causal mask and window
/// are the table's, applied per document, and not the call's.
fn with_table<'a>(options: AttentionOptions<'a>, table: Option<&'a crate::MaskTable>) -> AttentionOptions<'a> {
    match table {
        Some(table) if table.kind() == crate::MaskTableKind::Varlen => {
            AttentionOptions { causal: crate::Causal::None, window: None, ..options }.with_mask_table(table)
        }
        Some(table) => options.with_mask_table(table),
        None => options,
    }
}

/// The mask table of `--documents` (with `--documents-k`, a varlen table) or `--prefix-lm` (the
/// same for every batch entry), on `ctx`.
fn mask_table(args: &Args, shape: &AttentionShape, ctx: &Context) -> Result<Option<crate::MaskTable>> {
    let (batch, seqlen) = (shape.batch, shape.seqlen_q);
    if let (Some(lengths_q), Some(lengths_k)) = (&args.documents, &args.documents_k) {
        let (cu_q, cu_k) = (prefix_sums(lengths_q, shape.seqlen_q), prefix_sums(lengths_k, shape.seqlen_k));
        let (causal, window) = (args.causal.into(), args.model.window());
        return ctx.varlen_mask_repeated(&cu_q, &cu_k, causal, window, batch).map(Some);
    }
    if let Some(lengths) = &args.documents {
        // Document `d` is id `d`; the tokens after the listed documents are one more.
        let mut row: Vec<i32> =
            lengths.iter().enumerate().flat_map(|(d, &n)| std::iter::repeat_n(d as i32, n)).collect();
        row.resize(seqlen, lengths.len() as i32);
        let ids: Vec<i32> = (0..batch).flat_map(|_| row.iter().copied()).collect();
        return ctx.document_mask(&ids, [batch, seqlen]).map(Some);
    }
    match args.prefix_lm {
        Some(prefix) => ctx.prefix_lm_mask(&vec![prefix; batch], seqlen).map(Some),
        None => Ok(None),
    }
}

fn print_problem(inputs: &Inputs, shape: &AttentionShape, dtype: DType, args: &Args) {
    let files: Vec<String> = inputs
        .all()
        .map(|i| format!("{} {:?} {} ({})", i.tensor.name(), i.tensor.shape(), i.tensor.dtype(), i.source))
        .collect();
    println!("inputs: {}", files.join(", "));
    let s = shape;
    let converted = if inputs.all().any(|i| i.tensor.dtype() != dtype) { " (inputs rounded to it)" } else { "" };
    println!(
        "problem [B, Hq, Hkv, Sq, Sk, D] = [{}, {}, {}, {}, {}, {}], {dtype}{converted}, causal {}{}, scale {}",
        s.batch,
        s.num_heads_q,
        s.num_heads_kv,
        s.seqlen_q,
        s.seqlen_k,
        s.head_dim,
        args.causal.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string()),
        args.model.describe()
            + &args.bias.map_or_else(String::new, |b| format!(", bias {:?} (f32)", b.dims(s)))
            + &describe_mask_table(args, s.seqlen_q, s.seqlen_k),
        AttentionOptions { scale: args.scale, ..Default::default() }.scale_for(s.head_dim)
    );
}

/// `--documents` or `--prefix-lm` for the problem's line: `, documents 100,200 (+ the rest)`
/// (the rest only when the listed documents leave tokens of a row: queries of `seqlen_q`, or
/// keys of `seqlen_k` with `--documents-k`).
fn describe_mask_table(args: &Args, seqlen_q: usize, seqlen_k: usize) -> String {
    let list = |l: &[usize]| l.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",");
    let lengths = args.documents.as_ref().map(|l| {
        let keys_left = args.documents_k.as_ref().is_some_and(|k| k.iter().sum::<usize>() < seqlen_k);
        let rest = if l.iter().sum::<usize>() < seqlen_q || keys_left { " (+ the rest)" } else { "" };
        let keys = args.documents_k.as_ref().map_or_else(String::new, |k| format!(" with keys {}", list(k)));
        list(l) + &keys + rest
    });
    lengths.map_or_else(String::new, |l| format!(", documents {l}"))
        + &args.prefix_lm.map_or_else(String::new, |p| format!(", prefix-LM {p}"))
}

fn describe_paths(out: &Path, written: &[PathBuf]) -> String {
    if written.len() == 1 && written[0] == out {
        return out.display().to_string();
    }
    let names: Vec<String> =
        written.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect();
    format!("{}/{{{}}}", out.display().to_string().trim_end_matches('/'), names.join(", "))
}

/// What `attn` adds to the options on the host: the sinks (one per query head) and the bias,
/// uploaded by [`flash_rows`] and read by the references.
#[derive(Clone, Copy)]
struct Extras<'a> {
    sinks: Option<&'a [f32]>,
    bias: Option<&'a HostBias>,
}

impl<'a> Extras<'a> {
    /// The references' parameters of `options` with these extras.
    fn params(self, options: &AttentionOptions<'a>, head_dim: usize) -> cpu::Params<'a> {
        cpu::Params { sinks: self.sinks, bias: self.bias.map(HostBias::values), ..cpu::Params::of(options, head_dim) }
    }
}

/// The flash kernels in `T`: forward, and backward when dO is given; with the extras' sinks and
/// bias uploaded into the options.
fn flash_rows<T: Element>(
    ctx: &Context,
    rounded: &[HostTensor],
    options: &AttentionOptions,
    extras: Extras,
    dq: Option<DqAccumulation>,
    (warmup, repeats): (usize, usize),
    flops: f64,
) -> Result<Vec<Row>> {
    let dtype = T::DTYPE;
    let sinks = extras.sinks.map(|s| ctx.upload(s, &[s.len()])).transpose()?;
    let bias = extras.bias.map(|b| ctx.upload(&b.values, &b.dims)).transpose()?;
    let options = match &sinks {
        Some(sinks) => options.with_sinks(sinks),
        None => *options,
    };
    let options = &match &bias {
        Some(bias) => options.with_bias(bias),
        None => options,
    };
    let device: Vec<_> = rounded.iter().map(|t| t.upload::<T>(ctx)).collect::<Result<_>>()?;
    let (q, k, v) = (&device[0], &device[1], &device[2]);
    let shape = AttentionShape::from_qkv(q.shape(), k.shape(), v.shape())?;
    let d = shape.head_dim;
    let tile = ctx.default_tile(dtype, d);
    let mut out = ctx.flash_attention_forward(q, k, v, options, tile)?;
    let forward =
        time_gpu(ctx, warmup, repeats, || ctx.flash_attention_forward_into(q, k, v, &mut out, options, tile))?;
    let mut rows = vec![Row {
        label: format!("flash forward {dtype} ({})", ctx.forward_kernel_label(dtype, &shape, tile, options)),
        ms: forward.median_ms,
        flops,
        outputs: vec![HostTensor::from_device("o", &out.o)?, HostTensor::from_device("lse", &out.lse)?],
    }];
    if let Some(d_o) = device.get(3) {
        let mode = dq.unwrap_or(ctx.dq_accumulation_for(dtype, d));
        let tile = ctx.default_backward_tile(dtype, d, mode);
        let (o, lse) = (&out.o, &out.lse);
        let mut grads = ctx.flash_attention_backward(q, k, v, o, lse, d_o, options, tile, mode)?;
        let backward = time_gpu(ctx, warmup, repeats, || {
            ctx.flash_attention_backward_into(q, k, v, o, lse, d_o, &mut grads, options, tile, mode)
        })?;
        let mode_name = super::dq_mode_name(ctx, dtype, d, tile, mode);
        rows.push(Row {
            label: format!(
                "flash backward {dtype}, {mode_name} ({})",
                ctx.backward_kernel_label(dtype, d, tile, mode, options)
            ),
            ms: backward.median_ms,
            flops: 2.5 * flops,
            outputs: gradients(&grads)?,
        });
    }
    Ok(rows)
}

/// The naive kernels (`f32`): forward, and backward when dO is given.
fn naive_rows(
    ctx: &Context,
    rounded: &[HostTensor],
    options: &AttentionOptions,
    (warmup, repeats): (usize, usize),
    flops: f64,
) -> Result<Vec<Row>> {
    let device: Vec<_> = rounded.iter().map(|t| t.upload::<f32>(ctx)).collect::<Result<_>>()?;
    let (q, k, v) = (&device[0], &device[1], &device[2]);
    let mut out = ctx.attention_naive(q, k, v, options)?;
    let forward = time_gpu(ctx, warmup, repeats, || ctx.attention_naive_into(q, k, v, &mut out, options))?;
    let mut rows = vec![Row {
        label: "naive forward f32".into(),
        ms: forward.median_ms,
        flops,
        outputs: vec![HostTensor::from_device("o", &out.o)?, HostTensor::from_device("lse", &out.lse)?],
    }];
    if let Some(d_o) = device.get(3) {
        let o = &out.o;
        let mut grads = ctx.attention_naive_backward(q, k, v, o, d_o, options)?;
        let backward =
            time_gpu(ctx, warmup, repeats, || ctx.attention_naive_backward_into(q, k, v, o, d_o, &mut grads, options))?;
        rows.push(Row {
            label: "naive backward f32".into(),
            ms: backward.median_ms,
            flops: 2.5 * flops,
            outputs: gradients(&grads)?,
        });
    }
    Ok(rows)
}

fn gradients<T: Element>(grads: &crate::Gradients<T>) -> Result<Vec<HostTensor>> {
    let mut outputs = vec![
        HostTensor::from_device("dq", &grads.dq)?,
        HostTensor::from_device("dk", &grads.dk)?,
        HostTensor::from_device("dv", &grads.dv)?,
    ];
    if let Some(d_sinks) = &grads.d_sinks {
        outputs.push(HostTensor::from_device("d_sinks", d_sinks)?);
    }
    if let Some(d_bias) = &grads.d_bias {
        outputs.push(HostTensor::from_device("d_bias", d_bias)?);
    }
    Ok(outputs)
}

/// The CPU reference in place of the kernels; results rounded once from `f64` to `dtype` (LSE to
/// `f32`).
fn cpu_rows(
    rounded: &[HostTensor],
    shape: &AttentionShape,
    options: &AttentionOptions,
    extras: Extras,
    dtype: DType,
    flops: f64,
) -> Result<Vec<Row>> {
    let values: Vec<Vec<f32>> = rounded.iter().map(HostTensor::to_f32).collect();
    let params = extras.params(options, shape.head_dim);
    let start = Instant::now();
    let forward = cpu::attention(&values[0], &values[1], &values[2], shape, params)?;
    let forward_ms = start.elapsed().as_secs_f64() * 1e3;
    let mut rows = vec![Row {
        label: "CPU reference forward (f64)".into(),
        ms: forward_ms,
        flops,
        outputs: vec![
            HostTensor::from_f64("o", &shape.q_shape(), &forward.o, dtype)?,
            HostTensor::from_f64("lse", &shape.lse_shape(), &forward.lse, DType::F32)?,
        ],
    }];
    if let Some(d_o) = values.get(3) {
        let start = Instant::now();
        let grads = cpu::attention_backward(&values[0], &values[1], &values[2], d_o, shape, params)?;
        let backward_ms = start.elapsed().as_secs_f64() * 1e3;
        rows.push(Row {
            label: "CPU reference backward (f64)".into(),
            ms: backward_ms,
            flops: 2.5 * flops,
            outputs: vec![
                HostTensor::from_f64("dq", &shape.q_shape(), &grads.dq, dtype)?,
                HostTensor::from_f64("dk", &shape.kv_shape(), &grads.dk, dtype)?,
                HostTensor::from_f64("dv", &shape.kv_shape(), &grads.dv, dtype)?,
            ]
            .into_iter()
            .chain(match extras.sinks {
                Some(_) => Some(HostTensor::from_f64("d_sinks", &[shape.num_heads_q], &grads.d_sinks, DType::F32)?),
                None => None,
            })
            .chain(match extras.bias {
                Some(bias) => Some(HostTensor::from_f64("d_bias", &bias.dims, &grads.d_bias, DType::F32)?),
                None => None,
            })
            .collect(),
        });
    }
    Ok(rows)
}

/// "O …, LSE …" and "dQ …, dK …, dV …": each row's outputs against the CPU reference computed on
/// the same (rounded) inputs, as relative L2 errors, judged by `dtype`'s tolerances.
fn check(
    rounded: &[HostTensor],
    shape: &AttentionShape,
    options: &AttentionOptions,
    extras: Extras,
    dtype: DType,
    rows: &[Row],
) -> Result<Vec<Checked>> {
    let tolerance = Tolerance::of(dtype);
    let values: Vec<Vec<f32>> = rounded.iter().map(HostTensor::to_f32).collect();
    let params = extras.params(options, shape.head_dim);
    let forward = cpu::attention(&values[0], &values[1], &values[2], shape, params)?;
    let backward = match values.get(3) {
        Some(d_o) => Some(cpu::attention_backward(&values[0], &values[1], &values[2], d_o, shape, params)?),
        None => None,
    };
    Ok(rows
        .iter()
        .map(|row| {
            Checked(
                row.outputs
                    .iter()
                    .map(|t| {
                        let got = t.to_f32();
                        // Every output a row makes has its reference (dQ, dK, dV only with dO).
                        let (output, error) = match (t.name(), &backward) {
                            ("lse", _) => (Output::Lse, lse_error(&got, &forward.lse)),
                            ("dq", Some(b)) => (Output::Dq, gradient_error(&got, &b.dq)),
                            ("dk", Some(b)) => (Output::Dk, gradient_error(&got, &b.dk)),
                            ("dv", Some(b)) => (Output::Dv, gradient_error(&got, &b.dv)),
                            ("d_sinks", Some(b)) => (Output::DSinks, gradient_error(&got, &b.d_sinks)),
                            ("d_bias", Some(b)) => (Output::DBias, gradient_error(&got, &b.d_bias)),
                            ("o", _) => (Output::O, relative_l2_error(&got, &forward.o)),
                            _ => (Output::O, f64::NAN),
                        };
                        Measured::new(output, error, tolerance)
                    })
                    .collect(),
            )
        })
        .collect())
}

/// The table; with `--check`, each row's errors and its verdict.
fn print_table(rows: &[Row], errors: Option<&[Checked]>, dtype: DType, verdicts: &mut Verdicts) {
    let mut table = Table::new();
    let mut header = vec!["kernel", "time (ms)", "TFLOP/s"];
    if errors.is_some() {
        header.extend(["rel L2 error vs CPU (f64)", "check"]);
    }
    table.load_style(ASCII_MARKDOWN).set_header(header);
    for (i, row) in rows.iter().enumerate() {
        let mut cells = vec![row.label.clone(), format!("{:.3}", row.ms), format!("{:.2}", tflops(row.flops, row.ms))];
        if let Some(checked) = errors.and_then(|errors| errors.get(i)) {
            cells.extend([checked.to_string(), verdicts.judge(dtype, checked)]);
        }
        table.add_row(cells);
    }
    println!("{table}");
}
