//! The m16n8 accumulator layout, written once: which rows and columns of a tile a lane's
//! fragment entries are, for every kernel on the tensor cores (`mma.sync` in levels 5 and 6,
//! `wgmma` in levels 8 and 9, whose accumulators have the same per-warp layout).
//!
//! In a 16 × 8 `f32` accumulator fragment ([`FragC`], see the table in [`crate::hw::mma`]) lane
//! `l` holds four entries: with `g = l / 4` and `t = l % 4`, entries 0 and 1 are row `g`, columns
//! `2t` and `2t + 1`; entries 2 and 3 are row `g + 8`, the same columns. A tile of `N · 8`
//! columns is an array `[FragC; N]`, n-tile `nt` covering columns `8nt .. 8nt + 8`. Entries
//! `2h` and `2h + 1` (a "half" `h`) share a row, so per-row values come in pairs `[f32; 2]`.

use crate::attention::mask::Mask;
use crate::hw::{self, FragA, FragC, Half2, HalfFloat};

/// This lane's place in the m16n8 layout: rows `g` and `g + 8`, column pair `2t, 2t + 1`.
#[derive(Clone, Copy)]
pub struct FragmentLane {
    /// `lane / 4`: the lane's rows are `g` and `g + 8` of each 16-row m-tile.
    pub g: usize,
    /// `lane % 4`: the lane's columns are `2t` and `2t + 1` of each 8-column n-tile.
    pub t: usize,
}

impl FragmentLane {
    /// The calling lane's place.
    #[inline(always)]
    pub fn current() -> Self {
        Self::of(hw::lane_id())
    }

    /// Lane `lane`'s place.
    #[inline(always)]
    pub fn of(lane: usize) -> Self {
        Self { g: lane / 4, t: lane % 4 }
    }

    /// The row (0..16) of entry `e`: `g` for entries 0 and 1, `g + 8` for 2 and 3.
    #[inline(always)]
    pub fn row(self, e: usize) -> usize {
        self.half_row(e / 2)
    }

    /// The row (0..16) of half `h` (entries `2h` and `2h + 1`): `g + 8h`.
    #[inline(always)]
    pub fn half_row(self, h: usize) -> usize {
        self.g + 8 * h
    }

    /// The column (0..8) of entry `e` within its n-tile: `2t + e % 2`.
    #[inline(always)]
    pub fn col(self, e: usize) -> usize {
        self.pair_col() + e % 2
    }

    /// The first column (0..8) of the pair the lane holds in every n-tile: `2t`.
    #[inline(always)]
    pub fn pair_col(self) -> usize {
        2 * self.t
    }

    /// The (row, column) of entry `e` of n-tile `nt` in a row of m16n8 fragments whose first
    /// entry is at (`first_row`, `first_col`): n-tile `nt` covers columns `first_col + 8nt ..`.
    #[inline(always)]
    pub fn place(self, (first_row, first_col): (usize, usize), nt: usize, e: usize) -> (usize, usize) {
        (first_row + self.row(e), first_col + 8 * nt + self.col(e))
    }
}

