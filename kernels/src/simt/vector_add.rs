//! Level 1: C = A + B, the "hello world" of GPU programming.
//!
//! **Thread mapping.** One-dimensional grid of one-dimensional blocks. The arrays are seen as
//! `n / 4` chunks of four floats plus a tail of `n % 4` floats. Thread `t` of the grid adds chunks
//! `t`, `t + T`, `t + 2T`, … where `T` is the number of threads in the grid (a *grid-stride
//! loop*): any grid size covers any `n`. The host launches one thread per chunk (as Triton
//! launches one program per block of elements), so each thread normally takes one trip; the loop
//! covers arrays larger than the largest grid. Neighbouring threads touch neighbouring 16-byte chunks, so each warp reads and
//! writes 512 contiguous bytes per step (coalesced). The tail is added by the first `n % 4`
//! threads of the grid.
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
    let chunks = n / 4;
    let mut chunk = hw::global_thread_idx();
    while chunk < chunks {
        // SAFETY: chunk < n / 4, so floats 4·chunk .. 4·chunk + 4 are in bounds.
        unsafe {
            let (x, y) = (F32x4::load(a.add(4 * chunk)), F32x4::load(b.add(4 * chunk)));
            F32x4([x.0[0] + y.0[0], x.0[1] + y.0[1], x.0[2] + y.0[2], x.0[3] + y.0[3]]).store(c.add(4 * chunk));
        }
        chunk += hw::grid_stride();
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
