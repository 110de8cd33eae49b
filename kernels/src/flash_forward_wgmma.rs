//! Level 8 (sm_90a only): the FlashAttention forward pass on Hopper's warpgroup MMA, first
//! version. It is level 5's algorithm ([`crate::flash_forward_mma`]: online softmax with P kept
//! in registers between the two products) with the matrix products moved to `wgmma`
//! ([`crate::hopper`]):
//!
//! * one warpgroup (4 warps) per block owns 64 query rows, warp w rows 16w … 16w + 15: the
//!   `wgmma` accumulator of each warp has the layout of eight `mma.sync` m16n8 tiles, so the
//!   softmax of level 5 ([`RowSoftmax`]) and its P packing ([`pack_a`]) apply unchanged;
//! * S = Q·Kᵀ reads both operands from shared memory through descriptors (Q and K K-major);
//! * O += P·V takes P from registers and V from shared memory, MN-major.
//!
//! Q, K and V sit in shared memory as 8 × 8 *core matrices* (see [`core_matrix_offset`]). With 64
//! rows and head_dim 64 the K and V tiles share one layout: K's rows are keys and its K dimension
//! the head dimension; V's K dimension is the keys and its N dimension the head dimension, and
//! an MN-major operand keeps the same core matrices.
//!
//! K and V tiles go round a two-slot ring filled by `cp.async`: tile j + 1 is copied while tile j
//! is multiplied. Not yet here (issue #9's next steps): copies by TMA, producer and consumer
//! warpgroups, two consumer warpgroups, 128-byte swizzling, head_dim 128, the backward pass.

use crate::flash_forward_mma::{RowSoftmax, pack_a};
use crate::gpu::{self, FragC, HalfFloat};
use crate::hopper::{
    CORE_MATRIX_BYTES, core_matrix_offset, fence_proxy_async, matrix_descriptor, shared_address, wgmma_commit,
    wgmma_fence, wgmma_m64n64k16, wgmma_m64n64k16_register_a, wgmma_wait,
};
use crate::layout::AttentionShape;
use crate::tiles::{Mask, QueryBlock};

/// Query rows per block: one warpgroup's `wgmma` tile.
pub const BLOCK_M: usize = 64;
/// Keys per tile.
pub const BLOCK_N: usize = 64;
/// The head dimension of this version.
pub const HEAD_DIM: usize = 64;
/// Bytes of one 64 × 64 tile of 16-bit values.
const TILE_BYTES: usize = 64 * 64 * 2;
/// Core matrices per row of 8-row blocks (64 columns / 8).
const BLOCKS_PER_ROW: usize = 8;
/// Descriptor offsets of a K-major 64 × 64 tile: neighbours along K one core matrix apart, along
/// rows a row of core matrices apart. For the MN-major use of the same tile (V), the leading
/// offset steps along K (the rows) and the stride along N (see `DescriptorOffsets` on the host).
const ALONG_COLUMNS: u32 = CORE_MATRIX_BYTES as u32;
const ALONG_ROWS: u32 = (BLOCKS_PER_ROW * CORE_MATRIX_BYTES) as u32;

/// The accumulator as `wgmma` holds it (32 values per thread) viewed as eight m16n8 fragments.
#[inline(always)]
fn fragments(d: &[f32; 32]) -> [FragC; 8] {
    core::array::from_fn(|j| core::array::from_fn(|e| d[4 * j + e]))
}

/// Copies rows `0 .. valid` of a row-major 64 × 64 tile of 16-bit values at `src` into shared
/// memory at `dst` as core matrices; rows from `valid` on become zeros. Each 16-byte chunk of a
/// row is one row of one core matrix. `flip` is XORed into every value's bits (the sign flip of
/// a negative scale). Every thread of the warpgroup calls it.
///
/// # Safety
/// `src` holds `valid` rows of 64 values, 16-byte aligned; `dst` is 8192 bytes of shared memory.
#[inline(always)]
unsafe fn load_tile(dst: *mut u8, src: *const u16, valid: usize, flip: u32) {
    let mut chunk = gpu::thread_idx_x();
    while chunk < 64 * BLOCKS_PER_ROW {
        let (row, column) = (chunk / BLOCKS_PER_ROW, (chunk % BLOCKS_PER_ROW) * 8);
        let value = if row < valid {
            // SAFETY: row < valid; 16-byte aligned rows of 128 bytes.
            let words = unsafe { core::ptr::read(src.add(row * 64 + column) as *const [u32; 4]) };
            words.map(|w| w ^ flip)
        } else {
            [0; 4]
        };
        // SAFETY: the offset of a 16-byte chunk inside the 8 KiB tile.
        unsafe { core::ptr::write(dst.add(core_matrix_offset(row, column, BLOCKS_PER_ROW)) as *mut [u32; 4], value) };
        chunk += crate::hopper::WARPGROUP_THREADS;
    }
}

