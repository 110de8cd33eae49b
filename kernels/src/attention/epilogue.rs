//! The epilogue of every kernel: a block's results (O and LSE; dK and dV; dQ) from registers to
//! device memory, written once per thread layout.
//!
//! | layout | rows of `HEAD_DIM` values | per-row values (LSE) |
//! |---|---|---|
//! | `f32` 16 × 8 thread grid (levels 3, 4) | [`store_rows`]: 16-byte stores of a thread's `4·lane + 32·g` columns | [`store_row_values`] |
//! | m16n8 fragments, staged (levels 5, 6) | [`store_warp_rows`]: rounded to 16 bits through a warp's rows of shared memory, then whole 16-byte chunks | [`store_fragment_lse`] |
//! | m16n8 fragments, direct (levels 8, 9) | [`store_fragment_pairs`]: one 4-byte store per pair | [`store_fragment_lse`] |
//!
//! Every store skips rows at or past the tile's valid rows, so a block's padding rows (the
//! ragged end of a sequence) never touch device memory.

use crate::attention::fragment::{FragmentLane, pack_row};
use crate::hw::{self, F32x4, FragC, HalfFloat, SharedTile16};
use crate::layout::MMA_WARP_ROWS;

/// Writes `scale · acc` (this thread's rows and columns of a `HEAD_DIM`-wide accumulator) to the
/// row-major global tensor rows starting at `dst`, whose rows are `width` floats long
/// (`width ≤ HEAD_DIM`: a padded head_dim's columns past `width` are not written), for the
/// tile-local rows below `valid_rows` only.
///
/// # Safety
/// `dst` points to at least `valid_rows` rows of `width` floats, 16-byte aligned when `width` is
/// a multiple of 4.
#[inline(always)]
pub unsafe fn store_rows<const HEAD_DIM: usize, const ROWS: usize, const DVEC: usize>(
    acc: &[[F32x4; DVEC]; ROWS],
    scale: [f32; ROWS],
    dst: *mut f32,
    width: usize,
    valid_rows: usize,
    first_row: usize,
    lane: usize,
) {
    for i in 0..ROWS {
        if first_row + i < valid_rows {
            for g in 0..DVEC {
                let col = 4 * lane + 32 * g;
                // SAFETY: the row is below valid_rows and every column written below width.
                unsafe { store4_clipped(acc[i][g].scale(scale[i]), dst.add((first_row + i) * width), col, width) };
            }
        }
    }
}

// ANCHOR: clipped_store
/// Writes `value` to columns `col..col + 4` of the global row at `row`, as one 16-byte store
/// when the row's `width` allows, else the columns below `width` one by one.
///
/// # Safety
/// `row` holds `width` floats, 16-byte aligned when `width` is a multiple of 4.
#[inline(always)]
unsafe fn store4_clipped(value: F32x4, row: *mut f32, col: usize, width: usize) {
    if col + 4 <= width && width.is_multiple_of(4) {
        // SAFETY: the four columns are inside the row, 16-byte aligned.
        unsafe { value.store(row.add(col)) };
    } else {
        for (e, x) in value.0.into_iter().enumerate() {
            if col + e < width {
                // SAFETY: the column is inside the row.
                unsafe { *row.add(col + e) = x };
            }
        }
    }
}
// ANCHOR_END: clipped_store

/// [`store4_clipped`] rounded to 16 bits (format `T`): the columns below `width` one element at
/// a time, so that `row` needs only 2-byte alignment (the decoder's rows of O lie at strides of
/// the caller's choosing).
///
/// # Safety
/// `row` holds `width` 16-bit elements.
#[inline(always)]
pub unsafe fn store4_half_clipped<T: HalfFloat>(value: F32x4, row: *mut u16, col: usize, width: usize) {
    let [a, b, c, d] = value.0;
    let pairs = [T::pack(a, b), T::pack(c, d)];
    for e in 0..4 {
        if col + e < width {
            let bits = (pairs[e / 2] >> (16 * (e % 2))) as u16;
            // SAFETY: the column is inside the row.
            unsafe { *row.add(col + e) = bits };
        }
    }
}

/// Writes per-row values of the `f32` thread grid (this thread's rows `first_row + i`, the
/// same in all 8 lanes of its row group) to `dst[first_row + i]`, from lane 0 only, for the
/// tile-local rows below `valid_rows`.
///
/// # Safety
/// `dst` points to at least `valid_rows` floats.
#[inline(always)]
pub unsafe fn store_row_values<const ROWS: usize>(
    values: [f32; ROWS],
    dst: *mut f32,
    valid_rows: usize,
    first_row: usize,
    lane: usize,
) {
    if lane == 0 {
        for i in 0..ROWS {
            if first_row + i < valid_rows {
                // SAFETY: the row is below valid_rows.
                unsafe { *dst.add(first_row + i) = values[i] };
            }
        }
    }
}

