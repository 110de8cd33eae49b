//! Level 8 (sm_90a only): the FlashAttention forward pass on Hopper, organised as
//! FlashAttention-3 organises it (Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention
//! with Asynchrony and Low-precision", Algorithms 1 and 2). The arithmetic is level 5's
//! ([`crate::sm80::forward`]: online softmax, P kept in registers between the two products);
//! what changes is who does what, and when:
//!
//! * **Warp specialisation.** Warpgroup 0, the *producer*, owns no rows: one of its threads asks
//!   TMA ([`tma_load_3d`]) for the Q tile and then for K and V tiles, round a
//!   ring of `STAGES` slots. The other warpgroups, the *consumers*, each own 64 query rows and
//!   only compute: two (block_m = 128); at head_dim 64 three (block_m = 192) on grids deep
//!   enough, where the softmax costs as much as the products and a third warpgroup keeps the
//!   tensor cores busier, or one (block_m = 64) for short and causal sequences, with 64-key tiles, small
//!   enough that three blocks share an SM, one's prologue and epilogue overlap the others'
//!   products, and each scheduler has three consumer warps to hide the softmax's dependent
//!   chain (block_m 64 with 128-key tiles, two blocks an SM, is compiled too). Above head_dim
//!   128 the K/V tiles are smaller (96 keys at 160 and 192, 64 at 256), so that two stages fit beside
//!   the Q tile and S beside the O accumulator, `D / 2` registers a thread. Producer and
//!   consumers meet at
//!   `mbarrier`s: per slot a *full* barrier for K, one for V (TMA completes them),
//!   and an *empty* barrier that every consumer thread arrives at once it is done with the slot.
//!   The producer gives most of its registers to the consumers (`setmaxnreg`).
//! * **Both products on `wgmma`.** S = Q·Kᵀ reads both operands from shared memory; O += P·V
//!   takes P from registers. The tiles sit in shared memory as TMA writes them with the 128-byte
//!   swizzle ([`swizzled_descriptor`]): a `rows × head_dim` tile is `head_dim / 64` column
//!   blocks of `rows × 128` bytes, rounded up (at head_dim 80 and 96 the products read only
//!   the first 16 or 32 columns of the second block: `layout::hopper_tile_columns`).
//! * **Intra-warpgroup overlap** (FA3 Algorithm 2). In iteration j a consumer issues S_j = Q·K_jᵀ
//!   and O += P_{j−1}·V_{j−1} back to back, waits only for S_j, and runs the softmax of tile j
//!   while the tensor cores still work on P_{j−1}·V_{j−1}. The consumer warpgroups also overlap
//!   each other, as the scheduler interleaves them, or, with `PINGPONG`, by taking turns at the
//!   tensor cores (FA3 section 3.1).
//! * **A grid that ends evenly.** The work units (query blocks) of a head differ by at most 64
//!   rows, the longest start first, and under a causal mask the heads go in L2-sized sections
//!   ([`ForwardOrder::block`]); consumer warpgroups that own no rows of a short block only
//!   hand the K/V tiles back. One thread prefetches the tensor maps while the block sets up.
//!   (PERFORMANCE.md, sections "night" and "late", has what each of these gained.)
//! * **Persistent blocks** (FA3's persistent forward). A block may take several units, one after
//!   the other ([`PersistentUnits`]): Q is a ring of its own (`layout::hopper_forward_q_slots`
//!   slots), each slot with a *full* and an *empty* barrier, and the K/V ring runs on across
//!   units, so that the producer loads the next unit's Q and first K/V tiles while the
//!   consumers finish the current unit's last P·V and store its O (with two Q slots, at block_m
//!   64 and head_dim 80 and 96, while they still compute it).
//!   For short sequences, where a unit is only one or two K/V tiles, that hidden start is most
//!   of the gain (PERFORMANCE.md, issue 20). Under a causal mask the units differ in length and
//!   the blocks draw them from a counter in device memory (dynamic scheduling), otherwise in a
//!   fixed snake order. The host picks the grid (`select.rs`).
//!
//! Each consumer warp's `wgmma` accumulator has the m16n8 layout of `mma.sync`
//! ([`Accumulator`]), so level 5's [`RowSoftmax`] and [`pack_a`] apply unchanged.

