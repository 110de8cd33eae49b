//! Level 1: C = A + B, the "hello world" of GPU programming.
//!
//! **Thread mapping.** One-dimensional grid of one-dimensional blocks. The arrays are seen as
//! `n / 4` chunks of four floats plus a tail of `n % 4` floats. Thread `t` of the grid adds chunks
//! `t`, `t + T`, `t + 2T`, … where `T` is the number of threads in the grid (a *grid-stride
//! loop*): any grid size covers any `n`, so the host can size the grid to fill the GPU rather than
//! to match `n`. It takes them two at a time (`t + 2kT` and `t + (2k + 1)T`), so that four loads
//! are in flight at once. Neighbouring threads touch neighbouring 16-byte chunks, so each warp
//! reads and writes 512 contiguous bytes per step (coalesced). The tail is added by the first
//! `n % 4` threads of the grid.
//!
//! No shared memory: every element is read once and written once, so the kernel is bound by
//! device-memory bandwidth (12 bytes moved per addition).

use crate::hw::{self, F32x4};

// ANCHOR: vector_add
kernel! {
/// `c[i] = a[i] + b[i]` for `i < n`.
///
/// # Safety
/// `a`, `b` and `c` point to `n` floats of device memory each, 16-byte aligned; `c` does not
/// overlap `a` or `b`.
pub unsafe fn vector_add_f32(a: *const f32, b: *const f32, c: *mut f32, n: usize) {
    let (chunks, stride) = (n / 4, hw::grid_stride());
    let add = |x: F32x4, y: F32x4| F32x4([x.0[0] + y.0[0], x.0[1] + y.0[1], x.0[2] + y.0[2], x.0[3] + y.0[3]]);
    let mut chunk = hw::global_thread_idx();
    // Two chunks per trip, both loaded before either is stored: four 16-byte loads in flight
    // per thread instead of two. (The compiler may not move the next trip's loads above this
    // trip's store itself: for all it knows, `c` overlaps `a` or `b`.) Memory bandwidth is
    // reached only with enough bytes in flight to cover the latency of device memory.
    while chunk + stride < chunks {
        // SAFETY: chunk < chunk + stride < n / 4: both chunks are in bounds.
        unsafe {
            let (x0, y0) = (F32x4::load(a.add(4 * chunk)), F32x4::load(b.add(4 * chunk)));
            let far = chunk + stride;
            let (x1, y1) = (F32x4::load(a.add(4 * far)), F32x4::load(b.add(4 * far)));
            add(x0, y0).store(c.add(4 * chunk));
            add(x1, y1).store(c.add(4 * far));
        }
        chunk += 2 * stride;
    }
    if chunk < chunks {
        // SAFETY: chunk < n / 4.
        unsafe { add(F32x4::load(a.add(4 * chunk)), F32x4::load(b.add(4 * chunk))).store(c.add(4 * chunk)) };
    }
    // The n % 4 floats that do not fill a chunk.
    let i = 4 * chunks + hw::global_thread_idx();
    if i < n {
        // SAFETY: i < n.
        unsafe { *c.add(i) = *a.add(i) + *b.add(i) };
    }
}
}
// ANCHOR_END: vector_add
