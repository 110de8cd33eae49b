//! # Exercise 3: the online-softmax update
//!
//! Guide: *The online softmax, derived* (and Level 3). The kernels' version is `OnlineSoftmax` in
//! `kernels/src/attention/softmax.rs`, which shares each row among 8 lanes; here one thread owns
//! a whole row, so no shuffles are needed.
//!
//! A row's scores arrive one tile at a time. The state is the running maximum `m` and the
//! running sum `l = Σ 2^(s_j − m)` over the scores seen so far (base-2 units). Write
//! [`OnlineSoftmax::update`], which folds one tile `s` in:
//!
//! ```text
//! m_new = max(m, max_j s_j)
//! alpha = 2^(m − m_new)                  what everything accumulated under m must be scaled by
//! s_j   ← 2^(s_j − m_new)                the tile's unnormalised probabilities, in place
//! l     ← l · alpha + Σ_j s_j
//! m     ← m_new
//! ```
//!
//! and returns `alpha`, so that the caller rescales its output accumulator too (the given kernel
//! does: `acc = acc · alpha + Σ_j p_j v_j`).
//!
//! A row whose first tiles are all masked (every score `−∞`) still has `m_new = −∞`; then
//! `2^(−∞ − (−∞))` is NaN. Measure from 0 instead of `m_new` in that case (alpha and every p
//! are then 0).
//!
//! Run: `cargo test --release --manifest-path exercises/Cargo.toml ex03`. Before you write it,
//! the test fails with `row 0 (random scores): o = -0, LSE = -inf, expected …: the running sum is
//! still 0 after every tile …`.

use attn_kernels::hw::{self, LN_2};

/// The largest tile the given kernel folds in at once.
pub const MAX_BLOCK_N: usize = 16;

/// The online-softmax state of one query row.
pub struct OnlineSoftmax {
    /// The largest score seen so far (base-2 units); −∞ before any visible score.
    pub max: f32,
    /// Σ 2^(s − max) over the scores seen so far.
    pub sum: f32,
}

impl OnlineSoftmax {
    pub fn new() -> Self {
        Self { max: f32::NEG_INFINITY, sum: 0.0 }
    }

    /// Folds the tile of scores `s` in: replaces each score by 2^(s − m_new), updates `max` and
    /// `sum`, and returns alpha = 2^(m_old − m_new).
    pub fn update(&mut self, s: &mut [f32]) -> f32 {
        // Your code here.
        1.0
    }

    /// Given: 1 / l (to normalise the output) and the natural logsumexp
    /// LSE = ln Σ_j e^(scale·q·k_j) = (m + log₂ l) · ln 2; a row that saw nothing gets 0 and −∞.
    pub fn finish(&self) -> (f32, f32) {
        if self.sum > 0.0 { (1.0 / self.sum, (self.max + hw::log2(self.sum)) * LN_2) } else { (0.0, f32::NEG_INFINITY) }
    }
}

impl Default for OnlineSoftmax {
    fn default() -> Self {
        Self::new()
    }
}

kernel! {
/// Given: for each of `rows` rows of `cols` scores (base-2 units), one thread per row, folds the
/// scores in tiles of `block_n` (≤ [`MAX_BLOCK_N`]) and accumulates `o = Σ_j p_j · v_j` for one
/// column of values `v` (`cols` floats, shared by every row); writes `o` and the LSE per row.
///
/// # Safety
/// `s` holds `rows · cols` floats, `v` `cols`, `o` and `lse` `rows` each.
pub unsafe fn online_softmax_rows(
    s: *const f32,
    v: *const f32,
    o: *mut f32,
    lse: *mut f32,
    rows: usize,
    cols: usize,
    block_n: usize,
) {
    let mut row = hw::global_thread_idx();
    while row < rows {
        let mut state = OnlineSoftmax::new();
        let mut acc = 0.0;
        let mut start = 0;
        while start < cols {
            let n = block_n.min(cols - start);
            let mut tile = [0.0; MAX_BLOCK_N];
            for j in 0..n {
                // SAFETY: row < rows and start + j < cols.
                tile[j] = unsafe { *s.add(row * cols + start + j) };
            }
            let alpha = state.update(&mut tile[..n]);
            acc *= alpha;
            for j in 0..n {
                // SAFETY: start + j < cols.
                acc += tile[j] * unsafe { *v.add(start + j) };
            }
            start += n;
        }
        let (inv_sum, row_lse) = state.finish();
        // SAFETY: row < rows.
        unsafe {
            *o.add(row) = acc * inv_sum;
            *lse.add(row) = row_lse;
        }
        row += hw::grid_stride();
    }
}
}
