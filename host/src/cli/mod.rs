//! The `rust-attention` command line. With no subcommand it runs the main job ([`main_job`]):
//! naive attention against FlashAttention on the GPU, forward and backward, checked against the
//! CPU reference.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::{Causal, Context, Device, KernelPath, Result};

pub mod attn;
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

/// Entry point of the `rust-attention` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => main_job::run(cli.main_job),
        Some(Command::Attn(args)) => attn::run(&args),
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
            KernelPath::Sm80 => println!("kernels: sm_80 (mma.sync tensor cores; CUDA cores for f32)"),
        }
    }
    Ok(ctx)
}
