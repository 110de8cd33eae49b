//! Level 4, the host side: the FlashAttention-2 backward pass on CUDA cores (`f32`): dQ, dK, dV
//! from Q, K, V, the forward's O and LSE and a random dO, P recomputed from the LSE; checked
//! against the `f64` CPU reference of the gradients.
//!
//! The device side is `kernels/src/simt/backward.rs`; the guide's chapter *Level 4:
//! FlashAttention backward* (`docs/guide/src/level-4-flash-backward.md`).
//!
//! ```sh
//! cargo run --release --example 04_flash_backward -- --device cpu-emulated --causal top-left --deterministic
//! ```

mod common;

use std::process::ExitCode;

use attn_host::check::{Tolerance, relative_l2_error};
use attn_host::{Context, DType, DqAccumulation, Result, cpu};
use clap::Parser;
use common::{CausalArg, Check};

/// Level 4: the f32 flash backward on the device, against the CPU.
#[derive(Parser, Debug)]
pub struct Args {
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Query rows (seqlen_q).
    #[arg(long, default_value_t = 96)]
    pub seqlen: usize,
    /// Key rows (seqlen_k); default: as --seqlen.
    #[arg(long)]
    pub seqlen_k: Option<usize>,
    /// 32, 64 or 128 (the compiled head_dims).
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    #[arg(long, value_enum, default_value_t)]
    pub causal: CausalArg,
    /// dQ by a second, query-outer kernel (bit-identical on every run) instead of atomics.
    #[arg(long)]
    pub deterministic: bool,
}

pub fn run(ctx: &Context, args: &Args) -> Result<Vec<Check>> {
    let shape = common::shape(args.seqlen, args.seqlen_k.unwrap_or(args.seqlen), args.head_dim);
    let options = args.causal.options();
    let dq_mode = if args.deterministic { DqAccumulation::Deterministic } else { DqAccumulation::Atomic };
    let ([q, k, v, d_o], [q_dev, k_dev, v_dev, d_o_dev]) = common::inputs::<f32>(ctx, &shape)?;
    // The backward pass needs the forward's O and LSE. The tiles: the fastest compiled ones that
    // fit this GPU (the H200's own where they fit).
    let fwd_tile = ctx.default_tile(DType::F32, args.head_dim);
    let fwd = ctx.flash_attention_forward(&q_dev, &k_dev, &v_dev, &options, fwd_tile)?;
    let tile = ctx.default_backward_tile(DType::F32, args.head_dim, dq_mode);
    let grads =
        ctx.flash_attention_backward(&q_dev, &k_dev, &v_dev, &fwd.o, &fwd.lse, &d_o_dev, &options, tile, dq_mode)?;
    let reference = cpu::attention_backward(&q, &k, &v, &d_o, &shape, common::params(&options, &shape))?;
    println!("flash backward (f32, tile {tile}, dQ {dq_mode:?}), {}", common::describe(&shape, &options));
    Ok(vec![
        Check::new("dQ", relative_l2_error(&grads.dq.to_host()?, &reference.dq), Tolerance::F32.grad),
        Check::new("dK", relative_l2_error(&grads.dk.to_host()?, &reference.dk), Tolerance::F32.grad),
        Check::new("dV", relative_l2_error(&grads.dv.to_host()?, &reference.dv), Tolerance::F32.grad),
    ])
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::main(&args.device, |ctx| run(ctx, &args))
}
