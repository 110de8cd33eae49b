//! Level 8 (sm_90a only): the FlashAttention forward pass on Hopper, organised as
//! FlashAttention-3 organises it (Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention
//! with Asynchrony and Low-precision", Algorithms 1 and 2). The arithmetic is level 5's
//! ([`crate::flash_forward_mma`]: online softmax, P kept in registers between the two products);
//! what changes is who does what, and when:
//!
//! * **Warp specialisation.** Warpgroup 0, the *producer*, owns no rows: one of its threads asks
//!   TMA ([`tma_load_3d`]) for the Q tile and then for K and V tiles, round a
//!   ring of `STAGES` slots. The other warpgroups, the *consumers*, each own 64 query rows and
//!   only compute: two (block_m = 128), or three (block_m = 192) at head_dim 64 on grids deep
//!   enough, where the softmax costs as much as the products and a third warpgroup keeps the
//!   tensor cores busier. Producer and consumers meet at
//!   `mbarrier`s: per slot a *full* barrier for K, one for V (TMA completes them),
//!   and an *empty* barrier that every consumer thread arrives at once it is done with the slot.
//!   The producer gives most of its registers to the consumers (`setmaxnreg`).
//! * **Both products on `wgmma`.** S = Q·Kᵀ reads both operands from shared memory; O += P·V
//!   takes P from registers. The tiles sit in shared memory as TMA writes them with the 128-byte
//!   swizzle ([`swizzled_descriptor`]): a `rows × head_dim` tile is `head_dim / 64` column
//!   blocks of `rows × 128` bytes.
//! * **Intra-warpgroup overlap** (FA3 Algorithm 2). In iteration j a consumer issues S_j = Q·K_jᵀ
//!   and O += P_{j−1}·V_{j−1} back to back, waits only for S_j, and runs the softmax of tile j
//!   while the tensor cores still work on P_{j−1}·V_{j−1}. The consumer warpgroups also overlap
//!   each other, as the scheduler interleaves them, or, with `PINGPONG`, by taking turns at the
//!   tensor cores (FA3 section 3.1).
//! * **A grid that ends evenly.** The blocks of a head differ by at most 64 rows, the longest
//!   start first, and under a causal mask the heads go in L2-sized sections
//!   ([`QueryBlock::hopper_forward`]); consumer warpgroups that own no rows of a short block only
//!   hand the K/V tiles back. One thread prefetches the tensor maps while the block sets up.
//!   (PERFORMANCE.md, sections "night" and "late", on 4 × 16 × 4096 at head_dim 64: +4–8 % for
//!   the consumers without rows, then +2 % for the balanced, longest-first grid; causal, +6–12 %
//!   for the longest-first order within a head, then +5 %.)
//!
//! Each consumer warp's `wgmma` accumulator has the m16n8 layout of `mma.sync`
//! ([`Accumulator`]), so level 5's [`RowSoftmax`] and [`pack_a`] apply unchanged.

use crate::flash_forward_mma::{RowSoftmax, pack_a};
use crate::gpu::{self, FragA, FragC, HalfFloat};
use crate::hopper::{
    Accumulator, SWIZZLE_ATOM_BYTES, SWIZZLE_ROW_BYTES, TensorMaps, WARPGROUP_THREADS, advance_descriptor,
    fence_mbarrier_init, fence_proxy_async, k_major_descriptor, mbarrier_arrive, mbarrier_arrive_expect_tx,
    mbarrier_init, mbarrier_wait, mn_major_descriptor, named_barrier_arrive, named_barrier_sync, prefetch_tensor_map,
    registers_decrease, registers_increase, ring_slot, shared_address, tma_load_3d, warpgroup_id, wgmma_commit,
    wgmma_fence, wgmma_wait,
};
use crate::layout::{AttentionShape, HOPPER_SMEM_ALIGN, HOPPER_WARPGROUP_ROWS as WARPGROUP_ROWS};
use crate::tiles::{Mask, QueryBlock};

