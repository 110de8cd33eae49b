//! Which block works on what, and in which order: the grid of every tier mapped to its work.
//!
//! * Q-outer kernels (every forward, the deterministic dQ): a block owns query rows of one query
//!   head, [`QueryBlock`]. The plain grid is `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`
//!   ([`QueryBlock::current`]); the Hopper forward balances and reorders it
//!   ([`ForwardOrder`], [`BalancedRows`], [`PersistentUnits`]).
//! * K/V-outer kernels (dK, dV): a block owns keys of one key/value head and visits the query
//!   tiles of every query head of its group, [`KeyBlock`]. The plain grid is
//!   `(ceil(seqlen_k / BLOCK_N), num_heads_kv, batch)` ([`KeyBlock::current`]); the Hopper
//!   backward reorders it under a causal mask ([`KeyBlock::hopper_backward`]).
//!
//! Both reorderings follow one policy, *longest first by L2 sections* ([`by_sections`]): the GPU
//! starts blocks in the order of their linear index (`x + gridDim.x · (y + gridDim.y · z)`), so
//! the index is mapped to work such that the longest blocks start first and short ones fill the
//! SMs at the end (the "longest processing time first" rule FlashAttention-3's scheduler
//! follows), and heads go in sections whose shared operands fit in the L2 ([`L2_BYTES`]) while
//! the section's blocks run. A persistent grid ([`PersistentUnits`], the Hopper forward's) takes
//! its units in the same order, round by round.

use crate::attention::mask::Mask;
use crate::hw;
use crate::layout::{AttentionShape, div_rem};

/// The L2 size the schedules plan for: the H200's 60 MB, rounded to 64 MiB.
pub const L2_BYTES: usize = 64 << 20;

/// Bytes of K and V that one section of heads of a causal Hopper forward grid may read: a
/// quarter of [`L2_BYTES`], so that a section's K and V stay in L2 next to the Q tiles and
/// outputs streaming through it (PERFORMANCE.md has the measurements behind the fraction).
pub const FORWARD_SECTION_BYTES: usize = L2_BYTES / 4;

/// Bytes of Q, dO (16-bit) and the `f32` dQ that one section of key/value heads of a causal
/// Hopper backward grid reads: all of [`L2_BYTES`] (PERFORMANCE.md).
pub const BACKWARD_SECTION_BYTES: usize = L2_BYTES;

/// Heads per section when each head's blocks share `bytes_per_head` bytes that should stay in
/// L2 and a section may fill `section_bytes` (at least one head: [`by_sections`] clamps).
#[inline(always)]
pub fn heads_per_section(section_bytes: usize, bytes_per_head: usize) -> usize {
    section_bytes / bytes_per_head.max(1)
}

/// The query rows a block of a Q-outer kernel (the forward pass, the deterministic dQ) owns:
/// rows `q_start .. q_start + q_rows` of query head `head` of batch `batch`.
#[derive(Clone, Copy)]
pub struct QueryBlock {
    pub q_start: usize,
    /// Rows of the tile that exist: `BLOCK_M`, or fewer for the last tile of a head.
    pub q_rows: usize,
    pub head: usize,
    pub batch: usize,
    /// Offset (in elements) of the head's first row in Q, O, dO and dQ.
    pub q_offset: usize,
    /// Offset (in elements) of its key/value head's first row in K and V.
    pub kv_offset: usize,
}

impl QueryBlock {
    /// This block's rows in the plain grid `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`.
    #[inline(always)]
    pub fn current<const BLOCK_M: usize>(shape: &AttentionShape) -> Self {
        let (q_block, head, batch) = hw::block_idx();
        let q_start = q_block * BLOCK_M;
        Self::new(shape, q_start, BLOCK_M.min(shape.seqlen_q - q_start), head, batch)
    }

    #[inline(always)]
    fn new(shape: &AttentionShape, q_start: usize, q_rows: usize, head: usize, batch: usize) -> Self {
        Self {
            q_start,
            q_rows,
            head,
            batch,
            q_offset: shape.q_head_offset(batch, head),
            kv_offset: shape.kv_head_offset(batch, head),
        }
    }