/// Starts the copies of rows `0 .. valid` of a row-major 64 × 64 tile at `src` into shared memory
/// at `dst` (a shared-space address) as core matrices, with `cp.async`; rows from `valid` on are
/// zero-filled. The caller closes the commit group. Every thread of the warpgroup calls it.
///
/// # Safety
/// As [`load_tile`], with `dst` the address of 8192 bytes of shared memory.
#[inline(always)]
unsafe fn load_tile_async(dst: u32, src: *const u16, valid: usize) {
    let mut chunk = gpu::thread_idx_x();
    while chunk < 64 * BLOCKS_PER_ROW {
        let (row, column) = (chunk / BLOCKS_PER_ROW, (chunk % BLOCKS_PER_ROW) * 8);
        let offset = core_matrix_offset(row, column, BLOCKS_PER_ROW) as u32;
        // A zero-filled row reads nothing, but its source address must still be valid: row 0.
        let src_row = if row < valid { row } else { 0 };
        // SAFETY: src_row < max(valid, 1) rows exist; the chunk lies inside the tile.
        unsafe { gpu::cp_async_16(dst + offset, src.add(src_row * 64 + column), row < valid) };
        chunk += crate::hopper::WARPGROUP_THREADS;
    }
}

/// The kernel body for `T` (see the module docs). Grid: `(ceil(seqlen_q / 64), num_heads_q,
/// batch)`; block: 128 threads; dynamic shared memory: 5 · 8192 bytes (Q, then two slots of a
/// K and a V tile: the next tile's copies run while this one is multiplied).
///
/// # Safety
/// As `flash_forward_mma`, with `shape.head_dim == 64`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn flash_forward_wgmma<T: HalfFloat>(
    q: *const u16,
    k: *const u16,
    v: *const u16,
    o: *mut u16,
    lse: *mut f32,
    shape: AttentionShape,
    mask: Mask,
    scale_log2: f32,
) {
    let block = QueryBlock::current::<BLOCK_M>(&shape);
    let (q_start, q_rows) = (block.q_start, block.q_rows);
    // SAFETY: the host sized the grid, so these heads exist (offsets are in elements).
    let (q_head, k_head, v_head, o_head, lse_head) = unsafe {
        let (q_offset, kv_offset) = (block.q_offset, block.kv_offset);
        (q.add(q_offset), k.add(kv_offset), v.add(kv_offset), o.add(q_offset), lse.add(q_offset / HEAD_DIM))
    };
    let (warp, lane) = (gpu::warp_id(), gpu::lane_id());
    let (g, t) = (lane / 4, lane % 4);
    let shared = gpu::dynamic_shared_memory() as *mut u8;
    let q_tile = shared;
    let q_address = shared_address(q_tile);
    // Slot `i` of the two-slot ring: its K tile, then its V tile. (Computed from the slot number:
    // an array of addresses indexed by a loop variable would live in local memory.)
    let k_address = |slot: usize| q_address + ((1 + 2 * slot) * TILE_BYTES) as u32;
    let v_address = |slot: usize| k_address(slot) + TILE_BYTES as u32;

    // As in level 5: a negative scale is applied as −Q with |c|; zero as the smallest normal.
    let flip = if scale_log2 < 0.0 { 0x8000_8000 } else { 0 };
    let c = scale_log2.abs().max(f32::MIN_POSITIVE);
    // SAFETY: rows q_start .. q_start + q_rows of this head exist.
    unsafe { load_tile(q_tile, q_head.add(q_start * HEAD_DIM), q_rows, flip) };

    let kv_end = mask.key_limit(q_start + q_rows - 1);
    let all_see = mask.key_limit(q_start);
    let kv_tiles = kv_end.div_ceil(BLOCK_N);
    // Starts the copies of K/V tile `tile` into its slot, as one commit group (empty past the
    // last tile, so that every call commits exactly one group).
    let fetch = |tile: usize| {
        if tile < kv_tiles {
            let kv_start = tile * BLOCK_N;
            let valid = BLOCK_N.min(shape.seqlen_k - kv_start);
            // SAFETY: rows kv_start .. kv_start + valid of this head exist.
            unsafe {
                load_tile_async(k_address(tile % 2), k_head.add(kv_start * HEAD_DIM), valid);
                load_tile_async(v_address(tile % 2), v_head.add(kv_start * HEAD_DIM), valid);
            }
        }
        gpu::cp_async_commit();
    };
    fetch(0);
    let mut softmax = RowSoftmax::new();
    let mut acc = [0.0f32; 32];
    for tile in 0..kv_tiles {
        let kv_start = tile * BLOCK_N;
        // Everyone finished tile − 1 (each thread waited for its `wgmma`s), so its slot can take
        // tile + 1 while this tile is multiplied.
        gpu::sync_threads();
        fetch(tile + 1);
        // This thread's copies of `tile` have landed; the proxy fence (also covering Q's
        // ordinary stores) and the barrier publish everyone's to `wgmma`.
        gpu::cp_async_wait(1);
        fence_proxy_async();
        gpu::sync_threads();
        let (k_slot, v_slot) = (k_address(tile % 2), v_address(tile % 2));

        // S = Q·Kᵀ: four k-steps of 16 along the head dimension, two core matrices each.
        let mut s32 = [0.0f32; 32];
        wgmma_fence();
        for ks in 0..HEAD_DIM / 16 {
            let step = (ks * 2 * CORE_MATRIX_BYTES) as u32;
            let a = matrix_descriptor(q_address + step, ALONG_COLUMNS, ALONG_ROWS);
            let b = matrix_descriptor(k_slot + step, ALONG_COLUMNS, ALONG_ROWS);
            // SAFETY: the warpgroup issues it on tiles published above.
            unsafe {
                if T::IS_BF16 {
                    wgmma_m64n64k16::<true>(&mut s32, a, b, ks > 0);
                } else {
                    wgmma_m64n64k16::<false>(&mut s32, a, b, ks > 0);
                }
            }
        }
        wgmma_commit();
        wgmma_wait::<0>(&mut s32);
        let mut s = fragments(&s32);

        // Only tiles that cross some row's key limit pay for the per-element mask.
        if kv_start + BLOCK_N > all_see {
            for (nt, frag) in s.iter_mut().enumerate() {
                for (e, x) in frag.iter_mut().enumerate() {
                    let row = q_start + 16 * warp + g + 8 * (e / 2);
                    if !mask.visible(row, kv_start + 8 * nt + 2 * t + e % 2) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        let alpha = softmax.update(&mut s, c);
        for (i, x) in acc.iter_mut().enumerate() {
            *x *= alpha[(i % 4) / 2];
        }

        // O += P·V: P from registers, V MN-major; 16 keys (two key blocks of V) per k-step.
        wgmma_fence();
        for kk in 0..BLOCK_N / 16 {
            let p = pack_a::<T>(s[2 * kk], s[2 * kk + 1]);
            let b = matrix_descriptor(v_slot + (kk * 2) as u32 * ALONG_ROWS, ALONG_ROWS, ALONG_COLUMNS);
            // SAFETY: as above.
            unsafe {
                if T::IS_BF16 {
                    wgmma_m64n64k16_register_a::<true>(&mut acc, p, b, true);
                } else {
                    wgmma_m64n64k16_register_a::<false>(&mut acc, p, b, true);
                }
            }
        }
        wgmma_commit();
        wgmma_wait::<0>(&mut acc);
    }

    // Normalise and write O (two values per store) and the LSE of the rows that exist.
    let (inv_sum, row_lse) = softmax.finish();
    let out = fragments(&acc);
    for (dt, frag) in out.iter().enumerate() {
        for h in 0..2 {
            let row = 16 * warp + g + 8 * h;
            if row < q_rows {
                let value = T::pack(frag[2 * h] * inv_sum[h], frag[2 * h + 1] * inv_sum[h]);
                // SAFETY: row < q_rows; the column pair is inside the head dimension.
                unsafe { *(o_head.add((q_start + row) * HEAD_DIM + 8 * dt + 2 * t) as *mut u32) = value };
            }
        }
    }
    if t == 0 {
        for h in 0..2 {
            let row = 16 * warp + g + 8 * h;
            if row < q_rows {
                // SAFETY: row < q_rows.
                unsafe { *lse_head.add(q_start + row) = row_lse[h] };
            }
        }
    }
}

/// The entry of one format: `hopper_flash_fwd_{f16,bf16}_m64_n64_d64`, with the argument list of
/// the level-5 forward kernels.
macro_rules! flash_forward_wgmma_instance {
    ($name:ident, $format:ident) => {
        /// FlashAttention forward on `wgmma` (sm_90a); see the module docs.
        ///
        /// # Safety
        /// As `flash_forward_wgmma`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "gpu-kernel" fn $name(
            q: *const u16,
            k: *const u16,
            v: *const u16,
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
            unsafe { flash_forward_wgmma::<gpu::$format>(q, k, v, o, lse, shape, mask, scale_log2) }
        }
    };
}

flash_forward_wgmma_instance!(hopper_flash_fwd_f16_m64_n64_d64, F16);
flash_forward_wgmma_instance!(hopper_flash_fwd_bf16_m64_n64_d64, Bf16);