/// Columns of one swizzled column block: 128 bytes of 16-bit values.
const SWIZZLE_COLUMNS: usize = SWIZZLE_ROW_BYTES / 2;

/// Per-thread register budgets after `setmaxnreg`, (producer, consumers), by block size. The
/// launch gives every thread 65536 registers / threads, rounded down to a multiple of 8: 168 for
/// 384 threads (two consumer warpgroups), 128 for 512 (three). The producer only issues copies;
/// the consumers take the rest: 56 + 2 · 224 = 3 · 168, and 32 + 3 · 160 = 4 · 128. (With fewer
/// than about 48 registers the producer's loop spills a little; the consumers matter more.)
const REGISTERS_M128: (u32, u32) = (56, 224);
const REGISTERS_M192: (u32, u32) = (32, 160);

/// The first of the named barriers of the ping-pong schedule, one per consumer warpgroup (0 is
/// `__syncthreads`; 1 to 3 are the consumer warpgroups' own).
const PINGPONG_BARRIER: u32 = 4;

/// The block's shared memory: the Q tile, `STAGES` slots of a K and a V tile, then the
/// `mbarrier`s, from a base aligned to one swizzle atom. Addresses are shared-state-space
/// addresses (32-bit), as `wgmma` descriptors, TMA and `mbarrier`s take them.
#[derive(Clone, Copy)]
struct SharedTiles<const BLOCK_M: usize, const D: usize, const BLOCK_N: usize, const STAGES: usize> {
    /// The dynamic shared memory as a generic pointer, and its shared-state-space address.
    raw: *mut u8,
    raw_address: u32,
    /// The first tile's address: `raw_address` rounded up to `HOPPER_SMEM_ALIGN`.
    base: u32,
}

impl<const BLOCK_M: usize, const D: usize, const BLOCK_N: usize, const STAGES: usize>
    SharedTiles<BLOCK_M, D, BLOCK_N, STAGES>
{
    const Q_BYTES: u32 = (BLOCK_M * D * 2) as u32;
    const KV_BYTES: u32 = (BLOCK_N * D * 2) as u32;

    /// The layout over this block's dynamic shared memory (the host adds `HOPPER_SMEM_ALIGN`
    /// bytes of slack for the rounding).
    #[inline(always)]
    fn new() -> Self {
        let raw = gpu::dynamic_shared_memory() as *mut u8;
        let raw_address = shared_address(raw);
        let align = HOPPER_SMEM_ALIGN as u32;
        Self { raw, raw_address, base: raw_address.div_ceil(align) * align }
    }

    /// A generic pointer to the byte at shared-state-space `address`, for ordinary loads and
    /// stores.
    #[inline(always)]
    fn pointer(self, address: u32) -> *mut u8 {
        // SAFETY: `address` lies in this block's dynamic shared memory.
        unsafe { self.raw.add((address - self.raw_address) as usize) }
    }

    #[inline(always)]
    fn q(self) -> u32 {
        self.base
    }

    #[inline(always)]
    fn k(self, stage: usize) -> u32 {
        self.base + Self::Q_BYTES + 2 * stage as u32 * Self::KV_BYTES
    }

    #[inline(always)]
    fn v(self, stage: usize) -> u32 {
        self.k(stage) + Self::KV_BYTES
    }

    /// Barrier `i` of `[Q full, K full × STAGES, V full × STAGES, K empty × STAGES, V empty ×
    /// STAGES]`.
    #[inline(always)]
    fn barrier(self, i: usize) -> u32 {
        self.base + Self::Q_BYTES + 2 * STAGES as u32 * Self::KV_BYTES + 8 * i as u32
    }

    #[inline(always)]
    fn q_full(self) -> u32 {
        self.barrier(0)
    }

    #[inline(always)]
    fn k_full(self, stage: usize) -> u32 {
        self.barrier(1 + stage)
    }

    #[inline(always)]
    fn v_full(self, stage: usize) -> u32 {
        self.barrier(1 + STAGES + stage)
    }

    #[inline(always)]
    fn k_empty(self, stage: usize) -> u32 {
        self.barrier(1 + 2 * STAGES + stage)
    }

    #[inline(always)]
    fn v_empty(self, stage: usize) -> u32 {
        self.barrier(1 + 3 * STAGES + stage)
    }
}

