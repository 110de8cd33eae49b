//! Level 3: FlashAttention-2 forward pass (Dao 2023, "FlashAttention-2", Algorithm 1), in `f32`.
//!
//! O = softmax(Q Kᵀ · scale) V without ever writing the `seqlen_q × seqlen_k` score matrix to
//! device memory. Each block owns `BLOCK_M` query rows (the paper's Br) of one head: it loads them
//! once, then streams the head's keys and values through shared memory `BLOCK_N` rows (Bc) at a
//! time. For each key tile it computes the scores S = Q Kᵀ for its rows, and folds them into a
//! running output with the *online softmax*: per row it keeps the largest score seen so far `m`
//! and the sum of exponentials `l` under that maximum; when a new tile raises the maximum, what
//! was accumulated is rescaled by `exp(m_old − m_new)`. After the last tile, O = acc / l and the
//! logsumexp LSE = m + ln l is saved for the backward pass. Device memory traffic is
//! O(seqlen · head_dim) per head instead of O(seqlen²).
//!
//! Scores are multiplied by `scale · log₂e` as they are computed, so that the kernel can use the
//! hardware's `exp2` throughout; `m` is kept in those base-2 units.
//!
//! ## Thread mapping (block of 128 threads = 16 row groups × 8 lanes)
//!
//! Thread `t` is lane `t % 8` of row group `t / 8`; a warp holds 4 row groups. With
//! `ROWS = BLOCK_M / 16`, `COLS = BLOCK_N / 8` and `DVEC = HEAD_DIM / 32`, a thread owns:
//!
//! * query rows `row_group · ROWS + i` for `i < ROWS` (a row group's rows are contiguous);
//! * of the scores of those rows, key columns `lane + 8 · j` for `j < COLS` (interleaved, so the
//!   8 lanes read 8 different K rows at once);
//! * of the output of those rows, columns `4 · lane + 32 · g … +4` for `g < DVEC` (the 8 lanes
//!   cover 32 contiguous columns, one 16-byte vector each).
//!
//! The running max and sum of a row are shared by its 8 lanes: maxima are combined with warp
//! shuffles every tile; sums stay per-lane partial sums until the end (the rescaling is the same
//! for every lane, so the partial sums can be added once, at the end).
//!
//! ## Shared memory (floats; see `layout::flash_forward_strides`)
//!
//! | tile | shape | row stride | written by | read by |
//! |---|---|---|---|---|
//! | Q | BLOCK_M × HEAD_DIM | HEAD_DIM + 4 | whole block, once | a row group, its rows |
//! | K | BLOCK_N × HEAD_DIM | HEAD_DIM + 4 | whole block, every tile | every thread, 8 rows at a time |
//! | V | BLOCK_N × HEAD_DIM | HEAD_DIM | whole block, every tile | every thread, one row at a time |
//! | P | BLOCK_M × BLOCK_N | BLOCK_N + 4 | a row group, its rows | the same row group |
//!
//! ## Legend
//!
//! `s[i][j]`: score (then probability) of this thread's row `i`, column `j`; `acc[i][g]`: the
//! unnormalised output of row `i`, columns `4·lane + 32·g … +4`; `alpha`: the rescaling factor
//! `2^(m_old − m_new)` of a row.

use crate::gpu::{self, F32x4, LN_2, SharedMemory, SharedTile};
use crate::layout::{
    AttentionShape, FLASH_THREAD_COLS as LANES, FLASH_THREAD_ROWS, FLASH_THREADS, flash_forward_strides,
};

/// Per-row state of the online softmax for the `ROWS` query rows of one thread.
struct OnlineSoftmax<const ROWS: usize> {
    /// Largest score seen so far (base-2 units), the same in every lane of the row group.
    max: [f32; ROWS],
    /// This lane's share of Σ 2^(s − max) over the columns it has seen.
    partial_sum: [f32; ROWS],
}

impl<const ROWS: usize> OnlineSoftmax<ROWS> {
    fn new() -> Self {
        Self { max: [f32::NEG_INFINITY; ROWS], partial_sum: [0.0; ROWS] }
    }

