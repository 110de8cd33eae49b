//! Level 0 for Hopper (sm_90a only), what a warpgroup does: `wgmma` and its shared-memory matrix
//! descriptors, the accumulator registers ([`Accumulator`]), named barriers for parts of a block,
//! `setmaxnreg`, and shared-memory accesses by address.
//!
//! Hopper adds three things that the `mma.sync` kernels of levels 5 and 6 do not use:
//!
//! * **`wgmma`**: a *warpgroup* (4 consecutive warps, the first one's index a multiple of 4)
//!   multiplies a 64 × K tile of A by a K × N tile of B and accumulates into 64 × N `f32` values
//!   spread over its 128 threads' registers. A and B are read straight from shared memory,
//!   described by 64-bit *matrix descriptors* ([`matrix_descriptor`]), so no thread loads
//!   fragments. The instruction is asynchronous: it is issued, then committed in a group, and its
//!   results may only be read after waiting for the group.
//! * **TMA** (the tensor memory accelerator): one thread asks it for a whole 2-D box
//!   of a tensor (`cp.async.bulk.tensor`), described by a *tensor map* the host made
//!   (`cuTensorMapEncodeTiled`). The engine writes shared memory and reports the bytes it wrote to
//!   an `mbarrier`.
//! * **`mbarrier`**: a barrier object in shared memory that counts arrivals *and* transaction
//!   bytes; threads wait on one of its phases (parity). It is how copies and consumers meet
//!   without `__syncthreads`.
//!
//! ## Contracts (who calls what, and what it orders)
//!
//! | wrapper | called by | orders |
//! |---|---|---|
//! | [`Accumulator::pin`] | every thread, on the accumulators of the `wgmma`s about to be issued, and after a wait on those just finished | the compiler's register accesses: none moves across it |
//! | [`wgmma_fence`] | every thread of the warpgroup, before the first `wgmma` of a batch | earlier register writes to the accumulators (and A in registers) before the `wgmma`s read them |
//! | [`Accumulator::mma`], [`Accumulator::mma_register_a`], [`Accumulator::mma_mn_major`] | every thread of the warpgroup, same operands | nothing: it only issues |
//! | [`wgmma_commit`] | every thread of the warpgroup | closes the group of `wgmma`s issued since the last commit |
//! | [`wgmma_wait`] | every thread of the warpgroup | returns when at most `N` committed groups are pending; then their accumulators may be read, and their shared memory overwritten |
//! | [`fence_proxy_async`] | each thread that wrote shared memory with ordinary stores, before the barrier that publishes it | those stores before reads by `wgmma` or TMA (the *async proxy*) |
//! | [`mbarrier_init`] | one thread, then a barrier (and [`fence_mbarrier_init`]) before anyone uses it | the barrier's initial state before every use |
//! | [`mbarrier_arrive_expect_tx`] | the thread that issues the copies of a phase | announces the bytes that phase must receive; counts as one arrival |
//! | [`tma_load_2d`] | one thread | nothing by itself: completion is the `mbarrier`'s phase flipping |
//! | [`tma_load_3d`] | one thread | as [`tma_load_2d`] |
//! | [`tma_reduce_add_3d`] | one thread, after the writers' [`fence_proxy_async`] and a barrier | nothing by itself: [`bulk_commit_group`] closes its group, [`bulk_wait_group_read`] frees its source, [`bulk_wait_group`] completes it |
//! | [`wait_for_turn`] | one thread, before a reduction that must come after other blocks' | the reductions of the turns before it (their [`pass_turn`]) before its own |
//! | [`pass_turn`] | the thread that waited for the turn, after its reductions were committed | completes them, then lets the next turn begin |
//! | [`mbarrier_wait`] | every consumer | returns once the phase of the given parity completed: the copy's bytes are visible to the waiting thread |
//! | [`mbarrier_arrive`] | each consumer thread, once per phase, after its last read of the slot | counts one arrival: the producer waiting on the phase may overwrite the slot |
//! | [`named_barrier_sync`] | every thread of the part of the block named by the thread count | a `__syncthreads` for that part only (the producer warpgroup never waits on it) |
//! | [`named_barrier_arrive`] | threads that signal a named barrier others wait on | their earlier work before the waiters continue (one-way: the consumers' ping-pong turns) |
//! | [`registers_decrease`], [`registers_increase`] | every thread of the warpgroup, once, first thing | moves registers from the producer warpgroup to the consumers |
//!
//! The wrappers are only compiled for nvptx64: the CPU emulator does not model asynchronous
//! copies or warpgroup matrix units, so the kernels here are tested on Hopper GPUs only
//! (`tests/gpu_hopper.rs`). Their PTX is built with `llc -mcpu=sm_90a` into a module of its own,
//! which the host loads only on compute capability 9.0.