    /// Offset (in elements) of this block's first row in Q-shaped tensors, with rows of
    /// `head_dim` elements (the problem's; a kernel passes its constant where they agree, see
    /// `layout::row_length`).
    #[inline(always)]
    pub fn first_row_offset(&self, head_dim: usize) -> usize {
        self.q_offset + self.q_start * head_dim
    }
}

/// The work units of the Hopper forward, query blocks of every head, in the order its grid takes
/// them ([`ForwardOrder::block`]); computed once per kernel, as the blocks take several units
/// ([`PersistentUnits`]).
#[derive(Clone, Copy)]
pub struct ForwardOrder<const BLOCK_M: usize> {
    rows: BalancedRows<BLOCK_M>,
    /// Query heads of the problem, `batch · num_heads_q`.
    heads: usize,
    /// Heads per L2 section under a causal mask.
    section: Option<usize>,
}

impl<const BLOCK_M: usize> ForwardOrder<BLOCK_M> {
    #[inline(always)]
    pub fn new(shape: &AttentionShape, causal: bool) -> Self {
        // K and V of one head, 16-bit values (GQA heads that share them are counted apart).
        let section = causal.then(|| heads_per_section(FORWARD_SECTION_BYTES, 4 * shape.seqlen_k * shape.head_dim));
        Self { rows: BalancedRows::new(shape.seqlen_q), heads: shape.num_heads_q * shape.batch, section }
    }

    /// Units in all: query blocks per head times heads.
    #[inline(always)]
    pub fn units(&self) -> usize {
        self.rows.blocks * self.heads
    }

    /// The query block of unit `unit` (`0 .. units()`). The order differs from the plain grid's
    /// ([`QueryBlock::current`]) in two ways, both to shorten the grid's last wave:
    ///
    /// * **Balanced blocks** ([`BalancedRows`]): a head's rows are split into as many blocks as
    ///   with `BLOCK_M` rows each, but the rows missing from the last block are taken one
    ///   warpgroup (64 rows) at a time from the last few blocks. At 4096 rows and block_m 192 a
    ///   head has 20 blocks of 192 rows and 2 of 128 instead of 21 and one of 64: no SM is left
    ///   with an eleventh full block while others idle.
    /// * **Longest first** (see the module docs). Without a mask every head's full blocks come
    ///   first, head by head, then the short ones. Under a causal mask a block's length grows
    ///   with its query rows: the heads are taken in sections whose K and V fit in
    ///   [`FORWARD_SECTION_BYTES`], and within a section the last query block of every head comes
    ///   first, then the one before it, and so on.
    ///
    #[inline(always)]
    pub fn block(&self, shape: &AttentionShape, unit: usize) -> QueryBlock {
        let (q_block, head_index) = self.rows.longest_first(unit, self.heads, self.section);
        let (q_start, q_rows) = self.rows.block(q_block);
        let (batch, head) = div_rem(head_index, shape.num_heads_q);
        QueryBlock::new(shape, q_start, q_rows, head, batch)
    }
}

/// What a block of a K/V-outer kernel (dK, dV) works on: keys `k_start .. k_start + k_rows` of
/// key/value head `kv_head` of batch `batch`, and the query tiles of `BLOCK_M` rows that it
/// visits in every query head of the group.
#[derive(Clone, Copy)]
pub struct KeyBlock {
    /// First key of the block.
    pub k_start: usize,
    /// Keys of the block that exist: `BLOCK_N`, or fewer for the last block of a head.
    pub k_rows: usize,
    pub batch: usize,
    pub kv_head: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// The first query that sees a key of the block (causal masks skip the ones before).
    pub first_query: usize,
    /// The end of the queries that see a key of the block (a window's left edge skips the
    /// ones from it on; `seqlen_q` without one). No query sees the block if it is at most
    /// `first_query`.
    pub query_end: usize,
    /// The query tiles of `BLOCK_M` rows that hold those queries, `first_tile .. end_tile`,
    /// and the number of query tiles of a head.
    pub first_tile: usize,
    pub end_tile: usize,
    pub tiles: usize,
}

