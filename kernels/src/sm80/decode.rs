//! Level 10: decoding from a KV cache — split-KV ("Flash-Decoding", Dao, Haziza, Massa and
//! Sizov 2023), grouped-query heads packed into the query rows, paged or token-major K/V.
//!
//! A decoding step has a handful of new queries (seqlen_q 1 to 16) per sequence and a long cached
//! K/V. Run through the forward of level 5, one block per 64 query rows and head, it would give
//! the GPU a few dozen blocks and read the cache at a fraction of the memory's speed. Three
//! changes make the work wide enough to fill every SM, all of them about *where the keys go*:
//!
//! * **GQA packing.** The `group = num_heads_q / num_heads_kv` query heads that share a K/V head
//!   read the same keys: their `group · seqlen_q` query rows are one block's rows (row
//!   `r = i · seqlen_q + t` is query `t` of the group's head `i`), so a group reads its K/V once.
//! * **Split-KV.** A sequence's keys are cut into `num_splits` contiguous ranges, one block
//!   each; every block writes its rows' normalised partial O (`f32`) and LSE, and
//!   `decode_merge_*` merges the splits by their LSE ([`crate::attention::softmax::lse_weight`]).
//!   With one split the block writes O and LSE itself.
//! * **Warps split the keys, not the rows.** The block's 4 warps share its 16 rows (one `mma`
//!   m-tile) and take turns over the split's key tiles of 16 keys: warp `w` computes tiles
//!   `w, w + 4, w + 8, …`, each through its own `cp.async` ring and online softmax, so no block
//!   barrier stands in the key loop. At the end the block merges its 4 warps by their LSE in
//!   shared memory, the same merge as the splits'.
//!
//! The products are level 5's (`mma.sync` m16n8k16, P straight from registers); the kernel is
//! memory-bound, so 16 rows of which only `group · seqlen_q` are real cost nothing that matters.
//!
//! ## Threads
//!
//! | who | rows | keys |
//! |---|---|---|
//! | block `(b, kv_head, row block, split)` | packed rows `16 · row block ..` of the group | the split's tiles |
//! | warp `w` (of 4) | all 16 | tiles `w, w + 4, …` of the split |
//! | lane (m16n8 layout, [`crate::attention::fragment`]) | `g`, `g + 8` | columns `2t, 2t + 1` of each 8 |
//!
//! ## Shared memory ([`crate::layout::decode_smem_bytes`])
//!
//! | region | shape | written by | read by |
//! |---|---|---|---|
//! | Q | 16 × HEAD_DIM, 16-bit | `cp.async`, whole block | every warp (`ldmatrix`) |
//! | LSE of each warp | 4 × 16 `f32` | each warp its row | every thread (the merge) |
//! | ring of warp `w` | STAGES × (K, V) of 16 × HEAD_DIM | `cp.async`, warp `w` | warp `w` |
//! | merge (over the rings, after the key loop) | 4 × 16 × HEAD_DIM `f32` | each warp its weighted O | every thread, summing |
//!
//! ## The cache
//!
//! K and V rows are found through strides (elements): `batch` (or, paged, `page`), `token` and
//! `head`, so `[batch, seqlen, heads, head_dim]` (FlashAttention's cache), `[batch, heads,
//! seqlen, head_dim]` and views of a packed tensor all work. A paged cache is `[num_pages,
//! page_size, heads, head_dim]` with a `block_table [batch, pages_per_seq]` of page numbers;
//! `page_size` is a multiple of 16, so a key tile never straddles two pages. Sequence `b` has
//! `seqlens_k[b]` keys (or `seqlen_k` for all when no lengths are given), at most the cache's
//! capacity.
//!
//! ## Masks, score modifications, sinks
//!
//! What a row sees is the flash kernels' band ([`Mask::banded`]) in the sequence's own
//! coordinates: the causal diagonal (bottom-right aligned for speculative decoding) and a
//! sliding window around the sequence's end (Mistral's, Gemma's, GPT-OSS's local layers), so a
//! window of `w` keys reads only the tiles inside it. Softcapping and ALiBi go through the same
//! [`ScoreMod`] as everywhere, per row: a block's rows belong to the group's different heads
//! ([`ScoreMod::apply_fragments_by_row`]). An attention sink joins each row once, as one more
//! part of the final merge by LSE (an LSE with no O): the block's merge of its warps with one
//! split, `merge_splits` with several.