/// The producer: one thread loads the Q tile, then every K/V tile of the block, each into its
/// ring slot once the consumers have released the slot's previous tile.
///
/// # Safety
/// One thread of warpgroup 0 calls it, after the barriers were initialised.
#[inline(always)]
unsafe fn produce<const BLOCK_M: usize, const D: usize, const BLOCK_N: usize, const STAGES: usize>(
    smem: SharedTiles<BLOCK_M, D, BLOCK_N, STAGES>,
    maps: TensorMaps,
    shape: &AttentionShape,
    block: &QueryBlock,
    kv_tiles: usize,
) {
    let q_head = (block.batch * shape.num_heads_q + block.head) as i32;
    let kv_head = (block.batch * shape.num_heads_kv + block.head / shape.group_size()) as i32;
    // Loads a `rows × D` tile as D / 64 boxes, one per swizzled column block, completing on
    // `barrier`, which learns the bytes first.
    let load = |destination: u32, map: *const u8, rows: usize, first_row: usize, head: i32, barrier: u32| {
        // SAFETY: the barrier is initialised; each box fits its column block of the tile.
        unsafe {
            mbarrier_arrive_expect_tx(barrier, (rows * D * 2) as u32);
            for column_block in 0..D / SWIZZLE_COLUMNS {
                let x = (column_block * SWIZZLE_COLUMNS) as i32;
                let box_destination = destination + (column_block * rows * SWIZZLE_ROW_BYTES) as u32;
                tma_load_3d(box_destination, map, x, first_row as i32, head, barrier);
            }
        }
    };
    load(smem.q(), maps.get(0), BLOCK_M, block.q_start, q_head, smem.q_full());
    for tile in 0..kv_tiles {
        let (stage, parity) = ring_slot(tile, STAGES);
        let first_key = tile * BLOCK_N;
        // The slot's previous tile (tile − STAGES) is released by the phase before this one. K
        // is released as soon as its scores are done, V only after P·V, a step later.
        // SAFETY: initialised barriers.
        if tile >= STAGES {
            unsafe { mbarrier_wait(smem.k_empty(stage), parity ^ 1) };
        }
        load(smem.k(stage), maps.get(1), BLOCK_N, first_key, kv_head, smem.k_full(stage));
        if tile >= STAGES {
            unsafe { mbarrier_wait(smem.v_empty(stage), parity ^ 1) };
        }
        load(smem.v(stage), maps.get(2), BLOCK_N, first_key, kv_head, smem.v_full(stage));
    }
}

/// One consumer warpgroup's rows: their first query row and the warp and lane coordinates of
/// this thread in the m16n8 accumulator layout.
#[derive(Clone, Copy)]
struct ConsumerRows {
    /// The first query row of this thread's warp, in the head.
    warp_row: usize,
    /// Row within the warp's 16 (`lane / 4`, and 8 more) and column pair (`lane % 4`).
    g: usize,
    t: usize,
}

impl ConsumerRows {
    /// The query row of fragment entry `e` (rows `g` and `g + 8`).
    #[inline(always)]
    fn row(self, e: usize) -> usize {
        self.warp_row + self.g + 8 * (e / 2)
    }
}

/// The consumer warpgroup's loop: S = Q·Kᵀ, mask, online softmax and O += P·V over the block's
/// K/V tiles, pipelined as FA3's Algorithm 2, then O and the LSE written out.
///
/// # Safety
/// Every thread of one consumer warpgroup calls it; `o` and `lse` point to this head's rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn consume<
    T: HalfFloat,
    const BLOCK_M: usize,
    const D: usize,
    const BLOCK_N: usize,
    const STAGES: usize,
    const N_TILES: usize,
    const P_STEPS: usize,
    const D_TILES: usize,
    const PINGPONG: bool,
