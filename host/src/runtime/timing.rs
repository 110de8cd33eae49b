//! **Runtime layer.** Timing GPU work with CUDA events.

use cudarc::driver::sys::CUevent_flags;

use super::context::Context;
use crate::error::{During, Result};

/// Statistics of repeated GPU timings, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Median over the repeats: the number to report.
    pub median_ms: f64,
    /// Fastest repeat.
    pub min_ms: f64,
    /// Slowest repeat.
    pub max_ms: f64,
    /// Number of timed repeats.
    pub repeats: usize,
}

/// Runs `work` `warmup` times untimed (module loading, first-touch and clock ramp-up stay out of
/// the numbers), then `repeats` times back to back, each between two CUDA events recorded on the
/// context's stream (on the emulator: between two readings of the host clock); returns the
/// statistics. The repeats are queued without waiting for each other, as a program queues its
/// launches and as `benches/peers/sdpa_bench.py` times PyTorch: the host prepares the next
/// launch while the GPU runs the last, so a repeat counts the GPU's time, and the host's only
/// where the host is the slower of the two. `work` should only queue GPU work.
///
/// # Errors
/// The first error `work` returns, or a driver error from the events.
pub fn time_gpu(ctx: &Context, warmup: usize, repeats: usize, mut work: impl FnMut() -> Result<()>) -> Result<Timing> {
    for _ in 0..warmup {
        work()?;
    }
    ctx.synchronize()?;
    let repeats = repeats.max(1);
    let mut times = Vec::with_capacity(repeats);
    match ctx.cuda_stream() {
        Some(stream) => {
            let event = || stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).during("recording an event");
            let mut events = Vec::with_capacity(repeats);
            for _ in 0..repeats {
                let start = event()?;
                work()?;
                events.push((start, event()?));
            }
            for (start, end) in &events {
                times.push(start.elapsed_ms(end).during("reading an event time")? as f64);
            }
        }
        // The emulator runs every launch to completion before returning: a host clock
        // measures it (and says nothing about a GPU).
        None => {
            for _ in 0..repeats {
                let start = std::time::Instant::now();
                work()?;
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(Timing { median_ms: times[repeats / 2], min_ms: times[0], max_ms: times[repeats - 1], repeats })
}

/// TFLOP/s for `flops` floating-point operations in `ms` milliseconds.
pub fn tflops(flops: f64, ms: f64) -> f64 {
    flops / (ms * 1e-3) / 1e12
}
