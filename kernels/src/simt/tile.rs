//! The tile math of the `f32` FlashAttention kernels (levels 3 and 4): products of shared-memory
//! tiles computed by the 16 × 8 thread grid, and the stores of a thread's entries back to shared
//! memory. The epilogue's stores to global memory are in [`crate::attention::epilogue`].
//!
//! ## The thread grid
//!
//! Every `f32` FlashAttention block has 128 threads, seen as 16 *row groups* of 8 *lanes*
//! (`layout::FLASH_THREAD_ROWS × FLASH_THREAD_COLS`). A thread owns `ROWS` consecutive rows of a
//! tile, starting at `first_row = row_group · ROWS`. In a product tile it owns the columns
//! `lane + 8·j`, `j < COLS`: interleaved, so the 8 lanes of a row group read 8 different rows of
//! the right-hand operand at once. In a `… × head_dim` accumulator it owns the columns
//! `4·lane + 32·g … +4`, `g < DVEC`: the 8 lanes cover 32 contiguous columns, one 16-byte vector
//! each. A row group lies inside one warp, so rows a row group writes to shared memory and reads
//! back itself need only a warp barrier.
//!
//! The forward pass uses query rows as its rows; the K/V-outer backward kernel uses key rows.

use crate::hw::{self, F32x4, SharedTile};
use crate::layout::{FLASH_THREAD_COLS as LANES, FLASH_THREAD_ROWS, FLASH_THREADS};

/// Whether a kernel's tile fits the thread grid: `block_rows` rows as `rows` per thread over the
/// 16 row groups, `block_cols` product columns as `cols` per lane over the 8 lanes (a multiple
/// of 4: the products read 16 bytes at a time), and `head_dim` as `dvec` 4-float vectors per
/// lane. The kernels assert it at compile time for every instance.
pub const fn fits_thread_grid(
    (block_rows, rows): (usize, usize),
    (block_cols, cols): (usize, usize),
    (head_dim, dvec): (usize, usize),
) -> bool {
    block_rows == FLASH_THREAD_ROWS * rows
        && block_cols == LANES * cols
        && block_cols.is_multiple_of(4)
        && head_dim == 4 * LANES * dvec
}

/// Replaces the contents of two `ROWS × COLS` tiles with rows of `width ≤ COLS` floats from
/// global memory (rows past `valid_rows` and columns past `width` zero-filled), between the two block barriers every tile loop needs: the first
/// waits until no thread still reads the old contents, the second publishes the new ones.
///
/// # Safety
/// `a_src` and `b_src` point to `valid_rows · width` readable floats, 16-byte aligned when
/// `width` is a multiple of 4; every
/// thread of the block calls this together.
#[inline(always)]
pub unsafe fn refill_tiles<const ROWS: usize, const COLS: usize>(
    a: SharedTile,
    a_src: *const f32,
    b: SharedTile,
    b_src: *const f32,
    width: usize,
    valid_rows: usize,
) {
    hw::sync_threads();
    // SAFETY: the caller's contract.
    unsafe {
        a.copy_rows_from::<FLASH_THREADS>(a_src, ROWS, COLS, width, valid_rows);
        b.copy_rows_from::<FLASH_THREADS>(b_src, ROWS, COLS, width, valid_rows);
    }
    hw::sync_threads();
}

// ANCHOR: a_bt
/// This thread's entries of A Bᵀ: `out[i][j] = Σ_d A[first_row + i][d] · B[lane + 8j][d]` over
/// `d < K`. A and B are row-major tiles with strides that are multiples of 4; the loop reads 16
/// bytes of each per step and does 4 multiply-adds per pair.
#[inline(always)]
pub fn a_bt<const K: usize, const ROWS: usize, const COLS: usize>(
    a: SharedTile,
    b: SharedTile,
    first_row: usize,
    lane: usize,
) -> [[f32; COLS]; ROWS] {
    let mut out = [[0.0f32; COLS]; ROWS];
    for d in (0..K).step_by(4) {
        let a4: [F32x4; ROWS] = core::array::from_fn(|i| a.load4(first_row + i, d));
        let b4: [F32x4; COLS] = core::array::from_fn(|j| b.load4(lane + LANES * j, d));
        for i in 0..ROWS {
            for j in 0..COLS {
                out[i][j] = a4[i].dot_add(b4[j], out[i][j]);
            }
        }
    }
    out
}
// ANCHOR_END: a_bt