use crate::attention::epilogue::store4_half_clipped;
use crate::attention::fragment::{FragmentLane, mask_columns, pack_a, scale_rows};
use crate::attention::mask::Mask;
use crate::attention::score::{ScoreArgs, ScoreMod};
use crate::attention::softmax::{RowSoftmax, lse_weight, merged_lse, positive_factor, q_sign_mask};
use crate::hw::{self, F32x4, FragA, HalfFloat, SharedMemory};
use crate::layout::{
    DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_MERGE_COLUMNS, DECODE_MERGE_THREADS, DECODE_THREADS, DECODE_WARPS,
    DecodeShape, MMA_SMEM_PAD, decode_partial_stride, decode_ring_rows, div_rem,
};
use crate::sm80::pipeline::{KvRing, KvSource, WarpScope};

/// One warp's keys: tiles `first, first + step, …` of 16 keys of one K/V head of one sequence,
/// contiguous or paged.
#[derive(Clone, Copy)]
struct CacheTiles {
    /// K and V of this head: of its sequence when contiguous, of page 0 when paged.
    k: *const u16,
    v: *const u16,
    /// Elements from one token's row to the next.
    k_token: usize,
    v_token: usize,
    /// Elements from one page to the next (paged only).
    k_page: usize,
    v_page: usize,
    /// The sequence's row of the page table (paged only), its page size (0: not paged) and the
    /// number of pages the cache has (page numbers are clamped below it).
    pages: *const u32,
    page_size: usize,
    num_pages: usize,
    width: usize,
    /// Keys of the sequence this block visits.
    keys: usize,
    first: usize,
    step: usize,
}

impl KvSource for CacheTiles {
    #[inline(always)]
    unsafe fn tile(self, i: usize) -> (*const u16, *const u16, usize) {
        let key = (self.first + i * self.step) * DECODE_BLOCK_N;
        let valid = DECODE_BLOCK_N.min(self.keys - key);
        let (k_row, v_row) = if self.page_size == 0 {
            (key * self.k_token, key * self.v_token)
        } else {
            // A tile lies in one page (`page_size` is a multiple of the tile). A page number
            // past the cache is clamped to its last page, so that a bad table reads wrong keys
            // rather than outside the cache.
            let (slot, in_page) = div_rem(key, self.page_size);
            // SAFETY: `slot` < pages_per_seq: the keys fit the sequence's pages (host-checked).
            let page = (unsafe { *self.pages.add(slot) } as usize).min(self.num_pages - 1);
            (page * self.k_page + in_page * self.k_token, page * self.v_page + in_page * self.v_token)
        };
        // SAFETY: the row exists (the caller's contract and the host's checks).
        unsafe { (self.k.add(k_row), self.v.add(v_row), valid) }
    }

    #[inline(always)]
    fn row_strides(self) -> (usize, usize) {
        (self.k_token, self.v_token)
    }

    #[inline(always)]
    fn width(self) -> usize {
        self.width
    }
}

/// The packed query rows of a block: tile row `r` is packed row `row0 + r`, i.e. query
/// `t = (row0 + r) % seqlen_q` of the group's head `(row0 + r) / seqlen_q`.
#[derive(Clone, Copy)]
struct PackedRows {
    row0: usize,
    /// Packed rows of this block that exist (≤ 16).
    rows: usize,
    seqlen_q: usize,
}

impl PackedRows {
    /// The (head within the group, query) of tile row `r`.
    #[inline(always)]
    fn of(self, r: usize) -> (usize, usize) {
        div_rem(self.row0 + r, self.seqlen_q)
    }

    /// The smallest and largest query of the block's rows (a block that wraps from one head to
    /// the next holds query 0 and the last one).
    #[inline(always)]
    fn query_span(self) -> (usize, usize) {
        let (first, last) = (self.of(0), self.of(self.rows - 1));
        if first.0 == last.0 { (first.1, last.1) } else { (0, self.seqlen_q - 1) }
    }
}

