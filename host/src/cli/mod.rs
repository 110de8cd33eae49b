//! The `rust-attention` command line. With no subcommand it runs the main job ([`main_job`]):
//! naive attention against FlashAttention on the GPU, forward and backward, checked against the
//! CPU reference.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::check::{Checked, Tolerance};
use crate::{Causal, Context, DType, Device, DqAccumulation, Error, KernelPath, Result, TileConfig};

pub mod attn;
pub mod decode;
pub mod main_job;
mod tune;
pub mod vit;

/// Naive attention vs FlashAttention on the GPU, kernels written in Rust; see the subcommands for
/// the other jobs.
#[derive(Parser, Debug)]
#[command(name = "rust-attention", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// A job other than the main one.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The main job's flags (used when no subcommand is given).
    #[command(flatten)]
    pub main_job: main_job::Args,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Attention forward (and backward, given dO) on Q, K, V read from .npy or .safetensors files;
    /// writes O, LSE (and dQ, dK, dV), prints each kernel's time (see `cli::attn`).
    Attn(attn::Args),
    /// One decoding step over a KV cache (split-KV decoder), timed as the bandwidth of the K and
    /// V it reads; `--check` compares it with the f64 reference (see `cli::decode`).
    Decode(decode::Args),
    /// A Vision Transformer's self-attention on a real photo: patches to Q, K, V, attention with
    /// our kernels, attention maps as pictures.
    Vit(vit::Args),
}

/// `--device` of the `attn` and `vit` jobs: our kernels on a GPU or on the CPU emulator, or the
/// plain CPU path (references and rayon, no kernels) for machines with neither.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceArg {
    /// The kernels, on a GPU or on the CPU emulator (as the main job's `--device`).
    Kernels(Device),
    /// The CPU path instead of the kernels.
    Cpu,
}

impl std::str::FromStr for DeviceArg {
    type Err = String;

    /// `0`, `1`, … (a GPU), `cpu-emulated` or `cpu`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "cpu" {
            return Ok(Self::Cpu);
        }
        s.parse()
            .map(Self::Kernels)
            .map_err(|_| format!("`{s}` is not a GPU ordinal (0, 1, …), `cpu-emulated` or `cpu`"))
    }
}

/// `--causal`: the mask (see [`Causal`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CausalArg {
    /// No mask.
    None,
    /// Query i sees keys j ≤ i (PyTorch's is_causal).
    TopLeft,
    /// Query i sees keys j ≤ i + seqlen_k − seqlen_q (FlashAttention ≥ 2.1).
    BottomRight,
}

impl From<CausalArg> for Causal {
    fn from(arg: CausalArg) -> Self {
        match arg {
            CausalArg::None => Causal::None,
            CausalArg::TopLeft => Causal::TopLeft,
            CausalArg::BottomRight => Causal::BottomRight,
        }
    }
}

/// `--window LEFT,RIGHT`: a sliding window as FlashAttention's `window_size` (aligned
/// bottom-right; −1 leaves a side open), e.g. `4095,0` for Mistral's causal window of 4096.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowArg(pub crate::SlidingWindow);

impl std::str::FromStr for WindowArg {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let side = |x: &str| -> std::result::Result<Option<usize>, String> {
            match x.trim().parse::<i64>() {
                Ok(-1) => Ok(None),
                Ok(n) if n >= 0 => Ok(Some(n as usize)),
                _ => Err(format!("{x:?} is not a window side: a count of keys (0 or more), or -1 for all")),
            }
        };
        match s.split_once(',') {
            Some((left, right)) => Ok(Self(crate::SlidingWindow::new(side(left)?, side(right)?))),
            None => Err(format!("{s:?} is not LEFT,RIGHT (e.g. 4095,0; -1 leaves a side open)")),
        }
    }
}

