//! Level 0: the hardware, as a handful of small functions.
//!
//! Everything a kernel in this crate needs from the GPU is here, grouped by who executes it:
//!
//! * **a thread**: its index in the block and in the grid, fast `exp2`/`log2`, 16-byte loads;
//! * **a warp** (32 threads that issue together): shuffles, reductions over groups of lanes,
//!   the warp barrier;
//! * **a block** (threads that share one multiprocessor): the block barrier, dynamic shared
//!   memory, tiles carved out of it, cooperative copies from global memory into a tile.
//!
//! Warp-level operations call LLVM's NVPTX intrinsics rather than `asm!`: the intrinsics are known
//! to LLVM as *convergent* (every lane of the warp must reach them together), so the optimiser will
//! never move them into a branch that only some lanes take.
//!
//! Every hardware primitive lives in `backend`: on nvptx64 the module [`hw`] below (special
//! registers, intrinsics, PTX), on the host the CPU emulator ([`crate::emu`]), which implements the
//! same functions with threads, barriers and a checked shared memory. The functions of this file
//! are the same on both, so a kernel is written once.

use core::simd::Simd;

#[cfg(not(target_arch = "nvptx64"))]
use crate::emu as backend;
#[cfg(target_arch = "nvptx64")]
use hw as backend;

// ---------------------------------------------------------------------------------------------
// Thread: indices
// ---------------------------------------------------------------------------------------------

/// Index of this thread within its block along x (`threadIdx.x`).
#[inline(always)]
pub fn thread_idx_x() -> usize {
    backend::thread_idx_x()
}

/// Index of this block within the grid along x, y and z (`blockIdx`).
#[inline(always)]
pub fn block_idx() -> (usize, usize, usize) {
    backend::block_idx()
}

/// Threads per block along x (`blockDim.x`).
#[inline(always)]
pub fn block_dim_x() -> usize {
    backend::block_dim_x()
}

/// Blocks in the grid along x (`gridDim.x`).
#[inline(always)]
pub fn grid_dim_x() -> usize {
    backend::grid_dim_x()
}

/// This thread's index in a one-dimensional grid: `blockIdx.x · blockDim.x + threadIdx.x`.
/// Computed in 64 bits, so grids of more than 2³¹ threads index correctly.
#[inline(always)]
pub fn global_thread_idx() -> usize {
    block_idx().0 * block_dim_x() + thread_idx_x()
}

/// Number of threads in a one-dimensional grid: the step of a grid-stride loop.
#[inline(always)]
pub fn grid_stride() -> usize {
    grid_dim_x() * block_dim_x()
}

/// Lanes in a warp.
pub const WARP_SIZE: usize = 32;

/// This thread's lane within its warp (0..32). Blocks in this crate are one-dimensional, so the
/// lane is the low five bits of `threadIdx.x`.
#[inline(always)]
pub fn lane_id() -> usize {
    thread_idx_x() % WARP_SIZE
}

/// This thread's warp within its block.
#[inline(always)]
pub fn warp_id() -> usize {
    thread_idx_x() / WARP_SIZE
}

/// Stops the kernel; the host sees a launch failure at its next synchronisation.
#[inline(always)]
pub fn trap() -> ! {
    backend::trap()
}

// ---------------------------------------------------------------------------------------------
// Thread: math
// ---------------------------------------------------------------------------------------------

/// log₂(e). Softmax is computed with `exp2`, which the hardware has (`ex2.approx`), so scores are
/// multiplied by this once instead of calling `exp` per element: e^x = 2^(x·log₂e).
pub const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// ln(2): turns a base-2 logarithm back into a natural one, ln(x) = log₂(x)·ln 2.
pub const LN_2: f32 = core::f32::consts::LN_2;

/// 2^x with the hardware's `ex2.approx.f32` (relative error about 2⁻²²; exact 0 for x = −∞).
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    backend::exp2(x)
}

/// log₂(x) with the hardware's `lg2.approx.f32` (absolute error about 2⁻²²; −∞ for x = 0).
/// `core`'s `log2` has no NVPTX lowering (llc aborts), hence the intrinsic.
#[inline(always)]
pub fn log2(x: f32) -> f32 {
    backend::log2(x)
}

/// a·b + c with a single rounding (`fma.rn.f32`).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    backend::fma(a, b, c)
}

/// `*ptr += value` as one atomic read-modify-write in device memory (`red.add.f32`, which returns
/// nothing and so is cheaper than `atom.add`). Additions from different threads land in whatever
/// order the hardware serves them, so the rounding of the sum can differ from run to run.
///
/// # Safety
/// `ptr` points to an `f32` in global memory.
#[inline(always)]
pub unsafe fn atomic_add(ptr: *mut f32, value: f32) {
    // SAFETY: the caller's contract.
    unsafe { backend::atomic_add(ptr, value) }
}

