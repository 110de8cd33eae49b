//! The hardware backend of levels 0–6 on nvptx64: special registers, NVPTX intrinsics and PTX.
//! Only this file (and, for Hopper, [`super::warpgroup`] and [`super::tma`]) talks to the GPU;
//! on the host the CPU emulator ([`super::emu`]) provides the same functions.

use core::arch::{asm, nvptx};

#[inline(always)]
pub fn thread_idx_x() -> usize {
    // SAFETY: reading a special register has no preconditions.
    unsafe { nvptx::_thread_idx_x() as usize }
}

#[inline(always)]
pub fn block_idx() -> (usize, usize, usize) {
    // SAFETY: reading special registers has no preconditions.
    unsafe { (nvptx::_block_idx_x() as usize, nvptx::_block_idx_y() as usize, nvptx::_block_idx_z() as usize) }
}

#[inline(always)]
pub fn opaque(x: u32) -> u32 {
    let mut x = x;
    // SAFETY: no instruction (the operand sits in a PTX comment).
    unsafe { asm!("// opaque {x}", x = inout(reg32) x, options(nostack, nomem, preserves_flags)) };
    x
}

#[inline(always)]
pub fn block_dim_x() -> usize {
    // SAFETY: reading a special register has no preconditions.
    unsafe { nvptx::_block_dim_x() as usize }
}

#[inline(always)]
pub fn grid_dim_x() -> usize {
    // SAFETY: reading a special register has no preconditions.
    unsafe { nvptx::_grid_dim_x() as usize }
}

#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` has no preconditions; it never returns.
    unsafe { nvptx::trap() }
}

#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    // SAFETY: a pure arithmetic intrinsic.
    unsafe { ex2_approx_ftz(x) }
}

#[inline(always)]
pub fn log2(x: f32) -> f32 {
    // SAFETY: a pure arithmetic intrinsic.
    unsafe { lg2_approx(x) }
}

#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

#[inline(always)]
pub fn reciprocal(x: f32) -> f32 {
    // SAFETY: a pure arithmetic intrinsic.
    unsafe { rcp_approx_ftz(x) }
}

#[inline(always)]
pub unsafe fn atomic_add(ptr: *mut f32, value: f32) {
    // SAFETY: the caller guarantees a global address. Named as one (`.global`): with a generic
    // address the reduction becomes an `atom` that returns whether it reached global memory and
    // a branch on that answer, so every addition waits for its round trip (PERFORMANCE.md,
    // issue 27); a global one is fire-and-forget.
    unsafe {
        core::arch::asm!(
            "{{ .reg .u64 g; cvta.to.global.u64 g, {ptr}; red.relaxed.gpu.global.add.f32 [g], {value}; }}",
            ptr = in(reg64) ptr,
            value = in(reg32) value
        )
    };
}

#[inline(always)]
pub unsafe fn atomic_fetch_add_u32(ptr: *mut u32, value: u32) -> u32 {
    let old: u32;
    // SAFETY: the caller guarantees the address (a generic one).
    unsafe {
        core::arch::asm!("atom.relaxed.gpu.add.u32 {old}, [{ptr}], {value};", old = out(reg32) old,
            ptr = in(reg64) ptr, value = in(reg32) value)
    };
    old
}

const FULL_MASK: u32 = 0xffff_ffff;

#[inline(always)]
pub fn sync_warp() {
    // SAFETY: every kernel in this crate runs full warps, so all lanes in the mask exist.
    unsafe { bar_warp_sync(FULL_MASK) }
}

#[inline(always)]
pub fn shfl_xor(x: f32, lane_mask: u32) -> f32 {
    // `0x1f` is the "clamp" operand: lanes exchange within the whole warp.
    // SAFETY: all lanes take part (FULL_MASK), which every caller in this crate guarantees.
    unsafe { shfl_sync_bfly_f32(FULL_MASK, x, lane_mask, 0x1f) }
}

#[inline(always)]
pub fn warp_any(predicate: bool) -> bool {
    // SAFETY: all lanes take part (FULL_MASK), which every caller in this crate guarantees.
    unsafe { vote_any_sync(FULL_MASK, predicate) }
}