impl KeyBlock {
    /// This block's keys in the plain grid `(ceil(seqlen_k / BLOCK_N), num_heads_kv, batch)`.
    #[inline(always)]
    pub fn current<const BLOCK_M: usize, const BLOCK_N: usize>(shape: &AttentionShape, mask: &Mask) -> Self {
        let (block, kv_head, batch) = hw::block_idx();
        Self::new::<BLOCK_M, BLOCK_N>(shape, mask, block, kv_head, batch)
    }

    /// This block's keys in the Hopper backward's grid. Under a causal mask the first key blocks
    /// are seen by the most query tiles: the grid launches them first (longest first, see the
    /// module docs), by sections of key/value heads whose Q, dO and `f32` dQ add up to
    /// [`BACKWARD_SECTION_BYTES`]; with `shortest_first` (the deterministic backward under a
    /// causal mask) each section runs its key blocks in the opposite order, last key block first.
    /// Without a mask it is the plain grid.
    #[inline(always)]
    pub fn hopper_backward<const BLOCK_M: usize, const BLOCK_N: usize>(
        shape: &AttentionShape,
        mask: &Mask,
        shortest_first: bool,
    ) -> Self {
        let (x, y, z) = hw::block_idx();
        let (block, kv_head, batch) = if mask.causal {
            let blocks = shape.seqlen_k.div_ceil(BLOCK_N);
            let heads = shape.num_heads_kv * shape.batch;
            let linear = x + blocks * (y + shape.num_heads_kv * z);
            let head_bytes = (2 + 2 + 4) * shape.seqlen_q * shape.head_dim * shape.group_size();
            let (rank, head) =
                by_sections(linear, blocks, heads, heads_per_section(BACKWARD_SECTION_BYTES, head_bytes));
            let (batch, kv_head) = div_rem(head, shape.num_heads_kv);
            (if shortest_first { blocks - 1 - rank } else { rank }, kv_head, batch)
        } else {
            (x, y, z)
        };
        Self::new::<BLOCK_M, BLOCK_N>(shape, mask, block, kv_head, batch)
    }

    /// Key block `block` of head 0, for the host's tests of the schedule.
    #[cfg(not(target_arch = "nvptx64"))]
    pub fn new_for_tests<const BLOCK_M: usize, const BLOCK_N: usize>(
        shape: &AttentionShape,
        mask: &Mask,
        block: usize,
    ) -> Self {
        Self::new::<BLOCK_M, BLOCK_N>(shape, mask, block, 0, 0)
    }

    #[inline(always)]
    fn new<const BLOCK_M: usize, const BLOCK_N: usize>(
        shape: &AttentionShape,
        mask: &Mask,
        block: usize,
        kv_head: usize,
        batch: usize,
    ) -> Self {
        let k_start = block * BLOCK_N;
        let k_rows = BLOCK_N.min(shape.seqlen_k - k_start);
        // The caller's mask is the problem's; this block's batch entry may have a band table.
        let mask = mask.for_batch(batch);
        let first_query = mask.first_query_seeing(k_start);
        let query_end = mask.query_end_seeing(k_start + k_rows - 1);
        // A block that no query sees visits no tile (not the tile that holds row `seqlen_q`,
        // whose rows would all be masked, and whose dQ it would then add to in some turn).
        let (first_tile, end_tile) =
            if first_query < query_end { (first_query / BLOCK_M, query_end.div_ceil(BLOCK_M)) } else { (0, 0) };
        Self {
            k_start,
            k_rows,
            batch,
            kv_head,
            group: shape.group_size(),
            first_query,
            query_end,
            first_tile,
            end_tile,
            tiles: shape.seqlen_q.div_ceil(BLOCK_M),
        }
    }

    /// Offset (in elements) of the block's first key in K, V, dK and dV (all of K's layout).
    #[inline(always)]
    pub fn first_row_offset(&self, shape: &AttentionShape, head_dim: usize) -> usize {
        ((self.batch * shape.num_heads_kv + self.kv_head) * shape.seqlen_k + self.k_start) * head_dim
    }

