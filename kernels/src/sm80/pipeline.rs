//! The `cp.async` ring of K/V tiles that the tensor-core Q-outer kernels share (the level-5
//! forward, the level-6 deterministic dQ and the level-10 decoder): `STAGES` slots of a K and a V
//! tile, filled by the threads that use them while they compute on an earlier slot.
//!
//! Each thread's copies of one tile form one `cp.async` group; at the top of iteration `j` a
//! thread waits until its copies of tile `j` have landed, and a barrier makes everyone's copies
//! visible — and guarantees that every thread of the ring has finished iteration `j − 1`, so that
//! its slot can be refilled with tile `j + STAGES − 1` right away. The copies thus fetch up to
//! `STAGES − 1` tiles ahead, with one barrier per tile.
//!
//! Two things vary between the kernels, each a type parameter: *where* the tiles come from
//! ([`KvSource`]: consecutive rows of one head, or the rows of a paged, token-major cache), and
//! *who* fills and reads the ring ([`RingScope`]: the whole block, behind the block barrier, or
//! one warp, behind the warp barrier — the decoder's warps each stream their own keys).

use crate::hw::{self, SharedTile16};

/// Where a ring's tiles come from: for the ring's `i`-th tile, the first K and V row in global
/// memory and how many of its `BLOCK_N` rows exist (the others are zero-filled, never read).
pub trait KvSource: Copy {
    /// Tile `i`'s first K row, first V row and number of rows that exist (`1..=BLOCK_N`).
    ///
    /// # Safety
    /// `i` is one of the ring's tiles (below the `tiles` it was made with).
    unsafe fn tile(self, i: usize) -> (*const u16, *const u16, usize);
    /// Elements from one K row to the next, and from one V row to the next.
    fn row_strides(self) -> (usize, usize);
    /// Elements of a row that exist (`≤ HEAD_DIM`; the columns past it are zero-filled).
    fn width(self) -> usize;
}

/// Who fills and reads a ring: each of them copies a share of every tile, and they meet at a
/// barrier before a tile is read.
pub trait RingScope: Copy {
    /// The calling thread's number among the ring's threads, and how many there are.
    fn worker(self) -> (usize, usize);
    /// The barrier of the ring's threads.
    fn sync(self);
}

/// The whole block: `threads` threads, the block barrier.
#[derive(Clone, Copy)]
pub struct BlockScope {
    pub threads: usize,
}

impl RingScope for BlockScope {
    #[inline(always)]
    fn worker(self) -> (usize, usize) {
        (hw::thread_idx_x(), self.threads)
    }

    #[inline(always)]
    fn sync(self) {
        hw::sync_threads()
    }
}

/// One warp: its 32 lanes, the warp barrier (which orders their shared-memory accesses too).
#[derive(Clone, Copy)]
pub struct WarpScope;

impl RingScope for WarpScope {
    #[inline(always)]
    fn worker(self) -> (usize, usize) {
        (hw::lane_id(), 32)
    }

    #[inline(always)]
    fn sync(self) {
        hw::sync_warp()
    }
}

/// Consecutive key tiles of one head of a `[batch, heads, seqlen_k, head_dim]` tensor: tile `i`
/// is keys `(first_tile + i)·BLOCK_N ..` (the first tile a window's left edge leaves; 0 without
/// one), rows `head_dim` elements apart.
#[derive(Clone, Copy)]
pub struct HeadRows<const BLOCK_N: usize> {
    /// This head's K and V in global memory (16-bit elements, rows of `head_dim ≤ HEAD_DIM`:
    /// callers pass the constant `HEAD_DIM` where the problem has it, so that it folds into the
    /// addresses).
    pub k_head: *const u16,
    pub v_head: *const u16,
    pub seqlen_k: usize,
    pub head_dim: usize,
    pub first_tile: usize,
}

impl<const BLOCK_N: usize> KvSource for HeadRows<BLOCK_N> {
    #[inline(always)]
    unsafe fn tile(self, i: usize) -> (*const u16, *const u16, usize) {
        let kv_start = (self.first_tile + i) * BLOCK_N;
        let valid = BLOCK_N.min(self.seqlen_k - kv_start);
        let rows = kv_start * self.head_dim;
        // SAFETY: tile `i` starts inside the head (the caller's contract).
        unsafe { (self.k_head.add(rows), self.v_head.add(rows), valid) }
    }

    #[inline(always)]
    fn row_strides(self) -> (usize, usize) {
        (self.head_dim, self.head_dim)
    }