#[inline(always)]
pub fn sync_threads() {
    // SAFETY: callers in this crate reach barriers in uniform control flow.
    unsafe { nvptx::_syncthreads() }
}

#[inline(always)]
pub fn dynamic_shared_memory() -> *mut f32 {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<super::F32x4>() as *mut f32
}

// Tensor cores and asynchronous copies: PTX through `asm!`.

/// The address of `ptr` in the shared state space (32 bits), which `ldmatrix` and
/// `cp.async` take; `ptr` is a generic address inside the block's shared memory.
#[inline(always)]
pub fn shared_address<T>(ptr: *const T) -> u32 {
    let address: u64;
    // SAFETY: address conversion only; `pure` lets LLVM reuse the result.
    unsafe {
        asm!("cvta.to.shared.u64 {a}, {p};", a = out(reg64) address, p = in(reg64) ptr as u64, options(pure, nomem, nostack))
    };
    address as u32
}

#[inline(always)]
pub unsafe fn ldmatrix_x4<const TRANS: bool>(address: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees a 16-byte aligned row of shared memory per lane.
    unsafe {
        if TRANS {
            asm!(
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
                a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                p = in(reg32) address, options(readonly, nostack)
            )
        } else {
            asm!(
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
                a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                p = in(reg32) address, options(readonly, nostack)
            )
        }
    }
    [a, b, c, d]
}

#[cfg(target_feature = "sm_80")]
#[inline(always)]
pub fn mma_m16n8k16<const BF16: bool>(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    let [mut d0, mut d1, mut d2, mut d3] = c;
    // SAFETY: register-only; every lane of the warp executes it (the callers' contract).
    unsafe {
        if BF16 {
            asm!(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, \
                 {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
                d0 = inout(reg32) d0, d1 = inout(reg32) d1, d2 = inout(reg32) d2, d3 = inout(reg32) d3,
                a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                b0 = in(reg32) b[0], b1 = in(reg32) b[1], options(pure, nomem, nostack)
            )
        } else {
            asm!(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, \
                 {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
                d0 = inout(reg32) d0, d1 = inout(reg32) d1, d2 = inout(reg32) d2, d3 = inout(reg32) d3,
                a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                b0 = in(reg32) b[0], b1 = in(reg32) b[1], options(pure, nomem, nostack)
            )
        }
    }
    [d0, d1, d2, d3]
}

/// Turing (sm_75) has no m16n8k16 `mma` for `f16`, and none for `bf16` at all: the product is
/// two m16n8k8 steps over the two halves of k. In the m16n8k16 fragments a lane's registers a0,
/// a1 hold columns 0–7 of its rows and a2, a3 columns 8–15; b0 holds k rows 0–7 and b1 rows
/// 8–15 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), which are exactly the m16n8k8
/// fragments of the two halves, so no lane moves data. The `bf16` instances are not compiled
/// into the sm_75 modules (the host refuses `bf16` there); reaching this with `BF16` traps.
// ANCHOR: turing_mma
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
pub fn mma_m16n8k16<const BF16: bool>(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    if BF16 {
        trap();
    }
    let low_k = mma_m16n8k8_f16([a[0], a[1]], b[0], c);
    mma_m16n8k8_f16([a[2], a[3]], b[1], low_k)
}
// ANCHOR_END: turing_mma

/// One `mma.sync.m16n8k8` in `f16` with `f32` accumulators (sm_75 and newer).
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
fn mma_m16n8k8_f16(a: [u32; 2], b: u32, c: [f32; 4]) -> [f32; 4] {
    let [mut d0, mut d1, mut d2, mut d3] = c;
    // SAFETY: register-only; every lane of the warp executes it (the callers' contract).
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, \
             {{{a0}, {a1}}}, {{{b0}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) d0, d1 = inout(reg32) d1, d2 = inout(reg32) d2, d3 = inout(reg32) d3,
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], b0 = in(reg32) b, options(pure, nomem, nostack)
        )
    };
    [d0, d1, d2, d3]
}

#[inline(always)]
pub fn movmatrix_trans(x: u32) -> u32 {
    let out: u32;
    // SAFETY: register-only; every lane of the warp executes it (the callers' contract).
    unsafe {
        asm!("movmatrix.sync.aligned.m8n8.trans.b16 {o}, {x};", o = out(reg32) out, x = in(reg32) x,
             options(pure, nomem, nostack))
    };
    out
}