/// Four `f32` that load and store as one 16-byte access (`ld.v4.f32`), which moves a quarter of
/// the instructions of four scalar accesses. The address must be 16-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
pub struct F32x4(pub [f32; 4]);

impl F32x4 {
    pub const ZERO: Self = Self([0.0; 4]);

    /// Reads four consecutive floats; `ptr` must be 16-byte aligned.
    ///
    /// # Safety
    /// `ptr..ptr+4` must be readable (global or shared memory).
    #[inline(always)]
    pub unsafe fn load(ptr: *const f32) -> Self {
        // Read through a SIMD type: LLVM then emits one vector load. Copying `Self` as a plain
        // 16-byte aggregate would be split into two 8-byte loads. (Host buffers need not be
        // 16-byte aligned, so the emulator reads unaligned.)
        #[cfg(target_arch = "nvptx64")]
        let v = unsafe { (ptr as *const Simd<f32, 4>).read() };
        #[cfg(not(target_arch = "nvptx64"))]
        let v = unsafe { (ptr as *const Simd<f32, 4>).read_unaligned() };
        Self(v.to_array())
    }

    /// Writes four consecutive floats; `ptr` must be 16-byte aligned.
    ///
    /// # Safety
    /// `ptr..ptr+4` must be writable (global or shared memory).
    #[inline(always)]
    pub unsafe fn store(self, ptr: *mut f32) {
        #[cfg(target_arch = "nvptx64")]
        unsafe {
            (ptr as *mut Simd<f32, 4>).write(Simd::from_array(self.0))
        }
        #[cfg(not(target_arch = "nvptx64"))]
        unsafe {
            (ptr as *mut Simd<f32, 4>).write_unaligned(Simd::from_array(self.0))
        }
    }

    /// Σ self[i]·other[i], as four fused multiply-adds onto `acc`.
    #[inline(always)]
    pub fn dot_add(self, other: Self, acc: f32) -> f32 {
        let mut acc = acc;
        for i in 0..4 {
            acc = fma(self.0[i], other.0[i], acc);
        }
        acc
    }

    /// self + a·x, elementwise (fused multiply-add).
    #[inline(always)]
    pub fn add_scaled(self, a: f32, x: Self) -> Self {
        let mut out = self;
        for i in 0..4 {
            out.0[i] = fma(a, x.0[i], out.0[i]);
        }
        out
    }

    /// self·a, elementwise.
    #[inline(always)]
    pub fn scale(self, a: f32) -> Self {
        Self(self.0.map(|x| x * a))
    }
}

// ---------------------------------------------------------------------------------------------
// Warp
// ---------------------------------------------------------------------------------------------

/// Waits until every lane of this warp has reached this point, and orders their shared-memory
/// accesses (`bar.warp.sync`). Enough when the threads that write and read a piece of shared
/// memory are all in one warp; cheaper than [`sync_threads`].
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn sync_warp() {
    backend::sync_warp()
}

/// The value of `x` held by lane `lane_id() ^ lane_mask` (`shfl.sync.bfly`): the butterfly
/// exchange that tree reductions are built from. All 32 lanes must call it together.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn shfl_xor(x: f32, lane_mask: u32) -> f32 {
    backend::shfl_xor(x, lane_mask)
}

/// Maximum of `x` over each aligned group of `LANES` consecutive lanes (LANES = 1, 2, 4, …, 32);
/// every lane of a group receives its group's result. All 32 lanes must call it together.
#[inline(always)]
pub fn group_max<const LANES: usize>(x: f32) -> f32 {
    const { assert!(LANES.is_power_of_two() && LANES <= WARP_SIZE) };
    let mut x = x;
    let mut offset = LANES / 2;
    while offset > 0 {
        x = x.max(shfl_xor(x, offset as u32));
        offset /= 2;
    }
    x
}

/// Sum of `x` over each aligned group of `LANES` consecutive lanes; see [`group_max`].
#[inline(always)]
pub fn group_sum<const LANES: usize>(x: f32) -> f32 {
    const { assert!(LANES.is_power_of_two() && LANES <= WARP_SIZE) };
    let mut x = x;
    let mut offset = LANES / 2;
    while offset > 0 {
        x += shfl_xor(x, offset as u32);
        offset /= 2;
    }
    x
}

// ---------------------------------------------------------------------------------------------
// Block
// ---------------------------------------------------------------------------------------------

/// Waits until every thread of the block has reached this point; shared-memory writes made
/// before it are visible to every thread after it (`bar.sync 0`, CUDA's `__syncthreads`).
/// Every thread of the block must reach the same call.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn sync_threads() {
    backend::sync_threads()
}

/// Start of the block's dynamic shared memory: the bytes the host asked for at launch
/// (`sharedMemBytes` of `cuLaunchKernel`), 16-byte aligned, uninitialised.
#[inline(always)]
pub fn dynamic_shared_memory() -> *mut f32 {
    backend::dynamic_shared_memory()
}