/// The kernel body of every instance; `D_STEPS = HEAD_DIM / 16`, `D_TILES = HEAD_DIM / 8`.
///
/// Grid: `batch · num_heads_kv · row_blocks · num_splits` blocks in x (split fastest), with
/// `row_blocks = ceil(group · seqlen_q / 16)`; block: [`DECODE_THREADS`]; dynamic shared
/// memory: `layout::decode_smem_bytes(HEAD_DIM, STAGES)` bytes.
///
/// # Safety
/// The pointers and strides describe tensors of `shape` (16-bit elements of format `T`), with
/// every row 2-byte aligned and 16-byte aligned where its strides are multiples of 8; the keys
/// of every sequence fit its cache (its pages); with one split `o` and `lse` are written,
/// otherwise `o_partial` (`[num_splits, batch · num_heads_q · seqlen_q, decode_partial_stride]`) and
/// `lse_partial` (`[num_splits, batch · num_heads_q · seqlen_q]`); `score.sinks` is null or
/// holds `num_heads_q` floats; the launch has the grid, block and shared memory above.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn decode_forward<
    T: HalfFloat,
    const HEAD_DIM: usize,
    const STAGES: usize,
    const Q_IN_REGISTERS: bool,
    const D_STEPS: usize,
    const D_TILES: usize,