    /// Folds one tile of scores in: replaces each score by its unnormalised probability
    /// 2^(s − m_new) and returns, per row, the factor by which everything accumulated under the
    /// old maximum must be rescaled. Called by all lanes of the warp together (it shuffles).
    #[inline(always)]
    fn update<const COLS: usize>(&mut self, s: &mut [[f32; COLS]; ROWS]) -> [f32; ROWS] {
        let mut alpha = [0.0; ROWS];
        for i in 0..ROWS {
            let tile_max = gpu::group_max::<LANES>(s[i].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)));
            let new_max = self.max[i].max(tile_max);
            // A row that has only seen masked (−∞) scores has no maximum yet; measuring from 0
            // instead keeps 2^(−∞ − (−∞)) = NaN out: its probabilities and alpha are all 0.
            let base = if new_max == f32::NEG_INFINITY { 0.0 } else { new_max };
            alpha[i] = gpu::exp2(self.max[i] - base);
            let mut tile_sum = 0.0;
            for x in s[i].iter_mut() {
                *x = gpu::exp2(*x - base);
                tile_sum += *x;
            }
            self.partial_sum[i] = self.partial_sum[i] * alpha[i] + tile_sum;
            self.max[i] = new_max;
        }
        alpha
    }

    /// Ends the pass: per row, 1 / l (to normalise the output) and the natural logsumexp
    /// LSE = ln Σ_j e^(scale·s_j) = (m + log₂ l) · ln 2. A row that saw no key gets 1/l = 0 (so
    /// O = 0) and LSE = −∞. Called by all lanes of the warp together (it shuffles).
    #[inline(always)]
    fn finish(&self) -> ([f32; ROWS], [f32; ROWS]) {
        let (mut inv_sum, mut lse) = ([0.0; ROWS], [f32::NEG_INFINITY; ROWS]);
        for i in 0..ROWS {
            let sum = gpu::group_sum::<LANES>(self.partial_sum[i]);
            if sum > 0.0 {
                inv_sum[i] = 1.0 / sum;
                lse[i] = (self.max[i] + gpu::log2(sum)) * LN_2;
            }
        }
        (inv_sum, lse)
    }
}

/// Scores of this thread's `ROWS × COLS` entries of the tile, S = Q Kᵀ · scale_log2.
/// Reads 16 bytes of Q and of K at a time and does 4 multiply-adds per pair.
#[inline(always)]
fn tile_scores<const HEAD_DIM: usize, const ROWS: usize, const COLS: usize>(
    q_tile: SharedTile,
    k_tile: SharedTile,
    first_row: usize,
    lane: usize,
    scale_log2: f32,
) -> [[f32; COLS]; ROWS] {
    let mut s = [[0.0f32; COLS]; ROWS];
    for d in (0..HEAD_DIM).step_by(4) {
        let q: [F32x4; ROWS] = core::array::from_fn(|i| q_tile.load4(first_row + i, d));
        let k: [F32x4; COLS] = core::array::from_fn(|j| k_tile.load4(lane + LANES * j, d));
        for i in 0..ROWS {
            for j in 0..COLS {
                s[i][j] = q[i].dot_add(k[j], s[i][j]);
            }
        }
    }
    s.map(|row| row.map(|x| x * scale_log2))
}

