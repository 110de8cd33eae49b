//! `cargo bench --bench vector_add`: the bandwidth of our Rust vector add (16-byte loads, a
//! grid-stride loop; `kernels/src/simt/vector_add.rs`) for N = 2^16 … 2^28 floats, beside
//!
//! * the device-to-device copy of the driver (`cuMemcpyDtoDAsync`) in the same run: the practical
//!   ceiling of a kernel that streams memory;
//! * the textbook CUDA C++ kernel, one thread per element, compiled at run time by NVRTC: the
//!   classic Rust-vs-CUDA-C++ comparison on one device. Both results are checked element by
//!   element against the sums on the host.
//!
//! Bandwidth counts the bytes that must move: 12 per element for c = a + b (two reads, one
//! write), 8 for the copy. Timing: CUDA events, 2 warm-up rounds, median of 10; each round runs
//! the operation once on each of several input sets that together exceed the L2 cache many times
//! over (rotation), so small N are measured from device memory, not from the cache, and a round
//! is long enough for the events' resolution.
//!
//! Writes `bench-results/vector_add.csv`, `vector_add.json` and `vector_add.svg` (GB/s vs N).
//! Needs a GPU; without one it says so and exits successfully.

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;

use attn_host::check::random_normal;
use attn_host::timing::time_gpu;
use attn_host::{Context, DeviceTensor, Result};
use common::{Chart, Series};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use serde_json::json;

const LOG2_SIZES: std::ops::RangeInclusive<u32> = 16..=28;
/// Bytes of inputs and outputs the rotating sets cover at each N (far beyond H200's 60 MiB L2).
const ROTATION_BYTES: usize = 1 << 30;
const MAX_SETS: usize = 1024;
const WARMUP: usize = 2;
const REPEATS: usize = 10;

/// The textbook kernel: one thread per element, a bounds check, no vector loads.
const CUDA_CPP: &str = r#"
extern "C" __global__ void vector_add(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        c[i] = a[i] + b[i];
    }
}
"#;
const CUDA_CPP_THREADS: u32 = 256;

/// The three ways to move the data.
#[derive(Clone, Copy, PartialEq)]
enum Implementation {
    Copy,
    Rust,
    CudaCpp,
}

impl Implementation {
    fn name(self) -> &'static str {
        match self {
            Self::Copy => "device-to-device copy (driver)",
            Self::Rust => "Rust (this crate)",
            Self::CudaCpp => "CUDA C++ (NVRTC, one thread per element)",
        }
    }

    fn csv_name(self) -> &'static str {
        match self {
            Self::Copy => "copy",
            Self::Rust => "rust",
            Self::CudaCpp => "cuda-c++-nvrtc",
        }
    }

    /// Bytes moved per element.
    fn bytes_per_element(self) -> usize {
        if self == Self::Copy { 8 } else { 12 }
    }
}

/// One measurement.
struct Row {
    implementation: Implementation,
    log2_n: u32,
    ms: f64,
    gb_per_s: f64,
}

/// Rotating input/output sets of one size.
struct Sets {
    n: usize,
    a: Vec<DeviceTensor>,
    b: Vec<DeviceTensor>,
    c: Vec<DeviceTensor>,
}