use core::arch::asm;

use super::{FragA, FragC, HalfFloat, thread_idx_x};

/// Threads in a warpgroup: the unit that issues `wgmma`.
pub const WARPGROUP_THREADS: usize = 128;

/// Bytes of one *core matrix* row: 8 16-bit elements. `wgmma` reads shared memory in core
/// matrices of 8 rows × 16 bytes, stored as 128 contiguous bytes.
pub const CORE_MATRIX_ROW_BYTES: usize = 16;

/// Bytes of one core matrix (8 rows of 16 bytes).
pub const CORE_MATRIX_BYTES: usize = 8 * CORE_MATRIX_ROW_BYTES;

/// The shared-state-space (32-bit) address of a pointer into the block's shared memory.
pub use super::ptx::shared_address;

/// A `wgmma` matrix descriptor for an operand in shared memory without swizzling (PTX ISA,
/// "Matrix Descriptor Format"): bits 0–13 the start address, 16–29 the *leading dimension byte
/// offset* (between core matrices adjacent along K), 32–45 the *stride dimension byte offset*
/// (between core matrices adjacent along M or N), each stored divided by 16; bits 62–63 the
/// swizzle mode, 0 here. Addresses and offsets must be multiples of 16 bytes.
#[inline(always)]
pub fn matrix_descriptor(shared_address: u32, leading_byte_offset: u32, stride_byte_offset: u32) -> u64 {
    let field = |bytes: u32| (bytes as u64 >> 4) & 0x3fff;
    field(shared_address) | field(leading_byte_offset) << 16 | field(stride_byte_offset) << 32
}

/// A `wgmma` matrix descriptor for an operand stored with the *128-byte swizzle* that TMA writes
/// with `CU_TENSOR_MAP_SWIZZLE_128B` (PTX ISA, "Shared Memory Matrix Layout"): rows of 128 bytes
/// (64 16-bit values) in *atoms* of 8 rows (1024 bytes, 1024-byte aligned), where the 16-byte
/// chunk `c` of row `r` is stored at chunk `c ^ (r % 8)`, so that the 8 rows of a column of core
/// matrices fall in different shared-memory banks. Bits 62–63 = 1 select this mode.
///
/// * K-major operand (Q and K in S = Q·Kᵀ): `stride_byte_offset` = 1024 steps 8 rows; the
///   leading offset is unused (one atom spans 64 values of K). Stepping 16 values along K
///   inside the atom adds 32 bytes to the start address: the hardware applies the XOR to the
///   address it computes, as TMA did when it wrote.
/// * MN-major operand (V in O += P·V): `stride_byte_offset` = 1024 steps 8 rows of K, and
///   `leading_byte_offset` steps 64 values along N (to the next atom column).
#[inline(always)]
pub fn swizzled_descriptor(shared_address: u32, leading_byte_offset: u32, stride_byte_offset: u32) -> u64 {
    matrix_descriptor(shared_address, leading_byte_offset, stride_byte_offset) | 1 << 62
}

/// `descriptor` with its start address moved `bytes` further (a multiple of 16 that keeps the
/// address inside shared memory, so the 14-bit field cannot carry into the next). Only the low
/// 32 bits change: a single 32-bit add per `wgmma`, where rebuilding the descriptor from an
/// address costs ptxas a handful of 64-bit instructions.
///
/// The add is written in PTX: as Rust arithmetic, LLVM proves that the low word cannot carry
/// and turns the whole thing back into a 64-bit add, which ptxas does in two instructions plus
/// moves before every `wgmma`.
#[inline(always)]
pub fn advance_descriptor(descriptor: u64, bytes: u32) -> u64 {
    let mut low = descriptor as u32;
    // SAFETY: arithmetic on registers only.
    unsafe {
        asm!("add.u32 {l}, {l}, {b};", l = inout(reg32) low, b = in(reg32) bytes >> 4, options(pure, nomem, nostack))
    };
    (descriptor & !0xffff_ffff) | low as u64
}