#[cfg(target_feature = "sm_80")]
#[inline(always)]
pub fn pack_f16x2(lo: f32, hi: f32) -> u32 {
    let out: u32;
    // SAFETY: register-only. The first source goes to the upper half.
    unsafe {
        asm!("cvt.rn.f16x2.f32 {o}, {hi}, {lo};", o = out(reg32) out, hi = in(reg32) hi, lo = in(reg32) lo,
             options(pure, nomem, nostack))
    };
    out
}

/// Turing has no two-value `cvt` (it came with sm_80): two conversions, then one move packs
/// the halves.
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
pub fn pack_f16x2(lo: f32, hi: f32) -> u32 {
    let out: u32;
    // SAFETY: register-only.
    unsafe {
        asm!(
            "{{ .reg .b16 l, h; cvt.rn.f16.f32 l, {lo}; cvt.rn.f16.f32 h, {hi}; mov.b32 {o}, {{l, h}}; }}",
            o = out(reg32) out, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack)
        )
    };
    out
}

#[cfg(target_feature = "sm_80")]
#[inline(always)]
pub fn pack_bf16x2(lo: f32, hi: f32) -> u32 {
    let out: u32;
    // SAFETY: register-only. The first source goes to the upper half.
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {o}, {hi}, {lo};", o = out(reg32) out, hi = in(reg32) hi, lo = in(reg32) lo,
             options(pure, nomem, nostack))
    };
    out
}

/// Turing has no `bf16` conversion; its modules hold no `bf16` kernel.
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
pub fn pack_bf16x2(_lo: f32, _hi: f32) -> u32 {
    trap()
}

#[inline(always)]
pub fn unpack_f16x2(x: u32) -> (f32, f32) {
    let (lo, hi): (f32, f32);
    // SAFETY: register-only.
    unsafe {
        asm!(
            "{{ .reg .b16 l, h; mov.b32 {{l, h}}, {x}; cvt.f32.f16 {lo}, l; cvt.f32.f16 {hi}, h; }}",
            x = in(reg32) x, lo = out(reg32) lo, hi = out(reg32) hi, options(pure, nomem, nostack)
        )
    };
    (lo, hi)
}

/// Copies 16 bytes from `src` (global memory) to `dst` (a shared-space address)
/// asynchronously, or writes 16 zero bytes when `valid` is false; completes with
/// `cp_async_commit` and `cp_async_wait`.
///
/// # Safety
/// `dst` is 16-byte aligned inside the block's shared memory; `src` is a 16-byte aligned
/// global address (read only when `valid`).
#[cfg(target_feature = "sm_80")]
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const u16, valid: bool) {
    // `src-size` 0 makes the copy write 16 zero bytes without reading the source.
    let src_bytes: u32 = if valid { 16 } else { 0 };
    // SAFETY: the caller guarantees both addresses; the global address is converted from
    // the generic one, as `cp.async` wants a `.global` address.
    unsafe {
        asm!(
            "{{ .reg .u64 g; cvta.to.global.u64 g, {src}; cp.async.cg.shared.global [{dst}], [g], 16, {n}; }}",
            dst = in(reg32) dst, src = in(reg64) src, n = in(reg32) src_bytes,
            options(nostack)
        )
    };
}

#[cfg(target_feature = "sm_80")]
#[inline(always)]
pub unsafe fn cp_async_4(dst: u32, src: *const f32, valid: bool) {
    let src_bytes: u32 = if valid { 4 } else { 0 };
    // SAFETY: as `cp_async_16`; `.ca` is the variant that allows 4-byte copies.
    unsafe {
        asm!(
            "{{ .reg .u64 g; cvta.to.global.u64 g, {src}; cp.async.ca.shared.global [{dst}], [g], 4, {n}; }}",
            dst = in(reg32) dst, src = in(reg64) src, n = in(reg32) src_bytes,
            options(nostack)
        )
    };
}

#[cfg(target_feature = "sm_80")]
#[inline(always)]
pub fn cp_async_commit() {
    // SAFETY: no operands; it only closes this thread's group.
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}

