//! # Exercise 1: vector add — solution
//!
//! A scalar grid-stride loop. Level 1's kernel (`kernels/src/simt/vector_add.rs`) moves four
//! floats per access instead and adds the `n % 4` tail separately.

use attn_kernels::hw;

kernel! {
/// `c[i] = a[i] + b[i]` for `i < n`.
///
/// # Safety
/// `a`, `b` and `c` point to `n` floats each.
pub unsafe fn vector_add(a: *const f32, b: *const f32, c: *mut f32, n: usize) {
    let mut i = hw::global_thread_idx();
    while i < n {
        // SAFETY: i < n.
        unsafe { *c.add(i) = *a.add(i) + *b.add(i) };
        i += hw::grid_stride();
    }
}
}