/// The descriptor of a *K-major* operand in a tile written by TMA with the 128-byte swizzle (see
/// [`swizzled_descriptor`]), at `address`: rows of 128 bytes, groups of 8 rows one atom apart;
/// the leading offset is unused (given as 16 bytes).
#[inline(always)]
pub fn k_major_descriptor(address: u32) -> u64 {
    swizzled_descriptor(address, 16, SWIZZLE_ATOM_BYTES as u32)
}

/// The descriptor of an *MN-major* operand in such a tile, at `address`, whose column blocks (64
/// values of N each) are `rows` rows apart: groups of 8 rows (along K) one atom apart.
#[inline(always)]
pub fn mn_major_descriptor(address: u32, rows: usize) -> u64 {
    swizzled_descriptor(address, (rows * SWIZZLE_ROW_BYTES) as u32, SWIZZLE_ATOM_BYTES as u32)
}

/// Bytes of one row of a 128-byte swizzled tile, and of the swizzle span.
pub const SWIZZLE_ROW_BYTES: usize = 128;

/// Bytes of one 128-byte swizzle atom: 8 rows.
pub const SWIZZLE_ATOM_BYTES: usize = 8 * SWIZZLE_ROW_BYTES;

/// The PTX operand list `{d0_0, d0_1, …}` of an accumulator of the fragments listed
/// (`[0 1 … tiles−1]`), for the templates of [`asm_with_accumulator`]: operand `d{j}_{e}` is
/// entry `e` of fragment `j`.
macro_rules! accumulator_list {
    ([$first:literal $($rest:literal)*]) => {
        concat!("{{", accumulator_list!(@fragment $first) $(, ", ", accumulator_list!(@fragment $rest))*, "}}")
    };
    (@fragment $j:literal) => {
        concat!("{d", stringify!($j), "_0}, {d", stringify!($j), "_1}, {d", stringify!($j), "_2}, {d", stringify!($j), "_3}")
    };
}

/// `asm!` with the `f32` accumulator registers of a 64 × N `wgmma` tile, `$d: [FragC; N / 8]`
/// (`$tiles` lists the fragments, `[0 1 … N/8 − 1]`), bound as `{d0_0}`, `{d0_1}`, … (read and
/// written), after the template and the other operands given. Every instruction that touches an
/// accumulator (the `wgmma` forms and [`Accumulator::pin`]) goes through here, so the bindings
/// are written once, for every size.
macro_rules! asm_with_accumulator {
    ([$($j:literal)*], $d:ident, [$($template:tt)*], $($operands:tt)*) => {
        pastey::paste! {
            asm!(
                $($template)*
                $($operands)*
                $(
                    [<d $j _0>] = inout(reg32) $d[$j][0],
                    [<d $j _1>] = inout(reg32) $d[$j][1],
                    [<d $j _2>] = inout(reg32) $d[$j][2],
                    [<d $j _3>] = inout(reg32) $d[$j][3],
                )*
                options(nostack)
            )
        }
    };
}

/// One `wgmma.mma_async` on accumulator `$d` of `$tiles` fragments (N = `$n`), element type
/// `$ty`: the A operand's template (a descriptor `{a}`, or a register fragment), then B and the
/// immediates (`$tail`), then the operands they name.
macro_rules! wgmma_issue {
    ($tiles:tt, $n:literal, $ty:literal, $d:ident, $scale_d:ident, [$($a_template:expr),*], [$($tail:expr),*], $($operands:tt)*) => {
        // SAFETY: the caller's contract (see `Accumulator::mma`).
        unsafe {
            asm_with_accumulator!(
                $tiles,
                $d,
                [
                    "{{",
                    ".reg .pred p;",
                    "setp.ne.b32 p, {scale_d}, 0;",
                    concat!("wgmma.mma_async.sync.aligned.m64n", $n, "k16.f32.", $ty, ".", $ty),
                    concat!(accumulator_list!($tiles), ","),
                    $($a_template,)*
                    $($tail,)*
                    "}}",
                ],
                $($operands)*
                scale_d = in(reg32) $scale_d,
            )
        }
    };
}

