//! Level 2, the host side: standard attention, S = Q Kᵀ and P = softmax(S) through device
//! memory, checked against the `f64` CPU reference.
//!
//! The device side is `kernels/src/simt/naive.rs`; the guide's chapter *Level 2: naive
//! attention* (`docs/guide/src/level-2-naive-attention.md`) shows its kernels beside the
//! launches that `Context::attention_naive` makes.
//!
//! ```sh
//! cargo run --release --example 02_naive_attention -- --device cpu-emulated --causal top-left
//! ```

mod common;

use std::process::ExitCode;

use attn_host::check::{Tolerance, lse_error, relative_l2_error};
use attn_host::{Context, Result, cpu};
use clap::Parser;
use common::{CausalArg, Check};

/// Level 2: naive attention on the device, against the CPU.
#[derive(Parser, Debug)]
pub struct Args {
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Query rows (seqlen_q).
    #[arg(long, default_value_t = 64)]
    pub seqlen: usize,
    /// Key rows (seqlen_k); default: as --seqlen.
    #[arg(long)]
    pub seqlen_k: Option<usize>,
    /// Any head_dim works for the naive kernels.
    #[arg(long, default_value_t = 32)]
    pub head_dim: usize,
    #[arg(long, value_enum, default_value_t)]
    pub causal: CausalArg,
}

pub fn run(ctx: &Context, args: &Args) -> Result<Vec<Check>> {
    let shape = common::shape(args.seqlen, args.seqlen_k.unwrap_or(args.seqlen), args.head_dim);
    let options = args.causal.options();
    let ([q, k, v, _], [q_dev, k_dev, v_dev, _]) = common::inputs::<f32>(ctx, &shape)?;
    let out = ctx.attention_naive(&q_dev, &k_dev, &v_dev, &options)?;
    let reference = cpu::attention(&q, &k, &v, &shape, common::params(&options, &shape))?;
    println!("naive attention, {}", common::describe(&shape, &options));
    Ok(vec![
        Check::new("O", relative_l2_error(&out.o.to_host()?, &reference.o), Tolerance::F32.o),
        Check::new("LSE", lse_error(&out.lse.to_host()?, &reference.lse), Tolerance::F32.lse),
    ])
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::main(&args.device, |ctx| run(ctx, &args))
}