/// `acc[i][g] += Σ_c A[first_row + i][c] · B[c][4·lane + 32·g … +4]` over `c < K` (K a multiple
/// of 4): this thread's share of an A B product whose rows are its rows and whose columns are its
/// `head_dim` columns. A is read 16 bytes (4 values of c) at a time.
///
/// With `SKIP_ZEROS`, terms whose A entry is exactly 0 are skipped rather than multiplied: a
/// masked probability must not turn a NaN or ∞ in a row of B that its row cannot see into
/// 0 · NaN = NaN. Callers pass it on tiles that were masked; elsewhere the branch is not worth
/// its cost.
#[inline(always)]
pub fn accumulate_ab<const K: usize, const ROWS: usize, const DVEC: usize, const SKIP_ZEROS: bool>(
    acc: &mut [[F32x4; DVEC]; ROWS],
    a: SharedTile,
    b: SharedTile,
    first_row: usize,
    lane: usize,
) {
    for c in (0..K).step_by(4) {
        let a4: [F32x4; ROWS] = core::array::from_fn(|i| a.load4(first_row + i, c));
        // Four calls rather than a loop over 0..4: the index into each vector of `a4` must be a
        // compile-time constant. When LLVM leaves such a loop rolled (it does at head_dim 128),
        // a run-time index moves `a4` to local memory, which is slow.
        accumulate_b_row::<0, ROWS, DVEC, SKIP_ZEROS>(acc, &a4, b, c, lane);
        accumulate_b_row::<1, ROWS, DVEC, SKIP_ZEROS>(acc, &a4, b, c, lane);
        accumulate_b_row::<2, ROWS, DVEC, SKIP_ZEROS>(acc, &a4, b, c, lane);
        accumulate_b_row::<3, ROWS, DVEC, SKIP_ZEROS>(acc, &a4, b, c, lane);
    }
}

/// `acc[i][g] += a4[i][STEP] · B[c + STEP][4·lane + 32·g … +4]`: the contribution of row
/// `c + STEP` of B, `STEP` (0..4) being the position within the 4 values of each `a4[i]`.
#[inline(always)]
fn accumulate_b_row<const STEP: usize, const ROWS: usize, const DVEC: usize, const SKIP_ZEROS: bool>(
    acc: &mut [[F32x4; DVEC]; ROWS],
    a4: &[F32x4; ROWS],
    b: SharedTile,
    c: usize,
    lane: usize,
) {
    let b4: [F32x4; DVEC] = core::array::from_fn(|g| b.load4(c + STEP, 4 * lane + 32 * g));
    for i in 0..ROWS {
        if SKIP_ZEROS && a4[i].0[STEP] == 0.0 {
            continue;
        }
        for g in 0..DVEC {
            acc[i][g] = acc[i][g].add_scaled(a4[i].0[STEP], b4[g]);
        }
    }
}

/// Sets `x[i][j] = value` wherever column `first_col + lane + 8j` lies outside the band of
/// tile row `first_row + i`: `band(row)` gives the row's `(start, width)` in the same numbering
/// as `first_col` (the caller maps tile rows and columns to queries and keys:
/// `Mask::keys_seen_by`, or `Mask::queries_seeing` for a tile whose rows are keys). The band is
/// worked out once per row; an entry costs one subtraction and one comparison (a column left
/// of `start` wraps around to a huge offset).
#[inline(always)]
pub fn mask_tile<const ROWS: usize, const COLS: usize>(
    x: &mut [[f32; COLS]; ROWS],
    first_row: usize,
    lane: usize,
    value: f32,
    first_col: usize,
    band: impl Fn(usize) -> (usize, usize),
) {
    for i in 0..ROWS {
        let (start, width) = band(first_row + i);
        for j in 0..COLS {
            if (first_col + lane + LANES * j).wrapping_sub(start) >= width {
                x[i][j] = value;
            }
        }
    }
}

/// Replaces every entry by `f(tile row, tile column, entry)` (the same positions as
/// [`mask_tile`]): how a score modification ([`crate::attention::score`]) reaches this layout.
#[inline(always)]
pub fn map_tile<const ROWS: usize, const COLS: usize>(
    x: &mut [[f32; COLS]; ROWS],
    first_row: usize,
    lane: usize,
    f: impl Fn(usize, usize, f32) -> f32,
) {
    for i in 0..ROWS {
        for j in 0..COLS {
            x[i][j] = f(first_row + i, lane + LANES * j, x[i][j]);
        }
    }
}

/// Writes this thread's entries `x[i][j]` to `tile` at `(first_row + i, lane + 8j)`.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn store_tile<const ROWS: usize, const COLS: usize>(
    tile: SharedTile,
    x: &[[f32; COLS]; ROWS],
    first_row: usize,
    lane: usize,
) {
    for i in 0..ROWS {
        for j in 0..COLS {
            tile.store(first_row + i, lane + LANES * j, x[i][j]);
        }
    }
}

/// Writes this thread's entries `x[i][j]` to `tile` transposed, at `(lane + 8j, first_row + i)`.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn store_tile_transposed<const ROWS: usize, const COLS: usize>(
    tile: SharedTile,
    x: &[[f32; COLS]; ROWS],
    first_row: usize,
    lane: usize,
) {
    for i in 0..ROWS {
        for j in 0..COLS {
            tile.store(lane + LANES * j, first_row + i, x[i][j]);
        }
    }
}
