//! Level 6: FlashAttention-2 backward on tensor cores (Dao 2023, Algorithm 2), `f16` and `bf16`.
//!
//! The algorithm of [`crate::simt::backward`] with the five matrix products on the tensor cores.
//! With P recomputed from the saved logsumexp, per key block and query tile:
//!
//! | step | product | A operand | B operand |
//! |---|---|---|---|
//! | Sᵀ = K·Qᵀ | keys × queries, k = head_dim | K rows (`ldmatrix`, kept in registers up to head_dim 64) | Q rows (`ldmatrix`) |
//! | dPᵀ = V·dOᵀ | keys × queries, k = head_dim | V rows, likewise | dO rows |
//! | dV += Pᵀ·dO | keys × head_dim, k = queries | Pᵀ, from registers | dO, read again transposed (`ldmatrix.trans`) |
//! | dK += dSᵀ·Q | keys × head_dim, k = queries | dSᵀ = Pᵀ ∘ (dPᵀ − D), from registers | Q, likewise |
//! | dQ += dS·K | queries × head_dim, k = keys | atomic mode: dSᵀ from shared memory (`.trans`); deterministic dQ kernel: dS from registers | K (`.trans`) |
//!
//! Computing the transposes Sᵀ and dPᵀ (keys as rows) puts Pᵀ and dSᵀ in accumulator layout with
//! keys as rows, which is the A layout that dV and dK need: like P in the forward pass, they go
//! from one product into the next without leaving registers. Their B operands are the same
//! 16×16 blocks of Q and dO that Sᵀ and dPᵀ read, the other way round: the kernel works through
//! the query tile 16 queries at a time, reading a chunk's Q and dO with `ldmatrix` for Sᵀ and
//! dPᵀ and again with `ldmatrix.trans` for dK and dV. The warp's own 16 rows of K and V are the
//! same for every query tile: up to head_dim 64 they are read once and kept as A fragments for
//! the whole block (`keeps_kv_rows`). (Keeping a chunk's Q and dO instead and transposing them
//! in registers with `movmatrix` saves as many reads for as many registers, but costs an
//! instruction per 8×8 matrix: PERFORMANCE.md, issue 27, has the profile that chose.)
//!
//! ## Wide heads (head_dim above 128)
//!
//! A warp keeps dK and dV of its 16 keys in registers, `head_dim` `f32` values a thread for the
//! two: 128 at head_dim 128, with the fragments and scores beside them, and too many above. So
//! above 128 two warps share each 16-row slice ([`warp_slice`]): warps `2i` and `2i + 1` own
//! the same 16 keys, and each accumulates half of the columns of dK and dV (96 or 128 a
//! thread at 192 or 256). Both compute the slice's Sᵀ and dPᵀ over the whole head_dim, so the
//! products over head_dim are done twice: at 256, 6 products of a 16 × 16 × 256 size where an
//! unsplit kernel would do 4, which costs a third of the tensor-core work for a kernel that
//! fits. The dQ kernel splits its rows of dQ the same way, and reads Q and dO from shared memory
//! at every use instead of keeping them in registers. In atomic mode only the first warp of a
//! pair publishes dSᵀ (the two compute the same values). FlashAttention-2 spreads the columns of
//! dK and dV over its warps in the same spirit (its `AtomLayoutNdKV`); FlashAttention-3 does it
//! on Hopper with two consumer warpgroups.
//!
//! ## Shared memory of the K/V-outer kernel (16-bit rows padded by 8 elements; `layout::mma_backward_kv_smem_bytes`)
//!
//! | tile | shape | written by | read by |
//! |---|---|---|---|
//! | K, V | BLOCK_N × HEAD_DIM | `cp.async`, once | each warp its 16 keys (A operands); all keys for dQ |
//! | Q, dO ×`STAGES` | BLOCK_M × HEAD_DIM | `cp.async` ring, one slot per query tile | every warp (B operands) |
//! | dSᵀ | BLOCK_N × BLOCK_M | each warp its 16 keys (atomic dQ only) | every warp, transposed, for dQ |
//! | LSE, D ×`STAGES` | 2 × BLOCK_M `f32` | `cp.async` (4-byte), with Q and dO | every warp |
//!
//! The dQ kernel has Q and dO (`BLOCK_M × HEAD_DIM`, read once into registers up to head_dim
//! 128, at every use above) and a `STAGES`-slot K/V ring, as the forward pass
//! (`layout::mma_backward_dq_smem_bytes`).
//!
//! ## Kernels
//!
//! * `flash_backward_kv_mma` (`flash_bwd_{f16,bf16}_…` and `flash_bwd_dkdv_{f16,bf16}_…`): one
//!   block per `BLOCK_N` keys of one key/value head, `BLOCK_N / 16` warps (twice as many above
//!   head_dim 128), warp `w` owning keys `16w .. 16w + 16` and their rows of dK and dV in
//!   registers. It loops over the query tiles of
//!   every query head of its group (grouped-query attention needs no atomics for dK and dV), the
//!   Q/dO tiles streamed through a `STAGES`-slot `cp.async` ring as in the forward pass. With
//!   atomic dQ, the warps then share dSᵀ through shared memory and add dQ = scale · dS·K into an
//!   `f32` accumulator with `red.add`; a last kernel rounds it to 16 bits.
//! * `flash_backward_q_mma` (`flash_bwd_dq_{f16,bf16}_…`): the deterministic dQ, one block per
//!   `BLOCK_M` queries, warp `w` owning queries `16w .. 16w + 16`, looping over key tiles like
//!   the forward pass, 32 keys at a time (16 above head_dim 64): S, P, dP = dO·Vᵀ, dS, and
//!   dQ += dS·K with dS from registers and the chunk's K read again with `ldmatrix.trans`. No
//!   atomics, a fixed order of additions, bit-identical results from run to run.
//!
//! ## Legend
//!
//! `g = lane / 4`, `t = lane % 4` as in [`crate::attention::fragment`]. In the K/V-outer
//! kernel a query *chunk* is 16 queries starting at `q0`, split in two halves of 8:
//!
//! * `st[half]`, `dpt[half]`, `pt[half]`, `ds_t[half]`: accumulator fragments of Sᵀ, dPᵀ, Pᵀ and
//!   dSᵀ for the warp's 16 keys and the chunk's queries `q0 + 8·half .. q0 + 8·half + 8`;
//! * `k_frags.get(ks)`, `v_frags.get(ks)`: the warp's rows of K and V as A fragments, head_dim
//!   columns `16ks .. 16ks + 16` (a [`RowFragments`]: kept in registers up to head_dim 64);
//! * `dk_acc[dt]`, `dv_acc[dt]`: the warp's rows of dK and dV, columns `8dt .. 8dt + 8`.
//!
//! In the dQ kernel a *chunk* is 32 keys (16 above head_dim 64) starting at `k0`: `s[j]`,
//! `dp[j]`, `ds[j]` are S, dP and dS for the warp's 16 queries and keys `k0 + 8j .. k0 + 8j + 8`;
//! `q_frags.get(ks)`, `do_frags.get(ks)` the warp's rows of Q and dO as A fragments; `acc[dt]`
//! the warp's rows of dQ.

