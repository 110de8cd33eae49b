//! Level 5, the host side: the forward pass on tensor cores (`mma.sync`) in `f16`, with `f32`
//! accumulation; checked against the `f64` CPU reference run on the same `f16` inputs, so the
//! error measured is the kernel's own (P and O rounded to `f16`).
//!
//! The device side is `kernels/src/sm80/forward.rs`; the guide's chapter *Level 5: tensor
//! cores, forward* (`docs/guide/src/level-5-mma-forward.md`). On a Hopper GPU the default tile
//! runs the level-8 kernel instead (the line printed says which kernel ran).
//!
//! ```sh
//! cargo run --release --example 05_tensor_core_forward -- --device cpu-emulated --causal top-left
//! ```

mod common;

use std::process::ExitCode;

use attn_host::check::{Tolerance, lse_error, relative_l2_error};
use attn_host::{Context, DType, Result, cpu, f16};
use clap::Parser;
use common::{CausalArg, Check};

/// Level 5: the f16 tensor-core forward on the device, against the CPU.
#[derive(Parser, Debug)]
pub struct Args {
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Query rows (seqlen_q).
    #[arg(long, default_value_t = 128)]
    pub seqlen: usize,
    /// Key rows (seqlen_k); default: as --seqlen.
    #[arg(long)]
    pub seqlen_k: Option<usize>,
    /// 64 or 128 (the compiled head_dims of the tensor-core kernels).
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    #[arg(long, value_enum, default_value_t)]
    pub causal: CausalArg,
}

pub fn run(ctx: &Context, args: &Args) -> Result<Vec<Check>> {
    let shape = common::shape(args.seqlen, args.seqlen_k.unwrap_or(args.seqlen), args.head_dim);
    let options = args.causal.options();
    // The fastest compiled tile that fits this GPU (the H200's own where it fits).
    let tile = ctx.default_tile(DType::F16, args.head_dim);
    let ([q, k, v, _], [q_dev, k_dev, v_dev, _]) = common::inputs::<f16>(ctx, &shape)?;
    let out = ctx.flash_attention_forward(&q_dev, &k_dev, &v_dev, &options, tile)?;
    let reference = cpu::attention(&q, &k, &v, &shape, common::params(&options, &shape))?;
    let kernel = ctx.forward_kernel_label(DType::F16, &shape, tile, &options);
    println!("tensor-core forward (f16, {kernel}), {}", common::describe(&shape, &options));
    Ok(vec![
        Check::new("O", relative_l2_error(&common::host(&out.o)?, &reference.o), Tolerance::F16.o),
        Check::new("LSE", lse_error(&out.lse.to_host()?, &reference.lse), Tolerance::F16.lse),
    ])
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::main(&args.device, |ctx| run(ctx, &args))
}
