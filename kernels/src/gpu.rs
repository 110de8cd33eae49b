//! Level 0: the hardware, as a handful of small functions.
//!
//! Everything a kernel in this crate needs from the GPU is here, grouped by who executes it:
//!
//! * **a thread**: its index in the block and in the grid, fast `exp2`/`log2`, 16-byte loads;
//! * **a warp** (32 threads that issue together): shuffles, votes, reductions over groups of
//!   lanes, the warp barrier, and the tensor cores (`mma.sync` on fragments spread over the
//!   warp's lanes, loaded with `ldmatrix`, transposed with `movmatrix`);
//! * **a block** (threads that share one multiprocessor): the block barrier, dynamic shared
//!   memory, tiles carved out of it, cooperative copies from global memory into a tile, and
//!   asynchronous ones (`cp.async`, with commit groups to wait for).
//!
//! Warp-level operations call LLVM's NVPTX intrinsics rather than `asm!`: the intrinsics are known
//! to LLVM as *convergent* (every lane of the warp must reach them together), so the optimiser will
//! never move them into a branch that only some lanes take.
//!
//! Every hardware primitive lives in `backend`: on nvptx64 the module `hw` below (special
//! registers, intrinsics, PTX), on the host the CPU emulator ([`crate::emu`]), which implements the
//! same functions with threads, barriers and a checked shared memory. The functions of this file
//! are the same on both, so a kernel is written once.

use core::simd::Simd;

#[cfg(not(target_arch = "nvptx64"))]
use crate::emu as backend;
#[cfg(target_arch = "nvptx64")]
use hw as backend;
/// One 16-byte `cp.async` from global to shared memory (zero-filled when `valid` is false), for
/// kernels that place the chunks themselves (the Hopper kernels' core-matrix layouts).
#[cfg(target_arch = "nvptx64")]
pub use hw::cp_async_16;
/// The shared-state-space (32-bit) address of a pointer into the block's shared memory, which
/// the Hopper wrappers (`crate::hopper`) pass to `wgmma` descriptors, `mbarrier`s and TMA.
#[cfg(target_arch = "nvptx64")]
pub use hw::shared_address;

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

/// 2^x with the hardware's `ex2.approx.ftz.f32` (relative error about 2⁻²²; exact 0 for x = −∞;
/// results below 2⁻¹²⁶ flush to 0). The `.ftz` form is one instruction (`MUFU.EX2`); without it
/// the compiler wraps the instruction in denormal handling, three more per exponential, which the
/// softmax of attention (probabilities below 2⁻¹²⁶ are 0 to any sum that matters) does not need.
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

    /// Σ `self[i] · other[i]`, as four fused multiply-adds onto `acc`.
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

/// Whether `predicate` holds in any lane of the warp (`vote.sync.any`); every lane receives the
/// same answer, so a branch on it is uniform across the warp. All 32 lanes must call it together.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn warp_any(predicate: bool) -> bool {
    backend::warp_any(predicate)
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

impl SharedTile {
    /// Block-cooperative asynchronous copy of `cols` floats from global memory at `src` into row
    /// `row` of this tile, 4 bytes per `cp.async` (so `src` need only be 4-byte aligned); columns
    /// `valid_cols..cols` are zero-filled without reading. Part of the calling thread's current
    /// copy group (see [`SharedTile16::copy_rows_async`]).
    ///
    /// # Safety
    /// `src` points to `valid_cols` readable floats of global memory.
    #[inline(always)]
    pub unsafe fn copy_row_async(self, row: usize, src: *const f32, cols: usize, valid_cols: usize, threads: usize) {
        let mut col = thread_idx_x();
        while col < cols {
            let dst = self.at(row, col);
            backend::check_shared(dst, 1, true);
            let valid = col < valid_cols;
            // SAFETY: a valid column lies inside the source; otherwise nothing is read.
            unsafe { backend::cp_async_4(backend::shared_address(dst), src.add(if valid { col } else { 0 }), valid) };
            col += threads;
        }
    }
}

/// Hands out consecutive tiles of the block's dynamic shared memory. The host computes the same
/// total from `layout`, so the carve-up here and the launch's byte count agree.
pub struct SharedMemory {
    next: *mut u8,
}