/// A warpgroup's `f32` accumulator of a 64 × N `wgmma` tile, as this thread holds it: N / 8
/// fragments with the layout of `mma.sync`'s m16n8 C tiles. Warp w of the warpgroup owns rows
/// 16w … 16w + 15; lane l holds, for fragment j, entries 0 and 1 at row 16w + l/4, columns
/// 8j + 2(l%4) and + 1, and entries 2 and 3 eight rows lower. Implemented for N = 32, 64, 80, 96,
/// 128, 160, 192 and 256 (`[FragC; 4]` … `[FragC; 32]`): the key tiles and head dims the Hopper kernels
/// compile (`crate::configs`), and the half query tiles of the wide-head backward. One more is one
/// line below.
///
/// An MN-major B operand may end inside a column block: at N = 80, 96 or 160 the products read
/// the first 16 or 32 columns of a tile's last 64-column block (`layout::hopper_tile_columns`).
pub trait Accumulator {
    /// D (64 × N) = A (64 × 16) · B (16 × N) + D if `accumulate`, else A · B, on the warpgroup's
    /// tensor cores (`wgmma.mma_async.m64nNk16.f32.f16.f16`, or `.bf16`, as `T` is). A and B
    /// are shared-memory operands given by their descriptors ([`matrix_descriptor`],
    /// [`swizzled_descriptor`]), both *K-major*: A stored as rows of K, B as N rows of K (as Kᵀ
    /// is stored when S = Q·Kᵀ).
    ///
    /// # Safety
    /// Every thread of the warpgroup issues it with the same descriptors, which describe
    /// initialised shared memory (written by TMA, or published with [`fence_proxy_async`] and a
    /// barrier); the accumulator may be read only after [`wgmma_commit`], [`wgmma_wait`] and
    /// [`Accumulator::pin`].
    unsafe fn mma<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool);

    /// As [`Accumulator::mma`], with A from registers and B *MN-major* (`imm-trans-b` = 1,
    /// stored with N contiguous, as V's rows are): how P, computed in registers by the softmax,
    /// multiplies V. `a` is this thread's fragment of its warp's 16 rows of A, laid out as
    /// `mma.sync`'s m16n8k16 A fragment (see [`super::FragA`]).
    ///
    /// # Safety
    /// As [`Accumulator::mma`], for the B descriptor; `a` must not change until the wait.
    unsafe fn mma_register_a<T: HalfFloat>(&mut self, a: FragA, b: u64, accumulate: bool);

    /// As [`Accumulator::mma`], with both operands *MN-major* (`imm-trans-a` = `imm-trans-b` =
    /// 1): A stored with M contiguous (as Aᵀ row-major), B with N contiguous. How the backward
    /// pass multiplies dS, staged in shared memory as dSᵀ, by K.
    ///
    /// # Safety
    /// As [`Accumulator::mma`].
    unsafe fn mma_mn_major<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool);

    /// As [`Accumulator::mma`], with A *K-major* and B *MN-major* (`imm-trans-b` = 1), both in
    /// shared memory: how the wide-head backward multiplies Pᵀ or dSᵀ, staged in shared memory
    /// row by key, by dO or Q.
    ///
    /// # Safety
    /// As [`Accumulator::mma`].
    unsafe fn mma_mn_major_b<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool);

    /// Ties the accumulator's registers to this point of the program (an empty `asm!` that reads
    /// and writes them). Called after [`wgmma_wait`] it keeps the compiler from reading them
    /// earlier; called before [`wgmma_fence`] it keeps the compiler from writing them (zeroing,
    /// rescaling) after the fence, where ptxas would have to serialise the `wgmma`s.
    fn pin(&mut self);
}

