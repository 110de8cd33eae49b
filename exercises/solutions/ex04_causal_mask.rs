//! # Exercise 4: the causal mask — solution
//!
//! Guide: *Level 3: FlashAttention forward* (the kernels' mask: `Mask` in
//! `kernels/src/attention/mask.rs`; the host's definition: `Causal` in `host/src/problem.rs`).
//!
//! Write [`Mask::key_limit`] and [`Mask::visible`]. Key `j` is visible to query `i` iff
//! `j < key_limit(i)`:
//!
//! * not causal: every key, `key_limit(i) = seqlen_k`;
//! * causal: keys `j ≤ i + offset`. The host passes `offset = 0` for the top-left alignment
//!   (PyTorch's `is_causal`) and `offset = seqlen_k − seqlen_q` for the bottom-right one
//!   (FlashAttention ≥ 2.1, decoding with a KV cache: the last query sees every key). The offset
//!   can be negative (seqlen_q > seqlen_k): compute in `isize`, and clamp the limit to
//!   `0 ..= seqlen_k`;
//! * a query at or past `seqlen_q` (a padding row of the last query tile) sees no key.
//!
//! The test prints the mask as a picture when it fails (`#` visible, `.` hidden).
//!
//! Run: `cargo test --release --manifest-path exercises/Cargo.toml ex04`. Before you write it,
//! the test fails with `not causal, seqlen_q = 5, seqlen_k = 8, offset 0: query 5 has key_limit
//! 8, expected 0: query 5 is a padding row …`, and once padding rows are right, on the first
//! causal row.

use attn_kernels::hw;

/// Which keys each query may attend to, and the sequence bounds.
#[derive(Clone, Copy)]
pub struct Mask {
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub causal: bool,
    /// The causal diagonal: key `j` is visible to query `i` iff `j ≤ i + offset`.
    pub offset: isize,
}

impl Mask {
    /// Number of keys query `query` sees: keys `0 .. key_limit(query)`.
    pub fn key_limit(&self, query: usize) -> usize {
        if query >= self.seqlen_q {
            0
        } else if self.causal {
            // j ≤ i + offset  ⇔  j < i + 1 + offset; in isize because the offset can be negative.
            (query as isize + 1 + self.offset).clamp(0, self.seqlen_k as isize) as usize
        } else {
            self.seqlen_k
        }
    }

    /// Whether `key` is visible to `query`.
    pub fn visible(&self, query: usize, key: usize) -> bool {
        key < self.key_limit(query)
    }
}

kernel! {
/// Given: one thread per query row `i < rows` (rows past `seqlen_q` are padding) writes
/// `limits[i] = key_limit(i)` and row `i` of `visible` (`rows × seqlen_k`, 1 visible, 0 hidden).
///
/// # Safety
/// `limits` holds `rows` floats, `visible` `rows · seqlen_k`.
pub unsafe fn mask_matrix(
    limits: *mut f32,
    visible: *mut f32,
    rows: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    causal: usize,
    offset: isize,
) {
    let mask = Mask { seqlen_q, seqlen_k, causal: causal != 0, offset };
    let mut i = hw::global_thread_idx();
    while i < rows {
        // SAFETY: i < rows, j < seqlen_k.
        unsafe {
            *limits.add(i) = mask.key_limit(i) as f32;
            for j in 0..seqlen_k {
                *visible.add(i * seqlen_k + j) = if mask.visible(i, j) { 1.0 } else { 0.0 };
            }
        }
        i += hw::grid_stride();
    }
}
}