impl SharedMemory {
    /// Starts at the beginning of the dynamic shared memory.
    #[inline(always)]
    pub fn new() -> Self {
        Self { next: dynamic_shared_memory() as *mut u8 }
    }

    /// The next `rows × stride` floats as a tile. `stride` must be a multiple of 4 so that every
    /// tile and every row stays 16-byte aligned.
    #[inline(always)]
    pub fn tile(&mut self, rows: usize, stride: usize) -> SharedTile {
        let tile = SharedTile { ptr: self.next as *mut f32, stride };
        // SAFETY: the host sized the allocation from the same layout.
        self.next = unsafe { self.next.add(rows * stride * 4) };
        tile
    }

    /// The next `rows × stride` 16-bit floats as a tile for the tensor cores. `stride` must be a
    /// multiple of 8 so that every row starts 16-byte aligned (`ldmatrix` and `cp.async` need it).
    #[inline(always)]
    pub fn tile16(&mut self, rows: usize, stride: usize) -> SharedTile16 {
        let ptr = self.next as *mut u16;
        let tile = SharedTile16 { ptr, address: backend::shared_address(ptr), stride };
        // SAFETY: the host sized the allocation from the same layout.
        self.next = unsafe { self.next.add(rows * stride * 2) };
        tile
    }
}

impl Default for SharedMemory {
    fn default() -> Self {
        Self::new()
    }
}

// ---------------------------------------------------------------------------------------------
// Warp: tensor cores (`mma.sync`, `ldmatrix`) and block: asynchronous copies (`cp.async`)
// ---------------------------------------------------------------------------------------------
//
// A tensor core multiplies small matrices held *collectively* by the 32 lanes of a warp: each
// lane holds a few registers of each operand, in a layout fixed by the PTX ISA ("Matrix
// fragments for mma.m16n8k16"). With `g = lane / 4` (the lane's group) and `t = lane % 4` (its
// place in the group), for D = A·B + C with A 16×16, B 16×8 and C, D 16×8:
//
// | fragment | registers | lane holds |
// |---|---|---|
// | A ([`FragA`], 16-bit pairs) | a0, a1, a2, a3 | A[g][2t..2t+2], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..] |
// | B ([`FragB`], 16-bit pairs) | b0, b1 | B[2t..2t+2][g], B[2t+8..2t+10][g] |
// | C, D ([`FragC`], f32) | c0, c1, c2, c3 | C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1] |
//
// Two consequences shape the kernels. A row of C is spread over the 4 lanes of a group, so row
// maxima and sums need only shuffles among those 4 lanes. And the accumulator of one product has
// the layout of the A operand of the next one (c0, c1 of columns 0..8 and of columns 8..16 are
// a0 and a2): P = softmax(S) can feed P·V straight from registers, as FlashAttention-2 does.
//
// Fragments are read from shared memory with `ldmatrix`, which loads four 8×8 matrices of
// 16-bit values at once: lanes 8i..8i+8 name the eight rows of matrix i, and every lane receives
// its (g, 2t) pair of each matrix — exactly the fragment layout above. With `.trans` it receives
// the transposed pair, which turns a row-major tile into a column operand (V in P·V).

/// One 32-bit register holding two 16-bit floats: the element with the lower column (or row)
/// index in the low half.
pub type Half2 = u32;
/// A lane's share of a 16×16 A operand: four [`Half2`].
pub type FragA = [Half2; 4];
/// A lane's share of a 16×8 B operand (k × n): two [`Half2`].
pub type FragB = [Half2; 2];
/// A lane's share of a 16×8 `f32` accumulator.
pub type FragC = [f32; 4];

/// The 16-bit float formats the tensor cores multiply, as a type parameter of the kernels:
/// [`F16`] (IEEE half) and [`Bf16`] (bfloat16). Tensors hold their raw bits as `u16`.
pub trait HalfFloat: Copy + 'static {
    /// The format's name in kernel names: `f16` or `bf16`.
    const NAME: &'static str;

    /// Whether this is bfloat16 (the instruction suffix of `wgmma`).
    const IS_BF16: bool;

    /// Rounds two `f32` to this format (to nearest, ties to even) and packs them, `lo` in the
    /// low half (`cvt.rn.f16x2.f32` / `cvt.rn.bf16x2.f32`).
    fn pack(lo: f32, hi: f32) -> Half2;

    /// D = A·B + C on the tensor cores, for one 16×8×16 tile (`mma.sync.aligned.m16n8k16`,
    /// `f32` accumulation). All 32 lanes of the warp must call it together.
    fn mma(a: FragA, b: FragB, c: FragC) -> FragC;

    /// The two values of a [`Half2`], widened to `f32` (exact), `lo` first.
    fn unpack(x: Half2) -> (f32, f32);
}