/// Entry point of the `rust-attention` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => main_job::run(cli.main_job),
        Some(Command::Attn(args)) => attn::run(&args),
        Some(Command::Decode(args)) => decode::run(&args),
        Some(Command::Vit(args)) => vit::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--kernels` of the main job and `attn`: puts `ctx` on `path` when given (otherwise it keeps the
/// context's choice: sm_90a on compute capability 9.0, unless `RUST_ATTENTION_KERNELS` says
/// otherwise) and prints which kernels run.
///
/// # Errors
/// [`Error::Unsupported`] for `sm90a` on a device without the sm_90a kernels.
pub(crate) fn with_kernels(ctx: Context, path: Option<KernelPath>) -> Result<Context> {
    let ctx = match path {
        Some(path) => ctx.with_kernel_path(path)?,
        None => ctx,
    };
    if !ctx.is_emulated() {
        match ctx.kernel_path() {
            KernelPath::Sm90a => println!(
                "kernels: sm_90a (wgmma, TMA, warp specialisation) for the f16/bf16 forward and backward passes; \
                 sm_80 for the rest (--kernels sm80 for sm_80 throughout)"
            ),
            KernelPath::Sm80 if ctx.device().runs_turing_modules() => {
                println!("kernels: sm_75 (Turing: mma.sync m16n8k8 tensor cores for f16, no bf16; CUDA cores for f32)")
            }
            KernelPath::Sm80 => println!("kernels: sm_80 (mma.sync tensor cores; CUDA cores for f32)"),
        }
    }
    Ok(ctx)
}

/// How a backward row names its dQ mode: `deterministic`, `atomic dQ`, or, where
/// [`DqAccumulation::Atomic`] runs the Hopper backward, `TMA reduce-add dQ` (level 9 adds each
/// tile's dQ to device memory with `cp.reduce.async.bulk.tensor`, not with atomics).
pub(crate) fn dq_mode_name(
    ctx: &Context,
    dtype: DType,
    head_dim: usize,
    tile: TileConfig,
    mode: DqAccumulation,
) -> &'static str {
    match mode {
        DqAccumulation::Deterministic => "deterministic",
        DqAccumulation::Atomic
            if !ctx.is_emulated() && ctx.target().hopper_backward(dtype, head_dim, tile, mode).is_some() =>
        {
            "TMA reduce-add dQ"
        }
        DqAccumulation::Atomic => "atomic dQ",
    }
}

/// The verdicts of a table's rows against the test suite's tolerances ([`Tolerance`]): each row
/// gets a check cell, and [`Verdicts::finish`] prints the tolerances and the count, and fails
/// the job when a row failed.
#[derive(Debug, Default)]
pub(crate) struct Verdicts {
    rows: usize,
    failed: usize,
    not_run: usize,
    dtypes: Vec<DType>,
}

impl Verdicts {
    /// The check cell of a row whose outputs in `dtype` were measured: `PASS` or `**FAIL**`.
    pub(crate) fn judge(&mut self, dtype: DType, checked: &Checked) -> String {
        self.rows += 1;
        if !self.dtypes.contains(&dtype) {
            self.dtypes.push(dtype);
        }
        if checked.passes() {
            "PASS".into()
        } else {
            self.failed += 1;
            "**FAIL**".into()
        }
    }

    /// The check cell of a row whose kernel returned `error`: `not run` when it cannot run here
    /// (too little device memory; no kernels for the head_dim or tile), which says nothing about
    /// its results; `**FAIL**` for any other error.
    pub(crate) fn error(&mut self, error: &Error) -> String {
        let cannot_run = error.is_out_of_memory()
            || matches!(
                error,
                Error::HeadDimNotCompiled { .. } | Error::TileNotCompiled { .. } | Error::SharedMemory { .. }
            );
        if cannot_run {
            self.not_run += 1;
            "not run".into()
        } else {
            self.rows += 1;
            self.failed += 1;
            "**FAIL**".into()
        }
    }

    /// Prints the tolerances the rows were judged by and the count of rows that passed (the last
    /// line of a job that passed).
    ///
    /// # Errors
    /// [`Error::CheckFailed`] when a row failed: its message, the last line of the job, says how
    /// many.
    pub(crate) fn finish(self) -> Result<()> {
        let tolerances: Vec<String> =
            self.dtypes.iter().map(|&dtype| format!("{dtype} {}", Tolerance::of(dtype).describe())).collect();
        if !tolerances.is_empty() {
            println!(
                "check: relative L2 error vs the f64 reference within the test suite's tolerances \
                 (attn_host::check::Tolerance): {}",
                tolerances.join("; ")
            );
        }
        let not_run = match self.not_run {
            0 => String::new(),
            n => format!(" ({n} not run)"),
        };
        if self.failed > 0 {
            return Err(Error::CheckFailed {
                failed: self.failed,
                rows: self.rows,
                what: "errors beyond the test suite's tolerances, or a kernel that failed (the rows marked FAIL)",
            });
        }
        match self.rows {
            1 => println!("check: the row PASSES{not_run}"),
            rows => println!("check: all {rows} rows PASS{not_run}"),
        }
        Ok(())
    }
}

/// What models add to plain attention, as flags of `attn` and `decode`: a sliding window, a score
/// modification and attention sinks.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct ModelArgs {
    /// Sliding window LEFT,RIGHT (FlashAttention's window_size, aligned bottom-right: in `decode`,
    /// to each sequence's end): each query sees LEFT keys before its diagonal and RIGHT after; -1
    /// leaves a side open. Combines with --causal (a key must pass both). Mistral's window of
    /// 4096: --window 4095,0; GPT-OSS's local layers: --window 127,0.
    #[arg(long, allow_hyphen_values = true)]
    pub window: Option<WindowArg>,
    /// Logit softcapping at CAP: each logit becomes CAP·tanh(logit/CAP) (Gemma 2: 50).
    #[arg(long, value_name = "CAP", allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// ALiBi with the paper's slopes, 2^(-MAX_BIAS·(h+1)/H) per head for H a power of two
    /// (BLOOM's for other head counts; MAX_BIAS default 8, BLOOM's and MPT's); the distance is
    /// measured from the bottom-right diagonal.
    #[arg(long, value_name = "MAX_BIAS", num_args = 0..=1, default_missing_value = "8", allow_negative_numbers = true)]
    pub alibi: Option<f32>,
    /// An attention sink of logit SINK in every query head (GPT-OSS learns one per head): it
    /// joins each row's softmax with no value vector (-inf: none, inf: a row of O = 0). With a
    /// backward pass, d_sinks is returned too. Flash kernels and the decoder only.
    #[arg(long, value_name = "SINK", allow_negative_numbers = true, value_parser = parse_sink)]
    pub sinks: Option<f32>,
}

/// A sink's logit: any `f32` but NaN.
fn parse_sink(text: &str) -> std::result::Result<f32, String> {
    let sink: f32 = text.parse().map_err(|e| format!("{text:?} is not a number: {e}"))?;
    if sink.is_nan() { Err("a sink's logit must not be NaN".into()) } else { Ok(sink) }
}

impl ModelArgs {
    /// The window of `--window`.
    pub(crate) fn window(&self) -> Option<crate::SlidingWindow> {
        self.window.map(|w| w.0)
    }

    /// The score modification of `--softcap CAP` and `--alibi [MAX_BIAS]`.
    pub(crate) fn score(&self) -> crate::ScoreMod {
        crate::ScoreMod { softcap: self.softcap, alibi: self.alibi.map(|max_bias| crate::Alibi { max_bias }) }
    }

    /// What the flags add, for a problem's description: `, window 4095,0, softcap 50, ALiBi
    /// (max_bias 8), sinks 0.5`, or nothing.
    pub(crate) fn describe(&self) -> String {
        let side = |s: Option<usize>| s.map_or("-1".to_string(), |s| s.to_string());
        self.window.map_or_else(String::new, |w| format!(", window {},{}", side(w.0.left), side(w.0.right)))
            + &self.softcap.map_or_else(String::new, |cap| format!(", softcap {cap}"))
            + &self.alibi.map_or_else(String::new, |max_bias| format!(", ALiBi (max_bias {max_bias})"))
            + &self.sinks.map_or_else(String::new, |sink| format!(", sinks {sink}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::{Measured, Output};

    #[test]
    fn verdicts_count_failed_rows_and_fail_the_job() {
        let pass = Checked(vec![Measured::new(Output::O, 1e-6, Tolerance::F32)]);
        let fail = Checked(vec![Measured::new(Output::O, 5.4e-1, Tolerance::F32)]);
        let mut verdicts = Verdicts::default();
        assert_eq!(verdicts.judge(DType::F32, &pass), "PASS");
        assert_eq!(verdicts.judge(DType::F16, &fail), "**FAIL**");
        // A kernel that cannot run here is no verdict; one that errs otherwise fails.
        let no_kernels = Error::HeadDimNotCompiled { head_dim: 48, allowed: "64".into() };
        assert_eq!(verdicts.error(&no_kernels), "not run");
        assert_eq!(verdicts.error(&Error::Shape("broken".into())), "**FAIL**");
        match verdicts.finish() {
            Err(Error::CheckFailed { failed: 2, rows: 3, .. }) => {}
            other => panic!("{other:?}"),
        }
        let mut verdicts = Verdicts::default();
        verdicts.judge(DType::F32, &pass);
        assert!(verdicts.finish().is_ok());
    }
}