    /// Query tiles visited per query head: tiles `first_tile .. end_tile`.
    #[inline(always)]
    pub fn tiles_per_head(&self) -> usize {
        self.end_tile - self.first_tile
    }

    /// Query tiles visited in all: [`Self::tiles_per_head`] for each head of the group.
    #[inline(always)]
    pub fn steps(&self) -> usize {
        self.group * self.tiles_per_head()
    }

    /// The query head and query tile of the `step`-th tile the block visits (head by head).
    #[inline(always)]
    pub fn step(&self, step: usize) -> (usize, usize) {
        // 32-bit ([`div_rem`]): this runs once or twice per query tile, in every K/V-outer kernel.
        let (head_in_group, tile) = div_rem(step, self.tiles_per_head());
        (self.kv_head * self.group + head_in_group, self.first_tile + tile)
    }
}

// ANCHOR: persistent_units
/// The work units one block of a *persistent* grid takes (FlashAttention-3's forward on Hopper
/// runs this way): a one-dimensional grid of `G` blocks, at most as many as fit on the GPU at
/// once, goes through `units` work units. Block `b` takes unit `b` first; after that, either
///
/// * **static** (no counter): round `r` gives block `b` unit `r · G + b` when `r` is even and
///   `r · G + (G − 1 − b)` when it is odd (a *snake* order). Each round covers its `G` places
///   once, so every unit goes to exactly one block. For units of one length (no mask) that is
///   all it takes, with no shared state;
/// * **dynamic** (a counter in device memory, zero at launch): a block that starts a unit draws
///   the ticket for its next one, `G +` the counter's old value (an atomic add), so units go to
///   whichever block is free first, in the order they are numbered. Where units come longest
///   first (the causal forward) that is the "longest processing time first" list schedule,
///   within a unit of the best (FlashAttention-3's dynamic scheduler works so); the snake is
///   not: the causal order is longest first only within an L2 section of heads, and where a
///   round straddles two sections the long units of the next one pile onto the same blocks. The
///   ticket is drawn a unit ahead, so its latency hides behind the unit's work.
///
/// Why persistent: a block that stays resident overlaps the next unit's loads (Q, the first K/V
/// tiles) with the current one's last products and its epilogue, which a block that ends cannot.
/// With `G = units` (one unit per block) it is the plain grid, in the same order.
#[derive(Clone, Copy)]
pub struct PersistentUnits {
    /// This block, and the blocks of the grid.
    block: usize,
    blocks: usize,
    units: usize,
    round: usize,
    /// The grid's ticket counter (dynamic), or null (static).
    counter: *mut u32,
    /// Dynamic: the unit this block takes next, drawn when it took the current one.
    ticket: usize,
}

impl PersistentUnits {
    /// This block's units of `units` in all (grid `(G, 1, 1)`): dynamic with the ticket counter
    /// `counter` (a `u32` in device memory, zero at launch, one per grid), static when it is null.
    #[inline(always)]
    pub fn current(units: usize, counter: *mut u32) -> Self {
        Self::of_block(hw::block_idx().0, hw::grid_dim_x(), units, counter)
    }

    /// The units of block `block` of a grid of `blocks` (dynamic or static as in `current`).
    #[inline(always)]
    pub fn of_block(block: usize, blocks: usize, units: usize, counter: *mut u32) -> Self {
        Self { block, blocks, units, round: 0, counter, ticket: 0 }
    }
}

impl Iterator for PersistentUnits {
    type Item = usize;

    #[inline(always)]
    fn next(&mut self) -> Option<usize> {
        let unit = if self.round == 0 {
            self.block
        } else if self.counter.is_null() {
            let place = if self.round.is_multiple_of(2) { self.block } else { self.blocks - 1 - self.block };
            self.round * self.blocks + place
        } else {
            self.ticket
        };
        if !self.counter.is_null() && unit < self.units {
            // SAFETY: a dynamic grid's counter (see `current`).
            self.ticket = self.blocks + unsafe { hw::atomic_fetch_add_u32(self.counter, 1) } as usize;
        }
        self.round += 1;
        // A unit past the end ends the block: later rounds (or tickets) would be further past it.
        (unit < self.units).then_some(unit)
    }
}
// ANCHOR_END: persistent_units