/// IEEE 754 half precision: 5 exponent bits, 10 mantissa bits (largest finite value 65504).
#[derive(Clone, Copy)]
pub struct F16;

/// bfloat16: `f32`'s 8 exponent bits with 7 mantissa bits (same range as `f32`, coarser steps).
#[derive(Clone, Copy)]
pub struct Bf16;

impl HalfFloat for F16 {
    const NAME: &'static str = "f16";
    const IS_BF16: bool = false;

    #[inline(always)]
    fn pack(lo: f32, hi: f32) -> Half2 {
        backend::pack_f16x2(lo, hi)
    }

    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    fn mma(a: FragA, b: FragB, c: FragC) -> FragC {
        backend::mma_m16n8k16::<false>(a, b, c)
    }

    #[inline(always)]
    fn unpack(x: Half2) -> (f32, f32) {
        backend::unpack_f16x2(x)
    }
}

impl HalfFloat for Bf16 {
    const NAME: &'static str = "bf16";
    const IS_BF16: bool = true;

    #[inline(always)]
    fn pack(lo: f32, hi: f32) -> Half2 {
        backend::pack_bf16x2(lo, hi)
    }

    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    fn mma(a: FragA, b: FragB, c: FragC) -> FragC {
        backend::mma_m16n8k16::<true>(a, b, c)
    }

    #[inline(always)]
    fn unpack(x: Half2) -> (f32, f32) {
        // bfloat16 is the top half of an f32: widening is a shift.
        (f32::from_bits(x << 16), f32::from_bits(x & 0xffff_0000))
    }
}

/// A tile of 16-bit floats (raw bits) in shared memory, row-major with a row stride of `stride`
/// elements. Strides are the row length plus 8 elements (16 bytes) of padding: the 8 rows that
/// one `ldmatrix` matrix reads then start 4 banks apart and cover all 32 banks once, where an
/// unpadded 128- or 256-byte row would put all 8 rows on the same 4 banks (an 8-way conflict).
#[derive(Clone, Copy)]
pub struct SharedTile16 {
    ptr: *mut u16,
    /// `ptr` in the shared state space (32 bits): what `ldmatrix` and `cp.async` take. Computed
    /// once, so that every fragment address is this plus a lane offset plus a constant.
    address: u32,
    stride: usize,
}

impl SharedTile16 {
    /// Pointer to element `(row, col)`.
    #[inline(always)]
    fn at(self, row: usize, col: usize) -> *mut u16 {
        // SAFETY: only address arithmetic; callers stay within the carved tile.
        unsafe { self.ptr.add(row * self.stride + col) }
    }

    /// Shared-state-space address of element `(row, col)`.
    #[inline(always)]
    fn address(self, row: usize, col: usize) -> u32 {
        self.address + ((row * self.stride + col) * 2) as u32
    }

    /// The tile that starts at row `row0` of this one (a slot of a ring of tiles carved as one).
    #[inline(always)]
    pub fn rows_from(self, row0: usize) -> Self {
        // SAFETY: only address arithmetic; callers stay within the carved tile.
        Self { ptr: unsafe { self.ptr.add(row0 * self.stride) }, address: self.address(row0, 0), stride: self.stride }
    }