/// Sets the scores of key columns at or past `valid_cols` (the ragged end of the last key tile)
/// to −∞, so they get probability exactly 0.
#[inline(always)]
fn mask_columns<const ROWS: usize, const COLS: usize>(s: &mut [[f32; COLS]; ROWS], lane: usize, valid_cols: usize) {
    for row in s.iter_mut() {
        for (j, x) in row.iter_mut().enumerate() {
            if lane + LANES * j >= valid_cols {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// acc += P V for this thread's rows and output columns, P read back from shared memory (a row
/// group reads only the rows it wrote), four key columns at a time.
#[inline(always)]
fn accumulate_pv<const BLOCK_N: usize, const ROWS: usize, const DVEC: usize>(
    acc: &mut [[F32x4; DVEC]; ROWS],
    p_tile: SharedTile,
    v_tile: SharedTile,
    first_row: usize,
    lane: usize,
) {
    for c in (0..BLOCK_N).step_by(4) {
        let p: [F32x4; ROWS] = core::array::from_fn(|i| p_tile.load4(first_row + i, c));
        // Four calls rather than a loop over 0..4: the index into each vector of `p` must be a
        // compile-time constant. When LLVM leaves such a loop rolled (it does at head_dim 128),
        // a run-time index moves `p` to local memory, which is slow.
        accumulate_key::<0, ROWS, DVEC>(acc, &p, v_tile, c, lane);
        accumulate_key::<1, ROWS, DVEC>(acc, &p, v_tile, c, lane);
        accumulate_key::<2, ROWS, DVEC>(acc, &p, v_tile, c, lane);
        accumulate_key::<3, ROWS, DVEC>(acc, &p, v_tile, c, lane);
    }
}

/// acc += p[:, K] · V[c + K, :]: one key's contribution to this thread's outputs.
#[inline(always)]
fn accumulate_key<const K: usize, const ROWS: usize, const DVEC: usize>(
    acc: &mut [[F32x4; DVEC]; ROWS],
    p: &[F32x4; ROWS],
    v_tile: SharedTile,
    c: usize,
    lane: usize,
) {
    let v: [F32x4; DVEC] = core::array::from_fn(|g| v_tile.load4(c + K, 4 * lane + 32 * g));
    for i in 0..ROWS {
        for g in 0..DVEC {
            acc[i][g] = acc[i][g].add_scaled(p[i].0[K], v[g]);
        }
    }
}

/// The kernel body shared by every instance. `ROWS`, `COLS` and `DVEC` are the per-thread tile
/// (see the module docs); they are derived from the block shape by the instance macro because
/// register arrays need their sizes as plain const parameters.
///
/// Grid: `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`; block: [`FLASH_THREADS`] threads;
/// dynamic shared memory: `layout::flash_forward_smem_bytes(BLOCK_M, BLOCK_N, HEAD_DIM)` bytes.
///
/// # Safety
/// Pointers hold tensors of the shapes in `shape` (see [`AttentionShape`]), 16-byte aligned, with
/// `shape.head_dim == HEAD_DIM`; `o` and `lse` (`[batch, num_heads_q, seqlen_q]`) do not overlap
/// the inputs; the launch has the grid, block and shared memory above.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn flash_forward<
    const BLOCK_M: usize,
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const ROWS: usize,
    const COLS: usize,
    const DVEC: usize,
>(
    q: *const f32,
    k: *const f32,
    v: *const f32,
    o: *mut f32,
    lse: *mut f32,
    shape: AttentionShape,
    scale_log2: f32,
) {
    const {
        assert!(BLOCK_M == FLASH_THREAD_ROWS * ROWS);
        assert!(BLOCK_N == LANES * COLS && BLOCK_N.is_multiple_of(4));
        assert!(HEAD_DIM == 4 * LANES * DVEC);
    };
    let (q_block, head, batch) = gpu::block_idx();
    let q_start = q_block * BLOCK_M;
    let q_rows = BLOCK_M.min(shape.seqlen_q - q_start);
    // This block's head in each tensor. O has Q's layout; LSE has one float per query row.
    let (q_offset, kv_offset) = (shape.q_head_offset(batch, head), shape.kv_head_offset(batch, head));
    // SAFETY: the host sized the grid, so these heads exist.
    let (q_head, k_head, v_head, o_head, lse_head) =
        unsafe { (q.add(q_offset), k.add(kv_offset), v.add(kv_offset), o.add(q_offset), lse.add(q_offset / HEAD_DIM)) };

    let (row_group, lane) = (gpu::thread_idx_x() / LANES, gpu::thread_idx_x() % LANES);
    let first_row = row_group * ROWS;

    let [q_stride, k_stride, v_stride, p_stride] = flash_forward_strides(BLOCK_N, HEAD_DIM);
    let mut smem = SharedMemory::new();
    let q_tile = smem.tile(BLOCK_M, q_stride);
    let k_tile = smem.tile(BLOCK_N, k_stride);
    let v_tile = smem.tile(BLOCK_N, v_stride);
    let p_tile = smem.tile(BLOCK_M, p_stride);

    // SAFETY: rows q_start .. q_start + q_rows of this head exist.
    unsafe { q_tile.copy_rows_from::<FLASH_THREADS>(q_head.add(q_start * HEAD_DIM), BLOCK_M, HEAD_DIM, q_rows) };

    let mut softmax = OnlineSoftmax::<ROWS>::new();
    let mut acc = [[F32x4::ZERO; DVEC]; ROWS];

    for kv_start in (0..shape.seqlen_k).step_by(BLOCK_N) {
        let kv_rows = BLOCK_N.min(shape.seqlen_k - kv_start);
        // Nobody may still be reading the previous tile's K, V or P when we overwrite them.
        gpu::sync_threads();
        // Rows past the end of the sequence are zero-filled: their scores are masked to −∞
        // below, and a zero V row keeps 0 · (uninitialised shared memory, possibly NaN) out.
        // SAFETY: rows kv_start .. kv_start + kv_rows of this head exist.
        unsafe {
            k_tile.copy_rows_from::<FLASH_THREADS>(k_head.add(kv_start * HEAD_DIM), BLOCK_N, HEAD_DIM, kv_rows);
            v_tile.copy_rows_from::<FLASH_THREADS>(v_head.add(kv_start * HEAD_DIM), BLOCK_N, HEAD_DIM, kv_rows);
        }
        // Q (on the first trip), K and V are complete and visible to every thread.
        gpu::sync_threads();

        let mut s = tile_scores::<HEAD_DIM, ROWS, COLS>(q_tile, k_tile, first_row, lane, scale_log2);
        mask_columns(&mut s, lane, kv_rows);
        let alpha = softmax.update(&mut s);
        for i in 0..ROWS {
            acc[i] = acc[i].map(|x| x.scale(alpha[i]));
        }

        // Each lane holds only every 8th probability of its rows, but needs all of them for
        // P V: exchange them through shared memory. The 8 lanes of a row group are in one
        // warp, so a warp barrier is enough.
        for i in 0..ROWS {
            for j in 0..COLS {
                p_tile.store(first_row + i, lane + LANES * j, s[i][j]);
            }
        }
        gpu::sync_warp();
        accumulate_pv::<BLOCK_N, ROWS, DVEC>(&mut acc, p_tile, v_tile, first_row, lane);
    }

    let (inv_sum, row_lse) = softmax.finish();
    for i in 0..ROWS {
        let row = first_row + i;
        if row < q_rows {
            for g in 0..DVEC {
                let out = acc[i][g].scale(inv_sum[i]);
                // SAFETY: row < q_rows and the columns are < HEAD_DIM.
                unsafe { out.store(o_head.add((q_start + row) * HEAD_DIM + 4 * lane + 32 * g)) };
            }
            if lane == 0 {
                // SAFETY: row < q_rows.
                unsafe { *lse_head.add(q_start + row) = row_lse[i] };
            }
        }
    }
}

/// Exports one `extern "gpu-kernel"` entry per `(block_m, block_n, head_dim)`, named
/// `flash_fwd_f32_m{block_m}_n{block_n}_d{head_dim}`, for every combination of the three lists.
macro_rules! flash_forward_instances {
    ([$($block_m:literal)*], $block_n:tt, $head_dim:tt) => {
        $( flash_forward_instances!(@m $block_m, $block_n, $head_dim); )*
    };
    (@m $block_m:literal, [$($block_n:literal)*], $head_dim:tt) => {
        $( flash_forward_instances!(@mn $block_m, $block_n, $head_dim); )*
    };
    (@mn $block_m:literal, $block_n:literal, [$($head_dim:literal)*]) => {$(
        /// FlashAttention-2 forward, `f32`; see the module docs and `flash_forward`.
        ///
        /// # Safety
        /// As `flash_forward`.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn ${concat(flash_fwd_f32_m, $block_m, _n, $block_n, _d, $head_dim)}(
            q: *const f32,
            k: *const f32,
            v: *const f32,
            o: *mut f32,
            lse: *mut f32,
            batch: usize,
            num_heads_q: usize,
            num_heads_kv: usize,
            seqlen_q: usize,
            seqlen_k: usize,
            head_dim: usize,
            scale_log2: f32,
        ) {
            let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
            unsafe {
                flash_forward::<
                    $block_m,
                    $block_n,
                    $head_dim,
                    { $block_m / FLASH_THREAD_ROWS },
                    { $block_n / LANES },
                    { $head_dim / (4 * LANES) },
                >(q, k, v, o, lse, shape, scale_log2)
            }
        }
    )*};
}

flash_forward_instances!([16 32 64], [16 32 64], [32 64 128]);
