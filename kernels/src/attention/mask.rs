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
//! and it is what lets whole tiles be skipped from both ends. Bands that two offsets cannot
//! express — a document mask (each token sees only its own document), prefix-LM (a
//! bidirectional prefix, causal after it) — come as a *band table* ([`Mask::table`]): one
//! band per query and one per key, built on the host (`MaskTable`) and intersected here with
//! the offsets' band, so that every tier skips and masks tiles for them with no code of its
//! own. A new kind of band is a change here, in the kernel-argument list of `attention_kernel!`
//! (`lib.rs`), and on the host (`ProblemArgs`); a new table-built mask is host code only.

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
/// * a band table ([`Mask::table`], or null): per query, the keys `start ≤ j < limit` it may
///   see at most, intersected with the two edges above.
///
/// Queries at or past `seqlen_q` (padding rows of the last tile) see no key at all.
#[derive(Clone, Copy)]
pub struct Mask {
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub causal: bool,
    pub offset: isize,
    pub start_offset: isize,
    /// The band table of the block's batch entry ([`Mask::for_batch`]), or null: `seqlen_q`
    /// pairs of `u32` (the first key query `i` may see, the end of its keys), then `seqlen_k`
    /// pairs (the first query that may see key `j`, the end of those queries). Both pairs' ends
    /// are non-decreasing along the sequence, and the two halves describe the same visible
    /// pairs (the host builds both from one definition); a tile's range runs from its first
    /// row's start to its last row's limit, and tiles inside it that no row sees (a varlen
    /// table's gaps, host `table_gap`) are masked, not skipped; the Hopper backward's dQ turns
    /// need no gap. One batch entry's table is [`Mask::table_words`] long.
    pub table: *const u32,
}

impl Mask {
    /// `start_offset` of a mask without a left edge: far enough below zero that `query +
    /// start_offset` is negative for every query, and far enough above `isize::MIN` that no sum
    /// of it overflows.
    pub const NO_LEFT_EDGE: isize = isize::MIN / 4;

    /// The mask as kernels receive it: the sequence lengths, `causal` (0 or 1), the causal
    /// offset and the left edge's offset (see the type's docs); no band table.
    #[inline(always)]
    pub fn from_args(seqlen_q: usize, seqlen_k: usize, causal: usize, offset: isize, start_offset: isize) -> Self {
        Self { seqlen_q, seqlen_k, causal: causal != 0, offset, start_offset, table: core::ptr::null() }
    }

    /// This mask intersected with the band table at `table` (null: none), whose first batch
    /// entry it reads until [`Mask::for_batch`] picks another.
    #[inline(always)]
    pub fn with_table(self, table: *const u32) -> Self {
        Self { table, ..self }
    }

    /// Whether a band table is bound (always false in a mask that [`Mask::specialised`] made
    /// table-free, as the compiler can see).
    #[inline(always)]
    pub fn has_table(&self) -> bool {
        !self.table.is_null()
    }

    /// The mask as a kernel compiled for problems with (`TABLE`) or without a band table sees
    /// it. Without, the table is dropped: a null the compiler can see, so that every table
    /// branch below folds away and the kernel is the code it was before tables existed (the
    /// host launches that kernel only when no table is bound, so nothing is lost: the `table
    /// twin` entries of `attention_kernel!`). Why two kernels: the table's branches, even never
    /// taken, cost the `mma.sync` kernels and the `f32` backward registers, spills and resident
    /// blocks (PERFORMANCE.md, 2026-12-03, and its "table twins" entry).
    #[inline(always)]
    pub fn specialised<const TABLE: bool>(self) -> Self {
        if TABLE { self } else { Self { table: core::ptr::null(), ..self } }
    }

    /// `u32` words of one batch entry's band table ([`Mask::table`]): a pair per query and a
    /// pair per key.
    pub const fn table_words(seqlen_q: usize, seqlen_k: usize) -> usize {
        2 * (seqlen_q + seqlen_k)
    }

    /// The mask of batch entry `batch`: its band table, when there is one (the kernels call it
    /// once they know their block's batch entry; without a table it changes nothing).
    #[inline(always)]
    pub fn for_batch(self, batch: usize) -> Self {
        if self.table.is_null() {
            self
        } else {
            // SAFETY: the host's table has `batch` entries of `table_words` words (a pointer
            // computed inside it).
            Self { table: unsafe { self.table.add(batch * Self::table_words(self.seqlen_q, self.seqlen_k)) }, ..self }
        }
    }

