//! Level 2: "standard" attention, O = softmax(Q Kᵀ · scale) V, in three kernels that talk through
//! device memory (FlashAttention paper, Dao et al. 2022, Algorithm 0):
//!
//! 1. [`naive_scores_f32`]: S = Q Kᵀ · scale (−∞ where the causal mask hides a key), written to
//!    an `[batch, heads, seqlen_q, seqlen_k]` buffer in HBM;
//! 2. [`naive_softmax_f32`]: P = softmax(S) row by row, in place, and the row's logsumexp;
//! 3. [`naive_pv_f32`]: O = P V.
//!
//! The backward pass (the same paper's Algorithm 3, with P recomputed by the two kernels above)
//! adds D = rowsum(dO ∘ O) ([`crate::simt::backward::flash_bwd_preprocess_f32`]) and:
//!
//! 4. [`naive_pt_x_f32`]: dV = Pᵀ dO (and, later, dK = scale · dSᵀ Q);
//! 5. [`naive_ds_f32`]: dS = P ∘ (dO Vᵀ − D), in place of P;
//! 6. [`naive_pv_f32`] again: dQ = scale · dS K.
//!
//! The N×N buffer is written once and read twice: for long sequences those round trips, not the
//! arithmetic, set the speed, and the buffer sets the memory footprint. FlashAttention
//! ([`crate::simt::forward`]) removes both.
//!
//! Shapes and layouts are those of [`AttentionShape`]; any `head_dim ≥ 1` works here. The shape
//! arrives as six integers rather than as the struct: rustc warns that structs passed by value to
//! `extern "gpu-kernel"` functions may not match what the driver passes.

use crate::attention::softmax::infinite_max_lse;
use crate::hw::{self, LN_2, LOG2_E};
use crate::layout::AttentionShape;

/// For global query row `row` (in `0..shape.query_rows()`): the offset of that row in Q (and O)
/// and the offset of its key/value head in K (and V).
fn row_offsets(shape: &AttentionShape, row: usize) -> (usize, usize) {
    let head_row = row / shape.seqlen_q; // b · num_heads_q + h
    let (b, h) = (head_row / shape.num_heads_q, head_row % shape.num_heads_q);
    (row * shape.head_dim, shape.kv_head_offset(b, h))
}