use crate::attention::epilogue::store_warp_rows;
use crate::attention::fragment::{FragmentLane, mask_fragments, pack_a};
use crate::attention::mask::Mask;
use crate::attention::schedule::{KeyBlock, QueryBlock};
use crate::attention::score::{ScoreArgs, zero_hidden};
use crate::hw::{self, HalfFloat, LOG2_E, RowFragments, SharedMemory};
use crate::layout::{
    AttentionShape, MMA_SMEM_PAD, MMA_WARP_ROWS, mma_backward_column_warps, mma_backward_threads,
    mma_backward_warp_columns, row_length,
};
use crate::sm80::pipeline::KvRing;

kernel! {
/// `D[row] = Σ_d dO[row, d] · O[row, d]` for every query row (`rows = batch · heads · seqlen_q`),
/// from 16-bit O and dO, in `f32`. One warp per row (a grid-stride loop over rows), each lane
/// reading 8 elements (16 bytes) at a time when `head_dim` is a multiple of 8 (every row then
/// starts 16-byte aligned), one at a time otherwise.
///
/// # Safety
/// `o` and `d_o` hold `rows × head_dim` elements, 16-byte aligned; `delta` holds `rows`; blocks
/// are whole warps.
pub unsafe fn flash_bwd_preprocess_f16(o: *const u16, d_o: *const u16, delta: *mut f32, rows: usize, head_dim: usize) {
    unsafe { row_deltas::<hw::F16>(o, d_o, delta, rows, head_dim) }
}
}

kernel! {
/// [`flash_bwd_preprocess_f16`] for `bf16` tensors.
///
/// # Safety
/// As [`flash_bwd_preprocess_f16`].
pub unsafe fn flash_bwd_preprocess_bf16(o: *const u16, d_o: *const u16, delta: *mut f32, rows: usize, head_dim: usize) {
    unsafe { row_deltas::<hw::Bf16>(o, d_o, delta, rows, head_dim) }
}
}

/// The body of the preprocessing kernels.
#[inline(always)]
unsafe fn row_deltas<T: HalfFloat>(o: *const u16, d_o: *const u16, delta: *mut f32, rows: usize, head_dim: usize) {
    let warps_per_block = hw::block_dim_x() / hw::WARP_SIZE;
    let mut row = hw::block_idx().0 * warps_per_block + hw::warp_id();
    while row < rows {
        let mut sum = 0.0f32;
        if head_dim.is_multiple_of(8) {
            for col in (8 * hw::lane_id()..head_dim).step_by(8 * hw::WARP_SIZE) {
                // SAFETY: row < rows and col + 8 ≤ head_dim.
                let (x, y) = unsafe {
                    let at = row * head_dim + col;
                    (hw::load8_widened::<T>(o.add(at)), hw::load8_widened::<T>(d_o.add(at)))
                };
                for i in 0..8 {
                    sum = hw::fma(x[i], y[i], sum);
                }
            }
        } else {
            for col in (hw::lane_id()..head_dim).step_by(hw::WARP_SIZE) {
                // SAFETY: row < rows and col < head_dim.
                let (x, y) = unsafe { (*o.add(row * head_dim + col), *d_o.add(row * head_dim + col)) };
                sum = hw::fma(T::unpack(x as u32).0, T::unpack(y as u32).0, sum);
            }
        }
        let sum = hw::group_sum::<32>(sum);
        if hw::lane_id() == 0 {
            // SAFETY: row < rows.
            unsafe { *delta.add(row) = sum };
        }
        row += hw::grid_dim_x() * warps_per_block;
    }
}

kernel! {
/// Rounds the `f32` dQ accumulator of the atomic backward to `f16`: `dq[i] = dq_accum[i]` for
/// `i < n`, 8 elements per thread per trip of a grid-stride loop; the last `n % 8` (a head_dim
/// that is not a multiple of 8) one per thread.
///
/// # Safety
/// `dq_accum` holds `n` floats, `dq` `n` elements, both 16-byte aligned.
pub unsafe fn flash_bwd_convert_dq_f16(dq_accum: *const f32, dq: *mut u16, n: usize) {
    unsafe { convert_dq::<hw::F16>(dq_accum, dq, n) }
}
}

kernel! {
/// [`flash_bwd_convert_dq_f16`] for `bf16`.
///
/// # Safety
/// As [`flash_bwd_convert_dq_f16`].
pub unsafe fn flash_bwd_convert_dq_bf16(dq_accum: *const f32, dq: *mut u16, n: usize) {
    unsafe { convert_dq::<hw::Bf16>(dq_accum, dq, n) }
}
}