>(
    (q, k, v): (*const u16, *const u16, *const u16),
    (o, lse, o_partial, lse_partial): (*mut u16, *mut f32, *mut f32, *mut f32),
    (seqlens_k, block_table): (*const u32, *const u32),
    shape: DecodeShape,
    scale_log2: f32,
    score: ScoreArgs,
) {
    const { assert!(D_STEPS * 16 == HEAD_DIM && D_TILES * 8 == HEAD_DIM && STAGES >= 2) };
    const N_TILES: usize = DECODE_BLOCK_N / 8;
    let s = shape;
    let group = s.num_heads_q / s.num_heads_kv;
    let packed = group * s.seqlen_q;
    let row_blocks = packed.div_ceil(DECODE_BLOCK_M);
    let (rest, split) = div_rem(hw::block_idx().0, s.num_splits);
    let (rest, row_block) = div_rem(rest, row_blocks);
    let (b, kv_head) = div_rem(rest, s.num_heads_kv);
    let row0 = row_block * DECODE_BLOCK_M;
    let rows = PackedRows { row0, rows: DECODE_BLOCK_M.min(packed - row0), seqlen_q: s.seqlen_q };

    // This sequence's keys, and the mask in its coordinates: bottom-right aligns the diagonal
    // to the sequence's own length.
    let seqlen_k = if s.has_seqlens != 0 {
        // SAFETY: one length per sequence.
        ((unsafe { *seqlens_k.add(b) } as usize) + s.new_keys).min(s.capacity)
    } else {
        s.capacity
    };
    // A sliding window is aligned to the sequence's end, as decoding needs.
    let diagonal = seqlen_k as isize - s.seqlen_q as isize;
    let offset = if s.bottom_right != 0 { diagonal } else { 0 };
    let window = (s.window_left, s.window_right);
    let mask = Mask::banded(s.seqlen_q, seqlen_k, (s.causal != 0, offset), window, diagonal);
    // The keys the block's rows visit, as for a block of consecutive queries from its first
    // query to its last.
    let (first_query, last_query) = rows.query_span();
    let keys = mask.keys_for(first_query, last_query - first_query + 1);
    // The split's key tiles (counted from the first tile any row sees, left of which a window
    // hides everything), then this warp's share of them.
    let first_tile = keys.first_tile(DECODE_BLOCK_N);
    let tiles = keys.tiles(DECODE_BLOCK_N);
    let per_split = tiles.div_ceil(s.num_splits);
    let split_first = (split * per_split).min(tiles);
    let split_end = (split_first + per_split).min(tiles);
    let warp = hw::warp_id();
    let warp_tiles = (split_end.saturating_sub(split_first + warp)).div_ceil(DECODE_WARPS);

    let lane = FragmentLane::current();
    // The keys the lane's two rows see, `start .. start + width` (none for padding rows), and
    // their (head within the group, query).
    let row_of: [(usize, usize); 2] = core::array::from_fn(|h| rows.of(lane.half_row(h)));
    let band: ([usize; 2], [usize; 2]) = {
        let mut band = ([0; 2], [0; 2]);
        for h in 0..2 {
            if lane.half_row(h) < rows.rows {
                let query = row_of[h].1;
                band.0[h] = mask.key_start(query);
                band.1[h] = mask.key_limit(query).saturating_sub(band.0[h]);
            }
        }
        band
    };

    let stride = HEAD_DIM + MMA_SMEM_PAD;
    let mut smem = SharedMemory::new();
    let q_tile = smem.tile16(DECODE_BLOCK_M, stride);
    let warp_lse = smem.tile(DECODE_WARPS, DECODE_BLOCK_M);
    let rings = smem.tile16(DECODE_WARPS * decode_ring_rows(STAGES), stride);
    // After the key loop the rings' bytes hold the merge, every warp's weighted O in `f32`:
    // carved by a second walk that skips the same regions.
    let merge = {
        let mut again = SharedMemory::new();
        let _ = (again.tile16(DECODE_BLOCK_M, stride), again.tile(DECODE_WARPS, DECODE_BLOCK_M));
        again.tile(DECODE_WARPS * DECODE_BLOCK_M, HEAD_DIM + 4)
    };

    let kv_head_k = kv_head * s.k_head;
    let kv_head_v = kv_head * s.v_head;
    let (k_seq, v_seq, pages) = if s.page_size == 0 {
        (b * s.k_batch, b * s.v_batch, block_table)
    } else {
        // SAFETY: one row of the page table per sequence.
        (0, 0, unsafe { block_table.add(b * s.pages_per_seq) })
    };
    let source = CacheTiles {
        // SAFETY: the head's (or page 0's) first row exists.
        k: unsafe { k.add(k_seq + kv_head_k) },
        v: unsafe { v.add(v_seq + kv_head_v) },
        k_token: s.k_token,
        v_token: s.v_token,
        k_page: s.k_batch,
        v_page: s.v_batch,
        pages,
        page_size: s.page_size,
        num_pages: s.num_pages,
        width: s.head_dim,
        keys: keys.end,
        first: first_tile + split_first + warp,
        step: DECODE_WARPS,
    };
    let ring = KvRing::<DECODE_BLOCK_N, HEAD_DIM, STAGES, CacheTiles, WarpScope>::with_source(
        rings.rows_from(warp * decode_ring_rows(STAGES)),
        source,
        warp_tiles,
        WarpScope,
    );

    // Prologue: the block copies Q (one row per packed row, each from its own head), in the
    // first copy group of every thread, with its warp's first key tile.
    // SAFETY: the block's packed rows exist in Q.
    unsafe { copy_q_rows::<HEAD_DIM>(q_tile, q, (b, kv_head * group), rows, &s) };
    ring.prime();
    hw::cp_async_wait(STAGES - 2);
    hw::sync_threads();
    // A negative scale is −Q with |c|, a zero scale the smallest normal float (`positive_factor`).
    let (sign, c) = (q_sign_mask(scale_log2), positive_factor(scale_log2));
    let q_fragment = |ks: usize| -> FragA { q_tile.fragment_a(0, 16 * ks).map(|x| x ^ sign) };
    // Q stays in registers where the instance says so (`decode_tiles!`): at head_dim 256 its 64
    // registers go to O's 128, and a 3-blocks-an-SM instance needs them for its budget.
    let q_in_registers = Q_IN_REGISTERS;
    let mut q_frag = [[0u32; 4]; D_STEPS];
    if q_in_registers {
        q_frag = core::array::from_fn(q_fragment);
    }

    let mut softmax = RowSoftmax::new();
    let mut acc = [[0.0f32; 4]; D_TILES];
    for i in 0..warp_tiles {
        let (k_tile, v_tile) = ring.advance(i);
        let kv_start = (first_tile + split_first + warp + i * DECODE_WARPS) * DECODE_BLOCK_N;
        let mut s_frag = [[0.0f32; 4]; N_TILES];
        for ks in 0..D_STEPS {
            let q_ks = if q_in_registers { q_frag[ks] } else { q_fragment(ks) };
            for np in 0..N_TILES / 2 {
                let [b0, b1] = k_tile.fragments_b(16 * np, 16 * ks);
                s_frag[2 * np] = T::mma(q_ks, b0, s_frag[2 * np]);
                s_frag[2 * np + 1] = T::mma(q_ks, b1, s_frag[2 * np + 1]);
            }
        }
        // A score modification (softcap, ALiBi) turns the products into base-2 logits, each row
        // with its own head's modification; then the softmax's factor is 1.
        if score.is_active() {
            let mods: [ScoreMod; 2] = core::array::from_fn(|h| {
                score.for_head(kv_head * group + row_of[h].0, s.num_heads_q, s.seqlen_q, seqlen_k)
            });
            let query = [row_of[0].1, row_of[1].1];
            ScoreMod::apply_fragments_by_row(&mods, &mut s_frag, lane, query, kv_start, c);
        }
        // Only the tiles that cross some row's edge (the end of the keys, the causal diagonal
        // of the last seqlen_q keys, a window's edges) pay for the mask.
        if keys.needs_mask(kv_start, DECODE_BLOCK_N) {
            mask_columns(&mut s_frag, lane, f32::NEG_INFINITY, kv_start, band);
        }
        let alpha = softmax.update(&mut s_frag, score.softmax_factor(c));
        if hw::warp_any(alpha[0] != 1.0 || alpha[1] != 1.0) {
            scale_rows(&mut acc, alpha);
        }
        for kk in 0..N_TILES / 2 {
            let p = pack_a::<T>(s_frag[2 * kk], s_frag[2 * kk + 1]);
            for dp in 0..D_TILES / 2 {
                let [b0, b1] = v_tile.fragments_b_transposed(16 * kk, 16 * dp);
                acc[2 * dp] = T::mma(p, b0, acc[2 * dp]);
                acc[2 * dp + 1] = T::mma(p, b1, acc[2 * dp + 1]);
            }
        }
    }

    // Merge the warps by their LSE: each publishes its rows' LSE, then weighs its normalised O
    // by e^(LSE_w − LSE) into its slice of the merge tile (over the rings: every warp is past
    // its key loop after the barrier, and no copy is in flight — fetches past a warp's last
    // tile are empty groups).
    let (inv_sum, warp_row_lse) = softmax.finish(f32::NEG_INFINITY);
    if lane.t == 0 {
        for h in 0..2 {
            warp_lse.store(warp, lane.half_row(h), warp_row_lse[h]);
        }
    }
    hw::sync_threads();
    // An attention sink joins the merge once, as one more part (an LSE with no O): here with one
    // split, in `merge_splits` otherwise.
    let sink = |r: usize| -> f32 {
        if s.num_splits == 1 && r < rows.rows {
            // SAFETY: one sink per query head, or none.
            unsafe { score.natural_sink(kv_head * group + rows.of(r).0) }
        } else {
            f32::NEG_INFINITY
        }
    };
    let row_lse = |r: usize| -> f32 {
        let parts: [f32; DECODE_WARPS] = core::array::from_fn(|w| warp_lse.load(w, r));
        let sink = sink(r);
        let max = parts.iter().fold(sink, |m, &x| m.max(x));
        merged_lse(max, parts.iter().map(|&x| lse_weight(x, max)).sum::<f32>() + lse_weight(sink, max))
    };
    let weight: [f32; 2] = core::array::from_fn(|h| {
        let r = lane.half_row(h);
        inv_sum[h] * lse_weight(warp_row_lse[h], row_lse(r))
    });
    for (dt, frag) in acc.iter().enumerate() {
        for e in 0..4 {
            let (row, col) = lane.place((warp * DECODE_BLOCK_M, 0), dt, e);
            merge.store(row, col, frag[e] * weight[e / 2]);
        }
    }
    hw::sync_threads();

    // Sum the warps' slices and store: 4 columns a thread, rows at their heads' places.
    let tid = hw::thread_idx_x();
    let quads = HEAD_DIM / 4;
    let mut item = tid;
    while item < DECODE_BLOCK_M * quads {
        let (r, quad) = div_rem(item, quads);
        let col = 4 * quad;
        if r < rows.rows && col < s.head_dim {
            let mut sum = merge.load4(r, col);
            for w in 1..DECODE_WARPS {
                sum = sum.add_scaled(1.0, merge.load4(w * DECODE_BLOCK_M + r, col));
            }
            let (i, t) = rows.of(r);
            let head = kv_head * group + i;
            // SAFETY: the row exists in O / the partial tensors, and only columns below
            // head_dim are written.
            unsafe {
                if s.num_splits == 1 {
                    let dst = o.add(b * s.o_batch + t * s.o_token + head * s.o_head);
                    store4_half_clipped::<T>(sum, dst, col, s.head_dim);
                } else {
                    let row = ((split * s.batch + b) * s.num_heads_q + head) * s.seqlen_q + t;
                    sum.store(o_partial.add(row * decode_partial_stride(s.head_dim) + col));
                }
            }
        }
        item += DECODE_THREADS;
    }
    if tid < rows.rows {
        let (i, t) = rows.of(tid);
        let row = (b * s.num_heads_q + kv_head * group + i) * s.seqlen_q + t;
        let value = row_lse(tid);
        // SAFETY: the row exists in LSE / the partial LSE.
        unsafe {
            if s.num_splits == 1 {
                *lse.add(row) = value;
            } else {
                *lse_partial.add(split * s.batch * s.num_heads_q * s.seqlen_q + row) = value;
            }
        }
    }
}

