//! Level 7 (sm_90a only): Hopper's asynchronous building blocks, each checked on its own against
//! the CPU before the kernels of levels 8 and 9 rely on them (`tests/gpu_hopper.rs`).
//!
//! Hopper adds three things that the `mma.sync` kernels of levels 5 and 6 do not use, all in
//! [`crate::hw`] (the files `warpgroup.rs` and `tma.rs`, whose module docs give the contracts: who
//! calls what, and what it orders):
//!
//! * **`wgmma`**: a *warpgroup* (4 consecutive warps) multiplies a 64 × K tile of A by a K × N
//!   tile of B into 64 × N `f32` values spread over its 128 threads' registers, reading A and B
//!   straight from shared memory through 64-bit *matrix descriptors*. It is asynchronous: issued,
//!   committed in a group, waited for.
//! * **TMA** (the tensor memory accelerator): one thread asks for a whole box of a tensor
//!   (`cp.async.bulk.tensor`), described by a *tensor map* the host made (`cuTensorMapEncodeTiled`).
//! * **`mbarrier`**: a barrier in shared memory that counts arrivals *and* transaction bytes, on
//!   whose phases (parities) threads wait: how copies and their consumers meet.
//!
//! The probes here exercise one feature each: `wgmma` from unswizzled core matrices, `wgmma`
//! with A from registers, and a TMA load into the 128-byte swizzle read back by `wgmma`. The
//! Hopper PTX is built with `llc -mcpu=sm_90a` into a module of its own, which the host loads only
//! on compute capability 9.0.

use crate::hw::{
    self, Accumulator, CORE_MATRIX_BYTES, CORE_MATRIX_ROW_BYTES, FragC, WARPGROUP_THREADS, fence_mbarrier_init,
    fence_proxy_async, matrix_descriptor, mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_wait, shared_address,
    tma_load_2d, wgmma_commit, wgmma_fence, wgmma_wait,
};
/// Byte offset of element (row, k) of a K-major operand stored as core matrices without
/// swizzling: the core matrix of 8-row block `row / 8` and 8-column block `k / 8` starts at
/// `(row / 8 · k_blocks + k / 8) · 128` bytes, so core matrices adjacent along K are 128 bytes
/// apart (the leading dimension byte offset) and those adjacent along rows `k_blocks · 128`
/// apart (the stride dimension byte offset); within one, row `row % 8` starts at 16-byte steps.
#[inline(always)]
pub fn core_matrix_offset(row: usize, k: usize, k_blocks: usize) -> usize {
    ((row / 8) * k_blocks + k / 8) * CORE_MATRIX_BYTES + (row % 8) * CORE_MATRIX_ROW_BYTES + (k % 8) * 2
}

// ANCHOR: probe_wgmma
/// C (64 × 64, `f32`, row-major) = A (64 × K) · Bᵀ, with A and B (64 × K) row-major 16-bit
/// floats (`f16`, or `bf16` when `bf16 != 0`), K a multiple of 16 from 16 to 128. One block of one
/// warpgroup: A and B are copied to shared memory as core matrices by ordinary stores, then
/// multiplied by K/16 `wgmma`s in one commit group. `leading_bytes` and `stride_bytes` are the
/// descriptors' offsets (the test passes the layout's: 128 and K/8 · 128).
///
/// # Safety
/// A and B hold 64 · K values, C 64 · 64; launched with one block of 128 threads and
/// 2 · 64 · K · 2 bytes of dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn hopper_probe_wgmma(
    a: *const u16,
    b: *const u16,
    c: *mut f32,
    k: usize,
    bf16: usize,
    leading_bytes: usize,
    stride_bytes: usize,
) {
    let t = hw::thread_idx_x();
    let k_blocks = k / 8;
    let shared = hw::dynamic_shared_memory() as *mut u8;
    let b_shared = unsafe { shared.add(64 * k * 2) };
    // Ordinary stores into the core-matrix layout (thread t copies column t of every row), then
    // published to the async proxy.
    let mut row = 0;
    while row < 64 {
        if t < k {
            let offset = core_matrix_offset(row, t, k_blocks);
            // SAFETY: row < 64 and t < k: in bounds by the launch contract.
            unsafe {
                *(shared.add(offset) as *mut u16) = *a.add(row * k + t);
                *(b_shared.add(offset) as *mut u16) = *b.add(row * k + t);
            }
        }
        row += 1;
    }
    fence_proxy_async();
    hw::sync_threads();

    let mut d = [[0.0f32; 4]; 8];
    let (a_address, b_address) = (shared_address(shared), shared_address(b_shared));
    d.pin();
    wgmma_fence();
    let mut step = 0;
    while step < k / 16 {
        // Each step consumes two core matrices along K: 256 bytes further.
        let offset = (step * 2 * CORE_MATRIX_BYTES) as u32;
        let a_desc = matrix_descriptor(a_address + offset, leading_bytes as u32, stride_bytes as u32);
        let b_desc = matrix_descriptor(b_address + offset, leading_bytes as u32, stride_bytes as u32);
        // SAFETY: the whole warpgroup issues it on the tiles published above.
        unsafe {
            if bf16 != 0 {
                d.mma::<hw::Bf16>(a_desc, b_desc, step > 0);
            } else {
                d.mma::<hw::F16>(a_desc, b_desc, step > 0);
            }
        }
        step += 1;
    }
    wgmma_commit();
    wgmma_wait::<0>();
    d.pin();

    store_accumulator(c, &d);
}
// ANCHOR_END: probe_wgmma