>(
    smem: SharedTiles<BLOCK_M, D, BLOCK_N, STAGES>,
    block: &QueryBlock,
    mask: Mask,
    kv_tiles: usize,
    scale_log2: f32,
    o_head: *mut u16,
    lse_head: *mut f32,
) where
    [FragC; N_TILES]: Accumulator,
    [FragC; D_TILES]: Accumulator,
{
    let index = warpgroup_id() - 1;
    let lane = gpu::lane_id();
    let rows = ConsumerRows {
        warp_row: block.q_start + index * WARPGROUP_ROWS + 16 * (gpu::warp_id() % 4),
        g: lane / 4,
        t: lane % 4,
    };
    // This warpgroup's 64 rows of Q start 64 rows into each column block of the Q tile.
    let q_rows_offset = index * WARPGROUP_ROWS * SWIZZLE_ROW_BYTES;

    // In a block shorter than BLOCK_M (the last few of a head, see `QueryBlock::hopper_forward`)
    // a warpgroup may own no rows of the block (at 4096 rows and block_m 192, the third
    // warpgroup of the last two blocks): it has nothing to compute, and only hands each K/V slot
    // back (the empty barriers count every consumer thread), so that the block, and its SM,
    // finish sooner. It waits for each tile to arrive first, so that its arrival counts toward
    // that tile's phase and not an earlier one. (With ping-pong turns it would have to keep to
    // the schedule; it computes rows that belong to the next block or to no block, and does not
    // store them.)
    if !PINGPONG && index * WARPGROUP_ROWS >= block.q_rows {
        for tile in 0..kv_tiles {
            let (stage, parity) = ring_slot(tile, STAGES);
            // SAFETY: initialised barriers, one arrival per thread and tile, as the others.
            unsafe {
                mbarrier_wait(smem.k_full(stage), parity);
                mbarrier_arrive(smem.k_empty(stage));
                mbarrier_wait(smem.v_full(stage), parity);
                mbarrier_arrive(smem.v_empty(stage));
            }
        }
        return;
    }

    // SAFETY: initialised barriers; the first (only) phase of the Q barrier.
    unsafe { mbarrier_wait(smem.q_full(), 0) };
    // As in level 5, the softmax wants c = scale·log₂e > 0: a negative scale is applied as −Q
    // with |c|. TMA cannot flip signs on the way, so the warpgroup flips its own rows in shared
    // memory and publishes them back to the async proxy; a zero scale becomes the smallest normal.
    if scale_log2 < 0.0 {
        unsafe { negate_rows::<BLOCK_M, D>(smem.pointer(smem.q() + q_rows_offset as u32)) };
        fence_proxy_async();
        named_barrier_sync(1 + index as u32, WARPGROUP_THREADS as u32);
    }
    let c = scale_log2.abs().max(f32::MIN_POSITIVE);

    // The key limit of the warpgroup's first row: tiles that end before it need no mask.
    let all_see = mask.key_limit(block.q_start + index * WARPGROUP_ROWS);
    // The descriptors of the first k-step of Q (this warpgroup's rows), and of K and V in
    // stage 0; every other operand is one of these, moved along ([`advance_descriptor`]).
    let q_descriptor = k_major_descriptor(smem.q() + q_rows_offset as u32);
    let k_descriptor = k_major_descriptor(smem.k(0));
    // Column blocks of V (64 values of N each) are BLOCK_N rows apart.
    let v_descriptor = mn_major_descriptor(smem.v(0), BLOCK_N);
    let stage_offset = |stage: usize| stage as u32 * 2 * SharedTiles::<BLOCK_M, D, BLOCK_N, STAGES>::KV_BYTES;

    // S = Q·K_tileᵀ into `s` (issued, not waited for): head_dim / 16 k-steps, four per column
    // block, each 32 bytes further inside the swizzled rows.
    let issue_scores = |s: &mut [FragC; N_TILES], stage: usize| {
        let k_stage = advance_descriptor(k_descriptor, stage_offset(stage));
        for ks in 0..D / 16 {
            let (column_block, step) = (ks / 4, (ks % 4 * 32) as u32);
            let a = advance_descriptor(q_descriptor, (column_block * BLOCK_M * SWIZZLE_ROW_BYTES) as u32 + step);
            let b = advance_descriptor(k_stage, (column_block * BLOCK_N * SWIZZLE_ROW_BYTES) as u32 + step);
            // SAFETY: the warpgroup issues it on tiles TMA completed.
            unsafe {
                s.mma::<T>(a, b, ks > 0);
            }
        }
    };
    // O += P·V_stage (issued, not waited for): BLOCK_N / 16 k-steps of 16 keys (two atoms).
    let issue_values = |o: &mut [FragC; D_TILES], p: &[FragA; P_STEPS], stage: usize| {
        let v_stage = advance_descriptor(v_descriptor, stage_offset(stage));
        for kk in 0..BLOCK_N / 16 {
            let b = advance_descriptor(v_stage, (kk * 2 * SWIZZLE_ATOM_BYTES) as u32);
            // SAFETY: as above.
            unsafe {
                o.mma_register_a::<T>(p[kk], b, true);
            }
        }
    };
    // Scores of keys the row must not see become −∞ (only in tiles that cross a row's limit).
    let apply_mask = |s: &mut [FragC; N_TILES], tile: usize| {
        let first_key = tile * BLOCK_N;
        if first_key + BLOCK_N > all_see {
            for (nt, frag) in s.iter_mut().enumerate() {
                for (e, x) in frag.iter_mut().enumerate() {
                    if !mask.visible(rows.row(e), first_key + 8 * nt + 2 * rows.t + e % 2) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    };
    let pack =
        |s: &[FragC; N_TILES]| -> [FragA; P_STEPS] { core::array::from_fn(|kk| pack_a::<T>(s[2 * kk], s[2 * kk + 1])) };

    // Ping-pong (FA3 section 3.1), when `PINGPONG`: the consumer warpgroups take turns, round
    // robin, to issue their products, through one named barrier each, so that one warpgroup's
    // softmax runs while another's products occupy the tensor cores. (Measured on the H200: +5 %
    // with two consumers at head_dim 64, −2 % at 128, −2 % with three consumers.) Warpgroup 0 has the first turn; each turn
    // ends by handing the next to the following warpgroup (the last turn of the last warpgroup
    // is not handed on, so that every wait has exactly one arrival). A barrier's count is the
    // waiting warpgroup and the arriving one.
    let (consumers, turns) = (BLOCK_M / WARPGROUP_ROWS, kv_tiles + 1);
    let pair = 2 * WARPGROUP_THREADS as u32;
    let take_turn = || {
        if PINGPONG {
            named_barrier_sync(PINGPONG_BARRIER + index as u32, pair);
        }
    };
    let pass_turn = |turn: usize| {
        if PINGPONG && (index + 1 < consumers || turn + 1 < turns) {
            named_barrier_arrive(PINGPONG_BARRIER + ((index + 1) % consumers) as u32, pair);
        }
    };
    if PINGPONG && index + 1 == consumers && kv_tiles > 0 {
        named_barrier_arrive(PINGPONG_BARRIER, pair);
    }

    let mut softmax = RowSoftmax::new();
    let mut o = [[0.0f32; 4]; D_TILES];
    let mut s = [[0.0f32; 4]; N_TILES];
    let mut p = [[0u32; 4]; P_STEPS];
    if kv_tiles > 0 {
        // Prologue: the first tile's scores, with nothing to overlap them with.
        unsafe { mbarrier_wait(smem.k_full(0), 0) };
        s.pin();
        take_turn();
        wgmma_fence();
        issue_scores(&mut s, 0);
        wgmma_commit();
        pass_turn(0);
        wgmma_wait::<0>();
        s.pin();
        // K of tile 0 is no longer read.
        unsafe { mbarrier_arrive(smem.k_empty(0)) };
        apply_mask(&mut s, 0);
        softmax.update(&mut s, c);
        p = pack(&s);
    }
    for tile in 1..kv_tiles {
        let (stage, parity) = ring_slot(tile, STAGES);
        let (previous, previous_parity) = ring_slot(tile - 1, STAGES);
        // SAFETY: initialised barriers. V of the previous tile arrived with its K, long ago.
        unsafe {
            mbarrier_wait(smem.k_full(stage), parity);
            mbarrier_wait(smem.v_full(previous), previous_parity);
        }
        s.pin();
        o.pin();
        take_turn();
        wgmma_fence();
        issue_scores(&mut s, stage);
        wgmma_commit();
        issue_values(&mut o, &p, previous);
        wgmma_commit();
        pass_turn(tile);
        // The softmax of this tile runs while P·V of the previous one is still in flight.
        wgmma_wait::<1>();
        s.pin();
        unsafe { mbarrier_arrive(smem.k_empty(stage)) };
        apply_mask(&mut s, tile);
        let alpha = softmax.update(&mut s, c);
        wgmma_wait::<0>();
        o.pin();
        // The previous tile's V is free for the producer.
        unsafe { mbarrier_arrive(smem.v_empty(previous)) };
        // Once the running maxima settle most tiles leave them unchanged (alpha = 1 exactly), and
        // the warp skips the rescale (as level 5 does); the vote keeps the branch warp-uniform.
        if gpu::warp_any(alpha[0] != 1.0 || alpha[1] != 1.0) {
            for frag in o.iter_mut() {
                for (e, x) in frag.iter_mut().enumerate() {
                    *x *= alpha[e / 2];
                }
            }
        }
        p = pack(&s);
    }
    if kv_tiles > 0 {
        // Epilogue: the last tile's P·V.
        let (last, last_parity) = ring_slot(kv_tiles - 1, STAGES);
        unsafe { mbarrier_wait(smem.v_full(last), last_parity) };
        o.pin();
        take_turn();
        wgmma_fence();
        issue_values(&mut o, &p, last);
        wgmma_commit();
        pass_turn(kv_tiles);
        wgmma_wait::<0>();
        o.pin();
    }

    // Normalise and write O (two values per store) and the LSE of the block's rows.
    let (inv_sum, row_lse) = softmax.finish();
    let end = block.q_start + block.q_rows;
    for (dt, frag) in o.iter().enumerate() {
        for h in 0..2 {
            let row = rows.row(2 * h);
            if row < end {
                let value = T::pack(frag[2 * h] * inv_sum[h], frag[2 * h + 1] * inv_sum[h]);
                // SAFETY: row < q_start + q_rows ≤ seqlen_q; the column pair is inside the head
                // dimension.
                unsafe { *(o_head.add(row * D + 8 * dt + 2 * rows.t) as *mut u32) = value };
            }
        }
    }
    if rows.t == 0 {
        for h in 0..2 {
            let row = rows.row(2 * h);
            if row < end {
                // SAFETY: row < seqlen_q, as above.
                unsafe { *lse_head.add(row) = row_lse[h] };
            }
        }
    }
}

/// Flips the sign of the 64 rows × `D` 16-bit values at `rows` in each column block of the
/// Q tile (`BLOCK_M` rows apart): the warpgroup's share, 16 bytes per thread and step.
///
/// # Safety
/// `rows` points to a consumer warpgroup's rows in the Q tile; the whole warpgroup calls it.
#[inline(always)]
unsafe fn negate_rows<const BLOCK_M: usize, const D: usize>(rows: *mut u8) {
    const CHUNKS: usize = WARPGROUP_ROWS * SWIZZLE_ROW_BYTES / 16;
    let first = gpu::thread_idx_x() % WARPGROUP_THREADS;
    for column_block in 0..D / SWIZZLE_COLUMNS {
        let mut chunk = first;
        while chunk < CHUNKS {
            // SAFETY: inside this warpgroup's rows of the column block.
            unsafe {
                let word = rows.add(column_block * BLOCK_M * SWIZZLE_ROW_BYTES + 16 * chunk) as *mut [u32; 4];
                *word = (*word).map(|w| w ^ 0x8000_8000);
            }
            chunk += WARPGROUP_THREADS;
        }
    }
}

/// The kernel body (see the module docs). Grid: `(ceil(seqlen_q / BLOCK_M), num_heads_q, batch)`,
/// mapped to query blocks by [`QueryBlock::hopper_forward`];
/// block: [`crate::layout::hopper_forward_threads`]`(BLOCK_M)` threads (384 or 512); dynamic
/// shared memory: [`crate::layout::hopper_forward_smem_bytes`]`(BLOCK_M, BLOCK_N, D, STAGES)`. `N_TILES` = BLOCK_N / 8,
/// `P_STEPS` = BLOCK_N / 16 and `D_TILES` = D / 8 size the register arrays (array lengths must be
/// plain const parameters).
///
/// # Safety
/// `maps` holds the three tensor maps of Q, K and V (see [`TensorMaps`]) in device memory;
/// `o` and `lse` hold `[batch, num_heads_q, seqlen_q, D]` 16-bit values and
/// `[batch, num_heads_q, seqlen_q]` `f32`; `shape.head_dim == D`; the launch as above.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn flash_forward_wgmma<
    T: HalfFloat,
    const BLOCK_M: usize,
    const D: usize,
    const BLOCK_N: usize,
    const STAGES: usize,
    const N_TILES: usize,
    const P_STEPS: usize,
    const D_TILES: usize,
    const PINGPONG: bool,
>(
    maps: *const u8,
    o: *mut u16,
    lse: *mut f32,
    shape: AttentionShape,
    mask: Mask,
    scale_log2: f32,
) where
    [FragC; N_TILES]: Accumulator,
    [FragC; D_TILES]: Accumulator,
{
    if gpu::thread_idx_x() == gpu::WARP_SIZE {
        // The producer's first copies need the tensor maps: a warp that has nothing else to do
        // yet asks for them while the barriers are set up.
        for map in 0..3 {
            // SAFETY: the host's three maps.
            unsafe { prefetch_tensor_map(TensorMaps(maps).get(map)) };
        }
    }
    let block = QueryBlock::hopper_forward::<BLOCK_M>(&shape, mask.causal);
    let smem = SharedTiles::<BLOCK_M, D, BLOCK_N, STAGES>::new();
    let consumer_threads = (BLOCK_M / WARPGROUP_ROWS * WARPGROUP_THREADS) as u32;
    let kv_tiles = mask.key_limit(block.q_start + block.q_rows - 1).div_ceil(BLOCK_N);

    if gpu::thread_idx_x() == 0 {
        // SAFETY: one thread initialises the barriers before the block barrier below.
        unsafe {
            mbarrier_init(smem.q_full(), 1);
            for stage in 0..STAGES {
                // Full: the producer's arrival (plus the copies' bytes); empty: every consumer thread.
                mbarrier_init(smem.k_full(stage), 1);
                mbarrier_init(smem.v_full(stage), 1);
                mbarrier_init(smem.k_empty(stage), consumer_threads);
                mbarrier_init(smem.v_empty(stage), consumer_threads);
            }
        }
        fence_mbarrier_init();
    }
    gpu::sync_threads();

    if warpgroup_id() == 0 {
        // (The budgets must be immediates, so the choice is spelled out per block size.)
        if BLOCK_M == 128 {
            registers_decrease::<{ REGISTERS_M128.0 }>();
        } else {
            registers_decrease::<{ REGISTERS_M192.0 }>();
        }
        if gpu::thread_idx_x() == 0 {
            // SAFETY: the barriers are initialised; the maps are the host's.
            unsafe { produce(smem, TensorMaps(maps), &shape, &block, kv_tiles) };
        }
    } else {
        if BLOCK_M == 128 {
            registers_increase::<{ REGISTERS_M128.1 }>();
        } else {
            registers_increase::<{ REGISTERS_M192.1 }>();
        }
        // SAFETY: the host sized the grid, so this head's rows exist (offsets in elements).
        let (o_head, lse_head) = unsafe { (o.add(block.q_offset), lse.add(block.q_offset / D)) };
        unsafe {
            consume::<T, BLOCK_M, D, BLOCK_N, STAGES, N_TILES, P_STEPS, D_TILES, PINGPONG>(
                smem, &block, mask, kv_tiles, scale_log2, o_head, lse_head,
            )
        };
    }
}

/// The `f16` and `bf16` entries of one configuration:
/// `hopper_flash_fwd_{f16,bf16}_m{BLOCK_M}_n{BLOCK_N}_d{D}_{variant}`.
macro_rules! flash_forward_wgmma_entries {
    ($block_m:literal, $d:literal, $block_n:literal, $stages:literal, $pingpong:literal, $variant:ident) => {
        flash_forward_wgmma_entry!(
            ${concat(hopper_flash_fwd_f16_m, $block_m, _n, $block_n, _d, $d, _, $variant)},
            F16, $block_m, $d, $block_n, $stages, $pingpong
        );
        flash_forward_wgmma_entry!(
            ${concat(hopper_flash_fwd_bf16_m, $block_m, _n, $block_n, _d, $d, _, $variant)},
            Bf16, $block_m, $d, $block_n, $stages, $pingpong
        );
    };
}

/// One kernel entry.
macro_rules! flash_forward_wgmma_entry {
    ($name:ident, $format:ident, $block_m:literal, $d:literal, $block_n:literal, $stages:literal, $pingpong:literal) => {
        /// FlashAttention forward on Hopper (sm_90a); see the module docs.
        ///
        /// # Safety
        /// As `flash_forward_wgmma`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "gpu-kernel" fn $name(
            maps: *const u8,
            o: *mut u16,
            lse: *mut f32,
            batch: usize,
            num_heads_q: usize,
            num_heads_kv: usize,
            seqlen_q: usize,
            seqlen_k: usize,
            head_dim: usize,
            causal: usize,
            causal_offset: isize,
            scale_log2: f32,
        ) {
            let shape = AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim };
            let mask = Mask { seqlen_q, seqlen_k, causal: causal != 0, offset: causal_offset };
            unsafe {
                flash_forward_wgmma::<
                    gpu::$format,
                    $block_m,
                    $d,
                    $block_n,
                    $stages,
                    { $block_n / 8 },
                    { $block_n / 16 },
                    { $d / 8 },
                    $pingpong,
                >(maps, o, lse, shape, mask, scale_log2)
            }
        }
    };
}

// The configurations measured fastest on an H200 (PERFORMANCE.md, issue #9). At head_dim 64 the
// softmax costs as much as the products: three consumer warpgroups (block_m 192) keep the tensor
// cores busier than two taking ping-pong turns (+12 % non-causal on 4 × 16 × 4096), but make
// fewer, longer blocks, which lose where the grid is only a few waves deep; the host picks by
// grid size. At head_dim 128 the products dominate, registers allow only two consumers, and the
// turns only add waiting.
flash_forward_wgmma_entries!(192, 64, 128, 2, false, s2);
flash_forward_wgmma_entries!(128, 64, 128, 2, true, s2_pingpong);
flash_forward_wgmma_entries!(128, 128, 128, 2, false, s2);
