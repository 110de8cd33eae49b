//! Level 0, the tensor cores of levels 5 and 6: `mma.sync` on fragments spread over a warp's
//! lanes, loaded from 16-bit shared-memory tiles with `ldmatrix` ([`SharedTile16`]), transposed in
//! registers with `movmatrix` ([`transpose_b`]), and the two 16-bit formats ([`F16`], [`Bf16`]).

use super::backend;
use super::{F32x4, lane_id, thread_idx_x};

//
// ANCHOR: fragment_layout
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
// ANCHOR_END: fragment_layout

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
    pub(super) ptr: *mut u16,
    /// `ptr` in the shared state space (32 bits): what `ldmatrix` and `cp.async` take. Computed
    /// once, so that every fragment address is this plus a lane offset plus a constant.
    pub(super) address: u32,
    pub(super) stride: usize,
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

    /// Reads the element at `(row, col)`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn load1(self, row: usize, col: usize) -> u16 {
        let ptr = self.at(row, col);
        backend::check_shared(ptr.wrapping_sub(col % 2) as *const f32, 1, false);
        // SAFETY: inside the tile.
        unsafe { *ptr }
    }

    /// Block-cooperative *asynchronous* copy of `rows` rows of `cols` elements from global memory
    /// into rows `0..rows` of this tile. The source rows are `width` elements long and contiguous
    /// (row `r` starts at `src + r · width`); columns `width..cols` of the tile (a head_dim padded
    /// up to the compiled one) and rows `valid_rows..rows` (the ragged end of a sequence) are
    /// zero-filled without reading global memory. `cols` is a multiple of 8.
    ///
    /// When `width` is a multiple of 8 every row starts 16-byte aligned and the copy is 16 bytes
    /// per `cp.async`, running in the background: it belongs to the calling thread's current
    /// *group*, which [`super::cp_async_commit`] closes and [`super::cp_async_wait`] waits for.
    /// Other widths (head_dim 17, 100, …) leave rows only 2-byte aligned, which `cp.async` cannot
    /// copy: the threads then load element pairs and store them at once, before returning. Either
    /// way the caller's barrier publishes the tile. Call from every thread of a block of
    /// `threads` threads (a constant in every caller, so the loop unrolls).
    ///
    /// # Safety
    /// `src` points to `valid_rows · width` readable elements of global memory, 16-byte aligned
    /// when `width` is a multiple of 8 (2-byte aligned otherwise); `width ≤ cols`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_rows_async(
        self,
        src: *const u16,
        rows: usize,
        cols: usize,
        width: usize,
        valid_rows: usize,
        threads: usize,
    ) {
        // SAFETY: the caller's contract, with the rows `width` apart.
        unsafe { self.copy_rows_async_strided(src, width, rows, cols, width, valid_rows, (thread_idx_x(), threads)) }
    }

    /// [`Self::copy_rows_async`] for source rows `src_stride` elements apart (a token-major or
    /// paged cache, where a row of one head is followed by the other heads' rows), done by
    /// `workers` threads of which the caller is number `worker`: the whole block
    /// (`thread_idx_x()`, the block's threads) or one warp (`lane_id()`, 32). The 16-byte path
    /// needs `width` and `src_stride` to be multiples of 8.
    ///
    /// # Safety
    /// Row `r < valid_rows` of the source is `width` readable elements at `src + r · src_stride`,
    /// 16-byte aligned when `width` and `src_stride` are multiples of 8 (2-byte aligned
    /// otherwise); `width ≤ cols`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_rows_async_strided(
        self,
        src: *const u16,
        src_stride: usize,
        rows: usize,
        cols: usize,
        width: usize,
        valid_rows: usize,
        (worker, workers): (usize, usize),
    ) {
        if !width.is_multiple_of(8) || !src_stride.is_multiple_of(8) {
            // SAFETY: the caller's contract.
            return unsafe {
                self.copy_rows_by_pairs(src, src_stride, rows, cols, width, valid_rows, (worker, workers))
            };
        }
        let chunks_per_row = cols / 8;
        let mut chunk = worker;
        while chunk < rows * chunks_per_row {
            let (row, col) = (chunk / chunks_per_row, (chunk % chunks_per_row) * 8);
            let dst = self.at(row, col);
            backend::check_shared(dst as *const f32, 4, true);
            // A padding chunk still gets a valid source address (element 0), but reads 0 bytes of
            // it. With `width` a multiple of 8, a chunk is all inside the row or all past it.
            let valid = row < valid_rows && col < width;
            // SAFETY: for a valid chunk the 8 elements lie inside the source rows; otherwise
            // nothing is read. `dst` is a 16-byte aligned chunk of this tile.
            unsafe {
                backend::cp_async_16(
                    self.address(row, col),
                    src.add(if valid { row * src_stride + col } else { 0 }),
                    valid,
                )
            };
            chunk += workers;
        }
    }

    /// [`Self::copy_rows_async_strided`] for rows that are not 16-byte aligned: each thread loads
    /// two neighbouring elements at a time (zero past `width` or `valid_rows`) and stores them as
    /// one 4-byte word, synchronously.
    ///
    /// The loop steps by `workers` hidden from the compiler ([`super::opaque`]): with a visible
    /// step it unrolls the loop and issues a tile's loads at once, each holding a register, next
    /// to the accumulators of the key loop that calls it; ptxas then spills (PERFORMANCE.md,
    /// issue 21).
    ///
    /// # Safety
    /// As [`Self::copy_rows_async_strided`].
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn copy_rows_by_pairs(
        self,
        src: *const u16,
        src_stride: usize,
        rows: usize,
        cols: usize,
        width: usize,
        valid_rows: usize,
        (worker, workers): (usize, usize),
    ) {
        let pairs_per_row = cols / 2;
        let mut pair = worker;
        while pair < rows * pairs_per_row {
            let (row, col) = (pair / pairs_per_row, (pair % pairs_per_row) * 2);
            // SAFETY: an element is read only inside the source rows.
            let element =
                |c: usize| if row < valid_rows && c < width { unsafe { *src.add(row * src_stride + c) } } else { 0 };
            self.store2(row, col, element(col) as u32 | (element(col + 1) as u32) << 16);
            pair += super::opaque(workers as u32) as usize;
        }
    }
}

