//! What the Hopper kernels of levels 8 and 9 share: the pipeline that feeds their consumer
//! warpgroups (FlashAttention-3, section 3.1, "producer-consumer asynchrony").
//!
//! * **Roles** ([`take_role`]): warpgroup 0 is the *producer*. It owns no rows; one of its
//!   threads asks TMA for tiles, and it gives most of its registers to the *consumer*
//!   warpgroups (`setmaxnreg`), which only compute.
//! * **The ring**: tiles go round `STAGES` slots of shared memory. The `i`-th tile through the
//!   ring uses slot `i % STAGES` in phase `(i / STAGES) % 2` ([`ring_slot`]). Each slot has a
//!   *full* `mbarrier`, which TMA completes with the tile's bytes (the producer announces them
//!   first), and an *empty* one, at which every consumer thread arrives once it no longer reads
//!   the slot. The producer waits for *empty* before it refills a slot ([`wait_slot_free`]), the
//!   consumers wait for *full* before they read it.
//! * **Swizzled tiles** ([`load_swizzled_tile`]): a `rows × head_dim` 16-bit tile sits in shared
//!   memory as TMA writes it with the 128-byte swizzle, `head_dim / 64` column blocks of
//!   `rows × 128` bytes (rounded up: at head_dim 80 and 96 two, the second one partly padding),
//!   one TMA box each, from a base aligned to one swizzle atom
//!   ([`AlignedShared`]).
//!
//! The contracts of the instructions themselves (who calls what, what it orders) are in
//! [`crate::hw::warpgroup`].

use crate::hw::{
    self, SWIZZLE_ROW_BYTES, mbarrier_wait, registers_decrease, registers_increase, shared_address, tma_load_3d,
    warpgroup_id,
};
use crate::layout::{HOPPER_SMEM_ALIGN, hopper_tile_columns};

/// Columns of one swizzled column block: 128 bytes of 16-bit values.
pub const SWIZZLE_COLUMNS: usize = SWIZZLE_ROW_BYTES / 2;

/// Swizzled column blocks of a tile of head_dim `d` ([`hopper_tile_columns`]: 2 at head_dim 80,
/// 96 and 128).
#[inline(always)]
pub const fn column_blocks(d: usize) -> usize {
    hopper_tile_columns(d) / SWIZZLE_COLUMNS
}

/// Bytes of a `rows × d` 16-bit tile in shared memory, whole column blocks: what TMA writes for
/// it (the boxes' columns past the tensor's last one are written as zeros, and counted).
#[inline(always)]
pub const fn tile_bytes(rows: usize, d: usize) -> u32 {
    (rows * hopper_tile_columns(d) * 2) as u32
}

// ANCHOR: ring
/// The ring slot of the `use_index`-th tile that goes round a ring of `stages` slots, and the
/// parity of that use of the slot (0, 1, 0, …): the phase of the slot's `mbarrier`s to wait for.
#[inline(always)]
pub fn ring_slot(use_index: usize, stages: usize) -> (usize, u32) {
    (use_index % stages, ((use_index / stages) % 2) as u32)
}

/// The producer's wait before the `use_index`-th fill of a slot (in phase `parity`): the
/// slot's previous tile (use `use_index − stages`) must have been released on its `empty`
/// barrier, in the phase before this one. The first `stages` fills find their slots free.
///
/// # Safety
/// `empty` is an initialised `mbarrier` in this block's shared memory.
#[inline(always)]
pub unsafe fn wait_slot_free(empty: u32, use_index: usize, stages: usize, parity: u32) {
    if use_index >= stages {
        // SAFETY: the caller's contract.
        unsafe { mbarrier_wait(empty, parity ^ 1) };
    }
}
// ANCHOR_END: ring

/// Asks TMA for a `rows × D` tile (16-bit, rows `first_row ..` of head `head` of the tensor
/// that `map` describes, a 3-D map with 64-column boxes) as [`column_blocks`]`(D)` boxes, one
/// per swizzled column block at `destination + column_block · rows · 128`, completing on
/// `barrier`. The caller has announced the tile's bytes ([`tile_bytes`]) on `barrier`
/// (`mbarrier_arrive_expect_tx`).
///
/// # Safety
/// One thread calls it; `barrier` is initialised; the tile fits at `destination`.
#[inline(always)]
pub unsafe fn load_swizzled_tile<const D: usize>(
    destination: u32,
    map: *const u8,
    rows: usize,
    first_row: usize,
    head: i32,
    barrier: u32,
) {
    for column_block in 0..column_blocks(D) {
        let x = (column_block * SWIZZLE_COLUMNS) as i32;
        let box_destination = destination + (column_block * rows * SWIZZLE_ROW_BYTES) as u32;
        // SAFETY: the caller's contract; each box fits its column block.
        unsafe { tma_load_3d(box_destination, map, x, first_row as i32, head, barrier) };
    }
}

/// The offset of byte `byte` of row `row` in a tile of 128-byte rows with the 128-byte swizzle:
/// the row's 16-byte chunk `byte / 16` moves to chunk `(byte / 16) ^ (row % 8)`.
#[inline(always)]
pub fn swizzled_offset(row: usize, byte: usize) -> u32 {
    let chunk = (byte / 16) ^ (row % 8);
    (row * SWIZZLE_ROW_BYTES + chunk * 16 + byte % 16) as u32
}

/// The block's dynamic shared memory, from a base aligned to [`HOPPER_SMEM_ALIGN`] (one 128-byte
/// swizzle atom, which TMA and `wgmma` address from a 1024-byte boundary; the host adds that
/// many bytes of slack for the rounding). Addresses are shared-state-space addresses (32-bit),
/// as `wgmma` descriptors, TMA and `mbarrier`s take them.
#[derive(Clone, Copy)]
pub struct AlignedShared {
    /// The dynamic shared memory as a generic pointer, and its shared-state-space address.
    raw: *mut u8,
    raw_address: u32,
    /// The first tile's address: `raw_address` rounded up to `HOPPER_SMEM_ALIGN`.
    pub base: u32,
}

impl AlignedShared {
    /// The block's dynamic shared memory (every thread computes the same base).
    #[inline(always)]
    #[allow(clippy::new_without_default)] // reads the block's shared memory: not a plain value
    pub fn new() -> Self {
        let raw = hw::dynamic_shared_memory() as *mut u8;
        let raw_address = shared_address(raw);
        let align = HOPPER_SMEM_ALIGN as u32;
        Self { raw, raw_address, base: raw_address.div_ceil(align) * align }
    }

    /// A generic pointer to the byte at shared-state-space `address`, for ordinary loads and
    /// stores.
    #[inline(always)]
    pub fn pointer(self, address: u32) -> *mut u8 {
        // SAFETY: `address` lies in this block's dynamic shared memory.
        unsafe { self.raw.add((address - self.raw_address) as usize) }
    }
}

/// Which side of the pipeline this thread's warpgroup is on: warpgroup 0 the producer, lowering
/// its register limit to `PRODUCER`, the others consumers, raising theirs to `CONSUMER`
/// (`setmaxnreg`; the budgets are immediates, see [`crate::configs`]). Returns whether the
/// thread is a producer. Every thread of the block calls it once, first thing after the block
/// barrier that publishes the `mbarrier`s.
#[inline(always)]
pub fn take_role<const PRODUCER: u32, const CONSUMER: u32>() -> bool {
    if warpgroup_id() == 0 {
        registers_decrease::<PRODUCER>();
        true
    } else {
        registers_increase::<CONSUMER>();
        false
    }
}