/// A `ROWS × cols` tile of `f32` in shared memory, row-major with a row stride of `stride`
/// floats. A stride longer than the row ("padding") shifts consecutive rows onto different
/// memory banks, so threads that read the same column of different rows do not collide.
#[derive(Clone, Copy)]
pub struct SharedTile {
    ptr: *mut f32,
    stride: usize,
}

impl SharedTile {
    /// Pointer to element `(row, col)`.
    #[inline(always)]
    fn at(self, row: usize, col: usize) -> *mut f32 {
        // SAFETY: only address arithmetic; callers stay within the carved tile.
        unsafe { self.ptr.add(row * self.stride + col) }
    }

    /// Reads `(row, col..col+4)`; `col` must be a multiple of 4 and the stride too.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn load4(self, row: usize, col: usize) -> F32x4 {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 4, false);
        // SAFETY: tiles are carved 16-byte aligned with strides that are multiples of 4.
        unsafe { F32x4::load(ptr) }
    }

    /// Writes `(row, col..col+4)`; `col` must be a multiple of 4 and the stride too.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn store4(self, row: usize, col: usize, value: F32x4) {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 4, true);
        // SAFETY: as `load4`.
        unsafe { value.store(ptr) }
    }

    /// Reads `(row, col)`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn load(self, row: usize, col: usize) -> f32 {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 1, false);
        // SAFETY: see `at`.
        unsafe { *ptr }
    }

    /// Writes `(row, col)`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn store(self, row: usize, col: usize, value: f32) {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 1, true);
        // SAFETY: see `at`.
        unsafe { *ptr = value }
    }

    /// Block-cooperative copy of `rows` consecutive rows of `cols` floats from global memory,
    /// starting at `src` (rows contiguous, no gaps), into rows `0..rows` of this tile; rows
    /// `valid_rows..rows` are filled with zeros instead of being read, so a ragged last tile
    /// never reads past the end of its tensor. Threads take 16-byte chunks in turn, so
    /// neighbouring threads read neighbouring addresses (coalesced). `cols` must be a multiple
    /// of 4 and `src` 16-byte aligned. Call from every thread of a block of `THREADS` threads;
    /// the caller places the barrier that publishes the tile.
    ///
    /// # Safety
    /// `src` points to `valid_rows · cols` readable floats of global memory.
    #[inline(always)]
    pub unsafe fn copy_rows_from<const THREADS: usize>(
        self,
        src: *const f32,
        rows: usize,
        cols: usize,
        valid_rows: usize,
    ) {
        let chunks_per_row = cols / 4;
        let mut chunk = thread_idx_x();
        while chunk < rows * chunks_per_row {
            let (row, col) = (chunk / chunks_per_row, (chunk % chunks_per_row) * 4);
            let value = if row < valid_rows {
                // SAFETY: row < valid_rows, so the chunk lies inside the source rows.
                unsafe { F32x4::load(src.add(row * cols + col)) }
            } else {
                F32x4::ZERO
            };
            self.store4(row, col, value);
            chunk += THREADS;
        }
    }
}

/// Hands out consecutive tiles of the block's dynamic shared memory. The host computes the same
/// total from `layout`, so the carve-up here and the launch's byte count agree.
pub struct SharedMemory {
    next: *mut f32,
}

impl SharedMemory {
    /// Starts at the beginning of the dynamic shared memory.
    #[inline(always)]
    pub fn new() -> Self {
        Self { next: dynamic_shared_memory() }
    }

    /// The next `rows × stride` floats as a tile. `stride` must be a multiple of 4 so that every
    /// tile and every row stays 16-byte aligned.
    #[inline(always)]
    pub fn tile(&mut self, rows: usize, stride: usize) -> SharedTile {
        let tile = SharedTile { ptr: self.next, stride };
        // SAFETY: the host sized the allocation from the same layout.
        self.next = unsafe { self.next.add(rows * stride) };
        tile
    }
}

impl Default for SharedMemory {
    fn default() -> Self {
        Self::new()
    }
}

/// The hardware backend: special registers, NVPTX intrinsics and PTX. Only this module talks
/// to the GPU; the emulator ([`crate::emu`]) provides the same functions on the host.
#[cfg(target_arch = "nvptx64")]
mod hw {
    use core::arch::nvptx;

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
        core::intrinsics::exp2f32(x)
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
    pub unsafe fn atomic_add(ptr: *mut f32, value: f32) {
        // SAFETY: the caller guarantees the address; `red` with no state space takes a generic
        // address.
        unsafe {
            core::arch::asm!("red.relaxed.gpu.add.f32 [{ptr}], {value};", ptr = in(reg64) ptr, value = in(reg32) value)
        };
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
    pub fn sync_threads() {
        // SAFETY: callers in this crate reach barriers in uniform control flow.
        unsafe { nvptx::_syncthreads() }
    }

    #[inline(always)]
    pub fn dynamic_shared_memory() -> *mut f32 {
        core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<super::F32x4>() as *mut f32
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
    }
}