/// A warp's 16 rows of a tile as A fragments, across the tile's first `16 · STEPS` columns (16
/// at a time, `ks = 0 .. STEPS`): the rows that a loop multiplies by a different operand at
/// every step (K and V in the backward's K/V-outer kernel, Q and dO in its dQ kernel).
///
/// Kept (`keep`), the fragments are read from shared memory once, here, and live in `4 · STEPS`
/// registers for the rest of the loop; not kept (when those registers are needed elsewhere), each
/// [`Self::get`] reads them again with `ldmatrix`. `keep` is a constant in every caller, so only
/// one of the two ways is compiled.
#[derive(Clone, Copy)]
pub struct RowFragments<const STEPS: usize> {
    tile: SharedTile16,
    row0: usize,
    keep: bool,
    kept: [FragA; STEPS],
}

impl<const STEPS: usize> RowFragments<STEPS> {
    /// Rows `row0 .. row0 + 16` of `tile`. With `keep`, the tile's rows must be in place (the
    /// caller's barrier). Call from all lanes of a warp together.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn new(tile: SharedTile16, row0: usize, keep: bool) -> Self {
        let kept = core::array::from_fn(|ks| if keep { tile.fragment_a(row0, 16 * ks) } else { [0; 4] });
        Self { tile, row0, keep, kept }
    }

    /// The A fragment of columns `16ks .. 16ks + 16`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn get(&self, ks: usize) -> FragA {
        if self.keep { self.kept[ks] } else { self.tile.fragment_a(self.row0, 16 * ks) }
    }
}

/// The B fragments of a 16×16 block read the other way round: given the pair that
/// [`SharedTile16::fragments_b`] returns for a block stored row-major (rows = the n index), the
/// pair that [`SharedTile16::fragments_b_transposed`] would return for the same block (rows = the
/// k index) — without touching shared memory. Each register holds one 8×8 matrix of the block;
/// `movmatrix.trans` transposes it across the warp's lanes, and the two off-diagonal matrices
/// swap places. All lanes of the warp call it together.
///
/// No kernel calls it today: it costs one instruction per 8×8 matrix, and where the backward used
/// it the profile found those instructions as many as the products and the warps stalled on them,
/// so the backward reads such fragments again with `ldmatrix.trans` (PERFORMANCE.md, issue 27).
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn transpose_b(frags: [FragB; 2]) -> [FragB; 2] {
    let [[m00, m01], [m10, m11]] = frags;
    let t = |m| backend::movmatrix_trans(m);
    [[t(m00), t(m10)], [t(m01), t(m11)]]
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
