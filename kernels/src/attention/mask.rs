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
//! | hidden: no query of the tile sees any key of it | never load it | [`KeyRange::tiles`], [`Mask::first_query_seeing`] |
//! | fully visible | no mask | [`KeyRange::needs_mask`] false, [`Mask::all_visible`] true |
//! | partial (the causal diagonal, the ragged end of the keys, padding query rows) | mask element by element | [`KeyRange::needs_mask`], [`Mask::tile_needs_mask`], [`Mask::visible`] |
//!
//! A new kind of mask is a change here (its `key_limit` and `first_query_seeing` answers), in
//! the kernel-argument list of `attention_kernel!` (`lib.rs`), and on the host.

// ANCHOR: mask
/// Which keys each query may attend to (causal masking), and the sequence bounds.
///
/// Key `j` is visible to query `i` iff `j < key_limit(i)`:
///
/// * not causal: every key, `key_limit(i) = seqlen_k`;
/// * causal: keys `j ≤ i + offset`, where `offset = 0` aligns the mask to the top-left corner
///   (PyTorch's `is_causal`) and `offset = seqlen_k − seqlen_q` to the bottom-right corner
///   (FlashAttention ≥ 2.1). The host computes the offset.
///
/// Queries at or past `seqlen_q` (padding rows of the last tile) see no key at all.
#[derive(Clone, Copy)]
pub struct Mask {
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub causal: bool,
    pub offset: isize,
}

impl Mask {
    /// The mask as kernels receive it: the sequence lengths, `causal` (0 or 1) and the causal
    /// offset (see the type's docs).
    #[inline(always)]
    pub fn from_args(seqlen_q: usize, seqlen_k: usize, causal: usize, offset: isize) -> Self {
        Self { seqlen_q, seqlen_k, causal: causal != 0, offset }
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

    /// Whether `key` is visible to `query`.
    #[inline(always)]
    pub fn visible(&self, query: usize, key: usize) -> bool {
        key < self.key_limit(query)
    }

    /// The keys that query rows `q_start .. q_start + q_rows` (`q_rows ≥ 1`) visit.
    #[inline(always)]
    pub fn keys_for(&self, q_start: usize, q_rows: usize) -> KeyRange {
        // The last row of the block sees the most keys, the first row the fewest.
        KeyRange { end: self.key_limit(q_start + q_rows - 1), all_see: self.key_limit(q_start) }
    }

    /// Whether the tile of queries `q_start .. q_start + block_m` and keys `k_start .. k_start +
    /// block_n` needs the per-element mask, padding query rows (at or past `seqlen_q`) counted
    /// as rows that see nothing: the test of kernels whose padding rows would otherwise add to
    /// results that are stored (dK and dV sum over query rows).
    #[inline(always)]
    pub fn tile_needs_mask(&self, q_start: usize, block_m: usize, k_start: usize, block_n: usize) -> bool {
        q_start + block_m > self.seqlen_q || k_start + block_n > self.key_limit(q_start)
    }

    /// Whether query `q_start` — and so, the limit being non-decreasing, every later query of
    /// a tile — sees all of keys `k_start .. k_start + keys`.
    #[inline(always)]
    pub fn all_visible(&self, q_start: usize, k_start: usize, keys: usize) -> bool {
        self.key_limit(q_start) >= k_start + keys
    }
}
// ANCHOR_END: mask

/// The keys a block of query rows visits ([`Mask::keys_for`]): `0 .. end`, of which
/// `0 .. all_see` are seen by every row of the block.
#[derive(Clone, Copy)]
pub struct KeyRange {
    /// Keys at or past `end` are hidden from every row: their tiles are never loaded.
    pub end: usize,
    /// Keys before `all_see` are visible to every row.
    pub all_see: usize,
}

impl KeyRange {
    /// Key tiles of `block_n` keys to visit (tiles `0 .. tiles`).
    #[inline(always)]
    pub fn tiles(self, block_n: usize) -> usize {
        self.end.div_ceil(block_n)
    }

    /// Whether the key tile starting at `k_start` crosses some row's key limit (the causal
    /// diagonal, the ragged end of the keys) and so pays for the per-element mask. Padding
    /// query rows are not counted: kernels whose padding rows never reach a stored result use
    /// this test.
    #[inline(always)]
    pub fn needs_mask(self, k_start: usize, block_n: usize) -> bool {
        k_start + block_n > self.all_see
    }
}