/// Copies the block's packed Q rows into `q_tile` (zero past `head_dim` and past the block's
/// rows), as part of every thread's current copy group: tile row `r` is query `t` of head
/// `first_head + i`, where `(i, t) = rows.of(r)`. The rows of one block come from up to 16
/// heads at no common stride, so each row is its own copy, by 8 threads.
///
/// # Safety
/// The rows exist in `q` at the strides of `shape`.
#[inline(always)]
unsafe fn copy_q_rows<const HEAD_DIM: usize>(
    q_tile: hw::SharedTile16,
    q: *const u16,
    (b, first_head): (usize, usize),
    rows: PackedRows,
    shape: &DecodeShape,
) {
    const { assert!(DECODE_THREADS == DECODE_BLOCK_M * 8) };
    let (r, part) = div_rem(hw::thread_idx_x(), 8);
    let valid = r < rows.rows;
    let (i, t) = if valid { rows.of(r) } else { (0, 0) };
    // SAFETY: a valid row exists; an invalid one is zero-filled without reading.
    unsafe {
        let src = q.add(b * shape.q_batch + t * shape.q_token + (first_head + i) * shape.q_head);
        q_tile.rows_from(r).copy_rows_async_strided(
            src,
            shape.head_dim,
            1,
            HEAD_DIM,
            shape.head_dim,
            valid as usize,
            (part, 8),
        );
    }
}

