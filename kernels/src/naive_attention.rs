//! Level 2: "standard" attention, O = softmax(Q Kᵀ · scale) V, in three kernels that talk through
//! device memory (FlashAttention paper, Dao et al. 2022, Algorithm 0):
//!
//! 1. [`naive_scores_f32`]: S = Q Kᵀ · scale, written to an `[batch, heads, seqlen_q, seqlen_k]`
//!    buffer in HBM;
//! 2. [`naive_softmax_f32`]: P = softmax(S) row by row, in place, and the row's logsumexp;
//! 3. [`naive_pv_f32`]: O = P V.
//!
//! The N×N buffer is written once and read twice: for long sequences those round trips, not the
//! arithmetic, set the speed, and the buffer sets the memory footprint. FlashAttention
//! ([`crate::flash_forward`]) removes both.
//!
//! Shapes and layouts are those of [`AttentionShape`]; any `head_dim ≥ 1` works here. The shape
//! arrives as six integers rather than as the struct: rustc warns that structs passed by value to
//! `extern "gpu-kernel"` functions may not match what the driver passes.

use crate::gpu::{self, LN_2, LOG2_E};
use crate::layout::AttentionShape;

/// For global query row `row` (in `0..shape.query_rows()`): the offset of that row in Q (and O)
/// and the offset of its key/value head in K (and V).
fn row_offsets(shape: &AttentionShape, row: usize) -> (usize, usize) {
    let head_row = row / shape.seqlen_q; // b · num_heads_q + h
    let (b, h) = (head_row / shape.num_heads_q, head_row % shape.num_heads_q);
    (row * shape.head_dim, shape.kv_head_offset(b, h))
}

/// S[row, j] = scale · Σ_d Q[row, d] · K[j, d].
///
/// Thread mapping: blocks take query rows in a grid-stride loop (`row = blockIdx.x`,
/// `blockIdx.x + gridDim.x`, …); within a block, thread `t` computes columns `t`, `t + blockDim`,
/// … of the row. All threads of a block read the same Q row (served from cache) and each reads its
/// own K rows straight from device memory: no shared memory, no reuse: the naive way.
///
/// # Safety
/// Pointers hold the shapes given in the module docs; `s` holds `rows × seqlen_k` floats.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn naive_scores_f32(
    q: *const f32,
    k: *const f32,
    s: *mut f32,
    batch: usize,
    num_heads_q: usize,
    num_heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    scale: f32,
) {
    let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
    let mut row = gpu::block_idx().0;
    while row < shape.query_rows() {
        let (q_offset, kv_offset) = row_offsets(&shape, row);
        let mut j = gpu::thread_idx_x();
        while j < shape.seqlen_k {
            let mut dot = 0.0f32;
            for d in 0..shape.head_dim {
                // SAFETY: d < head_dim, j < seqlen_k: inside this row of Q and this head of K.
                unsafe { dot = gpu::fma(*q.add(q_offset + d), *k.add(kv_offset + j * shape.head_dim + d), dot) };
            }
            // SAFETY: row < rows, j < seqlen_k.
            unsafe { *s.add(row * shape.seqlen_k + j) = dot * scale };
            j += gpu::block_dim_x();
        }
        row += gpu::grid_dim_x();
    }
}

/// P[row, :] = softmax(S[row, :]) in place, and lse[row] = ln Σ_j exp(S[row, j]).
///
/// Thread mapping: one warp per row (`rows_per_block` warps per block, rows in a grid-stride
/// loop); lanes stride over the row. Three passes over the row: the maximum m (warp reduction),
/// then Σ exp(s − m), then the normalised probabilities. Subtracting m keeps exp from overflowing
/// however large the scores are.
///
/// # Safety
/// `s` holds `rows × seqlen_k` floats and `lse` holds `rows` floats, `rows = batch · heads ·
/// seqlen_q`; the block has `32 · rows_per_block` threads.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn naive_softmax_f32(s: *mut f32, lse: *mut f32, rows: usize, seqlen_k: usize) {
    let warps_per_block = gpu::block_dim_x() / gpu::WARP_SIZE;
    let mut row = gpu::block_idx().0 * warps_per_block + gpu::warp_id();
    // Uniform per warp: all 32 lanes of a warp agree on `row`, so the warp reductions below are
    // reached by full warps.
    while row < rows {
        // SAFETY: row < rows; every index below is < seqlen_k.
        let s_row = unsafe { s.add(row * seqlen_k) };
        let lanes = || (gpu::lane_id()..seqlen_k).step_by(gpu::WARP_SIZE);

        let mut max = f32::NEG_INFINITY;
        for j in lanes() {
            max = max.max(unsafe { *s_row.add(j) });
        }
        let max = gpu::group_max::<32>(max);

        let mut sum = 0.0f32;
        for j in lanes() {
            sum += gpu::exp2((unsafe { *s_row.add(j) } - max) * LOG2_E);
        }
        let sum = gpu::group_sum::<32>(sum);

        let inv_sum = 1.0 / sum;
        for j in lanes() {
            unsafe { *s_row.add(j) = gpu::exp2((*s_row.add(j) - max) * LOG2_E) * inv_sum };
        }
        if gpu::lane_id() == 0 {
            // ln Σ exp(s) = m + ln Σ exp(s − m)
            unsafe { *lse.add(row) = max + gpu::log2(sum) * LN_2 };
        }
        row += gpu::grid_dim_x() * warps_per_block;
    }
}

/// O[row, d] = Σ_j P[row, j] · V[j, d].
///
/// Thread mapping: as [`naive_scores_f32`], a block per query row; thread `t` computes output
/// columns `t`, `t + blockDim`, …. The whole block reads the same P entry at once (one broadcast
/// load) and neighbouring threads read neighbouring V entries (coalesced).
///
/// # Safety
/// As [`naive_scores_f32`]; `p` is the softmaxed `s`, `o` holds `rows × head_dim` floats.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn naive_pv_f32(
    p: *const f32,
    v: *const f32,
    o: *mut f32,
    batch: usize,
    num_heads_q: usize,
    num_heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
) {
    let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
    let mut row = gpu::block_idx().0;
    while row < shape.query_rows() {
        let (o_offset, kv_offset) = row_offsets(&shape, row);
        let mut d = gpu::thread_idx_x();
        while d < shape.head_dim {
            let mut acc = 0.0f32;
            for j in 0..shape.seqlen_k {
                // SAFETY: j < seqlen_k, d < head_dim.
                unsafe {
                    acc = gpu::fma(*p.add(row * shape.seqlen_k + j), *v.add(kv_offset + j * shape.head_dim + d), acc)
                };
            }
            // SAFETY: row < rows, d < head_dim.
            unsafe { *o.add(o_offset + d) = acc };
            d += gpu::block_dim_x();
        }
        row += gpu::grid_dim_x();
    }
}
