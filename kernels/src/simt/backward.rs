//! Level 4: FlashAttention-2 backward pass (Dao 2023, "FlashAttention-2", Algorithm 2), in `f32`.
//!
//! Given Q, K, V, the forward's O and logsumexp (LSE), and dO = ∂loss/∂O, compute dQ, dK, dV
//! without reading or writing any `seqlen_q × seqlen_k` matrix: every tile of P is *recomputed*
//! from Q, K and the saved LSE, P = exp(S − LSE), which is exact (no running max is needed any
//! more: LSE is the final normaliser). Per tile of query rows i and key rows j:
//!
//! ```text
//! S   = Q_i K_jᵀ · scale        P  = exp(S − LSE_i)           (masked entries: P = 0)
//! dV_j += P ᵀ dO_i              dP = dO_i V_jᵀ
//! dS  = P ∘ (dP − D_i)          where D_i = rowsum(dO_i ∘ O_i)
//! dK_j += dSᵀ Q_i · scale       dQ_i += dS K_j · scale
//! ```
//!
//! Three kernels, as FlashAttention-2/3 and the Triton tutorial split it:
//!
//! 1. [`flash_bwd_preprocess_f32`]: D = rowsum(dO ∘ O), one float per query row.
//! 2. `flash_bwd_f32_m*_n*_d*` and `flash_bwd_dkdv_f32_m*_n*_d*` (`flash_backward_kv`): one
//!    block per `BLOCK_N` keys of one key/value head. The block keeps K_j, V_j in shared memory and
//!    dK_j, dV_j in registers while it loops over every query head of its group (grouped-query
//!    attention sums their contributions on chip) and over the query tiles that can see its keys.
//!    The first variant also adds each tile's dQ contribution to device memory with atomic adds
//!    (fast; the order of the additions, and so the last bits of dQ, vary from run to run).
//! 3. `flash_bwd_dq_f32_m*_n*_d*` (`flash_backward_q`): the deterministic alternative for dQ, one
//!    block per `BLOCK_M` query rows looping over key tiles like the forward pass; no atomics, the
//!    same bits on every run.
//!
//! With attention sinks, [`flash_bwd_sink_gradient`] adds their gradient from the LSE and D (it
//! serves every tier: the 16-bit kernels have no sink-specific code in their backward either,
//! since the LSE already counts the sink).
//!
//! ## Thread mapping of the K/V-outer kernel
//!
//! The 16 × 8 thread grid of [`crate::simt::tile`] with *key* rows as rows: a thread owns key rows
//! `row_group · KROWS + i` (`KROWS = BLOCK_N / 16`), query columns `lane + 8j` of Pᵀ and dSᵀ
//! (`QCOLS = BLOCK_M / 8`) and head_dim columns `4·lane + 32·g` of dK and dV. For the atomic dQ it
//! switches to query rows: `row_group · QROWS + i` (`QROWS = BLOCK_M / 16`).
//!
//! ## Shared memory of the K/V-outer kernel (see `layout::flash_backward_kv_strides`)
//!
//! | tile | shape | written by | read by |
//! |---|---|---|---|
//! | K, V | BLOCK_N × HEAD_DIM | whole block, once | Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dQ = dS K |
//! | Q, dO | BLOCK_M × HEAD_DIM | whole block, every query tile | the products above, dV, dK |
//! | Pᵀ, then dSᵀ | BLOCK_N × BLOCK_M | a row group, its key rows | the same row group |
//! | dS | BLOCK_M × BLOCK_N | every row group (transposed store) | whole block, for dQ |
//! | LSE·log₂e, D | 2 × BLOCK_M | whole block, every query tile | every thread |
//!
//! ## The deterministic dQ kernel
//!
//! Thread mapping as the forward pass ([`crate::simt::forward`]): query rows
//! `row_group · ROWS + i` (`ROWS = BLOCK_M / 16`), key columns `lane + 8j` of P, dP and dS
//! (`COLS = BLOCK_N / 8`), head_dim columns `4·lane + 32·g` of dQ; each thread keeps its rows'
//! LSE and D in registers. Shared memory (`layout::flash_backward_q_strides`): Q and dO
//! (`BLOCK_M × HEAD_DIM`, loaded once), K and V (`BLOCK_N × HEAD_DIM`, every key tile) and dS
//! (`BLOCK_M × BLOCK_N`, each row group its own rows, read back for dQ += dS K).