/// Merges the splits of every query row by their LSE (see the module docs): O in format `T` at
/// its strides, LSE `[batch, num_heads_q, seqlen_q]`. One thread per row and 4 columns
/// (`DECODE_MERGE_COLUMNS`): each reads the row's split LSEs (the same for the row's threads, so
/// they come from L1 after the first), then the splits' columns, loads that do not wait for each
/// other. (A warp a row, looping over the splits, left the GPU nearly idle: PERFORMANCE.md.)
///
/// # Safety
/// `o_partial`, `lse_partial` are what the decoder wrote for `shape` with `shape.num_splits`
/// splits; O's rows exist at their strides; `sinks.sinks` is null or holds `num_heads_q` floats; the grid covers `query_rows · ceil(head_dim / 4)`
/// threads in blocks of `DECODE_MERGE_THREADS`.
#[inline(always)]
unsafe fn merge_splits<T: HalfFloat>(
    o_partial: *const f32,
    lse_partial: *const f32,
    o: *mut u16,
    lse: *mut f32,
    sinks: ScoreArgs,
    shape: DecodeShape,
) {
    let s = shape;
    let n = s.query_rows();
    let quads = s.head_dim.div_ceil(DECODE_MERGE_COLUMNS);
    let item = hw::block_idx().0 * DECODE_MERGE_THREADS + hw::thread_idx_x();
    if item >= n * quads {
        return;
    }
    let (row, quad) = div_rem(item, quads);
    let col = DECODE_MERGE_COLUMNS * quad;
    // SAFETY (every read below): split `p`'s row exists in the partial tensors.
    let part_lse = |p: usize| unsafe { *lse_partial.add(p * n + row) };
    let (bh, t) = div_rem(row, s.seqlen_q);
    let (b, head) = div_rem(bh, s.num_heads_q);
    // The row's attention sink, one more part with no O (see the decoder's block merge).
    // SAFETY: one sink per query head, or none.
    let sink = unsafe { sinks.natural_sink(head) };
    let mut max = sink;
    for p in 0..s.num_splits {
        max = max.max(part_lse(p));
    }
    let mut sum = lse_weight(sink, max);
    for p in 0..s.num_splits {
        sum += lse_weight(part_lse(p), max);
    }
    let total = merged_lse(max, sum);
    let mut acc = F32x4::ZERO;
    for p in 0..s.num_splits {
        let weight = lse_weight(part_lse(p), total);
        // SAFETY: the row's four columns (past head_dim: the stride's padding), 16-byte aligned.
        let value = unsafe { F32x4::load(o_partial.add((p * n + row) * decode_partial_stride(s.head_dim) + col)) };
        acc = acc.add_scaled(weight, value);
    }
    // SAFETY: O's row exists at its strides; columns below head_dim only.
    unsafe { store4_half_clipped::<T>(acc, o.add(b * s.o_batch + t * s.o_token + head * s.o_head), col, s.head_dim) };
    if quad == 0 {
        // SAFETY: one LSE per query row.
        unsafe { *lse.add(row) = total };
    }
}