    /// `ldmatrix` of four 8×8 matrices: lane `l` names the row starting at `at(row(l), col(l))`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    fn ldmatrix<const TRANS: bool>(self, row: usize, col: usize) -> [Half2; 4] {
        // SAFETY: the callers below keep rows and columns inside the tile; rows start 16-byte
        // aligned (strides are multiples of 8 elements, columns multiples of 8).
        unsafe { backend::ldmatrix_x4::<TRANS>(self.address(row, col)) }
    }

    /// The A fragment of the 16×16 block at `(row0, col0)` (A = this tile, rows are A's rows).
    /// Lanes 0–15 name rows `row0..row0+16` at `col0`, lanes 16–31 the same rows at `col0 + 8`:
    /// matrices 0..4 are then the (top-left, bottom-left, top-right, bottom-right) 8×8 blocks,
    /// i.e. a0..a3. Call from all lanes of a warp together.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn fragment_a(self, row0: usize, col0: usize) -> FragA {
        let lane = lane_id();
        self.ldmatrix::<false>(row0 + lane % 16, col0 + 8 * (lane / 16))
    }

    /// The A fragment of the 16×16 block whose *transpose* is stored at `(row0, col0)`: A's rows
    /// are this tile's columns `col0..col0+16` and A's columns (the k index) its rows
    /// `row0..row0+16` (dS in dQ = dS·K, when dSᵀ is what is stored). Call from all lanes.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn fragment_a_transposed(self, row0: usize, col0: usize) -> FragA {
        let lane = lane_id();
        self.ldmatrix::<true>(row0 + lane % 8 + 8 * (lane / 16), col0 + 8 * ((lane / 8) % 2))
    }

    /// B fragments of two neighbouring n-tiles when the tile stores Bᵀ, one row per column of B
    /// (K in S = Q·Kᵀ: `B[k][n] = K[n][k]`): n-tiles `n0..n0+8` and `n0+8..n0+16`, k-step
    /// `k0..k0+16`. Call from all lanes of a warp together.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn fragments_b(self, n0: usize, k0: usize) -> [FragB; 2] {
        let lane = lane_id();
        let [b00, b01, b10, b11] = self.ldmatrix::<false>(n0 + lane % 8 + 8 * (lane / 16), k0 + 8 * ((lane / 8) % 2));
        [[b00, b01], [b10, b11]]
    }

    /// B fragments of two neighbouring n-tiles when the tile stores B itself, row-major k × n
    /// (V in O = P·V: `B[k][n] = V[k][n]`): k-step `k0..k0+16`, n-tiles `n0..n0+8` and
    /// `n0+8..n0+16`, through `ldmatrix.trans`. Call from all lanes of a warp together.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn fragments_b_transposed(self, k0: usize, n0: usize) -> [FragB; 2] {
        let lane = lane_id();
        let [b00, b01, b10, b11] = self.ldmatrix::<true>(k0 + lane % 16, n0 + 8 * (lane / 16));
        [[b00, b01], [b10, b11]]
    }

    /// Writes one [`Half2`] at `(row, col..col+2)`; `col` even.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn store2(self, row: usize, col: usize, value: Half2) {
        let ptr = self.at(row, col) as *mut u32;
        backend::check_shared(ptr as *const f32, 1, true);
        // SAFETY: inside the tile; `col` even keeps the 4-byte alignment.
        unsafe { *ptr = value }
    }

    /// Reads 16 bytes (8 elements) at `(row, col..col+8)`; `col` a multiple of 8.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn load8(self, row: usize, col: usize) -> [u32; 4] {
        let ptr = self.at(row, col) as *const f32;
        backend::check_shared(ptr, 4, false);
        // SAFETY: inside the tile, 16-byte aligned (see the type's docs).
        unsafe { F32x4::load(ptr).0.map(f32::to_bits) }
    }

    /// Block-cooperative *asynchronous* copy of `rows` rows of `cols` elements from global memory
    /// (rows contiguous, `src` 16-byte aligned, `cols` a multiple of 8) into rows `0..rows` of this
    /// tile, 16 bytes per `cp.async`; rows `valid_rows..rows` are zero-filled without reading
    /// global memory. The copies run in the background: they belong to the calling thread's
    /// current *group*, which [`cp_async_commit`] closes and [`cp_async_wait`] waits for. Call
    /// from every thread of a block of `threads` threads (a constant in every caller, so the loop
    /// unrolls).
    ///
    /// # Safety
    /// `src` points to `valid_rows · cols` readable elements of global memory.
    #[inline(always)]
    pub unsafe fn copy_rows_async(self, src: *const u16, rows: usize, cols: usize, valid_rows: usize, threads: usize) {
        let chunks_per_row = cols / 8;
        let mut chunk = thread_idx_x();
        while chunk < rows * chunks_per_row {
            let (row, col) = (chunk / chunks_per_row, (chunk % chunks_per_row) * 8);
            let dst = self.at(row, col);
            backend::check_shared(dst as *const f32, 4, true);
            // A padding row still gets a valid source address (row 0), but reads 0 bytes of it.
            let valid = row < valid_rows;
            // SAFETY: for a valid row the chunk lies inside the source rows; otherwise nothing is
            // read. `dst` is a 16-byte aligned chunk of this tile.
            unsafe {
                backend::cp_async_16(self.address(row, col), src.add(if valid { row * cols + col } else { 0 }), valid)
            };
            chunk += threads;
        }
    }
}