/// The body of the dQ conversion kernels.
#[inline(always)]
unsafe fn convert_dq<T: HalfFloat>(dq_accum: *const f32, dq: *mut u16, n: usize) {
    let mut chunk = hw::global_thread_idx();
    while chunk < n / 8 {
        // SAFETY: 8·chunk + 8 ≤ n.
        unsafe {
            let (lo, hi) = (hw::F32x4::load(dq_accum.add(8 * chunk)).0, hw::F32x4::load(dq_accum.add(8 * chunk + 4)).0);
            let packed = [T::pack(lo[0], lo[1]), T::pack(lo[2], lo[3]), T::pack(hi[0], hi[1]), T::pack(hi[2], hi[3])];
            hw::store16(dq.add(8 * chunk), packed);
        }
        chunk += hw::grid_stride();
    }
    let (tail, i) = (n - n % 8, hw::global_thread_idx());
    if tail + i < n {
        // SAFETY: tail + i < n.
        unsafe { *dq.add(tail + i) = T::pack(*dq_accum.add(tail + i), 0.0) as u16 };
    }
}

/// This warp's slice of the block's accumulators: its first row (16 rows a warp: keys in the
/// K/V-outer kernels, queries in the dQ kernel) and its first column. Up to head_dim 128 a warp
/// owns its rows' every column; above, warps `2i` and `2i + 1` share rows `16i ..` and own a half
/// of the columns each ([`mma_backward_column_warps`]).
// ANCHOR: warp_slice
#[inline(always)]
fn warp_slice<const HEAD_DIM: usize>() -> (usize, usize) {
    let (split, columns) = const { (mma_backward_column_warps(HEAD_DIM), mma_backward_warp_columns(HEAD_DIM)) };
    let warp = hw::warp_id();
    (warp / split * MMA_WARP_ROWS, warp % split * columns)
}
// ANCHOR_END: warp_slice

/// How many of this warp's columns, from `col0` on ([`warp_slice`]), lie inside rows of `d`
/// elements: `d` itself where the warp owns whole rows.
#[inline(always)]
fn warp_columns<const HEAD_DIM: usize>(col0: usize, d: usize) -> usize {
    let columns = const { mma_backward_warp_columns(HEAD_DIM) };
    if columns == HEAD_DIM { d } else { d.saturating_sub(col0).min(columns) }
}

/// Pointers of one backward problem, as the kernels receive them (16-bit tensors as raw bits).
#[derive(Clone, Copy)]
pub(crate) struct BackwardTensors {
    q: *const u16,
    k: *const u16,
    v: *const u16,
    d_o: *const u16,
    lse: *const f32,
    delta: *const f32,
}

/// Whether the K/V-outer kernel keeps its warp's 16 rows of K and V as A fragments in registers
/// for the whole block: they are the same for every query tile, so kept they are read from shared
/// memory once instead of once per 16-query chunk (2 · `HEAD_DIM / 16` `ldmatrix.x4` a warp per
/// chunk), for `HEAD_DIM / 2` registers a thread. Up to head_dim 64; at 128 they would take 64
/// registers beside the 128 of dK and dV.
const fn keeps_kv_rows(head_dim: usize) -> bool {
    head_dim <= 64
}

/// The K/V-outer kernel body: dK and dV for `BLOCK_N` keys (and, with `ATOMIC_DQ`, their share
/// of dQ into the `f32` accumulator `dq_accum`). `D_STEPS = HEAD_DIM / 16`,
/// `M_TILES = BLOCK_M / 8` and `D_TILES = HEAD_DIM / 8 / mma_backward_column_warps(HEAD_DIM)`
/// (the warp's columns of dK and dV) size the register arrays.
///
/// Grid: `(ceil(seqlen_k / BLOCK_N), num_heads_kv, batch)`; block:
/// `layout::mma_backward_threads(BLOCK_N, HEAD_DIM)` threads; dynamic
/// shared memory: `layout::mma_backward_kv_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)` bytes.
///
/// # Safety
/// Pointers hold tensors of the shapes in `shape` (Q, dO, dQ as Q; K, V, dK, dV as K; LSE and D
/// `[batch, num_heads_q, seqlen_q]` `f32`), 16-byte aligned, `shape.head_dim == HEAD_DIM`;
/// outputs do not overlap inputs; `dq_accum` is zeroed before the launch (with `ATOMIC_DQ`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn flash_backward_kv_mma<
    T: HalfFloat,
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const STAGES: usize,
    const PADDED: bool,
    const D_STEPS: usize,
    const M_TILES: usize,
    const D_TILES: usize,
    const ATOMIC_DQ: bool,
>(
    x: BackwardTensors,
    dq_accum: *mut f32,
    dk: *mut u16,
    dv: *mut u16,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
) {
    // Two copies of the body: one for modified scores, one that runs exactly the code of the
    // plain path (`attention::score` says why).
    // SAFETY: the caller's contract.
    unsafe {
        if score.is_active() {
            backward_kv_body::<T, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PADDED, D_STEPS, M_TILES, D_TILES, ATOMIC_DQ, true>(
                x, dq_accum, dk, dv, shape, mask, score, scale,
            )
        } else {
            backward_kv_body::<T, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PADDED, D_STEPS, M_TILES, D_TILES, ATOMIC_DQ, false>(
                x, dq_accum, dk, dv, shape, mask, score, scale,
            )
        }
    }
}

/// [`flash_backward_kv_mma`]'s body, with (`MODS`) or without a score modification.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn backward_kv_body<
    T: HalfFloat,
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const STAGES: usize,
    const PADDED: bool,
    const D_STEPS: usize,
    const M_TILES: usize,
    const D_TILES: usize,
    const ATOMIC_DQ: bool,
    const MODS: bool,
