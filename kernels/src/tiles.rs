//! Block-level tile math of the `f32` FlashAttention kernels (forward and backward), and what
//! every FlashAttention kernel uses: the causal mask ([`Mask`]) and a block's query rows
//! ([`QueryBlock`]).
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

use crate::gpu::{self, F32x4, SharedTile};
use crate::layout::{AttentionShape, FLASH_THREAD_COLS as LANES, FLASH_THREADS};

/// The query rows a block of a Q-outer kernel (the forward pass, the deterministic dQ) owns:
/// rows `q_start .. q_start + q_rows` of query head `head` of batch `batch`. The grid is
/// `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`.
#[derive(Clone, Copy)]
pub struct QueryBlock {
    pub q_start: usize,
    /// Rows of the tile that exist: `BLOCK_M`, or fewer for the last tile of a head.
    pub q_rows: usize,
    pub head: usize,
    pub batch: usize,
    /// Offset (in floats) of the head's first row in Q, O, dO and dQ.
    pub q_offset: usize,
    /// Offset (in floats) of its key/value head's first row in K and V.
    pub kv_offset: usize,
}

impl QueryBlock {
    /// This block's rows.
    #[inline(always)]
    pub fn current<const BLOCK_M: usize>(shape: &AttentionShape) -> Self {
        let (q_block, head, batch) = gpu::block_idx();
        let q_start = q_block * BLOCK_M;
        Self::new(shape, q_start, BLOCK_M.min(shape.seqlen_q - q_start), head, batch)
    }