use crate::attention::epilogue::{store_fragment_lse, store_fragment_pairs};
use crate::attention::fragment::{FragmentLane, mask_fragments, pack_a, scale_rows};
use crate::attention::mask::Mask;
use crate::attention::schedule::{ForwardOrder, PersistentUnits};
use crate::attention::score::ScoreArgs;
use crate::attention::softmax::{NEGATED_HALF2, RowSoftmax, positive_factor};
use crate::configs::{
    SM90_FORWARD_REGISTERS_M64, SM90_FORWARD_REGISTERS_M64_N64, SM90_FORWARD_REGISTERS_M128,
    SM90_FORWARD_REGISTERS_M128_WIDE, SM90_FORWARD_REGISTERS_M192,
};
use crate::hw::{
    self, Accumulator, FragA, FragC, HalfFloat, SWIZZLE_ATOM_BYTES, SWIZZLE_ROW_BYTES, TensorMaps, WARPGROUP_THREADS,
    advance_descriptor, fence_mbarrier_init, fence_proxy_async, k_major_descriptor, mbarrier_arrive,
    mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_wait, mn_major_descriptor, named_barrier_arrive,
    named_barrier_sync, prefetch_tensor_map, warpgroup_id, wgmma_commit, wgmma_fence, wgmma_wait,
};
use crate::layout::{
    AttentionShape, HOPPER_FORWARD_UNIT_BYTES, HOPPER_WARPGROUP_ROWS as WARPGROUP_ROWS, div_rem, hopper_forward_q_slots,
};
use crate::sm90::pipeline::{
    AlignedShared, column_blocks, load_swizzled_tile, ring_slot, take_role, tile_bytes, wait_slot_free,
};

/// The first of the named barriers of the ping-pong schedule, one per consumer warpgroup (0 is
/// `__syncthreads`; 1 to 3 are the consumer warpgroups' own).
const PINGPONG_BARRIER: u32 = 4;

/// The block's shared memory: [`Self::Q_SLOTS`] Q tiles, `STAGES` slots of a K and a V tile, then
/// the `mbarrier`s and the Q tiles' units, from a base aligned to one swizzle atom
/// ([`AlignedShared`]).
#[derive(Clone, Copy)]
struct SharedTiles<const BLOCK_M: usize, const D: usize, const BLOCK_N: usize, const STAGES: usize> {
    memory: AlignedShared,
    /// The first tile's address.
    base: u32,
}

