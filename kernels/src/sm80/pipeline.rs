//! The `cp.async` ring of K/V tiles that the tensor-core Q-outer kernels share (the level-5
//! forward and the level-6 deterministic dQ): `STAGES` slots of a K and a V tile, filled by the
//! whole block while it computes on an earlier slot.
//!
//! Each thread's copies of one tile form one `cp.async` group; at the top of iteration `j` a
//! thread waits until its copies of tile `j` have landed, and a block barrier makes everyone's
//! copies visible — and guarantees that every warp has finished iteration `j − 1`, so that its
//! slot can be refilled with tile `j + STAGES − 1` right away. The copies thus fetch up to
//! `STAGES − 1` tiles ahead, with one barrier per tile.

use crate::hw::{self, SharedTile16};

/// The ring: slot `i` holds a K tile at rows `2i·BLOCK_N` and a V tile at `(2i + 1)·BLOCK_N` of
/// one shared-memory tile of `2 · STAGES · BLOCK_N` rows. Slots are computed from the slot
/// number rather than kept in an array: an array of tiles indexed by a loop variable would live
/// in local memory.
#[derive(Clone, Copy)]
pub struct KvRing<const BLOCK_N: usize, const HEAD_DIM: usize, const STAGES: usize> {
    /// The ring's rows in shared memory.
    pub tile: SharedTile16,
    /// This head's K and V in global memory (16-bit elements, rows of `head_dim ≤ HEAD_DIM`:
    /// the slots' columns past `head_dim` are zero-filled, see
    /// [`SharedTile16::copy_rows_async`]; callers pass the constant `HEAD_DIM` where the problem
    /// has it, so that it folds into the addresses).
    k_head: *const u16,
    v_head: *const u16,
    seqlen_k: usize,
    head_dim: usize,
    /// Key tiles the block visits.
    tiles: usize,
    /// Threads of the block (all of them copy).
    threads: usize,
}

impl<const BLOCK_N: usize, const HEAD_DIM: usize, const STAGES: usize> KvRing<BLOCK_N, HEAD_DIM, STAGES> {
    #[inline(always)]
    pub fn new(
        tile: SharedTile16,
        (k_head, v_head): (*const u16, *const u16),
        (seqlen_k, head_dim): (usize, usize),
        tiles: usize,
        threads: usize,
    ) -> Self {
        Self { tile, k_head, v_head, seqlen_k, head_dim, tiles, threads }
    }

    /// The K and V tiles of the slot that holds key tile `tile`.
    #[inline(always)]
    pub fn slot(self, tile: usize) -> (SharedTile16, SharedTile16) {
        let slot = tile % STAGES;
        (self.tile.rows_from(2 * slot * BLOCK_N), self.tile.rows_from((2 * slot + 1) * BLOCK_N))
    }

    /// Starts the copies of key tile `tile` into its slot, as one `cp.async` group (empty past
    /// the last tile, so that every iteration commits exactly one group). Every thread calls it.
    #[inline(always)]
    pub fn fetch(self, tile: usize) {
        if tile < self.tiles {
            let kv_start = tile * BLOCK_N;
            let valid = BLOCK_N.min(self.seqlen_k - kv_start);
            let (k_tile, v_tile) = self.slot(tile);
            // SAFETY: rows kv_start .. kv_start + valid of this head exist (the caller's heads).
            unsafe {
                let (rows, d) = (kv_start * self.head_dim, self.head_dim);
                k_tile.copy_rows_async(self.k_head.add(rows), BLOCK_N, HEAD_DIM, d, valid, self.threads);
                v_tile.copy_rows_async(self.v_head.add(rows), BLOCK_N, HEAD_DIM, d, valid, self.threads);
            }
        }
        hw::cp_async_commit();
    }

    /// The top of iteration `tile` of the key loop: waits until tile `tile` has landed for
    /// every thread (and every warp is done with tile `tile − 1`'s slot), starts the copies of
    /// tile `tile + STAGES − 1` into that slot, and returns tile `tile`'s K and V. Every thread
    /// calls it.
    #[inline(always)]
    pub fn advance(self, tile: usize) -> (SharedTile16, SharedTile16) {
        hw::cp_async_wait(STAGES - 2);
        hw::sync_threads();
        self.fetch(tile + STAGES - 1);
        self.slot(tile)
    }
}