    /// This block's rows in the Hopper forward's grid, which differs from [`Self::current`] in
    /// two ways, both to shorten the grid's last wave:
    ///
    /// * **Balanced blocks** ([`BalancedRows`]): a head's rows are split into as many blocks as
    ///   with `BLOCK_M` rows each, but the rows missing from the last block are taken one
    ///   warpgroup (64 rows) at a time from the last few blocks. At 4096 rows and block_m 192 a
    ///   head has 20 blocks of 192 rows and 2 of 128 instead of 21 and one of 64: no SM is left
    ///   with an eleventh full block while others idle.
    /// * **Longest first** (the "longest processing time first" rule FlashAttention-3's
    ///   scheduler follows). The GPU starts blocks in the order of their linear index
    ///   (`x + gridDim.x · (y + gridDim.y · z)`), so the index is mapped to work so that the
    ///   longest blocks start first and short ones fill the SMs at the end. Without a mask every
    ///   head's full blocks come first, head by head, then the short ones. Under a causal mask a
    ///   block's length grows with its query rows: the heads are taken in sections whose K and V
    ///   fit in [`L2_SECTION_BYTES`], and within a section the last query block of every head
    ///   comes first, then the one before it, and so on.
    #[inline(always)]
    pub fn hopper_forward<const BLOCK_M: usize>(shape: &AttentionShape, causal: bool) -> Self {
        let rows = BalancedRows::<BLOCK_M>::new(shape.seqlen_q);
        let (x, y, z) = gpu::block_idx();
        let linear = x + rows.blocks * (y + shape.num_heads_q * z);
        let heads = shape.num_heads_q * shape.batch;
        // K and V of one head, 16-bit values (GQA heads that share them are counted apart).
        let section = causal.then(|| L2_SECTION_BYTES / (4 * shape.seqlen_k * shape.head_dim).max(1));
        let (q_block, head_index) = rows.longest_first(linear, heads, section);
        let (q_start, q_rows) = rows.block(q_block);
        Self::new(shape, q_start, q_rows, head_index % shape.num_heads_q, head_index / shape.num_heads_q)
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

    /// Offset (in floats) of this block's first row in Q-shaped tensors.
    #[inline(always)]
    pub fn first_row_offset(&self, head_dim: usize) -> usize {
        self.q_offset + self.q_start * head_dim
    }
}

/// Bytes of K and V that one section of heads of a causal Hopper forward grid may read
/// ([`QueryBlock::hopper_forward`]): about a quarter of the H200's 60 MB L2, so that a section's
/// K and V stay there while its blocks run. Measured on the H200 against one section of
/// all heads: +5 % on 2 × 16 × 8192 × 128 (128 MB of K and V), −2 % on 4 × 16 × 4096 × 64 (64 MB).
pub const L2_SECTION_BYTES: usize = 16 << 20;

/// Block `linear` of a grid of `blocks` blocks per head over `heads` heads, taken in sections of
/// `section` heads (at least one) and, within a section, rank by rank: rank 0 of every head of the
/// section, then rank 1, and so on. Returns the rank and the head. A one-to-one map of
/// `0 .. blocks · heads`; a kernel whose blocks are longer at lower ranks launches them longest
/// first with it, section by section, so that a section's K and V stay in L2 while it runs.
#[inline(always)]
pub fn by_sections(linear: usize, blocks: usize, heads: usize, section: usize) -> (usize, usize) {
    let section = section.clamp(1, heads);
    let (index, within) = (linear / (section * blocks), linear % (section * blocks));
    let heads_here = section.min(heads - index * section);
    (within / heads_here, index * section + within % heads_here)
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
    /// over `heads` heads, longest first (see [`QueryBlock::hopper_forward`]): without a mask
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
            (linear % self.full, linear / self.full)
        } else {
            let (rest, short) = (linear - self.full * heads, self.blocks - self.full);
            (self.full + rest % short, rest / short)
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

/// Replaces the contents of two `ROWS × COLS` tiles with rows from global memory (rows past
/// `valid_rows` zero-filled), between the two block barriers every tile loop needs: the first
/// waits until no thread still reads the old contents, the second publishes the new ones.
///
/// # Safety
/// `a_src` and `b_src` point to `valid_rows · COLS` readable floats, 16-byte aligned; every
/// thread of the block calls this together.
#[inline(always)]
pub unsafe fn refill_tiles<const ROWS: usize, const COLS: usize>(
    a: SharedTile,
    a_src: *const f32,
    b: SharedTile,
    b_src: *const f32,
    valid_rows: usize,
) {
    gpu::sync_threads();
    // SAFETY: the caller's contract.
    unsafe {
        a.copy_rows_from::<FLASH_THREADS>(a_src, ROWS, COLS, valid_rows);
        b.copy_rows_from::<FLASH_THREADS>(b_src, ROWS, COLS, valid_rows);
    }
    gpu::sync_threads();
}

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
}

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

/// Sets `x[i][j] = value` wherever `visible(first_row + i, lane + 8j)` is false (tile-local
/// row and column; the caller maps them to queries and keys).
#[inline(always)]
pub fn mask_tile<const ROWS: usize, const COLS: usize>(
    x: &mut [[f32; COLS]; ROWS],
    first_row: usize,
    lane: usize,
    value: f32,
    visible: impl Fn(usize, usize) -> bool,
) {
    for i in 0..ROWS {
        for j in 0..COLS {
            if !visible(first_row + i, lane + LANES * j) {
                x[i][j] = value;
            }
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

/// Writes `scale · acc` (this thread's rows and `head_dim` columns) to the row-major global
/// tensor rows starting at `dst`, for the tile-local rows below `valid_rows` only.
///
/// # Safety
/// `dst` points to at least `valid_rows` rows of `HEAD_DIM` floats, 16-byte aligned.
#[inline(always)]
pub unsafe fn store_rows<const HEAD_DIM: usize, const ROWS: usize, const DVEC: usize>(
    acc: &[[F32x4; DVEC]; ROWS],
    scale: [f32; ROWS],
    dst: *mut f32,
    valid_rows: usize,
    first_row: usize,
    lane: usize,
) {
    for i in 0..ROWS {
        if first_row + i < valid_rows {
            for g in 0..DVEC {
                // SAFETY: the row is below valid_rows and the columns below HEAD_DIM.
                unsafe { acc[i][g].scale(scale[i]).store(dst.add((first_row + i) * HEAD_DIM + 4 * lane + 32 * g)) };
            }
        }
    }
}