attention_kernel! {
/// S[row, j] = scale · Σ_d Q[row, d] · K[j, d].
///
/// Thread mapping: blocks take query rows in a grid-stride loop (`row = blockIdx.x`,
/// `blockIdx.x + gridDim.x`, …); within a block, thread `t` computes columns `t`, `t + blockDim`,
/// … of the row. All threads of a block read the same Q row (served from cache) and each reads its
/// own K rows straight from device memory: no shared memory, no reuse: the naive way.
///
/// # Safety
/// Pointers hold the shapes given in the module docs; `s` holds `rows × seqlen_k` floats.
fn naive_scores_f32(q: *const f32, k: *const f32, s: *mut f32) |shape, mask, score, scale| {
    let mut row = hw::block_idx().0;
    while row < shape.query_rows() {
        let (q_offset, kv_offset) = row_offsets(&shape, row);
        let head = row / shape.seqlen_q % shape.num_heads_q;
        let mask = mask.for_batch(row / shape.seqlen_q / shape.num_heads_q);
        let head_score = score.for_head(head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
        let mut j = hw::thread_idx_x();
        while j < shape.seqlen_k {
            let mut dot = 0.0f32;
            for d in 0..shape.head_dim {
                // SAFETY: d < head_dim, j < seqlen_k: inside this row of Q and this head of K.
                unsafe { dot = hw::fma(*q.add(q_offset + d), *k.add(kv_offset + j * shape.head_dim + d), dot) };
            }
            let query = row % shape.seqlen_q;
            // A score modification works in base-2 units (`attention::score`); S is natural.
            let logit = if score.is_active() { head_score.logit(dot * scale * LOG2_E, query, j) * LN_2 } else { dot * scale };
            // SAFETY: row < rows, j < seqlen_k.
            unsafe { *s.add(row * shape.seqlen_k + j) = if mask.visible(query, j) { logit } else { f32::NEG_INFINITY } };
            j += hw::block_dim_x();
        }
        row += hw::grid_dim_x();
    }
}
}

// ANCHOR: naive_softmax
kernel! {
/// `P[row, :] = softmax(S[row, :])` in place, and `lse[row] = ln Σ_j exp(S[row, j])`.
///
/// Thread mapping: one warp per row (`rows_per_block` warps per block, rows in a grid-stride
/// loop); lanes stride over the row. Three passes over the row: the maximum m (warp reduction),
/// then Σ exp(s − m), then the normalised probabilities. Subtracting m keeps exp from overflowing
/// however large the scores are.
///
/// # Safety
/// `s` holds `rows × seqlen_k` floats and `lse` holds `rows` floats, `rows = batch · heads ·
/// seqlen_q`; the block has `32 · rows_per_block` threads.
pub unsafe fn naive_softmax_f32(s: *mut f32, lse: *mut f32, rows: usize, seqlen_k: usize) {
    let warps_per_block = hw::block_dim_x() / hw::WARP_SIZE;
    let mut row = hw::block_idx().0 * warps_per_block + hw::warp_id();
    // Uniform per warp: all 32 lanes of a warp agree on `row`, so the warp reductions below are
    // reached by full warps.
    while row < rows {
        // SAFETY: row < rows; every index below is < seqlen_k.
        let s_row = unsafe { s.add(row * seqlen_k) };
        let lanes = || (hw::lane_id()..seqlen_k).step_by(hw::WARP_SIZE);

        let mut max = f32::NEG_INFINITY;
        for j in lanes() {
            max = max.max(unsafe { *s_row.add(j) });
        }
        let max = hw::group_max::<32>(max);

        let mut sum = 0.0f32;
        for j in lanes() {
            sum += hw::exp2((unsafe { *s_row.add(j) } - max) * LOG2_E);
        }
        let sum = hw::group_sum::<32>(sum);

        // A row whose keys are all masked has max = −∞: it gets P = 0 and LSE = −∞, not
        // the NaN of exp(−∞ − (−∞)).
        let seen_any = max != f32::NEG_INFINITY;
        let inv_sum = 1.0 / sum;
        for j in lanes() {
            let p = if seen_any { hw::exp2((unsafe { *s_row.add(j) } - max) * LOG2_E) * inv_sum } else { 0.0 };
            unsafe { *s_row.add(j) = p };
        }
        if hw::lane_id() == 0 {
            // ln Σ exp(s) = m + ln Σ exp(s − m)
            let row_lse = if seen_any { max + hw::log2(sum) * LN_2 } else { f32::NEG_INFINITY };
            let row_lse = infinite_max_lse(max, row_lse);
            unsafe { *lse.add(row) = row_lse };
        }
        row += hw::grid_dim_x() * warps_per_block;
    }
}
}
// ANCHOR_END: naive_softmax

kernel! {
/// O[row, d] = scale · Σ_j P[row, j] · V[j, d]: the forward's O = P V (scale 1) and the
/// backward's dQ = scale · dS K (with dS in place of P and K in place of V).
///
/// Thread mapping: as [`naive_scores_f32`], a block per query row; thread `t` computes output
/// columns `t`, `t + blockDim`, …. The whole block reads the same P entry at once (one broadcast
/// load) and neighbouring threads read neighbouring V entries (coalesced).
///
/// # Safety
/// As [`naive_scores_f32`]; `p` is the softmaxed `s`, `o` holds `rows × head_dim` floats.
pub unsafe fn naive_pv_f32(
    p: *const f32,
    v: *const f32,
    o: *mut f32,
    batch: usize,
    num_heads_q: usize,
    num_heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    scale: f32,
) {
    let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
    let mut row = hw::block_idx().0;
    while row < shape.query_rows() {
        let (o_offset, kv_offset) = row_offsets(&shape, row);
        let mut d = hw::thread_idx_x();
        while d < shape.head_dim {
            let mut acc = 0.0f32;
            for j in 0..shape.seqlen_k {
                // SAFETY: j < seqlen_k, d < head_dim.
                let weight = unsafe { *p.add(row * shape.seqlen_k + j) };
                // A masked (zero) weight skips its V row, so a NaN or ∞ there cannot reach rows
                // that do not see it (0 · NaN would be NaN).
                if weight != 0.0 {
                    unsafe { acc = hw::fma(weight, *v.add(kv_offset + j * shape.head_dim + d), acc) };
                }
            }
            // SAFETY: row < rows, d < head_dim.
            unsafe { *o.add(o_offset + d) = acc * scale };
            d += hw::block_dim_x();
        }
        row += hw::grid_dim_x();
    }
}
}

kernel! {
/// out[j, d] = scale · Σ_{h in group} Σ_i P_h[i, j] · X_h[i, d] for every key row j of every
/// key/value head (hence the name: Pᵀ·X): dV = Pᵀ dO (scale 1) and dK = scale · dSᵀ Q. Under grouped-query attention a
/// key/value head receives the sum over the query heads that read it.
///
/// Thread mapping: blocks take key rows `(b, kv_head, j)` in a grid-stride loop; thread `t`
/// computes columns `t`, `t + blockDim`, …. P is read down a column (one broadcast load per
/// step for the whole block), X along rows (coalesced).
///
/// # Safety
/// `p` holds `[batch, num_heads_q, seqlen_q, seqlen_k]`, `x` has Q's shape, `out` K's shape.
pub unsafe fn naive_pt_x_f32(
    p: *const f32,
    x: *const f32,
    out: *mut f32,
    batch: usize,
    num_heads_q: usize,
    num_heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    scale: f32,
) {
    let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
    let kv_rows = batch * num_heads_kv * seqlen_k;
    let mut kv_row = hw::block_idx().0;
    while kv_row < kv_rows {
        let (head_row, j) = (kv_row / seqlen_k, kv_row % seqlen_k); // head_row = b · num_heads_kv + kv_head
        let (b, kv_head) = (head_row / num_heads_kv, head_row % num_heads_kv);
        let mut d = hw::thread_idx_x();
        while d < head_dim {
            let mut acc = 0.0f32;
            for h in kv_head * shape.group_size()..(kv_head + 1) * shape.group_size() {
                let q_head = shape.q_head_offset(b, h) / head_dim; // first query row of head h
                for i in 0..seqlen_q {
                    // SAFETY: i < seqlen_q, j < seqlen_k, d < head_dim, h < num_heads_q.
                    unsafe {
                        acc = hw::fma(*p.add((q_head + i) * seqlen_k + j), *x.add((q_head + i) * head_dim + d), acc)
                    };
                }
            }
            // SAFETY: kv_row < kv_rows, d < head_dim.
            unsafe { *out.add(kv_row * head_dim + d) = acc * scale };
            d += hw::block_dim_x();
        }
        kv_row += hw::grid_dim_x();
    }
}
}

kernel! {
/// `dS[row, j] = P[row, j] · (Σ_d dO[row, d] · V[j, d] − D[row])`, written over P.
///
/// Thread mapping: as [`naive_scores_f32`], a block per query row, threads over its keys.
///
/// # Safety
/// `p_ds` holds `[batch, num_heads_q, seqlen_q, seqlen_k]`; `d_o` has Q's shape, `v` K's shape,
/// `delta` holds one float per query row.
pub unsafe fn naive_ds_f32(
    p_ds: *mut f32,
    v: *const f32,
    d_o: *const f32,
    delta: *const f32,
    batch: usize,
    num_heads_q: usize,
    num_heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
) {
    let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
    let mut row = hw::block_idx().0;
    while row < shape.query_rows() {
        let (do_offset, kv_offset) = row_offsets(&shape, row);
        let mut j = hw::thread_idx_x();
        while j < seqlen_k {
            let mut dp = 0.0f32;
            for d in 0..head_dim {
                // SAFETY: d < head_dim, j < seqlen_k.
                unsafe { dp = hw::fma(*d_o.add(do_offset + d), *v.add(kv_offset + j * head_dim + d), dp) };
            }
            // SAFETY: row < rows, j < seqlen_k.
            unsafe {
                let entry = p_ds.add(row * seqlen_k + j);
                *entry *= dp - *delta.add(row);
            }
            j += hw::block_dim_x();
        }
        row += hw::grid_dim_x();
    }
}
}
