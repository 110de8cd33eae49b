//! Level 1, the host side: C = A + B on the device, checked against the CPU.
//!
//! The device side is `kernels/src/simt/vector_add.rs`; the guide's chapter *Level 1: vector
//! add* (`docs/guide/src/level-1-vector-add.md`) shows it beside the launch that
//! `Context::vector_add` makes (`host/src/ops/naive.rs`).
//!
//! ```sh
//! cargo run --release --example 01_vector_add -- --device cpu-emulated
//! ```

mod common;

use std::process::ExitCode;

use attn_host::{Context, Result, check, cpu};
use clap::Parser;
use common::Check;

/// Level 1: vector add on the device, against the CPU.
#[derive(Parser, Debug)]
pub struct Args {
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Elements; not a multiple of 4, so the kernel's tail runs too.
    #[arg(long, default_value_t = 100_003)]
    pub n: usize,
}

pub fn run(ctx: &Context, args: &Args) -> Result<Vec<Check>> {
    let n = args.n;
    let (a, b) = (check::random_normal(n, 1), check::random_normal(n, 2));
    // Copy the inputs to the device, run the kernel, copy the result back.
    let (a_dev, b_dev) = (ctx.upload(&a, &[n])?, ctx.upload(&b, &[n])?);
    let c = ctx.vector_add(&a_dev, &b_dev)?.to_host()?;
    println!("vector add of {n} floats");
    Ok(vec![Check::new("C", check::relative_l2_error(&c, &cpu::vector_add(&a, &b)?), 1e-7)])
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::main(&args.device, |ctx| run(ctx, &args))
}
