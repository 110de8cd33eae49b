//! What every example shares: where to run (`--device`), the problem's inputs, and the verdict
//! (each output's relative L2 error against the `f64` CPU reference, beside its tolerance).

#![allow(dead_code)] // each example uses part of it

use std::process::ExitCode;

use attn_host::check::random_normal;
use attn_host::dtype::{from_f32_slice, to_f32_vec};
use attn_host::{AttentionOptions, AttentionShape, Causal, Context, Device, DeviceTensor, Element, Error, cpu};

/// `--device`: a GPU ordinal or the CPU emulator.
#[derive(clap::Args, Debug)]
pub struct DeviceArgs {
    /// `0`, `1`, … (a GPU) or `cpu-emulated`; default: GPU 0 if there is one, else the emulator.
    #[arg(long)]
    pub device: Option<Device>,
}

/// `--causal`: the mask.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default)]
pub enum CausalArg {
    /// Every query sees every key.
    #[default]
    None,
    /// Query i sees keys j ≤ i (PyTorch's `is_causal`).
    TopLeft,
    /// Query i sees keys j ≤ i + seqlen_k − seqlen_q (FlashAttention ≥ 2.1).
    BottomRight,
}

impl CausalArg {
    pub fn options(self) -> AttentionOptions<'static> {
        AttentionOptions::causal(match self {
            Self::None => Causal::None,
            Self::TopLeft => Causal::TopLeft,
            Self::BottomRight => Causal::BottomRight,
        })
    }
}

/// Opens `--device`, or without one GPU 0 if there is one and else the emulator, saying so.
pub fn open(device: &DeviceArgs) -> attn_host::Result<Context> {
    let ctx = match device.device {
        Some(device) => Context::open(device)?,
        None => match Context::new(0) {
            Ok(ctx) => ctx,
            Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => {
                println!("device: CPU emulator (no GPU: {e}; --device 0 insists on one)");
                return Ok(Context::cpu_emulated());
            }
            Err(e) => return Err(e),
        },
    };
    println!("device: {}", if ctx.is_emulated() { "CPU emulator".to_string() } else { ctx.device().to_string() });
    Ok(ctx)
}

/// One output compared with the reference.
pub struct Check {
    pub name: &'static str,
    /// Relative L2 error, ‖got − want‖ / ‖want‖ (NaN if anything is NaN).
    pub error: f64,
    pub tolerance: f64,
}

impl Check {
    pub fn new(name: &'static str, error: f64, tolerance: f64) -> Self {
        Self { name, error, tolerance }
    }

    /// Within the tolerance (a NaN error never is).
    pub fn passed(&self) -> bool {
        self.error <= self.tolerance
    }
}

/// Prints each check; true if all passed.
pub fn report(checks: &[Check]) -> bool {
    for c in checks {
        let verdict = if c.passed() { "ok" } else { "FAIL" };
        println!("{:>4}: relative L2 error {:.2e} (tolerance {:.0e})  {verdict}", c.name, c.error, c.tolerance);
    }
    checks.iter().all(Check::passed)
}

/// The body of every example's `main`: open the device, run, report; exit code 1 on a FAIL or
/// an error.
pub fn main(device: &DeviceArgs, run: impl FnOnce(&Context) -> attn_host::Result<Vec<Check>>) -> ExitCode {
    let outcome = open(device).and_then(|ctx| run(&ctx));
    match outcome {
        Ok(checks) if report(&checks) => ExitCode::SUCCESS,
        Ok(_) => {
            println!("FAIL: an error is beyond its tolerance");
            ExitCode::FAILURE
        }
        Err(e) => {
            println!("FAIL: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Batch 1, 2 heads of Q and of K/V.
pub fn shape(seqlen_q: usize, seqlen_k: usize, head_dim: usize) -> AttentionShape {
    AttentionShape { batch: 1, num_heads_q: 2, num_heads_kv: 2, seqlen_q, seqlen_k, head_dim }
}

/// Q, K, V and dO on the host (as `f32`) and on the device.
pub type HostAndDevice<T> = ([Vec<f32>; 4], [DeviceTensor<T>; 4]);

/// Fresh random Q, K, V and dO (standard normal, seeded by the clock or `EXAMPLE_SEED`), rounded to `T`: the values on the host (as
/// `f32`, exactly what the device holds, for the reference) and on the device.
pub fn inputs<T: Element>(ctx: &Context, shape: &AttentionShape) -> attn_host::Result<HostAndDevice<T>> {
    let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()];
    // Fresh inputs each run (from the clock), unless EXAMPLE_SEED repeats a run: the seed is printed.
    let seed = std::env::var("EXAMPLE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
    });
    println!("inputs: seed {seed} (EXAMPLE_SEED={seed} repeats them)");
    let host: [Vec<f32>; 4] = std::array::from_fn(|i| {
        to_f32_vec(&from_f32_slice::<T>(&random_normal(shapes[i].iter().product(), seed * 4 + i as u64)))
    });
    let [q, k, v, d_o] = std::array::from_fn(|i| ctx.upload(&from_f32_slice::<T>(&host[i]), &shapes[i]));
    Ok((host, [q?, k?, v?, d_o?]))
}

/// The problem in one line, for the examples' output.
pub fn describe(shape: &AttentionShape, options: &AttentionOptions) -> String {
    let s = shape;
    format!(
        "batch {}, heads {}, seqlen_q {}, seqlen_k {}, head_dim {}, causal {:?}",
        s.batch, s.num_heads_q, s.seqlen_q, s.seqlen_k, s.head_dim, options.causal
    )
}

/// The reference's parameters for `options`.
pub fn params<'a>(options: &AttentionOptions<'a>, shape: &AttentionShape) -> cpu::Params<'a> {
    cpu::Params::of(options, shape.head_dim)
}

/// A device tensor back on the host, as `f32`.
pub fn host<T: Element>(t: &DeviceTensor<T>) -> attn_host::Result<Vec<f32>> {
    Ok(to_f32_vec(&t.to_host()?))
}