    #[inline(always)]
    fn width(self) -> usize {
        self.head_dim
    }
}

/// The ring: slot `i` holds a K tile at rows `2i·BLOCK_N` and a V tile at `(2i + 1)·BLOCK_N` of
/// one shared-memory tile of `2 · STAGES · BLOCK_N` rows. Slots are computed from the slot
/// number rather than kept in an array: an array of tiles indexed by a loop variable would live
/// in local memory.
#[derive(Clone, Copy)]
pub struct KvRing<
    const BLOCK_N: usize,
    const HEAD_DIM: usize,
    const STAGES: usize,
    S: KvSource = HeadRows<BLOCK_N>,
    W: RingScope = BlockScope,
> {
    /// The ring's rows in shared memory.
    pub tile: SharedTile16,
    source: S,
    /// Tiles the ring streams (tiles `0 .. tiles` of the source).
    tiles: usize,
    scope: W,
}

impl<const BLOCK_N: usize, const HEAD_DIM: usize, const STAGES: usize> KvRing<BLOCK_N, HEAD_DIM, STAGES> {
    /// The block's ring over key tiles `first_tile .. first_tile + tiles` of one head (`k_head`,
    /// `v_head`, rows of `head_dim` elements, `seqlen_k` of them), the ring's tiles `0 .. tiles`.
    #[inline(always)]
    pub fn new(
        tile: SharedTile16,
        (k_head, v_head): (*const u16, *const u16),
        (seqlen_k, head_dim): (usize, usize),
        (first_tile, tiles): (usize, usize),
        threads: usize,
    ) -> Self {
        let source = HeadRows { k_head, v_head, seqlen_k, head_dim, first_tile };
        Self::with_source(tile, source, tiles, BlockScope { threads })
    }
}

impl<const BLOCK_N: usize, const HEAD_DIM: usize, const STAGES: usize, S: KvSource, W: RingScope>
    KvRing<BLOCK_N, HEAD_DIM, STAGES, S, W>
{
    /// A ring over tiles `0 .. tiles` of `source`, filled and read by `scope`.
    #[inline(always)]
    pub fn with_source(tile: SharedTile16, source: S, tiles: usize, scope: W) -> Self {
        Self { tile, source, tiles, scope }
    }

    /// The K and V tiles of the slot that holds tile `tile`.
    #[inline(always)]
    pub fn slot(self, tile: usize) -> (SharedTile16, SharedTile16) {
        let slot = tile % STAGES;
        (self.tile.rows_from(2 * slot * BLOCK_N), self.tile.rows_from((2 * slot + 1) * BLOCK_N))
    }

    /// Starts the copies of tile `tile` into its slot, as one `cp.async` group (empty past the
    /// last tile, so that every iteration commits exactly one group). Every thread of the scope
    /// calls it.
    #[inline(always)]
    pub fn fetch(self, tile: usize) {
        if tile < self.tiles {
            // SAFETY: `tile` is one of the ring's tiles.
            let (k_rows, v_rows, valid) = unsafe { self.source.tile(tile) };
            let (k_tile, v_tile) = self.slot(tile);
            let ((k_stride, v_stride), d, worker) =
                (self.source.row_strides(), self.source.width(), self.scope.worker());
            // SAFETY: rows 0 .. valid of the tile exist (the source's contract).
            unsafe {
                k_tile.copy_rows_async_strided(k_rows, k_stride, BLOCK_N, HEAD_DIM, d, valid, worker);
                v_tile.copy_rows_async_strided(v_rows, v_stride, BLOCK_N, HEAD_DIM, d, valid, worker);
            }
        }
        hw::cp_async_commit();
    }

    /// The prologue: starts the copies of tiles `0 .. STAGES − 1`, one group each. Every thread
    /// of the scope calls it.
    #[inline(always)]
    pub fn prime(self) {
        for tile in 0..STAGES - 1 {
            self.fetch(tile);
        }
    }

    /// The top of iteration `tile` of the key loop: waits until tile `tile` has landed for
    /// every thread of the scope (and every one of them is done with tile `tile − 1`'s slot),
    /// starts the copies of tile `tile + STAGES − 1` into that slot, and returns tile `tile`'s K
    /// and V. Every thread of the scope calls it.
    #[inline(always)]
    pub fn advance(self, tile: usize) -> (SharedTile16, SharedTile16) {
        hw::cp_async_wait(STAGES - 2);
        self.scope.sync();
        self.fetch(tile + STAGES - 1);
        self.slot(tile)
    }
}