/// The [`Accumulator`] of `$tiles` fragments, N = `$n`.
macro_rules! accumulator {
    ($n_tiles:literal, $n:literal, $tiles:tt) => {
        impl Accumulator for [FragC; $n_tiles] {
            #[inline(always)]
            unsafe fn mma<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool) {
                let (d, scale_d) = (self, accumulate as u32);
                if T::IS_BF16 {
                    wgmma_issue!($tiles, $n, "bf16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 0, 0;"], a = in(reg64) a, b = in(reg64) b,);
                } else {
                    wgmma_issue!($tiles, $n, "f16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 0, 0;"], a = in(reg64) a, b = in(reg64) b,);
                }
            }

            #[inline(always)]
            unsafe fn mma_mn_major<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool) {
                let (d, scale_d) = (self, accumulate as u32);
                if T::IS_BF16 {
                    wgmma_issue!($tiles, $n, "bf16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 1, 1;"], a = in(reg64) a, b = in(reg64) b,);
                } else {
                    wgmma_issue!($tiles, $n, "f16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 1, 1;"], a = in(reg64) a, b = in(reg64) b,);
                }
            }

            #[inline(always)]
            unsafe fn mma_mn_major_b<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool) {
                let (d, scale_d) = (self, accumulate as u32);
                if T::IS_BF16 {
                    wgmma_issue!($tiles, $n, "bf16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 0, 1;"], a = in(reg64) a, b = in(reg64) b,);
                } else {
                    wgmma_issue!($tiles, $n, "f16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 0, 1;"], a = in(reg64) a, b = in(reg64) b,);
                }
            }

            #[inline(always)]
            unsafe fn mma_register_a<T: HalfFloat>(&mut self, a: FragA, b: u64, accumulate: bool) {
                let (d, scale_d) = (self, accumulate as u32);
                if T::IS_BF16 {
                    wgmma_issue!($tiles, $n, "bf16", d, scale_d, ["{{{a0}, {a1}, {a2}, {a3}}}, {b},"], ["p, 1, 1, 1;"],
                        a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3], b = in(reg64) b,);
                } else {
                    wgmma_issue!($tiles, $n, "f16", d, scale_d, ["{{{a0}, {a1}, {a2}, {a3}}}, {b},"], ["p, 1, 1, 1;"],
                        a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3], b = in(reg64) b,);
                }
            }

            #[inline(always)]
            fn pin(&mut self) {
                let d = self;
                // SAFETY: no instruction (the operand list sits in a PTX comment); every operand
                // must appear in the template.
                unsafe { asm_with_accumulator!($tiles, d, [concat!("// pinned: ", accumulator_list!($tiles)),],) };
            }
        }
    };
}

accumulator!(4, "32", [0 1 2 3]);
accumulator!(8, "64", [0 1 2 3 4 5 6 7]);
accumulator!(10, "80", [0 1 2 3 4 5 6 7 8 9]);
accumulator!(12, "96", [0 1 2 3 4 5 6 7 8 9 10 11]);
accumulator!(16, "128", [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15]);
accumulator!(20, "160", [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19]);
accumulator!(24, "192", [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23]);
accumulator!(32, "256", [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31]);

/// Orders earlier register accesses of the warpgroup before the `wgmma`s that follow
/// (`wgmma.fence`). Every thread of the warpgroup calls it, after pinning ([`Accumulator::pin`])
/// the accumulators the following `wgmma`s use.
#[inline(always)]
pub fn wgmma_fence() {
    // SAFETY: no operands; all threads of the warpgroup execute it (the callers' contract).
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) };
}

/// Closes the group of `wgmma`s issued since the last commit (`wgmma.commit_group`).
#[inline(always)]
pub fn wgmma_commit() {
    // SAFETY: as `wgmma_fence`.
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}

/// Waits until at most `PENDING` committed `wgmma` groups are unfinished (`wgmma.wait_group`);
/// groups finish in the order they were committed. Pin ([`Accumulator::pin`]) the accumulators
/// of the finished groups afterwards, before reading them.
#[inline(always)]
pub fn wgmma_wait<const PENDING: u32>() {
    // SAFETY: no memory access; every thread of the warpgroup executes it.
    unsafe { asm!("wgmma.wait_group.sync.aligned {n};", n = const PENDING, options(nostack)) };
}

