//! Level 9 (sm_90a only): the FlashAttention backward pass on Hopper. The algorithm is
//! FlashAttention-2's (Dao 2023, Algorithm 2: an outer loop over key blocks, an inner loop over
//! query tiles, dQ added to device memory by every key block), with the structure of level 8
//! ([`crate::sm90::forward`]) and of FlashAttention-3's backward (Shah et al. 2024,
//! section 3 and Appendix B):
//!
//! * a producer warpgroup loads this block's K and V once and then every query tile's Q and dO
//!   round a ring of `STAGES` slots with TMA; a second producer warp copies the tile's LSE and
//!   D = rowsum(dO ∘ O) into the same slot. Two consumer warpgroups each own 64 of the block's
//!   128 keys and keep their rows of dK and dV in registers for the whole loop;
//! * per query tile of 64 rows, each consumer computes Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (both operands
//!   from shared memory), then Pᵀ = exp(Sᵀ·scale − LSE) and dSᵀ = Pᵀ ∘ (dPᵀ − D) in registers
//!   (a tile that every query sees whole skips the mask's test where the registers allow a copy
//!   of that loop without it, [`unmasked_copy`]), and accumulates dV += Pᵀ·dO and dK += dSᵀ·Q
//!   with Pᵀ and dSᵀ as register operands;
//! * dQ = scale · dS·K needs dS with the queries as rows, which no thread holds: each consumer
//!   writes its rows of dSᵀ to shared memory (row-major by key), which `wgmma` reads as an
//!   MN-major A operand ([`Accumulator::mma_mn_major`]). Its share of the tile's dQ goes to a
//!   staging tile in shared memory, and one thread asks TMA to add that tile to an `f32` copy of
//!   dQ in device memory (`cp.reduce.async.bulk.tensor`, FA3's way; [`add_dq_boxes`]): the
//!   consumer's first thread in the atomic instances, a *dQ warp* of the producer warpgroup in
//!   the deterministic ones ([`produce_dq`], below). A last kernel rounds the copy to 16 bits.
//!
//! Who computes a tile's dQ (`layout::hopper_backward_dq_in_turns`): every element of dQ needs
//! all 128 keys' dSᵀ rows, half of them the other consumer's, so the consumers meet at a named
//! barrier. Up to head_dim 96, where dQ is one column block (or one and a bit), they take turns,
//! one tile each ([`adds_dq`]): at even steps consumer 0 multiplies all 128 keys into the tile's
//! whole dQ and adds it, at odd steps consumer 1, and the other only arrives at the barrier
//! (`bar.arrive`) and goes on to its next tile, so the two drift apart by up to a tile, one's
//! exponentials overlapping the other's products (FlashAttention-3 computes one dQ product per
//! tile too). At head_dim 128 each consumer multiplies all 128 keys by its own 64 columns of K,
//! every tile ([`dq_column_block`]). At 80 and 96 the tiles are two column blocks, the second
//! one partly padding ([`column_blocks`]), and every product is as wide as head_dim: it reads
//! only the first 16 or 32 columns of the second block. dSᵀ alternates between two buffers, so
//! a warp never overwrites rows that a product of the previous tile may still read: a consumer
//! writes a buffer again only two steps later, after the barrier of the step between, which the
//! other passes only once it has finished reading the buffer.
//!
//! **Wide heads** (head_dim 160, 192 and 256, [`consume_wide`]): 64 keys' dK and dV in registers
//! would take `head_dim` registers a thread (256 at 256) on top of Sᵀ and dPᵀ, more than a
//! thread has. So a block owns 64 keys, and the two consumers split the work of each query tile
//! instead of the keys: each computes Sᵀ and dPᵀ for all 64 keys and its half of the tile's
//! queries (`wgmma` N = 32), writes its halves of Pᵀ and dSᵀ to two key-row buffers, and after a
//! barrier of both, consumer 0 accumulates dV += Pᵀ·dO and consumer 1 dK += dSᵀ·Q over the whole
//! tile, both operands from shared memory (`head_dim / 2` registers each: 128 at 256). dQ = dS·K
//! goes by column blocks of 64, alternating between the consumers (at 160 and 192 the third
//! block split by keys, [`wide_dq_round`]; at 160 it is multiplied whole, 32 of its columns
//! padding). At 160 and 192 the first block's product is issued before dV's or dK's,
//! so that its staging overlaps that longer one; at 256, where each block is staged and added
//! 32 columns (one TMA box) at a time, dV's or dK's goes first (measured faster there): the
//! kernel takes 226 of the H200's 227 KiB at 256, and a staging tile of 64 columns each would
//! not fit. Its dQ is added in any order only; the deterministic mode runs on the sm_80 kernels
//! there. (FlashAttention-3 splits its head_dim-256 backward between two consumers too, with
//! 64 × 64 tiles, Shah et al. 2024; the split into dV and dK is ours.)
//!
//! What made it fast (`PERFORMANCE.md`): the statistics in shared memory (read from device memory
//! after every Sᵀ they stalled each tile), no register spills (the per-tile addresses are
//! recomputed, see [`crate::hw::opaque`]), TMA's reduction in place of 16
//! atomics per thread and tile, and the causal limit applied by selects rather than branches.
//!
//! **Deterministic dQ** (`DETERMINISTIC`): the additions to an element of dQ are atomic, but their
//! order is the order in which the blocks happen to reach a tile, so the last bits of dQ differ
//! from run to run. The deterministic instances fix the order: every dQ tile has a turn counter
//! in device memory, and the additions to a tile come in the grid's key-block order (increasing,
//! or under a causal mask decreasing; [`turn`]). A consumer hands its staged share
//! to a dQ warp (warps 2 and 3, one per consumer), which waits for the turn
//! ([`wait_for_turn`]), adds, frees the staging tile once TMA has read it, waits until the
//! addition is complete and passes the turn on ([`pass_turn`]); the consumer goes on and waits
//! only if the staging tile is still held when its next share is ready. The GPU starts blocks
//! in index order and the grid runs the key blocks of a head in that same order (the causal
//! grid shortest first, [`KeyBlock::hopper_backward`]), so a block only ever waits for blocks
//! that started before it: no deadlock. (FlashAttention-3's deterministic backward takes turns the
//! same way.)
//!
//! Who does what (384 threads):
//!
//! | warps | role |
//! |---|---|
//! | 0 (one thread) | TMA loads: K and V once, Q and dO of every query tile ([`produce_tiles`]) |
//! | 1 | LSE·log₂e and D of every query tile into its slot ([`produce_statistics`]) |
//! | 2, 3 (one thread each; deterministic instances) | consumer 0's, consumer 1's dQ share added to device memory in turns ([`produce_dq`]) |
//! | 4–7, 8–11 | consumers 0 and 1: 64 keys each, dK and dV in registers ([`consume`]); wide heads: the block's 64 keys, half the queries each, dV (0) or dK (1) in registers ([`consume_wide`]) |
//!
//! Shared memory ([`SharedTiles`]; at head_dim 128 and two stages 194 KiB): K and V 32 KiB each,
//! two slots of Q and dO 16 KiB each, two dSᵀ buffers of 16 KiB, two dQ staging tiles of 16 KiB
//! (`f32`), the statistics (512 bytes a slot) and the `mbarrier`s; at head_dim 256 (wide: 64
//! keys) 226 KiB: K and V 32 KiB each, two slots of Q and dO 32 KiB each, Pᵀ and dSᵀ 8 KiB each,
//! two dQ staging tiles of 8 KiB (32 columns). Legend: Sᵀ, dPᵀ, Pᵀ, dSᵀ are
//! `keys × queries` (the transposes of the paper's S, dP, P, dS); "column block" is 64 columns
//! of head_dim, one 128-byte swizzled box of 16-bit values.
//!
//! Grouped-query attention: a block owns a key block of one key/value head and loops over the
//! query tiles of every query head of its group, so dK and dV are complete when it ends.
//!
//! Under a causal mask the grid runs its longest blocks first, the first key blocks of every
//! head of an L2-sized section of heads ([`KeyBlock::hopper_backward`]; PERFORMANCE.md has the
//! gain); the deterministic instances run them shortest first, which their turns need ([`turn`]).