/// Appends new K and V rows to the cache before a decoding step: row `t` of `k_new`, `v_new`
/// (`[batch, seqlen_new, num_heads_kv, head_dim]` at the strides `new_batch`, `new_token`,
/// `new_head`) goes to token `seqlens_k[b] + t` of sequence `b` (a page of it when paged); rows
/// past the cache's capacity are dropped (the host sizes the cache). A grid-stride loop over the
/// elements.
///
/// # Safety
/// The tensors have the shapes and strides above and in `shape`; `seqlens_k` has `batch`
/// entries, the page table `batch · pages_per_seq`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn append_kv(
    (k_new, v_new): (*const u16, *const u16),
    (k_cache, v_cache): (*mut u16, *mut u16),
    (seqlens_k, block_table): (*const u32, *const u32),
    (new_batch, new_token, new_head): (usize, usize, usize),
    shape: DecodeShape,
) {
    let s = shape;
    let d = s.head_dim;
    let total = s.batch * s.new_keys * s.num_heads_kv * d;
    let mut index = hw::block_idx().0 * hw::block_dim_x() + hw::thread_idx_x();
    let step = hw::grid_dim_x() * hw::block_dim_x();
    while index < total {
        let (rest, col) = div_rem(index, d);
        let (rest, head) = div_rem(rest, s.num_heads_kv);
        let (b, t) = div_rem(rest, s.new_keys);
        // SAFETY: one length per sequence.
        let token = unsafe { *seqlens_k.add(b) } as usize + t;
        if token < s.capacity {
            let (k_row, v_row) = if s.page_size == 0 {
                (b * s.k_batch + token * s.k_token, b * s.v_batch + token * s.v_token)
            } else {
                let (slot, in_page) = div_rem(token, s.page_size);
                // SAFETY: token < capacity = pages_per_seq · page_size; pages clamped as in
                // the decoder.
                let page = (unsafe { *block_table.add(b * s.pages_per_seq + slot) } as usize).min(s.num_pages - 1);
                (page * s.k_batch + in_page * s.k_token, page * s.v_batch + in_page * s.v_token)
            };
            let src = b * new_batch + t * new_token + head * new_head + col;
            // SAFETY: the element exists in the new rows and in the cache.
            unsafe {
                *k_cache.add(k_row + head * s.k_head + col) = *k_new.add(src);
                *v_cache.add(v_row + head * s.v_head + col) = *v_new.add(src);
            }
        }
        index += step;
    }
}

