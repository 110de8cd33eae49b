//! Level 8, the host side: FlashAttention-3's forward pass on Hopper (`sm_90a`: a TMA producer
//! warpgroup, `wgmma` consumer warpgroups) in `f16`, checked against the `f64` CPU reference.
//! It needs a GPU of compute capability 9.0: elsewhere, the CPU emulator included (it does not
//! model TMA or `wgmma`), it says so and exits 0.
//!
//! The device side is `kernels/src/sm90/forward.rs`; the guide's chapter *Level 8: Hopper
//! forward* (`docs/guide/src/level-8-hopper-forward.md`).
//!
//! ```sh
//! cargo run --release --example 08_hopper_forward -- --device 0 --causal top-left
//! ```

mod common;

use std::process::ExitCode;

use attn_host::check::{Tolerance, lse_error, relative_l2_error};
use attn_host::{Context, Result, cpu, f16};
use clap::Parser;
use common::{CausalArg, Check};

/// Level 8: the Hopper forward on the device, against the CPU.
#[derive(Parser, Debug)]
pub struct Args {
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Query rows (seqlen_q).
    #[arg(long, default_value_t = 1024)]
    pub seqlen: usize,
    /// Key rows (seqlen_k); default: as --seqlen.
    #[arg(long)]
    pub seqlen_k: Option<usize>,
    /// 64 or 128 (the compiled head_dims of the Hopper kernels).
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    #[arg(long, value_enum, default_value_t)]
    pub causal: CausalArg,
}

pub fn run(ctx: &Context, args: &Args) -> Result<Vec<Check>> {
    if !ctx.has_hopper_kernels() {
        println!(
            "level 8 needs a Hopper GPU (sm_90a, compute capability 9.0), and {} is not one: nothing to run (not a failure)",
            ctx.device().name
        );
        return Ok(Vec::new());
    }
    let shape = common::shape(args.seqlen, args.seqlen_k.unwrap_or(args.seqlen), args.head_dim);
    let options = args.causal.options();
    let ([q, k, v, _], [q_dev, k_dev, v_dev, _]) = common::inputs::<f16>(ctx, &shape)?;
    let out = ctx.flash_attention_forward_hopper(&q_dev, &k_dev, &v_dev, &options)?;
    let reference = cpu::attention(&q, &k, &v, &shape, common::params(&options, &shape))?;
    println!("Hopper forward (f16), {}", common::describe(&shape, &options));
    Ok(vec![
        Check::new("O", relative_l2_error(&common::host(&out.o)?, &reference.o), Tolerance::F16.o),
        Check::new("LSE", lse_error(&out.lse.to_host()?, &reference.lse), Tolerance::F16.lse),
    ])
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::main(&args.device, |ctx| run(ctx, &args))
}