use crate::attention::epilogue::store_fragment_pairs;
use crate::attention::fragment::{FragmentLane, pack_a};
use crate::attention::mask::Mask;
use crate::attention::schedule::KeyBlock;
use crate::attention::score::ScoreArgs;
use crate::configs::SM90_BACKWARD_REGISTERS;
use crate::hw::{
    self, Accumulator, FragA, FragC, HalfFloat, LOG2_E, SWIZZLE_ATOM_BYTES, SWIZZLE_ROW_BYTES, TensorMaps,
    WARPGROUP_THREADS, advance_descriptor, bulk_commit_group, bulk_wait_group, bulk_wait_group_read,
    fence_mbarrier_init, fence_proxy_async, k_major_descriptor, load_shared_f32x2, mbarrier_arrive,
    mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_wait, mn_major_descriptor, named_barrier_arrive,
    named_barrier_sync, opaque, pass_turn, store_shared_f32x2, store_shared_u32, tma_reduce_add_3d, wait_for_turn,
    warpgroup_id, wgmma_commit, wgmma_fence, wgmma_wait,
};
use crate::layout::{
    AttentionShape, HOPPER_WARPGROUP_ROWS as WARPGROUP_ROWS, hopper_backward_block_n, hopper_backward_dq_columns,
    hopper_backward_dq_in_turns, hopper_backward_dq_staging_columns,
};
use crate::sm90::pipeline::{
    AlignedShared, SWIZZLE_COLUMNS, column_blocks, load_swizzled_tile, ring_slot, swizzled_offset, take_role,
    tile_bytes, wait_slot_free,
};

/// Keys per block up to head_dim 128: 64 per consumer warpgroup.
pub const BLOCK_N: usize = 128;
/// Keys per block above head_dim 128 ("Wide heads" in the module docs): 64, shared by both
/// consumers.
pub const WIDE_BLOCK_N: usize = 64;
/// Query rows per tile of the inner loop.
pub const BLOCK_M: usize = 64;
/// Consumer warpgroups.
const CONSUMERS: usize = BLOCK_N / WARPGROUP_ROWS;
/// The named barrier of both consumers (0 is `__syncthreads`, 1 and 2 each consumer's own, 4 and 5
/// the turns at dQ, [`dq_turn_barrier`]).
const ALL_CONSUMERS: u32 = 3;
/// Columns of one box of the `f32` dQ tile: 128 bytes, the widest box the 128-byte swizzle allows.
const DQ_BOX_COLUMNS: usize = SWIZZLE_ROW_BYTES / 4;
/// Bytes of one such box of `BLOCK_M` rows.
const DQ_BOX_BYTES: u32 = (BLOCK_M * SWIZZLE_ROW_BYTES) as u32;
/// Boxes of a column block of dQ (64 columns).
const COLUMN_BLOCK_BOXES: usize = SWIZZLE_COLUMNS / DQ_BOX_COLUMNS;
/// Boxes of a consumer's dQ share up to head_dim 128 (its staging tile's columns).
const fn dq_boxes(d: usize) -> usize {
    hopper_backward_dq_staging_columns(d) / DQ_BOX_COLUMNS
}
/// Queries of a tile per consumer in the wide-head kernel: each takes half of every tile.
const HALF_M: usize = BLOCK_M / CONSUMERS;

/// Whether a consumer's exponentials have a copy without the mask's test, for the tiles that every
/// query sees whole (most tiles of most problems): two instructions a score fewer (the test and
/// its select), and the band's branch a column. Up to head_dim 64, atomic and deterministic:
/// above, the second copy's registers make ptxas spill (4–20 bytes at 80 and 96, where the
/// kernels had 0–4; PERFORMANCE.md, 2026-12-06 (evening)). The deterministic instances at 64
/// spill a few bytes more with it and are still faster (PERFORMANCE.md, 2026-12-07).
const fn unmasked_copy(d: usize) -> bool {
    d <= 64
}

/// Which of a consumer's steps this is among those whose dQ it adds: `step` itself, or where the
/// consumers take turns at dQ ([`hopper_backward_dq_in_turns`]) `step / 2`. It counts the uses
/// of the consumer's staging tile.
const fn own_dq_step(d: usize, step: usize) -> usize {
    if hopper_backward_dq_in_turns(d) { step / 2 } else { step }
}

/// Whether consumer `index` adds step `step`'s dQ: every step where the consumers share each
/// tile by column blocks, every second step where they take turns.
const fn adds_dq(d: usize, step: usize, index: usize) -> bool {
    !hopper_backward_dq_in_turns(d) || step % 2 == index
}

/// The named barrier before tile `step`'s dQ product when the consumers take turns
/// ([`hopper_backward_dq_in_turns`]): the consumer whose turn it is waits on it for the other's
/// dSᵀ rows, the other only arrives. Two ids, alternating with the step: with one, a consumer
/// that arrives at step s and runs ahead to wait at step s + 1 could complete the barrier with
/// its own two arrivals.
const fn dq_turn_barrier(step: usize) -> u32 {
    ALL_CONSUMERS + 1 + (step % 2) as u32
}

/// Whether head_dim `D` runs the wide-head kernel (64 keys a block, [`consume_wide`]).
const fn is_wide(d: usize) -> bool {
    hopper_backward_block_n(d) == WIDE_BLOCK_N
}

/// The block's shared memory, as shared-state-space addresses from a base aligned to one swizzle
/// atom: K and V (`block_n × D`, [`hopper_backward_block_n`]), `STAGES` slots of a Q and a dO
/// tile (`BLOCK_M × D`), two key-row buffers (`block_n × BLOCK_M`: dSᵀ of two tiles, or in the
/// wide-head kernel Pᵀ and dSᵀ of one), a dQ staging tile per consumer (`BLOCK_M ×`
/// [`hopper_backward_dq_staging_columns`] `f32`), `STAGES` slots of the tile's statistics
/// (`BLOCK_M` values of LSE·log₂e, then `BLOCK_M` of D, `f32`), then the `mbarrier`s. Tiles are
/// [`column_blocks`]`(D)` swizzled column blocks. (`crate::layout::hopper_backward_smem_bytes`
/// adds the same up.)
#[derive(Clone, Copy)]
struct SharedTiles<const D: usize, const STAGES: usize> {
    base: u32,
}

impl<const D: usize, const STAGES: usize> SharedTiles<D, STAGES> {
    /// Keys per block.
    const BLOCK_N: usize = hopper_backward_block_n(D);
    const KV_BYTES: u32 = tile_bytes(Self::BLOCK_N, D);
    const Q_BYTES: u32 = tile_bytes(BLOCK_M, D);
    const DS_BYTES: u32 = (Self::BLOCK_N * BLOCK_M * 2) as u32;
    const STATISTICS_BYTES: u32 = (2 * BLOCK_M * 4) as u32;
    const DQ_STAGING_BYTES: u32 = (BLOCK_M * hopper_backward_dq_staging_columns(D) * 4) as u32;

    #[inline(always)]
    fn new() -> Self {
        Self { base: AlignedShared::new().base }
    }

    #[inline(always)]
    fn k(self) -> u32 {
        self.base
    }

    #[inline(always)]
    fn v(self) -> u32 {
        self.base + Self::KV_BYTES
    }

    #[inline(always)]
    fn q(self, stage: usize) -> u32 {
        self.base + 2 * Self::KV_BYTES + 2 * stage as u32 * Self::Q_BYTES
    }

    #[inline(always)]
    fn d_o(self, stage: usize) -> u32 {
        self.q(stage) + Self::Q_BYTES
    }

    #[inline(always)]
    fn ds(self, buffer: usize) -> u32 {
        self.base + 2 * Self::KV_BYTES + 2 * STAGES as u32 * Self::Q_BYTES + buffer as u32 * Self::DS_BYTES
    }

    /// Consumer `index`'s staging tile of dQ: `BLOCK_M` rows ×
    /// [`hopper_backward_dq_staging_columns`] `f32` (96 at 80 and 96, 64 at 64 to 192, 32 at
    /// 256), as swizzled boxes of [`DQ_BOX_COLUMNS`].
    #[inline(always)]
    fn dq_staging(self, index: usize) -> u32 {
        self.ds(2) + index as u32 * Self::DQ_STAGING_BYTES
    }

    /// LSE·log₂e of the tile in slot `stage`, one `f32` per query row.
    #[inline(always)]
    fn lse(self, stage: usize) -> u32 {
        self.dq_staging(CONSUMERS) + stage as u32 * Self::STATISTICS_BYTES
    }

    /// D = rowsum(dO ∘ O) of the tile in slot `stage`.
    #[inline(always)]
    fn delta(self, stage: usize) -> u32 {
        self.lse(stage) + Self::STATISTICS_BYTES / 2
    }

    /// Barrier `i` of `[K and V full, Q full × STAGES, dO full × STAGES, Q and dO empty × STAGES,
    /// dQ staged × CONSUMERS, dQ staging free × CONSUMERS]`. "dO full" also waits for the tile's
    /// statistics.
    #[inline(always)]
    fn barrier(self, i: usize) -> u32 {
        self.lse(STAGES) + 8 * i as u32
    }

    #[inline(always)]
    fn kv_full(self) -> u32 {
        self.barrier(0)
    }

    #[inline(always)]
    fn q_full(self, stage: usize) -> u32 {
        self.barrier(1 + stage)
    }