use crate::attention::epilogue::store_rows;
use crate::attention::mask::Mask;
use crate::attention::schedule::{KeyBlock, QueryBlock};
use crate::attention::score::{ScoreArgs, zero_hidden};
use crate::attention::softmax::lse_weight;
use crate::hw::{self, F32x4, LOG2_E, SharedMemory};
use crate::layout::{
    AttentionShape, FLASH_THREAD_COLS as LANES, FLASH_THREAD_ROWS, FLASH_THREADS, flash_backward_kv_strides,
    flash_backward_q_strides,
};
use crate::simt::tile::{
    a_bt, accumulate_ab, fits_thread_grid, map_tile, mask_tile, refill_tiles, store_tile, store_tile_transposed,
};

kernel! {
/// `D[row] = Σ_d dO[row, d] · O[row, d]` for every query row (`rows = batch · heads · seqlen_q`).
///
/// Thread mapping: one warp per row (rows in a grid-stride loop), lanes stride over head_dim,
/// a warp reduction adds their partial sums.
///
/// # Safety
/// `o` and `d_o` hold `rows × head_dim` floats, `delta` holds `rows`; blocks are whole warps.
pub unsafe fn flash_bwd_preprocess_f32(
    o: *const f32,
    d_o: *const f32,
    delta: *mut f32,
    rows: usize,
    head_dim: usize,
) {
    let warps_per_block = hw::block_dim_x() / hw::WARP_SIZE;
    let mut row = hw::block_idx().0 * warps_per_block + hw::warp_id();
    while row < rows {
        let mut sum = 0.0f32;
        for d in (hw::lane_id()..head_dim).step_by(hw::WARP_SIZE) {
            // SAFETY: row < rows, d < head_dim.
            unsafe { sum = hw::fma(*o.add(row * head_dim + d), *d_o.add(row * head_dim + d), sum) };
        }
        let sum = hw::group_sum::<32>(sum);
        if hw::lane_id() == 0 {
            // SAFETY: row < rows.
            unsafe { *delta.add(row) = sum };
        }
        row += hw::grid_dim_x() * warps_per_block;
    }
}
}

kernel! {
/// The attention sinks' gradient (`finish_row` in `attention::softmax` defines the sinks). A
/// sink is a logit with no value vector, so its probability in row `i`, `e^(sink − LSE_i)`,
/// enters the gradient like any key's with dP = 0: `dSink = Σ_i P_i (0 − D_i)`, summed over
/// the head's rows in every batch entry,
///
/// `dSink[h] = −Σ_{b, i} e^(sink_h − LSE[b, h, i]) · D[b, h, i]`,
///
/// with D = rowsum(dO ∘ O) from the preprocess kernel (`flash_bwd_preprocess_*`) and the LSE
/// of the forward pass (which includes the sink).
///
/// Thread mapping: one block per query head (`grid = num_heads_q`); its threads stride over the
/// head's rows of each batch entry in turn, warps add their lanes' sums, and thread 0 adds the
/// warps' sums from dynamic shared memory (one `f32` per warp) in order: the same sum on every
/// run.
///
/// # Safety
/// `lse` and `delta` hold `[batch, num_heads_q, seqlen_q]` floats, `sinks` and `d_sinks`
/// `[num_heads_q]`; blocks are whole warps, with one `f32` of dynamic shared memory per warp.
pub unsafe fn flash_bwd_sink_gradient(
    lse: *const f32,
    delta: *const f32,
    sinks: *const f32,
    d_sinks: *mut f32,
    batch: usize,
    num_heads_q: usize,
    seqlen_q: usize,
) {
    let head = hw::block_idx().0;
    // SAFETY: head < num_heads_q.
    let sink = unsafe { *sinks.add(head) };
    let mut sum = 0.0f32;
    for b in 0..batch {
        let rows = (b * num_heads_q + head) * seqlen_q;
        for i in (hw::thread_idx_x()..seqlen_q).step_by(hw::block_dim_x()) {
            // SAFETY: row rows + i of this head exists.
            let (row_lse, row_delta) = unsafe { (*lse.add(rows + i), *delta.add(rows + i)) };
            sum = hw::fma(lse_weight(sink, row_lse), row_delta, sum);
        }
    }
    let partial = hw::dynamic_shared_memory();
    let sum = hw::group_sum::<32>(sum);
    if hw::lane_id() == 0 {
        // SAFETY: one float per warp.
        unsafe { *partial.add(hw::warp_id()) = sum };
    }
    hw::sync_threads();
    if hw::thread_idx_x() == 0 {
        let total = (0..hw::block_dim_x() / hw::WARP_SIZE).fold(0.0f32, |t, w| t + unsafe { *partial.add(w) });
        // SAFETY: head < num_heads_q.
        unsafe { *d_sinks.add(head) = -total };
    }
}
}