impl<const BLOCK_M: usize, const D: usize, const BLOCK_N: usize, const STAGES: usize>
    SharedTiles<BLOCK_M, D, BLOCK_N, STAGES>
{
    const Q_BYTES: u32 = tile_bytes(BLOCK_M, D);
    const KV_BYTES: u32 = tile_bytes(BLOCK_N, D);
    /// Q is a ring of its own, of [`hopper_forward_q_slots`] slots.
    const Q_SLOTS: usize = hopper_forward_q_slots(BLOCK_M, BLOCK_N, D, STAGES);

    #[inline(always)]
    fn new() -> Self {
        let memory = AlignedShared::new();
        Self { memory, base: memory.base }
    }

    /// A generic pointer to the byte at shared-state-space `address`.
    #[inline(always)]
    fn pointer(self, address: u32) -> *mut u8 {
        self.memory.pointer(address)
    }

    #[inline(always)]
    fn q(self, slot: usize) -> u32 {
        self.base + slot as u32 * Self::Q_BYTES
    }

    #[inline(always)]
    fn k(self, stage: usize) -> u32 {
        self.q(Self::Q_SLOTS) + 2 * stage as u32 * Self::KV_BYTES
    }

    #[inline(always)]
    fn v(self, stage: usize) -> u32 {
        self.k(stage) + Self::KV_BYTES
    }

    /// Barrier `i` of `[Q full × Q_SLOTS, Q empty × Q_SLOTS, K full × STAGES, V full × STAGES,
    /// K empty × STAGES, V empty × STAGES]`.
    #[inline(always)]
    fn barrier(self, i: usize) -> u32 {
        self.k(STAGES) + 8 * i as u32
    }

    #[inline(always)]
    fn q_full(self, slot: usize) -> u32 {
        self.barrier(slot)
    }

    /// The consumers release a Q slot once the last scores of its unit are done.
    #[inline(always)]
    fn q_empty(self, slot: usize) -> u32 {
        self.barrier(Self::Q_SLOTS + slot)
    }

    #[inline(always)]
    fn k_full(self, stage: usize) -> u32 {
        self.barrier(2 * Self::Q_SLOTS + stage)
    }

    #[inline(always)]
    fn v_full(self, stage: usize) -> u32 {
        self.barrier(2 * Self::Q_SLOTS + STAGES + stage)
    }

    #[inline(always)]
    fn k_empty(self, stage: usize) -> u32 {
        self.barrier(2 * Self::Q_SLOTS + 2 * STAGES + stage)
    }

    #[inline(always)]
    fn v_empty(self, stage: usize) -> u32 {
        self.barrier(2 * Self::Q_SLOTS + 3 * STAGES + stage)
    }

    /// The [`Unit`] that goes with the Q tile in `slot`, after the barriers.
    #[inline(always)]
    fn unit(self, slot: usize) -> *mut Unit {
        let first = self.barrier(2 * Self::Q_SLOTS + 4 * STAGES);
        self.pointer(first + (slot * HOPPER_FORWARD_UNIT_BYTES) as u32) as *mut Unit
    }
}

// ANCHOR: unit
/// What the producer tells the consumers about the unit whose Q tile it loads: it writes this
/// next to the Q tile before it arrives on the Q *full* barrier (an arrival releases the stores
/// before it, and the consumers' wait acquires them), so that only the producer runs the
/// schedule's arithmetic ([`ForwardOrder::block`]) and the consumers keep no schedule state
/// across units (FlashAttention-3's tile scheduler hands work to its consumers the same way).
/// 32-bit fields: registers are what the consumers are shortest of. `q_rows == 0` means that the
/// block has no more units.
#[derive(Clone, Copy)]
#[repr(C)]
struct Unit {
    /// The unit's query rows, `q_start .. q_start + q_rows`, of query head `head` (over all
    /// batches: `batch · num_heads_q + head`).
    q_start: u32,
    q_rows: u32,
    head: u32,
    /// Its K/V tiles are the ring's uses `ring .. ring + kv_tiles`.
    ring: u32,
    kv_tiles: u32,
}

/// Bytes the Hopper forward keeps for each [`Unit`] after its barriers (`layout` counts them).
const _: () = assert!(core::mem::size_of::<Unit>() <= crate::layout::HOPPER_FORWARD_UNIT_BYTES);
// ANCHOR_END: unit

