//! Level 3, the host side: the FlashAttention-2 forward pass on CUDA cores (`f32`): Q, K, V
//! tiles in shared memory and the online softmax, checked against the `f64` CPU reference.
//!
//! The device side is `kernels/src/simt/forward.rs`; the guide's chapter *Level 3:
//! FlashAttention forward* (`docs/guide/src/level-3-flash-forward.md`) shows its main loop.
//! `--block-m` and `--block-n` pick a compiled tile (16, 32 or 64 each).
//!
//! ```sh
//! cargo run --release --example 03_flash_forward -- --device cpu-emulated --causal bottom-right --seqlen-k 100
//! ```

mod common;

use std::process::ExitCode;

use attn_host::check::{Tolerance, lse_error, relative_l2_error};
use attn_host::{Context, DType, Result, TileConfig, cpu};
use clap::Parser;
use common::{CausalArg, Check};

/// Level 3: the f32 flash forward on the device, against the CPU.
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
    /// 32, 64 or 128 (the compiled head_dims).
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    #[arg(long, value_enum, default_value_t)]
    pub causal: CausalArg,
    /// Query rows per block (Br); default: the built-in tile for the head_dim.
    #[arg(long)]
    pub block_m: Option<usize>,
    /// Keys per K/V tile (Bc).
    #[arg(long)]
    pub block_n: Option<usize>,
}

pub fn run(ctx: &Context, args: &Args) -> Result<Vec<Check>> {
    let shape = common::shape(args.seqlen, args.seqlen_k.unwrap_or(args.seqlen), args.head_dim);
    let options = args.causal.options();
    // The fastest compiled tile that fits this GPU (the H200's own where it fits).
    let default = ctx.default_tile(DType::F32, args.head_dim);
    let tile = TileConfig::new(args.block_m.unwrap_or(default.block_m), args.block_n.unwrap_or(default.block_n));
    let ([q, k, v, _], [q_dev, k_dev, v_dev, _]) = common::inputs::<f32>(ctx, &shape)?;
    let out = ctx.flash_attention_forward(&q_dev, &k_dev, &v_dev, &options, tile)?;
    let reference = cpu::attention(&q, &k, &v, &shape, common::params(&options, &shape))?;
    println!("flash forward (f32, tile {tile}), {}", common::describe(&shape, &options));
    Ok(vec![
        Check::new("O", relative_l2_error(&out.o.to_host()?, &reference.o), Tolerance::F32.o),
        Check::new("LSE", lse_error(&out.lse.to_host()?, &reference.lse), Tolerance::F32.lse),
    ])
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::main(&args.device, |ctx| run(ctx, &args))
}