/// Writes a warp's `16 · M_TILES` rows of `8 · D_TILES` accumulated values (m-tile `r` is tile
/// rows `row0 + 16r ..`, fragment `dt` columns `col0 + 8dt ..`), times `scale[r][h]` per row,
/// rounded to 16 bits, to global memory: tile row `row` goes to row `dst_row0 + row` of `dst`,
/// whose rows are `width` elements long (a padded head_dim's columns past `width` are not
/// written); tile rows at or past `valid_rows` are skipped, and columns from `col0 + valid_cols`
/// on (`valid_cols` is `width` where the warp owns whole rows). The values go through `staging` (the
/// same rows and columns of a tile that no other warp reads any more: the caller's barrier makes
/// sure of it) so that global writes are whole 16-byte chunks (single elements when `width` is
/// not a multiple of 8, which leaves rows unaligned). `col0` is 0 where the warp owns whole rows,
/// and a multiple of 8 where warps share them (the wide backward's column halves).
///
/// # Safety
/// `dst` holds rows `dst_row0 .. dst_row0 + valid_rows` of `width` elements, 16-byte aligned
/// when `width` is a multiple of 8; all lanes of the warp call it together, after a barrier
/// past every read of those staging rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn store_warp_rows<T: HalfFloat, const D_TILES: usize, const M_TILES: usize>(
    acc: &[[FragC; D_TILES]; M_TILES],
    scale: [[f32; 2]; M_TILES],
    staging: SharedTile16,
    (row0, col0): (usize, usize),
    dst: *mut u16,
    (dst_row0, width): (usize, usize),
    (valid_rows, valid_cols): (usize, usize),
    lane: FragmentLane,
) {
    for r in 0..M_TILES {
        let s = scale[r];
        // `pack_row` written out, with the scale read once per m-tile: the form that keeps the
        // tensor-core forward's registers as they were (PERFORMANCE.md, issue 19).
        for (dt, frag) in acc[r].iter().enumerate() {
            for h in 0..2 {
                let value = T::pack(frag[2 * h] * s[h], frag[2 * h + 1] * s[h]);
                staging.store2(row0 + 16 * r + lane.g + 8 * h, col0 + 8 * dt + 2 * lane.t, value);
            }
        }
    }
    hw::sync_warp();
    let rows = MMA_WARP_ROWS * M_TILES;
    if width.is_multiple_of(8) {
        let chunks = D_TILES;
        let mut chunk = hw::lane_id();
        while chunk < rows * chunks {
            let (row, col) = (row0 + chunk / chunks, col0 + (chunk % chunks) * 8);
            if row < valid_rows && col < width {
                // SAFETY: row < valid_rows, col + 8 ≤ width.
                unsafe { hw::store16(dst.add((dst_row0 + row) * width + col), staging.load8(row, col)) };
            }
            chunk += hw::WARP_SIZE;
        }
    } else {
        let mut element = hw::lane_id();
        while element < rows * valid_cols {
            let (row, col) = (row0 + element / valid_cols, col0 + element % valid_cols);
            if row < valid_rows {
                // SAFETY: row < valid_rows, col < width.
                unsafe { *dst.add((dst_row0 + row) * width + col) = staging.load1(row, col) };
            }
            element += hw::WARP_SIZE;
        }
    }
}

/// Writes a warp's 16 rows of accumulated values straight from its fragments, times
/// `scale[h]` per row half, rounded to 16 bits: lane `(g, t)` stores the pair of columns
/// `8dt + 2t` of rows `row0 + g` and `row0 + g + 8` of `dst`, whose rows are `width ≤ HEAD_DIM`
/// elements long (columns past `width`, a padded head_dim's, are not written); rows at or past
/// `valid_rows` are skipped.
///
/// # Safety
/// `dst` holds `valid_rows` rows of `width` 16-bit values, 4-byte aligned.
#[inline(always)]
pub unsafe fn store_fragment_pairs<T: HalfFloat, const HEAD_DIM: usize, const D_TILES: usize>(
    frags: &[FragC; D_TILES],
    scale: [f32; 2],
    dst: *mut u16,
    width: usize,
    row0: usize,
    valid_rows: usize,
    lane: FragmentLane,
) {
    let store = |dt: usize| {
        let col = 8 * dt + lane.pair_col();
        for h in 0..2 {
            let row = row0 + lane.half_row(h);
            if row < valid_rows && col < width {
                let pair = pack_row::<T>(frags[dt], h, scale[h]);
                // SAFETY: row < valid_rows and col < width; an even width keeps the pair inside
                // the row and 4-byte aligned, an odd one is written element by element.
                unsafe {
                    let at = dst.add(row * width + col);
                    if width.is_multiple_of(2) {
                        *(at as *mut u32) = pair;
                    } else {
                        *at = pair as u16;
                        if col + 1 < width {
                            *at.add(1) = (pair >> 16) as u16;
                        }
                    }
                }
            }
        }
    };
    // LLVM unrolls the loop itself up to 16 fragments (head_dim 128); above, it is too long for
    // LLVM's threshold, and the accumulator would live in local memory for the whole kernel
    // (an index known only at run time), so it is unrolled by hand.
    if D_TILES > 16 {
        hw::unroll::<D_TILES>(store);
    } else {
        for dt in 0..D_TILES {
            store(dt);
        }
    }
}

/// Writes the LSE of a warp's `16 · M_TILES` fragment rows: `finished[r]` is m-tile `r`'s
/// `(1/l, LSE)` from [`crate::attention::softmax::RowSoftmax::finish`], whose half `h` is tile
/// row `row0 + 16r + g + 8h` (the same in the 4 lanes of a row). Row `row` goes to
/// `lse[dst_row0 + row]`, from the lanes with `t = 0`, tile rows at or past `valid_rows` skipped.
///
/// # Safety
/// `lse` holds `dst_row0 + valid_rows` floats.
#[inline(always)]
pub unsafe fn store_fragment_lse<const M_TILES: usize>(
    finished: &[([f32; 2], [f32; 2]); M_TILES],
    lse: *mut f32,
    dst_row0: usize,
    row0: usize,
    valid_rows: usize,
    lane: FragmentLane,
) {
    if lane.t == 0 {
        for r in 0..M_TILES {
            for h in 0..2 {
                let row = row0 + 16 * r + lane.g + 8 * h;
                if row < valid_rows {
                    // SAFETY: row < valid_rows.
                    unsafe { *lse.add(dst_row0 + row) = finished[r].1[h] };
                }
            }
        }
    }
}