// ANCHOR: produce
/// The producer: for each of the block's units, one thread loads the Q tile into the next Q slot
/// once the consumers have released that slot's previous unit, then every K/V tile of the unit,
/// each into its ring slot once the consumers have released the slot's previous tile. Both
/// rings run on from one unit to the next: with two Q slots the next unit's Q tile and first
/// K/V tiles load while the consumers still compute the current one.
///
/// # Safety
/// One thread of warpgroup 0 calls it, after the barriers were initialised.
#[inline(always)]
unsafe fn produce<const BLOCK_M: usize, const D: usize, const BLOCK_N: usize, const STAGES: usize>(
    smem: SharedTiles<BLOCK_M, D, BLOCK_N, STAGES>,
    maps: TensorMaps,
    shape: &AttentionShape,
    mask: &Mask,
    (order, units): (ForwardOrder<BLOCK_M>, PersistentUnits),
) {
    // Loads a `rows × D` tile, completing on `barrier`, which learns the bytes first.
    let load = |destination: u32, map: *const u8, rows: usize, first_row: usize, head: i32, barrier: u32| {
        // SAFETY: the barrier is initialised; the tile fits at `destination`.
        unsafe {
            mbarrier_arrive_expect_tx(barrier, tile_bytes(rows, D));
            load_swizzled_tile::<D>(destination, map, rows, first_row, head, barrier);
        }
    };
    let q_slots = SharedTiles::<BLOCK_M, D, BLOCK_N, STAGES>::Q_SLOTS;
    // Tiles that went round the ring in the block's earlier units, and those units.
    let (mut ring, mut local) = (0, 0);
    for unit in units {
        let block = order.block(shape, unit);
        let mask = mask.for_batch(block.batch);
        let keys = mask.keys_for(block.q_start, block.q_rows);
        let kv_tiles = keys.tiles(BLOCK_N);
        let q_head = block.batch * shape.num_heads_q + block.head;
        let kv_head = (block.batch * shape.num_heads_kv + shape.kv_head(block.head)) as i32;
        // Q (and its unit) is a ring of its own.
        let (q_slot, q_parity) = ring_slot(local, q_slots);
        // SAFETY: initialised barriers; the consumers read the slot's previous unit before they
        // released the slot.
        unsafe {
            wait_slot_free(smem.q_empty(q_slot), local, q_slots, q_parity);
            let (q_start, q_rows, head) = (block.q_start as u32, block.q_rows as u32, q_head as u32);
            *smem.unit(q_slot) = Unit { q_start, q_rows, head, ring: ring as u32, kv_tiles: kv_tiles as u32 };
        }
        load(smem.q(q_slot), maps.get(0), BLOCK_M, block.q_start, q_head as i32, smem.q_full(q_slot));
        for tile in 0..kv_tiles {
            let (stage, parity) = ring_slot(ring + tile, STAGES);
            let first_key = keys.tile_start(tile, BLOCK_N);
            // K is released as soon as its scores are done, V only after P·V, a step later.
            // SAFETY: initialised barriers.
            unsafe { wait_slot_free(smem.k_empty(stage), ring + tile, STAGES, parity) };
            load(smem.k(stage), maps.get(1), BLOCK_N, first_key, kv_head, smem.k_full(stage));
            unsafe { wait_slot_free(smem.v_empty(stage), ring + tile, STAGES, parity) };
            load(smem.v(stage), maps.get(2), BLOCK_N, first_key, kv_head, smem.v_full(stage));
        }
        ring += kv_tiles;
        local += 1;
    }
    // The end: a unit of no rows, in the next Q slot once it is free.
    let (q_slot, q_parity) = ring_slot(local, q_slots);
    // SAFETY: as above; the arrival alone completes the phase (no bytes announced).
    unsafe {
        wait_slot_free(smem.q_empty(q_slot), local, q_slots, q_parity);
        *smem.unit(q_slot) = Unit { q_start: 0, q_rows: 0, head: 0, ring: 0, kv_tiles: 0 };
        mbarrier_arrive(smem.q_full(q_slot));
    }
}
// ANCHOR_END: produce

/// One consumer warpgroup's rows: the first query row of this thread's warp, and the lane's
/// place in the m16n8 accumulator layout.
#[derive(Clone, Copy)]
struct ConsumerRows {
    /// The first query row of this thread's warp, in the head.
    warp_row: usize,
    lane: FragmentLane,
}

