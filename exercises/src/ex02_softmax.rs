//! # Exercise 2: the softmax of one row
//!
//! Guide: *Level 2: naive attention* (its softmax kernel: `naive_softmax_f32` in
//! `kernels/src/simt/naive.rs`, which gives each row a warp; here one thread does a row).
//!
//! Write [`softmax_row`]: from one row of scores `s` (in base-2 units, that is already multiplied
//! by `scale · log₂e`, so that `exp2` does the work) write the probabilities
//!
//! ```text
//! p_j = 2^(s_j − m) / Σ_k 2^(s_k − m),   m = max_k s_k
//! ```
//!
//! in three steps: the maximum, the sum of `exp2(s_j − m)`, and the division by that sum.
//! Subtracting the maximum changes nothing mathematically but keeps `exp2` from overflowing: the
//! test has a row with scores near 200, and 2^200 is `inf` in `f32`.
//!
//! Masked scores are `−∞` (their `p` is 0). A row whose every score is masked has `m = −∞`, and
//! `−∞ − (−∞)` is NaN: such a row must come out all 0 (measure from 0 instead of `m`).
//!
//! The kernel [`softmax_rows`] around it is given: one thread per row, a grid-stride loop over
//! rows (exercise 1).
//!
//! Run: `cargo test --release --manifest-path exercises/Cargo.toml ex02`. Before you write it,
//! the test fails with `row 0: softmax sums to 0.00, expected 1.00 — did you normalise by the
//! sum?`.

use attn_kernels::hw;

/// Writes the softmax of the `cols` scores at `s` to `p` (see the module's docs).
///
/// # Safety
/// `s` and `p` point to `cols` floats each.
pub unsafe fn softmax_row(s: *const f32, p: *mut f32, cols: usize) {
    // Your code here: the row's maximum, the sum of exp2(s_j − max), then p_j.
    for j in 0..cols {
        // SAFETY: j < cols.
        unsafe { *p.add(j) = 0.0 };
    }
}

kernel! {
/// The softmax of each of `rows` rows of `cols` scores, one thread per row. Given.
///
/// # Safety
/// `s` and `p` point to `rows · cols` floats each.
pub unsafe fn softmax_rows(s: *const f32, p: *mut f32, rows: usize, cols: usize) {
    let mut row = hw::global_thread_idx();
    while row < rows {
        // SAFETY: row < rows, so the row's cols floats are in bounds.
        unsafe { softmax_row(s.add(row * cols), p.add(row * cols), cols) };
        row += hw::grid_stride();
    }
}
}
