//! # Exercise 1: vector add
//!
//! Guide: *Level 1: vector add* (the kernel: `kernels/src/simt/vector_add.rs`).
//!
//! Write the body of [`vector_add`]: `c[i] = a[i] + b[i]` for every `i < n`.
//!
//! The test launches it on the emulator with a grid of 2 blocks of 64 threads, for lengths from
//! 1 to 4099. The grid has 128 threads, so for `n > 128` each thread must add more than one
//! element, and for `n < 128` some threads have nothing to do.
//!
//! Hints:
//! * `hw::global_thread_idx()` is this thread's index in the grid (`blockIdx.x · blockDim.x +
//!   threadIdx.x`); `hw::grid_stride()` is the number of threads in the grid.
//! * A grid-stride loop: start at your index, step by the grid's size, stop before `n`.
//! * The arguments are raw pointers: `unsafe { *c.add(i) = *a.add(i) + *b.add(i) }`.
//! * Further: four floats at a time with `hw::F32x4` and a tail for the `n % 4` last ones, as
//!   level 1's kernel does.
//!
//! Run: `cargo test --release --manifest-path exercises/Cargo.toml ex01`. Before you write it,
//! the test fails with `n = 1: c[0] was never written (still NaN), expected …`.

use attn_kernels::hw;

kernel! {
/// `c[i] = a[i] + b[i]` for `i < n`.
///
/// # Safety
/// `a`, `b` and `c` point to `n` floats each.
pub unsafe fn vector_add(a: *const f32, b: *const f32, c: *mut f32, n: usize) {
    // Your code here: a grid-stride loop over i < n.
}
}
