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
//! With a causal mask ([`Mask`]) a block stops at the last key its last query row may see, and
//! only the tiles that cross some row's limit (the diagonal, and the ragged end of the keys) are
//! masked element by element: fully visible tiles skip that work, fully hidden ones are never
//! loaded. A row that sees no key at all ends with O = 0 and LSE = −∞.
//!
//! Scores are multiplied by `scale · log₂e` as they are computed, so that the kernel can use the
//! hardware's `exp2` throughout; `m` is kept in those base-2 units.
//!
//! ## Thread mapping (block of 128 threads = 16 row groups × 8 lanes; see [`crate::simt::tile`])
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

use crate::attention::epilogue::{store_row_values, store_rows};
use crate::attention::mask::Mask;
use crate::attention::schedule::QueryBlock;
use crate::attention::score::ScoreArgs;
use crate::attention::softmax::OnlineSoftmax;
use crate::hw::{self, F32x4, SharedMemory};
use crate::layout::{
    AttentionShape, FLASH_THREAD_COLS as LANES, FLASH_THREAD_ROWS, FLASH_THREADS, flash_forward_strides,
};
use crate::simt::tile::{a_bt, accumulate_ab, fits_thread_grid, map_tile, mask_tile, refill_tiles, store_tile};

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
pub(crate) unsafe fn flash_forward<
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
    mask: Mask,
    score: ScoreArgs,
    scale_log2: f32,
) {
    const { assert!(fits_thread_grid((BLOCK_M, ROWS), (BLOCK_N, COLS), (HEAD_DIM, DVEC))) };
    let block = QueryBlock::current::<BLOCK_M>(&shape);
    let mask = mask.for_batch(block.batch);
    let (q_start, q_rows) = (block.q_start, block.q_rows);
    // This block's head in each tensor. O has Q's layout; LSE has one float per query row.
    // SAFETY: the host sized the grid, so these heads exist.
    let (q_head, k_head, v_head, o_head, lse_head) = unsafe {
        let (q_offset, kv_offset) = (block.q_offset, block.kv_offset);
        (q.add(q_offset), k.add(kv_offset), v.add(kv_offset), o.add(q_offset), lse.add(q_offset / shape.head_dim))
    };

    let (row_group, lane) = (hw::thread_idx_x() / LANES, hw::thread_idx_x() % LANES);
    let first_row = row_group * ROWS;

    let [q_stride, k_stride, v_stride, p_stride] = flash_forward_strides(BLOCK_N, HEAD_DIM);
    let mut smem = SharedMemory::new();
    let q_tile = smem.tile(BLOCK_M, q_stride);
    let k_tile = smem.tile(BLOCK_N, k_stride);
    let v_tile = smem.tile(BLOCK_N, v_stride);
    let p_tile = smem.tile(BLOCK_M, p_stride);

    // Global rows are `d` floats long; the tiles are `HEAD_DIM` wide, zero past `d`.
    let d = shape.head_dim;
    // SAFETY: rows q_start .. q_start + q_rows of this head exist.
    unsafe { q_tile.copy_rows_from::<FLASH_THREADS>(q_head.add(q_start * d), BLOCK_M, HEAD_DIM, d, q_rows) };

    let mut softmax = OnlineSoftmax::<ROWS>::new();
    let mut acc = [[F32x4::ZERO; DVEC]; ROWS];

    // ANCHOR: main_loop
    // Keys before the first tile of `keys.begin` or past `keys.end` are hidden from every row
    // (never loaded).
    let keys = mask.keys_for(q_start, q_rows);
    for kv_start in (keys.tile_start(0, BLOCK_N)..keys.end).step_by(BLOCK_N) {
        // Rows past the end of the sequence are zero-filled: their scores are masked to −∞
        // below, and a zero V row keeps 0 · (uninitialised shared memory, possibly NaN) out.
        // The first barrier inside also publishes Q on the first trip.
        // SAFETY: rows kv_start .. kv_start + kv_rows of this head exist.
        unsafe {
            let (k_rows, v_rows) = (k_head.add(kv_start * d), v_head.add(kv_start * d));
            refill_tiles::<BLOCK_N, HEAD_DIM>(
                k_tile,
                k_rows,
                v_tile,
                v_rows,
                d,
                BLOCK_N.min(shape.seqlen_k - kv_start),
            );
        }

        let mut s = a_bt::<HEAD_DIM, ROWS, COLS>(q_tile, k_tile, first_row, lane).map(|r| r.map(|x| x * scale_log2));
        // Softcap, ALiBi or a bias, if the problem has one (`attention::score`): the scores are base-2
        // logits already, which is what `ScoreMod::logit` takes.
        if score.is_active() {
            let head_score = score.for_head(block.head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
            let bias = score.bias_plane(block.batch, block.head, shape.seqlen_q, shape.seqlen_k);
            // SAFETY: the host checked the bias's shape (`BiasPlane::logit`).
            map_tile(&mut s, first_row, lane, |r, c, y| {
                let (query, key) = (q_start + r, kv_start + c);
                head_score.logit(y, query, key) + unsafe { bias.logit(query, key) }
            });
        }
        // Only tiles that cross some row's key limit or start (the causal diagonal, a window's
        // edges, the ragged end of the keys) pay for the per-element mask.
        let masked = keys.needs_mask(kv_start, BLOCK_N);
        if masked {
            mask_tile(&mut s, first_row, lane, f32::NEG_INFINITY, kv_start, |r| mask.keys_seen_by(q_start + r));
        }
        let alpha = softmax.update(&mut s);
        for i in 0..ROWS {
            acc[i] = acc[i].map(|x| x.scale(alpha[i]));
        }

        // Each lane holds only every 8th probability of its rows, but needs all of them for
        // P V: exchange them through shared memory. The 8 lanes of a row group are in one
        // warp, so a warp barrier is enough.
        store_tile(p_tile, &s, first_row, lane);
        hw::sync_warp();
        // On masked tiles a hidden key's V row must not reach the rows it is hidden from, even
        // as 0 · NaN: skip the zero probabilities there.
        if masked {
            accumulate_ab::<BLOCK_N, ROWS, DVEC, true>(&mut acc, p_tile, v_tile, first_row, lane);
        } else {
            accumulate_ab::<BLOCK_N, ROWS, DVEC, false>(&mut acc, p_tile, v_tile, first_row, lane);
        }
    }
    // ANCHOR_END: main_loop

    // SAFETY: the host checked the sinks' length (`ScoreArgs::sink`).
    let (inv_sum, row_lse) = softmax.finish(unsafe { score.sink(block.head) });
    // SAFETY: rows q_start .. q_start + q_rows of O exist.
    unsafe { store_rows::<HEAD_DIM, ROWS, DVEC>(&acc, inv_sum, o_head.add(q_start * d), d, q_rows, first_row, lane) };
    // SAFETY: rows q_start .. q_start + q_rows of LSE exist.
    unsafe { store_row_values(row_lse, lse_head.add(q_start), q_rows, first_row, lane) };
}

/// One entry per tile, named `flash_fwd_f32_m{block_m}_n{block_n}_d{head_dim}`:
/// `pastey::paste!` glues the numbers into the name (`[<flash_fwd_f32_m $block_m …>]`), and
/// `simt_tiles!` (in [`crate::configs`], the one list of compiled `f32` tiles) calls this macro
/// once per tile.
macro_rules! flash_forward_instance {
    ($block_m:literal, $block_n:literal, $head_dim:literal) => {
        pastey::paste! {
            attention_kernel! {
            /// FlashAttention-2 forward, `f32`; see the module docs and `flash_forward`.
            ///
            /// # Safety
            /// As `flash_forward`.
            fn [<flash_fwd_f32_m $block_m _n $block_n _d $head_dim>](
                q: *const f32,
                k: *const f32,
                v: *const f32,
                o: *mut f32,
                lse: *mut f32,
            ) table twin |shape, mask, score, scale_log2, TABLE| {
                unsafe {
                    flash_forward::<
                        $block_m,
                        $block_n,
                        $head_dim,
                        { $block_m / FLASH_THREAD_ROWS },
                        { $block_n / LANES },
                        { $head_dim / (4 * LANES) },
                    >(q, k, v, o, lse, shape, mask, score, scale_log2)
                }
            }
            }
        }
    };
}

simt_tiles!(flash_forward_instance);