fn main() -> Result<()> {
    let Some(ctx) = common::open_gpu("vector_add") else { return Ok(()) };
    let cuda_cpp = compile_cuda_cpp(&ctx);
    if let Err(reason) = &cuda_cpp {
        println!("CUDA C++ rows skipped: {reason}");
    }
    // One pool of random host values; each set uploads its own slice of it (never zeros).
    let total = 1usize << LOG2_SIZES.end();
    let (host_a, host_b) = (random_normal(total, 1), random_normal(total, 2));
    let implementations = [Implementation::Copy, Implementation::Rust, Implementation::CudaCpp];
    let bar = common::progress(LOG2_SIZES.count() * implementations.len());
    let mut rows = Vec::new();
    for log2_n in LOG2_SIZES {
        let n = 1usize << log2_n;
        let mut sets = Sets::new(&ctx, n, &host_a, &host_b)?;
        for implementation in implementations {
            bar.set_message(format!("2^{log2_n}: {}", implementation.csv_name()));
            let ms = match implementation {
                Implementation::Copy => sets.time(&ctx, |a, _, c| copy(&ctx, a, c))?,
                Implementation::Rust => sets.time(&ctx, |a, b, c| ctx.vector_add_into(a, b, c))?,
                Implementation::CudaCpp => match &cuda_cpp {
                    Ok(function) => sets.time(&ctx, |a, b, c| launch_cuda_cpp(&ctx, function, a, b, c))?,
                    Err(_) => {
                        bar.inc(1);
                        continue;
                    }
                },
            };
            if implementation != Implementation::Copy {
                sets.check(&host_a, &host_b, implementation.name())?;
            }
            let gb_per_s = (implementation.bytes_per_element() * n) as f64 / (ms * 1e-3) / 1e9;
            rows.push(Row { implementation, log2_n, ms, gb_per_s });
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    print_table(&rows);
    write_files(&ctx, &rows);
    Ok(())
}

impl Sets {
    /// As many sets of `n` as cover [`ROTATION_BYTES`] (at least one), uploaded from the pools.
    fn new(ctx: &Context, n: usize, host_a: &[f32], host_b: &[f32]) -> Result<Self> {
        let count = ROTATION_BYTES.div_ceil(12 * n).clamp(1, MAX_SETS).min(host_a.len() / n);
        let upload = |host: &[f32], i: usize| ctx.upload(&host[i * n..(i + 1) * n], &[n]);
        Ok(Self {
            n,
            a: (0..count).map(|i| upload(host_a, i)).collect::<Result<_>>()?,
            b: (0..count).map(|i| upload(host_b, i)).collect::<Result<_>>()?,
            c: (0..count).map(|_| ctx.full(&[n], f32::NAN)).collect::<Result<_>>()?,
        })
    }

    /// Median ms of one operation: each timed round runs it once per set and is divided by the
    /// number of sets. The outputs are poisoned with NaN first, so [`Sets::check`] sees what this
    /// operation wrote.
    fn time(
        &mut self,
        ctx: &Context,
        mut op: impl FnMut(&DeviceTensor, &DeviceTensor, &mut DeviceTensor) -> Result<()>,
    ) -> Result<f64> {
        for c in &mut self.c {
            c.copy_from_host(&vec![f32::NAN; self.n])?;
        }
        let timing = time_gpu(ctx, WARMUP, REPEATS, || {
            for ((a, b), c) in self.a.iter().zip(&self.b).zip(&mut self.c) {
                op(a, b, c)?;
            }
            Ok(())
        })?;
        Ok(timing.median_ms / self.a.len() as f64)
    }

    /// Checks the first and the last set's output against the sums on the host, exactly (one
    /// `f32` addition per element either way). Panics with the first wrong element.
    fn check(&self, host_a: &[f32], host_b: &[f32], what: &str) -> Result<()> {
        for i in [0, self.c.len() - 1] {
            let got = self.c[i].to_host()?;
            let offset = i * self.n;
            if let Some(j) = (0..self.n).find(|&j| got[j] != host_a[offset + j] + host_b[offset + j]) {
                panic!(
                    "{what} at N = {}: c[{j}] = {} but a + b = {}",
                    self.n,
                    got[j],
                    host_a[offset + j] + host_b[offset + j]
                );
            }
        }
        Ok(())
    }
}

/// `c = a` with the driver's device-to-device copy.
fn copy(ctx: &Context, a: &DeviceTensor, c: &mut DeviceTensor) -> Result<()> {
    let stream = ctx.cuda_stream().expect("a GPU context");
    let (src, dst) = (a.cuda_slice().expect("on the GPU"), c.cuda_slice_mut().expect("on the GPU"));
    stream.memcpy_dtod(src, dst).map_err(|e| driver_error("copying", e))
}

/// The CUDA C++ kernel, compiled by NVRTC and loaded; the reason if that is not possible.
fn compile_cuda_cpp(ctx: &Context) -> std::result::Result<CudaFunction, String> {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("NVRTC (libnvrtc) not found; add the CUDA toolkit's lib64 to LD_LIBRARY_PATH".into());
    }
    let ptx = cudarc::nvrtc::compile_ptx(CUDA_CPP).map_err(|e| format!("NVRTC: {e}"))?;
    let stream: &Arc<cudarc::driver::CudaStream> = ctx.cuda_stream().ok_or("not a GPU context")?;
    let module = stream.context().load_module(ptx).map_err(|e| format!("loading the module: {e}"))?;
    module.load_function("vector_add").map_err(|e| format!("looking up vector_add: {e}"))
}

fn launch_cuda_cpp(
    ctx: &Context,
    function: &CudaFunction,
    a: &DeviceTensor,
    b: &DeviceTensor,
    c: &mut DeviceTensor,
) -> Result<()> {
    let n = a.len() as i32;
    let config = LaunchConfig {
        grid_dim: ((n as u32).div_ceil(CUDA_CPP_THREADS), 1, 1),
        block_dim: (CUDA_CPP_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = ctx.cuda_stream().expect("a GPU context");
    let mut launch = stream.launch_builder(function);
    launch.arg(a.cuda_slice().expect("on the GPU")).arg(b.cuda_slice().expect("on the GPU"));
    launch.arg(c.cuda_slice_mut().expect("on the GPU")).arg(&n);
    // SAFETY: the arguments match the kernel's signature; the three buffers hold n floats each.
    unsafe { launch.launch(config) }.map(drop).map_err(|e| driver_error("launching the CUDA C++ kernel", e))
}

fn driver_error(during: &str, e: cudarc::driver::DriverError) -> attn_host::Error {
    attn_host::Error::Driver { during: during.into(), source: e }
}

fn print_table(rows: &[Row]) {
    let find = |implementation, log2_n| rows.iter().find(|r| r.implementation == implementation && r.log2_n == log2_n);
    println!("\n### Vector add c = a + b (f32) vs the device-to-device copy\n");
    println!("| N | copy GB/s | Rust GB/s | Rust / copy | CUDA C++ GB/s | CUDA C++ / copy | Rust time (µs) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for log2_n in LOG2_SIZES {
        let Some(copy) = find(Implementation::Copy, log2_n) else { continue };
        let cell = |implementation| {
            find(implementation, log2_n).map_or(("-".to_string(), "-".to_string()), |r: &Row| {
                (format!("{:.0}", r.gb_per_s), format!("{:.1} %", 100.0 * r.gb_per_s / copy.gb_per_s))
            })
        };
        let ((rust, rust_share), (cpp, cpp_share)) = (cell(Implementation::Rust), cell(Implementation::CudaCpp));
        let rust_us = find(Implementation::Rust, log2_n).map_or("-".to_string(), |r| format!("{:.1}", r.ms * 1e3));
        println!("| 2^{log2_n} | {:.0} | {rust} | {rust_share} | {cpp} | {cpp_share} | {rust_us} |", copy.gb_per_s);
    }
}

fn write_files(ctx: &Context, rows: &[Row]) {
    let copy_of = |log2_n| rows.iter().find(|r| r.implementation == Implementation::Copy && r.log2_n == log2_n);
    let header = "impl,n,bytes,ms,gb_per_s,fraction_of_copy,status";
    let csv: Vec<String> = rows
        .iter()
        .map(|r| {
            let n = 1usize << r.log2_n;
            let share = copy_of(r.log2_n).map_or(String::new(), |c| format!("{:.4}", r.gb_per_s / c.gb_per_s));
            let bytes = r.implementation.bytes_per_element() * n;
            format!("{},{n},{bytes},{:.6},{:.1},{share},ok", r.implementation.csv_name(), r.ms, r.gb_per_s)
        })
        .collect();
    common::write_csv("vector_add.csv", header, &csv);
    let records: Vec<_> = rows
        .iter()
        .map(|r| json!({ "impl": r.implementation.csv_name(), "n": 1usize << r.log2_n, "ms": r.ms, "gb_per_s": r.gb_per_s }))
        .collect();
    let device = &ctx.device().name;
    common::write_json(
        "vector_add.json",
        &json!({ "device": device, "unix_time": common::unix_time(), "rows": records }),
    );
    let series = [Implementation::Copy, Implementation::Rust, Implementation::CudaCpp]
        .map(|implementation| Series {
            label: implementation.name().to_string(),
            points: rows
                .iter()
                .filter(|r| r.implementation == implementation)
                .map(|r| ((1u64 << r.log2_n) as f64, r.gb_per_s))
                .collect(),
        })
        .into_iter()
        .collect();
    let chart = Chart {
        title: "f32, c = a + b (12 B/element); copy: 8 B/element",
        x_label: "N (elements)",
        y_label: "GB/s",
        log_y: false,
        series,
    };
    common::line_charts("vector_add.svg", &format!("Vector add bandwidth on {device}"), &[chart]);
}