/// Pointers of one backward problem, as the kernels receive them.
#[derive(Clone, Copy)]
pub(crate) struct BackwardTensors {
    q: *const f32,
    k: *const f32,
    v: *const f32,
    d_o: *const f32,
    lse: *const f32,
    delta: *const f32,
    dq: *mut f32,
    dk: *mut f32,
    dv: *mut f32,
}

// ANCHOR: recompute_p
/// Unnormalised → normalised probabilities of a tile: `p = 2^(s·scale_log2 − lse2)`, with `lse2`
/// the row's (or column's) LSE in base 2. Rows that see no key have LSE = −∞ and so p = +∞ here;
/// the mask, which hides every key from such rows, replaces those entries with 0.
#[inline(always)]
fn probabilities<const ROWS: usize, const COLS: usize>(
    s: [[f32; COLS]; ROWS],
    scale_log2: f32,
    lse2: impl Fn(usize, usize) -> f32,
) -> [[f32; COLS]; ROWS] {
    let mut p = s;
    for i in 0..ROWS {
        for j in 0..COLS {
            p[i][j] = hw::exp2(s[i][j] * scale_log2 - lse2(i, j));
        }
    }
    p
}

/// dS = P ∘ (dP − D), entry by entry, `delta(i, j)` giving the D of the entry's query row.
#[inline(always)]
fn softmax_grad<const ROWS: usize, const COLS: usize>(
    p: &[[f32; COLS]; ROWS],
    dp: &[[f32; COLS]; ROWS],
    delta: impl Fn(usize, usize) -> f32,
) -> [[f32; COLS]; ROWS] {
    core::array::from_fn(|i| core::array::from_fn(|j| p[i][j] * (dp[i][j] - delta(i, j))))
}
// ANCHOR_END: recompute_p

/// The K/V-outer kernel body; see the module docs. With `ATOMIC_DQ` it also accumulates dQ into
/// `t.dq` (which the host zeroes first) with atomic adds.
///
/// Grid: `(ceil(seqlen_k / BLOCK_N), num_heads_kv, batch)`; block: [`FLASH_THREADS`] threads;
/// dynamic shared memory: `layout::flash_backward_kv_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM)`.
///
/// # Safety
/// Tensors of the shapes in `shape`, 16-byte aligned; `lse` and `delta` hold one float per query
/// row; dK and dV do not overlap the inputs; the launch has the grid, block and shared memory above.
#[inline(always)]
pub(crate) unsafe fn flash_backward_kv<
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const KROWS: usize,
    const QCOLS: usize,
    const QROWS: usize,
    const DVEC: usize,
    const ATOMIC_DQ: bool,
