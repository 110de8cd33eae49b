//! Level 6, the host side: the backward pass on tensor cores in `f16` (Pᵀ and dSᵀ kept in
//! registers), checked against the `f64` CPU reference of the gradients on the same `f16`
//! inputs.
//!
//! The device side is `kernels/src/sm80/backward.rs`; the guide's chapter *Level 6: tensor
//! cores, backward* (`docs/guide/src/level-6-mma-backward.md`).
//!
//! ```sh
//! cargo run --release --example 06_tensor_core_backward -- --device cpu-emulated --causal bottom-right
//! ```

mod common;

use std::process::ExitCode;

use attn_host::check::{Tolerance, relative_l2_error};
use attn_host::{Context, DType, Result, cpu, f16};
use clap::Parser;
use common::{CausalArg, Check};

/// Level 6: the f16 tensor-core backward on the device, against the CPU.
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
    let ([q, k, v, d_o], [q_dev, k_dev, v_dev, d_o_dev]) = common::inputs::<f16>(ctx, &shape)?;
    // The fastest compiled tiles that fit this GPU (the H200's own where they fit).
    let fwd_tile = ctx.default_tile(DType::F16, args.head_dim);
    let fwd = ctx.flash_attention_forward(&q_dev, &k_dev, &v_dev, &options, fwd_tile)?;
    let dq_mode = ctx.dq_accumulation_for(DType::F16, args.head_dim);
    let tile = ctx.default_backward_tile(DType::F16, args.head_dim, dq_mode);
    let grads =
        ctx.flash_attention_backward(&q_dev, &k_dev, &v_dev, &fwd.o, &fwd.lse, &d_o_dev, &options, tile, dq_mode)?;
    let reference = cpu::attention_backward(&q, &k, &v, &d_o, &shape, common::params(&options, &shape))?;
    let kernel = ctx.backward_kernel_label(DType::F16, args.head_dim, tile, dq_mode, &options);
    println!("tensor-core backward (f16, {kernel}, dQ {dq_mode:?}), {}", common::describe(&shape, &options));
    Ok(vec![
        Check::new("dQ", relative_l2_error(&common::host(&grads.dq)?, &reference.dq), Tolerance::F16.grad),
        Check::new("dK", relative_l2_error(&common::host(&grads.dk)?, &reference.dk), Tolerance::F16.grad),
        Check::new("dV", relative_l2_error(&common::host(&grads.dv)?, &reference.dv), Tolerance::F16.grad),
    ])
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::main(&args.device, |ctx| run(ctx, &args))
}