    #[inline(always)]
    fn do_full(self, stage: usize) -> u32 {
        self.barrier(1 + STAGES + stage)
    }

    #[inline(always)]
    fn q_empty(self, stage: usize) -> u32 {
        self.barrier(1 + 2 * STAGES + stage)
    }

    /// Consumer `index` wrote its dQ share to its staging tile (all 128 threads arrive).
    #[inline(always)]
    fn dq_full(self, index: usize) -> u32 {
        self.barrier(1 + 3 * STAGES + index)
    }

    /// Consumer `index`'s staging tile may be overwritten (its dQ warp arrives).
    #[inline(always)]
    fn dq_empty(self, index: usize) -> u32 {
        self.barrier(1 + 3 * STAGES + CONSUMERS + index)
    }
}

/// Which column block of 64 of a query tile's dQ consumer `index` computes at head_dim `D`: at
/// 128 its own, each consumer multiplying all 128 keys into its 64 columns; up to 96, where the
/// consumers take turns ([`hopper_backward_dq_in_turns`]), the first, the product as wide as
/// head_dim (see the module docs).
#[inline(always)]
const fn dq_column_block<const D: usize>(index: usize) -> usize {
    if hopper_backward_dq_in_turns(D) { 0 } else { index }
}

/// The turn of key block `key_block` at dQ tile `tile` (deterministic mode): the key blocks that
/// add to a tile take turns in grid order. Each adds once where the consumers take turns at dQ
/// (up to head_dim 96, [`hopper_backward_dq_in_turns`]), so its turn is its position `p` in that
/// order; at 128 both consumers add, to their own column blocks, so both wait for turn `2p`
/// and pass it on one after the other.
///
/// * Without a mask every key block adds to every tile and the grid runs them in increasing
///   order, so the position of key block `j` is `j`.
/// * Under a causal mask tile `i` receives from key blocks `0 ..= last`, `last` the last one its
///   last row sees, and the grid runs them shortest first ([`KeyBlock::hopper_backward`]), so
///   the position is `last − j`. In increasing order key block `j`, whose first tile comes
///   two after `j − 1`'s, would reach every tile two steps before `j − 1` does and wait for it
///   there, at every tile (and with a group of query heads, longer at each head). Decreasing,
///   `j + 1` reaches each tile before `j` does, and nobody waits.
///
/// Either way a block only waits for blocks that the grid started before it.
#[inline(always)]
fn turn<const D: usize>(mask: &Mask, key_block: usize, tile: usize) -> u32 {
    let additions = if hopper_backward_dq_in_turns(D) { 1 } else { CONSUMERS };
    // The tile's rows (clipped to the sequence) see keys from its first row's start to its
    // last row's limit; this block visits the tile, so it is among those key blocks.
    let position = if mask.causal {
        let last_row = ((tile + 1) * BLOCK_M).min(mask.seqlen_q) - 1;
        let last_block = mask.key_limit(last_row).saturating_sub(1) / BLOCK_N;
        last_block.saturating_sub(key_block)
    } else {
        // 0 without a window's left edge.
        key_block.saturating_sub(mask.key_start(tile * BLOCK_M) / BLOCK_N)
    };
    (additions * position) as u32
}

/// The producer's TMA work: K and V once, then Q and dO of every query tile the block
/// visits, each into its ring slot once the consumers released the slot.
///
/// # Safety
/// One thread of warpgroup 0 calls it, after the barriers were initialised.
#[inline(always)]
unsafe fn produce_tiles<const D: usize, const STAGES: usize>(
    smem: SharedTiles<D, STAGES>,
    maps: TensorMaps,
    shape: &AttentionShape,
    block: &KeyBlock,
) {
    // SAFETY (every load): the barrier learnt the tile's bytes first; the tile fits its slot.
    let load = |destination: u32, map: *const u8, rows: usize, first_row: usize, head: usize, barrier: u32| unsafe {
        load_swizzled_tile::<D>(destination, map, rows, first_row, head as i32, barrier)
    };
    let kv_head = block.batch * shape.num_heads_kv + block.kv_head;
    let keys = SharedTiles::<D, STAGES>::BLOCK_N;
    // SAFETY: initialised barriers.
    unsafe { mbarrier_arrive_expect_tx(smem.kv_full(), 2 * SharedTiles::<D, STAGES>::KV_BYTES) };
    load(smem.k(), maps.get(1), keys, block.k_start, kv_head, smem.kv_full());
    load(smem.v(), maps.get(2), keys, block.k_start, kv_head, smem.kv_full());
    for step in 0..block.steps() {
        let (stage, parity) = ring_slot(step, STAGES);
        let (q_head, tile) = block.step(step);
        let q_head = block.batch * shape.num_heads_q + q_head;
        let bytes = SharedTiles::<D, STAGES>::Q_BYTES;
        // SAFETY: initialised barriers.
        unsafe {
            wait_slot_free(smem.q_empty(stage), step, STAGES, parity);
            mbarrier_arrive_expect_tx(smem.q_full(stage), bytes);
            mbarrier_arrive_expect_tx(smem.do_full(stage), bytes);
        }
        load(smem.q(stage), maps.get(0), BLOCK_M, tile * BLOCK_M, q_head, smem.q_full(stage));
        load(smem.d_o(stage), maps.get(3), BLOCK_M, tile * BLOCK_M, q_head, smem.do_full(stage));
    }
}

/// The producer's second warp: the LSE (times log₂e) and D of every query tile, two rows per lane,
/// into the tile's slot, then one arrival per lane on the slot's "dO full" barrier. A tile's
/// statistics are 512 bytes whose start need not be 16-byte aligned (any `seqlen_q`), too little
/// and too unaligned for a bulk copy; read here, they reach the consumers with the tile instead
/// of costing them a device-memory round trip after every Sᵀ. Rows past `seqlen_q` get an LSE
/// of +∞, so their P is exactly 0.
///
/// # Safety
/// Every lane of one warp of warpgroup 0 calls it, after the barriers were initialised; `lse` and
/// `delta` hold `[batch, num_heads_q, seqlen_q]` `f32`.
#[inline(always)]
unsafe fn produce_statistics<const D: usize, const STAGES: usize>(
    smem: SharedTiles<D, STAGES>,
    shape: &AttentionShape,
    block: &KeyBlock,
    lse: *const f32,
    delta: *const f32,
) {
    let lane = hw::lane_id();
    for step in 0..block.steps() {
        let (stage, parity) = ring_slot(step, STAGES);
        let (q_head, tile) = block.step(step);
        let row0 = (block.batch * shape.num_heads_q + q_head) * shape.seqlen_q;
        // Read before waiting for the slot: the loads do not depend on it.
        let rows = [0, 1].map(|h| {
            let query = tile * BLOCK_M + 2 * lane + h;
            if query < shape.seqlen_q {
                // SAFETY: query < seqlen_q: inside this head's rows.
                unsafe { (*lse.add(row0 + query) * LOG2_E, *delta.add(row0 + query)) }
            } else {
                (f32::INFINITY, 0.0)
            }
        });
        let offset = (8 * lane) as u32;
        // SAFETY: initialised barriers; the slot is free once its phase before this one completed.
        unsafe {
            wait_slot_free(smem.q_empty(stage), step, STAGES, parity);
            store_shared_f32x2(smem.lse(stage) + offset, [rows[0].0, rows[1].0]);
            store_shared_f32x2(smem.delta(stage) + offset, [rows[0].1, rows[1].1]);
            // Release semantics: the stores above are visible to whoever waits on the phase.
            mbarrier_arrive(smem.do_full(stage));
        }
    }
}

/// Asks TMA to add the staging tile at `staging` (`BLOCK_M` rows, `boxes` swizzled boxes of
/// [`DQ_BOX_COLUMNS`] `f32` columns) to dQ's columns from `first_column` in query tile `tile` of
/// head `head` (`batch · num_heads_q + q_head`) of the `f32` dQ, element by element and
/// atomically, skipping rows past seqlen_q; one bulk group.
///
/// # Safety
/// One thread calls it; the staging tile was written, fenced ([`fence_proxy_async`]) and
/// published to this thread; map 4 is dQ's.
#[inline(always)]
unsafe fn add_dq_boxes(maps: TensorMaps, staging: u32, first_column: usize, boxes: usize, tile: usize, head: usize) {
    for dq_box in 0..boxes {
        let x = (first_column + dq_box * DQ_BOX_COLUMNS) as i32;
        let source = staging + dq_box as u32 * DQ_BOX_BYTES;
        // SAFETY: the caller's contract.
        unsafe { tma_reduce_add_3d(maps.get(4), x, (tile * BLOCK_M) as i32, head as i32, source) };
    }
    bulk_commit_group();
}