/// Block `linear` of a grid of `blocks` blocks per head over `heads` heads, taken in sections of
/// `section` heads (at least one) and, within a section, rank by rank: rank 0 of every head of the
/// section, then rank 1, and so on. Returns the rank and the head. A one-to-one map of
/// `0 .. blocks · heads`; a kernel whose blocks are longer at lower ranks launches them longest
/// first with it, section by section, so that a section's shared operands stay in L2 while it runs.
#[inline(always)]
pub fn by_sections(linear: usize, blocks: usize, heads: usize, section: usize) -> (usize, usize) {
    let section = section.clamp(1, heads);
    let (index, within) = div_rem(linear, section * blocks);
    let heads_here = section.min(heads - index * section);
    let (rank, head) = div_rem(within, heads_here);
    (rank, index * section + head)
}
/// A head's `seqlen_q` rows split into `ceil(seqlen_q / BLOCK_M)` blocks whose sizes differ by
/// at most one warpgroup's 64 rows: the first `full` blocks have `BLOCK_M` rows and the rest
/// `BLOCK_M − 64` (the very last block may have fewer, down to 1).
#[derive(Clone, Copy)]
pub struct BalancedRows<const BLOCK_M: usize> {
    /// Rows of the head.
    pub seqlen_q: usize,
    /// Blocks per head.
    pub blocks: usize,
    /// Blocks of `BLOCK_M` rows, the first ones.
    pub full: usize,
}

impl<const BLOCK_M: usize> BalancedRows<BLOCK_M> {
    /// Rows per consumer warpgroup, the unit a block gives up.
    const UNIT: usize = 64;

    #[inline(always)]
    pub fn new(seqlen_q: usize) -> Self {
        let blocks = seqlen_q.div_ceil(BLOCK_M);
        // Warpgroup-sized pieces the blocks hold beyond the rows: fewer than BLOCK_M / 64, so at
        // most one per block once there are two blocks or more (a single block is simply cut at
        // seqlen_q).
        let missing = blocks * (BLOCK_M / Self::UNIT) - seqlen_q.div_ceil(Self::UNIT);
        Self { seqlen_q, blocks, full: blocks.saturating_sub(missing) }
    }

    /// The query block and the head (`batch · num_heads_q + head`) of block `linear` of a grid
    /// over `heads` heads, longest first (see [`ForwardOrder::block`]): without a mask
    /// (`causal_section` `None`) every head's full blocks, head by head, then the short ones;
    /// under a causal mask, sections of `causal_section` heads (at least one), and within each
    /// the heads' last query blocks, then the ones before them, and so on. A one-to-one map of
    /// `0 .. blocks · heads` onto the grid's work.
    #[inline(always)]
    pub fn longest_first(self, linear: usize, heads: usize, causal_section: Option<usize>) -> (usize, usize) {
        if let Some(section) = causal_section {
            let (rank, head) = by_sections(linear, self.blocks, heads, section);
            (self.blocks - 1 - rank, head)
        } else if linear < self.full * heads {
            let (head, q_block) = div_rem(linear, self.full);
            (q_block, head)
        } else {
            let (rest, short) = (linear - self.full * heads, self.blocks - self.full);
            let (head, q_block) = div_rem(rest, short);
            (self.full + q_block, head)
        }
    }

    /// The first row and the number of rows of block `q_block`.
    #[inline(always)]
    pub fn block(self, q_block: usize) -> (usize, usize) {
        let start = q_block * BLOCK_M - Self::UNIT * q_block.saturating_sub(self.full);
        let span = if q_block < self.full { BLOCK_M } else { BLOCK_M - Self::UNIT };
        (start, span.min(self.seqlen_q - start))
    }
}