>(
    x: BackwardTensors,
    dq_accum: *mut f32,
    dk: *mut u16,
    dv: *mut u16,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
) {
    const {
        assert!(BLOCK_N.is_multiple_of(MMA_WARP_ROWS) && BLOCK_M.is_multiple_of(16));
        assert!(D_STEPS * 16 == HEAD_DIM && M_TILES * 8 == BLOCK_M);
        assert!(D_TILES * 8 * mma_backward_column_warps(HEAD_DIM) == HEAD_DIM && D_TILES.is_multiple_of(2));
        assert!(STAGES >= 2);
    };
    let threads = const { mma_backward_threads(BLOCK_N, HEAD_DIM) };
    // The atomic dQ's pieces: 32 columns wide (three `ldmatrix.x4` for four products, where 16
    // columns take two for two) wherever the warps still get the same number of pieces each (an
    // uneven split leaves the last round to a few warps while the others wait at the barrier).
    let piece_cols = const {
        let warps = mma_backward_threads(BLOCK_N, HEAD_DIM) / 32;
        if HEAD_DIM.is_multiple_of(32) && ((BLOCK_M / 16) * (HEAD_DIM / 32)).is_multiple_of(warps) { 32 } else { 16 }
    };
    let scale_log2 = scale * LOG2_E;
    let keep_kv = const { keeps_kv_rows(HEAD_DIM) };
    let block = KeyBlock::current::<BLOCK_M, BLOCK_N>(&shape, &mask);
    let mask = mask.for_batch(block.batch);
    let (kv_start, kv_rows, batch) = (block.k_start, block.k_rows, block.batch);
    // First element of this key block in K, V, dK, dV.
    // Global rows are `d` elements long; the tiles are `HEAD_DIM` wide, zero past `d`.
    let d = row_length::<HEAD_DIM, PADDED>(&shape);
    let kv_offset = block.first_row_offset(&shape, d);
    let lane = FragmentLane::current();
    // The warp's first key in the block, and the first of its columns of dK and dV.
    let (warp_key, col0) = warp_slice::<HEAD_DIM>();

    let stride = HEAD_DIM + MMA_SMEM_PAD;
    let mut smem = SharedMemory::new();
    let k_tile = smem.tile16(BLOCK_N, stride);
    let v_tile = smem.tile16(BLOCK_N, stride);
    // Ring slot `i`: a Q tile at rows `2i·BLOCK_M`, a dO tile at `(2i + 1)·BLOCK_M`; and rows `2i`
    // (LSE) and `2i + 1` (D) of the statistics. Slots are computed, not kept in an array, which
    // would live in local memory.
    let qdo_ring = smem.tile16(2 * STAGES * BLOCK_M, stride);
    let ds_t_tile = smem.tile16(BLOCK_N, BLOCK_M + MMA_SMEM_PAD);
    let stats_ring = smem.tile(2 * STAGES, BLOCK_M);
    let slot = |i: usize| {
        let s = i % STAGES;
        (qdo_ring.rows_from(2 * s * BLOCK_M), qdo_ring.rows_from((2 * s + 1) * BLOCK_M), 2 * s)
    };

    // The work list: every query tile, of every query head of the group, that sees some key of
    // this block (tiles before `block.first_tile`, under a causal mask, and from
    // `block.end_tile` on, past a window's left edge, see none of them).
    let steps = block.steps();
    // (query head, first query) of step `i`.
    let step = |i: usize| {
        let (head, tile) = block.step(i);
        (head, tile * BLOCK_M)
    };
    // Starts the copies of step `i`'s Q, dO, LSE and D into its slot, as one cp.async group.
    let fetch = |i: usize| {
        if i < steps {
            let (head, q_start) = step(i);
            let q_rows = BLOCK_M.min(shape.seqlen_q - q_start);
            let rows = shape.q_head_offset(batch, head) / d + q_start; // in LSE and D
            let (q_tile, do_tile, stats_row) = slot(i);
            // SAFETY: rows q_start .. q_start + q_rows of this head exist.
            unsafe {
                q_tile.copy_rows_async(x.q.add(rows * d), BLOCK_M, HEAD_DIM, d, q_rows, threads);
                do_tile.copy_rows_async(x.d_o.add(rows * d), BLOCK_M, HEAD_DIM, d, q_rows, threads);
                stats_ring.copy_row_async(stats_row, x.lse.add(rows), BLOCK_M, q_rows, threads);
                stats_ring.copy_row_async(stats_row + 1, x.delta.add(rows), BLOCK_M, q_rows, threads);
            }
        }
        hw::cp_async_commit();
    };

    // K and V travel with step 0's group.
    // SAFETY: rows kv_start .. kv_start + kv_rows of this head exist.
    unsafe {
        k_tile.copy_rows_async(x.k.add(kv_offset), BLOCK_N, HEAD_DIM, d, kv_rows, threads);
        v_tile.copy_rows_async(x.v.add(kv_offset), BLOCK_N, HEAD_DIM, d, kv_rows, threads);
    }
    for i in 0..STAGES - 1 {
        fetch(i);
    }
    // The warp's rows of K and V, kept (`keeps_kv_rows`): they arrived with step 0's group,
    // which the first step waits for anyway.
    if keep_kv {
        hw::cp_async_wait(STAGES - 2);
        hw::sync_threads();
    }
    let (k_frags, v_frags) = (
        RowFragments::<D_STEPS>::new(k_tile, warp_key, keep_kv),
        RowFragments::<D_STEPS>::new(v_tile, warp_key, keep_kv),
    );

    let mut dk_acc = [[0.0f32; 4]; D_TILES];
    let mut dv_acc = [[0.0f32; 4]; D_TILES];
    for i in 0..steps {
        hw::cp_async_wait(STAGES - 2);
        hw::sync_threads();
        fetch(i + STAGES - 1);
        let (head, q_start) = step(i);
        let (q_tile, do_tile, stats_row) = slot(i);
        let factor = if MODS { 1.0 } else { scale_log2 };

        // Tiles where some query cannot see some key (the causal diagonal, a window's edges, the
        // ragged ends) pay for the per-element mask; it also zeroes padding queries and queries that see no key
        // (whose LSE is −∞, which would make P infinite).
        let masked = mask.tile_needs_mask(q_start, BLOCK_M, kv_start, BLOCK_N);
        // The tile's queries, 16 at a time: a chunk's Q and dO fragments serve Sᵀ and dPᵀ as B
        // operands, and, read again transposed, dK and dV.
        for chunk in 0..BLOCK_M / 16 {
            let q0 = 16 * chunk;
            // ANCHOR: transposed_scores
            // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the warp's 16 keys and these 16 queries.
            let (mut st, mut dpt) = ([[0.0f32; 4]; 2], [[0.0f32; 4]; 2]);
            for ks in 0..D_STEPS {
                let (k_frag, v_frag) = (k_frags.get(ks), v_frags.get(ks));
                let (q_frag, do_frag) = (q_tile.fragments_b(q0, 16 * ks), do_tile.fragments_b(q0, 16 * ks));
                for half in 0..2 {
                    st[half] = T::mma(k_frag, q_frag[half], st[half]);
                    dpt[half] = T::mma(v_frag, do_frag[half], dpt[half]);
                }
            }
            // Pᵀ = 2^(Sᵀ·scale·log₂e − LSE·log₂e) and dSᵀ = Pᵀ ∘ (dPᵀ − D); the columns are queries.
            let (mut pt, mut ds_t) = ([[0.0f32; 4]; 2], [[0.0f32; 4]; 2]);
            // Entry (half, e) is key `warp_key + g + 8·(e / 2)`, query `q0 + 8·half + 2t + e % 2`.
            let query = |half: usize, e: usize| q0 + 8 * half + lane.col(e);
            // Rows are the warp's keys, columns the chunk's queries.
            let first = (kv_start + warp_key, q_start + q0);
            // (A head's `ScoreMod` is derived inside each branch that uses it: see `ScoreArgs`.)
            let head_score = || score.for_head(head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
            let bias = || score.bias_plane(batch, head, shape.seqlen_q, shape.seqlen_k);
            if MODS {
                head_score().apply_fragments::<2, true>(&mut st, lane, first, scale_log2);
                if score.has_bias() {
                    // SAFETY: the host checked the bias's shape.
                    unsafe { bias().add_to_fragments::<2, true>(&mut st, lane, first) };
                }
            }
            for half in 0..2 {
                for e in 0..4 {
                    let lse2 = stats_ring.load(stats_row, query(half, e)) * LOG2_E;
                    pt[half][e] = hw::exp2(hw::fma(st[half][e], factor, -lse2));
                }
            }
            if MODS && score.has_bias() {
                zero_hidden(&mut pt, &st);
            }
            if masked {
                mask_fragments::<2, true>(&mut pt, lane, 0.0, first, &mask);
            }
            if MODS && score.is_softcapped() {
                head_score()
                    .chain_rule_fragments(&st, &mut dpt, |half, e| stats_ring.load(stats_row + 1, query(half, e)));
            }
            for half in 0..2 {
                for e in 0..4 {
                    ds_t[half][e] = pt[half][e] * (dpt[half][e] - stats_ring.load(stats_row + 1, query(half, e)));
                }
            }
            if MODS && score.has_bias() && col0 == 0 {
                // dBias = dSᵀ's entries (of a pair of warps that share the keys, the first's).
                // SAFETY: the host checked dBias's shape.
                unsafe { bias().accumulate_fragments::<2, true>(&ds_t, lane, first) };
            }
            // ANCHOR_END: transposed_scores
            // dV += Pᵀ·dO and dK += dSᵀ·Q (scaled at the end): A operands from registers, B
            // operands the chunk's Q and dO read again the other way round (`ldmatrix.trans`).
            let (p, ds) = (pack_a::<T>(pt[0], pt[1]), pack_a::<T>(ds_t[0], ds_t[1]));
            for step in 0..D_TILES / 2 {
                // dO and Q as B operands with the chunk's queries as the k index (the warp's
                // columns: all of them, or its half of a wide head).
                let col = col0 + 16 * step;
                let (do_b, q_b) = (do_tile.fragments_b_transposed(q0, col), q_tile.fragments_b_transposed(q0, col));
                for half in 0..2 {
                    dv_acc[2 * step + half] = T::mma(p, do_b[half], dv_acc[2 * step + half]);
                    dk_acc[2 * step + half] = T::mma(ds, q_b[half], dk_acc[2 * step + half]);
                }
            }
            if ATOMIC_DQ && col0 == 0 {
                // dQ needs every key of the block: publish the warp's rows of dSᵀ (of a pair of
                // warps that share the keys, the first: their dSᵀ is the same).
                for half in 0..2 {
                    for r in 0..2 {
                        let value = T::pack(ds_t[half][2 * r], ds_t[half][2 * r + 1]);
                        ds_t_tile.store2(warp_key + lane.half_row(r), q0 + 8 * half + lane.pair_col(), value);
                    }
                }
            }
        }

        if ATOMIC_DQ {
            // dQ += scale · dS·K: the warps share the BLOCK_M × HEAD_DIM product out in pieces
            // of 16 queries by `piece_cols` columns, each summed over all the block's keys.
            hw::sync_threads();
            let q_rows = BLOCK_M.min(shape.seqlen_q - q_start);
            let dq_rows = shape.q_head_offset(batch, head) + q_start * d;
            let pieces = (BLOCK_M / 16) * (HEAD_DIM / piece_cols);
            let mut piece = hw::warp_id();
            while piece < pieces {
                let (m0, n0) = (16 * (piece / (HEAD_DIM / piece_cols)), piece_cols * (piece % (HEAD_DIM / piece_cols)));
                // Two 16-column halves of accumulators; a 16-column piece uses the first.
                let mut dq = [[[0.0f32; 4]; 2]; 2];
                for kk in 0..BLOCK_N / 16 {
                    // One dS fragment serves every 16 columns of the piece.
                    let ds = ds_t_tile.fragment_a_transposed(16 * kk, m0);
                    for j in 0..piece_cols / 16 {
                        let [k0, k1] = k_tile.fragments_b_transposed(16 * kk, n0 + 16 * j);
                        dq[j][0] = T::mma(ds, k0, dq[j][0]);
                        dq[j][1] = T::mma(ds, k1, dq[j][1]);
                    }
                }
                for eighth in 0..piece_cols / 8 {
                    let frag = dq[eighth / 2][eighth % 2];
                    for e in 0..4 {
                        let (row, col) = lane.place((m0, n0), eighth, e);
                        // (An exact instance's columns are all real: no test.)
                        if row < q_rows && (!PADDED || col < d) {
                            // SAFETY: the query row and column exist.
                            unsafe { hw::atomic_add(dq_accum.add(dq_rows + row * d + col), frag[e] * scale) };
                        }
                    }
                }
                piece += threads / hw::WARP_SIZE;
            }
        }
    }

    // Every warp is done reading K and V (dQ reads all their rows): the warps can stage their
    // own rows (and columns) of dK and dV there. A block that no query tile sees (`steps` is 0)
    // and keeps no K and V fragments (above head_dim 64) never waited for the copies of K and V,
    // which would land on the staged rows: wait for every copy group first (the others are empty
    // by now, so this costs nothing).
    hw::cp_async_wait(0);
    hw::sync_threads();
    let cols = warp_columns::<HEAD_DIM>(col0, d);
    // SAFETY: rows kv_start .. kv_start + kv_rows of dK and dV exist.
    unsafe {
        let (dk_rows, dv_rows) = (dk.add(kv_offset), dv.add(kv_offset));
        store_warp_rows::<T, D_TILES, 1>(
            &[dk_acc],
            [[scale; 2]],
            k_tile,
            (warp_key, col0),
            dk_rows,
            (0, d),
            (kv_rows, cols),
            lane,
        );
        hw::sync_warp();
        store_warp_rows::<T, D_TILES, 1>(
            &[dv_acc],
            [[1.0; 2]],
            v_tile,
            (warp_key, col0),
            dv_rows,
            (0, d),
            (kv_rows, cols),
            lane,
        );
    }
}

/// The deterministic dQ kernel body: `BLOCK_M` queries of one query head, looping over key tiles
/// like the forward pass (K/V ring of `STAGES` slots, hidden tiles skipped), `8 · CHUNK_TILES`
/// keys at a time ([`dq_chunk_tiles`]); `D_TILES` the warp's columns of dQ, as in
/// [`flash_backward_kv_mma`].
///
/// Grid: `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`; block:
/// `layout::mma_backward_threads(BLOCK_M, HEAD_DIM)` threads; dynamic
/// shared memory: `layout::mma_backward_dq_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)` bytes.
///
/// # Safety
/// As [`flash_backward_kv_mma`]; only `dq` (Q's shape, 16-bit) is written.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn flash_backward_q_mma<
    T: HalfFloat,
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const STAGES: usize,
    const PADDED: bool,
    const D_STEPS: usize,
    const CHUNK_TILES: usize,
    const D_TILES: usize,
>(
    x: BackwardTensors,
    dq: *mut u16,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
) {
    // Two copies of the body: one for modified scores, one that runs exactly the code of the
    // plain path (`attention::score` says why).
    // SAFETY: the caller's contract.
    unsafe {
        if score.is_active() {
            backward_q_body::<T, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PADDED, D_STEPS, CHUNK_TILES, D_TILES, true>(
                x, dq, shape, mask, score, scale,
            )
        } else {
            backward_q_body::<T, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PADDED, D_STEPS, CHUNK_TILES, D_TILES, false>(
                x, dq, shape, mask, score, scale,
            )
        }
    }
}

/// [`flash_backward_q_mma`]'s body, with (`MODS`) or without a score modification.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn backward_q_body<
    T: HalfFloat,
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const STAGES: usize,
    const PADDED: bool,
    const D_STEPS: usize,
    const CHUNK_TILES: usize,
    const D_TILES: usize,
    const MODS: bool,
>(
    x: BackwardTensors,
    dq: *mut u16,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
) {
    const {
        assert!(BLOCK_M.is_multiple_of(MMA_WARP_ROWS) && BLOCK_N.is_multiple_of(8 * CHUNK_TILES));
        assert!(D_STEPS * 16 == HEAD_DIM && CHUNK_TILES == dq_chunk_tiles(HEAD_DIM) && CHUNK_TILES.is_multiple_of(2));
        assert!(D_TILES * 8 * mma_backward_column_warps(HEAD_DIM) == HEAD_DIM && D_TILES.is_multiple_of(2));
        assert!(STAGES >= 2);
    };
    let threads = const { mma_backward_threads(BLOCK_M, HEAD_DIM) };
    let scale_log2 = scale * LOG2_E;
    let block = QueryBlock::current::<BLOCK_M>(&shape);
    let mask = mask.for_batch(block.batch);
    let (q_start, q_rows) = (block.q_start, block.q_rows);
    let factor = if MODS { 1.0 } else { scale_log2 };
    // Global rows are `d` elements long; the tiles are `HEAD_DIM` wide, zero past `d`.
    let d = row_length::<HEAD_DIM, PADDED>(&shape);
    let first_row = block.first_row_offset(d);
    let lane = FragmentLane::current();
    // The warp's first query in the block, and the first of its columns of dQ.
    let (warp_row, col0) = warp_slice::<HEAD_DIM>();
    // A wide head's Q and dO fragments (head_dim / 2 registers a thread for both) do not fit next
    // to dQ's: they are read from shared memory at every use instead.
    let keep_q = const { mma_backward_column_warps(HEAD_DIM) == 1 };

    let stride = HEAD_DIM + MMA_SMEM_PAD;
    let mut smem = SharedMemory::new();
    let q_tile = smem.tile16(BLOCK_M, stride);
    let do_tile = smem.tile16(BLOCK_M, stride);
    let kv_ring = smem.tile16(2 * STAGES * BLOCK_N, stride); // a K/V ring, as in the forward pass

    let keys = mask.keys_for(q_start, q_rows);
    let kv_tiles = keys.tiles(BLOCK_N);
    // A block with padding rows (past seqlen_q) masks every tile: their LSE is 0 or −∞.
    let padded = q_start + BLOCK_M > shape.seqlen_q;
    // SAFETY: the host sized the grid, so this head exists.
    let kv_heads = unsafe { (x.k.add(block.kv_offset), x.v.add(block.kv_offset)) };
    let tiles = (keys.first_tile(BLOCK_N), kv_tiles);
    let ring = KvRing::<BLOCK_N, HEAD_DIM, STAGES>::new(kv_ring, kv_heads, (shape.seqlen_k, d), tiles, threads);

    // SAFETY: rows q_start .. q_start + q_rows of this head exist.
    unsafe {
        q_tile.copy_rows_async(x.q.add(first_row), BLOCK_M, HEAD_DIM, d, q_rows, threads);
        do_tile.copy_rows_async(x.d_o.add(first_row), BLOCK_M, HEAD_DIM, d, q_rows, threads);
    }
    ring.prime();
    // This lane's two rows' LSE (base 2) and D; padding rows get 0 (they are masked).
    let (mut lse2, mut delta) = ([0.0f32; 2], [0.0f32; 2]);
    for r in 0..2 {
        let row = warp_row + lane.half_row(r);
        if row < q_rows {
            let at = first_row / d + row;
            // SAFETY: the row exists.
            unsafe { (lse2[r], delta[r]) = (*x.lse.add(at) * LOG2_E, *x.delta.add(at)) };
        }
    }
    hw::cp_async_wait(STAGES - 2);
    hw::sync_threads();
    let (q_frags, do_frags) = (
        RowFragments::<D_STEPS>::new(q_tile, warp_row, keep_q),
        RowFragments::<D_STEPS>::new(do_tile, warp_row, keep_q),
    );

    let mut acc = [[0.0f32; 4]; D_TILES];
    for tile in 0..kv_tiles {
        let (k_tile, v_tile) = ring.advance(tile);
        let kv_start = keys.tile_start(tile, BLOCK_N);

        // Masked as in the forward pass, and wherever the block has padding rows: a hidden or
        // padding entry gets P = 0.
        let masked = padded || keys.needs_mask(kv_start, BLOCK_N);
        // The tile's keys, a chunk of `8 · CHUNK_TILES` at a time: a chunk's K fragments serve
        // S = Q·Kᵀ and, read again transposed, dQ += dS·K (as Q and dO in the K/V-outer kernel).
        for chunk in 0..BLOCK_N / (8 * CHUNK_TILES) {
            let k0 = 8 * CHUNK_TILES * chunk;
            // Fragment `j` of s, dp, ds: keys `k0 + 8j .. k0 + 8j + 8`.
            let (mut s, mut dp) = ([[0.0f32; 4]; CHUNK_TILES], [[0.0f32; 4]; CHUNK_TILES]);
            for ks in 0..D_STEPS {
                let (q_a, do_a) = (q_frags.get(ks), do_frags.get(ks));
                for sixteen in 0..CHUNK_TILES / 2 {
                    let k_frag = k_tile.fragments_b(k0 + 16 * sixteen, 16 * ks);
                    let v_frag = v_tile.fragments_b(k0 + 16 * sixteen, 16 * ks);
                    for half in 0..2 {
                        let j = 2 * sixteen + half;
                        s[j] = T::mma(q_a, k_frag[half], s[j]);
                        dp[j] = T::mma(do_a, v_frag[half], dp[j]);
                    }
                }
            }
            // dS = P ∘ (dP − D), P recomputed from the LSE.
            let first = (q_start + warp_row, kv_start + k0);
            let head_score = || score.for_head(block.head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
            if MODS {
                head_score().apply_fragments::<CHUNK_TILES, false>(&mut s, lane, first, scale_log2);
                if score.has_bias() {
                    let bias = score.bias_plane(block.batch, block.head, shape.seqlen_q, shape.seqlen_k);
                    // SAFETY: the host checked the bias's shape.
                    unsafe { bias.add_to_fragments::<CHUNK_TILES, false>(&mut s, lane, first) };
                }
            }
            let mut p = [[0.0f32; 4]; CHUNK_TILES];
            for j in 0..CHUNK_TILES {
                for e in 0..4 {
                    p[j][e] = hw::exp2(hw::fma(s[j][e], factor, -lse2[e / 2]));
                }
            }
            if MODS && score.has_bias() {
                zero_hidden(&mut p, &s);
            }
            if masked {
                mask_fragments::<CHUNK_TILES, false>(&mut p, lane, 0.0, first, &mask);
            }
            if MODS && score.is_softcapped() {
                head_score().chain_rule_fragments(&s, &mut dp, |_, e| delta[e / 2]);
            }
            let mut ds = [[0.0f32; 4]; CHUNK_TILES];
            for j in 0..CHUNK_TILES {
                for e in 0..4 {
                    ds[j][e] = p[j][e] * (dp[j][e] - delta[e / 2]);
                }
            }
            // dQ += dS·K (scaled at the end), dS straight from registers: one A fragment per 16
            // keys, K's rows read again transposed.
            for sixteen in 0..CHUNK_TILES / 2 {
                let a = pack_a::<T>(ds[2 * sixteen], ds[2 * sixteen + 1]);
                for step in 0..D_TILES / 2 {
                    let k = k_tile.fragments_b_transposed(k0 + 16 * sixteen, col0 + 16 * step);
                    for half in 0..2 {
                        acc[2 * step + half] = T::mma(a, k[half], acc[2 * step + half]);
                    }
                }
            }
        }
    }

    // The warp's own rows of the Q tile are free (only it read them, or only it and its partner
    // of a wide head): stage dQ there, once every lane (of both) is past its last read.
    if keep_q {
        hw::sync_warp();
    } else {
        hw::sync_threads();
    }
    // SAFETY: rows q_start .. q_start + q_rows of dQ exist.
    unsafe {
        let dst = dq.add(first_row);
        let (rows, valid) = ((warp_row, col0), (q_rows, warp_columns::<HEAD_DIM>(col0, d)));
        store_warp_rows::<T, D_TILES, 1>(&[acc], [[scale; 2]], q_tile, rows, dst, (0, d), valid, lane);
    }
}

/// The fragments of one warp's columns of the backward's accumulators at `head_dim` (8 columns
/// each): all of them, or half above head_dim 128 ([`warp_slice`]).
const fn column_tiles(head_dim: usize) -> usize {
    mma_backward_warp_columns(head_dim) / 8
}

/// The deterministic dQ kernel's chunk at `head_dim`, in fragments of 8 keys: 32 keys up to
/// head_dim 64, 16 above. Two 16-key halves in flight make independent chains of products, so
/// each half's products and exponentials fill the other's waits for results (the kernel was
/// latency-bound). At head_dim 128 the whole backward measured 2 % slower with 32 keys than with
/// 16 (ptxas gave the kernel 246 of 255 registers there; not profiled), while head_dim 64
/// gained (PERFORMANCE.md, 2026-12-04 (later)); above 128 ptxas spilled. Head_dim 96 follows 128
/// unmeasured.
const fn dq_chunk_tiles(head_dim: usize) -> usize {
    if head_dim <= 64 { 4 } else { 2 }
}

/// Three entries per tile and format: `flash_bwd_{dtype}_…` (dK, dV, atomic dQ),
/// `flash_bwd_dkdv_{dtype}_…` and `flash_bwd_dq_{dtype}_…` (the deterministic pair), each
/// suffixed `_m{block_m}_n{block_n}_d{head_dim}_s{stages}`, and `_padded` after that for the
/// padded instances (`layout::row_length`). They share their inputs and problem
/// arguments and differ in their outputs (`@entry`).
macro_rules! flash_backward_mma_instance {
    ($dtype:ident, $format:ident, $m:literal, $n:literal, $d:literal, $s:literal) => {
        pastey::paste! {
            flash_backward_mma_instance!(@kernels $format, $m, $n, $d, $s, false,
                [<flash_bwd_ $dtype _m $m _n $n _d $d _s $s>],
                [<flash_bwd_dkdv_ $dtype _m $m _n $n _d $d _s $s>],
                [<flash_bwd_dq_ $dtype _m $m _n $n _d $d _s $s>]);
        }
    };
    ($dtype:ident, $format:ident, $m:literal, $n:literal, $d:literal, $s:literal, padded) => {
        pastey::paste! {
            flash_backward_mma_instance!(@kernels $format, $m, $n, $d, $s, true,
                [<flash_bwd_ $dtype _m $m _n $n _d $d _s $s _padded>],
                [<flash_bwd_dkdv_ $dtype _m $m _n $n _d $d _s $s _padded>],
                [<flash_bwd_dq_ $dtype _m $m _n $n _d $d _s $s _padded>]);
        }
    };
    (@kernels $format:ident, $m:literal, $n:literal, $d:literal, $s:literal, $padded:literal,
        $atomic:ident, $dkdv:ident, $dq:ident) => {
        flash_backward_mma_instance!(@entry
            /// dK, dV and the `f32` accumulator of dQ (atomic adds) on tensor cores; see the
            /// module docs and `flash_backward_kv_mma`.
            $atomic,
            [dq_accum: *mut f32, dk: *mut u16, dv: *mut u16],
            |x, shape, mask, score, scale| flash_backward_kv_mma::<
                hw::$format, $m, $n, $d, $s, $padded, { $d / 16 }, { $m / 8 }, { column_tiles($d) }, true
            >(x, dq_accum, dk, dv, shape, mask, score, scale)
        );
        flash_backward_mma_instance!(@entry
            /// dK and dV on tensor cores, without dQ (the deterministic backward's first kernel);
            /// see the module docs and `flash_backward_kv_mma`.
            $dkdv,
            [dk: *mut u16, dv: *mut u16],
            |x, shape, mask, score, scale| flash_backward_kv_mma::<
                hw::$format, $m, $n, $d, $s, $padded, { $d / 16 }, { $m / 8 }, { column_tiles($d) }, false
            >(x, core::ptr::null_mut(), dk, dv, shape, mask, score, scale)
        );
        flash_backward_mma_instance!(@entry
            /// The deterministic dQ on tensor cores; see the module docs and
            /// `flash_backward_q_mma`.
            $dq,
            [dq: *mut u16],
            |x, shape, mask, score, scale| flash_backward_q_mma::<
                hw::$format, $m, $n, $d, $s, $padded, { $d / 16 }, { dq_chunk_tiles($d) }, { column_tiles($d) }
            >(x, dq, shape, mask, score, scale)
        );
    };
    (@entry $(#[$attr:meta])* $name:ident, [$($out:ident: $out_ty:ty),*],
        |$x:ident, $shape:ident, $mask:ident, $score:ident, $scale:ident| $body:expr) => {
        attention_kernel! {
        $(#[$attr])*
        ///
        /// # Safety
        /// As the body it calls (`flash_backward_kv_mma` or `flash_backward_q_mma`).
        fn $name(
            q: *const u16,
            k: *const u16,
            v: *const u16,
            d_o: *const u16,
            lse: *const f32,
            delta: *const f32,
            $($out: $out_ty,)*
        ) table twin |$shape, $mask, $score, $scale, TABLE| {
            let $x = BackwardTensors { q, k, v, d_o, lse, delta };
            unsafe { $body }
        }
        }
    };
}

sm80_backward_tiles!(flash_backward_mma_instance);
sm80_padded_backward_tiles!(flash_backward_mma_instance);
