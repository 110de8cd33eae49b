//! # Exercise 5: the tile loop of a small flash forward
//!
//! Guide: *From the formula to tiles: `cpu::flash_attention`* and *Level 3: FlashAttention
//! forward* (the real loop: `kernels/src/simt/forward.rs`, anchor `main_loop`).
//!
//! [`flash_forward`] is FlashAttention's forward pass at its simplest: a block owns
//! [`BLOCK_M`] query rows of one head, one thread per query row, with that row of Q in
//! registers. The block walks the keys in tiles of [`BLOCK_N`]: all its threads copy one K tile
//! and one V tile into shared memory, wait at a barrier, use the tiles, and wait again before the
//! next copy overwrites them. The loads, the barriers and the epilogue are given; write the body
//! of the loop, for this thread's query row `query`:
//!
//! 1. **scores**: for each key `j` of the tile, `s_j = (q · k_j) · scale_log2` (base-2 units:
//!    the host passes `scale · log₂e`); `k_tile.load(j, c)` is column `c` of the tile's key `j`;
//! 2. **mask**: a key the row does not see (`!mask.visible(query, k_start + j)`: the causal
//!    mask, the zero-filled keys past `seqlen_k` in the last tile, and every key for a padding
//!    row past `seqlen_q`) gets `s_j = −∞`;
//! 3. **online softmax** (exercise 3): `m_new = max(m, max_j s_j)`, `alpha = 2^(m − m_new)`
//!    (measure from 0 while `m_new` is still −∞), `p_j = 2^(s_j − m_new)`,
//!    `l = l · alpha + Σ_j p_j`, `m = m_new`;
//! 4. **accumulate**: `acc = acc · alpha + Σ_j p_j · v_j` (`v_tile.load(j, c)`).
//!
//! The epilogue then writes O = acc / l and LSE = (m + log₂ l) · ln 2.
//!
//! Run: `cargo test --release --manifest-path exercises/Cargo.toml ex05`. Before you write it,
//! the test fails with `not causal, head 0, query 0: O is all 0 and LSE = −inf: nothing was
//! accumulated …`.

use attn_kernels::attention::mask::Mask;
use attn_kernels::hw::{self, LN_2, SharedMemory};

/// Query rows per block: one warp, one thread per row.
pub const BLOCK_M: usize = 32;
/// Keys per K/V tile.
pub const BLOCK_N: usize = 8;
/// The head dimension this kernel is written for.
pub const HEAD_DIM: usize = 16;
/// Dynamic shared memory of a block: one K tile and one V tile.
pub const SHARED_BYTES: usize = 2 * BLOCK_N * HEAD_DIM * 4;

kernel! {
/// O and LSE of `[heads, seqlen_q, HEAD_DIM]` Q against `[heads, seqlen_k, HEAD_DIM]` K and V
/// (grid: `(seqlen_q.div_ceil(BLOCK_M), heads, 1)`, [`BLOCK_M`] threads, [`SHARED_BYTES`]).
///
/// # Safety
/// The pointers hold the tensors of those shapes; `o` as Q, `lse` `[heads, seqlen_q]`.
pub unsafe fn flash_forward(
    q: *const f32,
    k: *const f32,
    v: *const f32,
    o: *mut f32,
    lse: *mut f32,
    seqlen_q: usize,
    seqlen_k: usize,
    causal: usize,
    causal_offset: isize,
    scale_log2: f32,
) {
    // A causal mask or none; no sliding window (no left edge).
    let mask = Mask::from_args(seqlen_q, seqlen_k, causal, causal_offset, Mask::NO_LEFT_EDGE);
    let head = hw::block_idx().1;
    let query = hw::block_idx().0 * BLOCK_M + hw::thread_idx_x();
    // SAFETY (all pointer arithmetic below): offsets stay inside this head's rows.
    let (q, k, v) = unsafe {
        (q.add(head * seqlen_q * HEAD_DIM), k.add(head * seqlen_k * HEAD_DIM), v.add(head * seqlen_k * HEAD_DIM))
    };
    // This thread's query row, in registers (zeros for a padding row).
    let mut q_row = [0.0f32; HEAD_DIM];
    if query < seqlen_q {
        for c in 0..HEAD_DIM {
            q_row[c] = unsafe { *q.add(query * HEAD_DIM + c) };
        }
    }
    let mut smem = SharedMemory::new();
    let (k_tile, v_tile) = (smem.tile(BLOCK_N, HEAD_DIM), smem.tile(BLOCK_N, HEAD_DIM));

    // The running state of this row: max m, sum l, unnormalised output acc.
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    let mut acc = [0.0f32; HEAD_DIM];

    // (Level 3 also skips the tiles no row of the block sees: `mask.keys_for`.)
    for k_start in (0..seqlen_k).step_by(BLOCK_N) {
        let valid = (seqlen_k - k_start).min(BLOCK_N);
        // Given: the block copies the tile (rows past `valid` are zero-filled) and waits.
        unsafe {
            k_tile.copy_rows_from::<BLOCK_M>(k.add(k_start * HEAD_DIM), BLOCK_N, HEAD_DIM, HEAD_DIM, valid);
            v_tile.copy_rows_from::<BLOCK_M>(v.add(k_start * HEAD_DIM), BLOCK_N, HEAD_DIM, HEAD_DIM, valid);
        }
        hw::sync_threads();

        // Your code here: scores, mask, online softmax, accumulate (see the module's docs).

        // Given: every thread is done with the tile before the next copy overwrites it.
        hw::sync_threads();
    }

    // Given: the epilogue. A row that saw no key gets O = 0 and LSE = −∞.
    if query < seqlen_q {
        let (inv_l, row_lse) = if l > 0.0 { (1.0 / l, (m + hw::log2(l)) * LN_2) } else { (0.0, f32::NEG_INFINITY) };
        unsafe {
            let o = o.add((head * seqlen_q + query) * HEAD_DIM);
            for c in 0..HEAD_DIM {
                *o.add(c) = acc[c] * inv_l;
            }
            *lse.add(head * seqlen_q + query) = row_lse;
        }
    }
}
}