>(
    t: BackwardTensors,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
) {
    // Key rows as the grid's rows for dK and dV, query rows for the atomic dQ.
    const {
        assert!(fits_thread_grid((BLOCK_N, KROWS), (BLOCK_M, QCOLS), (HEAD_DIM, DVEC)));
        assert!(BLOCK_M == FLASH_THREAD_ROWS * QROWS);
    };
    let scale_log2 = scale * LOG2_E;
    let block = KeyBlock::current::<BLOCK_M, BLOCK_N>(&shape, &mask);
    let (kv_start, kv_rows, kv_head, batch) = (block.k_start, block.k_rows, block.kv_head, block.batch);
    let mask = mask.for_batch(batch);
    // Global rows are `d` floats long; the tiles are `HEAD_DIM` wide, zero past `d`.
    let d = shape.head_dim;
    let kv_offset = block.first_row_offset(&shape, d);

    let (row_group, lane) = (hw::thread_idx_x() / LANES, hw::thread_idx_x() % LANES);
    let (first_key, first_query) = (row_group * KROWS, row_group * QROWS);

    let [kv_stride, q_stride, pt_stride, ds_stride] = flash_backward_kv_strides(BLOCK_M, BLOCK_N, HEAD_DIM);
    let mut smem = SharedMemory::new();
    let k_tile = smem.tile(BLOCK_N, kv_stride);
    let v_tile = smem.tile(BLOCK_N, kv_stride);
    let q_tile = smem.tile(BLOCK_M, q_stride);
    let do_tile = smem.tile(BLOCK_M, q_stride);
    let pt_tile = smem.tile(BLOCK_N, pt_stride);
    let ds_tile = smem.tile(BLOCK_M, ds_stride);
    let stats = smem.tile(2, BLOCK_M); // row 0: LSE·log₂e, row 1: D, per query of the tile

    // SAFETY: rows kv_start .. kv_start + kv_rows of this head exist.
    unsafe {
        k_tile.copy_rows_from::<FLASH_THREADS>(t.k.add(kv_offset), BLOCK_N, HEAD_DIM, d, kv_rows);
        v_tile.copy_rows_from::<FLASH_THREADS>(t.v.add(kv_offset), BLOCK_N, HEAD_DIM, d, kv_rows);
    }

    let mut dk = [[F32x4::ZERO; DVEC]; KROWS];
    let mut dv = [[F32x4::ZERO; DVEC]; KROWS];
    // Queries before `block.first_query` or from `block.query_end` on see none of this block's
    // keys: their tiles are skipped.
    for head in kv_head * block.group..(kv_head + 1) * block.group {
        let q_offset = shape.q_head_offset(batch, head);
        let row_offset = q_offset / d; // first query row of this head, in LSE and D
        for q_start in (block.first_query..block.query_end).step_by(BLOCK_M) {
            let q_rows = BLOCK_M.min(shape.seqlen_q - q_start);
            // Nobody may still be reading the previous tiles.
            hw::sync_threads();
            // SAFETY: rows q_start .. q_start + q_rows of this head exist.
            unsafe {
                let rows = q_offset + q_start * d;
                q_tile.copy_rows_from::<FLASH_THREADS>(t.q.add(rows), BLOCK_M, HEAD_DIM, d, q_rows);
                do_tile.copy_rows_from::<FLASH_THREADS>(t.d_o.add(rows), BLOCK_M, HEAD_DIM, d, q_rows);
            }
            let mut c = hw::thread_idx_x();
            while c < BLOCK_M {
                let (lse2, delta) = if c < q_rows {
                    // SAFETY: the query row exists.
                    unsafe { (*t.lse.add(row_offset + q_start + c) * LOG2_E, *t.delta.add(row_offset + q_start + c)) }
                } else {
                    (0.0, 0.0)
                };
                stats.store(0, c, lse2);
                stats.store(1, c, delta);
                c += FLASH_THREADS;
            }
            hw::sync_threads();

            // Pᵀ for this thread's key rows and query columns.
            let mut st = a_bt::<HEAD_DIM, KROWS, QCOLS>(k_tile, q_tile, first_key, lane);
            // A score modification turns the products into base-2 logits first (`attention::score`).
            let head_score = || score.for_head(head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
            let bias = score.bias_plane(batch, head, shape.seqlen_q, shape.seqlen_k);
            if score.is_active() {
                let head_score = head_score();
                // SAFETY: the host checked the bias's shape (`BiasPlane::logit`).
                map_tile(&mut st, first_key, lane, |r, c, x| {
                    let (query, key) = (q_start + c, kv_start + r);
                    head_score.logit(x * scale_log2, query, key) + unsafe { bias.logit(query, key) }
                });
            }
            let factor = score.softmax_factor(scale_log2);
            let mut pt = probabilities(st, factor, |_, j| stats.load(0, lane + LANES * j));
            if score.has_bias() {
                zero_hidden(&mut pt, &st);
            }
            // Tiles where some query cannot see some key (the causal diagonal, a window's edges,
            // the ragged ends) pay for the per-element mask.
            if mask.tile_needs_mask(q_start, BLOCK_M, kv_start, BLOCK_N) {
                mask_tile(&mut pt, first_key, lane, 0.0, q_start, |r| mask.queries_seeing(kv_start + r));
            }
            // dV += Pᵀ dO. A row group reads back only the key rows it wrote: a warp barrier.
            store_tile(pt_tile, &pt, first_key, lane);
            hw::sync_warp();
            accumulate_ab::<BLOCK_M, KROWS, DVEC, false>(&mut dv, pt_tile, do_tile, first_key, lane);

            // dSᵀ = Pᵀ ∘ (dPᵀ − D), dPᵀ = V dOᵀ; then dK += dSᵀ Q (scaled at the end).
            let mut dpt = a_bt::<HEAD_DIM, KROWS, QCOLS>(v_tile, do_tile, first_key, lane);
            if score.is_softcapped() {
                let head_score = head_score();
                for i in 0..KROWS {
                    for j in 0..QCOLS {
                        dpt[i][j] = head_score.chain_rule(st[i][j], dpt[i][j], stats.load(1, lane + LANES * j));
                    }
                }
            }
            let dst = softmax_grad(&pt, &dpt, |_, j| stats.load(1, lane + LANES * j));
            if score.has_bias() {
                // dBias = dS: the bias enters the logit with factor 1 (`BiasPlane`).
                for i in 0..KROWS {
                    for j in 0..QCOLS {
                        let (query, key) = (q_start + lane + LANES * j, kv_start + first_key + i);
                        // SAFETY: the host checked dBias's shape.
                        unsafe { bias.accumulate(query, key, dst[i][j]) };
                    }
                }
            }
            hw::sync_warp(); // the row group has finished reading Pᵀ
            store_tile(pt_tile, &dst, first_key, lane);
            hw::sync_warp();
            accumulate_ab::<BLOCK_M, KROWS, DVEC, false>(&mut dk, pt_tile, q_tile, first_key, lane);

            if ATOMIC_DQ {
                // dQ_i += dS K · scale needs every key row of dS: publish it to the whole block.
                store_tile_transposed(ds_tile, &dst, first_key, lane);
                hw::sync_threads();
                let mut dq = [[F32x4::ZERO; DVEC]; QROWS];
                accumulate_ab::<BLOCK_N, QROWS, DVEC, false>(&mut dq, ds_tile, k_tile, first_query, lane);
                for i in 0..QROWS {
                    if first_query + i < q_rows {
                        for g in 0..DVEC {
                            let column = 4 * lane + 32 * g;
                            for (e, &value) in dq[i][g].0.iter().enumerate() {
                                if column + e >= d {
                                    break; // a padded head_dim's columns
                                }
                                // SAFETY: the query row and column exist.
                                unsafe {
                                    hw::atomic_add(
                                        t.dq.add(q_offset + (q_start + first_query + i) * d + column + e),
                                        value * scale,
                                    )
                                };
                            }
                        }
                    }
                }
            }
        }
    }

    // SAFETY: rows kv_start .. kv_start + kv_rows of dK and dV exist.
    unsafe {
        store_rows::<HEAD_DIM, KROWS, DVEC>(&dk, [scale; KROWS], t.dk.add(kv_offset), d, kv_rows, first_key, lane);
        store_rows::<HEAD_DIM, KROWS, DVEC>(&dv, [1.0; KROWS], t.dv.add(kv_offset), d, kv_rows, first_key, lane);
    }
}

/// The deterministic dQ kernel body: one block per `BLOCK_M` query rows of one query head, looping
/// over key tiles like the forward pass (and skipping hidden ones the same way).
///
/// Grid: `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`; block: [`FLASH_THREADS`] threads;
/// dynamic shared memory: `layout::flash_backward_q_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM)`.
///
/// # Safety
/// As [`flash_backward_kv`]; only `t.dq` is written.
#[inline(always)]
pub(crate) unsafe fn flash_backward_q<
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const ROWS: usize,
    const COLS: usize,
    const DVEC: usize,
>(
    t: BackwardTensors,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
) {
    const { assert!(fits_thread_grid((BLOCK_M, ROWS), (BLOCK_N, COLS), (HEAD_DIM, DVEC))) };
    let scale_log2 = scale * LOG2_E;
    let block = QueryBlock::current::<BLOCK_M>(&shape);
    let mask = mask.for_batch(block.batch);
    let factor = score.softmax_factor(scale_log2);
    let head_score = score.for_head(block.head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
    let bias = score.bias_plane(block.batch, block.head, shape.seqlen_q, shape.seqlen_k);
    let (q_start, q_rows) = (block.q_start, block.q_rows);
    // Global rows are `d` floats long; the tiles are `HEAD_DIM` wide, zero past `d`.
    let d = shape.head_dim;
    let row_offset = block.q_offset / d + q_start; // first query row of this block, in LSE and D

    let (row_group, lane) = (hw::thread_idx_x() / LANES, hw::thread_idx_x() % LANES);
    let first_row = row_group * ROWS;

    let [qkv_stride, ds_stride] = flash_backward_q_strides(BLOCK_N, HEAD_DIM);
    let mut smem = SharedMemory::new();
    let q_tile = smem.tile(BLOCK_M, qkv_stride);
    let do_tile = smem.tile(BLOCK_M, qkv_stride);
    let k_tile = smem.tile(BLOCK_N, qkv_stride);
    let v_tile = smem.tile(BLOCK_N, qkv_stride);
    let ds_tile = smem.tile(BLOCK_M, ds_stride);

    // SAFETY: rows q_start .. q_start + q_rows of this head exist.
    unsafe {
        let rows = block.first_row_offset(d);
        q_tile.copy_rows_from::<FLASH_THREADS>(t.q.add(rows), BLOCK_M, HEAD_DIM, d, q_rows);
        do_tile.copy_rows_from::<FLASH_THREADS>(t.d_o.add(rows), BLOCK_M, HEAD_DIM, d, q_rows);
    }
    // This thread's rows' LSE (base 2) and D; padding rows get 0 and are never written.
    let (mut lse2, mut delta) = ([0.0f32; ROWS], [0.0f32; ROWS]);
    for i in 0..ROWS {
        if first_row + i < q_rows {
            // SAFETY: the row exists.
            unsafe {
                lse2[i] = *t.lse.add(row_offset + first_row + i) * LOG2_E;
                delta[i] = *t.delta.add(row_offset + first_row + i);
            }
        }
    }

    let mut dq = [[F32x4::ZERO; DVEC]; ROWS];
    let keys = mask.keys_for(q_start, q_rows);
    for kv_start in (keys.tile_start(0, BLOCK_N)..keys.end).step_by(BLOCK_N) {
        // SAFETY: rows kv_start .. of this head exist; the first barrier inside also publishes Q
        // and dO on the first trip.
        unsafe {
            let rows = block.kv_offset + kv_start * d;
            refill_tiles::<BLOCK_N, HEAD_DIM>(
                k_tile,
                t.k.add(rows),
                v_tile,
                t.v.add(rows),
                d,
                BLOCK_N.min(shape.seqlen_k - kv_start),
            );
        }

        let mut s = a_bt::<HEAD_DIM, ROWS, COLS>(q_tile, k_tile, first_row, lane);
        if score.is_active() {
            // SAFETY: the host checked the bias's shape (`BiasPlane::logit`).
            map_tile(&mut s, first_row, lane, |r, c, x| {
                let (query, key) = (q_start + r, kv_start + c);
                head_score.logit(x * scale_log2, query, key) + unsafe { bias.logit(query, key) }
            });
        }
        let mut p = probabilities(s, factor, |i, _| lse2[i]);
        if score.has_bias() {
            zero_hidden(&mut p, &s);
        }
        if keys.needs_mask(kv_start, BLOCK_N) {
            mask_tile(&mut p, first_row, lane, 0.0, kv_start, |r| mask.keys_seen_by(q_start + r));
        }
        let mut dp = a_bt::<HEAD_DIM, ROWS, COLS>(do_tile, v_tile, first_row, lane);
        if score.is_softcapped() {
            for i in 0..ROWS {
                for j in 0..COLS {
                    dp[i][j] = head_score.chain_rule(s[i][j], dp[i][j], delta[i]);
                }
            }
        }
        let ds = softmax_grad(&p, &dp, |i, _| delta[i]);
        store_tile(ds_tile, &ds, first_row, lane);
        hw::sync_warp();
        accumulate_ab::<BLOCK_N, ROWS, DVEC, false>(&mut dq, ds_tile, k_tile, first_row, lane);
    }
    // SAFETY: rows q_start .. q_start + q_rows of dQ exist.
    unsafe {
        store_rows::<HEAD_DIM, ROWS, DVEC>(
            &dq,
            [scale; ROWS],
            t.dq.add(block.first_row_offset(d)),
            d,
            q_rows,
            first_row,
            lane,
        )
    };
}

/// The three backward entries for one tile (see `flash_forward_instance!` for how the names are
/// made and `simt_tiles!` for the list of tiles): `flash_bwd_f32_*` (dK, dV and atomic dQ),
/// `flash_bwd_dkdv_f32_*` (dK, dV only) and `flash_bwd_dq_f32_*` (deterministic dQ). All take
/// the same arguments.
macro_rules! flash_backward_instance {
    ($block_m:literal, $block_n:literal, $head_dim:literal) => {
        pastey::paste! {
            flash_backward_instance!(@kv [<flash_bwd_f32_m $block_m _n $block_n _d $head_dim>], $block_m, $block_n, $head_dim, true);
            flash_backward_instance!(@kv [<flash_bwd_dkdv_f32_m $block_m _n $block_n _d $head_dim>], $block_m, $block_n, $head_dim, false);
            flash_backward_instance!(@q [<flash_bwd_dq_f32_m $block_m _n $block_n _d $head_dim>], $block_m, $block_n, $head_dim);
        }
    };
    (@kv $name:ident, $block_m:literal, $block_n:literal, $head_dim:literal, $atomic_dq:literal) => {
        flash_backward_instance!(@entry $name, |t, shape, mask, score, scale| flash_backward_kv::<
            $block_m,
            $block_n,
            $head_dim,
            { $block_n / FLASH_THREAD_ROWS },
            { $block_m / LANES },
            { $block_m / FLASH_THREAD_ROWS },
            { $head_dim / (4 * LANES) },
            $atomic_dq,
        >(t, shape, mask, score, scale));
    };
    (@q $name:ident, $block_m:literal, $block_n:literal, $head_dim:literal) => {
        flash_backward_instance!(@entry $name, |t, shape, mask, score, scale| flash_backward_q::<
            $block_m,
            $block_n,
            $head_dim,
            { $block_m / FLASH_THREAD_ROWS },
            { $block_n / LANES },
            { $head_dim / (4 * LANES) },
        >(t, shape, mask, score, scale));
    };
    (@entry $name:ident, |$t:ident, $shape:ident, $mask:ident, $score:ident, $scale:ident| $body:expr) => {
        attention_kernel! {
        /// FlashAttention-2 backward, `f32`; see the module docs.
        ///
        /// # Safety
        /// As `flash_backward_kv` / `flash_backward_q`.
        fn $name(
            q: *const f32,
            k: *const f32,
            v: *const f32,
            d_o: *const f32,
            lse: *const f32,
            delta: *const f32,
            dq: *mut f32,
            dk: *mut f32,
            dv: *mut f32,
        ) table twin |$shape, $mask, $score, $scale, TABLE| {
            let $t = BackwardTensors { q, k, v, d_o, lse, delta, dq, dk, dv };
            unsafe { $body }
        }
        }
    };
}

simt_tiles!(flash_backward_instance);
