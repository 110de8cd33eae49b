//! Which keys each query sees, and what that means for whole tiles: the one place where every
//! tier (CUDA cores, `mma.sync`, `wgmma`; forward and backward) learns which key tiles a block of
//! queries visits, which query tiles a block of keys visits, and which tiles need the
//! per-element mask.
//!
//! Every tile of the score matrix is of one of three kinds (FlashAttention-2, section 3.1.1; the
//! FlexAttention paper calls them empty, full and partial blocks):
//!
//! | kind | what the kernels do | how they know |
//! |---|---|---|
//! | hidden: no query of the tile sees any key of it | never load it | [`KeyRange::first_tile`], [`KeyRange::tiles`], [`Mask::first_query_seeing`], [`Mask::query_end_seeing`] |
//! | fully visible | no mask | [`KeyRange::needs_mask`] false, [`Mask::all_visible`] true |
//! | partial (the causal diagonal, a window's edges, the ragged end of the keys, padding query rows) | mask element by element | [`KeyRange::needs_mask`], [`Mask::tile_needs_mask`], [`Mask::visible`] |
//!
//! What a query sees is a band: keys from `key_start(query)` up to (not including)
//! `key_limit(query)`, both non-decreasing in the query. That one shape covers no mask, both
//! causal alignments and sliding windows (local attention, Beltagy et al. 2020; Mistral, Gemma),
//! and it is what lets whole tiles be skipped from both ends. A new kind of band is a change
//! here, in the kernel-argument list of `attention_kernel!` (`lib.rs`), and on the host
//! (`ProblemArgs`).

// ANCHOR: mask
/// Which keys each query may attend to, and the sequence bounds.
///
/// Key `j` is visible to query `i` iff `key_start(i) ≤ j < key_limit(i)`:
///
/// * upper edge: with `causal`, keys `j ≤ i + offset`, where `offset = 0` aligns the mask to the
///   top-left corner (PyTorch's `is_causal`) and `offset = seqlen_k − seqlen_q` to the
///   bottom-right corner (FlashAttention ≥ 2.1); a sliding window's right edge moves it further
///   right. Without `causal`, every key up to `seqlen_k`.
/// * lower edge: keys `j ≥ i + start_offset`, a sliding window's left edge; `start_offset =`
///   [`Mask::NO_LEFT_EDGE`] when there is none. The host computes both offsets, and with
///   `causal` never a `start_offset` above `offset` (so every row's band, before clamping to
///   the sequence, holds at least its diagonal key).
///
/// Queries at or past `seqlen_q` (padding rows of the last tile) see no key at all.
#[derive(Clone, Copy)]
pub struct Mask {
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub causal: bool,
    pub offset: isize,
    pub start_offset: isize,
}

impl Mask {
    /// `start_offset` of a mask without a left edge: far enough below zero that `query +
    /// start_offset` is negative for every query, and far enough above `isize::MIN` that no sum
    /// of it overflows.
    pub const NO_LEFT_EDGE: isize = isize::MIN / 4;

    /// The mask as kernels receive it: the sequence lengths, `causal` (0 or 1), the causal
    /// offset and the left edge's offset (see the type's docs).
    #[inline(always)]
    pub fn from_args(seqlen_q: usize, seqlen_k: usize, causal: usize, offset: isize, start_offset: isize) -> Self {
        Self { seqlen_q, seqlen_k, causal: causal != 0, offset, start_offset }
    }

    /// A sliding window's edge that is open (FlashAttention's `window_size` of −1): see
    /// [`Mask::banded`].
    pub const OPEN: usize = usize::MAX;

    /// The band of a causal mask and a sliding window together (a key is visible if both allow
    /// it), for `seqlen_q` queries and `seqlen_k` keys: the causal mask (when `causal`) lets query
    /// `i` see keys `j ≤ i + causal_offset`; the window sees keys `i + d − left ≤ j ≤ i + d +
    /// right` around its diagonal `d` (`window_diagonal`), an edge [`Mask::OPEN`] when that side
    /// is not limited (both open: no window). Where the window's left edge lies right of the
    /// causal diagonal (the two aligned differently), every row is empty, said in the plain form
    /// (a diagonal left of every key), so that the kernels skip every tile: a band of negative
    /// width would defeat their tile arithmetic.
    ///
    /// Computed once on the host for the flash kernels (`AttentionOptions::mask_args`), and per
    /// sequence on the device by the decoder, whose sequences have lengths of their own.
    #[inline(always)]
    pub fn banded(
        seqlen_q: usize,
        seqlen_k: usize,
        (causal, causal_offset): (bool, isize),
        (left, right): (usize, usize),
        window_diagonal: isize,
    ) -> Self {
        // Every offset is clamped to ±(seqlen_q + seqlen_k): beyond that it changes nothing.
        let bound = (seqlen_q + seqlen_k) as isize;
        let edge = |side: usize, sign: isize| -> isize {
            let side = side.min(bound as usize) as isize;
            (window_diagonal.clamp(-bound, bound) + sign * side).clamp(-bound, bound)
        };
        let (mut causal, mut offset, mut start_offset) = (causal, causal_offset, Self::NO_LEFT_EDGE);
        if right != Self::OPEN {
            let right_edge = edge(right, 1);
            offset = if causal { offset.min(right_edge) } else { right_edge };
            causal = true;
        }
        if left != Self::OPEN {
            start_offset = edge(left, -1);
        }
        if causal && start_offset > offset {
            (offset, start_offset) = (-bound, Self::NO_LEFT_EDGE);
        }
        Self { seqlen_q, seqlen_k, causal, offset, start_offset }
    }