/// The B fragments of a 16×16 block read the other way round: given the pair that
/// [`SharedTile16::fragments_b`] returns for a block stored row-major (rows = the n index), the
/// pair that [`SharedTile16::fragments_b_transposed`] would return for the same block (rows = the
/// k index) — without touching shared memory. Each register holds one 8×8 matrix of the block;
/// `movmatrix.trans` transposes it across the warp's lanes, and the two off-diagonal matrices
/// swap places. All lanes of the warp call it together.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn transpose_b(frags: [FragB; 2]) -> [FragB; 2] {
    let [[m00, m01], [m10, m11]] = frags;
    let t = |m| backend::movmatrix_trans(m);
    [[t(m00), t(m10)], [t(m01), t(m11)]]
}

/// Closes the calling thread's current group of [`SharedTile16::copy_rows_async`] copies
/// (`cp.async.commit_group`). Every thread commits the same number of groups, even empty ones,
/// so that group counts mean the same tile in every thread.
#[inline(always)]
pub fn cp_async_commit() {
    backend::cp_async_commit()
}

/// Waits until at most `pending` of the calling thread's committed copy groups are still in
/// flight (`cp.async.wait_group`, whose count is an immediate: callers pass a constant, and a
/// count above 3 waits for everything, which is always safe). It only covers the thread's own
/// copies: a block barrier must follow before other threads read the data.
#[inline(always)]
pub fn cp_async_wait(pending: usize) {
    match pending {
        3 => backend::cp_async_wait::<3>(),
        2 => backend::cp_async_wait::<2>(),
        1 => backend::cp_async_wait::<1>(),
        _ => backend::cp_async_wait::<0>(),
    }
}

/// Writes 16 bytes to global memory (`st.global.v4`); `dst` 16-byte aligned.
///
/// # Safety
/// `dst..dst+16 bytes` is writable global memory.
#[inline(always)]
pub unsafe fn store16(dst: *mut u16, value: [u32; 4]) {
    // SAFETY: the caller's contract.
    unsafe { F32x4(value.map(f32::from_bits)).store(dst as *mut f32) }
}

/// Reads 8 consecutive 16-bit floats from global memory (one 16-byte load) and widens them.
///
/// # Safety
/// `src..src+8` is readable global memory, 16-byte aligned.
#[inline(always)]
pub unsafe fn load8_widened<T: HalfFloat>(src: *const u16) -> [f32; 8] {
    // SAFETY: the caller's contract.
    let words = unsafe { F32x4::load(src as *const f32) }.0.map(f32::to_bits);
    let mut out = [0.0; 8];
    for i in 0..4 {
        (out[2 * i], out[2 * i + 1]) = T::unpack(words[i]);
    }
    out
}

/// The hardware backend: special registers, NVPTX intrinsics and PTX. Only this module talks
/// to the GPU; the emulator ([`crate::emu`]) provides the same functions on the host.
#[cfg(target_arch = "nvptx64")]
mod hw {
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

    #[inline(always)]
    pub fn cp_async_commit() {
        // SAFETY: no operands; it only closes this thread's group.
        unsafe { asm!("cp.async.commit_group;", options(nostack)) };
    }

    #[inline(always)]
    pub fn cp_async_wait<const PENDING: usize>() {
        // SAFETY: no operands. Not `nomem`: shared-memory reads must not move above it.
        unsafe { asm!("cp.async.wait_group {n};", n = const PENDING, options(nostack)) };
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
        #[link_name = "llvm.nvvm.vote.any.sync"]
        fn vote_any_sync(member_mask: u32, predicate: bool) -> bool;
    }
}
