//! Level 0, what one thread does: its indices in the block and the grid, fast `exp2`/`log2`,
//! fused multiply-add, `f32` atomics, and 16-byte loads and stores ([`F32x4`]).

#[cfg(target_arch = "nvptx64")]
use core::simd::Simd;

use super::backend;

// ANCHOR: indices
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

/// `x`, hidden from the compiler: on the GPU an empty `asm!` that returns its input. Values
/// computed from the result inside a loop are computed there, where they are used, instead of
/// being hoisted out of the loop and held in registers across it (LLVM hoists without regard to
/// register pressure, and ptxas then spills what it hoisted); a loop that steps by it cannot be
/// unrolled.
#[inline(always)]
pub fn opaque(x: u32) -> u32 {
    backend::opaque(x)
}

/// Calls `body(0)`, `body(1)`, … `body(N − 1)` as straight-line code, for `N` up to 64: CUDA's
/// `#pragma unroll`, which Rust does not have. A loop over a register array (an accumulator)
/// must be unrolled for the array to stay in registers (an index known only at run time puts it
/// in local memory); LLVM unrolls a loop only while the copies stay under a size threshold, which
/// a large accumulator's epilogue passes (at head_dim 256 the O of the Hopper forward is 32
/// fragments). Each call below has a constant index once `N` is known, so the branches fold away.
#[inline(always)]
pub fn unroll<const N: usize>(mut body: impl FnMut(usize)) {
    const { assert!(N <= 64, "unroll takes up to 64 steps") };
    macro_rules! steps {
        ($($i:literal)*) => { $( if $i < N { body($i) } )* };
    }
    steps!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
        32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63);
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
// ANCHOR_END: indices

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

/// 1/x with the hardware's `rcp.approx.ftz.f32` (one instruction, `MUFU.RCP`; within an ulp or
/// so; `1/∞ = 0`), where IEEE division (`/`) costs a dozen.
#[inline(always)]
pub fn reciprocal(x: f32) -> f32 {
    backend::reciprocal(x)
}

/// tanh(x) = 1 − 2 / (e^(2x) + 1), from one [`exp2`] and a reciprocal on the FMA units
/// ([`reciprocal_of_at_least_one`]): an absolute error of a few 10⁻⁷ at most, within 10⁻⁷ of
/// ±1 for large |x|, NaN for NaN. PTX's `tanh.approx.f32` is one
/// instruction but has a relative error of 2⁻¹¹, which the softcap's `cap · tanh(…)` would turn
/// into logit errors of 0.02 at Gemma 2's cap of 50; and a second special-function instruction
/// (`MUFU.RCP`) would cost the attention forward more than the FMAs do, as its `exp2`s already
/// keep that unit busy (PERFORMANCE.md, issue 24).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    // e^(2x) = 2^(2x·log₂e), capped at 2^64 (where tanh is 1 to f32) so that the reciprocal's
    // first guess stays a normal number; the comparison keeps a NaN a NaN.
    let exponent = x * (2.0 * LOG2_E);
    let exponent = if exponent > 64.0 { 64.0 } else { exponent };
    fma(-2.0, reciprocal_of_at_least_one(exp2(exponent) + 1.0), 1.0)
}

/// 1/x for 1 ≤ x ≤ 2^65 on the FMA units: a first guess from the bits of x (subtracting them from
/// a constant roughly negates the exponent; within 12 %) and three Newton steps `r ← r·(2 − x·r)`,
/// each of which squares the relative error (to about 10⁻⁷).
#[inline(always)]
pub fn reciprocal_of_at_least_one(x: f32) -> f32 {
    let mut r = f32::from_bits(0x7EF3_11C7u32.wrapping_sub(x.to_bits()));
    for _ in 0..3 {
        r *= fma(-x, r, 2.0);
    }
    r
}

/// a·b + c with a single rounding (`fma.rn.f32`).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    backend::fma(a, b, c)
}

/// `*ptr += value` as one atomic read-modify-write in device memory (`red.global.add.f32`, which returns
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

/// Adds `value` to the `u32` at `ptr` and returns what was there before (`atom.add.u32`, relaxed,
/// GPU scope): a ticket dispenser, e.g. for the next unit of a persistent grid.
///
/// # Safety
/// `ptr` points to a `u32` in global memory.
#[inline(always)]
pub unsafe fn atomic_fetch_add_u32(ptr: *mut u32, value: u32) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { backend::atomic_fetch_add_u32(ptr, value) }
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
        // 16-byte aggregate would be split into two 8-byte loads. (The emulator reads an array:
        // host buffers need not be 16-byte aligned, and `core::simd` is nightly-only, which the
        // host build of this crate is not.)
        #[cfg(target_arch = "nvptx64")]
        let v = unsafe { (ptr as *const Simd<f32, 4>).read() }.to_array();
        #[cfg(not(target_arch = "nvptx64"))]
        let v = unsafe { (ptr as *const [f32; 4]).read_unaligned() };
        Self(v)
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
            (ptr as *mut [f32; 4]).write_unaligned(self.0)
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

/// Writes 16 bytes to global memory (`st.global.v4`); `dst` 16-byte aligned.
///
/// # Safety
/// `dst..dst+16 bytes` is writable global memory.
#[inline(always)]
pub unsafe fn store16(dst: *mut u16, value: [u32; 4]) {
    // SAFETY: the caller's contract.
    unsafe { F32x4(value.map(f32::from_bits)).store(dst as *mut f32) }
}

#[cfg(test)]
mod tests {
    /// The softcap's tanh against `f64`, over the range that matters and past both ends.
    #[test]
    fn tanh_is_accurate_and_saturates() {
        let mut worst = 0.0f64;
        for i in -40_000..=40_000 {
            let x = i as f32 * 1e-3;
            worst = worst.max((super::tanh(x) as f64 - (x as f64).tanh()).abs());
        }
        assert!(worst < 3e-7, "largest error {worst:e}");
        for (x, want) in [(-1e30, -1.0f32), (1e30, 1.0), (f32::NEG_INFINITY, -1.0), (f32::INFINITY, 1.0)] {
            assert!((super::tanh(x) - want).abs() <= 2e-7, "tanh({x}) = {}", super::tanh(x));
        }
        assert!(super::tanh(f32::NAN).is_nan());
    }
}