    /// The first key query `query` sees (keys before it are left of its window); `seqlen_k` at
    /// most. Non-decreasing in `query`. Padding rows get the same formula (they see nothing
    /// anyway: their `key_limit` is 0), which keeps it monotone across the sequence's end.
    #[inline(always)]
    pub fn key_start(&self, query: usize) -> usize {
        (query as isize + self.start_offset).clamp(0, self.seqlen_k as isize) as usize
    }

    /// Number of keys query `query` sees: keys `0 .. key_limit(query)`. Non-decreasing in
    /// `query` (for queries below `seqlen_q`), which is what lets whole tiles be skipped.
    #[inline(always)]
    pub fn key_limit(&self, query: usize) -> usize {
        if query >= self.seqlen_q {
            0
        } else if self.causal {
            // 0 ≤ result ≤ seqlen_k; computed in isize because the offset can be negative.
            (query as isize + 1 + self.offset).clamp(0, self.seqlen_k as isize) as usize
        } else {
            self.seqlen_k
        }
    }

    /// The first query that sees `key` (`seqlen_q` if none does): queries before it can be
    /// skipped by a block that owns this key.
    #[inline(always)]
    pub fn first_query_seeing(&self, key: usize) -> usize {
        if self.causal {
            // key < query + 1 + offset  ⇔  query ≥ key − offset
            (key as isize - self.offset).clamp(0, self.seqlen_q as isize) as usize
        } else {
            0
        }
    }

    /// The end of the queries that see `key` (`0` if none does): queries at or past it have
    /// their window's left edge beyond the key, and a block that owns this key can stop there.
    #[inline(always)]
    pub fn query_end_seeing(&self, key: usize) -> usize {
        // key ≥ query + start_offset  ⇔  query ≤ key − start_offset
        (key as isize - self.start_offset + 1).clamp(0, self.seqlen_q as isize) as usize
    }

    /// Whether `key` is visible to `query`.
    #[inline(always)]
    pub fn visible(&self, query: usize, key: usize) -> bool {
        self.key_start(query) <= key && key < self.key_limit(query)
    }

    /// The keys that query rows `q_start .. q_start + q_rows` (`q_rows ≥ 1`) visit.
    #[inline(always)]
    pub fn keys_for(&self, q_start: usize, q_rows: usize) -> KeyRange {
        // The last row of the block sees the most keys on the right and the first row the most
        // on the left; the keys every row sees lie between the first row's limit and the last
        // row's start.
        let last = q_start + q_rows - 1;
        KeyRange {
            begin: self.key_start(q_start),
            end: self.key_limit(last),
            all_from: self.key_start(last),
            all_see: self.key_limit(q_start),
        }
    }

    /// Whether the tile of queries `q_start .. q_start + block_m` and keys `k_start .. k_start +
    /// block_n` needs the per-element mask, padding query rows (at or past `seqlen_q`) counted
    /// as rows that see nothing: the test of kernels whose padding rows would otherwise add to
    /// results that are stored (dK and dV sum over query rows).
    #[inline(always)]
    pub fn tile_needs_mask(&self, q_start: usize, block_m: usize, k_start: usize, block_n: usize) -> bool {
        q_start + block_m > self.seqlen_q || !self.all_visible(q_start, block_m, k_start, block_n)
    }

    /// Whether every query of `q_start .. q_start + q_rows` (padding rows included, by the
    /// formulas) sees all of keys `k_start .. k_start + keys`: the first query's limit is past
    /// them and the last query's start before them (both edges being non-decreasing).
    #[inline(always)]
    pub fn all_visible(&self, q_start: usize, q_rows: usize, k_start: usize, keys: usize) -> bool {
        self.key_limit(q_start) >= k_start + keys && self.key_start(q_start + q_rows - 1) <= k_start
    }
}
// ANCHOR_END: mask

/// The keys a block of query rows visits ([`Mask::keys_for`]): `begin .. end`, of which
/// `all_from .. all_see` are seen by every row of the block.
#[derive(Clone, Copy)]
pub struct KeyRange {
    /// Keys before `begin` are hidden from every row (left of every window).
    pub begin: usize,
    /// Keys at or past `end` are hidden from every row: their tiles are never loaded.
    pub end: usize,
    /// Keys from `all_from` to `all_see` are visible to every row.
    pub all_from: usize,
    pub all_see: usize,
}

impl KeyRange {
    /// The first key tile of `block_n` keys to visit.
    #[inline(always)]
    pub fn first_tile(self, block_n: usize) -> usize {
        self.begin / block_n
    }

    /// Key tiles of `block_n` keys to visit: tiles `first_tile .. first_tile + tiles` (none when
    /// no row sees a key).
    #[inline(always)]
    pub fn tiles(self, block_n: usize) -> usize {
        self.end.div_ceil(block_n).saturating_sub(self.first_tile(block_n))
    }

    /// The first key of the `i`-th tile visited.
    #[inline(always)]
    pub fn tile_start(self, i: usize, block_n: usize) -> usize {
        (self.first_tile(block_n) + i) * block_n
    }

    /// Whether the key tile starting at `k_start` crosses some row's key limit or key start
    /// (the causal diagonal, a window's edges, the ragged end of the keys) and so pays for the
    /// per-element mask. Padding query rows are not counted: kernels whose padding rows never
    /// reach a stored result use this test.
    #[inline(always)]
    pub fn needs_mask(self, k_start: usize, block_n: usize) -> bool {
        k_start + block_n > self.all_see || k_start < self.all_from
    }
}