/// The consumer warpgroup's work on one unit: S = Q·Kᵀ, mask, online softmax and O += P·V over
/// the unit's K/V tiles, pipelined as FA3's Algorithm 2, then O and the LSE written out.
///
/// # Safety
/// Every thread of one consumer warpgroup calls it, for the block's units in order, once the
/// unit's Q tile has arrived; `o` and `lse` point to this head's rows.
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
    (unit, q_slot): (Unit, usize),
    shape: &AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale_log2: f32,
    heads: (*mut u16, *mut f32),
    head_dim: usize,
) where
    [FragC; N_TILES]: Accumulator,
    [FragC; D_TILES]: Accumulator,
{
    // Three copies of the body: modified scores (and any sinks), sinks alone, and one that runs
    // exactly the code of the plain path (`attention::score` says why).
    macro_rules! body {
        ($mods:literal, $sinks:literal) => {
            consume_body::<T, BLOCK_M, D, BLOCK_N, STAGES, N_TILES, P_STEPS, D_TILES, PINGPONG, $mods, $sinks>(
                smem,
                (unit, q_slot),
                shape,
                mask,
                score,
                scale_log2,
                heads,
                head_dim,
            )
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        match (score.is_active(), score.has_sinks()) {
            (true, _) => body!(true, true),
            (false, true) => body!(false, true),
            (false, false) => body!(false, false),
        }
    }
}

/// [`consume`]'s body, with (`MODS`) or without a score modification, with (`SINKS`) or without
/// attention sinks.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn consume_body<
    T: HalfFloat,
    const BLOCK_M: usize,
    const D: usize,
    const BLOCK_N: usize,
    const STAGES: usize,
    const N_TILES: usize,
    const P_STEPS: usize,
    const D_TILES: usize,
    const PINGPONG: bool,
    const MODS: bool,
    const SINKS: bool,
>(
    smem: SharedTiles<BLOCK_M, D, BLOCK_N, STAGES>,
    (unit, q_slot): (Unit, usize),
    shape: &AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale_log2: f32,
    (o_head, lse_head): (*mut u16, *mut f32),
    head_dim: usize,
) where
    [FragC; N_TILES]: Accumulator,
    [FragC; D_TILES]: Accumulator,
{
    let index = warpgroup_id() - 1;
    let (q_start, q_rows) = (unit.q_start as usize, unit.q_rows as usize);
    let (ring, kv_tiles) = (unit.ring as usize, unit.kv_tiles as usize);
    let rows = ConsumerRows {
        warp_row: q_start + index * WARPGROUP_ROWS + 16 * (hw::warp_id() % 4),
        lane: FragmentLane::current(),
    };
    // This warpgroup's 64 rows of Q start 64 rows into each column block of the Q tile.
    let q_rows_offset = index * WARPGROUP_ROWS * SWIZZLE_ROW_BYTES;

    // In a block shorter than BLOCK_M (the last few of a head, see `ForwardOrder::block`)
    // a warpgroup may own no rows of the block (at 4096 rows and block_m 192, the third
    // warpgroup of the last two blocks): it has nothing to compute, and only hands each K/V slot
    // back (the empty barriers count every consumer thread), so that the block, and its SM,
    // finish sooner. It waits for each tile to arrive first, so that its arrival counts toward
    // that tile's phase and not an earlier one. (With ping-pong turns it would have to keep to
    // the schedule; it computes rows that belong to the next block or to no block, and does not
    // store them.)
    if !PINGPONG && index * WARPGROUP_ROWS >= q_rows {
        // SAFETY: as below; the Q slot is released at once.
        unsafe { mbarrier_arrive(smem.q_empty(q_slot)) };
        for tile in 0..kv_tiles {
            let (stage, parity) = ring_slot(ring + tile, STAGES);
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

    // As in level 5, the softmax wants c = scale·log₂e > 0: a negative scale is applied as −Q
    // with |c|. TMA cannot flip signs on the way, so the warpgroup flips its own rows in shared
    // memory and publishes them back to the async proxy; a zero scale becomes the smallest normal.
    if scale_log2 < 0.0 {
        unsafe { negate_rows::<BLOCK_M, D>(smem.pointer(smem.q(q_slot) + q_rows_offset as u32)) };
        fence_proxy_async();
        named_barrier_sync(1 + index as u32, WARPGROUP_THREADS as u32);
    }
    let c = positive_factor(scale_log2);
    // The factor the softmax applies: c for raw products, 1 for modified scores.
    let factor = if MODS { 1.0 } else { c };

    // The keys of the warpgroup's rows: tiles inside every row's band need no mask. The block's
    // tiles start at the first tile its first row sees, as the producer's do.
    let keys = mask.keys_for(q_start + index * WARPGROUP_ROWS, WARPGROUP_ROWS);
    let first_tile = mask.key_start(q_start) / BLOCK_N;
    // The descriptors of the first k-step of Q (this warpgroup's rows), and of K and V in
    // stage 0; every other operand is one of these, moved along ([`advance_descriptor`]).
    let q_descriptor = k_major_descriptor(smem.q(q_slot) + q_rows_offset as u32);
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
    // Softcap or ALiBi, if the problem has one, turns the scores into base-2 logits; then the
    // scores of keys the row must not see become −∞ (only in tiles that cross a row's limit).
    let modify_and_mask = |s: &mut [FragC; N_TILES], tile: usize| {
        let first_key = (first_tile + tile) * BLOCK_N;
        if MODS {
            let (num_heads, seqlen_q, seqlen_k) = (shape.num_heads_q, shape.seqlen_q, shape.seqlen_k);
            let head_score = score.for_head(unit.head as usize % num_heads, num_heads, seqlen_q, seqlen_k);
            head_score.apply_fragments::<N_TILES, false>(s, rows.lane, (rows.warp_row, first_key), c);
        }
        if keys.needs_mask(first_key, BLOCK_N) {
            mask_fragments::<N_TILES, false>(s, rows.lane, f32::NEG_INFINITY, (rows.warp_row, first_key), &mask);
        }
    };
    let pack =
        |s: &[FragC; N_TILES]| -> [FragA; P_STEPS] { core::array::from_fn(|kk| pack_a::<T>(s[2 * kk], s[2 * kk + 1])) };

    // Ping-pong (FA3 section 3.1), when `PINGPONG`: the consumer warpgroups take turns, round
    // robin, to issue their products, through one named barrier each, so that one warpgroup's
    // softmax runs while another's products occupy the tensor cores. (It pays with two consumers
    // at head_dim 64 only: PERFORMANCE.md.) Warpgroup 0 has the first turn; each turn ends by
    // handing the next to the following warpgroup (the last turn of the last warpgroup
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
        let (first, first_parity) = ring_slot(ring, STAGES);
        unsafe { mbarrier_wait(smem.k_full(first), first_parity) };
        s.pin();
        take_turn();
        wgmma_fence();
        issue_scores(&mut s, first);
        wgmma_commit();
        pass_turn(0);
        wgmma_wait::<0>();
        s.pin();
        // K of tile 0 is no longer read.
        unsafe { mbarrier_arrive(smem.k_empty(first)) };
        modify_and_mask(&mut s, 0);
        softmax.update(&mut s, factor);
        p = pack(&s);
    }
    for tile in 1..kv_tiles {
        let (stage, parity) = ring_slot(ring + tile, STAGES);
        let (previous, previous_parity) = ring_slot(ring + tile - 1, STAGES);
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
        modify_and_mask(&mut s, tile);
        let alpha = softmax.update(&mut s, factor);
        wgmma_wait::<0>();
        o.pin();
        // The previous tile's V is free for the producer.
        unsafe { mbarrier_arrive(smem.v_empty(previous)) };
        // Once the running maxima settle most tiles leave them unchanged (alpha = 1 exactly), and
        // the warp skips the rescale (as level 5 does); the vote keeps the branch warp-uniform.
        if hw::warp_any(alpha[0] != 1.0 || alpha[1] != 1.0) {
            scale_rows(&mut o, alpha);
        }
        p = pack(&s);
    }
    // Every product that reads Q is done: the producer may load a later unit's Q tile here.
    unsafe { mbarrier_arrive(smem.q_empty(q_slot)) };
    if kv_tiles > 0 {
        // Epilogue: the last tile's P·V.
        let (last, last_parity) = ring_slot(ring + kv_tiles - 1, STAGES);
        unsafe { mbarrier_wait(smem.v_full(last), last_parity) };
        o.pin();
        take_turn();
        wgmma_fence();
        issue_values(&mut o, &p, last);
        wgmma_commit();
        pass_turn(kv_tiles);
        wgmma_wait::<0>();
        o.pin();
        // The ring runs on into the block's next unit: this slot too must be handed back.
        unsafe { mbarrier_arrive(smem.v_empty(last)) };
    }

    // Normalise and write O (two values per store) and the LSE of the block's rows.
    // SAFETY: the host checked the sinks' length (`ScoreArgs::sink`).
    let sink = if SINKS { unsafe { score.sink(unit.head as usize % shape.num_heads_q) } } else { f32::NEG_INFINITY };
    let finished = softmax.finish(sink);
    let end = q_start + q_rows;
    // SAFETY: rows below q_start + q_rows ≤ seqlen_q of this head exist.
    unsafe {
        store_fragment_pairs::<T, D, D_TILES>(&o, finished.0, o_head, head_dim, rows.warp_row, end, rows.lane);
        store_fragment_lse(&[finished], lse_head, 0, rows.warp_row, end, rows.lane);
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
    let first = hw::thread_idx_x() % WARPGROUP_THREADS;
    for column_block in 0..column_blocks(D) {
        let mut chunk = first;
        while chunk < CHUNKS {
            // SAFETY: inside this warpgroup's rows of the column block.
            unsafe {
                let word = rows.add(column_block * BLOCK_M * SWIZZLE_ROW_BYTES + 16 * chunk) as *mut [u32; 4];
                *word = (*word).map(|w| w ^ NEGATED_HALF2);
            }
            chunk += WARPGROUP_THREADS;
        }
    }
}

/// The kernel body (see the module docs). Grid: `(G, 1, 1)` for any `G` from 1 to the number of
/// units ([`ForwardOrder::units`], the query blocks of every head), which the blocks share out
/// as [`PersistentUnits`] says; unit `u` is the query block [`ForwardOrder::block`] maps it to.
/// The host launches one block per unit, or as many as fit on the GPU at once (persistent);
/// block: [`crate::layout::hopper_forward_threads`]`(BLOCK_M)` threads (256, 384 or 512); dynamic
/// shared memory: [`crate::layout::hopper_forward_smem_bytes`]`(BLOCK_M, BLOCK_N, D, STAGES)`. `N_TILES` = BLOCK_N / 8,
/// `P_STEPS` = BLOCK_N / 16 and `D_TILES` = D / 8 size the register arrays (array lengths must be
/// plain const parameters).
///
/// # Safety
/// `maps` holds the three tensor maps of Q, K and V (see [`TensorMaps`]) in device memory;
/// `o` and `lse` hold `[batch, num_heads_q, seqlen_q, D]` 16-bit values and
/// `[batch, num_heads_q, seqlen_q]` `f32`; `unit_counter` is null (static units) or a `u32` in
/// device memory, zero at launch (dynamic units, [`PersistentUnits`]); `shape.head_dim == D`;
/// the launch as above.
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
    unit_counter: *mut u32,
    shape: AttentionShape,
    mask: Mask,
    score: ScoreArgs,
    scale_log2: f32,
) where
    [FragC; N_TILES]: Accumulator,
    [FragC; D_TILES]: Accumulator,
{
    if hw::thread_idx_x() == hw::WARP_SIZE {
        // The producer's first copies need the tensor maps: a warp that has nothing else to do
        // yet asks for them while the barriers are set up.
        for map in 0..3 {
            // SAFETY: the host's three maps.
            unsafe { prefetch_tensor_map(TensorMaps(maps).get(map)) };
        }
    }
    let order = ForwardOrder::<BLOCK_M>::new(&shape, mask.causal);
    let units = PersistentUnits::current(order.units(), unit_counter);
    let smem = SharedTiles::<BLOCK_M, D, BLOCK_N, STAGES>::new();
    let consumer_threads = (BLOCK_M / WARPGROUP_ROWS * WARPGROUP_THREADS) as u32;

    if hw::thread_idx_x() == 0 {
        // SAFETY: one thread initialises the barriers before the block barrier below.
        unsafe {
            for slot in 0..SharedTiles::<BLOCK_M, D, BLOCK_N, STAGES>::Q_SLOTS {
                mbarrier_init(smem.q_full(slot), 1);
                mbarrier_init(smem.q_empty(slot), consumer_threads);
            }
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
    hw::sync_threads();

    // (The budgets must be immediates, so the choice is spelled out per block size.)
    let producer = if BLOCK_M == 64 && BLOCK_N == 64 {
        take_role::<{ SM90_FORWARD_REGISTERS_M64_N64.0 }, { SM90_FORWARD_REGISTERS_M64_N64.1 }>()
    } else if BLOCK_M == 64 {
        take_role::<{ SM90_FORWARD_REGISTERS_M64.0 }, { SM90_FORWARD_REGISTERS_M64.1 }>()
    } else if BLOCK_M == 128 && D > 192 {
        take_role::<{ SM90_FORWARD_REGISTERS_M128_WIDE.0 }, { SM90_FORWARD_REGISTERS_M128_WIDE.1 }>()
    } else if BLOCK_M == 128 {
        take_role::<{ SM90_FORWARD_REGISTERS_M128.0 }, { SM90_FORWARD_REGISTERS_M128.1 }>()
    } else {
        take_role::<{ SM90_FORWARD_REGISTERS_M192.0 }, { SM90_FORWARD_REGISTERS_M192.1 }>()
    };
    if producer {
        if hw::thread_idx_x() == 0 {
            // SAFETY: the barriers are initialised; the maps are the host's.
            unsafe { produce(smem, TensorMaps(maps), &shape, &mask, (order, units)) };
        }
    } else {
        // The consumers take the units the producer announces with their Q tiles, in turn.
        let q_slots = SharedTiles::<BLOCK_M, D, BLOCK_N, STAGES>::Q_SLOTS;
        let mut local = 0;
        loop {
            let (q_slot, q_parity) = ring_slot(local, q_slots);
            // SAFETY: initialised barriers; this unit's phase of its Q slot's barrier, after which
            // its `Unit` can be read (the producer wrote it before arriving).
            let unit = unsafe {
                mbarrier_wait(smem.q_full(q_slot), q_parity);
                *smem.unit(q_slot)
            };
            if unit.q_rows == 0 {
                break;
            }
            // SAFETY: every unit is a query block of the problem, so this head's rows exist
            // (offsets in elements). O's rows are `head_dim ≤ D` long: the loads' boxes read
            // zeros past it, the stores skip it.
            let (head_dim, first_row) = (shape.head_dim, unit.head as usize * shape.seqlen_q);
            let heads = unsafe { (o.add(first_row * head_dim), lse.add(first_row)) };
            // The unit's batch entry (its head counts over all batches), for a band table.
            let mask = mask.for_batch(div_rem(unit.head as usize, shape.num_heads_q).0);
            unsafe {
                consume::<T, BLOCK_M, D, BLOCK_N, STAGES, N_TILES, P_STEPS, D_TILES, PINGPONG>(
                    smem,
                    (unit, q_slot),
                    &shape,
                    mask,
                    score,
                    scale_log2,
                    heads,
                    head_dim,
                )
            };
            local += 1;
        }
    }
}

/// One entry, `hopper_flash_fwd_{f16,bf16}_m{BLOCK_M}_n{BLOCK_N}_d{D}_{variant}`;
/// `sm90_forward_configs!` (in [`crate::configs`]) lists the configurations.
macro_rules! flash_forward_wgmma_instance {
    ($dtype:ident, $format:ident, $block_m:literal, $d:literal, $block_n:literal, $stages:literal, $pingpong:literal, $variant:ident) => {
        pastey::paste! {
            attention_kernel! {
            /// FlashAttention forward on Hopper (sm_90a); see the module docs.
            ///
            /// # Safety
            /// As `flash_forward_wgmma`.
            fn [<hopper_flash_fwd_ $dtype _m $block_m _n $block_n _d $d _ $variant>](
                maps: *const u8,
                o: *mut u16,
                lse: *mut f32,
                unit_counter: *mut u32,
            ) |shape, mask, score, scale_log2| {
                unsafe {
                    flash_forward_wgmma::<
                        hw::$format,
                        $block_m,
                        $d,
                        $block_n,
                        $stages,
                        { $block_n / 8 },
                        { $block_n / 16 },
                        { $d / 8 },
                        $pingpong,
                    >(maps, o, lse, unit_counter, shape, mask, score, scale_log2)
                }
            }
            }
        }
    };
}

sm90_forward_configs!(flash_forward_wgmma_instance);