/// Waits until `threads` threads (a multiple of 32) have arrived at named barrier `id`
/// (`bar.sync id, threads`): a barrier for part of the block, such as one warpgroup. Id 0 is
/// the one `__syncthreads` uses.
#[inline(always)]
pub fn named_barrier_sync(id: u32, threads: u32) {
    // SAFETY: synchronisation only; the callers use each id with one thread count.
    unsafe { asm!("bar.sync {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) };
}

/// Arrives at named barrier `id` without waiting (`bar.arrive id, threads`): the signalling half
/// of a barrier whose other threads call [`named_barrier_sync`] with the same count.
#[inline(always)]
pub fn named_barrier_arrive(id: u32, threads: u32) {
    // SAFETY: synchronisation only; as `named_barrier_sync`.
    unsafe { asm!("bar.arrive {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) };
}

/// Lowers this warpgroup's per-thread register limit to `COUNT` (`setmaxnreg.dec`), returning
/// the rest to the block's pool for [`registers_increase`]. Every thread of the warpgroup calls
/// it; `COUNT` is a multiple of 8 in 24…256.
#[inline(always)]
pub fn registers_decrease<const COUNT: u32>() {
    // SAFETY: a register-budget hint; executed by the whole warpgroup (the callers' contract).
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const COUNT, options(nostack)) };
}

/// Raises this warpgroup's per-thread register limit to `COUNT` (`setmaxnreg.inc`), waiting
/// until the block's pool has them. As [`registers_decrease`].
#[inline(always)]
pub fn registers_increase<const COUNT: u32>() {
    // SAFETY: as `registers_decrease`.
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const COUNT, options(nostack)) };
}

/// Loads two `f32` from shared-state-space `address` (8-byte aligned): `ld.shared.v2.f32`.
///
/// # Safety
/// `address` lies in this block's shared memory, 8-byte aligned.
#[inline(always)]
pub unsafe fn load_shared_f32x2(address: u32) -> [f32; 2] {
    let (x, y): (f32, f32);
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "ld.shared.v2.f32 {{{x}, {y}}}, [{a}];",
            a = in(reg32) address, x = out(reg32) x, y = out(reg32) y, options(nostack, readonly)
        )
    };
    [x, y]
}

/// Stores two `f32` to shared-state-space `address` (8-byte aligned): `st.shared.v2.f32`.
///
/// # Safety
/// `address` lies in this block's shared memory, 8-byte aligned, and no other thread accesses
/// those bytes until a barrier.
#[inline(always)]
pub unsafe fn store_shared_f32x2(address: u32, values: [f32; 2]) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "st.shared.v2.f32 [{a}], {{{x}, {y}}};",
            a = in(reg32) address, x = in(reg32) values[0], y = in(reg32) values[1], options(nostack)
        )
    };
}

/// Stores one 32-bit word (e.g. two packed 16-bit values) to shared-state-space `address`
/// (4-byte aligned): `st.shared.b32`.
///
/// # Safety
/// As [`store_shared_f32x2`], 4-byte aligned.
#[inline(always)]
pub unsafe fn store_shared_u32(address: u32, value: u32) {
    // SAFETY: the caller's contract.
    unsafe { asm!("st.shared.b32 [{a}], {v};", a = in(reg32) address, v = in(reg32) value, options(nostack)) };
}

/// Which warpgroup of the block this thread belongs to. Read from lane 0 of the warp
/// (`shfl.sync`), so that ptxas knows every lane has the same value: the shared-memory addresses
/// and descriptors derived from it then live in uniform registers, where `wgmma` takes its
/// descriptors, instead of being computed per thread and moved over before every `wgmma`.
#[inline(always)]
pub fn warpgroup_id() -> usize {
    let mut index = (thread_idx_x() / WARPGROUP_THREADS) as u32;
    // SAFETY: every lane of the warp executes it (warpgroups are whole warps).
    unsafe {
        asm!("shfl.sync.idx.b32 {i}, {i}, 0, 0x1f, 0xffffffff;", i = inout(reg32) index, options(nostack, nomem, pure))
    };
    index as usize
}