/// Sets every entry of `frags` that `mask` hides to `value` (−∞ for scores, 0 for
/// probabilities). An entry's row is `first_row` plus its row in the fragment (0..16), its column
/// `first_col` plus its column in the tile (`8nt + 0..8` for n-tile `nt`): a query and a key, or
/// with `TRANSPOSED` (the products Sᵀ = K·Qᵀ of the backward) a key and a query.
#[inline(always)]
pub fn mask_fragments<const N: usize, const TRANSPOSED: bool>(
    frags: &mut [FragC; N],
    lane: FragmentLane,
    value: f32,
    (first_row, first_col): (usize, usize),
    mask: &Mask,
) {
    if TRANSPOSED && !mask.has_table() {
        // The backward's transposed tiles without a band table test entry by entry: in the
        // `mma.sync` dK/dV kernels this form needs fewer registers than the per-row bands
        // below (18 fewer at head_dim 128, PERFORMANCE.md, "table twins"), and their masked tiles
        // are few. Index loops, sums from the first row and column, and the mask itself rather
        // than a closure over it: the form LLVM and ptxas turn into the fewest registers.
        for nt in 0..N {
            for e in 0..4 {
                let row = first_row + lane.g + 8 * (e / 2);
                let col = first_col + 8 * nt + 2 * lane.t + e % 2;
                if !mask.visible(col, row) {
                    frags[nt][e] = value;
                }
            }
        }
        return;
    }
    // The lane's two rows (a query each, or with `TRANSPOSED` a key each) see the columns
    // `start[h] .. start[h] + width[h]`: worked out once per row, so that each entry costs one
    // subtraction and one comparison ([`mask_columns`]), not the two edges' arithmetic (or a
    // band table's reads). The per-entry form made the diagonal tiles of causal forwards slow
    // enough to cost them 4–10 % (PERFORMANCE.md, 2026-12-02); the transposed tiles' rows are
    // keys, whose queries are a band too ([`Mask::queries_seeing`]).
    let mut start = [0; 2];
    let mut width = [0; 2];
    for h in 0..2 {
        let row = first_row + lane.g + 8 * h;
        (start[h], width[h]) = if TRANSPOSED { mask.queries_seeing(row) } else { mask.keys_seen_by(row) };
    }
    mask_columns(frags, lane, value, first_col, (start, width));
}

/// Sets the entries of `frags` (scores of keys `first_col + 8nt + 0..8`) outside the keys
/// their row sees to `value`: the lane's row of half `h` sees keys `start[h] .. start[h] +
/// width[h]` (width 0: none). The mask of a kernel whose lanes keep their two rows for the whole
/// pass (the decoder's packed rows, whose queries are not consecutive), which computes the two
/// bands once; a key left of `start` wraps around to a huge offset, so that an entry costs one
/// subtraction and one comparison.
#[inline(always)]
pub fn mask_columns<const N: usize>(
    frags: &mut [FragC; N],
    lane: FragmentLane,
    value: f32,
    first_col: usize,
    (start, width): ([usize; 2], [usize; 2]),
) {
    for nt in 0..N {
        for e in 0..4 {
            if (first_col + 8 * nt + lane.col(e)).wrapping_sub(start[e / 2]) >= width[e / 2] {
                frags[nt][e] = value;
            }
        }
    }
}

/// Multiplies each row of `frags` by its factor: entries `2h`, `2h + 1` by `factor[h]` (the
/// online softmax's rescaling of O by `alpha`).
#[inline(always)]
pub fn scale_rows<const N: usize>(frags: &mut [FragC; N], factor: [f32; 2]) {
    for frag in frags.iter_mut() {
        for (e, x) in frag.iter_mut().enumerate() {
            *x *= factor[e / 2];
        }
    }
}

/// Half `h` of `frag` times `scale`, rounded to 16 bits and packed: the two values of one row
/// that a lane stores together.
#[inline(always)]
pub fn pack_row<T: HalfFloat>(frag: FragC, h: usize, scale: f32) -> Half2 {
    T::pack(frag[2 * h] * scale, frag[2 * h + 1] * scale)
}

// ANCHOR: pack_a
/// The A fragment of a 16 × 16 operand whose two 16 × 8 halves are the accumulators `first`
/// (columns 0..8) and `second` (columns 8..16), rounded to 16 bits: a0 = row g of `first`,
/// a1 = row g + 8 of it, a2 and a3 the same of `second`. This is why P = softmax(S) can feed
/// P·V straight from registers (FlashAttention-2, section 3.3).
#[inline(always)]
pub fn pack_a<T: HalfFloat>(first: FragC, second: FragC) -> FragA {
    [
        T::pack(first[0], first[1]),
        T::pack(first[2], first[3]),
        T::pack(second[0], second[1]),
        T::pack(second[2], second[3]),
    ]
}
// ANCHOR_END: pack_a