// ANCHOR: dq_warp
/// The deterministic instances' dQ warp (one thread of it): for every query tile whose dQ
/// consumer `index` adds ([`adds_dq`]), waits until the consumer has staged it, waits for its
/// turn at the tile's counter in `turns` ([`turn`]), asks TMA to add the tile to the `f32` dQ in
/// device memory, frees the staging tile as soon as TMA has read it, and passes the turn on once
/// the addition is complete.
///
/// # Safety
/// One thread of warpgroup 0 calls it per consumer, after the barriers were initialised; map 4
/// is dQ's; `turns` holds `[batch, num_heads_q, tiles]` `u32` counters, zero before the launch.
#[inline(always)]
unsafe fn produce_dq<const D: usize, const STAGES: usize>(
    smem: SharedTiles<D, STAGES>,
    maps: TensorMaps,
    shape: &AttentionShape,
    block: &KeyBlock,
    mask: &Mask,
    index: usize,
    turns: *mut u32,
) {
    let column_block = dq_column_block::<D>(index);
    let key_block = block.k_start / BLOCK_N;
    let staging = smem.dq_staging(index);
    for step in (0..block.steps()).filter(|&step| adds_dq(D, step, index)) {
        let (_, parity) = ring_slot(own_dq_step(D, step), 1);
        let (q_head, tile) = block.step(step);
        let head = block.batch * shape.num_heads_q + q_head;
        // SAFETY: inside the counters (the contract).
        let counter = unsafe { turns.add(head * block.tiles + tile) };
        // SAFETY: initialised barriers; the counter as the contract says.
        unsafe {
            mbarrier_wait(smem.dq_full(index), parity);
            wait_for_turn(counter, turn::<D>(mask, key_block, tile));
        }
        // SAFETY: the consumer wrote and fenced the staging tile before its arrival.
        unsafe { add_dq_boxes(maps, staging, column_block * SWIZZLE_COLUMNS, dq_boxes(D), tile, head) };
        bulk_wait_group_read::<0>();
        // SAFETY: initialised barrier; TMA no longer reads the staging tile; this thread holds
        // the turn.
        unsafe {
            mbarrier_arrive(smem.dq_empty(index));
            pass_turn(counter);
        }
    }
    // The block's shared memory must outlive the last reduction's reads (and its writes are
    // complete before the kernel is).
    bulk_wait_group::<0>();
}
// ANCHOR_END: dq_warp

/// Issues `acc = A·Bᵀ` over the head dimension (not committed): A is this warpgroup's 64 rows of
/// K or V (`a_rows`, a descriptor of the block's swizzled tile, `block_n` rows per column block,
/// [`hopper_backward_block_n`]) and B the query tile's Q or dO from row `b_rows` (`BLOCK_M`
/// rows per column block; N rows from there, as `acc` is wide), both K-major. The result is Sᵀ
/// or dPᵀ: keys as rows, queries as columns.
///
/// # Safety
/// Every thread of the warpgroup calls it after [`wgmma_fence`]; both tiles are complete.
#[inline(always)]
unsafe fn issue_transposed_product<T: HalfFloat, const D: usize, A: Accumulator>(
    acc: &mut A,
    a_rows: u64,
    b_rows: u32,
) {
    for ks in 0..D / 16 {
        // 16 columns of head_dim: k-step ks % 4 (32 bytes) of column block ks / 4.
        let (column_block, step_bytes) = (ks / 4, (ks % 4 * 32) as u32);
        let a_offset = (column_block * hopper_backward_block_n(D) * SWIZZLE_ROW_BYTES) as u32 + step_bytes;
        let b_offset = (column_block * BLOCK_M * SWIZZLE_ROW_BYTES) as u32 + step_bytes;
        // SAFETY: the caller's contract.
        unsafe { acc.mma::<T>(advance_descriptor(a_rows, a_offset), k_major_descriptor(b_rows + b_offset), ks > 0) };
    }
}

/// Pᵀ = exp2(Sᵀ·`factor` − LSE·log₂e) and dSᵀ = Pᵀ ∘ (dPᵀ − D) of one tile (FlashAttention-2's
/// Algorithm 2, its P and dS transposed), column (query) by column, sixteen queries (two
/// fragments) at a time, packed into the A operands of dV += Pᵀ·dO and dK += dSᵀ·Q right away so
/// that the `f32` values die early. `statistics(j)` is the pair (LSE·log₂e, D) of the thread's
/// two queries of fragment j.
///
/// A score whose key the query does not see gets P = 0: `band(j, h)` is the first key and the
/// key count of the query in column h of fragment j, `keys` the thread's keys (rows g and
/// g + 8). It is applied by a select: a branch per score (what `if visible { exp2(…) }` compiles
/// to) cost three more instructions per score than the exponentials it skipped. One unsigned
/// comparison tests both edges: key − start wraps to a huge value below the start. The test is
/// done in 32 bits: in `usize` it was a 64-bit subtraction and comparison for every score, and
/// the backward ran 4–6 % slower at head_dim 64 (PERFORMANCE.md, 2026-12-04 (evening)). Keys
/// and key counts fit: the TMA coordinates that load these tiles are `i32` already.
///
/// Without `MASKED` (a tile every query sees whole) there is no test and no select.
///
/// `F` fragments (8 columns each) give `KK` = `F / 2` packed A operands of 16 columns.
#[inline(always)]
fn tile_gradients<T: HalfFloat, const F: usize, const KK: usize, const MASKED: bool>(
    s: &mut [FragC; F],
    dp: &mut [FragC; F],
    factor: f32,
    statistics: impl Fn(usize) -> ([f32; 2], [f32; 2]),
    band: impl Fn(usize, usize) -> (u32, u32),
    keys: [u32; 2],
) -> ([FragA; KK], [FragA; KK]) {
    const { assert!(F == 2 * KK) };
    let mut p = [[0u32; 4]; KK];
    let mut ds = [[0u32; 4]; KK];
    for kk in 0..KK {
        for j in 2 * kk..2 * kk + 2 {
            let (row_lse, row_delta) = statistics(j);
            for h in 0..2 {
                let (start, width) = if MASKED { band(j, h) } else { (0, u32::MAX) };
                // Entries h and h + 2: this query's column in key rows g and g + 8.
                for r in 0..2 {
                    let e = h + 2 * r;
                    let p = hw::exp2(hw::fma(s[j][e], factor, -row_lse[h]));
                    let p = if !MASKED || keys[r].wrapping_sub(start) < width { p } else { 0.0 };
                    s[j][e] = p;
                    dp[j][e] = p * (dp[j][e] - row_delta[h]);
                }
            }
        }
        p[kk] = pack_a::<T>(s[2 * kk], s[2 * kk + 1]);
        ds[kk] = pack_a::<T>(dp[2 * kk], dp[2 * kk + 1]);
    }
    (p, ds)
}

/// Pᵀ and dSᵀ of one transposed tile ([`tile_gradients`]) with what the problem adds to it: a
/// score modification (`MODS`, softcap or ALiBi: Sᵀ becomes base-2 logits, and a softcap's
/// derivative goes into dPᵀ, `ScoreMod::chain_rule`) and the mask. `s` and `dp` hold `F`
/// fragments: keys as rows (the warp's first is `warp_key`, this thread's `keys`, rows g and
/// g + 8), queries as columns from `q_first`, whose statistics (LSE·log₂e and D, one `f32` per
/// query of the tile) start at column `slot_column` of ring slot `stage`'s.
/// `all_visible`: every query sees every key of the tile ([`Mask::all_visible`]); such a tile
/// takes the copy without the mask where `unmasked` ([`unmasked_copy`]). `c` is
/// scale · log₂e.
///
/// # Safety
/// The slots hold the tile's statistics, published to this thread.
#[inline(always)]
#[allow(clippy::type_complexity)]
unsafe fn masked_tile_gradients<
    T: HalfFloat,
    const D: usize,
    const STAGES: usize,
    const F: usize,
    const KK: usize,
    const MODS: bool,