#[cfg(target_feature = "sm_80")]
#[inline(always)]
pub fn cp_async_wait<const PENDING: usize>() {
    // SAFETY: no operands. Not `nomem`: shared-memory reads must not move above it.
    unsafe { asm!("cp.async.wait_group {n};", n = const PENDING, options(nostack)) };
}

// Turing (sm_75) has no `cp.async` (it came with sm_80): the same four functions as ordinary
// loads into registers and stores to shared memory. The copy is complete when the function
// returns, so a commit group is empty and waiting for one returns at once; every caller waits
// before a barrier and only then reads the tile, which makes the stores visible to the block just
// as it does the asynchronous copies. (Only the overlap is lost: a warp stalls at the store until
// its load arrives, where `cp.async` let it go on.)

/// [`cp_async_16`] on Turing: a 16-byte load (cached in L2 only, as `cp.async.cg`) and store,
/// or a store of zeros.
///
/// # Safety
/// As on sm_80: `dst` is 16-byte aligned inside the block's shared memory; `src` is a 16-byte
/// aligned global address (read only when `valid`).
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const u16, valid: bool) {
    let valid = valid as u32;
    // SAFETY: the caller guarantees both addresses; the load is predicated off when not valid.
    unsafe {
        asm!(
            "{{ .reg .pred p; .reg .u64 g; .reg .b32 x, y, z, w; setp.ne.u32 p, {valid}, 0; \
             mov.b32 x, 0; mov.b32 y, 0; mov.b32 z, 0; mov.b32 w, 0; cvta.to.global.u64 g, {src}; \
             @p ld.global.cg.v4.b32 {{x, y, z, w}}, [g]; st.shared.v4.b32 [{dst}], {{x, y, z, w}}; }}",
            dst = in(reg32) dst, src = in(reg64) src, valid = in(reg32) valid,
            options(nostack)
        )
    };
}

/// [`cp_async_4`] on Turing: a 4-byte load and store, or a store of zero.
///
/// # Safety
/// As [`cp_async_16`], with 4-byte alignment.
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
pub unsafe fn cp_async_4(dst: u32, src: *const f32, valid: bool) {
    let valid = valid as u32;
    // SAFETY: as `cp_async_16`.
    unsafe {
        asm!(
            "{{ .reg .pred p; .reg .u64 g; .reg .b32 x; setp.ne.u32 p, {valid}, 0; mov.b32 x, 0; \
             cvta.to.global.u64 g, {src}; @p ld.global.ca.b32 x, [g]; st.shared.b32 [{dst}], x; }}",
            dst = in(reg32) dst, src = in(reg64) src, valid = in(reg32) valid,
            options(nostack)
        )
    };
}

/// Nothing to close on Turing: every copy has completed already.
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
pub fn cp_async_commit() {}

/// Nothing to wait for on Turing; still a compiler barrier (an `asm!` that may touch memory),
/// so that no shared-memory read moves above the point where the sm_80 code waits.
#[cfg(not(target_feature = "sm_80"))]
#[inline(always)]
pub fn cp_async_wait<const PENDING: usize>() {
    // SAFETY: no instruction (a PTX comment).
    unsafe {
        asm!("// cp.async.wait_group {n} (sm_75: the copies were synchronous)", n = const PENDING, options(nostack))
    };
}

/// Shared-memory accesses are not checked on the GPU (the emulator checks them).
#[inline(always)]
pub fn check_shared(_ptr: *const f32, _words: usize, _write: bool) {}

// LLVM's NVPTX intrinsics, declared by their LLVM names.
unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_sync_bfly_f32(member_mask: u32, value: f32, lane_mask: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.bar.warp.sync"]
    fn bar_warp_sync(member_mask: u32);
    #[link_name = "llvm.nvvm.lg2.approx.f"]
    fn lg2_approx(x: f32) -> f32;
    #[link_name = "llvm.nvvm.ex2.approx.ftz.f"]
    fn ex2_approx_ftz(x: f32) -> f32;
    #[link_name = "llvm.nvvm.rcp.approx.ftz.f"]
    fn rcp_approx_ftz(x: f32) -> f32;
    #[link_name = "llvm.nvvm.vote.any.sync"]
    fn vote_any_sync(member_mask: u32, predicate: bool) -> bool;
}