/// C (64 × 64, `f32`, row-major) = A (64 × K) · B (K × 64), A and B row-major 16-bit floats,
/// K a multiple of 16 up to 128: A from registers (each warp loads its 16 rows as `mma.sync`
/// A fragments), B from shared memory *MN-major* (B's rows, 64 values of N each, stored as core
/// matrices of 8 K-rows × 8 N-values: the one at K-block `kb`, N-block `nb` at
/// `(kb · 8 + nb) · 128` bytes). `leading_bytes` and `stride_bytes` are the descriptor's offsets
/// ([`DescriptorOffsets::mn_major_n64`] on the host).
///
/// # Safety
/// A holds 64 · K values, B K · 64, C 64 · 64; one block of 128 threads with K · 64 · 2 bytes of
/// dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn hopper_probe_wgmma_register_a(
    a: *const u16,
    b: *const u16,
    c: *mut f32,
    k: usize,
    bf16: usize,
    leading_bytes: usize,
    stride_bytes: usize,
) {
    let t = hw::thread_idx_x();
    let shared = hw::dynamic_shared_memory() as *mut u8;
    // B into MN-major core matrices: thread t copies column t (t < 64) of every row of B.
    let mut row = 0;
    while row < k {
        if t < 64 {
            // Rows are K, columns N: the same core-matrix placement as a K-major tile of 8 blocks.
            let offset = core_matrix_offset(row, t, 8);
            // SAFETY: row < k and t < 64: in bounds by the launch contract.
            unsafe { *(shared.add(offset) as *mut u16) = *b.add(row * 64 + t) };
        }
        row += 1;
    }
    fence_proxy_async();
    hw::sync_threads();

    let (warp, lane) = (hw::warp_id(), hw::lane_id());
    let (g, q) = (lane / 4, lane % 4);
    let a_row = |r: usize, col: usize| -> u32 {
        // SAFETY: r < 64 and col + 1 < k: in bounds by the launch contract.
        unsafe { (*a.add(r * k + col) as u32) | (*a.add(r * k + col + 1) as u32) << 16 }
    };
    let b_address = shared_address(shared);
    let mut d = [[0.0f32; 4]; 8];
    d.pin();
    wgmma_fence();
    let mut step = 0;
    while step < k / 16 {
        let (r, col) = (16 * warp + g, 16 * step + 2 * q);
        let fragment = [a_row(r, col), a_row(r + 8, col), a_row(r, col + 8), a_row(r + 8, col + 8)];
        // Each step consumes two K-blocks of B: 2 · 8 core matrices further.
        let offset = (step * 2 * 8 * CORE_MATRIX_BYTES) as u32;
        let b_desc = matrix_descriptor(b_address + offset, leading_bytes as u32, stride_bytes as u32);
        // SAFETY: the whole warpgroup issues it on the tile published above.
        unsafe {
            if bf16 != 0 {
                d.mma_register_a::<hw::Bf16>(fragment, b_desc, step > 0);
            } else {
                d.mma_register_a::<hw::F16>(fragment, b_desc, step > 0);
            }
        }
        step += 1;
    }
    wgmma_commit();
    wgmma_wait::<0>();
    d.pin();
    store_accumulator(c, &d);
}

/// Writes a warpgroup's 64 × 64 accumulator (the layout of [`Accumulator`]) to `c`,
/// row-major.
#[inline(always)]
fn store_accumulator(c: *mut f32, d: &[FragC; 8]) {
    let (warp, lane) = (hw::warp_id(), hw::lane_id());
    let row = 16 * warp + lane / 4;
    let mut j = 0;
    while j < 8 {
        let col = 8 * j + 2 * (lane % 4);
        // SAFETY: row + 8 < 64 and col + 1 < 64; the callers' `c` holds 64 · 64 values.
        unsafe {
            *c.add(row * 64 + col) = d[j][0];
            *c.add(row * 64 + col + 1) = d[j][1];
            *c.add((row + 8) * 64 + col) = d[j][2];
            *c.add((row + 8) * 64 + col + 1) = d[j][3];
        }
        j += 1;
    }
}

/// Copies the 64 × 64 box of 16-bit values at (`x`, `y`) of the 2-D tensor described by
/// `tensor_map` into shared memory with one TMA load completing on an `mbarrier`, then writes
/// the box to `out` (64 × 64, row-major) with ordinary loads: zeros where the box leaves the
/// tensor.
///
/// # Safety
/// `tensor_map` points to a `CUtensorMap` in device memory with a 64 × 64 box of 2-byte
/// elements; `out` holds 64 · 64 values; one block of 128 threads with 8192 + 128 bytes of
/// dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn hopper_probe_tma(tensor_map: *const u8, out: *mut u16, x: isize, y: isize) {
    const BOX_BYTES: usize = 64 * 64 * 2;
    let t = hw::thread_idx_x();
    let shared = hw::dynamic_shared_memory() as *mut u8;
    // The box first (128-byte aligned: the start of dynamic shared memory), the barrier after it.
    let barrier = shared_address(shared) + BOX_BYTES as u32;
    if t == 0 {
        // SAFETY: one thread initialises the barrier before anyone else touches it.
        unsafe { mbarrier_init(barrier, 1) };
        fence_mbarrier_init();
    }
    hw::sync_threads();
    if t == 0 {
        // SAFETY: the barrier is initialised; the box fits at `shared`.
        unsafe {
            mbarrier_arrive_expect_tx(barrier, BOX_BYTES as u32);
            tma_load_2d(shared_address(shared), tensor_map, x as i32, y as i32, barrier);
        }
    }
    // SAFETY: initialised above; the first phase has parity 0.
    unsafe { mbarrier_wait(barrier, 0) };
    let mut i = t;
    while i < 64 * 64 {
        // SAFETY: in bounds by the launch contract.
        unsafe { *out.add(i) = *(shared.add(2 * i) as *const u16) };
        i += WARPGROUP_THREADS;
    }
}