    /// Pair `index` of the band table (`index < seqlen_q + seqlen_k`).
    ///
    /// Volatile loads, so that the compiler reads the pair where the mask is asked for — inside
    /// the branch of a tile that needs the mask — rather than hoisting a row's pair out of the
    /// key loop to keep it live there. (The table's branches still cost kernels registers even
    /// when never taken, which volatile reads did not win back: PERFORMANCE.md, 2026-12-02
    /// (evening); hence the sm_80 path's table-free entries, [`Mask::specialised`].)
    #[inline(always)]
    fn table_pair(&self, index: usize) -> (usize, usize) {
        // SAFETY: the table holds `seqlen_q + seqlen_k` pairs (the host's contract).
        unsafe {
            let pair = self.table.add(2 * index);
            (core::ptr::read_volatile(pair) as usize, core::ptr::read_volatile(pair.add(1)) as usize)
        }
    }

    /// The table's band of query `query` (padding rows take the last row's, which keeps the
    /// ends non-decreasing).
    #[inline(always)]
    fn table_query_pair(&self, query: usize) -> (usize, usize) {
        self.table_pair(query.min(self.seqlen_q - 1))
    }

    /// The table's band of key `key`: the queries that may see it.
    #[inline(always)]
    fn table_key_pair(&self, key: usize) -> (usize, usize) {
        self.table_pair(self.seqlen_q + key.min(self.seqlen_k - 1))
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
        Self { seqlen_q, seqlen_k, causal, offset, start_offset, table: core::ptr::null() }
    }

    /// The first key query `query` sees (keys before it are left of its window); `seqlen_k` at
    /// most. Non-decreasing in `query`. Padding rows get the same formula (they see nothing
    /// anyway: their `key_limit` is 0), which keeps it monotone across the sequence's end.
    #[inline(always)]
    pub fn key_start(&self, query: usize) -> usize {
        let start = (query as isize + self.start_offset).clamp(0, self.seqlen_k as isize) as usize;
        if self.table.is_null() { start } else { start.max(self.table_query_pair(query).0) }
    }

    /// Number of keys query `query` sees: keys `0 .. key_limit(query)`. Non-decreasing in
    /// `query` (for queries below `seqlen_q`), which is what lets whole tiles be skipped.
    #[inline(always)]
    pub fn key_limit(&self, query: usize) -> usize {
        if query >= self.seqlen_q {
            return 0;
        }
        let limit = if self.causal {
            // 0 ≤ result ≤ seqlen_k; computed in isize because the offset can be negative.
            (query as isize + 1 + self.offset).clamp(0, self.seqlen_k as isize) as usize
        } else {
            self.seqlen_k
        };
        if self.table.is_null() { limit } else { limit.min(self.table_query_pair(query).1) }
    }

    /// The first query that sees `key` (`seqlen_q` if none does): queries before it can be
    /// skipped by a block that owns this key.
    #[inline(always)]
    pub fn first_query_seeing(&self, key: usize) -> usize {
        let first = if self.causal {
            // key < query + 1 + offset  ⇔  query ≥ key − offset
            (key as isize - self.offset).clamp(0, self.seqlen_q as isize) as usize
        } else {
            0
        };
        if self.table.is_null() { first } else { first.max(self.table_key_pair(key).0) }
    }

    /// The end of the queries that see `key` (`0` if none does): queries at or past it have
    /// their window's left edge beyond the key, and a block that owns this key can stop there.
    #[inline(always)]
    pub fn query_end_seeing(&self, key: usize) -> usize {
        // key ≥ query + start_offset  ⇔  query ≤ key − start_offset
        let end = (key as isize - self.start_offset + 1).clamp(0, self.seqlen_q as isize) as usize;
        if self.table.is_null() { end } else { end.min(self.table_key_pair(key).1) }
    }

    /// Whether `key` is visible to `query`.
    #[inline(always)]
    pub fn visible(&self, query: usize, key: usize) -> bool {
        self.key_start(query) <= key && key < self.key_limit(query)
    }

    /// The keys query `query` sees, as `(start, width)`: keys `start .. start + width` (width
    /// 0: none; padding rows see none). What a kernel works out once per row of a tile that
    /// needs the mask, so that an entry costs one subtraction and one comparison
    /// (`key.wrapping_sub(start) < width`, a key left of `start` wrapping to a huge offset)
    /// rather than the edges' arithmetic (and a band table's reads) per entry.
    #[inline(always)]
    pub fn keys_seen_by(&self, query: usize) -> (usize, usize) {
        let start = self.key_start(query);
        (start, self.key_limit(query).saturating_sub(start))
    }

    /// The queries that see key `key`, as `(start, width)` ([`Mask::keys_seen_by`] for the
    /// transposed tiles of the backward, whose rows are keys): a band too, the same pairs as
    /// [`Mask::visible`] (padding keys, at or past `seqlen_k`, are seen by none).
    #[inline(always)]
    pub fn queries_seeing(&self, key: usize) -> (usize, usize) {
        if key >= self.seqlen_k {
            return (0, 0);
        }
        let first = self.first_query_seeing(key);
        (first, self.query_end_seeing(key).saturating_sub(first))
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