/// The decoder's kernel parameters after its pointers, in [`DecodeShape`]'s field order, and the
/// struct rebuilt from them.
macro_rules! decode_kernel {
    (
        $(#[$attr:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) |$shape:ident| $body:block
    ) => {
        kernel! {
        $(#[$attr])*
        pub unsafe fn $name(
            $($arg: $ty,)*
            batch: usize, num_heads_q: usize, num_heads_kv: usize, seqlen_q: usize, head_dim: usize,
            capacity: usize, has_seqlens: usize, new_keys: usize, causal: usize, bottom_right: usize,
            num_splits: usize, q_batch: usize, q_token: usize, q_head: usize, o_batch: usize,
            o_token: usize, o_head: usize, k_batch: usize, k_token: usize, k_head: usize,
            v_batch: usize, v_token: usize, v_head: usize, page_size: usize, pages_per_seq: usize,
            num_pages: usize, window_left: usize, window_right: usize,
        ) {
            let $shape = DecodeShape {
                batch, num_heads_q, num_heads_kv, seqlen_q, head_dim, capacity, has_seqlens, new_keys,
                causal, bottom_right, num_splits, q_batch, q_token, q_head, o_batch, o_token, o_head,
                k_batch, k_token, k_head, v_batch, v_token, v_head, page_size, pages_per_seq, num_pages,
                window_left, window_right,
            };
            $body
        }
        }
    };
}

/// One decoder per format, compiled head_dim and ring depth, `decode_fwd_{f16,bf16}_d{head_dim}_s{stages}`
/// (every instance runs the head dims up to its own), and the merge per format; `decode_tiles!` (in
/// [`crate::configs`]) lists them.
macro_rules! decode_instance {
    ($dtype:ident, $format:ident, $head_dim:literal, $stages:literal, $q_regs:literal) => {
        pastey::paste! {
            decode_kernel! {
            /// The split-KV decoder; see the module docs and `decode_forward`.
            ///
            /// # Safety
            /// As `decode_forward`.
            fn [<decode_fwd_ $dtype _d $head_dim _s $stages>](
                q: *const u16,
                k: *const u16,
                v: *const u16,
                o: *mut u16,
                lse: *mut f32,
                o_partial: *mut f32,
                lse_partial: *mut f32,
                seqlens_k: *const u32,
                block_table: *const u32,
                scale_log2: f32,
                softcap: f32,
                alibi_max_bias: f32,
                sinks: *const f32,
            ) |shape| {
                let score = ScoreArgs::without_bias(softcap, alibi_max_bias, sinks);
                unsafe {
                    decode_forward::<hw::$format, $head_dim, $stages, $q_regs, { $head_dim / 16 }, { $head_dim / 8 }>(
                        (q, k, v), (o, lse, o_partial, lse_partial), (seqlens_k, block_table), shape, scale_log2, score,
                    )
                }
            }
            }
        }
    };
    (merge $dtype:ident, $format:ident) => {
        pastey::paste! {
            decode_kernel! {
            /// Merges the decoder's splits; see `merge_splits`.
            ///
            /// # Safety
            /// As `merge_splits`.
            fn [<decode_merge_ $dtype>](
                o_partial: *const f32,
                lse_partial: *const f32,
                o: *mut u16,
                lse: *mut f32,
                sinks: *const f32,
            ) |shape| {
                let sinks = ScoreArgs::without_bias(0.0, 0.0, sinks);
                unsafe { merge_splits::<hw::$format>(o_partial, lse_partial, o, lse, sinks, shape) }
            }
            }
        }
    };
}

decode_tiles!(decode_instance);
decode_instance!(merge f16, F16);
decode_instance!(merge bf16, Bf16);

decode_kernel! {
/// Appends new K/V rows to the cache; see `append_kv`. 16-bit elements of either format.
///
/// # Safety
/// As `append_kv`.
fn decode_append_kv(
    k_new: *const u16,
    v_new: *const u16,
    k_cache: *mut u16,
    v_cache: *mut u16,
    seqlens_k: *const u32,
    block_table: *const u32,
    new_batch: usize,
    new_token: usize,
    new_head: usize,
) |shape| {
    unsafe {
        append_kv((k_new, v_new), (k_cache, v_cache), (seqlens_k, block_table), (new_batch, new_token, new_head), shape)
    }
}
}
