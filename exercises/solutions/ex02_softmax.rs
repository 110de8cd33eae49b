//! # Exercise 2: the softmax of one row — solution

use attn_kernels::hw;

/// Writes the softmax of the `cols` scores at `s` to `p` (see the exercise's docs).
///
/// # Safety
/// `s` and `p` point to `cols` floats each.
pub unsafe fn softmax_row(s: *const f32, p: *mut f32, cols: usize) {
    // SAFETY (every access below): j < cols.
    let mut max = f32::NEG_INFINITY;
    for j in 0..cols {
        max = max.max(unsafe { *s.add(j) });
    }
    // A fully masked row: measure from 0, so that every p is 2^(−∞) = 0 rather than NaN.
    let base = if max == f32::NEG_INFINITY { 0.0 } else { max };
    let mut sum = 0.0;
    for j in 0..cols {
        let e = hw::exp2(unsafe { *s.add(j) } - base);
        unsafe { *p.add(j) = e };
        sum += e;
    }
    let inv_sum = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for j in 0..cols {
        unsafe { *p.add(j) *= inv_sum };
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