>(
    (s, dp): (&mut [FragC; F], &mut [FragC; F]),
    (smem, stage, slot_column): (SharedTiles<D, STAGES>, usize, usize),
    (mask, all_visible, unmasked, score, shape, q_head): (&Mask, bool, bool, &ScoreArgs, &AttentionShape, usize),
    (warp_key, keys, q_first): (usize, [u32; 2], usize),
    lane: FragmentLane,
    c: f32,
) -> ([FragA; KK], [FragA; KK]) {
    let t = lane.t;
    // This thread's two queries of fragment j are columns 8j + 2t and 8j + 2t + 1; their
    // statistics are a pair in the slot.
    // SAFETY: inside the slot's 64 values (the caller's contract).
    let statistics =
        |slot: u32, j: usize| unsafe { load_shared_f32x2(slot + (4 * (slot_column + 8 * j + 2 * t)) as u32) };
    if MODS {
        let head_score = score.for_head(q_head, shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
        head_score.apply_fragments::<F, true>(s, lane, (warp_key, q_first), c);
        if score.is_softcapped() {
            head_score.chain_rule_fragments(s, dp, |j, e| statistics(smem.delta(stage), j)[e % 2]);
        }
    }
    let factor = if MODS { 1.0 } else { c };
    let row_statistics = |j: usize| (statistics(smem.lse(stage), j), statistics(smem.delta(stage), j));
    // The band of the query in column h of fragment j: its first visible key and how many it
    // sees, in 32 bits; where the tile is all visible, (0, u32::MAX): every key.
    let band = |j: usize, h: usize| {
        if all_visible {
            (0, u32::MAX)
        } else {
            let (start, width) = mask.keys_seen_by(q_first + 8 * j + 2 * t + h);
            (start as u32, width as u32)
        }
    };
    if all_visible && unmasked {
        tile_gradients::<T, F, KK, false>(s, dp, factor, row_statistics, band, keys)
    } else {
        tile_gradients::<T, F, KK, true>(s, dp, factor, row_statistics, band, keys)
    }
}

/// Stores packed pairs of a transposed tile (`packed[kk]`, the A operands of [`tile_gradients`]:
/// 16 queries each) into a key-row buffer at `buffer`: row-major by key, 64 16-bit queries (one
/// 128-byte swizzled row) a key, the way `wgmma` reads it back (K-major as dSᵀ or Pᵀ, MN-major
/// as dS). `key_rows` are the buffer rows of the thread's keys (fragment rows g and g + 8),
/// `first_query` the buffer column of `packed[0]`'s first query, `t` the thread's column pair.
///
/// # Safety
/// The buffer holds those rows; nobody reads them until a fence and a barrier publish them.
#[inline(always)]
unsafe fn store_key_rows<const KK: usize>(
    buffer: u32,
    packed: &[FragA; KK],
    key_rows: [usize; 2],
    first_query: usize,
    t: usize,
) {
    for (kk, fragment) in packed.iter().enumerate() {
        // Entry i: row half i % 2 (key g or g + 8), queries 8 · (i / 2) + 2t and + 1 of the 16.
        for (i, &pair) in fragment.iter().enumerate() {
            let column = first_query + 16 * kk + 8 * (i / 2) + 2 * t;
            // SAFETY: the caller's contract.
            unsafe { store_shared_u32(buffer + swizzled_offset(key_rows[i % 2], 2 * column), pair) };
        }
    }
}

/// Writes `scale` times a warpgroup's dQ fragments `dq` (64 rows × 8 columns each) to the
/// staging tile at `staging`: boxes of [`DQ_BOX_COLUMNS`] `f32` columns, each `BLOCK_M` rows of
/// 128 bytes swizzled as TMA expects ([`add_dq_boxes`] adds them to dQ).
///
/// # Safety
/// The staging tile holds `8 · dq.len()` columns and nobody reads it until a fence and a
/// barrier publish it.
#[inline(always)]
unsafe fn stage_dq(staging: u32, dq: &[FragC], warp: usize, lane: FragmentLane, scale: f32) {
    for h in 0..2 {
        let row = 16 * warp + lane.half_row(h);
        for (j, frag) in dq.iter().enumerate() {
            let column = 8 * j + 2 * lane.t;
            let offset =
                (column / DQ_BOX_COLUMNS) as u32 * DQ_BOX_BYTES + swizzled_offset(row, 4 * (column % DQ_BOX_COLUMNS));
            // SAFETY: the caller's contract.
            unsafe { store_shared_f32x2(staging + offset, [frag[2 * h] * scale, frag[2 * h + 1] * scale]) };
        }
    }
}

/// One consumer warpgroup: dK and dV of its 64 keys over every query tile (see the module docs),
/// then written out.
///
/// # Safety
/// Every thread of one consumer warpgroup calls it; the pointers hold the tensors of `shape`;
/// `MODS` is `score.is_active()` (the entry's `_mods` suffix: see [`flash_backward_wgmma`]).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn consume<
    T: HalfFloat,
    const D: usize,
    const STAGES: usize,
    const D_TILES: usize,
    const DQ_TILES: usize,
    const DETERMINISTIC: bool,
    const MODS: bool,
>(
    smem: SharedTiles<D, STAGES>,
    block: &KeyBlock,
    shape: &AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
    maps: TensorMaps,
    (dk, dv): (*mut u16, *mut u16),
) where
    [FragC; D_TILES]: Accumulator,
    [FragC; DQ_TILES]: Accumulator,
{
    let index = warpgroup_id() - 1;
    // The thread that hands the warpgroup's dQ tiles to TMA (atomic instances).
    let leader = hw::thread_idx_x().is_multiple_of(WARPGROUP_THREADS);
    let k_first = block.k_start + index * WARPGROUP_ROWS;
    let c = scale * LOG2_E;

    let mut dk_acc = [[0.0f32; 4]; D_TILES];
    let mut dv_acc = [[0.0f32; 4]; D_TILES];
    // SAFETY: initialised barrier; its first (only) phase.
    unsafe { mbarrier_wait(smem.kv_full(), 0) };

    let (smem0, thread0) = (smem.base, hw::thread_idx_x() as u32);
    for step in 0..block.steps() {
        // Everything derived from these two is recomputed every tile ([`opaque`]): hoisted out of
        // the loop, the descriptors and shared-memory addresses held ~50 registers across it and
        // spilled 260 bytes at head_dim 128.
        let smem = SharedTiles::<D, STAGES> { base: opaque(smem0) };
        let thread = opaque(thread0) as usize;
        let (warp, lane) = (thread / 32 % 4, FragmentLane::of(thread % 32));
        let t = lane.t;
        // This warpgroup's keys, and the key of fragment entry e (rows g and g + 8 of the warp).
        let key = |e: usize| k_first + 16 * warp + lane.row(e);
        // Descriptors of this warpgroup's 64 rows of K and V (K-major, for Sᵀ and dPᵀ).
        let rows_offset = (index * WARPGROUP_ROWS * SWIZZLE_ROW_BYTES) as u32;
        let k_rows = k_major_descriptor(smem.k() + rows_offset);
        let v_rows = k_major_descriptor(smem.v() + rows_offset);
        let (stage, parity) = ring_slot(step, STAGES);
        let (q_head, tile) = block.step(step);
        let q_start = tile * BLOCK_M;
        // SAFETY: initialised barriers.
        unsafe {
            mbarrier_wait(smem.q_full(stage), parity);
            mbarrier_wait(smem.do_full(stage), parity);
        }
        let (q_tile, do_tile) = (smem.q(stage), smem.d_o(stage));

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warpgroup's 64 keys and the tile's 64 queries. (Two
        // groups, with Pᵀ's exponentials overlapping dPᵀ, were slower: PERFORMANCE.md.)
        let mut s = [[0.0f32; 4]; 8];
        let mut dp = [[0.0f32; 4]; 8];
        s.pin();
        dp.pin();
        wgmma_fence();
        // SAFETY: tiles TMA completed.
        unsafe {
            issue_transposed_product::<T, D, _>(&mut s, k_rows, q_tile);
            issue_transposed_product::<T, D, _>(&mut dp, v_rows, do_tile);
        }
        wgmma_commit();
        wgmma_wait::<0>();
        s.pin();
        dp.pin();

        // Pᵀ and dSᵀ ([`masked_tile_gradients`]): keys a query does not see get P = 0 (only tiles
        // that cross some query's limit check), and so do queries past seqlen_q (their LSE is +∞).
        let all_visible = mask.all_visible(q_start, BLOCK_M, k_first, WARPGROUP_ROWS);
        let keys = [0, 2].map(|e| key(e) as u32);
        // SAFETY: the slot's statistics were published by "dO full".
        let (p, ds) = unsafe {
            masked_tile_gradients::<T, D, STAGES, 8, 4, MODS>(
                (&mut s, &mut dp),
                (smem, stage, 0),
                (&mask, all_visible, unmasked_copy(D), &score, shape, q_head),
                (k_first + 16 * warp, keys, q_start),
                lane,
                c,
            )
        };

        // dV += Pᵀ·dO and dK += dSᵀ·Q: Pᵀ and dSᵀ from registers, dO and Q MN-major.
        let mn_major_step =
            |tile: u32, kk: usize| mn_major_descriptor(tile + (kk * 2 * SWIZZLE_ATOM_BYTES) as u32, BLOCK_M);
        dv_acc.pin();
        dk_acc.pin();
        wgmma_fence();
        for kk in 0..BLOCK_M / 16 {
            // SAFETY: as above.
            unsafe {
                dv_acc.mma_register_a::<T>(p[kk], mn_major_step(do_tile, kk), true);
                dk_acc.mma_register_a::<T>(ds[kk], mn_major_step(q_tile, kk), true);
            }
        }
        wgmma_commit();

        // dSᵀ into this tile's buffer, row-major by key.
        let ds_buffer = smem.ds(step % 2);
        let key_rows = [0, 2].map(|e| key(e) - block.k_start);
        // SAFETY: inside the 16 KiB buffer; the other buffer is the one a product may read.
        unsafe { store_key_rows(ds_buffer, &ds, key_rows, 0, t) };
        fence_proxy_async();
        // ANCHOR: dq_turns
        // dQ needs both warpgroups' rows of dSᵀ, published by a barrier of all consumers. Up to
        // head_dim 96 the consumers take turns ([`adds_dq`]): at the other's tile a consumer
        // only arrives (`bar.arrive`: its rows are published, it does not wait) and goes on to
        // its next tile. At 128 both multiply every tile, each into its own column block
        // ([`dq_column_block`]). In the atomic instances the barrier also frees the staging tile:
        // the leader's previous addition finished reading it before the leader reached it.
        let all_consumers = (CONSUMERS * WARPGROUP_THREADS) as u32;
        if !adds_dq(D, step, index) {
            named_barrier_arrive(dq_turn_barrier(step), all_consumers);
            // dV and dK read this slot's Q and dO: finished before the slot is released below.
            wgmma_wait::<0>();
            dv_acc.pin();
            dk_acc.pin();
            // SAFETY: initialised barrier; this thread's last read of the slot is complete.
            unsafe { mbarrier_arrive(smem.q_empty(stage)) };
            continue;
        }
        if !DETERMINISTIC && leader {
            bulk_wait_group_read::<0>();
        }
        let barrier = if hopper_backward_dq_in_turns(D) { dq_turn_barrier(step) } else { ALL_CONSUMERS };
        named_barrier_sync(barrier, all_consumers);
        // ANCHOR_END: dq_turns

        // dQ += scale · dS·K for the column block: dS (queries × keys, read MN-major from dSᵀ)
        // times K (keys × columns, MN-major).
        let column_block = dq_column_block::<D>(index);
        let ds_rows = mn_major_descriptor(ds_buffer, BLOCK_M);
        let k_block = smem.k() + (column_block * BLOCK_N * SWIZZLE_ROW_BYTES) as u32;
        let k_block = mn_major_descriptor(k_block, BLOCK_N);
        let mut dq = [[0.0f32; 4]; DQ_TILES];
        dq.pin();
        wgmma_fence();
        for ks in 0..BLOCK_N / 16 {
            let offset = (ks * 2 * SWIZZLE_ATOM_BYTES) as u32;
            let (a, b) = (advance_descriptor(ds_rows, offset), advance_descriptor(k_block, offset));
            // SAFETY: dSᵀ was published above; K is complete.
            unsafe { dq.mma_mn_major::<T>(a, b, ks > 0) };
        }
        wgmma_commit();
        wgmma_wait::<0>();
        dq.pin();

        // ANCHOR: dq_reduce
        // The block's share of dQ goes to device memory through TMA: each thread
        // writes its fragments to the staging tile (boxes of 32 `f32` columns, swizzled as
        // TMA expects), and one thread asks for the tile to be added to dQ, element by element
        // and atomically, skipping rows past seqlen_q ([`add_dq_boxes`]). That is one request per
        // tile instead of 16 atomics per thread, whose queue filled up and stalled the warps.
        // The atomic instances' leader asks right away; the deterministic instances hand the
        // tile to their dQ warp ([`produce_dq`]), which may have to wait for its turn, and the
        // consumer goes on (only at its next dQ, a tile later or two where the consumers take
        // turns, it waits for the staging tile to be free again).
        let staging = smem.dq_staging(index);
        if DETERMINISTIC {
            let use_index = own_dq_step(D, step);
            // SAFETY: initialised barrier; the first tile finds the staging tile free.
            unsafe { wait_slot_free(smem.dq_empty(index), use_index, 1, ring_slot(use_index, 1).1) };
        }
        // SAFETY: the staging tile, which the barrier or the wait above freed, holds the share's
        // columns (`hopper_backward_dq_staging_columns`).
        unsafe { stage_dq(staging, &dq, warp, lane, scale) };
        fence_proxy_async();
        if DETERMINISTIC {
            // SAFETY: initialised barrier (128 arrivals: release semantics publish the stores).
            unsafe { mbarrier_arrive(smem.dq_full(index)) };
        } else {
            named_barrier_sync(1 + index as u32, WARPGROUP_THREADS as u32);
            if leader {
                let head = block.batch * shape.num_heads_q + q_head;
                // SAFETY: the staging tile was written and published above; map 4 is dQ's.
                unsafe { add_dq_boxes(maps, staging, column_block * SWIZZLE_COLUMNS, dq_boxes(D), tile, head) };
            }
        }
        // ANCHOR_END: dq_reduce
        dv_acc.pin();
        dk_acc.pin();
        // Q and dO of this slot are no longer read (dV and dK finished with the first wait).
        unsafe { mbarrier_arrive(smem.q_empty(stage)) };
    }

    // The last dQ tile must be read before the block's shared memory goes away.
    if !DETERMINISTIC && leader {
        bulk_wait_group::<0>();
    }

    // dK = scale · Σ dSᵀ·Q and dV, for the keys that exist.
    let warp_key = k_first + 16 * (hw::warp_id() % 4);
    let lane = FragmentLane::current();
    let d = shape.head_dim; // rows of dK and dV are `d ≤ D` long; the columns past it are not stored
    let kv_rows = (block.batch * shape.num_heads_kv + block.kv_head) * shape.seqlen_k * d;
    // SAFETY: rows below seqlen_k of this key/value head exist.
    unsafe {
        store_fragment_pairs::<T, D, D_TILES>(&dk_acc, [scale; 2], dk.add(kv_rows), d, warp_key, shape.seqlen_k, lane);
        store_fragment_pairs::<T, D, D_TILES>(&dv_acc, [1.0; 2], dv.add(kv_rows), d, warp_key, shape.seqlen_k, lane);
    }
}

/// Round `round` of consumer `index`'s share of a tile's dQ in the wide-head kernel: its column
/// block (64 columns of head_dim), first key and key count. The column blocks go in pairs, one
/// to each consumer with all 64 keys; an odd last block (head_dim 160 and 192) is split by keys, 32
/// each, both adding to the same columns. So both consumers run the same rounds.
#[inline(always)]
const fn wide_dq_round<const D: usize>(round: usize, index: usize) -> (usize, usize, usize) {
    // Whether the pair of this round is whole does not depend on `index`.
    if 2 * round + 1 < column_blocks(D) {
        (2 * round + index, 0, WIDE_BLOCK_N)
    } else {
        (2 * round, index * WIDE_BLOCK_N / CONSUMERS, WIDE_BLOCK_N / CONSUMERS)
    }
}

/// Issues and commits the wide-head kernel's product over a whole query tile: dV += Pᵀ·dO for
/// consumer 0, dK += dSᵀ·Q for consumer 1, A the key-row buffer (64 keys × 64 queries, K-major),
/// B the tile (queries × D, MN-major). `acc` must not be read or written until a wait.
///
/// # Safety
/// Every thread of the warpgroup calls it; the buffers were published and the tiles are complete.
#[inline(always)]
unsafe fn issue_wide_gradient<T: HalfFloat, const D_TILES: usize>(
    acc: &mut [FragC; D_TILES],
    index: usize,
    (p_buffer, ds_buffer): (u32, u32),
    (q_tile, do_tile): (u32, u32),
) where
    [FragC; D_TILES]: Accumulator,
{
    let (a_buffer, b_tile) = if index == 0 { (p_buffer, do_tile) } else { (ds_buffer, q_tile) };
    acc.pin();
    wgmma_fence();
    for kk in 0..BLOCK_M / 16 {
        let a = advance_descriptor(k_major_descriptor(a_buffer), (kk * 32) as u32);
        let b = mn_major_descriptor(b_tile + (kk * 2 * SWIZZLE_ATOM_BYTES) as u32, BLOCK_M);
        // SAFETY: the caller's contract.
        unsafe { acc.mma_mn_major_b::<T>(a, b, true) };
    }
    wgmma_commit();
}

/// One consumer warpgroup of the wide-head kernel (head_dim above 128; "Wide heads" in the
/// module docs): for every query tile, Sᵀ and dPᵀ of the block's 64 keys and this consumer's
/// half of the queries; Pᵀ and dSᵀ of that half into the key-row buffers; then, over the whole
/// tile, dV += Pᵀ·dO (consumer 0) or dK += dSᵀ·Q (consumer 1), and this consumer's column
/// blocks of dQ (0, 2, … or 1, 3, …; an odd last one split by keys, [`wide_dq_round`]) added to
/// device memory 64 or 32 columns at a time.
///
/// # Safety
/// As [`consume`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn consume_wide<T: HalfFloat, const D: usize, const STAGES: usize, const D_TILES: usize, const MODS: bool>(
    smem: SharedTiles<D, STAGES>,
    block: &KeyBlock,
    shape: &AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
    maps: TensorMaps,
    (dk, dv): (*mut u16, *mut u16),
) where
    [FragC; D_TILES]: Accumulator,
{
    let index = warpgroup_id() - 1;
    let leader = hw::thread_idx_x().is_multiple_of(WARPGROUP_THREADS);
    let c = scale * LOG2_E;
    // dV (consumer 0) or dK (consumer 1) of all 64 keys, all D columns.
    let mut acc = [[0.0f32; 4]; D_TILES];
    // SAFETY: initialised barrier; its first (only) phase.
    unsafe { mbarrier_wait(smem.kv_full(), 0) };

    let (smem0, thread0) = (smem.base, hw::thread_idx_x() as u32);
    for step in 0..block.steps() {
        // Recomputed every tile, as in [`consume`].
        let smem = SharedTiles::<D, STAGES> { base: opaque(smem0) };
        let thread = opaque(thread0) as usize;
        let (warp, lane) = (thread / 32 % 4, FragmentLane::of(thread % 32));
        let t = lane.t;
        // The key of fragment entry e (rows g and g + 8 of the warp; the block's rows are its keys).
        let key = |e: usize| block.k_start + 16 * warp + lane.row(e);
        let (stage, parity) = ring_slot(step, STAGES);
        let (q_head, tile) = block.step(step);
        // This consumer's queries: the tile's half `index`.
        let q_first = tile * BLOCK_M + index * HALF_M;
        // SAFETY: initialised barriers.
        unsafe {
            mbarrier_wait(smem.q_full(stage), parity);
            mbarrier_wait(smem.do_full(stage), parity);
        }
        let (q_tile, do_tile) = (smem.q(stage), smem.d_o(stage));

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: 64 keys by this half's 32 queries (its rows of Q and dO,
        // whole swizzle atoms from the tile's start).
        let half_rows = (index * HALF_M * SWIZZLE_ROW_BYTES) as u32;
        let mut s = [[0.0f32; 4]; 4];
        let mut dp = [[0.0f32; 4]; 4];
        s.pin();
        dp.pin();
        wgmma_fence();
        // SAFETY: tiles TMA completed.
        unsafe {
            issue_transposed_product::<T, D, _>(&mut s, k_major_descriptor(smem.k()), q_tile + half_rows);
            issue_transposed_product::<T, D, _>(&mut dp, k_major_descriptor(smem.v()), do_tile + half_rows);
        }
        wgmma_commit();
        wgmma_wait::<0>();
        s.pin();
        dp.pin();

        // Pᵀ and dSᵀ as in [`consume`], for this half's queries.
        let all_visible = mask.all_visible(q_first, HALF_M, block.k_start, WIDE_BLOCK_N);
        let keys = [0, 2].map(|e| key(e) as u32);
        // SAFETY: the slot's statistics were published by "dO full".
        let (p, ds) = unsafe {
            masked_tile_gradients::<T, D, STAGES, 4, 2, MODS>(
                (&mut s, &mut dp),
                (smem, stage, index * HALF_M),
                (&mask, all_visible, false, &score, shape, q_head),
                (block.k_start + 16 * warp, keys, q_first),
                lane,
                c,
            )
        };

        // ANCHOR: wide_halves
        // Both halves into the key-row buffers: Pᵀ (buffer 0) and dSᵀ (buffer 1), 64 keys × 64
        // queries each. The first barrier waits until both consumers finished the previous
        // tile's products, the last readers of the buffers (each waited for its own); the
        // second publishes the new halves.
        let (p_buffer, ds_buffer) = (smem.ds(0), smem.ds(1));
        named_barrier_sync(ALL_CONSUMERS, (CONSUMERS * WARPGROUP_THREADS) as u32);
        let key_rows = [0, 2].map(|e| key(e) - block.k_start);
        // SAFETY: inside the 8 KiB buffers, which no product reads now (the barrier above).
        unsafe {
            store_key_rows(p_buffer, &p, key_rows, index * HALF_M, t);
            store_key_rows(ds_buffer, &ds, key_rows, index * HALF_M, t);
        }
        fence_proxy_async();
        named_barrier_sync(ALL_CONSUMERS, (CONSUMERS * WARPGROUP_THREADS) as u32);
        // ANCHOR_END: wide_halves

        // dV += Pᵀ·dO (consumer 0) or dK += dSᵀ·Q (consumer 1) over the whole tile
        // ([`issue_wide_gradient`]), and dQ = scale · dS·K by column blocks of 64
        // ([`wide_dq_round`]: the same rounds for both consumers, so that ptxas sees no `wgmma`
        // on a divergent path). Each round is staged and added in boxes of 32 columns, as many
        // at a time as the staging tile holds: two, or one at head_dim 256, where shared memory
        // holds no more. With two, the first round's product goes before dV's or dK's, so that
        // its staging and addition overlap that longer product; with one box at a time that
        // order measured slower, and dV's or dK's product goes first (PERFORMANCE.md,
        // 2026-12-04, "wide heads").
        let head = block.batch * shape.num_heads_q + q_head;
        let staging = smem.dq_staging(index);
        let staged_boxes = hopper_backward_dq_staging_columns(D) / DQ_BOX_COLUMNS;
        let gradient_first = staged_boxes == 1;
        if gradient_first {
            // SAFETY: the buffers were published above; the tiles are complete.
            unsafe { issue_wide_gradient::<T, D_TILES>(&mut acc, index, (p_buffer, ds_buffer), (q_tile, do_tile)) };
        }
        let rounds = D.div_ceil(2 * SWIZZLE_COLUMNS);
        hw::unroll::<4>(|round| {
            if round >= rounds {
                return;
            }
            let (column_block, first_key, keys) = wide_dq_round::<D>(round, index);
            let key_rows = (first_key * SWIZZLE_ROW_BYTES) as u32;
            let ds_rows = mn_major_descriptor(ds_buffer + key_rows, BLOCK_M);
            let k_block = smem.k() + (column_block * WIDE_BLOCK_N * SWIZZLE_ROW_BYTES) as u32 + key_rows;
            let k_block = mn_major_descriptor(k_block, WIDE_BLOCK_N);
            let mut dq = [[0.0f32; 4]; 8];
            dq.pin();
            wgmma_fence();
            // Unrolled: LLVM keeps the two-step loop of a split round, and ptxas then fences
            // around its `wgmma` (C7519).
            hw::unroll::<{ WIDE_BLOCK_N / 16 }>(|ks| {
                if ks < keys / 16 {
                    let offset = (ks * 2 * SWIZZLE_ATOM_BYTES) as u32;
                    let (a, b) = (advance_descriptor(ds_rows, offset), advance_descriptor(k_block, offset));
                    // SAFETY: dSᵀ was published above; K is complete.
                    unsafe { dq.mma_mn_major::<T>(a, b, ks > 0) };
                }
            });
            wgmma_commit();
            if round == 0 && !gradient_first {
                // SAFETY: the buffers were published above; the tiles are complete.
                unsafe { issue_wide_gradient::<T, D_TILES>(&mut acc, index, (p_buffer, ds_buffer), (q_tile, do_tile)) };
                // This round's product only: dV's or dK's may go on.
                wgmma_wait::<1>();
            } else {
                // (The first one also completes dV's or dK's products: they retire in order.)
                wgmma_wait::<0>();
            }
            dq.pin();
            for trip in 0..COLUMN_BLOCK_BOXES / staged_boxes {
                // The staging tile is free once the leader's previous addition has read it.
                if leader {
                    bulk_wait_group_read::<0>();
                }
                named_barrier_sync(1 + index as u32, WARPGROUP_THREADS as u32);
                let fragments =
                    &dq[trip * staged_boxes * DQ_BOX_COLUMNS / 8..(trip + 1) * staged_boxes * DQ_BOX_COLUMNS / 8];
                // SAFETY: the staging tile holds `staged_boxes` boxes, freed above.
                unsafe { stage_dq(staging, fragments, warp, lane, scale) };
                fence_proxy_async();
                named_barrier_sync(1 + index as u32, WARPGROUP_THREADS as u32);
                if leader {
                    let first_column = column_block * SWIZZLE_COLUMNS + trip * staged_boxes * DQ_BOX_COLUMNS;
                    // SAFETY: the staging tile was written and published above; map 4 is dQ's.
                    unsafe { add_dq_boxes(maps, staging, first_column, staged_boxes, tile, head) };
                }
            }
        });
        if rounds == 1 && !gradient_first {
            wgmma_wait::<0>();
        }
        acc.pin();
        // Q and dO of this slot are no longer read (the products finished with the waits above;
        // every consumer has at least one column block).
        // SAFETY: initialised barrier.
        unsafe { mbarrier_arrive(smem.q_empty(stage)) };
    }

    // The last dQ box must be read before the block's shared memory goes away.
    if leader {
        bulk_wait_group::<0>();
    }

    // dV (consumer 0) or dK = scale · Σ dSᵀ·Q (consumer 1), for the keys that exist.
    let warp_key = block.k_start + 16 * (hw::warp_id() % 4);
    let lane = FragmentLane::current();
    let d = shape.head_dim;
    let kv_rows = (block.batch * shape.num_heads_kv + block.kv_head) * shape.seqlen_k * d;
    let (out, factor) = if index == 0 { (dv, 1.0) } else { (dk, scale) };
    // SAFETY: rows below seqlen_k of this key/value head exist.
    unsafe {
        store_fragment_pairs::<T, D, D_TILES>(&acc, [factor; 2], out.add(kv_rows), d, warp_key, shape.seqlen_k, lane)
    };
}

/// The kernel body (see the module docs). Grid: `(ceil(seqlen_k / block_n), num_heads_kv,
/// batch)`, block_n = [`hopper_backward_block_n`]`(D)`,
/// mapped to key blocks by [`KeyBlock::hopper_backward`];
/// block: 384 threads; dynamic shared memory: [`crate::layout::hopper_backward_smem_bytes`]`(D,
/// STAGES)`. `D_TILES` = D / 8 sizes the dK and dV accumulators.
///
/// # Safety
/// `maps` holds, in device memory, the tensor maps (3-D, 128-byte swizzle) of Q, K, V and dO
/// (boxes of 64 columns by 64 rows for Q and dO, block_n for K and V) and of the `f32` dQ
/// accumulator (Q's shape, zeroed; boxes of 32 columns by 64 rows), which the kernel adds to;
/// `lse` and `delta` hold `[batch, num_heads_q, seqlen_q]` `f32`, `dk` and `dv` K's shape in 16
/// bits; with `DETERMINISTIC`, `dq_turns` holds `[batch, num_heads_q, ceil(seqlen_q / 64)]`
/// zeroed `u32` counters (else it is not read); `shape.head_dim == D`; `MODS` is
/// `score.is_active()`; the launch as above.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn flash_backward_wgmma<
    T: HalfFloat,
    const D: usize,
    const STAGES: usize,
    const D_TILES: usize,
    const DQ_TILES: usize,
    const DETERMINISTIC: bool,
    const MODS: bool,
>(
    maps: *const u8,
    lse: *const f32,
    delta: *const f32,
    dk: *mut u16,
    dv: *mut u16,
    dq_turns: *mut u32,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale: f32,
) where
    [FragC; D_TILES]: Accumulator,
    [FragC; DQ_TILES]: Accumulator,
{
    // The wide-head kernel adds dQ in any order only.
    const { assert!(!(is_wide(D) && DETERMINISTIC)) };
    let smem = SharedTiles::<D, STAGES>::new();
    let maps = TensorMaps(maps);
    let block = if is_wide(D) {
        KeyBlock::hopper_backward::<BLOCK_M, WIDE_BLOCK_N>(&shape, &mask, DETERMINISTIC)
    } else {
        KeyBlock::hopper_backward::<BLOCK_M, BLOCK_N>(&shape, &mask, DETERMINISTIC)
    };
    let mask = mask.for_batch(block.batch);
    if hw::thread_idx_x() == 0 {
        // SAFETY: one thread initialises the barriers before the block barrier below.
        unsafe {
            mbarrier_init(smem.kv_full(), 1);
            for stage in 0..STAGES {
                mbarrier_init(smem.q_full(stage), 1);
                // TMA's bytes, plus one arrival per lane of the statistics warp.
                mbarrier_init(smem.do_full(stage), 1 + 32);
                mbarrier_init(smem.q_empty(stage), (CONSUMERS * WARPGROUP_THREADS) as u32);
            }
            if DETERMINISTIC {
                // A consumer's 128 threads stage its dQ share; its dQ warp frees the tile.
                for index in 0..CONSUMERS {
                    mbarrier_init(smem.dq_full(index), WARPGROUP_THREADS as u32);
                    mbarrier_init(smem.dq_empty(index), 1);
                }
            }
        }
        fence_mbarrier_init();
    }
    hw::sync_threads();
    if take_role::<{ SM90_BACKWARD_REGISTERS.0 }, { SM90_BACKWARD_REGISTERS.1 }>() {
        // SAFETY: the barriers are initialised; the maps and pointers are the host's.
        // Warp 0 loads tiles, warp 1 the statistics; in the deterministic instances warps 2 and
        // 3 add dQ (one per consumer).
        match (hw::warp_id(), hw::lane_id()) {
            (0, 0) => unsafe { produce_tiles(smem, maps, &shape, &block) },
            (1, _) => unsafe { produce_statistics(smem, &shape, &block, lse, delta) },
            (warp @ 2..4, 0) if DETERMINISTIC => unsafe {
                produce_dq::<D, STAGES>(smem, maps, &shape, &block, &mask, warp - 2, dq_turns)
            },
            _ => {}
        }
    } else if is_wide(D) {
        // SAFETY: the launch contract.
        unsafe {
            consume_wide::<T, D, STAGES, D_TILES, MODS>(smem, &block, &shape, mask, score, scale, maps, (dk, dv))
        };
    } else {
        // SAFETY: the launch contract.
        unsafe {
            consume::<T, D, STAGES, D_TILES, DQ_TILES, DETERMINISTIC, MODS>(
                smem,
                &block,
                &shape,
                mask,
                score,
                scale,
                maps,
                (dk, dv),
            )
        };
    }
}

/// Four entries per configuration up to head_dim 128: `hopper_flash_bwd_{f16,bf16}_m64_n128_d{D}_s{STAGES}`
/// (dQ added in whatever order the blocks come), the same with `_deterministic` (in turns), and
/// each with `_mods` for problems with a score modification (`ScoreArgs::is_active`: softcap or
/// ALiBi), which the host picks by that suffix; above 128 (`_m64_n64_`, the wide-head kernel)
/// the two without `_deterministic`. The modified body is a kernel of its own, not a
/// branch of the plain one, because ptxas gives one kernel one register allocation and one
/// stack frame: the modified body spills at head_dim 128, and sharing a kernel with it cost the
/// plain body 5–10 % (PERFORMANCE.md). `sm90_backward_configs!` (in [`crate::configs`]) lists
/// the configurations.
macro_rules! flash_backward_wgmma_instance {
    ($dtype:ident, $format:ident, $d:literal, $block_n:literal, $stages:literal, deterministic) => {
        flash_backward_wgmma_instance!($dtype, $format, $d, $block_n, $stages, atomic);
        pastey::paste! {
            flash_backward_wgmma_instance!(@entry $format, true, false,
                [<hopper_flash_bwd_ $dtype _m64_n $block_n _d $d _s $stages _deterministic>], $d, $stages);
            flash_backward_wgmma_instance!(@entry $format, true, true,
                [<hopper_flash_bwd_ $dtype _m64_n $block_n _d $d _s $stages _deterministic_mods>], $d, $stages);
        }
    };
    ($dtype:ident, $format:ident, $d:literal, $block_n:literal, $stages:literal, atomic) => {
        const _: () = assert!($block_n == hopper_backward_block_n($d));
        pastey::paste! {
            flash_backward_wgmma_instance!(@entry $format, false, false,
                [<hopper_flash_bwd_ $dtype _m64_n $block_n _d $d _s $stages>], $d, $stages);
            flash_backward_wgmma_instance!(@entry $format, false, true,
                [<hopper_flash_bwd_ $dtype _m64_n $block_n _d $d _s $stages _mods>], $d, $stages);
        }
    };
    (@entry $format:ident, $deterministic:literal, $mods:literal, $name:ident, $d:literal, $stages:literal) => {
        attention_kernel! {
        /// FlashAttention backward on Hopper (sm_90a); see the module docs.
        ///
        /// # Safety
        /// As `flash_backward_wgmma`.
        fn $name(
            maps: *const u8,
            lse: *const f32,
            delta: *const f32,
            dk: *mut u16,
            dv: *mut u16,
            dq_turns: *mut u32,
        ) |shape, mask, score, scale| {
            unsafe {
                flash_backward_wgmma::<
                    hw::$format,
                    $d,
                    $stages,
                    { $d / 8 },
                    { hopper_backward_dq_columns($d) / 8 },
                    $deterministic,
                    $mods,
                >(
                    maps, lse, delta, dk, dv, dq_turns, shape, mask, score, scale,
                )
            }
        }
        }
    };
}

sm90_backward_configs!(flash_backward_wgmma_instance);
